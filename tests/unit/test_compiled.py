"""``autopar.runtime.compiled.CompiledGraph`` on its own: a graph that compiles runs compiled; one that
torch.compile cannot take whole runs eagerly, with one warning line naming why, and eager's values."""

from __future__ import annotations

import torch
from torch import fx

from autopar.runtime.compiled import CompiledGraph


def _reads_a_value(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if float(x.sum()) > 0 else x - 1  # a Python branch on a tensor's value: no whole graph


def _graph(fn) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.sin, (x,))
    g.output(g.call_function(fn, (y,)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_graph_that_compiles_runs_compiled():
    warnings: list[str] = []
    gm = _graph(torch.nn.functional.gelu)
    run = CompiledGraph(gm, "the test graph", torch.device("cpu"), warnings.append)
    x = torch.randn(4, 3, requires_grad=True)
    out = run(x)
    out.sum().backward()
    expected = x.detach().clone().requires_grad_()
    gm(expected).sum().backward()
    assert run.failed is None and run.compiled_runs == 1 and not warnings
    torch.testing.assert_close(out, gm(x))
    torch.testing.assert_close(x.grad, expected.grad)


def test_a_graph_that_does_not_compile_runs_eagerly_with_one_warning():
    warnings: list[str] = []
    gm = _graph(_reads_a_value)
    run = CompiledGraph(gm, "the test graph", torch.device("cpu"), warnings.append)
    x = torch.randn(4, 3)
    for _ in range(3):
        torch.testing.assert_close(run(x), gm(x))
    assert run.failed is not None and run.compiled_runs == 0
    assert len(warnings) == 1 and "the test graph does not compile" in warnings[0] and "runs eagerly" in warnings[0]


def test_compile_option_is_checked_and_auto_compiles_training_on_cuda_only():
    import pytest

    from autopar.config import CompileConfig
    from autopar.errors import ConfigError

    with pytest.raises(ConfigError, match="compile='yes' is invalid"):
        CompileConfig("yes")
    with pytest.raises(ConfigError):
        CompileConfig(1)
    auto = CompileConfig()
    assert auto.enabled("cuda", True) and not auto.enabled("cuda", False) and not auto.enabled("cpu", True)
    assert CompileConfig(True).enabled("cpu", False) and not CompileConfig(False).enabled("cuda", True)


def test_under_a_dispatch_mode_a_call_runs_eagerly_and_the_graph_stays_compiled():
    """A script's FLOP counter (a TorchDispatchMode) around a step: torch.compile refuses to run under one
    (it raised 'found no compiled frames'); that call runs eagerly and is counted by the mode."""
    from torch.utils.flop_counter import FlopCounterMode

    warnings: list[str] = []
    gm = _graph(lambda y: y @ y.T)
    run = CompiledGraph(gm, "the test graph", torch.device("cpu"), warnings.append)
    x = torch.randn(4, 3)
    with FlopCounterMode(display=False) as counter:
        out = run(x)
    assert counter.get_total_flops() > 0 and run.compiled_runs == 0 and run.failed is None and not warnings
    torch.testing.assert_close(out, gm(x))
    torch.testing.assert_close(run(x), gm(x))
    assert run.compiled_runs == 1
