"""Sequence parallelism's layouts (``passes.analysis.layouts.sequence_split`` and ``mark_partial_gathers``), on a
captured Llama: which matmuls reduce-scatter their output along the tokens, which gathers reduce-scatter their
readers' gradients, where it does not apply, and what the plan predicts for bytes and activations."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture_shard, meta_shadow, split_batch_leaves
from autopar.compat import pytree
from autopar.config import ParallelConfig
from autopar.examples.titan_llama import TitanLlama, TitanLlamaArgs
from passes.analysis.estimate_costs import bytes_by_kind, list_collectives, total_bytes
from passes.analysis.estimate_memory import estimate_memory
from passes.analysis.make_plan import layouts_for, make_plan


def _planned(config: ParallelConfig, seq: int = 16):
    torch.manual_seed(0)
    model = TitanLlama(TitanLlamaArgs())
    leaves, spec = pytree.tree_flatten(((torch.randint(0, 96, (4, seq)),), {}))
    split, batch = split_batch_leaves(leaves, config.num_batch_shards)
    cap = capture_shard(meta_shadow(model), leaves, spec, split, config.batch_sizes(batch) if split else (), 0,
                        requires_grad={n: True for n, _ in model.named_parameters()})
    plan = make_plan(cap.gm, config)
    res, by_node = layouts_for(cap.gm, plan)
    return cap.gm, plan, res, by_node


def _names(nodes, by_node) -> set[str]:
    return {by_node[n].weight.rsplit(".", 2)[-2] for n in nodes}


@pytest.mark.parametrize("tensor, data", [((2, 1, 1), 1), ((1, 2, 1), 1), ((2, 1, 1), 2), ((1, 2, 2), 1)])
def test_row_parallel_outputs_scatter_tokens_and_their_readers_share_one_gather(tensor, data):
    gm, plan, res, by_node = _planned(ParallelConfig(data, *tensor, sequence_parallel=True))
    matmuls = {n: d for n, d in res.seq_scatter.items() if n in by_node}  # (and a vocabulary-split lookup)
    assert _names(matmuls, by_node) == {"wo", "w2"}  # attention's and the MLP's output projections
    assert _names(res.partial_dx, by_node) == {"wqkv", "w1", "w3", "output"}  # (and the head reads the last norm)
    assert all(d == 1 for d in res.seq_scatter.values())  # (batch, tokens, features): the tokens
    assert len(res.partial_gathers) == 2 * 2 + 1  # each block's two norms' outputs, the last norm's: one gather each
    _, _, plain, _ = _planned(ParallelConfig(data, *tensor))
    assert not plain.seq_scatter and not plain.partial_gathers


def test_bytes_equal_the_all_reduces_plus_one_all_gather_per_gathered_input():
    config = ParallelConfig(1, 2, 1, 1)
    gm, plan, res, by_node = _planned(config)
    seq = ParallelConfig(1, 2, 1, 1, sequence_parallel=True)
    gm2, plan2, res2, by_node2 = _planned(seq)
    plain = bytes_by_kind(list_collectives(gm, res, by_node.values(), None, config))
    split = list_collectives(gm2, res2, by_node2.values(), None, seq)
    regathers = sum(c.message_bytes for c in split if c.kind == "all_gather" and c.phase == "backward"
                    and c.axis == "row") / 2  # (an all-gather over 2 ranks sends half its output)
    assert total_bytes(split) - regathers <= sum(plain.values())  # each all-reduce: a reduce-scatter + all-gather


@pytest.mark.parametrize("tensor, seq, why", [((2, 2, 1), 16, "the output's features are split over col"),
                                              ((2, 1, 1), 15, "15 tokens do not split over 2"),
                                              ((2, 1, 1), 1, "one token (a decode step)")])
def test_no_sequence_split_where_it_cannot_apply(tensor, seq, why):
    _, _, res, _ = _planned(ParallelConfig(1, *tensor, sequence_parallel=True), seq=seq)
    assert not res.seq_scatter, why


@pytest.mark.parametrize("tensor", [(2, 1, 1), (1, 2, 1)])
def test_a_block_keeps_its_share_of_serial_activations(tensor):
    """Every tensor a block saves is split: the residual stream, norms and the matmuls' inputs along the tokens
    (the embedding's rows reduce-scattered, the matmuls keeping their tokens), the rest along heads or features:
    the first block keeps exactly 1/2 of serial's bytes (without sequence parallelism, 0.65)."""
    def block(config: ParallelConfig) -> int:
        return next(s for s in estimate_memory(*_planned(config)[:2]).segments if s.checkpointable).saved_bytes
    serial = block(ParallelConfig())
    assert block(ParallelConfig(1, *tensor, sequence_parallel=True)) * 2 == serial
    assert block(ParallelConfig(1, *tensor)) > 0.6 * serial
