"""Faults and misuse (issue 59): what a rank that stalls does to the others."""

from __future__ import annotations

import datetime
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.compat import group_timeout
from autopar.examples.fc_net import FC_Net
from tests.helpers import SMALL, batches


def _own_process_group(seconds: float) -> None:
    """The script's own ``init_process_group(timeout=...)`` (the fixture's has torch's default)."""
    box = [tempfile.mktemp(prefix="autopar-store-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{box[0]}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=seconds))


def _stalled_worker(seconds: float, stall: float) -> dict[str, Any]:
    import autopar
    from autopar.parallel_model import runtime_of

    _own_process_group(seconds)
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 1)):
        model = FC_Net(**SMALL)
    x, y = batches()[0]
    F.cross_entropy(model(x), y).backward()
    mesh = runtime_of(model).mesh
    timeouts = {axis: group_timeout(mesh.group(axis)).total_seconds() for axis in ("data", "row", "batch")}
    timeouts["control"] = group_timeout(mesh.control).total_seconds()
    if dist.get_rank() == 1:
        time.sleep(stall)
    start = time.monotonic()
    try:
        F.cross_entropy(model(x), y).backward()
        error = None
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    return {"timeouts": timeouts, "error": error, "seconds": time.monotonic() - start}


def test_autopars_groups_take_the_timeout_the_script_gave_init_process_group(distributed):
    """init_process_group(timeout=3 s), and rank 1 stalls 12 s before a training call: rank 0's collective gives
    up after the script's 3 s (autopar's groups kept torch's 30 minutes, so it waited the whole stall)."""
    rank0, rank1 = distributed(_stalled_worker, 2, 3.0, 12.0, timeout=120)
    assert set(rank0["timeouts"].values()) == {3.0}, rank0["timeouts"]
    assert rank0["error"] is not None and rank0["seconds"] < 8.0, rank0
    assert rank1["error"] is not None, rank1  # (the group is broken for the late rank too: it raises at once)
