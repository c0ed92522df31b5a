"""Where the batch lies in every tensor of a captured graph, and which ops mix its rows.

Data and depth parallelism split the batch: each rank runs the captured graph on its own rows (the
graph was captured with this rank's row count, ``GraphInfo.batch``). That is exact for ops
that treat rows independently. This analysis follows the batch dim through every op (views merge it
with other dims or split it off, transposes move it) and finds the ops that do not:

- a sum or mean over the batch dim, and a loss with ``reduction="mean"`` or ``"sum"`` (cross-entropy,
  NLL, MSE, L1, BCE, ...): computed on this rank's rows as a partial sum (and a count) that one
  all-reduce over the batch completes (``reductions``; ``passes.split_batch`` rewrites them);
- any other op along the batch dim (a softmax or slice over rows, an op it does not know working
  along that dim): its inputs' rows are gathered first (``gathers``) and it runs on the whole batch;
  when its output keeps the input's shape (a softmax over rows, batch statistics) each rank takes
  its rows back (``scatters``).

Each value is SPLIT (this rank's rows; ``BatchDim`` says where they lie), WHOLE (computed from the
whole batch: the same on every rank holding a batch shard) or NONE (made without the batch:
parameters, constants, inputs that are not split). The runtime's gradient convention: a SPLIT
value's gradient is its rows' gradient; a WHOLE or NONE value's gradient is a part, and the parts
on the batch ranks sum to it (as parameters' gradients are summed over the batch). So values read
on both sides need no marker; only the ops between the two sides do (``passes.ir``: ``gather_rows``,
``scatter_rows``, ``batch_reduce``, and the outputs' ``gather_output``).

Pure: a function of the graph and its recorded batch split.

The per-op rules are in ``passes.analysis.batch_rules``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from autopar.compat import pytree
from autopar.errors import PlanError
from passes.analysis.batch_facts import BatchDim, BatchFacts, State, describe
from passes.analysis.batch_rules import ATTENTION, VIEWS, Gather, Reduce, Rules, known, map_batch_through_view, same_shape
from passes.analysis.graph_facts import carries_grad, tensor_inputs, tensor_meta
from passes.analysis.local_rows import LocalRows
from passes.analysis.opaque_calls import is_opaque, tensor_args, traced_call
from passes.analysis.row_extents import RowExtents
from passes.ir import (BatchInfo, InputInfo, InputKind, batch_reduce, gather_rows, graph_info, input_info,
                       record_graph_info, scatter_rows, sum_grad, vocab_cross_entropy)

aten = torch.ops.aten


_MARKERS = (batch_reduce, gather_rows, scatter_rows, sum_grad, vocab_cross_entropy)
_COUNTS = "its result counts or addresses rows that the ops after it take as this rank's"


# ---- the walk ---------------------------------------------------------------------------------------


def analyze_batch(gm: fx.GraphModule) -> BatchFacts:
    """Follows the batch through ``gm`` (see the module docstring).

    A count or position of the whole batch (a reduction's or a gathered op's integer result, or what is
    computed from one) that reaches an op running on this rank's rows in a layout autopar does not follow
    (LOCAL: ``split(x, counts.tolist())``) would address rows this rank does not hold: the reductions and
    gathers it comes from run on this rank's rows instead, and the walk is repeated until none does."""
    per_rank: frozenset[fx.Node] = frozenset()
    while True:
        facts = _walk(gm, per_rank)
        more = _whole_counts_read_locally(facts) - per_rank
        if not more:
            return facts
        per_rank |= more


def _whole_counts_read_locally(facts: BatchFacts) -> set[fx.Node]:
    """The reductions and gathered ops behind the integer WHOLE values that LOCAL ops read."""
    out: set[fx.Node] = set()
    for node, state in facts.states.items():
        if state is not State.LOCAL or node.target is operator.getitem:
            continue
        todo = [i for i in tensor_inputs(node) if facts.state(i) is State.WHOLE and _integral(i)]
        seen: set[fx.Node] = set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in facts.reductions or n in facts.gathers:
                out.add(n)
                continue
            todo.extend(i for i in tensor_inputs(n) if facts.state(i) is State.WHOLE)
    return out


def _integral(node: fx.Node) -> bool:
    """Whether ``node``'s value is integer-valued: a count, a size or a position (not a statistic)."""
    vals = node.meta.get("val")
    for v in (vals if isinstance(vals, (list, tuple)) else (vals,)):
        if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()):
            return True
        if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
            return True
    return False


def _walk(gm: fx.GraphModule, per_rank: frozenset[fx.Node]) -> BatchFacts:
    """One walk of ``analyze_batch``: the reductions and gathers in ``per_rank`` run on this rank's rows."""
    facts = BatchFacts()
    batch = graph_info(gm).batch
    has_rows = batch is not None and batch.local_sizes[batch.index] > 0
    rows = local_rows(gm) if has_rows else 0
    extents = RowExtents(gm)
    rules = Rules(facts, rows)
    local = LocalRows(rules, extents)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            info = input_info(node)
            split = bool(has_rows and info is not None and info.batch_split)
            facts.dims[node] = BatchDim(info.batch_dim, 1) if split else None
            facts.states[node] = State.SPLIT if split else State.NONE
            facts.requires_grad[node] = bool(info and info.requires_grad)
            continue
        if node.op == "output":
            continue
        ins = tensor_inputs(node)
        facts.requires_grad[node] = carries_grad(node, facts.requires_grad)
        split_ins = [i for i in ins if facts.state(i) is State.SPLIT]
        local_ins = [i for i in ins if facts.state(i) is State.LOCAL]
        if not split_ins and not local_ins and has_rows:
            _track_row_index(facts, node, rows)
        if node.target in _MARKERS:
            rules.marker(node)
        elif node.target is aten.sym_size.int and (split_ins or local_ins):
            # a symbolic length (the same on every rank), or this rank's row count: a number as the capture of
            # one batch size has it (``whole_constants`` finds it where the serial model has the whole batch's)
            facts.dims[node] = None
            facts.states[node] = State.NONE
            continue
        elif local_ins and node.op == "call_function" and node.target is not operator.getitem:
            _decide_local(facts, local, node, node in per_rank)
        elif not split_ins or node.op != "call_function":
            facts.dims[node] = None if node.target is not operator.getitem else rules.getitem(node)
            if node.op != "call_function" and split_ins:  # a subgraph (higher-order op) or module call
                facts.gathers[node] = {i: facts.batch_dim(i) for i in split_ins}
                facts.dims[node] = None
        else:
            try:
                facts.dims[node] = _opaque_rows(gm, node, facts, rows) if is_opaque(node) else rules.decide(node)
            except Reduce as r:
                if node in per_rank:
                    facts.local_starts[node] = _COUNTS
                    facts.dims[node] = None
                    facts.states[node] = State.LOCAL
                else:
                    facts.reductions[node] = r.reduction
                    facts.dims[node] = None
            except Gather:
                why = _COUNTS if node in per_rank else local.unsplittable(node, split_ins[0])
                if node.target in ATTENTION:
                    facts.across_rows.append(node)
                if why is None:
                    facts.gathers[node] = {i: facts.batch_dim(i) for i in split_ins}
                    facts.dims[node] = _scattered(facts, node, split_ins[0])
                else:
                    facts.local_starts[node] = why
                    facts.dims[node] = None
                    facts.states[node] = State.LOCAL
        if node not in facts.states:
            facts.states[node] = _state_of(facts, node, ins)
        if facts.states[node] is State.LOCAL and local.row_dims(node) != ():
            facts.local_rows[node] = local.as_rows(node)
    return facts


def _opaque_rows(gm: fx.GraphModule, node: fx.Node, facts: BatchFacts, rows: Any) -> Any:
    """Where the rows lie in the outputs of an opaque call (a custom autograd Function, a ``no_grad`` block),
    read off the ops it runs (``opaque_calls.traced_call``): analysed with its split inputs as this rank's rows,
    it keeps them row by row when it gathers, reduces and mixes none of them. Raises Gather otherwise."""
    sub = traced_call(gm, node)
    args = tensor_args(node)
    split = {i: facts.batch_dim(a) for i, a in enumerate(args) if facts.batch_dim(a) is not None}
    if sub is None or not split or len({(b.factor, b.outer) for b in split.values()}) != 1:
        raise Gather()
    factor = next(iter(split.values())).factor
    if next(iter(split.values())).outer != 1 or not isinstance(factor, int) or isinstance(rows, torch.SymInt):
        raise Gather()
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise Gather()
    for i, p in enumerate(placeholders):  # (the trace is the node's own: marked anew at each analysis)
        p.meta["autopar"] = InputInfo(InputKind.USER, str(i), False, i in split, split[i].dim if i in split else 0)
    entries = int(rows) * factor
    record_graph_info(sub, batch=BatchInfo(2 * entries, (entries, entries), 0))
    inner = analyze_batch(sub)
    if inner.reductions or inner.gathers or inner.local_starts or inner.across_rows:
        raise Gather()
    outs = pytree.tree_leaves(sub.graph.output_node().args)
    dims = [inner.batch_dim(o) if isinstance(o, fx.Node) else None for o in outs]
    scaled = [BatchDim(d.dim, d.factor * factor) if d is not None else None for d in dims]
    vals = node.meta.get("val")
    several = isinstance(vals, (list, tuple))
    if len(scaled) != (len(vals) if several else 1) or (not several and scaled[0] is None):
        raise Gather()
    return tuple(scaled) if several else scaled[0]


def _decide_local(facts: BatchFacts, local: LocalRows, node: fx.Node, per_rank: bool) -> None:
    """An op reading a LOCAL value: a sum, mean or loss over every dim that holds its rows completes over the
    batch like any other (the order of the rows does not matter to it), unless ``per_rank`` says its result
    must stay this rank's; an elementwise op that meets this rank's rows laid out as its LOCAL inputs are gives
    SPLIT rows again; anything else stays LOCAL."""
    if node.target in ATTENTION and local.attends_across(node):
        facts.across_rows.append(node)
    try:
        dims = local.rejoin(node)
    except Reduce as r:
        if per_rank:
            facts.dims[node] = None
            facts.states[node] = State.LOCAL
            return
        facts.reductions[node] = r.reduction
        facts.dims[node] = None
        facts.states[node] = State.WHOLE
        return
    except Gather:
        dims = None
    facts.dims[node] = dims
    if dims is None:
        facts.states[node] = State.LOCAL


def local_rows(gm: fx.GraphModule) -> Any:
    """This rank's row count in ``gm``: a SymInt where the graph was captured for every batch size (the
    batch dim of its split inputs symbolic), else the recorded number."""
    batch = graph_info(gm).batch
    for node in gm.graph.nodes:
        info = input_info(node) if node.op == "placeholder" else None
        if info is not None and info.batch_split:
            size = tensor_meta(node).shape[info.batch_dim]
            if isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None:
                return size
    return batch.local_sizes[batch.index]


_ARANGES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
_INDEX_KEEPING = frozenset({aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout,
                            aten.clone.default, aten.lift_fresh_copy.default, aten.alias.default, aten.detach.default})


def _track_row_index(facts: BatchFacts, node: fx.Node, rows: int) -> None:
    t = node.target
    if t in _ARANGES:
        args = list(node.args)
        start, end, step = (0, args[0], 1) if t is aten.arange.default else (
            args[0], args[1], args[2] if len(args) > 2 else 1)
        end = end.meta.get("val") if isinstance(end, fx.Node) else end
        if start == 0 and step == 1 and known(end == rows):
            facts.row_index[node] = 0
        return
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if src is None or src not in facts.row_index:
        return
    d = facts.row_index[src]
    st, val = tensor_meta(src), tensor_meta(node)
    if st is None or val is None:
        return
    if t in _INDEX_KEEPING:
        facts.row_index[node] = d
    elif t in VIEWS or t is aten.expand.default:
        if t is aten.expand.default:
            mapped = BatchDim(d + val.dim() - st.dim(), 1) if known(val.shape[d + val.dim() - st.dim()] == rows) \
                else None
        else:
            mapped = map_batch_through_view(tuple(st.shape), tuple(val.shape), BatchDim(d, 1), rows)
        if mapped is not None and mapped.factor == 1 and mapped.outer == 1:
            facts.row_index[node] = mapped.dim


def _scattered(facts: BatchFacts, node: fx.Node, first: fx.Node) -> Any:
    """A gathered op's output that keeps its input's shape gives each rank its rows back."""
    bd, t = facts.batch_dim(first), tensor_meta(first)
    vals = node.meta.get("val")
    if bd is None or t is None:
        return None
    if isinstance(vals, torch.Tensor):
        if not same_shape(vals, t):
            return None
        facts.scatters[node] = bd
        return bd
    if isinstance(vals, (list, tuple)):
        outs = tuple(bd if isinstance(v, torch.Tensor) and same_shape(v, t) else None for v in vals)
        if any(o is not None for o in outs):
            facts.scatters[node] = bd
            return outs
    return None


def _state_of(facts: BatchFacts, node: fx.Node, ins: list[fx.Node]) -> State:
    d = facts.dims.get(node)
    if isinstance(d, BatchDim) or (isinstance(d, tuple) and any(isinstance(x, BatchDim) for x in d)):
        return State.SPLIT
    if node in facts.reductions or node in facts.gathers or node.target in (batch_reduce, gather_rows):
        return State.WHOLE
    if any(facts.state(i) is State.LOCAL for i in ins):
        return State.LOCAL
    if any(facts.state(i) is not State.NONE for i in ins):
        return State.WHOLE
    return State.NONE


# ---- constants that scale with the batch ------------------------------------------------------------


def whole_constants(gm: fx.GraphModule, facts: BatchFacts) -> bool:
    """Whether any op computed from the whole batch takes a number (``loss / x.size(0)`` does): such a
    number may be this rank's row count, captured where the serial model had the whole batch's. In a graph
    captured for every batch size the row count is a symbol, and such an op takes a value made from it."""
    rows = local_rows(gm) if graph_info(gm).batch is not None else None
    symbol = rows.node.expr if isinstance(rows, torch.SymInt) else None
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in facts.reductions or facts.state(node) is not State.WHOLE:
            continue
        leaves = [v for v in pytree.tree_leaves((node.args, node.kwargs))]
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in leaves):
            return True
        if symbol is not None and any(_counts_rows(v, symbol) for v in leaves):
            return True
    return False


def _counts_rows(value: Any, symbol: Any) -> bool:
    """Whether ``value`` (an op's argument) is a number computed from the row count ``symbol``."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, (torch.SymInt, torch.SymFloat)) and symbol in val.node.expr.free_symbols


class BatchConstantError(PlanError):
    """A number in the whole-batch part of the graph depends on the rows in a way that is not a multiple."""


def batch_constants(gm: fx.GraphModule, other: fx.GraphModule, facts: BatchFacts, rows: int, other_rows: int
                    ) -> dict[str, dict[int, Any]]:
    """The numbers in ops on the whole batch that scale with the row count: node name -> {index of the
    number among the flattened (args, kwargs): its value per row (a Fraction)}.

    ``other`` is the same model captured with ``other_rows`` rows instead of ``rows``; a number that
    differs between the two graphs was computed from the batch size (``x.size(0)``), which is this
    rank's rows in the capture but the whole batch's in the serial model. Raises
    ``BatchConstantError`` when the two graphs differ otherwise.
    """
    from fractions import Fraction

    mine = [n for n in gm.graph.nodes]
    theirs = [n for n in other.graph.nodes]
    if len(mine) != len(theirs) or any(a.op != b.op or a.target != b.target for a, b in zip(mine, theirs)):
        raise BatchConstantError(f"the captured graph changes with the batch size ({rows} and {other_rows} rows)")
    out: dict[str, dict[int, Any]] = {}
    for a, b in zip(mine, theirs):
        if a.op != "call_function" or facts.state(a) is not State.WHOLE or a in facts.reductions:
            continue
        la = pytree.tree_leaves((a.args, a.kwargs))
        lb = pytree.tree_leaves((b.args, b.kwargs))
        for i, (x, y) in enumerate(zip(la, lb)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or x == y:
                continue
            if y * rows != x * other_rows:
                raise BatchConstantError(
                    f"{describe(a)} takes {x} with {rows} rows and {y} with {other_rows}: a number computed from the "
                    "batch size that is not a multiple of it")
            out.setdefault(a.name, {})[i] = Fraction(x) / rows
    return out
