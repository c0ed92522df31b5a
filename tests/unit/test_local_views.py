"""``param_layout.local_views``: a compiled graph reads all its parameters through one autograd node, and each
parameter gets the gradient the per-parameter ``local_view`` gives it: a DTensor laid out as the parameter, summed
where the graph reads a parameter twice, None for one the graph does not use, none at all for a frozen one
(whose view must not ask the compiled graph for a gradient). One process: a 2-rank mesh under torch's fake
process group (no collective runs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch import nn

from autopar.compat import fake_store
from autopar.runtime.params.layout import local_of, local_view, local_views, make_dtensor


def _params(mesh) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    made = []
    for shape, layout, grad in (((4, 3), [Shard(0)], True), ((4,), [Shard(0)], True), ((2, 3), [Replicate()], True),
                                ((4, 3), [Shard(0)], False)):
        local = torch.randn((shape[0] // 2, *shape[1:]) if isinstance(layout[0], Shard) else shape, generator=g)
        made.append(nn.Parameter(make_dtensor(local, mesh, layout, shape), requires_grad=grad))
    return made


def _loss(views: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Reads parameter 0 twice, never parameter 1 (unused), parameter 2 and the frozen parameter 3 once."""
    w, _, r, frozen = views
    return ((x @ w.t()) ** 2).sum() + (w * 3).sum() + (x @ r.t()).sum() + (x @ frozen.t()).sum()


def test_one_node_gives_each_parameter_its_per_parameter_gradient():
    if dist.is_initialized():
        pytest.skip("another test's process group is in the way")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
        want, got = _params(mesh), _params(mesh)
        _loss([local_view(p) for p in want], x).backward()
        views = local_views(got)
        assert len({v.grad_fn for v in views[:3]}) == 1  # one autograd node for those that need a gradient
        assert not views[3].requires_grad  # the frozen parameter's view asks for no gradient
        _loss(views, x).backward()
        assert got[1].grad is None and want[1].grad is None  # unused: no gradient, not zeros
        assert got[3].grad is None
        for p, q in ((want[0], got[0]), (want[2], got[2])):
            assert isinstance(q.grad, DTensor) and q.grad.placements == p.placements
            torch.testing.assert_close(local_of(q.grad), local_of(p.grad), rtol=0, atol=0)
        with torch.no_grad():  # evaluation: the local tensors themselves, no node
            assert all(v is local_of(p) for v, p in zip(local_views(got), got))
    finally:
        dist.destroy_process_group()
