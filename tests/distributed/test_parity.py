"""Parity with the serial model on every (row, col, depth, data) grid of 1, 2, 4 and 8 ranks.

FC_Net (small) trains 5 AdamW steps on a global batch of 13 rows (divides no data x depth > 1)
and a last batch of 9 (a new shape, captured again). Tolerance: 1e-5 norm-wise relative error per
tensor; float32 sums in a different order give ~1e-7, so a layout or gradient bug (errors of 1e-2
or more) cannot hide under it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.config import ParallelConfig
from autopar.parallel_model import runtime_of
from autopar.runtime.params.layout import local_of
from autopar.examples.fc_net import FC_Net
from autopar.planning.planner import plan_model
from tests.helpers import SMALL, batches, rel_err, serial_run

TOL = 1e-5


def grids(world_size: int) -> list[tuple[int, int, int, int]]:
    """Every (row, col, depth, data) whose product is ``world_size``."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [g for g in itertools.product(divisors, repeat=4) if g[0] * g[1] * g[2] * g[3] == world_size]


def parity_worker(grid_list: list[tuple[int, int, int, int]]) -> list[dict]:
    data = batches()
    s_losses, s_params, s_grads = serial_run(data)
    rank = dist.get_rank()
    out = []
    for row, col, depth, dp in grid_list:
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=(row, col, depth), data=dp):
            model = FC_Net(**SMALL)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, measured, grads = [], None, {}
        for step, (x, y) in enumerate(data):
            autopar.reset_comm_stats()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if step == 0:
                measured = autopar.comm_stats()["total"]
                grads = runtime_of(model).full_grads()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        final = autopar.full_state_dict(model)
        config = ParallelConfig(dp, row, col, depth)
        with torch.device("meta"):
            shadow = FC_Net(**SMALL)
        plan, report = plan_model(shadow, (data[0][0],), config, rank=rank)
        opt_params = {id(p) for g in opt.param_groups for p in g["params"]}
        out.append(dict(
            grid=(row, col, depth, dp),
            loss_err=max(abs(a - b) / abs(b) for a, b in zip(losses, s_losses)),
            param_err=max(rel_err(final[k], s_params[k]) for k in s_params),
            grad_err=max(rel_err(grads[k], s_grads[k]) for k in s_grads),
            measured=measured,
            predicted=float(report.comm_bytes_per_step),
            same_plan=plan == autopar.plan_of(model),
            local_numel=sum(local_of(p).numel() for p in model.parameters()),
            predicted_numel=sum(p.local_numel(config) for p in plan.params),
            optimizer_holds_shards=all(id(p) in opt_params for p in model.parameters()),
        ))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_parity_every_grid_matches_serial(distributed, world_size):
    todo = grids(world_size)
    results = distributed(parity_worker, world_size, todo, timeout=420)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            where = f"grid (row, col, depth, data)={r['grid']} rank {rank}"
            assert r["loss_err"] < TOL, f"{where}: losses differ by {r['loss_err']:.2e}"
            assert r["param_err"] < TOL, f"{where}: final parameters differ by {r['param_err']:.2e}"
            assert r["grad_err"] < TOL, f"{where}: first-step gradients differ by {r['grad_err']:.2e}"
            assert r["measured"] == r["predicted"], f"{where}: comm_stats {r['measured']} != predicted {r['predicted']}"
            assert r["same_plan"], f"{where}: the CLI's plan differs from the runtime's"
            assert r["local_numel"] == r["predicted_numel"], where
            assert r["optimizer_holds_shards"], where
    assert len(results) == world_size and all(len(r) == len(todo) for r in results)


def test_grids_enumerates_all_factorizations():
    assert grids(1) == [(1, 1, 1, 1)]
    assert len(grids(2)) == 4 and len(grids(4)) == 10 and len(grids(8)) == 20
