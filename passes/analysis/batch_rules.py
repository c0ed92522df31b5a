"""Per-op rules of the batch analysis: where each op's output holds the batch rows, given its inputs'.
See batch_dims for the walk."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from autopar.compat import OpOverload, op_schema
from passes.analysis.batch_facts import BatchDim, BatchFacts, Reduction, State
from passes.analysis.graph_facts import tensor_inputs, tensor_meta
from passes.ir import scatter_rows, sum_grad, vocab_cross_entropy


aten = torch.ops.aten


# ---- the op families ------------------------------------------------------------------------------

VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim,
                   aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.flatten.using_ints,
                   aten.unflatten.int, aten.view_as.default, aten.reshape_as.default})
_TRANSPOSES = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default,
                         aten.movedim.int})
_SOFTMAX_LIKE = frozenset({aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                           aten._log_softmax.default, aten.cumsum.default, aten.cumprod.default,
                           aten.logcumsumexp.default, aten.cummax.default, aten.cummin.default,
                           aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
                           aten.topk.default, aten.kthvalue.default, aten.flip.default, aten.roll.default})
SUM_MEAN = {aten.sum.default: "sum", aten.mean.default: "mean", aten.sum.dim_IntList: "sum",
             aten.mean.dim: "mean"}
#: Losses whose reduction over the batch is a sum of per-element terms (mean: divided by their number).
ELEMENTWISE_LOSSES = frozenset({aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
                                aten.huber_loss.default, aten.binary_cross_entropy.default,
                                aten.binary_cross_entropy_with_logits.default, aten.kl_div.default,
                                aten.soft_margin_loss.default})
#: Losses over class scores (N, C, ...): mean divides by the valid targets' count (or weight).
CLASS_LOSSES = frozenset({aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
                          aten.nll_loss_forward.default, aten.nll_loss2d.default, aten.nll_loss2d_forward.default})
_ROWS_AT_ZERO = frozenset({aten.convolution.default, aten.conv1d.default, aten.conv2d.default,
                           aten.conv3d.default, aten.max_pool2d.default, aten.max_pool1d.default,
                           aten.avg_pool2d.default, aten.avg_pool1d.default, aten.adaptive_avg_pool2d.default,
                           aten.adaptive_avg_pool1d.default, aten.max_pool2d_with_indices.default,
                           aten.group_norm.default, aten.native_group_norm.default,
                           aten.upsample_nearest2d.vec, aten.upsample_bilinear2d.vec, aten.pixel_shuffle.default})
#: Attention over the dim the batch analysis holds as rows: those are no batch (``split_batch`` refuses it).
ATTENTION = frozenset({aten.scaled_dot_product_attention.default})
_LAYER_NORMS = frozenset({aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default})
_BATCH_NORMS = frozenset({aten.batch_norm.default, aten._native_batch_norm_legit.default,
                          aten._native_batch_norm_legit_no_training.default, aten.native_batch_norm.default})
_LAYOUT_PRESERVING = frozenset({
    aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.contiguous.default, aten.dropout.default, aten.type_as.default,
    aten.lift_fresh_copy.default, aten.native_dropout.default, aten.bernoulli.p, aten.bernoulli.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.fill.Scalar,
    aten._assert_tensor_metadata.default, aten.copy_.default, aten.copy.default,
})


def is_pointwise(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, OpOverload) and (t in _LAYOUT_PRESERVING or torch.Tag.pointwise in t.tags)


def _arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """The value of the op's argument ``name`` (positional or keyword), or its schema default."""
    schema = op_schema(node.target)
    if schema is None:
        return default
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            if name in node.kwargs:
                return node.kwargs[name]
            return a.default_value if a.has_default_value() else default
    return default


def _has_arg(node: fx.Node, name: str) -> bool:
    schema = op_schema(node.target)
    return schema is not None and any(a.name == name for a in schema.arguments)


class Gather(Exception):
    """The op works along the batch dim: gather its inputs' rows."""


class Reduce(Exception):
    def __init__(self, reduction: Reduction) -> None:
        self.reduction = reduction


# ---- the rules ---------------------------------------------------------------------------------------


def _uniform_rows(node: fx.Node, dim: int) -> bool:
    """An ``expand`` of a size-1 dim: every row along ``dim`` holds the same values (RoBERTa's buffered
    token type ids, expanded to the batch)."""
    if node.target is not aten.expand.default:
        return False
    src, val = tensor_meta(node.args[0]), tensor_meta(node)
    d = dim - (val.dim() - src.dim())
    return d < 0 or src.shape[d] == 1


class Rules:
    def __init__(self, facts: BatchFacts, rows: Any) -> None:
        """``rows``: this rank's row count, a SymInt in a graph captured for every batch size."""
        self.facts, self.rows = facts, rows

    def bd(self, node: Any) -> BatchDim | None:
        return self.facts.batch_dim(node)

    def getitem(self, node: fx.Node) -> Any:
        src = self.facts.dims.get(node.args[0])
        return src[node.args[1]] if isinstance(src, tuple) and isinstance(node.args[1], int) else None

    def marker(self, node: fx.Node) -> None:
        if node.target is sum_grad:
            self.facts.dims[node] = self.facts.dims.get(node.args[0])
        elif node.target is scatter_rows:
            spec = node.args[1]
            self.facts.dims[node] = BatchDim(spec.dim, spec.factor)
        elif node.target is vocab_cross_entropy and node.args[-1].reduction == 0:  # per row, as the loss it replaced
            self.facts.dims[node] = self.facts.dims.get(node.args[0])
        else:  # batch_reduce, gather_rows: whole
            self.facts.dims[node] = None

    def decide(self, node: fx.Node) -> Any:
        t = node.target
        if t is operator.getitem:
            return self.getitem(node)
        handler = _HANDLERS.get(t)
        if handler is not None:
            return handler(self, node)
        if t in ELEMENTWISE_LOSSES or t in CLASS_LOSSES:
            return self.loss(node)
        if t in _SOFTMAX_LIKE:
            return self.along_dim(node)
        if is_pointwise(node):
            return self.pointwise(node)
        if _has_arg(node, "reduction") and int(_arg(node, "reduction", 1)) != 0:
            raise Gather()
        return self.unknown(node)

    # ---- rules ----------------------------------------------------------------------------------

    def pointwise(self, node: fx.Node) -> Any:
        vals = node.meta.get("val")
        if isinstance(vals, (list, tuple)):  # native_dropout: (output, mask), both laid out like the input
            outs = [self.aligned(node, v) if isinstance(v, torch.Tensor) else None for v in vals]
            return tuple(outs)
        return self.aligned(node, vals)

    def aligned(self, node: fx.Node, val: torch.Tensor) -> BatchDim:
        target = None
        for i in tensor_inputs(node):
            bd, t = self.bd(i), tensor_meta(i)
            if bd is None or t is None:
                continue
            d = bd.dim + val.dim() - t.dim()
            if d < 0 or not same(val.shape[d], t.shape[bd.dim]):
                raise Gather()
            cand = bd.at(d)
            if target is not None and cand != target:
                raise Gather()
            target = cand
        if target is None:
            raise Gather()
        return target

    def view(self, node: fx.Node) -> BatchDim:
        x = node.args[0]
        bd, xt, val = self.bd(x), tensor_meta(x), tensor_meta(node)
        mapped = map_batch_through_view(tuple(xt.shape), tuple(val.shape), bd, self.rows)
        if mapped is None:
            raise Gather()
        return mapped

    def expand(self, node: fx.Node) -> BatchDim:
        x = node.args[0]
        bd, xt, val = self.bd(x), tensor_meta(x), tensor_meta(node)
        d = bd.dim + val.dim() - xt.dim()
        if not same(val.shape[d], xt.shape[bd.dim]):
            raise Gather()
        return bd.at(d)

    def transpose(self, node: fx.Node) -> BatchDim:
        x = node.args[0]
        bd, nd = self.bd(x), tensor_meta(x).dim()
        t = node.target
        if t in (aten.t.default, aten.numpy_T.default):
            perm = list(range(nd))[::-1]
        elif t is aten.permute.default:
            perm = [d % nd for d in node.args[1]]
        elif t is aten.movedim.int:
            src, dst = node.args[1] % nd, node.args[2] % nd
            perm = [d for d in range(nd) if d != src]
            perm.insert(dst, src)
        else:
            a, b = node.args[1] % nd, node.args[2] % nd
            perm = list(range(nd))
            perm[a], perm[b] = perm[b], perm[a]
        return bd.at(perm.index(bd.dim))

    def complex_view(self, node: fx.Node) -> BatchDim:
        """``view_as_complex`` drops the trailing (re, im) dim, ``view_as_real`` adds one: rows stay put."""
        bd, xt = self.bd(node.args[0]), tensor_meta(node.args[0])
        if bd is None or bd.dim >= xt.dim() - (node.target is aten.view_as_complex.default):
            raise Gather()
        return bd

    def slice(self, node: fx.Node) -> BatchDim:
        x = node.args[0]
        bd, xt = self.bd(x), tensor_meta(x)
        dim = _arg(node, "dim", 0) % xt.dim()
        if dim == bd.dim:
            start, end, step = _arg(node, "start"), _arg(node, "end"), _arg(node, "step", 1)
            if (start or 0) != 0 or (end is not None and not known(end >= xt.shape[dim])) or step != 1:
                raise Gather()
        return bd

    def select(self, node: fx.Node) -> BatchDim:
        x = node.args[0]
        bd, xt = self.bd(x), tensor_meta(x)
        dim = node.args[1] % xt.dim()
        if dim == bd.dim:
            raise Gather()
        return bd.at(bd.dim - (dim < bd.dim))

    def index(self, node: fx.Node) -> BatchDim:
        """Advanced indexing ``x[i0, i1, ...]``: rows stay rows when the batch dim is not indexed, when it is
        indexed by ``arange(rows)`` (``row_index``), or when the indices themselves are this rank's rows."""
        x, indices = node.args[0], list(node.args[1])
        xbd, val = self.bd(x), tensor_meta(node)
        used = [d for d, i in enumerate(indices) if i is not None]
        metas = [tensor_meta(indices[d]) for d in used]
        if not used or any(m is None for m in metas) or val is None:
            raise Gather()
        nb = max(m.dim() for m in metas)
        adjacent = used == list(range(used[0], used[-1] + 1))
        start = used[0] if adjacent else 0

        def kept(d: int) -> int:  # where a dim of x that no index touches lands
            if adjacent:
                return d if d < used[0] else d - len(used) + nb
            return nb + d - sum(u < d for u in used)

        target = None
        cands = []
        if xbd is not None:
            if xbd.dim in used:
                idx = indices[xbd.dim]
                ri = self.facts.row_index.get(idx)
                if ri is None or xbd.factor != 1 or xbd.outer != 1:
                    raise Gather()
                cands.append(BatchDim(start + ri + nb - tensor_meta(idx).dim(), 1))
            else:
                cands.append(xbd.at(kept(xbd.dim)))
        for d in used:
            ibd = self.bd(indices[d])
            if ibd is not None:
                cands.append(ibd.at(start + ibd.dim + nb - tensor_meta(indices[d]).dim()))
        for cand in cands:
            if target is not None and cand != target:
                raise Gather()
            target = cand
        if target is None or target.dim >= val.dim() or \
                not known(val.shape[target.dim] == target.outer * self.rows * target.factor):
            raise Gather()
        return target

    def gather(self, node: fx.Node) -> BatchDim:
        """``gather(x, dim, index)``: row-wise along any dim but the rows' when x and index share them."""
        x, dim, index = node.args[:3]
        xbd, ibd, xt = self.bd(x), self.bd(index), tensor_meta(x)
        if ibd is None or dim % xt.dim() == ibd.dim or xbd not in (None, ibd):
            raise Gather()
        if xbd is None and not same(xt.shape[ibd.dim], 1) and not _uniform_rows(x, ibd.dim):
            raise Gather()  # x would have to hold the rows too
        return ibd

    def split(self, node: fx.Node) -> tuple:
        x = node.args[0]
        bd, xt = self.bd(x), tensor_meta(x)
        dim = _arg(node, "dim", 0) % xt.dim()
        if dim == bd.dim:
            raise Gather()
        vals = node.meta.get("val")
        if node.target is aten.unbind.int:
            return tuple(bd.at(bd.dim - (dim < bd.dim)) for _ in vals)
        return tuple(bd for _ in vals)

    def cat(self, node: fx.Node) -> BatchDim:
        tensors = list(node.args[0])
        val = tensor_meta(node)
        dim = _arg(node, "dim", 0) % val.dim()
        target = None
        for t in tensors:
            bd = self.bd(t)
            if bd is None:
                continue
            if node.target is aten.stack.default:
                bd = bd.at(bd.dim + (dim <= bd.dim))
            elif bd.dim == dim:
                raise Gather()
            if target is not None and bd != target:
                raise Gather()
            target = bd
        return target

    def embedding(self, node: fx.Node) -> BatchDim:
        weight, ids = node.args[0], node.args[1]
        if self.bd(weight) is not None:
            raise Gather()
        return self.bd(ids)

    def linear(self, node: fx.Node) -> BatchDim:
        x = node.args[0]
        bd, xt = self.bd(x), tensor_meta(x)
        if bd is None or bd.dim == xt.dim() - 1 or any(self.bd(i) is not None for i in node.args[1:3]):
            raise Gather()
        return bd

    def addmm(self, node: fx.Node) -> BatchDim:
        bias, a, b = node.args[:3]
        rows = self.bd(a)
        if rows is None or rows.dim != 0 or rows.outer != 1 or self.bd(b) is not None or self.bd(bias) not in (None, rows):
            raise Gather()
        return rows

    def matmul(self, node: fx.Node) -> BatchDim:
        a, b = node.args[:2]
        at, bt, val = tensor_meta(a), tensor_meta(b), tensor_meta(node)
        if at is None or bt is None or at.dim() < 2 or bt.dim() < 2:
            raise Gather()
        nd = val.dim()
        target = None
        for x, t, which in ((a, at, "a"), (b, bt, "b")):
            bd = self.bd(x)
            if bd is None:
                continue
            contracted = t.dim() - 1 if which == "a" else t.dim() - 2
            if bd.dim == contracted:
                raise Gather()
            if which == "a" and bd.dim == t.dim() - 2:
                cand = bd.at(nd - 2)
            elif which == "b" and bd.dim == t.dim() - 1:
                cand = bd.at(nd - 1)
            else:
                cand = bd.at(bd.dim + nd - t.dim())
                if not same(val.shape[cand.dim], t.shape[bd.dim]):
                    raise Gather()
            if target is not None and cand != target:
                raise Gather()
            target = cand
        return target

    def attention(self, node: fx.Node) -> BatchDim:
        q = node.args[0]
        nd = tensor_meta(q).dim()
        target = None
        for i in tensor_inputs(node):
            bd, t = self.bd(i), tensor_meta(i)
            if bd is None or t is None:
                continue
            d = bd.dim + nd - t.dim()
            if d >= nd - 2 or d < 0:
                raise Gather()
            cand = bd.at(d)
            if target is not None and cand != target:
                raise Gather()
            target = cand
        return target

    def rows_at_zero(self, node: fx.Node) -> Any:
        bd = self.bd(node.args[0])
        if bd is None or bd.dim != 0 or bd.outer != 1 or any(self.bd(i) is not None for i in tensor_inputs(node)[1:]):
            raise Gather()
        vals = node.meta.get("val")
        return tuple(bd for _ in vals) if isinstance(vals, (list, tuple)) else bd

    def layer_norm(self, node: fx.Node) -> Any:
        x = node.args[0]
        bd, xt = self.bd(x), tensor_meta(x)
        shape = node.args[1]
        if bd is None or bd.dim >= xt.dim() - len(shape) or any(self.bd(i) is not None for i in tensor_inputs(node)[1:]):
            raise Gather()
        vals = node.meta.get("val")
        return tuple(bd for _ in vals) if isinstance(vals, (list, tuple)) else bd

    def batch_norm(self, node: fx.Node) -> Any:
        training = node.target is not aten._native_batch_norm_legit_no_training.default and bool(
            _arg(node, "training", False))
        if training:  # batch statistics mix the rows
            raise Gather()
        return self.rows_at_zero(node)

    def reduce(self, node: fx.Node) -> Any:
        x = node.args[0]
        bd, xt = self.bd(x), tensor_meta(x)
        kind = SUM_MEAN[node.target]
        if node.target in (aten.sum.default, aten.mean.default):
            dims, keepdim = tuple(range(xt.dim())), False
        else:
            raw = _arg(node, "dim")
            dims = tuple(range(xt.dim())) if not raw else tuple(sorted(d % xt.dim() for d in raw))
            keepdim = bool(_arg(node, "keepdim", False))
        if bd.dim in dims:
            if _arg(node, "dtype") is not None and not tensor_meta(node).is_floating_point():
                raise Gather()
            raise Reduce(Reduction(kind, bd.flat(), dims, keepdim))
        return bd.at(bd.dim if keepdim else bd.dim - sum(d < bd.dim for d in dims))

    def along_dim(self, node: fx.Node) -> Any:
        """Ops with a ``dim`` argument (softmax, cumsum, sort, max over a dim, ...): fine along any other dim."""
        x = node.args[0]
        bd, xt, vals = self.bd(x), tensor_meta(x), node.meta.get("val")
        if bd is None or xt is None or any(self.bd(i) is not None for i in tensor_inputs(node)[1:]):
            raise Gather()
        raw = _arg(node, "dim")
        if raw is None or (isinstance(raw, (list, tuple)) and not raw):
            raise Gather()
        dims = tuple(sorted(d % xt.dim() for d in (raw if isinstance(raw, (list, tuple)) else (raw,))))
        if bd.dim in dims:
            raise Gather()
        outs = []
        for v in (vals if isinstance(vals, (list, tuple)) else (vals,)):
            if not isinstance(v, torch.Tensor):
                outs.append(None)
                continue
            d = bd.dim if v.dim() == xt.dim() else bd.dim - sum(d < bd.dim for d in dims)
            if v.dim() <= d or not same(v.shape[d], xt.shape[bd.dim]):
                raise Gather()
            outs.append(bd.at(d))
        return tuple(outs) if isinstance(vals, (list, tuple)) else outs[0]

    def loss(self, node: fx.Node) -> Any:
        x, target = node.args[0], node.args[1]
        bx, bt = self.bd(x), self.bd(target)
        if int(_arg(node, "reduction", 1)) != 0:  # (a sum over the entries: their order does not matter)
            bx, bt = bx and bx.flat(), bt and bt.flat()
        others = [i for i in tensor_inputs(node) if i not in (x, target)]
        if bx is None or bx.dim != 0 or any(self.bd(i) is not None for i in others):
            raise Gather()
        if node.target in CLASS_LOSSES:
            if bt is None or bt.dim != 0 or bt.factor != bx.factor:
                raise Gather()
        elif bt is not None and bt != bx:
            raise Gather()
        if int(_arg(node, "reduction", 1)) == 0:  # per element: rows stay rows
            vals = node.meta.get("val")
            return tuple(bx if isinstance(v, torch.Tensor) and v.dim() else None for v in vals) \
                if isinstance(vals, (list, tuple)) else bx
        if node.target in ELEMENTWISE_LOSSES and (bt is None or not same_shape(tensor_meta(target), tensor_meta(x))):
            raise Gather()  # broadcast targets: count the elements the serial mean divides by differently
        kind = "loss_mean" if int(_arg(node, "reduction", 1)) == 1 else "loss_sum"
        raise Reduce(Reduction(kind, bx))

    def index_copy(self, node: fx.Node) -> BatchDim:
        """``x.index_copy_(dim, index, source)`` (HF's StaticCache update): rows stay rows when the copy runs
        along another dim and ``x`` holds the source's rows (split as they are, or made for this rank's rows
        inside forward)."""
        x, dim, index, src = node.args[:4]
        bs, bx, xt, st = self.bd(src), self.bd(x), tensor_meta(x), tensor_meta(src)
        if bs is None or self.bd(index) is not None or xt is None or st is None or xt.dim() != st.dim():
            raise Gather()
        if dim % xt.dim() == bs.dim or bx not in (None, bs) or xt.shape[bs.dim] != st.shape[bs.dim]:
            raise Gather()
        return bs

    def unknown(self, node: fx.Node) -> Any:
        """An op without a rule: fine when it keeps the rows where they are and works along another dim."""
        if _has_arg(node, "dim"):
            return self.along_dim(node)
        split = [i for i in tensor_inputs(node) if self.bd(i) is not None]
        vals = node.meta.get("val")
        if len(split) != 1 or not isinstance(vals, torch.Tensor):
            raise Gather()
        if any(self.facts.state(i) is State.WHOLE for i in tensor_inputs(node)):
            raise Gather()  # a value of the whole batch (offsets, positions) may address the rows
        bd, t = self.bd(split[0]), tensor_meta(split[0])
        if t is None or vals.dim() != t.dim() or not same(vals.shape[bd.dim], t.shape[bd.dim]) or bd.dim != 0 \
                or bd.outer != 1:
            raise Gather()
        return bd


_HANDLERS: dict[Any, Callable[[Rules, fx.Node], Any]] = {
    **{t: Rules.view for t in VIEWS},
    aten.expand.default: Rules.expand,
    aten.expand_as.default: Rules.expand,
    **{t: Rules.transpose for t in _TRANSPOSES},
    **{t: Rules.complex_view for t in (aten.view_as_complex.default, aten.view_as_real.default)},
    aten.slice.Tensor: Rules.slice,
    aten.select.int: Rules.select,
    aten.index.Tensor: Rules.index,
    aten.gather.default: Rules.gather,
    aten.split.Tensor: Rules.split,
    aten.split_with_sizes.default: Rules.split,
    aten.chunk.default: Rules.split,
    aten.unbind.int: Rules.split,
    aten.tensor_split.sections: Rules.split,
    aten.cat.default: Rules.cat,
    aten.stack.default: Rules.cat,
    aten.embedding.default: Rules.embedding,
    aten.linear.default: Rules.linear,
    aten.addmm.default: Rules.addmm,
    aten.mm.default: Rules.matmul,
    aten.bmm.default: Rules.matmul,
    aten.matmul.default: Rules.matmul,
    aten.scaled_dot_product_attention.default: Rules.attention,
    aten.index_copy.default: Rules.index_copy,
    aten.index_copy_.default: Rules.index_copy,
    **{t: Rules.rows_at_zero for t in _ROWS_AT_ZERO},
    **{t: Rules.layer_norm for t in _LAYER_NORMS},
    **{t: Rules.batch_norm for t in _BATCH_NORMS},
    **{t: Rules.reduce for t in SUM_MEAN},
}


def map_batch_through_view(src: tuple[int, ...], dst: tuple[int, ...], bd: BatchDim, rows: Any) -> BatchDim | None:
    """Where the rows of dim ``bd.dim`` of shape ``src`` lie in the view ``dst``, or None when the view
    splits a row's entries over two dims.

    In the contiguous layout the rows lie in blocks: element ``a * (rows * S) + r * S + s`` belongs to row
    ``r``, where a row spans ``S = bd.factor * inner`` elements of a block (``inner``: the dims after the
    batch dim) and ``a`` runs over the dims before it and ``bd.outer``. The rows lie in dst dim ``d`` (stride
    ``D``, size ``n``) when a row's span is a whole number of its steps (``S % D == 0``: ``S // D`` entries per
    row) and the dim spans whole blocks (``n * D`` a multiple of ``rows * S``: that many blocks before the
    rows, ``outer``). The outermost such dim is taken (with one row, several can be).
    """
    if not known(rows > 0):
        return None
    span = bd.factor * _prod(src[bd.dim + 1:])
    block = rows * span
    for d, size in enumerate(dst):
        stride = _prod(dst[d + 1:])
        if not known(span % stride == 0) or not known((size * stride) % block == 0):
            continue
        outer = exact((size * stride) // block)
        if isinstance(outer, int):
            return BatchDim(d, exact(span // stride), outer)
    return None


def _prod(sizes: Any) -> Any:
    """The product, symbolic where a size is (int() would specialize a dynamic graph's sizes)."""
    out = 1
    for s in sizes:
        out *= s
    return out


def exact(size: Any) -> Any:
    """A size as an int where it is one, else the SymInt (``int()`` would fix its symbols)."""
    if isinstance(size, torch.SymInt):
        known = size.node.maybe_as_int()
        return size if known is None else int(known)
    return int(size)


def same(a: Any, b: Any) -> bool:
    """Whether two sizes are equal for every value of their symbols (no guard is added, even on a size
    the data decides: ``split`` by a ``.tolist()``)."""
    return known(a == b)


def same_shape(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.dim() == b.dim() and all(same(x, y) for x, y in zip(a.shape, b.shape))


def known(cond: Any) -> bool:
    """Whether a size comparison holds for every value of its symbols (no guard is added)."""
    return statically_known_true(cond) if isinstance(cond, torch.SymBool) else bool(cond)
