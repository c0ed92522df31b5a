"""auto_parallelize(): build an unchanged model inside it; after the block the model is parallel.

Inside the block, torch's removable global registration hooks (parameter, buffer and submodule
registration) record which modules are built; whatever happens inside, they are removed on the way out.
After it, what autopar changes on each model and in the process is installed through ``autopar.patches``
and undone by ``detach(model)`` (or with the last parallel model).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_hooks

from autopar import patches
from autopar.config import CompileConfig, InputConfig, MemoryConfig, ParallelConfig, PipelineConfig
from autopar.errors import AgreementError, ConfigError, ContextError, NotInitializedError
from autopar.grid_choice import at_first_call, choose_grid_now, too_big_for_data_parallel
from autopar.memory import release_freed_memory
from autopar.parallel_model import no_sync
from autopar.runtime.comm import collectives as C
from autopar.runtime.construction.record import Deferred
from autopar.runtime.construction.memory_mapped import FileMaps, file_fingerprint
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.params.layout import splits_parameters
from autopar.runtime.construction.pending import Pending, make_pending, materialize_whole
from autopar.runtime.parallel_runtime import ParallelRuntime, runtimes

log = logging.getLogger(__name__)

_state = threading.local()


class _ModuleRecorder:
    """Records modules that gain parameters, buffers or submodules; the roots are the models."""

    def __init__(self) -> None:
        self._owners: list[weakref.ref[nn.Module]] = []
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._children: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._handles = [
            module_hooks.register_module_parameter_registration_hook(self._owner),
            module_hooks.register_module_buffer_registration_hook(self._owner),
            module_hooks.register_module_module_registration_hook(self._child),
        ]

    def _owner(self, module: nn.Module, name: str, value: Any) -> None:
        if module not in self._seen:
            self._seen.add(module)
            self._owners.append(weakref.ref(module))

    def _child(self, module: nn.Module, name: str, child: nn.Module | None) -> None:
        self._owner(module, name, child)
        if child is not None:
            self._children.add(child)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def roots(self) -> list[nn.Module]:
        out = []
        for ref in self._owners:
            m = ref()
            if m is not None and m not in self._children and any(True for _ in m.parameters()):
                out.append(m)
        return out


#: transformers' switch for its hub kernels (``USE_HUB_KERNELS``), off inside a block that builds on meta.
_HUB_KERNELS = "USE_HUB_KERNELS"


@contextmanager
def auto_parallelize(*, tensor: Sequence[int] | None = None, data: int | None = None, pipeline: int | None = None,
                     microbatches: int | None = None, schedule: str | None = None, chunks: int | None = None,
                     example_inputs: tuple | None = None, checkpoint: str | int = "auto",
                     precision: str = "fp32", reduce_dtype: str = "fp32", batch: str = "auto",
                     eval_timeout: float = 30.0, batch_dims: dict[int | str, int | None] | None = None,
                     check_inputs: bool = True,
                     defer_init: bool = True, plan: str | None = None,
                     compile: bool | str = "auto", shard_optimizer: bool = False,
                     sequence_parallel: bool = False, expert_parallel: bool | str = False, context: int = 1
                     ) -> Iterator[ParallelConfig | None]:
    """Parallelizes every model built inside the block over data x pipeline x 3D tensor parallelism.

    Args:
        tensor: ``(row, col, depth)`` degrees of 3D tensor parallelism (AxoNN). Default (1, 1, 1).
        data: data-parallel degree. Default: every rank not used by ``tensor`` and ``pipeline``. With no
            degrees at all (no ``tensor``, ``data``, ``pipeline`` or ``plan``): data parallelism with plain
            tensors, as DDP, for a model whose training state (fp32 parameters, gradients and Adam's two
            moments) fits half a device's memory; a bigger model's grid is chosen as with ``plan="auto"``.
        pipeline: pipeline ranks. The model's blocks are cut into stages by predicted cost
            (``plan_of(model).pipeline``); each rank holds only its stages' parameters.
            ``autopar.train_step`` runs torch.distributed.pipelining's ``schedule`` over
            ``microbatches``; a plain ``model(x)`` runs the stages one after another and returns the
            full output on every rank.
        microbatches: micro-batches per ``train_step`` (default: ``pipeline``). Every data x depth
            shard of the batch must divide into them.
        schedule: "1f1b" (default), "gpipe", "interleaved" (Interleaved1F1B) or "looped-bfs" (with
            ``plan="auto"`` and neither this nor ``chunks`` given: 1F1B or interleaved, as predicted faster).
        chunks: stages per pipeline rank for "interleaved" and "looped-bfs" (default 2).
        example_inputs: optional positional inputs of one global batch; when given, the model is
            captured, planned and sharded at the end of the block instead of at its first call.
        checkpoint: which blocks recompute their activations in backward. "auto" (default): the
            fewest recomputed FLOPs that fit the device's memory (GPU: its total memory; CPU: physical
            memory divided by the ranks on the machine); an int: that budget in bytes per device;
            "full": every block; "none": nothing. The budget covers parameters, gradients, Adam's
            two optimizer states and activations. See ``plan_of(model).memory``.
        precision: "fp32", or "bf16"/"fp16": the model runs under ``torch.autocast`` in that dtype
            while parameters, gradients and optimizer state stay fp32 (master weights); outputs
            come back as fp32. With fp16 use ``torch.amp.GradScaler`` as usual: an overflow on any
            rank makes every rank skip the step.
        reduce_dtype: dtype of gradient reductions: "fp32" (default) or the compute dtype (half the
            bytes, less exact). Activations and weight all-gathers travel in the compute dtype.
        batch: how the script feeds the model. "global": every rank passes the same global batch
            (autopar splits it; outputs come back whole). "per-rank": every rank passes its own batch
            (``DistributedSampler``, ``seed_offset = rank``) and gets its own rows' outputs, with
            gradients averaged over the ranks, as under DDP. "auto" (default): decided at the first call
            with gradients by comparing the ranks' inputs (equal everywhere: "global").
        eval_timeout: seconds a call under ``no_grad`` waits for the other ranks to make the same call
            before raising (a model split over ranks cannot evaluate on rank 0 alone). Default 30.
        check_inputs: under a global batch, compare every call's input values across the ranks (a sum and a sum
            weighted by place per input, sent with the descriptor every call already sends): a rank whose loader drifted
            raises ``InputError``. Default True; False compares only each new input shape's first call (saves
            a pass over the inputs; a device's inputs cost one device sync per call).
        batch_dims: which inputs hold the batch, by position or keyword: ``{input: dim}``, or ``{input:
            None}`` for an input that holds none (packed sequences, a table whose dim 0 happens to equal
            the batch size). Default: dim 0 of the first tensor input is the batch, and dim 0 of every
            tensor input of that size.
        defer_init: record the block's construction on meta and build parameters at the first call, each
            rank only its pieces, with serial's values bit for bit (autopar/runtime/construction/record.py). Default
            True; False builds every parameter whole on every rank inside the block (for a model whose
            construction reads tensor data into Python, which DeferredInitError names).
        plan: "auto": the degrees not given (``tensor``, ``data``, ``pipeline``, ``microbatches``, the schedule) are
            chosen by ``python -m autopar.plan``'s search for this machine: the grid with the least
            predicted step time that fits the device's memory (the log names it and the runners-up;
            ``plan_of(model)`` has its plan). With ``example_inputs`` (one global batch, one model in the
            block) at the end of the block; without, at each model's first call, for that call's inputs
            (a batch per rank counts as the global batch of all ranks' rows; a pipeline only when that
            call is ``autopar.train_step``, the one call that runs a pipeline schedule). Until then the
            parameters are replicated DTensors, as under a tensor grid: build the optimizer, load a state
            dict, or enter ``no_sync()`` as usual. Default None: the degrees as given (none given: see
            ``data``).
        compile: True: each rank's program (forward and backward, each pipeline stage) runs under
            ``torch.compile`` with Inductor, its collectives as graph nodes (autopar/runtime/compiled/graph.py);
            a graph that does not compile runs eagerly with one warning line. False: eagerly, op by op.
            "auto" (default): compiled on CUDA devices, eager on CPU. Same results either way.
            "reduce-overhead": compiled, and on CUDA each training step's graphs are replayed as CUDA graphs
            (Inductor's CUDA graph trees; pipeline stages are not): a tensor the model returned is overwritten
            by the next training call, as under torch.compile(mode="reduce-overhead"); clone what you keep.
        shard_optimizer: True: each data rank keeps the optimizer state of 1/data of every parameter (ZeRO
            stages 1-2, Megatron's distributed optimizer) and, after backward, that part of its gradient (a
            reduce-scatter: ``p.grad`` is a DTensor split over data), steps it and all-gathers the updated
            parameters (autopar/runtime/params/data_shards.py): DDP's bytes. For torch.optim's elementwise
            optimizers (Adam, AdamW, SGD, ...); another keeps its whole state with one warning line.
        sequence_parallel: True: where a matmul would all-reduce a whole output over the row (or col) ranks
            (Megatron's row-parallel layer: attention's and the MLP's output projections), it reduce-scatters
            it along the tokens instead, so the residual stream, norms and dropout between matmuls hold
            1/row of the tokens; the next matmul all-gathers them and reduce-scatters their gradient. The
            same bytes as the all-reduces; serial's numbers. Applies to tensors of three or more dims whose
            token count divides by the group (a one-token decode step keeps the all-reduce).
        expert_parallel: True: a mixture-of-experts model's routed experts split over the data ranks, each
            holding experts/data whole experts; a layer's rows go to their experts' ranks by all-to-all and
            come back (dropless: no capacity factor, serial's numbers). Layers autopar cannot split, or whose
            experts do not divide, keep them whole (one note each in the plan). On a tensor grid each expert is
            split over the larger tensor axis too. ``"data+tensor"``: whole experts over the data ranks and the
            ranks of the one tensor axis together (Megatron's expert parallelism borrowing the tensor ranks:
            experts/(data*tensor) per rank; each tensor rank sends a block of the rows they all hold and the
            results are all-gathered over the axis). With ``plan="auto"`` the search chooses an expert layout on
            its own; expert_parallel=True holds it to grids that split them, "data+tensor" to that layout.
        context: ranks splitting every sequence's tokens for the whole model, attention included (context
            parallelism; default 1). Each holds two of ``2 * context`` equal chunks of the sequence (``i`` and
            ``2 * context - 1 - i``: causal attention's work is even), position ids and rotary tables follow, and
            attention gathers the keys and values over the context ranks; the loss is completed over them.
            Serial's numbers. The sequence length must divide into ``2 * context`` chunks. Combines with ``data``,
            ``pipeline``, ``tensor``, ``sequence_parallel`` and ``shard_optimizer`` (not yet with
            ``expert_parallel``); ``data=None`` counts it among the ranks used. With ``plan="auto"`` the search
            keeps a degree given here, and tries context degrees on its own where a sequence has 16,384 tokens or
            more. See docs/guide/context.md.

    Yields:
        The validated ParallelConfig (None with ``plan="auto"``: it is chosen later).

    After the block each model built inside it is the same object, now parallel: ``model(x)`` takes
    the same global batch on every rank and returns the full output on every rank (or, fed a batch per
    rank, each rank's own rows' outputs); its parameters become this rank's shards at the first call
    (or at the end of the block with example_inputs); gradients are complete and synchronized when
    backward returns.
    """
    options = _options(tensor=tensor, data=data, pipeline=pipeline, microbatches=microbatches, schedule=schedule,
                       chunks=chunks, checkpoint=checkpoint, precision=precision, reduce_dtype=reduce_dtype,
                       batch=batch, eval_timeout=eval_timeout, batch_dims=batch_dims, check_inputs=check_inputs,
                       plan=plan, compile=compile,
                       shard_optimizer=shard_optimizer, sequence_parallel=sequence_parallel,
                       expert_parallel=expert_parallel, context=context)
    if getattr(_state, "active", False):
        raise ContextError("auto_parallelize blocks cannot be nested. Build all models in one block.")
    _state.active = True
    recorder = _ModuleRecorder()
    deferred = Deferred() if defer_init else None
    kernels = os.environ.get(_HUB_KERNELS)
    try:
        if deferred is not None:
            deferred.roots = recorder.roots
            deferred.__enter__()
            # transformers >= 5.25 kernelizes every from_pretrained model by default, which raises on the meta
            # device the block builds on; autopar captures the model's own ops, so the block's models go without
            # hub kernels (the variable is put back as it was when the block ends)
            os.environ[_HUB_KERNELS] = "0"
        yield options.config
    finally:
        if kernels is None:
            os.environ.pop(_HUB_KERNELS, None)
        else:
            os.environ[_HUB_KERNELS] = kernels
        if deferred is not None:
            deferred.__exit__(None, None, None)
        recorder.remove()
        _state.active = False
    roots = recorder.roots()
    if deferred is not None:  # random ops serial ran on meta: as a plain build if the model keeps their tensors
        deferred.settle_if_kept()
    if not roots:
        log.warning("auto_parallelize: no module with parameters was built inside the block; nothing to do.")
    _parallelize_all(roots, options, example_inputs, deferred)


def parallelize_module(model: nn.Module, *, example_inputs: tuple | None = None, **options: Any) -> nn.Module:
    """``auto_parallelize`` for a model built outside a block (whole, with the same values on every rank:
    each rank keeps its pieces at the first call): the same keywords but ``defer_init``. Returns ``model``,
    now parallel (Lightning Fabric's ``setup`` of a model built outside ``init_module``)."""
    _parallelize_all([model], _options(**options), example_inputs, None)
    return model


@dataclasses.dataclass(frozen=True)
class _Options:
    given: dict[str, int]
    """The degrees the user gave (``plan="auto"`` keeps them); "chunks": the stages per pipeline rank of the
    schedule the user gave."""
    config: ParallelConfig | None
    """None with ``plan="auto"``: chosen later."""
    memory: MemoryConfig
    pipe: PipelineConfig
    inputs: InputConfig
    compile: CompileConfig = CompileConfig()
    open: bool = False
    """No degree and no plan given: data parallel where the model's training state fits half a device
    (``too_big_for_data_parallel``), else ``plan="auto"``."""


def _options(*, tensor: Sequence[int] | None = None, data: int | None = None, pipeline: int | None = None,
             microbatches: int | None = None, schedule: str | None = None, chunks: int | None = None,
             checkpoint: str | int = "auto", precision: str = "fp32", reduce_dtype: str = "fp32", batch: str = "auto",
             eval_timeout: float = 30.0, batch_dims: dict[int | str, int | None] | None = None,
             check_inputs: bool = True, plan: str | None = None, compile: bool | str = "auto",
             shard_optimizer: bool = False, sequence_parallel: bool = False, expert_parallel: bool | str = False,
             context: int = 1) -> _Options:
    """``auto_parallelize``'s keywords, checked (before any model is built)."""
    if not dist.is_available() or not dist.is_initialized():
        raise NotInitializedError(
            "auto_parallelize needs torch.distributed: launch with torchrun (or call "
            "torch.distributed.init_process_group()) before entering it.")
    if plan not in (None, "auto"):
        raise ConfigError(f"plan={plan!r} is not an option: pass plan='auto' to choose the grid, or leave it out.")
    given = {k: v for k, v in (("data", data), ("pipeline", pipeline)) if v is not None}
    if tensor is not None:
        given.update(zip(("row", "col", "depth"), tuple(tensor)))
    config = None if plan == "auto" else ParallelConfig.from_user(
        tensor=(1, 1, 1) if tensor is None else tensor, data=data, world_size=dist.get_world_size(),
        pipeline=1 if pipeline is None else pipeline, shard_optimizer=shard_optimizer,
        sequence_parallel=sequence_parallel, expert_parallel=expert_parallel, context=context)
    if plan == "auto" and context != 1:  # (the search keeps it, as the other degrees given)
        given["context"] = context
    pipe = PipelineConfig(microbatches, schedule or "1f1b", chunks)
    if schedule is not None or chunks is not None:  # the search keeps the user's schedule's stages per rank
        given["chunks"] = pipe.stages_per_rank
    if config is not None and config.pipeline > 1:
        pipe.num_microbatches(config.pipeline)  # validates microbatches against the schedule
    return _Options(given, config, MemoryConfig(checkpoint, precision, reduce_dtype, shard_optimizer, sequence_parallel,
                                                 expert_parallel), pipe,
                    InputConfig(batch, eval_timeout, batch_dims, check_inputs), CompileConfig(compile),
                    open=plan is None and tensor is None and data is None and pipeline is None and not expert_parallel
                    and context == 1)


def _parallelize_all(roots: list[nn.Module], options: _Options, example_inputs: tuple | None,
                     deferred: Deferred | None) -> None:
    """Makes ``roots`` parallel under ``options``: its grid, or (``plan="auto"``, or no degrees given for a
    model too big for data parallelism) the grid chosen now for ``example_inputs``, or a provisional one
    until each model's first call chooses."""
    searched = too_big_for_data_parallel(roots, options.memory, example_inputs is None) if options.open else []
    plans = []
    for model in roots:
        big = any(model is m for m in searched)
        config, pipe = None if big else options.config, options.pipe
        later = config is None and example_inputs is None
        if later:  # a provisional grid until each model's first call chooses one
            config = ParallelConfig.from_user(tensor=(1, 1, 1), data=None, world_size=dist.get_world_size(),
                                              shard_optimizer=options.memory.shard_optimizer,
                                              sequence_parallel=options.memory.sequence_parallel)
        elif config is None:  # (plan="auto" chooses one grid for one model: several raise)
            config, pipe = choose_grid_now([model] if big else roots, example_inputs, options.given, options.memory, pipe,
                                           options.compile)
        plans.append((model, config, pipe, later))
    # a torch.device("meta") around the block is the model's, not autopar's
    with torch.device("cpu") if torch.get_default_device().type == "meta" else nullcontext():
        for model, config, pipe, later in plans:
            parallelize(model, config, example_inputs=example_inputs, memory=options.memory, pipe=pipe,
                        inputs=options.inputs, deferred=deferred, choose=options.given if later else None,
                        compile=options.compile)


def parallelize(model: nn.Module, config: ParallelConfig, *, example_inputs: tuple | None = None,
                memory: MemoryConfig | None = None, pipe: PipelineConfig | None = None,
                inputs: InputConfig | None = None, deferred: Deferred | None = None,
                choose: dict[str, int] | None = None, compile: CompileConfig | None = None) -> nn.Module:
    """Makes ``model`` parallel in place under ``config`` (what auto_parallelize does at its end).

    ``choose``: ``config`` is provisional, the grid is chosen at the model's first call with these degrees the
    user gave (``autopar.grid_choice.at_first_call``).
    ``deferred``: the block's recorded construction (autopar/runtime/construction/record.py). Grids that split
    parameters build them at the first call (each rank its pieces); data parallelism alone builds them
    here, whole, as serial's construction would have.
    """
    if model in runtimes:
        raise ContextError(f"{type(model).__name__} is already parallelized.")
    meta = deferred.unrecorded(model) if deferred is not None else \
        [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if meta:
        raise ContextError(
            f"{type(model).__name__} was built on the meta device outside auto_parallelize: {len(meta)} parameters "
            f"and buffers ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}) have no values, and loading "
            "into them would do nothing. Build it inside the auto_parallelize block (on meta too: "
            "`with torch.device('meta')` there is recorded and replayed, each rank building only its shards).")
    mesh = Mesh(config)
    sinks = deferred.sinks(model) if deferred is not None else {}
    if sinks:
        _agree_on_construction(deferred, mesh)
        if splits_parameters(config) or choose is not None:
            make_pending(model, deferred, sinks)
        else:
            materialize_whole(model, deferred, sinks)
            sinks = {}
    _agree_on_parameters(model, mesh)
    runtime = ParallelRuntime(model, config, mesh, memory or MemoryConfig(), pipe or PipelineConfig(),
                              inputs or InputConfig(), (deferred, sinks) if sinks else None,
                              # any grid may shard the parameters the optimizer will hold: DTensors already
                              dtensors=True if choose is not None else None, compile=compile or CompileConfig(),
                              open_degrees=choose)
    runtimes[model] = runtime
    original = model.forward
    ref = weakref.ref(model)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return at_first_call(runtimes[ref()], args, kwargs, train_step=False)(*args, **kwargs)

    functools.update_wrapper(forward, original)  # inspect.signature(model.forward) stays the user's
    # A script's own torch.compile(model) (nanoGPT's train.py) would have dynamo trace autopar's runtime on every
    # call (5-6x slower steps, measured): it runs as it is, and compiles the per-rank program itself (compile=)
    forward = torch.compiler.disable(forward, recursive=True)
    installed = patches.of_model(model)
    installed.set_attribute("forward", forward)  # instance attribute: nn.Module.__call__ dispatches to it
    if not hasattr(model, "no_sync"):  # DDP's spelling, so a DDP script's accumulation loop runs unchanged
        installed.set_attribute("no_sync", functools.partial(no_sync, model))
    if example_inputs is not None:  # compiles and shards; the output is discarded; the batch mode stays open
        runtime.run(tuple(example_inputs), {}, example=True)
    return model


def _agree_on_parameters(model: nn.Module, mesh: Mesh) -> None:
    """Makes every rank hold rank 0's initial parameters and buffers (as DDP does).

    The usual case, every rank seeded alike, costs one small all-gather of fingerprints.
    """
    tensors = [t for t in list(model.parameters()) + list(model.buffers())
               if t.is_floating_point() and not isinstance(t, Pending)]
    if not tensors or mesh.config.world_size == 1:
        return
    with torch.no_grad():
        maps = FileMaps()
        fingerprints = torch.stack([_fingerprint(t, maps) for t in tensors]).flatten()
        release_freed_memory()
        if _ranks_agree(fingerprints, mesh, "initial parameters differ across ranks"):
            return
        for t in tensors:
            C.broadcast(t.data, 0, None, mesh.config.world_size)


def _ranks_agree(fingerprint: torch.Tensor, mesh: Mesh, what: str) -> bool:
    """Whether every rank has this fingerprint (one all-gather); if not, one warning: rank 0's wins. A
    simulated world's ranks all built what this one did."""
    if mesh.simulated:
        return True
    every = C.all_gather(fingerprint.to(mesh.device).unsqueeze(0), None, mesh.config.world_size)
    if torch.equal(every.amin(0), every.amax(0)):
        return True
    if mesh.rank == 0:
        log.warning("auto_parallelize: %s (no common seed?); using rank 0's.", what)
    return False


def _fingerprint(t: torch.Tensor, maps: FileMaps, chunk: int = 1 << 16) -> torch.Tensor:
    """(0, 0, sum, sum of squares) of ``t`` in float64, a chunk at a time: no full-size temporaries (small
    chunks: glibc kept 8 MiB ones resident, +600 MiB per rank over GPT-2's 774 MiB). A tensor that is
    a memory-mapped checkpoint's unwritten pages: where it lies in the file and a sample of its values,
    read without touching the rest (autopar/runtime/construction/memory_mapped.py)."""
    where = maps.region(t)
    if where is not None:
        return file_fingerprint(t, where).to(t.device)
    flat = t.detach().reshape(-1)
    out = torch.zeros(4, dtype=torch.float64, device=t.device)
    for piece in flat.split(chunk):
        piece = piece.double()
        out[2] += piece.sum()
        out[3] += piece.square().sum()
    return out


def _agree_on_construction(deferred: Deferred, mesh: Mesh) -> None:
    """Ranks whose recorded random streams differ (no common seed) all replay rank 0's, as DDP makes every
    rank start from rank 0's parameters. Checkpoint tensors whose conversion was recorded (not read yet)
    must be the same on every rank: their values are not here to broadcast."""
    if mesh.config.world_size == 1:
        return
    sources = deferred.mapped_sources()
    if sources:
        maps = FileMaps()
        mine = torch.stack([_fingerprint(t, maps) for t in sources]).flatten()
        every = C.all_gather(mine.to(mesh.device).unsqueeze(0), None, mesh.config.world_size).cpu()
        differ = [r for r in range(mesh.config.world_size) if not torch.equal(every[r], every[0])]
        if differ:
            first = int((every[differ[0]] != every[0]).nonzero()[0]) // 4
            where = maps.region(sources[first])
            raise AgreementError(
                f"ranks {differ} loaded other values than rank 0 from a memory-mapped checkpoint (first in "
                f"{where[0] if where else 'a tensor written since it was loaded'}, a {tuple(sources[first].shape)} "
                "tensor): each rank read its own copy, and they "
                "differ. Load the same checkpoint on every rank (or load it in its saved dtype: autopar then "
                "compares the values and broadcasts rank 0's).")
    if _ranks_agree(deferred.fingerprint(), mesh, "the ranks built the model from different random states"):
        return
    box = [[op.rng[1] if op.rng else None for op in deferred.ops]]
    C.broadcast_objects(box, 0, mesh.control)
    for op, state in zip(deferred.ops, box[0]):
        if op.rng is not None and state is not None:
            op.rng = (op.rng[0], state)
