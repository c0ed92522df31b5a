"""The only place that creates process groups: one DeviceMesh over (data, pipeline, depth, row, col), and the
gloo groups for host-side exchanges and background saves."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.compat import flatten_mesh, group_timeout
from autopar.config import MESH_AXES, ParallelConfig
from autopar.errors import CheckpointError, ConfigError, NotInitializedError
from autopar.runtime.comm.collectives import simulated


def device_for_backend() -> torch.device:
    """CUDA device of this rank under NCCL (or a simulated world on a machine with CUDA), else CPU."""
    if dist.get_backend() == "nccl" or (simulated() and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_saves: list[dist.ProcessGroup] = []
_warned_store: list[bool] = []


def save_group() -> dist.ProcessGroup:
    """A gloo group of the whole world for DCP's background saves (``autopar.checkpoints``), made at the first
    asynchronous save, which every rank makes: their collectives never interleave with the training's."""
    if not _saves:
        _saves.append(dist.new_group(backend="gloo", timeout=group_timeout()))
    return _saves[0]


def shared_store_trap() -> str | None:
    """The warning for torchrun's shared store under gloo with restarts (None where it does not apply): the
    restarted ranks read the previous attempt's addresses and cannot connect (pytorch/pytorch#135712)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.get_backend() != "gloo":
        return None
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1 or _warned_store:
        return None
    _warned_store.append(True)
    return ("torchrun shares its rendezvous store with the ranks, and with gloo a restarted attempt cannot connect "
            "(it reads the previous attempt's addresses: pytorch/pytorch#135712). Launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ... so that a restart resumes (docs/guide/operators.md).")


class Mesh:
    """This rank's place in the grid and a process group per mesh axis.

    ``group("batch")`` is data x depth flattened: the ranks that compute different slices of the
    batch with the same weight blocks. A group's rank order is the coordinate order on its axes, so
    ``index(axis)`` is this rank's position in ``group(axis)``.
    """

    def __init__(self, config: ParallelConfig) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise NotInitializedError(
                "torch.distributed is not initialized. Launch with torchrun, or call "
                "torch.distributed.init_process_group() before auto_parallelize().")
        world = dist.get_world_size()
        if world != config.world_size:
            raise ConfigError(f"world size {world} does not match {config} ({config.world_size} ranks).")
        self.config = config
        self.rank = dist.get_rank()
        self.coords = config.coords(self.rank)
        self.device = device_for_backend()
        self._mesh = init_device_mesh(self.device.type, config.mesh_shape, mesh_dim_names=MESH_AXES)
        self._groups = {axis: self._mesh.get_group(axis) for axis in MESH_AXES}
        self._groups["batch"] = flatten_mesh(self._mesh["data", "depth"], "batch").get_group()
        if config.context > 1:  # the ranks with this rank's weights: a gradient is summed over all of them
            self._groups["replicas"] = flatten_mesh(self._mesh["data", "context", "depth"], "replicas").get_group()
            if config.depth > 1:  # (a weight split over depth: the same piece on data x context)
                self._groups["data+context"] = flatten_mesh(self._mesh["data", "context"], "data_context").get_group()
                # (shard_optimizer: a data rank's chunk of a gradient, summed over the rest of its replicas)
                self._groups["context+depth"] = flatten_mesh(self._mesh["context", "depth"], "context_depth").get_group()
        if "+" in config.expert_axis:  # whole experts over data x a tensor axis ("data+row": rank order d * row + r)
            axes = tuple(config.expert_axis.split("+"))
            self._groups[config.expert_axis] = flatten_mesh(self._mesh[axes], "experts").get_group()
        self._stage_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._param_meshes: dict[tuple[int, ...], DeviceMesh] = {}
        self.simulated = simulated()
        self.timeout = group_timeout()
        """The script's ``init_process_group(timeout=)``: every group autopar makes takes it (torch's default
        would be 30 minutes on each of them, whatever the script asked)."""
        self.control = None if self.simulated else dist.new_group(backend="gloo", timeout=self.timeout)
        """A gloo group of the whole world for small host-side exchanges (autopar.runtime.execution.call_check); None
        in a simulated world (the fake backend builds no gloo group, and there is no one to agree with)."""
        if self.timeout is not None:  # (init_device_mesh takes none: set on its groups, torch's public way)
            for group in {id(g): g for g in self._groups.values()}.values():
                group.set_timeout(self.timeout)
        self._shard: dist.ProcessGroup | None = None
        trap = None if self.simulated else shared_store_trap()
        if trap is not None and self.rank == 0:
            logging.getLogger("autopar").warning("autopar: %s", trap)

    def param_mesh(self, holders: tuple[int, ...] = ()) -> DeviceMesh:
        """The DeviceMesh a parameter's DTensor lives on (one object per holder set, made once).

        ``()``: (data, context, depth, row, col) at this rank's pipeline coordinate. ``holders``: the pipeline
        coordinates holding a weight several stages read (tied embeddings), this rank among them:
        (data, pipeline, depth, row, col) over those coordinates, built from ``stage_group`` (only the
        holders call this, in the same order). Built from the existing groups: no new process group
        is created for the axes, and the mesh refuses to be pickled (``ShardMesh``).
        """
        if holders not in self._param_meshes:
            ranks = self._mesh.mesh[:, list(holders)] if holders else self._mesh.mesh[:, self.coords["pipeline"]]
            axes = ("data", "pipeline", "context", "depth", "row", "col") if holders else ("data", "context", "depth",
                                                                                          "row", "col")
            groups = [self.stage_group(holders) if a == "pipeline" else self._groups[a] for a in axes]
            mesh = DeviceMesh.from_group(groups, self.device.type, mesh=ranks, mesh_dim_names=axes)
            mesh.__class__ = ShardMesh
            self._param_meshes[holders] = mesh
        return self._param_meshes[holders]

    def stage_group(self, stages: tuple[int, ...]) -> dist.ProcessGroup:
        """The ranks at pipeline coordinates ``stages`` that share this rank's other coordinates.

        Sums the gradients of a weight read by several pipeline stages (tied embeddings). Only the
        member ranks call this (local synchronization), in the same order on each.
        """
        if stages not in self._stage_groups:
            ranks = [self.config.rank_of({**self.coords, "pipeline": s}) for s in stages]
            self._stage_groups[stages] = dist.new_group(ranks, use_local_synchronization=True, timeout=self.timeout)
        return self._stage_groups[stages]

    def shard_members(self) -> list[int]:
        """The ranks holding this rank's batch shard (its data and depth coordinates): pipeline x row x col,
        in rank order. Under per-rank batches they pool their rows."""
        c = self.coords
        return [r for r in range(self.config.world_size)
                if self.config.coords(r)["data"] == c["data"] and self.config.coords(r)["depth"] == c["depth"]]

    def graph_peers(self, per_rank: bool) -> tuple[int, ...]:
        """The ranks that run this rank's compiled graphs at the same calls, with the same sizes: those at its
        pipeline coordinate; under per-rank batches (each batch shard its own sizes) those of them that hold
        its batch shard. They agree on each compile (``autopar.runtime.compiled.agreement``)."""
        c = self.coords
        same = ("pipeline", "data", "depth") if per_rank else ("pipeline",)
        return tuple(r for r in range(self.config.world_size)
                     if all(self.config.coords(r)[a] == c[a] for a in same))

    def shard_group(self) -> dist.ProcessGroup:
        """The group of ``shard_members``; made at its first use, which every rank reaches together."""
        if self._shard is None:
            shards: dict[tuple[int, int], list[int]] = {}
            for r in range(self.config.world_size):
                c = self.config.coords(r)
                shards.setdefault((c["data"], c["depth"]), []).append(r)
            self._shard, _ = dist.new_subgroups_by_enumeration(list(shards.values()), timeout=self.timeout)
        return self._shard

    def peer(self, pipeline_index: int) -> int:
        """The global rank at pipeline coordinate ``pipeline_index`` with this rank's other coordinates."""
        return self.config.rank_of({**self.coords, "pipeline": pipeline_index})

    def group(self, axis: str) -> dist.ProcessGroup | None:
        return self._groups[axis] if axis else None

    def size(self, axis: str) -> int:
        if axis == "replicas":
            return self.config.num_batch_shards * self.config.context
        return self.config.num_batch_shards if axis == "batch" else self.config.size(axis)

    def index(self, axis: str) -> int:
        if not axis:
            return 0
        if axis == "batch":
            return self.config.batch_index(self.rank)
        if "+" in axis:  # (axes flattened outermost first, as the group's rank order)
            index = 0
            for a in axis.split("+"):
                index = index * self.size(a) + self.coords[a]
            return index
        return self.coords[axis]

    def grad_group(self, axes: tuple[str, ...]) -> tuple[str, int]:
        """The group that sums a gradient over ``axes``: (data,), (data, depth), or (depth,) for experts split over
        data (each expert's gradient is complete over the data ranks' rows already), widened over the context
        ranks under context parallelism (``ParallelConfig.grad_axes``): "replicas" (data x context x depth, or
        data x context without depth), "data+context" for a weight split over depth, "context" or
        "context+depth" for experts split over data."""
        axes = self.config.grad_axes(axes)
        if self.config.context > 1:
            if axes == ("data", "context", "depth") or (axes == ("data", "context") and self.config.depth == 1):
                return "replicas", self.size("replicas")
            if axes == ("context", "depth") and self.config.depth == 1:
                return "context", self.size("context")
            if axes in (("data", "context"), ("context", "depth")):
                name = "+".join(axes)
                return name, self.size(name)
        if axes == ("depth",):
            return "depth", self.size("depth")
        if axes == ("data", "depth"):
            return "batch", self.size("batch")
        if axes == ("data",):
            return "data", self.size("data")
        raise ConfigError(f"no process group for gradient axes {axes}.")


WAYS_TO_SAVE = (
    "Save a sharded checkpoint with torch.distributed.checkpoint on every rank (dcp.save(model.state_dict()) or "
    "dcp.save(get_state_dict(model, optimizer)); it loads at any grid), or one file in the serial format with "
    "sd = autopar.full_state_dict(model) and osd = autopar.full_optimizer_state_dict(model, optimizer) on every "
    "rank, then torch.save on rank 0.")
"""What every error about pickling one rank's pieces ends with."""


class ShardMesh(DeviceMesh):
    """The DeviceMesh of autopar's sharded parameters, gradients and optimizer state.

    A DTensor on it holds one rank's piece. Pickling one (``torch.save`` of ``model.state_dict()`` or
    ``optimizer.state_dict()``, as single-file scripts do from rank 0) would keep that piece only, so
    it raises ``CheckpointError`` at once, naming the ways that keep every piece.
    """

    def __reduce_ex__(self, protocol: object) -> object:
        raise CheckpointError(
            "torch.save (or pickle) of a tensor that holds this rank's shard of an autopar model's parameters, "
            f"gradients or optimizer state: saved from one rank, the other ranks' pieces would be lost. {WAYS_TO_SAVE}")

    def __deepcopy__(self, memo: dict) -> ShardMesh:
        return self  # one mesh per process: copies of a model's tensors share it
