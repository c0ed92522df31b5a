"""One parallel model's parameters on this rank (``ParamStore``): their plan, building them (replaying the
recorded construction, each rank its pieces), their full (serial) values, and loading serial state dicts.
How a parameter is laid out as a DTensor: ``autopar.runtime.params.layout``."""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from autopar import patches
from autopar.compat import buffer_slots, local_tensor, parameter_slots
from autopar.config import ParallelConfig
from autopar.decisions import ParamKind, ParamPlan, Plan
from autopar.errors import PlanError, StateDictError
from autopar.memory import release_freed_memory
from autopar.runtime.comm import collectives as C
from autopar.runtime.params.absent import Absent
from autopar.runtime.construction.record import Deferred, Sink
from autopar.runtime.construction.memory_mapped import FileMaps, release_pages
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.comm.pieces import gather_pieces
from autopar.runtime.params.layout import (DIMS, TIED_DIMS, distribute_parameters, local_of, local_piece,
                                          make_dtensor, own_piece, placements, set_layout, splits_parameters)
from autopar.runtime.params.data_shards import DataShards, piece_of
from autopar.runtime.construction.pending import LazyRead, is_pending, loaded_value

log = logging.getLogger(__name__)


_owners: dict[int, weakref.ref] = {}


def owner_of(p: torch.Tensor) -> ParamStore | None:
    """The ParamStore holding parameter ``p`` (optimizer hooks find a parameter's layout through it), or None.

    Kept by id with a weak reference to the store, not to the parameter: a weak reference to a parameter
    would stop ``model.to(dtype)`` from swapping it (``torch.utils.swap_tensors`` refuses weakly
    referenced tensors)."""
    ref = _owners.get(id(p))
    store = ref() if ref is not None else None
    return store if store is not None and store.by_id.get(id(p)) is p else None

class ParamStore:
    """The parameters of one parallel model on this rank: their layout, full (serial) values and loading.

    ``params`` maps every parameter name (tied aliases included) to the model's Parameter objects, which
    never change identity after ``auto_parallelize``'s block: optimizers built over
    ``model.parameters()`` keep working when the plan shards them in place (``adopt``).
    """

    def __init__(self, model: nn.Module, config: ParallelConfig, mesh: Mesh,
                 pending: tuple[Deferred, dict[int, Sink]] | None = None, dtensors: bool | None = None) -> None:
        """``dtensors``: parameters become DTensors even under data parallelism alone (a grid chosen at the
        first call: the optimizer built before it must hold the objects any grid could shard)."""
        self.config, self.mesh = config, mesh
        self.pending = pending
        """The recorded construction of parameters and buffers not built yet (autopar.runtime.construction.record)."""
        if pending is not None:
            for key in pending[1]:
                pending[0].on_demand[key] = self._materialize_whole
        self.buffers: dict[str, torch.Tensor] = dict(model.named_buffers(remove_duplicate=False))
        """Every buffer by name (tied names too): the runtime reads buffers here."""
        self._model = weakref.ref(model)
        self.dtensors = splits_parameters(config) if dtensors is None else dtensors
        if self.dtensors:
            distribute_parameters(model, mesh.param_mesh())
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        self.by_id = {id(p): p for p in self.params.values()}
        for p in self.unique():
            _owners[id(p)] = weakref.ref(self)
        self.plan: Plan | None = None
        self.data_shards: DataShards | None = None
        """Set by the runtime under ``shard_optimizer=True`` with data > 1: the optimizer keeps this data rank's
        chunk of each parameter's state (``autopar.runtime.params.data_shards``)."""
        self.readers: dict[str, tuple[int, ...]] = {}
        """pipeline > 1: parameter name -> the pipeline coordinates whose stages read it."""
        self.held: set[int] | None = None
        """pipeline > 1: ids of the parameters this rank holds (its stages read them, or no stage does)."""
        self.hooks = []
        for module in model.modules():  # after the model's own hooks: they see (and may merge) serial keys
            direct = [n for n, p in module.named_parameters(recurse=False)]
            if direct:
                self.hooks.append(module.register_load_state_dict_pre_hook(
                    functools.partial(self._load_hook, names=direct)))
        patches.of_model(model).add("load_state_dict pre-hooks", self.close)

    def close(self) -> None:
        """Detaches this store from the model: its load hooks go, and optimizer hooks no longer find its
        parameters (the store of the grid chosen at the first call, ``ParallelRuntime.take_grid``, takes the same
        Parameter objects and registers them again; ``autopar.detach``)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        for p in self.unique():
            ref = _owners.get(id(p))
            if ref is not None and ref() is self:
                del _owners[id(p)]

    def unique(self) -> list[nn.Parameter]:
        return list({id(p): p for p in self.params.values()}.values())

    def by_param(self) -> dict[int, ParamPlan]:
        """id(parameter) -> its ParamPlan (tied aliases share one)."""
        return {id(self.params[pp.name]): pp for pp in (self.plan.params if self.plan else ())}

    # ---- layout ----------------------------------------------------------------------------------

    def adopt(self, plan: Plan) -> None:
        """Stores this rank's piece of every parameter under ``plan`` (in place: same Parameter objects)."""
        for pp in plan.params:
            p = self.params.get(pp.name)
            if p is None or tuple(p.shape) != pp.shape:
                raise PlanError(f"parameter {pp.name!r} has shape {None if p is None else tuple(p.shape)}, "
                                f"but the captured graph has {pp.shape}. Do not resize parameters after "
                                "building the model inside auto_parallelize.")
        self.plan = plan
        if not self.dtensors:
            return
        if self.pending is not None:
            if self.config.pipeline > 1:  # parameters once hold() knows which this rank's stages read
                self._materialize(plan, only=lambda sink: not any(is_param for _, _, is_param in sink.names))
            else:
                self._materialize(plan)
            return
        maps = FileMaps()
        with torch.no_grad():
            for pp in plan.params:
                p = self.params[pp.name]
                if pp.kind is not ParamKind.REPLICATED:
                    whole = local_of(p)
                    local = own_piece(whole, pp, self.mesh)
                    set_layout(p, local, self.mesh.param_mesh(), placements(pp, DIMS, self.config))
                    release_pages(whole, maps)
        release_freed_memory()  # the wholes just freed (glibc keeps them otherwise)

    def _set_buffer(self, name: str, value: torch.Tensor) -> None:
        """Every name of the buffer ``name`` is (module attributes and this store's table) now ``value``."""
        old = self.buffers[name]
        for n, b in list(self.buffers.items()):
            if b is old:
                owner_name, _, leaf = n.rpartition(".")
                buffer_slots(self._model().get_submodule(owner_name))[leaf] = value
                self.buffers[n] = value

    def _materialize_whole(self, why: str) -> None:
        """Something needs parameter values before the plan exists: builds every pending parameter and
        buffer whole on this rank (in place: the Pending objects become the tensors); the plan cuts them."""
        if self.pending is None:
            return
        deferred, sinks = self.pending
        self.pending = None
        self.buffers.update(self._model().named_buffers(remove_duplicate=False))  # a cast replaced them
        for key in sinks:
            deferred.on_demand.pop(key, None)
        if self.mesh.rank == 0:
            log.warning("autopar: %s before the model's first call: building its parameters whole on every rank "
                        "(the first call keeps each rank's pieces). Pass example_inputs= to auto_parallelize to "
                        "build only the pieces at the block's end.", why)

        def emit(sink: Sink, values: dict[str, torch.Tensor]) -> None:
            for name, _, is_param in sink.names:
                t = self.params[name] if is_param else self.buffers.get(name)
                local = local_of(t) if is_param and isinstance(t, DTensor) else t
                if not is_pending(local) or local.cell["real"] is not None:
                    continue
                full = loaded_value(local, deferred) if local.loaded is not None else values[name]
                full = full.to(dtype=local.dtype, device=local.device).clone()
                local.cell["real"] = full  # every copy of the Pending now stands for it
                if is_param:
                    set_layout(t, full, self.mesh.param_mesh(), t.placements)
                else:
                    self._set_buffer(name, full)

        loaded = {k for k, s in sinks.items() if all(
            not is_pending(t := (local_of(self.params[n]) if p else self.buffers.get(n))) or t.loaded is not None
            for n, _, p in s.names)}
        with torch.no_grad():
            deferred.replay({k: s for k, s in sinks.items() if k not in loaded}, emit)
            for k in loaded:
                emit(sinks[k], {})

    def _materialize(self, plan: Plan, only: Callable[[Sink], bool] | None = None) -> None:
        """Builds the pending parameters and buffers (those ``only`` picks; the rest stay pending): the
        recorded construction is replayed (or a value loaded before the first call is taken), and each
        parameter keeps only this rank's piece."""
        deferred, every = self.pending
        sinks = {k: s for k, s in every.items() if only is None or only(s)}
        rest = {k: s for k, s in every.items() if k not in sinks}
        self.pending = (deferred, rest) if rest else None
        for key in sinks:
            deferred.on_demand.pop(key, None)
        plans = self.by_param()

        def pending_of(name: str, is_param: bool) -> Any:
            t = self.params[name] if is_param else self.buffers.get(name)
            local = local_of(t) if is_param and isinstance(t, DTensor) else t
            return t, local if is_pending(local) else None

        def emit(sink: Sink, values: dict[str, torch.Tensor]) -> None:
            done: set[int] = set()
            for name, _, is_param in sink.names:
                t, pending = pending_of(name, is_param)
                if pending is None or id(t) in done:
                    continue
                done.add(id(t))
                full = loaded_value(pending, deferred) if pending.loaded is not None else values[name]
                pp = plans.get(id(t))
                if not is_param or pp is None or pp.kind is ParamKind.REPLICATED:
                    full = full.to(dtype=pending.dtype, device=pending.device).clone()
                    if is_param:
                        set_layout(t, full, self.mesh.param_mesh(), t.placements)
                    else:
                        self._set_buffer(name, full)
                    continue
                # cut, then convert: a mapped checkpoint's tensor is read (and converted) only in this piece
                piece = own_piece(full, pp, self.mesh).to(dtype=pending.dtype, device=pending.device)
                set_layout(t, piece, self.mesh.param_mesh(), placements(pp, DIMS, self.config))
                # torch.load(mmap=True) then load_state_dict: its pages go (a LazyRead's mapping goes with it)
                if pending.loaded is not None and not isinstance(pending.loaded, LazyRead):
                    release_pages(pending.loaded, maps)

        maps = FileMaps()
        loaded = {k: s for k, s in sinks.items()
                  if all((p := pending_of(n, is_param)[1]) is None or p.loaded is not None for n, _, is_param in s.names)}
        with torch.no_grad():
            deferred.replay({k: s for k, s in sinks.items() if k not in loaded}, emit)
            for sink in loaded.values():
                emit(sink, {})

    def hold(self, readers: dict[str, tuple[int, ...]]) -> None:
        """pipeline > 1: keeps the parameters this rank's stages read. A weight several stages read moves to a
        mesh over those stages; one read by other stages only keeps its global shape around an ``Absent``
        local tensor (its Parameter object stays: an optimizer over ``model.parameters()`` never gets a
        gradient for it)."""
        self.readers = readers
        me = self.mesh.index("pipeline")
        self.held = set()
        plans = self.by_param()
        read = {id(p) for name, p in self.params.items() if name in readers}
        if self.pending is not None:  # build only what this rank's stages read (and what no stage reads)
            mine = {id(p) for name, p in self.params.items()
                    if me in readers.get(name, (me,)) and (name in readers or id(p) not in read)}
            self._materialize(self.plan, only=lambda sink: any(id(self.params[n]) in mine
                                                               for n, _, is_param in sink.names if is_param))
            if self.pending is not None:  # the other stages' parameters: never built here
                for key in self.pending[1]:
                    self.pending[0].on_demand.pop(key, None)
                self.pending = None
        for name, p in self.params.items():
            if id(p) in self.held or (name not in readers and id(p) in read):  # a tied alias: under its other name
                continue
            holders = readers.get(name)
            pp = plans.get(id(p))
            if holders is None or me in holders:
                self.held.add(id(p))
                if holders is not None and len(holders) > 1 and pp is not None:
                    set_layout(p, local_of(p), self.mesh.param_mesh(holders), placements(pp, TIED_DIMS, self.config))
                continue
            local = local_of(p)
            absent = Absent(local.shape, local.dtype, local.device, name, holders)
            set_layout(p, absent, self.mesh.param_mesh(), p.placements)
            p.grad = None

    # ---- full (serial) values --------------------------------------------------------------------

    def full_tensor(self, local: torch.Tensor, pp: ParamPlan) -> torch.Tensor:
        """The full (serial) tensor from every rank's ``local`` part of parameter ``pp`` (collective over the
        tensor axes)."""
        if pp.kind is ParamKind.REPLICATED:
            return local
        m, o = self.mesh, pp.orientation
        local = local.detach()

        def gather(t: torch.Tensor, axis: str, dim: int, parts: tuple[int, ...]) -> torch.Tensor:
            n = m.size(axis)
            return gather_pieces(t, dim, parts, pp.shape[dim], m.group(axis), n) if n > 1 else t

        if pp.kind is ParamKind.SPLIT:
            if pp.second_axis:
                local = gather(local, pp.second_axis, pp.second_dim, pp.second_parts)
            return gather(local, pp.split_axis, pp.split_dim, pp.parts).contiguous()
        if pp.kind is ParamKind.BIAS:
            return gather(local, o.out_axis, 0, pp.parts).contiguous()
        out_dim, in_dim = (1, 0) if pp.weight_in_out else (0, 1)
        block = C.all_gather(local, m.group("depth"), m.size("depth"))
        block = gather(block, o.in_axis, in_dim, ())
        return gather(block, o.out_axis, out_dim, pp.parts).contiguous()

    def full(self, local: torch.Tensor | None, pp: ParamPlan) -> torch.Tensor | None:
        """The full tensor of parameter ``pp`` (or of its gradient, or of optimizer state laid out like it) on
        every rank; with pipeline > 1 the first pipeline rank holding it gathers it and broadcasts it over
        the pipeline (collective). None when the holder's ``local`` is None."""
        if self.config.pipeline == 1 or pp.name not in self.readers:
            return None if local is None else self.full_tensor(local, pp)
        src = self.readers[pp.name][0]
        mine = self.mesh.index("pipeline") == src
        flag = torch.tensor([1.0 if mine and local is not None else 0.0], device=self.mesh.device)
        C.broadcast(flag, self.mesh.peer(src), self.mesh.group("pipeline"), self.config.pipeline)
        if flag.item() == 0:
            return None
        full = self.full_tensor(local, pp) if mine else torch.empty(pp.shape, dtype=self.params[pp.name].dtype,
                                                                       device=self.mesh.device)
        return C.broadcast(full.contiguous(), self.mesh.peer(src), self.mesh.group("pipeline"), self.config.pipeline)

    def full_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """``model.state_dict()`` with every sharded entry gathered to the serial tensor (collective)."""
        plans = self.by_param()
        out = {}
        for key, value in state.items():
            p = self.params.get(key)
            if p is not None and id(p) in plans:
                value = self.full(local_of(value), plans[id(p)])
            elif isinstance(value, DTensor):  # made by the model's own state_dict hooks from parameters
                value = value.full_tensor()
            out[key] = value
        return out

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's full gradient under each of its names (collective; for tests and debugging)."""
        out: dict[str, torch.Tensor | None] = {}
        plans = self.by_param()
        for pp in (self.plan.params if self.plan else ()):
            grad = self.params[pp.name].grad
            out[pp.name] = self.full(None if grad is None else piece_of(grad, self.params[pp.name]), pp)
        for name, p in self.params.items():  # tied weights: the same tensor under another name
            if name not in out and id(p) in plans:
                out[name] = out[plans[id(p)].name]
        return out

    # ---- loading ---------------------------------------------------------------------------------

    def _load_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                   missing_keys: list, unexpected_keys: list, error_msgs: list, *, names: list[str]) -> None:
        """Turns the entries of ``module``'s own parameters into what they load into on this rank: the
        serial tensor (or a replicated DTensor) becomes this rank's piece; a DTensor in this parameter's
        layout is taken as it is. Anything else is an error naming the key and both layouts."""
        if local_metadata.get("assign_to_params_buffers", False) and self.dtensors:
            raise StateDictError("load_state_dict(..., assign=True) would replace autopar's sharded parameters "
                                 "by the given tensors. Load without assign=True: values are copied into "
                                 "this rank's shards.")
        for name in names:
            key = prefix + name
            if key not in state_dict:
                continue
            p = parameter_slots(module)[name]
            value = state_dict[key]
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                raise StateDictError(f"state dict entry {key!r} is on the meta device: loading it would leave "
                                     f"parameter {key!r} unchanged. Load real tensors.")
            if not self.dtensors:
                continue
            state_dict[key] = self._loadable(key, p, value)

    def _loadable(self, key: str, p: nn.Parameter, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) and torch.overrides.is_tensor_like(value):
            # a lazily loaded checkpoint tensor (Lightning's lazy_load, litgpt's load_checkpoint): read at the
            # first call into a pending parameter, else now (through its __torch_function__), one at a time
            value = LazyRead(value) if is_pending(local_of(p)) else torch.detach(value)
        if not isinstance(value, torch.Tensor):
            return value
        if isinstance(local_tensor(p), Absent):
            return p  # another pipeline rank holds it: loading it here is a no-op
        if isinstance(value, DTensor):
            if value.device_mesh == p.device_mesh and tuple(value.placements) == tuple(p.placements):
                return value
            if all(isinstance(x, Replicate) for x in value.placements):
                value = local_of(value)  # whole on every rank: cut below, no communication
            else:
                unsharded = ("This model is not sharded yet (its first call plans and shards it): load after its "
                             "first call, or pass example_inputs= to auto_parallelize so the block's end shards "
                             "it. " if self.plan is None else "")
                raise StateDictError(
                    f"state dict entry {key!r} is a DTensor with placements {tuple(value.placements)} on mesh "
                    f"{value.device_mesh}; this model stores it as {tuple(p.placements)} on {p.device_mesh}. "
                    f"{unsharded}Otherwise load the serial tensor, a torch.distributed.checkpoint loaded into this "
                    "model's own model.state_dict(), or autopar.full_state_dict output.")
        if tuple(value.shape) != tuple(p.shape):
            raise StateDictError(
                f"state dict entry {key!r} has shape {tuple(value.shape)}; the serial parameter has shape "
                f"{tuple(p.shape)} (this rank stores a {tuple(local_tensor(p).shape)} piece of it). A checkpoint "
                "holding one rank's pieces cannot be loaded: save with torch.distributed.checkpoint or "
                "autopar.full_state_dict(model).")
        pp = self.by_param().get(id(p))
        local = value if pp is None else local_piece(value, pp, self.mesh)
        return make_dtensor(local.to(p.device), p.device_mesh, p.placements, p.shape)
