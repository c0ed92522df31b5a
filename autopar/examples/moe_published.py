"""Published mixture-of-experts models at their real sizes, for planning on paper (HuggingFace transformers 5.x).

``build_model(name)`` and ``example_inputs(name)`` make this file a model file for the plan and trace CLIs; build
them on the meta device (the CLIs do): nothing is allocated.

    python -m autopar.plan autopar/examples/moe_published.py:qwen3-30b-a3b --gpus 16 --hardware h100-80gb \\
        --precision bf16 --global-batch 256 --evaluate "data=16 expert_parallel"

Shapes from the models' published configurations: Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen team, "Qwen3 Technical
Report", arXiv 2505.09388; their HF configs), DeepSeek-V3 (DeepSeek-AI, arXiv 2412.19437; its HF config, without
the multi-token-prediction module, which HF's model does not build). 4,096-token sequences, as Megatron-Bridge's
recipes train them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

SEQ = 4096

#: name -> (config class, model class, config keywords).
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                           num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                           rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                             num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                             num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                             max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                         num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
                         num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
                         num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                         max_position_embeddings=163840, tie_word_embeddings=False)),
}


class TrainingLoss(nn.Module):
    """The model as a training step calls it: its causal-LM loss on the tokens (HF's ``labels=``), so the plan
    prices the loss on each rank's rows, not the logits of the whole batch gathered to every rank."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def build_model(name: str = "qwen3-30b-a3b") -> nn.Module:
    """The named model (``MODELS``) with its training loss (``TrainingLoss``)."""
    import transformers

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    config_cls, model_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(**kwargs, use_cache=False)
    for key in ("attention_dropout", "hidden_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return TrainingLoss(getattr(transformers, model_cls)(config))


def example_inputs(name: str = "qwen3-30b-a3b", batch: int = 8, seq: int = SEQ) -> tuple:
    return (torch.zeros(batch, seq, dtype=torch.long),)
