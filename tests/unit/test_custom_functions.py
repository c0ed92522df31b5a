"""A custom autograd Function keeps its own backward in a captured graph (``autopar.custom_functions``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.autograd.function import Function

from autopar import custom_functions
from autopar.capture import capture, meta_shadow
from autopar.errors import CaptureError
from tests.unlike_models import RoundSTE, STENet


def _captured(model: nn.Module, x: torch.Tensor):
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    return capture(meta_shadow(model), (x,), {}, requires_grad=requires_grad, batch=None).gm


def _grad_through(gm, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``a.weight``'s gradient of ``gm`` run on ``model``'s parameters (the runtime's inputs: parameters
    first, then the user's)."""
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    out = gm(*params, x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.square().sum().backward()
    return params[0].grad


def test_a_straight_through_function_is_one_call_with_its_own_backward():
    torch.manual_seed(0)
    model, x = STENet(), torch.randn(8, 16)
    gm = _captured(model, x)
    calls = [n for n in gm.graph.nodes if custom_functions.function_of(n) is not None]
    assert [custom_functions.function_of(n) for n in calls] == [RoundSTE]
    assert not any(n.target is torch.ops.aten.round.default for n in gm.graph.nodes)  # (its forward: inside)
    model(x).square().sum().backward()
    got = _grad_through(gm, model, x)
    assert got.abs().sum() > 0 and torch.allclose(got, model.a.weight.grad, rtol=1e-6, atol=1e-7)


def test_without_the_call_the_forward_is_inlined_and_the_gradient_is_rounds(monkeypatch):
    """What autopar did before (and does if the mechanism is dropped: the mutation this test guards): export
    inlines the Function's forward, and autograd of ``round`` gives 0."""
    import autopar.capture as capture_module

    torch.manual_seed(0)
    model, x = STENet(), torch.randn(8, 16)
    monkeypatch.setattr(capture_module, "kept_during_capture", contextlib.nullcontext)
    gm = _captured(model, x)
    assert any(n.target is torch.ops.aten.round.default for n in gm.graph.nodes)
    assert _grad_through(gm, model, x).abs().sum() == 0


def test_function_apply_is_torchs_own_after_a_capture_even_one_that_fails():
    before = Function.__dict__["apply"]

    class Raises(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = RoundSTE.apply(x)
            raise RuntimeError("the model's own error")

    with pytest.raises(CaptureError, match="the model's own error"):
        capture(meta_shadow(Raises()), (torch.randn(2, 3),), {}, requires_grad={}, batch=None)
    assert Function.__dict__["apply"] is before
    _captured(STENet(), torch.randn(4, 16))
    assert Function.__dict__["apply"] is before


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        return module(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:
        return g, None


class _TakesModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scaled.apply(x, self.inner)


def test_a_function_taking_a_module_is_refused_with_the_way_out():
    with pytest.raises(CaptureError, match="takes a module argument .*Pass the module's tensors"):
        _captured(_TakesModule(), torch.randn(2, 4))
