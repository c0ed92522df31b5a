"""One parallel model's gradient syncs (``GradSyncs``): which of its parameters are summed over which process
group during backward, under a plan (one bucketed ``GradSync`` per group) or for the uncaptured model's
fallback (one over the data ranks), and what they hold (the compiled graph is cut by those bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from autopar import patches
from autopar.config import ParallelConfig
from autopar.decisions import Plan
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.data_parallel.grad_sync import GradSync
from autopar.runtime.params.data_shards import DataShards


class GradSyncs:
    """The gradient syncs of the model ``model`` (their hooks on its parameters are its patches: undone by
    ``autopar.detach``). ``enabled``: whether this backward sums (not inside ``no_sync()``)."""

    def __init__(self, model: nn.Module, enabled: Callable[[], bool]) -> None:
        self._installed = patches.of_model(model)
        self.enabled = enabled
        self.syncs: list[GradSync] = []

    def __iter__(self) -> Iterator[GradSync]:
        return iter(self.syncs)

    def add(self, sync: GradSync, axis: str) -> None:
        """Keeps a gradient sync; its hooks on the parameters are the model's patches (``autopar.patches``)."""
        self.syncs.append(sync)
        self._installed.add(f"gradient hooks ({axis})", sync.remove)

    def finish(self) -> None:
        """Waits for every sync's sums (before anything reads the gradients at the end of backward)."""
        for sync in self.syncs:
            sync.finish()

    def group(self, plan: Plan, params: dict[str, nn.Parameter], mesh: Mesh, config: ParallelConfig,
              reduce_dtype: torch.dtype | None, shards: DataShards | None) -> None:
        """The syncs ``plan`` asks for (pipeline = 1; a pipeline's stages sum their own, ``StageGrads``): each
        trainable parameter's gradient summed over the group of its plan's gradient axes, one bucketed sync per
        group, overlapped with backward. Under ``shard_optimizer`` (``shards``) a parameter split over data
        then summed over depth is reduce-scattered on the data group first."""
        synced: dict[str, dict[int, nn.Parameter]] = {}
        for pp in plan.params:
            p = params[pp.name]
            axis, size = mesh.grad_group(pp.grad_axes)
            if axis == "batch" and config.depth == 1:  # the same ranks
                axis = "data"
            if p.requires_grad and size > 1 and config.pipeline == 1:
                synced.setdefault(axis, {})[id(p)] = p
        # split over data, then summed over the rest of the group (depth; under context parallelism the context
        # ranks too): on the data group, each data rank's chunk then summed over the rest
        rests = {"batch": "depth", "replicas": "context+depth" if config.depth > 1 else "context",
                 "data+context": "context"}
        for axis, rest in rests.items():
            if shards is None or axis not in synced:
                continue
            split = {i: p for i, p in synced[axis].items() if shards.grad_layout(p) is not None}
            synced[axis] = {i: p for i, p in synced[axis].items() if i not in split}
            if split:
                self.add(GradSync(list(split.values()), mesh.group("data"), mesh.size("data"), reduce_dtype,
                                  enabled=self.enabled, shards=shards, rest=(mesh.group(rest), mesh.size(rest))),
                         f"data, then {rest}")
        for axis, group in synced.items():  # (shard_optimizer: each data rank keeps the sum of its chunk only)
            if group:
                self.add(GradSync(list(group.values()), mesh.group(axis), mesh.size(axis), reduce_dtype,
                                  enabled=self.enabled, shards=shards if axis == "data" else None), axis)

    def synced_bytes(self, plan: Plan | None, params: dict[str, nn.Parameter],
                     config: ParallelConfig) -> dict[str, int]:
        """The parameters whose gradients these syncs sum during backward, by name: the bytes of each one's
        gradient on a rank as the plan counts them (the same on every rank, a piece split unevenly counted at
        its largest)."""
        held = {id(p) for sync in self.syncs for p in sync.params}
        sizes = {pp.name: pp.local_numel(config) for pp in plan.params} if plan is not None else {}
        return {name: sizes[name] * p.element_size() for name, p in params.items() if id(p) in held and name in sizes}
