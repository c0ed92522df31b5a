"""torch.optim steps over sharded parameters at plain-tensor speed.

An optimizer over DTensor parameters runs every update op through DTensor's dispatch: on CPU, where
torch's optimizers default to one op per parameter, that measured 2-3x the plain step (AdamW on the
benchmark's GPT-2: 31 ms against 11 ms). For optimizers whose update is elementwise (the torch.optim
classes in ``ELEMENTWISE``) the DTensor layout does not matter: each rank updates its piece as the
serial step would. So a global step pre-hook runs such an optimizer's step on a stand-in (the same object
but for its parameter groups and state) that holds, for each sharded parameter, a plain ``nn.Parameter``
sharing storage with its local piece (its "twin"), with the local gradient and state; the script's
optimizer never holds a twin, so a step that raises leaves it as it was. The post-hook wraps new state in DTensors
with the parameter's placements (so ``optimizer.state_dict()``, DCP and ``get_optimizer_state_dict``
see DTensors, as they would under FSDP2). The arithmetic is the plain optimizer's, bit for bit.

Any other optimizer (LBFGS, Adafactor, a subclass, a third-party class) runs on the DTensors as
given: correct wherever DTensor supports its ops, at DTensor's speed.
"""

from __future__ import annotations

import logging
from collections import ChainMap, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.weak import WeakIdKeyDictionary

from autopar import patches
from autopar.compat import dtensor_spec, local_tensor
from autopar.errors import CheckpointError
from autopar.runtime.interop.state_dicts import SCALAR_STATE, dcp_ready, relayout_state
from autopar.runtime.comm.mesh import ShardMesh
from autopar.runtime.params.absent import Absent
from autopar.runtime.params.data_shards import DataShards, Layout, split_over_data, whole_grad
from autopar.runtime.params.store import owner_of
from autopar.runtime.params.layout import local_of, make_dtensor

log = logging.getLogger(__name__)

ELEMENTWISE = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                         torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                         torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD})
"""Optimizers whose update of a parameter reads only that parameter's own elements."""


_twins: WeakIdKeyDictionary = WeakIdKeyDictionary()
_chunk_twins: WeakIdKeyDictionary = WeakIdKeyDictionary()
_swapped: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""optimizer -> (the stand-in its step runs on, [(parameter, twin, state before the step)], absent parameters,
[(parameter, twin, state before the step, its Layout, its mesh, its DataShards)]) during its step."""
_kept: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""optimizer -> its _Kept stand-in, between steps."""
_warned: set[type] = set()


class _Kept:
    """An optimizer's stand-in and what it was built from, kept between steps. The next step reuses it when the
    optimizer holds the same groups, parameters, local tensors and state objects as after the last step: a few
    identity checks per parameter instead of rebuilding it (hooks of 5.5-6.1 us a parameter against the
    rebuild's 14-21, on one CPU core; on an H200 the rebuilding step took 4.0 ms against the plain 1.4).
    It is taken out before each step and put back after, so a step that raises drops it, and so does any
    change the checks see: the next step then builds the stand-in anew."""

    __slots__ = ("stand_in", "group_list", "state_of", "sources", "twins", "others", "absent", "held")

    def __init__(self, optimizer: torch.optim.Optimizer, stand_in: Any, swapped: list, absent: list) -> None:
        self.stand_in, self.absent = stand_in, absent
        self.group_list, self.state_of = optimizer.param_groups, optimizer.state
        self.sources = [(group, list(map(id, group["params"]))) for group in optimizer.param_groups]
        self.held: list[tuple] = []  # every state value compared by id below, kept alive: no id is reused
        # twins: (parameter, its local tensor, its data pointer, twin, state and its values' ids in the
        # optimizer, state and its values' ids in the stand-in); others: (parameter, the same four)
        self.twins = [(p, local, local.data_ptr(), twin, *self._ids(optimizer.state.get(p)),
                       *self._ids(stand_in.state.get(twin)))
                      for p, twin, _ in swapped for local in (local_tensor(p),)]
        twinned = {id(p) for p, *_ in swapped}
        self.others = [(p, *self._ids(optimizer.state.get(p)), *self._ids(stand_in.state.get(p)))
                       for group in optimizer.param_groups for p in group["params"] if id(p) not in twinned]

    def _ids(self, state: dict | None) -> tuple[dict | None, list[int] | None]:
        if state is None:
            return None, None
        self.held.append(tuple(state.values()))
        return state, list(map(id, state.values()))

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds what it held after the step that recorded this."""
        groups, state = optimizer.param_groups, optimizer.state
        if groups is not self.group_list or state is not self.state_of or len(groups) != len(self.sources):
            return False
        for group, (source, ids) in zip(groups, self.sources):
            if group is not source or list(map(id, group["params"])) != ids:
                return False
        for p, local, ptr, _, before, ids, _, _ in self.twins:
            now = local_tensor(p)
            if now is not local or now.data_ptr() != ptr or not _same(state.get(p), before, ids):
                return False
        return all(_same(state.get(p), before, ids) for p, before, ids, _, _ in self.others)

    def prepare(self, optimizer: torch.optim.Optimizer) -> tuple[Any, list, list, list, _Kept]:
        """The stand-in for this step: the twins given this step's gradients, the optimizer's attributes as now."""
        swapped = []
        for p, _, _, twin, before, _, _, _ in self.twins:
            grad = p.grad
            twin.grad = None if grad is None else local_tensor(grad)
            swapped.append((p, twin, before or {}))
        stand_in = self.stand_in
        groups, state = stand_in.param_groups, stand_in.state
        stand_in.__dict__.update(vars(optimizer))
        stand_in.param_groups, stand_in.state = groups, state
        return stand_in, swapped, self.absent, [], self

    def unchanged(self) -> bool:
        """Whether the step kept the stand-in's state objects and set no group key (the usual case after the
        first step: torch's optimizers update their state tensors in place): then the optimizer's state needs
        nothing."""
        state = self.stand_in.state
        return (all(len(group.maps[0]) == 1 for group in self.stand_in.param_groups)
                and all(_same(state.get(twin), mine, ids) for _, _, _, twin, _, _, mine, ids in self.twins)
                and all(_same(state.get(p), mine, ids) for p, _, _, mine, ids in self.others))


def _same(state: dict | None, before: dict | None, ids: list[int] | None) -> bool:
    return state is before and (state is None or list(map(id, state.values())) == ids)


def _ours(p: Any) -> bool:
    return isinstance(p, DTensor) and isinstance(dtensor_spec(p).mesh, ShardMesh)  # p.device_mesh: a slower property


def _absent(p: DTensor) -> bool:
    return isinstance(local_tensor(p), Absent)


def _twin(p: DTensor) -> nn.Parameter:
    local = local_tensor(p)
    twin = _twins.get(p)
    if twin is None or twin.data_ptr() != local.data_ptr() or twin.shape != local.shape:
        twin = _twins[p] = nn.Parameter(local, requires_grad=p.requires_grad)
    return twin


def _local(value: Any) -> Any:
    return local_tensor(value) if isinstance(value, DTensor) else value


def _data_shards(p: Any) -> tuple[DataShards, Any] | None:
    """The DataShards splitting ``p``'s optimizer state over data and its store (``shard_optimizer=True``).
    None before the plan: the parameters' pieces are decided at the model's first call, so state made or
    loaded before it (``get_state_dict`` before a resumed script's first call) stays whole until then, and the
    first step after it cuts this rank's chunk of its piece."""
    store = owner_of(p)
    shards = getattr(store, "data_shards", None)
    return None if shards is None or getattr(store, "plan", None) is None else (shards, store)


def _chunk_twin(p: Any, piece: torch.Tensor, layout: Layout) -> nn.Parameter:
    """A plain parameter viewing this data rank's chunk of ``p``'s local piece (the step updates it in place)."""
    view = layout.chunk(piece.detach())
    twin = _chunk_twins.get(p)
    if twin is None or twin.data_ptr() != view.data_ptr() or twin.shape != view.shape \
            or twin.stride() != view.stride():
        twin = _chunk_twins[p] = nn.Parameter(view, requires_grad=p.requires_grad)
    return twin


def _chunk_state(key: str, value: Any, piece: torch.Tensor, layout: Layout) -> Any:
    """State ``value`` of a data-sharded parameter as its twin's step reads it: this rank's chunk."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or key in SCALAR_STATE:
        return value
    if isinstance(value, DTensor) and tuple(value.placements) == layout.placements:
        return local_tensor(value)
    if isinstance(value, DTensor) and split_over_data(value):  # (cut in another layout: never cut again)
        raise CheckpointError(f"optimizer state {key!r} of a parameter of shape {tuple(value.shape)} is split over "
                              f"data as {tuple(value.placements)}, where this grid keeps it as {layout.placements}. "
                              "Load optimizer state with torch's set_state_dict or autopar."
                              "load_full_optimizer_state_dict, which lay it out for this grid.")
    local = _local(value)
    if local.shape == piece.shape:  # whole (built before sharding, or loaded): keep the chunk
        return layout.chunk(local).clone()
    return local


def _wrap_chunk(key: str, value: Any, p: Any, layout: Layout, mesh: Any, before: Any) -> Any:
    """A data-sharded parameter's new state ``value`` as kept between steps: a DTensor split over data."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or key in SCALAR_STATE:
        return value
    if isinstance(before, DTensor) and local_tensor(before) is value:
        return before
    return dcp_ready(make_dtensor(value, mesh, layout.placements, p.shape))


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[tuple, dict] | None:
    kept = _kept.pop(optimizer, None)  # back in _post_step: a step that raises drops it
    if kept is not None and kept.holds(optimizer):
        _swapped[optimizer] = kept.prepare(optimizer)
        return (kept.stand_in, *args[1:]), kwargs
    for group in optimizer.param_groups:  # state made before the first call sharded its parameter
        for p in group["params"]:
            store = owner_of(p)
            if store is not None and isinstance(p, DTensor):
                relayout_state(store, optimizer, p)
    if type(optimizer) not in ELEMENTWISE:
        if type(optimizer) not in _warned and any(_data_shards(p) for g in optimizer.param_groups
                                                  for p in g["params"]):
            _warned.add(type(optimizer))
            log.warning("autopar: shard_optimizer=True splits the state of torch.optim's elementwise optimizers "
                        "(%s); %s keeps its whole state on every data rank (its gradients are gathered over data "
                        "before each step).",
                        ", ".join(sorted(c.__name__ for c in ELEMENTWISE)), type(optimizer).__name__)
        for group in optimizer.param_groups:  # whole gradients, as it reads them (collective over data)
            for p in group["params"]:
                if p.grad is not None and split_over_data(p.grad):
                    p.grad = whole_grad(p)
        return None
    swapped, absent, groups, sharded = [], [], [], []
    state: defaultdict[Any, dict] = defaultdict(dict)  # as Optimizer.state
    for group in optimizer.param_groups:
        params = list(group["params"])
        for i, p in enumerate(params):
            found = None if (_ours(p) and _absent(p)) else _data_shards(p)
            if found is not None:
                shards, store = found
                piece = local_of(p)
                mesh = p.device_mesh if isinstance(p, DTensor) else store.mesh.param_mesh()
                layout = shards.layout(p, piece, mesh.ndim)
                if layout is not None:
                    twin = _chunk_twin(p, piece, layout)
                    grad = p.grad  # split over data by the gradient sync (reduce-scatter), or whole
                    twin.grad = None if grad is None else \
                        local_of(grad) if split_over_data(grad) else layout.chunk(local_of(grad))
                    before = optimizer.state.get(p)
                    if before:
                        state[twin] = {k: _chunk_state(k, v, piece, layout) for k, v in before.items()}
                    params[i] = twin
                    sharded.append((p, twin, before or {}, layout, mesh, shards))
                    continue
            if not _ours(p) or _absent(p):
                if _ours(p):  # another pipeline stage's: left out of the step (DCP's first step gives it a zero grad)
                    absent.append(p)
                    params[i] = None
                if optimizer.state.get(p):
                    state[p] = optimizer.state[p]
                continue
            twin = _twin(p)
            twin.grad = None if p.grad is None else local_tensor(p.grad)
            before = optimizer.state.get(p)
            if before:
                state[twin] = {k: _local(v) for k, v in before.items()}
            params[i] = twin
            swapped.append((p, twin, before or {}))
        # the group's other keys read through, as they are now
        groups.append(ChainMap({"params": [p for p in params if p is not None]}, group))
    if not swapped and not absent and not sharded:
        return None
    # The step runs on a stand-in sharing everything but its groups and state: the optimizer the script holds
    # never holds the twins, so a step that raises leaves it as it was.
    stand_in = object.__new__(type(optimizer))
    stand_in.__dict__.update(vars(optimizer))
    stand_in.param_groups, stand_in.state = groups, state
    _swapped[optimizer] = (stand_in, swapped, absent, sharded, None)
    return (stand_in, *args[1:]), kwargs


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stand_in, swapped, absent, sharded, kept = _swapped.pop(optimizer, (None, (), (), (), None))
    if stand_in is None:
        return
    if kept is not None and kept.unchanged():
        for _, twin, _ in swapped:
            twin.grad = None
        _kept[optimizer] = kept
        return
    twins = {id(twin) for _, twin, _ in swapped} | {id(twin) for _, twin, *_ in sharded}
    for p, state in stand_in.state.items():  # state of plain parameters, made by this step
        if id(p) not in twins and state:
            optimizer.state[p] = state
    template = None
    for p, twin, before in swapped:
        state = stand_in.state.get(twin)
        twin.grad = None
        if state:
            optimizer.state[p] = {k: _wrap(k, v, p, before.get(k)) for k, v in state.items()}
            template = template or optimizer.state[p]
    gathers: dict[int, tuple[DataShards, list]] = {}
    for p, twin, before, layout, mesh, shards in sharded:
        state = stand_in.state.get(twin)
        twin.grad = None
        if state:
            optimizer.state[p] = {k: _wrap_chunk(k, v, p, layout, mesh, before.get(k)) for k, v in state.items()}
            template = template or optimizer.state[p]
        gathers.setdefault(id(shards), (shards, []))[1].append((local_of(p).detach(), layout))
    for shards, pieces in gathers.values():  # every data rank's updated chunks, into every rank's parameters
        shards.gather(pieces)
    for p in absent:
        if template and not optimizer.state.get(p):
            optimizer.state[p] = {k: _absent_like(v, p) for k, v in template.items()}
    for group, used in zip(optimizer.param_groups, stand_in.param_groups):
        group.update((k, v) for k, v in used.maps[0].items() if k != "params")  # keys the step set
        for key in [k for k in used.maps[0] if k != "params"]:  # read through from the group again
            del used.maps[0][key]
    if not sharded:  # (a data-sharded optimizer's stand-in is built at every step)
        _kept[optimizer] = _Kept(optimizer, stand_in, swapped, absent)


def _absent_like(value: Any, p: DTensor) -> Any:
    """State of another pipeline stage's parameter ``p``, shaped like the holder's: DCP writes and reads
    nothing for it, and ``set_optimizer_state_dict`` finds every parameter's state (the holder's is real)."""
    if not isinstance(value, torch.Tensor):
        return value
    holder = local_tensor(p)
    scalar = value.dim() == 0
    absent = Absent(() if scalar else holder.shape, value.dtype, p.device, holder.param_name, holder.holders)
    placements = [Replicate()] * p.device_mesh.ndim if scalar else p.placements
    return make_dtensor(absent, p.device_mesh, placements, () if scalar else p.shape)


def _wrap(key: str, value: Any, p: DTensor, before: Any) -> Any:
    """State ``value`` of parameter ``p`` as it is kept between steps: a DTensor laid out like ``p`` when it
    is laid out like ``p``'s local piece (the DTensor of the last step when its local tensor is the same)."""
    local = local_tensor(p)
    if not isinstance(value, torch.Tensor) or value.shape != local.shape or key in SCALAR_STATE:
        return value
    if isinstance(before, DTensor) and local_tensor(before) is value:
        return before
    return dcp_ready(make_dtensor(value, p.device_mesh, p.placements, p.shape))


def install() -> None:
    """Registers the global step hooks, for as long as a parallel model lives (``autopar.patches``)."""
    patches.install("torch.optim step hooks", _register_hooks)


def _register_hooks() -> Callable[[], None]:
    handles = (register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step))

    def undo() -> None:
        for h in handles:
            h.remove()

    return undo
