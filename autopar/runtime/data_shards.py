"""Optimizer state sharded over data (``auto_parallelize(shard_optimizer=True)``, ZeRO stage 1).

Every data rank holds the same parameters and, after backward, the same summed gradients. Under
``shard_optimizer`` data rank i keeps the optimizer state of only chunk i of each parameter's local piece,
split along one dim (``layout``: dim 0 when no other mesh axis splits it, else the first dim none splits) as
``torch.chunk`` splits it, the way DTensor's ``Shard(dim)`` lays out an uneven split; it steps those elements
and the data ranks then all-gather the updated chunks (``gather``), in buckets of ``BUCKET_BYTES``. The state
is a DTensor with ``Shard(dim)`` on the data dim of the parameter's mesh, so ``optimizer.state_dict()``,
DCP and ``autopar.full_optimizer_state_dict`` see its global shape (the serial one) and which box each rank
holds, and a checkpoint loads at any grid, sharded or not.

A weight split on both of its dims (tensor row and col above 1) is cut along a dim one of them splits: each
data rank keeps an even chunk of that axis's block (``StridedShard`` on the data dim, as FSDP2 over a
tensor-parallel shard; ``passes.analysis.optimizer_shards`` has the rule). A parameter with neither (a
scalar; a block whose rows do not divide by data) keeps its whole state on every data rank, which all step
it alike. Gradients stay whole (an all-reduce, as DDP's): every idiom that reads them
(clipping, GradScaler's overflow check, logging) sees serial's values. The parameter all-gather adds
(data - 1) / data of the parameter bytes per step to the all-reduce's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.compat import StridedShard, local_tensor
from autopar.runtime import collectives as C
from autopar.runtime.grad_sync import BUCKET_BYTES
from autopar.runtime.mesh import Mesh
from passes.analysis.optimizer_shards import chunk_rows, state_split

DATA_DIM = 0
"""The data axis's dim in every parameter mesh (``param_layout.DIMS`` and ``TIED_DIMS`` start with it)."""


class Layout:
    """How one parameter's optimizer state is split over data: along ``dim`` of its local piece."""

    __slots__ = ("dim", "lo", "hi", "placements")

    def __init__(self, dim: int, lo: int, hi: int, placements: tuple[Placement, ...]) -> None:
        self.dim, self.lo, self.hi, self.placements = dim, lo, hi, placements

    def chunk(self, piece: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``piece`` (a view)."""
        return piece.narrow(self.dim, self.lo, self.hi - self.lo)


class DataShards:
    """The data group a store's optimizer state is split over."""

    def __init__(self, mesh: Mesh) -> None:
        self.group, self.size, self.index = mesh.group("data"), mesh.size("data"), mesh.index("data")

    def layout(self, p: torch.Tensor, piece: torch.Tensor, ndim: int) -> Layout | None:
        """The split of ``p``'s state (``piece``: its local tensor; ``ndim``: its mesh's dims, for a plain
        parameter the store's parameter mesh); None when its state stays whole."""
        placements = p.placements if isinstance(p, DTensor) else (Replicate(),) * ndim
        split: dict[int, tuple[int, ...]] = {}
        for mesh_dim, q in enumerate(placements):
            if isinstance(q, Shard | StridedShard) and p.device_mesh.size(mesh_dim) > 1:
                split[q.dim] = (*split.get(q.dim, ()), p.device_mesh.size(mesh_dim))
        cut = state_split(p.shape, split, self.size)
        if cut is None:
            return None
        dim, factor = cut
        lo, hi = chunk_rows(piece.shape[dim], self.size, self.index)
        # (data chunks the block of the one axis splitting ``dim``: DTensor's strided shard, as FSDP2's over TP)
        data = StridedShard(dim, split_factor=factor) if factor > 1 else Shard(dim)
        return Layout(dim, lo, hi, (data, *placements[DATA_DIM + 1:]))

    def gather(self, pieces: Sequence[tuple[torch.Tensor, Layout]]) -> None:
        """Every data rank's updated chunks into each local piece (in place): all-gathers in buckets."""
        bucket: list[tuple[torch.Tensor, Layout]] = []
        nbytes = 0
        for piece, layout in pieces:
            if bucket and (piece.dtype != bucket[0][0].dtype or piece.device != bucket[0][0].device
                           or nbytes + piece.numel() * piece.element_size() > BUCKET_BYTES):
                self._gather(bucket)
                bucket, nbytes = [], 0
            bucket.append((piece, layout))
            nbytes += piece.numel() * piece.element_size()
        if bucket:
            self._gather(bucket)

    def _gather(self, bucket: list[tuple[torch.Tensor, Layout]]) -> None:
        widths = []  # elements of one (padded) chunk of each piece
        for piece, layout in bucket:
            rows = -(-piece.shape[layout.dim] // self.size)
            widths.append(rows * (piece.numel() // max(1, piece.shape[layout.dim])))
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


def piece_of(value: torch.Tensor) -> torch.Tensor:
    """The local piece of a parameter's state ``value`` (gathered over data when split there, as parameters
    never are: collective)."""
    if isinstance(value, DTensor) and isinstance(value.placements[DATA_DIM], Shard | StridedShard):
        return whole_piece(value)
    return local_tensor(value) if isinstance(value, DTensor) else value


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
