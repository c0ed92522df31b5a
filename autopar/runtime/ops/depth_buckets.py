"""The depth-split weights of one block gathered in one all-gather, their gradients reduce-scattered in one.

Under depth > 1 every 3D matmul gathers its weight block from the depth ranks' rows of it, in forward and
again in backward, and reduce-scatters the block's gradient (``ops._Matmul3D``): three collectives per
weight, where FSDP2 makes one all-gather per block each way and one reduce-scatter. A collective's fixed
cost dominates small messages (on this 2-core machine, 4 gloo ranks: 3.4 ms for an all-gather of 16 KiB,
8.8 ms for 1.75 MiB), so ``bucket_depth_gathers`` rewrites a bound graph: the 3D matmuls of one block
(``model.layers.3``) read their blocks from one ``GatherBucket`` node inserted before the first of them,
which gathers every weight of the block in one all-gather, and whose backward reduce-scatters all their
gradients in one (after the block's last matmul's backward, when autograd has every gradient). Each
matmul's backward regathers its block through the bucket (``DepthBucket.weight``): the first to ask gathers
the block's weights in one all-gather, the others take theirs. The bytes are the per-weight ones.

Only for graphs that run eagerly: a compiled graph's collectives are Inductor's to schedule, and its bucketing
passes merge them (``compat.inductor_bucketing_options``). Under a
pipeline the bucket's nodes carry their block's module, so they go to its stage when the graph is split.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from autopar.compat import version_of
from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.matmul import MatmulOp, backward_prologue, bias_grad
from autopar.runtime.ops.sequence_parallel import REGATHER, TokensOf
from passes.analysis.estimate_memory import block_of
from passes.analysis.graph_facts import module_of


def _compute_dtype(shards: Sequence[torch.Tensor]) -> torch.dtype | None:
    """The dtype the weights travel and multiply in: autocast's, else None (each its own, as eager's)."""
    device = shards[0].device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class DepthBucket:
    """The 3D matmuls of one block whose weights' rows are split over depth."""

    def __init__(self, ops: list[MatmulOp], mesh: Mesh) -> None:
        self.ops, self.group, self.size = ops, mesh.group("depth"), mesh.size("depth")
        self.numels = [op.block_shape[0] * op.block_shape[1] // self.size for op in ops]
        self.reduce_dtype = ops[0].reduce_dtype
        self.shards: tuple[torch.Tensor, ...] = ()
        """The shards the last forward read (the parameters' local tensors): backward regathers them."""
        self.kept: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}
        """Blocks regathered in backward, not yet taken: index -> (block, the shards' versions then)."""

    def gather(self, shards: Sequence[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Every weight block from every depth rank's rows of it, in one all-gather (per dtype)."""
        moved = [s if dtype is None else s.to(dtype) for s in shards]
        out: list[torch.Tensor | None] = [None] * len(moved)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, s in enumerate(moved):
            by_dtype.setdefault(s.dtype, []).append(i)
        for members in by_dtype.values():
            flat = torch.cat([moved[i].reshape(-1) for i in members])
            total = flat.numel()
            rows = C.all_gather(flat, self.group, self.size).view(self.size, total)
            offset = 0
            for i in members:
                n = self.numels[i]
                out[i] = rows[:, offset:offset + n].reshape(self.ops[i].block_shape)
                offset += n
        return out  # type: ignore[return-value]

    def weight(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Matmul ``index``'s block for its backward: the first to ask regathers the block's weights."""
        # (a block kept from before an in-place change of the weights is never taken: the bucket's saved shards
        # make autograd refuse such a backward, as the per-weight matmul's do; the versions say so here too)
        versions = tuple(version_of(s) for s in self.shards)
        entry = self.kept.pop(index, None)
        if entry is not None and entry[1] == versions and entry[0].dtype == dtype:
            return entry[0]
        blocks = self.gather(self.shards, dtype)
        self.kept = {i: (b, versions) for i, b in enumerate(blocks) if i != index}
        return blocks[index]

    def reduce_scatter(self, grads: Sequence[torch.Tensor | None], shards: Sequence[torch.Tensor]
                       ) -> list[torch.Tensor]:
        """Each weight's gradient block summed over depth, this rank's rows of it, in one reduce-scatter."""
        self.kept = {}  # the block's backward is done: regathered blocks no matmul took go
        dtype = self.reduce_dtype or functools.reduce(torch.promote_types, [s.dtype for s in shards])
        parts = []
        for g, op, n in zip(grads, self.ops, self.numels):
            g = torch.zeros(op.block_shape, dtype=dtype, device=shards[0].device) if g is None else g.to(dtype)
            parts.append(g.reshape(self.size, n))
        mine = C.reduce_scatter(torch.cat(parts, dim=1).reshape(-1), self.group, self.size)
        out, offset = [], 0
        for s, n in zip(shards, self.numels):
            out.append(mine[offset:offset + n].view(s.shape).to(s.dtype))
            offset += n
        return out


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bucket: DepthBucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        ctx.save_for_backward(*shards)
        bucket.shards = tuple(s.detach() for s in shards)
        bucket.kept = {}
        return tuple(bucket.gather(shards, _compute_dtype(shards)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        shards = ctx.saved_tensors
        return (None, *ctx.bucket.reduce_scatter(grads, shards))


class _Matmul3DGathered(torch.autograd.Function):
    """``ops._Matmul3D`` on a block its bucket gathered: the gradient goes back whole, to the bucket."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, op: MatmulOp,
                bucket: DepthBucket, index: int, tokens: TokensOf | None = None) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.op, ctx.dtype, ctx.bucket, ctx.index, ctx.w_dtype = op, dtype, bucket, index, w.dtype
        ctx.tokens = tokens and tokens.regather
        x = x.to(dtype)
        with torch.autocast(device, enabled=False):
            y = op.reduce_out(torch.matmul(x, w.to(dtype) if op.spec.weight_in_out else w.to(dtype).t()))
            if bias is not None:
                y = y + bias.to(dtype)
        ctx.save_for_backward(x if tokens is None else tokens.keep(dtype, ctx.needs_input_grad[1]))
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        op: MatmulOp = ctx.op
        (x,) = ctx.saved_tensors
        x, dy, (need_x, need_w, need_b) = backward_prologue(ctx, x, dy)
        dx = dw = None
        if need_x:
            dx = op.reduce_dx(op.input_grad(dy, ctx.bucket.weight(ctx.index, ctx.w_dtype).to(ctx.dtype)))
        if need_w:
            dw = op.weight_grad(x, dy).to(ctx.w_dtype)
        return dx, dw, bias_grad(dy, need_b), None, None, None, None


class _GatheredMatmul:
    """A bound 3D matmul reading its block from a bucket's output."""

    def __init__(self, op: MatmulOp, bucket: DepthBucket, index: int) -> None:
        self.op, self.bucket, self.index = op, bucket, index

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tokens = getattr(x, REGATHER, None) if self.op.spec.partial_dx else None
        return _Matmul3DGathered.apply(x, w, bias, self.op, self.bucket, self.index, tokens)


class _BucketGather:
    def __init__(self, bucket: DepthBucket) -> None:
        self.bucket = bucket

    def __call__(self, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _GatherBucket.apply(self.bucket, *shards)


def bucket_depth_gathers(gm: fx.GraphModule, mesh: Mesh) -> int:
    """Rewrites the bound 3D matmuls of each block in ``gm`` (and its subgraphs) to gather and reduce-scatter
    their depth-split weights together; returns the buckets made. Call after ``binding.bind_markers``."""
    if mesh.size("depth") == 1:
        return 0
    made = 0
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        groups: dict[str, list[fx.Node]] = {}
        for node in sub.graph.nodes:
            op = getattr(node.target, "__self__", None)
            if (isinstance(op, MatmulOp) and op.spec.orientation.is_3d and len(node.args) >= 2
                    and isinstance(node.args[1], fx.Node) and node.args[1].op == "placeholder"
                    and (block := block_of(module_of(node))) is not None):
                groups.setdefault(block, []).append(node)
        for nodes in groups.values():
            weights = [n.args[1] for n in nodes]
            if len(nodes) < 2 or len(set(weights)) < len(weights):  # one weight read twice: per-op gathers
                continue
            bucket = DepthBucket([n.target.__self__ for n in nodes], mesh)
            with sub.graph.inserting_before(nodes[0]):
                where = {k: v for k, v in nodes[0].meta.items() if k == "nn_module_stack"}
                gathered = sub.graph.call_function(_BucketGather(bucket).__call__, tuple(weights))
                gathered.meta.update(where)
                items = []
                for i in range(len(nodes)):
                    item = sub.graph.call_function(operator.getitem, (gathered, i))
                    item.meta.update(where)
                    items.append(item)
            for i, node in enumerate(nodes):
                node.target = _GatheredMatmul(node.target.__self__, bucket, i).__call__
                node.args = (node.args[0], items[i], *node.args[2:])
            made += 1
        sub.recompile()
    return made

