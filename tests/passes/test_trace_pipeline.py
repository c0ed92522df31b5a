"""Pipeline stages planned by cost in the trace (single process: the plan, not a run)."""

from __future__ import annotations

import torch

from autopar.config import ParallelConfig
from autopar.examples import zoo
from autopar.planning.machines import load_machine
from autopar.planning.planner import plan_model
from autopar.trace import main
from passes.analysis.choose_stages import Hardware


def _plan(name: str, pipeline: int, repeat: bool = True, layers: int = 8, hardware: Hardware | None = None):
    with torch.device("meta"):
        model = zoo.build_model(name, layers=layers)
    return plan_model(model, zoo.example_inputs(name, batch=8, seq=64), ParallelConfig(1, 2, 1, 1),
                      pipeline=pipeline, microbatches=8, repeat=repeat, hardware=hardware)[0]


def test_equal_blocks_split_evenly_and_every_segment_is_placed_once():
    with torch.device("meta"):
        model = zoo.build_model("llama-2-7b")
    plan = plan_model(model, zoo.example_inputs("llama-2-7b", batch=8, seq=512), ParallelConfig(1, 2, 1, 1),
                      pipeline=4, microbatches=8)[0]
    stages = plan.pipeline.stages
    names = [n for s in stages for n in s.segments]
    assert names == list(dict.fromkeys(names)) and sum(n.startswith("model.layers.") for n in names) == 32
    assert [sum(n.startswith("model.layers.") for n in s.segments) for s in stages] == [8, 8, 8, 8]
    # The lower bound ignores transfers and the head: 1.09 here.
    assert 1.0 <= plan.pipeline.bottleneck_seconds / plan.pipeline.lower_bound_seconds < 1.15
    assert plan.pipeline.bubble_fraction == 3 / 11
    total = sum(s.param_bytes for s in stages)
    assert total == sum(p.local_numel(plan.config) * 4 for p in plan.params)

    # Interleaved: 2 ranks x 2 stages each, the same four cuts; stage k runs on rank k mod 2.
    inter = plan_model(model, zoo.example_inputs("llama-2-7b", batch=8, seq=512), ParallelConfig(1, 2, 1, 1),
                       pipeline=2, microbatches=8, chunks=2)[0].pipeline
    assert [s.segments for s in inter.stages] == [s.segments for s in stages]
    assert inter.bubble_fraction == 1 / 17 and "stage 3 (rank 1)" in inter.summary()


def test_tiny_blocks_are_cut_where_transfers_are_cheapest():
    # At an H100's rates tiny layers compute in nanoseconds; moving a hidden state takes microseconds.
    # Interior stages pay two transfers, so they get the fewest blocks.
    plan = _plan("llama", 4, hardware=Hardware())
    blocks = [sum(n.startswith("model.layers.") for n in s.segments) for s in plan.pipeline.stages]
    assert sum(blocks) == 8 and blocks[0] + blocks[-1] > blocks[1] + blocks[2]


def test_stages_are_cut_for_the_machine_that_runs_them():
    """The same tiny blocks at a CPU's rates (the default on a machine without a GPU, as the runtime there
    cuts them): compute outweighs the transfers, so the interior stages get as many blocks as the ends,
    and the head's stage fewer. Mutation: the runtime's default left at H100 rates fails the first check."""
    cpu = Hardware.of(load_machine("cpu"), ParallelConfig(1, 2, 1, 1, pipeline=4))
    for plan in (_plan("llama", 4, hardware=cpu), *(() if torch.cuda.is_available() else (_plan("llama", 4),))):
        blocks = [sum(n.startswith("model.layers.") for n in s.segments) for s in plan.pipeline.stages]
        assert sum(blocks) == 8 and blocks[1] + blocks[2] >= blocks[0] + blocks[-1], blocks
        assert "stages cut for cpu rates" in plan.pipeline.summary()
    h100 = _plan("llama", 4, hardware=Hardware.of(load_machine("h100-80gb"), ParallelConfig(1, 2, 1, 1, pipeline=4)))
    assert "stages cut for h100-80gb rates" in h100.pipeline.summary()


def test_copied_blocks_give_the_stages_of_a_full_capture():
    a, b = _plan("gpt2", 3), _plan("gpt2", 3, repeat=False)
    assert [s.segments for s in a.pipeline.stages] == [s.segments for s in b.pipeline.stages]
    for x, y in zip(a.pipeline.stages, b.pipeline.stages):
        assert abs(x.seconds - y.seconds) <= 1e-12 * y.seconds and x.param_bytes == y.param_bytes


def test_trace_prints_the_stages(capsys):
    assert main([f"{zoo.__file__}:llama", "--tensor", "2", "1", "1", "--pipeline", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages, 4 micro-batches" in out and "stage 1: model.layers.1, <outside>#1" in out


def test_a_tied_embedding_is_shared_by_the_first_and_last_stage():
    for name in ("nanogpt", "gpt2"):
        plan = _plan(name, 3)
        assert [(n, s) for n, s in plan.pipeline.shared] == [("lm_head.weight", (0, 2))], name
    assert _plan("llama", 3).pipeline.shared == ()  # untied head
