"""Builds the ``Executable`` of one input signature of a parallel model on this rank (a builder, not a compiler:
"compile" is torch.compile's word, ``autopar.runtime.compiled``).

``Builder.build`` goes the whole way, in three steps:

- ``Builder.capture_call``: the model's meta shadow captured for this rank's rows of the batch, with
  symbolic sizes where asked and possible, and the numbers the model computes from the batch size;
- at the model's first capture, its plan (``autopar.planning.planner.decide_plan``, the same on every rank),
  adopted: the parameters cut to this rank's pieces (``ParamStore.adopt``) and their gradient syncs grouped
  (``GradSyncs.group``);
- ``Builder.executable``: the passes run under the plan, the marker ops bound to this rank's process
  groups, the model's tensor constants, and under a pipeline this rank's stages.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopar.capture import Captured, capture_shard
from autopar.compat import pytree
from autopar.config import CompileConfig, MemoryConfig, ParallelConfig, PipelineConfig
from autopar.decisions import Plan
from autopar.errors import CaptureError, PlanError
from autopar.hf_caches import state_outputs
from autopar.memory import device_budget, half_dtype
from autopar.planning.machines import local_rates
from autopar.planning.planner import PlanOptions, decide_plan
from autopar.runtime.comm import collectives as C
from autopar.runtime.data_parallel.grad_syncs import GradSyncs
from autopar.runtime.execution.binding import bind_markers, gather_spec, reading_params_at_use, travels
from autopar.runtime.compiled.form import in_pieces
from autopar.runtime.compiled.policy import CompilePolicy
from autopar.runtime.ops.depth_buckets import bucket_depth_gathers
from autopar.runtime.execution.graph_cache import Executable
from autopar.runtime.execution.kept_state import KeptOutputs, OutputTree
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.rows import BatchRows
from autopar.runtime.params.store import ParamStore
from autopar.runtime.pipeline.stages import Program
from passes.analysis.batch_dims import analyze_batch, batch_constants, whole_constants
from passes.analysis.graph_facts import sizes_fixed
from passes.insert_checkpoints import insert_checkpoints
from passes.ir import InputKind, input_info, record_graph_info
from passes.runner import run_passes
from passes.shard_linears import shard_linears
from passes.split_batch import split_batch
from passes.split_context import split_context
from passes.split_experts import split_experts
from passes.split_stages import split_stages

log = logging.getLogger(__name__)

PASSES = (split_batch, shard_linears, split_experts, split_context, insert_checkpoints)
#: With pipeline > 1 the stages are cut (from the graph of this rank's tokens under context parallelism: a stage
#: sends and receives them), then checkpoints go inside each stage.
PIPELINE_PASSES = (split_batch, shard_linears, split_experts, split_context, split_stages, insert_checkpoints)


class Builder:
    """Captures the graphs of one parallel model on this rank and builds their executables."""

    def __init__(self, model: nn.Module, shadow: nn.Module, store: ParamStore, syncs: GradSyncs, mesh: Mesh,
                 config: ParallelConfig, memory: MemoryConfig, pipe: PipelineConfig,
                 finish_grads: Callable[[], None], warn_once: Callable[[str], None],
                 compile: CompileConfig = CompileConfig(False)) -> None:
        """``syncs``: the model's gradient syncs, grouped at its first plan (a compiled training graph is cut in
        pieces by the bytes they sum, ``autopar.runtime.compiled.pieces``); ``finish_grads``: what a pipeline's
        backward ends with (the runtime's); ``warn_once``: one warning line per distinct message, on rank 0;
        ``compile``: which bound graphs run under torch.compile (``autopar.runtime.compiled.graph``)."""
        self._model = weakref.ref(model)
        self.shadow, self.store, self.syncs, self.mesh, self.config = shadow, store, syncs, mesh, config
        self.memory, self.pipe = memory, pipe
        self.finish_grads, self.warn_once = finish_grads, warn_once
        self.compiling = CompilePolicy(compile, mesh, warn_once, type(model).__name__)
        """Every question about ``compile=`` (the only reader of it here)."""

    def build(self, leaves: list[Any], spec: pytree.TreeSpec, split: dict[int, int], sizes: tuple[int, ...],
              local_outputs: bool = False, per_rank: tuple[tuple[int, ...], int] | None = None,
              dynamic: dict[int, dict[int, Any]] | None = None, arrived: dict[int, Any] | None = None) -> Executable:
        """This call's executable, planned at the model's first capture. ``per_rank``: (each member's rows, this
        rank's member index) under per-rank batches. ``dynamic``: input dims captured as symbolic sizes
        (``symbolic_dims``); if that capture fails, or the graph computes numbers from the batch, these sizes
        are captured as they are."""
        index = self.mesh.index("batch") if split else 0
        segments = per_rank[0] if per_rank is not None and split else ()
        captured = self.capture_call(leaves, spec, split, sizes, index, segments, dynamic, arrived)
        if self.store.plan is None:
            # Every rank plans from the capture of batch shard 0, so the plan is the same everywhere;
            # with per-rank batches the ranks' shapes may differ: rank 0's plan is everyone's.
            plan = None
            if per_rank is None or self.mesh.rank == 0:
                canonical = captured if index == 0 else self.capture(
                    leaves, spec, split, sizes, 0, segments, dynamic if captured.accepts is not None else None)
                plan = decide_plan(canonical.gm, self.config, self.plan_options())
                if not plan.memory.fits and self.mesh.rank == 0:
                    log.warning("autopar: %s", plan.memory.summary().replace("\n", "; "))
            if per_rank is not None:
                box = [plan]
                C.broadcast_objects(box, 0, self.mesh.control)
                plan = box[0]
            self.adopt(plan)
        return self.executable(captured, self.store.plan, split, sizes, local_outputs, per_rank)

    def plan_options(self) -> PlanOptions:
        """What this model's plan depends on beyond the grid: the user's memory and pipeline options, this
        device's memory shared by the ranks on it, and its rates (the pipeline's stages are cut for them)."""
        checkpoint = self.memory.checkpoint
        budget = None if isinstance(checkpoint, int) else device_budget(self.mesh.device, self.config.world_size)
        microbatches = self.pipe.num_microbatches(self.config.pipeline) if self.config.pipeline > 1 else 1
        return PlanOptions(checkpoint, budget, self.memory.precision, microbatches,
                           self.pipe.stages_per_rank, self.pipe.schedule, strict=True,
                           compiled=self.compiling.training,
                           hardware=local_rates(self.config, self.mesh.device) if self.config.pipeline > 1 else None,
                           device=self.mesh.device.type)

    def adopt(self, plan: Plan) -> None:
        """Makes ``plan`` the model's plan: its parameters cut to this rank's pieces in place, and their
        gradient syncs grouped (``GradSyncs.group``)."""
        self.store.adopt(plan)
        self.syncs.group(plan, self.store.params, self.mesh, self.config, half_dtype(self.memory.reduce_dtype),
                         self.store.data_shards)
        if self.mesh.rank == 0:
            log.info("%s", plan.summary())
            if self.config.row * self.config.col > 1:
                for note in plan.notes:  # one line per region that is not tensor-parallel
                    self.warn_once(note)  # (the batch notes again at the graph's passes: said once)

    def capture(self, leaves: list[Any], spec: pytree.TreeSpec, split: dict[int, int], sizes: tuple[int, ...],
                index: int, segments: tuple[int, ...] = (), dynamic: dict[int, dict[int, Any]] | None = None,
                arrived: dict[int, Any] | None = None) -> Captured:
        """The shadow captured for batch shard ``index``'s rows (as the model is now: training or not)."""
        self.shadow.train(self._model().training)
        requires_grad = {name: p.requires_grad for name, p in self.store.params.items()}
        captured = capture_shard(self.shadow, leaves, spec, split, sizes, index, requires_grad=requires_grad,
                                 segments=segments, device=self.mesh.device, dynamic=dynamic, arrived=arrived)
        if not torch.is_grad_enabled() and self.config.pipeline == 1:  # a cache comes back split (kept.py)
            record_graph_info(captured.gm, kept_outputs=state_outputs(captured.out_spec))
        return captured

    def capture_call(self, leaves: list[Any], spec: pytree.TreeSpec, split: dict[int, int], sizes: tuple[int, ...],
                     index: int, segments: tuple[int, ...], dynamic: dict[int, dict[int, Any]] | None,
                     arrived: dict[int, Any] | None) -> Captured:
        """This call's capture: with ``dynamic``'s symbolic sizes where that capture works and the graph
        computes nothing from the batch size, else with these sizes; then the numbers computed from the batch
        size (``find_batch_constants``)."""
        captured = None
        if dynamic:
            try:
                captured = self.capture(leaves, spec, split, sizes, index, segments, dynamic, arrived)
                # the graph computes numbers from the batch, or the batch analysis fixed a length (entries
                # per row of per-token values): these sizes are captured as they are
                if split and (whole_constants(captured.gm, analyze_batch(captured.gm)) or sizes_fixed(captured.gm)):
                    captured = None
            except CaptureError as e:
                log.debug("autopar: capture with symbolic sequence sizes failed (%s); capturing these sizes", e)
        if captured is None:
            captured = self.capture(leaves, spec, split, sizes, index, segments, arrived=arrived)
        if split:
            self.find_batch_constants(captured, leaves, spec, split, sizes, index, segments)
        return captured

    def find_batch_constants(self, captured: Captured, leaves: list[Any], spec: pytree.TreeSpec,
                             split: dict[int, int], sizes: tuple[int, ...], index: int,
                             segments: tuple[int, ...] = ()) -> None:
        """Numbers computed from the batch size where the model works on the whole batch (``loss.sum() /
        x.size(0)``): the capture saw this rank's rows; a second capture with twice as many tells which
        numbers scale with them, and ``passes.split_batch`` gives them the whole batch's value."""
        facts = analyze_batch(captured.gm)
        if not whole_constants(captured.gm, facts):
            return
        name = type(self._model()).__name__
        if segments:
            raise PlanError(f"{name} computes with numbers after a reduction over the batch "
                            "inside forward (e.g. loss.sum() / x.size(0)); under per-rank batches the ranks that split "
                            "the model pool their rows, and each one's number would be its own batch's. Compute the "
                            "loss outside the model, or use a grid whose tensor and pipeline degrees are 1.")
        doubled = tuple(2 * s if i == index else s for i, s in enumerate(sizes))
        try:
            other = captured.twice or self.capture(leaves, spec, split, doubled, index).gm
        except CaptureError as e:
            raise PlanError(f"{name} uses numbers after a reduction over the batch inside "
                            "forward; autopar captures it with twice this rank's rows to tell which of them are the "
                            f"batch size, and that capture failed ({e}). Compute the loss outside the model, or use "
                            "data=1 and depth=1.") from e
        record_graph_info(captured.gm, batch_constants=batch_constants(
            captured.gm, other, facts, sizes[index], doubled[index]))

    def executable(self, captured: Captured, plan: Plan, split: dict[int, int], sizes: tuple[int, ...],
                   local_outputs: bool, per_rank: tuple[tuple[int, ...], int] | None) -> Executable:
        """``captured`` compiled under ``plan`` for this rank. ``per_rank``: (each member's rows, this rank's
        member index) under per-rank batches."""
        pipelined = self.config.pipeline > 1
        agreement = self.compiling.agreement(per_rank is not None)
        gm, records = run_passes(captured.gm, plan, PIPELINE_PASSES if pipelined else PASSES)
        for note in (n for r in records if r.name in ("split_batch", "split_context") for n in r.notes):
            self.warn_once(note)
        output_specs = [gather_spec(gm, a) for a in gm.graph.output_node().args[0]]
        rows = BatchRows(sizes)
        bind_markers(gm, self.mesh, rows, half_dtype(self.memory.reduce_dtype), self.config.pipeline,
                     local_outputs, per_rank)
        if not self.compiling.training:
            bucket_depth_gathers(gm, self.mesh)  # one all-gather per block's weights each way (eager only)
        inputs = tuple((input_info(n).kind, input_info(n).target) for n in gm.graph.nodes if n.op == "placeholder")
        constants = {}
        for name, value in captured.constants.items():
            real = self._real_constant(name)  # a tensor attribute of the model: its current value
            value = real if real is not None else value
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                raise CaptureError(f"the model creates tensor constant {name!r} from a meta value during "
                                   "capture; autopar cannot recover its data. Register it as a buffer.")
            constants[name] = value.to(self.mesh.device) if isinstance(value, torch.Tensor) else value
        program = None
        if pipelined:
            program = Program(gm, lambda n: travels(n, split), self.mesh, half_dtype(self.memory.precision),
                              self.finish_grads, symbolic=captured.accepts is not None,
                              wrap=None if captured.accepts is not None else
                              lambda stage, name: self.compiling.stage(stage, name, agreement))
            if self.store.held is None:
                self.store.hold(program.readers())
        # a graph captured with symbolic sizes serves many (a decode step per length): it runs eagerly, since
        # a compiled graph of static sizes would compile again for each
        run = gm if captured.accepts is not None else \
            self.compiling.graph(gm, "the per-rank graph", agreement=agreement, synced=None if pipelined else
                       self.syncs.synced_bytes(plan, self.store.params, self.config))
        graphs = None if pipelined else self.compiling.call_graphs(gm, inputs, run, agreement)
        kept = KeptOutputs(output_specs, self.mesh) if not (pipelined or local_outputs or per_rank) else None
        eager = run is gm and graphs is None and program is None
        return Executable(gm, inputs, captured.out_spec, constants, records, output_specs, program, split,
                          captured.accepts, rows, reading_params_at_use(gm) if eager else run, graphs, kept or None,
                          OutputTree(captured.out_spec) if kept else None,
                          reads_params=eager or in_pieces(run))

    def _real_constant(self, name: str) -> Any:
        """A plain tensor attribute (not a buffer) of the real model, e.g. HF's ``embed_scale``."""
        obj: Any = self._model()
        for part in name.split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None
