"""``passes.split_context`` on captured models (pure: no process group): where this rank's tokens begin (the
token ids an embedding reads), that every attention becomes ``context_attention`` and the loss a reduction over
the context ranks, with no whole-sequence gather in HF's decoder families, BERT and GPT-2 (learned positions);
a model whose attention is written out (GPT-Neo's matmuls) reads the whole sequence there instead; a sequence
that does not split runs whole (one note) with its outputs still marked; dropout in training draws the whole
tensor's mask."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import passes.ir as ir
from autopar.capture import capture_shard, meta_shadow, split_batch_leaves
from autopar.compat import pytree
from autopar.config import ParallelConfig
from autopar.errors import PlanError
from autopar.examples import zoo
from autopar.planning.planner import PlanOptions, decide_plan
from autopar.runtime.execution.builder import PASSES
from passes.runner import run_passes

MARKERS = {ir.context_slice: "slice", ir.context_gather: "gather", ir.context_attention: "attention",
           ir.context_output: "output", ir.context_reduce: "reduce", ir.batch_reduce: "batch_reduce"}


def _emitted(name: str, config: ParallelConfig, seq: int = 16, dropout: bool = False):
    torch.manual_seed(0)
    model = zoo.build_model(name, dropout=dropout)
    ids = zoo.example_inputs(name, seq=seq)[0]
    kwargs = {**zoo.example_kwargs(name, seq=seq), "labels": ids, "use_cache": False}
    if name in zoo.ENCODERS:
        kwargs.pop("use_cache")
    leaves, spec = pytree.tree_flatten(((ids,), kwargs))
    split, batch = split_batch_leaves(leaves, config.num_batch_shards)
    cap = capture_shard(meta_shadow(model), leaves, spec, split, config.batch_sizes(batch) if split else (), 0,
                        requires_grad={n: True for n, _ in model.named_parameters()})
    plan = decide_plan(cap.gm, config, PlanOptions(checkpoint="none"))
    gm, records = run_passes(cap.gm, plan, PASSES)
    found = Counter(MARKERS[n.target] for n in gm.graph.nodes if n.target in MARKERS)
    notes = [n for r in records if r.name == "split_context" for n in r.notes]
    return gm, found, notes


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "bert"])
def test_decoders_and_encoders_split_every_op_and_gather_only_keys_and_values(name):
    gm, found, notes = _emitted(name, ParallelConfig(context=2))
    assert found["attention"] == zoo.LAYERS and found["gather"] == 0, found
    assert found["batch_reduce"] == 1 and found["output"] == 2 and not notes, (found, notes)
    attention = [n for n in gm.graph.nodes if n.target is ir.context_attention]
    assert all(n.args[-1].gather_kv and n.args[-1].tokens == 16 for n in attention)
    assert {n.args[-1].is_causal for n in attention} == {name != "bert"}


@pytest.mark.parametrize("name, tensor", [("llama", (2, 1, 1)), ("qwen3", (1, 2, 1)), ("gpt2", (2, 1, 1))])
def test_with_sequence_parallelism_the_tokens_gather_over_tensor_is_cut_to_this_ranks(name, tensor):
    """Sequence parallelism's gathers and scatters of the tokens over a tensor axis (``convert_layout``) name the
    tokens' size: cut to this rank's, they split like any op (they were whole-sequence reads, gathered over
    context, which the tokens split over the tensor axis too did not fit: an index error at run time); GPT-2's
    positions' lookup scatters this rank's tokens, its ids cut."""
    gm, found, notes = _emitted(name, ParallelConfig(row=tensor[0], col=tensor[1], context=2, sequence_parallel=True))
    assert found["attention"] == zoo.LAYERS and found["gather"] == 0 and not notes, (found, notes)
    converts = [n.args[-1] for n in gm.graph.nodes if n.target is ir.convert_layout]
    # the tokens' dim: dim 1 of [batch 4, 16 tokens, features], or dim 0 of GPT-2's [4 x 16 rows, features]
    dim, whole = (0, 64) if name == "gpt2" else (1, 16)
    tokens = [s.parts for c in converts for s in (c.src, c.dst) if not s.is_replicated and s.dim == dim]
    assert (whole // 2,) in tokens and (whole,) not in tokens, tokens  # (GPT-2's [4, 16, 32] split on its 4 rows)


def test_with_a_tensor_grid_the_vocabulary_split_loss_is_completed_over_context():
    gm, found, _ = _emitted("llama", ParallelConfig(row=2, context=2))
    assert found["attention"] == zoo.LAYERS and found["gather"] == 0, found
    (loss,) = [n for n in gm.graph.nodes if n.target is ir.vocab_cross_entropy]
    assert loss.args[-1].reduction == 0
    (reduce,) = [n for n in gm.graph.nodes if n.target is ir.batch_reduce]
    assert reduce.args[-1].context and reduce.args[0] is loss


def test_attention_written_as_matmuls_reads_the_whole_sequence():
    _, found, _ = _emitted("gpt-neo", ParallelConfig(context=2))
    assert found["attention"] == 0 and found["gather"] > 0, found


def test_a_sequence_that_does_not_split_runs_whole_with_a_note():
    _, found, notes = _emitted("llama", ParallelConfig(context=4), seq=12)
    assert found["slice"] == found["attention"] == 0 and found["output"] == 2, found
    assert notes and "12 tokens" in notes[0] and "multiple of 8" in notes[0]


@pytest.mark.parametrize("tensor", [(1, 1), (2, 1), (1, 2)])
def test_dropout_on_this_ranks_tokens_draws_the_whole_mask_and_sdpas_reads_the_whole_sequence(tensor):
    """GPT-2 with every dropout on: the hidden dropouts become ``context_dropout`` (with their piece over the tensor
    axis: the tokens' rows over row cut to this rank's under sequence parallelism), SDPA's attention dropout reads
    the whole sequence (a note). Under sequence parallelism the attention's whole output meets the residual
    stream through the output projection, which reduce-scatters its rows over row (and the positions through a
    scatter): their inputs are cut to this rank's tokens before (before 2026-12-06 the scattered rows were cut as
    if whole: an index error at run time)."""
    config = ParallelConfig(row=tensor[0], col=tensor[1], context=2, sequence_parallel=tensor != (1, 1))
    gm, found, notes = _emitted("gpt2", config, dropout=True)
    dropouts = [n.args[-1] for n in gm.graph.nodes if n.target is ir.context_dropout]
    whole = [n for n in gm.graph.nodes if n.target in (ir.split_dropout, torch.ops.aten.dropout.default)]
    # (the embeddings' and each block's two residual dropouts; the attention's, after its whole output's
    # projection (and under sequence parallelism, the tokens over row: cut before the projection), may draw whole)
    assert len(dropouts) + len(whole) == 1 + 2 * zoo.LAYERS and len(dropouts) >= 1 + zoo.LAYERS, (dropouts, whole)
    assert all(d.tokens.ranks == 2 and d.tokens.tokens == 16 for d in dropouts), dropouts
    pieces = {d.piece for d in dropouts if d.piece is not None}
    assert all(p.dim != 1 or p.parts == (8,) for p in pieces), pieces  # (the tokens over row: this rank's 8)
    assert len(notes) == 1 and "attention's dropout, drawn whole" in notes[0], notes
    scattered = {ir.sharded_matmul, ir.convert_layout}
    assert not any(n.target is ir.context_slice and n.args[0].target in scattered for n in gm.graph.nodes)


def _priced(config: ParallelConfig, seq: int = 256, layers: int = 4, repeat: bool = True):
    from autopar.planning.planner import plan_model

    with torch.device("meta"):
        torch.manual_seed(0)
        model = zoo.build_model("llama", layers=layers)
    ids = torch.empty(2, seq, dtype=torch.long, device="meta")
    return plan_model(model, (ids,), config, kwargs={"labels": ids, "use_cache": False}, checkpoint="none",
                      repeat=repeat)


def test_a_plan_of_repeated_blocks_prices_every_blocks_key_value_gathers():
    """A model of many alike blocks is planned from a capture of three, the rest copied by name
    (``repeat_blocks``): each block's key and value gathers are copied with it (they were named ``<context>``
    alone, so 8 layers were priced as 3: Llama-3-8B's gathers at a third), and its attentions' shapes for the
    search's screen (``StepReport.attention_kv``)."""
    cut = _priced(ParallelConfig(context=2), layers=8)[1]
    whole = _priced(ParallelConfig(context=2), layers=8, repeat=False)[1]
    def gathers(report):
        return sorted((x.kind, x.where, x.message_bytes) for x in report.collectives if x.axis == "context")
    assert gathers(cut) == gathers(whole)
    # k and v: gathered in forward and again in backward, their gradients reduce-scattered
    assert sum(x.where.endswith("<context>") for x in cut.collectives) == 8 * 2 * 3
    assert cut.attention_kv == whole.attention_kv and len(cut.attention_kv) == 16


def test_the_plan_prices_this_ranks_tokens_and_the_key_value_gathers():
    """Activations and FLOPs per rank fall with the context degree (attention keeps this rank's tokens of the keys
    and values); each attention all-gathers its keys and values over context in forward and again in backward, and
    reduce-scatters their gradients; gradients are summed over data x context. (Measured on this CPU at 1,024
    tokens, 4 layers: activations 23.1 MB serial, 14.8 at context 2 and 9.5 at context 4; the plan 8% and 6%
    under.)"""
    plain, plain_report = _priced(ParallelConfig())
    plans = {c: _priced(ParallelConfig(context=c)) for c in (2, 4)}
    for c, (plan, report) in plans.items():
        ratio = plan.memory.activation_bytes / plain.memory.activation_bytes
        assert 1 / c < ratio < 1 / c + 0.25, (c, ratio)
        gathers = [x for x in report.collectives if x.axis == "context"]
        # k and v whole, 4 layers x batch 2 x 4 heads of 8 (HF repeats the 2 key/value heads before attention, and
        # what attention reads is gathered) x 256 tokens x fp32
        kv = 2 * 4 * 2 * 4 * 8 * 256 * 4
        assert sum(x.message_bytes for x in gathers if x.phase == "forward" and x.where.endswith("<context>")) == kv
        # backward: gathered again (attention keeps this rank's tokens of them), their gradients reduce-scattered
        assert {x.kind for x in gathers if x.phase == "backward"} == {"all_gather", "reduce_scatter"}
        assert sum(x.message_bytes for x in gathers if x.phase == "backward" and x.kind == "all_gather") == kv
        assert all("context" in x.axis.split("+") and x.group_size == c for x in report.collectives
                   if x.phase == "step")
    assert plans[4][0].memory.activation_bytes < plans[2][0].memory.activation_bytes


def test_the_plan_says_and_prices_what_reads_the_whole_sequence():
    """What ``split_context`` would run whole is in the plan (``Plan.context_whole``): its note, and priced whole.
    GPT-Neo's written-out attention computes every context rank's tokens from its scores to its output, which is
    cut before the output projection (the projection runs on this rank's tokens: before 2026-12-06 after it, C
    times its work); the activations it saves are whole. GPT-2 with dropout reads the whole sequence in SDPA (its
    attention dropout): its attention FLOPs count C times this rank's share. Before 2026-12-06 the plan priced them
    at 1/C and said nothing (the notes came at run time only). Mutation: the plan blind to them prices less."""
    import autopar.planning.planner as planner
    from passes.analysis.choose_stages import Hardware
    from passes.analysis.report import estimate_step_seconds

    def priced(name: str, blind: bool = False):
        with torch.device("meta"):
            torch.manual_seed(0)
            model = zoo.build_model(name, layers=4, dropout=name == "gpt2")
        ids = torch.empty(2, 64, dtype=torch.long, device="meta")
        original = planner.whole_reads
        if blind:  # mutation: the plan blind to what reads the whole sequence
            planner.whole_reads = lambda gm, ranks: ((), ())
        try:
            return planner.plan_model(model, (ids,), ParallelConfig(context=2),
                                      kwargs={"labels": ids, "use_cache": False}, checkpoint="none")
        finally:
            planner.whole_reads = original

    hardware = Hardware(1e12, 1e10, 1e10)
    plan, report = priced("gpt-neo")
    assert any("attn.attention reads the whole sequence (matmul)" in n for n in plan.notes), plan.notes
    assert plan.context_whole and not any(r.all_tokens for r in report.layers)  # (out_proj: this rank's tokens)
    blind = priced("gpt-neo", blind=True)[0]
    assert plan.memory.activation_bytes > 1.2 * blind.memory.activation_bytes
    plan, report = priced("gpt2")
    assert any("attention's dropout, drawn whole" in n for n in plan.notes), plan.notes
    blind, blind_report = priced("gpt2", blind=True)
    assert report.rank_attention_flops == 2 * blind_report.rank_attention_flops > 0
    assert estimate_step_seconds(report, plan, hardware) > estimate_step_seconds(blind_report, blind, hardware)
    llama, llama_report = priced("llama")
    assert not llama.context_whole and not any("whole sequence" in n for n in llama.notes)


def test_the_screen_prices_what_a_context_degree_leaves_whole():
    """The search's screen reads what a context degree leaves whole from a plan at the least degree it tries
    (``screen.with_context_whole``): GPT-2 with its attention dropout read whole (SDPA's) has that attention's FLOPs
    there, and a context grid screens slower than blind to them; Llama has none (its screen is unchanged)."""
    from autopar.planning.machines import load_machine
    from autopar.planning.planner import plan_model
    from passes.analysis.screen import screen_grids, shape_of, with_context_whole
    from passes.analysis.search_plans import Candidate

    machine = load_machine("h100-80gb")
    grid = Candidate(data=1, pipeline=1, row=1, col=1, depth=1, context=2)
    for name in ("gpt2", "llama"):
        with torch.device("meta"):
            torch.manual_seed(0)
            model = zoo.build_model(name, layers=4, dropout=name == "gpt2")
        ids = torch.empty(2, 64, dtype=torch.long, device="meta")

        def report(context: int):
            return plan_model(model, (ids,), ParallelConfig(context=context), checkpoint="none",
                              kwargs={"labels": ids, "use_cache": False})[1]
        blind = shape_of(report(1))
        shape = with_context_whole(blind, report(2), 1, 2)
        (seconds, _), = screen_grids(shape, [grid], machine, False)
        (blind_seconds, _), = screen_grids(blind, [grid], machine, False)
        if name == "gpt2":
            assert shape.context_whole_flops == pytest.approx(blind.attention_flops), (shape, blind)
            assert seconds > blind_seconds
        else:
            assert shape.context_whole_flops == pytest.approx(0, abs=1e-6 * blind.attention_flops)
            assert seconds == pytest.approx(blind_seconds)


def test_evaluate_scores_a_context_layout_in_the_words_it_prints():
    from autopar.plan import parse_evaluate

    e = parse_evaluate("data=2 context=2 tensor=2,1,1", 8)
    assert e.candidate.config.context == 2 and "context=2" in e.candidate.describe()
    e = parse_evaluate("data=2 pipeline=2 context=2 tensor=2,1,1 microbatches=2 chunks=2 sequence_parallel", 16)
    assert (e.candidate.pipeline, e.candidate.context, e.candidate.chunks) == (2, 2, 2)
    assert e.candidate.describe().startswith("data=2 pipeline=2 context=2")
    e = parse_evaluate("data=2 context=2 expert_parallel", 4)  # (refused until 2026-12-05)
    assert (e.candidate.context, e.candidate.expert_parallel) == (2, True)


@pytest.mark.slow
def test_the_search_tries_context_parallelism_on_long_sequences_and_prices_it_as_planned():
    """At 16,384 tokens the search also tries context degrees (with and without a pipeline), each planned grid's
    numbers what planning it alone predicts; at 8,192 it tries none; held ``without`` context, none either."""
    from autopar.planning.machines import load_machine
    from autopar.planning.search import score, search

    with torch.device("meta"):
        model = zoo.build_model("llama", layers=2)
    machine = load_machine("h100-80gb")
    long = (torch.empty(1, 16384, dtype=torch.long, device="meta"),)
    ranked = search(model, long, 4, machine, precision="bf16")
    planned = [s for s in ranked if s.time is not None]
    split = [s for s in planned if s.candidate.context > 1]
    assert split, [s.candidate.describe() for s in planned]
    alone = score(model, long, split[0].candidate, machine, precision="bf16")
    assert (alone.seconds, alone.memory_bytes) == (split[0].seconds, split[0].memory_bytes)
    assert not any(s.candidate.context > 1 for s in search(model, long, 4, machine, precision="bf16",
                                                           without=frozenset({"context"})))
    short = (torch.empty(1, 8192, dtype=torch.long, device="meta"),)
    assert not any(s.candidate.context > 1 for s in search(model, short, 4, machine, precision="bf16"))


def test_the_nodes_holding_this_ranks_tokens_are_those_the_pass_cuts():
    """``graph_facts.token_split_nodes`` (what a pipeline's plan counts a rank's tokens of at a stage's cut): the
    nodes made from the token lookups, not the rotary tables or labels made apart; none where the pass leaves the
    graph whole (a length that does not divide into 2C chunks). Mutation: the length check dropped -> caught."""
    from passes.analysis.graph_facts import tensor_meta, token_split_nodes

    for seq, ranks, split in ((16, 2, True), (16, 4, True), (12, 4, False), (6, 2, False)):
        torch.manual_seed(0)
        model = zoo.build_model("llama")
        ids = zoo.example_inputs("llama", seq=seq)[0]
        leaves, spec = pytree.tree_flatten(((ids,), {"labels": ids, "use_cache": False}))
        cap = capture_shard(meta_shadow(model), leaves, spec, {}, (), 0,
                            requires_grad={n: True for n, _ in model.named_parameters()})
        nodes = token_split_nodes(cap.gm, ranks)
        assert bool(nodes) == split, (seq, ranks)
        if not split:
            continue
        embedded = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.embedding.default]
        assert embedded and all(n in nodes for n in embedded)
        # the rotary tables ([1, seq, dim], made from position ids, not from the tokens) stay whole
        tables = [n for n in cap.gm.graph.nodes if n.target in (torch.ops.aten.cos.default, torch.ops.aten.sin.default)]
        assert tables and not any(n in nodes for n in tables)
        assert all(tensor_meta(n) is None or n in nodes for n in cap.gm.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.mm.default)
