"""Every torch-version difference and every private torch name autopar uses, in one place.

autopar runs on torch 2.11 and newer (``setup.cfg`` says the floor). Code elsewhere in ``autopar/``,
``passes/``, ``benchmarks/`` and ``tests/`` imports what it needs from here and never names a private
torch module or attribute itself (``tests/unit/test_compat.py`` walks the sources to keep it so), so a new
torch release is this file's work. Differences are detected by feature, never by comparing versions.

A leaf: it imports only torch (``passes/`` may import it).

What lives here (each function's docstring says why it is private):
- ``pytree``, ``TorchDispatchMode``, ``FakeTensorMode``, ``OpOverload``, ``size_hint`` (a SymInt's example value).
- Collectives: ``all_gather_into`` / ``reduce_scatter_into`` (renamed in 2.13), ``resolve_process_group``,
  ``functional_all_reduce`` / ``_all_gather`` / ``_reduce_scatter`` and ``FUNCTIONAL_COLLECTIVES`` (a
  compiled graph's nodes), ``fake_store`` (torch's fake process group: a simulated world).
- Autograd and tensors: ``tensor_hooks`` / ``reattach_tensor_hooks``, ``queue_backward_callback`` (what DDP
  and FSDP use), ``make_wrapper_subclass`` / ``disabled_torch_function_impl`` /
  ``DisableTorchFunctionSubclass``, ``storage_key``, ``version_of``, ``assert_all``.
- DTensor: ``local_tensor`` / ``set_local_tensor`` / ``dtensor_spec`` / ``set_dtensor_spec`` / ``DTensorSpec`` /
  ``TensorMeta`` / ``StridedShard`` / ``select_split`` (its state, without its per-call checks),
  ``flatten_mesh``, ``DTENSOR_HANDLES_FUSED_PIECES`` (2.13: yes; 2.11: no), ``dtensor_op_handlers`` /
  ``dtensor_default`` (its table of custom op handlers).
- ``parameter_slots`` / ``buffer_slots``, ``op_schema``, ``register_fx_builtin``, ``fx_without_stack_traces``.
- torch.compile: ``compile_errors``, ``dispatch_mode_active`` / ``dispatch_modes_set_aside`` /
  ``dispatch_modes_entered`` / ``tracing_modes_active`` (a user's TorchDispatchModes around compiled code),
  ``inductor_backend`` / ``inductor_overlap_options`` / ``inductor_bucketing_options`` /
  ``collective_launches``, ``import_compiler``; ``schedule_action_types``: pipeline schedules' actions;
  ``timed_pipeline_waits``: their sends and receives wait at most the group's timeout (gloo's do not).
- ``export_tracer`` / ``untraced`` / ``trace_opaque_call`` / ``opaque_call_of``: a custom autograd Function
  exported as one call of itself (as ``torch._export.wrappers`` keeps a decorated one).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import symbolic_shapes
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "all_gather_into", "buffer_slots", "deregister_pytree_nodes", "disabled_torch_function_impl",
    "DisableTorchFunctionSubclass", "DTENSOR_HANDLES_FUSED_PIECES", "FUNCTIONAL_COLLECTIVES",
    "functional_all_gather", "functional_all_reduce", "functional_reduce_scatter", "group_name", "assert_all",
    "compile_errors", "dispatch_mode_active", "dispatch_modes_set_aside", "dispatch_modes_entered",
    "tracing_modes_active", "inductor_backend", "inductor_overlap_options", "inductor_bucketing_options",
    "collective_launches", "dtensor_default", "dtensor_op_handlers", "dtensor_spec",
    "DTensorSpec", "fake_store", "FakeTensorMode", "flatten_mesh", "fx_builtin_names", "fx_without_stack_traces",
    "import_compiler", "local_or_none", "local_tensor", "make_wrapper_subclass", "module_hook_tables", "op_schema",
    "OpOverload", "optimizer_global_hooks", "parameter_slots", "post_accumulate_grad_hooks", "pytree",
    "pytree_node_types", "queue_backward_callback", "reattach_tensor_hooks", "reduce_scatter_into",
    "register_fx_builtin", "resolve_process_group", "schedule_action_types", "select_split", "set_dtensor_spec",
    "set_local_tensor", "size_hint", "storage_key", "StridedShard", "tensor_hooks", "TensorMeta", "TorchDispatchMode",
    "version_of", "export_tracer", "untraced", "trace_opaque_call", "opaque_call_of", "group_timeout",
    "cpu_flash_attention", "cpu_flash_attention_backward"
]

# --- attention kernels -------------------------------------------------------------------------------

#: The CPU's flash attention with its log-sum-exp, and its backward (torch >= 2.3): context parallelism's
#: blockwise causal attention merges blocks by their log-sum-exps (``autopar.runtime.ops.context``).
cpu_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
cpu_flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# --- symbolic shapes ---------------------------------------------------------------------------------

_hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.hint_int  # (torch >= 2.13; 2.11-2.12)


def size_hint(v: Any) -> Any:
    """A SymInt's example value (its size at capture), without adding a guard; other values as they are."""
    return _hint(v) if isinstance(v, torch.SymInt) else v

# --- collectives -------------------------------------------------------------------------------------

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Gathers every rank's ``t`` into ``out`` (dim 0, group order)."""
    return _all_gather(out, t, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Sums ``t`` over the group and writes this rank's 1/size chunk of dim 0 into ``out``."""
    return _reduce_scatter(out, t, group=group, async_op=async_op)


def compiled_original(model: Any) -> Any:
    """The module ``torch.compile(module)`` wrapped (its ``OptimizedModule``), else ``model``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


def dynamo_graphs() -> int:
    """Graphs dynamo has made in this process so far (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def default_store() -> dist.Store:
    """The c10d store the default process group was made with (every rank of the world reaches it)."""
    return dist.distributed_c10d._get_default_store()


def resolve_process_group(name: str) -> dist.ProcessGroup:
    """The ProcessGroup a functional collective names by ``group_name``."""
    return dist.distributed_c10d._resolve_process_group(name)


# torch's functional collectives (``torch.ops._c10d_functional``): out-of-place ops a compiled graph holds as
# nodes (Inductor schedules them; ``wait_tensor`` marks where the result is needed). Eager autopar calls the
# in-place ``torch.distributed`` ones instead (measured faster there: no wrapper tensors).
_funcol = torch.ops._c10d_functional

#: The functional collectives a compiled graph may hold, by the kind ``comm_stats`` counts them as, and which
#: argument names the group.
FUNCTIONAL_COLLECTIVES: dict[Any, str] = {
    _funcol.all_reduce.default: "all_reduce",
    _funcol.all_gather_into_tensor.default: "all_gather",
    _funcol.reduce_scatter_tensor.default: "reduce_scatter",
}


def group_name(group: Any) -> str:
    """The name functional collectives take for ``group`` (None: the world)."""
    return (group if group is not None else dist.group.WORLD).group_name


def functional_all_reduce(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``t`` reduced over ``group`` ("sum", "max" or "min"), as a new tensor (traceable)."""
    return _funcol.wait_tensor(_funcol.all_reduce(t, op, group_name(group)))


def functional_all_gather(t: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0 (traceable)."""
    return _funcol.wait_tensor(_funcol.all_gather_into_tensor(t, size, group_name(group)))


def functional_reduce_scatter(t: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``t`` summed over ``group``, this rank's 1/size chunk of dim 0 (traceable)."""
    return _funcol.wait_tensor(_funcol.reduce_scatter_tensor(t, "sum", size, group_name(group)))


# --- autograd ----------------------------------------------------------------------------------------

def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs ``fn`` once the running backward pass has finished (call it from inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


#: Where ``Tensor.register_hook`` and ``register_post_accumulate_grad_hook`` keep a leaf's hooks.
_HOOK_TABLES = ("_backward_hooks", "_post_accumulate_grad_hooks")


def tensor_hooks(t: torch.Tensor) -> dict | None:
    """The hooks ``t.register_hook`` registered on leaf ``t`` (None if none were)."""
    return getattr(t, "_backward_hooks", None)


def post_accumulate_grad_hooks(t: torch.Tensor) -> dict | None:
    """The hooks ``t.register_post_accumulate_grad_hook`` registered on leaf ``t`` (None if none were)."""
    return getattr(t, "_post_accumulate_grad_hooks", None)


def module_hook_tables(module: torch.nn.Module) -> dict[str, dict]:
    """A module's own state-dict hook tables (read by tests that check autopar removed its hooks)."""
    return {"state_dict": module._state_dict_hooks, "load_state_dict_pre": module._load_state_dict_pre_hooks}


def reattach_tensor_hooks(t: torch.Tensor) -> None:
    """Attaches a leaf's registered hooks to its current value again: ``torch.utils.swap_tensors`` (what
    ``module.to`` does to a tensor-subclass parameter) gives the same object a value whose autograd state
    holds none of them. Setting a hook table attaches it (idempotent)."""
    for table in _HOOK_TABLES:
        hooks = getattr(t, table, None)
        if hooks is not None:
            setattr(t, table, hooks)


# --- tensor subclasses -------------------------------------------------------------------------------

make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
disabled_torch_function_impl = torch._C._disabled_torch_function_impl
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass


def storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage, shared by every view of it."""
    return t.untyped_storage()._cdata


def version_of(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (bumped by every in-place op on it or its views)."""
    return t._version


# --- DTensor's state ---------------------------------------------------------------------------------

from torch.distributed.tensor import DTensor  # noqa: E402  (after the plain-torch names above)
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402
from torch.distributed.tensor.placement_types import Shard, _StridedShard  # noqa: E402

#: DTensor's placement for a dim split into interleaved chunks (FSDP2 over TP's layout).
StridedShard = _StridedShard


def local_tensor(t: DTensor) -> torch.Tensor:
    """A DTensor's local piece, without ``to_local()``'s view and checks (read once per parameter per call)."""
    return t._local_tensor


def local_or_none(t: Any) -> torch.Tensor | None:
    """``t``'s local piece if it is a DTensor, else None."""
    return getattr(t, "_local_tensor", None)


def set_local_tensor(t: DTensor, local: torch.Tensor) -> None:
    """Replaces a DTensor's local piece in place (the same object keeps its identity for the optimizer)."""
    t._local_tensor = local


def dtensor_spec(t: DTensor) -> DTensorSpec:
    """A DTensor's spec: mesh, placements and global tensor meta (``device_mesh`` is a slower property)."""
    return t._spec


def set_dtensor_spec(t: DTensor, spec: DTensorSpec) -> None:
    """Replaces a DTensor's spec in place."""
    t._spec = spec


def _handles_fused_pieces() -> bool:
    """Whether DTensor computes right on a ``StridedShard`` that encodes no shard order (autopar's fused
    pieces: q, k and v of one projection, each split alike). torch 2.13 does (its redistribute falls back
    to the greedy plan: ``_StridedShardNotDecodableError``); 2.11 raises in ``full_tensor()`` and returns
    wrong values from ``chunk`` (2 chunks of a 3-piece weight, measured), so there a fused projection
    is not split into pieces (``passes/analysis/make_plan.py``)."""
    from torch.distributed.tensor import _redistribute

    return hasattr(_redistribute, "_StridedShardNotDecodableError")


#: See ``_handles_fused_pieces``.
DTENSOR_HANDLES_FUSED_PIECES = _handles_fused_pieces()


def select_split(placement: Shard, index: torch.Tensor, num_chunks: int, chunk: int) -> torch.Tensor:
    """The part of 1-D ``index`` that shard ``chunk`` of ``num_chunks`` holds under ``placement`` (dim 0)."""
    return placement._select_split_tensor(index, num_chunks, chunk, with_padding=False, clone=False)


def pytree_node_types() -> set[type]:
    """The classes registered as pytree nodes now (torch's Python pytree)."""
    return set(pytree.SUPPORTED_NODES)


def deregister_pytree_nodes(classes: set[type]) -> bool:
    """Removes ``classes`` from torch's Python pytree registry. Returns False, removing nothing, where torch's
    C++ pytree (optree) was imported and may hold them too: torch removes from the Python one only."""
    if getattr(pytree, "_cxx_pytree_imported", False):
        return False
    pending = getattr(pytree, "_cxx_pytree_pending_imports", [])
    pending[:] = [entry for entry in pending if entry[0][0] not in classes]
    for cls in classes:
        if cls in pytree.SUPPORTED_NODES:
            pytree._deregister_pytree_node(cls)
    return True


def optimizer_global_hooks() -> tuple[dict, dict]:
    """torch.optim's process-wide step (pre, post) hooks, by handle id (read by tests)."""
    import torch.optim.optimizer as optimizer

    return optimizer._global_optimizer_pre_hooks, optimizer._global_optimizer_post_hooks


def dtensor_op_handlers() -> dict:
    """DTensor's table of custom op handlers (op overload -> handler(op, args, kwargs)), process-wide."""
    return DTensor._op_dispatcher._custom_op_handlers


def dtensor_default(op: Any, args: tuple, kwargs: dict) -> Any:
    """Runs ``op`` through DTensor's own dispatch, without the custom handler installed for it (if any)."""
    table = dtensor_op_handlers()
    mine = table.pop(op, None)
    try:
        return op(*args, **kwargs)
    finally:
        if mine is not None:
            table[op] = mine


def group_timeout(group: Any = None) -> Any:
    """A process group's timeout (default: the world's, the script's), or None (the fake backend's): no getter."""
    for device in (pg := group if group is not None else dist.group.WORLD)._device_types:
        with contextlib.suppress(AttributeError, RuntimeError):
            return pg._get_backend(device).options._timeout
    return None


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A 1-D DeviceMesh over the ranks of ``mesh``'s dims together (``mesh["data", "depth"]`` -> "batch")."""
    return mesh._flatten(name)


# --- nn.Module's slots -------------------------------------------------------------------------------

def parameter_slots(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own parameter table (name -> Parameter or None), written to swap a parameter object."""
    return module._parameters


def buffer_slots(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own buffer table (name -> tensor or None), written to swap a buffer object."""
    return module._buffers


# --- ops -------------------------------------------------------------------------------------------

def op_schema(op: Any) -> Any:
    """An op overload's schema (its arguments, alias info, name), or None for anything else."""
    return getattr(op, "_schema", None)


# --- fx ----------------------------------------------------------------------------------------------

def fx_builtin_names() -> set[str]:
    """The names fx's generated code resolves without an import of its own (read by tests)."""
    return set(fx.graph._custom_builtins)


def register_fx_builtin(name: str, import_str: str, obj: Any) -> Callable[[], None]:
    """Lets fx's generated code name ``obj`` as ``name`` (imported by ``import_str``); returns the undo (which
    leaves a name another registration replaced alone)."""
    builtins, illegal = fx.graph._custom_builtins, getattr(fx.graph, "_illegal_names", {})
    before = builtins.get(name), illegal.get(name)
    fx.graph._register_custom_builtin(name, import_str, obj)

    def undo() -> None:
        for table, old in ((builtins, before[0]), (illegal, before[1])):
            if old is None:
                current = table.get(name)
                if current is obj or getattr(current, "obj", None) is obj:
                    del table[name]
            else:
                table[name] = old

    return undo


@contextlib.contextmanager
def fx_without_stack_traces() -> Iterator[None]:
    """fx records no source line per node inside (``torch.fx.config.do_not_emit_stack_traces``, torch >= 2.13;
    a no-op before, where graphs keep their stack traces)."""
    import torch.fx.config as fx_config

    if not hasattr(fx_config, "do_not_emit_stack_traces"):
        yield
        return
    saved = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = saved


def fake_store() -> dist.Store:
    """The store of torch's fake process group (``init_process_group("fake", store=fake_store(), ...)``):
    one process stands in for a rank of a bigger world, every collective a no-op."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def import_compiler() -> None:
    """Imports torch's compiler stack (dynamo), which the first functional collective would import."""
    import torch._dynamo  # noqa: F401


# --- compiling (torch.compile, Inductor) ------------------------------------------------------------

def inductor_compile_graph(gm: fx.GraphModule, example_inputs: Any, *args: Any, **kwargs: Any) -> Callable:
    """Inductor's compile of one graph AOTAutograd partitioned (forward, or backward: ``is_backward``), as
    ``inductor_backend`` calls it (looked up at each call: tests put a failing one in its place)."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, *args, **kwargs)


def inductor_backend(wrap: Callable[[fx.GraphModule], Callable[[Callable], Callable]],
                     config_patches: dict[str, Any]) -> Callable:
    """A ``torch.compile`` backend: Inductor, with every graph it compiles (forward and backward, after
    AOTAutograd's partition) shown to ``wrap(graph)`` before Inductor's own passes rewrite it (in place:
    e.g. functional collectives made in-place); what that returns wraps the compiled graph, and runs in
    its place. AOTAutograd's on-disk cache is off inside it: a graph loaded from that cache would skip
    ``wrap``. So is its common-subexpression elimination over the joint graph, which would merge a
    backward's weight all-gather with the forward's and keep the gathered weight alive between them (the
    memory a depth-sharded weight exists to save; each graph is still simplified on its own). The backward
    is lowered with the forward, not at the first backward (where this torch can): a backward that does not
    compile then fails before the forward runs, and the graph runs eagerly, both ways."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def inner(gm: fx.GraphModule, example_inputs: Any, *args: Any, **kwargs: Any) -> Callable:
        around = wrap(gm)  # (before compile_fx_inner's passes rewrite gm)
        return around(inductor_compile_graph(gm, example_inputs, *args, **kwargs))

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Callable:
        patch = {k: False for k in ("enable_autograd_cache", "cse") if hasattr(functorch_config, k)}
        if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
            patch["force_non_lazy_backward_lowering"] = True
        with functorch_config.patch(patch):
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=config_patches)
    return backend


def compile_errors() -> tuple[type[BaseException], ...]:
    """What ``torch.compile`` raises when a graph does not compile (dynamo's and the backend's errors)."""
    from torch._dynamo import exc

    return tuple(getattr(exc, n) for n in ("Unsupported", "BackendCompilerFailed", "TorchRuntimeError",
                                           "InternalTorchDynamoError", "UserError") if hasattr(exc, n))


def dispatch_mode_active() -> Any:
    """The user's TorchDispatchMode that is active (a FLOP counter, a byte meter), else None: torch.compile does
    not run under one, and a CUDA graph's replay would not pass through it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def tracing_modes_active() -> bool:
    """Whether a mode that traces or fakes tensors is among the active TorchDispatchModes (FakeTensorMode, a
    make_fx proxy mode, functionalization): compiled code cannot run under those."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, (FakeTensorMode, ProxyTorchDispatchMode, FunctionalTensorMode))
               for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def dispatch_modes_set_aside() -> Iterator[list[Any]]:
    """Takes the active TorchDispatchModes off their stack for the block (torch.compile then runs) and yields
    them, innermost first; puts them back after (``torch.utils._python_dispatch._disable_current_modes``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes() as modes:
        yield modes


@contextlib.contextmanager
def dispatch_modes_entered(modes: list[Any]) -> Iterator[None]:
    """Puts ``modes`` (innermost first, as ``dispatch_modes_set_aside`` yields them) back on their stack for
    the block, as they were: the ops dispatched inside pass through them."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    for mode in reversed(modes):
        _push_mode(mode)
    try:
        yield
    finally:
        for mode in modes:
            _pop_mode(getattr(mode, "_dispatch_key", None))


def assert_all(ok: torch.Tensor, message: str) -> None:
    """Raises ``message`` when the 0-d bool tensor ``ok`` is false, checked where the tensor is (traceable:
    a compiled graph checks it without reading it back; on CUDA, asynchronously)."""
    torch._assert_async(ok, message)


def inductor_overlap_options() -> dict[str, Any]:
    """Inductor's options that reorder collectives to overlap compute, those this torch has (by feature)."""
    from torch._inductor import config as inductor_config

    options = {}
    if hasattr(inductor_config, "reorder_for_compute_comm_overlap"):
        options["reorder_for_compute_comm_overlap"] = True
    return options


def inductor_bucketing_options(cap_bytes: int) -> dict[str, Any]:
    """Inductor's FX bucketing (``torch._inductor.fx_passes.bucketing``), where this torch has it: the graph's
    all-gathers that do not depend on each other (a block's depth-split weights, or the next blocks' too: a
    prefetch) become one all-gather of their concatenation, and its reduce-scatters one, up to ``cap_bytes``
    a bucket (its default, 2 GB, would gather a whole model's weights at once); the bytes are the same. Empty
    where this torch has no such pass (a log line says so, once)."""
    from torch._inductor import config as inductor_config

    names = ("bucket_all_gathers_fx", "bucket_reduce_scatters_fx")
    if not all(hasattr(inductor_config, n) and hasattr(inductor_config, f"{n}_bucket_size_determinator")
               for n in names):
        if not _said.get("bucketing"):
            _said["bucketing"] = True
            logging.getLogger("autopar").info("autopar: this torch's Inductor has no collective bucketing pass; "
                                              "compiled graphs launch each collective on its own")
        return {}
    cap_mb = functools.partial(_bucket_cap_mb, cap_bytes / 2**20)
    return {"bucket_all_gathers_fx": "all", "bucket_all_gathers_fx_bucket_size_determinator": cap_mb,
            "bucket_reduce_scatters_fx": "all", "bucket_reduce_scatters_fx_bucket_size_determinator": cap_mb}


def _bucket_cap_mb(cap: float, bucket: int) -> float:
    return cap


_said: dict[str, bool] = {}
_LAUNCHES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
             "all_reduce": "all_reduce", "all_to_all": "all_to_all_single"}


def collective_launches(compiled: Any) -> dict[str, int] | None:
    """Collectives of each kind the code Inductor generated for a graph launches (after its bucketing), from
    the generated source; None where the compiled object has none to read."""
    source = getattr(compiled, "source_code", None)
    if not isinstance(source, str):
        return None
    return {kind: n for kind, op in _LAUNCHES.items()
            if (n := len(re.findall(rf"_c10d_functional\.{op}(?:_out|_coalesced|_)?\.default\(", source)))}


def inductor_cuda_graph_options() -> dict[str, Any]:
    """Inductor's options that replay a compiled graph as a CUDA graph (its CUDA graph trees, as
    ``mode="reduce-overhead"`` sets them); empty where this torch has none."""
    from torch._inductor import config as inductor_config

    triton = getattr(inductor_config, "triton", None)
    return {"triton.cudagraphs": True} if hasattr(triton, "cudagraphs") else {}


# --- pipelining --------------------------------------------------------------------------------------

def schedule_action_types() -> tuple[type, type]:
    """``(ScheduleAction, ComputationType)``: one step of a pipeline schedule's order and its kinds."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    return _Action, _ComputationType


@contextlib.contextmanager
def timed_pipeline_waits(group: Any) -> Iterator[None]:
    """While inside, torch's pipeline schedules wait for their sends and receives on ``group`` at most its
    timeout, where its backend is gloo: gloo's ``Work.wait()`` without an argument never times out (a stalled
    neighbour's stage held the others for as long as it stalled), and torch's schedules call it so
    (``schedules._wait_batch_p2p``, a private function swapped here for the call and put back). NCCL's
    watchdog ends such waits itself, and its ``wait(timeout)`` would block the host: left alone."""
    timeout = group_timeout(group)
    if timeout is None or dist.get_backend(group) != "gloo":
        yield
        return
    from torch.distributed.pipelining import schedules
    plain = schedules._wait_batch_p2p

    def wait(work: list[Any]) -> None:
        for w in work:
            w.wait(timeout)

    schedules._wait_batch_p2p = wait
    try:
        yield
    finally:
        schedules._wait_batch_p2p = plain


# --- opaque calls in an export -------------------------------------------------------------------------

def export_tracer() -> Any:
    """The tracer of a ``torch.export`` in progress (its pre-dispatch proxy mode's), else None."""
    from torch._ops import _get_dispatch_mode_pre_dispatch as mode
    return getattr(mode(torch._C._TorchDispatchModeKey.PROXY), "tracer", None) if torch.compiler.is_exporting() \
        else None


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Runs the block on an export's fake tensors, its ops unrecorded (as ``torch._export.wrappers`` runs a Function
    it keeps): export's torch-function mode off its stack too, or it records the block's ``no_grad`` for all."""
    from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode, disable_proxy_modes_tracing

    key, c = torch._C.DispatchKey.PreDispatch, torch._C
    modes = [c._pop_torch_function_stack() for _ in range(c._len_torch_function_stack())][::-1]
    try:
        for m in (m for m in modes if not isinstance(m, PreDispatchTorchFunctionMode)):
            c._push_on_torch_function_stack(m)
        with c._ForceDispatchKeyGuard(c._dispatch_tls_local_include_set().remove(key),
                                      c._dispatch_tls_local_exclude_set() | c.DispatchKeySet(key)), \
                disable_proxy_modes_tracing():
            yield
    finally:
        while c._len_torch_function_stack():
            c._pop_torch_function_stack()
        for m in modes:
            c._push_on_torch_function_stack(m)


def trace_opaque_call(tracer: Any, fn: Callable[..., Any], name: str, leaves: tuple[Any, ...], out: Any) -> fx.Node:
    """Records ``fn(*leaves)`` as one node (with outputs ``out``, on fake tensors) of the graph ``tracer`` builds:
    through torch's ``flat_apply`` (export takes ops only as targets), ``fn`` a constant of the graph."""
    from torch._higher_order_ops.flat_apply import _ConstantFunction, flat_apply, to_graphable
    from torch.fx.experimental.proxy_tensor import track_tensor_tree

    flat, in_spec = to_graphable((leaves, {}))
    attrs = []
    for suffix, value in (("fn", pytree.tree_flatten(_ConstantFunction(fn))[1]), ("spec", in_spec)):
        attr = tracer.get_fresh_qualname(f"_{name}_{suffix}")
        setattr(tracer.root, attr, value)
        attrs.append(tracer.create_proxy("get_attr", attr, (), {}))
    proxy = tracer.create_proxy("call_function", flat_apply, (*attrs, *map(tracer.unwrap_proxy, flat)), {}, name=name)
    track_tensor_tree(out, proxy, constant=None, tracer=tracer)
    return proxy.node


def opaque_call_of(gm: fx.GraphModule, node: fx.Node) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
    """A node ``trace_opaque_call`` recorded, as (its callable, its arguments); None for any other node."""
    from torch._higher_order_ops.flat_apply import flat_apply
    if node.target is not flat_apply or len(node.args) < 2 or node.args[0].op != "get_attr":
        return None
    return pytree._retrieve_constant(getattr(gm, node.args[0].target)).func, tuple(node.args[2:])
