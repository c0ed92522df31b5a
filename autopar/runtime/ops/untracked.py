"""Autograd Functions called where autograd records nothing (evaluation, decoding): their forward alone."""

from __future__ import annotations

from typing import Any

import torch


class _Untracked:
    """``ctx`` of an autograd Function's forward run where autograd records nothing: it keeps nothing."""

    needs_input_grad = (False,) * 8

    def save_for_backward(self, *tensors: Any) -> None:
        pass


def apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``; where autograd records nothing (``torch.no_grad``, inference mode: evaluation and
    decoding), ``fn``'s forward alone: the same values, without a Function call's Python bookkeeping (its
    context, saved tensors and output wrapping, about 10 us per call on this CPU, each matmul of a decode
    step)."""
    if torch.is_grad_enabled():
        return fn.apply(*args)
    out = fn.forward(_Untracked(), *args)
    if isinstance(out, torch.Tensor) and any(out is a for a in args):
        return out.detach()  # (as apply's: an input returned as it is comes back another tensor of its storage)
    return out
