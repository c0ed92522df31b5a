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

from autopar.grid_choice import at_first_call
from autopar.parallel_model import runtime_of
from autopar.runtime.comm import collectives as C
from autopar.runtime.ops.vocabulary import cross_entropy_options, logits_and_spec, splits_last_only, vocab_parallel_sum
from autopar.runtime.pipeline.train_step import pipelined_step


def train_step(model: nn.Module, inputs: Any, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor:
    """Runs forward, the loss and backward; returns the global mean loss (detached) on every rank.

    Args:
        model: a model built inside ``autopar.auto_parallelize``.
        inputs: positional inputs (a tuple), keyword inputs (a dict) or one tensor: the global batch.
        targets: the global batch's targets (same on every rank), batch along dim 0.
        loss_fn: the loss; cross-entropy is vocabulary-parallel (see the module docstring).
    """
    args, kwargs = _split_inputs(inputs)
    ce = cross_entropy_options(loss_fn)
    runtime = at_first_call(runtime_of(model), args, kwargs, train_step=True)
    if runtime.config.pipeline > 1:
        return pipelined_step(runtime, args, kwargs, targets, loss_fn, ce)
    if ce is not None:
        out, specs, sizes = runtime.run(args, kwargs, local_outputs=True)
        logits, spec = logits_and_spec(out, specs)
        if logits.dim() - 1 == targets.dim() and (spec is None or splits_last_only(spec, logits)):
            return _vocab_parallel_step(runtime, logits, spec, targets, sizes, *ce)
        # The logits are laid out some other way: fall back to the gathered path.
    out = model(*args, **kwargs)
    logits = logits_and_spec(out, None)[0]
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


def _vocab_parallel_step(runtime: Any, logits: torch.Tensor, spec: Any, targets: torch.Tensor,
                         sizes: tuple[int, ...], ignore_index: int, reduction: str) -> torch.Tensor:
    mesh = runtime.mesh
    batch_split = spec is not None and spec.batch_split
    if batch_split:
        start = sum(sizes[:mesh.index("batch")])
        targets = targets[start:start + sizes[mesh.index("batch")]]
    local_sum, count = vocab_parallel_sum(mesh, logits, spec, targets, ignore_index)
    batch_n = mesh.size("batch") if batch_split else 1
    totals = torch.stack([local_sum.detach(), count])
    totals = C.all_reduce(totals, mesh.group("batch"), batch_n) if batch_n > 1 else totals
    denominator = totals[1].clamp(min=1) if reduction == "mean" else torch.ones((), device=logits.device)
    (local_sum / denominator).backward()
    return totals[0] / denominator


