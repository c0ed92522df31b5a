"""Sharded tensors as ``torch.distributed.checkpoint`` sees them.

DCP describes a DTensor shard as one box (offset, size) of the global tensor. Most autopar layouts
are boxes; a fused weight whose pieces (q/k/v, gate/up) are each split over an axis is not: the rank
holds [q_r; k_r; v_r], three boxes (``_StridedShard``). DCP would refuse that DTensor (its global
plan validation finds the one-box claims overlapping). ``checkpointable`` gives such a DTensor a local
tensor that shares the same storage and implements DCP's ``_Checkpointable`` protocol with every box
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), so DCP writes and
reads each box where it belongs, at any grid. ``model.state_dict()`` (a post-hook) and the optimizer
state kept by ``autopar.runtime.optim`` hold such DTensors; computing on them is unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from autopar.runtime.mesh import ShardMesh
from autopar.runtime.parameters import Absent, local_indices, runs


class Boxes(torch.Tensor):
    """A local tensor (same storage, plain computation) that tells DCP the boxes it holds."""

    boxes: list[tuple[torch.Size, torch.Size, tuple[slice, ...]]]
    """(global offsets, sizes, the local slices holding them)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(local: torch.Tensor, boxes: list[tuple[torch.Size, torch.Size, tuple[slice, ...]]]) -> Boxes:
        out = local.as_subclass(Boxes)
        out.boxes = boxes
        return out

    def plain(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.plain())
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=props, size=obj.size()))
                for offsets, sizes, _ in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, _, where in self.boxes:
            if offsets == index.offset:
                return self.plain()[where]
        raise KeyError(f"no shard of {index.fqn!r} at offset {tuple(index.offset)} on this rank")


def boxes_of(t: DTensor) -> list[tuple[torch.Size, torch.Size, tuple[slice, ...]]]:
    """The boxes of the global tensor that this rank's piece of ``t`` holds (one when it is contiguous)."""
    coordinate = t.device_mesh.get_coordinate()
    per_dim = [runs(ix) for ix in local_indices(t.shape, t.device_mesh.shape, coordinate, t.placements)]
    out = []
    for combo in itertools.product(*per_dim):
        offsets = torch.Size(g for g, _, _ in combo)
        sizes = torch.Size(n for _, _, n in combo)
        out.append((offsets, sizes, tuple(slice(local, local + n) for _, local, n in combo)))
    return out


def checkpointable(t: Any) -> Any:
    """``t``, or when it is a DTensor on autopar's mesh whose piece is several boxes, the same DTensor (same
    storage) with a local tensor that describes every box to DCP."""
    if not isinstance(t, DTensor) or not isinstance(t.device_mesh, ShardMesh):
        return t
    local = t._local_tensor
    if isinstance(local, (Boxes, Absent)):
        return t
    boxes = boxes_of(t)
    if len(boxes) == 1:
        return t
    return DTensor(Boxes.of(local, boxes), t._spec, requires_grad=t.requires_grad)


def state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``model.state_dict()``: DTensors whose pieces are several boxes become DCP-checkpointable."""
    for key, value in state_dict.items():
        state_dict[key] = checkpointable(value)
