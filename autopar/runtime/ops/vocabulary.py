"""The loss of a ``train_step`` on what this rank computed: the logits in the model's output, and
cross-entropy on this rank's rows and piece of the vocabulary (``autopar.train`` and the pipelined step)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.compat import pytree
from autopar.errors import InputError
from autopar.runtime.ops.matmul import vocab_parallel_losses


def cross_entropy_options(loss_fn: Any) -> tuple[int, str] | None:
    """(ignore_index, reduction) when ``loss_fn`` is a plain cross-entropy, else None."""
    if loss_fn is F.cross_entropy:
        return -100, "mean"
    if isinstance(loss_fn, nn.CrossEntropyLoss) and type(loss_fn) is nn.CrossEntropyLoss:
        if loss_fn.weight is None and loss_fn.label_smoothing == 0 and loss_fn.reduction in ("mean", "sum"):
            return loss_fn.ignore_index, loss_fn.reduction
    return None


def logits_and_spec(out: Any, specs: list[Any] | None) -> tuple[torch.Tensor, Any]:
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


def splits_last_only(spec: Any, logits: torch.Tensor) -> bool:
    s = spec.sharding
    return s.is_replicated or (s.dim == logits.dim() - 1 and len(s.parts) == 1)


def vocab_parallel_sum(mesh: Any, logits: torch.Tensor, spec: Any, targets: torch.Tensor,
                        ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of this rank's tokens' losses, differentiable; its count of valid tokens)."""
    sharding = spec.sharding if spec is not None else None
    axis = "" if sharding is None or sharding.is_replicated else sharding.axis
    if not axis:  # every class here: torch's own (two kernels each way, where the split path runs about 15)
        targets = targets.to(logits.device).reshape(-1)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, ignore_index=ignore_index,
                                reduction="sum")
        return total, (targets != ignore_index).sum().to(torch.float32)
    per_token, valid = vocab_parallel_losses(mesh, axis, logits, targets, ignore_index,
                                             vocab=sharding.full_size if axis else None)
    return per_token.sum(), valid.sum().to(torch.float32)
