"""shard_linears: rewrites matmuls on 2-D parameters into 3D-sharded matmuls and fixes up layouts.

Requires: a captured graph (autopar.capture) whose placeholders carry ``InputInfo``, and a Plan made
for it (or for another capture of the same model).
Ensures: every matmul the plan shards is a ``passes.ir.sharded_matmul`` reading the weight and
bias placeholders directly; every edge whose layouts differ goes through one
``passes.ir.convert_layout`` per (producer, layout); every model output goes through
``passes.ir.gather_output`` when it is sharded or batch-split. ``node.meta["val"]`` keeps the
logical (unsharded) value. At every degree 1 the emitted graph computes the same numbers.

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

import torch.fx as fx

from autopar.config import Layout, Plan
from autopar.errors import PlanError
from passes.analysis.graph_facts import MatmulMatch, find_matmuls, tensor_meta
from passes.analysis.layouts import output_node, propagate_layouts
from passes.analysis.make_plan import local_batch_of
from passes.ir import ConvertSpec, GatherOutputSpec, MatmulSpec, convert_layout, gather_output, sharded_matmul
from passes.runner import PassResult


def shard_linears(gm: fx.GraphModule, plan: Plan) -> PassResult:
    matches = find_matmuls(gm)
    for m in matches:
        if plan.matmul(m.weight) is None:
            raise PlanError(f"the graph has a matmul on '{m.weight}' that the plan does not know. The model "
                            "changed after it was planned; build a new model inside auto_parallelize.")
    by_node = {m.node: m for m in matches}
    res = propagate_layouts(gm, by_node, lambda m, _: plan.matmul(m.weight).orientation, local_batch_of(gm))
    graph = gm.graph
    output = output_node(gm)
    notes: list[str] = []

    converted: dict[tuple[fx.Node, Layout], fx.Node] = {}
    for (consumer, producer), dst in res.conversions.items():
        if consumer is output:
            continue
        key = (producer, dst)
        if key not in converted:
            spec = ConvertSpec(res.layouts[producer], dst, int(tensor_meta(producer).shape[-1]))
            with graph.inserting_after(producer):
                conv = graph.call_function(convert_layout, (producer, spec))
            conv.meta.update(val=producer.meta.get("val"), nn_module_stack=consumer.meta.get("nn_module_stack", {}))
            converted[key] = conv
        consumer.replace_input_with(producer, converted[key])

    replaced: dict[fx.Node, fx.Node] = {}
    for node, orientation in res.orientations.items():
        m = by_node[node]
        x = converted.get((m.x, orientation.in_layout), m.x)
        w = m.weight_node if m.weight_node.op == "placeholder" else m.weight_node.args[0]
        b = _bias_node(node, m)
        spec = MatmulSpec(m.weight, orientation, m.in_features, m.out_features, m.weight_in_out, b is not None)
        with graph.inserting_before(node):
            new = graph.call_function(sharded_matmul, (x, w, b, spec))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced[new] = node
        if m.weight_node is not w and not m.weight_node.users:
            graph.erase_node(m.weight_node)
        notes.append(f"{m.weight}: {orientation.value}")

    gathered: dict[fx.Node, fx.Node] = {}
    for producer in list(output.all_input_nodes):
        val = tensor_meta(producer)
        original = replaced.get(producer, producer)
        layout = res.layouts.get(original, Layout.REPLICATED)
        split = res.batch_split.get(original, False) and gm.meta.get("autopar_batch") is not None
        if val is None or (layout is Layout.REPLICATED and not split):
            continue
        if producer not in gathered:
            spec = GatherOutputSpec(layout, int(val.shape[-1]) if val.dim() else 1, split)
            with graph.inserting_before(output):
                gathered[producer] = graph.call_function(gather_output, (producer, spec))
            gathered[producer].meta["val"] = producer.meta.get("val")
        output.replace_input_with(producer, gathered[producer])

    changed = bool(res.orientations or converted or gathered)
    return PassResult(gm, changed, tuple(notes))


def _bias_node(node: fx.Node, m: MatmulMatch) -> fx.Node | None:
    if m.bias is None:
        return None
    if m.op == "addmm":
        return node.args[0]
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")

