"""Binds emitted graphs to this rank: parameter shards, process groups, gradient sync, state dicts.

One ``ParallelRuntime`` per parallelized model. The plan is made once, at the first capture (all
ranks plan from the same canonical capture, so the plan is identical everywhere); later input
signatures (a smaller last batch, eval mode) are captured again and compiled with the same plan.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from autopar import patches
from autopar.capture import batch_leaves, input_names, meta_shadow, microbatch_leaves, split_batch_leaves, symbolic_dims
from autopar.compat import pytree, queue_backward_callback
from autopar.config import CompileConfig, InputConfig, MemoryConfig, ParallelConfig, PipelineConfig
from autopar.decisions import Plan
from autopar.errors import CaptureError, InputError, ParameterError
from autopar.hf_caches import register_hf_caches
from autopar.memory import half_dtype
from autopar.planning.planner import pooled_rows
from autopar.runtime.params.data_shards import DataShards
from autopar.runtime.comm import collectives as C
from autopar.runtime.execution import graph_cache as executables
from autopar.runtime.comm import faults
from autopar.runtime.interop import norms
from autopar.runtime.interop import optimizers as optim
from autopar.runtime.interop import pointwise
from autopar.runtime.execution.call_check import GLOBAL, PER_RANK, CallCheck
from autopar.runtime.execution.binding import placeholders
from autopar.runtime.interop.casts import Casts
from autopar.runtime.interop.state_dicts import state_dict_post_hook
from autopar.runtime.compiled.form import compiled_of, reads_parameters_in_one_node, replays_cuda_graphs
from autopar.runtime.compiled.graph import CompiledGraph, SurvivingGrads
from autopar.runtime.execution.builder import Builder
from autopar.runtime.construction.record import Deferred, Sink
from autopar.runtime.execution.graph_cache import Executable, Executables, signature
from autopar.runtime.execution.uncaptured import (OwnForward, data_parallel_sync, fallback_reason, forward_local,
                                                  forward_whole, run_data_parallel, say_eval_fallback)
from autopar.runtime.data_parallel.grad_syncs import GradSyncs
from autopar.runtime.execution.kept_state import (arrived_inputs, carry_cache, given_cache, read_in_place, whole,
                                                  wrap_generate)
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.rows import scatter_batch
from autopar.runtime.params.store import ParamStore
from autopar.runtime.params.layout import local_of, local_view, local_views
from autopar.runtime.data_parallel.per_rank import own_output, pool_rows
from autopar.runtime.pipeline.stage_grads import StageGrads
from passes.ir import InputKind

#: The tokens from which an evaluation call under context parallelism is split over the context ranks
#: (``ParallelRuntime._long``).
EVAL_CONTEXT_FROM = 1024

log = logging.getLogger(__name__)

runtimes: weakref.WeakKeyDictionary[nn.Module, ParallelRuntime] = weakref.WeakKeyDictionary()
"""Every parallel model's runtime: the one its grid runs under now (``auto_parallelize`` registers it)."""


class ParallelRuntime:
    def __init__(self, model: nn.Module, config: ParallelConfig, mesh: Mesh,
                 memory: MemoryConfig = MemoryConfig(), pipe: PipelineConfig = PipelineConfig(),
                 inputs: InputConfig = InputConfig(), pending: tuple[Deferred, dict[int, Sink]] | None = None,
                 dtensors: bool | None = None, compile: CompileConfig = CompileConfig(),
                 open_degrees: dict[str, int] | None = None) -> None:
        """``pending``: the recorded construction of the parameters and buffers built at the first call.
        ``dtensors``: ParamStore's (True for a provisional grid, replaced by the one chosen at the first call).
        ``open_degrees``: ``config`` is provisional, the grid is chosen at the model's first call (``plan="auto"``
        without example inputs, ``autopar.grid_choice``) with these degrees the user gave."""
        self.memory, self.inputs, self.compile = memory, inputs, compile
        self.open_degrees = open_degrees
        """The degrees the user gave while the grid waits for the first call to choose it (``take_grid``); None
        once chosen, or when the grid was given."""
        self.no_sync_depth = 0
        """>0 inside ``no_sync()``: backward keeps gradients local (accumulation), as DDP's no_sync does."""
        installed = patches.of_model(model)  # (the model's changes, undone by autopar.detach)
        self.shadow = meta_shadow(model)  # before the parameters become DTensors
        register_hf_caches(model)  # before any call flattens its inputs
        if getattr(model, "can_generate", lambda: False)() and "attribute generate" not in installed:
            installed.set_attribute("generate", wrap_generate(model, model.generate, self.following))  # (kept_state)
        if mesh.control is not None:  # the script's own collectives name the ranks that parted, as the model's calls do
            patches.install("torch.distributed collectives naming parted ranks",
                            faults.name_parted_ranks_in_script_collectives)
        self._model = weakref.ref(model)
        self.original_forward = OwnForward(model.forward, model)
        """The model's own forward, not bound to it (the runtime must not keep the model alive)."""
        self._warned: set[Any] = set()
        self._on_grid(config, mesh, pipe, pending, dtensors)
        self.casts = Casts(model, self.shadow, self.store)
        """The dtypes the graphs are captured for: part of their keys (``model.to(dtype)``, casts.py)."""

    def _on_grid(self, config: ParallelConfig, mesh: Mesh, pipe: PipelineConfig,
                 pending: tuple[Deferred, dict[int, Sink]] | None, dtensors: bool | None) -> None:
        """Everything of this runtime that its grid decides: the process groups, the call check, the parameter
        store (the same Parameter objects, laid out for ``config``), the builder and the graphs' cache."""
        model = self._model()
        self.config, self.mesh, self.pipe = config, mesh, pipe
        self.pure_data = (config.num_tensor == 1 and config.pipeline == 1 and not config.expert_parallel
                          and config.context == 1)
        """No collective in forward for a batch of this rank's own (data parallelism only, experts not split)."""
        self.calls = CallCheck(mesh.control, self.inputs.batch, self.inputs.eval_timeout, mesh.shard_members(),
                               self.pure_data, self.inputs.check_inputs)
        self.num_microbatches = pipe.num_microbatches(config.pipeline) if config.pipeline > 1 else 1
        self.store = ParamStore(model, config, mesh, pending, dtensors)
        self.params = self.store.params
        if config.shard_optimizer and config.data > 1:
            self.store.data_shards = DataShards(mesh)
            optim.install()  # each data rank steps its chunk of every parameter
        if self.store.dtensors:
            norms.install()  # clip_grad_norm_ and other norms over the sharded parameters: serial's values
            pointwise.install()  # in-place elementwise ops (a backward adding into p.grad) on the local pieces
            optim.install()  # torch.optim's elementwise optimizers step on the local pieces
            installed = patches.of_model(model)
            if "state_dict post-hook" not in installed:  # DCP sees every box of fused pieces
                installed.add("state_dict post-hook", model.register_state_dict_post_hook(state_dict_post_hook).remove)
        self.buffers = self.store.buffers  # built at the first call with deferred construction
        self.syncs = GradSyncs(model, self.sync_enabled)
        """The gradient syncs of the parameters (pipeline = 1): one per process group."""
        self.builder = Builder(model, self.shadow, self.store, self.syncs, mesh, config, self.memory, pipe,
                               self.finish_grads, self._warn_once, self.compile)
        self.executables = Executables()
        """Compiled graphs by input signature (autopar/runtime/execution/graph_cache.py)."""
        self.shapes_met: set[Any] = set()
        """Keys (symbolic sizes) a training call was captured for with its own sizes: the next is symbolic."""
        self.shapes_fixed: set[Any] = set()
        """Keys whose symbolic capture failed or had its sizes fixed: captured with their own sizes."""
        self.uncaptured: dict[Any, str] = {}
        """Signatures of evaluation calls that could not be captured (run whole on every rank): why not."""
        self.stage_grads = StageGrads()
        """pipeline > 1: the plain leaves the stages read for the parameters, and the step's gradients."""
        self.surviving_grads = SurvivingGrads(self.store.unique)
        """compile="reduce-overhead": gradients copied out of CUDA graph memory before the next replay."""
        self.fallback = False

    def take_grid(self, config: ParallelConfig, pipe: PipelineConfig) -> None:
        """The grid chosen at the model's first call replaces the provisional one (``autopar.grid_choice``): the
        same Parameter objects (the optimizer's) are laid out anew, the batch mode the first call decided
        stays. Nothing was captured yet: the provisional grid never plans."""
        self.open_degrees = None
        if config == self.config:
            return
        mode = self.calls.mode
        self.store.close()  # its load hooks go: the new store registers its own
        self._on_grid(config, Mesh(config), pipe, self.store.pending, True)
        self.casts.store = self.store  # (the shadow was cast with the model: it stays, and the dtypes seen)
        self.calls.mode = mode

    def following(self) -> contextlib.AbstractContextManager:
        """``CallCheck.following`` (generate's wrapper asks each call)."""
        return self.calls.following()

    # ---- calling ----------------------------------------------------------------------------------

    def sync_enabled(self) -> bool:
        """Whether this backward sums gradients over data (x depth): not inside ``no_sync()``, nor while the
        script sets DDP's ``model.require_backward_grad_sync = False`` (nanoGPT's accumulation)."""
        return self.no_sync_depth == 0 and getattr(self._model(), "require_backward_grad_sync", True) is not False

    @property
    def plan(self) -> Plan | None:
        """The model's plan, made at its first capture (``Builder.build``); None before."""
        return self.store.plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return carry_cache(args, kwargs, self.run(args, kwargs)[0])  # the cache passed in is updated, as serial

    def run(self, args: tuple, kwargs: dict, *, local_outputs: bool = False,
            example: bool = False) -> tuple[Any, list[Any], tuple[int, ...]]:
        """Runs the model; returns (outputs, the GatherOutputSpec of each output leaf, batch sizes).

        With ``local_outputs`` the outputs stay as this rank computed them (its batch rows, its
        piece of a split dim) and the specs say how they are laid out; train_step uses this.
        ``example``: auto_parallelize's example_inputs, the same on every rank: a global batch that
        decides nothing about how the script feeds the model later.
        """
        grad = torch.is_grad_enabled()
        if not grad and self.pure_data:  # like DDP's module in evaluation: this rank's inputs, no collective
            return self._forward_local(args, kwargs), None, ()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        leaves, arrived = arrived_inputs(leaves, self.mesh)  # a cache an earlier call returned split
        names = input_names(args, kwargs, spec)
        declared = self.inputs.batch_dims
        found = batch_leaves(leaves, names, declared)
        mode, every = (GLOBAL, None) if example else self.calls.check(leaves, spec, found[0], grad)
        with self.calls.running():  # (the others may wait in this call's collectives: autopar.runtime.comm.faults)
            result = self._run_as(mode, every, args, kwargs, leaves, spec, arrived, names, found, grad, local_outputs)
        if not example:
            self.calls.settle(result[0])
        return result

    def _long(self, leaves: list[Any]) -> bool:
        """An evaluation call under context parallelism whose token ids (a 2-D integer input) are
        ``EVAL_CONTEXT_FROM`` tokens or more and split into 2C chunks: captured at its length and split (one
        capture per such length; shorter calls, prompts and decode steps keep one graph for every length, whole
        on every context rank)."""
        chunks = 2 * self.config.context
        return any(isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() and not
                   x.is_complex() and x.shape[1] >= EVAL_CONTEXT_FROM and x.shape[1] % chunks == 0 for x in leaves)

    def _run_as(self, mode: str, every: Any, args: tuple, kwargs: dict, leaves: list[Any], spec: Any,
                arrived: dict, names: Any, found: Any, grad: bool,
                local_outputs: bool) -> tuple[Any, list[Any], tuple[int, ...]]:
        """``run`` after the call's check: in ``mode``, with the inputs ``leaves`` (``arrived``: the split caches)."""
        declared = self.inputs.batch_dims
        if mode == PER_RANK:
            if local_outputs:
                raise InputError("train_step takes one global batch, the same on every rank, but this model is fed a "
                                 "batch per rank (batch='per-rank'): call the model and compute the loss as the DDP "
                                 "script does.")
            return self._run_per_rank(args, kwargs, leaves, spec, every), None, ()
        if self.fallback:
            return self._run_data_parallel(args, kwargs), None, ()
        shards = self.config.num_batch_shards
        if not grad and self.config.pipeline == 1 and 0 < found[1] < shards:
            shards = 1  # an evaluation batch with fewer rows than data x depth: every batch rank runs it whole
        split, global_batch = split_batch_leaves(leaves, shards, names, declared, found)
        sizes = self.config.batch_sizes(global_batch) if split else ()
        if arrived:  # read in place where this call's graph takes them split, else made whole
            leaves, arrived = read_in_place(leaves, arrived, split, sizes,
                                            not grad and not local_outputs and self.config.pipeline == 1)
        # sequence dims (and an unsplit batch) symbolic, one graph for every length and batch size (a key holds
        # the graphs captured for it; the first that accepts these sizes runs, else one more is captured).
        # Training captures its first shape as it is and goes symbolic when a second shape meets the key (as
        # torch.compile's automatic dynamic shapes): a script with one shape pays no symbolic capture.
        # Where data x depth split the batch, each rank's rows are symbolic when every shard has two or more
        # (export specializes a size of 1), and the graph's batch ops read the call's row counts.
        rows_symbolic = not split or min(sizes) > 1
        # (context parallelism splits a static length: its training graphs are captured per length, and so are
        # evaluation calls of long sequences that split, which whole would not fit where training needed context)
        dynamic = symbolic_dims(self._model(), leaves, found[0] if rows_symbolic else {}, bool(split),
                                sequence=not (self.config.context > 1 and (grad or self._long(leaves))))
        training = self._model().training

        def these_sizes() -> Any:
            return spec, training, global_batch, tuple(signature(x) for x in leaves), local_outputs

        batch = ("split", len(sizes)) if rows_symbolic and any(d in dynamic.get(i, {}) for i, d in split.items()) \
            else global_batch
        key = (spec, training, batch, tuple(signature(x, dynamic.get(i)) for i, x in enumerate(leaves)),
               local_outputs) if dynamic else these_sizes()
        exe = self._cached(key, these_sizes if dynamic else None, leaves, split, sizes)
        if exe is None and key in self.uncaptured:  # an evaluation call that could not be captured before
            self._say_eval_fallback(self.uncaptured[key])  # (once more if a plan changed its cost)
            return self._forward_local(*whole((args, kwargs))), None, ()
        if exe is None:
            sharding = {i: a.sharding for i, a in arrived.items() if a.sharding is not None}
            try:
                exe = self._cached_or_built(key, these_sizes() if dynamic else key, dynamic,
                                            lambda symbolic: self._build(leaves, spec, split, sizes, local_outputs,
                                                                         dynamic=symbolic, arrived=sharding))
            except CaptureError as e:
                if self.config.pipeline > 1 or (self.plan is not None and grad):
                    raise
                if not grad:  # this call only: training calls are still captured and get the plan
                    self._eval_fall_back(e, key)
                    return self._forward_local(*whole((args, kwargs))), None, ()
                self._fall_back(e)
                return self._run_data_parallel(args, kwargs), None, ()
        local = [local_of(x) if i in arrived else scatter_batch(x, self.mesh, sizes, split[i]) if i in split else x
                 for i, x in enumerate(leaves)]
        exe.rows.sizes = sizes
        return (self._execute(exe, self._graph_inputs(exe, local), given_cache(args, kwargs)), exe.output_specs,
                sizes)

    def _execute(self, exe: Executable, flat: list[Any], given: Any = None) -> Any:
        """Runs ``exe`` on its placeholders' values; returns the outputs in the model's structure (``given``:
        the cache object the call passed, which receives the cache the graph returns)."""
        dtype = half_dtype(self.memory.precision)
        if exe.program is not None:
            values = dict(zip(placeholders(exe.gm), flat))
            out = exe.program.run_sequential(values)
            exe.program.sync_buffers(self.buffers)
            return pytree.tree_unflatten(list(out), exe.out_spec)
        graphs = exe.graphs if exe.graphs is not None and not torch.is_grad_enabled() else None
        if replays_cuda_graphs(exe.run) and torch.is_grad_enabled():
            self.surviving_grads.copy_out()  # (before the replay overwrites the last one's gradients)
        with torch.autocast(self.mesh.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            out = exe.run(*flat) if graphs is None else graphs.run(exe.run, flat)
        if exe.kept is not None:
            out = exe.kept(list(out), exe.rows.sizes)
        if dtype is not None:
            # Outputs come back in float32, as the serial model's do (the loss then runs in fp32).
            out = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in out]
            if self.memory.precision == "fp16" and torch.is_grad_enabled():
                self._agree_on_overflow_after_backward(out)
        if exe.tree is not None:
            return exe.tree(list(out), given)
        return pytree.tree_unflatten(list(out), exe.out_spec)

    def _run_per_rank(self, args: tuple, kwargs: dict, leaves: list[Any], spec: pytree.TreeSpec,
                      every: list[Any] | None) -> Any:
        """This rank's own batch (DDP semantics, ``autopar.runtime.data_parallel.per_rank``): its rows' outputs, pooled with
        the rows of the ranks holding the same batch shard."""
        members = self.mesh.shard_members()
        member = members.index(self.mesh.rank)
        split = batch_leaves(leaves, input_names(args, kwargs), self.inputs.batch_dims)[0]
        if len(members) > 1:
            rows = tuple(int(every[r].rows) for r in members)
            split, sizes, _ = pooled_rows(split, rows, self.config)  # (the planner's rule)
            local = [pool_rows(x, self.mesh, rows, member, split[i]) if i in split else x
                     for i, x in enumerate(leaves)]
        else:  # alone with its rows: nothing is split, the graph runs on them as they are
            first = min(split) if split else None
            own = int(leaves[first].shape[split[first]]) if split else 0
            rows, local, split, sizes = (own,), list(leaves), {}, ()
        if self.fallback:
            return pytree.tree_map(lambda t: own_output(t, None, self.mesh, rows, member),
                                   self._forward_whole(args, kwargs))
        # lengths symbolic as for a global batch (training: from the second shape on); each member's rows stay
        # numbers (the members' losses are cut by them)
        whole_lengths = self.config.context > 1 and (torch.is_grad_enabled() or self._long(local))  # (as in run)
        dynamic = symbolic_dims(self._model(), local, sequence=not whole_lengths) if self.config.pipeline == 1 else {}
        static = ("per-rank", spec, self._model().training, rows, tuple(signature(x) for x in local))
        key = ("per-rank", spec, self._model().training, rows, tuple(signature(x, dynamic.get(i)) for i, x in enumerate(local))
               ) if dynamic else static
        exe = self._cached(key, (lambda: static) if static is not key else None, local, {}, ())
        if exe is None:
            try:
                exe = self._cached_or_built(key, static, dynamic, lambda symbolic: self._build(
                    local, spec, split, sizes, per_rank=(rows, member), dynamic=symbolic))
            except CaptureError as e:
                if self.plan is not None or self.config.pipeline > 1:
                    raise
                self._fall_back(e, per_rank=True)
                return self._run_per_rank(args, kwargs, leaves, spec, every)
        out = self._execute(exe, self._graph_inputs(exe, local))
        flat, out_spec = pytree.tree_flatten(out)
        specs = exe.output_specs if len(exe.output_specs) == len(flat) else [None] * len(flat)
        return pytree.tree_unflatten([own_output(t, s, self.mesh, rows, member) for t, s in zip(flat, specs)], out_spec)

    def _forward_local(self, args: tuple, kwargs: dict) -> Any:
        """The user's forward on this rank's inputs and whole parameters (``fallback.forward_local``)."""
        return forward_local(self._forward_whole, self.memory.precision, self.mesh.device, args, kwargs)

    def _agree_on_overflow_after_backward(self, outputs: list[Any]) -> None:
        """fp16: when any rank's gradients overflow, every rank's do, so torch.amp.GradScaler skips the
        step (and lowers its scale) on all ranks alike. One small all-reduce at the end of backward."""
        first = next((t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is None:
            return

        def at_end() -> None:
            self._agree_on_overflow()

        def queue(grad: torch.Tensor) -> torch.Tensor:
            queue_backward_callback(at_end)
            return grad

        first.register_hook(queue)

    def _agree_on_overflow(self) -> None:
        """If any rank's gradients overflowed, poisons every rank's (one all-reduce of one value); raises where a
        rank holds no gradient element to poison."""
        self.syncs.finish()  # queued before the syncs' own end callbacks: the sums first
        held = [local_of(p.grad) for p in self.store.unique() if p.grad is not None]
        grads = [g for g in held if g.numel()]  # (a gradient split over data: a chunk, maybe empty on some ranks)
        # one value summed over the ranks: how many overflowed, plus world + 1 for each holding gradients
        # without an element (chunks of ceil(rows / data) rows leave the last data ranks none of a small one)
        world = self.config.world_size
        flag = int(any(not torch.isfinite(g).all() for g in grads)) + int(bool(held) and not grads) * (world + 1)
        total = int(C.all_reduce(torch.tensor([flag], dtype=torch.int64, device=self.mesh.device), None, world).item())
        if total % (world + 1) == 0:
            return
        if total >= world + 1:
            raise ParameterError(
                f"fp16: gradients overflowed, and {total // (world + 1)} rank(s) hold no element of any gradient "
                "(shard_optimizer splits each one over the data ranks in chunks of ceil(rows / data) rows, and "
                "every trainable parameter of this model has too few rows to give those ranks one), so "
                "torch.amp.GradScaler could not skip this step there. Use fewer data ranks, "
                "shard_optimizer=False, or precision='bf16' (no loss scaling).")
        with torch.no_grad():
            for g in grads:
                g.view(-1)[0] = float("inf")

    # ---- fallback: no graph ---------------------------------------------------------------------

    def _find(self, key: Any, leaves: list[Any], split: dict[int, int], sizes: tuple[int, ...],
              dtypes: tuple[torch.dtype, ...]) -> Executable | None:
        """The compiled graph for ``key`` that takes these inputs (a graph with symbolic sizes is checked
        against this rank's rows of the batch), among those captured for the model's ``dtypes`` now."""
        rows = sizes[self.mesh.index("batch")] if split else 0

        def narrow(x: torch.Tensor, dim: int) -> torch.Tensor:  # (sizes only: a DTensor's narrow would gather)
            x = torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, DTensor) else x
            return x.narrow(dim, 0, rows)

        return self.executables.find((dtypes, key), lambda: [narrow(x, split[i]) if i in split else x
                                                                         for i, x in enumerate(leaves)])

    def _cached(self, key: Any, static: Callable[[], Any] | None, leaves: list[Any], split: dict[int, int],
                sizes: tuple[int, ...]) -> Executable | None:
        """The cache policy's lookup, for every kind of call: the graph for ``key`` (symbolic sizes) that takes
        these inputs, else the one captured for these sizes (``static()``, made only then; None: ``key`` is
        these sizes), else None (``_cached_or_built`` makes one)."""
        dtypes = self.casts.check()  # (once a call: it passes over every parameter)
        exe = self._find(key, leaves, split, sizes, dtypes)
        return exe if exe is not None or static is None else self._find(static(), leaves, split, sizes, dtypes)

    def _cached_or_built(self, key: Any, static: Any, dynamic: dict[int, dict[int, Any]],
                  build: Callable[[dict[int, dict[int, Any]]], Executable]) -> Executable:
        """The cache policy, one for every kind of call (a global batch, per-rank batches, a pipeline's
        micro-batch), after ``_find`` found no graph for ``key`` (symbolic sizes) nor ``static`` (these sizes):
        ``build`` one, with ``dynamic``'s symbolic sizes in evaluation and from a key's second shape in
        training (as torch.compile's automatic dynamic shapes: a script with one shape pays no symbolic
        capture), as these sizes where symbolic capture failed before; kept under the key it accepts."""
        symbolic = dynamic if (not torch.is_grad_enabled() or key in self.shapes_met) and key not in self.shapes_fixed \
            else {}
        self.shapes_met.add(key)
        exe = build(symbolic)
        if symbolic and exe.accepts is None:  # symbolic sizes failed or were fixed: not tried again
            self.shapes_fixed.add(key)
        self._keep(key if exe.accepts is not None else static, exe)  # (captured as these sizes: their key)
        return exe

    def _keep(self, key: Any, exe: Executable) -> None:
        """Caches a compiled graph; one warning the first time a signature has to go (each new input shape
        then costs a capture)."""
        if self.executables.keep((self.casts.dtypes, key), exe):
            if "evict" not in self._warned and self.mesh.rank == 0:
                log.warning("autopar: %s was called with more than %d input signatures; the least recently used "
                            "compiled graphs are dropped and captured again when met. Pad inputs to a few lengths "
                            "to avoid the captures.", type(self._model()).__name__, executables.MAX_EXECUTABLES)
            self._warned.add("evict")

    def _eval_fall_back(self, error: CaptureError, key: Any) -> None:
        """An evaluation call before any plan that cannot be captured: it (and later calls with the same
        signature) runs the whole model on every rank; the next training call is captured as usual."""
        self.uncaptured[key] = reason = fallback_reason(error)
        self._say_eval_fallback(reason)

    def _say_eval_fallback(self, reason: str) -> None:
        say_eval_fallback(reason, bool(self.store.dtensors and self.plan), self._warned, self.mesh.rank)

    def _fall_back(self, error: CaptureError, per_rank: bool = False) -> None:
        """The model cannot be captured: every rank runs it whole, on its data rank's share of the batch (DDP
        over the data ranks), or with ``per_rank`` batches on its own (DDP over every rank)."""
        self.fallback = True
        sync = data_parallel_sync(error, self.params, self.mesh, self.sync_enabled, per_rank)
        if sync is not None:
            self.syncs.add(sync, "world")

    def _run_data_parallel(self, args: tuple, kwargs: dict) -> Any:
        return run_data_parallel(self._forward_whole, self._model(), self.mesh, self.inputs.batch_dims, args, kwargs)

    def _forward_whole(self, args: tuple, kwargs: dict) -> Any:
        """The user's forward on a whole copy of the model (``fallback.forward_whole``)."""
        return forward_whole(self._model(), self.store, self.plan is not None, self.original_forward, args, kwargs)

    # ---- compiling --------------------------------------------------------------------------------

    def _build(self, leaves: list[Any], spec: pytree.TreeSpec, split: dict[int, int],
               sizes: tuple[int, ...], local_outputs: bool = False,
               per_rank: tuple[tuple[int, ...], int] | None = None,
               dynamic: dict[int, dict[int, Any]] | None = None, arrived: dict[int, Any] | None = None
               ) -> Executable:
        """This call's executable (``Builder.build``: capture, the first plan, bind, wrap)."""
        return self.builder.build(leaves, spec, split, sizes, local_outputs, per_rank, dynamic, arrived)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned and self.mesh.rank == 0:
            log.warning("autopar: %s", message)
        self._warned.add(message)

    def finish_grads(self) -> None:
        """pipeline > 1, after backward (or after the schedule's last micro-batch): the step's gradients into
        ``p.grad`` (``StageGrads.finish``), then the fp16 overflow agreement. Every rank calls this once per
        step."""
        if self.stage_grads.finish(self.plan, self.params, self.mesh, self.config,
                                   half_dtype(self.memory.reduce_dtype), self.sync_enabled(),
                                   self.store.data_shards) \
                and self.memory.precision == "fp16":
            self._agree_on_overflow()

    # ---- pipeline: what train_step needs ----------------------------------------------------------

    def pipeline_inputs(self, args: tuple, kwargs: dict) -> tuple[Executable, dict[fx.Node, Any], int, tuple[int, ...]]:
        """Compiles the graph of one micro-batch and binds this step's inputs to its placeholders.

        Returns (executable, values, global batch, batch shard sizes); batch-split values hold this
        rank's whole shard (torch's schedule cuts it into micro-batches).
        """
        leaves, spec = pytree.tree_flatten((args, kwargs))
        m, shards = self.num_microbatches, self.config.num_batch_shards
        split, global_batch, sizes = microbatch_leaves(leaves, self.config, m, input_names(args, kwargs),
                                                       self.inputs.batch_dims)
        if self.calls.check(leaves, spec, split, torch.is_grad_enabled())[0] == PER_RANK:
            raise InputError("train_step takes one global batch, the same on every rank, but this model is fed a "
                             "batch per rank (batch='per-rank').")
        micro = [x[:global_batch // m] if i in split else x for i, x in enumerate(leaves)]
        micro_sizes = tuple(s // m for s in sizes)
        key = ("pipeline", spec, self._model().training, global_batch // m, tuple(signature(x) for x in micro))
        exe = self._cached(key, None, micro, {}, ()) or self._cached_or_built(
            key, key, {}, lambda _: self._build(micro, spec, split, micro_sizes, True))
        local = [scatter_batch(x, self.mesh, sizes, 0) if i in split and shards > 1 else x
                 for i, x in enumerate(leaves)]
        values = dict(zip(placeholders(exe.gm), self._graph_inputs(exe, local)))
        return exe, values, global_batch, sizes

    def _graph_inputs(self, exe: Executable, local: list[Any]) -> list[Any]:
        """The value of each placeholder of ``exe``: parameters, buffers, constants, this rank's inputs."""
        flat = []
        read = self.stage_grads.leaf if exe.program is not None else local_view
        if exe.reads_params and torch.is_grad_enabled():  # (the graph reads each where it is first used; without
            read = _itself  # gradients it takes the local pieces as well, as a CUDA graph's capture of it does)
        elif exe.program is None and reads_parameters_in_one_node(exe.run):
            views = iter(local_views([self.params[t] for kind, t in exe.inputs if kind is InputKind.PARAMETER]))
            read = lambda p: next(views)  # noqa: E731
        for kind, target in exe.inputs:
            if kind is InputKind.PARAMETER:
                flat.append(read(self.params[target]))
            elif kind is InputKind.BUFFER:
                flat.append(self.buffers[target])
            elif kind is InputKind.CONSTANT:
                flat.append(exe.constants[target])
            else:
                flat.append(local[int(target)])
        return flat

    # ---- parameters -------------------------------------------------------------------------------

    def full_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.store.full_state_dict(state)

    def compiled_graphs(self) -> list[CompiledGraph]:
        """The graphs this model runs compiled (each executable's, or each pipeline stage's, and those captured
        as CUDA graphs)."""
        return compiled_of(r for graphs in self.executables.values() for exe in graphs
                           for r in ([exe.run] if exe.program is None else [a.run for a in exe.program.adapters.values()])
                           + ([exe.graphs.warm] if exe.graphs is not None and exe.graphs.warm is not exe.run else []))

    def graph_replays(self) -> int:
        """Evaluation calls replayed as CUDA graphs (``autopar.runtime.compiled.cuda_graphs``), over the graphs kept."""
        return sum(exe.graphs.replays() for graphs in self.executables.values() for exe in graphs
                   if exe.graphs is not None)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return self.store.full_grads()


def _itself(p: Any) -> Any:
    return p
