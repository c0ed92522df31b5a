"""State a model returns and is given back, kept split between calls (a key/value cache).

HF's ``generate`` feeds each step the cache the previous step returned. Gathering it whole at every
output costs a collective over the whole cache per layer and step, and the next call only slices it
again. So an evaluation graph returns its cache tensors as DTensors (the global shape, this rank's
heads as the local piece, on the parameters' mesh: ``GatherOutputSpec.keep_split``), and a call that
gets one of them back reads the local piece in place (``InputInfo.sharding``): decode runs no gather.

A DTensor from elsewhere (another mesh, or a placement autopar does not make) is made whole first.
Code that reads the cache sees a DTensor: ``.full_tensor()`` gives the whole tensor; HF's own cache
methods run on it (beam search's reordering under ``generating``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from autopar.capture import is_cache_type
from autopar.config import Layout
from autopar.runtime.mesh import Mesh
from passes.ir import Sharding


def kept_output(x: torch.Tensor, mesh: Mesh, sharding: Sharding) -> DTensor:
    """This rank's piece ``x`` of an output split as ``sharding``, as a DTensor of the whole."""
    device_mesh = mesh.param_mesh()
    placements = [Shard(sharding.dim) if axis == sharding.axis else Replicate() for axis in device_mesh.mesh_dim_names]
    return DTensor.from_local(x, device_mesh, placements, run_check=False)  # (an even split: kept_split)


def arrived_sharding(x: Any, mesh: Mesh) -> Sharding | None:
    """How an input that autopar returned split (``kept_output``) is laid out; None for anything else."""
    if not isinstance(x, DTensor) or x.device_mesh is not mesh.param_mesh():
        return None
    split = [(axis, p) for axis, p in zip(x.device_mesh.mesh_dim_names, x.placements, strict=True)
             if not isinstance(p, Replicate)]
    if len(split) != 1 or split[0][0] not in ("row", "col") or not isinstance(split[0][1], Shard):
        return None
    (axis, placement), = split
    dim = placement.dim % x.dim()
    if x.shape[dim] % mesh.size(axis):
        return None
    return Sharding(Layout(axis), dim, (int(x.shape[dim]),))


def arrived_inputs(leaves: list[Any], mesh: Mesh) -> tuple[list[Any], dict[int, Sharding]]:
    """The leaves with every DTensor autopar cannot take split made whole, and the split ones' layouts."""
    arrived, out = {}, []
    for i, x in enumerate(leaves):
        if isinstance(x, DTensor):
            s = arrived_sharding(x, mesh)
            if s is None:
                x = x.full_tensor()
            else:
                arrived[i] = s
        out.append(x)
    return out, arrived


def carry_cache(args: tuple, kwargs: dict, out: Any) -> Any:
    """Serial's in-place cache: HF's forward updates the cache object it is given and returns that object.
    autopar's graph returns a new one (built from its outputs); this moves its state into the object the
    caller passed (so ``model(x, past_key_values=cache)`` leaves ``cache`` filled, as serial) and returns
    that object in its place. Nothing when no single cache went in, or one of another type came out."""
    given = [v for v in (*args, *kwargs.values()) if is_cache_type(type(v))]
    if len(given) != 1 or not isinstance(out, dict):  # (HF's ModelOutput is a dict)
        return out
    cache = given[0]
    returned = [k for k, v in out.items() if is_cache_type(type(v))]
    if len(returned) != 1 or out[returned[0]] is cache or type(out[returned[0]]) is not type(cache):
        return out
    cache.__dict__.update(vars(out[returned[0]]))
    out[returned[0]] = cache
    return out


def whole(tree: Any) -> Any:
    """``tree`` with every DTensor made whole (for a call that runs the user's forward itself)."""
    return pytree.tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, tree)


@contextlib.contextmanager
def generating() -> Iterator[None]:
    """While ``generate`` runs: HF's cache methods may combine the DTensor cache with plain tensors that are
    the same on every rank (beam indices), which DTensor then treats as replicated."""
    with implicit_replication():
        yield


def wrap_generate(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``model.generate`` running under ``generating()``."""
    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with generating():
            return generate(*args, **kwargs)
    return wrapper
