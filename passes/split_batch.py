"""split_batch: makes ops that mix batch rows exact when each rank holds only its rows.

Requires: a captured graph whose batch-split inputs are marked (``InputInfo.batch_split``) and whose
``GraphInfo.batch`` says how the batch was split (nothing to do without it).
Ensures: every reduction over the batch dim that ``passes.analysis.batch_dims`` finds is computed on
this rank's rows and completed by one ``passes.ir.batch_reduce``; every op it finds working along
the batch dim reads its inputs through ``passes.ir.gather_rows`` (and, when its output keeps their
shape, its users read that output through ``passes.ir.scatter_rows``). With one batch shard the
markers compute what the ops computed.

Before -> After (nanoGPT's loss, rows split over data=2)::

    logits = linear(x, W)                       logits = linear(x, W)
    flat = view(logits, [-1, V])                flat = view(logits, [-1, V])
    loss = cross_entropy_loss(flat, t, None,    per = cross_entropy_loss(flat, t, None, 0, -1)  # per token
                              1, -1)     ->     valid = ne(t, -1)
                                                loss = batch_reduce(per, valid, BatchReduceSpec(mean=True))
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from autopar.compat import op_schema, pytree
from autopar.decisions import Plan
from autopar.errors import PlanError
from passes.analysis.batch_dims import analyze_batch
from passes.analysis.batch_facts import BatchDim, BatchFacts, Reduction
from passes.analysis.batch_rules import ATTENTION, CLASS_LOSSES
from passes.analysis.graph_facts import InPlaceWrites, module_of, tensor_meta
from passes.ir import BatchReduceSpec, GatherRowsSpec, batch_reduce, gather_rows, graph_info, scatter_rows
from passes.runner import PassResult

aten = torch.ops.aten


def split_batch(gm: fx.GraphModule, plan: Plan | None = None) -> PassResult:
    batch = graph_info(gm).batch
    if batch is None or (len(batch.local_sizes) <= 1 and len(batch.segments) <= 1):
        return PassResult(gm, False)
    facts = analyze_batch(gm)
    _refuse_attention_across_rows(facts)
    if not facts.reductions and not facts.gathers:
        return PassResult(gm, False, facts.notes())
    _scale_batch_constants(gm, graph_info(gm).batch_constants, batch.global_size)
    for node, reduction in list(facts.reductions.items()):
        _rewrite_reduction(gm.graph, node, reduction)
    gathered: dict[tuple, fx.Node] = {}
    writes = InPlaceWrites(gm.graph)
    for consumer, producers in facts.gathers.items():
        for producer, bd in producers.items():
            late = writes.between(producer, consumer)  # (read what the model's in-place writes left in it)
            key = (producer, bd, consumer) if late else (producer, bd)
            if key not in gathered:
                with gm.graph.inserting_before(consumer) if late else gm.graph.inserting_after(producer):
                    x, first = unflatten_rows(gm.graph, producer, bd)
                    whole = _call(gm.graph, gather_rows, (x, GatherRowsSpec(first.dim, first.static_factor())), x)
                    gathered[key] = flatten_rows(gm.graph, whole, bd)
            consumer.replace_input_with(producer, gathered[key])
    for node, bd in facts.scatters.items():
        _scatter_outputs(gm.graph, node, bd, facts)
    for node in list(facts.reductions):
        gm.graph.erase_node(node)
    return PassResult(gm, True, facts.notes())


def _scale_batch_constants(gm: fx.GraphModule, constants: dict[str, dict[int, Any]], rows: int) -> None:
    """Numbers the capture computed from this rank's row count (``batch_dims.batch_constants``) become the
    whole batch's, as in the serial model (``loss.sum() / x.size(0)``, ``kl_div(reduction="batchmean")``)."""
    if not constants:
        return
    for node in gm.graph.nodes:
        scaled = constants.get(node.name)
        if not scaled:
            continue
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        for i, per_row in scaled.items():
            value = per_row * rows
            leaves[i] = int(value) if isinstance(leaves[i], int) else float(value)
        node.args, node.kwargs = pytree.tree_unflatten(leaves, spec)


def _refuse_attention_across_rows(facts: BatchFacts) -> None:
    """Attention across the rows autopar splits means they are no batch: tokens of packed sequences (dim 0
    is tokens), or sequence-first inputs. Gathering would run every attention on the whole input on every
    rank; say so instead."""
    for consumer in [*facts.gathers, *facts.across_rows]:
        if consumer.target in ATTENTION:
            raise PlanError(
                f"op {consumer.target.__name__} in module '{module_of(consumer) or '<root>'}' attends across the dim "
                "data and depth parallelism split as the batch: the inputs' dim 0 is not a batch (packed sequences "
                "of tokens, or sequence-first tensors). Declare where the batch is with auto_parallelize("
                "batch_dims={input: dim, or None for no batch}), feed each rank its own sequences "
                "(batch='per-rank', as under DDP), or use data=1 and depth=1.")


def _call(graph: fx.Graph, target: Any, args: tuple, like: fx.Node, val: Any = None) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = like.meta.get("val") if val is None else val
    node.meta["nn_module_stack"] = like.meta.get("nn_module_stack", {})
    return node


def _scatter_outputs(graph: fx.Graph, node: fx.Node, bd: BatchDim, facts: BatchFacts) -> None:
    """Users of a gathered op's output read this rank's rows of it (per getitem for tuple outputs)."""
    dims = facts.dims.get(node)
    if isinstance(dims, tuple):
        for user in list(node.users):
            if user.target is operator.getitem and dims[user.args[1]] is not None:
                _scatter_one(graph, user, bd)
        return
    _scatter_one(graph, node, bd)


def _scatter_one(graph: fx.Graph, node: fx.Node, bd: BatchDim) -> None:
    users = list(node.users)
    with graph.inserting_after(node):
        x, first = unflatten_rows(graph, node, bd)
        mine = _call(graph, scatter_rows, (x, GatherRowsSpec(first.dim, first.static_factor())), x)
        scattered = flatten_rows(graph, mine, bd)
    for user in users:
        user.replace_input_with(node, scattered)


def unflatten_rows(graph: fx.Graph, x: fx.Node, bd: BatchDim) -> tuple[fx.Node, BatchDim]:
    """``x`` with its rows first in their dim, and where they lie there: where blocks come before them
    (``bd.outer``, a sequence-first ``(T*B, C)``) the dim is unflattened into (blocks, the rest). Call inside
    ``inserting_after``/``before``."""
    if bd.outer == 1:
        return x, bd
    t = tensor_meta(x)
    shape = [*t.shape[:bd.dim], bd.outer, t.shape[bd.dim] // bd.outer, *t.shape[bd.dim + 1:]]
    node = _call(graph, aten.unflatten.int, (x, bd.dim, [bd.outer, -1]), x, _meta(shape, t.dtype))
    return node, BatchDim(bd.dim + 1, bd.factor)


def flatten_rows(graph: fx.Graph, x: fx.Node, bd: BatchDim) -> fx.Node:
    """Undoes ``unflatten_rows`` (of a tensor laid out as ``bd`` says)."""
    if bd.outer == 1:
        return x
    t = tensor_meta(x)
    shape = [*t.shape[:bd.dim], t.shape[bd.dim] * t.shape[bd.dim + 1], *t.shape[bd.dim + 2:]]
    return _call(graph, aten.flatten.using_ints, (x, bd.dim, bd.dim + 1), x, _meta(shape, t.dtype))



def _rewrite_reduction(graph: fx.Graph, node: fx.Node, r: Reduction) -> None:
    """``node`` -> per-entry values of this rank's rows (dim 0), their batch_reduce, the original shape."""
    val = tensor_meta(node)
    with graph.inserting_before(node):
        if r.kind in ("sum", "mean"):
            values, counts, per_row = _sum_mean_values(graph, node, r)
        elif node.target in CLASS_LOSSES:
            values, counts, per_row = _class_loss_values(graph, node, r)
        else:
            values, counts, per_row = _elementwise_loss_values(graph, node, r)
        spec = BatchReduceSpec(r.kind in ("mean", "loss_mean"), r.batch.static_factor(), per_row)
        out_val = val if val is not None else node.meta["val"][0]
        reduced = _call(graph, batch_reduce, (values, counts, spec), node, torch.empty(
            tuple(tensor_meta(values).shape[1:]), dtype=out_val.dtype, device="meta"))
        result = reduced
        if tuple(tensor_meta(reduced).shape) != tuple(out_val.shape):
            result = _call(graph, aten.reshape.default, (reduced, _sizes(graph, reduced, out_val.shape, node)), node,
                           out_val)
    if val is not None:
        node.replace_all_uses_with(result)
        return
    # nll_loss_forward: (loss, total_weight)
    for user in list(node.users):
        index = user.args[1]
        if index == 0:
            user.replace_all_uses_with(result)
        else:
            with graph.inserting_before(user):
                total = counts if counts is not None else _constant_counts(graph, values, per_row, node)
                weight = _call(graph, batch_reduce, (total, None, BatchReduceSpec(False, r.batch.static_factor())), node,
                               user.meta["val"])
            user.replace_all_uses_with(weight)
        graph.erase_node(user)


def _sizes(graph: fx.Graph, source: fx.Node, shape: Any, like: fx.Node) -> list[Any]:
    """``shape`` as a reshape's argument: its numbers, and for each symbolic size (a graph captured for every
    length) a node reading it off ``source``, which has that size (a SymInt would be printed into the code)."""
    have = list(tensor_meta(source).shape)
    out: list[Any] = []
    for size in shape:
        known = size.node.maybe_as_int() if isinstance(size, torch.SymInt) else size
        if known is not None:
            out.append(int(known))
            continue
        dim = next(d for d, h in enumerate(have) if isinstance(h, torch.SymInt) and h.node.expr == size.node.expr)
        out.append(_call(graph, aten.sym_size.int, (source, dim), like, size))
    return out


def _meta(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _rows_first(graph: fx.Graph, x: fx.Node, bd: BatchDim, like: fx.Node) -> fx.Node:
    """``x`` with its batch dim moved to dim 0."""
    if bd.dim == 0:
        return x
    t = tensor_meta(x)
    perm = [bd.dim] + [d for d in range(t.dim()) if d != bd.dim]
    return _call(graph, aten.permute.default, (x, perm), like, _meta([t.shape[d] for d in perm], t.dtype))


def _sum_over(graph: fx.Graph, x: fx.Node, dims: list[int], like: fx.Node, keepdim: bool) -> fx.Node:
    if not dims:
        return x
    t = tensor_meta(x)
    shape = [1 if d in dims else s for d, s in enumerate(t.shape)] if keepdim else \
        [s for d, s in enumerate(t.shape) if d not in dims]
    return _call(graph, aten.sum.dim_IntList, (x, dims, keepdim), like, _meta(shape, t.dtype))


def _sum_mean_values(graph: fx.Graph, node: fx.Node, r: Reduction) -> tuple[fx.Node, fx.Node | None, int | None]:
    x = node.args[0]
    t = tensor_meta(x)
    dtype = node.kwargs.get("dtype")
    if dtype is not None and dtype != t.dtype:
        x = _call(graph, aten._to_copy.default, (x,), node, _meta(t.shape, dtype))
        x.kwargs = {"dtype": dtype}
    others = [d for d in r.dims if d != r.batch.dim]
    y = _rows_first(graph, _sum_over(graph, x, others, node, keepdim=True), r.batch, node)
    return _per_row(graph, y, node.args[0], others, node, r.kind == "mean")


def _per_entry(graph: fx.Graph, node: fx.Node, per: fx.Node) -> fx.Node:
    """Per-element losses -> one value per entry of dim 0 (summed over the other dims)."""
    t = tensor_meta(per)
    return _sum_over(graph, per, list(range(1, t.dim())), node, keepdim=False)


def _with_reduction_none(graph: fx.Graph, node: fx.Node) -> fx.Node:
    schema = op_schema(node.target)
    args = list(node.args)
    kwargs = dict(node.kwargs)
    index = next(i for i, a in enumerate(schema.arguments) if a.name == "reduction")
    if index < len(args):
        args[index] = 0
    else:
        kwargs["reduction"] = 0
    x, target = tensor_meta(node.args[0]), tensor_meta(node.args[1])
    if node.target in CLASS_LOSSES:
        class_dim = 1 if x.dim() > 1 else None
        shape = [s for d, s in enumerate(x.shape) if d != class_dim] if target.is_floating_point() else target.shape
    else:
        shape = torch.broadcast_shapes(x.shape, target.shape)
    per = graph.call_function(node.target, tuple(args), kwargs)
    per.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    if node.target is aten.nll_loss_forward.default or node.target is aten.nll_loss2d_forward.default:
        per.meta["val"] = (_meta(shape, x.dtype), _meta((), x.dtype))
        first = _call(graph, operator.getitem, (per, 0), node, _meta(shape, x.dtype))
        return first
    per.meta["val"] = _meta(shape, x.dtype)
    return per


def _elementwise_loss_values(graph: fx.Graph, node: fx.Node, r: Reduction) -> tuple[fx.Node, Any, int | None]:
    per = _with_reduction_none(graph, node)
    return _per_row(graph, _per_entry(graph, node, per), per, range(1, tensor_meta(per).dim()), node,
                    r.kind == "loss_mean")


def _per_row(graph: fx.Graph, values: fx.Node, source: fx.Node, dims: Any, like: fx.Node, mean: bool
             ) -> tuple[fx.Node, fx.Node | None, int | None]:
    """(values, counts, count per row) for a mean whose count per entry of ``values`` is the product of
    ``source``'s sizes along ``dims``: a number, or where one of them is a symbolic length, a ``counts`` node
    holding that product for each entry (``int()`` would fix the length the graph was captured for)."""
    sizes = [tensor_meta(source).shape[d] for d in dims]
    if all(not isinstance(s, torch.SymInt) or s.node.maybe_as_int() is not None for s in sizes):
        per_row = 1
        for s in sizes:
            per_row *= int(s)
        return values, None, per_row
    if not mean:  # a sum needs no count
        return values, None, None
    product: Any = 1
    for d, s in zip(dims, sizes):
        size = _call(graph, aten.sym_size.int, (source, d), like, s)
        product = size if product == 1 else _call(graph, operator.mul, (product, size), like,
                                                   product.meta["val"] * s)
    t = tensor_meta(values)
    entries = _call(graph, aten.sym_size.int, (values, 0), like, t.shape[0])
    counts = _call(graph, aten.new_full.default, (values, [entries], product), like, _meta((t.shape[0],), t.dtype))
    return values, counts, None


def _class_loss_values(graph: fx.Graph, node: fx.Node, r: Reduction) -> tuple[fx.Node, fx.Node | None, int | None]:
    """Cross-entropy / NLL: per-entry losses; for the mean, the count the serial mean divides by
    (valid targets, weighted by their class weight when there is one)."""
    per = _with_reduction_none(graph, node)
    values = _per_entry(graph, node, per)
    target = node.args[1]
    tt = tensor_meta(target)
    if r.kind != "loss_mean":
        return values, None, None
    if tt.is_floating_point():  # class probabilities: the mean is over every entry
        return _per_row(graph, values, per, range(1, tensor_meta(per).dim()), node, True)
    ignore = int(_ignore_index(node))
    dtype = tensor_meta(per).dtype
    valid = _call(graph, aten.ne.Scalar, (target, ignore), node, _meta(tt.shape, torch.bool))
    counts = _call(graph, aten._to_copy.default, (valid,), node, _meta(tt.shape, dtype))
    counts.kwargs = {"dtype": dtype}
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    if isinstance(weight, fx.Node):
        safe = _call(graph, aten.clamp_min.default, (target, 0), node, _meta(tt.shape, tt.dtype))
        flat = _call(graph, aten.reshape.default, (safe, [-1]), node, _meta((tt.numel(),), tt.dtype))
        picked = _call(graph, aten.index_select.default, (weight, 0, flat), node, _meta((tt.numel(),), dtype))
        shaped = _call(graph, aten.reshape.default, (picked, _sizes(graph, target, tt.shape, node)), node,
                       _meta(tt.shape, dtype))
        counts = _call(graph, aten.mul.Tensor, (counts, shaped), node, _meta(tt.shape, dtype))
    return values, _per_entry(graph, node, counts), None


def _ignore_index(node: fx.Node) -> int:
    schema = op_schema(node.target)
    for i, a in enumerate(schema.arguments):
        if a.name == "ignore_index":
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get("ignore_index", a.default_value)
    return -100


def _constant_counts(graph: fx.Graph, values: fx.Node, per_row: int | None, node: fx.Node) -> fx.Node:
    t = tensor_meta(values)
    ones = _call(graph, aten.ones_like.default, (values,), node, _meta(t.shape, t.dtype))
    return _call(graph, aten.mul.Tensor, (ones, float(per_row or 1)), node, _meta(t.shape, t.dtype))
