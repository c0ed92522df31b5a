"""``train_step``: forward, loss and backward in one call, with vocabulary-parallel cross-entropy.

Serial meaning (what the returned loss equals)::

    out = model(*inputs)                       # or model(**inputs) for a dict, model(inputs) for a tensor
    logits = out if tensor else out.logits     # HF ModelOutput; else the first element
    if targets.dim() == logits.dim() - 1:      # class indices: flatten tokens, as LM loops do
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    else:
        loss = loss_fn(logits, targets)
    loss.backward()

Which loss functions get the fast path. ``torch.nn.functional.cross_entropy`` and
``torch.nn.CrossEntropyLoss`` (no class weights, no label smoothing, reduction "mean" or "sum",
any ``ignore_index``) with class-index targets are computed on this rank's batch rows and its piece
of the vocabulary: the full logits are never built (one max and two sum all-reduces of one value
per token, and one all-reduce of the loss and token count over data x depth). Every other loss
function gets the full logits on every rank (gathered, as ``model(x)`` returns them) and is
applied exactly as written above.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.compat import pytree
from autopar.runtime import collectives as C
from autopar.context import runtime_of
from autopar.errors import InputError
from autopar.runtime.ops import gather_features, vocab_parallel_losses
from autopar.runtime.pipeline import build_schedule


def train_step(model: nn.Module, inputs: Any, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor:
    """Runs forward, the loss and backward; returns the global mean loss (detached) on every rank.

    Args:
        model: a model built inside ``autopar.auto_parallelize``.
        inputs: positional inputs (a tuple), keyword inputs (a dict) or one tensor: the global batch.
        targets: the global batch's targets (same on every rank), batch along dim 0.
        loss_fn: the loss; cross-entropy is vocabulary-parallel (see the module docstring).
    """
    args, kwargs = _split_inputs(inputs)
    ce = _cross_entropy_options(loss_fn)
    runtime = runtime_of(model).decided(args, kwargs, train_step=True)
    if runtime.config.pipeline > 1:
        return _pipelined_step(runtime, args, kwargs, targets, loss_fn, ce)
    if ce is not None:
        out, specs, sizes = runtime.run(args, kwargs, local_outputs=True)
        logits, spec = _logits_and_spec(out, specs)
        if logits.dim() - 1 == targets.dim() and (spec is None or _splits_last_only(spec, logits)):
            return _vocab_parallel_step(runtime, logits, spec, targets, sizes, *ce)
        # The logits are laid out some other way: fall back to the gathered path.
    out = model(*args, **kwargs)
    logits = _logits_and_spec(out, None)[0]
    if targets.dim() == logits.dim() - 1:
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    else:
        loss = loss_fn(logits, targets)
    loss.backward()
    return loss.detach()


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _cross_entropy_options(loss_fn: Any) -> tuple[int, str] | None:
    """(ignore_index, reduction) when ``loss_fn`` is a plain cross-entropy, else None."""
    if loss_fn is F.cross_entropy:
        return -100, "mean"
    if isinstance(loss_fn, nn.CrossEntropyLoss) and type(loss_fn) is nn.CrossEntropyLoss:
        if loss_fn.weight is None and loss_fn.label_smoothing == 0 and loss_fn.reduction in ("mean", "sum"):
            return loss_fn.ignore_index, loss_fn.reduction
    return None


def _logits_and_spec(out: Any, specs: list[Any] | None) -> tuple[torch.Tensor, Any]:
    if isinstance(out, torch.Tensor):
        logits = out
    elif hasattr(out, "logits") and isinstance(out.logits, torch.Tensor):
        logits = out.logits
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        logits = out[0]
    else:
        raise InputError(f"train_step cannot find logits in the model output of type {type(out).__name__}: "
                         "return a tensor, a tuple whose first element is the logits, or an object with "
                         ".logits.")
    if specs is None:
        return logits, None
    leaves = pytree.tree_leaves(out)
    index = next(i for i, leaf in enumerate(leaves) if leaf is logits)
    return logits, specs[index]


def _splits_last_only(spec: Any, logits: torch.Tensor) -> bool:
    s = spec.sharding
    return s.is_replicated or (s.dim == logits.dim() - 1 and len(s.parts) == 1)


def _vocab_parallel_step(runtime: Any, logits: torch.Tensor, spec: Any, targets: torch.Tensor,
                         sizes: tuple[int, ...], ignore_index: int, reduction: str) -> torch.Tensor:
    mesh = runtime.mesh
    batch_split = spec is not None and spec.batch_split
    if batch_split:
        start = sum(sizes[:mesh.index("batch")])
        targets = targets[start:start + sizes[mesh.index("batch")]]
    local_sum, count = _vocab_parallel_sum(mesh, logits, spec, targets, ignore_index)
    batch_n = mesh.size("batch") if batch_split else 1
    totals = torch.stack([local_sum.detach(), count])
    totals = C.all_reduce(totals, mesh.group("batch"), batch_n) if batch_n > 1 else totals
    denominator = totals[1].clamp(min=1) if reduction == "mean" else torch.ones((), device=logits.device)
    (local_sum / denominator).backward()
    return totals[0] / denominator


def _vocab_parallel_sum(mesh: Any, logits: torch.Tensor, spec: Any, targets: torch.Tensor,
                        ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of this rank's tokens' losses, differentiable; its count of valid tokens)."""
    sharding = spec.sharding if spec is not None else None
    axis = "" if sharding is None or sharding.is_replicated else sharding.axis
    per_token, valid = vocab_parallel_losses(mesh, axis, logits, targets, ignore_index)
    return per_token.sum(), valid.sum().to(torch.float32)


def _pipelined_step(runtime: Any, args: tuple, kwargs: dict, targets: torch.Tensor, loss_fn: Any,
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
        logits, spec = _logits_and_spec(out, exe.output_specs)
        tokens = logits.dim() - 1 == target.dim()
        if ce is not None and tokens and (spec is None or _splits_last_only(spec, logits)):
            return _vocab_parallel_sum(mesh, logits, spec, target, ce[0])[0] / total
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
    program.schedule.step(*(batch if is_first else ()), target=targets.to(mesh.device), losses=losses)
    runtime.finish_grads()
    last = program.num_stages - 1
    result = torch.zeros(1, device=mesh.device)
    if last in program.adapters:
        result = torch.stack([x.detach().float() for x in losses]).sum().reshape(1)
        if shards > 1:
            result = C.all_reduce(result, mesh.group("batch"), shards)
    C.broadcast(result, program.final.src, mesh.group("pipeline"), mesh.size("pipeline"))
    return result[0]

