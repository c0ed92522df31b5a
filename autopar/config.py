"""What the user asked for: the grid (ParallelConfig), memory, inputs and pipeline. Leaf module.

Frozen and identical on every rank; what the plan made of it is ``autopar.decisions.Plan``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from autopar.errors import ConfigError

#: Mesh axes, outermost first. ``col`` varies fastest between consecutive ranks, so it is placed on
#: the fastest links (as AxoNN does); ``data`` is outermost, then ``pipeline`` (stages exchange one
#: activation per micro-batch, less than tensor parallelism moves), then ``context`` (its key/value gathers
#: move more than a stage's send and less than the tensor axes' per-matmul collectives: Megatron orders
#: tensor, context, data, pipeline from the inside out too).
MESH_AXES: tuple[str, ...] = ("data", "pipeline", "context", "depth", "row", "col")

#: ``expert_parallel``'s value for whole experts over data x the tensor axis (Megatron's EP borrowing the TP ranks).
TENSOR_EXPERTS = "data+tensor"


def check_expert_parallel(value: object) -> None:
    """``ConfigError`` unless ``value`` is one of ``expert_parallel``'s: False, True or "data+tensor"."""
    if not (isinstance(value, bool) or value == TENSOR_EXPERTS):
        raise ConfigError(f"expert_parallel={value!r} is invalid. Use True (routed experts split over the data "
                          f"ranks, each over the larger tensor axis on a tensor grid), {TENSOR_EXPERTS!r} (whole "
                          "experts over the data ranks and the tensor axis together) or False.")


#: Pipeline schedules of torch.distributed.pipelining that autopar drives (runtime.schedule_class).
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "looped-bfs")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """The parallel degrees the user asked for.

    Rank placement is row-major over ``MESH_AXES`` = (data, pipeline, context, depth, row, col).
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
    shard_optimizer: bool = False
    """The data ranks split the optimizer state and the gradients (ZeRO stages 1-2): each keeps the reduced
    gradient of 1/data of every parameter, steps it and then all-gathers it (``auto_parallelize(shard_optimizer=True)``,
    ``autopar.runtime.params.data_shards``)."""
    sequence_parallel: bool = False
    """Sequence parallelism (Korthikanti et al. 2022): where a matmul would all-reduce a whole output over
    row (or col), it reduce-scatters it along the tokens instead, so the norms, residual adds and dropout
    after it hold 1/row of the tokens; the next matmul all-gathers them and reduce-scatters their gradient
    (``auto_parallelize(sequence_parallel=True)``, ``passes.analysis.layouts.sequence_split``)."""
    expert_parallel: bool | str = False
    """Routed experts split over the data ranks (expert parallelism): each holds ``experts / data`` whole experts,
    and a layer's rows go to their experts' ranks by all-to-all and come back (``auto_parallelize(
    expert_parallel=True)``, ``passes.split_experts``, ``autopar.runtime.ops.experts``). ``"data+tensor"``: whole
    experts over the data ranks and the ranks of the tensor axis together (Megatron's expert parallelism borrowing
    the tensor ranks: each holds ``experts / (data * tensor)``, and each tensor rank sends a block of the rows it
    holds alike), where a tensor grid would otherwise split each expert over a tensor axis (``expert_axis``)."""
    context: int = 1
    """Context parallelism: ranks splitting every sequence's tokens for the whole model, attention included
    (each holds two of ``2 * context`` equal chunks, ``i`` and ``2 * context - 1 - i``, so causal attention's
    work is even); attention gathers the keys and values over them (``auto_parallelize(context=C)``,
    ``passes.split_context``, ``autopar.runtime.ops.context``). Same weights on each, as over data."""

    def __post_init__(self) -> None:
        for name in MESH_AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel degree {name}={value!r} is invalid. Use an integer >= 1.")
        if not isinstance(self.shard_optimizer, bool):
            raise ConfigError(f"shard_optimizer={self.shard_optimizer!r} is invalid. Use True (the optimizer state "
                              "split over the data ranks) or False.")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel={self.sequence_parallel!r} is invalid. Use True (activations "
                              "between matmuls split along the tokens over the tensor group) or False.")
        check_expert_parallel(self.expert_parallel)
        if self.expert_parallel == TENSOR_EXPERTS and (self.depth > 1 or min(self.row, self.col) > 1):
            raise ConfigError(f"expert_parallel={TENSOR_EXPERTS!r} lends one tensor axis to the experts, and "
                              f"tensor=(row={self.row}, col={self.col}, depth={self.depth}) has "
                              f"{'depth > 1' if self.depth > 1 else 'two'}: use a tensor grid of one axis "
                              "(tensor=(T, 1, 1)), or expert_parallel=True (experts over data, each split over the "
                              "larger tensor axis).")

    @classmethod
    def from_user(cls, *, tensor: tuple[int, int, int] | list[int] = (1, 1, 1), data: int | None = None,
                  world_size: int | None = None, pipeline: int = 1, shard_optimizer: bool = False,
                  sequence_parallel: bool = False, expert_parallel: bool | str = False, context: int = 1
                  ) -> ParallelConfig:
        """Validates the user's ``tensor=(row, col, depth)``, ``pipeline`` and ``data`` against the world size.

        ``data=None`` means "every rank not used by tensor, pipeline or context parallelism" (pure data
        parallelism when ``tensor``, ``pipeline`` and ``context`` are left at their defaults).
        """
        try:
            row, col, depth = tuple(tensor)
        except (TypeError, ValueError):
            raise ConfigError(f"tensor={tensor!r} is invalid. Pass tensor=(row, col, depth), "
                              "three integers >= 1.") from None
        probe = cls(1, row, col, depth, pipeline, context=context)  # validates the tensor, pipeline, context degrees
        used = probe.num_tensor * pipeline * context
        if data is None:
            if world_size is None:
                data = 1
            elif world_size % used:
                what = (f"pipeline*row*col*depth = {pipeline}*{row}*{col}*{depth}" if pipeline > 1
                        else f"row*col*depth = {row}*{col}*{depth}")
                if context > 1:
                    what = f"context*{what.replace(' = ', ' = ' + str(context) + '*', 1)}"
                raise ConfigError(f"world size {world_size} is not divisible by {what} = {used}. Launch a "
                                  f"multiple of {used} processes or change tensor=/pipeline="
                                  f"{'/context=' if context > 1 else ''}.")
            else:
                data = world_size // used
        config = cls(data, row, col, depth, pipeline, shard_optimizer, sequence_parallel, expert_parallel, context)
        if world_size is not None and config.world_size != world_size:
            ctx = ("*context", f"*{context}") if context > 1 else ("", "")
            raise ConfigError(
                f"world size {world_size} does not match data*pipeline{ctx[0]}*row*col*depth = "
                f"{config.data}*{pipeline}{ctx[1]}*{row}*{col}*{depth} = {config.world_size}. Launch "
                f"{config.world_size} processes (torchrun --nproc-per-node {config.world_size}) or change "
                "data=/pipeline=/tensor=/context=.")
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
        return self.data * self.pipeline * self.context * self.num_tensor

    def size(self, axis: str) -> int:
        """Ranks along ``axis``; the empty axis '' (nothing split) has one; axes joined by '+' (``expert_axis``:
        "data+row") their product."""
        if "+" in axis:
            return math.prod(getattr(self, a) for a in axis.split("+"))
        return getattr(self, axis) if axis else 1

    def grad_axes(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """The mesh axes a gradient of a parameter whose plan sums it over ``axes`` (``ParamPlan.grad_axes``) is
        summed over on this grid: the context ranks hold the same weights and compute other tokens, so under
        context parallelism a gradient summed over data, or over depth only (experts split over data), is summed
        over them too."""
        if self.context > 1 and ("data" in axes or axes == ("depth",)):
            return tuple(a for a in ("data", "context", "depth") if a in axes or a == "context")
        return axes

    @property
    def expert_axis(self) -> str:
        """The mesh axes splitting routed experts under ``expert_parallel``, those of more than one rank joined
        by '+': "data" (True), "data+row" or "data+col" ("data+tensor": the tensor axis of more than one rank
        too); '' where nothing splits them."""
        if not self.expert_parallel:
            return ""
        axes = ["data"]
        if self.expert_parallel == TENSOR_EXPERTS:
            axes.append("row" if self.row > 1 else "col")
        return "+".join(a for a in axes if self.size(a) > 1)

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
        experts = (f" experts over {self.expert_axis.replace('+', ' x ')}"
                   if self.expert_parallel == TENSOR_EXPERTS and self.expert_axis not in ("", "data") else "")
        zero = " shard_optimizer" if self.shard_optimizer and self.data > 1 else ""
        seq = " sequence_parallel" if self.sequence_parallel and max(self.row, self.col) > 1 else ""
        ctx = f" context={self.context}" if self.context > 1 else ""
        return f"data={self.data}{stages}{ctx} tensor=(row={self.row}, col={self.col}, depth={self.depth}){zero}{seq}{experts}"


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
    shard_optimizer: bool = False
    """Each data rank keeps the optimizer state and the reduced gradient of 1/data of every parameter, steps that
    part and all-gathers the updated parameters (ZeRO stages 1-2, ``autopar.runtime.params.data_shards``)."""
    sequence_parallel: bool = False
    """Activations between matmuls split along the tokens over the tensor group (``ParallelConfig``)."""
    expert_parallel: bool | str = False
    """Routed experts split over the data ranks, or (``"data+tensor"``) over data x the tensor axis
    (``ParallelConfig``): with ``plan="auto"`` the search tries only grids that split them where they can be
    (without it, it tries both)."""

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"precision={self.precision!r} is invalid. Use 'fp32', 'bf16' or 'fp16'.")
        if self.reduce_dtype not in ("fp32", self.precision):
            raise ConfigError(f"reduce_dtype={self.reduce_dtype!r} is invalid with precision={self.precision!r}. "
                              f"Use 'fp32' or {self.precision!r}.")
        if not isinstance(self.shard_optimizer, bool):
            raise ConfigError(f"shard_optimizer={self.shard_optimizer!r} is invalid. Use True (the optimizer state "
                              "split over the data ranks) or False.")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel={self.sequence_parallel!r} is invalid. Use True (activations "
                              "between matmuls split along the tokens over the tensor group) or False.")
        check_expert_parallel(self.expert_parallel)
        c = self.checkpoint
        if isinstance(c, bool) or not (c in ("auto", "none", "full") or (isinstance(c, int) and c > 0)):
            raise ConfigError(f"checkpoint={c!r} is invalid. Use 'auto', 'none', 'full' or a budget in bytes "
                              "per device (an int > 0, e.g. 80 * 2**30).")


COMPILE_MODES: tuple[bool | str, ...] = (False, True, "auto", "reduce-overhead")


@dataclass(frozen=True, slots=True)
class CompileConfig:
    """Whether the per-rank program runs compiled: ``auto_parallelize(compile=...)``.

    True: each bound per-rank graph of static sizes (each pipeline stage) runs under ``torch.compile`` with
    Inductor (``autopar.runtime.compiled.graph``); False: eagerly, op by op; "auto" (default), on CUDA devices,
    where launching kernels one by one costs more than the compute of a rank's share (measured: one rank's
    step at 4-way tensor parallelism took longer than the whole serial step on an H200): the graphs of
    training calls (gradients enabled), and the evaluation calls replayed as CUDA graphs (a static cache's
    decode steps, ``autopar.runtime.compiled.cuda_graphs``: the same sizes at every step, as HF's ``generate`` compiles
    a static cache's decode on CUDA); eager on CPU, where compiling takes longer than it saves in a short
    run, and for other evaluation calls, whose many shapes would each compile. "reduce-overhead" (torch.compile's
    name for it): as True, and on CUDA each training graph (forward and backward, not a pipeline stage) is also
    replayed as a CUDA graph by Inductor's CUDA graph trees (``cuda_graphs``): a step no longer waits on the
    host's kernel launches, but a tensor the model returned is overwritten by the next training call's replay
    (torch raises when it is read after that; clone what you keep).
    """

    mode: bool | str = "auto"

    def __post_init__(self) -> None:
        if not any(self.mode is m or (isinstance(m, str) and self.mode == m) for m in COMPILE_MODES):
            raise ConfigError(f"compile={self.mode!r} is invalid. Use True, False, 'auto' (compiled on CUDA) or "
                              "'reduce-overhead' (compiled, and training steps replayed as CUDA graphs).")

    def enabled(self, device_type: str, training: bool, replayed: bool = False) -> bool:
        """Whether a graph is compiled: on this device type, for a call with gradients or without
        (``replayed``: an evaluation call captured as a CUDA graph)."""
        return self.mode is True or self.mode == "reduce-overhead" or \
            (self.mode == "auto" and device_type == "cuda" and (training or replayed))

    def cuda_graphs(self, device_type: str, training: bool) -> bool:
        """Whether a compiled training graph is also replayed as a CUDA graph (``compile="reduce-overhead"``)."""
        return self.mode == "reduce-overhead" and device_type == "cuda" and training


BATCH_MODES: tuple[str, ...] = ("auto", "global", "per-rank")

AGREEMENT_BYTES = 7 * 8
"""One rank's description of a call (autopar.runtime.execution.call_check): all-gathered over the world per call."""

COMPILE_AGREEMENT_TIMEOUT = 1800.0
"""Seconds a rank waits for the others to finish compiling a graph (autopar.runtime.compiled.agreement):
compiling takes minutes, and ranks that load a graph from Inductor's cache finish far sooner."""


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
    check_inputs: bool = True
    """Under a global batch, compare every call's input values across the ranks (a sum and a sum weighted by place,
    sent with the call's descriptor); False compares only each new input signature's first call."""

    def __post_init__(self) -> None:
        if self.batch not in BATCH_MODES:
            raise ConfigError(f"batch={self.batch!r} is invalid. Use 'auto', 'global' (the same global batch on every "
                              "rank) or 'per-rank' (each rank its own batch, as under DDP).")
        if isinstance(self.eval_timeout, bool) or not isinstance(self.eval_timeout, (int, float)) \
                or not self.eval_timeout > 0:
            raise ConfigError(f"eval_timeout={self.eval_timeout!r} is invalid. Use a number of seconds > 0.")
        if not isinstance(self.check_inputs, bool):
            raise ConfigError(f"check_inputs={self.check_inputs!r} is invalid. Use True or False.")
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
