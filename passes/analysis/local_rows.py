"""The batch analysis where it cannot follow the rows: which ops are gathered and which run on each rank's
rows (LOCAL), and where a LOCAL value meets the rows again. The per-op rules are ``batch_rules``; the walk
is ``batch_dims``; what holds rows in a LOCAL value is ``row_extents``'s."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from autopar.compat import op_schema
from passes.analysis.batch_facts import BatchDim, State
from passes.analysis.batch_rules import (ATTENTION, CLASS_LOSSES, ELEMENTWISE_LOSSES, SUM_MEAN, Gather, Rules,
                                         exact, is_pointwise, known, same, same_shape)
from passes.analysis.graph_facts import tensor_inputs, tensor_meta
from passes.analysis.row_extents import RowExtents


class LocalRows:
    """The rules for ops whose rows the per-op rules (``rules``) cannot follow, with ``extents`` (which dims of
    each value hold rows, where known)."""

    def __init__(self, rules: Rules, extents: RowExtents | None) -> None:
        self.rules, self.extents = rules, extents
        self.facts, self.rows = rules.facts, rules.rows

    def unsplittable(self, node: fx.Node, first: fx.Node) -> str | None:
        """Why ``node``, an op that works along the batch dim, cannot run on the whole batch's rows and hand
        each rank its own back, or None when it can. It can when nothing it reads was made for this rank's
        rows alone (a tensor sized by them that is not its rows: ``arange(n_tokens)``), and each output it
        hands on holds no rows (a statistic of the batch) or floats laid out as its input (cut back to this
        rank's rows after). Its other outputs would hold the whole batch's rows, or positions in it, where
        the graph around them holds this rank's: those ops run on each rank's own rows instead (LOCAL)."""
        if node.target in ATTENTION:
            return None  # (split_batch refuses attention across the split rows: they are no batch)
        schema = op_schema(node.target)
        if schema is not None and schema.is_mutable:
            return "it writes in place into this rank's rows, which a gathered copy would not"
        for i in tensor_inputs(node):
            if self.facts.state(i) is not State.SPLIT and self.row_dims(i) not in ((), None):
                return "it reads a tensor made for this rank's rows"
        t = tensor_meta(first)
        vals = node.meta.get("val")
        outs = vals if isinstance(vals, (list, tuple)) else (vals,)
        used = range(len(outs))
        if isinstance(vals, (list, tuple)):
            used = sorted({u.args[1] for u in node.users if u.target is operator.getitem})
        for k in used:
            v = outs[k]
            if not isinstance(v, torch.Tensor):
                continue
            rows = self.row_dims(node, k if isinstance(vals, (list, tuple)) else None)
            if rows == ():
                continue
            if not same_shape(v, t):
                return "its result holds the batch's rows in a layout autopar does not follow"
            if not (v.is_floating_point() or v.is_complex()):
                return "its result holds positions in the batch, or integer values of the rows"
        return None

    def row_dims(self, node: Any, index: int | None = None) -> tuple[int, ...] | None:
        return self.extents.of(node, index) if self.extents is not None else None

    def as_rows(self, node: fx.Node) -> BatchDim | None:
        """A LOCAL value's rows as a BatchDim, for an op that does not mind their order (a sum over them):
        its one dim that holds rows, (this rank's rows) x factor in size."""
        rows, t = self.row_dims(node), tensor_meta(node)
        if not rows or len(rows) != 1 or t is None:
            return None
        size = t.shape[rows[0]]
        if not known(size % self.rows == 0):
            return None
        return BatchDim(rows[0], exact(size // self.rows))

    def attends_across(self, node: fx.Node) -> bool:
        """Whether an attention op reads rows (split, or LOCAL ones where it is known where they lie) along the
        dims it attends over: the last two of its query, key, value and mask."""
        for i in tensor_inputs(node):
            t, bd = tensor_meta(i), self.rules.bd(i)
            dims = (bd.dim,) if bd is not None else self.row_dims(i) if self.facts.state(i) is State.LOCAL else ()
            if t is not None and any(d >= t.dim() - 2 for d in dims or ()):
                return True
        return False

    def rejoin(self, node: fx.Node) -> Any:
        """An op reading a LOCAL value (see ``batch_dims._decide_local``): raises Reduce for a sum, mean or loss
        over every dim holding its rows; returns the SPLIT rows of an elementwise op that meets this rank's
        rows laid out as its LOCAL inputs are; raises Gather otherwise (the op stays LOCAL)."""
        t = node.target
        local = [i for i in tensor_inputs(node) if self.facts.state(i) is State.LOCAL]
        if t in SUM_MEAN or t in ELEMENTWISE_LOSSES or t in CLASS_LOSSES:
            saved = {i: self.facts.dims.get(i) for i in local}
            try:
                for i in local:
                    self.facts.dims[i] = self.as_rows(i)
                if any(self.facts.dims[i] is None for i in local):
                    raise Gather()
                self.rules.decide(node)  # a sum over other dims keeps the rows where autopar does not follow them
                raise Gather()
            finally:
                self.facts.dims.update(saved)
        if not is_pointwise(node) or isinstance(node.meta.get("val"), (list, tuple)):
            raise Gather()
        target = self.rules.aligned(node, node.meta.get("val"))  # from the SPLIT inputs (LOCAL ones have no BatchDim)
        val = tensor_meta(node)
        for i in local:
            it = tensor_meta(i)
            d = target.dim + it.dim() - val.dim()
            if d < 0 or self.row_dims(i) != (d,) or not same(it.shape[d], val.shape[target.dim]):
                raise Gather()
        return target
