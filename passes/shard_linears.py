"""shard_linears: rewrites matmuls on 2-D parameters into 3D-sharded matmuls and fixes up layouts.

Requires: a captured graph (autopar.capture) whose placeholders carry ``InputInfo``, and a Plan made
for it (or for another capture of the same model).
Ensures: every matmul the plan shards is a ``passes.ir.sharded_matmul`` reading the weight and
bias placeholders directly; every embedding table it shards is read by one
``passes.ir.sharded_embedding``; ops on sharded tensors that carry sizes (views, expands, slices,
splits) take this rank's local sizes; a sum/mean over a split dim is followed by
``passes.ir.reduce_partial``; every edge whose shardings differ goes through one
``passes.ir.convert_layout`` per (producer, sharding); every tensor output goes through one
``passes.ir.gather_output`` (saying how it is laid out and whether it holds the batch); a dropout on a
tensor split over a tensor axis is a ``passes.ir.split_dropout`` (the whole tensor's mask, this rank's
part), and any other random op there a ``passes.ir.split_random`` (the piece's own draws). The outputs
at the positions in ``GraphInfo.kept_outputs`` (state the caller passes back, such as a key/value cache),
when split over one axis in one piece or by batch rows split evenly, are kept split
(``GatherOutputSpec.keep_split``): the next call takes them as they are.
``node.meta["val"]`` keeps the logical (unsharded) value. At every degree 1 the emitted graph computes the same numbers.

Before -> After (FC_Net block, tensor=(2, 2, 1))::

    ln = layer_norm(h, ...)                  h_full = convert_layout(h, ROW -> REPLICATED)
    y = linear(ln, W1, b1)                   ln = layer_norm(h_full, ...)
    y = relu(y)                      ->      ln_r = convert_layout(ln, REPLICATED -> ROW)
    y = linear(y, W2, b2)                    y = sharded_matmul(ln_r, W1, b1, TRANSPOSED)  # -> COL
    h = add(h, y)                            y = relu(y)
                                             y = sharded_matmul(y, W2, b2, NORMAL)         # -> ROW
                                             h = add(h, y)
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx

from autopar.decisions import Plan
from passes.analysis.batch_facts import BatchDim, State
from passes.analysis.graph_facts import InPlaceWrites, MatmulMatch, param_name, tensor_meta
from passes.analysis.layout_rules import LayoutResult, output_node
from passes.analysis.layouts import kept_split
from passes.analysis.make_plan import layouts_for
from passes.ir import (
    REPLICATED,
    ConvertSpec,
    EmbeddingSpec,
    GatherOutputSpec,
    MatmulSpec,
    Sharding,
    convert_layout,
    gather_output,
    reduce_partial,
    sharded_embedding,
    sharded_matmul,
    split_dropout,
    split_random,
    sum_grad,
)
from passes.runner import PassResult
from passes.split_batch import flatten_rows, unflatten_rows


def shard_linears(gm: fx.GraphModule, plan: Plan) -> PassResult:
    res, by_node = layouts_for(gm, plan)
    graph = gm.graph
    output = output_node(gm)
    kept = kept_split(gm, res)  # (before any rewrite: res knows the captured nodes)
    notes: list[str] = []

    for node, (target, args, kwargs) in res.local_args.items():
        node.target, node.args, node.kwargs = target, args, kwargs

    converted: dict[tuple, fx.Node] = {}
    writes = InPlaceWrites(graph)
    for (consumer, producer), dst in res.conversions.items():
        if consumer is output:
            continue
        late = writes.between(producer, consumer)  # (read what the model's in-place writes left in it)
        key = (producer, dst, consumer) if late else (producer, dst)
        if key not in converted:
            spec = ConvertSpec(res.sharding(producer), dst, (producer, dst) in res.partial_gathers)
            with graph.inserting_before(consumer) if late else graph.inserting_after(producer):
                conv = graph.call_function(convert_layout, (producer, spec))
            conv.meta.update(val=producer.meta.get("val"), nn_module_stack=consumer.meta.get("nn_module_stack", {}))
            converted[key] = conv
        consumer.replace_input_with(producer, converted[key])

    summed: dict[tuple[fx.Node, str], fx.Node] = {}
    for (consumer, producer), axis in res.grad_sums.items():
        source = next((a for a in consumer.all_input_nodes if a is producer or a.args[:1] == (producer,)
                       and a.target is convert_layout), producer)
        key = (source, axis)
        if key not in summed:
            with graph.inserting_after(source):
                summed[key] = graph.call_function(sum_grad, (source, axis))
            summed[key].meta.update(val=source.meta.get("val"))
        consumer.replace_input_with(source, summed[key])

    for node, spec in res.reductions.items():
        with graph.inserting_after(node):
            red = graph.call_function(reduce_partial, (node, spec))
        red.meta.update(val=node.meta.get("val"), nn_module_stack=node.meta.get("nn_module_stack", {}))
        node.replace_all_uses_with(red, delete_user_cb=lambda user, red=red: user is not red)

    replaced: dict[fx.Node, fx.Node] = {}
    for node, orientation in res.orientations.items():
        m = by_node[node]
        mp = plan.matmul(m.weight)
        x = node.args[1] if m.op == "addmm" else node.args[0]
        w = m.weight_node if m.weight_node.op == "placeholder" else m.weight_node.args[0]
        b = _bias_node(node, m)
        spec = MatmulSpec(m.weight, orientation, m.in_features, m.out_features, m.weight_in_out, b is not None,
                          mp.out_parts, res.seq_scatter.get(node, -1), node in res.partial_dx)
        replaced[_swap(node, sharded_matmul, (x, w, b, spec))] = node
        if m.weight_node is not w and not m.weight_node.users:
            graph.erase_node(m.weight_node)
        notes.append(f"{m.weight}: {orientation.value}")

    for node, (mode, axis) in res.embeddings.items():
        table, ids = node.args[0], node.args[1]
        padding_idx = node.args[2] if len(node.args) > 2 else -1
        spec = EmbeddingSpec(plan.embedding(param_name(table)).weight, mode, axis, int(tensor_meta(table).shape[0]),
                             res.seq_scatter.get(node, -1))
        replaced[_swap(node, sharded_embedding, (table, ids, padding_idx, spec))] = node
        notes.append(f"{spec.weight}: {mode.value}-parallel over {axis}")

    for node in [n for n in graph.nodes if _random(n)]:
        sharding = res.sharding(node)
        if sharding.is_replicated:
            continue
        if node.target is torch.ops.aten.dropout.default:
            _swap(node, split_dropout, (*node.args, sharding))
        else:
            _swap(node, split_random, (node.target, node.args, node.kwargs, sharding))

    gathered: dict[fx.Node, fx.Node] = {}
    for producer in list(output.all_input_nodes):
        if tensor_meta(producer) is None:
            continue
        original = replaced.get(producer, producer)
        if producer.target is reduce_partial:
            sharding, original = REPLICATED, replaced.get(producer.args[0], producer.args[0])
        else:
            sharding = res.sharding(original)
        if producer not in gathered:
            with graph.inserting_before(output):
                keep = original in kept and (not sharding.is_replicated or res.batch is not None)
                rows = _output_rows(res, original)
                x, first = unflatten_rows(graph, producer, rows) if rows is not None else (producer, None)
                if first is not rows and not sharding.is_replicated and sharding.dim > rows.dim:
                    sharding = replace(sharding, dim=sharding.dim + 1)  # (after the unflattened dim)
                spec = _output_spec(res, original, sharding, keep, first)
                full = graph.call_function(gather_output, (x, spec))
                full.meta["val"] = x.meta.get("val")
                gathered[producer] = flatten_rows(graph, full, rows) if rows is not None else full
        output.replace_input_with(producer, gathered[producer])

    changed = bool(res.orientations or converted or gathered or res.embeddings or res.local_args)
    return PassResult(gm, changed, tuple(notes))


def _output_rows(res: LayoutResult, node: fx.Node) -> BatchDim | None:
    """Where a model output holds this rank's rows: where the batch analysis followed them, or for a value
    computed past where it could not (LOCAL), its one dim that holds rows, taken to hold them outermost."""
    if res.batch is None:
        return None
    bd = res.batch.batch_dim(node)
    if bd is None and res.batch.state(node) is State.LOCAL:
        bd = res.batch.local_rows.get(node)
    return bd


def _output_spec(res: LayoutResult, node: fx.Node, sharding: Sharding, keep: bool = False,
                 rows: BatchDim | None = None) -> GatherOutputSpec:
    """How a model output is laid out on this rank: its feature sharding, and where it holds the batch
    (``rows``: ``_output_rows``, with the rows first in their dim)."""
    if res.batch is None:
        return GatherOutputSpec(sharding, False, batch_state="none", keep_split=keep)
    if rows is not None:
        return GatherOutputSpec(sharding, True, rows.dim, rows.static_factor(), "split", keep_split=keep)
    state = res.batch.state(node)
    if state is State.LOCAL:
        val = tensor_meta(node)
        averaged = val is not None and (val.is_floating_point() or val.is_complex()) and node not in res.batch.local_rows
        return GatherOutputSpec(sharding, False, batch_state="local" if averaged else "per-rank")
    return GatherOutputSpec(sharding, False, batch_state=state.value)


def _random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a seeded op, but not a dropout of probability 0 or outside training."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    if node.target is torch.ops.aten.dropout.default:
        return node.args[1] != 0 and node.args[2] is not False
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return p != 0
    return True


def _swap(node: fx.Node, target: object, args: tuple) -> fx.Node:
    """Replaces ``node`` by a call of ``target`` that keeps its metadata; returns the new node."""
    with node.graph.inserting_before(node):
        new = node.graph.call_function(target, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)
    return new


def _bias_node(node: fx.Node, m: MatmulMatch) -> fx.Node | None:
    if m.bias is None:
        return None
    if m.op == "addmm":
        return node.args[0]
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
