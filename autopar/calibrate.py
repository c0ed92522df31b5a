"""Measures this machine for the plan search: ``python -m autopar.plan --calibrate FILE [--gpus N]``.

The built-in hardware descriptions (``autopar/hardware/*.json``) are published figures. This measures
instead, on this machine's device (CUDA if there is one, else the CPU):

- the matmul rate: square float32 (bf16 on a GPU) GEMMs, the median of a few after a warm-up;
- the collectives: all-reduces of 1 KiB .. 4 MiB over ``ranks`` processes (NCCL on GPUs, else gloo),
  fitted as ``seconds = latency + bytes sent / bandwidth`` (bytes sent per rank as
  ``decisions.collective_bytes`` counts them). Under torchrun the launched ranks measure; otherwise
  ``ranks`` processes are forked here (file rendezvous, no port).

One node is measured, so its figures are both the within-node and the across-node link's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.decisions import collective_bytes
from autopar.errors import ConfigError
from autopar.memory import device_budget
from passes.analysis.search_plans import Machine

SIZES = (256, 4096, 65536, 1 << 20)  # float32 elements: 1 KiB .. 4 MiB


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def matmul_rate(device: torch.device | None = None, n: int | None = None, repeats: int = 5) -> float:
    """Sustained FLOP/s of an ``n`` x ``n`` GEMM on ``device`` (median of ``repeats``)."""
    device = device or _device()
    gpu = device.type == "cuda"
    n = n or (8192 if gpu else 512)
    dtype = torch.bfloat16 if gpu else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(repeats + 1):
        if gpu:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if gpu:
            torch.cuda.synchronize(device)
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times)


def all_reduce_fit(group: Any = None, repeats: int = 5) -> tuple[float, float]:
    """(bytes per second, seconds per call) of this group's all-reduces, fitted over ``SIZES``. Every rank of
    the group calls it; every rank gets the same figures (rank 0's, broadcast)."""
    device = _device() if dist.get_backend(group) == "nccl" else torch.device("cpu")
    world = dist.get_world_size(group)
    points = []
    for n in SIZES:
        x = torch.ones(n, device=device)
        times = []
        for i in range(repeats + 1):
            dist.barrier(group)
            start = time.perf_counter()
            dist.all_reduce(x, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - start)
        points.append((float(collective_bytes("all_reduce", world, n * 4)), statistics.median(times)))
    rate, latency = _fit(points)
    box = [(rate, latency)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of seconds = latency + bytes / rate; a latency never below zero, a rate never infinite."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    slope = max(slope, 1e-15)
    latency = max(my - slope * mx, min(ys) * 0.5 if min(ys) > 0 else 0.0)
    return 1.0 / slope, latency


def calibrate(ranks: int = 2, name: str = "calibrated") -> Machine:
    """This machine, measured (module docstring). Under torchrun the launched ranks measure the
    collectives (every rank must call this); otherwise ``ranks`` forked processes do."""
    if ranks < 2:
        raise ConfigError(f"--gpus {ranks}: measuring collectives needs at least 2 ranks.")
    if dist.is_available() and dist.is_initialized():
        rate, latency = all_reduce_fit()
        flops = matmul_rate()
        ranks = dist.get_world_size()
    else:
        rate, latency, flops = _forked(ranks)
    device = _device()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    return Machine(name, flops_per_second=flops, memory_bytes=device_budget(device, local),
                   intra_bytes_per_second=rate, inter_bytes_per_second=rate, intra_latency=latency,
                   inter_latency=latency, gpus_per_node=local)


def _forked(ranks: int) -> tuple[float, float, float]:
    """``all_reduce_fit`` on ``ranks`` processes forked from this one (gloo, or NCCL with a GPU each), and
    rank 0's matmul rate with the threads a rank has (one on a CPU, as OMP_NUM_THREADS=1 ranks run)."""
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "gloo"
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        procs = [ctx.Process(target=_measure, args=(r, ranks, backend, str(store), str(Path(tmp) / f"{r}.out")))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        if any(p.is_alive() or p.exitcode != 0 for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise ConfigError(f"measuring collectives on {ranks} forked {backend} processes failed (exit codes "
                              f"{[p.exitcode for p in procs]}); run under torchrun instead.")
        return pickle.loads((Path(tmp) / "0.out").read_bytes())


def _measure(rank: int, ranks: int, backend: str, store: str, out: str) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=ranks)
        rate, latency = all_reduce_fit()
        Path(out).write_bytes(pickle.dumps((rate, latency, matmul_rate())))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (the parent reports the exit code)
        code = 1
    os._exit(code)


def write(machine: Machine, path: str) -> None:
    Path(path).write_text(machine.to_json())

