"""One path from a captured graph, a grid and the user's options to a ``Plan``.

Whoever asks (the runtime at a model's first call, ``python -m autopar.trace``, ``python -m autopar.plan``'s
search and ``plan="auto"``) plans here, in the same steps:

1. the batch split: which inputs hold the batch and each batch shard's rows (``batch_split``; a global batch,
   per-rank batches pooled by the ranks that split the model, or a pipeline's micro-batch);
2. the sharding of every matmul (``make_plan``);
3. with a pipeline, the stages cut by predicted cost (``choose_pipeline``);
4. the memory plan: which blocks recompute under the device's budget (``choose_memory``).

``decide_plan`` runs 2-4 on one graph (the runtime's); ``plan_model`` captures a model on meta first, with a
shortcut for repeated blocks, and also reports one rank's predicted step (the CLIs' and the search's).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import fx, nn

from autopar.compat import pytree
from autopar.capture import (batch_leaves, capture_shard, input_names, meta_shadow, microbatch_leaves,
                             repeated_blocks, split_batch_leaves, truncated_blocks, without_stack_traces)
from autopar.config import MemoryConfig, ParallelConfig
from autopar.decisions import MemoryPlan, PipelinePlan, Plan
from autopar.errors import ConfigError, PlanError
from autopar.planning.machines import local_rates
from autopar.memory import device_budget, half_dtype
from passes.analysis.choose_checkpoints import pipeline_memory, plan_memory, stage_memory
from passes.analysis.choose_stages import ChainSegment, Hardware, pipeline_chain, plan_pipeline
from passes.analysis.estimate_costs import Collective, loss_collectives
from passes.analysis.estimate_memory import MemoryProfile, block_of, compiled_recompute, estimate_memory
from passes.analysis.graph_facts import ATTENTION_STEP_FACTOR, graph_copy, hinted
from passes.analysis.make_plan import layouts_for, make_plan
from passes.analysis.pipeline_comm import pipeline_collectives, pipeline_flops
from passes.analysis.repeat_blocks import (Repeat, repeat_chain, repeat_memory, repeat_plan, repeat_report,
                                          template_holds)
from passes.analysis.report import StepReport, estimate_step, summarize
from passes.ir import BatchInfo, record_graph_info
from passes.split_context import whole_reads

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The user's options a plan depends on beyond the grid (``auto_parallelize``'s keywords)."""

    checkpoint: str | int = "auto"
    """"auto", "none", "full" or a budget in bytes per device."""
    budget: int | None = None
    """Bytes per device for ``checkpoint="auto"`` (the device's memory shared by its ranks)."""
    precision: str = "fp32"
    """Compute dtype: activations are counted in it."""
    microbatches: int = 1
    """Micro-batches per step (pipeline > 1)."""
    chunks: int = 1
    """Stages per pipeline rank (interleaved schedules)."""
    schedule: str | None = None
    """The pipeline schedule's name, recorded in the plan."""
    strict: bool = False
    """Raise when a byte budget cannot be met even recomputing every block (the runtime's; the CLIs show
    the plan that does not fit)."""
    compiled: bool = False
    """Training runs under ``compile=True``: each compiled piece of backward returns its gradients at once
    (``estimate_memory.compiled_recompute``); a recomputed block keeps its inputs only, as eagerly."""
    hardware: Hardware | None = None
    """The rates pipeline stages are cut with; None: this machine's (``autopar.planning.machines.local_rates``), as the
    runtime here would cut them."""
    device: str = "cpu"
    """The device type training runs on: which attention kernel the memory plan counts (``estimate_memory``)."""

    @property
    def dtype(self) -> torch.dtype | None:
        return half_dtype(MemoryConfig(self.checkpoint, self.precision).precision)

    @property
    def bytes_per_device(self) -> int | None:
        return self.checkpoint if isinstance(self.checkpoint, int) else self.budget


def pooled_rows(split: dict[int, int], rows: tuple[int, ...], config: ParallelConfig
                ) -> tuple[dict[int, int], tuple[int, ...], tuple[int, ...]]:
    """Per-rank batches (``batch="per-rank"``): the ranks holding one batch shard (pipeline x row x col of
    them, ``rows`` each) pool their rows, and each batch shard is that many rows. Returns (split, each shard's
    rows, each member's rows); alone with its rows a rank splits nothing."""
    if len(rows) > 1 and split:
        return split, (sum(rows),) * config.num_batch_shards, rows
    return {}, (), ()


def choose_pipeline(gm: fx.GraphModule, plan: Plan, options: PlanOptions,
                    collectives: tuple[Collective, ...] | None = None) -> tuple[PipelinePlan, tuple[ChainSegment, ...]]:
    """The stages of a pipeline of ``plan.config.pipeline`` ranks over ``gm`` (one micro-batch's graph), and
    the chain of blocks they were cut from."""
    if collectives is None:
        collectives = estimate_step(gm, plan).collectives
    chain = pipeline_chain(gm, plan, collectives)
    return stages_of_chain(chain, plan.config, options), chain


def stages_of_chain(chain: tuple[ChainSegment, ...], config: ParallelConfig, options: PlanOptions) -> PipelinePlan:
    """Cuts ``chain`` into ``config.pipeline`` x ``options.chunks`` stages by predicted cost."""
    num_stages = config.pipeline * options.chunks
    if len(chain) < num_stages:
        raise PlanError(f"the model has {len(chain)} blocks to cut into pipeline stages, fewer than "
                        f"pipeline={config.pipeline} x {options.chunks} stages per rank = {num_stages}. "
                        "Lower pipeline= (or chunks=).")
    hardware = options.hardware or local_rates(config)
    planned = plan_pipeline(chain, config.pipeline, options.microbatches, options.chunks, hardware)
    return planned if options.schedule is None else dataclasses.replace(planned, schedule=options.schedule)


def choose_memory(profile: MemoryProfile, plan: Plan, options: PlanOptions) -> MemoryPlan:
    """Which blocks recompute their activations so that a rank fits ``options``' budget."""
    budget = options.bytes_per_device
    if options.compiled:
        profile = compiled_recompute(profile)
    if plan.pipeline is not None:
        memory = pipeline_memory(profile, plan, options.microbatches, options.checkpoint, budget)
        if options.strict and isinstance(options.checkpoint, int) and not memory.fits:
            raise PlanError(f"checkpoint={options.checkpoint:,} bytes per device: a pipeline rank does not fit even "
                            f"recomputing every block of its stages ({memory.summary().splitlines()[0]}). "
                            "Raise the budget, or use more pipeline or tensor ranks.")
        return dataclasses.replace(memory, compiled=options.compiled)
    strict = options.strict and isinstance(options.checkpoint, int)
    return dataclasses.replace(plan_memory(profile, options.checkpoint, budget, strict=strict),
                               compiled=options.compiled)


def _sharding(gm: fx.GraphModule, config: ParallelConfig, shared: dict[Any, Any] | None = None) -> Plan:
    """Step 2: every matmul's sharding (``make_plan``) and, under context parallelism, what reads the whole
    sequence (``passes.split_context.whole_reads``: said in the notes, priced and kept whole)."""
    plan = make_plan(gm, config, shared=shared)
    if config.context > 1:
        notes, whole = whole_reads(gm, config.context)
        plan = dataclasses.replace(plan, notes=plan.notes + notes, context_whole=whole)
    return plan


def decide_plan(gm: fx.GraphModule, config: ParallelConfig, options: PlanOptions) -> Plan:
    """The whole plan for a captured graph (one batch shard's; one micro-batch's under a pipeline): sharding,
    then the pipeline's stages, then the memory plan (each rank recomputes for its own stages' memory)."""
    with hinted(gm):  # plans and estimates see the capture's example sizes
        plan = _sharding(gm, config)
        if config.pipeline > 1:
            plan = dataclasses.replace(plan, pipeline=choose_pipeline(gm, plan, options)[0])
        return dataclasses.replace(plan, memory=choose_memory(estimate_memory(gm, plan, options.dtype,
                                                                              device=options.device), plan, options))


SLOWEST = -1
"""``plan_model(rank=SLOWEST)``: under a pipeline, the rank whose stages compute the most matmul FLOPs
(batch and tensor coordinates 0); else rank 0."""


def plan_model(model: nn.Module, inputs: tuple, config: ParallelConfig, *, rank: int = 0,
               kwargs: dict | None = None, repeat: bool = True, checkpoint: str | int = "auto",
               budget: int | None = None, precision: str = "fp32", pipeline: int = 1,
               microbatches: int = 1, chunks: int = 1, per_rank: bool = False,
               batch_dims: dict[int | str, int | None] | None = None,
               captures: dict[Any, Any] | None = None, hardware: Hardware | None = None,
               compiled: bool = False, device: str = "cpu") -> tuple[Plan, StepReport]:
    """The Plan every rank would run under, and ``rank``'s step report, for one global batch (or, with
    ``per_rank``, for ``inputs`` as every rank's own batch, DDP-style: ``auto_parallelize(batch="per-rank")``,
    every rank with as many rows). ``batch_dims`` is auto_parallelize's.

    ``pipeline`` > 1 adds the stages a pipeline of that many ranks would use, for ``microbatches``
    micro-batches of this batch (as ``auto_parallelize(pipeline=...)`` places them). Like the runtime, it
    then plans from one micro-batch: the table shows a micro-batch's shapes (FLOPs are still the whole
    step's), and the bytes are what ``rank`` sends in one ``train_step`` with cross-entropy
    (passes/analysis/pipeline_comm.py): its stages, sends, gradient sync and loss. ``checkpoint`` is
    auto_parallelize's option; ``budget`` (bytes per device) replaces the device's
    memory for "auto" (default: this machine's memory shared by the ranks, as on CPU).

    With ``repeat``, a ModuleList of alike blocks (a transformer's layers) is captured with three of
    them and the plan extended to the rest by name (passes/analysis/repeat_blocks.py): Llama-2-70B
    plans in seconds instead of exporting 80 layers. If the cut model does not capture, or its two
    last blocks are not planned alike, the whole model is captured instead.

    ``captures``: a dict kept between calls for the same model and inputs (the plan search's): a capture
    depends only on the rows each batch shard gets, so grids alike in that share it. ``hardware``: the rates
    the pipeline's stages are cut with (default: this machine's, as the runtime here cuts them). ``compiled``:
    training runs compiled (``auto_parallelize(compile=...)`` on the device it runs on, e.g. "auto" on CUDA): the
    memory plan counts what a compiled step holds (``estimate_memory.compiled_recompute``). ``device``: the device
    type training runs on, for the attention kernel the memory plan counts (``estimate_memory``).
    """
    slowest = rank == SLOWEST
    rank = 0 if slowest else rank
    pipeline = max(pipeline, config.pipeline)
    if per_rank and pipeline > 1:
        raise ConfigError("the trace models a pipeline's train_step, which takes one global batch; per_rank "
                          "needs pipeline=1.")
    if config.pipeline != pipeline:  # the plan's config says where each rank sits, pipeline included
        config = dataclasses.replace(config, pipeline=pipeline)
    dtype = half_dtype(MemoryConfig(checkpoint, precision).precision)
    if isinstance(checkpoint, int):
        budget = checkpoint
    elif budget is None:
        budget = device_budget(torch.device("cpu"), config.world_size)
    if captures is not None and "shadow" in captures:  # the search's later grids: the same model
        shadow, lists = captures["shadow"]
    else:
        shadow = model if _is_meta(model) else meta_shadow(model)
        lists = repeated_blocks(shadow)
        if captures is not None:
            captures["shadow"] = shadow, lists
    lists = lists if repeat else []
    micro = microbatches if pipeline > 1 else 0
    found = None
    if lists:
        try:
            with truncated_blocks(shadow, lists):
                found = _plan_captured(shadow, inputs, kwargs, config, rank, dtype, micro, per_rank, batch_dims,
                                       _cache_for(captures, "cut"), device)
        except Exception as e:  # the cut model is only a shortcut: fall back to the exact capture
            log.debug("autopar: capturing %s with its blocks cut failed (%s); capturing all of it",
                      type(shadow).__name__, e)
    if found is not None:
        whole = _repeated(found, lists, pipeline, _cache_for(captures, "cut"))
        if whole is not None:
            return _finish(*whole, checkpoint, budget, pipeline, microbatches, chunks, rank, slowest, hardware,
                           compiled)
    plan, report, profile, chain, loss = _plan_captured(shadow, inputs, kwargs, config, rank, dtype, micro, per_rank,
                                                        batch_dims, _cache_for(captures, "whole"), device)
    return _finish(plan, report, profile, chain, loss, checkpoint, budget, pipeline, microbatches, chunks, rank,
                   slowest, hardware, compiled)


def _repeated(found: tuple, lists: list[tuple[str, int, int]], pipeline: int, captures: dict[Any, Any] | None
              ) -> tuple | None:
    """The plan, report, memory profile, chain and loss collectives of the whole model from ``found``, those of
    the model cut to three blocks; None when its last two blocks are not planned alike. With ``captures`` (the
    search's) kept there by ``found``'s identity: a grid's schedules (1F1B, interleaved) share one plan."""
    key = ("repeated", id(found), pipeline <= 1)
    if captures is not None and key in captures:
        return captures[key][1]
    plan, report, profile, chain, loss = found
    repeats = [Repeat(name, start + 2, count) for name, start, count in lists]
    whole = None
    if all(template_holds(plan, report, r, profile) for r in repeats):
        full = repeat_plan(plan, repeats)
        # (a pipeline's report is summarized again per rank in _finish: only its records are needed here)
        whole = (full, repeat_report(report, full, repeats, totals=pipeline <= 1),
                 repeat_memory(profile, full, repeats), repeat_chain(chain, repeats), loss)
    if captures is not None:
        captures[key] = found, whole  # (found kept alive with it: its id is not reused)
    return whole


def _finish(plan: Plan, report: StepReport, profile: MemoryProfile, chain: tuple[ChainSegment, ...],
            loss: tuple[Collective, ...], checkpoint: str | int, budget: int | None, pipeline: int,
            microbatches: int, chunks: int, rank: int, slowest: bool = False,
            hardware: Hardware | None = None, compiled: bool = False) -> tuple[Plan, StepReport]:
    options = PlanOptions(checkpoint, budget, microbatches=microbatches, chunks=chunks, compiled=compiled,
                          hardware=hardware)
    plan = dataclasses.replace(plan, memory=choose_memory(profile, plan, options))
    report = dataclasses.replace(report, rank_saved_bytes=sum(s.saved_bytes for s in profile.segments),
                                 rank_attention_flops=ATTENTION_STEP_FACTOR * sum(s.attention_flops
                                                                                  for s in profile.segments),
                                 rank_update_bytes=profile.optimizer_bytes // 2,
                                 rank_ops=sum(s.ops for s in profile.segments),
                                 rank_least_kept_bytes=sum(min(s.saved_bytes, s.input_bytes) if s.checkpointable
                                                           else s.saved_bytes for s in profile.segments),
                                 segments=sum(s.name not in ("<shared>", "<loss>") for s in profile.segments))
    if pipeline > 1:  # everything was captured for one micro-batch, as the runtime compiles it
        plan = dataclasses.replace(plan, pipeline=stages_of_chain(chain, plan.config, options))
        plan = dataclasses.replace(plan, memory=choose_memory(profile, plan, options))
        step = [c for c in report.collectives if c.phase == "step"]
        me = plan.config.coords(rank)["pipeline"]
        if slowest:  # the pipeline rank with the most matmul FLOPs (the bottleneck of a step)
            me = max(range(plan.pipeline.ranks), key=lambda r: pipeline_flops(chain, plan, r, microbatches))
        colls = pipeline_collectives(chain, plan, step, loss, me, microbatches)
        mine = plan.pipeline.stages_of(me)
        mine_names = {name for st in mine for name in st.segments}
        mine_segments = [s for s in profile.segments if s.name in mine_names]

        def step_sum(field: str) -> int:  # over this rank's stages, every micro-batch
            return microbatches * sum(getattr(s, field) for s in mine_segments)

        trainable = profile.optimizer_bytes / 2 / profile.param_bytes if profile.param_bytes else 1.0
        # the ops left whole that this rank computes: its stages' blocks' (one outside every block: counted on
        # every rank, an upper bound)
        blocks = {name for st in plan.pipeline.stages for name in st.segments}
        whole = tuple(r for r in report.whole if (blk := block_of(r.module)) in mine_names or blk not in blocks)
        report = dataclasses.replace(
            summarize(report.layers, colls, report.num_parameters, plan, flops_scale=microbatches, whole=whole),
            rank_flops=pipeline_flops(chain, plan, me, microbatches),
            rank_saved_bytes=step_sum("saved_bytes"), rank_ops=step_sum("ops"),
            rank_attention_flops=ATTENTION_STEP_FACTOR * step_sum("attention_flops"),
            rank_update_bytes=int(sum(st.param_bytes for st in mine) * trainable), segments=report.segments,
            largest_param_bytes=report.largest_param_bytes,
            rank_memory=stage_memory(profile, plan, mine, me, microbatches, checkpoint, budget))
    return plan, report


def _cache_for(captures: dict[Any, Any] | None, which: str) -> dict[Any, Any] | None:
    """The part of ``captures`` for the model cut to three blocks ("cut") or whole."""
    return None if captures is None else captures.setdefault(which, {})


def _plan_captured(shadow: nn.Module, inputs: tuple, kwargs: dict | None, config: ParallelConfig,
                   rank: int, dtype: torch.dtype | None = None, microbatches: int = 0, per_rank: bool = False,
                   batch_dims: dict[int | str, int | None] | None = None, captures: dict[Any, Any] | None = None,
                   device: str = "cpu"
                   ) -> tuple[Plan, StepReport, MemoryProfile, tuple[ChainSegment, ...], tuple[Collective, ...]]:
    """Captures and plans; with ``microbatches`` (pipelines) one micro-batch of this batch, as the
    runtime does, and also the pipeline chain and the loss's collectives. With ``captures`` the result
    is kept there too (the search's screen plans the data-parallel grid it then scores)."""
    memo = ("planned", config, rank, dtype, microbatches, per_rank, tuple(sorted((batch_dims or {}).items(), key=str)),
            device)
    if captures is not None and memo in captures:
        return captures[memo]
    leaves, spec = pytree.tree_flatten((tuple(inputs), dict(kwargs or {})))
    names = input_names(tuple(inputs), dict(kwargs or {}))
    segments: tuple[int, ...] = ()
    if per_rank:  # every rank as many rows as these inputs hold
        split, rows = batch_leaves(leaves, names, batch_dims)
        split, sizes, segments = pooled_rows(split, (rows,) * (config.pipeline * config.row * config.col), config)
    elif microbatches:  # one micro-batch of each batch shard, as a pipeline's step runs it
        split, _, sizes = microbatch_leaves(leaves, config, microbatches, names, batch_dims)
        sizes = tuple(s // microbatches for s in sizes)
    else:
        split, batch = split_batch_leaves(leaves, config.num_batch_shards, names, batch_dims)
        sizes = config.batch_sizes(batch) if split else ()
    requires_grad = {n: p.requires_grad for n, p in shadow.named_parameters(remove_duplicate=False)}

    def shard(index: int) -> Any:  # (the analyses only read the graph: a capture serves every grid alike)
        key = (tuple(sorted(split.items())), sizes, index, segments)
        if captures is not None and key in captures:
            return captures[key]
        if captures is not None and split:
            captured = _shared_rows(captures, shadow, leaves, spec, split, sizes, index, segments, requires_grad)
        else:
            captured = capture_shard(shadow, leaves, spec, split, sizes, index, requires_grad=requires_grad,
                                     segments=segments)
        if captures is not None:
            captures[key] = captured
        return captured

    index = config.batch_index(rank) if split else 0
    with without_stack_traces():  # (analysed only, never run)
        canonical = shard(0)
        mine = canonical if index == 0 else shard(index)
    plan = _sharding(canonical.gm, config, captures)
    layouts = layouts_for(canonical.gm, plan)  # (read by each analysis below)
    mine_layouts = layouts if mine is canonical else layouts_for(mine.gm, plan)
    report = estimate_step(mine.gm, plan, mine_layouts)
    if per_rank and not split and config.num_batch_shards > 1:
        # each rank computes its own batch, not a shard of one: the whole step is every shard's, alike
        report = dataclasses.replace(summarize(report.layers, report.collectives, report.num_parameters, plan,
                                               flops_scale=config.num_batch_shards, whole=report.whole),
                                     largest_param_bytes=report.largest_param_bytes, experts=report.experts,
                                     attention_kv=report.attention_kv, output_bytes=report.output_bytes)
    chain, loss = (), ()
    if microbatches:
        chain = pipeline_chain(mine.gm, plan, report.collectives, layouts=mine_layouts)
        loss = tuple(loss_collectives(mine.gm, mine_layouts[0], config))
    result = (plan, report, estimate_memory(canonical.gm, plan, dtype, runs=captures, layouts=layouts, device=device),
              chain, loss)
    if captures is not None:
        captures[memo] = result
    return result


def _shared_rows(captures: dict[Any, Any], shadow: nn.Module, leaves: list[Any], spec: pytree.TreeSpec,
                 split: dict[int, int], sizes: tuple[int, ...], index: int, segments: tuple[int, ...],
                 requires_grad: dict[str, bool]) -> Any:
    """Batch shard ``index``'s capture for the plan search: grids whose shards get as many rows share one
    capture (the graph depends on this shard's rows only; how the whole batch was split is ``meta``), a
    copy of it with this split recorded. A capture costs ~50 times a copy."""
    key = ("rows", tuple(sorted(split.items())), sizes[index], segments)
    if key not in captures:
        captures[key] = capture_shard(shadow, leaves, spec, split, sizes, index, requires_grad=requires_grad,
                                      segments=segments)
    captured = captures[key]
    gm = graph_copy(captured.gm)
    record_graph_info(gm, batch=BatchInfo(sum(sizes), sizes, index, segments))
    return dataclasses.replace(captured, gm=gm)


def _is_meta(model: nn.Module) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


