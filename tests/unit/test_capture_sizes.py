"""Which sizes a graph captured with symbolic sizes takes (``Captured.accepts``): export's ranges, the
sizes it fixed, sizes that are expressions of others, and its guards, checked without export's per-call
sympy substitution."""

from __future__ import annotations

import torch
from torch import nn

from autopar.compat import pytree
from autopar.capture import capture, meta_shadow

AUTO = torch.export.Dim.AUTO


class Sizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[1] <= 10)  # a range
        fixed = z.view(2, -1)  # fixes z's dim 0 to 2
        return (x * self.w).sum() + (x[:, :, :1] + y[:, 1:]).sum() + fixed.sum()  # y's dim 1 = x's + 1


def _accepts(captured, x_len: int, y_len: int, z_rows: int) -> bool:
    return captured.accepts([torch.ones(3, x_len, 4), torch.ones(3, y_len, 1), torch.ones(z_rows, 5)])


def test_a_graph_takes_only_the_sizes_export_allows():
    model = Sizes()
    args = (torch.ones(3, 6, 4), torch.ones(3, 7, 1), torch.ones(2, 5))
    captured = capture(meta_shadow(model), args, {}, requires_grad={"w": True}, batch=None,
                       dynamic={0: {1: AUTO}, 1: {1: AUTO}, 2: {0: AUTO}})
    assert _accepts(captured, 6, 7, 2) and _accepts(captured, 9, 10, 2) and _accepts(captured, 2, 3, 2)
    assert not _accepts(captured, 11, 12, 2)  # beyond the range
    assert not _accepts(captured, 6, 8, 2)  # y's length is x's + 1
    assert not _accepts(captured, 6, 7, 4)  # z's rows were fixed


def _nanogpt_split(rows_symbolic: bool):
    """nanoGPT (its loss views the logits as (B*T, V)) captured as batch shard 0 of 2 with symbolic lengths
    (and, with ``rows_symbolic``, symbolic rows), as the runtime captures it."""
    from autopar.capture import capture_shard, symbolic_dims
    from autopar.examples.nanogpt import GPTConfig, NanoGPT

    model = NanoGPT(GPTConfig(vocab_size=128, block_size=32, n_layer=1, n_head=2, n_embd=16, bias=False))
    x = torch.randint(0, 100, (4, 12))
    leaves, spec = pytree.tree_flatten(((x, x.clone()), {}))
    rows = {0: 0, 1: 0} if rows_symbolic else {}
    return capture_shard(meta_shadow(model), leaves, spec, {0: 0, 1: 0}, (2, 2), 0, requires_grad={},
                         dynamic=symbolic_dims(model, leaves, rows, split=True))


def test_the_batch_analysis_keeps_lengths_and_rows_symbolic():
    """The batch analysis of a split batch follows the rows through the per-token loss without fixing the
    length or the rows (it compared them, and torch's shape environment replaced the length by its value)."""
    from passes.analysis.batch_dims import analyze_batch
    from passes.analysis.graph_facts import sizes_fixed

    captured = _nanogpt_split(rows_symbolic=True)
    facts = analyze_batch(captured.gm)
    assert facts.reductions and not sizes_fixed(captured.gm)
    for rows, length in ((2, 12), (2, 5), (3, 9), (7, 30)):
        assert captured.accepts([torch.empty(rows, length, dtype=torch.long)] * 2), (rows, length)
    assert not captured.accepts([torch.empty(1, 5, dtype=torch.long)] * 2)  # export's size-1 rule


def test_a_size_an_analysis_fixes_after_capture_is_refused():
    """An analysis that fixes a symbolic size after capture (``int()`` of it) leaves the graph taking that
    size only: the check read export's guards alone, and accepted every length."""
    from passes.analysis.graph_facts import sizes_fixed

    captured = _nanogpt_split(rows_symbolic=False)
    length = next(n for n in captured.gm.graph.nodes if n.op == "placeholder" and n.name.startswith("flat")
                  ).meta["val"].shape[1]
    int(length)  # as an analysis would
    assert sizes_fixed(captured.gm)
    assert not captured.accepts([torch.empty(2, 5, dtype=torch.long)] * 2)
    assert captured.accepts([torch.empty(2, 12, dtype=torch.long)] * 2)


def test_sizes_an_analysis_finds_equal_after_capture_must_stay_equal():
    """An analysis that compares two symbolic sizes with equal examples makes the shape environment replace
    one by the other: the graph then takes equal sizes only (the check used to read export's guards, where
    that replacement leaves nothing)."""
    model = Sizes()
    args = (torch.ones(3, 6, 4), torch.ones(3, 7, 1), torch.ones(2, 5))
    captured = capture(meta_shadow(model), args, {}, requires_grad={"w": True}, batch=None,
                       dynamic={0: {0: AUTO, 1: AUTO}, 1: {0: AUTO, 1: AUTO}, 2: {0: AUTO}})
    rows, length = next(n for n in captured.gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dim() == 3
                        and n.meta["val"].shape[2] == 4).meta["val"].shape[:2]
    bool(rows == length - 3)  # 3 == 6 - 3, as an analysis would compare them: one symbol replaces the other
    assert captured.accepts([torch.ones(4, 7, 4), torch.ones(4, 8, 1), torch.ones(2, 5)])
    assert not captured.accepts([torch.ones(5, 6, 4), torch.ones(5, 7, 1), torch.ones(2, 5)])
