"""screen: a grid's step time and least memory in closed form, without planning it.

The plan search (``autopar.planning.search``) screens every grid a world size allows, tens of thousands at
thousands of GPUs, and plans exactly only the most promising (``passes.analysis.search_plans`` prices a
plan). The screen reads one plan of the model on one rank (``shape_of``: its matmuls grouped by shape,
its parameters, activations and links) and prices a grid from it: AxoNN's per-layer collectives on even
splits, the busiest pipeline rank's share of the blocks (``stage_imbalance``), the gradient sync and the
optimizer state, whole or split over data (``screen_pair`` prices both with their shared part once).

Pure: no process groups, ranks or environment.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.config import ParallelConfig
from autopar.decisions import lent_axis
from passes.analysis.choose_stages import choose_stages
from passes.analysis.expert_costs import ExpertShape, exchange_bytes
from passes.analysis.estimate_memory import block_of, scattered_grad_bytes
from passes.analysis.machine import Machine
from passes.analysis.report import StepReport
from passes.analysis.search_plans import BUCKET_BYTES, Candidate, Prices, arrival_skew, matmul_slowdown, pipeline_span


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the screen needs of a model, from one plan on one rank (``shape_of``): its matmuls grouped by
    (rows of the global batch, in features, out features, orientation parity) with their count and
    FLOPs, and its parameters, saved activations and operators."""

    matmuls: tuple[tuple[int, int, int, int, int, float], ...]
    """(rows, in features k, out features n, 0 normal / 1 transposed, how many, FLOPs of all of them)."""
    param_bytes: int
    """Trainable parameters (fp32)."""
    saved_bytes: int
    """Activations saved for backward over the global batch."""
    ops: int
    segments: int
    """Links a pipeline can be cut into (at most this many stages)."""
    least_kept_bytes: int = 0
    """Activations kept for backward over the global batch at the least (every block recomputed that
    saves more than its inputs)."""
    attention_flops: float = 0.0
    """The attention products' FLOPs of a step over the global batch, forward and backward."""
    segment_flops: tuple[tuple[float, bool], ...] = ()
    """Matmul and attention FLOPs of each link of the chain, in order (the runs of matmuls outside the
    blocks, and each block), and whether it is a block: how evenly a pipeline's stages can split the work
    (``stage_imbalance``)."""
    outside_flops: float = 0.0
    """The FLOPs of the matmuls outside the blocks (a language model's head): a grid with two tensor axes
    splits them over one (the vocabulary over the larger), not both."""
    whole_flops: float = 0.0
    """The FLOPs of a step's matmul-like ops left whole (grouped matmuls of routed experts at the rows routed
    to them, convolutions: ``StepReport.whole``) over the global batch: split over the batch shards only."""
    whole_weight_bytes: int = 0
    """The parameters those ops read (fp32): whole on every tensor rank."""
    experts: tuple[ExpertShape, ...] = ()
    """The routed-experts layers an expert layout can split over data (``StepReport.experts``)."""
    attention_kv: tuple[int, ...] = ()
    """Each attention's keys' and values' bytes over the global batch (``StepReport.attention_kv``): what a
    context degree gathers."""
    output_bytes: int = 0
    """The floating outputs' bytes over the global batch (logits): what a context degree gathers whole."""
    context_whole_flops: float = 0.0
    """Of ``matmuls``' and ``attention_flops``' FLOPs, those a context degree leaves whole (after a read of the
    whole sequence, ``Plan.context_whole``): every context rank computes all their tokens (``with_context_whole``)."""


def shape_of(report: StepReport, shards: int = 1) -> ModelShape:
    """A ModelShape from the step report of a plan whose only degree is data (``shards`` ranks: each
    holds the whole model and 1/shards of the batch; 1: one rank). Matmuls alternate orientation as
    Megatron pairs them (a column-split layer feeds a row-split one)."""
    groups: dict[tuple[int, int, int, int], list[float]] = {}
    links: list[tuple[str, float]] = []  # (block, or '' outside the blocks; FLOPs)
    for i, r in enumerate(report.layers):
        rows = shards
        for d in r.in_shape[:-1]:
            rows *= d
        key = (rows, r.in_shape[-1], r.out_shape[-1], i % 2)
        count, flops = groups.get(key, [0, 0.0])
        groups[key] = [count + 1, flops + r.flops]
        block = block_of(r.module) or ""
        if links and links[-1][0] == block:
            links[-1] = (block, links[-1][1] + r.flops)
        else:
            links.append((block, float(r.flops)))
    blocks = sum(1 for b, _ in links if b)
    attention = report.rank_attention_flops * shards / blocks if blocks else 0.0  # (the blocks compute it)
    weights = {r.weight: r.num_parameters * 4 for r in report.whole}
    return ModelShape(tuple((*k, int(c), f) for k, (c, f) in groups.items()), report.rank_update_bytes,
                      report.rank_saved_bytes * shards, report.rank_ops, report.segments,
                      report.rank_least_kept_bytes * shards, report.rank_attention_flops * shards,
                      tuple((f + (attention if b else 0.0), bool(b)) for b, f in links),
                      sum(f for b, f in links if not b), float(sum(r.flops for r in report.whole)),
                      sum(weights.values()), report.experts, tuple(a.kv_bytes * shards for a in report.attention_kv),
                      sum(report.output_bytes) * shards)


def with_context_whole(shape: ModelShape, report: StepReport, shards: int, context: int) -> ModelShape:
    """``shape`` (``shape_of``'s, over ``shards`` batch shards) with the FLOPs a context degree leaves whole, from
    ``report``: a plan of the same model and batch shards at context ``context`` (its rows marked
    ``all_tokens``, its attention FLOPs per rank the whole part's plus 1/context of the rest's)."""
    matmuls = sum(r.flops for r in report.layers if r.all_tokens)
    split = shape.attention_flops / shards  # (per batch shard: all of it, without context)
    attention = max(0.0, (context * report.rank_attention_flops - split) / (context - 1)) * shards
    return dataclasses.replace(shape, context_whole_flops=float(matmuls + attention))


def stage_imbalance(segment_flops: Sequence[float], ranks: int, chunks: int = 1) -> float:
    """How much more work the busiest of ``ranks`` pipeline ranks does than the average, when a chain of
    links costing ``segment_flops`` is cut into ``ranks x chunks`` stages as the planner cuts it (the
    smallest largest stage; stage k on rank k mod ranks). 128 equal blocks and a head half a block's
    size on 64 stages: 2.5 blocks on the head's stage against 2.0 on average, 1.25; on 128 stages, 1.5
    against 1.0. 1.0 without links to read."""
    total = sum(segment_flops)
    stages = ranks * chunks
    if ranks <= 1 or not total:
        return 1.0
    links = [0.0] * max(stages - len(segment_flops), 0) + list(segment_flops)  # (links without matmuls)
    cut = choose_stages(links, [0.0] * (len(links) - 1), stages)
    loads = [0.0] * ranks
    for k, st in enumerate(cut):
        loads[k % ranks] += st.seconds
    return max(loads) / (total / ranks)


def _tensor_seconds(shape: ModelShape, c: Candidate, price: Prices, axes: tuple) -> tuple[float, float]:
    """AxoNN's per-layer collectives of every matmul, one step of this rank (DESIGN-NOTES section 2): their
    seconds and how many, under the cheaper of the two alternations the planner may choose (which layer of
    a pair splits its output over row). A weight's depth collectives, the same under both, are priced once.
    ``axes``: ``_axes(c, price)``."""
    shards = c.data * c.depth * c.context  # (a context rank's matmuls take its tokens: rows alike)
    micro = c.microbatches if c.pipeline > 1 else 1
    totals = [[0.0, 0.0], [0.0, 0.0]]  # per alternation: seconds, calls
    memo = price.memo
    for rows, k, n, parity, layers, _ in shape.matmuls:
        m_d = max(rows // (shards * micro), 1)
        share = layers * micro / c.pipeline
        both = memo.get((axes, k, n, parity, m_d))  # (``_layer_seconds``'s memo, read inline: 135,000 calls)
        if both is None:
            both = _layer_seconds(c, k, n, parity, m_d, price, axes)
        for total, (seconds, calls) in zip(totals, both):
            total[0] += share * seconds
            total[1] += share * calls
    return min((total, count) for total, count in totals)


def _axes(c: Candidate, price: Prices) -> tuple:
    """What a matmul's tensor collectives depend on besides its shape: the tensor degrees and their links."""
    return ("layer", price.half, c.row, c.col, c.depth, price.link("row"), price.link("col"), price.link("depth"))


def _layer_seconds(c: Candidate, k: int, n: int, parity: int, m_d: int, price: Prices, axes: tuple
                   ) -> tuple[tuple[float, int], tuple[float, int]]:
    """One call's collectives of a matmul of ``m_d`` rows, ``k`` in and ``n`` out features under either
    alternation: (seconds, calls) of each. They depend on the tensor axes and their links alone (``axes``:
    the tensor degrees and links, ``price.half``), so grids alike in those share them (``price.memo``)."""
    key = (axes, k, n, parity, m_d)
    out = price.memo.get(key)
    if out is not None:
        return out
    depth, depth_calls = 0.0, 0
    if c.depth > 1:  # the weight's gathers (forward, backward) and its gradient's reduce-scatter
        w = n * k * 4 // (c.row * c.col)
        weight = (axes, w)  # (the same for every rows per call)
        depth = price.memo.get(weight)
        if depth is None:
            depth = price.memo[weight] = (price("all_gather", "depth", c.depth, w, "forward")
                                          + price("all_gather", "depth", c.depth, w, "backward")
                                          + price("reduce_scatter", "depth", c.depth, w, "backward"))
        depth_calls = 3
    flips = []
    for flip in (0, 1):
        transposed = parity ^ flip
        a, b = (c.col, c.row) if transposed else (c.row, c.col)
        seconds, calls = (depth, depth_calls) if c.depth > 1 else (0.0, 0)
        if b > 1:  # the output's partial sums
            seconds += price("all_reduce", "row" if transposed else "col", b, m_d * n // a * 4, "forward")
            calls += 1
        if a > 1:  # the input gradient's
            seconds += price("all_reduce", "col" if transposed else "row", a, m_d * k // b * 4, "backward")
            calls += 1
        flips.append((seconds, calls))
    out = price.memo[key] = (flips[0], flips[1])
    return out


def _divides(k: int, n: int, row: int, col: int) -> bool:
    """Whether row x col can split a matmul of ``k`` in and ``n`` out features evenly, in either orientation."""
    return k % row == 0 and n % col == 0 or k % col == 0 and n % row == 0


def screen(shape: ModelShape, candidate: Candidate, machine: Machine, half: bool = False,
           memo: dict[Any, float] | None = None, compiled: bool = False) -> tuple[float, int]:
    """(predicted seconds, least memory per device) of ``candidate`` in closed form: AxoNN's per-layer
    collectives (DESIGN-NOTES section 2) on even splits, the head's matmuls over one tensor axis, and the
    busiest pipeline rank's share of the blocks (``stage_imbalance``), without planning it. The memory is a
    floor: parameters, gradients and optimizer state, and (without a pipeline, whose ranks hold unequal
    parts) the least activations any recomputation keeps, split over every tensor rank (some stay whole: a
    floor). Not priced: the recomputation a pipeline's activations need to fit (the interleaved schedule
    keeps more micro-batches in flight), which the search leaves to exact planning (it plans both schedules
    of a grid it keeps). Ranks grids for the search to plan the most promising exactly; not a plan's
    prediction.
    ``memo``: collective prices kept between calls on the same machine (``Prices``). ``compiled``: training runs
    compiled, each piece of whose backward returns its gradients at once (``estimate_memory.compiled_recompute``)."""
    return _Degrees(shape, candidate, machine, half, {} if memo is None else memo, compiled).pair(candidate)[0]


def screen_pair(shape: ModelShape, candidate: Candidate, machine: Machine, half: bool = False,
                memo: dict[Any, float] | None = None, compiled: bool = False
                ) -> tuple[tuple[float, int], tuple[float, int] | None]:
    """``screen`` of ``candidate`` and of it with its optimizer state split over data (None where data is 1
    or it is split already), the part they share priced once (the search screens both for a grid that does
    not fit)."""
    return screen_grids(shape, [candidate], machine, half, memo, compiled)[0]


def screen_grids(shape: ModelShape, grids: Sequence[Candidate], machine: Machine, half: bool = False,
                 memo: dict[Any, float] | None = None, compiled: bool = False
                 ) -> list[tuple[tuple[float, int], tuple[float, int] | None]]:
    """``screen_pair`` of each of ``grids``, in order, the same to the bit: grids of the same degrees (their
    micro-batches and schedules differ: 53,482 grids of 3,072 GPUs have 5,005 degrees) share what depends on
    the degrees alone (the config, the links, the FLOPs, the parameters, the gradient sync and the optimizer
    state), priced once for them."""
    memo = {} if memo is None else memo
    groups: dict[tuple, _Degrees] = {}
    out = []
    for c in grids:
        key = (c.data, c.pipeline, c.row, c.col, c.depth, c.shard_optimizer, c.sequence_parallel, c.expert_parallel,
               c.context)
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Degrees(shape, c, machine, half, memo, compiled)
        out.append(group.pair(c))
    return out


class _Degrees:
    """What the screen prices alike for every grid of one set of degrees (and state and sequence splits),
    and, per grid, the rest (``pair``)."""

    def __init__(self, shape: ModelShape, c: Candidate, machine: Machine, half: bool, memo: dict[Any, Any],
                 compiled: bool = False) -> None:
        self.shape, self.machine, self.half, self.memo, self.compiled = shape, machine, half, memo, compiled
        self.config = config = c.config
        # (a context rank computes its tokens of every row: its share as a batch shard's)
        self.shards, self.tensor, self.stages = c.data * c.depth * c.context, c.row * c.col, c.pipeline
        self.price = price = Prices(machine, config, half, memo)
        # the matmuls outside the blocks (the head) split over one tensor axis, the larger, at best
        self.widen = widen = self.tensor / max(c.row, c.col)
        key = ("matmuls", id(shape), c.row, c.col)  # (what depends on the tensor axes alone)
        if key not in memo:
            flops = sum(f for *_, f in shape.matmuls) + (widen - 1) * shape.outside_flops
            # a block's matmul whose features the tensor axes divide in neither orientation stays whole on every
            # tensor rank (make_plan's divisibility rule): its work and its weight are not split (the 1T GPT's
            # 25,600 features at tensor 6)
            whole = [(k * n * count * 4, f) for _, k, n, _, count, f in shape.matmuls
                     if count > 1 and self.tensor > 1 and not _divides(k, n, c.row, c.col)]
            flops += (self.tensor - 1) * sum(f for _, f in whole)
            memo[key] = flops, sum(b for b, _ in whole)
        self.flops, whole_bytes = memo[key]
        # the weights of the ops left whole (convolutions, experts a layout does not split) are whole on every
        # tensor rank; an expert layout splits the routed experts' over data (each data rank its experts, their
        # gradients complete)
        kept_whole = shape.whole_weight_bytes
        # (or, ``expert_parallel="data+tensor"``, whole ones over data x the tensor axis: ``config.expert_axis``)
        self.over = over = config.expert_axis
        self.lent = lent_axis(over)
        self.experts = experts = shape.experts if over else ()
        # and on a tensor grid each expert splits over the larger of row and col (make_plan's tensor_split; its
        # hidden features taken to divide), unless the tensor axis holds whole experts
        self.expert_axis = ("row" if c.row >= c.col else "col") if self.tensor > 1 and not self.lent else ""
        self.each_expert = each = shape.experts if self.expert_axis else ()
        pieces = max(c.row, c.col)  # (each expert's pieces, or the lent axis's ranks: the same share either way)
        split = sum(e.weight_bytes for e in experts)
        split_experts = split // (c.data * self.stages * pieces)  # (a pipeline rank: its stages' share of the layers)
        parted = sum(e.weight_bytes for e in each) if not experts else 0
        self.params = params = ((shape.param_bytes - kept_whole + (self.tensor - 1) * whole_bytes)
                                // (self.tensor * c.depth * self.stages)
                                + (kept_whole - split - parted) // self.stages + split_experts
                                + parted // (pieces * self.stages))
        # (a pipeline's ranks: not priced)
        self.kept = shape.least_kept_bytes // (self.shards * self.tensor) if self.stages == 1 else 0
        self.own = self._state(c, params, price, c.shard_optimizer, split_experts)
        self.split = None if c.shard_optimizer or c.data == 1 else self._state(c, params, price, True, split_experts)
        self.micro: dict[int, tuple[float, float, float, int]] = {}
        self.axes = _axes(c, price)

    def _exchange(self, c: Candidate, micro: int) -> tuple[float, float]:
        """The all-to-alls of the routed experts split over data (``expert_costs.expert_collectives``, balanced
        routing), or the all-reduces of each expert split over a tensor axis: seconds and calls of one step of
        ``micro`` micro-batches, a pipeline rank its stages' share of
        the layers."""
        price, seconds, calls = self.price, 0.0, 0
        over, lent = self.over, self.lent
        n, t = self.config.size(over), self.config.size(lent)
        for e in self.experts:
            rows = e.rows // (self.shards * micro)
            block = -(-rows // t)  # (a lent tensor axis: each of its ranks sends a block of the rows they hold)
            seconds += price("all_to_all", over, n, (n - 1) * (e.experts // n) * 8, "forward")
            seconds += sum(price("all_to_all", over, n, exchange_bytes(block, b, n), "forward") for b in e.forward)
            seconds += sum(price("all_to_all", over, n, exchange_bytes(block, b, n), "backward") for b in e.backward)
            calls += 1 + len(e.forward) + len(e.backward)
            if lent:  # (the results gathered over it forward, the rows' gradients backward)
                seconds += price("all_gather", lent, t, rows * e.forward[-1], "forward")
                seconds += price("all_gather", lent, t, rows * e.forward[0], "backward")
                calls += 2
        size = max(c.row, c.col)
        for e in self.each_expert:  # each expert split over a tensor axis: its partial results, the rows' gradient
            rows = e.rows // (self.shards * micro)
            seconds += price("all_reduce", self.expert_axis, size, rows * e.forward[-1], "forward")
            seconds += price("all_reduce", self.expert_axis, size, rows * e.forward[0], "backward")
            calls += 2
        share = micro / self.stages
        return seconds * share, calls * share

    def _context(self, c: Candidate, micro: int) -> tuple[float, float]:
        """Context parallelism's collectives of one step (``estimate_costs.context_collectives``): each attention's
        keys and values gathered whole over the context ranks in forward and again in backward, and their gradients
        reduce-scattered (causal attention, as most are: this rank's rows, the heads over the larger tensor axis), and the outputs gathered: seconds and
        calls. Under a pipeline, per micro-batch (``micro``) of the rank's share of the blocks, and the last
        stage's outputs gathered for the loss and their gradients reduce-scattered (``loss_collectives``), priced
        on every rank (the busiest may be the last)."""
        price, n, rows, stages = self.price, c.context, c.data * c.depth * micro, self.stages
        heads = max(c.row, c.col)
        seconds = sum(price("all_gather", "context", n, kv // (rows * heads), "forward")
                      + price("all_gather", "context", n, kv // (rows * heads), "backward")
                      + price("reduce_scatter", "context", n, kv // (rows * heads), "backward")
                      for kv in self.shape.attention_kv) * micro / stages
        calls = 3 * len(self.shape.attention_kv) * micro / stages
        if self.shape.output_bytes:
            seconds += micro * price("all_gather", "context", n, self.shape.output_bytes // rows, "forward")
            calls += micro
            if stages > 1:
                seconds += micro * price("reduce_scatter", "context", n, self.shape.output_bytes // rows, "backward")
                calls += micro
        return seconds, calls

    def _state(self, c: Candidate, params: int, price: Prices, shard_optimizer: bool, split_experts: int = 0
               ) -> tuple[float, float, int]:
        """The gradient sync and the optimizer update (seconds) and the memory (bytes), with the optimizer
        state whole on every data rank or (``shard_optimizer``) split over data. ``split_experts``: this rank's
        bytes of experts split over data, whose gradients are complete from every data rank's rows (summed over
        depth only)."""
        sync = 0.0
        replicas = c.data * c.context  # (the context ranks hold the same weights: summed over data x context)
        scatter = shard_optimizer and c.data > 1
        if replicas > 1:  # in the runtime's buckets: as many full ones as fit, and the rest
            # (split state: each data rank keeps the sum of its chunk, a reduce-scatter, then sums it over context)
            kind, axis, group = (("reduce_scatter", "data", c.data) if scatter else
                                 ("all_reduce", "data+context" if c.context > 1 else "data", replicas))
            full, rest = divmod(params - split_experts, BUCKET_BYTES)
            sync = full * price(kind, axis, group, BUCKET_BYTES, "step") if full else 0.0
            sync += price(kind, axis, group, rest, "step") if rest else 0.0
            if scatter and c.context > 1:
                sync += price("all_reduce", "context", c.context, (params - split_experts) // c.data, "step")
        if split_experts and c.depth * c.context > 1:  # (the experts' gradients: over the ranks holding the same)
            axis = "+".join(a for a in ("context", "depth") if getattr(c, a) > 1)
            sync += price("all_reduce", axis, c.depth * c.context, split_experts, "step")
        state = 2 * params  # Adam's two moments
        grads = params
        if shard_optimizer and c.data > 1:  # each data rank keeps and updates 1/data, then all-gathers the rest
            shared = params - split_experts  # (the experts split over data are each rank's own already)
            state = 2 * shared // c.data + 2 * split_experts
            grads = (scattered_grad_bytes(shared // c.data, shared) + split_experts if self.stages == 1
                     else params)
            if self.compiled and self.stages == 1:  # (a compiled piece of backward returns a bucket's worth of
                grads += min(shared, BUCKET_BYTES)  # whole gradients at once: autopar.runtime.compiled.pieces)
            full, rest = divmod(shared, BUCKET_BYTES)
            sync += full * price("all_gather", "data", c.data, BUCKET_BYTES, "step") if full else 0.0
            sync += price("all_gather", "data", c.data, rest, "step") if rest else 0.0
        machine = self.machine
        update = 7 * state / 2 / machine.memory_bytes_per_second if machine.memory_bytes_per_second else 0.0
        return sync, update, params + grads + state + self.kept

    def _per_micro(self, c: Candidate, micro: int) -> tuple[float, float, float, int]:
        """(compute seconds, tensor collectives' seconds, blocking calls, bytes a pipeline stage sends per
        micro-batch) of a grid of these degrees running ``micro`` micro-batches, before the pipeline's
        imbalance."""
        shape, machine, price, memo = self.shape, self.machine, self.price, self.memo
        shards, tensor, stages = self.shards, self.tensor, self.stages
        key = ("slowdown", id(shape), self.half, shards * micro, c.row, c.col)
        if key not in memo:
            calls = [(f, (max(rows // (shards * micro), 1), k // (c.row if parity else c.col),
                          n // (c.col if parity else c.row)))
                     for rows, k, n, parity, _, f in shape.matmuls]  # (normal: in features over col, out over row)
            memo[key] = matmul_slowdown(calls, machine, self.half)
        compute = self.flops / (shards * tensor * stages) / machine.flops_per_second * memo[key]
        compute += shape.ops * micro / stages * machine.op_seconds
        # attention's heads split over one tensor axis (the q projection's output axis: the larger, at best)
        compute += shape.attention_flops / (shards * max(c.row, c.col) * stages) / machine.flops_per_second
        # the ops left whole: each rank its rows' share (under a pipeline, of its stages' blocks)
        whole = shape.whole_flops - sum(e.flops for e in self.each_expert) * (1 - 1 / max(c.row, c.col))
        compute += whole / (shards * stages) / machine.flops_per_second
        if c.context > 1:  # (what reads the whole sequence: each context rank all its tokens, not 1/C; over the
            # tensor axes as the rest, at best)
            compute += (shape.context_whole_flops * (c.context - 1) / (shards * max(c.row, c.col) * stages)
                        / machine.flops_per_second)
        if machine.activation_bytes_per_second:
            compute += shape.saved_bytes / (shards * tensor * stages) / machine.activation_bytes_per_second
        # the planner orients each matmul; of the two alternations (which layer of a pair splits its output
        # over row) the screen takes the cheaper
        key = ("tensor", id(shape), self.half, c.data, c.row, c.col, c.depth, c.context, stages, micro)  # (either schedule)
        if key not in memo:
            memo[key] = _tensor_seconds(shape, c, price, self.axes)
        comm, blocking = memo[key]
        if c.context > 1:
            gathers, calls = self._context(c, micro)
            comm, blocking = comm + gathers, blocking + calls
        if self.experts or self.each_expert:
            exchange, calls = self._exchange(c, micro)
            comm, blocking = comm + exchange, blocking + calls
        message = 0
        if stages > 1:  # each micro-batch's activation to the next stage and its gradient back: its bytes
            key = ("hidden", id(shape))
            if key not in memo:
                memo[key] = max(((r, k) for r, k, _, _, count, _ in shape.matmuls), key=lambda t: t[0] * t[1])
            rows, hidden = memo[key]
            message = max(rows // (shards * micro), 1) * hidden * 4 // tensor
        return compute, comm, blocking, message

    def pair(self, c: Candidate) -> tuple[tuple[float, int], tuple[float, int] | None]:
        """``screen_pair`` of ``c``, a grid of these degrees."""
        shape, machine, stages = self.shape, self.machine, self.stages
        if stages * c.chunks > max(shape.segments, 1):  # more stages than links to cut: not a plan
            return (math.inf, 0), None
        micro = c.microbatches if stages > 1 else 1
        parts = self.micro.get(micro)
        if parts is None:
            parts = self.micro[micro] = self._per_micro(c, micro)
        compute, comm, blocking, message = parts
        if stages > 1:  # the busiest pipeline rank's share: the stages cannot split the blocks evenly
            key = ("imbalance", stages, c.chunks, self.widen)
            if key not in self.memo:
                self.memo[key] = stage_imbalance([f if block else f * self.widen for f, block in shape.segment_flops],
                                                 stages, c.chunks)
            compute, comm = compute * self.memo[key], comm * self.memo[key]
            comm += 2 * micro * c.chunks * self.price("send", "pipeline", 2, message, "forward")
            blocking += 2 * micro * c.chunks
        comm += arrival_skew(round(blocking), compute, machine, self.config)
        bubble = 0.0
        if stages > 1:
            f = (stages - 1) / (c.chunks * micro + stages - 1)
            bubble = pipeline_span(compute + comm, f, machine, self.config) - (compute + comm)
        busy = compute + comm
        sync, update, memory = self.own
        own = busy + sync + update + bubble, memory
        if self.split is None:
            return own, None
        sync, update, memory = self.split
        return own, (busy + sync + update + bubble, memory)
