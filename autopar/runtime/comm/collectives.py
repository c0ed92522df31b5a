"""Counted collectives. Every byte autopar sends goes through here and lands in ``comm_stats()``.

Bytes are what this rank sends under ring algorithms (``autopar.decisions.collective_bytes``),
counted from the tensors actually passed, so the count is the same on gloo (which emulates
reduce-scatter with all-reduce) and NCCL. Groups of one are skipped and count nothing.

A collective that fails (a timeout, a lost peer: some rank never joined) raises ``RanksPartedError``
naming what each rank was doing (``autopar.runtime.comm.faults``).

Traced by ``torch.compile`` (``autopar.runtime.compiled.graph``), the same calls emit torch's functional
collectives, which the compiled graph holds as nodes; each compiled graph then counts the collectives
it holds every time it runs (``record``), so ``comm_stats()`` reads the same in both.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from autopar.compat import (all_gather_into, functional_all_gather, functional_all_reduce, functional_reduce_scatter,
                            reduce_scatter_into)
from autopar.decisions import COLLECTIVE_KINDS, collective_bytes
from autopar.runtime.comm.faults import guarded


BUCKET_BYTES = 25 * 2**20
"""The most bytes one bucketed collective carries (DDP's default bucket cap): gradient sync, the optimizer's
parameter all-gather, compiled graphs' merged collectives."""


class _CommStats:
    """The collectives counted: their messages' bytes summed per (kind, group size), integers (the bytes sent,
    ``collective_bytes``, are linear in them: exact fractions made only when read, not at each collective)."""

    def __init__(self) -> None:
        self.messages: dict[tuple[str, int], int] = {}
        self.calls = {k: 0 for k in COLLECTIVE_KINDS}

    def record(self, kind: str, group_size: int, message_bytes: int) -> None:
        key = (kind, group_size)
        self.messages[key] = self.messages.get(key, 0) + message_bytes
        self.calls[kind] += 1

    def add(self, tally: Tally) -> None:
        for key, nbytes in tally.messages:
            self.messages[key] = self.messages.get(key, 0) + nbytes
        for kind, _, calls in tally.sums:
            self.calls[kind] += calls

    def bytes(self) -> dict[str, Fraction]:
        """Bytes sent, per kind."""
        out = {k: Fraction(0) for k in COLLECTIVE_KINDS}
        for (kind, size), nbytes in self.messages.items():
            out[kind] += collective_bytes(kind, size, nbytes)
        return out


class Tally:
    """Collectives a graph holds, summed per kind once, counted together at each run (``record_tally``)."""

    def __init__(self, collectives: Sequence[tuple[str, int, int]]) -> None:
        bytes_, calls, messages = {}, {}, {}
        for kind, size, nbytes in collectives:
            bytes_[kind] = bytes_.get(kind, Fraction(0)) + collective_bytes(kind, size, nbytes)
            calls[kind] = calls.get(kind, 0) + 1
            messages[(kind, size)] = messages.get((kind, size), 0) + nbytes
        self.sums = tuple((kind, bytes_[kind], calls[kind]) for kind in bytes_)
        self.messages = tuple(messages.items())
        """The messages' bytes per (kind, group size) (``_CommStats``)."""
        self.held = tuple(collectives)


_stats = _CommStats()


def comm_stats() -> dict[str, float]:
    """Bytes this rank sent since the last ``reset_comm_stats()``: one key per collective kind and "total"."""
    sent = _stats.bytes()
    out = {k: float(v) for k, v in sent.items()}
    out["total"] = float(sum(sent.values(), Fraction(0)))
    return out


def comm_calls() -> dict[str, int]:
    """Number of collectives of each kind since the last reset (groups of one are not counted)."""
    return dict(_stats.calls)


def record(kind: str, group_size: int, message_bytes: int) -> None:
    """Counts one collective a compiled graph ran (``autopar.runtime.compiled.graph``)."""
    _stats.record(kind, group_size, message_bytes)


def record_tally(tally: Tally) -> None:
    """Counts every collective of ``tally`` (a CUDA graph's replay, ``autopar.runtime.compiled.cuda_graphs``)."""
    if isinstance(_stats, _Held):
        _stats.into.extend(tally.held)
        return
    _stats.add(tally)


class _Held:
    """Collectives issued while a CUDA graph is captured: held, not counted (``held``)."""

    def __init__(self, into: list[tuple[str, int, int]]) -> None:
        self.into = into

    def record(self, kind: str, group_size: int, message_bytes: int) -> None:
        self.into.append((kind, group_size, message_bytes))


@contextlib.contextmanager
def held() -> Iterator[list[tuple[str, int, int]]]:
    """Inside, collectives are listed, not counted (a CUDA graph's capture runs nothing: each replay counts
    them with ``record``, ``autopar.runtime.compiled.cuda_graphs``)."""
    global _stats
    outer, into = _stats, []
    _stats = _Held(into)
    try:
        yield into
    finally:
        _stats = outer


def reset_comm_stats() -> None:
    global _stats
    _stats = _CommStats()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, size: int, op: str = "sum") -> torch.Tensor:
    """Sums (or takes the max or min of) ``t`` over the group; returns a contiguous result (``t`` itself when
    possible)."""
    if size == 1:
        return t
    if torch.compiler.is_compiling():
        return functional_all_reduce(t.contiguous(), op, group)
    t = t.contiguous()
    _stats.record("all_reduce", size, _nbytes(t))
    with guarded():
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def all_reduce_async(t: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> Any:
    """Starts summing contiguous ``t`` over the group in place; returns the work to ``wait()`` on (None
    for a group of one)."""
    if size == 1:
        return None
    _stats.record("all_reduce", size, _nbytes(t))
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter_async(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> Any:
    """Starts summing contiguous ``t`` (``size`` equal rows) over the group into ``out``, this rank's row;
    returns the work to ``wait()`` on."""
    _stats.record("reduce_scatter", size, _nbytes(t))
    return reduce_scatter_into(out, t, group=group, async_op=True)


def all_gather(t: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Concatenates every rank's ``t`` along dim 0, in group order."""
    if size == 1:
        return t
    if torch.compiler.is_compiling():
        return functional_all_gather(t.contiguous(), size, group)
    t = t.contiguous()
    out = torch.empty((size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _stats.record("all_gather", size, _nbytes(out))
    with guarded():
        all_gather_into(out, t, group=group)
    return out


def all_gather_last(t: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Concatenates every rank's ``t`` along the last dim, in group order."""
    if size == 1:
        return t
    stacked = all_gather(t.unsqueeze(0), group, size)  # (size, *t.shape)
    return torch.cat(stacked.unbind(0), dim=-1)


def reduce_scatter(t: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Sums ``t`` over the group and returns this rank's 1/size chunk of dim 0."""
    if size == 1:
        return t
    if torch.compiler.is_compiling():
        return functional_reduce_scatter(t.contiguous(), size, group)
    t = t.contiguous()
    out = torch.empty((t.shape[0] // size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    _stats.record("reduce_scatter", size, _nbytes(t))
    with guarded():
        reduce_scatter_into(out, t, group=group)
    return out


def all_to_all(t: torch.Tensor, send: Sequence[int], receive: Sequence[int], group: dist.ProcessGroup | None,
               size: int, rank: int) -> torch.Tensor:
    """Sends ``send[p]`` consecutive rows of ``t`` (dim 0) to the group's ``p``-th rank and returns the rows
    received, ``receive[p]`` from each, in group order (``rank``: this rank's index in the group; the rows it
    keeps are not counted as sent)."""
    t = t.contiguous()
    out = torch.empty((sum(receive), *t.shape[1:]), dtype=t.dtype, device=t.device)
    if size == 1:
        return out.copy_(t)
    row = t.element_size() * math.prod(t.shape[1:])
    _stats.record("all_to_all", size, row * (sum(send) - send[rank]))
    with guarded():
        dist.all_to_all_single(out, t, list(receive), list(send), group=group)
    return out


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """Overwrites ``t`` with global rank ``src``'s values."""
    if size == 1:
        return t
    _stats.record("broadcast", size, _nbytes(t))
    with guarded():
        dist.broadcast(t, src=src, group=group)
    return t


def send(t: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    """Sends ``t`` to global rank ``dst`` (pipeline stages: activations forward, gradients back)."""
    t = t.contiguous()
    _stats.record("send", 2, _nbytes(t))
    with guarded():
        dist.send(t, dst=dst, group=group)


def recv(t: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Receives into ``t`` from global rank ``src`` (the sender counts the bytes)."""
    with guarded():
        dist.recv(t, src=src, group=group)
    return t


def all_gather_async(out: list[torch.Tensor], t: torch.Tensor, group: dist.ProcessGroup, size: int) -> Any:
    """Starts an all-gather of ``t`` into ``out`` (one tensor per rank); returns its work handle."""
    if size > 1:
        _stats.record("all_gather", size, _nbytes(t) * size)
    return dist.all_gather(out, t, group=group, async_op=True)


def wait(work: Any) -> None:
    """Waits for an async collective's ``work``; a failure (a rank that never joined) is told as
    ``autopar.runtime.comm.faults`` tells it."""
    with guarded():
        work.wait()


def simulated() -> bool:
    """True under torch's fake process group (backend "fake"): this process stands in for one rank of a
    world whose collectives are no-ops, and every other rank is taken to do what this one does."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def broadcast_objects(box: list[Any], src: int, group: dist.ProcessGroup | None, **kw: Any) -> None:
    """``dist.broadcast_object_list``, except in a simulated world, where every rank holds what this one does."""
    if not simulated():
        dist.broadcast_object_list(box, src=src, group=group, **kw)


def count_send(t: torch.Tensor) -> None:
    """Counts a send that torch.distributed.pipelining issues on autopar's behalf."""
    _stats.record("send", 2, _nbytes(t))
