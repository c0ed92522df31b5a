"""Sharded tensors as ``torch.distributed.checkpoint`` sees them.

DCP describes a DTensor shard as one box (offset, size) of the global tensor. Most autopar layouts
are boxes; a fused weight whose pieces (q/k/v, gate/up) are each split over an axis is not: the rank
holds [q_r; k_r; v_r], three boxes (``StridedShard``). DCP would refuse that DTensor (its global
plan validation finds the one-box claims overlapping). ``dcp_ready`` gives such a DTensor a local
tensor that shares the same storage and implements DCP's ``_Checkpointable`` protocol with every box
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), so DCP writes and
reads each box where it belongs, at any grid. ``model.state_dict()`` (a post-hook) and the optimizer
state kept by ``autopar.runtime.interop.optimizers`` hold such DTensors; computing on them is unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from autopar.compat import disabled_torch_function_impl, dtensor_spec, local_or_none, local_tensor
from autopar.errors import CheckpointError
from autopar.runtime.comm.mesh import ShardMesh
from autopar.runtime.params.absent import Absent
from autopar.runtime.params.data_shards import piece_of
from autopar.runtime.params.layout import local_indices, local_of, local_piece, make_dtensor, runs

SCALAR_STATE = frozenset({"step", "eta", "mu"})
"""Optimizer state entries that are scalars whatever the parameter's shape (torch.optim's ``step``, ASGD's)."""


class Boxes(torch.Tensor):
    """A local tensor (same storage, plain computation) that tells DCP the boxes it holds."""

    boxes: list[tuple[torch.Size, torch.Size, tuple[slice, ...]]]
    """(global offsets, sizes, the local slices holding them)."""

    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    def of(local: torch.Tensor, boxes: list[tuple[torch.Size, torch.Size, tuple[slice, ...]]]) -> Boxes:
        out = local.as_subclass(Boxes)
        out.boxes = boxes
        return out

    def plain(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def __deepcopy__(self, memo: dict) -> Boxes:  # copy.deepcopy(model.state_dict()): a snapshot in memory
        if id(self) not in memo:
            memo[id(self)] = Boxes.of(self.plain().clone(), self.boxes)
        return memo[id(self)]

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


def dcp_ready(t: Any) -> Any:
    """``t``, or when it is a DTensor on autopar's mesh whose piece is several boxes, the same DTensor (same
    storage) with a local tensor that describes every box to DCP."""
    if not isinstance(t, DTensor) or not isinstance(t.device_mesh, ShardMesh):
        return t
    local = local_tensor(t)
    if isinstance(local, (Boxes, Absent)):
        return t
    boxes = boxes_of(t)
    if len(boxes) == 1:
        return t
    return DTensor(Boxes.of(local, boxes), dtensor_spec(t), requires_grad=t.requires_grad)


def host_copy(state: Any) -> Any:
    """A copy of a state dict (nested dicts and lists) in host memory, each DTensor still describing its boxes to
    DCP (torch's own staging for ``async_save`` copies a DTensor's local tensor as one box: a fused piece's
    boxes would be written as overlapping ones). Pieces this rank does not hold (``Absent``) stay as they are."""
    if isinstance(state, dict):
        return {k: host_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(host_copy(v) for v in state)
    if isinstance(state, DTensor):
        local = local_tensor(state)
        if isinstance(local, Absent):
            return state
        copy = (local.plain() if isinstance(local, Boxes) else local).detach().to("cpu", copy=True)
        if isinstance(local, Boxes):
            copy = Boxes.of(copy, local.boxes)
        return DTensor(copy, dtensor_spec(state), requires_grad=False)
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return state


def state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``model.state_dict()``: DTensors whose pieces are several boxes made ready for DCP."""
    for key, value in state_dict.items():
        state_dict[key] = dcp_ready(value)


# ---- the optimizer's state in the serial format ------------------------------------------------------


def _names(store: Any) -> dict[int, str]:
    """id(parameter) -> its first name (the one torch's state-dict helpers key it by)."""
    out: dict[int, str] = {}
    for name, p in store.params.items():
        out.setdefault(id(p), name)
    return out


def full_optimizer_state(store: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state as torch's ``get_optimizer_state_dict(..., full_state_dict=True)`` formats
    it, keyed by parameter names, with full (serial) tensors, on every rank; pipeline ranks receive the
    state of parameters other stages hold. Collective: every rank calls it."""
    names, plans = _names(store), store.by_param()
    mesh, config = store.mesh, store.config
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names.get(id(p), "") for p in group["params"]]})
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError("the optimizer holds a tensor that is not a parameter of this model; "
                                      "autopar.full_optimizer_state_dict needs an optimizer over model.parameters().")
            pp = plans.get(id(p))
            mine = optimizer.state.get(p, {})
            held = not isinstance(local_or_none(p), Absent)
            keys = {k: ("layout" if _laid_out_like(v, p) else v) for k, v in mine.items()} if held else None
            if config.pipeline > 1 and pp is not None and pp.name in store.readers:
                box = [keys]
                src = mesh.peer(store.readers[pp.name][0])
                dist.broadcast_object_list(box, src=src, group=mesh.group("pipeline"), device=mesh.device)
                keys = box[0]
            if not keys:
                continue
            entry = {}
            for k, v in keys.items():
                if isinstance(v, str) and v == "layout":
                    local = piece_of(mine[k], p) if held and k in mine else None
                    entry[k] = local.clone() if pp is None else store.full(local, pp)
                else:
                    entry[k] = v.clone() if isinstance(v, torch.Tensor) else v
            state[names[id(p)]] = entry
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(store: Any, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """Loads a serial-format optimizer state (``full_optimizer_state``'s, or torch's full one) into
    ``optimizer``: every rank keeps its pieces. No communication."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise CheckpointError("expected a serial-format optimizer state: {'state': {name: {...}}, 'param_groups': "
                              "[...]} (autopar.full_optimizer_state_dict or torch's get_optimizer_state_dict with "
                              "full_state_dict=True).")
    names, plans = _names(store), store.by_param()
    if len(osd["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"the saved optimizer state has {len(osd['param_groups'])} parameter groups; this "
                              f"optimizer has {len(optimizer.param_groups)}. Build the optimizer as the saved run did.")
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for saved, group in zip(osd["param_groups"], optimizer.param_groups):
        ids = []
        for p in group["params"]:
            name = names.get(id(p))
            entry = osd["state"].get(name)
            if entry is not None:
                state[index] = {k: _local_state(store, name, k, v, p, plans.get(id(p))) for k, v in entry.items()}
            ids.append(index)
            index += 1
        if len(saved["params"]) != len(ids):
            raise CheckpointError(f"a saved parameter group holds {len(saved['params'])} parameters; this "
                                  f"optimizer's holds {len(ids)}. Build the optimizer as the saved run did.")
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def relayout_state(store: Any, optimizer: torch.optim.Optimizer, p: DTensor) -> None:
    """Optimizer state of ``p`` that is still whole (loaded or created before the first call sharded ``p``)
    becomes this rank's piece, laid out like ``p``. No communication."""
    state = optimizer.state.get(p)
    if not state:
        return
    local = local_tensor(p)
    for key, value in state.items():
        whole = local_or_none(value)  # checked first: this runs for every state at every step
        if (whole is not None and whole.dim() > 0 and whole.shape != local.shape and tuple(whole.shape) == tuple(p.shape)
                and all(isinstance(x, Replicate) for x in value.placements)):
            name = _names(store)[id(p)]
            state[key] = _local_state(store, name, key, local_tensor(value), p, store.by_param().get(id(p)))


def _laid_out_like(value: Any, p: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(p.shape)


def _local_state(store: Any, name: str, key: str, value: Any, p: torch.Tensor, pp: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or key in SCALAR_STATE:
        return value
    if tuple(value.shape) != tuple(p.shape):
        raise CheckpointError(f"optimizer state {name!r}[{key!r}] has shape {tuple(value.shape)}; parameter {name!r} "
                              f"has the serial shape {tuple(p.shape)}. Load the optimizer state saved with this model.")
    if not isinstance(p, DTensor):
        return value.to(p.device)
    local = local_tensor(p)
    if isinstance(local, Absent):
        piece = Absent(local.shape, value.dtype, p.device, local.param_name, local.holders)
    else:
        piece = (value if pp is None else local_piece(value, pp, store.mesh)).to(p.device).clone()
    return dcp_ready(make_dtensor(piece, p.device_mesh, p.placements, p.shape))
