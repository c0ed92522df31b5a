"""What a script does with a parallel model: ``no_sync``, full state dicts, its plan, and ``detach`` (the plain
module back). Each takes the model (or the one a framework's wrapper holds)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar import patches
from autopar.compat import buffer_slots, compiled_original, local_tensor, parameter_slots
from autopar.decisions import Plan
from autopar.errors import ContextError
from autopar.runtime.interop.state_dicts import full_optimizer_state, load_full_optimizer_state
from autopar.runtime.parallel_runtime import ParallelRuntime, runtimes


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside the block keep gradients local (summed into ``.grad`` on this rank); the first
    backward after it sums everything accumulated over data (x depth), as DDP's ``no_sync`` does. Also
    ``model.no_sync()``, and DDP's ``model.require_backward_grad_sync = False`` (nanoGPT's loop)."""
    runtime_of(model).no_sync_depth += 1
    try:
        yield
    finally:
        runtime_of(model).no_sync_depth -= 1


def unwrapped(model: nn.Module) -> nn.Module:
    """The model a framework's wrapper holds (Lightning Fabric's ``_FabricModule``: the script passes what
    ``fabric.setup`` returned; the script's own ``torch.compile(model)``), else ``model``."""
    inner = compiled_original(model)
    return compiled_original(getattr(inner, "_forward_module", inner))


def runtime_of(model: nn.Module) -> ParallelRuntime:
    """The runtime of a parallel model (or of the one a framework's wrapper holds: ``unwrapped``)."""
    try:
        return runtimes[unwrapped(model)]
    except KeyError:
        raise ContextError(f"{type(model).__name__} was not built inside autopar.auto_parallelize().") from None


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The serial model's state dict (full tensors, serial names) on every rank. Collective."""
    return runtime_of(model).full_state_dict(unwrapped(model).state_dict())


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state in the serial format, on every rank (collective).

    The format of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer,
    options=StateDictOptions(full_state_dict=True))``: ``{"state": {parameter name: {"step": ...,
    "exp_avg": full tensor, ...}}, "param_groups": [{..., "params": [names]}]}``, which a serial model's
    optimizer state converts to and from by name. Unlike torch's helper it also gathers the state that
    other pipeline stages hold. Load it at any grid with ``load_full_optimizer_state_dict``.
    """
    return full_optimizer_state(runtime_of(model).store, optimizer)


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """Loads a serial-format optimizer state (``full_optimizer_state_dict``'s, or torch's with
    ``full_state_dict=True``) into ``optimizer`` at this grid: each rank keeps its pieces of every state
    tensor. Build the optimizer over ``model.parameters()`` with the saved run's parameter groups."""
    load_full_optimizer_state(runtime_of(model).store, optimizer, osd)


def plan_of(model: nn.Module) -> Plan | None:
    """The Plan the model runs under, or None before its first call."""
    return runtime_of(model).plan


def detach(model: nn.Module) -> nn.Module:
    """Gives the plain module back: serial's parameters and buffers, whole, on every rank (plain tensors,
    gradients dropped), the module's own ``forward`` (and ``no_sync``, ``generate``), and none of autopar's
    hooks; torch's process-wide tables lose autopar's entries with the last parallel model
    (``autopar.patches``). Collective: call it on every rank. Returns the module (the one a framework's wrapper
    holds, for a wrapper).

    The parameters are new objects: build a new optimizer over ``model.parameters()`` (to keep its state,
    take ``full_optimizer_state_dict`` before and load it by name after, as a serial script would).
    """
    inner = unwrapped(model)
    runtime = runtime_of(inner)
    with torch.no_grad():
        full = runtime.full_state_dict(inner.state_dict())  # (builds parameters not built yet, whole)
        names: dict[int, str] = {}
        for name, p in inner.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        plain: dict[int, nn.Parameter] = {}
        for module in inner.modules():
            for slot, p in list(parameter_slots(module).items()):
                if p is None:
                    continue
                if id(p) not in plain:
                    plain[id(p)] = nn.Parameter(_whole(full[names[id(p)]], p), requires_grad=p.requires_grad)
                parameter_slots(module)[slot] = plain[id(p)]
        for name, b in inner.named_buffers(remove_duplicate=False):
            module_name, _, slot = name.rpartition(".")
            value = full.get(name, runtime.buffers.get(name, b))
            buffer_slots(inner.get_submodule(module_name))[slot] = _whole(value, b)
    runtime.store.close()  # its load hooks and the optimizer hooks' way to the parameters go
    patches.release(inner)
    runtimes.pop(inner, None)
    return inner


def _whole(value: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """A full value as a plain tensor of its own (not sharing storage with ``old``, which the script may still
    hold: an optimizer built over the parallel model)."""
    value = value.full_tensor() if isinstance(value, DTensor) else value
    value = value.detach()
    old_local = local_tensor(old) if isinstance(old, DTensor) else old
    try:
        shared = value.untyped_storage().data_ptr() == old_local.untyped_storage().data_ptr()
    except RuntimeError:  # no storage: a parameter not built yet, or another pipeline stage's
        shared = False
    return value.clone() if shared else value
