"""Zoo parity: train a zoo model serially and under autopar; both sides share this code."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autopar.examples import zoo


def batches(name: str, steps: int = 2, batch: int = 4, seq: int = 16) -> list[tuple[tuple, dict, torch.Tensor]]:
    out = []
    for s in range(steps):
        args = zoo.example_inputs(name, batch, seq, seed=s)
        kwargs = zoo.example_kwargs(name, batch, seq, seed=100 + s)
        g = torch.Generator().manual_seed(200 + s)
        if name == "vit":
            target = torch.randint(0, 10, (batch,), generator=g)
        else:
            t = kwargs["decoder_input_ids"].shape[1] if name in zoo.ENCODER_DECODER else seq
            target = torch.randint(0, zoo.VOCAB, (batch, t), generator=g)
        out.append((args, kwargs, target))
    return out


def loss_of(model: torch.nn.Module, args: tuple, kwargs: dict, target: torch.Tensor) -> torch.Tensor:
    logits = zoo.logits_of(model(*args, **kwargs))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def train(model: torch.nn.Module, data: list, grads_of=None, step_fn=None) -> tuple[list[float], Any]:
    """Losses of a few AdamW steps; ``grads_of(model)`` is called after the first backward.

    ``step_fn(model, args, kwargs, target)`` replaces forward + loss + backward (autopar.train_step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step, (args, kwargs, target) in enumerate(data):
        if step_fn is None:
            loss = loss_of(model, args, kwargs, target)
            loss.backward()
        else:
            loss = step_fn(model, args, kwargs, target)
        if step == 0 and grads_of is not None:
            grads = grads_of(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def serial(name: str, data: list, seed: int = 0, layers: int | None = None
           ) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = zoo.build_model(name, layers=layers)
    return train(model, data, lambda m: {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})


def parallel(name: str, data: list, tensor: tuple[int, int, int], data_degree: int | None = None,
             seed: int = 0, layers: int | None = None, checkpoint: str | int = "auto",
             pipeline: dict[str, Any] | None = None, use_train_step: bool = False) -> dict[str, Any]:
    """Runs on every rank (forked by run_distributed); returns losses, first-step grads and the plan.

    ``pipeline``: auto_parallelize's pipeline keywords (pipeline=, microbatches=, schedule=, chunks=)."""
    import autopar
    from autopar.parallel_model import runtime_of
    from autopar.runtime.params.layout import held_numel

    torch.manual_seed(seed)
    with autopar.auto_parallelize(tensor=tensor, data=data_degree, checkpoint=checkpoint, **(pipeline or {})):
        model = zoo.build_model(name, layers=layers)
    def with_train_step(m, args, kwargs, target):
        inputs = kwargs if not args else (args if not kwargs else None)
        assert inputs is not None, "train_step takes positional or keyword inputs, not both"
        return autopar.train_step(m, inputs, target, F.cross_entropy)

    losses, grads = train(model, data, lambda m: runtime_of(m).full_grads(),
                          with_train_step if use_train_step else None)
    plan = autopar.plan_of(model)
    held = sum(held_numel(p) for p in model.parameters())
    return {"losses": losses, "grads": grads, "plan": plan, "held": held,
            "state": {k: v for k, v in autopar.full_state_dict(model).items()}}


def assert_matches_serial(results: list[dict], losses: list[float], grads: dict[str, torch.Tensor],
                          tol: float, name: str = "") -> None:
    """Every rank's losses within ``tol`` relative, and each gradient within ``tol`` of its norm plus 1% of
    the model's whole gradient norm (some gradients are zero in exact arithmetic: rounding noise)."""
    scale = torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item()
    for r in results:
        for got, want in zip(r["losses"], losses, strict=True):
            assert abs(got - want) <= tol * abs(want), (name, r["losses"], losses)
        for k, want in grads.items():
            err = (r["grads"][k].double() - want.double()).norm().item()
            assert err <= tol * (want.double().norm().item() + 1e-2 * scale), (name, k, err)
