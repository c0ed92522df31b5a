"""The paths with no captured graph: the user's forward run whole on this rank.

``ParallelRuntime`` takes them when a model cannot be captured (data parallelism over all ranks, as
DDP: ``run_data_parallel``), for an evaluation call that cannot be captured (the whole batch on every
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
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.mesh import Mesh
from autopar.runtime.ops import gather_rows_world
from autopar.runtime.parameters import ParamStore
from autopar.runtime.param_layout import local_view

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


def data_parallel_sync(error: CaptureError, params: dict[str, nn.Parameter], rank: int, world: int,
                       enabled: Callable[[], bool]) -> GradSync | None:
    """The model cannot be captured: every rank runs it whole on its share of the batch (DDP). Warns, and
    returns the gradient sync over all ranks (None when there is nothing to sum)."""
    if rank == 0:
        log.warning("autopar: %s; falling back to data parallelism over all %d ranks (no tensor "
                    "parallelism for this model).", fallback_reason(error), world)
    unique = {id(p): p for p in params.values() if p.requires_grad}
    if world > 1 and unique:
        return GradSync(list(unique.values()), None, world, enabled=enabled)
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


def run_data_parallel(whole: Whole, model: nn.Module, mesh: Mesh, world: int, batch_dims: Any,
                      args: tuple, kwargs: dict) -> Any:
    """This rank's share of the batch through ``whole``; the outputs' rows gathered from every rank.
    ``batch_dims``: the inputs' declared batch dims (``InputConfig.batch_dims``)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    split, batch = batch_leaves(leaves, input_names(args, kwargs), batch_dims)
    if not split or batch < world:  # fewer rows than ranks: every rank runs them all (equal gradients)
        return whole(args, kwargs)
    flat = ParallelConfig(data=world)
    sizes = flat.batch_sizes(batch)
    start = sum(sizes[:mesh.rank])
    local = [x.narrow(split[i], start, sizes[mesh.rank]) if i in split else x for i, x in enumerate(leaves)]
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
    rows = sizes[mesh.rank]

    def gathered(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() and t.shape[0] == rows:
            return gather_rows_world(t, sizes)
        if t.requires_grad:  # a loss computed inside forward from this rank's rows only
            raise InputError(
                f"{type(model).__name__} could not be captured, so autopar runs it whole on each rank's "
                f"share of the global batch; it returned a tensor of shape {tuple(t.shape)} that is not one row per "
                "sample (a loss inside forward?), and autopar cannot tell how to combine the ranks' values. "
                "Compute the loss outside the model, or feed each rank its own batch (batch='per-rank') as "
                "under DDP.")
        return t

    return pytree.tree_map(gathered, out)


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
