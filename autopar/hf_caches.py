"""HuggingFace key/value caches in captured calls: dropped in training (as HF does under gradient
checkpointing), registered as pytrees otherwise (HF's own helper, as its exporter does), so that a cache
passed in or returned is tensors autopar captures and keeps split (``autopar.runtime.execution.kept_state``)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from autopar import patches
from autopar.compat import deregister_pytree_nodes, pytree, pytree_node_types

log = logging.getLogger(__name__)
_warned = threading.local()


@contextlib.contextmanager
def cache_outputs(shadow: nn.Module, user_chose: bool) -> Iterator[None]:
    """HuggingFace key/value caches in outputs (``use_cache``), handled the way HF itself does.

    Training: the cache is dropped (HF does the same under gradient checkpointing): the shadow's
    ``config.use_cache`` is False while it is captured, and the output's ``past_key_values`` is
    None, with one warning. Eval: HF's cache classes are registered as pytrees (with HF's own
    helper) so the cache comes back as an output, gathered like any other.
    """
    config = getattr(shadow, "config", None)
    if user_chose or not getattr(config, "use_cache", False):
        yield
        return
    if not shadow.training:
        with hf_caches_registered(shadow):
            yield
        return
    if not getattr(_warned, "cache", False):
        _warned.cache = True
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            log.warning("autopar: %s returns a key/value cache (use_cache=True); it is not built in training "
                        "(past_key_values is None), as HF does under gradient checkpointing. Pass use_cache= "
                        "explicitly to choose.", type(shadow).__name__)
    # Sub-stacks may hold their own config copies (T5's decoder does).
    configs = {id(c): c for m in shadow.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def register_hf_caches(model: nn.Module) -> None:
    """Registers HF's key/value cache classes as pytrees (HF's own helper, as its exporter does) for as long as
    a parallel model lives (``autopar.patches``): a cache passed in (``generate`` passes
    ``past_key_values=DynamicCache()``) is then tensors autopar can capture and split, not an opaque input
    that fails the export. Nothing for other models."""
    name = _hf_caches_name(model)
    if name is not None:
        patches.install(name, lambda: _register_hf_caches(model))


@contextlib.contextmanager
def hf_caches_registered(model: nn.Module) -> Iterator[None]:
    """``register_hf_caches`` for the length of a capture only (the trace's, the plan search's), unless a
    parallel model keeps them registered."""
    name = _hf_caches_name(model)
    if name is None or patches.installed(name):
        yield
        return
    undo = _register_hf_caches(model)
    try:
        yield
    finally:
        undo()


def _hf_caches_name(model: nn.Module) -> str | None:
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, getattr(transformers, "PreTrainedModel", ())):
        return None
    return f"HF cache classes as pytrees ({type(model).__module__})"


def _register_hf_caches(model: nn.Module) -> Callable[[], None]:
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:  # older transformers: the export then fails with a clear CaptureError
        return lambda: None
    before = pytree_node_types()
    register_cache_pytrees_for_model(model)
    added = pytree_node_types() - before  # (classes registered before stay)

    def undo() -> None:
        if not deregister_pytree_nodes(added):
            log.debug("autopar: HF's cache classes stay registered as pytrees (torch's C++ pytree holds them)")

    return undo


def is_cache_type(t: type | None) -> bool:
    """An HF key/value cache class (DynamicCache, StaticCache, ...)."""
    return t is not None and t.__module__.startswith("transformers.") and "Cache" in t.__name__


def state_outputs(out_spec: pytree.TreeSpec) -> frozenset[int]:
    """The output leaves (flat positions) inside an HF key/value cache object: state the caller passes
    back in, which autopar keeps split between calls (``autopar.runtime.execution.kept_state``)."""
    kept: set[int] = set()

    def walk(spec: pytree.TreeSpec, start: int, inside: bool) -> None:
        inside = inside or is_cache_type(spec.type)
        if spec.is_leaf():
            if inside:
                kept.add(start)
            return
        for child in spec.children():
            walk(child, start, inside)
            start += child.num_leaves

    walk(out_spec, 0, False)
    return frozenset(kept)
