"""Which sizes a graph captured with symbolic sizes takes (``Captured.accepts``): export's ranges, the
sizes it fixed, sizes that are expressions of others, and its guards, checked without export's per-call
sympy substitution."""

from __future__ import annotations

import torch
from torch import nn

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


def test_a_size_an_analysis_fixes_after_capture_is_refused():
    """The batch analysis of a split batch compares a symbolic length (entries per row of per-token values),
    which makes torch's shape environment replace the symbol by its value. The graph must then take that
    length only: the check read export's guards alone, and accepted every length."""
    from autopar.capture import capture_shard, symbolic_dims
    from autopar.examples.nanogpt import GPTConfig, NanoGPT
    from passes.analysis.batch_dims import analyze_batch
    from passes.analysis.graph_facts import sizes_fixed

    model = NanoGPT(GPTConfig(vocab_size=128, block_size=32, n_layer=1, n_head=2, n_embd=16, bias=False))
    x = torch.randint(0, 100, (4, 12))
    leaves, spec = torch.utils._pytree.tree_flatten(((x, x.clone()), {}))
    captured = capture_shard(meta_shadow(model), leaves, spec, {0: 0, 1: 0}, (2, 2), 0, requires_grad={},
                             dynamic=symbolic_dims(model, leaves))
    assert not sizes_fixed(captured.gm)
    analyze_batch(captured.gm)  # nanoGPT's loss: logits viewed as (B*T, V); (the check is read after it)
    assert sizes_fixed(captured.gm)
    assert not captured.accepts([torch.empty(2, 5, dtype=torch.long)] * 2)
    assert captured.accepts([torch.empty(2, 12, dtype=torch.long)] * 2)
