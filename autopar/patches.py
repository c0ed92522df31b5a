"""Every change autopar makes outside its own objects: installed here, recorded, and undone.

Two kinds, each with the way it is undone:

- **A model's** (``ModelPatches``): its ``forward``, DDP's ``no_sync`` and HF's ``generate`` replaced by
  instance attributes, a state-dict post-hook, load-state-dict pre-hooks on its modules, and the gradient
  hooks on its parameters. ``autopar.detach(model)`` undoes them (last installed first) and gives the plain
  module back; a model that is garbage-collected takes them with it.
- **The process's** (``install``): torch.optim's global step hooks, DTensor's handlers for norms and
  clipping, HF's key/value cache classes registered as pytrees, and torch.distributed's synchronous
  collectives wrapped so that one failing for a rank that parted names every rank (``runtime.faults``). Installed with the first parallel model,
  undone when the last one is detached or collected.

Not here, because they last only while a graph is exported or its passes run: ``Function.apply`` records a
user's custom autograd Function as one call of itself (``autopar.custom_functions.kept_during_capture``), and
``passes.ir.spec_names`` names autopar's spec
types to fx's code generator inside ``passes.runner.run_passes`` and takes the names away after it.
Inside an ``auto_parallelize`` block that builds on meta, transformers' ``USE_HUB_KERNELS`` is "0" (its
``from_pretrained`` kernelizes by default since 5.25, which raises on meta; ``autopar.context``, put back at the
block's end). While torch's pipeline schedule runs a gloo pipeline's step, its waits for sends and receives take the group's
timeout (``autopar.compat.timed_pipeline_waits``, put back when the step returns).

``inventory()`` lists what is installed now (tests hold it against torch's own tables).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

_MISSING = object()

Undo = Callable[[], None]


class ModelPatches:
    """The changes made to one model, by name, undone last first."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._undo: dict[str, Undo] = {}
        self.finalizer = weakref.finalize(model, _model_gone)

    def names(self) -> list[str]:
        return list(self._undo)

    def __contains__(self, name: str) -> bool:
        return name in self._undo

    def set_attribute(self, name: str, value: Any) -> None:
        """``model.<name> = value`` as an instance attribute; undone to what the instance had (or nothing,
        so the class's attribute shows again)."""
        model = self._model()
        before = vars(model).get(name, _MISSING)
        setattr(model, name, value)
        key = f"attribute {name}"
        if key in self._undo:  # installed before: the first value is the one to restore
            return
        ref = self._model

        def undo() -> None:
            m = ref()
            if m is None:
                return
            if before is _MISSING:
                vars(m).pop(name, None)
            else:
                setattr(m, name, before)

        self._undo[key] = undo

    def add(self, name: str, undo: Undo) -> None:
        """Records a change made elsewhere (hook handles, a parameter store's hooks); a later ``add`` of the
        same name replaces it (its owner undid the first)."""
        self._undo.pop(name, None)
        self._undo[name] = undo

    def discard(self, name: str) -> None:
        """Forgets ``name`` (its owner undid it)."""
        self._undo.pop(name, None)

    def undo_all(self) -> None:
        errors = []
        for name in reversed(list(self._undo)):
            try:
                self._undo.pop(name)()
            except Exception as e:  # every other change is still undone; the first error is raised after
                errors.append((name, e))
        self.finalizer.detach()
        _model_gone()
        if errors:
            name, e = errors[0]
            raise RuntimeError(f"autopar: undoing {name!r} failed ({e})") from e


_models: weakref.WeakKeyDictionary[nn.Module, ModelPatches] = weakref.WeakKeyDictionary()
_live = 0
"""Models with patches that were neither detached nor collected."""
_process: dict[str, Undo] = {}


def of_model(model: nn.Module) -> ModelPatches:
    """The record of ``model``'s changes (made on first use: the model counts as live from then)."""
    global _live
    patches = _models.get(model)
    if patches is None:
        patches = _models[model] = ModelPatches(model)
        _live += 1
    return patches


def install(name: str, make: Callable[[], Undo]) -> None:
    """Installs a process-wide change once (``make`` does it and returns how to undo it), for as long as any
    parallel model lives."""
    if name not in _process:
        _process[name] = make()


def installed(name: str) -> bool:
    """Whether the process-wide change ``name`` is installed now."""
    return name in _process


def release(model: nn.Module) -> None:
    """Undoes every change made to ``model`` (``autopar.detach``); the process's go with the last model."""
    patches = _models.pop(model, None)
    if patches is not None:
        patches.undo_all()


def _model_gone() -> None:
    global _live
    _live -= 1
    if _live <= 0:
        _live = 0
        undo_process()


def undo_process() -> None:
    """Undoes the process-wide changes (last installed first)."""
    for name in reversed(list(_process)):
        try:
            _process.pop(name)()
        except Exception as e:  # never raised from a finalizer: one line, the others still undone
            log.warning("autopar: undoing %s failed (%s)", name, e)


def inventory() -> dict[str, Any]:
    """What is installed now: {"process": [names], "models": [(model class, [names]), ...]}."""
    return {"process": list(_process),
            "models": [(type(m).__name__, p.names()) for m, p in list(_models.items())]}
