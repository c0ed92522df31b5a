"""The matmul-like ops autopar leaves whole are counted, and named, in the plan and the trace."""

from __future__ import annotations

import torch

from autopar.config import ParallelConfig
from autopar.examples import moe_zoo
from autopar.planning.planner import plan_model
from autopar.trace import coverage_gaps
from passes.analysis.whole_matmuls import CONVOLUTION, EXPERTS, find_whole_matmuls
from tests.unlike_models import ResNet


def test_moe_experts_count_in_flops_parameters_and_the_unsharded_share():
    torch.manual_seed(0)
    model = moe_zoo.build_model("mixtral")
    (ids,) = moe_zoo.example_inputs("mixtral", batch=8, seq=16)
    plan, report = plan_model(model, (ids,), ParallelConfig(1, 2), kwargs={"use_cache": False})
    whole = report.whole
    assert [r.op for r in whole] == ["grouped_mm"] * 4  # up and down projections of two layers' experts
    assert {r.weight.rsplit(".", 1)[1] for r in whole} == {"gate_up_proj", "down_proj"}
    up = next(r for r in whole if r.weight == "model.layers.0.mlp.experts.gate_up_proj")
    rows = 8 * 16 * 2  # every token, once per expert it is routed to (top 2)
    assert up.flops == 3 * 2 * rows * 32 * 128  # forward, input gradient, weight gradient
    dense = sum(r.flops for r in report.layers)
    assert report.flops_per_step == dense + sum(r.flops for r in whole)
    # on a tensor grid each expert splits over row: its FLOPs count as sharded, and no note says they stay whole
    assert report.matmul_flops_sharded > 0.9 * report.flops_per_step
    assert not any(EXPERTS in why for why, _ in coverage_gaps(report))
    assert not any(EXPERTS in n for n in plan.notes), plan.notes
    plan, report = plan_model(model, (ids,), ParallelConfig(2), kwargs={"use_cache": False})  # data: whole
    assert report.matmul_flops_sharded < 0.4 * report.flops_per_step  # the experts are most of the work
    assert any(EXPERTS in why for why, _ in coverage_gaps(report))
    assert any(EXPERTS in n and "77% of the parameters" in n for n in plan.notes), plan.notes
    assert "matmuls on 2-D weights sharded" in plan.summary()


def test_convolutions_count_with_their_kernel_products():
    torch.manual_seed(0)
    model, x = ResNet(), torch.randn(8, 3, 8, 8)
    plan, report = plan_model(model, (x,), ParallelConfig(2))
    convs = [r for r in report.whole if r.op == "conv"]
    assert len(convs) == 5 and all(CONVOLUTION in r.sharding for r in convs)
    stem = next(r for r in convs if r.weight == "stem.weight")
    assert stem.flops == 2 * (8 * 8 * 8 * 8) * (3 * 3 * 3) * 2  # forward and weight gradient (input: no grad)
    assert any(CONVOLUTION in n for n in plan.notes)


def test_a_graph_without_them_finds_none():
    from autopar.capture import capture, meta_shadow
    from tests.unlike_models import STENet

    model = STENet()
    gm = capture(meta_shadow(model), (torch.randn(4, 16),), {}, requires_grad={}, batch=None).gm
    assert find_whole_matmuls(gm) == []
