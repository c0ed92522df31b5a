"""The paths with no captured graph: the user's forward run whole on this rank.

``ParallelRuntime`` takes them when a model cannot be captured (data parallelism over the data ranks, as
DDP, or the whole batch on every rank where data=1: ``run_data_parallel``), for an evaluation call that cannot be captured (the whole batch on every
rank: ``forward_local``), and for evaluation under data parallelism only (this rank's inputs, no
collective). ``forward_whole`` runs the user's forward on whole parameters: this rank's while they
are replicated, else gathered for the call.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopar.compat import pytree
from autopar.capture import batch_leaves, input_names
from autopar.config import ParallelConfig
from autopar.errors import CaptureError, InputError
from autopar.memory import half_dtype
from autopar.runtime.comm import collectives as C
from autopar.runtime.data_parallel.grad_sync import GradSync
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.params.store import ParamStore
from autopar.runtime.params.layout import local_view

log = logging.getLogger(__name__)

#: Runs the user's forward whole on (args, kwargs): ``forward_whole`` bound to one model.
Whole = Callable[[tuple, dict], Any]


def fallback_reason(error: CaptureError) -> str:
    """Why a capture failed, without the advice that follows it."""
    return str(error).split(". autopar needs")[0]


def say_eval_fallback(reason: str, gathers: bool, warned: set[Any], rank: int) -> None:
    """Warns (on rank 0, once per reason and cost) that an evaluation call runs the whole model on every rank.
    ``gathers``: the parameters are sharded under a plan, so the call gathers them whole."""
    cost = "gathers every parameter whole on every rank for the call" if gathers else "gets no tensor parallelism"
    if (reason, cost) not in warned and rank == 0:
        log.warning("autopar: %s; this evaluation call (and any with the same input shapes) runs the whole model "
                    "on every rank: each rank computes the whole batch, and it %s. Training calls are still "
                    "captured and parallelized.", reason, cost)
    warned.add((reason, cost))


def data_parallel_sync(error: CaptureError, params: dict[str, nn.Parameter], mesh: Mesh,
                       enabled: Callable[[], bool], per_rank: bool = False) -> GradSync | None:
    """The model cannot be captured: every rank runs it whole, on its data rank's share of the batch (DDP over
    the ``data`` ranks; the other axes' ranks hold copies), or with ``per_rank`` batches on its own batch (DDP
    over every rank, as the script that feeds them is written for). Warns, and returns the gradient sync
    (None when there is nothing to sum)."""
    ranks = mesh.config.world_size if per_rank else mesh.size("data")
    if mesh.rank == 0:
        if per_rank:
            how = f"each rank runs it whole on its own batch, as under DDP over all {ranks} ranks"
        elif ranks > 1:
            how = (f"falling back to data parallelism over the data={ranks} ranks, as DDP (the other "
                   f"{mesh.config.world_size // ranks} ranks of each hold copies)")
        else:
            how = f"every rank runs it whole on the whole batch (serial's numbers; {mesh.config.world_size} copies)"
        log.warning("autopar: %s; %s: no tensor or pipeline parallelism for this model.", fallback_reason(error), how)
    unique = {id(p): p for p in params.values() if p.requires_grad}
    if ranks > 1 and unique:
        return GradSync(list(unique.values()), None if per_rank else mesh.group("data"), ranks, enabled=enabled,
                        branches=True)
    return None


def forward_local(whole: Whole, precision: str, device: torch.device, args: tuple, kwargs: dict) -> Any:
    """The user's forward on this rank's inputs and whole parameters, under the precision's autocast
    (data parallelism, or an evaluation call that could not be captured)."""
    dtype = half_dtype(precision)
    if dtype is None:
        return whole(args, kwargs)
    with torch.autocast(device.type, dtype=dtype):
        out = whole(args, kwargs)
    return pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)


def run_data_parallel(whole: Whole, model: nn.Module, mesh: Mesh, batch_dims: Any, args: tuple,
                      kwargs: dict) -> Any:
    """The data rank's share of the batch through ``whole`` (with data=1, the whole batch: serial's numbers);
    outputs with one row per sample gathered from the data ranks, others (a loss inside forward) averaged
    over them with their gradients, as DDP averages its ranks' gradients. ``batch_dims``: the inputs'
    declared batch dims (``InputConfig.batch_dims``)."""
    data, index = mesh.size("data"), mesh.index("data")
    if data == 1:
        return whole(args, kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    split, batch = batch_leaves(leaves, input_names(args, kwargs), batch_dims)
    if not split or batch < data:  # fewer rows than data ranks: each computes them all, the gradient once
        return pytree.tree_map(lambda t: _Averaged.apply(t, None, data) if _grad_float(t) else t,
                               whole(args, kwargs))
    sizes = ParallelConfig(data=data).batch_sizes(batch)
    start = sum(sizes[:index])
    local = [x.narrow(split[i], start, sizes[index]) if i in split else x for i, x in enumerate(leaves)]
    local_args, local_kwargs = pytree.tree_unflatten(local, spec)
    try:
        out = whole(local_args, local_kwargs)
    except (RuntimeError, ValueError, IndexError) as e:
        names = input_names(args, kwargs)
        which = ", ".join(f"{names[i]!r} (dim {d}, shape {tuple(leaves[i].shape)})" for i, d in sorted(split.items()))
        raise InputError(
            f"{type(model).__name__} failed on this rank's share of the batch ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}). autopar split these inputs as the batch: {which}. If one of them holds "
            "no batch (its dim 0 only equals the batch size), declare it with auto_parallelize(batch_dims="
            "{input: None}); if the model needs whole batches, feed each rank its own (batch='per-rank').") from e
    rows = sizes[index]

    def gathered(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() and t.shape[0] == rows:
            return _GatheredRows.apply(t, mesh, sizes)
        if t.is_floating_point() or t.is_complex():  # a loss inside forward: the data ranks' mean (DDP's)
            return _Averaged.apply(t, mesh, data)
        return t

    return pytree.tree_map(gathered, out)


def _grad_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())


class _Averaged(torch.autograd.Function):
    """The data ranks' mean of a value each computed from its own rows (with ``mesh`` None: the same value on
    every data rank); backward gives each its share, the gradient over ``data`` (the gradient sync sums the
    data ranks' parameter gradients: DDP's average)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh | None, data: int) -> torch.Tensor:
        ctx.data = data
        if mesh is None:
            return x.view_as(x)
        return C.all_reduce(x.detach().clone(), mesh.group("data"), data) / data

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return dy / ctx.data, None, None


class _GatheredRows(torch.autograd.Function):
    """Every data rank's rows (dim 0) of its share of the batch, in order; backward keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, sizes: tuple[int, ...]) -> torch.Tensor:
        ctx.start, ctx.rows = sum(sizes[:mesh.index("data")]), x.shape[0]
        pad = max(sizes) - x.shape[0]
        padded = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x
        stacked = C.all_gather(padded.unsqueeze(0), mesh.group("data"), len(sizes))
        return torch.cat([stacked[i, :s] for i, s in enumerate(sizes)])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return dy.narrow(0, ctx.start, ctx.rows), None, None


class OwnForward:
    """The model's own forward, held without keeping the model alive (a method of it is bound at each call)."""

    def __init__(self, forward: Callable[..., Any], model: nn.Module) -> None:
        bound = getattr(forward, "__self__", None) is model
        self._func = forward.__func__ if bound else forward
        self._model = weakref.ref(model) if bound else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._model is None:
            return self._func(*args, **kwargs)
        return self._func(self._model(), *args, **kwargs)


def forward_whole(model: nn.Module, store: ParamStore, planned: bool, forward: Callable[..., Any],
                  args: tuple, kwargs: dict) -> Any:
    """The user's forward on a whole copy of the model: this rank's (parameters still replicated), or
    under a plan one gathered for the call (evaluation only; a collective). ``forward``: the model's
    own forward, called as it is while the parameters are replicated."""
    if not store.dtensors:
        return forward(*args, **kwargs)
    if planned:
        with torch.no_grad():
            views = store.full_state_dict(dict(store.params))
    else:
        views = {name: local_view(p) for name, p in store.params.items()}
    wrapper = model.__dict__.pop("forward", None)  # call the user's forward, not ours
    try:
        return torch.func.functional_call(model, views, args, kwargs, tie_weights=False)
    finally:
        if wrapper is not None:
            model.forward = wrapper
