"""A zoo of transformer models, unmodified, at tiny and real sizes (HuggingFace transformers 5.x).

``build_model(name)`` and ``example_inputs(name)`` make this file a model file for the trace CLI:
``python -m autopar.trace autopar/examples/zoo.py:llama --tensor 2 2 1``. Tiny configs keep every
size divisible by 4 where the architecture allows (hidden 32, 4 heads, vocab 128) and set every
dropout probability to 0 so parallel runs can be compared with serial ones number for number.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from autopar.examples.nanogpt import GPT, GPTConfig

VOCAB, HIDDEN, HEADS, FFN, LAYERS, POSITIONS = 128, 32, 4, 64, 2, 64

#: name -> (config class, model class, config keywords). Causal LMs first.
_HF: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",  # q/k norms over each head
              dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=2, head_dim=8, max_position_embeddings=POSITIONS)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=1, head_dim=8,
                   max_position_embeddings=POSITIONS)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                  pad_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, max_position_embeddings=POSITIONS, word_embed_proj_dim=HIDDEN)),
    "gpt-neo": ("GPTNeoConfig", "GPTNeoForCausalLM",
                dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                     attention_types=[[["global", "local"], 1]], max_position_embeddings=POSITIONS,
                     window_size=8)),
    "bert": ("BertConfig", "BertForMaskedLM",
             dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=POSITIONS)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM",
                dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, max_position_embeddings=POSITIONS + 2)),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM",
                   dict(vocab_size=VOCAB, dim=HIDDEN, hidden_dim=FFN, n_layers=LAYERS, n_heads=HEADS,
                        max_position_embeddings=POSITIONS)),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                  max_position_embeddings=POSITIONS)),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=1, num_heads=HEADS)),
    "vit": ("ViTConfig", "ViTForImageClassification",
            dict(image_size=16, patch_size=4, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, intermediate_size=FFN, num_labels=10)),
}

#: Real sizes, for planning on the meta device only.
REAL: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-2-70b": ("LlamaConfig", "LlamaForCausalLM",
                    dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                         rms_norm_eps=1e-5)),
    "llama-2-7b": ("LlamaConfig", "LlamaForCausalLM",
                   dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)),
    "gpt2-xl": ("GPT2Config", "GPT2LMHeadModel",
                dict(vocab_size=50257, n_embd=1600, n_layer=48, n_head=25, n_positions=1024)),
}

ENCODER_DECODER = ("bart", "t5")
ENCODERS = ("bert", "roberta", "distilbert")
NAMES = ("nanogpt", *_HF)


def no_dropout(config: Any) -> None:
    for key, value in list(vars(config).items()):
        if ("drop" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)


_LAYER_KEYS = ("n_layer", "n_layers", "num_layers", "num_hidden_layers", "num_decoder_layers")


def build_model(name: str = "llama", *, dropout: bool = False, layers: int | None = None) -> nn.Module:
    """The named model with random weights (tiny unless the name is in REAL), optionally with ``layers`` blocks."""
    if name == "nanogpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=POSITIONS, n_layer=layers or LAYERS, n_head=HEADS, n_embd=HIDDEN,
                             dropout=0.1 if dropout else 0.0))
    import transformers

    table = REAL if name in REAL else _HF
    if name not in table:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(NAMES + tuple(REAL))}")
    config_cls, model_cls, kwargs = table[name]
    if layers is not None:
        kwargs = {k: layers if k in _LAYER_KEYS else v for k, v in kwargs.items()}
        if "attention_types" in kwargs:  # GPT-Neo alternates global and local attention
            kwargs["attention_types"] = [[["global", "local"], layers // 2]] + [[["global"], layers % 2]] * (layers % 2)
    config = getattr(transformers, config_cls)(**kwargs)
    if not dropout:
        no_dropout(config)
    return getattr(transformers, model_cls)(config)


def example_inputs(name: str = "llama", batch: int = 4, seq: int = 16, seed: int = 0) -> tuple:
    """One batch of positional inputs: token ids (or pixels), plus decoder ids for encoder-decoders."""
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return (torch.randn(batch, 3, 16, 16, generator=g),)
    vocab = REAL[name][2].get("vocab_size", VOCAB) if name in REAL else VOCAB
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return (ids,)


def example_kwargs(name: str, batch: int = 4, seq: int = 16, seed: int = 1) -> dict[str, Any]:
    """Keyword inputs the model needs besides ``example_inputs`` (decoder ids, attention masks)."""
    g = torch.Generator().manual_seed(seed)
    if name in ENCODER_DECODER:
        return {"decoder_input_ids": torch.randint(0, VOCAB, (batch, seq // 2), generator=g)}
    if name in ENCODERS:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, seq - 3:] = 0  # one padded row: the mask must reach attention
        return {"attention_mask": mask}
    return {}


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output (HF ModelOutput, tuple or tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return output[0]
