"""Models unlike the dense transformers autopar's tests grew around, and the training loop both sides run:
torch's own attention and encoder layers, a BatchNorm CNN, a straight-through autograd Function, HF MoE
families (``autopar.examples.moe_zoo``). Importable by forked workers."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.examples import moe_zoo

V, H = 128, 32


class MHADecoder(nn.Module):
    """A decoder block on ``nn.MultiheadAttention`` (batch first: it folds the batch into the heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.attn = nn.MultiheadAttention(H, 4, batch_first=True)
        self.ln = nn.LayerNorm(H)
        self.ff = nn.Sequential(nn.Linear(H, 64), nn.GELU(), nn.Linear(64, H))
        self.head = nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        t = ids.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        h = h + a
        return self.head(h + self.ff(self.ln(h)))


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` of two ``nn.TransformerEncoderLayer``s."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        layer = nn.TransformerEncoderLayer(H, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids)))


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class ResNet(nn.Module):
    """A small ResNet: BatchNorm2d (running statistics updated in place in training) in repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.blocks = nn.Sequential(_Block(8), _Block(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.fc(h.mean((2, 3)))


class RoundSTE(torch.autograd.Function):
    """Rounding with a straight-through gradient (quantization-aware training's estimator)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class STENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(RoundSTE.apply(self.a(x) * 4) / 4)


TORCH_MODELS = {"mha": MHADecoder, "encoder": Encoder, "resnet": ResNet, "ste": STENet}
#: HF MoE families under another experts implementation or loss: "mixtral+eager" (transformers' per-expert
#: loop, which export cannot capture: the fallback), "+labels" (HF's own loss), "+aux" (the load-balancing loss).
VARIANTS = {"mixtral+eager+labels": dict(experts="eager"), "mixtral+aux": dict(router_logits=True)}


def is_hf(name: str) -> bool:
    return name.split("+")[0] in moe_zoo.NAMES


def build(name: str) -> nn.Module:
    if name in TORCH_MODELS:
        return TORCH_MODELS[name]()
    return moe_zoo.build_model(name.split("+")[0], **VARIANTS.get(name, {}))


def batches(name: str, steps: int = 3, batch: int = 8, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        if name == "resnet":
            out.append((torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)))
        elif name == "ste":
            out.append((torch.randn(batch, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)))
        else:
            ids = torch.randint(0, V, (batch, seq), generator=g)
            out.append((ids, ids))
    return out


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if "labels" in name:
        return model(x, labels=y, use_cache=False).loss
    if "aux" in name:  # HF's loss with the load-balancing term (router_aux_loss_coef x aux_loss)
        return model(x, labels=y, use_cache=False).loss
    out = model(x, use_cache=False) if is_hf(name) else model(x)
    logits = out.logits if hasattr(out, "logits") else out
    if logits.dim() == 3:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1))
    return F.cross_entropy(logits, y)


def train(name: str, model: nn.Module, data: list, state: Any = None, generate: bool = True) -> dict[str, Any]:
    """Three SGD steps (momentum: Adam's normalization would amplify last-bit differences of gradients that
    are zero in exact arithmetic), then the final state (``state(model)``: the serial-shaped state dict) and,
    for an HF model, greedy ``generate()`` tokens in eval mode."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        loss = loss_of(name, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    sd = state(model) if state is not None else model.state_dict()
    out: dict[str, Any] = {"losses": losses, "state": {k: v.detach().clone() for k, v in sd.items()}}
    if is_hf(name) and generate:
        model.eval()
        with torch.no_grad():
            out["tokens"] = model.generate(data[0][0][:2, :6], max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out


def serial(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    return train(name, build(name), batches(name))
