"""The batch's rows over the batch ranks (data x depth): a global batch scattered, a model output gathered
(``passes.ir.gather_output``), reductions over the batch (``batch_reduce``) and ops reading the whole batch
(``gather_rows`` / ``scatter_rows``)."""

from __future__ import annotations

from typing import Any

import torch

from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.layouts import GatherFeatures
from autopar.runtime.ops.untracked import apply
from passes.ir import BatchReduceSpec, GatherOutputSpec, GatherRowsSpec


def keeps(spec: Any, sizes: tuple[int, ...]) -> bool:
    """Whether an output of ``GatherOutputSpec`` ``spec`` stays split (a cache the next call reads split) when
    the batch shards have ``sizes`` rows: its rows are kept only where they split evenly."""
    return bool(getattr(spec, "keep_split", False)) and (not spec.batch_split or len(set(sizes)) <= 1)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad])


class _ScatterBatch(torch.autograd.Function):
    """This rank's rows (along ``dim``) of a global-batch input; backward gathers every batch shard's rows'
    gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...], dim: int) -> torch.Tensor:
        ctx.mesh, ctx.sizes, ctx.dim = mesh, sizes, dim
        i = mesh.index("batch")
        return x.narrow(dim, sum(sizes[:i]), sizes[i])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return _gather_rows_along(dy, ctx.mesh, ctx.sizes, ctx.dim, 1), None, None, None


def scatter_batch(x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...], dim: int = 0) -> torch.Tensor:
    return _ScatterBatch.apply(x, mesh, sizes, dim)


class BatchRows:
    """Each batch shard's rows in the current call, read by a graph's batch ops when they run. The runtime
    sets them before each run: a graph captured with a symbolic row count serves every batch size."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def entries(self, x: torch.Tensor, dim: int, mesh: Mesh, whole: bool = False) -> int:
        """Entries per row along ``dim`` of ``x`` (this rank's rows, or with ``whole`` every shard's)."""
        rows = sum(self.sizes) if whole else self.sizes[mesh.index("batch")]
        return x.shape[dim] // rows


class GatherOutputOp:
    """A model output made full on every rank: features gathered, then the batch's rows (global batch).

    An output computed from the whole batch (a loss inside forward) or without it is the same on every
    batch rank, and so is the caller's gradient of it; backward keeps it on one batch rank so that the
    batch ranks' parts of every gradient behind it sum to it once (``passes.analysis.batch_dims``)."""

    def __init__(self, spec: GatherOutputSpec, mesh: Mesh, rows: BatchRows) -> None:
        self.spec, self.mesh, self.rows = spec, mesh, rows

    def __call__(self, x: torch.Tensor, gather_features: bool = True) -> torch.Tensor:
        sizes = self.rows.sizes
        if gather_features and keeps(self.spec, sizes):
            # a cache the next call reads split: this rank's piece, made a DTensor after the graph ran
            # (autopar.runtime.execution.kept_state.KeptOutputs)
            return x
        if not self.spec.sharding.is_replicated and gather_features and self.mesh.size(self.spec.sharding.axis) > 1:
            x = apply(GatherFeatures, x, self.mesh, self.spec.sharding)
        if self.spec.batch_split:
            dim = self.spec.batch_dim
            return apply(_GatherRows, x, self.mesh, sizes, dim, self.rows.entries(x, dim, self.mesh))
        n = self.mesh.size("batch")
        if n > 1 and self.spec.batch_state == "per-rank":  # DDP's: each rank's own, its gradient averaged
            return apply(_ScaleGrad, x, 1.0 / n) if x.requires_grad else x
        if n > 1 and self.spec.batch_state == "local":  # the batch ranks' values averaged, as DDP's loss is
            x = apply(_BatchSum, x, self.mesh) / n
        if n > 1 and x.requires_grad:
            return apply(OnOneRank, x, self.mesh.index("batch") == 0)
        return x


class _ScaleGrad(torch.autograd.Function):
    """Identity; backward scales the gradient (a per-rank output's, by 1 / the batch ranks: DDP's average)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return dy * ctx.scale, None


def _rows_bounds(sizes: tuple[int, ...], factor: int, index: int) -> tuple[int, int]:
    start = sum(sizes[:index]) * factor
    return start, start + sizes[index] * factor


def _gather_rows_along(x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...], dim: int, factor: int) -> torch.Tensor:
    n = mesh.size("batch")
    if n == 1:
        return x
    moved = x.movedim(dim, 0)
    stacked = C.all_gather(_pad_rows(moved, max(sizes) * factor).unsqueeze(0), mesh.group("batch"), n)
    # (concatenated along ``dim`` itself: a fresh tensor, which the model's in-place ops may write)
    return torch.cat([stacked[i, :s * factor].movedim(0, dim) for i, s in enumerate(sizes)], dim)


class _GatherRows(torch.autograd.Function):
    """This rank's rows (along ``dim``, ``factor`` entries each) -> every batch shard's, in batch order;
    backward keeps this rank's rows of the gradient: of the same gradient everywhere, or (``summed``) of the
    sum of the batch ranks' parts of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...], dim: int, factor: int,
                summed: bool = False) -> torch.Tensor:
        ctx.mesh, ctx.sizes, ctx.dim, ctx.factor, ctx.summed = mesh, sizes, dim, factor, summed
        return _gather_rows_along(x, mesh, sizes, dim, factor)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        if ctx.summed:
            dy = C.all_reduce(dy.contiguous().clone(), ctx.mesh.group("batch"), ctx.mesh.size("batch"))
        start, stop = _rows_bounds(ctx.sizes, ctx.factor, ctx.mesh.index("batch"))
        return dy.narrow(ctx.dim, start, stop - start), None, None, None, None, None


class OnOneRank(torch.autograd.Function):
    """Identity; backward keeps the gradient where ``keep`` (on one rank of the group whose ranks all hold the
    value: batch rank 0 here, context rank 0 in ``autopar.runtime.ops.context``) and zeroes it on the others.

    Traced (``compile=True``) the backward is the same ops on every rank, ``dy`` times 1 or 0: zeros made
    without ``dy`` let AOTAutograd's partitioner move what follows them into the forward graph on the other
    ranks only, a later collective included (``_BatchSum``'s backward all-reduce), so the ranks' graphs
    issued their collectives in different orders and waited forever (the zoo's GPT-2 at depth 4 with labels)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        if torch.compiler.is_compiling():
            return dy * (1.0 if ctx.keep else 0.0), None
        return (dy if ctx.keep else torch.zeros_like(dy)), None


class _BatchSum(torch.autograd.Function):
    """Sums over the batch ranks (``axis``: "batch", or "replicas" where the values hold this rank's tokens under
    context parallelism: data x context x depth); backward sums the gradient's parts (every rank gets all of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str = "batch") -> torch.Tensor:
        ctx.mesh, ctx.axis = mesh, axis
        return C.all_reduce(x.clone(), mesh.group(axis), mesh.size(axis))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return C.all_reduce(dy.clone(), ctx.mesh.group(ctx.axis), ctx.mesh.size(ctx.axis)), None, None


class BatchReduceOp:
    """A bound ``passes.ir.batch_reduce`` (global batch): one all-reduce of this rank's partial sums and
    count over data x depth."""

    def __init__(self, spec: BatchReduceSpec, mesh: Mesh, rows: BatchRows) -> None:
        self.spec, self.mesh, self.rows = spec, mesh, rows

    def __call__(self, values: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        total = values.sum(0)
        axis = "replicas" if self.spec.context and self.mesh.size("context") > 1 else "batch"
        if self.spec.mean and counts is not None:
            packed = torch.cat([total.reshape(-1), counts.detach().sum().reshape(1).to(total.dtype)])
            packed = apply(_BatchSum, packed, self.mesh, axis)
            return packed[:-1].view_as(total) / packed[-1].detach()
        if axis == "replicas":  # (split_context gives every mean over tokens its counts)
            return apply(_BatchSum, total, self.mesh, axis)
        if self.mesh.size("batch") > 1:
            total = _BatchSum.apply(total, self.mesh)
        if not self.spec.mean:
            return total
        sizes = self.rows.sizes  # entries: every shard's rows x this rank's entries per row
        entries = sum(sizes) * self.rows.entries(values, 0, self.mesh) if sizes else values.shape[0]
        return total / (entries * (self.spec.count_per_row or 1))


class GatherRowsOp:
    """A bound ``passes.ir.gather_rows``: the whole batch's rows on every batch rank; backward sums the
    gradient's parts over the batch ranks and keeps this rank's rows."""

    def __init__(self, spec: GatherRowsSpec, mesh: Mesh, rows: BatchRows) -> None:
        self.spec, self.mesh, self.rows = spec, mesh, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh.size("batch") == 1:
            return x
        dim = self.spec.dim
        return apply(_GatherRows, x, self.mesh, self.rows.sizes, dim, self.rows.entries(x, dim, self.mesh), True)


class ScatterRowsOp:
    """A bound ``passes.ir.scatter_rows``: this rank's rows of a whole-batch tensor; backward places their
    gradient in zeros (this rank's part of the whole tensor's gradient). No communication."""

    def __init__(self, spec: GatherRowsSpec, mesh: Mesh, rows: BatchRows) -> None:
        self.spec, self.mesh, self.rows = spec, mesh, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh.size("batch") == 1:
            return x
        dim = self.spec.dim
        factor = self.rows.entries(x, dim, self.mesh, whole=True)
        start, stop = _rows_bounds(self.rows.sizes, factor, self.mesh.index("batch"))
        return _ScatterRows.apply(x, dim, start, stop)


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
        ctx.shape, ctx.dim, ctx.start = x.shape, dim, start
        return x.narrow(dim, start, stop - start).contiguous()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        out = dy.new_zeros(ctx.shape)
        out.narrow(ctx.dim, ctx.start, dy.shape[ctx.dim]).copy_(dy)
        return out, None, None, None
