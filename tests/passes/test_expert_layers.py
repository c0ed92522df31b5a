"""find_expert_layers: the routed-experts layers of every grouped-matmul MoE family, and where one cannot split."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture, meta_shadow
from autopar.examples import moe_zoo
from passes.analysis.experts import find_expert_layers

aten = torch.ops.aten


def _captured(name: str):
    torch.manual_seed(0)
    model = moe_zoo.build_model(name)
    (ids,) = moe_zoo.example_inputs(name, batch=8, seq=16)
    return capture(meta_shadow(model), (ids,), {"use_cache": False},
                   requires_grad={n: True for n, _ in model.named_parameters()}, batch=None).gm


@pytest.mark.parametrize("name", [n for n in ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3") if n in moe_zoo.NAMES])
def test_every_grouped_matmul_family_has_splittable_expert_layers(name):
    layers = find_expert_layers(_captured(name))
    dense_first = name == "deepseek_v3"  # (its first layer is dense)
    assert len(layers) == 2 - dense_first
    for layer in layers:
        assert not layer.why_whole, layer.why_whole
        assert layer.experts == 4 and len(layer.matmuls) == 2
        assert {w.rsplit(".", 1)[1] for w in layer.weights} == {"gate_up_proj", "down_proj"}
        assert layer.output is layer.matmuls[-1] and layer.matmuls[0] in layer.region
        assert int(layer.rows.meta["val"].shape[0]) == 8 * 16 * 2  # every token once per pick (top 2)
        # gpt-oss adds an expert bias taken by row between the matmuls: it travels with the rows
        assert len(layer.inputs) == (name == "gpt_oss")
        assert not any(n.target is aten.transpose.int for n in layer.region)  # weights are read, not moved


def test_a_layer_reducing_over_its_rows_is_not_split():
    """Mutation: the activation between the grouped matmuls made a softmax over the rows (dim 0): each row's result
    would depend on the others, which other ranks hold."""
    gm = _captured("mixtral")
    layer = find_expert_layers(gm)[0]
    silu = next(n for n in layer.region if n.target is aten.silu.default)
    silu.target, silu.args = aten._softmax.default, (silu.args[0], 0, False)
    assert "is not row-wise" in find_expert_layers(gm)[0].why_whole


def test_the_plan_splits_experts_over_data_where_they_divide_and_says_where_not():
    from autopar.config import ParallelConfig
    from autopar.decisions import ParamKind
    from autopar.planning.planner import plan_model

    torch.manual_seed(0)
    model = moe_zoo.build_model("mixtral")
    (ids,) = moe_zoo.example_inputs("mixtral", batch=8, seq=16)
    plan, report = plan_model(model, (ids,), ParallelConfig(2, expert_parallel=True), kwargs={"use_cache": False})
    assert [(e.axis, e.experts) for e in plan.experts] == [("data", 4)] * 2
    up = plan.param("model.layers.0.mlp.experts.gate_up_proj")
    assert up.kind is ParamKind.SPLIT and up.split_axis == "data" and up.split_dim == 0 and "data" not in up.grad_axes
    assert up.local_numel(plan.config) * 2 == up.shape[0] * up.shape[1] * up.shape[2]
    assert "2 whole experts per rank" in plan.summary() and "stay whole" not in " ".join(plan.notes)
    assert all("experts over data: 2 of 4 per rank" == r.sharding for r in report.whole)
    # each layer, balanced: the counts, then half of this rank's 128 rows of 32 floats out, back, and their
    # gradients the other way (the plan's all-to-all bytes, which the exchange's measured bytes match)
    assert report.comm_bytes_by_kind["all_to_all"] == 2 * ((2 - 1) * 2 * 8 + 4 * 64 * 32 * 4)
    plan3, _ = plan_model(model, (ids[:6],), ParallelConfig(3, expert_parallel=True), kwargs={"use_cache": False})
    assert all(not e.axis for e in plan3.experts)  # 4 experts over 3 data ranks: whole, and a note says why
    assert any("4 experts do not divide over data=3" in n for n in plan3.notes), plan3.notes


def test_expert_parallel_refuses_what_is_not_a_choice():
    from autopar.config import MemoryConfig, ParallelConfig
    from autopar.errors import ConfigError

    assert ParallelConfig(2, shard_optimizer=True, expert_parallel=True).expert_parallel  # (combined since 2026-12-03)
    with pytest.raises(ConfigError, match="expert_parallel"):
        ParallelConfig(2, expert_parallel="yes")
    with pytest.raises(ConfigError, match="expert_parallel"):
        MemoryConfig(expert_parallel=1)


def test_a_layer_reading_its_offsets_between_the_matmuls_is_not_split():
    """Mutation: an op between the grouped matmuls that reads the offsets (the rank's rows would meet the global
    counts there): the layer is reported as not splittable rather than split."""
    gm = _captured("mixtral")
    layer = find_expert_layers(gm)[0]
    silu = next(n for n in layer.region if n.target is aten.silu.default)
    with gm.graph.inserting_after(silu):
        total = gm.graph.call_function(aten.sum.default, (layer.offsets,))
        scaled = gm.graph.call_function(aten.mul.Tensor, (silu, total))
    scaled.meta["val"] = silu.meta["val"]
    total.meta["val"] = layer.offsets.meta["val"].sum()
    silu.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    assert "reads the offsets" in find_expert_layers(gm)[0].why_whole


def test_an_expert_weight_read_outside_its_layer_keeps_the_layer_whole():
    """Mutation: forward also reads an expert weight elsewhere (a penalty on it): split, that read would see this
    rank's experts only."""
    from passes.analysis.graph_facts import param_name

    gm = _captured("mixtral")
    layer = find_expert_layers(gm)[0]
    weight = next(n for n in gm.graph.nodes if param_name(n) == layer.weights[0])
    with gm.graph.inserting_after(weight):
        penalty = gm.graph.call_function(aten.sum.default, (weight,))
    penalty.meta["val"] = weight.meta["val"].sum()
    assert "also read outside" in find_expert_layers(gm)[0].why_whole


@pytest.mark.parametrize("name", [n for n in ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3") if n in moe_zoo.NAMES])
def test_each_expert_splits_over_a_tensor_axis_by_its_hidden_features(name):
    """The fused gate/up weight splits its output features, gate and up each in pieces (``chunk``), or as one
    interleaved run (gpt-oss's ``[:, ::2]``, its bias taken by row alike); down splits its input features."""
    from passes.analysis.experts import tensor_split
    from passes.analysis.graph_facts import param_name

    gm = _captured(name)
    for layer in find_expert_layers(gm):
        split = tensor_split(layer, 2)
        assert not split.why_whole, split.why_whole
        (up, up_dim, up_parts), (down, down_dim, down_parts) = split.weights
        shapes = {param_name(n): tuple(n.meta["val"].shape) for n in gm.graph.nodes if param_name(n)}
        up_shape = shapes[up]
        hidden = down_parts[0]
        assert sum(up_parts) == up_shape[up_dim] == 2 * hidden
        assert up_parts == ((2 * hidden,) if name == "gpt_oss" else (hidden, hidden))
        assert shapes[down][down_dim] == hidden and down_dim != 0 and up_dim != 0
        assert split.inputs == (((2 * hidden,),) if name == "gpt_oss" else ())
        assert "do not divide over 3 ranks" in tensor_split(layer, 3).why_whole
    if name == "gpt_oss":  # 64 interleaved features over 32 ranks: pieces of 2, each a gate and an up; over 64, not
        assert not tensor_split(layer, 32).why_whole and "in steps of 2" in tensor_split(layer, 64).why_whole


def test_a_layer_taking_part_of_its_hidden_features_stays_whole_over_tensor():
    """Mutation: the chunk of gate and up made a slice of the first 16 features: a rank's piece would not be
    the features the slice takes."""
    from passes.analysis.experts import tensor_split

    gm = _captured("mixtral")
    layer = find_expert_layers(gm)[0]
    chunk = next(n for n in layer.region if n.target is aten.chunk.default)
    chunk.target, chunk.args = aten.slice.Tensor, (chunk.args[0], 1, 0, 16)
    assert "takes a part of the experts' hidden features" in tensor_split(find_expert_layers(gm)[0], 2).why_whole


def test_a_tensor_grid_splits_each_expert_and_prices_its_all_reduces():
    from autopar.config import ParallelConfig
    from autopar.decisions import ParamKind
    from autopar.planning.planner import plan_model

    torch.manual_seed(0)
    model = moe_zoo.build_model("mixtral")
    (ids,) = moe_zoo.example_inputs("mixtral", batch=8, seq=16)
    plan, report = plan_model(model, (ids,), ParallelConfig(1, row=2), kwargs={"use_cache": False})
    assert [(e.axis, e.tensor_axis) for e in plan.experts] == [("", "row")] * 2
    up = plan.param("model.layers.0.mlp.experts.gate_up_proj")
    down = plan.param("model.layers.0.mlp.experts.down_proj")
    assert (up.kind, up.split_axis, up.split_dim, up.parts) == (ParamKind.SPLIT, "row", 1, (64, 64))
    assert (down.kind, down.split_axis, down.split_dim, down.parts) == (ParamKind.SPLIT, "row", 2, (64,))
    assert up.local_numel(plan.config) * 2 == up.shape[0] * up.shape[1] * up.shape[2]
    assert "each split over row: 1/2 of every expert per rank" in plan.summary()
    assert all(r.sharding == "each expert over row: 1/2 of it per rank" for r in report.whole)
    whole, _ = plan_model(model, (ids,), ParallelConfig(2), kwargs={"use_cache": False})
    share = {r.weight: r.flops for r in report.whole}
    from passes.analysis.report import whole_flops_per_rank
    assert whole_flops_per_rank(report, plan) == sum(share.values()) / 2  # each rank its half of every expert
    # per layer: the results' partial sums (256 rows x 32 floats) forward, the rows' gradient backward
    rows = 8 * 16 * 2 * 32 * 4
    expert = [c for c in report.collectives if c.where.endswith("mlp.experts") and c.kind == "all_reduce"]
    assert sorted((c.kind, c.phase, c.message_bytes) for c in expert) == \
        [("all_reduce", "backward", rows)] * 2 + [("all_reduce", "forward", rows)] * 2
    assert not whole.experts


def test_experts_over_data_split_each_over_tensor_too():
    """``expert_parallel=True`` on a data x tensor grid: each data rank its experts (dim 0), each split over row
    (the hidden features): a quarter of every layer's expert weights per rank at data 2 x row 2, the exchange's
    all-to-alls and the split's all-reduces both priced."""
    from autopar.config import ParallelConfig
    from autopar.planning.planner import plan_model

    torch.manual_seed(0)
    model = moe_zoo.build_model("mixtral")
    (ids,) = moe_zoo.example_inputs("mixtral", batch=8, seq=16)
    plan, report = plan_model(model, (ids,), ParallelConfig(2, row=2, expert_parallel=True),
                              kwargs={"use_cache": False})
    assert [(e.axis, e.tensor_axis, e.reason) for e in plan.experts] == [("data", "row", "")] * 2
    up = plan.param("model.layers.0.mlp.experts.gate_up_proj")
    assert (up.split_axis, up.split_dim, up.second_axis, up.second_dim, up.second_parts) == ("data", 0, "row", 1,
                                                                                             (64, 64))
    assert up.local_shape(plan.config) == (2, 64, 32) and up.local_numel(plan.config) * 4 == 4 * 128 * 32
    assert up.grad_axes == ("depth",) and plan.whole_share(up.name) == 2
    assert "2 whole experts per rank, each split over row (1/2 per rank)" in plan.summary()
    assert all(r.sharding == "experts over data: 2 of 4 per rank, each over row: 1/2 of it" for r in report.whole)
    kinds = {(c.kind, c.phase) for c in report.collectives if c.where.endswith("mlp.experts")}
    assert {("all_to_all", "forward"), ("all_reduce", "forward"), ("all_reduce", "backward")} <= kinds


@pytest.mark.skipif("llama4" not in moe_zoo.NAMES, reason="the installed transformers lacks Llama 4")
def test_llama4s_batched_experts_are_a_layer_of_blocks_that_splits_both_ways():
    """Llama 4's experts multiply ``[experts, tokens, hidden]`` blocks by ``bmm`` (every expert every token, scaled
    by its router score): one layer per block, two row dims, no offsets, splittable over data (blocks of experts)
    and over a tensor axis (gate/up's output features, down's input features); the plan prices the blocks'
    exchange as rows of ``hidden`` floats."""
    from autopar.config import ParallelConfig
    from autopar.planning.planner import plan_model
    from passes.analysis.experts import tensor_split

    gm = _captured("llama4")
    layers = find_expert_layers(gm)
    assert len(layers) == 2
    for layer in layers:
        assert not layer.why_whole and layer.batched and layer.row_dims == 2 and layer.experts == 4
        assert [m.target for m in layer.matmuls] == [aten.bmm.default] * 2
        assert layer.rows_in(layer.rows) == 4 * 8 * 16 and layer.row_bytes(layer.output) == 32 * 4
        split = tensor_split(layer, 2)
        assert [(w.rsplit(".", 1)[1], dim, parts) for w, dim, parts in split.weights] == \
            [("gate_up_proj", 2, (32, 32)), ("down_proj", 1, (32,))]
    torch.manual_seed(0)
    model = moe_zoo.build_model("llama4")
    (ids,) = moe_zoo.example_inputs("llama4", batch=8, seq=16)
    plan, report = plan_model(model, (ids,), ParallelConfig(2, row=2, expert_parallel=True),
                              kwargs={"use_cache": False})
    assert [(e.axis, e.tensor_axis, e.reason) for e in plan.experts] == [("data", "row", "")] * 2
    assert "3-D expert weights stay whole" not in plan.summary()
    # (its exchange's bytes do not depend on the routing: the report says so, not "balanced routing assumed")
    assert all(e.batched for e in plan.experts)
    labels = [what for what, _ in report.other_comm]
    assert any("each expert's block of tokens" in w for w in labels) and not any("balanced" in w for w in labels)
    out = [c for c in report.collectives if c.kind == "all_to_all" and c.phase == "forward"
           and c.where.endswith("experts") and c.message_bytes > 100]
    rows = 4 * 8 * 16 // 2  # this data rank's tokens, once per expert: half of them to the other rank
    assert sorted(c.message_bytes for c in out) == [rows // 2 * 32 * 4] * 4  # rows out, results back; 2 layers
    assert report.experts and all(s.rows == 4 * 8 * 16 and s.forward == (128, 128) for s in report.experts)


@pytest.mark.skipif("llama4" not in moe_zoo.NAMES, reason="the installed transformers lacks Llama 4")
def test_a_batched_layer_mixing_its_tokens_is_not_split():
    """Mutation: the activation between Llama 4's bmms made a softmax over the tokens (dim 1): each row's result
    would depend on rows other ranks hold."""
    gm = _captured("llama4")
    layer = find_expert_layers(gm)[0]
    silu = next(n for n in layer.region if n.target is aten.silu.default)
    silu.target, silu.args = aten._softmax.default, (silu.args[0], 1, False)
    assert "is not row-wise" in find_expert_layers(gm)[0].why_whole


def test_whole_experts_over_data_and_the_tensor_axis_borrow_its_ranks():
    """``expert_parallel="data+tensor"`` (Megatron's expert parallelism borrowing the tensor ranks): whole experts
    over data x row, 1 of 4 per rank at data 2 x row 2, no expert split over row; each row rank sends half of the
    rows both hold (a quarter of the exchange's bytes of whole rows) and all-gathers the results forward and the
    rows' gradients backward; at data 1 the experts go over row alone."""
    from autopar.config import ParallelConfig
    from autopar.decisions import ParamKind
    from autopar.errors import ConfigError
    from autopar.planning.planner import plan_model
    from passes.analysis.report import whole_flops_per_rank

    torch.manual_seed(0)
    model = moe_zoo.build_model("mixtral")
    (ids,) = moe_zoo.example_inputs("mixtral", batch=8, seq=16)
    for data, axis, per in ((2, "data+row", 1), (1, "row", 2)):
        config = ParallelConfig(data, row=2, expert_parallel="data+tensor")
        assert config.expert_axis == axis and config.size(axis) == 2 * data
        plan, report = plan_model(model, (ids,), config, kwargs={"use_cache": False})
        assert [(e.axis, e.tensor_axis, e.lent, e.reason) for e in plan.experts] == [(axis, "", "row", "")] * 2
        up = plan.param("model.layers.0.mlp.experts.gate_up_proj")
        assert (up.kind, up.split_axis, up.split_dim, up.second_axis) == (ParamKind.SPLIT, axis, 0, "")
        assert up.local_shape(plan.config) == (per, 128, 32) and plan.whole_share(up.name) == 2
        assert up.splits_over_data(config) == (data > 1)
        word = "expert" if per == 1 else "experts"
        assert f"split over {axis.replace('+', ' x ')}: {per} whole {word} per rank" in plan.summary()
        assert all(r.sharding == f"experts over {axis.replace('+', ' x ')}: {per} of 4 per rank" for r in report.whole)
        assert whole_flops_per_rank(report, plan) == sum(r.flops for r in report.whole) / (2 * data)
        # per layer: the counts of the other ranks' experts; this rank's 256 / data rows, half of them sent by each
        # row rank, (size-1)/size of those away;
        # the results (256 / data rows of 32 floats) gathered over row forward, the rows' gradients backward
        rows, size = 256 // data, 2 * data
        expert = sorted((c.kind, c.phase, c.axis, c.message_bytes) for c in report.collectives
                        if c.where == "model.layers.0.mlp.experts" and c.node != "index_4")
        assert expert == sorted([("all_gather", "forward", "row", rows * 32 * 4),
                                 ("all_gather", "backward", "row", rows * 32 * 4),
                                 ("all_to_all", "forward", axis, (size - 1) * (4 // size) * 8)]
                                + [("all_to_all", phase, axis, rows // 2 * (size - 1) // size * 32 * 4)
                                   for phase in ("forward", "forward", "backward", "backward")]), expert
    assert "experts over data x row" in str(ParallelConfig(2, row=2, expert_parallel="data+tensor"))
    with pytest.raises(ConfigError, match="one tensor axis"):
        ParallelConfig(2, row=2, col=2, expert_parallel="data+tensor")
    with pytest.raises(ConfigError, match="depth > 1"):
        ParallelConfig(2, row=2, depth=2, expert_parallel="data+tensor")
    three, _ = plan_model(model, (ids[:6],), ParallelConfig(3, row=2, expert_parallel="data+tensor"),
                          kwargs={"use_cache": False})  # 4 experts over 6 ranks: each split over row instead
    assert [(e.axis, e.tensor_axis) for e in three.experts] == [("", "row")] * 2
    assert "not over data+row: its 4 experts do not divide over data+row=6" in three.experts[0].reason
