"""split_experts: each routed-experts layer the plan splits (``Plan.experts``) runs its experts where they live.

Before the layer's first grouped matmul, ``expert_dispatch`` sends the rows (and the values with a row per row
the layer reads, ``ExpertLayer.inputs``) to the ranks of ``axis`` holding their experts, and gives back this
rank's rows by local expert with offsets of their own; the grouped matmuls then read this rank's experts
(each parameter's piece is ``experts / size`` of them, ``ParamKind.SPLIT`` on dim 0) with those offsets, and
the ops between them, row-wise, run on those rows; after the last, ``expert_combine`` sends each result back
to the rank its row came from, in its place.

Each expert split over a tensor axis instead (``ExpertPlan.tensor_axis``, ``passes.analysis.experts.tensor_split``):
the rows stay where they are and enter through ``sum_grad`` (their gradient, computed from this rank's part of
every expert, is summed over the axis); the values read with them are cut to this rank's features
(``convert_layout``); the grouped matmuls read this rank's part of each expert's weights; and the last one's
partial sums are completed by ``reduce_partial``. Both (experts over data, each over a tensor axis: Megatron's
expert and expert-tensor parallelism): the tensor split runs on the rows the exchange brought, between it and the
results' way back. Whole experts over data x a tensor axis (``ExpertPlan.lent``, Megatron's expert parallelism
borrowing the tensor ranks): the same exchange over both axes, each tensor rank sending its block of the rows
they all hold (``ExpertSpec.lent``). Every other op of the graph is untouched. Pure.
"""

from __future__ import annotations

import operator

from torch import fx

from autopar.decisions import Layout, Plan
from autopar.errors import PlanError
from passes.analysis.experts import ExpertLayer, TensorSplit, find_expert_layers, tensor_split
from passes.ir import (REPLICATED, ConvertSpec, ExpertSpec, ReduceSpec, Sharding, convert_layout, expert_combine,
                       expert_dispatch, reduce_partial, sum_grad)
from passes.runner import PassResult


def split_experts(gm: fx.GraphModule, plan: Plan) -> PassResult:
    split = {e.module: e for e in plan.experts if e.axis}
    tensor = {e.module: e.tensor_axis for e in plan.experts if e.tensor_axis}
    if not split and not tensor:
        return PassResult(gm, False)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for layer in find_expert_layers(gm):
        decided = split.get(layer.module)
        axis = tensor.get(layer.module, "")
        pieces = _tensor_split(layer, axis, plan.config.size(axis)) if axis else None  # (before any rewrite)
        if decided is None:
            if pieces is not None:
                _split_each_expert(gm, layer, axis, pieces, layer.rows, layer.inputs)
                changed = True
            continue
        if layer.why_whole:
            raise PlanError(f"{layer.module}: the plan splits its experts, but the graph's layer cannot split: "
                            f"{layer.why_whole}")
        first, last = layer.matmuls[0], layer.output
        late = [n.name for n in layer.inputs if order[n] > order[first]]
        if late:
            raise PlanError(f"{layer.module}: {', '.join(late)} (read with the rows) is computed after the first "
                            "grouped matmul; autopar sends them together before it")
        spec = ExpertSpec(decided.axis, decided.experts, layer.module, layer.batched, decided.lent)
        with graph.inserting_before(first):
            dispatch = graph.call_function(expert_dispatch, (layer.rows, layer.offsets, list(layer.inputs), spec))
            moved = [graph.call_function(operator.getitem, (dispatch, i)) for i in range(3 + len(layer.inputs))]
        for node, source in zip(moved, (layer.rows, layer.offsets, *layer.inputs)):
            if source is not None and "val" in source.meta:  # (the sizes are data's: the capture's stand for them)
                node.meta["val"] = source.meta["val"]
        rows, offsets, inputs, routes = moved[0], moved[1], moved[2:-1], moved[-1]
        first.replace_input_with(layer.rows, rows)
        if layer.batched:  # (no offsets: each local expert's block of rows is its own)
            graph.erase_node(offsets)
        for matmul in layer.matmuls if not layer.batched else ():
            matmul.replace_input_with(layer.offsets, offsets)
        for node in layer.region:
            for source, local in zip(layer.inputs, inputs):
                node.replace_input_with(source, local)
        with graph.inserting_after(last):
            combine = graph.call_function(expert_combine, (last, routes, spec))
        if "val" in last.meta:
            combine.meta["val"] = last.meta["val"]
        last.replace_all_uses_with(combine, delete_user_cb=lambda user: user is not combine and user not in layer.region)
        if pieces is not None:  # each expert of this rank split over a tensor axis too, on the rows it received
            _split_each_expert(gm, layer, axis, pieces, rows, tuple(inputs))
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return PassResult(gm, changed)


def _tensor_split(layer: ExpertLayer, axis: str, size: int) -> TensorSplit:
    split = tensor_split(layer, size)
    if split.why_whole:
        raise PlanError(f"{layer.module}: the plan splits each expert over {axis}, but the graph's layer cannot: "
                        f"{split.why_whole}")
    return split


def _split_each_expert(gm: fx.GraphModule, layer: ExpertLayer, axis: str, split: TensorSplit, rows: fx.Node,
                       inputs: tuple[fx.Node, ...]) -> None:
    """``layer``'s grouped matmuls on each rank's piece of every expert over ``axis`` (``split``): ``rows`` and
    ``inputs`` are what its region reads (the layer's own, or those an exchange over data brought)."""
    graph = gm.graph
    first, last = layer.matmuls[0], layer.output
    with graph.inserting_before(first):
        entered = graph.call_function(sum_grad, (rows, axis))
        pieces = [graph.call_function(convert_layout, (value, ConvertSpec(REPLICATED,
                                                                            Sharding(Layout(axis), layer.row_dims, p))))
                  for value, p in zip(inputs, split.inputs)]
    for node, source in zip((entered, *pieces), (rows, *inputs)):
        if "val" in source.meta:  # (the logical value, as every rewritten node keeps)
            node.meta["val"] = source.meta["val"]
    for matmul in layer.matmuls[:-1]:
        matmul.replace_input_with(rows, entered)
    for node in layer.region:
        for source, piece in zip(inputs, pieces):
            node.replace_input_with(source, piece)
    with graph.inserting_after(last):
        reduced = graph.call_function(reduce_partial, (last, ReduceSpec(axis, False)))
    if "val" in last.meta:
        reduced.meta["val"] = last.meta["val"]
    last.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
