"""A tensor's layout over the tensor axes changed, as autograd Functions over process groups: gathered, sliced,
partial sums reduced, and the conversions between two layouts (``passes.ir.convert``).

Gradient convention: a tensor whose features are split over an axis is replicated over the other
tensor axes, and so is its gradient. Hence a gather's backward is a local slice and a slice's
backward is a gather (Megatron's conjugate pairs); see DESIGN-NOTES section 1 for the matmul.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.comm.pieces import gather_pieces, take_pieces
from autopar.runtime.ops.sequence_parallel import GatherPartial, REGATHER, Regather, TokensOf
from autopar.runtime.ops.untracked import apply
from passes.ir import ConvertSpec, GatherOutputSpec, ReduceSpec, Sharding


def axis_of(mesh: Mesh, s: Sharding) -> tuple[int, int]:
    return mesh.size(s.axis), mesh.index(s.axis)


def gather_sharded(x: torch.Tensor, s: Sharding, mesh: Mesh) -> torch.Tensor:
    n, _ = axis_of(mesh, s)
    return gather_pieces(x, s.dim, s.parts, s.full_size, mesh.group(s.axis), n)


class GatherFeatures(torch.autograd.Function):
    """Local pieces -> the full tensor on every rank of the axis; backward keeps this rank's piece."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, s: Sharding) -> torch.Tensor:
        ctx.mesh, ctx.s = mesh, s
        return gather_sharded(x, s, mesh)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        s = ctx.s
        return take_pieces(dy, s.dim, s.parts, *axis_of(ctx.mesh, s)), None, None


def gather_features(x: torch.Tensor, s: Sharding, mesh: Mesh) -> torch.Tensor:
    """The whole of a tensor split over a tensor-parallel axis, on every rank of the axis (autograd-aware)."""
    return x if s.is_replicated else apply(GatherFeatures, x, mesh, s)


class GatherFeaturesOp:
    """A model output's features gathered (per-rank batches: its rows are taken by
    ``autopar.runtime.data_parallel.per_rank``)."""

    def __init__(self, spec: GatherOutputSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gather_features(x, self.spec.sharding, self.mesh)


class SliceFeatures(torch.autograd.Function):
    """A replicated tensor -> this rank's piece; backward gathers the pieces' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, s: Sharding) -> torch.Tensor:
        ctx.mesh, ctx.s = mesh, s
        return take_pieces(x, s.dim, s.parts, *axis_of(mesh, s))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return gather_sharded(dy, ctx.s, ctx.mesh), None, None


class ReduceFrom(torch.autograd.Function):
    """Sums partial results over an axis (times ``scale``); the gradient is already replicated."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, scale: float) -> torch.Tensor:
        ctx.scale = scale
        y = C.all_reduce(x.clone(), mesh.group(axis), mesh.size(axis))
        return y * scale if scale != 1.0 else y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return (dy * ctx.scale if ctx.scale != 1.0 else dy), None, None, None


class CopyTo(torch.autograd.Function):
    """Identity forward into ops that split their output over an axis; backward sums the gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
        ctx.mesh, ctx.axis = mesh, axis
        return x

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return C.all_reduce(dy.clone(), ctx.mesh.group(ctx.axis), ctx.mesh.size(ctx.axis)), None, None


class ReduceOp:
    def __init__(self, spec: ReduceSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.mesh.size(self.spec.axis)
        return apply(ReduceFrom, x, self.mesh, self.spec.axis, 1.0 / n if self.spec.mean else 1.0)


class SumGradOp:
    def __init__(self, axis: str, mesh: Mesh) -> None:
        self.axis, self.mesh = axis, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply(CopyTo, x, self.mesh, self.axis)


class ConvertOp:
    def __init__(self, spec: ConvertSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.partial_grad:  # (its readers are matmuls only; a split of one rank is no split)
            whole = apply(GatherPartial, x, self.mesh, self.spec.src)
            if not torch.compiler.is_compiling():  # (compiled: the partitioner decides what backward keeps)
                setattr(whole, REGATHER, TokensOf(x, Regather(self.mesh, self.spec.src)))
            return whole
        # (an axis of one rank: nothing to move, and a Function returning its input as it is would make the
        # result a view that an in-place op of the model may not write)
        if not self.spec.src.is_replicated and self.mesh.size(self.spec.src.axis) > 1:
            x = apply(GatherFeatures, x, self.mesh, self.spec.src)
        if not self.spec.dst.is_replicated and self.mesh.size(self.spec.dst.axis) > 1:
            x = apply(SliceFeatures, x, self.mesh, self.spec.dst)
        return x
