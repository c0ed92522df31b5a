"""What an opaque call in a captured graph computes: its ops traced on meta tensors, for the analyses to read.

A captured graph may call Python code as one node: a custom autograd Function kept whole so that its own
backward runs (``autopar.custom_functions.FunctionCall``), or a higher-order op around a block of the model
(``wrap_with_set_grad_enabled``: a ``torch.no_grad()`` inside forward). No per-op rule knows such a node; the
batch analysis reads the ATen ops it runs instead (``traced_call``), traced once with ``make_fx`` on meta
tensors of the node's recorded sizes.

Pure: nothing runs on data, nothing is kept outside the node's own metadata.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.compat import OpOverload, pytree, size_hint

log = logging.getLogger(__name__)

_KEY = "autopar_traced"


def is_opaque(node: fx.Node) -> bool:
    """Whether ``node`` calls something no per-op rule describes: a Python callable or a higher-order op
    (not an ATen op, not a Python operator, not one of autopar's markers: those are named in ``passes.ir``)."""
    t = node.target
    if node.op != "call_function" or isinstance(t, OpOverload) or getattr(t, "__module__", "") in (
            "_operator", "operator", "passes.ir"):
        return False
    return callable(t) and t is not operator.getitem


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        shape = [int(size_hint(s)) for s in value.shape]
        return torch.empty(shape, dtype=value.dtype, device="meta")
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return size_hint(value)
    return value


def traced_call(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The ATen ops ``node`` runs, as a graph whose placeholders are its tensor arguments in order (None
    where it cannot be traced on meta tensors). Kept on the node."""
    if _KEY in node.meta:
        return node.meta[_KEY]
    traced = None
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: getattr(gm, n.target) if n.op == "get_attr"
                                   else _meta(n.meta.get("val")))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def call(*tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(slots, tensors):
            filled[i] = t
        a, k = pytree.tree_unflatten(filled, spec)
        return node.target(*a, **k)

    try:
        traced = make_fx(call)(*(leaves[i] for i in slots))
    except Exception as e:  # noqa: BLE001  (the analysis then knows only that the call works on its inputs)
        log.debug("autopar: could not trace %s on meta tensors (%s)", node.name, e)
    node.meta[_KEY] = traced
    return traced


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The nodes whose tensors ``node`` passes, in the order of ``traced_call``'s placeholders."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [x for x in leaves if isinstance(x, fx.Node) and x.op != "get_attr"
            and isinstance(x.meta.get("val"), torch.Tensor)]
