"""A small Llama-3 written in the idioms of torchtitan's llama3 model (written here, not copied).

What matters for autopar is how the code is written, not the checkpoint: RMSNorm, rotary embeddings
from a complex ``freqs_cis`` table (``view_as_complex`` of adjacent pairs, ``view_as_real`` +
``flatten`` back), a fused ``wqkv`` (or three projections) cut into heads with ``view`` + ``split``,
grouped-query attention whose k/v heads go to SDPA with ``enable_gqa`` (or are repeated first,
``repeat_kv``: expand + reshape), heads moved with ``transpose``, and the attention's output
flattened with ``.contiguous()`` + ``.view``: a trace drops the ``.contiguous()`` when SDPA's output
(laid out as the query, by CPU's and GPU's fused kernels) is already contiguous after the
transpose, so the ``view`` runs on it directly. SwiGLU feed-forward, depth-scaled init, tied or
untied output projection. The small defaults are for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TitanLlamaArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 96
    multiple_of: int = 16
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 64
    enable_gqa: bool = True
    """Pass k/v with fewer heads to SDPA (``enable_gqa=True``, torchtitan's current code) instead of
    repeating them first (``repeat_kv``, its earlier code)."""
    tie_embeddings: bool = False
    """The output projection shares the embeddings' weight."""
    fuse_qkv: bool = True
    """One ``wqkv`` projection whose output holds, per kv head, its query heads then its key and value
    (torchtitan's default), split with ``view`` + ``split``; else ``wq``, ``wk``, ``wv``."""
    token_major: bool = False
    """Flatten the attention output as ``out_TNH.view(T, -1)`` over the batch's tokens (torchtitan's
    packed-token layout) instead of ``(bs, seqlen, -1)``."""


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    # (end, dim/2) complex64: position t times each pair's frequency, on the unit circle
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (bs, seqlen, n, head_dim) as (bs, seqlen, n, head_dim/2) complex pairs
    xq_c = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_c = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    seqlen = xq.shape[1]
    cis = freqs_cis[:seqlen].view(1, seqlen, 1, xq_c.shape[-1])
    xq_out = torch.view_as_real(xq_c * cis).flatten(3)
    xk_out = torch.view_as_real(xk_c * cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(bs, seqlen, n_kv, head_dim) -> (bs, seqlen, n_kv * n_rep, head_dim), each kv head n_rep times."""
    bs, slen, n_kv, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, head_dim).reshape(bs, slen, n_kv * n_rep, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f = x.float()
        out = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: TitanLlamaArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.enable_gqa, self.token_major = args.enable_gqa, args.token_major
        if args.fuse_qkv:
            self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
            self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 heads: the count a sharded projection leaves (torchtitan's idiom for tensor parallelism)
        if hasattr(self, "wqkv"):
            # (bs, seqlen, n_kv, n_rep + 2, head_dim): each kv group's query heads, its key, its value
            qkv = self.wqkv(x).view(bs, seqlen, -1, self.n_rep + 2, self.head_dim)
            xq, xk, xv = torch.split(qkv, [self.n_rep, 1, 1], dim=-2)
            xq = xq.reshape(bs, seqlen, -1, self.head_dim).contiguous()
            xk = xk.reshape(bs, seqlen, -1, self.head_dim).contiguous()
            xv = xv.reshape(bs, seqlen, -1, self.head_dim).contiguous()
        else:
            xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
            xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
            xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        if not self.enable_gqa:
            xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)  # (bs, n, seqlen, head_dim)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True,
                                                enable_gqa=self.enable_gqa and self.n_rep > 1)
        output = output.transpose(1, 2).contiguous()  # (bs, seqlen, n, head_dim)
        if self.token_major:
            out_TNH = output.flatten(0, 1)
            return self.wo(out_TNH.view(out_TNH.shape[0], -1)).view(bs, seqlen, -1)
        return self.wo(output.view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TitanLlamaArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))  # depth-scaled, as torchtitan's default

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for name in ("wqkv", "wq", "wk", "wv"):
            if hasattr(self.attention, name):
                nn.init.trunc_normal_(getattr(self.attention, name).weight, mean=0.0, std=0.02)
        for lin in (self.attention.wo, self.feed_forward.w2, self.feed_forward.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=self.weight_init_std)
        nn.init.trunc_normal_(self.feed_forward.w1.weight, mean=0.0, std=0.02)


class TitanLlama(nn.Module):
    """``TitanLlama(args)(tokens)`` -> logits ``(bs, seqlen, vocab_size)``."""

    def __init__(self, args: TitanLlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len * 2,
                                                               args.rope_theta), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        cutoff = self.args.dim ** -0.5  # tied, this is the embeddings' init too: logits of unit scale
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=cutoff, a=-3 * cutoff, b=3 * cutoff)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))
