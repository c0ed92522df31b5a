"""split_stages: the plan's pipeline stages become one submodule each, called in order.

Requires: ``plan.pipeline`` lists each stage's segments (choose_stages); segments are named as
  estimate_memory.segment_names names them, and each stage's nodes are consecutive in the graph.
Ensures: stage k's nodes are the GraphModule attribute ``stage_<k>``, called with every value it
  reads from before it (graph inputs, parameters, earlier stages' values) and returning every value
  read after it. The graph computes what it computed before; a pipeline runtime gives ``stage_k``
  to rank k and sends the values between the calls.

Before -> After::

    %h0 = embedding(%w_e, %ids); %h1 = layer0(%h0, ...); %h2 = layer1(%h1, ...); %y = head(%h2)
    # two stages: [<outside>#0, layers.0] and [layers.1, <outside>#1]
    %s0 = stage_0(%w_e, %ids, ...); %h1 = getitem(%s0, 0); %s1 = stage_1(%h1, ...); %y = getitem(%s1, 0)
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.config import Plan
from autopar.errors import PlanError
from passes.analysis.estimate_memory import block_of, segment_names
from passes.analysis.graph_facts import module_of
from passes.outline import outline
from passes.runner import PassResult


def split_stages(gm: fx.GraphModule, plan: Plan) -> PassResult:
    if plan.pipeline is None or len(plan.pipeline.stages) < 2:
        return PassResult(gm, False)
    _sink_prologue(gm)
    stage_of = {seg: k for k, st in enumerate(plan.pipeline.stages) for seg in st.segments}
    runs: list[list[fx.Node]] = [[] for _ in plan.pipeline.stages]
    seg_of = segment_names(gm)
    position = {n: i for i, n in enumerate(seg_of)}
    for node, seg in seg_of.items():
        if seg not in stage_of:
            raise PlanError(f"segment {seg!r} of the graph is in no pipeline stage of the plan. The model "
                            "changed after it was planned; build a new model inside auto_parallelize.")
        runs[stage_of[seg]].append(node)
    for k, nodes in enumerate(runs):
        if not nodes or position[nodes[-1]] - position[nodes[0]] != len(nodes) - 1:
            raise PlanError(f"pipeline stage {k}'s nodes are not consecutive in the graph; this is an autopar "
                            "bug: please report it with the model.")
    for k, nodes in enumerate(runs):
        outline(gm, nodes, f"stage_{k}")
    sizes = ", ".join(str(len(n)) for n in runs)
    return PassResult(gm, True, (f"split into {len(runs)} pipeline stages of {sizes} nodes",))


def _sink_prologue(gm: fx.GraphModule) -> None:
    """Moves each node of a block computed from graph inputs alone (shard_linears' weight conversions,
    which it puts at the top of the graph) to just before its first user in the same block, so the
    block's nodes are consecutive again. Random ops stay where they are: moving them would change
    which numbers they draw."""
    nodes = list(gm.graph.nodes)
    position = {n: float(i) for i, n in enumerate(nodes)}
    prologue: list[fx.Node] = []
    inputs_only: set[fx.Node] = set()
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            inputs_only.add(n)
        elif n.op != "output" and all(a in inputs_only for a in n.all_input_nodes) and not _is_random(n):
            inputs_only.add(n)
            prologue.append(n)
    for n in reversed(prologue):
        block = block_of(module_of(n))
        if not n.users or not block:
            continue
        first = min(n.users, key=position.__getitem__)
        if block_of(module_of(first)) != block:
            continue
        first.prepend(n)
        position[n] = (position[n.prev] + position[first]) / 2  # between its new neighbours


def _is_random(node: fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
