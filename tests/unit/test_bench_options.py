"""The benchmark harness's own parsing: grid tokens (``benchmarks.systems.parse_grid``) and ``--batch``."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.simulate import batch_shape
from benchmarks.systems import parse_grid


def test_grid_tokens_set_each_option_and_label_round_trips():
    g = parse_grid("t4x1x1-c-z-s-e", 8)
    assert (g.tensor, g.data, g.pipeline) == ((4, 1, 1), 2, 1)
    assert g.compiled and g.shard_optimizer and g.sequence_parallel and g.expert_parallel
    assert parse_grid(g.label, 8) == g
    plain = parse_grid("t4x1x1", 4)
    assert not (plain.compiled or plain.shard_optimizer or plain.sequence_parallel)


@pytest.mark.parametrize("bad", ["t4x1x1-s-s", "t4x1x1-q", "d2-p2-x"])
def test_a_bad_or_repeated_token_is_refused_with_the_tokens_named(bad):
    with pytest.raises(ValueError, match="s \\(sequence parallelism\\)"):
        parse_grid(bad, 4)


def test_batch_shape():
    assert batch_shape("32x1024") == (32, 1024) and batch_shape("2X8") == (2, 8)
    for bad in ("32", "0x8", "axb", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError, match="--batch"):
            batch_shape(bad)


def test_each_simulated_row_mode_is_a_compile_option_autopar_accepts():
    """A row ``grid:mode`` runs ``auto_parallelize(compile=COMPILE[mode])``: ``--reduce-overhead``'s rows run
    training steps replayed as CUDA graphs, not compile=True under another name."""
    from autopar.config import CompileConfig
    from benchmarks.simulate import COMPILE, GRAPHS

    assert COMPILE[GRAPHS] == "reduce-overhead" and COMPILE["compiled"] is True and COMPILE["eager"] is False
    for mode in COMPILE.values():
        CompileConfig(mode)
    assert CompileConfig(COMPILE[GRAPHS]).cuda_graphs("cuda", True)


def test_an_all_to_all_counts_the_rows_sent_to_other_ranks(monkeypatch):
    """The benchmark's byte counter counts an all-to-all as autopar's does (``collectives.all_to_all``): the input's
    rows but this rank's own split; even splits where none are given."""
    import torch.distributed as dist

    from benchmarks.measure import sent_to_others

    class Group:  # (a stand-in for the op's process group: rank 1 of 4)
        def rank(self) -> int:
            return 1

    monkeypatch.setattr(dist, "ProcessGroup", Group)
    assert sent_to_others({"input_split_sizes": [2, 3, 0, 5], "process_group": Group()}, 4, 10 * 8) == 7 * 8
    assert sent_to_others({"input_split_sizes": [], "process_group": Group()}, 4, 64) == 48
