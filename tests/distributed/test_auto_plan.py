"""``auto_parallelize(plan="auto")``: the grid is chosen at the end of the block by the plan search (the one
``python -m autopar.plan`` ranks first for this machine), degrees the user gave stay, and training on the
chosen grid gives serial's losses and parameters."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.examples.nanogpt import GPTConfig, NanoGPT
from autopar.plan import choose_grid

CONFIG = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=False)


def auto_worker(tensor: tuple | None) -> dict:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g))
               for _ in range(3)]
    torch.manual_seed(0)
    serial = NanoGPT(GPTConfig(**CONFIG))
    torch.manual_seed(0)
    with autopar.auto_parallelize(plan="auto", example_inputs=batches[0], tensor=tensor) as yielded:
        model = NanoGPT(GPTConfig(**CONFIG))
    with torch.device("meta"):
        shadow = NanoGPT(GPTConfig(**CONFIG))
    fixed = dict(zip(("row", "col", "depth"), tensor)) if tensor else None
    best = choose_grid(shadow, batches[0], torch.distributed.get_world_size(), fixed=fixed)[0].candidate
    losses = []
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.1) for m in (serial, model)}
    for x, y in batches:
        step = {}
        for m, opt in optimizers.items():
            loss = m(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            step[m] = loss.item()
        losses.append(abs(step[model] - step[serial]) / abs(step[serial]))
    params = autopar.full_state_dict(model)
    error = max(float((params[n] - p).abs().max()) for n, p in serial.named_parameters())
    c = autopar.plan_of(model).config
    return {"chosen": (c.data, c.pipeline, c.row, c.col, c.depth), "yielded": yielded,
            "best": (best.data, best.pipeline, best.row, best.col, best.depth), "loss": max(losses), "param": error}


@pytest.mark.parametrize("tensor", [None, (2, 1, 1)])
def test_plan_auto_runs_the_searchs_best_grid_with_serials_numbers(distributed, tensor):
    for got in distributed(auto_worker, 4, tensor, timeout=600):
        assert got["yielded"] is None and got["chosen"] == got["best"], got
        if tensor:
            assert got["chosen"][2:] == tensor, got
        assert got["loss"] < 1e-5 and got["param"] < 1e-5, got


def needs_inputs_worker() -> str:
    try:
        with autopar.auto_parallelize(plan="auto"):
            NanoGPT(GPTConfig(**CONFIG))
    except ConfigError as e:
        return str(e)
    return "no error"


def test_plan_auto_without_example_inputs_says_what_it_needs(distributed):
    assert "plan='auto' needs example_inputs" in distributed(needs_inputs_worker, 2)[0]
