"""Models unlike autopar's own train untouched on data, tensor and both grids: serial's numbers.

Each grid is one spawned run that trains several models one after another (three SGD steps each, then
greedy ``generate()`` for the HF ones), against the same models trained serially: losses within 1e-5
relative, every final parameter and buffer (BatchNorm's running statistics too) within 1e-5, the tokens
equal. The CI slice is one MoE family, torch's own attention, a BatchNorm CNN and a straight-through
Function; the ``extended`` sweep takes every MoE family of the installed transformers and the variants
(transformers' per-expert loop with HF's ``labels=`` loss: the data-parallel fallback; the load-balancing
loss). Where a training forward draws random numbers on each rank's rows (PhiMoE's router samples), DDP is
the oracle on the grids that split the batch.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import pytest
import torch

from autopar.examples import moe_zoo
from tests import unlike_models as U

GRIDS = [((1, 1, 1), 2), ((2, 1, 1), 1), ((2, 1, 1), 2)]
GRID_IDS = ["data2", "tensor2", "tensor2-data2"]
CI_SLICE = ("mixtral", "mha", "resnet", "ste")
SWEEP = tuple(n for n in (*moe_zoo.NAMES, "encoder", *U.VARIANTS) if n not in CI_SLICE)
#: fp32, the same ops in another order (sums over ranks, split matmuls): measured 5e-7 at most.
TOL = 1e-5


def _worker(names: tuple[str, ...], tensor: tuple[int, int, int], data: int, ep: bool = False) -> dict[str, Any]:
    import autopar

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("autopar").addHandler(handler)
    out: dict[str, Any] = {}
    for name in names:
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=tensor, data=data, expert_parallel=ep):
            model = U.build(name)
        out[name] = U.train(name, model, U.batches(name), autopar.full_state_dict)
        plan = autopar.plan_of(model)
        out[name]["plan"] = plan.summary() if plan is not None else ""
        out[name]["experts"] = [(e.axis, e.tensor_axis) for e in plan.experts] if plan is not None else []
        autopar.detach(model)
    out["<warnings>"] = records
    return out


def _ddp_worker(name: str) -> dict[str, Any]:
    """DDP's numbers for ``name``: each rank its contiguous half of every batch, losses averaged."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(U.build(name))
    rows = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in U.batches(name)]
    result = U.train(name, model, rows, lambda m: m.module.state_dict(), generate=False)
    for i, loss in enumerate(result["losses"]):
        t = torch.tensor(loss)
        torch.distributed.all_reduce(t)
        result["losses"][i] = t.item() / world
    return result


@lru_cache(maxsize=None)
def _serial(name: str) -> dict[str, Any]:
    return U.serial(name)


def _check(name: str, got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert abs(a - b) <= TOL * abs(b), (name, where, got["losses"], want["losses"])
    assert set(got["state"]) == set(want["state"]), (name, where)
    for k, w in want["state"].items():
        err = (got["state"][k].double() - w.double()).abs().max().item() if w.numel() else 0.0
        assert err <= TOL * max(1.0, w.double().abs().max().item()), (name, where, k, err)
    if "tokens" in want and "tokens" in got:
        assert torch.equal(got["tokens"], want["tokens"]), (name, where)


def _run(names: tuple[str, ...], tensor: tuple[int, int, int], data: int, distributed,
         ep: bool = False) -> list[dict[str, Any]]:
    world = tensor[0] * tensor[1] * tensor[2] * data
    return distributed(_worker, world, names, tensor, data, ep, timeout=900)


def _against_oracles(names: tuple[str, ...], tensor: tuple[int, int, int], data: int, results: list[dict[str, Any]],
                     distributed) -> None:
    for name in names:
        ddp = name.split("+")[0] in moe_zoo.RANDOM_IN_TRAINING and data > 1
        want = distributed(_ddp_worker, data, name)[0] if ddp else _serial(name)
        for r in results:
            got = dict(r[name])
            if ddp:
                got.pop("tokens", None)
            _check(name, got, want, f"tensor={tensor} data={data}" + (" against DDP" if ddp else ""))


@pytest.mark.slow
@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_unlike_models_train_with_serial_numbers(grid, distributed):
    tensor, data = grid
    names = tuple(n for n in CI_SLICE if n in U.TORCH_MODELS or U.is_hf(n))
    results = _run(names, tensor, data, distributed)
    _against_oracles(names, tensor, data, results, distributed)
    warnings = results[0]["<warnings>"]
    if data > 1 and "mixtral" in names:  # the routing runs on each rank's rows, and it says so, once
        routed = [w for w in warnings if "op sort in" in w and "mlp.experts" in w]
        assert len(routed) == 1 and "as DDP does" in routed[0], warnings
    if "mixtral" in names:  # the plan names the experts it leaves whole, or how a tensor grid splits each
        plan = results[0]["mixtral"]["plan"]
        if tensor[0] > 1:
            assert "experts 4 each split over row" in plan and "stay whole" not in plan, plan
        else:
            assert "3-D expert weights stay whole on every rank" in plan
    assert all(r["<warnings>"] == [] for r in results[1:])  # (rank 0 says it)


@pytest.mark.slow
@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_every_moe_family_and_torch_layer_trains_with_serial_numbers(grid, distributed):
    tensor, data = grid
    results = _run(SWEEP, tensor, data, distributed)
    _against_oracles(SWEEP, tensor, data, results, distributed)


#: The MoE families whose experts split over data (whole experts: transformers' grouped matmuls, Llama 4's
#: batched ones); JetMoE's per-expert loop stays whole, PhiMoE's router samples in training (DDP the oracle).
EP_SWEEP = tuple(n for n in moe_zoo.NAMES if n not in ("jetmoe", *moe_zoo.RANDOM_IN_TRAINING))


@pytest.mark.slow
@pytest.mark.parametrize("grid", [((1, 1, 1), 2), ((2, 1, 1), 2)], ids=["data2-ep", "tensor2-data2-ep"])
def test_every_moe_family_trains_with_its_experts_split_over_data(grid, distributed):
    """``expert_parallel=True``: every family's experts split over data (and each over row on the tensor grid),
    with serial's losses, parameters and tokens (the parity table of docs/benchmarks.md)."""
    tensor, data = grid
    results = _run(EP_SWEEP, tensor, data, distributed, ep=True)
    _against_oracles(EP_SWEEP, tensor, data, results, distributed)
    for name in EP_SWEEP:
        experts = results[0][name]["experts"]
        assert experts and all(e == ("data", "row" if tensor[0] > 1 else "") for e in experts), (name, experts)


def _checkpointed_worker() -> dict[str, Any]:
    import autopar

    torch.manual_seed(0)
    with autopar.auto_parallelize(data=2, checkpoint="full"):
        model = U.build("resnet")
    out = U.train("resnet", model, U.batches("resnet"), autopar.full_state_dict)
    out["plan"] = autopar.plan_of(model).summary()
    return out


@pytest.mark.slow
def test_a_batchnorm_cnn_checkpointed_in_full_updates_its_running_statistics_once(distributed):
    """checkpoint="full" recomputes every block it may: a block whose BatchNorm updates running statistics in
    place is not one of them (recomputed, they would update twice: ``num_batches_tracked`` 2 per step)."""
    for got in distributed(_checkpointed_worker, 2):
        _check("resnet", got, _serial("resnet"), "data=2 checkpoint=full")
        assert got["state"]["blocks.0.b1.num_batches_tracked"].item() == 3


def _pipelined_worker() -> dict[str, Any]:
    import autopar

    torch.manual_seed(0)
    with autopar.auto_parallelize(pipeline=2, microbatches=2):
        model = U.build("resnet")
    out = U.train("resnet", model, U.batches("resnet"), autopar.full_state_dict)
    out["own"] = {k: v.detach().clone() for k, v in model.named_buffers()}
    return out


@pytest.mark.slow
def test_buffers_a_pipeline_stage_writes_reach_every_rank(distributed):
    """The running statistics BatchNorm updates inside a pipeline stage are the holder's; after each call every
    pipeline rank holds them (its state dict, a checkpoint, an evaluation on any rank), as serial's model."""
    want = _serial("resnet")
    for got in distributed(_pipelined_worker, 2):
        _check("resnet", got, want, "pipeline=2")
        for k, v in got["own"].items():
            assert torch.equal(v, want["state"][k]), k


def _bytes_worker(name: str) -> tuple[float, float]:
    import autopar
    from autopar.planning.planner import plan_model

    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 1), data=2):
        model = U.build(name)
    (x, y), = U.batches(name, steps=1)
    U.loss_of(name, model, x, y)  # (the first call: capture and plan, and the agreement's collectives)
    model.zero_grad()
    autopar.reset_comm_stats()
    U.loss_of(name, model, x, y).backward()
    measured = autopar.comm_stats()["total"]
    with torch.device("meta"):
        meta = U.build(name)
    kwargs = {"use_cache": False} if U.is_hf(name) else {}
    _, report = plan_model(meta, (x,), autopar.plan_of(model).config, rank=torch.distributed.get_rank(), kwargs=kwargs)
    return measured, float(report.comm_bytes_per_step)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "resnet"])
def test_measured_bytes_equal_the_plans_with_routing_and_batch_statistics(name, distributed):
    """The batch analysis's gathers (BatchNorm's statistics) and its LOCAL regions (MoE routing: no collective)
    are priced as they run (measured: 362,600 and 134,028 bytes)."""
    for measured, predicted in distributed(_bytes_worker, 4, name):
        assert measured == predicted > 0
