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
from passes.ir import batch_reduce, gather_rows, graph_info, scatter_rows
from passes.split_batch import split_batch


@pytest.mark.parametrize("src,dst,bd,rows,want", [
    ((4, 6, 8), (24, 8), BatchDim(0), 4, BatchDim(0, 6)),         # (B, T, C) -> (B*T, C)
    ((24, 8), (4, 6, 8), BatchDim(0, 6), 4, BatchDim(0, 1)),      # and back
    ((1, 6, 8), (6, 8), BatchDim(0), 1, BatchDim(0, 6)),          # one row: merged into the next dim
    ((6, 4, 8), (6, 32), BatchDim(1), 4, BatchDim(1, 8)),         # (T, B, C) -> (T, B*C): rows outermost in dim 1
    ((6, 4, 8), (24, 8), BatchDim(1), 4, BatchDim(0, 1, 6)),      # (T, B, C) -> (T*B, C): T blocks of the rows
    ((24, 8), (6, 4, 8), BatchDim(0, 1, 6), 4, BatchDim(1)),      # and back (nn.MultiheadAttention's layout)
    ((6, 32), (24, 8), BatchDim(1, 8), 4, BatchDim(0, 1, 6)),
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


class _Dispatched(nn.Module):
    """A mixture of experts' dispatch: tokens sorted by their expert, each through its expert's weight, put
    back in order, added to the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.out = nn.Linear(8, 4), nn.Linear(8, 5)
        self.experts = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, 8)                                    # (B*T, 8)
        expert = self.gate(h).argmax(-1)
        order = expert.argsort()
        y = torch.bmm(h[order].unsqueeze(1), self.experts[expert[order]]).squeeze(1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        return self.out(x + y[back].reshape(x.shape))


def test_rows_reordered_by_data_run_on_each_ranks_rows_until_they_meet_its_rows_again():
    gm = _captured(_Dispatched(), torch.randn(4, 3, 8))
    assert graph_info(gm).rows_compared  # (captured again with twice the rows: what holds rows is known)
    facts = analyze_batch(gm)
    assert [n.target for n in facts.local_starts] == [torch.ops.aten.argsort.default] or \
        [n.target for n in facts.local_starts] == [torch.ops.aten.sort.default]
    assert not facts.gathers and not facts.reductions  # nothing gathered into the region, nothing cut back
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    assert facts.state(add) is State.SPLIT and facts.batch_dim(add) == BatchDim(0)  # met its rows again
    out = split_batch(gm).gm
    assert not any(n.target in (gather_rows, scatter_rows) for n in out.graph.nodes)
    assert any("sort in '<root>'" in note and "as DDP does" in note for note in facts.notes()), facts.notes()


class _Counted(nn.Module):
    """Rows per expert counted with ``.tolist()`` and the sorted rows split by those counts (JetMoE)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)                                         # (B, 4)
        top = (h == h.max(-1, keepdim=True).values).long()
        counts = top.sum(0).tolist()
        order = top.argmax(-1).argsort()
        parts = [p * (i + 1) for i, p in enumerate(h[order].split(counts))]
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        return self.out(x + torch.cat(parts)[back])


def test_counts_that_split_this_ranks_rows_are_this_ranks_counts():
    gm = _captured(_Counted(), torch.randn(8, 4))
    facts = analyze_batch(gm)
    counted = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList)
    assert counted not in facts.reductions and facts.state(counted) is State.LOCAL  # not the whole batch's


class _CopiedInto(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h[..., :8].copy_(x)
        return self.down(h)


def test_an_in_place_copy_into_split_rows_stays_on_them():
    """Gathered, the copy would write into a gathered copy of the rows and be lost."""
    facts = analyze_batch(_captured(_CopiedInto(), torch.randn(6, 8)))
    assert not facts.gathers and not facts.local_starts
