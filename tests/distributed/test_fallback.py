"""A model torch.export cannot capture runs whole: serial's numbers where no data parallelism was asked for,
DDP's over the data ranks where it was (a loss inside forward averaged over them, as DDP's ranks average
their gradients)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class Branching(nn.Module):
    """Branches on a statistic of the batch: data-dependent control flow, which export cannot capture. With
    ``loss``, it returns the loss (computed inside forward) instead of the logits."""

    def __init__(self, loss: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.out, self.loss = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3), loss

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        if h.mean() > 0:
            h = self.b(h)
        logits = self.out(h.relu())
        return F.cross_entropy(logits, y) if self.loss else logits


def batches(rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)
        x[: rows // 2] += 2.0  # (the halves take different branches)
        out.append((x, y))
    return out


def train(model: nn.Module, data: list, loss_in_forward: bool) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        loss = model(x, y) if loss_in_forward else F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    inner = getattr(model, "module", model)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in inner.state_dict().items()}}


def _parallel(tensor: tuple[int, int, int], data: int, loss_in_forward: bool, rows: int) -> dict[str, Any]:
    import autopar

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("autopar").addHandler(handler)
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, data=data):
        model = Branching(loss_in_forward)
    out = train(model, batches(rows), loss_in_forward)
    out["params"] = {k: v.detach().clone() for k, v in autopar.full_state_dict(model).items()}
    out["warnings"] = records
    return out


def _ddp(loss_in_forward: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(Branching(loss_in_forward), find_unused_parameters=True)  # (a branch each)
    out = train(model, [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches()], loss_in_forward)
    losses = torch.tensor(out["losses"])
    torch.distributed.all_reduce(losses)
    out["losses"] = (losses / world).tolist()  # (autopar returns the data ranks' mean on every rank)
    return out


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-6, abs=1e-7)
    for k, v in want["params"].items():
        torch.testing.assert_close(got["params"][k], v, rtol=1e-6, atol=1e-7)


def test_without_data_parallelism_an_uncaptured_model_runs_whole_with_serial_numbers(distributed):
    """tensor=(2, 2, 1), data=1: every rank decides the branch on the whole batch, as the serial model."""
    torch.manual_seed(0)
    serial = train(Branching(), batches(), False)
    results = distributed(_parallel, 4, (2, 2, 1), 1, False, 8)
    for r in results:
        _same(r, serial)
    said = [w for w in results[0]["warnings"] if "could not capture Branching" in w]
    assert len(said) == 1 and "every rank runs it whole on the whole batch (serial's numbers; 4 copies)" in said[0], said
    assert not any("could not capture" in w for r in results[1:] for w in r["warnings"])  # (rank 0 says it)


@pytest.mark.parametrize("loss_in_forward", [False, True], ids=["loss-outside", "loss-in-forward"])
def test_under_data_parallelism_an_uncaptured_model_gets_ddps_numbers(loss_in_forward, distributed):
    """data=2 x tensor=(2, 1, 1): each data rank runs its half (the tensor ranks hold copies), gradients averaged
    over the data ranks; a loss inside forward is the data ranks' mean. DDP on 2 ranks is the oracle."""
    want = distributed(_ddp, 2, loss_in_forward)[0]
    results = distributed(_parallel, 4, (2, 1, 1), 2, loss_in_forward, 8)
    for r in results:
        _same(r, want)
    assert any("falling back to data parallelism over the data=2 ranks, as DDP" in w for w in results[0]["warnings"])
    torch.manual_seed(0)
    serial = train(Branching(loss_in_forward), batches(), loss_in_forward)
    assert results[0]["losses"] != pytest.approx(serial["losses"], rel=1e-3)  # (DDP's branches are not serial's)


class _ParamBranch(nn.Module):
    """Branches on a parameter (export cannot capture it), not on the batch: DDP's numbers are serial's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.out = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.out(h.relu() if self.a.weight.sum() > 0 else h.tanh())


def _rows_then_one(parallel: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    if parallel:
        import autopar

        with autopar.auto_parallelize(data=2):
            model = _ParamBranch()
    else:
        model = _ParamBranch()
    data = batches()[:1] + [(x[:1], y[:1]) for x, y in batches()[1:]]  # then batches of one row
    out = train(model, data, False)
    if parallel:
        out["params"] = {k: v.detach().clone() for k, v in autopar.full_state_dict(model).items()}
    return out


def test_a_batch_smaller_than_the_data_ranks_runs_whole_with_the_gradient_once(distributed):
    """Each data rank runs the one row: the gradient sync over them must count it once, not twice."""
    serial = _rows_then_one(False)
    for r in distributed(_rows_then_one, 2, True):
        _same(r, serial)
