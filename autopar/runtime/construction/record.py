"""Deferred construction: a model built inside ``auto_parallelize`` is recorded on meta and replayed one
tensor at a time, so a rank never holds the whole model to keep its shards of it.

Recording. Inside the block every factory call makes meta tensors (``torch.empty``, ``zeros``,
``arange``, ``nn.Linear``'s parameters ...; ``torch.tensor(data)`` stays real: its data is the value),
``.to(device)`` stays on meta, and every aten op that touches a meta tensor is logged with the device
the serial script would have run it on. A random op (uniform_, normal_, ... any op torch tags
``nondeterministic_seeded``) also runs on a real scratch tensor of the same shape and strides, one at a
time: the generator advances exactly as serial construction advances it (``torch.manual_seed`` inside
the block included), and its state before the op is kept. Python that needs tensor data while building
(``.item()``, ``if t.sum() > 0``) cannot run on meta: ``DeferredInitError`` names the module.

Replay (``autopar.runtime.construction.replay``). Each tensor the model keeps (a parameter or a buffer: a *sink*) is a storage whose value the
log computes. Replaying the log on the real device gives the serial values bit for bit: every random op
first restores the generator state it had in the recording. Ops whose results are overwritten whole
before anyone reads them (``nn.Linear``'s own init when ``post_init`` or ``_init_weights`` re-initializes
it) are skipped; a storage is allocated at the op that writes it whole and freed after its last reader,
and a sink is handed to ``emit`` (the caller keeps its shard) as soon as its last op ran. So a rank holds
its shards plus the few tensors one module's init touches at once.

Random ops serial runs on meta (``torch.device("meta")``, a loader such as ``from_pretrained``) do not
move serial's generator: they wait (*unsettled*) and advance it only if a module keeps what they computed.
``.to(dtype)`` of a memory-mapped checkpoint's tensor is recorded too (``MappedConversion``), so loading
in another dtype reads and converts one tensor at a time at the replay.

Until then the model's parameters and buffers are ``Pending`` tensors (autopar/runtime/construction/pending.py).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autopar.compat import TorchDispatchMode, op_schema, pytree, storage_key
from autopar.errors import AutoparError
from autopar.memory import release_freed_memory
from autopar.runtime.construction.memory_mapped import FileMaps, MappedConversion
from autopar.runtime.construction.replay import Ref, live_ops, replay

aten = torch.ops.aten
META = torch.device("meta")
HF_SYNC_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"
MAPPED = "(memory-mapped checkpoint)"
"""``Op.module`` of a recorded conversion of a memory-mapped tensor."""


class DeferredInitError(AutoparError, RuntimeError):
    """A module's construction cannot be recorded on meta and replayed."""


#: Factory functions that take ``device=``: made on meta inside the block.
FACTORIES = frozenset({
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint, torch.randperm,
    torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye, torch.empty_strided, torch.tril_indices,
    torch.triu_indices, torch.scalar_tensor, torch.normal, torch.bartlett_window, torch.blackman_window,
    torch.hamming_window, torch.hann_window, torch.kaiser_window,
})
#: Factory functions whose values come from Python data: made real (the data is the value).
FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
#: Ops that make a tensor shaped like their input without reading it.
LIKE_FACTORIES = frozenset({aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
                            aten.full_like.default, aten.rand_like.default, aten.randn_like.default,
                            aten.randint_like.default})
#: Ops that read tensor data into Python: impossible on meta.
DATA_DEPENDENT = frozenset({aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,
                            aten.nonzero.default, aten.allclose.default,
                            aten._unique2.default, aten.masked_select.default, aten.item.default})
#: In-place ops that write every element of ``self`` without reading it (a new value of the storage).
OVERWRITES = frozenset({
    aten.uniform_.default, aten.normal_.default, aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor,
    aten.random_.default, getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default, aten.cauchy_.default,
    aten.log_normal_.default, aten.geometric_.default, aten.bernoulli_.float, aten.copy_.default,
})


def value_device(device: torch.device | None) -> torch.device:
    """Where a recorded tensor's value is made: the serial script's device (meta means the user built on
    meta on purpose: the value is made on the CPU, as the plain serial build makes it)."""
    if device is None or device.type == "meta":
        return torch.device("cpu")
    return device


def _key(t: torch.Tensor) -> int:
    return storage_key(t)


@dataclass
class Op:
    func: Any
    args: Any
    kwargs: dict
    outs: list[Ref]
    device: torch.device
    """The serial script's device for this op (its tensors', or a factory's device)."""
    writes: tuple[int, ...] = ()
    reads: tuple[int, ...] = ()
    overwrites: int | None = None
    fresh: tuple[int, ...] = ()
    rng: tuple[Any, torch.Tensor | None] | None = None
    """Random ops: (generator, its state before the op); the state is None while a random op serial runs
    on meta is not settled (``Deferred.settle``)."""
    module: str = ""


@dataclass
class Sink:
    """A storage the model keeps: its names and their views."""

    key: int
    names: list[tuple[str, Ref, bool]] = field(default_factory=list)
    """(name, view, is a parameter)."""


def _module_being_built() -> str:
    """The innermost ``nn.Module.__init__`` on the stack and the user's line that needed data."""
    where, module = "", ""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    for info in inspect.stack(context=0)[2:]:
        fname = info.filename
        if not where and not fname.startswith(torch_dir) and not fname.startswith(here):
            where = f"{fname}:{info.lineno}"
        self_ = info.frame.f_locals.get("self")
        if isinstance(self_, nn.Module) and not module:
            module = type(self_).__name__
        if where and module:
            break
    return f"{module or 'the model'} (at {where or 'unknown'})"


class _Factories(TorchFunctionMode):
    """Factory calls make meta tensors; the device serial's would have used is noted for the log."""

    def __init__(self, recorder: Deferred) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if self.recorder.paused:
            return func(*args, **kwargs)
        if func in FROM_DATA:
            device = kwargs.get("device")
            device = torch.device(device) if device is not None else torch.get_default_device()
            kwargs["device"] = value_device(device)
            return func(*args, **kwargs)
        if func in FACTORIES and not any(isinstance(a, torch.Tensor) for a in pytree.tree_leaves((args, kwargs))):
            device = kwargs.get("device")
            self.recorder.intended.append(torch.device(device) if device is not None else torch.get_default_device())
            kwargs["device"] = META
            try:
                return func(*args, **kwargs)
            finally:
                self.recorder.intended.pop()
        return func(*args, **kwargs)


class _Recording(TorchDispatchMode):
    def __init__(self, recorder: Deferred) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.recorder.record(func, args, kwargs or {})


#: torch.nn.init functions that return at once on meta tensors (rejection sampling, QR, random columns):
#: inside the block they are recorded as one call each, replayed on the real tensor.
SKIPS_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


class InitCall:
    """A recorded ``torch.nn.init`` call, replayed on the real tensor (its first argument)."""

    def __init__(self, fn: Callable, rest: tuple, kwargs: dict) -> None:
        self.fn, self.rest, self.kwargs = fn, rest, kwargs
        self.__name__ = getattr(fn, "__name__", "init")

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.fn(tensor, *self.rest, **self.kwargs)


class Deferred:
    """The recorded construction of the models of one ``auto_parallelize`` block."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.intended: list[torch.device] = []
        self.devices: dict[int, torch.device] = {}
        """Storage -> the device its value lives on in the serial script."""
        self.nbytes: dict[int, int] = {}
        self.keep: dict[int, torch.Tensor] = {}  # one meta tensor per storage: keeps its key unique
        self.on_meta: set[int] = set()
        """Storages serial's script makes on meta (``torch.device("meta")``, HF's from_pretrained)."""
        self.unsettled: list[int] = []
        """Random ops on those, in order, whose generator has not advanced yet (``settle``)."""
        self.roots: Callable[[], list[nn.Module]] = list
        """The modules built so far (set by auto_parallelize): whose tensors a settle decision looks at."""
        self._modes: list[Any] = []
        self.paused = False
        self.on_demand: dict[int, Callable[[str], None]] = {}
        """Storage -> builds its model's parameters whole now (something needs values before the plan)."""

    # ---- recording ----------------------------------------------------------------------------------

    def __enter__(self) -> Deferred:
        self._modes = [_Factories(self), _Recording(self)]
        for m in self._modes:
            m.__enter__()
        # The only patches autopar makes: while the block runs, these init functions (torch's, and the table
        # transformers.initialization keeps of them) are recorded instead of skipping meta tensors, and
        # transformers loads on this thread (its worker threads would convert weights out of the recording's
        # sight, whole); the originals are back when the block ends, whatever happens in it.
        self._async_load = os.environ.get(HF_SYNC_LOAD)
        os.environ[HF_SYNC_LOAD] = "1"
        self._originals = []
        tables: list[Any] = [nn.init.__dict__]
        hf = sys.modules.get("transformers.initialization")
        if hf is not None and isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
            tables.append(hf.TORCH_INIT_FUNCTIONS)
        for table in tables:
            for name in SKIPS_META:
                if name in table:
                    self._originals.append((table, name, table[name]))
                    table[name] = self._recorded_init(table[name])
        return self

    def __exit__(self, *exc: Any) -> None:
        if getattr(self, "_async_load", "") is None:
            os.environ.pop(HF_SYNC_LOAD, None)
        elif hasattr(self, "_async_load"):
            os.environ[HF_SYNC_LOAD] = self._async_load
        for table, name, fn in reversed(getattr(self, "_originals", [])):
            table[name] = fn
        self._originals = []
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []

    def _recorded_init(self, fn: Callable) -> Callable:
        def init(tensor: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta" or _key(tensor) not in self.nbytes:
                return fn(tensor, *rest, **kwargs)
            key = _key(tensor)
            device = self.devices[key]
            op = Op(InitCall(fn, rest, kwargs), (Ref.of(tensor),), {}, [Ref.of(tensor)], device, writes=(key,),
                    reads=(key,))
            if Ref.of(tensor).covers(self.nbytes[key]) and fn.__name__ != "dirac_":  # dirac_ keeps other entries
                op.overwrites, op.reads = key, ()
            self._random(op, kwargs.get("generator"), key in self.on_meta)
            self.ops.append(op)
            return tensor

        init.__name__, init.__doc__ = fn.__name__, fn.__doc__
        return init

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.paused:
            return func(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        metas = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        device = kwargs.get("device")
        device = torch.device(device) if device is not None else None
        if func in DATA_DEPENDENT and metas:
            raise DeferredInitError(
                f"{_module_being_built()} reads tensor data into Python while it is built ({func.__name__}), "
                "which autopar cannot do: inside auto_parallelize the model is built on meta (no values) and its "
                "init replayed later, one shard at a time. Compute that value from Python numbers, or build this "
                "model with auto_parallelize(defer_init=False) (every rank then builds the whole model).")
        if func is aten._to_copy.default and not metas and self._mapped(args[0]):
            return self._convert_later(func, args, kwargs)
        if not metas and (device is None or device.type != "meta"):
            if self.unsettled and torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                self.settle_if_kept()  # serial's meta random ops came first: the stream must be past them
            return func(*args, **kwargs)  # real tensors only: not part of the model's recorded values
        if func is aten.empty_like.default and device is not None and device.type != "meta":
            # "move this meta tensor to a device" (HF's loading of keys a checkpoint lacks): empty_like's contents
            # are unspecified, so the recorded value is a valid one, and the one the code means
            return self.evaluate(args[0]).to(device=device, dtype=kwargs.get("dtype") or args[0].dtype)
        if func in LIKE_FACTORIES and device is not None and device.type != "meta":
            return func(*args, **kwargs)  # zeros_like(t, device="cpu"): a real tensor asked for (only t's shape)
        if self._writes_real(func, args, kwargs):  # copy_(real, recorded): the real one needs the value now
            self.settle()
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: self.evaluate(t) if t.device.type == "meta"
                                                else t, (args, kwargs))
            return func(*args, **kwargs)
        if not metas:  # a factory (made meta by _Factories): serial's device is the one noted there
            intended = self.intended[-1] if self.intended else device
        elif device is not None and device.type != "meta":  # .to(device), empty_like(device=...): stays meta
            intended = device
            kwargs = {**kwargs, "device": META}
        else:
            intended = META if _key(metas[0]) in self.on_meta else self.devices.get(_key(metas[0]), torch.device("cpu"))
        # real tensors meeting meta ones: their values are constants of the log (copied: later in-place
        # changes must not reach back); meta stands in for them in the meta computation
        consts: dict[int, torch.Tensor] = {}

        def to_meta(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.dim() > 0:
                consts[id(t)] = t
                return t.to(META)
            return t

        meta_args, meta_kwargs = pytree.tree_map(to_meta, (args, kwargs))
        out = func(*meta_args, **meta_kwargs)

        def ref(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in consts:
                return t.detach().clone()
            if t.device.type != "meta":
                return t.detach().clone()
            self.keep.setdefault(_key(t), t)
            return Ref.of(t)

        op = Op(func, pytree.tree_map(ref, args), pytree.tree_map(ref, kwargs), [], value_device(intended))
        schema = op_schema(func)
        writes = []
        if schema is not None:
            for a, value in zip(schema.arguments, list(args) + [kwargs.get(x.name) for x in
                                                                schema.arguments[len(args):]]):
                if a.alias_info is not None and a.alias_info.is_write:  # a tensor, or a list (_foreach_*_)
                    writes += [_key(v) for v in pytree.tree_leaves(value)
                               if isinstance(v, torch.Tensor) and v.device.type == "meta"]
        op.writes = tuple(writes)
        op.reads = tuple(dict.fromkeys(_key(t) for t in metas))
        if func in OVERWRITES and writes and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            first = Ref.of(args[0])
            if first.covers(args[0].untyped_storage().nbytes()):
                op.overwrites = first.key
                other = [_key(t) for t in metas[1:] if _key(t) != first.key]
                op.reads = tuple(dict.fromkeys(other))
        fresh = []
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                k = _key(t)
                if k not in self.nbytes:
                    self.nbytes[k] = t.untyped_storage().nbytes()
                    self.devices[k] = value_device(intended)
                    if intended is None or intended.type == "meta":
                        self.on_meta.add(k)
                    self.keep[k] = t
                    fresh.append(k)
                op.outs.append(Ref.of(t))
        op.fresh = tuple(fresh)
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self._random(op, kwargs.get("generator"), intended is None or intended.type == "meta")
        self.ops.append(op)
        return out

    def _mapped(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "cpu" and FileMaps().region(t) is not None

    def _convert_later(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """``.to(dtype/device)`` of a memory-mapped checkpoint's tensor (``from_pretrained(dtype=...)`` of a
        checkpoint saved in another dtype): recorded with the mapped source as its argument (by reference,
        not copied), so the conversion runs one tensor at a time at the replay, like an init."""
        source = args[0]
        target = torch.device(kwargs["device"]) if kwargs.get("device") is not None else source.device
        self.paused = True
        try:
            out = torch.empty(source.shape, dtype=kwargs.get("dtype") or source.dtype, device=META)
        finally:
            self.paused = False
        k = _key(out)
        self.nbytes[k] = out.untyped_storage().nbytes()
        self.devices[k] = value_device(target)
        self.keep[k] = out
        convert = MappedConversion(kwargs.get("dtype") or source.dtype, value_device(target))
        self.ops.append(Op(convert, (source,), {}, [Ref.of(out)], value_device(target), fresh=(k,), module=MAPPED))
        return out

    def mapped_sources(self) -> list[torch.Tensor]:
        """The memory-mapped tensors recorded conversions read (the ranks compare them)."""
        return [op.args[0] for op in self.ops if op.module == MAPPED]

    @staticmethod
    def _writes_real(func: Any, args: tuple, kwargs: dict) -> bool:
        schema = op_schema(func)
        if schema is None:
            return False
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        return any(a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor)
                   and v.device.type != "meta" for a, v in zip(schema.arguments, values))

    def evaluate(self, t: torch.Tensor) -> torch.Tensor:
        """The real value a recorded tensor has now (replays what it depends on; generators untouched)."""
        if _key(t) not in self.nbytes:
            raise DeferredInitError(f"{_module_being_built()} uses a meta tensor autopar did not record; build it "
                                    "inside the auto_parallelize block, or with defer_init=False.")
        out: dict[str, torch.Tensor] = {}
        self.paused = True
        try:
            self.replay({_key(t): Sink(_key(t), [("value", Ref.of(t), False)])},
                        lambda sink, values: out.update({k: v.clone() for k, v in values.items()}))
        finally:
            self.paused = False
        return out["value"]

    def _random(self, op: Op, generator: Any, on_meta: bool) -> None:
        """A random op: on serial's real device it runs now on scratch (the generator advances as serial's;
        its state before is kept); on meta, where serial's generator does not move, it waits for ``settle``."""
        device = op.device
        if generator is None:
            generator = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" \
                else torch.default_generator
        op.rng = (generator, None)
        if on_meta:
            self.unsettled.append(len(self.ops))
        else:
            self.settle_if_kept()  # serial's meta random ops before it came first
            self._advance(op)

    def _advance(self, op: Op) -> None:
        """Runs ``op`` on real scratch tensors (one at a time) so its generator advances as serial's does,
        keeping the generator's state before."""
        generator = op.rng[0]
        op.rng = (generator, generator.get_state())
        device = op.device

        def scratch(t: Any) -> Any:
            if isinstance(t, Ref):
                empty = torch.empty_strided(t.size, t.stride, dtype=t.dtype, device=device)
                return empty.fill_(0.5) if t.dtype.is_floating_point else empty.zero_()
            if isinstance(t, torch.device) and t.type == "meta":
                return device
            return t

        self.paused = True
        try:
            args, kwargs = pytree.tree_map(scratch, (op.args, op.kwargs))
            op.func(*args, **kwargs)
            del args, kwargs
        finally:
            self.paused = False
        if device.type == "cpu":
            release_freed_memory()

    def settle(self) -> None:
        """Advances the generators past the random ops serial's script ran on meta, in order, as a plain
        build would have (their values become the plain build's): the model built on meta is kept, so its
        values are the module's own init."""
        for i in self.unsettled:
            self._advance(self.ops[i])
        self.unsettled = []

    def settle_if_kept(self) -> None:
        """Settles if a module built so far keeps a meta tensor those random ops computed; else (a loader
        such as ``from_pretrained`` built on meta and replaced every tensor by a loaded one) they are left
        as serial leaves them: the generator never moved."""
        if not self.unsettled:
            return
        sinks: dict[int, Sink] = {}
        for model in self.roots():
            sinks.update(self.sinks(model))
        pending = set(self.unsettled)
        if sinks and pending & set(self.live_ops(sinks)):
            self.settle()

    # ---- the model's tensors ------------------------------------------------------------------------

    def sinks(self, model: nn.Module) -> dict[int, Sink]:
        """The recorded storages ``model`` keeps, by storage (tied names share one)."""
        out: dict[int, Sink] = {}
        for kind, items in ((True, model.named_parameters(remove_duplicate=False)),
                            (False, model.named_buffers(remove_duplicate=False))):
            for name, t in items:
                if t is None or t.device.type != "meta" or _key(t) not in self.nbytes:
                    continue
                out.setdefault(_key(t), Sink(_key(t))).names.append((name, Ref.of(t), kind))
        return out

    def unrecorded(self, model: nn.Module) -> list[str]:
        """Meta parameters and buffers the log does not compute (built on meta outside the block)."""
        return [n for n, t in (*model.named_parameters(), *model.named_buffers())
                if t.device.type == "meta" and _key(t) not in self.nbytes]

    def fingerprint(self) -> torch.Tensor:
        """Of the recorded random streams: ranks that agree on it build the same values."""
        sums = [int(state.to(torch.int64).sum()) * 1_000_003 + i for i, op in enumerate(self.ops)
                if op.rng and op.rng[1] is not None for state in (op.rng[1],)]
        return torch.tensor([len(self.ops), len(sums), sum(sums) % (2**62)], dtype=torch.int64)

    # ---- replay (autopar/runtime/construction/replay.py) ----------------------------------------------------------

    def replay(self, sinks: dict[int, Sink], emit: Callable[[Sink, dict[str, torch.Tensor]], None]) -> None:
        """Computes the value of every sink and hands it to ``emit`` (``replay.replay``)."""
        replay(self.ops, self.nbytes, self.devices, sinks, emit)

    def live_ops(self, sinks: dict[int, Sink]) -> list[int]:
        """Indices of the ops some sink's value depends on, in order (``replay.live_ops``)."""
        return live_ops(self.ops, sinks)
