"""The per-op layout rules of ``passes.analysis.layouts``: given the shardings of an op's inputs, the sharding
of its output, the layouts it needs its inputs in, its arguments on local pieces, and the reductions that
complete it (one ``Decision`` per op; None: every input gathered). ``LayoutResult`` holds what propagation
decided for a whole graph."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from autopar.compat import OpOverload
from autopar.decisions import EmbeddingMode, Orientation
from passes.analysis.batch_facts import BatchFacts
from passes.analysis.graph_facts import tensor_inputs, tensor_meta
from passes.ir import REPLICATED, ReduceSpec, Sharding, VocabLossSpec, vocab_cross_entropy

aten = torch.ops.aten

_LAYOUT_PRESERVING = frozenset({
    aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.contiguous.default, aten.dropout.default,
    aten.type_as.default, aten.where.ScalarOther, aten.where.ScalarSelf, aten.lift_fresh_copy.default,
})
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
_SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default})
_REDUCE = {aten.mean.dim: True, aten.sum.dim_IntList: False}


def is_pointwise(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    return node.target in _LAYOUT_PRESERVING or torch.Tag.pointwise in node.target.tags


@dataclass
class LayoutResult:
    shardings: dict[fx.Node, Any] = field(default_factory=dict)
    """Sharding of every node's value; a tuple of them for ops returning several tensors."""
    requires_grad: dict[fx.Node, bool] = field(default_factory=dict)
    batch_split: dict[fx.Node, bool] = field(default_factory=dict)
    conversions: dict[tuple[fx.Node, fx.Node], Sharding] = field(default_factory=dict)
    """(consumer, producer) -> the sharding the consumer needs the producer in."""
    orientations: dict[fx.Node, Orientation] = field(default_factory=dict)
    """Orientation of each matmul node that is sharded."""
    embeddings: dict[fx.Node, tuple[EmbeddingMode, str]] = field(default_factory=dict)
    """Sharded embedding lookups: (mode, axis)."""
    local_args: dict[fx.Node, tuple[Any, tuple, dict]] = field(default_factory=dict)
    """Ops whose target/arguments change on local pieces: (target, args, kwargs)."""
    reductions: dict[fx.Node, ReduceSpec] = field(default_factory=dict)
    """Sums/means over a split dim: computed locally, completed by an all-reduce."""
    batch: BatchFacts | None = None
    """Where each tensor holds the batch (None when the batch is not split)."""
    grad_sums: dict[tuple[fx.Node, fx.Node], str] = field(default_factory=dict)
    """(consumer, producer) -> axis: a replicated tensor broadcast along a split dim gets only this
    rank's part of its gradient from the consumer; the parts are summed over the axis in backward."""
    seq_scatter: dict[fx.Node, int] = field(default_factory=dict)
    """Sequence parallelism: matmul -> the dim (its tokens) its output is reduce-scattered along."""
    partial_gathers: set[tuple[fx.Node, Sharding]] = field(default_factory=set)
    """(producer, needed sharding) whose gather reduce-scatters the gradient in backward: every reader is a
    matmul in ``partial_dx``."""
    partial_dx: set[fx.Node] = field(default_factory=set)
    """Matmuls whose input gradient stays partial over their output axis (summed by the gather's backward)."""
    uneven_heads: dict[fx.Node, tuple[Sharding, int]] = field(default_factory=dict)
    """Views that cut a split dim into pieces of their own (heads) that do not divide over its axis: view ->
    (the input's sharding, the size of the pieces). Their input is gathered: what reads the pieces (the
    attention) runs whole on each rank of that axis."""

    def sharding(self, node: Any) -> Sharding:
        s = self.shardings.get(node, REPLICATED) if isinstance(node, fx.Node) else REPLICATED
        return s if isinstance(s, Sharding) else REPLICATED


@dataclass
class Decision:
    out: Any
    needs: dict[fx.Node, Sharding] = field(default_factory=dict)
    args: tuple[Any, tuple, dict] | None = None
    reduce: ReduceSpec | None = None
    broadcast: tuple[fx.Node, ...] = ()
    """Replicated inputs broadcast along the output's split dim (their gradients are partial)."""


class LayoutRules:
    """Per-op sharding rules. Each returns a Decision, or None for "gather everything"."""

    def __init__(self, res: LayoutResult, sizes: Mapping[str, int]) -> None:
        self.res, self.sizes = res, sizes

    def n(self, s: Sharding) -> int:
        return self.sizes.get(s.axis, 1)

    def decide(self, node: fx.Node) -> Decision | None:
        t = node.target
        if t is operator.getitem:
            src = self.res.shardings.get(node.args[0])
            return Decision(src[node.args[1]] if isinstance(src, tuple) else REPLICATED)
        if t is aten._assert_tensor_metadata.default:
            kwargs = {k: v for k, v in node.kwargs.items() if k not in ("size", "stride")}
            return Decision(REPLICATED, {}, (t, node.args, kwargs))
        ins = tensor_inputs(node)
        if not any(not self.res.sharding(i).is_replicated for i in ins):
            return None if not ins else Decision(REPLICATED)
        handler = _HANDLERS.get(t)
        if handler is not None:
            return handler(self, node)
        if is_pointwise(node):
            return self.pointwise(node)
        return None

    # ---- helpers --------------------------------------------------------------------------------

    def x(self, node: fx.Node) -> tuple[fx.Node, Sharding, torch.Tensor]:
        x = node.args[0]
        return x, self.res.sharding(x), tensor_meta(x)

    def local_shape(self, shape: Any, s: Sharding) -> list[int]:
        out = [int(v) for v in shape]
        out[s.dim] = s.full_size // self.n(s)
        return out

    def divides(self, s: Sharding) -> bool:
        return all(p % self.n(s) == 0 and p > 0 for p in s.parts)

    # ---- rules ----------------------------------------------------------------------------------

    def pointwise(self, node: fx.Node) -> Decision | None:
        val = tensor_meta(node)
        if val is None:
            return None
        target = None
        for i in tensor_inputs(node):
            s, t = self.res.sharding(i), tensor_meta(i)
            if not s.is_replicated and t is not None:
                target = Sharding(s.layout, s.dim + val.dim() - t.dim(), s.parts)
                break
        if target is None or target.dim < 0 or val.shape[target.dim] != target.full_size:
            return None
        needs, broadcast = {}, []
        for i in tensor_inputs(node):
            t = tensor_meta(i)
            if t is None:
                continue
            a = target.dim - (val.dim() - t.dim())
            if a < 0 or t.shape[a] == 1:
                needs[i] = REPLICATED
                broadcast.append(i)
            else:
                needs[i] = Sharding(target.layout, a, target.parts)
        return Decision(target, needs, broadcast=tuple(broadcast))

    def view(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        val = tensor_meta(node)
        mapped = _map_through_view(tuple(xt.shape), tuple(val.shape), s)
        if mapped is None:
            return None
        sizes = list(node.args[1])  # the view's own sizes (symbolic ones stay graph nodes): only the split dim changes
        if not self.divides(mapped):
            # a dim split unevenly (a vocabulary) that the view keeps whole: each rank's size is its own, so -1
            # infers it; a view that would cut the split dim into pieces of its own (heads) is not split
            if (self.divides(s) or len(mapped.parts) != 1 or mapped.full_size != s.full_size
                    or any(v == -1 for i, v in enumerate(sizes) if i != mapped.dim)):
                if mapped.full_size != s.full_size:  # (heads: 14 of them over 4 ranks)
                    self.res.uneven_heads[node] = (s, s.full_size // mapped.full_size)
                return None
            sizes[mapped.dim] = -1
        elif sizes[mapped.dim] != -1:
            sizes[mapped.dim] = mapped.full_size // self.n(mapped)
        return Decision(mapped, {x: s}, (node.target, (x, sizes), node.kwargs))

    def expand(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        val = tensor_meta(node)
        o = s.dim + val.dim() - xt.dim()
        if val.shape[o] != xt.shape[s.dim]:
            return None
        out = Sharding(s.layout, o, s.parts)
        sizes = list(node.args[1])
        if sizes[o] != -1:
            if not self.divides(out):  # an uneven split: the local size differs by rank
                sizes[o] = -1
            else:
                sizes[o] = out.full_size // self.n(out)
        return Decision(out, {x: s}, (node.target, (x, sizes, *node.args[2:]), node.kwargs))

    def unsqueeze(self, node: fx.Node) -> Decision | None:
        x, s, _ = self.x(node)
        d = node.args[1] % tensor_meta(node).dim()
        return Decision(Sharding(s.layout, s.dim + (1 if d <= s.dim else 0), s.parts), {x: s})

    def squeeze(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        dims = node.args[1] if len(node.args) > 1 else ()
        dims = [d % xt.dim() for d in (dims if isinstance(dims, (list, tuple)) else (dims,))]
        removed = [d for d in dims if xt.shape[d] == 1]
        if s.dim in removed or not dims:
            return None
        return Decision(Sharding(s.layout, s.dim - sum(d < s.dim for d in removed), s.parts), {x: s})

    def transpose(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        nd = xt.dim()
        if node.target is aten.t.default:
            perm = list(range(nd))[::-1]
        elif node.target is aten.permute.default:
            perm = [d % nd for d in node.args[1]]
        else:
            a, b = node.args[1] % nd, node.args[2] % nd
            perm = list(range(nd))
            perm[a], perm[b] = perm[b], perm[a]
        return Decision(Sharding(s.layout, perm.index(s.dim), s.parts), {x: s})

    def slice(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        dim = (node.args[1] if len(node.args) > 1 else 0) % xt.dim()
        if dim != s.dim:
            return Decision(s, {x: s})
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else s.full_size
        step = node.args[4] if len(node.args) > 4 else 1
        start, end = _clamp(start, s.full_size), _clamp(end, s.full_size)
        segs = _segments_between(s.parts, start, end)
        if segs is None or step != 1 or not self.divides(s):  # (uneven: local bounds differ by rank)
            return None
        a, b = segs
        n = self.n(s)
        local = (x, dim, sum(s.parts[:a]) // n, sum(s.parts[:b]) // n)
        return Decision(Sharding(s.layout, s.dim, s.parts[a:b]), {x: s}, (aten.slice.Tensor, local, {}))

    def split(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        vals = node.meta.get("val")
        if not isinstance(vals, (list, tuple)):
            return None
        if node.target is aten.chunk.default:
            dim = node.args[2] if len(node.args) > 2 else 0
        else:
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        dim %= xt.dim()
        if dim != s.dim:
            return Decision(tuple(s for _ in vals), {x: s})
        if not self.divides(s):
            return None
        pieces, outs, start = [], [], 0
        for v in vals:
            size = int(v.shape[dim])
            segs = _segments_between(s.parts, start, start + size)
            if segs is None:
                return None
            outs.append(Sharding(s.layout, s.dim, s.parts[segs[0]:segs[1]]))
            pieces.append(size // self.n(s))
            start += size
        return Decision(tuple(outs), {x: s}, (aten.split_with_sizes.default, (x, pieces, dim), {}))

    def cat(self, node: fx.Node) -> Decision | None:
        val = tensor_meta(node)
        # torch.cat skips 1-D empty tensors whatever the dim (HF's legacy empty key/value cache): no layout
        tensors = [t for t in node.args[0] if not (tensor_meta(t).dim() == 1 and tensor_meta(t).numel() == 0
                                                   and val.dim() > 1)]
        dim = (node.args[1] if len(node.args) > 1 else 0) % val.dim()
        first = next(self.res.sharding(t) for t in tensors if not self.res.sharding(t).is_replicated)
        needs: dict[fx.Node, Sharding] = {}
        if first.dim != dim:
            for t in tensors:
                needs[t] = first
            return Decision(first, needs)
        parts: list[int] = []
        for t in tensors:
            s = self.res.sharding(t)
            if not s.is_replicated and not self.divides(s):
                return None
            if s.is_replicated:
                s = Sharding(first.layout, dim, (int(tensor_meta(t).shape[dim]),))
                if not self.divides(s):
                    return None
            elif s.layout is not first.layout:
                return None
            needs[t] = s
            parts.extend(s.parts)
        return Decision(Sharding(first.layout, dim, tuple(parts)), needs)

    def attention(self, node: fx.Node) -> Decision | None:
        q, k, v = node.args[:3]
        qt = tensor_meta(q)
        hd = qt.dim() - 3
        first = next(self.res.sharding(i) for i in (q, k, v) if not self.res.sharding(i).is_replicated)
        if first.dim != hd or len(first.parts) != 1:
            return None
        needs = {}
        for i in (q, k, v):
            heads = int(tensor_meta(i).shape[hd])
            s = Sharding(first.layout, hd, (heads,))
            if not self.divides(s) or heads != int(qt.shape[hd]) and self.res.sharding(i) != s:
                return None
            needs[i] = s
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        broadcast = ()
        if isinstance(mask, fx.Node):
            mt = tensor_meta(mask)
            a = hd - (qt.dim() - mt.dim())
            if a < 0 or mt.shape[a] == 1:
                needs[mask], broadcast = REPLICATED, (mask,)
            else:
                needs[mask] = Sharding(first.layout, a, (int(mt.shape[a]),))
        return Decision(needs[q], needs, broadcast=broadcast)

    def bmm(self, node: fx.Node) -> Decision | None:
        a, b = node.args[:2]
        at, bt, val = tensor_meta(a), tensor_meta(b), tensor_meta(node)
        if at is None or bt is None or at.dim() < 3 or bt.dim() < 3:
            return None
        first = next(self.res.sharding(i) for i in (a, b) if not self.res.sharding(i).is_replicated)
        src = a if not self.res.sharding(a).is_replicated else b
        o = first.dim + val.dim() - tensor_meta(src).dim()
        if o >= val.dim() - 2 or not self.divides(first):
            return None
        needs, broadcast = {}, []
        for i in (a, b):
            t = tensor_meta(i)
            d = o - (val.dim() - t.dim())
            if d < 0 or t.shape[d] == 1:
                needs[i] = REPLICATED
                broadcast.append(i)
            else:
                needs[i] = Sharding(first.layout, d, first.parts)
        return Decision(Sharding(first.layout, o, first.parts), needs, broadcast=tuple(broadcast))

    def softmax(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        if node.args[1] % xt.dim() == s.dim:
            return None
        return Decision(s, {x: s})

    def layer_norm(self, node: fx.Node) -> Decision | None:
        """Split along a dim it does not normalize over (tokens under sequence parallelism, heads): local. Its
        whole weight and bias get from this rank only its rows' part of their gradients (``broadcast``)."""
        x, s, xt = self.x(node)
        if s.dim >= xt.dim() - len(node.args[1]):
            return None
        affine = tuple(a for a in node.args[2:4] if isinstance(a, fx.Node))
        return Decision(s, {x: s, **{a: REPLICATED for a in affine}}, broadcast=affine)

    def cross_entropy(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        target = node.args[1]
        args = dict(zip(("weight", "reduction", "ignore_index", "label_smoothing"), node.args[2:]), **node.kwargs)
        class_dim = 1 if xt.dim() > 1 else 0
        tt = tensor_meta(target) if isinstance(target, fx.Node) else None
        # (one segment, split evenly or not: the loss reads each rank's offset from the vocabulary's size)
        if (s.dim != class_dim or len(s.parts) != 1 or tt is None or tt.is_floating_point()
                or args.get("weight") is not None):
            return None  # class probabilities or class weights: gathered (correct, not vocabulary-parallel)
        spec = VocabLossSpec(s.axis, class_dim, int(args.get("reduction", 1)), int(args.get("ignore_index", -100)),
                             float(args.get("label_smoothing", 0.0)), s.full_size)
        return Decision(REPLICATED, {x: s, target: REPLICATED}, (vocab_cross_entropy, (x, target, spec), {}))

    def size(self, node: fx.Node) -> Decision | None:
        """``x.size(d)`` of a dim that is not split: the local tensor's size is the whole's (no gather)."""
        x, s, xt = self.x(node)
        if len(node.args) < 2 or node.args[1] % xt.dim() == s.dim:
            return None
        return Decision(REPLICATED, {x: s})

    def index_copy(self, node: fx.Node) -> Decision | None:
        """``cache.index_copy_(dim, positions, new)`` (HF's StaticCache update) with the cache and the new
        keys split alike along another dim (their heads): a local copy, in place on this rank's piece. A
        cache the graph makes (``torch.zeros`` at the first update) and only this copy reads is made split
        like the new keys: it was decided replicated before its user was seen, and nothing else read that."""
        dst, dim, index, src = node.args[:4]
        dt, st = tensor_meta(dst), tensor_meta(src)
        if dt is None or st is None or dt.dim() != st.dim() or not isinstance(index, fx.Node):
            return None
        dim %= dt.dim()
        ds, ss = self.res.sharding(dst), self.res.sharding(src)
        if (ds.is_replicated and not ss.is_replicated and ss.dim != dim and st.shape[ss.dim] == ss.full_size
                and self._fresh(dst, ss)):  # (_fresh: split evenly)
            size = list(dst.args[0])
            size[ss.dim] = ss.full_size // self.n(ss)
            self.res.shardings[dst] = ds = ss
            self.res.local_args[dst] = (dst.target, (size, *dst.args[1:]), dict(dst.kwargs))
        if ds.is_replicated or ds.dim == dim or len(ds.parts) != 1 or st.shape[ds.dim] != ds.full_size:
            return None
        return Decision(ds, {dst: ds, src: ds, index: REPLICATED})

    def _fresh(self, dst: fx.Node, s: Sharding) -> bool:
        """``dst`` is a zero/empty/full tensor the graph makes, read by one op only, and ``s`` splits it."""
        if dst.target not in _FACTORIES or len(dst.users) != 1 or dst.args[0] is None:
            return False
        size = dst.args[0]
        return (0 <= s.dim < len(size) and len(s.parts) == 1 and isinstance(size[s.dim], int)
                and size[s.dim] == s.full_size and self.divides(s))

    def reduce(self, node: fx.Node) -> Decision | None:
        x, s, xt = self.x(node)
        dims = node.args[1] if len(node.args) > 1 else None
        if not dims:
            return None
        dims = sorted(d % xt.dim() for d in dims)
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        if s.dim in dims:
            if _REDUCE[node.target] and not self.divides(s):  # a mean of unequal pieces is not their mean
                return None
            return Decision(REPLICATED, {x: s}, reduce=ReduceSpec(s.axis, _REDUCE[node.target]))
        o = s.dim if keepdim else s.dim - sum(d < s.dim for d in dims)
        return Decision(Sharding(s.layout, o, s.parts), {x: s})


_HANDLERS: dict[Any, Callable[[LayoutRules, fx.Node], Decision | None]] = {
    **{t: LayoutRules.view for t in _VIEWS},
    aten.expand.default: LayoutRules.expand,
    aten.unsqueeze.default: LayoutRules.unsqueeze,
    aten.squeeze.dim: LayoutRules.squeeze,
    aten.squeeze.dims: LayoutRules.squeeze,
    aten.transpose.int: LayoutRules.transpose,
    aten.permute.default: LayoutRules.transpose,
    aten.t.default: LayoutRules.transpose,
    aten.slice.Tensor: LayoutRules.slice,
    aten.split.Tensor: LayoutRules.split,
    aten.split_with_sizes.default: LayoutRules.split,
    aten.chunk.default: LayoutRules.split,
    aten.cat.default: LayoutRules.cat,
    aten.scaled_dot_product_attention.default: LayoutRules.attention,
    aten.matmul.default: LayoutRules.bmm,
    aten.bmm.default: LayoutRules.bmm,
    **{t: LayoutRules.softmax for t in _SOFTMAX},
    aten.layer_norm.default: LayoutRules.layer_norm,
    **{t: LayoutRules.reduce for t in _REDUCE},
    aten.cross_entropy_loss.default: LayoutRules.cross_entropy,
    aten.sym_size.int: LayoutRules.size,
    aten.index_copy_.default: LayoutRules.index_copy,
    aten.index_copy.default: LayoutRules.index_copy,
}
_FACTORIES = frozenset({aten.zeros.default, aten.empty.memory_format, aten.full.default, aten.ones.default})


def _clamp(i: int, size: int) -> int:
    i = i + size if i < 0 else i
    return max(0, min(i, size))


def _segments_between(parts: tuple[int, ...], start: int, end: int) -> tuple[int, int] | None:
    """Indices [a, b) of the segments that exactly cover [start, end), or None if unaligned."""
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + p)
    if start not in bounds or end not in bounds or end <= start:
        return None
    return bounds.index(start), bounds.index(end)


def _map_through_view(src: tuple[int, ...], dst: tuple[int, ...], s: Sharding) -> Sharding | None:
    """Where split dim ``s.dim`` of shape ``src`` lands in the view ``dst``, or None if it is strided."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i >= len(src):
                    return None
                gi.append(i)
                pi *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return None
                gj.append(j)
                pj *= dst[j]
        groups.append((gi, gj))
        i, j = i + 1, j + 1
    for gi, gj in groups:
        if s.dim not in gi:
            continue
        if any(src[d] != 1 for d in gi[:gi.index(s.dim)]):
            return None
        inner_in = 1
        for d in gi[gi.index(s.dim) + 1:]:
            inner_in *= src[d]
        o = next((d for d in gj if dst[d] != 1), gj[0])
        inner_out = 1
        for d in gj[gj.index(o) + 1:]:
            inner_out *= dst[d]
        parts = []
        for p in s.parts:
            if (p * inner_in) % inner_out:
                return None
            parts.append(p * inner_in // inner_out)
        return Sharding(s.layout, o, tuple(parts))
    return None


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


