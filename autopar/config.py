"""What the user asked for (ParallelConfig) and what the compiler decided (Plan). Leaf module.

Both are frozen and identical on every rank. The Plan is keyed by stable names (parameter FQNs,
module FQNs), never by FX node names, so one Plan applies to every capture of the same model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from typing import Any

from autopar.errors import ConfigError

#: Mesh axes, outermost first. ``col`` varies fastest between consecutive ranks, so it is placed on
#: the fastest links (as AxoNN does); ``data`` is outermost, then ``pipeline`` (stages exchange one
#: activation per micro-batch, less than tensor parallelism moves).
MESH_AXES: tuple[str, ...] = ("data", "pipeline", "depth", "row", "col")

#: Pipeline schedules of torch.distributed.pipelining that autopar drives (runtime.schedule_class).
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "looped-bfs")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """The parallel degrees the user asked for.

    Rank placement is row-major over ``MESH_AXES`` = (data, pipeline, depth, row, col).
    """

    data: int = 1
    """Data-parallel replicas."""
    row: int = 1
    """Tensor-parallel ranks splitting a normal layer's output features (the paper's G_r)."""
    col: int = 1
    """Tensor-parallel ranks splitting a normal layer's input features (the paper's G_c)."""
    depth: int = 1
    """Tensor-parallel ranks splitting each weight block and the batch (the paper's G_d)."""
    pipeline: int = 1
    """Pipeline stages: each rank holds the layers of one stage (or several, interleaved)."""

    def __post_init__(self) -> None:
        for name in MESH_AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel degree {name}={value!r} is invalid. Use an integer >= 1.")

    @classmethod
    def from_user(cls, *, tensor: tuple[int, int, int] | list[int] = (1, 1, 1), data: int | None = None,
                  world_size: int | None = None, pipeline: int = 1) -> ParallelConfig:
        """Validates the user's ``tensor=(row, col, depth)``, ``pipeline`` and ``data`` against the world size.

        ``data=None`` means "every rank not used by tensor or pipeline parallelism" (pure data
        parallelism when ``tensor`` and ``pipeline`` are left at their defaults).
        """
        try:
            row, col, depth = tuple(tensor)
        except (TypeError, ValueError):
            raise ConfigError(f"tensor={tensor!r} is invalid. Pass tensor=(row, col, depth), "
                              "three integers >= 1.") from None
        probe = cls(1, row, col, depth, pipeline)  # validates the tensor and pipeline degrees
        used = probe.num_tensor * pipeline
        if data is None:
            if world_size is None:
                data = 1
            elif world_size % used:
                what = (f"pipeline*row*col*depth = {pipeline}*{row}*{col}*{depth}" if pipeline > 1
                        else f"row*col*depth = {row}*{col}*{depth}")
                raise ConfigError(f"world size {world_size} is not divisible by {what} = {used}. Launch a "
                                  f"multiple of {used} processes or change tensor=/pipeline=.")
            else:
                data = world_size // used
        config = cls(data, row, col, depth, pipeline)
        if world_size is not None and config.world_size != world_size:
            raise ConfigError(
                f"world size {world_size} does not match data*pipeline*row*col*depth = "
                f"{config.data}*{pipeline}*{row}*{col}*{depth} = {config.world_size}. Launch "
                f"{config.world_size} processes (torchrun --nproc-per-node {config.world_size}) or change "
                "data=/pipeline=/tensor=.")
        return config

    @property
    def tensor(self) -> tuple[int, int, int]:
        return (self.row, self.col, self.depth)

    @property
    def num_tensor(self) -> int:
        return self.row * self.col * self.depth

    @property
    def num_batch_shards(self) -> int:
        """Ranks the batch is split over: data x depth."""
        return self.data * self.depth

    @property
    def world_size(self) -> int:
        return self.data * self.pipeline * self.num_tensor

    def size(self, axis: str) -> int:
        """Ranks along ``axis``; the empty axis '' (nothing split) has one."""
        return getattr(self, axis) if axis else 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.size(a) for a in MESH_AXES)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each mesh axis."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the grid of {self.world_size} ranks.")
        out: dict[str, int] = {}
        for axis in reversed(MESH_AXES):
            out[axis] = rank % self.size(axis)
            rank //= self.size(axis)
        return {a: out[a] for a in MESH_AXES}

    def rank_of(self, coords: dict[str, int]) -> int:
        """The global rank at ``coords`` (the inverse of ``coords``)."""
        rank = 0
        for axis in MESH_AXES:
            rank = rank * self.size(axis) + coords[axis]
        return rank

    def batch_index(self, rank: int) -> int:
        """Which of the ``num_batch_shards`` slices of the global batch this rank computes."""
        c = self.coords(rank)
        return c["data"] * self.depth + c["depth"]

    def batch_sizes(self, global_batch: int) -> tuple[int, ...]:
        """Rows per batch shard, in batch-index order; the first ``global_batch % n`` get one extra."""
        n = self.num_batch_shards
        return tuple(global_batch // n + (1 if i < global_batch % n else 0) for i in range(n))

    def __str__(self) -> str:
        stages = f" pipeline={self.pipeline}" if self.pipeline > 1 else ""
        return f"data={self.data}{stages} tensor=(row={self.row}, col={self.col}, depth={self.depth})"


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
    segment is split evenly over the ``n`` ranks of the axis, and a rank keeps its piece of each.
    """
    out, start = [], 0
    for size in parts:
        k = size // n
        out.append((start + index * k, k))
        start += size
    return out


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

    def local_numel(self, config: ParallelConfig) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        if self.kind is ParamKind.WEIGHT_3D:
            return numel // (config.row * config.col * config.depth)
        if self.kind is ParamKind.BIAS:
            return numel // config.size(self.orientation.out_axis)
        if self.kind is ParamKind.SPLIT:
            return numel // config.size(self.split_axis)
        return numel


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """What the user asked for memory: ``checkpoint="auto" | "none" | "full" | <bytes per device>``.

    "auto" recomputes the fewest FLOPs that fit the device's memory (the GPU's total memory; on CPU
    the machine's physical memory divided by the ranks on it); bytes give that budget explicitly.
    The budget covers parameters, gradients, optimizer state (two fp32 tensors per trainable
    parameter, as Adam keeps) and activations.
    """

    checkpoint: str | int = "auto"
    precision: str = "fp32"
    """Compute dtype: fp32, or bf16/fp16 under autocast with fp32 parameters (master weights),
    gradients and optimizer state."""
    reduce_dtype: str = "fp32"
    """dtype of gradient reductions (weight-gradient reduce-scatters and gradient all-reduces): fp32,
    or the compute dtype to halve their bytes. Activations and weight all-gathers always travel in
    the compute dtype."""

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"precision={self.precision!r} is invalid. Use 'fp32', 'bf16' or 'fp16'.")
        if self.reduce_dtype not in ("fp32", self.precision):
            raise ConfigError(f"reduce_dtype={self.reduce_dtype!r} is invalid with precision={self.precision!r}. "
                              f"Use 'fp32' or {self.precision!r}.")
        c = self.checkpoint
        if isinstance(c, bool) or not (c in ("auto", "none", "full") or (isinstance(c, int) and c > 0)):
            raise ConfigError(f"checkpoint={c!r} is invalid. Use 'auto', 'none', 'full' or a budget in bytes "
                              "per device (an int > 0, e.g. 80 * 2**30).")


BATCH_MODES: tuple[str, ...] = ("auto", "global", "per-rank")

AGREEMENT_BYTES = 7 * 8
"""One rank's description of a call (autopar.runtime.agreement): all-gathered over the world per call."""


@dataclass(frozen=True, slots=True)
class InputConfig:
    """How the script feeds the model: ``auto_parallelize(batch=..., eval_timeout=...)``."""

    batch: str = "auto"
    """"global": every rank passes the same global batch (autopar splits it; outputs come back whole);
    "per-rank": every rank passes its own batch and gets its own rows' outputs, gradients averaged over
    the ranks (DDP semantics); "auto": decided at the first call that needs it by comparing the ranks'
    inputs (the same everywhere: global)."""
    eval_timeout: float = 30.0
    """Seconds an evaluation call waits for the other ranks before raising (evaluation on one rank only)."""
    batch_dims: Mapping[int | str, int | None] | None = None
    """Which inputs hold the batch, and in which dim: {input position or keyword: dim, or None for an input
    that holds no batch}. Inputs not listed: dim 0 when it equals the batch size (the default rule)."""

    def __post_init__(self) -> None:
        if self.batch not in BATCH_MODES:
            raise ConfigError(f"batch={self.batch!r} is invalid. Use 'auto', 'global' (the same global batch on every "
                              "rank) or 'per-rank' (each rank its own batch, as under DDP).")
        if isinstance(self.eval_timeout, bool) or not isinstance(self.eval_timeout, (int, float)) \
                or not self.eval_timeout > 0:
            raise ConfigError(f"eval_timeout={self.eval_timeout!r} is invalid. Use a number of seconds > 0.")
        if self.batch_dims is not None:
            if not isinstance(self.batch_dims, Mapping):
                raise ConfigError(f"batch_dims={self.batch_dims!r} is invalid. Use a dict: {{input position or "
                                  "keyword: batch dim, or None}}, e.g. batch_dims={'input_ids': 1, 'cu_seqlens': None}.")
            for key, dim in self.batch_dims.items():
                if isinstance(key, bool) or not isinstance(key, (int, str)) or (isinstance(key, int) and key < 0):
                    raise ConfigError(f"batch_dims key {key!r} is invalid. Name an input by its position (an int "
                                      ">= 0) or its keyword (a str).")
                if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
                    raise ConfigError(f"batch_dims[{key!r}] = {dim!r} is invalid. Use the batch's dim (an int) or "
                                      "None for an input that holds no batch.")


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """What the user asked for the pipeline: how many micro-batches, which torch schedule.

    Only read when ``ParallelConfig.pipeline`` > 1. ``chunks`` is the number of stages per rank
    (interleaved and looped-BFS schedules; default 2 for them, 1 for gpipe and 1f1b).
    """

    microbatches: int | None = None
    """Micro-batches per ``train_step`` (default: the number of stages). Each batch shard's rows must
    divide evenly."""
    schedule: str = "1f1b"
    """One of ``SCHEDULES``: gpipe, 1f1b, interleaved (Interleaved1F1B) or looped-bfs."""
    chunks: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is invalid. Use one of {', '.join(SCHEDULES)}.")
        m, v = self.microbatches, self.chunks
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ConfigError(f"microbatches={m!r} is invalid. Use an integer >= 1.")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"chunks={v!r} is invalid. Use an integer >= 1 (stages per pipeline rank).")
        if v is not None and v > 1 and self.schedule in ("gpipe", "1f1b"):
            raise ConfigError(f"chunks={v} needs a multi-stage schedule; {self.schedule!r} runs one stage per "
                              "rank. Use schedule='interleaved' or 'looped-bfs', or chunks=1.")

    @property
    def stages_per_rank(self) -> int:
        if self.chunks is not None:
            return self.chunks
        return 1 if self.schedule in ("gpipe", "1f1b") else 2

    def num_microbatches(self, num_ranks: int) -> int:
        """The micro-batch count for a pipeline of ``num_ranks`` ranks, checked against the schedule."""
        m = self.microbatches if self.microbatches is not None else num_ranks
        if self.schedule == "1f1b" and m < num_ranks:
            raise ConfigError(f"schedule '1f1b' needs at least as many micro-batches as pipeline ranks "
                              f"(microbatches={m}, pipeline={num_ranks}). Raise microbatches= or use 'gpipe'.")
        rounds = max(1, m // num_ranks)
        if self.schedule == "interleaved" and m % rounds:
            raise ConfigError(f"schedule 'interleaved' needs microbatches divisible by "
                              f"max(1, microbatches // pipeline) = {rounds} (microbatches={m}, "
                              f"pipeline={num_ranks}). Use a multiple of {num_ranks}.")
        return m


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
    """Peak while the model is built (autopar.runtime.deferred): the parameters plus the largest one whole."""

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        return self.static_bytes + self.activation_bytes

    def summary(self) -> str:
        mib = 2.0 ** 20
        lines = [f"memory per rank ({self.checkpoint}"
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

    def summary(self) -> str:
        mib = 2.0 ** 20
        ranks = len(self.stages) // self.chunks_per_rank
        shape = (f"{len(self.stages)} stages" if self.chunks_per_rank == 1 else
                 f"{ranks} ranks x {self.chunks_per_rank} interleaved stages")
        schedule = self.schedule or ("1F1B" if self.chunks_per_rank == 1 else "interleaved 1F1B")
        lines = [f"pipeline: {shape}, {self.num_microbatches} micro-batches; bottleneck "
                 f"{_seconds(self.bottleneck_seconds)} per micro-batch "
                 f"({self.bottleneck_seconds / self.lower_bound_seconds:.3f}x the lower bound), predicted "
                 f"bubble {self.bubble_fraction:.1%} ({schedule})"]
        for k, st in enumerate(self.stages):
            where = f" (rank {k % ranks})" if self.chunks_per_rank > 1 else ""
            lines.append(f"  stage {k}{where}: {_ranges(st.segments)}  {_seconds(st.seconds)}, "
                         f"parameters {st.param_bytes / mib:,.1f} MiB")
        for name, stages in self.shared:
            lines.append(f"  shared by stages {', '.join(map(str, stages))} (gradients summed): {name}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Plan:
    """Every decision the compiler made for one model under one ParallelConfig."""

    config: ParallelConfig
    matmuls: tuple[MatmulPlan, ...]
    params: tuple[ParamPlan, ...]
    notes: tuple[str, ...] = ()
    embeddings: tuple[EmbeddingPlan, ...] = ()
    memory: MemoryPlan | None = None
    pipeline: PipelinePlan | None = None
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
                 f"{len(sharded)}/{len(self.matmuls)} matmuls sharded"]
        for m in self.matmuls:
            what = m.orientation.value if not m.reason else f"replicated ({m.reason})"
            if len(m.parts) > 1:
                what += f" (fused {'+'.join(map(str, m.parts))})"
            lines.append(f"  {m.weight:<40} {m.op:<7} {m.in_features:>6} -> {m.out_features:<6} {what}")
        for e in self.embeddings:
            what = f"{e.mode.value}-parallel over {e.axis}" if e.axis else f"replicated ({e.reason})"
            lines.append(f"  {e.weight:<40} {'lookup':<7} {e.num_embeddings:>6} x {e.embedding_dim:<6} {what}")
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.memory is not None:
            lines.extend(f"  {line}" for line in self.memory.summary().splitlines())
        return "\n".join(lines)


# ---- communication accounting (bytes a rank sends under ring algorithms) ------------------------------

COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


def collective_bytes(kind: str, group_size: int, message_bytes: int) -> Fraction:
    """Bytes one rank sends for one collective, as an exact fraction.

    ``message_bytes`` is the output size for all-gather, the input size for reduce-scatter and the
    tensor size otherwise. A group of one sends nothing.
    """
    p = group_size
    if p <= 1:
        return Fraction(0)
    if kind == "all_reduce":
        return Fraction(2 * (p - 1) * message_bytes, p)
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return Fraction((p - 1) * message_bytes, p)
    if kind == "send":
        return Fraction(message_bytes)
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
