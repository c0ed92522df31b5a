"""End to end: the tutorial-shaped Fabric script (autopar/examples/fabric_train.py) launched by Fabric's own
process launcher on 2 ranks at tensor (2,1,1) prints the losses of its 1-device run, and saves a checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "autopar.examples.fabric_train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [float(v) for v in re.findall(r"^step \d+ loss ([0-9.]+)$", done.stdout, re.M)]


@pytest.mark.slow
def test_fabric_launches_the_tutorial_loop_and_it_prints_serials_losses(tmp_path):
    serial = _run("--devices", "1")
    assert len(serial) == 3, serial
    parallel = _run("--devices", "2", "--tensor", "2", "1", "1", "--save", str(tmp_path / "ckpt"))
    assert len(parallel) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(parallel, serial)), (parallel, serial)
    assert (tmp_path / "ckpt" / "meta.pt").is_file()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fabric_runs_the_tutorial_loop_on_gpus_with_nccl():
    """The same loop on a GPU per rank (Fabric picks NCCL through the strategy): the 2-GPU tensor (2,1,1)
    run prints the 1-GPU run's losses (fp32; reductions in another order: 1e-4)."""
    serial = _run("--accelerator", "cuda", "--devices", "1")
    parallel = _run("--accelerator", "cuda", "--devices", "2", "--tensor", "2", "1", "1")
    assert len(parallel) == len(serial) == 3
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(parallel, serial)), (parallel, serial)
