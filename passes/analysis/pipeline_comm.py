"""pipeline_collectives: what one pipeline rank communicates in a ``train_step`` (pipeline > 1).

The runtime (autopar.runtime.pipeline.stages, autopar.train) runs M micro-batches through the rank's stages; this
lists the same communication, one Collective per call, so ``comm_stats()`` after a step equals the
sum of their bytes (tests hold the two equal). Per micro-batch:

- each of the rank's stages: its segments' tensor-parallel collectives (the chain is captured for
  one micro-batch, so weight gathers repeat per micro-batch and activation ones are its rows');
- stage k before the last: one send per tensor crossing its cut (forward); stage k after the first:
  one send back per received tensor that needs a gradient (backward). The sender counts the bytes;
- the last stage: the loss's collectives (``loss_collectives``: cross-entropy on the logits).

Once per step, after the last micro-batch:

- the gradient sync (data x depth) of every parameter the rank's stages read;
- a weight read by stages on several ranks (tied embeddings): its gradient all-reduced over them;
- the returned loss: all-reduced over the batch shards on the last stage's rank, then broadcast
  from it over the pipeline;
- the check that every rank makes the call (autopar.runtime.execution.call_check): one all-gather of ``AGREEMENT_BYTES``
  per rank over the world.

Stage k runs on pipeline rank k mod P (PipelinePlan). Activations are counted at their captured
dtype: under bf16/fp16 autocast the real sends can be smaller.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.decisions import Plan
from passes.analysis.choose_stages import ChainSegment
from autopar.config import AGREEMENT_BYTES
from passes.analysis.estimate_costs import AGREEMENT, Collective, axis_size


def pipeline_collectives(chain: Sequence[ChainSegment], plan: Plan, step: Sequence[Collective],
                         loss: Sequence[Collective], rank: int, num_microbatches: int) -> tuple[Collective, ...]:
    """Every collective pipeline rank ``rank`` issues in one training step.

    Args:
        chain: the whole model's chain, captured for one micro-batch on this rank.
        plan: the plan, with ``plan.pipeline``'s stages cut from ``chain``.
        step: the gradient sync of every parameter (phase "step"; estimate_costs.grad_sync_collectives).
        loss: the loss's collectives for one micro-batch (estimate_costs.loss_collectives).
        rank: this rank's index along the pipeline axis.
        num_microbatches: micro-batches per step.
    """
    pipe, config = plan.pipeline, plan.config
    if pipe is None:
        raise ValueError("pipeline_collectives needs a plan with pipeline stages")
    ranks, last = pipe.ranks, len(pipe.stages) - 1
    segment = {s.name: s for s in chain}
    stages = [[segment[name] for name in st.segments] for st in pipe.stages]
    mine = [k for k in range(len(stages)) if k % ranks == rank]
    micro: list[Collective] = []
    for k in mine:
        micro += [c for s in stages[k] for c in s.collectives]
        if k < last:
            micro += [_send(b, "forward", f"stage {k} -> {k + 1}") for b, _ in stages[k][-1].crossing]
        if k > 0:
            micro += [_send(b, "backward", f"stage {k} -> {k - 1}") for b, g in stages[k - 1][-1].crossing if g]
        if k == last:
            micro += loss
    out = micro * num_microbatches
    held = {name for k in mine for s in stages[k] for name, _ in s.params}
    out += [c for c in step if c.where in held]
    nbytes = {name: b for s in chain for name, b in s.params}
    for name, shared in pipe.shared:
        holders = {k % ranks for k in shared}
        if len(holders) > 1 and rank in holders:
            out.append(Collective("all_reduce", "pipeline", len(holders), nbytes[name], "step", name))
    if last in mine and config.num_batch_shards > 1:
        out.append(Collective("all_reduce", "batch", axis_size(config, "batch"), 4, "step", "<loss>"))
    out.append(Collective("broadcast", "pipeline", ranks, 4, "step", "<loss>"))
    # train_step's check that every rank makes the same call, once a step (autopar.runtime.execution.call_check)
    out.append(Collective("all_gather", "world", config.world_size, AGREEMENT_BYTES * config.world_size, "forward",
                          AGREEMENT))
    return tuple(c for c in out if c.group_size > 1)


def pipeline_flops(chain: Sequence[ChainSegment], plan: Plan, rank: int, num_microbatches: int) -> float:
    """The matmul FLOPs pipeline rank ``rank`` computes in one training step (its stages only)."""
    segment = {s.name: s for s in chain}
    return num_microbatches * sum(segment[name].flops for st in plan.pipeline.stages_of(rank) for name in st.segments)


def _send(nbytes: int, phase: str, where: str) -> Collective:
    return Collective("send", "pipeline", 2, nbytes, phase, where)
