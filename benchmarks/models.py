"""The benchmark's models, and what each peer needs written by hand for them.

A ``BenchModel`` builds the unchanged model, its batches and its loss, and says how a user of each peer
would parallelize it by hand: the FSDP2 units, a DTensor tensor-parallel plan written the way torch's
tutorials write it (Colwise into Rowwise), and a hand split into pipeline stages. A peer that cannot
take the model raises ``NotApplicable`` with the reason, which the table shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.examples.fc_net import FC_Net, synthetic_mnist

SIZES = ("tiny", "small")


class NotApplicable(Exception):
    """A peer cannot run this model without rewriting it (the message says why)."""


@dataclass(frozen=True)
class BenchModel:
    name: str
    size: str
    build: Callable[[], nn.Module]
    batch: int
    """Global batch (rows) of every step."""
    make_batches: Callable[[int, int], list[tuple[torch.Tensor, torch.Tensor]]]
    """(steps, batch) -> [(inputs, targets)], the same on every rank."""
    blocks: Callable[[nn.Module], nn.ModuleList]
    """The repeated blocks: FSDP2's units and the hand pipeline split's unit."""
    tp_plan: Callable[[nn.Module], dict[str, Any]]
    stages: Callable[[nn.Module, int], list[nn.Module]]
    """(model, num_stages) -> the stage modules, in order, sharing the model's parameters."""

    def loss(self, out: Any, targets: torch.Tensor) -> torch.Tensor:
        """The serial loss (autopar.train_step's meaning): cross-entropy over the logits' last dim."""
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _even_split(n: int, parts: int) -> list[tuple[int, int]]:
    bounds = [n * k // parts for k in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


def _check_stages(num_blocks: int, num_stages: int) -> None:
    if num_stages > num_blocks:
        raise NotApplicable(f"{num_blocks} blocks cannot fill {num_stages} hand-split stages")


# ---- FC_Net (the AxoNN tutorial's model) ------------------------------------------------------------------

_FC = {"tiny": dict(num_layers=4, hidden=512, image_size=28), "small": dict(num_layers=4, hidden=2048, image_size=64)}


class _FcStage(nn.Module):
    def __init__(self, model: FC_Net, first: int, stop: int) -> None:
        super().__init__()
        self.embed = model.embed if first == 0 else None
        self.layers = nn.ModuleList(model.layers[first:stop])
        self.clf = model.clf if stop == len(model.layers) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x.view(x.shape[0], -1))
        for layer in self.layers:
            x = layer(x)
        return self.clf(x) if self.clf is not None else x


def _fc_stages(model: FC_Net, num_stages: int) -> list[nn.Module]:
    _check_stages(len(model.layers), num_stages)
    return [_FcStage(model, a, b) for a, b in _even_split(len(model.layers), num_stages)]


def _fc_tp_plan(model: FC_Net) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for k in range(len(model.layers)):
        plan[f"layers.{k}.fc1"] = ColwiseParallel()
        plan[f"layers.{k}.fc2"] = RowwiseParallel()
    return plan


def _fc_net(size: str) -> BenchModel:
    shape = _FC[size]

    def make_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(synthetic_mnist(steps, batch, shape["image_size"]))

    return BenchModel("fc_net", size, lambda: FC_Net(**shape), 64 if size == "tiny" else 32, make_batches,
                      lambda m: m.layers, _fc_tp_plan, _fc_stages)


# ---- HuggingFace GPT-2 and Llama --------------------------------------------------------------------------

_GPT2 = {"tiny": dict(vocab_size=4096, n_embd=256, n_layer=4, n_head=8, n_positions=128),
         "small": dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)}  # GPT-2 124M
_LLAMA = {"tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128),
          "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024)}
_SEQ = {"tiny": 64, "small": 256}
# Mixtral-shaped: 8 experts of the Llama-sized MLP, 2 per token (its ~4x parameters, ~Llama's FLOPs)
_MIXTRAL = {"tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=128),
            "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                          num_attention_heads=12, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=1024)}


def _hf(config_cls: str, model_cls: str, kwargs: dict[str, Any]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        from autopar.examples.zoo import no_dropout

        config = getattr(transformers, config_cls)(**kwargs)
        no_dropout(config)  # parallel and serial runs compare number for number
        return getattr(transformers, model_cls)(config)

    return build


def _token_batches(vocab: int, seq: int) -> Callable[[int, int], list[tuple[torch.Tensor, torch.Tensor]]]:
    def make_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(steps):
            ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
            out.append((ids[:, :-1], ids[:, 1:]))  # next-token prediction
        return out

    return make_batches


def _gpt2_tp_plan(model: nn.Module) -> dict[str, Any]:
    raise NotApplicable("GPT-2's blocks are HF Conv1D, which DTensor's Colwise/RowwiseParallel do not take")


def _gpt2_stages(model: nn.Module, num_stages: int) -> list[nn.Module]:
    raise NotApplicable("GPT-2 ties wte and lm_head, which a hand split puts on the first and the last stage")


def _llama_tp_plan(model: nn.Module) -> dict[str, Any]:
    """torch's tensor-parallel tutorial plan for Llama, under HF's module names."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for k in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{k}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{k}.{name}"] = RowwiseParallel()
    return plan


class _LlamaStage(nn.Module):
    """Layers [first, stop) of a HF Llama, with the embedding on the first stage and the norm and head
    on the last; each stage recomputes the rotary embeddings (causal attention needs no mask under SDPA)."""

    def __init__(self, model: nn.Module, first: int, stop: int) -> None:
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first == 0 else None
        self.layers = nn.ModuleList(inner.layers[first:stop])
        self.rotary = inner.rotary_emb
        last = stop == len(inner.layers)
        self.norm, self.head = (inner.norm, model.lm_head) if last else (None, None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, position_embeddings=rotary, position_ids=positions)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def _llama_stages(model: nn.Module, num_stages: int) -> list[nn.Module]:
    if model.config.tie_word_embeddings:
        raise NotApplicable("the embedding is tied to the head, which a hand split puts on two stages")
    n = len(model.model.layers)
    _check_stages(n, num_stages)
    return [_LlamaStage(model, a, b) for a, b in _even_split(n, num_stages)]


def _gpt2(size: str) -> BenchModel:
    kw = _GPT2[size]
    return BenchModel("gpt2", size, _hf("GPT2Config", "GPT2LMHeadModel", kw), 8,
                      _token_batches(kw["vocab_size"], _SEQ[size]), lambda m: m.transformer.h,
                      _gpt2_tp_plan, _gpt2_stages)


def _llama(size: str) -> BenchModel:
    kw = _LLAMA[size]
    return BenchModel("llama", size, _hf("LlamaConfig", "LlamaForCausalLM", kw), 8,
                      _token_batches(kw["vocab_size"], _SEQ[size]), lambda m: m.model.layers,
                      _llama_tp_plan, _llama_stages)


def _mixtral_tp_plan(model: nn.Module) -> dict[str, Any]:
    raise NotApplicable("Mixtral's experts are 3-D grouped-matmul weights, which DTensor's Colwise/RowwiseParallel "
                        "do not take")


def _mixtral(size: str) -> BenchModel:
    kw = _MIXTRAL[size]
    return BenchModel("mixtral", size, _hf("MixtralConfig", "MixtralForCausalLM", kw), 8,
                      _token_batches(kw["vocab_size"], _SEQ[size]), lambda m: m.model.layers,
                      _mixtral_tp_plan, _llama_stages)  # (HF's Mixtral model has Llama's attribute names)


MODELS: dict[str, Callable[[str], BenchModel]] = {"fc_net": _fc_net, "gpt2": _gpt2, "llama": _llama,
                                                  "mixtral": _mixtral}
DEFAULT_MODELS = ("fc_net", "gpt2", "llama")
"""What ``python -m benchmarks`` runs without ``--models`` (mixtral: ``--models mixtral --grids d4 d4-e``)."""


def bench_model(name: str, size: str) -> BenchModel:
    if name not in MODELS or size not in SIZES:
        raise ValueError(f"unknown model {name!r} or size {size!r}; models: {', '.join(MODELS)}; "
                         f"sizes: {', '.join(SIZES)}")
    return MODELS[name](size)
