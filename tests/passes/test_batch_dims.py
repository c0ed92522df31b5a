"""The batch analysis and split_batch on captured graphs, without processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.compat import pytree
from autopar.capture import batch_leaves, capture_shard, meta_shadow
from autopar.config import ParallelConfig
from passes.analysis.batch_dims import BatchDim, State, analyze_batch, map_batch_through_view
from passes.analysis.make_plan import make_plan
from passes.ir import batch_reduce, gather_rows, scatter_rows
from passes.split_batch import split_batch


@pytest.mark.parametrize("src,dst,bd,rows,want", [
    ((4, 6, 8), (24, 8), BatchDim(0), 4, BatchDim(0, 6)),         # (B, T, C) -> (B*T, C)
    ((24, 8), (4, 6, 8), BatchDim(0, 6), 4, BatchDim(0, 1)),      # and back
    ((1, 6, 8), (6, 8), BatchDim(0), 1, BatchDim(0, 6)),          # one row: merged into the next dim
    ((6, 4, 8), (6, 32), BatchDim(1), 4, BatchDim(1, 8)),         # (T, B, C) -> (T, B*C): rows outermost in dim 1
    ((6, 4, 8), (24, 8), BatchDim(1), 4, None),                   # (T, B, C) -> (T*B, C): rows interleaved
    ((4, 2), (2, 4), BatchDim(0), 4, None),                       # the rows split over two dims
    ((4, 6, 8), (4, 6, 2, 4), BatchDim(0), 4, BatchDim(0, 1)),    # heads split off the features
])
def test_rows_follow_views_or_are_found_split(src, dst, bd, rows, want):
    assert map_batch_through_view(src, dst, bd, rows) == want


def _captured(model: nn.Module, *inputs: torch.Tensor, shards: int = 2):
    leaves, spec = pytree.tree_flatten((inputs, {}))
    split, batch = batch_leaves(leaves)
    sizes = ParallelConfig(shards).batch_sizes(batch)
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    return capture_shard(meta_shadow(model), leaves, spec, split, sizes, 0, requires_grad=requires_grad).gm


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = self.lin(x)                                                  # (B, T, 5)
        picked = mask[torch.arange(x.shape[0])[:, None], torch.arange(x.shape[1])[None, :]]  # HF's mask idiom
        over_rows = torch.softmax(z, dim=0)                              # along the batch: gathered
        loss = F.cross_entropy(z.reshape(-1, 5), y.reshape(-1))          # a reduction: completed
        return z * picked[..., None], over_rows, loss


def test_analysis_finds_reductions_gathers_and_row_indexing():
    gm = _captured(_Mixed(), torch.randn(4, 3, 8), torch.randint(0, 5, (4, 3)), torch.ones(4, 3))
    facts = analyze_batch(gm)
    assert [n.target for n in facts.reductions] == [torch.ops.aten.cross_entropy_loss.default]
    assert [n.target for n in facts.gathers] == [torch.ops.aten._softmax.default] or \
        [n.target for n in facts.gathers] == [torch.ops.aten.softmax.int]
    assert list(facts.scatters) == list(facts.gathers)  # softmax keeps the shape: rows go back
    index = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor)
    assert facts.batch_dim(index) == BatchDim(0) and index not in facts.gathers  # arange(B) rows: row-local
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [facts.state(o) for o in outputs] == [State.SPLIT, State.SPLIT, State.WHOLE]


def test_split_batch_rewrites_the_reduction_and_brackets_the_gathered_op():
    gm = _captured(_Mixed(), torch.randn(4, 3, 8), torch.randint(0, 5, (4, 3)), torch.ones(4, 3))
    result = split_batch(gm, make_plan(gm, ParallelConfig(2)))
    targets = [n.target for n in result.gm.graph.nodes]
    assert targets.count(batch_reduce) == 1 and targets.count(gather_rows) == 1 and targets.count(scatter_rows) == 1
    assert torch.ops.aten.cross_entropy_loss.default in targets  # per token now: reduction none
    ce = next(n for n in result.gm.graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default)
    assert (ce.args[3] if len(ce.args) > 3 else ce.kwargs["reduction"]) == 0
    assert any("softmax" in note for note in result.notes)


def test_one_batch_shard_changes_nothing():
    gm = _captured(_Mixed(), torch.randn(4, 3, 8), torch.randint(0, 5, (4, 3)), torch.ones(4, 3), shards=1)
    assert not split_batch(gm, make_plan(gm, ParallelConfig(1))).changed
