"""The local tensor of a parameter that other pipeline ranks hold (``ParamStore.hold``): a placeholder
with the parameter's shape and dtype and no storage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autopar.compat import disabled_torch_function_impl, make_wrapper_subclass
from autopar.errors import CheckpointError, ParameterError
from autopar.runtime.comm.mesh import WAYS_TO_SAVE

aten = torch.ops.aten

LIKE = frozenset({aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default})
"""Ops that make a tensor laid out like their input."""


class Absent(torch.Tensor):
    """The local tensor of a parameter that other pipeline ranks hold: no storage.

    Shapes and dtype are the holder's, so the DTensor around it is well formed. Checkpoints skip it
    (DCP writes and reads nothing for it); any computation raises ``ParameterError``.
    """

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, device: torch.device, name: str,
                holders: tuple[int, ...]) -> Absent:
        r = make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        r.param_name, r.holders = name, holders
        return r

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in (aten.detach.default, aten.alias.default):
            return args[0]
        # laid out like the parameter: a gradient or optimizer state (DCP's state init), or model.to(dtype)'s copy
        if func in LIKE or func is aten._to_copy.default:
            a, kwargs = args[0], kwargs or {}
            return Absent(a.shape, kwargs.get("dtype") or a.dtype, kwargs.get("device") or a.device, a.param_name,
                          a.holders)
        if func is aten.copy_.default and isinstance(args[1], Absent):
            return args[0]
        what = next(a for a in args if isinstance(a, Absent))
        raise ParameterError(
            f"parameter {what.param_name!r} lives on pipeline rank(s) {', '.join(map(str, what.holders))}, not on this "
            f"rank, so {func.__name__} cannot run on it here. Under pipeline parallelism each rank holds only its "
            "stages' parameters: use autopar.full_state_dict(model) (on every rank) for the whole model, or "
            "torch.distributed.checkpoint, which reads and writes each stage's parameters on the rank holding them.")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Absent({self.param_name!r}, held by pipeline rank(s) {self.holders})"

    def __reduce_ex__(self, protocol: object) -> object:
        raise CheckpointError(
            f"torch.save (or pickle) of parameter {self.param_name!r} (or its gradient or optimizer state) on a rank "
            f"that does not hold it: pipeline rank(s) {', '.join(map(str, self.holders))} hold it, so this rank has "
            f"only a placeholder and the value would be lost. {WAYS_TO_SAVE}")

    # torch.distributed.checkpoint's _Checkpointable protocol: this rank writes and reads nothing.
    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        return []

    def __create_chunk_list__(self) -> list:
        return []

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        raise ParameterError(f"this rank holds no piece of {self.param_name!r} (pipeline rank(s) {self.holders} do).")
