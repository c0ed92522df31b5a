"""The trace CLI's memory lines and flags."""

from __future__ import annotations

import argparse

import pytest

from autopar.examples import zoo
from autopar.trace import parse_bytes, main


def test_sizes_parse_in_decimal_and_binary_units():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("2e9") == 2 * 10**9
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_bytes("80 furlongs")


def test_trace_shows_memory_and_the_recomputed_blocks(capsys):
    assert main([f"{zoo.__file__}:llama", "--tensor", "2", "1", "1", "--checkpoint", "full"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank (full)" in out and "recomputed in backward: 2/2 blocks" in out


def test_llama_70b_on_8_ranks_does_not_fit_80gb_with_fp32_adam(capsys):
    # 69e9 parameters / 8 ranks * 16 bytes (weights, gradients, two Adam moments) = 138 GB per rank.
    assert main([f"{zoo.__file__}:llama-2-70b", "--tensor", "8", "1", "1", "--batch-size", "1",
                 "--memory-per-device", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "recomputed in backward: 80/80 blocks" in out


def test_bf16_halves_what_matmuls_and_attention_keep():
    import torch

    from autopar.config import ParallelConfig
    from autopar.planner import plan_model

    with torch.device("meta"):
        model = zoo.build_model("llama", layers=4)
    args = zoo.example_inputs("llama", batch=8, seq=64)
    fp32, bf16 = (plan_model(model, args, ParallelConfig(1, 2, 1, 1), checkpoint="none", precision=p)[0].memory
                  for p in ("fp32", "bf16"))
    # the norms' inputs stay fp32 and whole between blocks (Megatron's alternation): ~0.81 here
    assert 0.5 * fp32.activation_bytes < bf16.activation_bytes < 0.85 * fp32.activation_bytes
    assert bf16.static_bytes == fp32.static_bytes  # fp32 master weights, gradients and Adam moments
