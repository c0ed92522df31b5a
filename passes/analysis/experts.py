"""find_expert_layers: the routed-experts layers of a captured graph, as an expert layout rewrites them.

A routed experts layer as transformers 5.x captures its grouped-matmul experts (and as ``torch._grouped_mm``
reads them): the tokens' picks as rows sorted by expert, the running count of rows per expert (``offsets``,
from ``histc``/``bincount`` and ``cumsum``), and a chain of grouped matmuls that all read those offsets, on 3-D
expert weights ``[experts, in, out]`` (read through transposes and casts), with row-wise ops between them (the
gate/up halves, the activation, their product, expert biases taken by row). The layer's ``region`` is the
grouped matmuls and every op between the first and the last; what it reads from outside is its ``rows`` (what
the first grouped matmul multiplies), the ``offsets``, the weights, and other values with a row per pick
(``inputs``: an expert bias taken for each row); what leaves it is the last grouped matmul's result.

Batched experts (Llama 4): ``bmm`` of every expert's rows ``[experts, rows, in]`` by 3-D expert weights, every
expert multiplying its own block of rows (as many for each; no offsets): the same layer with two row dims
(``ExpertLayer.row_dims``), the rows of expert ``e`` being ``rows[e]``.

Splitting the experts over ranks (expert parallelism) moves exactly that: the rows and inputs go to their experts' ranks, the region
runs there on that rank's experts, and the result comes back. It is sound only where every op of the region
keeps the rows as rows (one result row per input row, computed from that row alone): ``find_expert_layers``
checks that, and reports a layer it cannot split with the reason (``ExpertLayer.why_whole``).

Splitting each expert over a tensor axis instead (``tensor_split``, Megatron's MLP on every expert): the grouped
matmuls that multiply the rows compute a piece of each row's hidden features (their weights split on the
output features, each fused segment, such as gate and up, in its own pieces), the row-wise ops between run on
those pieces, and the last grouped matmul multiplies them by its weight's matching rows (split on the input
features), giving each rank a partial sum of every row's result that one all-reduce completes. No row moves
and the work per rank does not depend on the routing. Pure.
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
    row_dims: int = 1
    """The leading dims that count rows: 1 for grouped matmuls (``[rows, features]``), 2 for batched ones
    (``[experts, rows, features]``, ``offsets`` None)."""

    @property
    def output(self) -> fx.Node:
        return self.matmuls[-1]

    @property
    def batched(self) -> bool:
        return self.offsets is None

    def rows_in(self, node: fx.Node) -> int:
        """The rows of ``node`` (a value with a row per pick): every expert's, together."""
        t = tensor_meta(node)
        return int(t.shape[:self.row_dims].numel()) if t is not None else 0

    def row_bytes(self, node: fx.Node) -> int:
        """The bytes of one row of ``node``."""
        t = tensor_meta(node)
        return int(t.shape[self.row_dims:].numel()) * t.element_size() if t is not None and t.dim() else 0


def is_grouped_matmul(node: fx.Node) -> bool:
    """A grouped matmul: ``torch._grouped_mm``, transformers' ``grouped_mm`` experts (its custom op)."""
    return node.op == "call_function" and "grouped_mm" in (getattr(node.target, "__name__", "") or "")


def is_batched_expert_matmul(node: fx.Node) -> bool:
    """A ``bmm`` of 3-D rows by a 3-D expert weight (Llama 4's experts)."""
    return node.op == "call_function" and node.target is aten.bmm.default and len(node.args) >= 2 and \
        isinstance(node.args[0], fx.Node) and expert_weight(node.args[1]) is not None


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


def _rows_of(node: fx.Node, row_dims: int = 1) -> object:
    meta = tensor_meta(node)
    return tuple(meta.shape[:row_dims]) if meta is not None and meta.dim() >= row_dims else None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    for a in (*node.args, *node.kwargs.values()):
        for v in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def _layer(matmuls: list[fx.Node], offsets: fx.Node | None) -> ExpertLayer:
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
    row_dims = 1 if offsets is not None else 2
    counted, todo = set(), [offsets] if offsets is not None else []
    while todo:  # what is computed from the global running counts (only the grouped matmuls may read them)
        node = todo.pop()
        if node not in counted and order[node] <= order[last]:
            counted.add(node)
            todo.extend(u for u in node.users if u not in matmuls)
    weights, inputs, why = [], [], ""
    size = _rows_of(rows, row_dims)
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
        elif tensor_meta(node) is not None and _rows_of(node, row_dims) != size:
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
            if meta.dim() >= row_dims and _rows_of(a, row_dims) == size and a not in inputs:
                inputs.append(a)
            elif param_name(a) is None:
                why = why or f"{node.name} reads {a.name}, which has no row per pick"
    if len(set(weights)) != len(weights) or not weights:
        why = why or "its grouped matmuls do not each read their own expert weight"
    if offsets is None and any(int(tensor_meta(m).shape[0]) != experts for m in matmuls):
        why = why or "its batched matmuls do not multiply one block of rows per expert"
    return ExpertLayer(module_of(first), tuple(matmuls), offsets, rows, tuple(inputs), tuple(weights), experts,
                       frozenset(region), why, row_dims)


def find_expert_layers(gm: fx.GraphModule) -> list[ExpertLayer]:
    """Every routed-experts layer of ``gm`` (grouped matmuls sharing their offsets; batched matmuls on expert
    weights, a chain each, the next reading the last's result), in graph order."""
    by_offsets: dict[fx.Node, list[fx.Node]] = {}
    chains: list[list[fx.Node]] = []
    order: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        order[node] = len(order)
        if is_grouped_matmul(node) and len(node.args) >= 2 and isinstance(node.args[0], fx.Node):
            offsets = _offsets(node)
            if offsets is not None:
                by_offsets.setdefault(offsets, []).append(node)
        elif is_batched_expert_matmul(node):
            chain = next((c for c in chains if _reads(node, c[-1])), None)
            if chain is None:
                chains.append([node])
            else:
                chain.append(node)
    layers = [_layer(matmuls, offsets) for offsets, matmuls in by_offsets.items()] + \
        [_layer(chain, None) for chain in chains]
    return sorted(layers, key=lambda layer: order[layer.matmuls[0]])


def _reads(node: fx.Node, source: fx.Node, depth: int = 12) -> bool:
    """Whether ``node``'s rows are computed from ``source``'s through at most ``depth`` row-wise ops."""
    todo, seen = [(node.args[0], 0)], set()
    while todo:
        value, d = todo.pop()
        if value is source:
            return True
        if not isinstance(value, fx.Node) or value in seen or d >= depth or value.target not in _ROW_WISE:
            continue
        seen.add(value)
        todo.extend((a, d + 1) for a in _tensor_args(value))
    return False


@dataclass(frozen=True, slots=True)
class TensorSplit:
    """How a layer's experts split over ``n`` ranks of a tensor axis (``tensor_split``)."""

    weights: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    """(weight, the parameter's dim split, the segments of that dim) for each grouped matmul's weight."""
    inputs: tuple[tuple[int, ...], ...] = ()
    """The segments of each of ``ExpertLayer.inputs``' features (dim 1), split alike."""
    why_whole: str = ""


def _read_dims(node: object) -> tuple[str, list[int]] | None:
    """(the 3-D parameter a grouped matmul's weight reads, the parameter dim behind each dim read)."""
    steps: list[fx.Node] = []
    for _ in range(8):
        if not isinstance(node, fx.Node):
            return None
        name = param_name(node)
        if name is not None:
            break
        if node.op != "call_function" or node.target not in _THROUGH or not node.args:
            return None
        steps.append(node)
        node = node.args[0]
    else:
        return None
    dims = [0, 1, 2]
    for step in reversed(steps):
        if step.target is aten.transpose.int:
            a, b = (int(d) % 3 for d in step.args[1:3])
            dims[a], dims[b] = dims[b], dims[a]
        elif step.target is aten.permute.default:
            dims = [dims[int(d) % 3] for d in step.args[1]]
        elif step.target is aten.t.default:
            return None
    return name, dims


def _feature_parts(start: fx.Node, region: frozenset[fx.Node], features: int, n: int) -> tuple[tuple[int, ...], str]:
    """The segments of ``start``'s features (dim 1, ``features`` wide) as the region's ops cut them (a fused
    gate/up ``chunk``, an interleaved ``[:, ::2]``), and why they cannot split over ``n`` ('' where they can)."""
    parts: tuple[int, ...] = (features,)
    step = 1
    todo, seen = [start], set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user not in region or user in seen:
                continue
            seen.add(user)
            meta = tensor_meta(node)
            last = meta.dim() - 1 if meta is not None else 1
            if user.target is aten.chunk.default:
                if int(user.args[2] if len(user.args) > 2 else 0) % (last + 1) == last:
                    parts = (features // int(user.args[1]),) * int(user.args[1])
            elif user.target is aten.split.Tensor:
                if int(user.args[2] if len(user.args) > 2 else 0) % (last + 1) == last:
                    size = int(user.args[1])
                    parts = (size,) * (features // size)
            elif user.target in (aten.slice.Tensor, aten.narrow.default):
                dim = int(user.args[1]) % (last + 1)
                if dim == last:
                    begin = int(user.args[2]) if len(user.args) > 2 and user.args[2] is not None else 0
                    end = user.args[3] if len(user.args) > 3 else None
                    stride = int(user.args[4]) if len(user.args) > 4 else 1
                    if user.target is aten.narrow.default or stride == 1 or begin >= stride or \
                            (end is not None and int(end) < features):
                        return parts, f"{user.name} takes a part of the experts' hidden features"
                    step = max(step, stride)
                    continue  # (its result is a strided piece: the ops after it are row-wise)
            elif user.target is operator.getitem and node.target is not aten.chunk.default and \
                    node.target is not aten.split.Tensor:
                return parts, f"{user.name} indexes the experts' hidden features"
            if user.target not in (aten.chunk.default, aten.split.Tensor):
                todo.append(user)
    if sum(parts) != features or any(p % (n * step) for p in parts):
        return parts, f"its hidden features ({'+'.join(map(str, parts))}) do not divide over {n} ranks" + \
            (f" in steps of {step}" if step > 1 else "")
    return parts, ""


def tensor_split(layer: ExpertLayer, n: int) -> TensorSplit:
    """Each expert of ``layer`` split over ``n`` ranks of a tensor axis: the grouped matmuls that multiply the
    layer's rows split their weights' output features, the last its input features (see the module docstring),
    or why the layer cannot (``TensorSplit.why_whole``)."""
    if layer.why_whole:
        return TensorSplit(why_whole=layer.why_whole)
    *columns, last = layer.matmuls
    if not columns or any(m.args[0] is not layer.rows for m in columns) or last.args[0] is layer.rows:
        return TensorSplit(why_whole="its grouped matmuls are not a chain of matmuls of the rows and one of their "
                                     "result")
    for node in layer.region:
        for a in _tensor_args(node):
            if a not in layer.region and a not in layer.inputs and param_name(a) is not None and \
                    not any(a is m.args[1] for m in layer.matmuls):
                return TensorSplit(why_whole=f"{node.name} reads the parameter {param_name(a)}")
    weights = []
    inputs: list[tuple[int, ...]] = [()] * len(layer.inputs)
    for matmul in columns:
        read = _read_dims(matmul.args[1])
        features = int(tensor_meta(matmul).shape[-1])
        parts, why = _feature_parts(matmul, layer.region, features, n)
        if read is None or why:
            return TensorSplit(why_whole=why or f"{matmul.name}'s weight is read through a view autopar does not "
                                                "follow")
        weights.append((read[0], read[1][2], parts))
        for i, value in enumerate(layer.inputs):
            meta = tensor_meta(value)
            if meta is not None and meta.dim() == layer.row_dims + 1 and int(meta.shape[-1]) == features and \
                    any(u in layer.region and matmul in u.all_input_nodes for u in value.users):
                inputs[i] = parts
    read = _read_dims(last.args[1])
    if read is None:
        return TensorSplit(why_whole=f"{last.name}'s weight is read through a view autopar does not follow")
    hidden = int(tensor_meta(last.args[1]).shape[1])
    if hidden % n:
        return TensorSplit(why_whole=f"its {hidden} hidden features do not divide over {n} ranks")
    weights.append((read[0], read[1][1], (hidden,)))
    missing = [v.name for v, parts in zip(layer.inputs, inputs) if not parts]
    if missing:
        return TensorSplit(why_whole=f"{', '.join(missing)} (read with the rows) is not added to a matmul's result")
    return TensorSplit(tuple(weights), tuple(inputs))
