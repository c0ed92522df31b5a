"""The estimator against the closed-form per-layer formulas of DESIGN-NOTES section 2."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
import torch.nn as nn

from autopar.config import AGREEMENT_BYTES, ParallelConfig
from autopar.decisions import Orientation
from autopar.planning.planner import plan_model

M, K, N, B = 8, 16, 32, 4  # batch rows, in features, out features, bytes per float32


def analytic(R: int, C: int, D: int, G: int, orientation: Orientation) -> Fraction:
    """Bytes one rank sends for a Linear(K, N) with bias whose input needs no gradient, plus the ranks'
    agreement on the call (one all-gather of AGREEMENT_BYTES per rank over the world)."""
    return _layer(R, C, D, G, orientation) + Fraction(R * C * D * G - 1, R * C * D * G) * AGREEMENT_BYTES * R * C * D * G


def _layer(R: int, C: int, D: int, G: int, orientation: Orientation) -> Fraction:
    md = M // (G * D)
    f = lambda p: Fraction(p - 1, p)  # noqa: E731
    if not orientation.is_3d:
        # Output features split over one axis of P ranks (P = 1: replicated): no forward comm.
        P = {Orientation.OUT_ROW: R, Orientation.OUT_COL: C}.get(orientation, 1)
        return (2 * f(G * D) * Fraction(N * K, P) * B   # weight gradient over data x depth
                + 2 * f(G * D) * Fraction(N, P) * B     # bias gradient over data x depth
                + f(P) * md * N * B                     # output: features gathered over the axis
                + f(G * D) * M * N * B)                 # output: batch rows gathered over data x depth
    if orientation is Orientation.TRANSPOSED:
        R, C = C, R  # the other orientation swaps the roles of row and col
    w = Fraction(N * K, R * C) * B
    return (f(D) * w                               # fwd all-gather W over depth
            + 2 * f(C) * md * N // R * B           # fwd all-reduce Y over the axis splitting in
            + f(D) * w                             # bwd all-gather W again
            + f(D) * w                             # bwd reduce-scatter dW over depth
            + 2 * f(G) * w / D                     # all-reduce of the dW shard over data
            + 2 * f(G * D) * Fraction(N, R) * B    # bias gradient over data x depth
            + f(R) * md * N * B                    # output: features gathered over the out axis
            + f(G * D) * M * N * B)                # output: batch rows gathered over data x depth


@pytest.mark.parametrize("R,C,D,G", [g for g in itertools.product([1, 2], repeat=4)])
def test_single_linear_matches_design_notes_formula(R, C, D, G):
    with torch.device("meta"):
        model = nn.Linear(K, N)
    plan, report = plan_model(model, (torch.empty(M, K),), ParallelConfig(G, R, C, D))
    (mp,) = plan.matmuls
    assert report.comm_bytes_per_step == analytic(R, C, D, G, mp.orientation)
    # A lone Linear is an output head: split over its outputs unless 3D sends fewer bytes.
    if R * C > 1:
        assert mp.orientation.is_sharded


def test_estimate_step_seconds_splits_matmul_work_and_charges_each_collective():
    from autopar.examples.fc_net import FC_Net
    from passes.analysis.choose_stages import Hardware
    from passes.analysis.report import estimate_step_seconds

    with torch.device("meta"):
        model = FC_Net(num_layers=2, hidden=32, image_size=8, num_classes=16)  # every size divides by 4
    x = torch.randn(16, 1, 8, 8)
    compute_only = Hardware(flops_per_second=1e9, tensor_bytes_per_second=float("inf"))
    per_call = Hardware(flops_per_second=float("inf"), tensor_bytes_per_second=float("inf"), collective_seconds=1.0)

    def estimate(config: ParallelConfig, hardware: Hardware) -> tuple[float, int]:
        plan, report = plan_model(model, (x,), config, checkpoint="none")
        return estimate_step_seconds(report, plan, hardware), sum(c.group_size > 1 for c in report.collectives)

    serial, _ = estimate(ParallelConfig(1, 1, 1, 1), compute_only)
    _, calls = estimate(ParallelConfig(1, 2, 2, 1), per_call)
    assert serial > 0 and calls > 0
    for config in (ParallelConfig(4, 1, 1, 1), ParallelConfig(1, 4, 1, 1), ParallelConfig(1, 2, 2, 1),
                   ParallelConfig(1, 1, 1, 4)):  # each of 4 ranks does a quarter of every matmul
        assert estimate(config, compute_only)[0] == pytest.approx(serial / 4)
    assert estimate(ParallelConfig(1, 2, 2, 1), per_call)[0] == calls  # one fixed cost per collective


def test_pipeline_ranks_split_the_matmul_work_and_wait_out_the_bubble():
    from autopar.examples.fc_net import FC_Net
    from passes.analysis.choose_stages import Hardware
    from passes.analysis.report import estimate_step_seconds

    with torch.device("meta"):
        model = FC_Net(num_layers=4, hidden=32, image_size=8, num_classes=16)
    x = torch.randn(16, 1, 8, 8)
    compute_only = Hardware(flops_per_second=1e9, tensor_bytes_per_second=float("inf"),
                            pipeline_bytes_per_second=float("inf"))
    _, whole = plan_model(model, (x,), ParallelConfig(1, 1, 1, 1), checkpoint="none")
    config = ParallelConfig(1, 1, 1, 1, pipeline=2)
    shares = []
    for rank in (0, 1):
        plan, report = plan_model(model, (x,), config, rank=rank, checkpoint="none", pipeline=2, microbatches=4)
        assert 0 < report.rank_flops < whole.flops_per_step
        assert report.flops_per_step == whole.flops_per_step  # the table still shows the whole step
        bubble = plan.pipeline.bubble_fraction
        assert bubble == 1 / 5
        assert estimate_step_seconds(report, plan, compute_only) == pytest.approx(
            report.rank_flops / 1e9 / (1 - bubble))
        shares.append(report.rank_flops)
    assert sum(shares) == pytest.approx(whole.flops_per_step)  # every stage's work is on one rank


def test_summarize_keeps_every_field_of_a_row_and_counts_each_collective_once():
    """summarize builds its rows field by field (faster than dataclasses.replace): a field added to LayerRow
    must be added there too. Its totals come from collectives grouped by (where, kind, group, phase)."""
    import dataclasses

    from autopar.decisions import Plan
    from passes.analysis.estimate_costs import Collective
    from passes.analysis.report import LayerRow, summarize

    assert [f.name for f in dataclasses.fields(LayerRow)] == [
        "module", "weight", "bias", "op", "in_shape", "out_shape", "num_parameters", "flops", "sharding",
        "comm_bytes", "all_tokens"], "a new LayerRow field: copy it in report.summarize's rows"
    row = LayerRow("fc", "fc.weight", "fc.bias", "linear", (2, 3), (2, 4), 16, 48, "row", Fraction(7), True)
    colls = [Collective("all_reduce", "row", 2, 100, "forward", "fc"),
             Collective("all_reduce", "row", 2, 60, "backward", "fc"),
             Collective("all_reduce", "data", 4, 64, "step", "fc.weight"),
             Collective("all_gather", "col", 3, 30, "forward", "other")]
    report = summarize([row], colls, 16, Plan(ParallelConfig(1, 1, 1, 1), (), ()), flops_scale=3)
    # fc: 2 (2-1)/2 (100 + 60) = 160; fc.weight: 2 (3/4) 64 = 96; other: (2/3) 30 = 20
    assert report.layers == (dataclasses.replace(row, flops=144, comm_bytes=Fraction(256)),)
    assert report.other_comm == (("layout conversion at other", Fraction(20)),)
    assert report.comm_bytes_by_kind == {"all_reduce": Fraction(256), "all_gather": Fraction(20)}
    assert report.comm_bytes_per_step == 276 and report.flops_per_step == 144
