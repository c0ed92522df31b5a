"""Which grid a model runs on when the user did not give it all: data parallelism for a model whose training
state fits half a device, else the plan search's best grid (``autopar.planning.search.choose_grid``), chosen by rank 0
and broadcast, at the end of the block (example inputs) or at the model's first call: the model's runtime then
takes the grid (``ParallelRuntime.take_grid``), which until then was data parallel with DTensor parameters."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture import batch_leaves, input_names
from autopar.compat import pytree
from autopar.config import CompileConfig, MemoryConfig, ParallelConfig, PipelineConfig
from autopar.errors import ContextError
from autopar.memory import device_budget
from autopar.runtime.comm import collectives as C
from autopar.runtime.execution.call_check import PER_RANK
from autopar.runtime.comm.mesh import device_for_backend
from autopar.runtime.parallel_runtime import ParallelRuntime

log = logging.getLogger(__name__)


def training_state_bytes(model: nn.Module) -> int:
    """What data parallelism keeps of ``model`` on every rank whatever it recomputes: fp32 parameters, and
    for each trainable one its gradient and Adam's two moments (16 bytes per trainable parameter)."""
    return sum(p.numel() * (16 if p.requires_grad else 4) for p in model.parameters())


def too_big_for_data_parallel(roots: list[nn.Module], memory: MemoryConfig, at_first_call: bool) -> list[nn.Module]:
    """The models of a block given no degrees whose training state exceeds half the device's memory (the
    ``checkpoint`` budget where it is bytes): data parallelism would leave them too little for
    activations, or not fit at all, so the plan search chooses their grid. Ranks agree on the budget (the
    least of theirs: a node with less memory decides). One warning line per such model; the others are
    data parallel with plain tensors, as under DDP (one info line)."""
    if not roots:
        return []
    world = dist.get_world_size()
    device = device_for_backend()
    budget = memory.checkpoint if isinstance(memory.checkpoint, int) else device_budget(device, world)
    least = torch.tensor([budget], dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    budget = int(least.item())
    out = []
    for model in roots:
        state, name = training_state_bytes(model), type(model).__name__
        if 2 * state <= budget:
            log.info("autopar: no degrees given: %s is data parallel over %d ranks, as under DDP (its training "
                     "state, %.3g GiB, fits half of a device's %.3g GiB); plan='auto' searches every grid.",
                     name, world, state / 2**30, budget / 2**30)
            continue
        out.append(model)
        if dist.get_rank() == 0:
            log.warning("autopar: no degrees given and %s's training state (%.3g GiB: fp32 parameters, gradients "
                        "and Adam's two moments) exceeds half of a device's %.3g GiB, too much for data parallelism "
                        "alone: its grid is chosen as with plan='auto' (%s). Its parameters are DTensors, so a "
                        "rank-0 torch.save(model.state_dict()) raises: use autopar.full_state_dict(model). Pass "
                        "data=, tensor= or pipeline= to choose the grid yourself.", name, state / 2**30,
                        budget / 2**30, "at its first call" if at_first_call else "now, for example_inputs")
    return out


def choose_grid_now(roots: list[nn.Module], example_inputs: tuple, given: dict[str, int], memory: MemoryConfig,
                    pipe: PipelineConfig, compile: CompileConfig) -> tuple[ParallelConfig, PipelineConfig]:
    """plan="auto": the best grid for the block's model (``autopar.planning.search.choose_grid``), rank 0's choice on
    every rank; the degrees the user gave stay."""
    if len(roots) > 1:
        raise ContextError(f"plan='auto' with example_inputs chooses one grid for one model; the block built "
                           f"{len(roots)} ({', '.join(type(m).__name__ for m in roots)}). Build one model per block, "
                           "leave example_inputs out (each model's grid is then chosen at its first call), or give "
                           "the degrees.")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    return agreed_choice(roots[0], type(roots[0]).__name__, inputs, {}, None, given, memory, pipe, None, compile)


def agreed_choice(model: nn.Module, name: str, args: tuple, kwargs: dict, rows: int | None, given: dict[str, int],
                   memory: MemoryConfig, pipe: PipelineConfig, group: Any,
                   compile: CompileConfig) -> tuple[ParallelConfig, PipelineConfig]:
    """Rank 0's search (``autopar.planning.search.choose_grid``) for one global batch (``rows``: its rows, where the call
    holds one rank's), broadcast: every rank runs the same grid, or raises rank 0's error."""
    from autopar.planning.search import choose_grid
    from passes.analysis.search_plans import why_slower

    world = dist.get_world_size()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            budget = memory.checkpoint if isinstance(memory.checkpoint, int) else None
            experts = memory.expert_parallel or None  # (True: either layout that splits them; "data+tensor")
            ranked = choose_grid(model, args, world, fixed=given, precision=memory.precision, kwargs=kwargs,
                                 batch_size=rows, checkpoint="auto" if budget else memory.checkpoint, budget=budget,
                                 compiled=compile.enabled(device_for_backend().type, training=True),
                                 expert_parallel=experts)
        except Exception as e:  # every rank raises it, none waits for a choice that never comes
            box[0] = e
        else:
            if pipe.microbatches is not None:
                ranked = [s for s in ranked if s.candidate.pipeline == 1 or s.candidate.microbatches ==
                          pipe.microbatches] or ranked
            best = ranked[0]
            box[0] = best.candidate
            runners = "; ".join(f"{s.candidate.describe()} ({s.seconds * 1e3:.3g} ms: {why_slower(best, s)})"
                                for s in ranked[1:3])
            log.warning("autopar: plan='auto' chose %s for %s on %d ranks: predicted %.3g ms per step, %.3g MiB "
                        "per device. Runners-up: %s.", best.candidate.describe(), name, world,
                        best.seconds * 1e3, best.memory_bytes / 2**20, runners or "none")
    C.broadcast_objects(box, 0, group)
    chosen = box[0]
    if isinstance(chosen, Exception):
        raise chosen
    config = ParallelConfig.from_user(tensor=chosen.tensor, data=chosen.data, world_size=world,
                                      pipeline=chosen.pipeline,
                                      shard_optimizer=memory.shard_optimizer or chosen.shard_optimizer,
                                      sequence_parallel=memory.sequence_parallel or chosen.sequence_parallel,
                                      expert_parallel=chosen.expert_parallel or memory.expert_parallel,
                                      context=chosen.context)
    if chosen.pipeline > 1:
        pipe = dataclasses.replace(pipe, microbatches=chosen.microbatches)
        if "chunks" not in given and chosen.chunks > 1:
            pipe = dataclasses.replace(pipe, schedule="interleaved", chunks=chosen.chunks)
        pipe.num_microbatches(chosen.pipeline)
    return config, pipe


def at_first_call(runtime: ParallelRuntime, args: tuple, kwargs: dict, train_step: bool) -> ParallelRuntime:
    """``runtime``, with its grid chosen if this is the first call of a model whose grid is chosen then
    (``plan="auto"`` without example inputs): the model's forward and ``train_step`` ask before they run it."""
    if runtime.open_degrees is not None:
        runtime.take_grid(*choose_at_first_call(runtime, runtime.open_degrees, args, kwargs, train_step))
    return runtime


def choose_at_first_call(runtime: ParallelRuntime, given: dict[str, int], args: tuple, kwargs: dict,
                         train_step: bool) -> tuple[ParallelConfig, PipelineConfig]:
    """plan="auto" without example inputs: the grid for the model's first call (``runtime``'s provisional grid
    when the choice is data parallelism alone). The ranks' inputs decide the batch mode as any first call does
    (``CallCheck``)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    found = batch_leaves(leaves, input_names(args, kwargs), runtime.inputs.batch_dims)
    mode, every = runtime.calls.check(leaves, spec, found[0], torch.is_grad_enabled())
    rows = None
    if mode == PER_RANK:  # the batch the search plans is every rank's rows
        rows = sum(int(e.rows) for e in every) if every else found[1] * dist.get_world_size()
    if mode == PER_RANK or not train_step:  # a plain call runs a pipeline's stages one after another
        given = {**given, "pipeline": 1}
    return agreed_choice(runtime.shadow, type(runtime.shadow).__name__, args, kwargs, rows, given, runtime.memory,
                         runtime.pipe, runtime.mesh.control, runtime.compile)
