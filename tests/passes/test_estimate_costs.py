"""The estimator against the closed-form per-layer formulas of DESIGN-NOTES section 2."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
import torch.nn as nn

from autopar.config import Orientation, ParallelConfig
from autopar.trace import plan_model

M, K, N, B = 8, 16, 32, 4  # batch rows, in features, out features, bytes per float32


def analytic(R: int, C: int, D: int, G: int, orientation: Orientation) -> Fraction:
    """Bytes one rank sends for a Linear(K, N) with bias whose input needs no gradient."""
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
