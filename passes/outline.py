"""outline: move consecutive nodes of a graph into a GraphModule attribute and call it instead.

Shared by insert_checkpoints (the call goes through torch.utils.checkpoint) and split_stages (a
plain call per pipeline stage). The submodule takes every value its nodes read from outside, in
first-use order, and returns every value read after it, as a tuple.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from torch import fx


def _extract(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph), inputs, outputs


def outline(gm: fx.GraphModule, nodes: Sequence[fx.Node], attr: str,
            call: Callable[[fx.Graph, fx.Node, list[fx.Node]], fx.Node] | None = None) -> fx.Node:
    """Replaces ``nodes`` (consecutive, in graph order) by a call of the new submodule ``gm.<attr>``.

    Args:
        call: builds the call node from (graph, the submodule's get_attr node, inputs); default a
            ``call_module``.

    Returns:
        The call node; its users are one ``getitem`` per value read after the nodes.
    """
    sub, inputs, outputs = _extract(gm, nodes)
    gm.add_submodule(attr, sub)
    with gm.graph.inserting_after(nodes[-1]):
        if call is None:
            node = gm.graph.call_module(attr, tuple(inputs))
        else:
            fn = gm.graph.get_attr(attr)
            with gm.graph.inserting_after(fn):
                node = call(gm.graph, fn, inputs)
    anchor, inside = node, set(nodes)
    for j, out in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            got = gm.graph.call_function(operator.getitem, (node, j))
        got.meta = dict(out.meta)
        out.replace_all_uses_with(got, delete_user_cb=lambda user: user not in inside)
        anchor = got
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return node
