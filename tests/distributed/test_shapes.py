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
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.parallel_model import runtime_of
from autopar.examples import zoo

# (rows, length) per step: lengths vary at every step, rows at some (a last, smaller batch)
SHAPES = [(4, 9), (4, 14), (3, 6), (4, 11), (2, 16), (4, 5)]


def shapes_worker(name: str, tensor: tuple, data: int, shapes: list, checkpoint: str = "auto",
                  train_step: bool = False, pipeline: int = 1) -> dict:
    torch.manual_seed(0)
    serial = zoo.build_model(name)
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, data=data, pipeline=pipeline, checkpoint=checkpoint):
        model = zoo.build_model(name)
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.5) for m in (serial, model)}
    g = torch.Generator().manual_seed(0)
    losses, grads = [], []
    for rows, length in shapes:
        ids = torch.randint(1, zoo.VOCAB, (rows, length), generator=g)
        labels = torch.randint(1, zoo.VOCAB, (rows, length), generator=g)
        got = {}
        for m in (serial, model):
            if train_step and m is model:  # logits out of forward, autopar's vocabulary-parallel loss and backward
                got[m] = autopar.train_step(m, ids, labels, F.cross_entropy).item()
                continue
            if train_step:
                logits = m(ids).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            else:
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
    """Depth splits the batch, and each rank's rows are symbolic too (its graph's batch ops read the call's row
    counts and entries per row): the first shape, then one graph for the shapes whose rows give each rank two or
    more; (3, 6) and (2, 16) leave one row on a rank, which export fixes (a size of 1), each its own graph."""
    _check(distributed(shapes_worker, 2, "gpt2", (1, 1, 2), 1, SHAPES, timeout=600), graphs=4)


# (rows, length) per step where data x depth split the batch: two or more rows on every rank, unevenly at 5
SPLIT_SHAPES = [(4, 9), (6, 14), (8, 6), (4, 11), (10, 16), (5, 5)]


def test_varying_rows_and_lengths_with_depth_train_through_one_graph(distributed):
    """Every batch size and length after the first through one graph, the loss inside forward (cross-entropy
    per token: entries per row are the length). Mutation: ops bound to the first call's row counts fail it."""
    _check(distributed(shapes_worker, 2, "gpt2", (1, 1, 2), 1, SPLIT_SHAPES, timeout=600), graphs=2)


class RowMixer(nn.Module):
    """Ops across the rows that data x depth split: batch statistics and a softmax over the rows (rows gathered,
    then each rank's scattered back), means over the batch and the tokens (partial sums completed, the count
    per row a length), and optionally the batch size as a number (``x.size(0)``, which a graph of symbolic rows
    would read as this rank's rows)."""

    def __init__(self, by_size: bool) -> None:
        super().__init__()
        self.by_size = by_size
        self.emb, self.a, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(self.emb(x)))                  # (B, T, 16)
        h = h - h.mean(dim=(0, 1), keepdim=True)             # batch statistics over every token
        z = self.head(h)                                     # (B, T, 8)
        over_rows = torch.softmax(z, dim=0)
        loss = F.cross_entropy(z.reshape(-1, 8), y.reshape(-1), ignore_index=-1)
        loss = loss + (over_rows * z).sum(-1).mean(0).sum()
        loss = loss + F.mse_loss(over_rows, torch.full_like(over_rows, 0.1))  # a mean over B x T x 8
        if self.by_size:
            loss = loss + (z ** 2).sum() / x.size(0)
        return z, loss


def row_mixer_worker(tensor: tuple, data: int, by_size: bool) -> dict:
    torch.manual_seed(0)
    serial = RowMixer(by_size)
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, data=data):
        model = RowMixer(by_size)
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.1) for m in (serial, model)}
    g = torch.Generator().manual_seed(0)
    losses, grads, outputs = [], [], []
    for rows, length in SPLIT_SHAPES:
        x, y = torch.randint(0, 32, (rows, length), generator=g), torch.randint(0, 8, (rows, length), generator=g)
        y[0, 1] = -1
        got = {}
        for m in (serial, model):
            z, loss = m(x, y)
            (loss + z.square().mean()).backward()
            got[m] = (loss.item(), z.detach())
        losses.append(abs(got[model][0] - got[serial][0]) / abs(got[serial][0]))
        outputs.append((got[model][1] - got[serial][1]).abs().max().item())
        grads.append(worst(runtime_of(model).full_grads(),
                           {n: p.grad for n, p in serial.named_parameters() if p.grad is not None}))
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad()
    params = worst(autopar.full_state_dict(model), dict(serial.named_parameters()))
    graphs = sum(len(v) for v in runtime_of(model).executables.values())
    return {"loss": max(losses + outputs), "grad": max(grads), "param": params, "graphs": graphs,
            "parallel": autopar.plan_of(model) is not None and not runtime_of(model).fallback}


@pytest.mark.parametrize("by_size, graphs", [(False, 2), (True, 6)])
def test_ops_across_rows_with_varying_batch_sizes(distributed, by_size, graphs):
    """Depth 2: gathered and scattered rows, completed means and the batch's size take each call's rows. A
    model that computes with ``x.size(0)`` after a reduction over the batch is captured per batch size (its
    number is scaled to the whole batch's there, ``passes.split_batch``), as before graphs of symbolic rows."""
    _check(distributed(row_mixer_worker, 2, (1, 1, 2), 1, by_size, timeout=600), graphs=graphs)


@pytest.mark.parametrize("tensor", [(2, 1, 1), (1, 1, 2)])
def test_varying_shapes_through_train_step(distributed, tensor):
    """``autopar.train_step`` (outputs left as each rank computed them; at (2,1,1) the loss vocabulary-
    parallel on split logits): the first shape, then one graph of symbolic rows and lengths."""
    _check(distributed(shapes_worker, 2, "llama", tensor, 1, SPLIT_SHAPES, train_step=True, timeout=600), graphs=2)


def test_varying_shapes_through_a_pipeline(distributed):
    """Pipeline 2 x data 2, plain calls (each runs every stage in order; the stages' boundaries carry each
    call's sizes ahead of the values, and a size read past a boundary travels as a number): two graphs."""
    _check(distributed(shapes_worker, 4, "llama", (1, 1, 1), 2, SPLIT_SHAPES, pipeline=2, timeout=600), graphs=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "bert"])
def test_varying_lengths_with_recomputation(distributed, name):
    """Recomputed blocks (checkpoint='full') replay the symbolic graph: the same numbers."""
    _check(distributed(shapes_worker, 2, name, (1, 2, 1), 1, SHAPES, checkpoint="full", timeout=600), graphs=2)


@pytest.mark.slow
def test_varying_rows_and_lengths_with_data_and_tensor(distributed):
    """As with depth: data 2 x tensor (2,1,1), every shape after the first through one graph."""
    _check(distributed(shapes_worker, 4, "llama", (2, 1, 1), 2, SPLIT_SHAPES, timeout=600), graphs=2)
