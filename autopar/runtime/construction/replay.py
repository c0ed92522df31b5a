"""Replaying a recorded construction (``autopar.runtime.construction.record``): each kept tensor's value computed on the
real device from the log, one tensor at a time, with serial's values bit for bit (every random op restores the
generator state it had in the recording); a storage is allocated at the op that writes it whole and freed
after its last reader, so a rank holds its shards plus the few tensors one module's init touches at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autopar.compat import pytree, storage_key
from autopar.memory import release_freed_memory


@dataclass(frozen=True)
class Ref:
    """A meta tensor in the log: its storage and the view of it."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> Ref:
        return Ref(storage_key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def covers(self, nbytes: int) -> bool:
        """Whether this view is its whole storage, contiguous."""
        numel, expected = 1, 1
        for s in self.size:
            numel *= s
        contiguous = True
        for size, stride in reversed(list(zip(self.size, self.stride))):
            if size != 1 and stride != expected:
                contiguous = False
            expected *= size
        return self.offset == 0 and contiguous and numel * self.dtype.itemsize == nbytes



def replay(ops: list[Any], nbytes: dict[int, int], devices: dict[int, torch.device], sinks: dict[int, Any],
           emit: Callable[[Any, dict[str, torch.Tensor]], None]) -> None:
    """Computes the value of every sink and hands it to ``emit`` (sink, name -> full tensor) right after
    the last op that writes it; frees every other value after its last reader. Leaves the generators
    as they were."""
    needed = live_ops(ops, sinks)
    last: dict[int, int] = {}
    for i in needed:
        op = ops[i]
        for k in (*op.reads, *op.writes, *op.fresh, *([op.overwrites] if op.overwrites is not None else [])):
            last[k] = i
    env: dict[int, torch.UntypedStorage] = {}
    saved = {}
    done: set[int] = set()
    try:
        for i in needed:
            op = ops[i]
            if op.rng is not None:  # (an unsettled one: values of no kept tensor; the generator is restored)
                generator, state = op.rng
                saved.setdefault(id(generator), (generator, generator.get_state()))
                if state is not None:
                    generator.set_state(state)
            if op.overwrites is not None and op.overwrites not in env:
                env[op.overwrites] = torch.empty(nbytes[op.overwrites], dtype=torch.uint8,
                                                 device=devices[op.overwrites]).untyped_storage()
            args, kwargs = pytree.tree_map(lambda a: _real(a, env, op.device), (op.args, op.kwargs))
            out = op.func(*args, **kwargs)
            for ref, t in zip(op.outs, [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]):
                if ref.key not in env:
                    env[ref.key] = t.untyped_storage()
            freed = False
            for k in [k for k, at in last.items() if at == i]:
                if k in sinks and k not in done:
                    done.add(k)
                    emit(sinks[k], {name: _view(r, env[k]) for name, r, _ in sinks[k].names})
                freed |= env.pop(k, None) is not None and nbytes.get(k, 0) >= 1 << 20
                del last[k]
            if freed:
                del args, kwargs, out
                release_freed_memory()
        for k, sink in sinks.items():  # written by no live op: loaded, or never initialized
            if k not in done:
                emit(sink, {})
    finally:
        for generator, state in saved.values():
            generator.set_state(state)

def live_ops(ops: list[Any], sinks: dict[int, Any]) -> list[int]:
    """Indices of the ops some sink's value depends on, in order (backwards liveness over values; an
    overwrite ends the life of the value before it)."""
    live: set[int] = set(sinks)
    needed = []
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        produced = set(op.writes) | set(op.fresh) | ({op.overwrites} if op.overwrites is not None else set())
        if not produced & live:
            continue
        needed.append(i)
        if op.overwrites is not None:
            live.discard(op.overwrites)
        for k in op.fresh:
            live.discard(k)
        live |= set(op.reads) | (set(op.writes) - {op.overwrites})
    return needed[::-1]

def _view(ref: Ref, storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.size, ref.stride)

def _real(a: Any, env: dict[int, torch.UntypedStorage], device: torch.device) -> Any:
    if isinstance(a, Ref):
        return _view(a, env[a.key])
    if isinstance(a, torch.device) and a.type == "meta":
        return device
    return a
