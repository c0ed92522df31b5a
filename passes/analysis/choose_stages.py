"""choose_stages: cut the chain of segments into pipeline stages with the smallest bottleneck, exactly.

The chain is estimate_memory's segments (blocks of a ModuleList and the runs of nodes between them).
A stage is a contiguous run ``[i, j)``; its time is its segments' compute and tensor-parallel
communication plus the transfers at its two cuts (activations forward, their gradients backward):

    time(i, j) = S[j] - S[i] + cut[i - 1] + cut[j - 1]        (cut[-1] = cut[n - 1] = 0)

Minimizing the largest stage time over P stages is a dynamic program over (stages used, segments
covered); ``time`` separates into a term of ``i`` and a term of ``j``, so each step is one vectorized
min-max over an ``n x n`` table: 1,000 segments and 8 stages take milliseconds.

``Hardware`` holds the rates that turn FLOPs and bytes into seconds. Only their ratios matter to the
choice; the defaults are one H100-class GPU per rank (documented on the fields), and ``Hardware.of`` reads
them from a described machine (``passes.analysis.machine``): the runtime cuts for the machine it runs on,
where a CPU's matmuls are ~20,000 times slower against its links than an H100's, so the same model's
best cut differs (a tiny Llama's 4 stages: H100 rates keep the embedding alone, since a cut's transfer
outweighs a block's compute; CPU rates balance the blocks and the head).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx

from autopar.config import ParallelConfig
from autopar.decisions import PipelinePlan, Plan, StagePlan
from autopar.errors import PlanError
from passes.analysis.estimate_costs import AGREEMENT, Collective, matmul_flops, matmul_split
from passes.analysis.estimate_memory import shard_fraction, segment_names
from passes.analysis.graph_facts import (ATTENTION_STEP_FACTOR, MatmulMatch, attention_flops, module_of, param_name,
                                         tensor_meta, token_split_nodes)
from passes.analysis.layout_rules import LayoutResult
from passes.analysis.machine import Machine
from passes.analysis.make_plan import layouts_for
from passes.analysis.whole_matmuls import match_whole
from passes.ir import input_info


@dataclass(frozen=True, slots=True)
class Hardware:
    flops_per_second: float = 400e12
    """Sustained matmul rate per rank (about 40% of an H100's dense bf16 peak)."""
    tensor_bytes_per_second: float = 200e9
    """Per-rank bandwidth of tensor-parallel collectives (NVLink within a node)."""
    pipeline_bytes_per_second: float = 25e9
    """Point-to-point bandwidth between pipeline stages (a 200 Gb/s inter-node link)."""
    collective_seconds: float = 0.0
    """Fixed cost of one collective (latency). The planner's default leaves it out: at the sizes it
    plans for, bytes dominate; ``estimate_step_seconds`` uses it for a machine it was measured on."""
    name: str = "H100-class default"
    """What the rates describe, as the plan report names them."""

    @staticmethod
    def of(machine: Machine, config: ParallelConfig) -> Hardware:
        """``machine``'s rates for ``config``'s grid: tensor collectives on the link of the tensor axes, stage
        transfers on the pipeline axis's (within a node when the pipeline's ranks are)."""
        tensor = machine.link(config, "row+col+depth")[0]
        return Hardware(machine.flops_per_second, tensor, machine.link(config, "pipeline")[0], name=machine.name)


@dataclass(frozen=True, slots=True)
class Stage:
    first: int
    """Index of the stage's first segment."""
    stop: int
    """One past its last segment."""
    seconds: float


def stage_seconds(costs: Sequence[float], cuts: Sequence[float], first: int, stop: int) -> float:
    """time(first, stop) of the module docstring."""
    inside = sum(costs[first:stop])
    return inside + (cuts[first - 1] if first > 0 else 0.0) + (cuts[stop - 1] if stop < len(costs) else 0.0)


def choose_stages(costs: Sequence[float], cuts: Sequence[float], num_stages: int) -> tuple[Stage, ...]:
    """The partition of the chain into ``num_stages`` non-empty contiguous stages with the smallest
    largest stage time (ties: the first found).

    Args:
        costs: seconds of each segment (forward + backward compute and tensor-parallel communication).
        cuts: ``cuts[k]`` is the transfer time of a cut after segment k (len n - 1, or n with a 0 last).
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise PlanError(f"cannot cut {n} segments into {num_stages} pipeline stages. Use between 1 and {n} "
                        "stages (a model with more layers can use more).")
    cut = torch.zeros(n + 1, dtype=torch.float64)  # cut[k + 1]: after segment k; cut[0] = cut[n] = 0
    cut[1:n] = torch.tensor([float(c) for c in list(cuts)[:n - 1]], dtype=torch.float64)
    prefix = torch.zeros(n + 1, dtype=torch.float64)
    prefix[1:] = torch.cumsum(torch.tensor([float(c) for c in costs], dtype=torch.float64), 0)
    # time(i, j) = left[i] + right[j] for 0 <= i < j <= n
    left = -prefix + cut  # cut before segment i is cut[i]
    right = prefix + cut  # cut after segment j - 1 is cut[j]
    table = left[:, None] + right[None, :]
    table = table.masked_fill(~torch.ones(n + 1, n + 1, dtype=torch.bool).triu(1), float("inf"))
    best = table[0].clone()  # best[j]: smallest bottleneck covering segments [0, j) with p stages
    choice = []
    for _ in range(num_stages - 1):
        candidates = torch.maximum(best[:, None], table)  # (i, j): stages so far end at i, the next is [i, j)
        best, arg = candidates.min(0)
        choice.append(arg)
    stops, j = [n], n
    for arg in reversed(choice):
        j = int(arg[j])
        stops.append(j)
    bounds = [0, *reversed(stops)]
    return tuple(Stage(a, b, stage_seconds(costs, cuts, a, b)) for a, b in zip(bounds, bounds[1:]))


def lower_bound(costs: Sequence[float], num_stages: int, cuts: Sequence[float] = ()) -> float:
    """No partition beats this: the largest segment, or the average stage. Stage times sum to the
    segments' total plus each chosen cut twice (both stages beside it pay its transfer), so the
    average counts the ``num_stages - 1`` cheapest cuts twice."""
    cheapest = sorted(cuts)[:max(num_stages - 1, 0)]
    return max((sum(costs) + 2 * sum(cheapest)) / num_stages, max(costs, default=0.0))


def bubble_fraction(num_stages: int, num_microbatches: int, chunks_per_rank: int = 1) -> float:
    """Idle share of a 1F1B or GPipe step, (p - 1) / (v m + p - 1) with v chunks per rank (interleaved)."""
    p, m, v = num_stages, num_microbatches, chunks_per_rank
    return (p - 1) / (v * m + p - 1)


# (pure; a plan search asks for the same schedules again: 798 calls planning the 1T GPT)
@functools.lru_cache(maxsize=4096)
def inflight_microbatches(num_ranks: int, num_microbatches: int, rank: int, chunks_per_rank: int = 1
                          ) -> tuple[int, ...]:
    """How many micro-batches' activations pipeline rank ``rank`` holds at most for each of its stages
    (its chunks, in order), under torch's 1F1B (one stage per rank: ``min(m, P - rank)``) or
    Interleaved1F1B, whose order this follows: rounds of ``m // max(1, m // P)`` micro-batches, each
    rank first runs ``(v - 1) x round + 2 (P - 1 - rank)`` forwards (at most ``v m``), then alternates
    one forward with one backward, backwards going through its chunks in reverse. The count of each
    chunk is its most over the step, a bound on what it holds at once: the first rank of 4 with 2 chunks
    and 8 micro-batches holds 11 chunk-micro-batches at most (Megatron's factor ``1 + (P - 1) / (P v)``
    over 1F1B's 8), 8 of the first chunk and 4 of the second at their most."""
    p, m, v = num_ranks, num_microbatches, chunks_per_rank
    if v == 1:
        return (max(min(m, p - rank), 1),)
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), v * m)

    def forward(i: int) -> int:
        return (i // per_round) % v

    def backward(j: int) -> int:
        return v - 1 - (j // per_round) % v

    held, most = [0] * v, [0] * v
    order = ([("f", i) for i in range(warmup)]
             + [x for k in range(v * m - warmup) for x in (("f", warmup + k), ("b", k))]
             + [("b", j) for j in range(v * m - warmup, v * m)])
    for kind, i in order:
        if kind == "f":
            held[forward(i)] += 1
            most = [max(a, b) for a, b in zip(most, held)]
        else:
            held[backward(i)] -= 1
    return tuple(max(c, 1) for c in most)


@dataclass(frozen=True, slots=True)
class ChainSegment:
    """One link of the chain a pipeline is cut from, with what a stage holding it pays."""

    name: str
    """Block FQN (``model.layers.3``) or ``<outside>#k``."""
    seconds: float
    """Forward + backward compute and tensor-parallel communication of one step, this rank."""
    cut_seconds: float
    """Sending the tensors that cross a cut after this segment (forward) and their gradients (backward)."""
    params: tuple[tuple[str, int], ...]
    """Parameters the segment reads, with this rank's fp32 bytes of each (a tied weight is read by two)."""
    collectives: tuple[Collective, ...] = ()
    """The tensor-parallel collectives its forward and backward issue (one step of the captured batch)."""
    flops: float = 0.0
    """This rank's matmul FLOPs of its forward and backward (one step of the captured batch)."""
    crossing: tuple[tuple[int, bool], ...] = ()
    """Each tensor a cut after this segment would send: (this rank's bytes, whether its gradient is
    sent back)."""
    attention_flops: float = 0.0
    """This rank's attention work of its forward and backward, in FLOPs of its stage's time."""


def priced(chain: Sequence[ChainSegment], hardware: Hardware) -> tuple[ChainSegment, ...]:
    """``chain`` with each segment's ``seconds`` and ``cut_seconds`` under ``hardware``'s rates."""
    return tuple(dataclasses.replace(
        s, seconds=(s.flops + s.attention_flops) / hardware.flops_per_second
        + sum(float(c.bytes) for c in s.collectives) / hardware.tensor_bytes_per_second,
        cut_seconds=sum(b * (1 + g) for b, g in s.crossing) / hardware.pipeline_bytes_per_second) for s in chain)


def pipeline_chain(gm: fx.GraphModule, plan: Plan, collectives: Sequence[Collective],
                   hardware: Hardware = Hardware(),
                   layouts: tuple[LayoutResult, dict[fx.Node, MatmulMatch]] | None = None) -> tuple[ChainSegment, ...]:
    """The chain of ``gm`` (captured for one micro-batch on this rank) with times under ``hardware``.
    ``layouts``: ``layouts_for(gm, plan)`` where the caller has it (read only)."""
    config = plan.config
    sizes = {"row": config.row, "col": config.col}
    res, by_node = layouts or layouts_for(gm, plan)
    seg_of = segment_names(gm)
    order = list(dict.fromkeys(seg_of.values()))
    index = {name: k for k, name in enumerate(order)}
    flops = dict.fromkeys(order, 0.0)
    attention = dict.fromkeys(order, 0.0)
    of_module: dict[str, str] = {}
    of_param: dict[str, str] = {}
    weights = {name: n for n in gm.graph.nodes if (name := param_name(n)) is not None}
    # context parallelism: a stage computes and sends this rank's tokens of what the token lookups make (the
    # rest, rotary tables, position ids, labels, crosses whole and is cut where it is read), all of them where it
    # reads the whole sequence (``Plan.context_whole``)
    tokens = token_split_nodes(gm, config.context)
    whole = frozenset(plan.context_whole) if tokens else frozenset()
    for node, seg in seg_of.items():
        of_module.setdefault(module_of(node), seg)
        for a in node.all_input_nodes:
            if (name := param_name(a)) is not None:
                of_param.setdefault(name, seg)
        m = by_node.get(node)
        every = config.context if node.name in whole else 1  # (all the tokens, where they are divided below)
        if m is not None:
            w = m.weight_node if m.weight_node.op == "placeholder" else m.weight_node.args[0]
            flops[seg] += matmul_flops(m, res.requires_grad[m.x], res.requires_grad[w]) * every / matmul_split(
                config, plan.matmul(m.weight).orientation)
        if (w := match_whole(node)) is not None:  # grouped matmuls of experts, convolutions: whole on every rank
            # (or each expert split over a tensor axis: its part),
            # forward and the backward products that are needed (as ``report.estimate_step`` counts them)
            grads = 1 + int(res.requires_grad.get(w.x, False)) + int(res.requires_grad.get(weights.get(w.weight), False))
            flops[seg] += w.forward_flops * grads * every / plan.whole_share(w.weight)
        if (a := attention_flops(node)):  # its stage's time, not its matmul FLOPs (reported apart)
            attention[seg] += ATTENTION_STEP_FACTOR * a * every * float(shard_fraction(res.sharding(node), sizes))
    issued: dict[str, list[Collective]] = {name: [] for name in order}
    by_name = {n.name: seg for n, seg in seg_of.items()}
    for c in collectives:
        if c.phase == "step" or c.where in ("<input>", "<output>", AGREEMENT):
            continue  # once per step (gradient sync), or not run by a pipeline (train_step's loss instead)
        seg = by_name.get(c.node) or of_param.get(c.where) or of_module.get(c.where) or order[-1]
        issued[seg].append(c)
    if tokens:
        flops = {k: v / config.context for k, v in flops.items()}
        attention = {k: v / config.context for k, v in attention.items()}
    crossing: list[list[tuple[int, bool]]] = [[] for _ in order]  # tensors live across a cut after segment k
    last = len(order) - 1
    for node in gm.graph.nodes:
        info = input_info(node) if node.op == "placeholder" else None
        if node in seg_of:
            born = index[seg_of[node]]
        elif info is not None and info.batch_split:  # a batch input travels from stage 0 to its last reader
            born = 0
        else:
            continue  # parameters, buffers and constants are bound on every rank
        t = tensor_meta(node)
        users = [last if u.op == "output" else index[seg_of[u]] for u in node.users if u in seg_of or u.op == "output"]
        if t is None or not users:
            continue
        nbytes = int(t.numel() * t.element_size() * shard_fraction(res.sharding(node), sizes)
                     / (config.context if node in tokens and node.name not in whole else 1))
        for k in range(born, max(users)):
            crossing[k].append((nbytes, bool(res.requires_grad.get(node, False))))
    params = {p.name: p.local_numel(config) * 4 for p in plan.params}
    held: dict[str, dict[str, int]] = {name: {} for name in order}
    for node, seg in seg_of.items():
        for a in node.all_input_nodes:
            if (name := param_name(a)) in params:
                held[seg][name] = params[name]
    return priced([ChainSegment(name, 0.0, 0.0, tuple(held[name].items()), tuple(issued[name]), flops[name],
                                tuple(crossing[k]), attention[name]) for k, name in enumerate(order)], hardware)


def plan_pipeline(chain: Sequence[ChainSegment], num_stages: int, num_microbatches: int,
                  chunks_per_rank: int = 1, hardware: Hardware | None = None) -> PipelinePlan:
    """Stages for ``chain`` (per-micro-batch times) and what the pipeline is predicted to cost.

    With ``chunks_per_rank`` v > 1 (interleaved schedules) the chain is cut into P x v stages, the
    largest of which is minimized, and stage k runs on rank k mod P. ``hardware``: the rates to price the
    chain with first (default: the times it carries).
    """
    if hardware is not None:
        chain = priced(chain, hardware)
    costs = [s.seconds for s in chain]
    cuts = [s.cut_seconds for s in chain[:-1]]
    total = num_stages * chunks_per_rank
    stages = choose_stages(costs, cuts, total)
    held = [dict(p for s in chain[st.first:st.stop] for p in s.params) for st in stages]
    plans = tuple(StagePlan(tuple(s.name for s in chain[st.first:st.stop]), st.seconds, sum(h.values()))
                  for st, h in zip(stages, held))
    holders: dict[str, list[int]] = {}
    for k, h in enumerate(held):
        for name in h:
            holders.setdefault(name, []).append(k)
    shared = tuple((name, tuple(ks)) for name, ks in holders.items() if len(ks) > 1)
    return PipelinePlan(plans, max(st.seconds for st in stages), lower_bound(costs, total, cuts), num_microbatches,
                        bubble_fraction(num_stages, num_microbatches, chunks_per_rank), shared, chunks_per_rank,
                        rates=hardware.name if hardware is not None else "")
