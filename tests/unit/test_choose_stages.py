"""The pipeline partitioner against brute force, and its speed on a deep model."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from autopar.errors import PlanError
from passes.analysis.choose_stages import bubble_fraction, choose_stages, lower_bound, stage_seconds


def _brute_force(costs: list[float], cuts: list[float], p: int) -> float:
    n = len(costs)
    best = math.inf
    for inner in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *inner, n)
        best = min(best, max(stage_seconds(costs, cuts, a, b) for a, b in zip(bounds, bounds[1:])))
    return best


def test_partition_equals_brute_force_on_small_chains():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 9)
        costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
        cuts = [rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in range(n - 1)]
        p = rng.randint(1, n)
        stages = choose_stages(costs, cuts, p)
        assert len(stages) == p and stages[0].first == 0 and stages[-1].stop == n
        assert all(a.stop == b.first and a.first < a.stop for a, b in zip(stages, stages[1:]))
        got = max(s.seconds for s in stages)
        assert math.isclose(got, _brute_force(costs, cuts, p), rel_tol=1e-12), (costs, cuts, p)
        assert got >= lower_bound(costs, p) - 1e-12


def test_cheap_cuts_attract_the_boundaries():
    costs = [1.0] * 8
    cuts = [9.0, 9.0, 9.0, 0.0, 9.0, 9.0, 9.0]  # only the middle cut is free
    (a, b) = choose_stages(costs, cuts, 2)
    assert (a.first, a.stop, b.stop) == (0, 4, 8) and a.seconds == b.seconds == 4.0


def test_a_1000_block_model_partitions_in_under_a_second():
    rng = random.Random(1)
    costs = [1.0 + rng.random() for _ in range(1000)]
    cuts = [0.01] * 999
    start = time.perf_counter()
    stages = choose_stages(costs, cuts, 8)
    assert time.perf_counter() - start < 1.0
    assert max(s.seconds for s in stages) <= lower_bound(costs, 8) * 1.01


def test_too_many_stages_is_refused_with_the_limit():
    with pytest.raises(PlanError, match="cannot cut 3 segments into 4 pipeline stages"):
        choose_stages([1.0, 1.0, 1.0], [0.0, 0.0], 4)


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == 3 / 11
    assert bubble_fraction(4, 8, chunks_per_rank=2) == 3 / 19
