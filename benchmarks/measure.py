"""What the harness measures on one rank: communicated bytes, peak memory, step times.

``Instrument`` is one dispatch mode for one (untimed) training step of any system. It sees every
collective that DDP's reducer, FSDP2, DTensor, torch pipelining and autopar issue, because they all end
in the dispatcher's ``c10d`` ops (process-group collectives) or ``_c10d_functional`` ops (DTensor's
functional collectives), and it counts each under the ring formulas of
``autopar.decisions.collective_bytes``: the same accounting as ``autopar.comm_stats()``, applied to the
peers' own calls. (torch's ``CommDebugMode`` sees the same ops but reports only how many.) It is also
autopar's ``PeakMemory``: on CPU glibc's ``mallinfo2`` after every op, which counts every live
allocation of the process (tensors of any system, DDP's C++ buckets and gloo's buffers included)
without the RSS's retained pages; on CUDA the caching allocator's peak.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from autopar.compat import op_schema, resolve_process_group
from autopar.planning.calibrate import (activation_rate, arrival_skew_seconds, collective_table, lockstep_seconds, matmul_rate,
                               op_overhead, optimizer_rate, warm_up)
from autopar.decisions import collective_bytes
from autopar.memory import PeakMemory

# c10d op -> (kind, how its message size is read). Message = output for all-gather, input for
# reduce-scatter, the tensor otherwise (autopar.decisions.collective_bytes).
_C10D = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "send": ("send", "tensors"),
    "alltoall_base_": ("all_to_all", "input"),  # (the rows this rank keeps are not sent: ``_record``)
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "all_gather_into_tensor": ("all_gather", "input"),  # output = input x group size
    "all_gather_into_tensor_out": ("all_gather", "input"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"),
}
_SILENT = {"recv_", "recv_any_source_", "barrier", "monitored_barrier_", "wait_tensor", "_wrap_tensor_autograd"}
"""Ops that send nothing themselves (the sender of a recv counts its bytes; waits and wrappers)."""


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_size(named: dict[str, Any]) -> int:
    if "group_size" in named:
        return int(named["group_size"])
    if "group_name" in named:
        return resolve_process_group(named["group_name"]).size()
    pg = named["process_group"]
    return (pg if isinstance(pg, dist.ProcessGroup) else dist.ProcessGroup.unbox(pg)).size()


def sent_to_others(named: dict[str, Any], size: int, message: int) -> int:
    """Of an all-to-all's input (``message`` bytes), the bytes for the other ranks: its rows but those of this rank's
    own split (even splits where none are given)."""
    splits = list(named.get("input_split_sizes") or ())
    pg = named["process_group"]
    rank = (pg if isinstance(pg, dist.ProcessGroup) else dist.ProcessGroup.unbox(pg)).rank()
    if not splits:
        return message - message // size
    rows = sum(splits)
    return message // rows * (rows - splits[rank]) if rows else 0


class Instrument(PeakMemory):
    """``with Instrument(device) as m: step()``, then ``m.bytes`` (per collective kind), ``m.calls``,
    ``m.unknown`` (collective ops not counted) and, from ``autopar.memory.PeakMemory``, ``m.peak``
    (the most bytes in use at once, counted from zero, as ``bytes_in_use`` reads them)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.bytes: dict[str, Fraction] = {}
        self.calls: dict[str, int] = {}
        self.unknown: set[str] = set()

    @property
    def total(self) -> Fraction:
        return sum(self.bytes.values(), Fraction(0))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        ns, name = func.namespace, op_schema(func).name.split("::")[-1]
        if ns in ("c10d", "_c10d_functional") and name not in _SILENT:
            self._record(func, ns, name, args, kwargs or {})
        return out

    def _record(self, func: Any, ns: str, name: str, args: tuple, kwargs: dict) -> None:
        table = _C10D if ns == "c10d" else _FUNCTIONAL
        if name not in table:
            self.unknown.add(f"{ns}.{name}")
            return
        kind, field = table[name]
        named = {a.name: v for a, v in zip(op_schema(func).arguments, args)} | kwargs
        if field not in named:  # a schema this table does not describe: say so rather than guess
            self.unknown.add(f"{ns}.{name}")
            return
        size = _group_size(named)
        message = _nbytes(named[field])  # lists (of lists) of tensors: their sum
        if kind == "all_to_all":  # the bytes sent to the other ranks (autopar.comm_stats' count)
            message = sent_to_others(named, size, message)
        if field == "input" and kind == "all_gather":
            message *= size
        self.bytes[kind] = self.bytes.get(kind, Fraction(0)) + collective_bytes(kind, size, message)
        self.calls[kind] = self.calls.get(kind, 0) + 1


def timed(step: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, result) of ``step()``, started together on every rank (a barrier first)."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def slowest_median(times: list[float], device: torch.device) -> float:
    """The median over steps of the slowest rank's time per step (a step ends when its last rank does)."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def calibrate(device: torch.device, repeats: int = 10) -> dict[str, Any]:
    """This machine's rates as each rank sees them while every rank runs at once (shared cores
    included; ``autopar.planning.calibrate``, every rate the slowest rank's): a GEMM's FLOP rate, an all-reduce's
    fixed cost and bandwidth over all ranks (the bytes of ``collective_bytes``), an AdamW step's memory
    rate, the elementwise work's rate per saved activation byte, an operator's overhead and the tables of collectives per group: the plan search's ``Machine`` for predicting step times
    here."""
    world = dist.get_world_size()
    small, big = torch.zeros(1, device=device), torch.zeros(1 << 20, device=device)  # 4 B, 4 MiB
    latency = lockstep_seconds(lambda: dist.all_reduce(small), 4 * repeats, device)
    transfer = lockstep_seconds(lambda: dist.all_reduce(big), repeats, device)
    bandwidth = float(collective_bytes("all_reduce", world, big.numel() * 4)) / max(transfer - latency, 1e-9)
    table, crossed = collective_table()
    return {**compute_rates(device), "collective_seconds": latency, "bytes_per_second": bandwidth,
            "collectives": table, "crossed_collectives": crossed, "skew_seconds": arrival_skew_seconds()}


def compute_rates(device: torch.device) -> dict[str, float]:
    """The rates of ``calibrate`` that a rank's own work meets (GEMM, AdamW, elementwise, per operator): a
    few seconds, so the harness measures them again before each autopar grid (a shared machine drifts by
    20-30% over a job's minutes; the collectives' table, the long part, is measured once)."""
    warm_up(device, 0.5)
    return {"flops_per_second": matmul_rate(device), "memory_bytes_per_second": optimizer_rate(device),
            "activation_bytes_per_second": activation_rate(device), "op_seconds": op_overhead(device)}
