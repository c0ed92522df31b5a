"""Planning repeated blocks from a capture that keeps three of them (autopar.planning.planner's shortcut)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.capture import repeated_blocks
from autopar.config import ParallelConfig
from autopar.examples import zoo
from autopar.planning.planner import plan_model

COPIED = "planned as copies of block"


def _both(model: nn.Module, inputs: tuple, config: ParallelConfig, kwargs: dict | None = None):
    return (plan_model(model, inputs, config, kwargs=kwargs),
            plan_model(model, inputs, config, kwargs=kwargs, repeat=False))


@pytest.mark.parametrize("name,tensor,data", [
    ("llama", (2, 2, 1), 1), ("gpt2", (4, 1, 1), 1), ("gemma", (1, 2, 2), 1), ("t5", (2, 1, 1), 2),
    ("bert", (1, 2, 1), 2),
])
def test_copied_blocks_give_the_plan_and_report_of_a_full_capture(name, tensor, data):
    with torch.device("meta"):
        model = zoo.build_model(name, layers=6)
    (plan, report), (full_plan, full_report) = _both(model, zoo.example_inputs(name), ParallelConfig(data, *tensor),
                                                     zoo.example_kwargs(name))
    copied = [n for n in plan.notes if COPIED in n]
    assert copied and not any(COPIED in n for n in full_plan.notes)
    assert (plan.matmuls, plan.params, plan.embeddings) == (full_plan.matmuls, full_plan.params, full_plan.embeddings)
    assert [n for n in plan.notes if COPIED not in n] == list(full_plan.notes)
    assert report == full_report  # rows, every collective in order, totals, parameter count


def test_blocks_that_differ_are_not_copied():
    with torch.device("meta"):
        alternating = zoo.build_model("gpt-neo", layers=6)  # global, local, global, ...
    assert repeated_blocks(alternating) == []
    first_differs = nn.ModuleList([nn.Linear(8, 4), *[nn.Linear(8, 8) for _ in range(6)]])
    assert repeated_blocks(nn.Sequential(first_differs)) == [("0", 1, 7)]
    assert repeated_blocks(nn.Sequential(nn.ModuleList([nn.Linear(8, 8) for _ in range(4)]))) == []


class _Indexed(nn.Module):
    """Loops over a stored count rather than the list: the cut model cannot be captured."""

    def __init__(self, num_blocks: int = 6) -> None:
        super().__init__()
        self.num_blocks = num_blocks
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(num_blocks)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.num_blocks):
            x = torch.relu(self.blocks[i](x))
        return self.head(x)


def test_a_model_the_cut_breaks_is_captured_whole():
    with torch.device("meta"):
        model = _Indexed()
    (plan, report), (full_plan, full_report) = _both(model, (torch.randn(4, 16),), ParallelConfig(1, 2, 1, 1))
    assert not any(COPIED in n for n in plan.notes)
    assert plan == full_plan and report == full_report
    assert len(model.blocks) == 6  # restored


def test_llama_70b_plans_with_copied_blocks_and_an_exact_parameter_count():
    with torch.device("meta"):
        model = zoo.build_model("llama-2-70b")
    plan, report = plan_model(model, zoo.example_inputs("llama-2-70b", batch=1), ParallelConfig(1, 8, 1, 1))
    assert report.num_parameters == sum(p.numel() for p in model.parameters()) == 68_976_648_192
    assert any("blocks 3-79 planned as copies of block 2" in n for n in plan.notes)
    assert len(plan.matmuls) == 80 * 7 + 1 and report.matmul_flops_sharded == report.flops_per_step
    assert len(model.model.layers) == 80


@pytest.mark.parametrize("name,precision", [("llama", "fp32"), ("gpt2", "bf16")])
def test_copied_blocks_give_the_memory_plan_of_a_full_capture(name, precision):
    with torch.device("meta"):
        model = zoo.build_model(name, layers=6)
    args = zoo.example_inputs(name, batch=8, seq=64)
    for checkpoint in ("none", "full", 3 * 2**20):
        kw = dict(checkpoint=checkpoint, precision=precision)
        plan = plan_model(model, args, ParallelConfig(1, 1, 2, 1), **kw)[0]
        full = plan_model(model, args, ParallelConfig(1, 1, 2, 1), repeat=False, **kw)[0]
        assert plan.memory == full.memory and plan.memory is not None


def test_heads_that_do_not_divide_are_noted_in_copied_blocks_too():
    """Item 4 of issue 34: where no orientation splits the heads evenly (4 heads over col=8, and the 2 key/value
    heads), q/k/v are gathered and the attention runs whole on each rank of that axis; the plan says so, once
    for all blocks, whether the blocks were captured or copied. A grid whose axes divide the heads says nothing."""
    with torch.device("meta"):
        model = zoo.build_model("llama", layers=6)
    inputs = zoo.example_inputs("llama")
    (plan, _), (full_plan, _) = _both(model, inputs, ParallelConfig(1, 8, 8, 1))
    heads = [n for n in plan.notes if "heads" in n]
    assert heads == [n for n in full_plan.notes if "heads" in n], (plan.notes, full_plan.notes)
    assert len(heads) == 1 and heads[0].startswith("model.layers.#.self_attn: 4 heads of 8, 2 heads of 8 split "), heads
    assert "do not divide" in heads[0] and "attention runs whole" in heads[0]
    plan, _ = plan_model(model, inputs, ParallelConfig(1, 2, 2, 1))
    assert not [n for n in plan.notes if "heads" in n], plan.notes
