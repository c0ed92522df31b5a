"""``--calibrate``'s table of collectives under a machine that drifts while it measures."""

from __future__ import annotations

import time

from autopar.planning.calibrate import collective_table


def _table_while_the_compute_speeds_up() -> dict:
    done = [0]

    def between() -> None:  # the compute between calls: 20 ms for its first six runs, then 1 ms
        done[0] += 1
        time.sleep(0.02 if done[0] <= 6 else 0.001)

    table, _ = collective_table(repeats=1, sizes=(4, 4096), between=between)
    return table


def test_a_collective_is_never_priced_at_nothing_when_the_compute_drifts(distributed):
    """Each point is its calls after the compute less that compute, measured beside it, and never below
    the calls back to back: a table that took the compute's time once at the start read every point
    measured in a faster moment as nothing (a benchmark job here priced 2-rank all-reduces up to 1 MiB
    at 0 ms, and predicted GPT-2's tensor grids at 40-51% of their steps). Mutation: subtracting one
    compute time taken first prices every collective at 1 us."""
    for table in distributed(_table_while_the_compute_speeds_up, 2):
        for kind, groups in table.items():
            for seconds in (s for points in groups.values() for _, s in points):
                assert seconds > 2e-5, (kind, groups)


def _skews() -> tuple[float, float]:
    import autopar.planning.calibrate as calibrate

    with_cores = calibrate.arrival_skew_seconds(stretch=0.005, calls=2, trials=1)
    calibrate.cpu_cores = lambda: 1  # (this child only) two ranks on one core
    return with_cores, calibrate.arrival_skew_seconds(stretch=0.005, calls=2, trials=1)


def test_the_arrival_skew_is_measured_only_where_ranks_outnumber_cores(distributed):
    """``Machine.skew_seconds``: 0 where every local rank has a core (on a GPU, or here with 2 ranks and
    LOCAL_WORLD_SIZE unset and at least 2 cores), a measured delay (never negative, less than a second)
    where they share one."""
    import os

    for with_cores, shared in distributed(_skews, 2):
        assert with_cores == 0 or (os.cpu_count() or 1) < 2
        assert 0 <= shared < 1
