"""Layout propagation: which feature layout every tensor has, and where a re-layout is needed.

Given an orientation for each sharded matmul, the per-op rules below fix every other layout:

- a sharded matmul reads its input in ``orientation.in_layout`` and writes ``out_layout``;
- a pointwise op (``torch.Tag.pointwise``, plus clone/detach/dtype casts) keeps the layout of its
  first sharded operand; other sharded operands are re-laid out to it and replicated operands that
  span the feature dimension are sliced (free forward, all-gather of the gradient in backward);
- every other op (LayerNorm, views, reductions, the model output) sees replicated inputs: a
  sharded input is gathered first. Correct first; later issues add rules that keep more sharded.

The orientation chooser and the transform both call ``propagate_layouts``, so the costs the
planner compares are those of the graph that is emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.config import Layout, Orientation
from autopar.errors import PlanError
from passes.analysis.graph_facts import MatmulMatch, module_of, tensor_meta
from passes.ir import input_info

aten = torch.ops.aten

_LAYOUT_PRESERVING = frozenset({
    aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
    aten.to.dtype, aten.contiguous.default, aten.dropout.default,
})


def is_pointwise(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target in _LAYOUT_PRESERVING or torch.Tag.pointwise in node.target.tags


@dataclass
class LayoutResult:
    layouts: dict[fx.Node, Layout] = field(default_factory=dict)
    """Feature layout of every node's value (REPLICATED for non-tensors)."""
    requires_grad: dict[fx.Node, bool] = field(default_factory=dict)
    batch_split: dict[fx.Node, bool] = field(default_factory=dict)
    conversions: dict[tuple[fx.Node, fx.Node], Layout] = field(default_factory=dict)
    """(consumer, producer) -> the layout the consumer needs the producer in."""
    orientations: dict[fx.Node, Orientation] = field(default_factory=dict)
    """Orientation of each matmul node that is sharded."""
    joins: list[tuple[fx.Node, fx.Node, fx.Node]] = field(default_factory=list)
    """(pointwise node, first sharded operand, other sharded operand): the parity constraints."""


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    for n in node.all_input_nodes:
        if n not in seen:
            seen.append(n)
    return seen


def propagate_layouts(gm: fx.GraphModule, matmuls: Mapping[fx.Node, MatmulMatch],
                      orientation_of: Callable[[MatmulMatch, Layout], Orientation],
                      local_batch: int | None = None) -> LayoutResult:
    """Walks ``gm`` in order and assigns layouts.

    Args:
        matmuls: the matmul nodes that may be sharded.
        orientation_of: called with each matmul and the layout of its input as it arrives; returns
            the orientation to use (REPLICATED leaves it unsharded).
        local_batch: rows of the batch-split inputs on this rank, to check that ops keep dim 0 as
            the batch; None skips the check (no batch split).
    """
    res = LayoutResult()
    R = Layout.REPLICATED
    for node in gm.graph.nodes:
        ins = _tensor_inputs(node)
        val = tensor_meta(node)
        if node.op == "placeholder":
            info = input_info(node)
            res.layouts[node] = R
            res.requires_grad[node] = bool(info and info.requires_grad)
            res.batch_split[node] = bool(info and info.batch_split)
            continue
        if node.op == "output":
            continue
        res.requires_grad[node] = bool(
            any(res.requires_grad.get(i, False) for i in ins)
            and val is not None and (val.is_floating_point() or val.is_complex()))
        res.batch_split[node] = any(res.batch_split.get(i, False) for i in ins)
        if res.batch_split[node] and local_batch is not None:
            _check_batch_dim(node, local_batch)
        match = matmuls.get(node)
        if match is not None:
            orientation = orientation_of(match, res.layouts[match.x])
            if orientation is not Orientation.REPLICATED:
                res.orientations[node] = orientation
                _need(res, node, match.x, orientation.in_layout)
                res.layouts[node] = orientation.out_layout
                continue
        if val is not None and is_pointwise(node):
            sharded = [i for i in ins if res.layouts.get(i, R) is not R]
            if sharded and all(_spans_features(i, val) for i in sharded):
                target = res.layouts[sharded[0]]
                for i in ins:
                    src = res.layouts.get(i, R)
                    if src is R:
                        if _spans_features(i, val) and val.shape[-1] > 1:
                            _need(res, node, i, target)
                    elif src is not target:
                        res.joins.append((node, sharded[0], i))
                        _need(res, node, i, target)
                    elif i is not sharded[0]:
                        res.joins.append((node, sharded[0], i))
                res.layouts[node] = target
                continue
        for i in ins:
            if res.layouts.get(i, R) is not R:
                _need(res, node, i, R)
        res.layouts[node] = R
    for out in _tensor_inputs(output_node(gm)):
        if res.layouts.get(out, R) is not R:
            res.conversions.setdefault((output_node(gm), out), R)
    return res


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def _need(res: LayoutResult, consumer: fx.Node, producer: fx.Node, layout: Layout) -> None:
    if res.layouts.get(producer, Layout.REPLICATED) is not layout:
        res.conversions[(consumer, producer)] = layout


def _spans_features(node: fx.Node, out: torch.Tensor) -> bool:
    t = tensor_meta(node)
    return t is not None and t.dim() >= 1 and t.shape[-1] == out.shape[-1]


def _check_batch_dim(node: fx.Node, local_batch: int) -> None:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    for v in vals:
        if not isinstance(v, torch.Tensor):
            continue
        if v.dim() == 0 or v.shape[0] != local_batch:
            raise PlanError(
                f"op {node.target} in module '{module_of(node) or '<root>'}' turns the batch-split dim 0 "
                f"(size {local_batch} on this rank) into shape {tuple(v.shape)}. Data and depth "
                "parallelism split dim 0 of the inputs as the batch; this model mixes batch rows "
                "(a reduction over the batch, or a loss inside forward). Use data=1 and depth=1 for it.")
    dim = _dim_arg(node)
    if dim is None or is_pointwise(node):
        return
    first = tensor_meta(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    if first is not None and first.dim():
        dims = dim if isinstance(dim, (list, tuple)) else (dim,)
        if any(isinstance(d, int) and d % first.dim() == 0 for d in dims) or dims == ():
            raise PlanError(
                f"op {node.target} in module '{module_of(node) or '<root>'}' works along dim 0, "
                "which data and depth parallelism split as the batch. Use data=1 and depth=1 "
                "for this model.")


def _dim_arg(node: fx.Node) -> object:
    """The value of the op's argument named ``dim``, or None if it has none."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dim":
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get("dim", arg.default_value if arg.has_default_value() else None)
    return None
