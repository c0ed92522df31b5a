"""The sequence's tokens over the context ranks (context parallelism, ``passes.split_context``): this rank's
tokens of a whole tensor, the whole sequence gathered back, sums completed, attention over the gathered keys
and values, and the model's outputs made whole.

Each rank holds two of ``2 * C`` equal chunks of the tokens, ``i`` and ``2C - 1 - i`` (``token_index``): under a
causal mask every rank's queries then see the same number of keys (Megatron's and torchtitan's load balance).

Gradient convention (as over the batch ranks, ``autopar.runtime.ops.rows``): a tensor the same on every context
rank carries a part of its gradient on each (the parts sum to it); a tensor of this rank's tokens carries its
whole gradient. Hence a slice's backward places its gradient in zeros, a gather's sums the parts and keeps this
rank's tokens, and an output's keeps the caller's gradient (the same on every rank) on one rank.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from autopar.compat import cpu_flash_attention, cpu_flash_attention_backward
from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.rows import OnOneRank
from autopar.runtime.ops.untracked import apply
from autopar.runtime.comm.pieces import take_pieces
from passes.ir import ContextAttentionSpec, ContextDropoutSpec, ContextSpec


def token_index(tokens: int, ranks: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions of rank ``rank``'s tokens of ``tokens``, in its order: chunks ``rank`` and
    ``2 * ranks - 1 - rank`` of ``2 * ranks`` equal chunks. (Made at each call, a few small ops: no cache, which
    torch.compile would trace through.)"""
    chunk = tokens // (2 * ranks)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                      torch.arange((2 * ranks - 1 - rank) * chunk, (2 * ranks - rank) * chunk, device=device)])


def _order(tokens: int, ranks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.cat([token_index(tokens, ranks, r, device) for r in range(ranks)])  # the gathered tokens' places
    return order, torch.argsort(order)


def _unflat(x: torch.Tensor, spec: ContextSpec) -> torch.Tensor:
    """``x`` with its token dim as ``[outer, tokens, inner]`` (the token axis at ``spec.dim + 1``)."""
    shape = x.shape
    n = shape[spec.dim] // (spec.outer * spec.inner)
    return x.reshape(*shape[:spec.dim], spec.outer, n, spec.inner, *shape[spec.dim + 1:])


def _flat(x: torch.Tensor, spec: ContextSpec) -> torch.Tensor:
    shape = x.shape
    return x.reshape(*shape[:spec.dim], -1, *shape[spec.dim + 3:])


def take_tokens(x: torch.Tensor, spec: ContextSpec, rank: int) -> torch.Tensor:
    """This rank's tokens of whole ``x``."""
    index = token_index(spec.tokens, spec.ranks, rank, x.device)
    return _flat(_unflat(x, spec).index_select(spec.dim + 1, index), spec)


def place_tokens(dy: torch.Tensor, spec: ContextSpec, rank: int) -> torch.Tensor:
    """A zero tensor of the whole sequence with ``dy`` (this rank's tokens) in their places."""
    local = _unflat(dy, spec)
    shape = list(local.shape)
    shape[spec.dim + 1] = spec.tokens
    whole = local.new_zeros(shape)
    whole.index_copy_(spec.dim + 1, token_index(spec.tokens, spec.ranks, rank, dy.device), local)
    return _flat(whole, spec)


def gather_tokens(x: torch.Tensor, spec: ContextSpec, mesh: Mesh) -> torch.Tensor:
    """Every context rank's tokens of ``x`` -> the whole sequence, in order."""
    axis = spec.dim + 1
    local = _unflat(x, spec).movedim(axis, 0)
    stacked = C.all_gather(local.contiguous(), mesh.group("context"), spec.ranks)  # ranks' tokens, rank order
    _, inverse = _order(spec.tokens, spec.ranks, x.device)
    whole = stacked.index_select(0, inverse).movedim(0, axis)
    return _flat(whole, spec)


def reduce_scatter_tokens(dy: torch.Tensor, spec: ContextSpec, mesh: Mesh) -> torch.Tensor:
    """The sum over the context ranks of whole ``dy``, this rank's tokens of it."""
    axis = spec.dim + 1
    order, _ = _order(spec.tokens, spec.ranks, dy.device)
    ranked = _unflat(dy, spec).index_select(axis, order).movedim(axis, 0)
    mine = C.reduce_scatter(ranked.contiguous(), mesh.group("context"), spec.ranks).movedim(0, axis)
    return _flat(mine, spec)


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: ContextSpec, rank: int) -> torch.Tensor:
        ctx.spec, ctx.rank = spec, rank
        return take_tokens(x, spec, rank)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return place_tokens(dy, ctx.spec, ctx.rank), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: ContextSpec, mesh: Mesh) -> torch.Tensor:
        ctx.spec, ctx.mesh = spec, mesh
        return gather_tokens(x, spec, mesh)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return reduce_scatter_tokens(dy, ctx.spec, ctx.mesh), None, None


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        ctx.mesh = mesh
        return C.all_reduce(x.clone(), mesh.group("context"), mesh.size("context"))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return C.all_reduce(dy.clone(), ctx.mesh.group("context"), ctx.mesh.size("context")), None


class ContextOps:
    """The context markers bound to this rank (``autopar.runtime.execution.binding``)."""

    def __init__(self, mesh: Mesh, per_rank: bool = False) -> None:
        """``per_rank``: the graph runs under per-rank batches (``autopar.runtime.data_parallel.per_rank``)."""
        self.mesh, self.per_rank = mesh, per_rank
        self.rank = mesh.index("context")

    def slice(self, x: torch.Tensor, spec: ContextSpec) -> torch.Tensor:
        return apply(_Slice, x, spec, self.rank)

    def gather(self, x: torch.Tensor, spec: ContextSpec) -> torch.Tensor:
        return apply(_Gather, x, spec, self.mesh)

    def reduce(self, x: torch.Tensor, spec: ContextSpec) -> torch.Tensor:
        return apply(_Sum, x, self.mesh)

    def output(self, x: torch.Tensor, spec: ContextSpec) -> torch.Tensor:
        if spec.reduced and self.per_rank:  # each rank's own loss: SegmentReduceOp's backward gathers theirs
            return x
        if spec.split:
            x = apply(_Gather, x, spec, self.mesh)
        if x.requires_grad:
            x = apply(OnOneRank, x, self.rank == 0)
        return x

    def dropout(self, x: torch.Tensor, p: float, train: bool, spec: ContextDropoutSpec) -> torch.Tensor:
        """Dropout with the mask of the whole tensor (the op itself, on ones, as serial draws it; every rank
        alike), this rank's tokens of it, then its piece over the tensor axis: serial's masks. The whole mask
        lives only inside this call."""
        if not train or p == 0:
            return torch.ops.aten.dropout(x, p, train)
        whole, piece = list(x.shape), spec.piece
        n = self.mesh.size(piece.axis) if piece is not None else 1
        if n > 1:
            whole[piece.dim] = piece.full_size
        whole[spec.tokens.dim] *= spec.tokens.ranks
        with torch.no_grad():
            scale = take_tokens(torch.ops.aten.dropout(x.new_ones(whole), p, True), spec.tokens, self.rank)
            if n > 1:
                scale = take_pieces(scale, piece.dim, piece.parts, n, self.mesh.index(piece.axis))
        return x * scale

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  spec: ContextAttentionSpec) -> torch.Tensor:
        kv = ContextSpec(k.dim() - 2, spec.tokens, spec.ranks) if spec.gather_kv else None
        if not spec.is_causal:
            if kv is not None:
                k, v = apply(_Gather, k, kv, self.mesh), apply(_Gather, v, kv, self.mesh)
            kwargs = {"enable_gqa": True} if spec.enable_gqa else {}
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale, **kwargs)
        if torch.compiler.is_compiling():  # (traced: the gathers and the kernel as ops, saved as the compiler picks)
            if kv is not None:
                k, v = apply(_Gather, k, kv, self.mesh), apply(_Gather, v, kv, self.mesh)
            return chunked_causal(q, k, v, spec, self.rank)
        return apply(CausalOverGathered, q, k, v, spec, self.rank, None if kv is None else KeysValues(kv, self.mesh))


class KeysValues:
    """How attention's keys and values of this rank's tokens come whole, and their gradients go back."""

    def __init__(self, spec: ContextSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_tokens(x, self.spec, self.mesh)

    def scatter(self, dx: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_tokens(dx, self.spec, self.mesh)


class CausalOverGathered(torch.autograd.Function):
    """Causal attention of this rank's queries over every context rank's keys and values, which are gathered in
    forward and again in backward (``kv``; None: ``k`` and ``v`` are whole already), so that between the two only
    this rank's tokens of them are kept, without GQA's repeat (as TransformerEngine's all-gather context
    parallelism keeps them). On the CPU the blocks run on the flash kernel (``blockwise_causal``) and backward runs
    its backward on them; elsewhere the lower-right chunks run (``chunked_causal``) and backward runs them again
    with autograd on (one more attention forward in backward)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ContextAttentionSpec, rank: int,
                kv: KeysValues | None) -> torch.Tensor:
        whole_k, whole_v = (k, v) if kv is None else (kv.gather(k), kv.gather(v))
        ctx.spec, ctx.rank, ctx.kv, ctx.cpu = spec, rank, kv, flash_blocks(q)
        if ctx.cpu:
            out, lse = blockwise_causal(q, whole_k, whole_v, spec, rank)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        with torch.no_grad():
            out = chunked_causal(q, whole_k, whole_v, spec, rank)
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        q, k, v, *kept = ctx.saved_tensors
        kv, spec, rank = ctx.kv, ctx.spec, ctx.rank
        whole_k, whole_v = (k, v) if kv is None else (kv.gather(k), kv.gather(v))
        if ctx.cpu:
            dq, dk, dv = blockwise_causal_backward(dy, q, whole_k, whole_v, *kept, spec, rank)
        else:
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_() for t in (q, whole_k, whole_v)]
                dq, dk, dv = torch.autograd.grad(chunked_causal(*inputs, spec, rank), inputs, dy)
        del whole_k, whole_v  # (freed before the gradients' copies in the ranks' order are made)
        if kv is not None:
            dk = kv.scatter(dk)
            dv = kv.scatter(dv)
        return dq, dk, dv, None, None, None


def _blocks(spec: ContextAttentionSpec, rank: int) -> list[tuple[int, int, int, bool]]:
    """(query offset in this rank's tokens, key start, key end, causal) of each block of rank ``rank``'s two chunks
    of queries: the keys before the chunk (all seen), then the chunk's own (causal, a square)."""
    chunk = spec.tokens // (2 * spec.ranks)
    out = []
    for half, index in ((0, rank), (1, 2 * spec.ranks - 1 - rank)):
        if index:
            out.append((half * chunk, 0, index * chunk, False))
        out.append((half * chunk, index * chunk, (index + 1) * chunk, True))
    return out


def flash_blocks(q: torch.Tensor) -> bool:
    """Whether attention on ``q``'s device runs in blocks on the CPU's flash kernel (else in lower-right chunks)."""
    return q.device.type == "cpu"


@functools.cache
def _kernel_takes_gqa() -> bool:
    """Whether the CPU's flash kernel (and its backward) takes keys and values with fewer heads (torch 2.13 does)."""
    q, kv = torch.zeros(1, 2, 2, 8), torch.zeros(1, 1, 2, 8)
    try:
        out, lse = cpu_flash_attention(q, kv, kv, 0.0, True)
        cpu_flash_attention_backward(out, q, kv, kv, out, lse, 0.0, True)
    except RuntimeError:
        return False
    return True


def _repeat(q: torch.Tensor, k: torch.Tensor) -> int:
    """How many times each key head repeats for ``q``'s heads where the kernel must be given them repeated; 1."""
    repeat = q.shape[-3] // k.shape[-3]
    return repeat if repeat > 1 and not _kernel_takes_gqa() else 1


def blockwise_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ContextAttentionSpec,
                     rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this rank's two chunks of queries over the whole keys and values, on the CPU's flash
    kernel without a mask: per chunk, its prefix of keys (no mask) and its own block (causal), merged by their
    log-sum-exps. The output and the log-sum-exps: no score or mask of the sequence's size."""
    repeat = _repeat(q, k)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    chunk = spec.tokens // (2 * spec.ranks)
    parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {0: [], chunk: []}
    for at, start, end, causal in _blocks(spec, rank):
        parts[at].append(cpu_flash_attention(q.narrow(-2, at, chunk), k.narrow(-2, start, end - start),
                                             v.narrow(-2, start, end - start), 0.0, causal, scale=spec.scale))
    outs, lses = [], []
    for blocks in parts.values():
        lse = blocks[0][1] if len(blocks) == 1 else torch.logaddexp(blocks[0][1], blocks[1][1])
        outs.append(sum(o.float() * torch.exp(b - lse).unsqueeze(-1) for o, b in blocks).to(q.dtype))
        lses.append(lse)
    return sdpa_layout(torch.cat(outs, dim=-2)), torch.cat(lses, dim=-1)


def blockwise_causal_backward(dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, spec: ContextAttentionSpec,
                              rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``blockwise_causal``'s gradients: the kernel's backward on each block with the merged output and
    log-sum-exp (as blockwise flash attention does), which gives the exact gradients."""
    repeat = _repeat(q, k)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    chunk = spec.tokens // (2 * spec.ranks)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dy = dy.contiguous()
    for at, start, end, causal in _blocks(spec, rank):
        rows = slice(at, at + chunk)
        gq, gk, gv = cpu_flash_attention_backward(
            dy[..., rows, :], q[..., rows, :], k[..., start:end, :], v[..., start:end, :],
            out[..., rows, :], lse[..., rows], 0.0, causal, scale=spec.scale)
        dq[..., rows, :] += gq
        dk[..., start:end, :] += gk
        dv[..., start:end, :] += gv
    if repeat > 1:  # (each key head's repeats' gradients summed back)
        dk, dv = dk.unflatten(-3, (-1, repeat)).sum(-3), dv.unflatten(-3, (-1, repeat)).sum(-3)
    return dq, dk, dv


def chunked_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ContextAttentionSpec,
                   rank: int) -> torch.Tensor:
    """Causal attention of rank ``rank``'s two chunks of queries (``q``'s halves along the tokens, ``token_index``),
    each over the keys up to its end with the causal diagonal at the bottom right
    (``torch.nn.attention.bias.causal_lower_right``: on CUDA the memory-efficient kernel, no mask built)."""
    chunk = spec.tokens // (2 * spec.ranks)
    if spec.enable_gqa and k.shape[-3] != q.shape[-3]:  # (the bias takes no enable_gqa: the heads repeated)
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    out = []
    for half, index in ((0, rank), (1, 2 * spec.ranks - 1 - rank)):
        end = (index + 1) * chunk
        qs = q.narrow(-2, half * chunk, chunk)
        bias = causal_lower_right(chunk, end)
        out.append(F.scaled_dot_product_attention(qs, k.narrow(-2, 0, end), v.narrow(-2, 0, end), attn_mask=bias,
                                                  scale=spec.scale))
    return sdpa_layout(torch.cat(out, dim=-2))


def sdpa_layout(out: torch.Tensor) -> torch.Tensor:
    """``out`` ([batch, heads, tokens, features]) laid out as the fused kernels lay out theirs, tokens outside the
    heads: the captured graph may view its transpose as it would theirs (a ``contiguous`` export saw no need of)."""
    return out.transpose(-3, -2).contiguous().transpose(-3, -2) if out.dim() == 4 else out
