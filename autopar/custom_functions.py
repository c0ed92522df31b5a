"""Custom ``torch.autograd.Function``s keep their own backward in a captured model.

``torch.export`` (non-strict) records a Function's forward as the ATen ops it runs and drops its backward:
autograd of those ops would replace it (a straight-through ``round`` would get gradient 0, PhiMoE's router
another gradient than its own). For the length of one capture, ``Function.apply`` of a user's Function (any
class not defined in torch or autopar) is recorded instead as one call: a ``FunctionCall`` node whose target,
when the graph runs, calls the Function itself on the real tensors, so its forward and its backward are the
ones the serial model runs (by construction: the same ``apply``). The forward still runs on the capture's
fake tensors, unrecorded, to give the graph its output sizes.

The change to ``Function.apply`` lasts as long as the capture (``kept_during_capture``), like the spec names
``passes.ir.spec_names`` gives fx's code generator while passes run; see ``autopar.patches``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.autograd.function import Function

from autopar import compat
from autopar.compat import pytree
from autopar.errors import CaptureError

_ORIGINAL_APPLY = Function.__dict__["apply"]
_state = threading.local()
_OWN = ("torch", "autopar", "passes")


def is_users(cls: type) -> bool:
    """A Function the model brings (its own, or a library's such as transformers'): not torch's (checkpoint,
    DTensor, the collectives, a custom op's generated autograd) nor autopar's."""
    module = getattr(cls, "__module__", "") or ""
    return not any(module == p or module.startswith(p + ".") for p in _OWN)


class FunctionCall:
    """A captured graph's call of a custom autograd Function: its arguments rebuilt from the graph's values and
    the other arguments the capture saw, then ``cls.apply`` (forward and backward the Function's own)."""

    def __init__(self, cls: type, spec: pytree.TreeSpec, constants: list[Any], slots: list[int]) -> None:
        self.cls, self.spec, self.constants, self.slots = cls, spec, constants, slots
        self.__name__ = self.__qualname__ = f"{cls.__name__}_apply"
        self.__module__ = __name__

    def __call__(self, *values: Any) -> Any:
        leaves = list(self.constants)
        for slot, value in zip(self.slots, values, strict=True):
            leaves[slot] = value
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.cls.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.cls.__qualname__}.apply"


def function_of(node: fx.Node) -> type | None:
    """The custom Function a node of a captured graph calls (None for any other node)."""
    return node.target.cls if isinstance(node.target, FunctionCall) else None


def _graph_value(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    original = functools.partial(_ORIGINAL_APPLY.__func__, cls)
    tracer = None if getattr(_state, "inside", False) or not is_users(cls) else compat.export_tracer()
    if tracer is None:
        return original(*args, **kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    held = [type(x).__name__ for x in leaves if isinstance(x, nn.Module)]
    if held:
        raise CaptureError(f"custom autograd Function {cls.__qualname__} takes a module argument ({held[0]}); "
                           "autopar can keep a Function's own backward only when its arguments are tensors and plain "
                           "values. Pass the module's tensors instead of the module.")
    _state.inside = True  # (Functions it calls run as they are: they are part of this one)
    try:
        with compat.untraced():
            out = original(*args, **kwargs)
    finally:
        _state.inside = False
    slots = [i for i, x in enumerate(leaves) if _graph_value(x)]
    call = FunctionCall(cls, spec, [None if i in slots else x for i, x in enumerate(leaves)], slots)
    compat.trace_opaque_call(tracer, call, call.__name__, tuple(leaves[i] for i in slots), out)
    return out


@contextlib.contextmanager
def kept_during_capture() -> Iterator[None]:
    """Inside, an export records each user Function's ``apply`` as one ``FunctionCall`` (see the module
    docstring); ``Function.apply`` is torch's own again after, whatever happened inside."""
    Function.apply = classmethod(_apply)
    try:
        yield
    finally:
        Function.apply = _ORIGINAL_APPLY


def unwrap_calls(gm: fx.GraphModule) -> bool:
    """Turns the exported ``flat_apply`` nodes of ``kept_during_capture`` into plain calls of their
    ``FunctionCall`` (what the passes, the runtime and torch.compile read). Returns whether it changed
    ``gm`` (the caller recompiles it)."""
    changed = False
    for node in list(gm.graph.nodes):
        found = compat.opaque_call_of(gm, node) if node.op == "call_function" else None
        if found is None or not isinstance(found[0], FunctionCall):
            continue
        node.target, node.args = found
        changed = True
    if changed:
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
                if hasattr(gm, node.target):
                    delattr(gm, node.target)
    return changed
