"""Implementations of the marker ops in ``passes.ir`` as autograd Functions over process groups.

Gradient convention: a tensor whose features are split over an axis is replicated over the other
tensor axes, and so is its gradient. Hence a gather's backward is a local slice and a slice's
backward is a gather (Megatron's conjugate pairs); see DESIGN-NOTES section 1 for the matmul.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.compat import assert_all
from autopar.runtime.comm import collectives as C
from autopar.decisions import EmbeddingMode, split_chunks
from autopar.errors import InputError
from autopar.runtime.execution.kept_state import keeps
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.untracked import apply
from autopar.runtime.ops.sequence_parallel import (REGATHER, GatherPartial, MatmulOut, Regather, ScatterTokens, TokensOf, gather_along,
                                    scatter_along)
from passes.ir import (
    BatchReduceSpec,
    ConvertSpec,
    EmbeddingSpec,
    GatherOutputSpec,
    GatherRowsSpec,
    MatmulSpec,
    ReduceSpec,
    Sharding,
    VocabLossSpec,
)


def _axis(mesh: Mesh, s: Sharding) -> tuple[int, int]:
    return mesh.size(s.axis), mesh.index(s.axis)


def take_pieces(t: torch.Tensor, dim: int, parts: tuple[int, ...], n: int, index: int,
                contiguous: bool = True) -> torch.Tensor:
    """Rank ``index``'s piece of every segment of ``dim`` (see ``split_chunks``), concatenated (a view
    when it is one segment and ``contiguous`` is False)."""
    if n == 1:
        return t
    chunks = [t.narrow(dim, start, k) for start, k in split_chunks(parts or (t.shape[dim],), n, index)]
    out = torch.cat(chunks, dim) if len(chunks) > 1 else chunks[0]
    return out.contiguous() if contiguous else out


def join_pieces(pieces: list[torch.Tensor], dim: int, parts: tuple[int, ...]) -> torch.Tensor:
    """The inverse of ``take_pieces`` given every rank's pieces, in rank order."""
    if len(pieces) == 1:
        return pieces[0]
    if len(parts) <= 1:
        return torch.cat(pieces, dim)
    sizes = [p // len(pieces) for p in parts]
    split = [t.split(sizes, dim) for t in pieces]
    return torch.cat([split[i][j] for j in range(len(sizes)) for i in range(len(pieces))], dim)


def gather_pieces(x: torch.Tensor, dim: int, parts: tuple[int, ...], full: int, group: Any, n: int) -> torch.Tensor:
    """Every rank's piece of ``dim`` (``full`` long, segments ``parts``), joined in rank order. A single segment
    split unevenly (``decisions.uneven_split``) travels padded to the largest piece and is cut back."""
    if n == 1:
        return x
    if len(parts) <= 1 and full % n:
        k = -(-full // n)
        lengths = [length for _, length in (split_chunks((full,), n, i)[0] for i in range(n))]
        if x.shape[dim] < k:
            pad = list(x.shape)
            pad[dim] = k - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim)
        stacked = C.all_gather(x.contiguous().unsqueeze(0), group, n)
        return torch.cat([stacked[i].narrow(dim, 0, lengths[i]) for i in range(n)], dim)
    stacked = C.all_gather(x.contiguous().unsqueeze(0), group, n)  # (n, *local)
    return join_pieces(list(stacked.unbind(0)), dim, parts)


def gather_sharded(x: torch.Tensor, s: Sharding, mesh: Mesh) -> torch.Tensor:
    n, _ = _axis(mesh, s)
    return gather_pieces(x, s.dim, s.parts, s.full_size, mesh.group(s.axis), n)


class _Gather(torch.autograd.Function):
    """Local pieces -> the full tensor on every rank of the axis; backward keeps this rank's piece."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, s: Sharding) -> torch.Tensor:
        ctx.mesh, ctx.s = mesh, s
        return gather_sharded(x, s, mesh)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        s = ctx.s
        return take_pieces(dy, s.dim, s.parts, *_axis(ctx.mesh, s)), None, None


def gather_features(x: torch.Tensor, s: Sharding, mesh: Mesh) -> torch.Tensor:
    """The whole of a tensor split over a tensor-parallel axis, on every rank of the axis (autograd-aware)."""
    return x if s.is_replicated else apply(_Gather, x, mesh, s)


class GatherFeaturesOp:
    """A model output's features gathered (per-rank batches: its rows are taken by autopar.runtime.data_parallel.per_rank)."""

    def __init__(self, spec: GatherOutputSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gather_features(x, self.spec.sharding, self.mesh)


class _Slice(torch.autograd.Function):
    """A replicated tensor -> this rank's piece; backward gathers the pieces' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, s: Sharding) -> torch.Tensor:
        ctx.mesh, ctx.s = mesh, s
        return take_pieces(x, s.dim, s.parts, *_axis(mesh, s))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return gather_sharded(dy, ctx.s, ctx.mesh), None, None


class ReduceFrom(torch.autograd.Function):
    """Sums partial results over an axis (times ``scale``); the gradient is already replicated."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, scale: float) -> torch.Tensor:
        ctx.scale = scale
        y = C.all_reduce(x.clone(), mesh.group(axis), mesh.size(axis))
        return y * scale if scale != 1.0 else y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return (dy * ctx.scale if ctx.scale != 1.0 else dy), None, None, None


class _CopyTo(torch.autograd.Function):
    """Identity forward into ops that split their output over an axis; backward sums the gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
        ctx.mesh, ctx.axis = mesh, axis
        return x

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return C.all_reduce(dy.clone(), ctx.mesh.group(ctx.axis), ctx.mesh.size(ctx.axis)), None, None


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad])


class _ScatterBatch(torch.autograd.Function):
    """This rank's rows (along ``dim``) of a global-batch input; backward gathers every batch shard's rows'
    gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...], dim: int) -> torch.Tensor:
        ctx.mesh, ctx.sizes, ctx.dim = mesh, sizes, dim
        i = mesh.index("batch")
        return x.narrow(dim, sum(sizes[:i]), sizes[i])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return _gather_rows_along(dy, ctx.mesh, ctx.sizes, ctx.dim, 1), None, None, None


def scatter_batch(x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...], dim: int = 0) -> torch.Tensor:
    return _ScatterBatch.apply(x, mesh, sizes, dim)


class _Matmul3D(torch.autograd.Function):
    """``y = x @ W^T + b`` with W's (out, in) block on this (row, col) and 1/depth of its rows stored here.

    Under autocast (precision bf16/fp16) x and the weight shard are cast to the compute dtype before
    they travel, and the weight gradient is reduced in ``op.reduce_dtype`` (fp32 by default) and
    returned in the shard's dtype: fp32 master weights get fp32 gradients.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                op: MatmulOp, tokens: TokensOf | None = None) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.op, ctx.dtype, ctx.tokens = op, dtype, tokens and tokens.regather
        x = x.to(dtype)
        w = op.gather_weight(w_shard.to(dtype))
        if torch.is_autocast_enabled(device):  # (a context each call costs its Python enter and exit)
            with torch.autocast(device, enabled=False):
                y = op.product(x, w, bias)
        else:
            y = op.product(x, w, bias)
        ctx.save_for_backward(x if tokens is None else tokens.keep(dtype, ctx.needs_input_grad[1]), w_shard)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        op: MatmulOp = ctx.op
        x, w_shard = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.tokens is not None and need_w:  # (x serves only the weight's gradient)
            x = ctx.tokens.whole(x).to(ctx.dtype)
        ctx.tokens = None
        dy = op.whole_grad(dy.to(ctx.dtype))
        dx = dw = db = None
        if need_x or need_w:
            w = op.gather_weight(w_shard.to(ctx.dtype))
        if need_x:
            dx = op.reduce_dx(torch.matmul(dy, w.t() if op.spec.weight_in_out else w))
        dy2 = dy.reshape(-1, dy.shape[-1])
        if need_w:  # the block's rows are split over depth: reduce-scatter them
            x2 = x.reshape(-1, x.shape[-1])
            block = x2.t() @ dy2 if op.spec.weight_in_out else dy2.t() @ x2
            block = block.to(op.reduce_dtype or w_shard.dtype)
            dw = C.reduce_scatter(block, op.mesh.group("depth"), op.mesh.size("depth")).to(w_shard.dtype)
        if need_b:
            db = dy2.sum(0)
        return dx, dw, db, None, None


class MatmulOp:
    """A bound ``passes.ir.sharded_matmul``: the spec plus the groups it talks over."""

    def __init__(self, spec: MatmulSpec, mesh: Mesh, reduce_dtype: torch.dtype | None = None) -> None:
        self.spec, self.mesh, self.reduce_dtype = spec, mesh, reduce_dtype
        o = spec.orientation
        n_loc = spec.out_features // mesh.size(o.out_axis)
        k_loc = spec.in_features // mesh.size(o.in_axis)
        self.block_shape = (k_loc, n_loc) if spec.weight_in_out else (n_loc, k_loc)

    def gather_weight(self, w_shard: torch.Tensor) -> torch.Tensor:
        """The (row, col) block from every depth rank's rows of it."""
        m = self.mesh
        return C.all_gather(w_shard, m.group("depth"), m.size("depth")).view(self.block_shape)

    def all_reduce(self, t: torch.Tensor, axis: str) -> torch.Tensor:
        return C.all_reduce(t, self.mesh.group(axis), self.mesh.size(axis))

    def product(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T (+ b)`` of the whole (row, col) block ``w``, its partial sums reduced (``reduce_out``)."""
        y = self.reduce_out(torch.matmul(x, w if self.spec.weight_in_out else w.t()))
        return y + bias.to(y.dtype) if bias is not None else y

    def reduce_out(self, y: torch.Tensor) -> torch.Tensor:
        """The local product's partial sums over the input axis: all-reduced, or (sequence parallelism)
        reduce-scattered along the tokens."""
        axis, dim = self.spec.orientation.in_axis, self.spec.scatter_dim
        if dim < 0:
            return self.all_reduce(y, axis)
        return scatter_along(y, dim, self.mesh, axis)

    def whole_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """The output's gradient for every token (sequence parallelism: gathered from the tokens' ranks)."""
        dim = self.spec.scatter_dim
        return dy if dim < 0 else gather_along(dy, dim, self.mesh, self.spec.orientation.in_axis)

    def reduce_dx(self, dx: torch.Tensor) -> torch.Tensor:
        """The input's gradient summed over the output axis, unless the gather before this matmul does it."""
        return dx if self.spec.partial_dx else self.all_reduce(dx, self.spec.orientation.out_axis)

    def __call__(self, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tokens = getattr(x, REGATHER, None) if self.spec.partial_dx else None
        if self.spec.orientation.is_3d:
            return apply(_Matmul3D, x, w_shard, bias, self, tokens)
        # OUT_ROW/OUT_COL: the weight's output features are split over one axis, the input is whole.
        if tokens is not None:
            return apply(MatmulOut, x, w_shard, bias, self, tokens)
        if not self.spec.partial_dx:
            x = apply(_CopyTo, x, self.mesh, self.spec.orientation.out_axis)
        y = torch.matmul(x, w_shard) if self.spec.weight_in_out else torch.nn.functional.linear(x, w_shard)
        return y + bias.to(y.dtype) if bias is not None else y  # under autocast y is bf16/fp16, as serial


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


class ReduceOp:
    def __init__(self, spec: ReduceSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.mesh.size(self.spec.axis)
        return apply(ReduceFrom, x, self.mesh, self.spec.axis, 1.0 / n if self.spec.mean else 1.0)


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


class SumGradOp:
    def __init__(self, axis: str, mesh: Mesh) -> None:
        self.axis, self.mesh = axis, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply(_CopyTo, x, self.mesh, self.axis)


class ConvertOp:
    def __init__(self, spec: ConvertSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.partial_grad:  # (its readers are matmuls only; a split of one rank is no split)
            whole = apply(GatherPartial, x, self.mesh, self.spec.src)
            if not torch.compiler.is_compiling():  # (compiled: the partitioner decides what backward keeps)
                setattr(whole, REGATHER, TokensOf(x, Regather(self.mesh, self.spec.src)))
            return whole
        # (an axis of one rank: nothing to move, and a Function returning its input as it is would make the
        # result a view that an in-place op of the model may not write)
        if not self.spec.src.is_replicated and self.mesh.size(self.spec.src.axis) > 1:
            x = apply(_Gather, x, self.mesh, self.spec.src)
        if not self.spec.dst.is_replicated and self.mesh.size(self.spec.dst.axis) > 1:
            x = apply(_Slice, x, self.mesh, self.spec.dst)
        return x


class BatchRows:
    """Each batch shard's rows in the current call, read by a graph's batch ops when they run. The runtime
    sets them before each run: a graph captured with a symbolic row count serves every batch size."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def entries(self, x: torch.Tensor, dim: int, mesh: Mesh, whole: bool = False) -> int:
        """Entries per row along ``dim`` of ``x`` (this rank's rows, or with ``whole`` every shard's)."""
        rows = sum(self.sizes) if whole else self.sizes[mesh.index("batch")]
        return x.shape[dim] // rows


class GatherOutputOp:
    """A model output made full on every rank: features gathered, then the batch's rows (global batch).

    An output computed from the whole batch (a loss inside forward) or without it is the same on every
    batch rank, and so is the caller's gradient of it; backward keeps it on one batch rank so that the
    batch ranks' parts of every gradient behind it sum to it once (``passes.analysis.batch_dims``)."""

    def __init__(self, spec: GatherOutputSpec, mesh: Mesh, rows: BatchRows) -> None:
        self.spec, self.mesh, self.rows = spec, mesh, rows

    def __call__(self, x: torch.Tensor, gather_features: bool = True) -> torch.Tensor:
        sizes = self.rows.sizes
        if gather_features and keeps(self.spec, sizes):
            # a cache the next call reads split: this rank's piece, made a DTensor after the graph ran
            # (autopar.runtime.execution.kept_state.KeptOutputs)
            return x
        if not self.spec.sharding.is_replicated and gather_features and self.mesh.size(self.spec.sharding.axis) > 1:
            x = apply(_Gather, x, self.mesh, self.spec.sharding)
        if self.spec.batch_split:
            dim = self.spec.batch_dim
            return apply(_GatherRows, x, self.mesh, sizes, dim, self.rows.entries(x, dim, self.mesh))
        n = self.mesh.size("batch")
        if n > 1 and self.spec.batch_state == "per-rank":  # DDP's: each rank's own, its gradient averaged
            return apply(_ScaleGrad, x, 1.0 / n) if x.requires_grad else x
        if n > 1 and self.spec.batch_state == "local":  # the batch ranks' values averaged, as DDP's loss is
            x = apply(_BatchSum, x, self.mesh) / n
        if n > 1 and x.requires_grad:
            return apply(_OnOneBatchRank, x, self.mesh)
        return x


class _ScaleGrad(torch.autograd.Function):
    """Identity; backward scales the gradient (a per-rank output's, by 1 / the batch ranks: DDP's average)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return dy * ctx.scale, None


def _rows_bounds(sizes: tuple[int, ...], factor: int, index: int) -> tuple[int, int]:
    start = sum(sizes[:index]) * factor
    return start, start + sizes[index] * factor


def _gather_rows_along(x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...], dim: int, factor: int) -> torch.Tensor:
    n = mesh.size("batch")
    if n == 1:
        return x
    moved = x.movedim(dim, 0)
    stacked = C.all_gather(_pad_rows(moved, max(sizes) * factor).unsqueeze(0), mesh.group("batch"), n)
    # (concatenated along ``dim`` itself: a fresh tensor, which the model's in-place ops may write)
    return torch.cat([stacked[i, :s * factor].movedim(0, dim) for i, s in enumerate(sizes)], dim)


class _GatherRows(torch.autograd.Function):
    """This rank's rows (along ``dim``, ``factor`` entries each) -> every batch shard's, in batch order;
    backward keeps this rank's rows of the gradient: of the same gradient everywhere, or (``summed``) of the
    sum of the batch ranks' parts of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...], dim: int, factor: int,
                summed: bool = False) -> torch.Tensor:
        ctx.mesh, ctx.sizes, ctx.dim, ctx.factor, ctx.summed = mesh, sizes, dim, factor, summed
        return _gather_rows_along(x, mesh, sizes, dim, factor)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        if ctx.summed:
            dy = C.all_reduce(dy.contiguous().clone(), ctx.mesh.group("batch"), ctx.mesh.size("batch"))
        start, stop = _rows_bounds(ctx.sizes, ctx.factor, ctx.mesh.index("batch"))
        return dy.narrow(ctx.dim, start, stop - start), None, None, None, None, None


class _OnOneBatchRank(torch.autograd.Function):
    """Identity; backward keeps the gradient on batch rank 0 and zeroes it on the others.

    Traced (``compile=True``) the backward is the same ops on every rank, ``dy`` times 1 or 0: zeros made
    without ``dy`` let AOTAutograd's partitioner move what follows them into the forward graph on the other
    ranks only, a later collective included (``_BatchSum``'s backward all-reduce), so the ranks' graphs
    issued their collectives in different orders and waited forever (the zoo's GPT-2 at depth 4 with labels)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        ctx.keep = mesh.index("batch") == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        if torch.compiler.is_compiling():
            return dy * (1.0 if ctx.keep else 0.0), None
        return (dy if ctx.keep else torch.zeros_like(dy)), None


class _BatchSum(torch.autograd.Function):
    """Sums over the batch ranks; backward sums the gradient's parts (every rank gets all of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        ctx.mesh = mesh
        return C.all_reduce(x.clone(), mesh.group("batch"), mesh.size("batch"))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return C.all_reduce(dy.clone(), ctx.mesh.group("batch"), ctx.mesh.size("batch")), None


class BatchReduceOp:
    """A bound ``passes.ir.batch_reduce`` (global batch): one all-reduce of this rank's partial sums and
    count over data x depth."""

    def __init__(self, spec: BatchReduceSpec, mesh: Mesh, rows: BatchRows) -> None:
        self.spec, self.mesh, self.rows = spec, mesh, rows

    def __call__(self, values: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        total = values.sum(0)
        if self.spec.mean and counts is not None:
            packed = torch.cat([total.reshape(-1), counts.detach().sum().reshape(1).to(total.dtype)])
            packed = _BatchSum.apply(packed, self.mesh)
            return packed[:-1].view_as(total) / packed[-1].detach()
        if self.mesh.size("batch") > 1:
            total = _BatchSum.apply(total, self.mesh)
        if not self.spec.mean:
            return total
        sizes = self.rows.sizes  # entries: every shard's rows x this rank's entries per row
        entries = sum(sizes) * self.rows.entries(values, 0, self.mesh) if sizes else values.shape[0]
        return total / (entries * (self.spec.count_per_row or 1))


class GatherRowsOp:
    """A bound ``passes.ir.gather_rows``: the whole batch's rows on every batch rank; backward sums the
    gradient's parts over the batch ranks and keeps this rank's rows."""

    def __init__(self, spec: GatherRowsSpec, mesh: Mesh, rows: BatchRows) -> None:
        self.spec, self.mesh, self.rows = spec, mesh, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh.size("batch") == 1:
            return x
        dim = self.spec.dim
        return apply(_GatherRows, x, self.mesh, self.rows.sizes, dim, self.rows.entries(x, dim, self.mesh), True)


class ScatterRowsOp:
    """A bound ``passes.ir.scatter_rows``: this rank's rows of a whole-batch tensor; backward places their
    gradient in zeros (this rank's part of the whole tensor's gradient). No communication."""

    def __init__(self, spec: GatherRowsSpec, mesh: Mesh, rows: BatchRows) -> None:
        self.spec, self.mesh, self.rows = spec, mesh, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh.size("batch") == 1:
            return x
        dim = self.spec.dim
        factor = self.rows.entries(x, dim, self.mesh, whole=True)
        start, stop = _rows_bounds(self.rows.sizes, factor, self.mesh.index("batch"))
        return _ScatterRows.apply(x, dim, start, stop)


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
        ctx.shape, ctx.dim, ctx.start = x.shape, dim, start
        return x.narrow(dim, start, stop - start).contiguous()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        out = dy.new_zeros(ctx.shape)
        out.narrow(ctx.dim, ctx.start, dy.shape[ctx.dim]).copy_(dy)
        return out, None, None, None
