"""Optimizer state and gradients split over data (``auto_parallelize(shard_optimizer=True)``, ZeRO stages 1-2).

Every data rank holds the same parameters. Under ``shard_optimizer`` data rank i keeps the optimizer state
of only chunk i of each parameter's local piece, split along one dim (``layout``: dim 0 when no other mesh
axis splits it, else the first dim none splits) as ``torch.chunk`` splits it, the way DTensor's ``Shard(dim)``
lays out an uneven split; it steps those elements and the data ranks then all-gather the updated chunks
(``gather``), in buckets of ``BUCKET_BYTES``. The state
is a DTensor with ``Shard(dim)`` on the data dim of the parameter's mesh, so ``optimizer.state_dict()``,
DCP and ``autopar.full_optimizer_state_dict`` see its global shape (the serial one) and which box each rank
holds, and a checkpoint loads at any grid, sharded or not.

A weight split on both of its dims (tensor row and col above 1) is cut along a dim one of them splits: each
data rank keeps an even chunk of that axis's block (``StridedShard`` on the data dim, as FSDP2 over a
tensor-parallel shard; ``passes.analysis.optimizer_shards`` has the rule). A parameter with neither (a
scalar; a block whose rows do not divide by data) keeps its whole state on every data rank, which all step
it alike.

Gradients are split the same way (ZeRO stage 2): ``GradSync`` reduce-scatters them over data into the
layout ``pack`` writes, and ``p.grad`` becomes this rank's chunk of the sum as a DTensor with the state's
placements (``split_grad``), so clipping, GradScaler and a script reading ``p.grad`` (``full_tensor()``)
see serial's values. With the all-gather after the step, a step sends the bytes of DDP's all-reduce.
Pipeline stages sum their gradients whole (``stage_grads``); a non-elementwise optimizer gathers them
whole before its step (``whole_grad``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils.weak import WeakIdKeyDictionary

from autopar.compat import StridedShard, local_tensor
from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.params.layout import make_dtensor
from passes.analysis.optimizer_shards import chunk_rows, state_split

DATA_DIM = 0
"""The data axis's dim in every parameter mesh (``param_layout.DIMS`` and ``TIED_DIMS`` start with it)."""


class Layout:
    """How one parameter's optimizer state (and gradient) is split over data: along ``dim`` of its local piece."""

    __slots__ = ("dim", "lo", "hi", "placements", "width")

    def __init__(self, dim: int, lo: int, hi: int, placements: tuple[Placement, ...], width: int) -> None:
        self.dim, self.lo, self.hi, self.placements = dim, lo, hi, placements
        self.width = width
        """Elements of one chunk padded to the first (the largest): each rank's share of a collective."""

    def chunk(self, piece: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``piece`` (a view)."""
        return piece.narrow(self.dim, self.lo, self.hi - self.lo)


class DataShards:
    """The data group a store's optimizer state is split over."""

    def __init__(self, mesh: Mesh) -> None:
        self.group, self.size, self.index = mesh.group("data"), mesh.size("data"), mesh.index("data")
        self._grad_layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """parameter -> (its local shape and placements, ``grad_layout``'s answer): asked at every pipeline step."""

    def layout(self, p: torch.Tensor, piece: torch.Tensor, ndim: int) -> Layout | None:
        """The split of ``p``'s state (``piece``: its local tensor; ``ndim``: its mesh's dims, for a plain
        parameter the store's parameter mesh); None when its state stays whole, or is already this rank's alone
        (a parameter split over data: experts under ``expert_parallel``)."""
        placements = p.placements if isinstance(p, DTensor) else (Replicate(),) * ndim
        if split_over_data(p) and p.device_mesh.size(DATA_DIM) > 1:
            return None  # (split over data itself, each rank its own experts: their state is this rank's already)
        split: dict[int, tuple[int, ...]] = {}
        fused: set[int] = set()  # (fused pieces, each split: ``ParamPlan.fused_dims``)
        for mesh_dim, q in enumerate(placements):
            if isinstance(q, Shard | StridedShard) and p.device_mesh.size(mesh_dim) > 1:
                split[q.dim] = (*split.get(q.dim, ()), p.device_mesh.size(mesh_dim))
                if isinstance(q, StridedShard):
                    fused.add(q.dim)
        cut = state_split(p.shape, split, self.size, fused)
        if cut is None:
            return None
        dim, factor = cut
        n = piece.shape[dim]
        lo, hi = chunk_rows(n, self.size, self.index)
        # (data chunks the block of the one axis splitting ``dim``: DTensor's strided shard, as FSDP2's over TP)
        data = StridedShard(dim, split_factor=factor) if factor > 1 else Shard(dim)
        width = -(-n // self.size) * (piece.numel() // max(1, n))
        return Layout(dim, lo, hi, (data, *placements[DATA_DIM + 1:]), width)

    def grad_layout(self, p: torch.Tensor) -> Layout | None:
        """The split of ``p``'s gradient over data: its optimizer state's (None: whole, all-reduced)."""
        if not isinstance(p, DTensor):
            return None
        piece = local_tensor(p)
        key = (piece.shape, tuple(p.placements))
        known = self._grad_layouts.get(p)
        if known is None or known[0] != key:
            known = self._grad_layouts[p] = (key, self.layout(p, piece, p.device_mesh.ndim))
        return known[1]

    @staticmethod
    def split_grad(p: DTensor, chunk: torch.Tensor, layout: Layout) -> DTensor:
        """``p``'s gradient as this data rank's ``chunk`` of it: a DTensor split over data."""
        return make_dtensor(chunk, p.device_mesh, layout.placements, p.shape)

    def pack(self, piece: torch.Tensor, layout: Layout, out: torch.Tensor, offset: int) -> None:
        """Writes chunk j of ``piece`` (a whole local gradient) into row j of ``out`` (data ranks x elements)
        from column ``offset``: the layout a reduce-scatter of ``out`` hands each rank its own chunk in."""
        n = piece.shape[layout.dim]
        if layout.dim == 0 and n % self.size == 0:  # every chunk full: one copy
            out[:, offset:offset + layout.width].copy_(piece.reshape(self.size, -1))
            return
        for j in range(self.size):
            lo, hi = chunk_rows(n, self.size, j)
            part = piece.narrow(layout.dim, lo, hi - lo)
            out[j, offset:offset + part.numel()].view(part.shape).copy_(part)
            out[j, offset + part.numel():offset + layout.width].zero_()  # (padding: summed, then dropped)

    @staticmethod
    def unpack(mine: torch.Tensor, offset: int, layout: Layout, piece_shape: Sequence[int]) -> torch.Tensor:
        """This rank's chunk, shaped (a view), out of its reduce-scatter result ``mine`` (its row of ``pack``'s)."""
        shape = list(piece_shape)
        shape[layout.dim] = layout.hi - layout.lo
        return mine[offset:offset + math.prod(shape)].view(shape)

    def gather(self, pieces: Sequence[tuple[torch.Tensor, Layout]]) -> None:
        """Every data rank's updated chunks into each local piece (in place): all-gathers in buckets."""
        bucket: list[tuple[torch.Tensor, Layout]] = []
        nbytes = 0
        for piece, layout in pieces:
            if bucket and (piece.dtype != bucket[0][0].dtype or piece.device != bucket[0][0].device
                           or nbytes + piece.numel() * piece.element_size() > C.BUCKET_BYTES):
                self._gather(bucket)
                bucket, nbytes = [], 0
            bucket.append((piece, layout))
            nbytes += piece.numel() * piece.element_size()
        if bucket:
            self._gather(bucket)

    def _gather(self, bucket: list[tuple[torch.Tensor, Layout]]) -> None:
        widths = [layout.width for _, layout in bucket]  # elements of one (padded) chunk of each piece
        total = sum(widths)
        send = bucket[0][0].new_zeros(total)
        offset = 0
        for (piece, layout), width in zip(bucket, widths):
            mine = layout.chunk(piece).reshape(-1)
            send[offset:offset + mine.numel()].copy_(mine)
            offset += width
        out = C.all_gather(send, self.group, self.size).view(self.size, total)
        offset = 0
        for (piece, layout), width in zip(bucket, widths):
            n = piece.shape[layout.dim]
            if layout.dim == 0 and n % self.size == 0:  # every chunk full: one copy
                piece.view(self.size, -1).copy_(out[:, offset:offset + width])
            else:
                for j in range(self.size):
                    lo, hi = chunk_rows(n, self.size, j)
                    if hi > lo:
                        part = piece.narrow(layout.dim, lo, hi - lo)
                        part.copy_(out[j, offset:offset + part.numel()].view(part.shape))
            offset += width


def split_over_data(value: torch.Tensor) -> bool:
    """Whether ``value`` (a gradient or optimizer state) is a DTensor split over data."""
    return isinstance(value, DTensor) and isinstance(value.placements[DATA_DIM], Shard | StridedShard)


def piece_of(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The local piece of parameter ``param``'s state (or gradient) ``value``, laid out as the parameter: gathered
    over data where the state is split there and the parameter is not (``shard_optimizer``; collective). A
    parameter split over data itself (experts, ``expert_parallel``) keeps its piece."""
    if split_over_data(value) and not split_over_data(param):
        return whole_piece(value)
    return local_tensor(value) if isinstance(value, DTensor) else value


def whole_grad(p: DTensor) -> DTensor:
    """``p``'s gradient, split over data, made whole: laid out as ``p`` (collective over the data ranks)."""
    return make_dtensor(whole_piece(p.grad), p.device_mesh, p.placements, p.shape)


def whole_piece(value: DTensor) -> torch.Tensor:
    """The local piece a data-sharded state DTensor ``value`` is a chunk of: its chunks all-gathered over
    data (collective over the data ranks). The split dim is split by no other axis, or evenly by one whose
    size is the data placement's split factor (``DataShards.layout``): the piece holds ``value.shape[dim]``
    rows over that factor."""
    mesh, placement = value.device_mesh, value.placements[DATA_DIM]
    dim, factor = placement.dim, getattr(placement, "split_factor", 1)
    size, n = mesh.size(DATA_DIM), value.shape[dim] // factor
    rows = -(-n // size)
    chunk = local_tensor(value).movedim(dim, 0)
    padded = chunk.new_zeros((rows, *chunk.shape[1:]))
    padded[:chunk.shape[0]].copy_(chunk)
    out = C.all_gather(padded, mesh.get_group(DATA_DIM), size)  # (size * rows, ...)
    parts = []
    for j in range(size):
        lo, hi = chunk_rows(n, size, j)
        parts.append(out[j * rows:j * rows + hi - lo])
    return torch.cat(parts).movedim(0, dim).contiguous()
