"""The orders torch's schedules run, checked without processes.

Multi-stage schedules (interleaved, looped BFS) execute their ``pipeline_order`` (rank -> actions),
computed in the constructor from the stages' indices and group size: stand-in stages are enough.
Single-stage schedules (GPipe, 1F1B) run hand-written loops, so their order is recorded by running
``_step_microbatches`` on a stage that only records its calls (their ``pipeline_order`` is only a
picture, and torch 2.13's picture of 1F1B numbers rank 1's micro-batches from 1). A small event
simulation then runs every rank's actions in order, each when its inputs exist, and checks that:
- every action is on the rank autopar places its stage on (``autopar.runtime.pipeline.stages.owner``);
- each stage runs forward and backward of every micro-batch exactly once;
- the order never waits for something that comes later (no deadlock);
- with uniform stages the idle share equals the predicted bubble (p-1)/(v m + p-1).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autopar.compat import schedule_action_types
from autopar.config import PipelineConfig
from autopar.runtime.pipeline.stages import owner, schedule_class
from passes.analysis.choose_stages import bubble_fraction

_Action, _ComputationType = schedule_action_types()
FORWARD, BACKWARD = 1.0, 2.0  # backward costs twice the forward, as for matmuls


class _RecordingStage:
    """What a single-stage schedule calls on its stage, recorded; no tensors, no communication."""

    def __init__(self, index: int, num_stages: int, log: list) -> None:
        self.stage_index, self.num_stages, self.log = index, num_stages, log
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.has_backward = True

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.log.append(_Action(self.stage_index, _ComputationType.FORWARD, mb))

    def backward_one_chunk(self, mb: int, **kwargs) -> None:
        self.log.append(_Action(self.stage_index, _ComputationType.FULL_BACKWARD, mb))

    def get_fwd_recv_ops(self, mb: int) -> list:
        return []

    get_bwd_recv_ops = get_fwd_send_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, factor: int) -> None:
        pass


def pipeline_order(schedule: str, num_ranks: int, num_microbatches: int, chunks: int) -> dict[int, list]:
    cls = schedule_class(schedule)
    num_stages = num_ranks * chunks
    if chunks == 1:  # executed loop, recorded per rank
        order = {}
        for rank in range(num_ranks):
            log: list = []
            built = cls(_RecordingStage(rank, num_stages, log), num_microbatches, loss_fn=lambda out, tgt: None)
            built._stage_forward_initialized = built._stage_backward_initialized = True
            built._step_microbatches(target_mbs=[None] * num_microbatches)
            order[rank] = log
        return order
    stages = [SimpleNamespace(num_stages=num_stages, group_size=num_ranks, group_rank=0, stage_index=k)
              for k in range(chunks)]
    built = cls(stages, num_microbatches)
    return {rank: [a for a in actions if a is not None and a.computation_type in
                   (_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD)]
            for rank, actions in built.pipeline_order.items()}


def simulate(order: dict[int, list], num_stages: int) -> tuple[float, float]:
    """Runs each rank's actions in order, each as soon as its inputs exist; returns (makespan, busy)."""
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    position = dict.fromkeys(order, 0)
    busy = 0.0
    while any(position[r] < len(order[r]) for r in order):
        progressed = False
        for rank, actions in order.items():
            if position[rank] == len(actions):
                continue
            a = actions[position[rank]]
            s, mb = a.stage_index, a.microbatch_index
            if a.computation_type is _ComputationType.FORWARD:
                needs, key, cost = [("F", s - 1, mb)] if s > 0 else [], ("F", s, mb), FORWARD
            else:
                needs = [("F", s, mb)] + ([("B", s + 1, mb)] if s < num_stages - 1 else [])
                key, cost = ("B", s, mb), BACKWARD
            if any(n not in done for n in needs):
                continue
            start = max([clock[rank]] + [done[n] for n in needs])
            done[key] = clock[rank] = start + cost
            busy += cost
            position[rank] += 1
            progressed = True
        assert progressed, f"deadlock: every rank waits ({position})"
    return max(clock.values()), busy


CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1), ("1f1b", 8, 8, 1),
         ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 2), ("looped-bfs", 2, 4, 2)]


@pytest.mark.parametrize("schedule, num_ranks, num_microbatches, chunks", CASES)
def test_schedule_order_runs_every_stage_once_on_autopar_ranks(schedule, num_ranks, num_microbatches, chunks):
    order = pipeline_order(schedule, num_ranks, num_microbatches, chunks)
    num_stages = num_ranks * chunks
    assert sorted(order) == list(range(num_ranks))
    seen = []
    for rank, actions in order.items():
        for a in actions:
            assert owner(a.stage_index, num_ranks) == rank, (schedule, rank, str(a))
            seen.append((a.computation_type, a.stage_index, a.microbatch_index))
    expected = [(t, s, mb) for t in (_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD)
                for s in range(num_stages) for mb in range(num_microbatches)]
    assert sorted(seen, key=str) == sorted(expected, key=str)
    simulate(order, num_stages)  # asserts no deadlock


@pytest.mark.parametrize("schedule, num_ranks, num_microbatches, chunks",
                         [c for c in CASES if c[0] in ("gpipe", "1f1b", "interleaved")])
def test_simulated_bubble_equals_the_prediction(schedule, num_ranks, num_microbatches, chunks):
    order = pipeline_order(schedule, num_ranks, num_microbatches, chunks)
    makespan, busy = simulate(order, num_ranks * chunks)
    idle = 1 - busy / (num_ranks * makespan)
    assert idle == pytest.approx(bubble_fraction(num_ranks, num_microbatches, chunks), abs=1e-9), (
        schedule, makespan, busy)


def test_pipeline_config_defaults_and_checks():
    assert PipelineConfig().stages_per_rank == 1
    assert PipelineConfig(schedule="interleaved").stages_per_rank == 2
    assert PipelineConfig().num_microbatches(4) == 4
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        PipelineConfig(microbatches=2).num_microbatches(4)
    with pytest.raises(ValueError, match="schedule='zb'"):
        PipelineConfig(schedule="zb")
    with pytest.raises(ValueError, match="chunks=2 needs a multi-stage schedule"):
        PipelineConfig(chunks=2)
    with pytest.raises(ValueError, match="microbatches=0"):
        PipelineConfig(microbatches=0)
