"""Per-rank batches (DDP semantics): every rank feeds its own batch and gets its own rows' outputs.

A DDP script gives each rank its own batch (``DistributedSampler``, ``seed_offset = rank``) and
expects what DDP computes: each rank's outputs for its rows, and gradients averaged over the ranks,
``(1/W) sum_r grad(loss_r)``. Under autopar the ranks that hold one batch shard (its tensor and
pipeline peers: ``Mesh.shard_members``) pool their rows and run the shard's graph on them; each
takes its own rows of the outputs back. A reduction over the batch inside forward (a loss) is taken
over each member's rows separately (``SegmentReduceOp``), so rank r's loss is the mean over its own
rows, as under DDP.

Gradients: every output's gradient is scaled by 1/W on the way back, so the runtime's sum over data
x depth is DDP's average. Within a shard the members' gradients meet: an output row's gradient is
all-gathered from the member owning it, a per-member loss's from every member, and the gradient of
an output computed without the batch is summed over the members (every member reads it; the shard's
computation must see one gradient, the same on every member).

With one member per shard (data and depth only) nothing is pooled: the graph runs on the rank's own
rows with its own sizes, like DDP's module, and the only communication is the gradient sum.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from passes.ir import BatchReduceSpec, GatherOutputSpec


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _gather_members(x: torch.Tensor, mesh: Mesh, rows: tuple[int, ...], dim: int = 0, factor: int = 1) -> torch.Tensor:
    """Every member's rows of ``x`` (along ``dim``, ``factor`` entries per row), in member order."""
    n = len(rows)
    moved = x.movedim(dim, 0).contiguous()
    stacked = C.all_gather(_pad(moved, max(rows) * factor).unsqueeze(0), mesh.shard_group(), n)
    return torch.cat([stacked[i, :r * factor] for i, r in enumerate(rows)]).movedim(0, dim)


def _bounds(rows: tuple[int, ...], member: int, factor: int = 1) -> tuple[int, int]:
    start = sum(rows[:member]) * factor
    return start, start + rows[member] * factor


class _PoolRows(torch.autograd.Function):
    """This member's rows (along ``dim``) -> the shard's (every member's, in member order); backward keeps
    this member's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, rows: tuple[int, ...], member: int, dim: int) -> torch.Tensor:
        ctx.rows, ctx.member, ctx.dim = rows, member, dim
        return _gather_members(x, mesh, rows, dim)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        start, stop = _bounds(ctx.rows, ctx.member)
        return dy.narrow(ctx.dim, start, stop - start), None, None, None, None


def pool_rows(x: torch.Tensor, mesh: Mesh, rows: tuple[int, ...], member: int, dim: int = 0) -> torch.Tensor:
    return _PoolRows.apply(x, mesh, rows, member, dim) if len(rows) > 1 else x


class _OwnRows(torch.autograd.Function):
    """The shard's rows of an output -> this member's; backward gathers every member's rows' gradient
    (each computed by its owner) and scales it by ``scale`` (1/W)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, rows: tuple[int, ...], member: int, dim: int, factor: int,
                scale: float) -> torch.Tensor:
        ctx.mesh, ctx.rows, ctx.dim, ctx.factor, ctx.scale = mesh, rows, dim, factor, scale
        start, stop = _bounds(rows, member, factor)
        return x.narrow(dim, start, stop - start).contiguous()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        whole = _gather_members(dy, ctx.mesh, ctx.rows, ctx.dim, ctx.factor) if len(ctx.rows) > 1 else dy
        return whole * ctx.scale, None, None, None, None, None, None


class _Scaled(torch.autograd.Function):
    """Identity; backward scales the gradient (1/W) after summing it over the shard's members when
    ``summed`` (an output computed without the batch: every member's loss may read it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, scale: float, summed: bool) -> torch.Tensor:
        ctx.mesh, ctx.scale, ctx.summed = mesh, scale, summed
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        if ctx.summed:
            n = len(ctx.mesh.shard_members())
            dy = C.all_reduce(dy.contiguous().clone(), ctx.mesh.shard_group(), n)
        return dy * ctx.scale, None, None, None


def own_output(x: Any, spec: GatherOutputSpec | None, mesh: Mesh, rows: tuple[int, ...], member: int) -> Any:
    """What this rank's script receives for one output leaf of the shard's graph (see module docstring)."""
    if not isinstance(x, torch.Tensor):
        return x
    scale = 1.0 / mesh.config.world_size
    if spec is not None and spec.batch_split and len(rows) > 1:  # (entries per row: a length, when symbolic)
        factor = x.shape[spec.batch_dim] // sum(rows)
        return _OwnRows.apply(x, mesh, rows, member, spec.batch_dim, factor, scale)
    if not x.requires_grad:
        return x
    summed = len(rows) > 1 and (spec is None or spec.batch_state == "none")
    return _Scaled.apply(x, mesh, scale, summed)


class _Segments(torch.autograd.Function):
    """Per-member sums of ``values`` (dim 0: the shard's entries, member by member) -> this member's;
    backward gathers every member's gradient of its own sum and gives each member's entries theirs."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, mesh: Mesh, rows: tuple[int, ...], member: int, factor: int,
                denominators: torch.Tensor | None, context: bool = False) -> torch.Tensor:
        ctx.mesh, ctx.rows, ctx.factor = mesh, rows, factor
        ctx.denominators = denominators
        if context:  # each context rank holds its tokens of every row: every member's sum completed over them
            sums = torch.stack([values[a:b].sum(0) for a, b in (_bounds(rows, m, factor) for m in range(len(rows)))])
            own = C.all_reduce(sums, mesh.group("context"), mesh.size("context"))[member]
        else:
            start, stop = _bounds(rows, member, factor)
            own = values[start:stop].sum(0)
        return own / denominators[member] if denominators is not None else own

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        n = len(ctx.rows)
        every = C.all_gather(dy.contiguous().unsqueeze(0), ctx.mesh.shard_group(), n) if n > 1 else dy.unsqueeze(0)
        if ctx.denominators is not None:
            every = every / ctx.denominators.reshape(-1, *([1] * dy.dim())).to(every.dtype)
        sizes = [r * ctx.factor for r in ctx.rows]
        grad = torch.cat([every[m].unsqueeze(0).expand(s, *dy.shape) for m, s in enumerate(sizes)])
        return grad, None, None, None, None, None, None


class SegmentReduceOp:
    """A bound ``passes.ir.batch_reduce`` under per-rank batches: this member's rows only (its own loss,
    as DDP computes it); no communication forward."""

    def __init__(self, spec: BatchReduceSpec, mesh: Mesh, rows: tuple[int, ...], member: int) -> None:
        self.spec, self.mesh, self.rows, self.member = spec, mesh, rows, member

    def __call__(self, values: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        f = values.shape[0] // sum(self.rows)  # entries per row (a length, in a graph captured for every one)
        context = self.spec.context and self.mesh.size("context") > 1  # (values: this rank's tokens of each row)
        denominators = None
        if self.spec.mean:
            if counts is not None:
                c = counts.detach()
                denominators = torch.stack([c[a:b].sum() for a, b in (_bounds(self.rows, m, f)
                                                                     for m in range(len(self.rows)))])
                if context:
                    denominators = C.all_reduce(denominators.to(values.dtype), self.mesh.group("context"),
                                                self.mesh.size("context"))
            else:
                denominators = torch.tensor([r * f * (self.spec.count_per_row or 1) for r in self.rows],
                                            dtype=values.dtype, device=values.device)
                if context:
                    denominators = denominators * self.mesh.size("context")
        return _Segments.apply(values, self.mesh, self.rows, self.member, f, denominators, context)
