"""The only place that creates process groups: one DeviceMesh over (data, pipeline, depth, row, col)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.config import MESH_AXES, ParallelConfig
from autopar.errors import ConfigError, NotInitializedError


def device_for_backend() -> torch.device:
    """CUDA device of this rank under NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
        self._groups["batch"] = self._mesh["data", "depth"]._flatten("batch").get_group()
        self._stage_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def stage_group(self, stages: tuple[int, ...]) -> dist.ProcessGroup:
        """The ranks at pipeline coordinates ``stages`` that share this rank's other coordinates.

        Sums the gradients of a weight read by several pipeline stages (tied embeddings). Only the
        member ranks call this (local synchronization), in the same order on each.
        """
        if stages not in self._stage_groups:
            ranks = [self.config.rank_of({**self.coords, "pipeline": s}) for s in stages]
            self._stage_groups[stages] = dist.new_group(ranks, use_local_synchronization=True)
        return self._stage_groups[stages]

    def peer(self, pipeline_index: int) -> int:
        """The global rank at pipeline coordinate ``pipeline_index`` with this rank's other coordinates."""
        return self.config.rank_of({**self.coords, "pipeline": pipeline_index})

    def group(self, axis: str) -> dist.ProcessGroup | None:
        return self._groups[axis] if axis else None

    def size(self, axis: str) -> int:
        return self.config.num_batch_shards if axis == "batch" else self.config.size(axis)

    def index(self, axis: str) -> int:
        if not axis:
            return 0
        if axis == "batch":
            return self.config.batch_index(self.rank)
        return self.coords[axis]

    def grad_group(self, axes: tuple[str, ...]) -> tuple[str, int]:
        """The group that sums a gradient over ``axes``: only (data,) and (data, depth) occur."""
        if axes == ("data", "depth"):
            return "batch", self.size("batch")
        if axes == ("data",):
            return "data", self.size("data")
        raise ConfigError(f"no process group for gradient axes {axes}.")
