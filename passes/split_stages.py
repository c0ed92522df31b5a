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

import itertools

import torch
from torch import fx

from autopar.decisions import Plan
from autopar.errors import PlanError
from passes.analysis.estimate_memory import block_of, segment_names
from passes.analysis.graph_facts import module_of
from passes.ir import context_dropout, split_dropout, split_random
from passes.outline import outline
from passes.runner import PassResult


def split_stages(gm: fx.GraphModule, plan: Plan) -> PassResult:
    if plan.pipeline is None or len(plan.pipeline.stages) < 2:
        return PassResult(gm, False)
    _sink_prologue(gm)
    seg_of = segment_names(gm)
    position = {n: i for i, n in enumerate(seg_of)}
    runs: list[list[fx.Node]] = [[] for _ in plan.pipeline.stages]
    for nodes, stage in _staged_runs(list(seg_of.items()), plan):
        runs[stage].extend(nodes)
    for k, nodes in enumerate(runs):
        if not nodes or position[nodes[-1]] - position[nodes[0]] != len(nodes) - 1:
            raise PlanError(f"pipeline stage {k}'s nodes are not consecutive in the graph; this is an autopar "
                            "bug: please report it with the model.")
    for k, nodes in enumerate(runs):
        outline(gm, nodes, f"stage_{k}")
    sizes = ", ".join(str(len(n)) for n in runs)
    return PassResult(gm, True, (f"split into {len(runs)} pipeline stages of {sizes} nodes",))


def _staged_runs(seg_of: list[tuple[fx.Node, str]], plan: Plan) -> list[tuple[list[fx.Node], int]]:
    """The graph's runs of nodes of one segment, each with its stage. A block's run goes to the block's
    stage. Runs outside the blocks are numbered by their order in each graph, and a graph of another input
    signature may have runs the planned capture did not (a decode step's cache reads inside a layer, sizes
    read between blocks under symbolic sizes), which shifts the numbers. So an outside run is matched by
    position: one between two runs of the same block stays with that block; else it takes the stage of the
    plan's next segment when that is an outside one (the plan's run at this place), and otherwise joins the
    stage before it."""
    stages = plan.pipeline.stages
    stage_of = {seg: k for k, st in enumerate(stages) for seg in st.segments}
    order = [seg for st in stages for seg in st.segments]
    index = {seg: i for i, seg in enumerate(order)}
    grouped = [(seg, [n for n, _ in group]) for seg, group in itertools.groupby(seg_of, key=lambda t: t[1])]
    blocks = [seg if not seg.startswith("<outside>") else None for seg, _ in grouped]
    out, stage, at = [], 0, -1  # at: the plan's segment last matched
    for i, (seg, nodes) in enumerate(grouped):
        if not seg.startswith("<outside>"):
            if seg not in stage_of:
                raise PlanError(f"segment {seg!r} of the graph is in no pipeline stage of the plan. The model "
                                "changed after it was planned; build a new model inside auto_parallelize.")
            stage, at = stage_of[seg], index[seg]
        else:
            before = next((b for b in reversed(blocks[:i]) if b is not None), None)
            after = next((b for b in blocks[i + 1:] if b is not None), None)
            if not (before is not None and before == after) and at + 1 < len(order) \
                    and order[at + 1].startswith("<outside>"):
                at += 1
                stage = stage_of[order[at]]
        out.append((nodes, stage))
    return out


def _sink_prologue(gm: fx.GraphModule) -> None:
    """Moves each block node stranded among other segments (shard_linears puts weight conversions at
    the top of the graph and input conversions right after their producer) to just before its first
    user in the same block, so every block's nodes are consecutive again; a conversion of a weight
    outside the blocks (the final norm) moves next to its user too, so the weight does not travel.
    Random ops stay where they are: moving them would change which numbers they draw."""
    nodes = [n for n in gm.graph.nodes]
    position = {n: float(i) for i, n in enumerate(nodes)}
    segment = segment_names(gm)
    for n in reversed(nodes):
        if n.op in ("placeholder", "get_attr", "output") or not n.users or _is_random(n):
            continue
        block = block_of(module_of(n))
        after = n.next
        first = min(n.users, key=position.__getitem__)
        if not block:  # outside every block: move only conversions of weights read far below
            if all(a.op in ("placeholder", "get_attr") for a in n.all_input_nodes) \
                    and segment.get(first) != segment.get(n) and first is not after:
                first.prepend(n)
                position[n] = (position[n.prev] + position[first]) / 2
            continue
        stranded = after.op == "placeholder" or (after.meta.get("nn_module_stack") is not None
                                                  and block_of(module_of(after)) != block)
        if not stranded or segment.get(first) != block or first is after:
            continue  # the next node is in the same block (or carries no module)
        first.prepend(n)
        position[n] = (position[n.prev] + position[first]) / 2  # between its new neighbours


def _is_random(node: fx.Node) -> bool:
    """A seeded op, or a marker standing for one (the dropouts and random ops on a piece of a tensor)."""
    return node.target in _RANDOM_MARKERS or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


_RANDOM_MARKERS = (split_dropout, split_random, context_dropout)
