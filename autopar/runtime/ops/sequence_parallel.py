"""Sequence parallelism's ops (``auto_parallelize(sequence_parallel=True)``): a tensor split along its tokens
over a tensor axis, gathered for the matmuls that read it whole and reduce-scattered back out of the matmuls
whose outputs are partial sums.

``GatherPartial`` and ``ScatterTokens`` are the conjugate pair (an all-gather whose backward reduce-scatters,
and the reverse). The matmuls that read a gathered tensor keep only this rank's tokens (``TokensOf``) and
gather them again in backward (``Regather``), as Megatron-LM's sequence parallelism does.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from passes.ir import Sharding


class ScatterTokens(torch.autograd.Function):
    """Partial sums over an axis -> this rank's tokens of their sum (a reduce-scatter along ``dim``); backward
    all-gathers the tokens' gradients (sequence parallelism's conjugate of ``GatherPartial``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return scatter_along(x, dim, mesh, axis)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return gather_along(dy, ctx.dim, ctx.mesh, ctx.axis), None, None, None


class Regather:
    """The readers of a tensor gathered from its tokens' ranks (``ConvertSpec.partial_grad``: matmuls only) keep
    this rank's tokens, not the whole (``TokensOf.keep``); the first backward to need the whole gathers it
    again for all of them (``whole``), as Megatron's sequence parallelism does: a block keeps 1/n of its
    matmuls' inputs, for one all-gather more in backward. The readers' ``ctx`` hold this object, which holds
    no tensor of the forward (a recomputed block keeps nothing through it)."""

    def __init__(self, mesh: Mesh, s: Sharding) -> None:
        self.mesh, self.s = mesh, s
        self.readers = self.served = 0
        self.gathered: torch.Tensor | None = None

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole, gathered from ``piece`` (a reader's saved tokens) by the first reader to ask, once."""
        if self.gathered is None:
            self.gathered = gather_along(piece, self.s.dim, self.mesh, self.s.axis)
        out = self.gathered
        self.served += 1
        if self.served >= self.readers:  # the last reader: let the gathered copy go
            self.gathered, self.served = None, 0
        return out


class TokensOf:
    """What the gathered tensor carries for its readers' forward (and no longer: it goes with that tensor):
    this rank's tokens and their ``Regather``."""

    def __init__(self, piece: torch.Tensor, regather: Regather) -> None:
        self.piece, self.regather = piece, regather

    def keep(self, dtype: torch.dtype, regathers: bool) -> torch.Tensor:
        """This rank's tokens in ``dtype`` (the compute dtype: one copy for every reader), for a reader to save;
        ``regathers``: its backward will ask for the whole (its weight takes a gradient)."""
        self.regather.readers += regathers
        if self.piece.dtype != dtype:
            self.piece = self.piece.to(dtype)
        return self.piece


REGATHER = "_autopar_regather"
"""The attribute a gathered tensor carries its ``Regather`` in, read by the matmuls it feeds."""


class GatherPartial(torch.autograd.Function):
    """An evenly split tensor -> the whole on every rank of the axis, for readers whose gradients are partial
    sums over that axis: backward reduce-scatters them (sequence parallelism's conjugate pair)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, s: Sharding) -> torch.Tensor:
        ctx.mesh, ctx.s = mesh, s
        return gather_along(x, s.dim, mesh, s.axis)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return scatter_along(dy, ctx.s.dim, ctx.mesh, ctx.s.axis), None, None


def gather_along(x: torch.Tensor, dim: int, mesh: Mesh, axis: str) -> torch.Tensor:
    """Every rank's equal piece of ``dim``, joined in rank order over ``axis``."""
    n = mesh.size(axis)
    if n == 1:
        return x
    return C.all_gather(x.movedim(dim, 0), mesh.group(axis), n).movedim(0, dim)


def scatter_along(x: torch.Tensor, dim: int, mesh: Mesh, axis: str) -> torch.Tensor:
    """``x`` summed over ``axis``; this rank keeps its 1/n of ``dim`` (a reduce-scatter)."""
    n = mesh.size(axis)
    if n == 1:
        return x
    out = C.reduce_scatter(x.movedim(dim, 0), mesh.group(axis), n)
    # (a tensor of its own, never a view: a custom Function's output the model then adds into in place, as Llama
    # 4's routed experts' sum does, must not be a view)
    return out if dim == 0 else out.movedim(0, dim).contiguous()
