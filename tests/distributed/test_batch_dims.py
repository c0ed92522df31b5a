"""Inputs whose dim 0 is not the batch, and ``auto_parallelize(batch_dims=...)`` declaring where it is.

Data and depth parallelism split dim 0 of the inputs as the batch by default. A packed sequence of
tokens (torchtitan's style: one row of N tokens, or N tokens flat) has no batch there: autopar must
say so, naming the way out, instead of blaming a loss or hanging. Declared batch dims give serial's
results: sequence-first inputs (T, B, C) with ``{0: 1}``, and an input whose dim 0 only happens to
equal the batch size with ``{"bias": None}``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.parallel_model import runtime_of
from autopar.errors import AutoparError
from tests.helpers import rel_err


class SeqFirst(nn.Module):
    """Self-attention over (T, B, C) inputs, the layout of nn.Transformer(batch_first=False)."""

    def __init__(self, dim: int = 16, heads: int = 2, classes: int = 7) -> None:
        super().__init__()
        self.qkv, self.out, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, classes)
        self.heads = heads

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, b, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.reshape(t, b, self.heads, c // self.heads).permute(1, 2, 0, 3) for z in (q, k, v))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # (B, H, T, D)
        h = x + self.out(h.permute(2, 0, 1, 3).reshape(t, b, c))          # back to (T, B, C)
        logits = self.head(h)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class Packed(nn.Module):
    """Tokens of sequences packed into one row, attended over with a document mask (dim 0: tokens)."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.proj = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)                                            # (N, C)
        n = tokens.shape[0]
        mask = (documents[:, None] == documents[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        h = F.scaled_dot_product_attention(h[None], h[None], h[None], attn_mask=mask)[0]
        return self.proj(h)


class WithBias(nn.Module):
    """Takes a per-feature bias whose size happens to equal the batch size (8 rows, 8 features)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.lin(x + bias)


def _seq_first_data(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 8, 16, generator=g), torch.randint(0, 7, (6, 8), generator=g)) for _ in range(steps)]


def seq_first_run(grid: tuple | None, declare: bool = True) -> dict:
    torch.manual_seed(0)
    if grid is None:
        model = SeqFirst()
    else:
        with autopar.auto_parallelize(tensor=grid[0], data=grid[1], batch_dims={0: 1, 1: 1} if declare else None):
            model = SeqFirst()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for step, (x, y) in enumerate(_seq_first_data()):
        try:
            logits, loss = model(x, y)
        except AutoparError as e:
            return {"error": str(e)}
        loss.backward()
        if step == 0:
            grads = runtime_of(model).full_grads() if grid else {n: p.grad.clone() for n, p in model.named_parameters()}
            first_logits = logits.detach()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "logits": first_logits}


@pytest.mark.parametrize("grid", [((1, 1, 1), 4), ((2, 1, 1), 2), ((1, 1, 2), 2)])
def test_sequence_first_inputs_with_declared_batch_dims_match_serial(grid, distributed):
    want = seq_first_run(None)
    for got in distributed(seq_first_run, 4, grid):
        assert "error" not in got, got.get("error")
        for a, b in zip(got["losses"], want["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
        assert rel_err(got["logits"], want["logits"]) < 1e-5  # (T, B, classes): the whole batch, along dim 1
        for k, g in want["grads"].items():
            assert rel_err(got["grads"][k], g) < 1e-5, k


def test_sequence_first_inputs_without_the_declaration_raise(distributed):
    """dim 0 is the sequence: split as a batch, attention would cross the ranks' rows."""
    for got in distributed(seq_first_run, 4, ((1, 1, 1), 4), False):
        assert "attends across the dim" in got["error"] and "batch_dims" in got["error"], got


def packed_worker() -> str:
    torch.manual_seed(0)
    with autopar.auto_parallelize(data=2):
        model = Packed()
    tokens, documents = torch.randint(0, 32, (12,)), torch.tensor([0] * 5 + [1] * 7)  # two documents, packed
    try:
        model(tokens, documents)
    except AutoparError as e:
        return str(e)
    return "no error"


def packed_row_worker() -> str:
    torch.manual_seed(0)
    with autopar.auto_parallelize(data=2):
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    try:
        model(torch.randint(0, 32, (1, 12)))  # one packed row of 12 tokens: no batch to split over 2 ranks
    except AutoparError as e:
        return str(e)
    return "no error"


def test_packed_sequences_raise_naming_the_ways_out(distributed):
    for message in distributed(packed_worker, 2):
        assert "not a batch (packed sequences" in message and "batch_dims" in message, message
        assert "batch='per-rank'" in message and "data=1 and depth=1" in message, message
    for message in distributed(packed_row_worker, 2):
        assert "smaller than data*depth = 2" in message and "packed sequence" in message, message
        assert "batch_dims" in message and "batch='per-rank'" in message, message


def bias_run(declare: bool | None) -> torch.Tensor | str:
    g = torch.Generator().manual_seed(0)
    x, bias = torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
    torch.manual_seed(0)
    if declare is None:
        model = WithBias()
    else:
        with autopar.auto_parallelize(data=2, batch_dims={"bias": None} if declare else None):
            model = WithBias()
    try:
        return model(x, bias=bias).detach()
    except AutoparError as e:
        return str(e)


def test_an_input_declared_batchless_is_not_split(distributed):
    want = bias_run(None)
    for got in distributed(bias_run, 2, True):
        assert rel_err(got, want) < 1e-6
    # without the declaration the bias's 8 entries are split as 8 rows: an error that names the input and the fix
    for got in distributed(bias_run, 2, False):
        assert "'bias' (dim 0, shape (8,))" in got and "batch_dims" in got, got
