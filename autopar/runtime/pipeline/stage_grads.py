"""Gradients under a pipeline: the plain leaves the stages read, and the step's gradients into ``p.grad``.

A step's micro-batches accumulate their gradients into a plain leaf that shares the parameter's local
piece (at plain-tensor cost: a DTensor ``.grad`` would add through DTensor's dispatch at every micro-batch,
~5% of FC_Net's ``p4`` step); ``finish`` then runs the script's tensor hooks on each step gradient (autograd
never runs them: the stages do not read the parameter), sums it over data (x depth) and tied weights' over
the stages holding them, and adds it to ``p.grad`` once. The sums go in buckets of up to ``BUCKET_BYTES``, one
collective per bucket, as ``GradSync``'s (not overlapped: a pipeline's step ends with its last micro-batch's
backward). Under ``shard_optimizer`` the sum over data is a reduce-scatter (``autopar.runtime.params.data_shards``):
``p.grad`` holds this data rank's chunk.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.compat import dtensor_spec, tensor_hooks
from autopar.config import ParallelConfig
from autopar.decisions import Plan
from autopar.runtime.comm import collectives as C
from autopar.runtime.params.absent import Absent
from autopar.runtime.params.data_shards import DataShards, Layout, split_over_data
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.params.layout import local_of, local_view, make_dtensor
from autopar.runtime.pipeline.stages import owner


class StageGrads:
    def __init__(self) -> None:
        self.leaves: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        """id(parameter) -> (parameter, the plain leaf the stages read)."""
        self.unsynced: set[int] = set()
        """Parameters whose ``.grad`` holds gradients a no_sync step kept local."""
        self.carried: dict[int, torch.Tensor] = {}
        """Of those, what ``.grad`` held before (a sum already, kept once: not summed again)."""

    def leaf(self, p: nn.Parameter) -> torch.Tensor:
        """What the stages read for ``p``: a plain leaf sharing its local piece's storage. It lives until its
        parameter's local tensor is replaced, so calls without backward and several forwards before one
        backward share it."""
        local = local_of(p)
        if not isinstance(p, DTensor) or isinstance(local, Absent) or not torch.is_grad_enabled():
            return local_view(p)
        held = self.leaves.get(id(p))
        if held is None or held[1].data_ptr() != local.data_ptr() or held[1].shape != local.shape:
            held = self.leaves[id(p)] = (p, local.detach().requires_grad_(p.requires_grad))
        return held[1]

    def finish(self, plan: Plan, params: Mapping[str, nn.Parameter], mesh: Mesh, config: ParallelConfig,
               reduce: torch.dtype | None, sync: bool, shards: DataShards | None = None) -> bool:
        """This step's gradients (what the leaves gathered) summed over data (x depth) when ``sync`` (else
        kept local, as no_sync does, and reduced at the next synchronized step), tied weights' summed over
        the stages holding them, then added to ``p.grad`` (which may hold earlier steps' gradients:
        accumulation). With ``shards`` (``shard_optimizer``) a gradient whose optimizer state is split over
        data is reduce-scattered there: ``p.grad`` holds this data rank's chunk of the sum, split over data.
        Returns whether they were synchronized."""
        new: dict[int, torch.Tensor] = {}
        for p, leaf in self.leaves.values():
            if leaf.grad is not None:
                new[id(p)], leaf.grad = _hooked(p, leaf.grad), None
        layouts = {id(p): layout for p, _ in self.leaves.values() if id(p) in new and shards is not None
                   for layout in [shards.grad_layout(p)] if layout is not None}
        if not sync:
            for p, _ in self.leaves.values():
                if id(p) in new:
                    if id(p) not in self.unsynced and p.grad is not None:  # a sum already: kept once
                        earlier = local_of(p.grad).detach()
                        if id(p) in layouts:  # (its chunk: whole local gradients go in p.grad until the sum)
                            self.carried[id(p)] = earlier if split_over_data(p.grad) \
                                else layouts[id(p)].chunk(earlier).clone()
                            p.grad = None
                        else:
                            self.carried[id(p)] = earlier.clone()
                    self.unsynced.add(id(p))
                    _add_grad(p, new[id(p)])
            return False
        replace = set()
        for p, _ in self.leaves.values():
            if id(p) in self.unsynced and p.grad is not None and id(p) in new:
                new[id(p)] = new[id(p)] + local_of(p.grad)
                if id(p) in self.carried and id(p) not in layouts:  # (an earlier sum does not travel)
                    new[id(p)] = new[id(p)] - self.carried[id(p)]
                replace.add(id(p))
        self.unsynced.clear()
        done: set[int] = set()
        groups: dict[tuple[bool, str, torch.dtype], list[nn.Parameter]] = {}  # (scattered, axis, dtype): in plan order
        for pp in plan.params:
            p = params[pp.name]
            if id(p) in done or id(p) not in new:
                continue
            done.add(id(p))
            axis, size = mesh.grad_group(pp.grad_axes)
            if id(p) in layouts or size > 1:
                groups.setdefault((id(p) in layouts, axis, reduce or new[id(p)].dtype), []).append(p)
        for (scattered, axis, dtype), synced in groups.items():  # one collective per bucket, as GradSync's
            for bucket in _buckets(synced, new):
                if scattered:
                    _scatter_grads(mesh, shards, [layouts[id(p)] for p in bucket], axis, dtype, bucket, new)
                else:
                    _sync_grads(mesh, axis, dtype, bucket, new)
        for name, stages in plan.pipeline.shared:
            ranks = tuple(sorted({owner(s, config.pipeline) for s in stages}))
            p = params[name]
            if len(ranks) < 2 or mesh.index("pipeline") not in ranks or id(p) not in new:
                continue
            new[id(p)] = C.all_reduce(new[id(p)].contiguous(), mesh.stage_group(ranks), len(ranks))
        for p, _ in self.leaves.values():
            grad = new.get(id(p))
            if grad is not None:
                if id(p) in replace:
                    p.grad = None
                    carried = self.carried.get(id(p))
                    grad = grad if carried is None else grad + carried
                if id(p) in layouts and p.grad is None:
                    p.grad = shards.split_grad(p, grad, layouts[id(p)])
                else:
                    _add_grad(p, grad)
        self.carried.clear()
        return True


def _hooked(p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """This step's local gradient of ``p`` through the script's tensor hooks on ``p``
    (``p.register_hook``), which autograd never runs there (the stages read a plain leaf, ``StageGrads.leaf``):
    once per step, on the gradient in ``p``'s own form, before it is summed over data, as DDP runs them."""
    hooks = tensor_hooks(p)
    if not hooks:
        return grad
    whole = make_dtensor(grad, p.device_mesh, p.placements, p.shape) if isinstance(p, DTensor) else grad
    for hook in list(hooks.values()):
        out = hook(whole)
        whole = whole if out is None else out
    return local_of(whole)


def _add_grad(p: nn.Parameter, local: torch.Tensor) -> None:
    """Adds ``local`` (this rank's piece) to ``p.grad``, making it when there is none."""
    if p.grad is None:
        p.grad = DTensor(local, dtensor_spec(p), requires_grad=False) if isinstance(p, DTensor) else local
    else:
        local_of(p.grad).add_(local)


def _buckets(synced: list[nn.Parameter], new: dict[int, torch.Tensor]) -> list[list[nn.Parameter]]:
    """``synced`` in runs of up to ``BUCKET_BYTES`` of gradient (one parameter alone where it is larger)."""
    out: list[list[nn.Parameter]] = []
    nbytes = 0
    for p in synced:
        size = new[id(p)].numel() * new[id(p)].element_size()
        if not out or nbytes + size > C.BUCKET_BYTES:
            out.append([])
            nbytes = 0
        out[-1].append(p)
        nbytes += size
    return out


def _scatter_grads(mesh: Mesh, shards: DataShards, layouts: list[Layout], axis: str, dtype: torch.dtype,
                   bucket: list[nn.Parameter], new: dict[int, torch.Tensor]) -> None:
    """Each gradient in ``new`` of ``bucket`` becomes this data rank's chunk of its sum over data (one
    reduce-scatter), then over depth where ``axis`` spans it too (one all-reduce)."""
    offsets = [0]
    for layout in layouts:
        offsets.append(offsets[-1] + layout.width)
    first = new[id(bucket[0])]
    rows = torch.empty((shards.size, offsets[-1]), dtype=dtype, device=first.device)
    for p, layout, offset in zip(bucket, layouts, offsets):
        shards.pack(new[id(p)], layout, rows, offset)
    mine = C.reduce_scatter(rows.view(-1), shards.group, shards.size)
    if axis == "batch" and mesh.size("depth") > 1:
        mine = C.all_reduce(mine, mesh.group("depth"), mesh.size("depth"))
    for p, layout, offset in zip(bucket, layouts, offsets):
        grad = new[id(p)]
        new[id(p)] = shards.unpack(mine, offset, layout, grad.shape).to(grad.dtype)


def _sync_grads(mesh: Mesh, axis: str, dtype: torch.dtype, bucket: list[nn.Parameter],
                new: dict[int, torch.Tensor]) -> None:
    """Each gradient in ``new`` of ``bucket`` summed over ``axis`` (one all-reduce of their concatenation)."""
    flat = torch.cat([new[id(p)].reshape(-1).to(dtype) for p in bucket])  # (its own memory: autograd's buffers
    flat = C.all_reduce(flat, mesh.group(axis), mesh.size(axis))          # may have other consumers)
    offset = 0
    for p in bucket:
        grad = new[id(p)]
        new[id(p)] = flat[offset:offset + grad.numel()].view(grad.shape).to(grad.dtype)
        offset += grad.numel()
