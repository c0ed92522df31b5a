"""Dropout on activations a tensor axis splits (``passes.ir.split_dropout``): every rank draws the mask of the
whole tensor, in serial's order, and keeps its part, so the masks are serial's (at data 1) and differ between
the pieces, as serial's do. Oracle: the serial model with dropout on, same seed and data: losses, first-step
gradients and final parameters; eager attention (its dropout runs on the heads split over col), and the
residual stream split along the tokens (``sequence_parallel``)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.examples import zoo
from autopar.parallel_model import runtime_of
from tests.helpers import rel_err, train_with_labels

TOL = 1e-5


def _build() -> torch.nn.Module:
    model = zoo.build_model("gpt2", dropout=True)
    model.config._attn_implementation = "eager"  # attention dropout as an op on the (split) probabilities
    return model


def _train(model: torch.nn.Module, data: list[torch.Tensor], grads_of) -> dict:
    torch.manual_seed(1)  # the masks' generator, alike on every rank and in serial
    return train_with_labels(model, data, grads_of)


def _worker(tensor: tuple[int, int, int], options: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, zoo.VOCAB, (4, 16), generator=g) for _ in range(3)]
    torch.manual_seed(0)
    serial = _build()
    want = _train(serial, data, lambda m: {n: p.grad.clone() for n, p in m.named_parameters()})
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, **options):
        model = _build()
    got = _train(model, data, lambda m: runtime_of(m).full_grads())
    final = autopar.full_state_dict(model)
    torch.manual_seed(0)
    without = _build()
    zoo.no_dropout(without.config)
    for module in without.modules():  # (the config is read at construction: the modules hold p)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    unmasked = _train(without, data, lambda m: {})["losses"]
    autopar.detach(model)
    return {
        "loss": max(abs(a - b) for a, b in zip(want["losses"], got["losses"])),
        "grads": max(rel_err(want["grads"][k], got["grads"][k]) for k in want["grads"]
                     if got["grads"].get(k) is not None),
        "params": max(rel_err(v, final[k]) for k, v in serial.state_dict().items() if k in final),
        "logits": rel_err(want["logits"], got["logits"]),  # (no_grad, in training: masks drawn there too)
        "masked": max(abs(a - b) for a, b in zip(unmasked, got["losses"])),  # the masks dropped something
    }


@pytest.mark.parametrize("tensor, options", [((1, 2, 1), {}), ((2, 1, 1), {"sequence_parallel": True})],
                         ids=["heads-over-col", "tokens-over-row"])
def test_dropout_on_split_activations_draws_serials_masks(distributed, tensor, options):
    for out in distributed(_worker, 2, tensor, options):
        assert max(out["loss"], out["grads"], out["params"], out["logits"]) < TOL and out["masked"] > 1e-3, out


def _sdpa_worker(checkpoint: str) -> tuple[list[float], dict]:
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, zoo.VOCAB, (4, 16), generator=g) for _ in range(3)]
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(1, 2, 1), checkpoint=checkpoint):
        model = zoo.build_model("gpt2", dropout=True)  # SDPA draws the attention dropout itself
    out = _train(model, data[:2], lambda m: runtime_of(m).full_grads())
    autopar.detach(model)
    return out["losses"], out["grads"]


def test_attention_dropout_on_split_heads_draws_per_piece_and_again_when_recomputed(distributed):
    """SDPA's own dropout (``passes.ir.split_random``) on the heads split over col: a recomputed block draws the
    masks its forward drew (the forked state comes from the generator's, which the checkpoint restores)."""
    kept = distributed(_sdpa_worker, 2, "none")
    recomputed = distributed(_sdpa_worker, 2, "full")
    for (losses, grads), (again, grads_again) in zip(kept, recomputed):
        assert max(abs(a - b) for a, b in zip(losses, again)) < TOL
        assert max(rel_err(grads[k], grads_again[k]) for k in grads if grads[k] is not None) < TOL
    assert kept[0][0] == kept[1][0]  # the ranks' losses agree
