"""State a model returns and is given back, kept split between calls (a key/value cache).

HF's ``generate`` feeds each step the cache the previous step returned. Gathering it whole at every
output costs a collective over the whole cache per layer and step, and the next call only slices it
again. So an evaluation graph returns its cache tensors as DTensors (the global shape; the local piece
is this rank's heads, and its batch rows when data or depth split the batch evenly; on the parameters'
mesh: ``GatherOutputSpec.keep_split``), and a call that gets one of them back reads the local piece in
place (``InputInfo.sharding`` for the heads, its rows as the call's batch split): decode runs no gather.

A DTensor from elsewhere (another mesh, or a placement autopar does not make) is made whole first.
Code that reads the cache sees a DTensor: ``.full_tensor()`` gives the whole tensor; HF's own cache
methods run on it (beam search's reordering under ``generating``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from autopar.compat import local_tensor, pytree
from autopar.hf_caches import is_cache_type
from autopar.decisions import Layout
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.ops.rows import keeps
from passes.ir import Sharding


BATCH_AXES = ("data", "depth")
"""The parameter mesh's axes that split the batch (in this order: the batch index, ParallelConfig.batch_index)."""


@dataclass(frozen=True)
class Arrived:
    """How an input that autopar returned split (``kept_output``) is laid out on this rank."""

    sharding: Sharding | None
    """Its split heads (features) over row or col; None: whole over the tensor axes."""
    batch_dim: int | None
    """The dim holding this rank's batch rows (an even split over data x depth); None: every row."""


def kept_output(x: torch.Tensor, mesh: Mesh, sharding: Sharding, batch_dim: int | None = None) -> DTensor:
    """This rank's piece ``x`` of an output split as ``sharding`` (and, with ``batch_dim``, holding this rank's
    rows of a batch split evenly over data x depth), as a DTensor of the whole."""
    device_mesh = mesh.param_mesh()

    def place(axis: str) -> Shard | Replicate:
        if batch_dim is not None and axis in BATCH_AXES:
            return Shard(batch_dim)  # (nested left to right: the rank's chunk is its batch index)
        return Shard(sharding.dim) if axis == sharding.axis else Replicate()

    placements = [place(axis) for axis in device_mesh.mesh_dim_names]
    return DTensor.from_local(x, device_mesh, placements, run_check=False)  # (even splits: kept_split)


class KeptOutputs:
    """The outputs a graph keeps split, made DTensors after it ran. The graph returns their local pieces
    (``ops.GatherOutputOp``): a graph under ``torch.compile`` or replayed as a CUDA graph then holds no
    DTensor (dynamo does not trace ``DTensor.from_local`` on autopar's mesh). A piece that is the tensor
    the last call returned (a decode step's cache, written in place) gets that call's DTensor back, not a
    new one per layer and step."""

    def __init__(self, specs: list[Any], mesh: Mesh) -> None:
        self.specs = {i: s for i, s in enumerate(specs) if getattr(s, "keep_split", False)}
        self.mesh = mesh
        self.last: dict[int, tuple[weakref.ref, weakref.ref, torch.Size]] = {}
        """Per output: (the DTensor's local tensor, the DTensor, that tensor's shape) of the last call."""

    def __bool__(self) -> bool:
        return bool(self.specs)

    def __call__(self, out: list[Any], sizes: tuple[int, ...]) -> list[Any]:
        for i, spec in self.specs.items():
            x = out[i]
            if not keeps(spec, sizes) or not isinstance(x, torch.Tensor):
                continue  # (gathered whole in the graph)
            last = self.last.get(i)
            if last is not None and last[0]() is x and x.shape == last[2] and (d := last[1]()) is not None:
                out[i] = d  # (x is the piece of the DTensor the last call returned: the next call's input)
                continue
            out[i] = d = kept_output(x, self.mesh, spec.sharding, spec.batch_dim if spec.batch_split else None)
            piece = local_tensor(d)  # (DTensor.from_local wraps a view of x)
            self.last[i] = (weakref.ref(piece), weakref.ref(d), piece.shape)
        return out


def _sizes(mesh: Mesh) -> tuple[int, int, int]:
    return mesh.size("batch"), mesh.size("row"), mesh.size("col")


@functools.lru_cache(maxsize=256)
def _arrived(names: tuple[str, ...], placements: tuple, shape: tuple[int, ...],
             sizes: tuple[int, int, int]) -> Arrived | None:
    """How a DTensor on the parameters' mesh (axis ``names``), of this ``shape``, placed as ``placements``, with
    (batch, row, col) ``sizes``, arrived (None: not as autopar returns a split output). Cached: one decode
    step's cache layers all look alike."""
    size = dict(zip(("batch", "row", "col"), sizes))
    placed = dict(zip(names, placements, strict=True))
    rows = {placed[axis] for axis in BATCH_AXES}
    if len(rows) != 1:
        return None
    row, = rows
    batch_dim = None
    if isinstance(row, Shard):
        batch_dim = row.dim % len(shape)
        if shape[batch_dim] % size["batch"]:
            return None
    elif not isinstance(row, Replicate):
        return None
    split = [(axis, p) for axis, p in placed.items() if axis not in BATCH_AXES and not isinstance(p, Replicate)]
    sharding = None
    if split:
        if len(split) != 1 or split[0][0] not in ("row", "col") or not isinstance(split[0][1], Shard):
            return None
        (axis, placement), = split
        dim = placement.dim % len(shape)
        if shape[dim] % size[axis] or dim == batch_dim:
            return None
        sharding = Sharding(Layout(axis), dim, (int(shape[dim]),))
    if sharding is None and batch_dim is None:
        return None
    return Arrived(sharding, batch_dim)


def arrived_inputs(leaves: list[Any], mesh: Mesh) -> tuple[list[Any], dict[int, Arrived]]:
    """The leaves with every DTensor autopar cannot take split made whole, and the split ones' layouts."""
    arrived, out, sizes = {}, [], None
    for i, x in enumerate(leaves):
        if isinstance(x, DTensor):
            sizes = sizes or _sizes(mesh)
            param_mesh = x.device_mesh is mesh.param_mesh()
            a = _arrived(x.device_mesh.mesh_dim_names, tuple(x.placements), tuple(x.shape), sizes) if param_mesh else None
            if a is None:
                x = x.full_tensor()
            else:
                arrived[i] = a
        out.append(x)
    return out, arrived


def read_in_place(leaves: list[Any], arrived: Mapping[int, Arrived], split: Mapping[int, int],
                  sizes: tuple[int, ...], kept: bool) -> tuple[list[Any], dict[int, Arrived]]:
    """The arrived leaves this call reads as they are (``kept``: a call whose graph keeps its state split, an
    evaluation without a pipeline); the others made whole. A leaf is read in place when its rows are split as
    the call splits the batch (or, with no batch split, it holds every row), the split even."""
    even = len(set(sizes)) <= 1
    taken = {i: a for i, a in arrived.items()
             if kept and a.batch_dim == split.get(i) and (a.batch_dim is None or even)}
    return [whole(x) if i in arrived and i not in taken else x for i, x in enumerate(leaves)], taken


def given_cache(args: tuple, kwargs: dict) -> Any:
    """The one HF cache object a call passes (None: none, or several)."""
    given = [v for v in (*args, *kwargs.values()) if is_cache_type(type(v))]
    return given[0] if len(given) == 1 else None


class OutputTree:
    """A graph's output leaves in the model's structure (``out_spec``), with the cache among them (a child of
    the top node: HF's ModelOutput holds it) moved into the object the caller passed, as ``carry_cache``
    does. When the cache's leaves are the very tensors the last call moved into that same object (a decode
    step hands back the cache it was given, read in place), the object already holds them, and is handed
    back as it is: HF's cache is otherwise rebuilt from its TreeSpec at every step (its unflatten imports
    each layer's class by path), which costs more than a replayed step. Were the caller's cache changed
    since (another tensor in a layer), this call's inputs, and so its outputs, would be other tensors."""

    def __init__(self, spec: pytree.TreeSpec) -> None:
        self.spec = spec
        self.caches: list[tuple[int, int, pytree.TreeSpec]] = []
        """(first leaf, end, the cache's spec) of each cache child of the top node."""
        self.short: pytree.TreeSpec | None = None
        """``spec`` with each cache child a leaf (None: no cache child)."""
        self.last: tuple[weakref.ref, tuple] | None = None
        """(the caller's cache, its leaves) as the last call left them."""
        if spec.is_leaf():
            return
        children, start, leaf = [], 0, pytree.tree_flatten(0)[1]
        for child in spec.children():
            if is_cache_type(child.type):
                self.caches.append((start, start + child.num_leaves, child))
            children.append(leaf if is_cache_type(child.type) else child)
            start += child.num_leaves
        if len(self.caches) == 1:
            self.short = pytree.TreeSpec(spec.type, spec.context, children)

    def __call__(self, leaves: list[Any], given: Any = None) -> Any:
        if self.short is None or given is None:
            return pytree.tree_unflatten(leaves, self.spec)
        (start, end, spec), = self.caches
        part = leaves[start:end]
        if self.last is not None and self.last[0]() is given and len(self.last[1]) == len(part) \
                and all(r() is x if isinstance(r, weakref.ref) else r is x for r, x in zip(self.last[1], part)):
            cache = given
        else:
            cache = pytree.tree_unflatten(part, spec)
            if type(cache) is type(given):
                given.__dict__.update(vars(cache))
                cache = given
                self.last = (weakref.ref(given), tuple(weakref.ref(x) if isinstance(x, torch.Tensor) else x
                                                       for x in part))
        return pytree.tree_unflatten([*leaves[:start], cache, *leaves[end:]], self.short)


def carry_cache(args: tuple, kwargs: dict, out: Any) -> Any:
    """Serial's in-place cache: HF's forward updates the cache object it is given and returns that object.
    autopar's graph returns a new one (built from its outputs); this moves its state into the object the
    caller passed (so ``model(x, past_key_values=cache)`` leaves ``cache`` filled, as serial) and returns
    that object in its place. Nothing when no single cache went in, or one of another type came out."""
    cache = given_cache(args, kwargs)
    if cache is None or not isinstance(out, dict):  # (HF's ModelOutput is a dict)
        return out
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


# generate() arguments that can make one rank's steps differ from another's (a clock, the caller's own code)
_RANK_DEPENDENT = ("max_time", "stopping_criteria", "logits_processor", "prefix_allowed_tokens_fn", "streamer",
                   "assistant_model", "synced_gpus", "negative_prompt_ids")


def follows_from_logits(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether every call of this ``generate()`` after the first follows from the logits alone: greedy or beam
    search with HF's own processors and no clock. The logits are the same on every rank (gathered whole), so
    then are the tokens, the cache and when generation stops: every rank makes the same calls."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if config is None:
        return False
    sampling = kwargs.get("do_sample", getattr(config, "do_sample", False))
    return not sampling and getattr(config, "max_time", None) is None and not any(
        kwargs.get(k) is not None for k in _RANK_DEPENDENT)


def wrap_generate(model: Any, generate: Callable[..., Any],
                  following: Callable[[], contextlib.AbstractContextManager]) -> Callable[..., Any]:
    """``model.generate`` running under ``generating()``; when its steps follow from the logits alone, under
    ``following()`` too (the runtime checks its first call against the other ranks, not every step)."""
    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "disable_compile" not in kwargs and hasattr(getattr(model, "generation_config", None), "disable_compile"):
            kwargs["disable_compile"] = True  # HF's own compile of the forward (static cache, CUDA) would trace
            # autopar's runtime: autopar compiles and graphs the per-rank program itself (autopar.runtime.compiled.cuda_graphs)
        with generating(), following() if follows_from_logits(model, kwargs) else contextlib.nullcontext():
            return generate(*args, **kwargs)
    return wrapper
