"""estimate_step: the per-layer table and totals that ``python -m autopar.trace`` prints.

Everything is for one training step (forward + backward + gradient sync) on one rank, from a graph
captured for that rank's batch shard and the Plan; communicated bytes use the same accounting as
``autopar.comm_stats()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Sequence

from torch import fx

from autopar.decisions import Orientation, Plan, collective_bytes
from passes.analysis.choose_stages import Hardware
from passes.analysis.estimate_costs import (
    CONTEXT,
    AttentionShape,
    Collective,
    attention_shapes,
    gathered_outputs,
    list_collectives,
    matmul_flops,
    matmul_split,
)
from passes.analysis.expert_costs import ExpertShape, expert_collectives, expert_shapes
from passes.analysis.graph_facts import MatmulMatch, param_name, rows_of, tensor_meta
from passes.analysis.layout_rules import LayoutResult
from passes.analysis.make_plan import layouts_for
from passes.analysis.whole_matmuls import find_whole_matmuls
from passes.ir import graph_info


EVERY_TOKEN = ", every context rank's tokens"
"""Said of a row whose op comes after a read of the whole sequence under context parallelism."""


@dataclass(frozen=True, slots=True)
class LayerRow:
    module: str
    weight: str
    bias: str | None
    op: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    """Logical (unsharded) shapes on this rank's batch shard."""
    num_parameters: int
    flops: int
    """Forward + backward over the global batch."""
    sharding: str
    comm_bytes: Fraction
    """This rank's bytes for the matmul and the gradient sync of its weight and bias."""
    all_tokens: bool = False
    """Under context parallelism: every context rank computes all the tokens here (it comes after a read of the
    whole sequence: ``Plan.context_whole``), not its own."""

    @property
    def is_sharded(self) -> bool:
        return not self.sharding.startswith("replicated")

    def context_flops(self, context: int) -> int:
        """What the ``context`` ranks of one sequence compute of ``flops`` between them: ``flops``, or ``context``
        times it where each computes all the tokens."""
        return self.flops * context if self.all_tokens else self.flops


@dataclass(frozen=True, slots=True)
class StepReport:
    layers: tuple[LayerRow, ...]
    other_comm: tuple[tuple[str, Fraction], ...]
    """Communication not attributed to a matmul: (what, bytes)."""
    num_parameters: int
    flops_per_step: int
    matmul_flops_sharded: int
    param_bytes_per_rank: int
    comm_bytes_per_step: Fraction
    comm_bytes_by_kind: dict[str, Fraction] = field(default_factory=dict)
    collectives: tuple[Collective, ...] = ()
    rank_flops: float | None = None
    """Matmul FLOPs this rank computes per step when it runs part of the model only (its pipeline
    stages; the ops left whole, ``whole``, included); None: its share of every row."""
    largest_param_bytes: int = 0
    """The largest parameter, whole: what deferred construction holds at once besides the pieces."""
    rank_saved_bytes: int = 0
    """Activation bytes this rank saves for backward in one step (its stages' under a pipeline, every
    micro-batch): written in forward and read in backward, the step's elementwise traffic at least."""
    rank_update_bytes: int = 0
    """Bytes (fp32) of the trainable parameters this rank's optimizer updates."""
    rank_memory: Any = None
    """Under a pipeline, this rank's ``MemoryPlan`` (its stages' parameters and the micro-batches in flight
    there; the plan's own ``memory`` is the rank that needs the most); else None."""
    segments: int = 0
    """Links of the chain a pipeline is cut from (blocks and the runs between them): at most this many
    stages."""
    rank_ops: int = 0
    """Operators this rank's forwards call in one step (every micro-batch of its stages under a
    pipeline), each with its backward."""
    rank_attention_flops: float = 0.0
    """FLOPs of the attention products (scores and ``p v``) this rank computes in one step, forward and
    backward (``ATTENTION_STEP_FACTOR`` times the forward's; its stages' under a pipeline, every
    micro-batch); not in ``rank_flops`` or the layers' FLOPs."""
    whole: tuple[LayerRow, ...] = ()
    """The matmul-like ops on parameters that run whole on every rank (grouped matmuls of 3-D expert weights,
    convolutions: ``whole_matmuls``), with why; counted in ``flops_per_step``, in the sharded share only where
    each expert splits over a tensor axis."""
    experts: tuple[ExpertShape, ...] = ()
    """The routed-experts layers an expert layout can split, whatever this plan does with them (the plan
    search's screen prices expert layouts from them)."""
    rank_least_kept_bytes: int = 0
    """Activation bytes this rank keeps for backward at the least (without a pipeline): each block that
    saves more than its inputs recomputed. No choice of recomputation needs less (the plan search's
    screen prices memory with it)."""
    attention_kv: tuple[AttentionShape, ...] = ()
    """Each attention's keys and values over this rank's rows (every token, the heads it holds), fp32 as
    captured: what context parallelism gathers (the plan search's screen prices context degrees with them;
    under a pipeline, empty)."""
    output_bytes: tuple[int, ...] = ()
    """Bytes of each floating output of two or more dimensions over this rank's rows (logits): what context
    parallelism gathers whole."""

    @property
    def construction_bytes_per_rank(self) -> int:
        """Peak parameter bytes while the model is built (autopar.runtime.construction.record): this rank's pieces and
        one parameter whole."""
        return self.param_bytes_per_rank + self.largest_param_bytes


def estimate_step(gm: fx.GraphModule, plan: Plan,
                  layouts: tuple[LayoutResult, dict[fx.Node, MatmulMatch]] | None = None) -> StepReport:
    """``gm``'s step under ``plan``: its matmuls' rows and every collective. ``layouts``: ``layouts_for(gm,
    plan)`` where the caller has it (they are read only)."""
    config = plan.config
    res, by_node = layouts or layouts_for(gm, plan)
    matches = list(by_node.values())
    params = {p.name: p for p in plan.params}
    colls = list_collectives(gm, res, matches, params, config) + expert_collectives(gm, plan.experts, config, res.requires_grad)
    batch = graph_info(gm).batch
    scale = Fraction(batch.global_size, batch.local_sizes[batch.index]) if batch is not None else Fraction(1)

    shapes: dict[str, tuple[int, ...]] = {}
    grad_of: dict[str, bool] = {}
    num_parameters = largest = 0
    for node in gm.graph.nodes:
        name = param_name(node)
        if name is not None:
            shapes[name] = tuple(int(s) for s in tensor_meta(node).shape)
            largest = max(largest, _numel(shapes[name]) * tensor_meta(node).element_size())
            grad_of[name] = res.requires_grad[node]
            if node.users:  # an unused placeholder is export's alias of a tied weight, counted once
                num_parameters += _numel(shapes[name])

    everything = frozenset(plan.context_whole) if plan.config.context > 1 else frozenset()
    rows = []
    for m in matches:
        mp = plan.matmul(m.weight)
        global_rows = int(rows_of(tensor_meta(m.x)) * scale)
        flops = matmul_flops(m, res.requires_grad[m.x], grad_of[m.weight], global_rows)
        nparams = _numel(shapes[m.weight]) + (_numel(shapes[m.bias]) if m.bias else 0)
        sharding = (f"replicated: {mp.reason}" if mp.orientation is Orientation.REPLICATED
                    else mp.orientation.value)
        if m.node in res.partial_dx:  # sequence parallelism: its input gathered from the tokens' ranks
            sharding += f", tokens gathered over {mp.orientation.out_axis}"
        if m.node in res.seq_scatter:
            sharding += f", out tokens over {mp.orientation.in_axis}"
        every = m.node.name in everything
        if every:
            sharding += EVERY_TOKEN
        rows.append(LayerRow(m.module, m.weight, m.bias, m.op, tuple(tensor_meta(m.x).shape),
                             tuple(tensor_meta(m.node).shape), nparams, flops, sharding, Fraction(0), every))
    whole = []
    split = {w: e for e in plan.experts if e.axis or e.tensor_axis for w in e.weights}
    for w in find_whole_matmuls(gm):
        grads = 1 + int(res.requires_grad.get(w.x, False)) + int(grad_of.get(w.weight, False))
        e = split.get(w.weight)
        if e is None:
            how = f"replicated: {w.reason}"
        elif e.axis:
            how = f"experts over {e.axis.replace('+', ' x ')}: {e.experts // plan.config.size(e.axis)} of {e.experts} per rank" + (
                f", each over {e.tensor_axis}: 1/{plan.config.size(e.tensor_axis)} of it" if e.tensor_axis else "")
        else:
            how = f"each expert over {e.tensor_axis}: 1/{plan.config.size(e.tensor_axis)} of it per rank"
        every = w.node.name in everything
        whole.append(LayerRow(w.module, w.weight, None, w.op, tuple(tensor_meta(w.x).shape),
                              tuple(tensor_meta(w.node).shape), _numel(shapes[w.weight]),
                              int(w.forward_flops * scale) * grads, how + (EVERY_TOKEN if every else ""), Fraction(0),
                              every))
    experts = expert_shapes(gm, res.requires_grad, scale, {r.weight: r.flops for r in whole}) \
        if any(w.op in ("grouped_mm", "bmm") for w in whole) else ()
    return dataclasses.replace(summarize(rows, colls, num_parameters, plan, whole=tuple(whole)),
                               largest_param_bytes=largest, experts=experts,
                               attention_kv=attention_shapes(gm, res, config),
                               output_bytes=tuple(gathered_outputs(gm)))


def summarize(rows: Sequence[LayerRow], colls: Sequence[Collective], num_parameters: int,
              plan: Plan, flops_scale: int = 1, whole: Sequence[LayerRow] = ()) -> StepReport:
    """Totals over the per-matmul rows and every collective; each row's bytes are its module's and its
    weight's and bias's collectives (each counted at its first row), the rest listed by where they occur.
    ``flops_scale``: each row's FLOPs times this (a pipeline's rows are one micro-batch's); ``whole``: the
    matmul-like ops left whole (``StepReport.whole``), FLOPs scaled alike."""
    # the messages of one (where, kind, group size, phase) summed as integers, in one pass over the collectives
    # (a pipeline rank of the 1T GPT has ~8,000); their bytes are linear in the message, so every total below
    # is exactly the sum over the collectives
    messages: dict[tuple[str, str, int, str], int] = {}
    for c in colls:
        key = (c.where, c.kind, c.group_size, c.phase)
        messages[key] = messages.get(key, 0) + c.message_bytes
    groups = [(key, collective_bytes(key[1], key[2], message)) for key, message in messages.items()]
    by_where: dict[str, Fraction] = {}
    by_kind: dict[str, Fraction] = {}
    for (where, kind, _, _), nbytes in groups:
        by_where[where] = by_where.get(where, Fraction(0)) + nbytes
        by_kind[kind] = by_kind.get(kind, Fraction(0)) + nbytes
    counted: set[str] = set()
    with_comm = []
    for r in rows:
        comm = Fraction(0)
        for n in dict.fromkeys((r.module or r.weight, r.weight, r.bias)):
            if n and n not in counted:
                counted.add(n)
                nbytes = by_where.get(n)
                if nbytes is not None:
                    comm += nbytes
        # (LayerRow's fields in order: dataclasses.replace takes 3x as long, on thousands of rows per report)
        with_comm.append(LayerRow(r.module, r.weight, r.bias, r.op, r.in_shape, r.out_shape, r.num_parameters,
                                  r.flops * flops_scale, r.sharding, comm, r.all_tokens))
    rows = with_comm
    shared = shared_names(plan)
    lent = {e.module: e.lent for e in plan.experts if e.lent}
    blocks = {e.module for e in plan.experts if e.batched}

    def label(where: str, kind: str, phase: str) -> str:
        fixed = {"<output>": "output gather", "<input>": "input gradient gather", "<loss>": "loss"}.get(where)
        if where.endswith(CONTEXT):
            fixed = "attention's keys and values over context"
        if fixed is not None:
            return fixed
        if kind == "send":
            return f"pipeline sends ({phase})"
        if kind == "all_to_all":
            if where in blocks:  # (every token to every expert: the same bytes whatever the routing)
                return f"expert exchange at {where} (all-to-all of each expert's block of tokens)"
            return f"expert exchange at {where} (all-to-all, balanced routing assumed)"
        if kind == "all_gather" and where in lent:  # (whole experts over data x a tensor axis)
            return f"all-gathers at {where} (expert blocks over {lent[where]}, layout conversions)"
        if where in shared:
            return "tied weight gradients over the pipeline"
        return "gradient sync of replicated parameters" if phase == "step" else f"layout conversion at {where}"

    other: dict[str, Fraction] = {}
    for (where, kind, _, phase), nbytes in groups:
        if where not in counted:
            what = label(where, kind, phase)
            other[what] = other.get(what, Fraction(0)) + nbytes
    param_bytes = sum(p.local_numel(plan.config) * 4 for p in plan.params)  # fp32 parameters
    whole = tuple(dataclasses.replace(r, flops=r.flops * flops_scale) for r in whole) if flops_scale != 1 \
        else tuple(whole)
    return StepReport(tuple(rows), tuple(other.items()), num_parameters,
                      sum(r.flops for r in rows) + sum(r.flops for r in whole),
                      sum(r.flops for r in rows if r.is_sharded) + sum(r.flops for r in whole if r.sharding.startswith(
                          "each expert")), param_bytes, sum(by_kind.values(), Fraction(0)),
                      by_kind, tuple(colls), whole=whole)


def estimate_step_seconds(report: StepReport, plan: Plan, hardware: Hardware) -> float:
    """One rank's training step under ``hardware``: its share of the matmul FLOPs at the sustained rate,
    plus every collective it joins (its bytes at the tensor-parallel bandwidth, sends at the pipeline
    one, plus the fixed cost per call). In a pipeline the work of the micro-batches is stretched by the
    plan's bubble (busy / (1 - bubble)); the gradient sync after them is not.

    What is left out (elementwise ops and norms, the optimizer, overlap of compute with communication)
    is what a measured step has on top: ``python -m benchmarks`` reports the ratio.
    """
    config = plan.config
    compute = report.rank_flops
    if compute is None:
        compute = sum(r.context_flops(config.context) / (config.num_batch_shards * config.context
                                 * matmul_split(config, plan.matmul(r.weight).orientation)) for r in report.layers)
    compute += report.rank_attention_flops + whole_flops_per_rank(report, plan)

    def seconds(c: Collective) -> float:
        rate = hardware.pipeline_bytes_per_second if c.kind == "send" else hardware.tensor_bytes_per_second
        return float(c.bytes) / rate + hardware.collective_seconds

    busy = compute / hardware.flops_per_second + sum(seconds(c) for c in report.collectives
                                                     if c.group_size > 1 and c.phase != "step")
    if plan.pipeline is not None:
        busy /= 1 - plan.pipeline.bubble_fraction
    return busy + sum(seconds(c) for c in report.collectives if c.group_size > 1 and c.phase == "step")


def whole_flops_per_rank(report: StepReport, plan: Plan) -> float:
    """What one rank computes of the ops left whole (``StepReport.whole``) beside ``rank_flops``: its rows' share of
    them (of each expert split over a tensor axis, its part: ``Plan.whole_share``);
    0 where the rank runs part of the model (a pipeline's stages), whose ``rank_flops`` count them already
    (``choose_stages.pipeline_chain``'s segment FLOPs)."""
    if report.rank_flops is not None:
        return 0.0
    c = plan.config
    return sum(r.context_flops(c.context) / plan.whole_share(r.weight) for r in report.whole) / (
        c.num_batch_shards * c.context)


def shared_names(plan: Plan) -> set[str]:
    """Parameters read by several pipeline stages (tied weights)."""
    return {name for name, _ in plan.pipeline.shared} if plan.pipeline is not None else set()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
