"""insert_checkpoints: the plan's recomputed segments become checkpointed submodules.

Requires: ``plan.memory.recompute`` names segments of ``gm`` (estimate_memory.segment_names); each
  segment's nodes are consecutive in the graph. After split_stages, segments are looked for inside
  each ``stage_<k>`` submodule (a stage cut falls between blocks, so no block spans two stages).
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

import functools
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.decisions import Plan
from passes.analysis.estimate_memory import segment_names
from passes.outline import outline
from passes.runner import PassResult


def _recompute_collectives_too(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Compiled, every op of a recomputed segment is recomputed, its collectives included: torch's partitioner
    keeps a collective's output unless told it must be recomputed (``force_save_collectives``)."""
    if getattr(op, "namespace", None) == "_c10d_functional":
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


RECOMPUTE_COLLECTIVES = functools.partial(create_selective_checkpoint_contexts, _recompute_collectives_too)


def recomputed(fn: Any, *inputs: Any) -> Any:
    """``fn(*inputs)`` with its activations dropped after forward and recomputed in backward
    (``torch.utils.checkpoint``, non-reentrant). Under ``torch.compile`` its collectives are recomputed too,
    every rank of their groups issuing them again in the same order (every rank has the same plan), as
    eager's recomputation does; otherwise the partitioner would keep their outputs from forward."""
    if torch.compiler.is_compiling():
        return checkpoint(fn, *inputs, use_reentrant=False, context_fn=RECOMPUTE_COLLECTIVES)
    return checkpoint(fn, *inputs, use_reentrant=False)


def insert_checkpoints(gm: fx.GraphModule, plan: Plan) -> PassResult:
    chosen = set(plan.memory.recompute) if plan.memory is not None else set()
    if not chosen:
        return PassResult(gm, False)
    # After split_stages the blocks live inside the stage submodules: checkpoint them there.
    stages = [m for name, m in gm.named_children() if name.startswith("stage_") and isinstance(m, fx.GraphModule)]
    done: list[str] = []
    for target in stages or [gm]:
        runs: dict[str, list[fx.Node]] = {}
        for node, name in segment_names(target).items():
            if name in chosen:
                runs.setdefault(name, []).append(node)
        for i, nodes in enumerate(runs.values()):
            outline(target, nodes, f"checkpoint_{i}", lambda graph, fn, inputs: graph.call_function(
                recomputed, (fn, *inputs)))
        if target is not gm and runs:
            target.graph.lint()
            target.recompile()
        done.extend(runs)
    notes = (f"recomputed in backward: {', '.join(done)}",)
    return PassResult(gm, True, notes)
