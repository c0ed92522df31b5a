"""causal_attention: a captured constant causal mask becomes is_causal=True, and nothing else does."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.examples import zoo
from passes.causal_attention import SDPA, causal_attention

pytest.importorskip("transformers")

DECODERS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "opt")


def _export(model: nn.Module, args: tuple, kwargs: dict | None = None) -> torch.export.ExportedProgram:
    return torch.export.export(model, args, kwargs or {}, strict=False)


def _attentions(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in ep.graph_module.graph.nodes if n.target is SDPA]


def _causal(node: torch.fx.Node) -> bool:
    return len(node.args) > 5 and node.args[3] is None and node.args[5] is True


@pytest.mark.parametrize("name", DECODERS)
def test_hf_causal_masks_become_is_causal_and_outputs_stay(name):
    torch.manual_seed(0)
    model = zoo.build_model(name).eval()
    (ids,) = zoo.example_inputs(name)
    ep = _export(model, (ids,), {"use_cache": False})
    before = ep.module()(ids, use_cache=False).logits
    nodes = len(ep.graph_module.graph.nodes)
    assert causal_attention(ep.graph_module).changed
    assert _attentions(ep) and all(map(_causal, _attentions(ep)))
    assert len(ep.graph_module.graph.nodes) < nodes - 5, "the mask's nodes are gone"
    after = ep.module()(ids, use_cache=False).logits
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after, eager, rtol=1e-5, atol=1e-6)


def test_masks_from_inputs_stay():
    """A padding mask (the user's attention_mask) and the user's position ids are values the graph reads."""
    model = zoo.build_model("llama").eval()
    (ids,) = zoo.example_inputs("llama")
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    for kwargs in ({"attention_mask": padding}, {"position_ids": positions}):
        ep = _export(model, (ids,), {"use_cache": False, **kwargs})
        assert not causal_attention(ep.graph_module).changed, kwargs
        assert not any(map(_causal, _attentions(ep)))


class _Attention(nn.Module):
    """q [2, 4, L, 8] against k, v [2, 4, S, 8] with a mask made in forward from nothing but sizes."""

    def __init__(self, make_mask):
        super().__init__()
        self.make_mask = make_mask

    def forward(self, q, k, v):
        mask = self.make_mask(q.shape[-2], k.shape[-2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _run(make_mask, length=6, keys=6, **kwargs):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, length, 8, generator=g)
    k, v = torch.randn(2, 2, 4, keys, 8, generator=g)
    ep = _export(_Attention(make_mask), (q, k, v))
    before = ep.module()(q, k, v)
    modified = causal_attention(ep.graph_module, **kwargs).changed
    torch.testing.assert_close(ep.module()(q, k, v), before, rtol=1e-5, atol=1e-6)
    return modified


def test_causal_masks_of_every_form_are_found():
    assert _run(lambda l, s, d: torch.ones(l, s, dtype=torch.bool, device=d).tril())
    assert _run(lambda l, s, d: torch.full((l, s), float("-inf"), device=d).triu(1))
    assert _run(lambda l, s, d: torch.full((l, s), torch.finfo(torch.float32).min, device=d).triu(1)[None, None])
    positions = lambda n, d: torch.arange(n, device=d)  # noqa: E731
    assert _run(lambda l, s, d: (positions(s, d)[None, :] <= positions(l, d)[:, None]).expand(2, 1, l, s))


def test_other_masks_stay():
    # one token ahead is visible (mutation: accepting any lower-triangular-ish mask passes this)
    assert not _run(lambda l, s, d: torch.ones(l, s, dtype=torch.bool, device=d).tril(1))
    # a sliding window of 3
    assert not _run(lambda l, s, d: torch.ones(l, s, dtype=torch.bool, device=d).tril() &
                    torch.ones(l, s, dtype=torch.bool, device=d).triu(-2))
    # a decode step's bottom-right mask: 2 queries after 6 keys; is_causal would be top-left
    assert not _run(lambda l, s, d: torch.ones(l, s, dtype=torch.bool, device=d).tril(s - l), length=2, keys=6)
    # additive, but a masked entry is only -1 (a bias, not a mask)
    assert not _run(lambda l, s, d: -torch.ones(l, s, device=d).triu(1))
    # bigger than the evaluation may build
    assert not _run(lambda l, s, d: torch.ones(l, s, dtype=torch.bool, device=d).tril(), max_elements=35)


def test_a_long_sequences_mask_is_decided_by_blocks_of_rows():
    """A mask larger than the evaluation may build, made of row-wise ops on position aranges (as HF's): decided
    block of query rows by block (here blocks of one row: ``max_elements`` below a row of the broadcast mask);
    a sliding window made alike stays (mutation: each block compared with the first rows' causal mask, the
    causal one stays too)."""
    positions = lambda n, d: torch.arange(n, device=d)  # noqa: E731
    causal = lambda l, s, d: (positions(s, d)[None, :] <= positions(l, d)[:, None]).expand(2, 1, l, s)  # noqa: E731
    assert _run(causal, max_elements=11)
    assert _run(causal, length=7, keys=7, max_elements=30)  # (blocks of 2 rows, the last one of 1)
    window = lambda l, s, d: causal(l, s, d) & (positions(s, d)[None, :] > positions(l, d)[:, None] - 3)  # noqa: E731
    assert not _run(window, max_elements=11)
    additive = lambda l, s, d: torch.where(causal(l, s, d), 0.0, float("-inf"))  # noqa: E731
    assert _run(additive, max_elements=11)


def test_a_mask_alike_for_every_batch_row_is_decided_on_one(monkeypatch):
    """A mask made from values alike along the batch's rows (HF's position ids of a batch without padding) is the
    same for every row: one row's is evaluated, so a mask counted whole over ``LIMIT`` is still decided (BLOOM's
    search captured a [2048, 1, 2048, 2048] mask: 2^33 elements to evaluate, 90 s of its 115); one made from values
    that differ along them is evaluated whole, so over the limit it stays (mutation: the limit counted on the
    whole mask -> the first stays)."""
    import passes.causal_attention as pass_module

    monkeypatch.setattr(pass_module, "LIMIT", 40)  # (one [6, 6] row's 36 elements; the [2, 1, 6, 6] mask's 72)
    positions = lambda n, d: torch.arange(n, device=d)  # noqa: E731
    causal = lambda l, s, d: (positions(s, d)[None, :] <= positions(l, d)[:, None]).expand(2, 1, l, s)  # noqa: E731
    assert _run(causal, max_elements=11)
    batch = lambda d: torch.arange(2, device=d)[:, None, None, None]  # noqa: E731  (0 and 1: not alike)
    rows = lambda l, s, d: causal(l, s, d) & (batch(d) + positions(l, d)[None, None, :, None] >= 0)  # noqa: E731
    assert not _run(rows, max_elements=11)
    monkeypatch.setattr(pass_module, "LIMIT", 1 << 36)
    assert _run(rows, max_elements=11)  # (whole, within the limit: still causal)


def test_hf_llamas_mask_turns_causal_by_blocks():
    torch.manual_seed(0)
    model = zoo.build_model("llama").eval()
    (ids,) = zoo.example_inputs("llama")
    ep = _export(model, (ids,), {"use_cache": False})
    before = ep.module()(ids, use_cache=False).logits
    # (max_elements: the position ids' 4 x 16 and their [4, 1, 16, 1] views whole, the [4, 1, 16, 16] mask by
    # blocks of one row)
    assert causal_attention(ep.graph_module, max_elements=64).changed
    assert _attentions(ep) and all(map(_causal, _attentions(ep)))
    torch.testing.assert_close(ep.module()(ids, use_cache=False).logits, before, rtol=1e-5, atol=1e-6)


def test_random_masks_are_never_evaluated():
    assert not _run(lambda l, s, d: (torch.rand(l, s, device=d) < 2).tril())


def test_autopars_own_capture_runs_the_pass():
    """What the runtime and the planner capture (``autopar.capture.capture``) has no materialized causal mask
    left (mutation: a capture without the pass keeps one per attention)."""
    from autopar.capture import capture, meta_shadow

    model = zoo.build_model("llama")
    captured = capture(meta_shadow(model), zoo.example_inputs("llama"), {"use_cache": False}, requires_grad={},
                       batch=None)
    attentions = [n for n in captured.gm.graph.nodes if n.target is SDPA]
    assert len(attentions) == 2 and all(map(_causal, attentions))


def test_a_mask_decided_on_one_row_is_remembered_for_the_values_it_reads_only(monkeypatch):
    """A search captures one graph per count of rows a batch shard gets, each with the same long mask: decided on
    one row once, then remembered (``_DECIDED``) by its large ops and the values they read. The same ops on other
    values (the queries' positions one ahead: a token ahead visible) are evaluated again and stay (mutation: the
    key without the values read -> taken as causal, and the outputs differ)."""
    import passes.causal_attention as pass_module

    monkeypatch.setattr(pass_module, "_DECIDED", {})
    evaluated = []
    original = pass_module._mask_blocks

    def counted(*args, **kwargs):
        evaluated.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(pass_module, "_mask_blocks", counted)
    keys_at = lambda n, d: torch.arange(n, device=d)  # noqa: E731
    mask = lambda start: lambda l, s, d: (keys_at(s, d)[None, :] <= torch.arange(start, start + l, device=d)[:, None]  # noqa: E731
                                          ).expand(2, 1, l, s)
    assert _run(mask(0), max_elements=11) and len(evaluated) == 1
    assert _run(mask(0), max_elements=11) and len(evaluated) == 1  # (a second capture: remembered)
    assert not _run(mask(1), max_elements=11) and len(evaluated) == 2
