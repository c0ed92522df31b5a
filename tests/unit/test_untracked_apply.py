"""``untracked.apply``: an autograd Function's call, or where autograd records nothing (evaluation, decoding) its
forward alone, with the values ``Function.apply`` gives; an input returned as it is comes back as another tensor
(a script's attribute on it, or autopar's ``REGATHER``, must not land on the input)."""

from __future__ import annotations

from typing import Any

import torch

from autopar.runtime.ops.untracked import apply


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        ctx.save_for_backward(x)
        return x if k == 1 else x * k

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return dy * ctx.k, None


def test_untracked_calls_give_applys_values_and_aliasing():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        for k in (1.0, 2.0):
            got, want = apply(_Scale, x, k), _Scale.apply(x, k)
            assert torch.equal(got, want) and got.grad_fn is None and not got.requires_grad
            assert got is not x and want is not x  # (an input returned: another tensor of its storage)
            assert (got.data_ptr() == x.data_ptr()) == (want.data_ptr() == x.data_ptr())
    y = apply(_Scale, x, 3.0)  # gradients on: the Function itself
    assert y.grad_fn is not None
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0))
