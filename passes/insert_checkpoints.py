"""insert_checkpoints: the plan's recomputed segments become checkpointed submodules.

Requires: ``plan.memory.recompute`` names segments of ``gm`` (estimate_memory.segment_names); each
  segment's nodes are consecutive in the graph.
Ensures: each such segment is a GraphModule attribute ``checkpoint_<i>`` called through
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its activations are dropped after
  forward and recomputed in backward. The markers inside it are bound like any others, so the
  collectives of a recomputed segment are issued again, in the same order, on every rank of their
  groups (every rank has the same plan). RNG state is restored for the recomputation, so dropout
  draws the same masks.

Before -> After::

    %a = linear(%x, %w1); %b = relu(%a); %c = linear(%b, %w2); %y = add(%c, %x)
    # model.layers.1 recomputed:
    %ck = checkpoint(self.checkpoint_0, %x, %w1, %w2, use_reentrant=False); %y = getitem(%ck, 0)
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autopar.config import Plan
from passes.analysis.estimate_memory import segment_names
from passes.runner import PassResult


def _segment_module(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """A GraphModule computing ``nodes``; its inputs (nodes read from outside) and outputs (read outside)."""
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


def insert_checkpoints(gm: fx.GraphModule, plan: Plan) -> PassResult:
    chosen = set(plan.memory.recompute) if plan.memory is not None else set()
    if not chosen:
        return PassResult(gm, False)
    runs: dict[str, list[fx.Node]] = {}
    for node, name in segment_names(gm).items():
        if name in chosen:
            runs.setdefault(name, []).append(node)
    for i, (name, nodes) in enumerate(runs.items()):
        sub, inputs, outputs = _segment_module(gm, nodes)
        attr = f"checkpoint_{i}"
        gm.add_submodule(attr, sub)
        last = nodes[-1]
        with gm.graph.inserting_after(last):
            fn = gm.graph.get_attr(attr)
        with gm.graph.inserting_after(fn):
            call = gm.graph.call_function(torch.utils.checkpoint.checkpoint, (fn, *inputs),
                                          {"use_reentrant": False})
        anchor = call
        for j, out in enumerate(outputs):
            with gm.graph.inserting_after(anchor):
                got = gm.graph.call_function(operator.getitem, (call, j))
            got.meta = dict(out.meta)
            out.replace_all_uses_with(got, delete_user_cb=lambda user: user not in set(nodes))
            anchor = got
        for n in reversed(nodes):
            gm.graph.erase_node(n)
    notes = (f"recomputed in backward: {', '.join(runs)}",)
    return PassResult(gm, True, notes)
