"""In-place pointwise ops on autopar's DTensors, done on their local pieces.

Scripts change parameters and gradients in place, elementwise: a backward adds into ``p.grad`` (gradient
accumulation: autograd's ``AccumulateGrad`` calls ``aten.add_``), an EMA of the weights (``ema.mul_(d)
.add_(p, alpha=1 - d)``, ``lerp_``), gradients scaled by hand (``p.grad.div_(steps)``), weights loaded with
``p.copy_(other)``. torch 2.13's DTensor works out each such op's sharding, for each new case (shapes and
placements), by expanding a one-dimension strategy over the whole mesh, and autopar's parameter meshes have
four dimensions. On a tiny Llama at tensor (2,2,1) the first time cost: ``add_`` 0.47 s per parameter shape
(3.6 s at the first accumulating backward), ``div_`` 0.31 s and ``mul_``/``add_`` 0.32 s over the parameters,
``copy_`` 1.3 s. torch 2.11 took 2-16 ms.

Where every tensor operand is a DTensor on ``self``'s autopar mesh with its placements and shape, the op on
the local pieces is what DTensor computes: this handler runs it there and returns ``self``. A ``Partial``
placement (a value summed over ranks later) allows only what is linear in the operands: a weighted sum
(``add_``, ``sub_``, ``lerp_`` by a number, ``copy_``) or a scaling by a number (``mul_``, ``div_``), of
partial sums or means; a product of two partial values, a clamp or a partial maximum is not computed on the
pieces. Any other case (other layouts, meshes, plain tensors) takes DTensor's own path. Installed in
DTensor's table of custom op handlers for as long as a parallel model lives (``autopar.patches``), as
``norms`` is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar import patches
from autopar.compat import dtensor_default, dtensor_op_handlers, local_tensor
from autopar.runtime.comm.mesh import ShardMesh

aten = torch.ops.aten

SUMS = (aten.add_.Tensor, aten.sub_.Tensor, aten.lerp_.Scalar, aten.copy_.default)
"""Weighted sums of the operands: a partial sum stays one."""
SCALED = (aten.mul_.Tensor, aten.div_.Tensor)
"""Linear where the other operand is a number."""
OTHERS = (aten.lerp_.Tensor, aten.addcmul_.default, aten.addcdiv_.default, aten.clamp_.default,
          aten.clamp_min_.default, aten.clamp_max_.default)
OPS = SUMS + SCALED + OTHERS


def _same_layout(a: DTensor, b: Any) -> bool:
    return (isinstance(b, DTensor) and b.device_mesh == a.device_mesh and b.placements == a.placements
            and b.shape == a.shape)


def _on_pieces(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``op`` on the local pieces is DTensor's result (see the module's docstring)."""
    self = args[0]
    if not isinstance(self, DTensor) or not isinstance(self.device_mesh, ShardMesh):
        return False
    operands = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not all(_same_layout(self, t) for t in operands):
        return False
    partials = [p for p in self.placements if p.is_partial()]
    if not partials:
        return True
    linear = op in SUMS or (op in SCALED and not operands)
    return linear and all(getattr(p, "reduce_op", "sum") in ("sum", "avg") for p in partials)


def _local(op: Any, args: tuple, kwargs: dict) -> Any:
    if not _on_pieces(op, args, kwargs):
        return dtensor_default(op, args, kwargs)
    piece = lambda a: local_tensor(a) if isinstance(a, DTensor) else a  # noqa: E731
    op(*(piece(a) for a in args), **{k: piece(v) for k, v in kwargs.items()})
    return args[0]


def install() -> None:
    """Puts the handlers in DTensor's dispatch, for as long as a parallel model lives (``autopar.patches``)."""
    patches.install("DTensor handlers for in-place pointwise ops", _add_handlers)


def _add_handlers() -> Callable[[], None]:
    table = dtensor_op_handlers()
    added = [op for op in OPS if op not in table]  # torch's own stay first
    for op in added:
        table[op] = _local

    def undo() -> None:
        for op in added:
            if table.get(op) is _local:
                del table[op]

    return undo
