"""Context parallelism's token bookkeeping (``autopar.runtime.ops.context``), on one process: which tokens each
rank holds, cutting and placing them in flattened layouts, and attention of one rank's queries over the whole
sequence with the mask made from their positions, against serial causal attention. Mutation: a mask made from
another rank's positions differs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.runtime.ops.context import place_tokens, take_tokens, token_index
from passes.ir import ContextSpec


@pytest.mark.parametrize("tokens, ranks", [(16, 2), (16, 4), (24, 3), (8, 4)])
def test_every_token_on_one_rank_and_causal_work_even(tokens, ranks):
    held = [token_index(tokens, ranks, r) for r in range(ranks)]
    assert sorted(torch.cat(held).tolist()) == list(range(tokens))
    work = {int((i + 1).sum()) for i in held}  # keys each rank's queries attend to, causally
    assert len(work) == 1, work


@pytest.mark.parametrize("shape, spec", [((3, 16, 5), ContextSpec(1, 16, 2)),
                                         ((3 * 16, 7), ContextSpec(0, 16, 4, outer=3)),
                                         ((2, 16 * 6), ContextSpec(1, 16, 2, inner=6)),
                                         ((2, 4, 16, 8), ContextSpec(2, 16, 4))])
def test_take_and_place_are_inverse_in_flattened_layouts(shape, spec):
    x = torch.randn(shape)
    parts = [take_tokens(x, spec, r) for r in range(spec.ranks)]
    assert all(p.shape[spec.dim] == shape[spec.dim] // spec.ranks for p in parts)
    assert torch.equal(sum(place_tokens(p, spec, r) for r, p in enumerate(parts)), x)
    # the tokens themselves: a [outer, tokens, inner] view cut along its middle
    view = x.reshape(*shape[:spec.dim], spec.outer, 16, spec.inner, *shape[spec.dim + 1:])
    want = view.index_select(spec.dim + 1, token_index(16, spec.ranks, 1)).reshape(parts[1].shape)
    assert torch.equal(parts[1], want)


@pytest.mark.parametrize("ranks", [2, 4])
def test_one_ranks_queries_over_the_whole_sequence_give_serials_rows(ranks):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    serial = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    spec = ContextSpec(2, 16, ranks)
    for r in range(ranks):
        mine = token_index(16, ranks, r)
        mask = torch.arange(16)[None, :] <= mine[:, None]
        got = F.scaled_dot_product_attention(take_tokens(q, spec, r), k, v, attn_mask=mask)
        assert torch.allclose(got, take_tokens(serial, spec, r), atol=1e-6)
        other = token_index(16, ranks, (r + 1) % ranks)  # mutation: another rank's positions
        wrong = F.scaled_dot_product_attention(take_tokens(q, spec, r), k, v,
                                               attn_mask=torch.arange(16)[None, :] <= other[:, None])
        assert not torch.allclose(wrong, take_tokens(serial, spec, r), atol=1e-3)


class _Stand:
    """``KeysValues`` without ranks: the whole keys and values given, the whole gradients kept for the test."""

    def __init__(self, whole: dict[int, torch.Tensor], spec: ContextSpec, rank: int) -> None:
        self.whole, self.spec, self.rank, self.grads, self.gathers = whole, spec, rank, [], 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        self.gathers += 1
        assert torch.equal(x, take_tokens(self.whole[id(x)], self.spec, self.rank))
        return self.whole[id(x)]

    def scatter(self, dx: torch.Tensor) -> torch.Tensor:
        self.grads.append(dx)
        return take_tokens(dx, self.spec, self.rank)


@pytest.mark.parametrize("ranks, gqa", [(2, False), (4, True)])
def test_both_causal_kernels_give_serials_rows_and_gradients(ranks, gqa, monkeypatch):
    """The CPU's blocks merged by their log-sum-exps and the two lower-right chunks CUDA runs (``chunked_causal``,
    here on the CPU), against serial causal attention: outputs and the gradients of the queries and of the whole
    keys and values (this rank's part of them). ``CausalOverGathered`` keeps this rank's tokens of the keys and
    values, unrepeated, and gathers them again in backward."""
    from autopar.runtime.ops import context
    from autopar.runtime.ops.context import CausalOverGathered, chunked_causal
    from passes.ir import ContextAttentionSpec

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2 if gqa else 4, 16, 8, requires_grad=True) for _ in range(2))
    spec = ContextSpec(2, 16, ranks)
    attn = ContextAttentionSpec(16, ranks, True, None, gqa)
    extra = {"enable_gqa": True} if gqa else {}
    dy = torch.randn(2, 4, 16, 8)
    serial = F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
    want = torch.autograd.grad(serial, (q, k, v), dy)
    for kernel in ("blocks", "chunks", "chunks recomputed"):
        parts, grads = [], [torch.zeros_like(t) for t in (q, k, v)]
        for r in range(ranks):
            mine = take_tokens(q, spec, r)
            if kernel == "chunks":
                out = chunked_causal(mine, k, v, attn, r)
                got = torch.autograd.grad(out, (q, k, v), take_tokens(dy, spec, r))
            else:
                local = [take_tokens(t.detach(), spec, r).requires_grad_() for t in (k, v)]
                stand = _Stand({id(t): w.detach() for t, w in zip(local, (k, v))}, spec, r)
                # (on other devices the chunks run, and again in backward)
                monkeypatch.setattr(context, "flash_blocks", lambda t: kernel == "blocks")
                out = CausalOverGathered.apply(mine, *local, attn, r, stand)
                saved = out.grad_fn.saved_tensors[1:3]  # (this rank's keys and values, unrepeated)
                assert [t.shape for t in saved] == [local[0].shape] * 2
                gq, _, _ = torch.autograd.grad(out, (mine, *local), take_tokens(dy, spec, r))
                got = (torch.autograd.grad(mine, q, gq)[0], *stand.grads)
                assert stand.gathers == 4  # (forward's two and backward's two)
            for g, part in zip(grads, got):
                g += part
            parts.append(place_tokens(out.detach(), spec, r))
        assert torch.allclose(sum(parts), serial, atol=1e-5), kernel
        for g, w in zip(grads, want):
            assert torch.allclose(g, w, atol=1e-5), kernel
    assert context._kernel_takes_gqa()  # (torch 2.13's CPU kernel: no repeat)
