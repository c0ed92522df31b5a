"""choose_checkpoints: which blocks to recompute so activations fit a budget, at the least recompute.

The model, per segment k of the chain (estimate_memory's segments, in order), with ``C`` the set of
recomputed (checkpointed) segments and ``P_k`` the bytes kept by the segments before k (``a_i`` for
i in C: only its inputs; ``s_i`` otherwise: everything it saves):

    peak(C) = max( max_k  P_k + s_k + t_k + [k in C] a_k ,  P_end )

While segment k runs forward, or backward (after recomputing it when k is in C), all of its saved
tensors ``s_k`` and its transients ``t_k`` are live on top of what the earlier segments keep; a
recomputed segment also still holds its inputs. Segments after k have been freed by then in
backward, and are not yet built in forward.

On a pipeline rank ``n_k`` micro-batches are in flight at once (``SegmentCost.copies``): each keeps
``s_k`` (recomputed: ``a_k``), so ``P`` grows by ``n_k s_k`` (``n_k a_k``), and the term of k is
``P_k + n_k s_k + t_k``, recomputed ``P_k + s_k + t_k + n_k a_k``: one micro-batch at a time
recomputes its activations, the others keep only their inputs.

The cost is the forward FLOPs of the recomputed segments, plus each one's operator count (its dispatch, and
what keeps a block of no FLOPs, a norm, from being recomputed where nothing needs it). Minimizing it under ``peak <= budget`` is
exact by dynamic programming over the chain with the kept prefix ``P`` as the state: the constraint
at k depends only on ``P_k`` and the choice at k, so for each ``P`` only the cheapest way to reach it
matters, and a state that keeps more bytes at a higher cost is dropped (a Pareto front). For a chain
of identical blocks the front has at most one state per number of checkpointed blocks so far, so
100 blocks take well under 100 ms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from autopar.decisions import MemoryPlan, Plan
from autopar.errors import PlanError
from passes.analysis.choose_stages import inflight_microbatches
from passes.analysis.estimate_memory import MemoryProfile, SegmentCost


@dataclass(frozen=True, slots=True)
class CheckpointChoice:
    recompute: tuple[str, ...]
    """Names of the segments recomputed in backward, in chain order."""
    peak_bytes: int
    """Predicted activation peak with this choice."""
    recompute_flops: int


def activation_peak(segments: Sequence[SegmentCost], recompute: set[str] | frozenset[str]) -> int:
    """The predicted activation peak (see the module docstring) when ``recompute`` is checkpointed."""
    kept = peak = 0
    for s in segments:
        ck = s.name in recompute
        peak = max(peak, kept + _running(s, ck))
        kept += s.copies * (s.input_bytes if ck else s.saved_bytes)
    return max(peak, kept)


def _running(s: SegmentCost, recomputed: bool) -> int:
    """Bytes live while ``s`` runs beyond what the segments before it keep (module docstring)."""
    if recomputed:
        return s.saved_bytes + s.peak_bytes + s.copies * s.input_bytes
    return s.copies * s.saved_bytes + s.peak_bytes


def _choice(segments: Sequence[SegmentCost], recompute: set[str] | frozenset[str]) -> CheckpointChoice:
    names = tuple(s.name for s in segments if s.name in recompute)
    return CheckpointChoice(names, activation_peak(segments, recompute),
                            sum(s.flops for s in segments if s.name in recompute))


def choose_checkpoints(segments: Sequence[SegmentCost], budget: int) -> CheckpointChoice:
    """The cheapest set of checkpointable segments whose activation peak fits ``budget`` bytes.

    Raises:
        PlanError: not even recomputing every checkpointable segment fits.
    """
    # front: kept prefix -> (cost, chosen names); only Pareto-optimal (kept, cost) pairs survive.
    front: list[tuple[int, int, tuple[str, ...]]] = [(0, 0, ())]
    for s in segments:
        grown: list[tuple[int, int, tuple[str, ...]]] = []
        for kept, cost, chosen in front:
            if kept + _running(s, False) <= budget:
                grown.append((kept + s.copies * s.saved_bytes, cost, chosen))
            if s.checkpointable and kept + _running(s, True) <= budget:
                grown.append((kept + s.copies * s.input_bytes, cost + s.flops + max(s.ops, 1), (*chosen, s.name)))
        grown.sort(key=lambda x: (x[0], x[1]))
        front = []
        for state in grown:
            if not front or state[1] < front[-1][1]:
                front.append(state)
        if not front:
            break
    feasible = [st for st in front if st[0] <= budget]
    if not feasible:
        every = _choice(segments, {s.name for s in segments if s.checkpointable})
        raise PlanError(f"activations need at least {every.peak_bytes:,} bytes per rank even with every block "
                        f"recomputed, over the budget of {budget:,}. Raise the memory budget, use more "
                        "tensor-parallel ranks, or a smaller batch.")
    _, _, chosen = min(feasible, key=lambda st: (st[1], st[0]))
    return _choice(segments, set(chosen))


def plan_memory(profile: MemoryProfile, checkpoint: str | int, budget: int | None, *,
                strict: bool = False) -> MemoryPlan:
    """The MemoryPlan for ``checkpoint``: 'none', 'full', or 'auto' / bytes with the per-device ``budget``.

    When nothing fits the budget, every block is recomputed and ``fits`` is False; with ``strict``
    (an explicit budget at run time) that raises PlanError instead.
    """
    segments = profile.segments
    blocks = tuple(s.name for s in segments if s.checkpointable)
    # Headroom of one largest tensor, for a transient the model does not see (measured peaks have
    # been seen, rarely, one such tensor above the prediction).
    headroom = max((s.peak_bytes // 2 for s in segments), default=0)
    fits = True
    if checkpoint == "none":
        choice = _choice(segments, set())
    elif checkpoint == "full":
        choice = _choice(segments, set(blocks))
    else:
        assert budget is not None
        try:
            room = budget - profile.static_bytes - headroom
            if room <= 0:
                raise PlanError(f"parameters, gradients and optimizer state need {profile.static_bytes:,} bytes "
                                f"per rank, over the memory budget of {budget:,}. Use more tensor-parallel ranks "
                                "or a larger budget.")
            choice = choose_checkpoints(segments, room)
        except PlanError:
            if strict:
                raise
            choice, fits = _choice(segments, set(blocks)), False
    forward = sum(s.flops for s in segments)
    return MemoryPlan("budget" if isinstance(checkpoint, int) else checkpoint,
                      budget if checkpoint not in ("none", "full") else None, choice.recompute, blocks,
                      profile.param_bytes, profile.grad_bytes, profile.optimizer_bytes, choice.peak_bytes,
                      activation_peak(segments, set()), choice.recompute_flops, 3 * forward, fits, headroom,
                      profile.param_bytes + profile.largest_param_bytes)


def stage_memory(profile: MemoryProfile, plan: Plan, mine: list[Any], me: int, microbatches: int,
                 checkpoint: str | int, budget: int | None) -> MemoryPlan:
    """Pipeline rank ``me``'s memory: its stages' parameters, gradients and optimizer state, and their
    activations for the micro-batches the schedule keeps in flight there (1F1B's first rank: one per
    pipeline rank; the last: one; interleaved: ``inflight_microbatches`` per chunk), recomputation chosen
    under ``budget`` for that (FLOPs: every micro-batch's). The model's outputs and the loss's activations
    are the last rank's, one micro-batch of this shard's rows at a time (``train_step`` computes the loss
    per micro-batch; nothing is gathered)."""
    ranks = plan.pipeline.ranks
    counts = inflight_microbatches(ranks, microbatches, me, plan.pipeline.chunks_per_rank)
    inflight = {name: counts[k] for k, st in enumerate(mine) for name in st.segments}
    last = me == ranks - 1  # (the last stage, P v - 1, is on the last rank)
    local = plan.config.num_batch_shards  # the profile counts outputs whole over the batch shards
    segments = []
    for s in profile.segments:
        if s.name == "<shared>":  # masks and rotary tables per micro-batch in flight; outputs on the last rank
            kept = (s.saved_bytes - profile.output_bytes) * max(counts) + (profile.output_bytes // local if last else 0)
            segments.append(dataclasses.replace(s, saved_bytes=max(kept, 0)))
        elif s.name == "<loss>" and last:
            segments.append(dataclasses.replace(s, saved_bytes=s.saved_bytes // local, peak_bytes=s.peak_bytes // local))
        elif s.name in inflight:
            segments.append(dataclasses.replace(s, copies=inflight[s.name]))
    share = sum(st.param_bytes for st in mine) / profile.param_bytes if profile.param_bytes else 1.0
    stage = dataclasses.replace(profile, segments=tuple(segments), param_bytes=int(profile.param_bytes * share),
                                grad_bytes=int(profile.grad_bytes * share),
                                optimizer_bytes=int(profile.optimizer_bytes * share))
    memory = plan_memory(stage, checkpoint, budget)
    return dataclasses.replace(memory, recompute_flops=memory.recompute_flops * microbatches,
                               step_flops=memory.step_flops * microbatches)


def pipeline_memory(profile: MemoryProfile, plan: Plan, microbatches: int, checkpoint: str | int,
                    budget: int | None) -> MemoryPlan:
    """Under a pipeline: the recomputation every rank chooses for its own stages under ``budget``
    (``stage_memory``; a block belongs to one stage, so the union is every rank's choice), with the
    figures of the rank that needs the most memory. Whole-model memory would recompute blocks no rank
    needs to."""
    pipe = plan.pipeline
    per_rank = [stage_memory(profile, plan, pipe.stages_of(r), r, microbatches, checkpoint, budget)
                for r in range(pipe.ranks)]
    worst = max(per_rank, key=lambda m: m.peak_bytes)
    chosen = {b for m in per_rank for b in m.recompute}
    blocks = tuple(s.name for s in profile.segments if s.checkpointable)
    return dataclasses.replace(worst, recompute=tuple(b for b in blocks if b in chosen), blocks=blocks,
                               fits=all(m.fits for m in per_rank))
