"""The vocabulary of an emitted graph: metadata on captured nodes and the distributed ops passes insert.

The ops are markers: calling one raises. The runtime binds each marker node to an implementation
over real process groups (autopar.runtime). Keeping them abstract keeps the passes free of
process groups and lets a graph be planned, printed and checked without processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from torch import fx

from autopar.compat import register_fx_builtin
from autopar.decisions import EmbeddingMode, Layout, Orientation


class InputKind(StrEnum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"
    USER = "user"


@dataclass(frozen=True, slots=True)
class InputInfo:
    """``node.meta["autopar"]`` of a placeholder of a captured graph."""

    kind: InputKind
    target: str
    """Parameter/buffer FQN, constant name, or the user input's position in the flattened inputs."""
    requires_grad: bool
    batch_split: bool = False
    """True for user inputs that hold the batch: each rank receives its slice of it."""
    batch_dim: int = 0
    """With ``batch_split``: the dim holding the batch (0 unless declared: auto_parallelize(batch_dims=...))."""
    sharding: Sharding | None = None
    """A user input that arrives as this rank's piece (a key/value cache an earlier call returned split by
    heads, ``GatherOutputSpec.keep_split``): how it is split. None: whole on every rank."""


@dataclass(frozen=True, slots=True)
class RowsInfo:
    """``node.meta["autopar"]`` of an op of a captured graph whose batch is split: which dims of its output
    scale with the batch rows, found by capturing the model again with twice the rows
    (``passes.analysis.row_extents``). What it says of an op that has lost track of where the rows lie (a sort
    of them, an index by data) is all the batch analysis knows of such a value."""

    dims: tuple[tuple[int, ...] | None, ...]
    """Per output tensor (one entry for an op returning one tensor; None for a non-tensor output): the dims
    whose size changed with the rows, in order."""


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """``GraphInfo.batch``: how the global batch was split when this graph was captured."""

    global_size: int
    local_sizes: tuple[int, ...]
    """Rows per batch shard, in batch-index order (see ParallelConfig.batch_sizes)."""
    index: int
    """Which shard this graph was captured for."""
    segments: tuple[int, ...] = ()
    """Per-rank batches: the rows each member of this shard fed (the shard's rows are theirs, in order);
    a reduction over the batch is taken per member. Empty for a global batch."""


@dataclass(frozen=True)
class GraphInfo:
    """What autopar records on a captured graph as a whole: ``gm.meta["autopar"]`` (``graph_info``)."""

    batch: BatchInfo | None = None
    """How the global batch was split for this capture (None: not split)."""
    batch_constants: dict[str, dict[int, Any]] = field(default_factory=dict)
    """Numbers the model computes from the batch size: node name -> {position among its flattened arguments:
    value per row} (``batch_dims.batch_constants``; ``split_batch`` gives them the whole batch's value)."""
    kept_outputs: frozenset[int] = frozenset()
    """Output positions returned split, not gathered (state passed back in: a key/value cache)."""
    rows_compared: bool = False
    """Each op's ``RowsInfo`` was recorded from a capture with twice the rows (``row_extents``)."""


def graph_info(gm: fx.GraphModule) -> GraphInfo:
    """``gm``'s GraphInfo (empty for a graph autopar did not capture)."""
    info = gm.meta.get("autopar")
    return info if isinstance(info, GraphInfo) else GraphInfo()


def record_graph_info(gm: fx.GraphModule, **fields: Any) -> None:
    """Sets fields of ``gm``'s GraphInfo (the others stay)."""
    gm.meta["autopar"] = replace(graph_info(gm), **fields)


@dataclass(frozen=True, slots=True)
class Sharding:
    """How one tensor is laid out over the tensor-parallel grid.

    Either replicated, or dim ``dim`` is split over the mesh axis ``layout`` (row or col) and the
    tensor is replicated over the other axes. The split dim is a concatenation of segments of
    logical sizes ``parts`` (one segment, or e.g. q/k/v of a fused projection); each segment is
    split evenly, and a rank holds its piece of every segment, in order.
    """

    layout: Layout = Layout.REPLICATED
    dim: int = -1
    """Non-negative index of the split dim (-1 when replicated)."""
    parts: tuple[int, ...] = ()

    @property
    def is_replicated(self) -> bool:
        return self.layout is Layout.REPLICATED

    @property
    def axis(self) -> str:
        return "" if self.is_replicated else self.layout.value

    @property
    def full_size(self) -> int:
        return sum(self.parts)

    def __str__(self) -> str:
        if self.is_replicated:
            return "replicated"
        fused = f" in {'+'.join(map(str, self.parts))}" if len(self.parts) > 1 else ""
        return f"dim {self.dim} over {self.layout.value}{fused}"


REPLICATED = Sharding()


def last_dim(layout: Layout, size: int, ndim: int, parts: tuple[int, ...] = ()) -> Sharding:
    """The sharding that splits the last dim (features) over ``layout``."""
    if layout is Layout.REPLICATED:
        return REPLICATED
    return Sharding(layout, ndim - 1, parts or (size,))


@dataclass(frozen=True, slots=True)
class MatmulSpec:
    weight: str
    orientation: Orientation
    in_features: int
    out_features: int
    weight_in_out: bool
    has_bias: bool
    out_parts: tuple[int, ...] = ()
    scatter_dim: int = -1
    """Sequence parallelism: the output's partial sums are reduce-scattered along this dim (its tokens) over
    ``orientation.in_axis`` instead of all-reduced; backward all-gathers the gradient along it (-1: off)."""
    partial_dx: bool = False
    """The input's gradient is left partial over ``orientation.out_axis``: the gather that made the input
    (``ConvertSpec.partial_grad``) reduce-scatters it, in place of this matmul's all-reduce."""


@dataclass(frozen=True, slots=True)
class EmbeddingSpec:
    weight: str
    mode: EmbeddingMode
    axis: str
    num_embeddings: int
    scatter_dim: int = -1
    """Sequence parallelism: a vocabulary-split lookup's partial rows are reduce-scattered along this dim (its
    tokens) instead of all-reduced; backward all-gathers the gradient along it (-1: off)."""


@dataclass(frozen=True, slots=True)
class ConvertSpec:
    src: Sharding
    dst: Sharding
    partial_grad: bool = False
    """Every reader of the gathered tensor leaves its gradient partial over ``src.axis`` (``MatmulSpec.partial_dx``):
    backward reduce-scatters it along ``src.dim`` (sequence parallelism's all-gather / reduce-scatter pair)."""


@dataclass(frozen=True, slots=True)
class ReduceSpec:
    """A sum or mean over a split dim computed on local pieces: completed by an all-reduce."""

    axis: str
    mean: bool


@dataclass(frozen=True, slots=True)
class BatchReduceSpec:
    """A sum (or mean) over the batch of values computed per row: see ``batch_reduce``."""

    mean: bool
    factor: int = 1
    """Entries of dim 0 per batch row (a (B*T, ...) tensor of per-token values: T); 0 where that is a
    symbolic length (the runtime counts them at each call, as it does for every bound batch op)."""
    count_per_row: int | None = None
    """mean without a ``counts`` tensor: the serial mean divides by (entries of dim 0) x this."""
    context: bool = False
    """The values hold this rank's tokens of each row (context parallelism, ``passes.split_context``): the sums
    are completed over the context ranks too."""


@dataclass(frozen=True, slots=True)
class VocabLossSpec:
    """``cross_entropy_loss`` on logits whose class dim is split over ``axis`` (vocabulary-parallel): the
    arguments of the op it replaces, with torch's reduction enum (0 none, 1 mean, 2 sum)."""

    axis: str
    class_dim: int
    reduction: int
    ignore_index: int
    label_smoothing: float
    vocab: int
    """Classes in all (this rank holds ``vocab / ranks`` of them, in order)."""


@dataclass(frozen=True, slots=True)
class GatherRowsSpec:
    """Where a SPLIT tensor holds its rows (see ``passes.analysis.batch_dims.BatchDim``; the markers read
    tensors whose rows come first in ``dim``: ``split_batch`` unflattens any blocks before them)."""

    dim: int
    factor: int = 1


@dataclass(frozen=True, slots=True)
class GatherOutputSpec:
    sharding: Sharding
    batch_split: bool
    batch_dim: int = 0
    """With ``batch_split``: the dim holding the rows, ``batch_factor`` entries per row."""
    batch_factor: int = 1
    batch_state: str = "split"
    """"split" (this rank's rows), "whole" (computed from the whole batch, e.g. a loss inside forward), "none"
    (computed without the batch), "local" (computed from this rank's rows only, holding none of them: the
    batch ranks' values are averaged, as DDP averages its ranks' losses) or "per-rank" (this rank's own value,
    where no average means anything: integers, rows in a layout autopar did not follow): how it is made full
    and how its gradient is shared between the batch ranks."""
    keep_split: bool = False
    """Returned as this rank's piece of a sharded tensor (a DTensor) instead of gathered: state the caller
    passes back in (a key/value cache), which the next call then reads in place."""


@dataclass(frozen=True, slots=True)
class ExpertSpec:
    """A routed-experts layer whose experts are split over ``axis``: ``experts`` in all, consecutive blocks of
    ``experts / size`` on each rank (``passes.split_experts``)."""

    axis: str
    experts: int
    module: str = ""
    batched: bool = False
    """The layer's rows are ``[experts, rows, features]``, a block per expert (batched matmuls, no offsets)."""
    lent: str = ""
    """A tensor axis among ``axis`` ("data+row": whole experts over data x row), whose ranks hold the same rows:
    each sends its block of them (of dim 0, or of dim 1 when ``batched``), and the results come back gathered
    over it; '' for none."""


@dataclass(frozen=True, slots=True)
class ContextSpec:
    """Where a tensor holds the sequence's tokens under context parallelism (``passes.split_context``): dim
    ``dim`` has ``outer * tokens * inner`` entries whole (``outer`` rows merged before the tokens, ``inner``
    entries of each token after them: a ``[batch * tokens, vocab]`` view has outer = batch); this rank holds two
    of ``2 * ranks`` equal chunks of the tokens, ``i`` and ``2 * ranks - 1 - i``, in that order."""

    dim: int
    tokens: int
    ranks: int
    outer: int = 1
    inner: int = 1
    split: bool = True
    """``context_output`` only: whether the output holds this rank's tokens (else it is whole)."""
    reduced: bool = False
    """``context_output`` only: the output is a ``batch_reduce``'s (a loss): under per-rank batches each rank's
    is its own rows' (``SegmentReduceOp``), whose backward gathers every rank's gradient itself."""


@dataclass(frozen=True, slots=True)
class ContextDropoutSpec:
    """``dropout`` on this rank's tokens (``tokens``), and on its piece of a tensor axis's split (``piece``, a
    ``split_dropout``'s sharding, its tokens' segment this rank's under sequence parallelism; None where no tensor
    axis splits it): the mask is drawn for the whole tensor and this rank keeps its part."""

    tokens: ContextSpec
    piece: Sharding | None = None


@dataclass(frozen=True, slots=True)
class ContextAttentionSpec:
    """``scaled_dot_product_attention`` on this rank's queries (``passes.split_context``): its arguments, and
    whether the keys and values hold this rank's tokens (gathered over the context ranks first) or all of them."""

    tokens: int
    ranks: int
    is_causal: bool
    scale: float | None = None
    enable_gqa: bool = False
    gather_kv: bool = True


class UnboundOpError(RuntimeError):
    pass


def sharded_matmul(x, weight, bias, spec: MatmulSpec):
    """``x @ W^T + b`` with W cut 3D-wise per ``spec.orientation`` (AxoNN). Input layout is
    ``spec.orientation.in_layout``, output layout ``out_layout``."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def sharded_embedding(weight, indices, padding_idx, spec: EmbeddingSpec):
    """``embedding(weight, indices)`` with the table split per ``spec.mode`` over ``spec.axis``."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def reduce_partial(x, spec: ReduceSpec):
    """Completes a sum/mean that each rank computed over its piece of a split dim."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def sum_grad(x, axis: str):
    """Identity forward; backward sums the gradient over ``axis`` (a replicated tensor that fed
    computations split over the axis)."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def batch_reduce(values, counts, spec: BatchReduceSpec):
    """Sums ``values`` (dim 0: the entries of this rank's rows) over the whole batch; with ``spec.mean``,
    divides by the count (the sum of ``counts``, or the entries x ``spec.count_per_row``). The result's
    gradient arrives in parts (one per batch rank): backward sums them and gives each rank's values the
    whole of it."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def vocab_cross_entropy(logits, target, spec: VocabLossSpec):
    """``cross_entropy_loss(logits, target)`` where each rank holds a piece of the classes: the row max,
    the sum of exponentials and the target's logit are completed by all-reduces of one value per row over
    ``spec.axis``; the full logits are never built. The result is replicated over the axis."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def gather_rows(x, spec: GatherRowsSpec):
    """This rank's rows of ``x`` -> the whole batch's, on every batch rank. The gradient of the whole batch
    arrives in parts (one per batch rank); backward sums them and keeps this rank's rows (reduce-scatter)."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def scatter_rows(x, spec: GatherRowsSpec):
    """The whole batch's rows (the same on every batch rank) -> this rank's rows; backward puts this rank's
    rows' gradient in a zero tensor of the whole batch (a part: the batch ranks' parts sum to it)."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def convert_layout(x, spec: ConvertSpec):
    """Re-lays out ``x`` from sharding ``spec.src`` to ``spec.dst`` (gather, then slice)."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def split_dropout(x, p, train, spec: Sharding):
    """``dropout(x, p, train)`` where ``x`` is this rank's piece (``spec``) of a tensor split over a tensor
    axis: the piece is multiplied by its part of the mask dropout draws for the whole tensor, so the masks
    are the unsplit tensor's (neither repeated across the ranks' pieces nor changed by the grid)."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def split_random(op, args, kwargs, spec: Sharding):
    """``op(*args, **kwargs)``, a random op (``torch.Tag.nondeterministic_seeded``: SDPA with dropout,
    ``bernoulli``, ``rand_like``) whose output is this rank's piece (``spec``) of a tensor split over a tensor
    axis: it draws from a generator state forked by the piece's index, so the pieces' draws differ, as the
    whole tensor's do."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def expert_dispatch(rows, offsets, inputs, spec: ExpertSpec):
    """Rows sorted by expert (``offsets``: their running count per expert) -> (the rows of this rank's experts,
    from every rank of ``spec.axis``, by local expert; their offsets; the same rows of each of ``inputs``; the
    routes ``expert_combine`` takes). Backward sends the rows' gradients back. ``spec.batched``: ``rows`` is
    ``[experts, rows, features]`` and ``offsets`` None; this rank's are ``[local experts, rows received,
    features]`` and its offsets None."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def expert_combine(x, routes, spec: ExpertSpec):
    """The results of the rows ``expert_dispatch`` moved (``routes``), back on the ranks they came from, in
    their order. Backward sends the gradients to the experts' ranks."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def context_slice(x, spec: ContextSpec):
    """A whole-sequence tensor (the same on every context rank) -> this rank's tokens; backward puts their
    gradient in zeros of the whole (a part: the context ranks' parts sum to it). No communication."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def context_gather(x, spec: ContextSpec):
    """This rank's tokens -> the whole sequence in order, on every context rank (all-gather); backward sums
    the ranks' parts of the gradient and keeps this rank's tokens (reduce-scatter)."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def context_reduce(x, spec: ContextSpec):
    """A sum each context rank computed over its tokens, completed over the context ranks (all-reduce);
    backward sums the gradient's parts."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def context_dropout(x, p, train, spec: ContextDropoutSpec):
    """``dropout(x, p, train)`` on this rank's tokens (and piece): every context rank draws the mask dropout
    draws for the whole tensor, in serial's order, and keeps its tokens' part, so the masks are serial's."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def context_attention(q, k, v, mask, spec: ContextAttentionSpec):
    """Attention of this rank's queries over the whole sequence: keys and values gathered over the context
    ranks (``spec.gather_kv``) in order, a causal mask made from the tokens' positions (``spec.is_causal``) or
    ``mask`` (its query rows this rank's)."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def context_output(x, spec: ContextSpec):
    """A model output made whole on every context rank (tokens gathered when ``spec.split``); the caller's
    gradient of it, the same on every rank, is kept on one so that the ranks' parts sum to it once."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def gather_output(x, spec: GatherOutputSpec):
    """Makes a model output full on every rank: features gathered, then batch rows gathered."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


SPEC_TYPES = (Layout, Orientation, EmbeddingMode, Sharding, MatmulSpec, EmbeddingSpec, ConvertSpec, ReduceSpec,
              GatherOutputSpec, BatchReduceSpec, GatherRowsSpec, ExpertSpec, ContextSpec, ContextAttentionSpec,
              ContextDropoutSpec)
"""The types whose values marker ops take as arguments."""

_spec_names_depth = 0
_spec_names_undo: list = []


@contextlib.contextmanager
def spec_names() -> Iterator[None]:
    """Inside, fx's generated code names the spec types (``ConvertSpec(src=Layout.ROW, ...)``), so graphs holding
    specs recompile and print as runnable code; the names go on the way out (re-entrant). The transforms run
    inside it (``passes.runner.run_passes``); the runtime's binding takes the specs out of the graph."""
    global _spec_names_depth
    if _spec_names_depth == 0:
        for obj in SPEC_TYPES:
            module = "autopar.decisions" if obj in (Layout, Orientation, EmbeddingMode) else __name__
            _spec_names_undo.append(register_fx_builtin(obj.__name__, f"from {module} import {obj.__name__}", obj))
    _spec_names_depth += 1
    try:
        yield
    finally:
        _spec_names_depth -= 1
        if _spec_names_depth == 0:
            while _spec_names_undo:
                _spec_names_undo.pop()()


def input_info(node: fx.Node) -> InputInfo | None:
    info = node.meta.get("autopar")
    return info if isinstance(info, InputInfo) else None


def rows_info(node: fx.Node) -> RowsInfo | None:
    info = node.meta.get("autopar")
    return info if isinstance(info, RowsInfo) else None
