"""find_expert_layers: the routed-experts layers of a captured graph, as an expert layout rewrites them.

A routed experts layer as transformers 5.x captures its grouped-matmul experts (and as ``torch._grouped_mm``
reads them): the tokens' picks as rows sorted by expert, the running count of rows per expert (``offsets``,
from ``histc``/``bincount`` and ``cumsum``), and a chain of grouped matmuls that all read those offsets, on 3-D
expert weights ``[experts, in, out]`` (read through transposes and casts), with row-wise ops between them (the
gate/up halves, the activation, their product, expert biases taken by row). The layer's ``region`` is the
grouped matmuls and every op between the first and the last; what it reads from outside is its ``rows`` (what
the first grouped matmul multiplies), the ``offsets``, the weights, and other values with a row per pick
(``inputs``: an expert bias taken for each row); what leaves it is the last grouped matmul's result.

Splitting the experts over ranks moves exactly that: the rows and inputs go to their experts' ranks, the region
runs there on that rank's experts, and the result comes back. It is sound only where every op of the region
keeps the rows as rows (one result row per input row, computed from that row alone): ``find_expert_layers``
checks that, and reports a layer it cannot split with the reason (``ExpertLayer.why_whole``). Pure.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from passes.analysis.graph_facts import module_of, param_name, tensor_meta

aten = torch.ops.aten

#: Views and casts a weight is read through on its way to a grouped matmul.
_THROUGH = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default,
                      aten.to.dtype, aten.to.dtype_layout, aten.contiguous.default, aten.alias.default})
#: Ops that keep rows as rows: one result row per input row, from that row alone (with values of a row per row,
#: or scalars, or per-feature tensors).
_ROW_WISE = frozenset({
    aten.chunk.default, aten.split.Tensor, aten.slice.Tensor, aten.narrow.default, operator.getitem,
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default,
    aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.div.Tensor,
    aten.clamp.default, aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.alias.default,
    aten.neg.default, aten.exp.default, aten.pow.Tensor_Scalar, aten.square.default,
})


@dataclass(frozen=True, slots=True)
class ExpertLayer:
    module: str
    matmuls: tuple[fx.Node, ...]
    """The grouped matmuls reading ``offsets``, in graph order."""
    offsets: fx.Node
    rows: fx.Node
    """What the first grouped matmul multiplies: the picks' rows, sorted by expert."""
    inputs: tuple[fx.Node, ...]
    """Other values the region reads with a row per pick (an expert bias taken by row)."""
    weights: tuple[str, ...]
    """The 3-D expert weights (dim 0: the experts) the grouped matmuls read."""
    experts: int
    region: frozenset[fx.Node]
    why_whole: str = ""
    """Why the layer cannot be split over ranks ('' where it can)."""

    @property
    def output(self) -> fx.Node:
        return self.matmuls[-1]


def is_grouped_matmul(node: fx.Node) -> bool:
    """A grouped matmul: ``torch._grouped_mm``, transformers' ``grouped_mm`` experts (its custom op)."""
    return node.op == "call_function" and "grouped_mm" in (getattr(node.target, "__name__", "") or "")


def _offsets(node: fx.Node) -> fx.Node | None:
    value = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    return value if isinstance(value, fx.Node) else None


def expert_weight(node: object) -> str | None:
    """The 3-D parameter ``node`` reads, through views and casts, or None."""
    for _ in range(8):
        if not isinstance(node, fx.Node):
            return None
        name = param_name(node)
        if name is not None:
            meta = tensor_meta(node)
            return name if meta is not None and meta.dim() == 3 else None
        if node.op != "call_function" or node.target not in _THROUGH or not node.args:
            return None
        node = node.args[0]
    return None


def _read_elsewhere(matmul: fx.Node, matmuls: list[fx.Node]) -> bool:
    """Whether the weight ``matmul`` reads is also read by something other than the layer's grouped matmuls
    (through views and casts): there it would meet this rank's experts only."""
    node = matmul.args[1]
    while isinstance(node, fx.Node) and param_name(node) is None:
        node = node.args[0]
    todo = [node]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in matmuls:
                continue
            if user.op != "call_function" or user.target not in _THROUGH:
                return True
            todo.append(user)
    return False


def _rows_of(node: fx.Node) -> object:
    meta = tensor_meta(node)
    return meta.shape[0] if meta is not None and meta.dim() >= 1 else None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    for a in (*node.args, *node.kwargs.values()):
        for v in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def _layer(matmuls: list[fx.Node], offsets: fx.Node) -> ExpertLayer:
    first, last = matmuls[0], matmuls[-1]
    rows = first.args[0]
    order = {n: i for i, n in enumerate(first.graph.nodes)}
    after, todo = set(), [first]
    while todo:  # what the first grouped matmul's result flows into, up to the last one
        node = todo.pop()
        if node not in after and order[node] <= order[last]:
            after.add(node)
            todo.extend(node.users)
    region, todo = set(), [last]
    while todo:  # of that, what the last one reads: the ops between them (not the weights' transposes)
        node = todo.pop()
        if node in after and node not in region:
            region.add(node)
            todo.extend(_tensor_args(node))
    counted, todo = set(), [offsets]
    while todo:  # what is computed from the global running counts (only the grouped matmuls may read them)
        node = todo.pop()
        if node not in counted and order[node] <= order[last]:
            counted.add(node)
            todo.extend(u for u in node.users if u not in matmuls)
    weights, inputs, why = [], [], ""
    size = _rows_of(rows)
    experts = 0
    for node in sorted(region, key=order.__getitem__):
        if node in matmuls:
            name = expert_weight(node.args[1])
            if name is None:
                why = f"{node.name} multiplies by something other than a 3-D parameter"
                continue
            weights.append(name)
            experts = int(tensor_meta(node.args[1]).shape[0])
            if _read_elsewhere(node, matmuls):
                why = why or f"{name} is also read outside the layer's grouped matmuls"
            continue
        if node.op != "call_function" or node.target not in _ROW_WISE:
            why = why or f"{node.name} ({getattr(node.target, '__name__', node.target)}) is not row-wise"
        elif tensor_meta(node) is not None and _rows_of(node) != size:
            why = why or f"{node.name} does not keep one row per pick"
        for a in _tensor_args(node):
            if a in region:
                continue
            if a in counted:  # (the running counts are the global ones: only the grouped matmuls take this rank's)
                why = why or f"{node.name} reads the offsets ({a.name})"
                continue
            meta = tensor_meta(a)
            if meta is None or meta.dim() == 0:
                continue
            if meta.dim() >= 1 and _rows_of(a) == size and a not in inputs:
                inputs.append(a)
            elif param_name(a) is None:
                why = why or f"{node.name} reads {a.name}, which has no row per pick"
    if len(set(weights)) != len(weights) or not weights:
        why = why or "its grouped matmuls do not each read their own expert weight"
    return ExpertLayer(module_of(first), tuple(matmuls), offsets, rows, tuple(inputs), tuple(weights), experts,
                       frozenset(region), why)


def find_expert_layers(gm: fx.GraphModule) -> list[ExpertLayer]:
    """Every routed-experts layer of ``gm`` (grouped matmuls sharing their offsets), in graph order."""
    by_offsets: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_grouped_matmul(node) and len(node.args) >= 2 and isinstance(node.args[0], fx.Node):
            offsets = _offsets(node)
            if offsets is not None:
                by_offsets.setdefault(offsets, []).append(node)
    return [_layer(matmuls, offsets) for offsets, matmuls in by_offsets.items()]
