"""``train_step`` under a pipeline: torch's schedule runs this rank's stages over the micro-batches, each
micro-batch's loss its share of the serial loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autopar.compat import pytree, timed_pipeline_waits
from autopar.runtime.comm import collectives as C
from autopar.runtime.ops.vocabulary import logits_and_spec, splits_last_only, vocab_parallel_sum
from autopar.runtime.ops.layouts import gather_features
from autopar.runtime.pipeline.stages import build_schedule


def pipelined_step(runtime: Any, args: tuple, kwargs: dict, targets: torch.Tensor, loss_fn: Any,
                    ce: tuple[int, str] | None) -> torch.Tensor:
    """pipeline > 1: torch's schedule runs the micro-batches; the loss of micro-batch j is its share of
    the serial loss, so the summed gradients are the serial step's.

    Cross-entropy: each micro-batch's token losses divided by the valid tokens of the whole global
    batch (exact, with any ignore_index). Another loss is taken as a mean over samples: micro-batch
    j's loss (on its rows, full features) is weighted by its rows / the global batch (reduction
    "sum": weight 1).
    """
    mesh, m = runtime.mesh, runtime.num_microbatches
    exe, values, global_batch, sizes = runtime.pipeline_inputs(args, kwargs)
    program = exe.program
    shards = runtime.config.num_batch_shards
    if ce is not None:  # every rank has the global targets: the serial denominator is known up front
        ignore_index, reduction = ce
        total = float(max(int((targets != ignore_index).sum()), 1)) if reduction == "mean" else 1.0
    else:
        total = float(global_batch) if getattr(loss_fn, "reduction", "mean") != "sum" else 1.0
    if shards > 1:
        start = sum(sizes[:mesh.index("batch")])
        targets = targets[start:start + sizes[mesh.index("batch")]]

    def micro_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        out = pytree.tree_unflatten(list(output), exe.out_spec)
        logits, spec = logits_and_spec(out, exe.output_specs)
        tokens = logits.dim() - 1 == target.dim()
        if ce is not None and tokens and (spec is None or splits_last_only(spec, logits)):
            return vocab_parallel_sum(mesh, logits, spec, target, ce[0])[0] / total
        if spec is not None:  # full features, this rank's rows
            logits = gather_features(logits, spec.sharding, mesh)
        if ce is not None:
            flat = (logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) if tokens else (logits, target)
            return F.cross_entropy(*flat, ignore_index=ce[0], reduction="sum") / total
        if tokens:
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        else:
            loss = loss_fn(logits, target)
        return loss * (target.shape[0] / total) if total != 1.0 else loss

    if program.schedule is None:
        record: dict[int, Any] = {}
        first = {n: (v[:sizes[mesh.index("batch")] // m] if n in program.specs[0].received else v)
                 for n, v in values.items()}
        program.run_sequential(first, record)  # shapes and requires_grad of every boundary, once
        program.schedule = build_schedule(program, runtime.pipe, m,
                                          lambda out, tgt: program.micro_loss(out, tgt), record)
    program.micro_loss = micro_loss
    program.bind(values)
    losses: list[torch.Tensor] = []
    batch = tuple(values[n] for n in program.specs[0].received)
    is_first = 0 in program.adapters
    # (torch's schedule sends and receives itself: a rank that never came is named, within the group's timeout)
    with runtime.calls.running(), timed_pipeline_waits(mesh.group("pipeline")):
        program.schedule.step(*(batch if is_first else ()), target=targets.to(mesh.device), losses=losses)
    runtime.calls.settle()
    runtime.finish_grads()
    program.sync_buffers(runtime.buffers)
    last = program.num_stages - 1
    result = torch.zeros(1, device=mesh.device)
    if last in program.adapters:
        result = torch.stack([x.detach().float() for x in losses]).sum().reshape(1)
        if shards > 1:
            result = C.all_reduce(result, mesh.group("batch"), shards)
    C.broadcast(result, program.final.src, mesh.group("pipeline"), mesh.size("pipeline"))
    return result[0]
