"""``python -m autopar.trace model.py --tensor R C D --data D``: the plan, without processes or GPUs.

``model.py`` defines ``build_model()`` and ``example_inputs()``. The model is built on the meta
device (no weights are allocated), captured for one rank's batch shard, planned, and reported: a
per-matmul table (module, op, shapes, parameters, FLOPs, sharding, bytes per step) and totals.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.compat import pytree
from autopar.capture import (batch_leaves, capture_shard, input_names, meta_shadow, microbatch_leaves,
                             repeated_blocks, split_batch_leaves, truncated_blocks, without_stack_traces)
from autopar.config import MemoryConfig, ParallelConfig
from autopar.decisions import Plan
from autopar.memory import device_budget, half_dtype
from autopar.errors import AutoparError, ConfigError
from passes.analysis.graph_facts import ATTENTION_STEP_FACTOR, graph_copy
from passes.analysis.make_plan import make_plan
from passes.analysis.choose_checkpoints import pipeline_memory, plan_memory, stage_memory
from passes.analysis.choose_stages import ChainSegment, pipeline_chain, plan_pipeline
from passes.analysis.estimate_costs import Collective, loss_collectives
from passes.analysis.make_plan import layouts_for
from passes.analysis.pipeline_comm import pipeline_collectives, pipeline_flops
from passes.analysis.estimate_memory import MemoryProfile, estimate_memory
from passes.analysis.repeat_blocks import (Repeat, repeat_chain, repeat_memory, repeat_plan, repeat_report,
                                          template_holds)
from passes.analysis.report import StepReport, estimate_step, summarize
from passes.ir import BatchInfo

log = logging.getLogger(__name__)


SLOWEST = -1
"""``plan_model(rank=SLOWEST)``: under a pipeline, the rank whose stages compute the most matmul FLOPs
(batch and tensor coordinates 0); else rank 0."""


def plan_model(model: nn.Module, inputs: tuple, config: ParallelConfig, *, rank: int = 0,
               kwargs: dict | None = None, repeat: bool = True, checkpoint: str | int = "auto",
               budget: int | None = None, precision: str = "fp32", pipeline: int = 1,
               microbatches: int = 1, chunks: int = 1, per_rank: bool = False,
               batch_dims: dict[int | str, int | None] | None = None,
               captures: dict[Any, Any] | None = None) -> tuple[Plan, StepReport]:
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
    depends only on the rows each batch shard gets, so grids alike in that share it.
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
                                       _cache_for(captures, "cut"))
        except Exception as e:  # the cut model is only a shortcut: fall back to the exact capture
            log.debug("autopar.trace: capturing %s with its blocks cut failed (%s); capturing all of it",
                      type(shadow).__name__, e)
    if found is not None:
        plan, report, profile, chain, loss = found
        repeats = [Repeat(name, start + 2, count) for name, start, count in lists]
        if all(template_holds(plan, report, r, profile) for r in repeats):
            full = repeat_plan(plan, repeats)
            return _finish(full, repeat_report(report, full, repeats), repeat_memory(profile, full, repeats),
                           repeat_chain(chain, repeats), loss, checkpoint, budget, pipeline, microbatches,
                           chunks, rank, slowest)
    plan, report, profile, chain, loss = _plan_captured(shadow, inputs, kwargs, config, rank, dtype, micro, per_rank,
                                                        batch_dims, _cache_for(captures, "whole"))
    return _finish(plan, report, profile, chain, loss, checkpoint, budget, pipeline, microbatches, chunks, rank,
                   slowest)


def _finish(plan: Plan, report: StepReport, profile: MemoryProfile, chain: tuple[ChainSegment, ...],
            loss: tuple[Collective, ...], checkpoint: str | int, budget: int | None, pipeline: int,
            microbatches: int, chunks: int, rank: int, slowest: bool = False) -> tuple[Plan, StepReport]:
    plan = dataclasses.replace(plan, memory=plan_memory(profile, checkpoint, budget))
    report = dataclasses.replace(report, rank_saved_bytes=sum(s.saved_bytes for s in profile.segments),
                                 rank_attention_flops=ATTENTION_STEP_FACTOR * sum(s.attention_flops
                                                                                  for s in profile.segments),
                                 rank_update_bytes=profile.optimizer_bytes // 2,
                                 rank_ops=sum(s.ops for s in profile.segments),
                                 rank_least_kept_bytes=sum(min(s.saved_bytes, s.input_bytes) if s.checkpointable
                                                           else s.saved_bytes for s in profile.segments),
                                 segments=sum(s.name not in ("<shared>", "<loss>") for s in profile.segments))
    if pipeline > 1:  # everything was captured for one micro-batch, as the runtime compiles it
        plan = dataclasses.replace(plan, pipeline=plan_pipeline(chain, pipeline, microbatches, chunks))
        plan = dataclasses.replace(plan, memory=pipeline_memory(profile, plan, microbatches, checkpoint, budget))
        step = [c for c in report.collectives if c.phase == "step"]
        me = plan.config.coords(rank)["pipeline"]
        if slowest:  # the pipeline rank with the most matmul FLOPs (the bottleneck of a step)
            me = max(range(plan.pipeline.ranks), key=lambda r: pipeline_flops(chain, plan, r, microbatches))
        colls = pipeline_collectives(chain, plan, step, loss, me, microbatches)
        rows = [dataclasses.replace(r, flops=r.flops * microbatches) for r in report.layers]
        mine = plan.pipeline.stages_of(me)
        mine_names = {name for st in mine for name in st.segments}
        mine_segments = [s for s in profile.segments if s.name in mine_names]

        def step_sum(field: str) -> int:  # over this rank's stages, every micro-batch
            return microbatches * sum(getattr(s, field) for s in mine_segments)

        trainable = profile.optimizer_bytes / 2 / profile.param_bytes if profile.param_bytes else 1.0
        report = dataclasses.replace(
            summarize(rows, colls, report.num_parameters, plan), rank_flops=pipeline_flops(chain, plan, me, microbatches),
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
                   batch_dims: dict[int | str, int | None] | None = None, captures: dict[Any, Any] | None = None
                   ) -> tuple[Plan, StepReport, MemoryProfile, tuple[ChainSegment, ...], tuple[Collective, ...]]:
    """Captures and plans; with ``microbatches`` (pipelines) one micro-batch of this batch, as the
    runtime does, and also the pipeline chain and the loss's collectives. With ``captures`` the result
    is kept there too (the search's screen plans the data-parallel grid it then scores)."""
    memo = ("planned", config, rank, dtype, microbatches, per_rank, tuple(sorted((batch_dims or {}).items(), key=str)))
    if captures is not None and memo in captures:
        return captures[memo]
    leaves, spec = pytree.tree_flatten((tuple(inputs), dict(kwargs or {})))
    names = input_names(tuple(inputs), dict(kwargs or {}))
    segments: tuple[int, ...] = ()
    if per_rank:  # ParallelRuntime._run_per_rank's rule: the shard's members pool their rows, if several
        split, rows = batch_leaves(leaves, names, batch_dims)
        members = config.pipeline * config.row * config.col
        if members > 1 and split:
            segments = (rows,) * members
            sizes = (rows * members,) * config.num_batch_shards
        else:
            split, sizes = {}, ()
    elif microbatches:  # Runtime.pipeline_inputs's rule
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
    plan = make_plan(canonical.gm, config)
    report = estimate_step(mine.gm, plan)
    if per_rank and not split and config.num_batch_shards > 1:
        # each rank computes its own batch, not a shard of one: the whole step is every shard's, alike
        rows = [dataclasses.replace(r, flops=r.flops * config.num_batch_shards) for r in report.layers]
        report = dataclasses.replace(summarize(rows, report.collectives, report.num_parameters, plan),
                                     largest_param_bytes=report.largest_param_bytes)
    chain, loss = (), ()
    if microbatches:
        chain = pipeline_chain(mine.gm, plan, report.collectives)
        loss = tuple(loss_collectives(mine.gm, layouts_for(mine.gm, plan)[0], config))
    result = plan, report, estimate_memory(canonical.gm, plan, dtype), chain, loss
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
    gm.meta["autopar_batch"] = BatchInfo(sum(sizes), sizes, index, segments)
    return dataclasses.replace(captured, gm=gm)


def _is_meta(model: nn.Module) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


def load_model_file(path: str) -> Any:
    """The module of ``MODEL.py[:NAME]`` (its ``build_model()`` / ``example_inputs()``, NAME passed to both)."""
    path, _, name = path.partition(":")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"model file {path!r} does not exist. Pass a .py file that defines "
                          "build_model() and example_inputs().")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(file.stem, module)
    spec.loader.exec_module(module)
    for fn in ("build_model", "example_inputs"):
        if not callable(getattr(module, fn, None)):
            raise ConfigError(f"{path} does not define {fn}(). It must define build_model() and "
                              "example_inputs().")
    if name:  # model.py:NAME -> build_model(NAME), example_inputs(NAME)
        return _Named(module, name)
    return module


class _Named:
    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name = module, name

    def build_model(self) -> nn.Module:
        return self.module.build_model(self.name)

    def example_inputs(self) -> Any:
        return self.module.example_inputs(self.name)


def meta_inputs(inputs: tuple, batch_size: int | None, seq: int | None = None) -> tuple:
    """Meta copies of ``inputs``; with ``batch_size``, tensors sharing the first tensor's dim 0 get it; with
    ``seq``, tensors of two or more dims sharing its dim 1 (the sequence) get that."""
    leaves, spec = pytree.tree_flatten(inputs)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    first = tensors[0].shape[0] if tensors else None
    length = tensors[0].shape[1] if tensors and tensors[0].dim() > 1 else None
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            shape = list(x.shape)
            if batch_size is not None and x.dim() > 0 and shape[0] == first:
                shape[0] = batch_size
            if seq is not None and x.dim() > 1 and shape[1] == length:
                shape[1] = seq
            x = torch.empty(shape, dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)
        out.append(x)
    return pytree.tree_unflatten(out, spec)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def format_report(plan: Plan, report: StepReport, *, batch_size: int, rank: int) -> str:
    c = plan.config
    lines = [f"autopar plan for {c} = {c.world_size} ranks, global batch {batch_size}, shown for rank {rank}",
             ""]
    header = f"{'module':<22} {'op':<7} {'in shape':<16} {'out shape':<16} {'params':>9} {'FLOPs':>9}  {'sharding':<12} {'comm/step':>11}"
    lines += [header, "-" * len(header)]
    for r in report.layers:
        lines.append(f"{r.module or '<root>':<22} {r.op:<7} {list(r.in_shape)!s:<16} {list(r.out_shape)!s:<16} "
                     f"{_fmt_count(r.num_parameters):>9} {_fmt_count(r.flops):>9}  {r.sharding:<12} "
                     f"{_fmt_bytes(float(r.comm_bytes)):>11}")
    for what, nbytes in report.other_comm:
        lines.append(f"{what:<80} {_fmt_bytes(float(nbytes)):>11}")
    lines.append("-" * len(header))
    share = report.matmul_flops_sharded / report.flops_per_step if report.flops_per_step else 1.0
    kinds = ", ".join(f"{k} {_fmt_bytes(float(v))}" for k, v in report.comm_bytes_by_kind.items())
    lines += [
        f"parameters:            {report.num_parameters:,}",
        f"matmul FLOPs per step: {report.flops_per_step:,} (fwd+bwd, global batch; {share:.1%} sharded)",
        f"parameter bytes/rank:  {report.param_bytes_per_rank:,} ({_fmt_bytes(report.param_bytes_per_rank)})",
        f"construction peak:     {report.construction_bytes_per_rank:,} ({_fmt_bytes(report.construction_bytes_per_rank)}"
        f"; this rank's pieces + the largest parameter whole while it is initialized)",
        f"comm bytes/step/rank:  {float(report.comm_bytes_per_step):,.0f} ({kinds or 'none'})",
    ]
    for reason, flops in coverage_gaps(report):
        lines.append(f"not sharded: {flops / report.flops_per_step:.1%} of matmul FLOPs: {reason}")
    if plan.memory is not None:
        lines += plan.memory.summary().splitlines()
    if plan.pipeline is not None:
        lines += plan.pipeline.summary().splitlines()
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def coverage_gaps(report: StepReport) -> list[tuple[str, int]]:
    """(reason, FLOPs) of the matmul FLOPs that stay replicated, largest first."""
    gaps: dict[str, int] = {}
    for r in report.layers:
        if r.sharding.startswith("replicated"):
            reason = f"{r.module or '<root>'}: {r.sharding.removeprefix('replicated: ')}"
            gaps[reason] = gaps.get(reason, 0) + r.flops
    return sorted(gaps.items(), key=lambda kv: -kv[1])


def report_json(plan: Plan, report: StepReport, *, batch_size: int, rank: int) -> dict[str, Any]:
    return {
        "config": {"data": plan.config.data, "tensor": list(plan.config.tensor), "world_size": plan.config.world_size},
        "batch_size": batch_size,
        "rank": rank,
        "num_parameters": report.num_parameters,
        "flops_per_step": report.flops_per_step,
        "param_bytes_per_rank": report.param_bytes_per_rank,
        "construction_bytes_per_rank": report.construction_bytes_per_rank,
        "comm_bytes_per_step": float(report.comm_bytes_per_step),
        "memory": plan.to_dict()["memory"],
        "comm_bytes_by_kind": {k: float(v) for k, v in report.comm_bytes_by_kind.items()},
        "matmul_flops_sharded": report.matmul_flops_sharded,
        "not_sharded": [{"why": w, "flops": f} for w, f in coverage_gaps(report)],
        "layers": [{"module": r.module, "op": r.op, "in_shape": list(r.in_shape), "out_shape": list(r.out_shape),
                    "num_parameters": r.num_parameters, "flops": r.flops, "sharding": r.sharding,
                    "comm_bytes": float(r.comm_bytes)} for r in report.layers],
        "other_comm": [{"what": w, "comm_bytes": float(b)} for w, b in report.other_comm],
        "plan": plan.to_dict(),
    }


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '2e9' -> 2e9."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GB, 80GiB or 2e9")
    try:
        return int(float(m.group(1)) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GB, 80GiB or 2e9") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.trace", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .py file defining build_model() and example_inputs()")
    parser.add_argument("--tensor", type=int, nargs=3, default=(1, 1, 1), metavar=("ROW", "COL", "DEPTH"))
    parser.add_argument("--data", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=None, help="global batch (default: example_inputs')")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose bytes and shapes are shown")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--pipeline", type=int, default=1, metavar="P",
                        help="pipeline ranks: the blocks are cut into P stages by cost, as "
                             "auto_parallelize(pipeline=P) runs them (world size data x P x tensor)")
    parser.add_argument("--chunks", type=int, default=1, metavar="V",
                        help="stages per pipeline rank for an interleaved schedule (default 1)")
    parser.add_argument("--microbatches", type=int, default=None, metavar="M",
                        help="micro-batches per step for --pipeline (default: P, as auto_parallelize's); each "
                             "batch shard's rows must divide by it")
    parser.add_argument("--checkpoint", default="auto", choices=("auto", "none", "full"),
                        help="activation checkpointing policy, as auto_parallelize's checkpoint= (default auto)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="compute dtype, as auto_parallelize's precision= (activations in the memory plan)")
    parser.add_argument("--memory-per-device", type=parse_bytes, default=None, metavar="SIZE",
                        help="memory budget per device for --checkpoint auto, e.g. 80GB, 80GiB or 2e9 "
                             "(default: this machine's memory shared by the ranks)")
    parser.add_argument("--capture-all-blocks", action="store_true",
                        help="capture every repeated block instead of three (slower; the plan is the same "
                             "whenever the shortcut applies)")
    args = parser.parse_args(argv)
    try:
        config = ParallelConfig(args.data, *args.tensor, pipeline=max(args.pipeline, 1))
        module = load_model_file(args.model)
        with torch.device("meta"):
            model = module.build_model()
        inputs = module.example_inputs()
        inputs = meta_inputs(inputs if isinstance(inputs, tuple) else (inputs,), args.batch_size)
        leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > 0]
        batch_size = leaves[0].shape[0] if leaves else 0
        plan, report = plan_model(model, inputs, config, rank=args.rank, repeat=not args.capture_all_blocks,
                                  checkpoint=args.checkpoint, budget=args.memory_per_device,
                                  precision=args.precision, pipeline=args.pipeline,
                                  microbatches=args.microbatches or args.pipeline, chunks=args.chunks)
    except AutoparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(plan, report, batch_size=batch_size, rank=args.rank))
    if args.json:
        Path(args.json).write_text(json.dumps(report_json(plan, report, batch_size=batch_size, rank=args.rank),
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
