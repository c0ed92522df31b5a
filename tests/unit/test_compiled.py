"""``autopar.runtime.compiled.graph.CompiledGraph`` on its own: a graph that compiles runs compiled; one that
torch.compile cannot take whole runs eagerly, with one warning line naming why, and eager's values."""

from __future__ import annotations

import torch
from torch import fx

from autopar.runtime.compiled.graph import CompiledGraph


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


def test_a_graph_compiles_where_fabric_copies_torch_compiles_arguments():
    """Lightning Fabric wraps ``torch.compile`` once imported, and deep-copies its arguments (the backend
    among them). The backend must survive that: a bound method of the graph once dragged the ranks' compile
    agreement, with its c10d store, into the copy, and every compile under Fabric raised 'cannot pickle'."""
    import pickle

    import pytest

    pytest.importorskip("lightning.fabric")  # (importing it wraps torch.compile, for the whole process)
    assert getattr(torch.compile, "__wrapped__", None) is not None, "Fabric no longer wraps torch.compile"

    class Unpicklable:  # an agreement (its store) that every rank's compile agrees with
        def __reduce__(self):
            raise pickle.PicklingError("a c10d store or process group")

        def agree(self, key, failed, groups, once=False):
            return failed

    run = CompiledGraph(_graph(torch.nn.functional.gelu), "the test graph", torch.device("cpu"), print,
                        agreement=Unpicklable())
    x = torch.randn(4, 3)
    torch.testing.assert_close(run(x), torch.nn.functional.gelu(torch.sin(x)))
    assert run.failed is None and run.compiled_runs == 1, run.failed


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
    graphs = CompileConfig("reduce-overhead")  # compiled everywhere; CUDA graphs for CUDA training calls only
    assert graphs.enabled("cpu", True) and graphs.enabled("cpu", False) and graphs.enabled("cuda", False)
    assert graphs.cuda_graphs("cuda", True) and not graphs.cuda_graphs("cuda", False)
    assert not graphs.cuda_graphs("cpu", True) and not CompileConfig(True).cuda_graphs("cuda", True)
    with pytest.raises(ConfigError, match="'reduce-overhead'"):
        CompileConfig("max-autotune")
    run = CompiledGraph(_graph(lambda y: y @ y.T), "a graph", torch.device("cpu"), print, cuda_graphs=True)
    assert not run.cuda_graphs  # (no CUDA graphs on the CPU: compiled as compile=True)


def test_surviving_gradients_are_copied_out_once_before_a_replay():
    """compile="reduce-overhead": a ``p.grad`` kept across steps (accumulation) lives in CUDA graph memory the next
    replay overwrites (torch raised "accessing tensor output of CUDAGraphs that has been overwritten" on an H200
    without the copy); ``SurvivingGrads`` copies it into memory of its own, once, and copies nothing when the
    loop set the gradients to None. Mutation: a copy_out that copies nothing fails the storage checks."""
    from torch.distributed.tensor import DTensor

    from autopar.runtime.compiled.graph import SurvivingGrads
    from autopar.runtime.params.layout import local_of

    plain, none = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(2))
    plain.grad = torch.randn(4, 3)
    fake = _dtensor_parameter()
    params = [plain, none, *([fake] if fake is not None else [])]
    before = {id(p): local_of(p.grad) for p in params if p.grad is not None}
    keeper = SurvivingGrads(lambda: params)
    assert keeper.copy_out() == len(before)
    for p in params:
        if p.grad is not None:
            old, new = before[id(p)], local_of(p.grad)
            assert new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
            torch.testing.assert_close(new, old, rtol=0, atol=0)
            assert type(p.grad) is type(p.data) or isinstance(p.grad, DTensor)
    assert none.grad is None and keeper.copy_out() == 0  # copied before: not again
    plain.grad = torch.ones(4, 3)  # a new gradient (the loop set it anew): copied again
    assert keeper.copy_out() == 1 and local_of(plain.grad).eq(1).all()


def _dtensor_parameter() -> torch.nn.Parameter | None:
    """A DTensor parameter with a gradient, over a mesh of this process alone (None where a process group of
    another test is in the way)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if dist.is_initialized():
        return None
    from autopar.compat import fake_store

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(3, 2), mesh, [Replicate()]))
        p.grad = distribute_tensor(torch.randn(3, 2), mesh, [Replicate()])
        return p
    finally:
        dist.destroy_process_group()


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
