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
    from autopar.planning.planner import plan_model

    with torch.device("meta"):
        model = zoo.build_model("llama", layers=4)
    args = zoo.example_inputs("llama", batch=8, seq=64)
    fp32, bf16 = (plan_model(model, args, ParallelConfig(1, 2, 1, 1), checkpoint="none", precision=p)[0].memory
                  for p in ("fp32", "bf16"))
    # the norms' inputs stay fp32 and whole between blocks (Megatron's alternation): ~0.81 here
    assert 0.5 * fp32.activation_bytes < bf16.activation_bytes < 0.85 * fp32.activation_bytes
    assert bf16.static_bytes == fp32.static_bytes  # fp32 master weights, gradients and Adam moments


def test_a_compiled_run_is_planned_as_it_holds_its_gradients(capsys):
    """``compile="auto"`` compiles training on GPUs, and each compiled piece of backward returns its gradients at
    once (``autopar.runtime.compiled.pieces``): under shard_optimizer a piece's whole gradients live besides the
    chunks (here every gradient: the model's fit one piece). The trace and the plan search count that
    where the run would compile (``--compile true``, or a GPU's ``--hardware``) and say so; on this CPU, "auto"
    is eager. The same path plans for the runtime (PlanOptions.compiled) and the search (its screen too)."""
    import re

    import torch

    from autopar.config import ParallelConfig
    from autopar.planning.planner import plan_model
    from passes.analysis.screen import screen_pair, shape_of
    from passes.analysis.search_plans import Candidate
    from autopar.planning.machines import load_machine

    def grads(*flags: str) -> tuple[float, bool]:
        assert main([f"{zoo.__file__}:llama", "--data", "4", "--shard-optimizer", *flags]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory per rank"))
        return float(re.search(r"gradients ([\d.,]+) MiB", line).group(1)), ", compiled" in line

    eager, compiled = grads("--compile", "false"), grads("--compile", "true")
    assert not eager[1] and compiled[1] and compiled[0] > eager[0]
    assert grads("--hardware", "h100-80gb") == compiled and grads("--hardware", "cpu") == eager
    assert (grads() == compiled) == torch.cuda.is_available()

    with torch.device("meta"):
        model = zoo.build_model("llama")
    config = ParallelConfig(4, shard_optimizer=True)
    plans = [plan_model(model, zoo.example_inputs("llama"), config, compiled=c)[0].memory for c in (False, True)]
    whole = sum(p.local_numel(ParallelConfig(4)) * 4 for p in plan_model(model, zoo.example_inputs("llama"),
                                                                         ParallelConfig(4))[0].params)
    assert plans[1].grad_bytes == plans[0].grad_bytes + whole and plans[1].compiled and not plans[0].compiled

    _, probe = plan_model(model, zoo.example_inputs("llama"), ParallelConfig(4), checkpoint="none")
    shape, machine = shape_of(probe, 4), load_machine("h100-80gb")
    candidate = Candidate(data=4, pipeline=1, row=1, col=1, depth=1, microbatches=1, shard_optimizer=True)
    (_, eager_bytes), _ = screen_pair(shape, candidate, machine)
    (_, compiled_bytes), _ = screen_pair(shape, candidate, machine, compiled=True)
    assert compiled_bytes > eager_bytes
