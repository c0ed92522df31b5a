"""find_whole_matmuls: the matmul-like ops on parameters that autopar does not split.

autopar splits matmuls on 2-D weights (``graph_facts.find_matmuls``). Others compute as much or more, and
each rank runs them with the whole weight on its rows of the batch:

- grouped matmuls of mixture-of-experts layers (``torch._grouped_mm``, transformers' ``grouped_mm`` experts)
  and batched matmuls (``bmm``, ``matmul``) on 3-D expert weights: every expert stays whole on every rank;
- convolutions (``conv2d`` and friends).

The plan, its summary and ``python -m autopar.trace`` count them in FLOPs, parameters and the share that is
not sharded, and say why (``WholeMatmul.reason``). Pure: a function of the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from passes.analysis.graph_facts import module_of, param_name, tensor_meta

aten = torch.ops.aten

_CONVS = frozenset({aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                    aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input})
_BATCHED = frozenset({aten.bmm.default, aten.matmul.default, aten.baddbmm.default})
#: Views and casts a weight is read through on its way to the op (HF's experts transpose and cast them).
_THROUGH = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default,
                      aten.to.dtype, aten.to.dtype_layout, aten.view.default, aten.reshape.default,
                      aten.contiguous.default, aten.alias.default, aten.expand.default, aten.unsqueeze.default})

EXPERTS = "3-D expert weights stay whole on every rank (autopar splits 2-D weights only)"
CONVOLUTION = "convolutions stay whole on every rank (autopar splits matmuls on 2-D weights only)"


@dataclass(frozen=True, slots=True)
class WholeMatmul:
    node: fx.Node
    x: fx.Node
    weight: str
    op: str
    """"grouped_mm", "bmm" or "conv"."""
    module: str
    forward_flops: int
    """Forward FLOPs over the rows this graph was captured for (a grouped matmul: each row with its expert)."""
    reason: str


def _weight(node: object) -> str | None:
    """The parameter ``node`` reads, through views and casts."""
    seen = 0
    while isinstance(node, fx.Node) and seen < 8:
        name = param_name(node)
        if name is not None:
            return name
        if node.op != "call_function" or node.target not in _THROUGH or not node.args:
            return None
        node, seen = node.args[0], seen + 1
    return None


def _is_grouped(target: object) -> bool:
    name = getattr(target, "__name__", "") or ""
    return "grouped_mm" in name


def match_whole(node: fx.Node) -> WholeMatmul | None:
    """``node`` as a whole matmul-like op on a parameter, or None."""
    if node.op != "call_function" or len(node.args) < 2:
        return None
    t = node.target
    x, w = node.args[0], node.args[1]
    out, xt = tensor_meta(node), tensor_meta(x) if isinstance(x, fx.Node) else None
    if t is aten.baddbmm.default:
        x, w = node.args[1], node.args[2]
        xt = tensor_meta(x) if isinstance(x, fx.Node) else None
    name = _weight(w)
    wt = tensor_meta(w) if isinstance(w, fx.Node) else None
    if name is None or out is None or xt is None or wt is None or param_name(x) is not None:
        return None
    if t in _CONVS:  # each output entry sums (input channels / groups) x kernel products
        per_out = math.prod(int(s) for s in wt.shape[1:])
        transposed = t in (aten.conv_transpose1d.default, aten.conv_transpose2d.input,
                           aten.conv_transpose3d.input) or (t is aten.convolution.default and bool(node.args[6]))
        flops = 2 * (xt.numel() if transposed else out.numel()) * per_out
        return WholeMatmul(node, x, name, "conv", module_of(node), int(flops), CONVOLUTION)
    if wt.dim() < 3 and not _is_grouped(t):
        return None  # (a 2-D weight: find_matmuls' own, or one it left whole and the plan says why)
    if _is_grouped(t) or t in _BATCHED:  # (rows, k) or (batch, rows, k) against (experts, k, n)
        k, n = int(wt.shape[-2]), int(wt.shape[-1])
        rows = xt.numel() // max(int(xt.shape[-1]), 1)
        return WholeMatmul(node, x, name, "grouped_mm" if _is_grouped(t) else "bmm", module_of(node),
                           2 * rows * k * n, EXPERTS)
    return None


def find_whole_matmuls(gm: fx.GraphModule) -> list[WholeMatmul]:
    """Every matmul-like op on a parameter that is not a split 2-D matmul, in graph order."""
    return [m for n in gm.graph.nodes if (m := match_whole(n)) is not None]
