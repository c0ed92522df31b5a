"""Small models and the serial oracle shared by tests (importable by forked workers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.examples.fc_net import FC_Net, synthetic_mnist

#: Small FC_Net: features divide by 8 (hidden 16, 4*16, 8*8 inputs); 10 classes do not divide by 4 or 8.
SMALL = dict(num_layers=2, hidden=16, image_size=8)


def batches(steps: int = 5, batch: int = 13, last: int = 9, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches; all of ``batch`` rows except a smaller last one (a new shape)."""
    out = list(synthetic_mnist(steps, batch, SMALL["image_size"], seed))
    x, y = out[-1]
    out[-1] = (x[:last], y[:last])
    return out


def train(model: torch.nn.Module, data: list, lr: float = 1e-2, on_step=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if on_step is not None:
            on_step(step, model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def serial_run(data: list, seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, final parameters and first-step gradients of the serial model."""
    torch.manual_seed(seed)
    model = FC_Net(**SMALL)
    grads: dict[str, torch.Tensor] = {}

    def keep(step: int, m: torch.nn.Module) -> None:
        if step == 0:
            grads.update({n: p.grad.clone() for n, p in m.named_parameters()})

    losses = train(model, data, on_step=keep)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| (0 when both are 0)."""
    denom = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / denom if denom else diff
