"""search_plans: which grid (data x pipeline x tensor row/col/depth) and micro-batches run a model fastest.

The planner's pieces predict, for one grid, the exact bytes of every collective (``estimate_costs``),
the memory per device and the blocks to recompute (``choose_checkpoints``) and the pipeline's stages
(``choose_stages``). This module turns them into a step time on a described machine and searches the
grids a world size allows:

- ``Machine`` (``passes/analysis/machine.py``): the device and interconnect a step is priced on.
- ``candidates``: every factorization of the world size into the five degrees (a degree the user gave
  stays fixed), with micro-batch counts for pipelines, each run by 1F1B or interleaved (two stages per
  rank).
- ``step_seconds``: one rank's step: its matmul FLOPs (and recomputation) at the machine's rate, every
  collective at its group's bandwidth plus latency, the pipeline's bubble, then the gradient sync.
- ``passes/analysis/screen.py``: every grid priced in closed form without planning it, so the search
  plans only the most promising exactly.
- ``rank_plans``: plans that fit memory first, fastest first; ``why_slower`` says in words what makes a
  plan slower than the best (more communication, less compute split, a bubble, recomputation).

Pure: the caller plans each candidate (it captures the model) and passes the results in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.config import TENSOR_EXPERTS, ParallelConfig
from autopar.decisions import Plan
from passes.analysis.estimate_costs import Collective, matmul_split
from passes.analysis.machine import Machine
from passes.analysis.report import StepReport, whole_flops_per_rank

DEGREES = ("data", "pipeline", "row", "col", "depth")


@dataclass(frozen=True, slots=True)
class Candidate:
    data: int
    pipeline: int
    row: int
    col: int
    depth: int
    microbatches: int = 1
    chunks: int = 1
    """Stages per pipeline rank: 1 runs torch's 1F1B, more its Interleaved1F1B."""
    shard_optimizer: bool = False
    """The data ranks split the optimizer state and gradients (ZeRO stages 1-2): the search tries it on grids that
    do not fit."""
    sequence_parallel: bool = False
    """Activations between matmuls split along the tokens over the tensor group."""
    expert_parallel: bool | str = False
    """Routed experts split over the data ranks, their rows moved by all-to-alls, or ("data+tensor") whole ones
    over data x the tensor axis (``ParallelConfig``'s)."""
    context: int = 1
    """Ranks splitting every sequence's tokens (``ParallelConfig.context``): the search tries it where the sequence
    is long (``context_degrees``)."""

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(self.data, self.row, self.col, self.depth, pipeline=self.pipeline,
                              shard_optimizer=self.shard_optimizer, sequence_parallel=self.sequence_parallel,
                              expert_parallel=self.expert_parallel, context=self.context)

    @property
    def tensor(self) -> tuple[int, int, int]:
        return self.row, self.col, self.depth

    def describe(self) -> str:
        micro = f" microbatches={self.microbatches}" if self.pipeline > 1 else ""
        micro += f" chunks={self.chunks}" if self.chunks > 1 else ""
        micro += " shard_optimizer" if self.shard_optimizer else ""
        micro += " sequence_parallel" if self.sequence_parallel else ""
        micro += (f" expert_parallel={self.expert_parallel}" if isinstance(self.expert_parallel, str)
                  else " expert_parallel" if self.expert_parallel else "")
        ctx = f" context={self.context}" if self.context > 1 else ""
        return (f"data={self.data} pipeline={self.pipeline}{ctx} tensor={self.row},{self.col},{self.depth}{micro}")


def candidates(world: int, global_batch: int, *, fixed: Mapping[str, int] | None = None,
               max_microbatches: int = 4, chunks: Sequence[int] = (1, 2), experts: Sequence[int] = (),
               expert_parallel: bool | str | None = None, contexts: Sequence[int] = ()) -> list[Candidate]:
    """Every grid of ``world`` ranks: data x pipeline x row x col x depth = world, each degree in ``fixed``
    as given. The batch must give every data x depth shard a row; a pipeline takes ``pipeline`` x 1, 2, ...
    ``max_microbatches``, x every power of two, and micro-batches of one, two, four, ... rows (as Megatron
    runs large models: BLOOM's 12 stages took 128 micro-batches of 2 rows), as many as divide each shard's
    rows and at least one per stage (1F1B's condition), each with every count of stages per rank in
    ``chunks`` (more than one: interleaved, where the micro-batches divide into torch's rounds).
    ``experts``: the expert counts of the model's routed-experts layers an expert layout can split; a grid
    whose data degree (> 1) divides them all also comes with its experts split over data (``expert_parallel``),
    and a grid of one tensor axis whose data x tensor ranks divide them all with whole experts over those
    ("data+tensor"), beside it (``expert_parallel=None``) or instead of it (True: either layout; "data+tensor":
    that one); False: never.
    ``contexts``: context degrees (> 1) also tried, each on every grid of ``world / C`` ranks, with the same
    expert layouts (``Candidate.context``; the exchange runs among the data (x tensor) ranks of one context
    rank); ``fixed["context"]`` keeps one degree only (1: none)."""
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - {*DEGREES, "context"})
    if unknown:
        raise ValueError(f"unknown degrees {unknown}; expected some of {(*DEGREES, 'context')}")
    if "context" in fixed:
        contexts = () if fixed["context"] == 1 else (fixed.pop("context"),)
        fixed.pop("context", None)
        if contexts:  # (only grids of that context degree)
            return _context_grids(world, global_batch, fixed, contexts, max_microbatches, chunks, experts,
                                  expert_parallel)
    return _grids(world, global_batch, fixed, max_microbatches, chunks, experts, expert_parallel) + \
        _context_grids(world, global_batch, fixed, contexts, max_microbatches, chunks, experts, expert_parallel)


def _context_grids(world: int, global_batch: int, fixed: Mapping[str, int], contexts: Sequence[int],
                   max_microbatches: int, chunks: Sequence[int], experts: Sequence[int],
                   expert_parallel: bool | str | None) -> list[Candidate]:
    """``candidates``' grids of each context degree in ``contexts``: data x pipeline x row x col x depth of
    ``world / C``, each with its expert layouts."""
    out = []
    for context in contexts:
        if context <= 1 or world % context:
            continue
        out += [dataclasses.replace(c, context=context) for c in
                _grids(world // context, global_batch, fixed, max_microbatches, chunks, experts, expert_parallel)]
    return out


def _grids(world: int, global_batch: int, fixed: Mapping[str, int], max_microbatches: int, chunks: Sequence[int],
           experts: Sequence[int], expert_parallel: bool | str | None) -> list[Candidate]:
    """``candidates`` without context parallelism."""
    out = []
    for degrees in _factorings(world, len(DEGREES)):
        grid = dict(zip(DEGREES, degrees))
        if any(grid[k] != v for k, v in fixed.items()):
            continue
        shards = grid["data"] * grid["depth"]
        if global_batch < shards:
            continue
        layouts = expert_layouts(grid, experts, expert_parallel)
        if grid["pipeline"] == 1:
            out += [Candidate(**grid, expert_parallel=e) for e in layouts]
            continue
        if global_batch % shards:
            continue
        rows, stages = global_batch // shards, grid["pipeline"]
        per_stage = rows // stages  # micro-batches per stage at one row each
        counts = {stages * k for k in range(1, max_microbatches + 1)}
        counts |= {stages * 2 ** e for e in range(per_stage.bit_length())}
        counts |= {rows >> e for e in range(rows.bit_length()) if rows % (1 << e) == 0}  # 1, 2, 4, ... rows each
        for m in sorted(m for m in counts if m >= stages and rows % m == 0):
            out += [Candidate(**grid, microbatches=m, chunks=v, expert_parallel=e) for v in chunks
                    if v == 1 or m % max(1, m // stages) == 0 for e in layouts]
    return out


def expert_layouts(grid: Mapping[str, int], experts: Sequence[int], expert_parallel: bool | str | None
                   ) -> tuple[bool | str, ...]:
    """The expert layouts ``candidates`` tries on ``grid`` (its degrees): False (whole, or each expert split
    over a tensor axis), True (experts over data, where data > 1 divides every layer's experts) and
    "data+tensor" (whole experts over data x the one tensor axis of more than one rank, depth 1, where those
    ranks divide them); ``expert_parallel`` None keeps them all, True those that split, False or a value the
    grid cannot run the first."""
    if not experts or expert_parallel is False:
        return (False,)
    data, tensor = grid["data"], (grid["row"], grid["col"])
    split = []
    if data > 1 and all(e % data == 0 for e in experts):
        split.append(True)
    one_axis = grid["depth"] == 1 and min(tensor) == 1
    lent = max(tensor) if one_axis else 1
    if lent > 1 and all(e % (data * lent) == 0 for e in experts):
        split.append(TENSOR_EXPERTS)
    if isinstance(expert_parallel, str):  # (on a grid of no tensor axis, "data+tensor" is experts over data)
        split = [e for e in split if e == expert_parallel or (e is True and one_axis and lent == 1)]
    if expert_parallel is None:
        return (False, *split)
    return tuple(split) or (False,)


CONTEXT_FROM = 16384
"""Tokens per sequence from which the search also tries context parallelism (``context_degrees``): below it a
sequence's activations rarely outgrow what tensor parallelism with sequence parallelism splits, and the
search's grids stay as they were."""
CONTEXT_TOKENS = 1024
"""The fewest tokens a context rank holds in a grid the search tries (each of its two chunks half of them)."""


def context_degrees(world: int, tokens: int) -> tuple[int, ...]:
    """The context degrees the search tries for sequences of ``tokens`` on ``world`` ranks: none below
    ``CONTEXT_FROM`` tokens; else each divisor ``C > 1`` of the world size whose ``2C`` chunks divide the
    sequence, each rank holding at least ``CONTEXT_TOKENS``."""
    if tokens < CONTEXT_FROM:
        return ()
    return tuple(c for c in range(2, world + 1)
                 if world % c == 0 and tokens % (2 * c) == 0 and tokens // c >= CONTEXT_TOKENS)


def _factorings(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered ``parts``-tuple of positive integers whose product is ``n``, in lexicographic order
    (``itertools.product`` over the divisors, filtered, in its order; 3,072's 26 divisors make 11.9 million
    5-tuples, of which 3,920 multiply to it)."""
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorings(n // d, parts - 1):
                yield (d, *rest)


def factorizations(world: int, fixed: Mapping[str, int] | None = None) -> list[dict[str, int]]:
    """The degree assignments ``candidates`` would try, ignoring the batch (for an error message)."""
    return [dataclasses.asdict(c) for c in candidates(world, world ** 2, fixed=fixed, max_microbatches=1, chunks=(1,))]


def halved(c: Collective) -> Collective:
    """``c`` under bf16/fp16 autocast: an activation's collective (forward or backward, not over depth,
    which gathers fp32 weights and reduces their gradients) moves half the bytes the fp32 count says."""
    return dataclasses.replace(c, message_bytes=c.message_bytes // 2) if _halves(c.phase, c.axis) else c


def _halves(phase: str, axis: str) -> bool:
    """Whether ``halved`` halves a collective of this phase and axis."""
    return phase in ("forward", "backward") and "depth" not in axis and axis != "world"


BUCKET_BYTES = 25 * 2**20
"""The gradient sync's bucket cap (autopar.runtime.data_parallel.grad_sync and, under a pipeline, stage_grads; as DDP's)."""


def bucketed(collectives: Iterable[Collective], cap: int = BUCKET_BYTES) -> list[Collective]:
    """The gradient sync's collectives as the runtime issues them: one per parameter in the prediction,
    packed in backward's order (the reverse) into buckets of at most ``cap`` bytes per group (a larger
    tensor alone in its bucket), one collective per bucket."""
    out: list[Collective] = []
    open_: dict[tuple[str, str, int], Collective] = {}
    for c in reversed(list(collectives)):
        key = (c.kind, c.axis, c.group_size)
        held = open_.get(key)
        if held is not None and held.message_bytes + c.message_bytes <= cap:
            open_[key] = dataclasses.replace(held, message_bytes=held.message_bytes + c.message_bytes,
                                             where="gradient bucket")
            continue
        if held is not None:
            out.append(held)
        open_[key] = c
    return out + list(open_.values())


@dataclass(frozen=True, slots=True)
class StepTime:
    """One rank's predicted step, in seconds, and its parts."""

    compute: float
    """Matmul FLOPs (recomputation included) at the machine's rate, the elementwise work (per saved
    activation byte) and each operator's overhead."""
    communication: float
    """Collectives during forward and backward (bytes at their link's bandwidth, plus latency)."""
    bubble: float
    """Time the pipeline's schedule leaves this rank idle."""
    sync: float
    """The gradient synchronization after backward."""
    optimizer: float = 0.0
    """The optimizer's update of this rank's parameters."""

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.bubble + self.sync + self.optimizer


def step_seconds(collectives: Sequence[Collective], layer_flops: Sequence[tuple[float, Any]], plan: Plan,
                 machine: Machine, *, rank_flops: float | None = None, recompute_flops: float = 0.0,
                 optimizer_bytes: int = 0, saved_bytes: int = 0, ops: int = 0, half: bool = False,
                 matmul_slowdown: float = 1.0, attention_flops: float = 0.0, whole_flops: float = 0.0) -> StepTime:
    """One rank's training step under ``machine``.

    ``layer_flops``: each matmul's FLOPs for the whole step and its orientation (this rank computes its
    share: split over data x depth and over the orientation's tensor axes); ``rank_flops`` replaces that sum
    when the rank runs part of the model only (its pipeline stages). ``recompute_flops``: forward FLOPs this
    rank recomputes in backward (the memory plan's). ``optimizer_bytes``: the trainable parameters' bytes
    (fp32) this rank updates. ``saved_bytes``: activations this rank saves for backward (written in
    forward, read in backward: the elementwise work, at the machine's activation or memory rate).
    ``ops``: operators this rank's forwards call (each with its backward), at ``op_seconds`` each.
    ``half``: bf16/fp16 autocast, whose activations (and their collectives) are half the bytes.
    ``matmul_slowdown``: how much longer than their FLOPs at the matmul rate the rank's matmuls take where
    some read more bytes than the memory rate moves in that time (``matmul_slowdown``).
    ``attention_flops``: the attention products' FLOPs this rank computes, forward and backward (at the
    matmul rate: fused kernels keep them on the matrix units). ``whole_flops``: this rank's FLOPs of the
    matmul-like ops left whole (``report.whole_flops_per_rank``: 3-D expert weights, convolutions).

    The gradient sync also copies each gradient into its bucket and the sum back (four bytes moved per
    gradient byte, at the memory rate)."""
    config = plan.config
    compute = rank_flops if rank_flops is not None else sum(
        flops / (config.num_batch_shards * config.context * matmul_split(config, orientation))
        for flops, orientation in layer_flops)
    compute = (compute + recompute_flops) / machine.flops_per_second * matmul_slowdown
    compute += (attention_flops + whole_flops) / machine.flops_per_second
    compute += ops * machine.op_seconds
    if machine.activation_bytes_per_second:
        compute += saved_bytes / machine.activation_bytes_per_second
    elif machine.memory_bytes_per_second:
        compute += 2 * saved_bytes / machine.memory_bytes_per_second

    price = Prices(machine, config, half, {})  # (a plan's thousands of collectives repeat a few shapes)
    blocking = [c for c in collectives if c.group_size > 1 and c.phase != "step"]
    comm = sum(price(c.kind, c.axis, c.group_size, c.message_bytes, c.phase) for c in blocking)
    comm += arrival_skew(len(blocking), compute, machine, config)
    buckets = [c for c in bucketed(c for c in collectives if c.phase == "step") if c.group_size > 1]
    sync = sum(price(c.kind, c.axis, c.group_size, c.message_bytes, c.phase) for c in buckets)
    if machine.memory_bytes_per_second:  # into the bucket and back
        sync += 4 * sum(c.message_bytes for c in buckets if c.kind == "all_reduce") / machine.memory_bytes_per_second
    bubble = 0.0
    if plan.pipeline is not None and plan.pipeline.bubble_fraction < 1:
        busy = compute + comm
        bubble = pipeline_span(busy, plan.pipeline.bubble_fraction, machine, config) - busy
    update = 7 * optimizer_bytes / machine.memory_bytes_per_second if machine.memory_bytes_per_second else 0.0
    return StepTime(compute, comm, bubble, sync, update)


def arrival_skew(calls: int, compute: float, machine: Machine, config: ParallelConfig) -> float:
    """What ``calls`` blocking collectives between ``compute`` seconds of work cost beyond their own
    time where a node's ranks outnumber its cores: the ranks arrive at each up to ``skew_seconds`` apart
    (one waits while the scheduler runs the others), never more than the compute since the last call
    (the stretch each rank had to fall behind in): ``calls * min(compute / calls, skew_seconds)``.
    Measured on 4 ranks sharing 2 cores: GPT-2's tensor (4, 1, 1) step spent 165 ms in its 27 stretches
    of compute up to the last rank's arrival against 100 ms for the mean rank (timed inside real steps);
    0 with a device (or a core) per rank."""
    ranks = min(config.world_size, machine.gpus_per_node)
    if not calls or not machine.skew_seconds or not machine.cores or ranks <= machine.cores:
        return 0.0
    return calls * min(compute / calls, machine.skew_seconds)


def plan_seconds(plan: Plan, report: StepReport, machine: Machine, precision: str = "fp32") -> StepTime:
    """``step_seconds`` of a planned grid from its step report (``autopar.planning.planner.plan_model``'s, under
    ``precision``)."""
    layers = [(r.context_flops(plan.config.context), plan.matmul(r.weight).orientation) for r in report.layers]
    memory = report.rank_memory or plan.memory
    half = precision in ("bf16", "fp16")
    calls = [(r.context_flops(plan.config.context) / (plan.config.num_batch_shards * plan.config.context * matmul_split(plan.config, orientation)),
              _call_shape(r.in_shape, r.out_shape, plan.config, orientation))
             for r, (_, orientation) in zip(report.layers, layers)]
    return step_seconds(report.collectives, layers, plan, machine, rank_flops=report.rank_flops,
                        recompute_flops=memory.recompute_flops if memory is not None else 0.0,
                        optimizer_bytes=report.rank_update_bytes, saved_bytes=report.rank_saved_bytes,
                        ops=report.rank_ops, half=half, matmul_slowdown=matmul_slowdown(calls, machine, half),
                        attention_flops=report.rank_attention_flops, whole_flops=whole_flops_per_rank(report, plan))


def _call_shape(in_shape: Sequence[int], out_shape: Sequence[int], config: ParallelConfig,
                orientation: Any) -> tuple[int, int, int]:
    """(rows, in features, out features) of one call of a matmul on this rank (the captured rows: one
    batch shard's, or one micro-batch's)."""
    rows = math.prod(in_shape[:-1])
    if not orientation.is_sharded:
        return rows, in_shape[-1], out_shape[-1]
    return rows, in_shape[-1] // config.size(orientation.in_axis), out_shape[-1] // config.size(orientation.out_axis)


def matmul_slowdown(calls: Sequence[tuple[float, tuple[int, int, int]]], machine: Machine, half: bool = False
                    ) -> float:
    """How much longer a rank's matmuls take than their FLOPs at the matmul rate: a call of ``m`` rows,
    ``k`` in and ``n`` out features (forward and its two backward products: ``6mkn`` FLOPs) moves its
    weight, input and output three times each (``3 (kn + mk + mn)`` elements) and takes the longer of
    the two at the machine's rates (a roofline). Few rows (a data-parallel rank's 16, a micro-batch's 8)
    make a layer read its whole weight for little work: FC_Net's 512-wide layers at 16 rows take ~2.5x
    their FLOPs' time here. ``calls``: (this rank's FLOPs of that matmul in a step, its call's (m, k, n)).
    1 without a memory rate."""
    if not machine.memory_bytes_per_second:
        return 1.0
    element = 2 if half else 4
    flops = seconds = 0.0
    for total, (m, k, n) in calls:
        if not total or not (m and k and n):
            continue
        intensity = 6 * m * k * n / (3 * element * (k * n + m * k + m * n))  # FLOPs per byte moved
        flops += total
        seconds += total * max(1.0, machine.flops_per_second / (intensity * machine.memory_bytes_per_second))
    return seconds / flops if flops else 1.0


class Prices:
    """``machine.seconds`` of one candidate's collectives, as ``(kind, axis, group size, message bytes, phase)``
    (bf16/fp16 halved as ``halved``): each link read once per candidate, each (link, collective) priced once
    per ``memo`` (the search's: the screen prices tens of thousands of grids, and their collectives repeat)."""

    def __init__(self, machine: Machine, config: ParallelConfig, half: bool, memo: dict[Any, float]) -> None:
        self.machine, self.config, self.half, self.memo = machine, config, half, memo
        self.links: dict[str, tuple[float, float]] = {}
        self.multi = sum(config.size(a) > 1 for a in ("row", "col", "depth")) > 1
        self.degrees = (config.data, config.pipeline, config.row, config.col, config.depth)

    def __call__(self, kind: str, axis: str, group_size: int, message_bytes: int, phase: str) -> float:
        if self.half and phase in ("forward", "backward") and axis != "world" and "depth" not in axis:
            message_bytes //= 2  # (``_halves``, inline: called a million times by a search of 3,072 GPUs)
        where = "pipeline" if kind == "send" else axis
        link = self.links.get(where)
        if link is None:
            link = self.link(where)
        crossed = phase != "step" and self.multi
        key = (link, crossed, kind, group_size, message_bytes)
        seconds = self.memo.get(key)
        if seconds is None:
            seconds = self.memo[key] = self.machine.on_link(link, crossed, kind, group_size, message_bytes)
        return seconds

    def link(self, where: str) -> tuple[float, float]:
        """``machine.link`` of this candidate's ``where`` (an axis, or "pipeline" for sends)."""
        link = self.links.get(where)
        if link is None:  # (grids of the same degrees share their links: the schedules, the micro-batches)
            key = ("link", self.degrees, where)
            link = self.memo.get(key)
            if link is None:
                link = self.memo[key] = self.machine.link(self.config, where)
            self.links[where] = link
        return link


def pipeline_span(busy: float, bubble_fraction: float, machine: Machine, config: ParallelConfig) -> float:
    """Seconds a pipeline rank's step spans when it is busy ``busy`` seconds and the schedule leaves it
    idle ``bubble_fraction`` of the span: ``busy / (1 - bubble_fraction)`` with a device per rank. Where
    ``R`` ranks share ``c < R`` cores, ``busy`` is at the shared rate (every rank busy at once), so at a
    core's own rate the rank works ``busy * c / R``; the cores are never idle while ``c`` ranks have work,
    and the step takes the longer of the rank's span at full speed and the node's work on ``c`` cores:
    ``max(busy * c / (R * (1 - f)), busy)``. (On 4 ranks sharing 2 cores, 1F1B's bubble is then free:
    measured steps of 4 stages with 8 micro-batches were 72-73% of ``busy / (1 - f)``, i.e. ``busy``.)"""
    span = busy / (1 - bubble_fraction)
    ranks = min(config.world_size, machine.gpus_per_node)
    if machine.cores and ranks > machine.cores:
        span = max(span * machine.cores / ranks, busy)
    return span


@dataclass(frozen=True, slots=True)
class Scored:
    """A candidate grid with its plan's prediction."""

    candidate: Candidate
    time: StepTime | None
    """None when it could not be planned (``reason`` says why)."""
    memory_bytes: int
    """Predicted peak per device (parameters, gradients, optimizer state, activations)."""
    fits: bool
    recompute: tuple[str, ...] = ()
    """Blocks the memory plan recomputes."""
    reason: str = ""
    """Why it does not fit, or could not be planned."""

    @property
    def seconds(self) -> float:
        return self.time.total if self.time is not None else float("inf")


def rank_plans(scored: Iterable[Scored]) -> list[Scored]:
    """Plans that fit memory first, then by predicted step time; ties to fewer tensor-parallel ranks, then
    fewer pipeline stages, then experts whole (less to go wrong for the same time)."""
    def key(s: Scored) -> tuple:
        c = s.candidate
        return (not s.fits, s.time is None, s.seconds, c.row * c.col * c.depth, c.pipeline, -c.data,
                (False, True, TENSOR_EXPERTS).index(c.expert_parallel))
    return sorted(scored, key=key)


def why_slower(best: Scored, other: Scored) -> str:
    """What costs ``other`` more than ``best``, in words (the largest difference first)."""
    if other.time is None:
        return other.reason or "could not be planned"
    if not other.fits:
        return other.reason or "does not fit in memory"
    if best.time is None:
        return ""
    parts = []
    for label, mine, theirs in (("compute", other.time.compute, best.time.compute),
                                ("communication", other.time.communication, best.time.communication),
                                ("pipeline bubble", other.time.bubble, best.time.bubble),
                                ("gradient sync", other.time.sync, best.time.sync),
                                ("optimizer update", other.time.optimizer, best.time.optimizer)):
        if mine - theirs > 1e-12:
            parts.append((mine - theirs, f"{label} +{_ms(mine - theirs)}"))
    if not parts:
        return "as fast (a tie broken toward fewer tensor and pipeline ranks)"
    parts.sort(reverse=True)
    if other.recompute and not best.recompute:
        parts.append((0.0, f"recomputes {len(other.recompute)} blocks to fit"))
    return ", ".join(p for _, p in parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a of two scores of the same items (1: the same order, -1: reversed; ties count neither)."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return 1.0
    agree = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs)
    disagree = sum((a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return (agree - disagree) / len(pairs)


@dataclass(frozen=True, slots=True)
class Accuracy:
    mape: float
    """Mean absolute error of the predictions as a share of the measured times."""
    kendall_tau: float
    """How alike the predicted and measured orders are."""
    picked_over_fastest: float
    """The measured time of the grid predicted fastest over the fastest measured (1: the right pick)."""


def prediction_accuracy(predicted: Sequence[float], measured: Sequence[float]) -> Accuracy:
    """How well predicted step times match measured ones over the same grids."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError(f"{len(predicted)} predictions for {len(measured)} measurements")
    picked = measured[min(range(len(predicted)), key=predicted.__getitem__)]
    return Accuracy(sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured),
                    kendall_tau(predicted, measured), picked / min(measured))
