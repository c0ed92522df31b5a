"""Norms of sharded tensors, as the serial script computes them (``clip_grad_norm_`` and friends).

``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and ``clip_grads_with_norm_`` take one norm
per gradient (``torch._foreach_norm`` or ``torch.linalg.vector_norm``), stack them and take the norm
of the stack. For a DTensor on autopar's meshes (parameters, gradients, optimizer state) a full norm
is a ``PartialNorm``: this rank's share of it, the norm of its local piece if this rank is the piece's
designated holder (coordinate 0 on every mesh dim the tensor is replicated over: data, tensor axes
that do not split it, the pipeline stages sharing a tied weight), else nothing. Stacking PartialNorms
gives a PartialNorm; the norm of the stack, or any other use, reduces it with one all-reduce over
all ranks (sum of p-th powers; max for inf, min for -inf). Every rank gets the same value, so every
rank clips by the same factor and replicated parameters stay bitwise equal across ranks. Pipeline
stages are included: the reduction spans the world, which DTensor's own (per-mesh) norms cannot.

Installed in DTensor's op dispatch (its table of custom op handlers) for ``aten.linalg_vector_norm``
and ``aten._foreach_norm``, acting only on DTensors whose mesh is autopar's ``ShardMesh``; every
other DTensor takes torch's own path. The in-place foreach ops clipping then applies (scale by the
clip coefficient, clamp) run on the local pieces too, since a pipeline rank's gradients may live on
two meshes (its stage's, and a tied weight's over the stages sharing it). Like any DTensor reduction it is collective: every rank must
compute the same norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from autopar import patches
from autopar.compat import DisableTorchFunctionSubclass, dtensor_default, dtensor_op_handlers, local_tensor
from autopar.errors import AutoparError
from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import ShardMesh
from autopar.runtime.params.absent import Absent

aten = torch.ops.aten


class PartialNorm(torch.Tensor):
    """This rank's share of a norm (or of a stack of norms) of order ``ord``; reduced on first use."""

    ord: float

    @staticmethod
    def of(local: torch.Tensor, ord: float) -> PartialNorm:
        out = local.as_subclass(PartialNorm)
        out.ord = ord
        return out

    def local(self) -> torch.Tensor:
        with DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def reduce(self) -> torch.Tensor:
        """The norm over every rank (elementwise for a stack): one all-reduce over the world."""
        return _reduce(self.local(), self.ord)

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        return f"PartialNorm(local={self.local()!r}, ord={self.ord})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        with DisableTorchFunctionSubclass():
            if func is torch.stack:
                return _stack(*args, **kwargs)
            if func is torch.Tensor.to and isinstance(args[0], PartialNorm):
                return PartialNorm.of(args[0].local().to(*args[1:], **kwargs), args[0].ord)
            if func is torch.linalg.vector_norm and isinstance(args[0], PartialNorm):
                ord = args[1] if len(args) > 1 else kwargs.get("ord", 2.0)
                rest = {k: v for k, v in kwargs.items() if k != "ord"}
                if float(ord) == args[0].ord and len(args) <= 2 and rest.get("dim") is None \
                        and not rest.get("keepdim", False):
                    local = torch.linalg.vector_norm(args[0].local(), ord, dtype=rest.get("dtype"))
                    return _reduce(local, args[0].ord)
            if getattr(func, "__name__", "") == "__get__":  # .device, .dtype, .shape: no reduction needed
                return func(*[a.local() if isinstance(a, PartialNorm) else a for a in args])
            reduced_args = _materialize(args)
            reduced_kwargs = _materialize(kwargs)
            return func(*reduced_args, **reduced_kwargs)


def _materialize(value: Any) -> Any:
    if isinstance(value, PartialNorm):
        return value.reduce()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialize(v) for k, v in value.items()}
    return value


def _stack(tensors: Any, dim: int = 0, *, out: Any = None) -> Any:
    tensors = list(tensors)
    if out is None and tensors and all(isinstance(t, PartialNorm) for t in tensors):
        orders = {t.ord for t in tensors}
        if len(orders) == 1:
            return PartialNorm.of(torch.stack([t.local() for t in tensors], dim), orders.pop())
    if any(isinstance(t, PartialNorm) for t in tensors) and any(not isinstance(t, PartialNorm) for t in tensors):
        raise AutoparError(
            "a norm over autopar's sharded tensors and other tensors at once (e.g. clip_grad_norm_ over the "
            "parameters of an autopar model and of a model autopar does not parallelize): autopar cannot tell "
            "which ranks hold the other tensors. Clip each model's parameters in its own call.")
    return torch.stack(_materialize(tensors), dim, out=out)


def _reduce(local: torch.Tensor, ord: float) -> torch.Tensor:
    world = dist.get_world_size()
    if ord == math.inf:
        return C.all_reduce(local.clone(), None, world, op="max")
    if ord == -math.inf:
        return C.all_reduce(local.clone(), None, world, op="min")
    return C.all_reduce(local.pow(ord), None, world).pow(1.0 / ord)


def designated(t: DTensor) -> bool:
    """Whether this rank counts its piece of ``t`` in a norm: coordinate 0 wherever ``t`` is replicated."""
    if isinstance(local_tensor(t), Absent):
        return False
    coordinate = t.device_mesh.get_coordinate()
    return all(c == 0 for c, p in zip(coordinate, t.placements) if isinstance(p, Replicate))


def _ours(t: Any) -> bool:
    return isinstance(t, DTensor) and isinstance(t.device_mesh, ShardMesh)


def _share(t: DTensor, ord: float, dtype: torch.dtype | None) -> PartialNorm:
    if ord == 0:
        raise AutoparError("norm_type=0 (a count of nonzero entries) over autopar's sharded tensors is not "
                           "supported. Use norm_type 2, 1, inf or any p > 0.")
    local = local_tensor(t)
    if designated(t):
        value = torch.linalg.vector_norm(local, ord, dtype=dtype)
    else:  # the reduction's identity: this rank's copy is counted on another rank
        value = torch.full((), math.inf if ord == -math.inf else 0.0, dtype=dtype or local.dtype,
                           device=local.device)
    return PartialNorm.of(value, float(ord))


def _vector_norm(op: Any, args: tuple, kwargs: dict) -> Any:
    t, rest = args[0], dict(zip(("ord", "dim", "keepdim"), args[1:]))
    rest.update(kwargs)
    if not _ours(t) or rest.get("dim") is not None or rest.get("keepdim", False):
        return dtensor_default(op, args, kwargs)
    return _share(t, float(rest.get("ord", 2.0)), rest.get("dtype"))


def _foreach_norm(op: Any, args: tuple, kwargs: dict) -> Any:
    tensors = list(args[0])
    ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
    mine = [_ours(t) for t in tensors]
    if not any(mine):
        return dtensor_default(op, args, kwargs)
    if not all(mine):
        return _stack([PartialNorm.of(torch.zeros(()), ord), torch.zeros(())])  # raises the mixing error
    return [_share(t, ord, kwargs.get("dtype")) for t in tensors]


def _foreach_local(op: Any, args: tuple, kwargs: dict) -> Any:
    """An in-place elementwise foreach op with scalar operands (clipping's scale and clamps) on the local
    pieces: their layout does not matter, and a list may mix meshes (a pipeline's tied weights live on a
    mesh over the stages sharing them), which DTensor's foreach refuses."""
    tensors = list(args[0])
    if not all(_ours(t) for t in tensors) or any(isinstance(a, DTensor) for a in args[1:]):
        return dtensor_default(op, args, kwargs)
    op([local_tensor(t) for t in tensors], *args[1:], **kwargs)
    return None


#: In-place foreach ops clip_grad_norm_ / clip_grads_with_norm_ / clip_grad_value_ apply to the gradients.
FOREACH_IN_PLACE = (aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar, aten._foreach_clamp_min_.Scalar,
                    aten._foreach_clamp_max_.Scalar)


def install() -> None:
    """Puts the handlers in DTensor's dispatch, for as long as a parallel model lives (``autopar.patches``)."""
    patches.install("DTensor handlers for norms and clipping", _add_handlers)


def _add_handlers() -> Callable[[], None]:
    table = dtensor_op_handlers()
    mine = {aten.linalg_vector_norm.default: _vector_norm, aten._foreach_norm.Scalar: _foreach_norm,
            **{op: _foreach_local for op in FOREACH_IN_PLACE}}
    added = {op: handler for op, handler in mine.items() if op not in table}  # torch's own stay first
    table.update(added)

    def undo() -> None:
        for op, handler in added.items():
            if table.get(op) is handler:
                del table[op]

    return undo
