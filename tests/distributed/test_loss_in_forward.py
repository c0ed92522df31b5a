"""Models that compute their loss inside forward, trained on the same global batch as the serial model.

nanoGPT's ``logits, loss = model(x, y)``, HF's ``model(input_ids, labels=labels).loss`` (with -100
padding, and with ``num_items_in_batch``), and a model of every other reduction over the batch
autopar knows (batch statistics, a softmax over rows, weighted and smoothed cross-entropy, soft
targets, MSE, BCE, NLL, a parameter after the reduction, ``kl_div(reduction="batchmean")`` and
``loss.sum() / x.size(0)``): losses, first-step gradients and final parameters equal serial's on
data, depth, 3D and pipeline grids.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.config import ParallelConfig
from autopar.parallel_model import runtime_of
from autopar.planning.planner import plan_model
from autopar.examples import zoo
from autopar.examples.nanogpt import GPTConfig, NanoGPT
from tests.helpers import rel_err

TOL = 1e-5  # first-step differences are ~1e-7 (float32 sums in another order); AdamW carries them
GRIDS = {  # name -> (tensor, data, pipeline)
    "d4": ((1, 1, 1), 4, 1),
    "t211-d2": ((2, 1, 1), 2, 1),
    "t221": ((2, 2, 1), 1, 1),
    "t112-d2": ((1, 1, 2), 2, 1),
    "p2-d2": ((1, 1, 1), 2, 2),
}
NANO = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32)


def _tokens(steps: int, batch: int = 8, seq: int = 16, pad: int = -1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 128, (batch, seq), generator=g)
        y = torch.randint(0, 128, (batch, seq), generator=g)
        y[1, 10:] = pad  # padding: ignored targets on some ranks only
        y[3, :4] = pad
        out.append((x, y))
    return out


def _train(model: nn.Module, step, grads_of, steps: int = 3) -> dict:
    # SGD: Adam would turn gradients that are zero in exact arithmetic (a key bias) into full steps of noise.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], None
    for i in range(steps):
        loss = step(model, i)
        loss.backward()
        if i == 0:
            grads = grads_of(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def _serial_grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _full_grads(model: nn.Module) -> dict:
    return {k: v for k, v in runtime_of(model).full_grads().items() if v is not None}


def _build(grid: tuple | None, make) -> nn.Module:
    torch.manual_seed(0)
    if grid is None:
        return make()
    tensor, data, pipeline = grid
    with autopar.auto_parallelize(tensor=tensor, data=data, pipeline=pipeline):
        return make()


def _final(model: nn.Module, grid: tuple | None) -> dict:
    return {k: v.clone() for k, v in (model.state_dict() if grid is None else autopar.full_state_dict(model)).items()}


def nanogpt_run(grid: tuple | None) -> dict:
    data = _tokens(3)
    model = _build(grid, lambda: NanoGPT(GPTConfig(**NANO)))
    out = _train(model, lambda m, i: m(*data[i])[1], _full_grads if grid else _serial_grads)
    out["final"] = _final(model, grid)
    if grid is not None and grid[2] == 1:  # the bytes of one step: what the trace predicts
        autopar.reset_comm_stats()
        model(*data[0])[1].backward()
        out["measured"] = autopar.comm_stats()["total"]
        with torch.device("meta"):
            shadow = NanoGPT(GPTConfig(**NANO))
        config = ParallelConfig(grid[1], *grid[0])
        out["predicted"] = float(plan_model(shadow, data[0], config, rank=torch.distributed.get_rank())[1]
                                 .comm_bytes_per_step)
    return out


def hf_run(grid: tuple | None) -> dict:
    out = {}
    for name in ("llama", "gpt2"):
        for items in (False, True):
            data = _tokens(2, pad=-100)
            model = _build(grid, lambda: zoo.build_model(name))

            def step(m, i):
                x, y = data[i]
                kwargs = {"num_items_in_batch": (y[:, 1:] != -100).sum()} if items else {}
                return m(input_ids=x, labels=y, **kwargs).loss

            out[(name, items)] = _train(model, step, _full_grads if grid else _serial_grads, steps=2)
    return out


def _check(got: dict, want: dict, what: str) -> None:
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert abs(a - b) <= TOL * abs(b), (what, got["losses"], want["losses"])
    for k, g in want["grads"].items():
        assert rel_err(got["grads"][k], g) < TOL, (what, k, rel_err(got["grads"][k], g))
    for k, v in want.get("final", {}).items():
        assert rel_err(got["final"][k], v) < TOL, (what, k)


@pytest.mark.parametrize("grid", list(GRIDS))
def test_nanogpt_loss_inside_forward_matches_serial(grid, distributed):
    want = nanogpt_run(None)
    for rank, got in enumerate(distributed(nanogpt_run, 4, GRIDS[grid])):
        _check(got, want, (grid, rank))
        if "measured" in got:  # the loss's all-reduces (forward and backward) are in the trace's count
            assert got["measured"] == got["predicted"] > 0, (grid, rank, got["measured"], got["predicted"])


@pytest.mark.slow
@pytest.mark.parametrize("grid", list(GRIDS))
def test_hf_labels_loss_matches_serial(grid, distributed):
    want = hf_run(None)
    results = distributed(hf_run, 4, GRIDS[grid])
    for key, w in want.items():
        for rank, got in enumerate(results):
            _check(got[key], w, (grid, key, rank))


class Reductions(nn.Module):
    """Every reduction over the batch autopar completes, and ops along the batch dim."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 5)
        self.norm = nn.LayerNorm(16)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor, soft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))                             # (B, T, 16)
        h = self.norm(h - h.mean(dim=(0, 1), keepdim=True))   # batch statistics
        z = self.b(h)                                         # (B, T, 5)
        over_rows = torch.softmax(z, dim=0)                   # a softmax over the batch
        flat, target = z.reshape(-1, 5), y.reshape(-1)
        loss = F.cross_entropy(flat, target, weight=self.class_weight)
        loss = loss + F.cross_entropy(flat, target, label_smoothing=0.1)
        loss = loss + F.cross_entropy(flat, soft.reshape(-1, 5))
        loss = loss + F.mse_loss(over_rows, torch.full_like(over_rows, 0.2))
        loss = loss + F.binary_cross_entropy_with_logits(z, torch.sigmoid(z.detach()))
        loss = loss + F.nll_loss(F.log_softmax(flat, -1), target, reduction="sum") / 100
        loss = loss + (z.sum(0) ** 2).mean() * self.scale    # a parameter after the reduction
        loss = loss + F.kl_div(F.log_softmax(z, -1), soft, reduction="batchmean")
        loss = loss + (z ** 2).sum() / x.size(0)              # the batch size, as a number
        return z, loss


def _reduction_batches(steps: int = 2) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        y = torch.randint(0, 5, (8, 3), generator=g)
        y[0, 0] = y[5, 1] = -100
        out.append((torch.randn(8, 3, 8, generator=g), y, torch.softmax(torch.randn(8, 3, 5, generator=g), -1)))
    return out


def reductions_run(grid: tuple | None, local_only: bool = False) -> dict:
    if local_only:  # the mutation: each rank's partial sum taken as the whole batch's
        from autopar.runtime.ops import rows

        rows.BatchReduceOp.__call__ = lambda self, values, counts: (
            values.sum(0) / (counts.sum() if counts is not None else values.shape[0] * (self.spec.count_per_row or 1))
            if self.spec.mean else values.sum(0))
    data = _reduction_batches()
    model = _build(grid, Reductions)

    def step(m, i):
        z, loss = m(*data[i])
        return loss + z.square().mean()

    return {**_train(model, step, _full_grads if grid else _serial_grads, steps=2), "final": _final(model, grid)}


@pytest.mark.parametrize("grid", ["d4", "t112-d2", "t211-d2"])
def test_reductions_over_the_batch_inside_forward_match_serial(grid, distributed):
    want = reductions_run(None)
    for rank, got in enumerate(distributed(reductions_run, 4, GRIDS[grid])):
        _check(got, want, (grid, rank))


def test_partial_sums_taken_as_whole_fail_the_checks(distributed):
    want = reductions_run(None)
    got = distributed(reductions_run, 4, GRIDS["d4"], True)[0]
    with pytest.raises(AssertionError):
        _check(got, want, "mutation")


class VocabLM(nn.Module):
    """An LM head whose logits the plan splits along the vocabulary, and the cross-entropy forms on them."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.emb, self.mlp = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mlp(self.emb(x))))           # (B, T, V)
        flat, target = logits.view(-1, logits.size(-1)), y.view(-1)
        loss = F.cross_entropy(flat, target, ignore_index=-1)
        loss = loss + F.cross_entropy(flat, target, ignore_index=-1, label_smoothing=0.1)
        loss = loss + F.cross_entropy(logits.transpose(1, 2), y.clamp(min=0), reduction="sum") / 1000  # class dim 1
        return loss


VOCAB_GRIDS = {"t211": ((2, 1, 1), 2, 1), "t121": ((1, 2, 1), 2, 1), "t221": ((2, 2, 1), 1, 1),
               "t212": ((2, 1, 2), 1, 1)}


def vocab_run(grid: tuple | None, mutate: bool = False) -> dict:
    from autopar.runtime.ops import layouts, vocabulary

    if mutate:  # the mutation: the sums of exponentials and targets' logits left un-reduced
        layouts.ReduceFrom.apply = staticmethod(lambda x, *args: x)
    data = [(x, y.masked_fill(y == 5, -1)) for x, y in _tokens(3, seq=8)]
    data = [(x % 64, y % 64 - (y == -1).long() * 64) for x, y in data]  # vocabulary 64, padding -1 kept
    model = _build(grid, VocabLM)
    out = _train(model, lambda m, i: m(*data[i]), _full_grads if grid else _serial_grads)
    out["final"] = _final(model, grid)
    if grid is not None:
        exe = next(iter(runtime_of(model).executables.values()))[0]
        out["vocab_parallel"] = sum(isinstance(getattr(n.target, "__self__", None), vocabulary.VocabCrossEntropyOp)
                                    for n in exe.gm.graph.nodes)
        autopar.reset_comm_stats()
        model(*data[0]).backward()
        out["measured"] = autopar.comm_stats()["total"]
        with torch.device("meta"):
            shadow = VocabLM()
        config = ParallelConfig(grid[1], *grid[0])
        out["predicted"] = float(plan_model(shadow, data[0], config, rank=torch.distributed.get_rank())[1]
                                 .comm_bytes_per_step)
    return out


@pytest.mark.parametrize("grid", list(VOCAB_GRIDS))
def test_vocab_parallel_cross_entropy_inside_forward_matches_serial(grid, distributed):
    """Logits split along the vocabulary are never gathered for the loss: three cross-entropies (ignore_index,
    label smoothing, class dim 1 with reduction="sum") run vocabulary-parallel and match serial."""
    want = vocab_run(None)
    for rank, got in enumerate(distributed(vocab_run, 4, VOCAB_GRIDS[grid])):
        _check(got, want, (grid, rank))
        assert got["vocab_parallel"] == 3, (grid, rank, got["vocab_parallel"])
        assert got["measured"] == got["predicted"] > 0, (grid, rank, got["measured"], got["predicted"])


def test_vocab_parallel_cross_entropy_without_its_all_reduce_fails_the_checks(distributed):
    want = vocab_run(None)
    got = distributed(vocab_run, 4, VOCAB_GRIDS["t221"], True)[0]
    with pytest.raises(AssertionError):
        _check(got, want, "mutation")


def vocab_bad_target_run() -> str:
    with autopar.auto_parallelize(tensor=(2, 1, 1)):
        model = VocabLM()
    x = torch.zeros(2, 4, dtype=torch.long)
    try:
        model(x, torch.full((2, 4), 64))
    except autopar.AutoparError as e:
        return str(e)
    return "no error"


def test_vocab_parallel_cross_entropy_refuses_targets_out_of_range(distributed):
    for message in distributed(vocab_bad_target_run, 2):
        assert "target 64 is out of bounds for 64 classes" in message
