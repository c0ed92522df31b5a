"""What the planner decided (Plan) for a ParallelConfig, and the bytes collectives send. Leaf module
besides ``autopar.config``.

Frozen and identical on every rank. The Plan is keyed by stable names (parameter FQNs, module FQNs),
never by FX node names, so one Plan applies to every capture of the same model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from typing import Any

from autopar.config import ParallelConfig


class _CodeEnum(StrEnum):
    """A StrEnum whose repr is valid Python (``Layout.ROW``), so FX code that holds one compiles."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Layout(_CodeEnum):
    """How an activation's last (feature) dimension is laid out over the tensor-parallel grid."""

    REPLICATED = "replicated"
    ROW = "row"  # split over the row axis, replicated over col
    COL = "col"  # split over the col axis, replicated over row


class Orientation(_CodeEnum):
    """How a matmul's weight is cut over (row, col). See DESIGN-NOTES section 1."""

    NORMAL = "normal"  # out features over row, in features over col: input COL -> output ROW
    TRANSPOSED = "transposed"  # out features over col, in features over row: input ROW -> output COL
    REPLICATED = "replicated"  # not sharded: full weight, input and output REPLICATED
    OUT_ROW = "out-row"  # output features over row only (Megatron column-parallel): input REPLICATED -> ROW
    OUT_COL = "out-col"  # output features over col only: input REPLICATED -> COL

    @property
    def is_3d(self) -> bool:
        return self in (Orientation.NORMAL, Orientation.TRANSPOSED)

    @property
    def is_sharded(self) -> bool:
        return self is not Orientation.REPLICATED

    @property
    def in_layout(self) -> Layout:
        return {Orientation.NORMAL: Layout.COL, Orientation.TRANSPOSED: Layout.ROW}.get(self, Layout.REPLICATED)

    @property
    def out_layout(self) -> Layout:
        return {Orientation.NORMAL: Layout.ROW, Orientation.TRANSPOSED: Layout.COL, Orientation.OUT_ROW: Layout.ROW,
                Orientation.OUT_COL: Layout.COL}.get(self, Layout.REPLICATED)

    @property
    def out_axis(self) -> str:
        """The mesh axis splitting the output features."""
        return "col" if self in (Orientation.TRANSPOSED, Orientation.OUT_COL) else "row"

    @property
    def in_axis(self) -> str:
        """The mesh axis splitting the input features ('' when the input is replicated)."""
        return {Orientation.NORMAL: "col", Orientation.TRANSPOSED: "row"}.get(self, "")


class ParamKind(_CodeEnum):
    WEIGHT_3D = "weight3d"  # (out, in) block over (row, col), flattened and split over depth
    BIAS = "bias"  # split over the axis that splits the matmul's output
    SPLIT = "split"  # one dim split over one axis (vocab/hidden-parallel tables, OUT_* weights)
    REPLICATED = "replicated"  # full on every rank


class EmbeddingMode(_CodeEnum):
    VOCAB = "vocab"  # rows (tokens) split over an axis: masked local lookup, all-reduce of the output
    HIDDEN = "hidden"  # columns (features) split over an axis: local lookup, output sharded, no comm
    REPLICATED = "replicated"


def split_chunks(parts: tuple[int, ...], n: int, index: int) -> list[tuple[int, int]]:
    """(start, length) of rank ``index``'s piece of each segment of a dim made of ``parts``.

    A sharded dim is a concatenation of segments (one, or q/k/v of a fused projection); each
    segment is split over the ``n`` ranks of the axis, and a rank keeps its piece of each. A segment
    that does not divide (a vocabulary of 50257 over 4) is split as ``torch.chunk`` and DTensor's
    ``Shard`` split it: pieces of ``ceil(size / n)``, the last rank's smaller (``uneven_split``).
    """
    out, start = [], 0
    for size in parts:
        k = -(-size // n)
        first = min(index * k, size)
        out.append((start + first, min(k, size - first)))
        start += size
    return out


def uneven_split(size: int, n: int) -> bool:
    """Whether one segment of ``size`` may be split over ``n`` ranks unevenly (``split_chunks``): it does not
    divide, and every rank still gets a piece (9 over 4 would leave the last rank none: 3+3+3+0)."""
    return size % n != 0 and size >= n and (n - 1) * -(-size // n) < size


@dataclass(frozen=True, slots=True)
class MatmulPlan:
    """The decision for one matmul whose weight is a 2-D parameter."""

    weight: str
    """FQN of the weight parameter: the stable key."""
    module: str
    """FQN of the module that ran the matmul ('' for the root)."""
    op: str
    """ATen op name (linear, addmm, mm, matmul)."""
    in_features: int
    out_features: int
    weight_in_out: bool
    """True when the weight is stored (in, out), as in HF's Conv1D (addmm); False for nn.Linear's (out, in)."""
    bias: str | None
    orientation: Orientation
    reason: str = ""
    """Why the matmul stays replicated ('' when it is sharded)."""
    out_parts: tuple[int, ...] = ()
    """Segments of the output features each split on its own (fused q/k/v); () means one."""

    @property
    def parts(self) -> tuple[int, ...]:
        return self.out_parts or (self.out_features,)


@dataclass(frozen=True, slots=True)
class EmbeddingPlan:
    """The decision for one embedding lookup (``aten.embedding``) on a 2-D parameter."""

    weight: str
    module: str
    num_embeddings: int
    embedding_dim: int
    mode: EmbeddingMode
    axis: str = ""
    """Mesh axis splitting the table (row or col); '' when replicated."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ParamPlan:
    """How one parameter is stored on each rank and how its gradient is completed."""

    name: str
    shape: tuple[int, ...]
    kind: ParamKind
    orientation: Orientation = Orientation.REPLICATED
    """For WEIGHT_3D and BIAS: the orientation of the matmul that uses it."""
    weight_in_out: bool = False
    grad_axes: tuple[str, ...] = ("data", "depth")
    """Mesh axes over which this parameter's gradient is summed after backward."""
    parts: tuple[int, ...] = ()
    """Segments of the split dim (WEIGHT_3D and BIAS: the output features; SPLIT: ``split_dim``)."""
    split_axis: str = ""
    """SPLIT only: the mesh axis splitting ``split_dim``."""
    split_dim: int = 0
    second_axis: str = ""
    """SPLIT only: a second mesh axis splitting another dim, ``second_dim`` (routed experts split over data on dim 0,
    each split over a tensor axis on its hidden features); '' for none."""
    second_dim: int = 0
    second_parts: tuple[int, ...] = ()
    """Segments of ``second_dim`` (as ``parts``)."""

    def local_numel(self, config: ParallelConfig) -> int:
        """Elements of this parameter on a rank; split unevenly (``uneven_split``): on the ranks with the
        largest piece (the first ones)."""
        numel = 1
        for s in self.shape:
            numel *= s
        if self.kind is ParamKind.WEIGHT_3D:
            return numel // (config.row * config.col * config.depth)
        if self.kind is ParamKind.SPLIT and self.second_axis:
            return math.prod(self.local_shape(config))
        if self.kind in (ParamKind.BIAS, ParamKind.SPLIT):
            n = config.size(self.orientation.out_axis if self.kind is ParamKind.BIAS else self.split_axis)
            size = self.shape[0 if self.kind is ParamKind.BIAS else self.split_dim]
            return numel // size * -(-size // n)
        return numel

    def splits_over_data(self, config: ParallelConfig) -> bool:
        """Split over the data ranks itself (experts under ``expert_parallel``): each data rank holds and updates
        its own part, so ``shard_optimizer`` leaves its state and gradient as they are."""
        return self.kind is ParamKind.SPLIT and "data" in self.split_axis.split("+") and config.data > 1

    def local_shape(self, config: ParallelConfig) -> tuple[int, ...]:
        """The shape of this parameter's piece on a rank (the largest one where a split is uneven)."""
        shape = list(self.shape)
        for dim, n in self.split_dims(config).items():
            shape[dim] = -(-shape[dim] // n)
        return tuple(shape)

    def split_dims(self, config: ParallelConfig) -> dict[int, int]:
        """The dims of this parameter the tensor axes split, and into how many pieces each."""
        return {dim: math.prod(sizes) for dim, sizes in self.split_axes(config).items()}

    def fused_dims(self, config: ParallelConfig) -> frozenset[int]:
        """The split dims that hold fused pieces (``parts``), each split over its axis: a strided shard."""
        if self.kind is ParamKind.SPLIT and len(self.second_parts) > 1 and config.size(self.second_axis) > 1:
            return frozenset({self.second_dim}) | ParamPlan.fused_dims(dataclasses.replace(self, second_parts=()),
                                                                       config)
        if len(self.parts) < 2:
            return frozenset()
        if self.kind is ParamKind.SPLIT:
            return frozenset({self.split_dim}) if config.size(self.split_axis) > 1 else frozenset()
        if self.kind in (ParamKind.WEIGHT_3D, ParamKind.BIAS) and config.size(self.orientation.out_axis) > 1:
            return frozenset({1 if self.kind is ParamKind.WEIGHT_3D and self.weight_in_out else 0})
        return frozenset()

    def split_axes(self, config: ParallelConfig) -> dict[int, tuple[int, ...]]:
        """The dims of this parameter the tensor axes split, and the sizes of the axes splitting each."""
        out: dict[int, tuple[int, ...]] = {}

        def split(dim: int, n: int) -> None:
            if n > 1:
                out[dim] = (*out.get(dim, ()), n)

        o = self.orientation
        if self.kind is ParamKind.WEIGHT_3D:
            out_dim, in_dim = (1, 0) if self.weight_in_out else (0, 1)
            split(out_dim, config.size(o.out_axis))
            split(in_dim, config.size(o.in_axis))
            split(0, config.depth)  # the block's rows, again over depth
        elif self.kind is ParamKind.BIAS:
            split(0, config.size(o.out_axis))
        elif self.kind is ParamKind.SPLIT:
            split(self.split_dim, config.size(self.split_axis))
            if self.second_axis:
                split(self.second_dim, config.size(self.second_axis))
        return out


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Predicted memory per rank for one training step, and which blocks are recomputed."""

    checkpoint: str
    """The policy: auto, none, full or budget."""
    budget_bytes: int | None
    """The per-device budget the choice had to fit (None for none/full)."""
    recompute: tuple[str, ...]
    """Blocks (module FQNs) recomputed in backward."""
    blocks: tuple[str, ...]
    """Every block that could be recomputed."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Predicted activation peak with ``recompute``."""
    activation_bytes_no_checkpoint: int
    recompute_flops: int
    """Forward FLOPs recomputed in backward, this rank."""
    step_flops: int
    """Forward + backward matmul FLOPs of one step without recomputation, this rank."""
    fits: bool = True
    """False when even recomputing every block exceeds the budget (then every block is recomputed)."""
    headroom_bytes: int = 0
    """Kept free under a budget: one largest tensor, for transients the prediction does not see."""
    construction_bytes: int = 0
    """Peak while the model is built (autopar.runtime.construction.record): the parameters plus the largest one whole."""
    compiled: bool = False
    """Counted as a compiled step holds it (``compile=``: ``estimate_memory.compiled_recompute``)."""

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        return self.static_bytes + self.activation_bytes

    def summary(self) -> str:
        mib = 2.0 ** 20
        lines = [f"memory per rank ({self.checkpoint}" + (", compiled" if self.compiled else "")
                 + (f", budget {self.budget_bytes / mib:,.1f} MiB" if self.budget_bytes else "") + "): "
                 f"parameters {self.param_bytes / mib:,.1f} MiB, gradients {self.grad_bytes / mib:,.1f} MiB, "
                 f"optimizer {self.optimizer_bytes / mib:,.1f} MiB, activations "
                 f"{self.activation_bytes / mib:,.1f} MiB (without checkpointing "
                 f"{self.activation_bytes_no_checkpoint / mib:,.1f} MiB); peak {self.peak_bytes / mib:,.1f} MiB"]
        if self.construction_bytes:
            lines.append(f"construction peak {self.construction_bytes / mib:,.1f} MiB (this rank's parameters and "
                         "the largest one whole while it is initialized)")
        if self.budget_bytes and self.construction_bytes > self.budget_bytes:
            lines.append(f"DOES NOT FIT: building the model needs {self.construction_bytes / mib:,.1f} MiB")
        if not self.fits:
            lines.append(f"DOES NOT FIT: the budget of {self.budget_bytes / mib:,.1f} MiB is exceeded even with "
                         "every block recomputed")
        if self.recompute:
            overhead = self.recompute_flops / self.step_flops if self.step_flops else 0.0
            lines.append(f"recomputed in backward: {len(self.recompute)}/{len(self.blocks)} blocks "
                         f"(+{overhead:.1%} FLOPs): {_ranges(self.recompute)}")
        return "\n".join(lines)


def _uneven(size: int, n: int, axis: str) -> str:
    """' (split unevenly: ...)' for a dim of ``size`` split over ``n`` ranks that does not divide, else ''."""
    if n <= 1 or size % n == 0:
        return ""
    pieces = [length for _, length in (split_chunks((size,), n, i)[0] for i in range(n))]
    return f" (split unevenly over {axis}={n}: {'+'.join(map(str, pieces))})"


def _seconds(x: float) -> str:
    return f"{x * 1e3:.3f} ms" if x >= 1e-3 else f"{x * 1e6:.3f} us"


def _ranges(names: tuple[str, ...]) -> str:
    """``a.0, a.1, a.2, a.5`` -> ``a.0-2, a.5``."""
    out: list[list] = []
    for name in names:
        head, _, index = name.rpartition(".")
        if index.isdigit() and out and out[-1][0] == head and out[-1][2] == int(index) - 1:
            out[-1][2] = int(index)
        else:
            out.append([head, int(index) if index.isdigit() else index, int(index) if index.isdigit() else index])
    return ", ".join((f"{h}.{a}" if h else f"{a}") + (f"-{b}" if b != a else "") for h, a, b in out)


@dataclass(frozen=True, slots=True)
class StagePlan:
    segments: tuple[str, ...]
    """Blocks (module FQNs) and ``<outside>#k`` runs, in order."""
    seconds: float
    """Predicted time of one micro-batch's forward + backward on this stage."""
    param_bytes: int
    """This rank's fp32 parameters the stage reads (a weight shared with another stage counts in both)."""


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """Pipeline stages chosen by cost (passes/analysis/choose_stages.py); planned, not yet run."""

    stages: tuple[StagePlan, ...]
    bottleneck_seconds: float
    lower_bound_seconds: float
    """No partition can beat this (average stage, or the largest block)."""
    num_microbatches: int
    bubble_fraction: float
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Parameters read by more than one stage (tied embeddings): (name, the stages holding a copy);
    their gradients are summed over those stages."""
    chunks_per_rank: int = 1
    """Stages per rank (interleaved schedules): stage k runs on rank k mod (number of ranks)."""
    schedule: str = ""
    """The torch schedule that runs the stages ('' when only planned: the trace)."""
    rates: str = ""
    """The machine whose rates priced the stages (``choose_stages.Hardware.name``)."""

    @property
    def ranks(self) -> int:
        """Pipeline ranks (stages / stages per rank)."""
        return len(self.stages) // self.chunks_per_rank

    def stages_of(self, rank: int) -> list[StagePlan]:
        """The stages pipeline rank ``rank`` runs (stage k on rank k mod ranks)."""
        return [st for k, st in enumerate(self.stages) if k % self.ranks == rank]

    def summary(self) -> str:
        mib = 2.0 ** 20
        ranks = self.ranks
        shape = (f"{len(self.stages)} stages" if self.chunks_per_rank == 1 else
                 f"{ranks} ranks x {self.chunks_per_rank} interleaved stages")
        schedule = self.schedule or ("1F1B" if self.chunks_per_rank == 1 else "interleaved 1F1B")
        lines = [f"pipeline: {shape}, {self.num_microbatches} micro-batches; bottleneck "
                 f"{_seconds(self.bottleneck_seconds)} per micro-batch "
                 f"({self.bottleneck_seconds / self.lower_bound_seconds:.3f}x the lower bound), predicted "
                 f"bubble {self.bubble_fraction:.1%} ({schedule})"
                 + (f"; stages cut for {self.rates} rates" if self.rates else "")]
        for k, st in enumerate(self.stages):
            where = f" (rank {k % ranks})" if self.chunks_per_rank > 1 else ""
            lines.append(f"  stage {k}{where}: {_ranges(st.segments)}  {_seconds(st.seconds)}, "
                         f"parameters {st.param_bytes / mib:,.1f} MiB")
        for name, stages in self.shared:
            lines.append(f"  shared by stages {', '.join(map(str, stages))} (gradients summed): {name}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    """A routed-experts layer (``passes.analysis.experts``) and how its experts are laid out."""

    module: str
    weights: tuple[str, ...]
    experts: int
    axis: str = ""
    """The mesh axis splitting the experts (each rank ``experts / size`` whole ones); '' for whole on every rank;
    axes joined by '+' ("data+row", ``ParallelConfig.expert_axis``) for whole experts over data x a tensor axis."""
    reason: str = ""
    """Why the experts stay whole ('' where they are split)."""
    tensor_axis: str = ""
    """The tensor axis (row or col) splitting each expert's hidden features (``passes.analysis.experts.tensor_split``);
    '' where each expert stays whole on the tensor ranks."""
    batched: bool = False
    """Every token goes to every expert in blocks (Llama 4's ``bmm`` of ``[experts, tokens, hidden]``): the bytes
    its exchange moves do not depend on the routing."""

    @property
    def lent(self) -> str:
        """The tensor axis among ``axis`` ('' for none): its ranks hold the same rows, and each sends a block of
        them to the experts' ranks (``passes.ir.ExpertSpec.lent``)."""
        return lent_axis(self.axis)


def lent_axis(axis: str) -> str:
    """The tensor axis (row or col) among mesh axes joined by '+' (an expert axis), '' for none."""
    return next((a for a in axis.split("+") if a in ("row", "col")), "")


@dataclass(frozen=True, slots=True)
class Plan:
    """Every decision the planner made for one model under one ParallelConfig."""

    config: ParallelConfig
    matmuls: tuple[MatmulPlan, ...]
    params: tuple[ParamPlan, ...]
    notes: tuple[str, ...] = ()
    embeddings: tuple[EmbeddingPlan, ...] = ()
    memory: MemoryPlan | None = None
    pipeline: PipelinePlan | None = None
    experts: tuple[ExpertPlan, ...] = ()
    context_whole: tuple[str, ...] = ()
    """Under context parallelism, the nodes of the captured graph that compute every context rank's tokens
    (``passes.split_context.whole_reads``: after a read of the whole sequence): priced and kept whole."""
    _by_weight: dict[str, MatmulPlan] = field(default_factory=dict, compare=False, repr=False)
    _by_param: dict[str, ParamPlan] = field(default_factory=dict, compare=False, repr=False)
    _by_table: dict[str, EmbeddingPlan] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_weight.update({m.weight: m for m in self.matmuls})
        self._by_param.update({p.name: p for p in self.params})
        self._by_table.update({e.weight: e for e in self.embeddings})

    def matmul(self, weight: str) -> MatmulPlan | None:
        return self._by_weight.get(weight)

    def embedding(self, weight: str) -> EmbeddingPlan | None:
        return self._by_table.get(weight)

    def param(self, name: str) -> ParamPlan:
        return self._by_param[name]

    def whole_share(self, weight: str) -> int:
        """How many ranks share the work of a matmul-like op left whole (``passes.analysis.whole_matmuls``) on
        ``weight``: the ranks of the tensor axis an expert's hidden features split over, else 1."""
        p = self._by_param.get(weight)
        if p is None or p.kind is not ParamKind.SPLIT:
            return 1
        axis = p.second_axis or lent_axis(p.split_axis)  # (whole experts over data x a tensor axis: its ranks
        return self.config.size(axis) if axis else 1  # share each data rank's rows)

    def to_dict(self) -> dict[str, Any]:
        def enc(obj: Any) -> Any:
            if dataclasses.is_dataclass(obj):
                return {f.name: enc(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                        if not f.name.startswith("_")}
            if isinstance(obj, (tuple, list)):
                return [enc(o) for o in obj]
            return obj
        return enc(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """A short human-readable account of the decisions (the CLI prints a longer table)."""
        c = self.config
        sharded = [m for m in self.matmuls if m.orientation is not Orientation.REPLICATED]
        lines = [f"autopar plan: {c} on {c.world_size} ranks; "
                 f"{len(sharded)}/{len(self.matmuls)} matmuls on 2-D weights sharded"]
        for m in self.matmuls:
            what = m.orientation.value if not m.reason else f"replicated ({m.reason})"
            if len(m.parts) > 1:
                what += f" (fused {'+'.join(map(str, m.parts))})"
            if m.orientation.is_sharded and len(m.parts) <= 1:
                what += _uneven(m.out_features, c.size(m.orientation.out_axis), m.orientation.out_axis)
            lines.append(f"  {m.weight:<40} {m.op:<7} {m.in_features:>6} -> {m.out_features:<6} {what}")
        for e in self.embeddings:
            what = f"{e.mode.value}-parallel over {e.axis}" if e.axis else f"replicated ({e.reason})"
            if e.axis and e.mode is EmbeddingMode.VOCAB:
                what += _uneven(e.num_embeddings, c.size(e.axis), e.axis)
            lines.append(f"  {e.weight:<40} {'lookup':<7} {e.num_embeddings:>6} x {e.embedding_dim:<6} {what}")
        for e in self.experts:
            if e.axis:
                each = f", each split over {e.tensor_axis} (1/{c.size(e.tensor_axis)} per rank)" if e.tensor_axis else ""
                per = e.experts // c.size(e.axis)
                lent = f" (the {e.lent} ranks each send a block of their rows)" if e.lent else ""
                lines.append(f"  {e.module:<40} experts {e.experts} split over {e.axis.replace('+', ' x ')}: {per} "
                             f"whole expert{'s' if per > 1 else ''} per rank{each}, rows exchanged by all-to-all{lent}")
            elif e.tensor_axis:
                lines.append(f"  {e.module:<40} experts {e.experts} each split over {e.tensor_axis}: 1/"
                             f"{c.size(e.tensor_axis)} of every expert per rank, results all-reduced")
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.memory is not None:
            lines.extend(f"  {line}" for line in self.memory.summary().splitlines())
        return "\n".join(lines)


# ---- communication accounting (bytes a rank sends under ring algorithms) ------------------------------

COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "all_to_all")


def collective_bytes(kind: str, group_size: int, message_bytes: int) -> Fraction:
    """Bytes one rank sends for one collective, as an exact fraction.

    ``message_bytes`` is the output size for all-gather, the input size for reduce-scatter and the
    tensor size otherwise; for all-to-all it is what this rank sends to the other ranks (the rows it keeps
    are not sent), taken as it is. A group of one sends nothing.
    """
    p = group_size
    if p <= 1:
        return Fraction(0)
    if kind == "all_reduce":
        return Fraction(2 * (p - 1) * message_bytes, p)
    if kind == "all_to_all":
        return Fraction(message_bytes)
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return Fraction((p - 1) * message_bytes, p)
    if kind == "send":
        return Fraction(message_bytes)
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
