"""The checkpoint solver against brute force, and its speed on a deep model."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pytest

from autopar.errors import PlanError
from passes.analysis.choose_checkpoints import activation_peak, choose_checkpoints
from passes.analysis.estimate_memory import SegmentCost


def _chain(rng: random.Random, n: int, alike: bool) -> list[SegmentCost]:
    block = (rng.randint(50, 200), rng.randint(5, 40), rng.randint(5, 60), rng.randint(10, 100))
    out = [SegmentCost("embed", False, rng.randint(0, 30), 0, rng.randint(0, 40), 0)]
    for i in range(n):
        saved, inp, peak, flops = block if alike else (rng.randint(50, 200), rng.randint(5, 40),
                                                       rng.randint(5, 60), rng.randint(10, 100))
        out.append(SegmentCost(f"layers.{i}", True, saved, inp, peak, flops))
    out.append(SegmentCost("head", False, rng.randint(0, 80), rng.randint(5, 40), rng.randint(0, 90), 0))
    return out


def _brute_force(segments: list[SegmentCost], budget: int) -> int | None:
    names = [s.name for s in segments if s.checkpointable]
    flops = {s.name: s.flops for s in segments}
    best = None
    for k in range(len(names) + 1):
        for chosen in itertools.combinations(names, k):
            if activation_peak(segments, set(chosen)) <= budget:
                cost = sum(flops[c] for c in chosen)
                best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("alike", [False, True])
@pytest.mark.parametrize("copies", [1, 3])
def test_solver_equals_brute_force_on_small_chains(alike, copies):
    rng = random.Random(0)
    checked = 0
    for _ in range(60):
        segments = [dataclasses.replace(s, copies=copies) if s.name != "head" else s
                    for s in _chain(rng, rng.randint(1, 8), alike)]
        a = activation_peak(segments, {s.name for s in segments if s.checkpointable})
        b = activation_peak(segments, set())
        low, high = min(a, b), max(a, b)
        for budget in sorted({low - 1, low, (low + high) // 2, high - 1, high, rng.randint(low, high)}):
            want = _brute_force(segments, budget)
            if want is None:
                with pytest.raises(PlanError, match="even with every block recomputed"):
                    choose_checkpoints(segments, budget)
                continue
            got = choose_checkpoints(segments, budget)
            assert got.recompute_flops == want, (segments, budget)
            assert got.peak_bytes == activation_peak(segments, set(got.recompute)) <= budget
            checked += 1
    assert checked > 200


def test_no_budget_pressure_recomputes_nothing_and_full_pressure_everything():
    segments = _chain(random.Random(1), 6, alike=True)
    assert choose_checkpoints(segments, activation_peak(segments, set())).recompute == ()
    every = {s.name for s in segments if s.checkpointable}
    assert set(choose_checkpoints(segments, activation_peak(segments, every)).recompute) == every


def test_a_100_block_model_solves_in_under_100_ms():
    segments = _chain(random.Random(2), 100, alike=True)
    low = activation_peak(segments, {s.name for s in segments if s.checkpointable})
    budget = (low + activation_peak(segments, set())) // 2
    seconds = min(_timed(segments, budget) for _ in range(3))
    assert seconds < 0.1, seconds


def _timed(segments: list[SegmentCost], budget: int) -> float:
    start = time.perf_counter()
    choose_checkpoints(segments, budget)
    return time.perf_counter() - start



def test_micro_batches_in_flight_keep_their_activations_and_one_recomputes_at_a_time():
    """A pipeline rank with 4 micro-batches in flight: each keeps what a block saves (100) or, recomputed,
    its input (10); while one micro-batch recomputes the block for backward, only it holds the block's
    activations again (mutation: all four recomputing at once, 4 x 100, overstated BLOOM-176B's first
    rank by 8 GiB and put its published grid over 80 GB)."""
    block = SegmentCost("block", True, saved_bytes=100, input_bytes=10, peak_bytes=5, flops=1, copies=4)
    assert activation_peak([block], set()) == 4 * 100 + 5
    assert activation_peak([block], {"block"}) == 100 + 5 + 4 * 10
    two = [block, dataclasses.replace(block, name="block2")]
    assert activation_peak(two, {"block", "block2"}) == 4 * 10 + 100 + 5 + 4 * 10
    assert choose_checkpoints(two, 4 * 10 + 4 * 100 + 5).recompute == ("block",)  # the first recomputed, not the last


def test_a_block_of_no_flops_is_not_recomputed_where_nothing_needs_it():
    """Recomputing a norm costs no FLOPs but an op's dispatch each way: with room to spare, nothing is."""
    segments = [SegmentCost("embed", False, 10, 0, 10, 0),
                *(SegmentCost(f"layers.{i}.norm", True, 50, 10, 20, 0, ops=3) for i in range(3)),
                SegmentCost("head", False, 10, 10, 10, 0)]
    assert choose_checkpoints(segments, 10_000).recompute == ()
    tight = choose_checkpoints(segments, activation_peak(segments, {"layers.0.norm"}))
    assert len(tight.recompute) == 1 and tight.recompute_flops == 0  # (and where memory needs it, it is)
