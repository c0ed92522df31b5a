"""The model's side of deferred construction (autopar/runtime/construction/record.py): until the first call builds
them, recorded parameters and buffers are ``Pending`` tensors; grids that keep whole parameters build
them at the block's end instead.

A ``Pending`` has the global shape, dtype and the device serial's would have, no storage.
``.to(device/dtype)`` works on it (applied when it is built), ``copy_`` into one (``load_state_dict``
of full tensors) replaces its recorded init by the loaded value (only this rank's slice is kept).
Anything else that needs values before the first call (an optimizer step, DCP's ``get_state_dict``
initializing optimizer state, ``torch.save``) builds the model's parameters whole on this rank, with one
warning line, and the first call cuts them as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopar.compat import (buffer_slots, disabled_torch_function_impl, make_wrapper_subclass, parameter_slots, pytree,
                            version_of)
from autopar.errors import CheckpointError, ParameterError
from autopar.runtime.construction.record import META, Sink
from autopar.runtime.construction.memory_mapped import mapped_record

if TYPE_CHECKING:
    from autopar.runtime.construction.record import Deferred

aten = torch.ops.aten


class Pending(torch.Tensor):
    """A parameter's or buffer's value before it is materialized: shape, dtype and device, no storage.

    Copies (``detach``, ``.to(dtype)``) share one ``cell``: the value loaded into any of them, and the
    real tensor once the model is built whole before its first call."""

    @staticmethod
    def __new__(cls, shape: Iterable[int], dtype: torch.dtype, device: torch.device, name: str, key: int,
                source: Deferred, cell: dict[str, Any] | None = None) -> Pending:
        r = make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        r.param_name, r.key, r.source = name, key, source
        r.cell = cell if cell is not None else {"loaded": None, "version": 0, "real": None}
        return r

    __torch_function__ = disabled_torch_function_impl

    @property
    def loaded(self) -> torch.Tensor | None:
        return self.cell["loaded"]

    @property
    def real(self) -> torch.Tensor | None:
        """The tensor this stands for once built, in this copy's dtype and device."""
        real = self.cell["real"]
        return None if real is None else real.to(dtype=self.dtype, device=self.device)

    def _like(self, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        if device is not None and torch.device(device).type == "meta":  # a meta copy (capture's shadow)
            return torch.empty(self.shape, dtype=dtype or self.dtype, device=META)
        return Pending(self.shape, dtype or self.dtype, torch.device(device) if device is not None else self.device,
                       self.param_name, self.key, self.source, self.cell)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, Pending) and first.cell["real"] is None:
            if func in (aten.detach.default, aten.alias.default):
                return first._like()  # a new object: autograd marks detach's output as not requiring grad
            if func is aten._to_copy.default:  # model.to(device / dtype), .half()
                return first._like(kwargs.get("dtype"), kwargs.get("device"))
            if func is aten.copy_.default and not isinstance(args[1], Pending):
                if tuple(args[1].shape) != tuple(first.shape):
                    raise ParameterError(f"copying a {tuple(args[1].shape)} tensor into {first.param_name!r} of "
                                         f"shape {tuple(first.shape)}.")
                first.cell["loaded"] = args[1]  # load_state_dict before the first call: replaces the init
                first.cell["version"] = version_of(args[1])  # (read at the first call: it must not change till then)
                return first
        if func in (aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default):
            like = dict(kwargs, dtype=kwargs.get("dtype") or first.dtype, device=kwargs.get("device") or first.device)
            fill = {aten.empty_like.default: torch.empty, aten.zeros_like.default: torch.zeros,
                    aten.ones_like.default: torch.ones}.get(func)
            like.pop("memory_format", None)
            if fill is not None:
                return fill(first.shape, **like)
            return torch.full(first.shape, args[1], **like)
        for what in [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Pending)]:
            if what.cell["real"] is None:
                build = what.source.on_demand.get(what.key)
                if build is None:
                    raise ParameterError(f"{what.param_name!r} has no value: its model was not built by autopar.")
                build(f"{func.__name__} on {what.param_name!r}")
        args, kwargs = pytree.tree_map_only(Pending, lambda a: a.real, (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Pending({self.param_name!r}, {tuple(self.shape)}, {self.dtype}, built at the model's first call)"

    def __reduce_ex__(self, protocol: object) -> object:
        if self.cell["real"] is None:
            build = self.source.on_demand.get(self.key)
            if build is None:
                raise CheckpointError(f"{self.param_name!r} has no value: its model was not built by autopar.")
            build(f"pickling {self.param_name!r}")
        return self.real.__reduce_ex__(protocol)


class LazyRead(torch.Tensor):
    """A lazily loaded checkpoint tensor (Lightning's ``lazy_load``, which litgpt's ``load_checkpoint``
    uses: tensor-like, read from the file on first use) loaded into a pending parameter: shape and dtype
    only, read at the first call (``read``), one tensor at a time and only this rank's pieces' pages, so
    the loaded model is never whole in memory. ``load_state_dict`` copies it into the Pending like any
    loaded tensor."""

    @staticmethod
    def __new__(cls, source: Any) -> LazyRead:
        r = make_wrapper_subclass(cls, torch.Size(source.shape), dtype=source.dtype,
                                                device=torch.device("cpu"))
        r.source = source
        return r

    __torch_function__ = disabled_torch_function_impl

    def read(self) -> torch.Tensor:
        """The tensor as a view of its file's pages (nothing read until touched: cutting this rank's piece
        out reads the piece's pages), or, where the file cannot be mapped, read whole through the
        source's own ``__torch_function__``."""
        mapped = mapped_record(self.source)
        return mapped if mapped is not None else torch.detach(self.source)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        first = args[0] if args else None
        if func in (aten.detach.default, aten.alias.default) or (
                func is aten._to_copy.default and isinstance(first, LazyRead)
                and torch.device((kwargs or {}).get("device") or "cpu").type == "cpu"
                and (kwargs or {}).get("dtype") in (None, first.dtype)):
            return first  # the DTensor around it, load_state_dict's detach and .to(device)
        args, kwargs = pytree.tree_map_only(LazyRead, lambda a: a.read(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LazyRead({tuple(self.shape)}, {self.dtype}, read at the model's first call)"


def loaded_value(pending: Pending, deferred: Deferred) -> torch.Tensor:
    """The value loaded into a pending parameter (``load_state_dict`` before the first call, which keeps the
    source tensor, not a copy: a checkpoint is read once, each rank its slices): a recorded one (a
    checkpoint's tensor converted inside the block, not read yet) is computed now. Raises when the source
    was written since it was loaded (a live model's ``state_dict()`` that then trained): the values loaded
    are gone, and serial's load would have copied them."""
    loaded = pending.loaded
    if isinstance(loaded, LazyRead):
        return loaded.read()
    if version_of(loaded) != pending.cell["version"]:
        raise ParameterError(
            f"the tensor loaded into {pending.param_name!r} by load_state_dict before the model's first call was "
            "changed in place since (e.g. another model's state_dict() that then trained). autopar reads a "
            "loaded tensor at the first call, when it knows this rank's pieces, so the values loaded are gone. "
            "Load a copy ({k: v.clone() for k, v in sd.items()}), load after the first call, or pass "
            "example_inputs= to auto_parallelize so the model is sharded at the block's end.")
    return deferred.evaluate(loaded) if loaded.device.type == "meta" else loaded


def materialize_whole(model: nn.Module, deferred: Deferred, sinks: dict[int, Sink]) -> None:
    """Gives every recorded parameter and buffer of ``model`` its serial value, in place (same objects):
    for grids that keep whole parameters on every rank (data parallelism alone)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))

    def emit(sink: Sink, values: dict[str, torch.Tensor]) -> None:
        done: set[int] = set()
        for name, _, is_param in sink.names:
            t = tensors[name]
            if id(t) in done:
                continue
            done.add(id(t))
            value = values[name].clone()
            torch.utils.swap_tensors(t, nn.Parameter(value, requires_grad=t.requires_grad) if is_param else value)

    deferred.replay(sinks, emit)


def make_pending(model: nn.Module, deferred: Deferred, sinks: dict[int, Sink]) -> None:
    """Replaces ``model``'s recorded meta parameters and buffers by ``Pending`` ones (tied names stay one
    object); the ParamStore materializes them when the plan says which pieces this rank keeps."""
    made: dict[int, torch.Tensor] = {}
    for sink in sinks.values():
        for name, ref, is_param in sink.names:
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            old = parameter_slots(owner)[leaf] if is_param else buffer_slots(owner)[leaf]
            new = made.get(id(old))
            if new is None:
                pending = Pending(ref.size, ref.dtype, deferred.devices[sink.key], name, sink.key, deferred)
                new = made[id(old)] = nn.Parameter(pending, requires_grad=old.requires_grad) if is_param else pending
            if is_param:
                parameter_slots(owner)[leaf] = new
            else:
                buffer_slots(owner)[leaf] = new


def is_pending(t: Any) -> bool:
    return isinstance(t, Pending)
