"""What routed experts split over ranks cost a training step: the collectives of an expert layout
(``expert_collectives``: all-to-alls of experts over data, all-reduces of each expert split over a tensor axis)
and each experts layer's shape as the plan search's screen prices it for any data degree (``expert_shapes``).

Requires: a captured graph (``passes.analysis.experts.find_expert_layers`` finds its layers) and the plan's
``ExpertPlan``s. Ensures: the bytes one rank sends, balanced routing assumed (tests hold them equal to the
runtime's under balanced routing: ``tests/distributed/test_experts.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from torch import fx

from autopar.config import ParallelConfig
from autopar.decisions import ExpertPlan
from passes.analysis.estimate_costs import Collective
from passes.analysis.experts import ExpertLayer, find_expert_layers
from passes.analysis.graph_facts import param_name, tensor_meta


def exchange_bytes(rows: int, row_bytes: int, size: int) -> int:
    """Bytes one rank sends moving ``rows`` rows of ``row_bytes`` to their experts' ranks over ``size`` ranks, the
    routing taken as balanced (each rank's experts get ``1 / size`` of every rank's rows; the rows a rank keeps
    are not sent)."""
    return rows * (size - 1) // size * row_bytes


def expert_collectives(gm: fx.GraphModule, experts: Iterable[ExpertPlan], config: ParallelConfig,
                       requires_grad: Mapping[fx.Node, bool]) -> list[Collective]:
    """The collectives of the experts layers split over ranks. Each expert split over a tensor axis
    (``passes.split_experts``): forward the all-reduce of the partial results, backward the all-reduce of the rows'
    gradient and the all-gather of the gradients of the values read with them. Experts split over data, the
    all-to-alls of ``autopar.runtime.ops.experts``: forward the
    per-expert counts, the rows (and the values travelling with them) out and the results back; backward
    the results' gradients out and the rows' gradients back (those that need one: ``requires_grad``, the
    layouts' analysis). Whole experts over data x a tensor axis (``ExpertPlan.lent``): each rank of that axis
    moves its block of the rows, and the results (forward) and the rows' gradients (backward) are all-gathered
    over it. Balanced routing assumed:
    the bytes of an uneven one differ (the plan says so). Under context parallelism each context rank routes its
    own tokens (``passes.split_context``): 1/context of the rows (a module that reads them whole, Llama 4's
    batched experts, is priced so too)."""
    experts = tuple(experts)
    share = config.context  # (this rank's tokens' rows)
    split = {e.module: e for e in experts if e.axis}
    tensor = {e.module: e.tensor_axis for e in experts if e.tensor_axis}
    out: list[Collective] = []
    for layer in find_expert_layers(gm) if split or tensor else ():
        if layer.module in tensor and not layer.why_whole:  # each expert split over a tensor axis
            axis = tensor[layer.module]
            size = config.size(axis)
            out.append(Collective("all_reduce", axis, size, _nbytes(layer.output) // share, "forward", layer.module,
                                  layer.output.name))  # the partial sums
            if requires_grad.get(layer.rows, False):
                out.append(Collective("all_reduce", axis, size, _nbytes(layer.rows) // share, "backward",
                                      layer.module, layer.rows.name))  # the rows' gradient, from each rank's part
            out += [Collective("all_gather", axis, size, _nbytes(n) // share, "backward", layer.module, n.name)
                    for n in layer.inputs if requires_grad.get(n, False)]  # their features' gradients
            # (over data too: on the rows received, as many as this rank's own under balanced routing)
        e = split.get(layer.module)
        if e is None or layer.why_whole:
            continue
        size = config.size(e.axis)
        rows = layer.rows_in(layer.rows) // share
        if e.lent:  # (each rank of the lent axis sends its block of the rows, and gathers the results over it)
            lent = config.size(e.lent)
            rows = -(-rows // lent)
            out.append(Collective("all_gather", e.lent, lent, _nbytes(layer.output) // share, "forward",
                                  layer.module, layer.output.name))
            out += [Collective("all_gather", e.lent, lent, _nbytes(n) // share, "backward", layer.module, n.name)
                    for n in (layer.rows, *layer.inputs) if requires_grad.get(n, False)]

        def moved(node: fx.Node, phase: str, layer: ExpertLayer = layer) -> Collective:
            return Collective("all_to_all", e.axis, size, exchange_bytes(rows, layer.row_bytes(node), size),
                              phase, layer.module, node.name)

        out.append(Collective("all_to_all", e.axis, size, (size - 1) * (e.experts // size) * 8, "forward",
                              layer.module, (layer.offsets or layer.rows).name))  # the counts
        out += [moved(n, "forward") for n in (layer.rows, *layer.inputs)] + [moved(layer.output, "forward")]
        out.append(moved(layer.output, "backward"))
        out += [moved(n, "backward") for n in (layer.rows, *layer.inputs) if requires_grad.get(n, False)]
    return [c for c in out if c.group_size > 1]


def _nbytes(node: fx.Node) -> int:
    t = tensor_meta(node)
    return t.numel() * t.element_size()


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """One routed-experts layer an expert layout can split (``find_expert_layers``), as the plan search's screen
    prices it for any data degree (``passes.analysis.screen``)."""

    module: str
    experts: int
    weight_bytes: int
    """Its expert weights' bytes (fp32 parameters)."""
    rows: int
    """The picks' rows (tokens x experts per token) of one step over the global batch."""
    forward: tuple[int, ...]
    """Bytes per row of each value moved in forward: the rows and values travelling with them out, the
    results back (``expert_collectives``'s order)."""
    backward: tuple[int, ...]
    """Bytes per row of each value moved in backward: the results' gradients out, the rows' back."""
    flops: float = 0.0
    """Its grouped matmuls' FLOPs of one step over the global batch (``StepReport.whole``'s rows)."""


def expert_shapes(gm: fx.GraphModule, requires_grad: Mapping[fx.Node, bool], scale: Fraction,
                  flops: Mapping[str, float] | None = None) -> tuple[ExpertShape, ...]:
    """Every routed-experts layer of ``gm`` that can split over ranks, with what its exchange moves per row
    (``expert_collectives``' values); ``scale``: the global batch's rows over the captured ones; ``flops``: each
    expert weight's grouped matmul's FLOPs of a step."""
    out: list[ExpertShape] = []
    numel: dict[str, int] = {}
    for layer in find_expert_layers(gm):
        if layer.why_whole:
            continue
        if not numel:
            numel = {name: tensor_meta(n).numel() for n in gm.graph.nodes if (name := param_name(n)) is not None}
        weights = sum(numel[w] * 4 for w in layer.weights)
        moved = (layer.rows, *layer.inputs)
        row_bytes = layer.row_bytes
        out.append(ExpertShape(layer.module, layer.experts, weights, int(layer.rows_in(layer.rows) * scale),
                               tuple(row_bytes(n) for n in (*moved, layer.output)),
                               (row_bytes(layer.output),
                                *(row_bytes(n) for n in moved if requires_grad.get(n, False))),
                               float(sum((flops or {}).get(w, 0) for w in layer.weights))))
    return tuple(out)
