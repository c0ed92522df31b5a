"""The plan search's pure parts (``passes.analysis.search_plans``): the grids a world size allows, where a
collective runs (within a node or across), the step time's parts, the ranking and its reasons."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from autopar.config import ParallelConfig
from autopar.planning.machines import BUILT_IN, load_machine
from autopar.planning.planner import plan_model
from passes.analysis.choose_stages import Hardware
from passes.analysis.machine import Machine
from passes.analysis.search_plans import (Candidate, Scored, StepTime, candidates, plan_seconds, rank_plans, step_seconds,
                                         why_slower)

MACHINE = Machine("test", flops_per_second=1e12, memory_bytes=2**30, intra_bytes_per_second=1e11,
                  inter_bytes_per_second=1e10, intra_latency=1e-5, inter_latency=1e-4, gpus_per_node=4)


def test_candidates_are_every_grid_of_the_world_size():
    grids = candidates(8, 8)
    assert all(c.data * c.pipeline * c.row * c.col * c.depth == 8 for c in grids)
    assert Candidate(8, 1, 1, 1, 1) in grids and Candidate(1, 1, 2, 2, 2) in grids
    assert len({dataclasses.replace(c, microbatches=1, chunks=1) for c in grids}) == 35  # 5 degrees, 2^3: C(3+4, 4)
    for c in grids:
        if c.pipeline > 1:  # micro-batches: at least one per stage, dividing each shard's rows
            assert c.microbatches >= c.pipeline and (8 // (c.data * c.depth)) % c.microbatches == 0, c
    # every pipeline also runs interleaved, two stages per rank
    assert {c for c in grids if c.pipeline > 1} == {dataclasses.replace(c, chunks=v) for c in grids
                                                    if c.pipeline > 1 for v in (1, 2)}
    assert all(c.chunks == 1 for c in candidates(8, 8, chunks=(1,)))


def test_interleaved_grids_keep_torchs_rounds():
    """torch's Interleaved1F1B runs m micro-batches on P ranks in ``max(1, m // P)`` equal rounds: 9 on 4
    ranks (36 rows in micro-batches of 4) do not divide into 2 rounds, so 9 is a 1F1B candidate only."""
    from autopar.config import PipelineConfig

    grids = candidates(4, 36, fixed={"data": 1, "pipeline": 4, "row": 1, "col": 1, "depth": 1})
    for c in grids:
        PipelineConfig(c.microbatches, "interleaved" if c.chunks > 1 else "1f1b", c.chunks).num_microbatches(4)
    assert {c.chunks for c in grids if c.microbatches == 9} == {1}
    assert {c.chunks for c in grids if c.microbatches == 12} == {1, 2}


def test_pipelines_take_micro_batches_of_one_two_four_rows():
    """BLOOM-176B's 12 stages over 256 rows per data rank took 128 micro-batches of 2 rows: no multiple of
    the stages divides the rows (mutation: only multiples of the stages leaves these grids out)."""
    grids = candidates(6, 8, fixed={"data": 2, "pipeline": 3, "row": 1, "col": 1, "depth": 1})
    assert [c.microbatches for c in grids if c.chunks == 1] == [4]  # 4 rows per data rank: 4 micro-batches of 1 row
    assert {c.microbatches for c in candidates(24, 512, fixed={"data": 2, "pipeline": 12, "row": 1, "col": 1})} \
        >= {128, 256} and not candidates(24, 4, fixed={"data": 2, "pipeline": 12, "row": 1, "col": 1})


def test_candidates_keep_given_degrees_and_need_a_row_per_shard():
    assert all(c.row == 4 for c in candidates(8, 8, fixed={"row": 4}))
    assert all(c.data * c.depth <= 2 for c in candidates(8, 2))
    with pytest.raises(ValueError, match="unknown degrees"):
        candidates(8, 8, fixed={"tensor": 2})


def test_a_collective_runs_within_a_node_when_its_group_does():
    config = ParallelConfig(2, 4, 1, 1)  # data 2 x row 4: row is innermost (4 ranks), data spans all 8
    assert MACHINE.link(config, "row") == (1e11, 1e-5)
    assert MACHINE.link(config, "data") == (1e10, 1e-4) and MACHINE.link(config, "batch") == (1e10, 1e-4)
    assert dataclasses.replace(MACHINE, gpus_per_node=8).link(config, "data") == (1e11, 1e-5)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _step(config: ParallelConfig, machine: Machine, recompute: float = 0.0) -> StepTime:
    with torch.device("meta"):
        model = MLP()
    plan, report = plan_model(model, (torch.empty(16, 64, device="meta"),), config)
    layers = [(r.flops, plan.matmul(r.weight).orientation) for r in report.layers]
    return step_seconds(report.collectives, layers, plan, machine, recompute_flops=recompute)


def test_step_time_parts():
    alone = _step(ParallelConfig(1, 1, 1, 1), MACHINE)
    assert alone.communication == alone.sync == alone.bubble == 0 and alone.compute > 0
    split = _step(ParallelConfig(1, 2, 1, 1), MACHINE)
    assert split.compute == pytest.approx(alone.compute / 2) and split.communication > 0
    data = _step(ParallelConfig(2, 1, 1, 1), MACHINE)
    assert data.sync > 0  # the gradient sum after backward (forward: the call check and the output gather)
    slower_links = dataclasses.replace(MACHINE, intra_bytes_per_second=1e9)
    assert _step(ParallelConfig(1, 2, 1, 1), slower_links).communication > split.communication
    assert _step(ParallelConfig(1, 1, 1, 1), MACHINE, recompute=1e9).compute == pytest.approx(alone.compute + 1e-3)


def test_a_pipelines_bubble_is_free_where_ranks_share_fewer_cores():
    """Rates measured with every rank busy are shared ones where a node's ranks outnumber its cores, and
    a rank idle in the bubble gives its core to a busy one: 4 ranks on 2 cores take the longer of the
    rank's span at a core's full speed and the node's work on 2 cores (the benchmark measured 4-stage
    1F1B steps at 72-73% of busy / (1 - bubble)). A device per rank (cores 0) or a core per rank keep
    the whole bubble. Mutation: ignoring cores predicts the oversubscribed pipeline 1/(1 - f) slower."""
    from passes.analysis.search_plans import pipeline_span

    four = ParallelConfig(1, 1, 1, 1, pipeline=4)
    f = 3 / 11  # 4 stages, 8 micro-batches
    assert pipeline_span(1.0, f, MACHINE, four) == pytest.approx(11 / 8)  # a device per rank
    shared = dataclasses.replace(MACHINE, cores=2)
    assert pipeline_span(1.0, f, shared, four) == pytest.approx(1.0)  # max(11/8 * 2/4, 1)
    assert pipeline_span(1.0, 0.75, shared, four) == pytest.approx(2.0)  # a long bubble still costs
    assert pipeline_span(1.0, f, dataclasses.replace(MACHINE, cores=4), four) == pytest.approx(11 / 8)
    assert pipeline_span(1.0, f, dataclasses.replace(shared, gpus_per_node=2), four) == pytest.approx(11 / 8)


def _scored(data: int, seconds: float, fits: bool = True, row: int = 1) -> Scored:
    return Scored(Candidate(data, 1, row, 1, 1), StepTime(seconds, 0.0, 0.0, 0.0), 100, fits,
                  reason="" if fits else "needs more")


def test_plans_that_fit_come_first_then_the_fastest():
    ranked = rank_plans([_scored(1, 1.0, fits=False), _scored(2, 3.0), _scored(4, 2.0)])
    assert [s.candidate.data for s in ranked] == [4, 2, 1]
    tie = rank_plans([_scored(1, 2.0, row=4), _scored(4, 2.0)])  # equal time: fewer tensor ranks first
    assert tie[0].candidate.row == 1


def test_why_a_plan_is_slower():
    best = Scored(Candidate(4, 1, 1, 1, 1), StepTime(1.0, 0.0, 0.0, 0.1), 0, True)
    other = Scored(Candidate(1, 1, 4, 1, 1), StepTime(1.0, 0.5, 0.0, 0.0), 0, True)
    assert why_slower(best, other) == "communication +500 ms"
    assert why_slower(best, _scored(1, 1.0, fits=False)) == "needs more"


def test_built_in_hardware_loads_and_a_bad_file_is_refused(tmp_path):
    for name in BUILT_IN:
        machine = load_machine(name)
        assert machine.name == name and machine.flops_per_second > 0 and machine.memory_bytes > 0
    assert load_machine("h100-80gb", gpus_per_node=4).gpus_per_node == 4
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "flops": 1}')
    from autopar.errors import ConfigError
    with pytest.raises(ConfigError, match="not valid"):
        load_machine(str(bad))
    with pytest.raises(ConfigError, match="unknown hardware"):
        load_machine("tpu-v9")


def test_prediction_accuracy():
    """The figures the benchmark harness reports for the step model against measured grids."""
    from passes.analysis.search_plans import kendall_tau, prediction_accuracy

    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0 and kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    a = prediction_accuracy([1.0, 2.2, 2.8], [1.1, 2.0, 3.0])
    assert a.mape == pytest.approx((0.1 / 1.1 + 0.2 / 2.0 + 0.2 / 3.0) / 3) and a.kendall_tau == 1.0
    assert a.picked_over_fastest == 1.0
    assert prediction_accuracy([2.0, 1.0], [1.0, 2.0]).picked_over_fastest == 2.0  # it picks the slower grid


def test_measured_collectives_replace_bandwidth_and_latency_within_a_node():
    """A calibrated machine's table of collectives (autopar.planning.calibrate.collective_table) prices a collective
    by its kind, group size and message: interpolated in log-log, extrapolated at the last points' rate;
    with more than one tensor axis, the crossed table. Across nodes, the link's bandwidth still rules."""
    from passes.analysis.estimate_costs import Collective
    from passes.analysis.machine import interpolate

    points = ((4, 1e-3), (1024, 2e-3), (1 << 20, 8e-3))
    assert interpolate(points, 1) == 1e-3 and interpolate(points, 1024) == 2e-3
    assert 2e-3 < interpolate(points, 32768) < 8e-3
    assert interpolate(points, 2 << 20) == pytest.approx(8e-3 + (1 << 20) * 6e-3 / ((1 << 20) - 1024))
    table = {"all_reduce": {2: points}}
    machine = dataclasses.replace(MACHINE, collectives=table,
                                  crossed_collectives={"all_reduce": {2: ((4, 5e-3), (1 << 20, 9e-3))}})
    c = Collective("all_reduce", "row", 2, 1024, "forward", "x")
    assert machine.seconds(ParallelConfig(1, 2, 1, 1), c) == 2e-3
    assert machine.seconds(ParallelConfig(1, 2, 2, 1), c) > 5e-3  # rows and columns: the crossed table
    assert machine.seconds(ParallelConfig(1, 2, 2, 1), dataclasses.replace(c, phase="step")) == 2e-3
    spans = ParallelConfig(1, 2, 1, 1)  # a 4-rank group over 1-GPU nodes: not measured within a node
    assert dataclasses.replace(machine, gpus_per_node=1).seconds(spans, c) == pytest.approx(
        float(c.bytes) / MACHINE.inter_bytes_per_second + MACHINE.inter_latency)
    assert machine.seconds(ParallelConfig(1, 2, 1, 1), dataclasses.replace(c, kind="all_gather")) == pytest.approx(
        float(dataclasses.replace(c, kind="all_gather").bytes) / 1e11 + 1e-5)  # kind not measured
    again = Machine.from_json(machine.to_json())  # JSON's string keys come back as group sizes
    assert again.collectives == table and again.seconds(ParallelConfig(1, 2, 1, 1), c) == 2e-3


def test_gradient_sync_is_priced_in_buckets():
    """GradSync packs gradients into 25 MiB buckets per group: 52 small all-reduces are one or two calls."""
    from passes.analysis.estimate_costs import Collective
    from passes.analysis.search_plans import BUCKET_BYTES, bucketed

    grads = [Collective("all_reduce", "data", 4, 1 << 20, "step", f"p{i}") for i in range(40)]
    depth = [Collective("all_reduce", "depth", 2, 4, "step", "q")]
    out = bucketed(grads + depth)
    assert sorted((c.axis, c.message_bytes) for c in out) == [
        ("data", 15 << 20), ("data", 25 << 20), ("depth", 4)]
    assert bucketed([Collective("all_reduce", "data", 4, 2 * BUCKET_BYTES, "step", "big")])[0].message_bytes == \
        2 * BUCKET_BYTES  # a tensor over the cap alone in its bucket


def test_the_optimizer_and_activation_traffic_are_priced_at_the_memory_rate():
    plain = _step(ParallelConfig(1, 1, 1, 1), MACHINE)
    with torch.device("meta"):
        model = MLP()
    plan, report = plan_model(model, (torch.empty(16, 64, device="meta"),), ParallelConfig(1, 1, 1, 1))
    assert report.rank_update_bytes == 4 * sum(p.numel() for p in model.parameters())
    assert report.rank_saved_bytes > 0

    timed = plan_seconds(plan, report, dataclasses.replace(MACHINE, memory_bytes_per_second=1e9))
    assert timed.optimizer == pytest.approx(7 * report.rank_update_bytes / 1e9)
    # a roofline: 16 rows of 64 -> 256 (and back) move 3 x 4 x (kn + mk + mn) bytes for 6 mkn FLOPs, so
    # at 1 TFLOP/s and 1 GB/s each matmul takes its bytes' time, not its FLOPs'
    m, k, n = 16, 64, 256
    slowdown = (12 * (k * n + m * k + m * n) / 1e9) / (6 * m * k * n / 1e12)
    assert timed.compute == pytest.approx(plain.compute * slowdown + 2 * report.rank_saved_bytes / 1e9)
    fast = plan_seconds(plan, report, dataclasses.replace(MACHINE, memory_bytes_per_second=1e15))
    assert fast.compute == pytest.approx(plain.compute + 2 * report.rank_saved_bytes / 1e15)  # FLOP-bound
    assert plan_seconds(plan, report, MACHINE).optimizer == 0  # no memory rate: not timed


def test_gradient_sync_copies_each_gradient_into_its_bucket_and_back():
    """GradSync copies each gradient into its bucket and the sum back: 4 bytes moved per gradient byte at
    the memory rate, on top of the all-reduce (mutation: without the copies FC_Net's data-parallel sync
    was predicted at 66% of its measured time)."""

    with torch.device("meta"):
        model = MLP()
    plan, report = plan_model(model, (torch.empty(16, 64, device="meta"),), ParallelConfig(2, 1, 1, 1))
    grads = sum(c.message_bytes for c in report.collectives if c.phase == "step" and c.group_size > 1)
    assert grads == 4 * sum(p.numel() for p in model.parameters())
    plain = plan_seconds(plan, report, MACHINE).sync
    timed = plan_seconds(plan, report, dataclasses.replace(MACHINE, memory_bytes_per_second=1e9)).sync
    assert timed == pytest.approx(plain + 4 * grads / 1e9)


def test_per_rank_batches_count_every_ranks_rows():
    """batch='per-rank' (DDP-style): each rank's batch is its own, so the step's FLOPs are every rank's;
    a rank computes what serial computes on its batch, not a shard of it (mutation: unscaled rows give a
    quarter of the compute)."""
    with torch.device("meta"):
        model = MLP()
    x = torch.empty(16, 64, device="meta")
    serial = _step(ParallelConfig(1, 1, 1, 1), MACHINE)
    plan, report = plan_model(model, (x,), ParallelConfig(4, 1, 1, 1), per_rank=True)
    layers = [(r.flops, plan.matmul(r.weight).orientation) for r in report.layers]
    assert step_seconds(report.collectives, layers, plan, MACHINE).compute == pytest.approx(serial.compute)


def test_a_measured_table_never_says_a_bigger_message_is_cheaper():
    """--calibrate's noisy points are made non-decreasing by least squares (pool adjacent violators):
    mutation: a running maximum would carry one slow outlier to every larger size."""
    from autopar.planning.calibrate import monotone

    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert monotone([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert monotone([1.0, 9.0, 2.0, 3.0, 10.0]) == pytest.approx([1.0, 14 / 3, 14 / 3, 14 / 3, 10.0])


def fc_net_and_tiny_llama() -> list[tuple[nn.Module, tuple]]:
    """FC_Net (4 layers of 512) and the zoo's tiny Llama on meta, each with a batch of inputs."""
    from autopar.examples import zoo
    from autopar.examples.fc_net import FC_Net

    with torch.device("meta"):
        fc = FC_Net(num_layers=4, hidden=512, image_size=28)
        llama = zoo.build_model("llama")
    return [(fc, (torch.empty(64, 784, device="meta"),)),
            (llama, tuple(t.to("meta") for t in zoo.example_inputs("llama", batch=16, seq=32)))]


@pytest.mark.parametrize("hardware,world", [("h100-80gb", 8), ("cpu", 8)])
def test_the_screened_search_finds_the_exhaustive_searchs_best(hardware, world):
    """Planning only the closed-form screen's best few grids (passes.analysis.screen) gives the best plan that
    planning every grid gives, on FC_Net and a tiny Llama (mutation: a screen without the pipelines'
    sends keeps four pipelines on an H100 and drops the tiny Llama's best, data 8)."""
    from autopar.planning.machines import load_machine
    from autopar.planning.search import search

    machine = load_machine(hardware)
    cases = fc_net_and_tiny_llama()
    for model, inputs in cases:
        every = search(model, inputs, world, machine, keep=None)
        screened = search(model, inputs, world, machine, keep=4)
        assert screened[0].candidate == every[0].candidate, (type(model).__name__, screened[:4], every[:4])
        assert screened[0].seconds == pytest.approx(every[0].seconds)
        # (each kept pipeline grid is planned under both schedules: 1F1B's and the interleaved one)
        assert len(screened) == len(every) and sum(s.time is not None for s in screened) <= 2 * 4


def test_a_pipeline_rank_holds_its_stages_memory():
    """The search judges a pipeline by what one of its ranks holds: its stages' parameters, gradients
    and optimizer state, and the micro-batches 1F1B keeps in flight there; the outputs and the loss on the
    last rank only (the plan's own memory plan is the rank that needs the most).
    Mutation: the outputs kept on every rank in flight put the logits in rank 0's activations."""
    import transformers

    from autopar.examples import zoo

    with torch.device("meta"):
        llama = zoo.build_model("llama", layers=8)
        wide = transformers.LlamaForCausalLM(dataclasses.replace(llama.config, vocab_size=4 * llama.config.vocab_size))
    inputs = tuple(t.to("meta") for t in zoo.example_inputs("llama", batch=8, seq=16))
    four = ParallelConfig(1, 1, 1, 1, pipeline=4)
    h100 = Hardware()  # the stages as an H100 cuts them (the embedding alone on rank 0), on any machine
    plan, report = plan_model(llama, inputs, four, pipeline=4, microbatches=8, hardware=h100)
    stage, whole = report.rank_memory, plan.memory
    assert stage.param_bytes < whole.param_bytes / 2
    _, last = plan_model(llama, inputs, four, rank=3, pipeline=4, microbatches=8, hardware=h100)
    # a micro-batch's logits (1 x 16 x vocab) are the last rank's alone: 4x the vocabulary leaves rank 0's
    # activations as they were (its stages are the same) and grows the last rank's by 3x the logits
    logits = 16 * llama.config.vocab_size * 4
    assert logits <= last.rank_memory.activation_bytes
    wide_plan, wide_first = plan_model(wide, inputs, four, pipeline=4, microbatches=8, hardware=h100)
    _, wide_last = plan_model(wide, inputs, four, rank=3, pipeline=4, microbatches=8, hardware=h100)
    assert wide_plan.pipeline.stages[0].segments == plan.pipeline.stages[0].segments
    assert wide_first.rank_memory.activation_bytes == stage.activation_bytes
    assert wide_last.rank_memory.activation_bytes >= last.rank_memory.activation_bytes + 3 * logits
    assert stage.optimizer_bytes == pytest.approx(2 * stage.param_bytes, abs=2)
    assert report.segments >= 8


def test_a_pipeline_is_scored_by_its_slowest_rank():
    """plan_model(rank=SLOWEST) reports the pipeline rank whose stages compute most, not rank 0 (which
    may hold the embedding alone: it computed no matmul, and made every pipeline look fast)."""
    from autopar.examples import zoo
    from autopar.planning.planner import SLOWEST

    with torch.device("meta"):
        llama = zoo.build_model("llama", layers=8)
    inputs = tuple(t.to("meta") for t in zoo.example_inputs("llama", batch=8, seq=16))
    config = ParallelConfig(1, 1, 1, 1, pipeline=4)
    flops = [plan_model(llama, inputs, config, rank=r, pipeline=4, microbatches=8)[1].rank_flops for r in range(4)]
    _, slowest = plan_model(llama, inputs, config, rank=SLOWEST, pipeline=4, microbatches=8)
    assert slowest.rank_flops == max(flops) > flops[0]


def test_half_precision_halves_the_activations_collectives_only():
    """Under bf16/fp16 autocast an activation's all-reduce moves bf16; depth's weight gathers and
    gradient reduce-scatters, the per-call check and the gradient sync stay fp32."""
    from passes.analysis.estimate_costs import Collective
    from passes.analysis.search_plans import halved

    assert halved(Collective("all_reduce", "col", 2, 1024, "forward", "x")).message_bytes == 512
    assert halved(Collective("send", "pipeline", 2, 1024, "backward", "x")).message_bytes == 512
    for c in (Collective("all_gather", "depth", 2, 1024, "forward", "w"),
              Collective("all_reduce", "data", 2, 1024, "step", "w"),
              Collective("all_gather", "world", 4, 64, "forward", "<agreement>")):
        assert halved(c) == c


@pytest.mark.slow
def test_grids_with_as_many_rows_per_shard_share_a_capture_and_score_as_alone():
    """The search captures each row count once (a capture of the cut model costs ~50 graph copies) and
    gives each grid a copy recording its own split: every grid of 4 ranks, pipelines and uneven shards
    (a batch of 6 rows) included, scores exactly as when captured on its own. Mutation: sharing the
    capture without its own split (the first grid's BatchInfo) changes the uneven grids' scores."""
    from autopar.planning import planner
    from autopar.examples import zoo
    from autopar.planning.search import score

    machine = load_machine("h100-80gb")
    with torch.device("meta"):
        llama = zoo.build_model("llama", layers=6)
    inputs = tuple(t.to("meta") for t in zoo.example_inputs("llama", batch=6, seq=16))
    captured = []
    real = planner.capture_shard
    planner.capture_shard = lambda *a, **k: captured.append((a[4] or (None,))[a[5]]) or real(*a, **k)
    try:
        shared: dict = {}
        grids = candidates(4, 6)
        # and the variants the search retries on its planned grids (the optimizer state split over data,
        # sequence parallelism), in half precision too: grids alike in their capture share its meta memory
        # run, the layouts make_plan propagates and the whole-model expansion (keyed by what they depend on)
        alone_grids = [c for c in grids if c.pipeline == 1]
        grids += [dataclasses.replace(c, shard_optimizer=True) for c in alone_grids if c.data > 1]
        grids += [dataclasses.replace(c, sequence_parallel=True) for c in alone_grids if (c.row > 1) != (c.col > 1)]
        precisions = ["fp32"] * len(grids) + ["bf16"] * len(alone_grids)
        grids += alone_grids
        together = [score(llama, inputs, c, machine, captures=shared, precision=p) for c, p in zip(grids, precisions)]
        rows = list(captured)
        alone = [score(llama, inputs, c, machine, captures={}, precision=p) for c, p in zip(grids, precisions)]
    finally:
        planner.capture_shard = real
    assert len(rows) == len(set(rows)) < len(grids) / 3, rows  # one capture per row count
    assert any(len(set(c.config.batch_sizes(6))) > 1 for c in grids)  # uneven shards are among them
    for c, a, b in zip(grids, together, alone):
        assert (a.time, a.memory_bytes, a.fits, a.recompute, a.reason) == (b.time, b.memory_bytes, b.fits,
                                                                            b.recompute, b.reason), c


def test_the_screen_prices_alike_with_its_memo_shared_and_alone():
    """The search's screen keeps what grids share in one memo (links, collective prices, a matmul's tensor
    collectives by tensor axes and rows, FLOPs and the roofline by grid shape): every grid of 64 ranks of a
    tiny Llama, full and half precision, on a machine whose nodes hold 4 GPUs (tensor groups cross nodes),
    screens bitwise as with a memo of its own, and as ``screen_grids`` screens them all at once (grids of the
    same degrees sharing their pricing). Mutation: the tensor collectives kept without the col degree, the
    roofline without the micro-batches, or screen_grids' groups keyed without the optimizer state's split,
    changed grids' prices."""
    from autopar.examples import zoo
    from passes.analysis.screen import screen_grids, screen_pair, shape_of

    machine = dataclasses.replace(load_machine("a100-80gb"), gpus_per_node=4)
    with torch.device("meta"):
        llama = zoo.build_model("llama", layers=8)
    inputs = tuple(t.to("meta") for t in zoo.example_inputs("llama", batch=64, seq=32))
    _, probe = plan_model(llama, inputs, ParallelConfig(64, 1, 1, 1), checkpoint="none")
    shape = shape_of(probe, 64)
    grids = candidates(64, 64)
    assert len({(c.row, c.col, c.depth) for c in grids}) > 10 and any(c.pipeline > 1 for c in grids)
    for half in (False, True):
        shared: dict = {}
        together = [screen_pair(shape, c, machine, half, shared) for c in grids]
        for c, t in zip(grids, together):
            assert t == screen_pair(shape, c, machine, half, {}), (c, half)
        mixed = grids + [dataclasses.replace(c, shard_optimizer=True) for c in grids if c.data > 1]
        assert screen_grids(shape, mixed, machine, half) == [screen_pair(shape, c, machine, half, {}) for c in mixed]


def test_the_search_leaves_the_garbage_collector_as_it_found_it():
    """The search freezes the process's objects for the collector while it runs (its passes then skip
    them) and unfreezes them after; a process that froze objects itself keeps them frozen. Mutation:
    leaving them frozen would keep every object alive till the process ends."""
    import gc

    from autopar.planning.search import search

    with torch.device("meta"):
        model = MLP()
    inputs = (torch.empty(16, 64, device="meta"),)
    assert gc.get_freeze_count() == 0
    search(model, inputs, 2, MACHINE)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        search(model, inputs, 2, MACHINE)
        assert gc.get_freeze_count() > frozen // 2  # (some frozen objects are freed meanwhile)
    finally:
        gc.unfreeze()


def test_a_pipeline_fits_when_its_fullest_rank_does():
    """A pipeline's step is its slowest rank's, but it fits memory only if every rank does: FC_Net's
    slowest rank (two blocks and the output layer) holds less than the one with a block and 3 of the 16
    micro-batches in flight. Between the two the grid does not fit (mutation: judging the slowest rank's
    memory, as the search did, says it fits; BLOOM's published grid then fitted 80 GB on paper while its
    first rank needed 88 GiB)."""
    from autopar.examples.fc_net import FC_Net
    from autopar.planning.search import score
    from autopar.planning.planner import SLOWEST

    with torch.device("meta"):
        model = FC_Net(num_layers=3, hidden=256, image_size=28)
    inputs = (torch.empty(256, 784, device="meta"),)
    config = ParallelConfig(1, 1, 1, 1, pipeline=4)
    peaks = []
    for rank in (*range(4), SLOWEST):
        _, report = plan_model(model, inputs, config, rank=rank, pipeline=4, microbatches=16, checkpoint="none")
        peaks.append(report.rank_memory.static_bytes + report.rank_memory.activation_bytes)
    *ranks, slowest = peaks
    assert slowest < max(ranks)
    machine = dataclasses.replace(MACHINE, memory_bytes=(slowest + max(ranks)) // 2)
    scored = score(model, inputs, Candidate(1, 4, 1, 1, 1, microbatches=16), machine, checkpoint="none")
    assert scored.memory_bytes == max(ranks) and not scored.fits, scored
    assert score(model, inputs, Candidate(1, 4, 1, 1, 1, microbatches=16),
                 dataclasses.replace(machine, memory_bytes=max(ranks)), checkpoint="none").fits


def test_interleaved_in_flight_micro_batches_follow_torchs_schedule():
    """What each rank holds per chunk under Interleaved1F1B (``inflight_microbatches``) against the order
    torch's own schedule computes for that rank (its action list, replayed: a forward adds a micro-batch
    to its chunk, a backward frees one), over pipelines of 2-8 ranks, 2-3 chunks and 1-4 rounds
    (mutation: backwards taking the chunks in forward order fails)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    from passes.analysis.choose_stages import inflight_microbatches

    def torchs(p: int, m: int, rank: int, v: int) -> tuple[int, ...]:
        schedule = object.__new__(ScheduleInterleaved1F1B)  # the order alone: no stages, no process group
        schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = v, p, m
        schedule.number_of_rounds = max(1, m // p)
        schedule.microbatches_per_round = m // schedule.number_of_rounds
        held, most = [0] * v, [0] * v
        for action in schedule._calculate_single_rank_operations(rank):
            if action is None:
                continue
            kind, chunk = str(action.computation_type), action.stage_index // p
            held[chunk] += 1 if kind.endswith("F") or "FORWARD" in kind else -1
            most[chunk] = max(most[chunk], held[chunk])
        return tuple(most)

    cases = 0
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p, 4 * p):
            for v in (2, 3):
                for rank in range(p):
                    assert inflight_microbatches(p, m, rank, v) == torchs(p, m, rank, v), (p, m, rank, v)
                    cases += 1
    assert cases == 136
    assert inflight_microbatches(4, 8, 0) == (4,) and inflight_microbatches(4, 8, 3) == (1,)  # 1F1B


def test_while_no_planned_grid_fits_the_search_plans_the_next_ones(monkeypatch):
    """The screen prices parameters, not activations, so under tight memory its best grids may all not
    fit where later ones do: the search then plans the screen's next grids, ROUNDS x keep in all
    (mutation: one round reports no fitting grid for FC_Net on 8 ranks with ~18 MiB per device)."""
    import autopar.planning.search as P
    from autopar.examples.fc_net import FC_Net

    with torch.device("meta"):
        model = FC_Net(num_layers=4, hidden=512, image_size=28)
    inputs = (torch.empty(64, 784, device="meta"),)
    h100 = load_machine("h100-80gb")
    tight = P.score(model, inputs, Candidate(1, 2, 1, 2, 2, microbatches=8, chunks=2), h100).memory_bytes
    machine = dataclasses.replace(h100, memory_bytes=tight)
    monkeypatch.setattr(P, "ROUNDS", 1)
    # depth 2 splits the batch, whose rows are FC_Net's tokens, so no grid splits its activations along them
    # (sequence parallelism made a first-round grid fit), and pipeline 2 keeps a first round that does not fit
    fixed = {"depth": 2, "pipeline": 2}
    assert not P.search(model, inputs, 8, machine, keep=2, fixed=fixed)[0].fits
    monkeypatch.undo()
    ranked = P.search(model, inputs, 8, machine, keep=2, fixed=fixed)
    assert ranked[0].fits and ranked[0].memory_bytes <= tight, ranked[0]
    assert 2 < sum(s.time is not None for s in ranked) <= P.ROUNDS * 2


def test_the_screens_memory_is_a_floor_of_the_planned_memory():
    """The screen's memory per device (parameters, gradients, optimizer state, and the least activations
    any recomputation keeps) is never above what planning the grid finds with every block recomputed,
    over every grid of 8 ranks for FC_Net and a tiny Llama (mutation: activations not split over the
    tensor ranks exceed it on tensor grids), and counts activations (more than the static bytes)."""
    from autopar.planning.search import score
    from passes.analysis.screen import screen, shape_of

    h100 = load_machine("h100-80gb")
    cases = fc_net_and_tiny_llama()
    for model, inputs in cases:
        _, probe = plan_model(model, inputs, ParallelConfig(8, 1, 1, 1), checkpoint="none")
        shape = shape_of(probe, 8)
        above_static = 0
        for c in candidates(8, int(inputs[0].shape[0])):
            floor = screen(shape, c, h100)[1]
            planned = score(model, inputs, c, h100, checkpoint="full")
            if planned.time is None:
                continue
            assert floor <= planned.memory_bytes, (type(model).__name__, c, floor, planned.memory_bytes)
            above_static += floor > 4 * (shape.param_bytes // (c.row * c.col * c.depth * c.pipeline))
        assert above_static, type(model).__name__


def test_attention_products_are_priced_on_the_heads_and_rows_a_rank_holds():
    """The attention's score and ``p v`` products, in no linear layer's FLOPs, are priced at the matmul
    rate: ``2 b h s s (d + d_v)`` forward, halved for causal attention (fused kernels skip the masked
    blocks; the captured HF mask runs as ``is_causal``), 3.5x that for forward and backward (backward
    recomputes the scores); split over the heads a tensor rank holds and the rows of its batch shard.
    Mutation: leaving them out prices 1,024 tokens as if attention cost nothing."""
    from autopar.examples import zoo
    from passes.analysis.graph_facts import ATTENTION_STEP_FACTOR

    with torch.device("meta"):
        llama = zoo.build_model("llama", layers=2)
    heads, hidden = llama.config.num_attention_heads, llama.config.hidden_size
    for seq in (16, 256):
        inputs = tuple(t.to("meta") for t in zoo.example_inputs("llama", batch=4, seq=seq))
        one_plan, one = plan_model(llama, inputs, ParallelConfig(1, 1, 1, 1))
        forward = 2 * 2 * 4 * heads * seq * seq * (2 * hidden // heads) // 2  # 2 layers, causal
        assert one.rank_attention_flops == ATTENTION_STEP_FACTOR * forward
        for config in (ParallelConfig(1, 2, 1, 1), ParallelConfig(2, 1, 1, 1), ParallelConfig(1, 1, 1, 2)):
            assert plan_model(llama, inputs, config)[1].rank_attention_flops == one.rank_attention_flops / 2, config
        without = dataclasses.replace(one, rank_attention_flops=0.0)
        extra = plan_seconds(one_plan, one, MACHINE).compute - plan_seconds(one_plan, without, MACHINE).compute
        assert extra == pytest.approx(one.rank_attention_flops / MACHINE.flops_per_second)


def test_ranks_sharing_cores_reach_each_collective_late_by_at_most_a_time_slice():
    """Where a node's ranks outnumber its cores, each blocking collective costs ``min(stretch, skew)`` on
    top of its own time (the last rank arrives late by up to a scheduler slice, never by more than the
    compute since the last call); nothing with a core or a device per rank, or with no skew measured.
    Timed inside real steps on 4 ranks sharing 2 cores: GPT-2's tensor (4, 1, 1) spent 165 ms in its 27
    stretches of compute until the last rank arrived against 100 ms for the mean rank. Mutation: no
    skew term predicts every grid of the benchmark's transformers below 70-86% of measured."""
    from autopar.examples import zoo
    from passes.analysis.search_plans import arrival_skew

    four = ParallelConfig(1, 4, 1, 1)
    shared = dataclasses.replace(MACHINE, cores=2, skew_seconds=0.002, gpus_per_node=4)
    assert arrival_skew(10, 0.1, shared, four) == pytest.approx(0.02)  # long stretches: the skew each
    assert arrival_skew(10, 0.005, shared, four) == pytest.approx(0.005)  # short ones: at most the stretch
    for machine in (dataclasses.replace(shared, cores=4), dataclasses.replace(shared, cores=0),
                    dataclasses.replace(shared, skew_seconds=0.0)):
        assert arrival_skew(10, 0.1, machine, four) == 0
    assert arrival_skew(0, 0.1, shared, four) == 0

    with torch.device("meta"):
        llama = zoo.build_model("llama", layers=2)
    inputs = tuple(t.to("meta") for t in zoo.example_inputs("llama", batch=8, seq=16))
    counted = []
    for config in (four, ParallelConfig(4, 1, 1, 1)):  # (data: the outputs' gathers block too)
        plan, report = plan_model(llama, inputs, config)
        calls = sum(c.group_size > 1 and c.phase != "step" for c in report.collectives)
        counted.append(calls)
        slow, fast = (plan_seconds(plan, report, m) for m in (shared, dataclasses.replace(shared, skew_seconds=0.0)))
        assert slow.communication - fast.communication == pytest.approx(
            calls * min(slow.compute / calls, 0.002) if calls else 0.0)
    assert counted[0] > counted[1]


def test_stage_imbalance_is_the_busiest_pipeline_ranks_share():
    """The screen's pipeline ranks get the blocks as the planner's exact cut gives them: 128 equal blocks and
    a head half a block's size cannot split evenly over 64 stages (2.5 blocks on the head's, 2.008 on
    average); equal blocks that divide split evenly. Mutation: the screen without it ranked the 1T GPT's
    interleaved (2, 4, 1) grid above the published one (tests/passes/test_published_plans.py)."""
    from passes.analysis.screen import stage_imbalance

    chain = [0.0] + [1.0] * 128 + [0.5]
    assert stage_imbalance(chain, 64) == pytest.approx(2.5 / (128.5 / 64))
    assert stage_imbalance(chain, 128) == pytest.approx(1.5 / (128.5 / 128))
    assert stage_imbalance(chain, 64, chunks=2) == pytest.approx(2.5 / (128.5 / 64))  # 1.5 + 1.0 on one rank
    assert stage_imbalance([1.0] * 8, 4) == 1.0 and stage_imbalance(chain, 1) == 1.0


def test_grids_are_every_factoring_of_the_world_in_order():
    """candidates enumerates the factorings of the world size directly (3,072's 26 divisors make 11.9
    million 5-tuples to filter); the grids and their order are what filtering the product gave."""
    import itertools

    for world in (1, 7, 12, 96, 1536):
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        expected = [d for d in itertools.product(divisors, repeat=5) if math.prod(d) == world]
        got = [(c.data, c.pipeline, c.row, c.col, c.depth) for c in candidates(world, world, max_microbatches=1,
                                                                               chunks=(1,))]
        assert list(dict.fromkeys(got)) == expected, world


def test_the_search_splits_the_optimizer_state_over_data_only_where_memory_needs_it():
    """FC_Net's tutorial shape (143M parameters) on 4 data ranks: 16 bytes a parameter fit 3 GiB, not 1.5 GiB;
    with Adam's moments split over data (ZeRO stage 1) it fits, predicted slower (the parameters' all-gather)."""
    from autopar.examples.fc_net import build_model, example_inputs
    from autopar.planning.search import search

    with torch.device("meta"):
        model = build_model()
    x = example_inputs()[0].to("meta")
    picks = {}
    for gib in (3, 1.5):
        best = search(model, (x,), 4, dataclasses.replace(MACHINE, memory_bytes=int(gib * 2**30)),
                      fixed={"data": 4})[0]
        assert best.fits, best
        picks[gib] = best
    assert not picks[3].candidate.shard_optimizer and picks[1.5].candidate.shard_optimizer
    assert picks[1.5].candidate.describe().endswith(" shard_optimizer")
    assert picks[1.5].seconds > picks[3].seconds and picks[1.5].memory_bytes < picks[3].memory_bytes - 2**29
    # the screen agrees: less memory, more time
    from passes.analysis.screen import screen, shape_of
    _, probe = plan_model(model, (x,), ParallelConfig(4, 1, 1, 1), checkpoint="none")
    shape = shape_of(probe, 4)
    whole, split = (screen(shape, Candidate(4, 1, 1, 1, 1, shard_optimizer=s), MACHINE) for s in (False, True))
    assert split[1] < whole[1] * 0.7 and split[0] > whole[0]


def test_the_screen_keeps_a_matmul_whole_where_the_tensor_axes_divide_none_of_its_features():
    """make_plan leaves a matmul replicated when neither orientation splits its features evenly: the screen
    prices its FLOPs and its weight unsplit (the 1T GPT's 25,600 features at tensor 6 planned 12 grids in vain)."""
    from passes.analysis.screen import ModelShape, screen

    flops = 2 * 4096 * 600 * 600 * 3.0
    shape = ModelShape(((4096, 600, 600, 0, 8, 8 * flops), (4096, 600, 600, 1, 8, 8 * flops)), 16 * 600 * 600 * 4,
                       0, 0, 8)
    machine = dataclasses.replace(MACHINE, memory_bytes=2**40)
    (t4, m4), (t7, m7) = (screen(shape, Candidate(1, 1, 1, n, 1), machine) for n in (4, 7))  # 600 = 4 x 150, not 7 x
    assert m7 >= 2 * 16 * 600 * 600 * 4 > m4  # the weights (and their gradients) whole on every rank
    assert t7 > 1.5 * t4


def test_context_degrees_are_tried_for_long_sequences_only():
    from passes.analysis.search_plans import CONTEXT_FROM, context_degrees

    assert context_degrees(8, CONTEXT_FROM // 2) == ()
    assert context_degrees(8, 16384) == (2, 4, 8)
    assert context_degrees(8, 16386) == ()  # (2C chunks must divide the sequence)
    assert context_degrees(256, 16384) == (2, 4, 8, 16)  # (at least CONTEXT_TOKENS per rank)
    assert context_degrees(64, 131072) == (2, 4, 8, 16, 32, 64)


def test_context_grids_come_with_and_without_a_pipeline_and_keep_the_fixed_degrees():
    plain = candidates(8, 8)
    both = candidates(8, 8, contexts=(2, 4))
    split = [c for c in both if c.context > 1]
    assert [c for c in both if c.context == 1] == plain
    assert {c.context for c in split} == {2, 4}
    assert all(not c.expert_parallel and c.config.world_size == 8 for c in split)
    # each context degree on every grid of the other ranks, pipelines (and their micro-batch counts) included
    for context in (2, 4):
        assert [dataclasses.replace(c, context=1) for c in split if c.context == context] == candidates(8 // context, 8)
    assert any(c.pipeline > 1 for c in split)
    assert all(c.context == 2 for c in candidates(8, 8, fixed={"context": 2}, contexts=(2, 4)))
    assert candidates(8, 8, fixed={"context": 1}, contexts=(2, 4)) == plain
    assert all(c.pipeline == 2 for c in candidates(8, 8, fixed={"pipeline": 2}, contexts=(2, 4)))
    assert all(c.row == 2 for c in candidates(8, 8, fixed={"context": 2, "row": 2}))
    assert "context=2" in split[0].describe()


def test_context_grids_carry_the_expert_layouts():
    """A model with routed experts: each context degree's grids come with the same expert layouts as the grids
    without context (whole over data, over data x tensor), the exchange among one context rank's data ranks."""
    both = candidates(8, 8, experts=(8,), contexts=(2,))
    split = [c for c in both if c.context == 2]
    assert [dataclasses.replace(c, context=1) for c in split] == candidates(4, 8, experts=(8,))
    layouts = {(c.data, c.row, c.expert_parallel) for c in split if c.pipeline == 1 and c.col == c.depth == 1}
    assert {(4, 1, True), (2, 2, "data+tensor")} <= layouts, layouts
    assert not any(c.expert_parallel for c in candidates(8, 8, experts=(8,), contexts=(2,), expert_parallel=False))
