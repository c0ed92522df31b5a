"""Training on batches of varying shape through one captured graph.

Scripts that pad each batch to its own longest sequence (HF's DataCollatorWithPadding, dynamic padding)
or end an epoch on a smaller batch call the model with a new shape at almost every step. Each used to be
captured and compiled again (~0.3-1.5 s each for these tiny models) and to evict older graphs from the
bounded cache. Now the first shape is captured as it is, and when a second one meets the same signature
the call is captured with symbolic lengths (and batch rows, where the batch is not split), as evaluation
calls are, and that graph serves every later shape (torch.compile's automatic dynamic shapes do the
same). Where data or depth split the batch and the model computes its loss inside forward, the batch
analysis fixes the length, and each shape is still captured. The oracle is the serial model with the same seed and data: each
step's loss, every gradient and the final parameters; the test counts the graphs.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.context import runtime_of
from autopar.examples import zoo

# (rows, length) per step: lengths vary at every step, rows at some (a last, smaller batch)
SHAPES = [(4, 9), (4, 14), (3, 6), (4, 11), (2, 16), (4, 5)]


def shapes_worker(name: str, tensor: tuple, data: int, shapes: list, checkpoint: str = "auto") -> dict:
    torch.manual_seed(0)
    serial = zoo.build_model(name)
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, data=data, checkpoint=checkpoint):
        model = zoo.build_model(name)
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.5) for m in (serial, model)}
    g = torch.Generator().manual_seed(0)
    losses, grads = [], []
    for rows, length in shapes:
        ids = torch.randint(1, zoo.VOCAB, (rows, length), generator=g)
        labels = torch.randint(1, zoo.VOCAB, (rows, length), generator=g)
        got = {}
        for m in (serial, model):
            loss = m(ids, labels=labels).loss  # the HF idiom: the loss computed inside forward
            loss.backward()
            got[m] = loss.item()
        losses.append(abs(got[model] - got[serial]) / abs(got[serial]))
        grads.append(worst(runtime_of(model).full_grads(),
                           {n: p.grad for n, p in serial.named_parameters() if p.grad is not None}))
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad()
    params = worst(autopar.full_state_dict(model), dict(serial.named_parameters()))
    graphs = sum(len(v) for v in runtime_of(model).executables.values())
    return {"loss": max(losses), "grad": max(grads), "param": params, "graphs": graphs,
            "parallel": autopar.plan_of(model) is not None and not runtime_of(model).fallback}


def worst(got: dict, want: dict) -> float:
    """The largest error of a tensor in ``want`` relative to its norm plus 1% of all of them together: some are
    zero in exact arithmetic (an attention key's bias gets no gradient: rounding noise on both sides), as the
    zoo's parity tests compare gradients."""
    scale = torch.sqrt(sum(w.detach().double().square().sum() for w in want.values())).item()
    return max((got[n].double() - w.detach().double()).norm().item() / (w.detach().double().norm().item() + 1e-2 * scale)
               for n, w in want.items())


def _check(results: list[dict], graphs: int) -> None:
    for got in results:
        assert got["parallel"], got
        assert got["loss"] < 1e-5 and got["grad"] < 1e-4 and got["param"] < 1e-5, got
        assert got["graphs"] == graphs, got


def test_varying_lengths_and_rows_train_through_one_graph(distributed):
    """Tensor (2,1,1): six shapes, two graphs (the first shape's, then one with symbolic lengths and rows;
    before: six)."""
    _check(distributed(shapes_worker, 2, "llama", (2, 1, 1), 1, SHAPES, timeout=600), graphs=2)


def test_varying_lengths_with_depth(distributed):
    """Depth splits the batch. The batch analysis of a loss computed inside forward fixes the length (the
    per-token values' entries per row): the symbolic graph then takes its own length only (its graph check
    says so; it used to accept every length and run on them with the first length's entries per row), so
    each shape is captured: serial's numbers, six graphs."""
    _check(distributed(shapes_worker, 2, "gpt2", (1, 1, 2), 1, SHAPES, timeout=600), graphs=6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "bert"])
def test_varying_lengths_with_recomputation(distributed, name):
    """Recomputed blocks (checkpoint='full') replay the symbolic graph: the same numbers."""
    _check(distributed(shapes_worker, 2, name, (1, 2, 1), 1, SHAPES, checkpoint="full", timeout=600), graphs=2)


@pytest.mark.slow
def test_varying_lengths_with_data_and_tensor(distributed):
    """As with depth: the lengths are fixed by the batch analysis, each shape is its own graph."""
    _check(distributed(shapes_worker, 4, "llama", (2, 1, 1), 2, SHAPES, timeout=600), graphs=6)
