"""The vocabulary split over a tensor axis: the embedding lookup in a table split over the vocabulary or the
features (``passes.ir.sharded_embedding``), cross-entropy on logits split over the classes
(``passes.ir.vocab_cross_entropy``), and the loss of a ``train_step`` on what this rank computed (the logits in
the model's output, its rows and piece of the vocabulary: ``autopar.train`` and the pipelined step)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.compat import pytree
from autopar.errors import InputError
from autopar.compat import assert_all
from autopar.decisions import EmbeddingMode, split_chunks
from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.layouts import ReduceFrom
from autopar.runtime.ops.sequence_parallel import ScatterTokens
from autopar.runtime.ops.untracked import apply
from passes.ir import EmbeddingSpec, VocabLossSpec


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


class EmbeddingOp:
    """A lookup in a table split over the vocabulary (masked lookup + all-reduce) or the features."""

    def __init__(self, spec: EmbeddingSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1) -> torch.Tensor:
        aten = torch.ops.aten
        if self.spec.mode is EmbeddingMode.HIDDEN:
            return aten.embedding.default(weight, ids, padding_idx)
        n, i = self.mesh.size(self.spec.axis), self.mesh.index(self.spec.axis)
        start, rows = split_chunks((self.spec.num_embeddings,), n, i)[0]  # (uneven: the last rank's is smaller)
        mine = (ids >= start) & (ids < start + rows)
        local_ids = (ids - start).masked_fill(~mine, 0)
        local_pad = padding_idx - start if 0 <= padding_idx - start < rows else -1
        out = aten.embedding.default(weight, local_ids, local_pad) * mine.unsqueeze(-1).to(weight.dtype)
        if self.spec.scatter_dim >= 0:
            return apply(ScatterTokens, out, self.mesh, self.spec.axis, self.spec.scatter_dim)
        return apply(ReduceFrom, out, self.mesh, self.spec.axis, 1.0)


def vocab_parallel_losses(mesh: Mesh, axis: str, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                          label_smoothing: float = 0.0, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy (fp32, 0 where ignored) of ``logits`` (..., V/n: this rank's piece of the
    classes, the last dim) and whether each row counts. Two all-reduces over ``axis``: the row maxima,
    then the sums of exponentials with the targets' logits (and, with label smoothing, the logits' sums)
    in one buffer. Serial's value: lse - (1 - e) * x[t] - e / V * sum(x), any shift being exact."""
    n, i = mesh.size(axis), mesh.index(axis)
    targets = targets.to(logits.device)
    x = logits.float()
    local_vocab = x.shape[-1]
    vocab = vocab or local_vocab * n
    valid = targets != ignore_index
    if torch.compiler.is_compiling():  # the check runs in the compiled graph (no value to name there)
        assert_all(~(valid & ((targets < 0) | (targets >= vocab))).any(),
                   f"cross-entropy target out of bounds for {vocab} classes (ignore_index is {ignore_index}). Fix "
                   "the labels or the model's vocabulary size.")
    elif bool((valid & ((targets < 0) | (targets >= vocab))).any()):
        bad = targets[valid & ((targets < 0) | (targets >= vocab))]
        raise InputError(f"cross-entropy target {int(bad[0])} is out of bounds for {vocab} classes "
                         f"({bad.numel()} such targets; ignore_index is {ignore_index}). Fix the labels or the "
                         f"model's vocabulary size.")
    with torch.no_grad():  # the max keeps exp() in range
        peak = x.max(dim=-1).values
        peak = C.all_reduce(peak, mesh.group(axis), n, op="max") if n > 1 else peak
    shifted = x - peak.unsqueeze(-1)
    local_t = targets - split_chunks((vocab,), n, i)[0][0]  # this rank's first class (uneven splits too)
    mine = valid & (local_t >= 0) & (local_t < local_vocab)
    picked = shifted.gather(-1, local_t.masked_fill(~mine, 0).unsqueeze(-1)).squeeze(-1) * mine
    parts = [shifted.exp().sum(-1), picked] + ([shifted.sum(-1)] if label_smoothing else [])
    packed = torch.stack(parts)
    if n > 1:
        packed = apply(ReduceFrom, packed, mesh, axis, 1.0)
    per_row = packed[0].log() - (1.0 - label_smoothing) * packed[1]
    if label_smoothing:
        per_row = per_row - label_smoothing / vocab * packed[2]
    return per_row * valid, valid


class VocabCrossEntropyOp:
    """A bound ``passes.ir.vocab_cross_entropy``: torch's cross_entropy_loss with the classes split."""

    def __init__(self, spec: VocabLossSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        s = self.spec
        x = logits.movedim(s.class_dim, -1) if s.class_dim != logits.dim() - 1 else logits
        per_row, valid = vocab_parallel_losses(self.mesh, s.axis, x, target, s.ignore_index, s.label_smoothing,
                                               s.vocab)
        if s.reduction == 0:
            out = per_row
        elif s.reduction == 2:
            out = per_row.sum()
        else:  # serial's mean: over the rows that count (nan when none does, as serial's)
            out = per_row.sum() / valid.sum()
        return out.to(logits.dtype)
