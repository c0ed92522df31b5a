"""Parameters as DTensors: the serial (global) shape outside, this rank's shard inside.

Whenever the grid splits parameters (tensor or pipeline parallelism), every parameter of the model
becomes an ``nn.Parameter`` wrapping a ``torch.distributed.tensor.DTensor`` whose placements say
exactly which piece of the serial tensor this rank stores. So ``p.shape``, ``p.dim()``,
``p.numel()``, ``p.full_tensor()`` and parameter counts equal the serial model's; gradients and
optimizer state are DTensors with the same placements; ``torch.distributed.checkpoint`` and the
``state_dict`` helpers of ``torch.distributed.checkpoint.state_dict`` reshard them. The compute
never runs DTensor ops: the emitted graph reads ``p.to_local()`` (see ``local_view``).

Layouts (see ``passes.analysis.make_plan``; mesh dims (data, depth, row, col), placements left to
right):

==============  ==========================================================================
kind            placements
==============  ==========================================================================
REPLICATED      Replicate everywhere
SPLIT           ``Shard(split_dim)`` on its axis (``StridedShard(split_dim, sf=#pieces)`` when a
                fused dim has pieces (q/k/v) each split on its own); a second axis likewise on
                ``second_dim`` (experts over data, each over a tensor axis)
BIAS            as SPLIT on dim 0 over the axis splitting the matmul's output
WEIGHT_3D       out dim and in dim sharded over (row, col) by orientation; the block's rows (dim 0
                of the stored tensor) split again over depth, inside the other axis's blocks:
                ``StridedShard(0, sf=size of that axis)`` on depth
==============  ==========================================================================

Pipelines: a parameter lives on the pipeline ranks whose stages read it. A weight several stages
read (a tied embedding) lives on a mesh with a pipeline dim over those ranks (Replicate there). On
every other rank the same ``Parameter`` object keeps its global shape but its local tensor is an
``Absent`` placeholder: no storage, checkpoint-neutral (DCP writes and reads nothing for it), and
any computation on it raises ``ParameterError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.compat import (DTensorSpec, StridedShard, TensorMeta, dtensor_spec, local_tensor, parameter_slots,
                            select_split, set_dtensor_spec, set_local_tensor)
from autopar.config import ParallelConfig
from autopar.decisions import ParamKind, ParamPlan
from autopar.runtime.params.absent import Absent
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.comm.pieces import take_pieces

#: Dims of a parameter's mesh (``Mesh.param_mesh``); a weight several pipeline stages hold adds "pipeline".
DIMS = ("data", "context", "depth", "row", "col")
TIED_DIMS = ("data", "pipeline", "context", "depth", "row", "col")


def splits_parameters(config: ParallelConfig) -> bool:
    """Whether parameters become DTensors under ``config`` (tensor or pipeline parallelism, gradients split
    over data by ``shard_optimizer``, as FSDP2's are, or experts split over data).

    Pure data parallelism keeps plain tensors, as DDP does: every rank holds the whole model.
    """
    return config.num_tensor > 1 or config.pipeline > 1 or ((config.shard_optimizer or config.expert_parallel)
                                                             and config.data > 1)


def placements(pp: ParamPlan, dims: Sequence[str], config: ParallelConfig) -> tuple[Placement, ...]:
    """The DTensor placements of parameter ``pp`` on a mesh with dims ``dims`` (names of mesh axes)."""
    out: dict[str, Placement] = {d: Replicate() for d in dims}

    def shard(axis: str, dim: int, parts: tuple[int, ...] = ()) -> None:
        # (axes joined by '+', experts over data x a tensor axis: each shards the dim, the first outermost, as
        # DTensor applies a dim's shardings in mesh order)
        for a in axis.split("+") if axis else ():
            if config.size(a) > 1:
                out[a] = StridedShard(dim, split_factor=len(parts)) if len(parts) > 1 else Shard(dim)

    o = pp.orientation
    if pp.kind is ParamKind.SPLIT:
        shard(pp.split_axis, pp.split_dim, pp.parts)
        shard(pp.second_axis, pp.second_dim, pp.second_parts)
    elif pp.kind is ParamKind.BIAS:
        shard(o.out_axis, 0, pp.parts)
    elif pp.kind is ParamKind.WEIGHT_3D:
        out_dim, in_dim = (1, 0) if pp.weight_in_out else (0, 1)
        shard(o.out_axis, out_dim, pp.parts)
        shard(o.in_axis, in_dim)
        if config.depth > 1:  # depth splits the block's rows, inside the blocks of the axis splitting dim 0
            outer = config.size(o.in_axis if pp.weight_in_out else o.out_axis)
            out["depth"] = StridedShard(0, split_factor=outer) if outer > 1 else Shard(0)
    return tuple(out[d] for d in dims)


def local_indices(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                  layout: Sequence[Placement]) -> list[list[int]]:
    """For each tensor dim, the global indices this coordinate's local tensor holds, in local order.

    DTensor layouts are separable by dim; applying each mesh dim's placement in turn to an arange of
    every dim gives the local index sets (exact for ``StridedShard`` too). Used to check a layout
    against autopar's own slicing, and by checkpoints to describe non-contiguous shards.
    """
    index = [torch.arange(n) for n in shape]
    for mesh_dim, p in enumerate(layout):
        if not isinstance(p, Shard | StridedShard):
            continue
        one = StridedShard(0, split_factor=p.split_factor) if isinstance(p, StridedShard) else Shard(0)
        index[p.dim] = select_split(one, index[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
    return [i.tolist() for i in index]


def runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive indices: (global start, local start, length)."""
    out: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if out and out[-1][0] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((g, local, 1))
    return out


def spec_of(mesh: DeviceMesh, layout: Sequence[Placement], shape: Sequence[int], dtype: torch.dtype) -> DTensorSpec:
    """The DTensorSpec of a contiguous global tensor of ``shape`` laid out as ``layout`` over ``mesh``."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, tuple(layout), tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def make_dtensor(local: torch.Tensor, mesh: DeviceMesh, layout: Sequence[Placement], shape: Sequence[int]) -> DTensor:
    """A DTensor of global ``shape`` around ``local`` as it is (no view, no check: ``local`` may be Absent)."""
    return DTensor(local, spec_of(mesh, layout, shape, local.dtype), requires_grad=False)


def distribute_parameters(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replaces every parameter of ``model`` by a Parameter wrapping a replicated DTensor (same storage).

    Tied parameters (one Parameter under several names) stay one. Called at the end of the
    ``auto_parallelize`` block, before the script builds its optimizer, so the optimizer holds the
    objects that later change layout in place (``set_layout``). Replicated DTensors on another mesh (a
    grid chosen at the first call replacing the provisional one) move to ``mesh`` in place.
    """
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(parameter_slots(module).items()):
            if isinstance(p, DTensor) and p.device_mesh is not mesh and id(p) not in made:
                made[id(p)] = p
                set_layout(p, local_tensor(p), mesh, [Replicate()] * mesh.ndim)
            if p is None or isinstance(p, DTensor):
                continue
            q = made.get(id(p))
            if q is None:
                whole = make_dtensor(p.detach(), mesh, [Replicate()] * mesh.ndim, p.shape)  # same storage
                q = made[id(p)] = nn.Parameter(whole, requires_grad=p.requires_grad)
            setattr(module, name, q)


def set_layout(p: DTensor, local: torch.Tensor, mesh: DeviceMesh, layout: Sequence[Placement]) -> None:
    """Gives DTensor ``p`` (a Parameter the optimizer may hold) a new local tensor and placements, in place.

    The global shape does not change. This is what FSDP2 does to its sharded parameters
    (``_local_tensor`` and ``_spec`` are the DTensor's whole state).
    """
    set_local_tensor(p, local)
    set_dtensor_spec(p, spec_of(mesh, layout, p.shape, p.dtype))


class _LocalPiece(torch.autograd.Function):
    """``p.to_local(grad_placements=p.placements)`` without its per-call checks: a view of the local
    tensor, whose gradient becomes a DTensor laid out like ``p`` (measured 5x cheaper per parameter,
    forward and backward, than ``to_local``)."""

    @staticmethod
    def forward(ctx: Any, p: DTensor) -> torch.Tensor:
        ctx.spec = dtensor_spec(p)
        return local_tensor(p).view_as(local_tensor(p))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:
        return DTensor(grad, ctx.spec, requires_grad=False)


def local_view(p: torch.Tensor) -> torch.Tensor:
    """What the emitted graph reads for parameter ``p``: its local tensor, differentiably (the gradient
    comes back as a DTensor with ``p``'s placements)."""
    if isinstance(p, DTensor):
        if isinstance(local_tensor(p), Absent) or not torch.is_grad_enabled():  # (Absent: bound but never
            return local_tensor(p)  # read, another pipeline rank's stage; no_grad: no autograd Function per call)
        return _LocalPiece.apply(p)
    return p


class _LocalPieces(torch.autograd.Function):
    """``_LocalPiece`` for many parameters in one autograd node: one Python call each way for all of them."""

    @staticmethod
    def forward(ctx: Any, *ps: DTensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # a parameter the graph did not use keeps no gradient (None), as serial
        ctx.specs = [dtensor_spec(p) for p in ps]
        return tuple(local_tensor(p).view_as(local_tensor(p)) for p in ps)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[DTensor | None, ...]:
        return tuple(None if g is None else DTensor(g, spec, requires_grad=False) for g, spec in zip(grads, ctx.specs))


def local_views(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``local_view`` of each of ``params``, those that need a gradient read through one autograd node.

    For a compiled graph (``autopar.runtime.compiled.graph``): its backward is one node that returns every
    gradient at once, so one node reading every parameter delays no gradient, where a node per parameter
    cost a Python ``apply`` in forward and a Python backward call per parameter (eager graphs keep those:
    each gradient is ready, and its data-parallel sync can start, as soon as its own layer's backward ran, since
    the graph makes each node where the parameter is first used: ``binding.reading_params_at_use``).
    """
    out = [local_view(p) if not isinstance(p, DTensor) or not p.requires_grad or isinstance(local_tensor(p), Absent)
           or not torch.is_grad_enabled() else None for p in params]
    grouped = [i for i, v in enumerate(out) if v is None]
    if grouped:
        for i, view in zip(grouped, _LocalPieces.apply(*(params[i] for i in grouped))):
            out[i] = view
    return out


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a parameter, its gradient, optimizer state); ``t`` otherwise."""
    return local_tensor(t) if isinstance(t, DTensor) else t  # to_local() would add a view (and a check) per call


def held_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` this rank stores (0 for another pipeline stage's parameter)."""
    local = local_of(p)
    return 0 if isinstance(local, Absent) else local.numel()


def replace_local(t: DTensor, local: torch.Tensor) -> None:
    """Replaces the local tensor of DTensor ``t`` (a gradient) by ``local`` of the same shape."""
    if tuple(local.shape) != tuple(local_tensor(t).shape):
        raise AssertionError(f"local shape {tuple(local.shape)} != {tuple(local_tensor(t).shape)}")
    set_local_tensor(t, local)


def local_piece(full: torch.Tensor, pp: ParamPlan, mesh: Mesh) -> torch.Tensor:
    """This rank's piece of a full (serial) parameter tensor (a view where possible); ``placements`` gives
    its DTensor layout (tests/unit/test_param_layouts.py holds the two equal)."""
    o = pp.orientation
    if pp.kind is ParamKind.REPLICATED:
        return full
    if pp.kind is ParamKind.SPLIT:
        axis, second = pp.split_axis, pp.second_axis
        if second:  # (experts over data, each over a tensor axis: one copy at most, at the end)
            full = take_pieces(full, pp.second_dim, pp.second_parts, mesh.size(second), mesh.index(second),
                               contiguous=False)
        return take_pieces(full, pp.split_dim, pp.parts, mesh.size(axis), mesh.index(axis))
    if pp.kind is ParamKind.BIAS:
        return take_pieces(full, 0, pp.parts, mesh.size(o.out_axis), mesh.index(o.out_axis))
    out_dim, in_dim = (1, 0) if pp.weight_in_out else (0, 1)
    # one copy at most, at the end (a contiguous middle step would copy half the weight for nothing)
    block = take_pieces(full, out_dim, pp.parts, mesh.size(o.out_axis), mesh.index(o.out_axis), contiguous=False)
    block = take_pieces(block, in_dim, (), mesh.size(o.in_axis), mesh.index(o.in_axis), contiguous=False)
    rows = block.shape[0] // mesh.size("depth")  # the plan keeps the block's rows divisible by depth
    return block.narrow(0, mesh.index("depth") * rows, rows).contiguous()


def own_piece(full: torch.Tensor, pp: ParamPlan, mesh: Mesh) -> torch.Tensor:
    """``local_piece`` in storage of its own (the whole can be freed)."""
    piece = local_piece(full, pp, mesh)
    if piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
        piece = piece.clone()
    return piece
