"""Small models and the serial oracle shared by tests (importable by forked workers)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from autopar.compat import TorchDispatchMode
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


def train_with_labels(model: torch.nn.Module, data: list[torch.Tensor], grads_of, prompt: int = 6) -> dict:
    """Three SGD steps of an HF causal LM with its own ``labels=`` loss, then ``model(x)``'s logits and greedy
    ``generate()`` tokens from the first batch's first ``prompt`` tokens: the losses, the first step's
    gradients (``grads_of(model)``), the logits, the tokens and ``comm_stats()``'s total per step."""
    import autopar

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # (Adam amplifies last-bit differences)
    losses, grads, comm = [], None, []
    for i, ids in enumerate(data):
        autopar.reset_comm_stats()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        comm.append(autopar.comm_stats()["total"])
        if i == 0:
            grads = grads_of(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(data[0], use_cache=False).logits
    model.eval()
    tokens = model.generate(data[0][:2, :prompt], max_new_tokens=5, do_sample=False, pad_token_id=0)
    return {"losses": losses, "grads": grads, "logits": logits, "tokens": tokens, "comm": comm}


class SettleCollectives(TorchDispatchMode):
    """Sleeps briefly after every c10d op, so gloo's worker thread has released the op's tensors
    before the next op allocates (a measurement aid: the runtime itself never waits)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            time.sleep(0.002)
        return out
