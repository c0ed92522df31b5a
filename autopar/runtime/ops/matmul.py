"""The sharded matmul (``passes.ir.sharded_matmul``): the 3D matmul of AxoNN's algorithm (the weight's (row, col)
block on this rank, 1/depth of its rows stored here), the one-axis matmuls (OUT_ROW/OUT_COL), and the one-axis
matmul on a sequence-parallel input (it keeps this rank's tokens and gathers them again in backward).

Under autocast (precision bf16/fp16) the input and the weight shard are cast to the compute dtype before they
travel; see DESIGN-NOTES section 1 for the algorithm.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.layouts import CopyTo
from autopar.runtime.ops.sequence_parallel import REGATHER, TokensOf, gather_along, scatter_along
from autopar.runtime.ops.untracked import apply
from passes.ir import MatmulSpec


def backward_prologue(ctx: Any, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The start every matmul Function's backward shares (``_Matmul3D``, ``MatmulOut``, the depth buckets'
    ``_Matmul3DGathered``; ``ctx`` holds ``op``, ``dtype`` and ``tokens``): the input whole again where sequence
    parallelism kept only this rank's tokens and the weight takes a gradient (the input serves only that), the
    output's gradient whole in the compute dtype, and which of (input, weight, bias) take gradients."""
    needs = tuple(ctx.needs_input_grad[:3])
    if ctx.tokens is not None and needs[1]:
        x = ctx.tokens.whole(x).to(ctx.dtype)
    ctx.tokens = None
    return x, ctx.op.whole_grad(dy.to(ctx.dtype)), needs


def bias_grad(dy: torch.Tensor, needed: bool) -> torch.Tensor | None:
    """The bias's gradient: ``dy`` summed over every dim but the features."""
    return dy.reshape(-1, dy.shape[-1]).sum(0) if needed else None


class _Matmul3D(torch.autograd.Function):
    """``y = x @ W^T + b`` with W's (out, in) block on this (row, col) and 1/depth of its rows stored here.

    Under autocast (precision bf16/fp16) x and the weight shard are cast to the compute dtype before
    they travel, and the weight gradient is reduced in ``op.reduce_dtype`` (fp32 by default) and
    returned in the shard's dtype: fp32 master weights get fp32 gradients.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                op: MatmulOp, tokens: TokensOf | None = None) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.op, ctx.dtype, ctx.tokens = op, dtype, tokens and tokens.regather
        x = x.to(dtype)
        w = op.gather_weight(w_shard.to(dtype))
        if torch.is_autocast_enabled(device):  # (a context each call costs its Python enter and exit)
            with torch.autocast(device, enabled=False):
                y = op.product(x, w, bias)
        else:
            y = op.product(x, w, bias)
        ctx.save_for_backward(x if tokens is None else tokens.keep(dtype, ctx.needs_input_grad[1]), w_shard)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        op: MatmulOp = ctx.op
        x, w_shard = ctx.saved_tensors
        x, dy, (need_x, need_w, need_b) = backward_prologue(ctx, x, dy)
        dx = dw = None
        if need_x or need_w:
            w = op.gather_weight(w_shard.to(ctx.dtype))
        if need_x:
            dx = op.reduce_dx(op.input_grad(dy, w))
        if need_w:  # the block's rows are split over depth: reduce-scatter them
            block = op.weight_grad(x, dy).to(op.reduce_dtype or w_shard.dtype)
            dw = C.reduce_scatter(block, op.mesh.group("depth"), op.mesh.size("depth")).to(w_shard.dtype)
        return dx, dw, bias_grad(dy, need_b), None, None


class MatmulOut(torch.autograd.Function):
    """An OUT_ROW/OUT_COL matmul (weight split over its output features) on an input gathered from the tokens'
    ranks (``Regather``): it keeps this rank's tokens and gathers them again in backward; the input's gradient
    stays partial (the gather's backward reduce-scatters it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, op: MatmulOp,
                tokens: TokensOf) -> torch.Tensor:
        ctx.op, ctx.tokens = op, tokens.regather
        y = torch.matmul(x, w) if op.spec.weight_in_out else torch.nn.functional.linear(x, w)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(tokens.keep(y.dtype, ctx.needs_input_grad[1]), w)  # (autocast: y's dtype computes)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        op: MatmulOp = ctx.op
        piece, w = ctx.saved_tensors
        ctx.dtype = dy.dtype  # (autocast: y's dtype computes)
        x, dy, (need_x, need_w, need_b) = backward_prologue(ctx, piece, dy)
        dx = op.input_grad(dy, w.to(dy.dtype)) if need_x else None  # (partial: the gather's backward sums it)
        dw = op.weight_grad(x, dy).to(w.dtype) if need_w else None
        return dx, dw, bias_grad(dy, need_b), None, None


class MatmulOp:
    """A bound ``passes.ir.sharded_matmul``: the spec plus the groups it talks over."""

    def __init__(self, spec: MatmulSpec, mesh: Mesh, reduce_dtype: torch.dtype | None = None) -> None:
        self.spec, self.mesh, self.reduce_dtype = spec, mesh, reduce_dtype
        o = spec.orientation
        n_loc = spec.out_features // mesh.size(o.out_axis)
        k_loc = spec.in_features // mesh.size(o.in_axis)
        self.block_shape = (k_loc, n_loc) if spec.weight_in_out else (n_loc, k_loc)

    def gather_weight(self, w_shard: torch.Tensor) -> torch.Tensor:
        """The (row, col) block from every depth rank's rows of it."""
        m = self.mesh
        return C.all_gather(w_shard, m.group("depth"), m.size("depth")).view(self.block_shape)

    def all_reduce(self, t: torch.Tensor, axis: str) -> torch.Tensor:
        return C.all_reduce(t, self.mesh.group(axis), self.mesh.size(axis))

    def product(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T (+ b)`` of the whole (row, col) block ``w``, its partial sums reduced (``reduce_out``)."""
        y = self.reduce_out(torch.matmul(x, w if self.spec.weight_in_out else w.t()))
        return y + bias.to(y.dtype) if bias is not None else y

    def reduce_out(self, y: torch.Tensor) -> torch.Tensor:
        """The local product's partial sums over the input axis: all-reduced, or (sequence parallelism)
        reduce-scattered along the tokens."""
        axis, dim = self.spec.orientation.in_axis, self.spec.scatter_dim
        if dim < 0:
            return self.all_reduce(y, axis)
        return scatter_along(y, dim, self.mesh, axis)

    def whole_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """The output's gradient for every token (sequence parallelism: gathered from the tokens' ranks)."""
        dim = self.spec.scatter_dim
        return dy if dim < 0 else gather_along(dy, dim, self.mesh, self.spec.orientation.in_axis)

    def input_grad(self, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The input's gradient from this rank's block ``w`` (before any reduction over the output axis)."""
        return torch.matmul(dy, w.t() if self.spec.weight_in_out else w)

    def weight_grad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """The whole block's gradient from the input ``x`` and the output's gradient ``dy`` (rows flattened)."""
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        return x2.t() @ dy2 if self.spec.weight_in_out else dy2.t() @ x2

    def reduce_dx(self, dx: torch.Tensor) -> torch.Tensor:
        """The input's gradient summed over the output axis, unless the gather before this matmul does it."""
        return dx if self.spec.partial_dx else self.all_reduce(dx, self.spec.orientation.out_axis)

    def __call__(self, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tokens = getattr(x, REGATHER, None) if self.spec.partial_dx else None
        if self.spec.orientation.is_3d:
            return apply(_Matmul3D, x, w_shard, bias, self, tokens)
        # OUT_ROW/OUT_COL: the weight's output features are split over one axis, the input is whole.
        if tokens is not None:
            return apply(MatmulOut, x, w_shard, bias, self, tokens)
        if not self.spec.partial_dx:
            x = apply(CopyTo, x, self.mesh, self.spec.orientation.out_axis)
        y = torch.matmul(x, w_shard) if self.spec.weight_in_out else torch.nn.functional.linear(x, w_shard)
        return y + bias.to(y.dtype) if bias is not None else y  # under autocast y is bf16/fp16, as serial
