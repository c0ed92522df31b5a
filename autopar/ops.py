"""Implementations of the marker ops in ``passes.ir`` as autograd Functions over process groups.

Gradient convention: a tensor whose features are split over an axis is replicated over the other
tensor axes, and so is its gradient. Hence a gather's backward is a local slice and a slice's
backward is a gather (Megatron's conjugate pairs); see DESIGN-NOTES section 1 for the matmul.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar import collectives as C
from autopar.config import Layout
from autopar.mesh import Mesh
from passes.ir import ConvertSpec, GatherOutputSpec, MatmulSpec


def _chunk_last(t: torch.Tensor, size: int, index: int) -> torch.Tensor:
    if size == 1:
        return t
    n = t.shape[-1] // size
    return t[..., index * n:(index + 1) * n].contiguous()


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
        ctx.mesh, ctx.axis = mesh, axis
        return C.all_gather_last(x, mesh.group(axis), mesh.size(axis))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        m = ctx.mesh
        return _chunk_last(dy, m.size(ctx.axis), m.index(ctx.axis)), None, None


class _SliceLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
        ctx.mesh, ctx.axis = mesh, axis
        return _chunk_last(x, mesh.size(axis), mesh.index(axis))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        m = ctx.mesh
        return C.all_gather_last(dy, m.group(ctx.axis), m.size(ctx.axis)), None, None


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad])


def _gather_rows(x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...]) -> torch.Tensor:
    n = mesh.size("batch")
    if n == 1:
        return x
    stacked = C.all_gather(_pad_rows(x, max(sizes)).unsqueeze(0), mesh.group("batch"), n)
    return torch.cat([stacked[i, :s] for i, s in enumerate(sizes)])


class _GatherBatch(torch.autograd.Function):
    """Rows of every batch shard, in batch order; shards may be uneven (padded on the wire)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...]) -> torch.Tensor:
        ctx.mesh, ctx.sizes = mesh, sizes
        return _gather_rows(x, mesh, sizes)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        i = ctx.mesh.index("batch")
        start = sum(ctx.sizes[:i])
        return dy[start:start + ctx.sizes[i]], None, None


class _ScatterBatch(torch.autograd.Function):
    """This rank's rows of a global-batch input (the inverse of _GatherBatch)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...]) -> torch.Tensor:
        ctx.mesh, ctx.sizes = mesh, sizes
        i = mesh.index("batch")
        start = sum(sizes[:i])
        return x[start:start + sizes[i]]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return _gather_rows(dy, ctx.mesh, ctx.sizes), None, None


def scatter_batch(x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...]) -> torch.Tensor:
    return _ScatterBatch.apply(x, mesh, sizes)


class _Matmul3D(torch.autograd.Function):
    """``y = x @ W^T + b`` with W's (out, in) block on this (row, col) and 1/depth of it stored here."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                op: MatmulOp) -> torch.Tensor:
        ctx.op = op
        w = op.gather_weight(w_shard)
        y = torch.matmul(x, w if op.spec.weight_in_out else w.t())
        y = op.all_reduce(y, op.spec.orientation.in_axis)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x, w_shard)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        op: MatmulOp = ctx.op
        x, w_shard = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if need_x or need_w:
            w = op.gather_weight(w_shard)
        if need_x:
            dx = torch.matmul(dy, w.t() if op.spec.weight_in_out else w)
            dx = op.all_reduce(dx, op.spec.orientation.out_axis)
        dy2 = dy.reshape(-1, dy.shape[-1])
        if need_w:
            x2 = x.reshape(-1, x.shape[-1])
            block = x2.t() @ dy2 if op.spec.weight_in_out else dy2.t() @ x2
            dw = C.reduce_scatter(block.reshape(-1), op.mesh.group("depth"), op.mesh.size("depth"))
        if need_b:
            db = dy2.sum(0)
        return dx, dw, db, None


class MatmulOp:
    """A bound ``passes.ir.sharded_matmul``: the spec plus the groups it talks over."""

    def __init__(self, spec: MatmulSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh
        o = spec.orientation
        n_loc = spec.out_features // mesh.size(o.out_axis)
        k_loc = spec.in_features // mesh.size(o.in_axis)
        self.block_shape = (k_loc, n_loc) if spec.weight_in_out else (n_loc, k_loc)

    def gather_weight(self, w_shard: torch.Tensor) -> torch.Tensor:
        m = self.mesh
        return C.all_gather(w_shard, m.group("depth"), m.size("depth")).view(self.block_shape)

    def all_reduce(self, t: torch.Tensor, axis: str) -> torch.Tensor:
        return C.all_reduce(t, self.mesh.group(axis), self.mesh.size(axis))

    def __call__(self, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _Matmul3D.apply(x, w_shard, bias, self)


class ConvertOp:
    def __init__(self, spec: ConvertSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.src is not Layout.REPLICATED:
            x = _GatherLast.apply(x, self.mesh, self.spec.src.value)
        if self.spec.dst is not Layout.REPLICATED:
            x = _SliceLast.apply(x, self.mesh, self.spec.dst.value)
        return x


class GatherOutputOp:
    def __init__(self, spec: GatherOutputSpec, mesh: Mesh, batch_sizes: tuple[int, ...]) -> None:
        self.spec, self.mesh, self.batch_sizes = spec, mesh, batch_sizes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.layout is not Layout.REPLICATED:
            x = _GatherLast.apply(x, self.mesh, self.spec.layout.value)
        if self.spec.batch_split:
            x = _GatherBatch.apply(x, self.mesh, self.batch_sizes)
        return x
