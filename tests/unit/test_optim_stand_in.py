"""``autopar.runtime.interop.optimizers``'s stand-in, kept between steps: an optimizer over a parallel model's sharded
parameters steps bit for bit as the plain optimizer over their local pieces, through the changes a script
makes between steps (a new learning rate, a loaded state, a state value replaced, a parameter that gets its
first gradient late), each of which the kept stand-in must see. One process: rank 0 of a 2-rank tensor grid
under torch's fake process group (the step is elementwise: no collective is needed to check it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.compat import fake_store
from autopar.runtime.params.layout import local_of


def _steps(model: nn.Module, opt: torch.optim.Optimizer, pieces: list[nn.Parameter], ref: torch.optim.Optimizer,
           grads: torch.Generator, n: int, skip: set[int] = frozenset()) -> None:
    params = list(model.parameters())
    for _ in range(n):
        for i, (p, r) in enumerate(zip(params, pieces)):
            if i in skip:
                p.grad = r.grad = None
                continue
            g = torch.randn(r.shape, generator=grads)
            if p.grad is None:
                p.grad = p.detach().clone()
            local_of(p.grad).copy_(g)
            r.grad = g.clone()
        opt.step()
        ref.step()
    for p, r in zip(params, pieces):
        torch.testing.assert_close(local_of(p).detach(), r.detach(), rtol=0, atol=0)
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for i, state in theirs.items():
        for key, value in state.items():
            torch.testing.assert_close(local_of(ours[i][key]), value, rtol=0, atol=0)


def test_a_kept_stand_in_steps_as_the_plain_optimizer_through_a_scripts_changes():
    if dist.is_initialized():
        pytest.skip("another test's process group is in the way")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=(2, 1, 1)):
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        model(torch.randn(4, 8)).sum().backward()  # the first call lays the parameters out
        pieces = [nn.Parameter(local_of(p).detach().clone()) for p in model.parameters()]
        assert any(tuple(local_of(p).shape) != tuple(p.shape) for p in model.parameters())  # some are split
        opt, ref = torch.optim.AdamW(model.parameters(), lr=0.01), torch.optim.AdamW(pieces, lr=0.01)
        grads = torch.Generator().manual_seed(1)
        _steps(model, opt, pieces, ref, grads, 3, skip={3})  # the last bias has no gradient yet: no state
        _steps(model, opt, pieces, ref, grads, 2)  # its state is made by a step on the kept stand-in
        for group in (*opt.param_groups, *ref.param_groups):  # a scheduler's change, read at the next step
            group["lr"] = 0.003
        _steps(model, opt, pieces, ref, grads, 2)
        for o in (opt, ref):  # a state value replaced: the kept stand-in must step the new one
            first = o.state[o.param_groups[0]["params"][0]]
            first["exp_avg"] = first["exp_avg"] * 0
        _steps(model, opt, pieces, ref, grads, 2)
        opt.load_state_dict(opt.state_dict())  # new state objects
        ref.load_state_dict(ref.state_dict())
        _steps(model, opt, pieces, ref, grads, 2)
    finally:
        dist.destroy_process_group()
