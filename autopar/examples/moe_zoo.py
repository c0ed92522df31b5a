"""Mixture-of-experts families of HuggingFace transformers 5.x at tiny sizes, unmodified.

``build_model(name)`` and ``example_inputs(name)`` make this file a model file for the trace CLI:
``python -m autopar.trace autopar/examples/moe_zoo.py:mixtral --tensor 2 1 1 --data 2``. Tiny configs: hidden
32, 4 heads, 4 experts (2 per token), vocabulary 128, two layers, every dropout 0. A family the installed
transformers lacks is left out of ``NAMES``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from autopar.examples.zoo import no_dropout

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64)
_EXPERTS = dict(num_experts_per_tok=2)

#: name -> (config class, model class, config keywords beyond the common ones).
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=64, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # a shared expert beside the routed ones
                  dict(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4, head_dim=8)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",  # expert biases, sliding-window layers
                dict(intermediate_size=32, num_local_experts=4, head_dim=8, sliding_window=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=32, num_experts=4)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(intermediate_size=32, num_local_experts=4)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",  # a dense first layer, grouped routing
                 dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",  # a router scattering its top-1 scores in place
               dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
                    head_dim=8, interleave_moe_layer_step=1)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",  # multi-head latent attention (MLA)
                    dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=1, topk_group=1, num_key_value_heads=4, kv_lora_rank=16,
                         q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8)),
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM",  # experts sized by .tolist() of the routing counts
               dict(intermediate_size=32, num_local_experts=4, kv_channels=8)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",  # a router with its own autograd Function; samples in training
               dict(intermediate_size=32, num_local_experts=4)),
}


def _available() -> tuple[str, ...]:
    try:
        import transformers
    except ImportError:
        return ()
    return tuple(n for n, (config, model, _) in _FAMILIES.items()
                 if hasattr(transformers, config) and hasattr(transformers, model))


NAMES = _available()
#: Families whose training forward draws random numbers (PhiMoE's router samples experts): on a grid that
#: splits the batch each rank draws for its own rows, as DDP's ranks do, so DDP is the oracle there.
RANDOM_IN_TRAINING = ("phimoe",)


def build_model(name: str = "mixtral", *, experts: str | None = None, router_logits: bool = False) -> nn.Module:
    """The named family with random weights. ``experts``: transformers' experts implementation ("eager",
    "batched_mm"; default its own, ``grouped_mm``); ``router_logits``: the load-balancing loss in ``loss``."""
    import transformers

    if name not in _FAMILIES:
        raise ValueError(f"unknown MoE family {name!r}; choose one of {', '.join(NAMES)}")
    config_cls, model_cls, extra = _FAMILIES[name]
    kwargs = {**_COMMON, **_EXPERTS, **extra}
    if name == "jetmoe":  # (heads are its kv_channels' business)
        kwargs.pop("num_attention_heads")
    if experts is not None:
        kwargs["experts_implementation"] = experts
    config = getattr(transformers, config_cls)(**kwargs)
    no_dropout(config)
    if router_logits:
        config.output_router_logits = True
    return getattr(transformers, model_cls)(config)


def example_inputs(name: str = "mixtral", batch: int = 8, seq: int = 16, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, seq), generator=g),)
