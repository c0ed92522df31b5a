"""The plan search chooses expert layouts: grids with routed experts split over data are candidates beside the
plain ones, the screen prices them (experts' weights, their exchange, the ops left whole) and the search keeps
the faster fitting one; ``--evaluate`` takes the same words the ranked list prints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.planning.machines import load_machine
from autopar.planning.planner import plan_model
from autopar.planning.search import score, search
from passes.analysis.search_plans import Candidate, candidates

moe_zoo = pytest.importorskip("autopar.examples.moe_zoo")
pytestmark = pytest.mark.skipif("mixtral" not in moe_zoo.NAMES, reason="transformers has no Mixtral")


class WithLoss(nn.Module):
    """A causal LM as a training step calls it: HF's ``labels=`` loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def _mixtral(batch: int = 8, seq: int = 16) -> tuple[nn.Module, tuple]:
    with torch.device("meta"):
        model = WithLoss(moe_zoo.build_model("mixtral"))
    return model, (torch.empty(batch, seq, dtype=torch.long, device="meta"),)


def test_grids_that_divide_the_experts_come_with_them_split_over_data():
    """Every grid whose data degree (> 1) divides every layer's experts, pipelines included, is listed with
    ``expert_parallel`` beside it (None), instead of it (True), or not at all (False); and every grid of one
    tensor axis whose data x tensor ranks divide them with whole experts over those ("data+tensor")."""
    plain = candidates(8, 16)
    both = candidates(8, 16, experts=(4, 4))
    lent = [c for c in both if c.expert_parallel == "data+tensor"]
    assert lent and all(c.depth == 1 and min(c.row, c.col) == 1 and 4 % (c.data * max(c.row, c.col)) == 0
                        and max(c.row, c.col) > 1 for c in lent)
    assert [dataclasses.replace(c, expert_parallel=False) for c in lent] == \
        [c for c in plain if c.depth == 1 and min(c.row, c.col) == 1 < max(c.row, c.col) and 4 % (c.data * c.row * c.col) == 0]
    assert all(c.config.expert_axis in ("row", "col", "data+row", "data+col") for c in lent)
    assert {c for c in candidates(8, 16, experts=(4, 4), expert_parallel="data+tensor") if c.expert_parallel} == \
        set(lent) | {c for c in both if c.expert_parallel is True and c.row == c.col == c.depth == 1}
    split = [c for c in both if c.expert_parallel is True]
    assert [dataclasses.replace(c, expert_parallel=False) for c in split] == [c for c in plain if c.data in (2, 4)]
    assert any(c.pipeline > 1 for c in split)
    assert [c for c in both if not c.expert_parallel] == plain
    only = candidates(8, 16, experts=(4, 4), expert_parallel=True)
    assert set(split) | set(lent) <= set(only) and not any(c.expert_parallel is False and c.data in (2, 4)
                                                           for c in only)
    assert candidates(8, 16, experts=(4, 4), expert_parallel=False) == plain
    six = candidates(8, 16, experts=(4, 6))
    assert [c for c in six if not c.expert_parallel] == plain
    assert [c for c in six if c.expert_parallel is True] == [c for c in split if c.data == 2]
    assert all(c.data * max(c.row, c.col) == 2 for c in six if c.expert_parallel == "data+tensor")


def test_the_search_splits_the_experts_where_memory_needs_it_and_scores_as_planned_alone():
    """A device too small for Mixtral's experts whole on every data rank but big enough for half of them: the
    search picks a grid with experts split over data (mutation: never offered, ``expert_parallel=False``: the
    pick is another grid, slower or not fitting) and its numbers are that grid's plan alone, to the bit; the
    screen's memory for the split grid is a floor of the planned one, and less than the plain grid's."""
    from passes.analysis.screen import screen, shape_of

    model, inputs = _mixtral()
    h100 = load_machine("h100-80gb")
    plain = score(model, inputs, Candidate(4, 1, 1, 1, 1), h100)
    split = score(model, inputs, Candidate(4, 1, 1, 1, 1, expert_parallel=True), h100)
    # (ZeRO's split of the optimizer state over data also fits under the plain grid's memory: the device is
    # made smaller than that too)
    zero = score(model, inputs, Candidate(4, 1, 1, 1, 1, shard_optimizer=True), h100)
    assert split.memory_bytes < zero.memory_bytes < plain.memory_bytes
    small = dataclasses.replace(h100, memory_bytes=(split.memory_bytes + zero.memory_bytes) // 2)
    one = {"pipeline": 1}  # (a pipeline of 4 stages also fits: each rank holds a quarter of the experts)
    best = search(model, inputs, 4, small, keep=None, checkpoint="none", fixed=one)[0]
    assert best.fits and best.candidate.expert_parallel, best.candidate.describe()
    alone = score(model, inputs, best.candidate, small, checkpoint="none")
    assert (alone.seconds, alone.memory_bytes) == (best.seconds, best.memory_bytes)
    without = search(model, inputs, 4, small, keep=None, checkpoint="none", fixed=one, expert_parallel=False)[0]
    assert not without.candidate.expert_parallel and (not without.fits or without.seconds > best.seconds)

    _, probe = plan_model(model, inputs, ParallelConfig(4, 1, 1, 1), checkpoint="none")
    shape = shape_of(probe, 4)
    assert [(e.experts, len(e.forward), len(e.backward)) for e in shape.experts] == [(4, 2, 2)] * 2
    assert shape.whole_flops > 0 and shape.whole_weight_bytes == sum(e.weight_bytes for e in shape.experts)
    for c in (Candidate(4, 1, 1, 1, 1, expert_parallel=True), Candidate(2, 1, 2, 1, 1, expert_parallel=True),
              Candidate(2, 1, 2, 1, 1)):
        floor = screen(shape, c, h100)[1]
        assert floor <= score(model, inputs, c, h100, checkpoint="full").memory_bytes, c
        other = screen(shape, dataclasses.replace(c, expert_parallel=False), h100)[1]
        # (on a tensor grid each expert splits over row as well: experts over data x row)
        assert (floor < other if c.expert_parallel else floor == other), (c, floor, other)
    # compiled, a checkpointed block recomputes its collectives as eagerly (passes.insert_checkpoints.recomputed):
    # the same floor, still a floor of the compiled plan
    c = Candidate(2, 1, 2, 1, 1)
    compiled = screen(shape, c, h100, compiled=True)[1]
    assert compiled == screen(shape, c, h100)[1]
    assert compiled <= score(model, inputs, c, h100, checkpoint="full", compiled=True).memory_bytes


def test_the_screen_prices_the_exchange_and_the_experts_work():
    """The screen adds the experts' all-to-alls to a split grid's communication (mutation: left out, the split
    grid screens only the counts' exchange) and their FLOPs (left whole: split over the batch
    shards only) to every grid's compute."""
    from passes.analysis.screen import screen, shape_of

    model, inputs = _mixtral()
    h100 = load_machine("h100-80gb")
    _, probe = plan_model(model, inputs, ParallelConfig(4, 1, 1, 1), checkpoint="none")
    shape = shape_of(probe, 4)
    plain, split = (screen(shape, Candidate(4, 1, 1, 1, 1, expert_parallel=e), h100)[0] for e in (False, True))
    none = dataclasses.replace(shape, experts=tuple(dataclasses.replace(e, forward=(), backward=()) for e in shape.experts))
    no_exchange = screen(none, Candidate(4, 1, 1, 1, 1, expert_parallel=True), h100)[0]
    assert no_exchange < split
    idle = screen(dataclasses.replace(shape, whole_flops=0.0), Candidate(4, 1, 1, 1, 1), h100)[0]
    assert idle < plain


def test_evaluate_takes_the_words_the_ranked_list_prints():
    from autopar.plan import parse_evaluate

    c = parse_evaluate("data=4 tensor=1,1,1 expert_parallel", 4).candidate
    assert c == Candidate(4, 1, 1, 1, 1, expert_parallel=True)
    assert parse_evaluate(c.describe(), 4).candidate == c
    lent = parse_evaluate("data=2 tensor=2,1,1 expert_parallel=data+tensor", 4).candidate
    assert lent == Candidate(2, 1, 2, 1, 1, expert_parallel="data+tensor")
    assert parse_evaluate(lent.describe(), 4).candidate == lent
    with pytest.raises(ConfigError, match="one tensor axis"):
        parse_evaluate("data=1 tensor=2,2,1 expert_parallel=data+tensor", 4)
    s = Candidate(2, 1, 2, 1, 1, shard_optimizer=True, sequence_parallel=True)
    assert parse_evaluate(s.describe(), 4).candidate == s
    both = parse_evaluate("data=4 expert_parallel shard_optimizer", 4).candidate
    assert both.expert_parallel and both.shard_optimizer
    with pytest.raises(ConfigError, match="chunks=2 needs a pipeline"):
        parse_evaluate("data=4 chunks=2 expert_parallel", 4)
    with pytest.raises(ConfigError, match="'experts' is not one of them"):
        parse_evaluate("data=4 experts", 4)


def test_a_shard_of_one_row_captures_as_one_of_two():
    """Mixtral's experts sort the rows, so each shard is captured again with twice its rows to tell where values
    hold rows. With one row per shard HF's shifted labels are contiguous already (no ``contiguous`` op), with
    two they are not: the comparison skips that copy (mutation: compared, the capture raises CaptureError)."""
    model, inputs = _mixtral(batch=4)
    plan, _ = plan_model(model, inputs, ParallelConfig(4, 1, 1, 1, expert_parallel=True), checkpoint="none")
    assert all(e.axis == "data" for e in plan.experts)


def test_the_twice_rows_capture_decides_its_causal_mask_as_the_first(monkeypatch):
    """A causal mask at the size limit the capture evaluates (``MAX_ELEMENTS``) turns causal in the first capture;
    the capture with twice the rows (twice the mask) is held to twice the limit, so it turns causal too and the
    graphs compare (mutation: the same limit: the graphs differ and the capture raises CaptureError)."""
    import autopar.capture as capture_module

    model, inputs = _mixtral(batch=8, seq=16)
    monkeypatch.setattr(capture_module, "MAX_ELEMENTS", 4 * 16 * 16)  # a shard of data 2: 4 rows x 16 x 16
    plan, _ = plan_model(model, inputs, ParallelConfig(2, 1, 1, 1), checkpoint="none")
    assert plan.config.data == 2


def test_blocks_planned_as_copies_keep_their_experts_split():
    """A model captured as repeated blocks (the first blocks planned, the rest copies: ``repeat_blocks``) keeps
    every layer's expert plan and exchange shape (mutation: the copies' dropped, as they were: a 4-layer
    Mixtral had 2 of its 4 layers split, and the search's screen found no expert layer of a 48-layer Qwen3)."""
    import transformers

    from passes.analysis.screen import shape_of

    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = WithLoss(transformers.MixtralForCausalLM(config))
    inputs = (torch.empty(8, 16, dtype=torch.long, device="meta"),)
    plan, report = plan_model(model, inputs, ParallelConfig(2, 1, 1, 1, expert_parallel=True), checkpoint="none")
    assert any("planned as copies" in n for n in plan.notes), plan.notes
    assert [e.module for e in plan.experts] == [f"model.model.layers.{i}.mlp.experts" for i in range(5)]
    assert all(e.axis == "data" for e in plan.experts)
    _, probe = plan_model(model, inputs, ParallelConfig(2, 1, 1, 1), checkpoint="none")
    assert len(shape_of(probe, 2).experts) == 5


def test_a_pipeline_rank_prices_its_own_stages_experts():
    """Under a pipeline each rank computes its stages' experts only: the two pipeline ranks' whole-op FLOPs
    add up to the model's (mutation: every rank counted every layer's, as before: twice the total), and they are
    in the rank's FLOPs the stages are cut by (mutation: left out of ``pipeline_chain``'s segments, which cut
    stages and priced ranks by their linear layers alone); with experts split over data, each rank's exchange
    is its own layers', and the screen's memory is a floor of the planned one."""
    from passes.analysis.screen import screen, shape_of

    model, inputs = _mixtral()
    config = ParallelConfig(2, 1, 1, 1, pipeline=2, expert_parallel=True)
    _, flat = plan_model(model, inputs, ParallelConfig(2, 1, 1, 1, expert_parallel=True), checkpoint="none")
    total = sum(r.flops for r in flat.whole)  # (the global batch's)
    per_rank, exchanges = [], []
    for rank in (0, 1):  # (pipeline ranks 0 and 1 of data rank 0: data is the outermost axis)
        plan, report = plan_model(model, inputs, config, rank=rank, checkpoint="none", pipeline=2, microbatches=4)
        mine = sum(r.flops for r in report.whole)  # (its stage's, over the global batch)
        assert report.rank_flops > mine / 2 > 0  # (the rank computes its own data shard's: 1 of 2)
        per_rank.append(mine)
        exchanges.append({c.where for c in report.collectives if c.kind == "all_to_all"})
    assert sum(per_rank) == pytest.approx(total)  # (each its stage's layers, over the global batch)
    assert exchanges == [{"model.model.layers.0.mlp.experts"}, {"model.model.layers.1.mlp.experts"}]
    h100 = load_machine("h100-80gb")
    _, probe = plan_model(model, inputs, ParallelConfig(2, 1, 1, 1), checkpoint="none")
    c = Candidate(2, 2, 1, 1, 1, microbatches=4, expert_parallel=True)
    assert screen(shape_of(probe, 2), c, h100)[1] <= score(model, inputs, c, h100, checkpoint="full").memory_bytes


def test_the_screen_prices_whole_experts_over_data_and_the_tensor_axis(monkeypatch):
    """``expert_parallel="data+tensor"`` at data 2 x row 2: the screen holds a quarter of the experts per rank (as
    experts over data, each over row), its memory a floor of the planned grid's; it prices the exchange over
    the four ranks and the row ranks' gathers (mutation: the gathers left out, the screen's time drops)."""
    from passes.analysis import screen as screen_module
    from passes.analysis.screen import screen, shape_of

    model, inputs = _mixtral()
    h100 = load_machine("h100-80gb")
    _, probe = plan_model(model, inputs, ParallelConfig(4, 1, 1, 1), checkpoint="none")
    shape = shape_of(probe, 4)
    lent = Candidate(2, 1, 2, 1, 1, expert_parallel="data+tensor")
    scored = score(model, inputs, lent, h100, checkpoint="full")
    assert scored.time is not None and scored.candidate == lent
    seconds, floor = screen(shape, lent, h100)
    assert floor <= scored.memory_bytes
    assert floor == screen(shape, dataclasses.replace(lent, expert_parallel=True), h100)[1]
    assert floor < screen(shape, dataclasses.replace(lent, expert_parallel=False), h100)[1]
    prices = screen_module.Prices.__call__

    def no_gathers(self, kind, axis, size, nbytes, phase):
        return 0.0 if kind == "all_gather" and axis == "row" else prices(self, kind, axis, size, nbytes, phase)

    monkeypatch.setattr(screen_module.Prices, "__call__", no_gathers)
    assert screen(shape, lent, h100, memo={})[0] < seconds
