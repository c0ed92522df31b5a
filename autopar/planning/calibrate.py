"""Measures this machine for the plan search: ``python -m autopar.plan --calibrate FILE [--gpus N]``.

The built-in hardware descriptions (``autopar/hardware/*.json``) are published figures. This measures
instead, on this machine's device (CUDA if there is one, else the CPU):

- the matmul rate: a linear layer's forward and backward, float32 (bf16 on a GPU), after a warm-up;
- the optimizer's memory rate: an AdamW step over 16 MiB of parameters in 16 tensors of 1 MiB (a
  mid-sized layer's: on a CPU a step over one 16 MiB tensor runs at ~0.7x the rate of 1 MiB ones, which
  stay in cache, and ~1.5x that of 16 KiB ones, where each tensor's fixed cost shows);
- the rates of a rank's own work (GEMM, AdamW, elementwise, per operator) are each the median of five
  timed runs, after a second of GEMMs (a process's first second ran at 60-80% of its later speed);
- the elementwise rate: saved activation bytes per second of a chain of norms, activations and softmax,
  forward and backward; and an operator's overhead (a chain of tiny ones);
- where the ranks outnumber the CPU cores, how late the last rank reaches a collective after a long
  stretch of compute (``arrival_skew_seconds``);
- the collectives: all-reduces of 1 KiB .. 4 MiB over ``ranks`` processes (NCCL on GPUs, else gloo),
  fitted as ``seconds = latency + bytes sent / bandwidth`` (bytes sent per rank as
  ``decisions.collective_bytes`` counts them); and ``collective_table``: all-reduce, all-gather,
  reduce-scatter and send of 4 B .. 16 MiB per group size, as a step meets them (after compute, every
  group at once), which the search prefers where a collective's kind and group were measured. Under
  torchrun the launched ranks measure; otherwise ``ranks`` processes are forked here (file rendezvous,
  no port).

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

from autopar.compat import all_gather_into, group_timeout, reduce_scatter_into
from autopar.decisions import collective_bytes
from autopar.errors import ConfigError
from autopar.memory import device_budget
from passes.analysis.machine import Machine

SIZES = (256, 4096, 65536, 1 << 20)  # float32 elements: 1 KiB .. 4 MiB
TABLE_SIZES = (4, 4096, 65536, 262144, 1 << 20, 4 << 20, 16 << 20)
"""Message bytes the collective table measures: 4 B .. 16 MiB."""
TABLE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def lockstep_seconds(fn: Any, n: int, device: torch.device | None = None) -> float:
    """Seconds per call of ``fn`` run ``n`` times after a warm-up; with a process group, on every rank at
    once (a barrier first) and the slowest rank's time, as a step meets it where ranks share cores."""
    device = device or _device()
    together = dist.is_available() and dist.is_initialized()
    fn()
    if together:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    if together:
        box = torch.tensor([took], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        took = box.item()
    return took / n


def steady_seconds(fn: Any, n: int, device: torch.device | None = None, trials: int = 5) -> float:
    """The median of ``trials`` runs of ``lockstep_seconds(fn, n)``: one run on a shared machine can be 20-30%
    off its neighbours (another tenant, a frequency change)."""
    return statistics.median(lockstep_seconds(fn, n, device) for _ in range(trials))


def warm_up(device: torch.device | None = None, seconds: float = 1.0) -> None:
    """GEMMs for ``seconds`` before the rates are timed: a process's first second of compute ran at
    60-80% of its later rate here (every rate alike: the core's clock, first-touch pages)."""
    device = device or _device()
    a = torch.randn(512, 512, device=device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device | None = None, n: int | None = None, repeats: int = 10) -> float:
    """Sustained FLOP/s of a linear layer's forward and backward (``x @ W.T``, then ``dX`` and ``dW``: 6
    ``m k n`` FLOPs) on ``device``: ``m`` = 2 ``n`` rows of ``n`` features in and out (1024 x 512 -> 512 on a
    CPU; its transposed products run slower than a square GEMM, ~0.9x here, as a model's do), bf16 and
    ``n`` = 8192 on a GPU. ``steady_seconds``: with a process group, every rank at once and the slowest
    one's rate, the median of five runs."""
    device = device or _device()
    gpu = device.type == "cuda"
    n = n or (8192 if gpu else 512)
    dtype = torch.bfloat16 if gpu else torch.float32
    x = torch.randn(2 * n, n, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, n, device=device, dtype=dtype, requires_grad=True)
    g = torch.ones(2 * n, n, device=device, dtype=dtype)

    def step() -> None:
        torch.nn.functional.linear(x, w).backward(g)
        x.grad = w.grad = None

    return 6 * 2 * n ** 3 / steady_seconds(step, repeats, device)


def optimizer_rate(device: torch.device | None = None, numel: int = 1 << 18, tensors: int = 16,
                   repeats: int = 10) -> float:
    """Memory bytes per second that an AdamW step sustains (``Machine.memory_bytes_per_second``: it
    touches seven bytes per byte of parameter) over ``tensors`` parameters of ``numel`` elements each,
    ``steady_seconds`` as ``matmul_rate``."""
    device = device or _device()
    params = [torch.nn.Parameter(torch.zeros(numel, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return 7 * numel * tensors * 4 / steady_seconds(opt.step, repeats, device)


def activation_rate(device: torch.device | None = None, rows: int = 512, repeats: int = 10) -> float:
    """Saved activation bytes per second of forward + backward elementwise work
    (``Machine.activation_bytes_per_second``): a chain of a transformer's non-matmul ops (layer and RMS
    norm, tanh-GELU, SiLU, a product, softmax, residual adds) on ``rows`` x 1024, the bytes autograd saves
    for it counted by a saved-tensor hook; ``steady_seconds`` as ``matmul_rate``."""
    import torch.nn.functional as F

    device = device or _device()
    x = torch.randn(rows, 1024, device=device, requires_grad=True)
    w = torch.ones(1024, device=device)

    def chain() -> torch.Tensor:
        h = F.layer_norm(x, (1024,), w, w)
        a = F.gelu(h, approximate="tanh") * F.silu(h)
        s = torch.softmax(a.view(rows, 8, 128), -1).view(rows, 1024)
        r = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (s + r + x).sum()

    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chain().backward()
    return saved[0] / steady_seconds(lambda: chain().backward(), repeats, device)


def op_overhead(device: torch.device | None = None, ops: int = 64, repeats: int = 20) -> float:
    """Seconds one operator costs beyond its arithmetic, forward and backward (``Machine.op_seconds``): a
    chain of ``ops`` elementwise ops on 64 floats, forward and backward, per op; ``steady_seconds`` as
    ``matmul_rate``."""
    device = device or _device()
    x = torch.randn(64, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for k in range(ops // 2):
            y = torch.tanh(y * (1.0 + k))
        y.sum().backward()

    return steady_seconds(chain, repeats, device) / ops


def arrival_skew_seconds(stretch: float = 0.02, calls: int = 8, trials: int = 5) -> float:
    """``Machine.skew_seconds``: how much longer a blocking collective takes after ``stretch`` seconds of
    compute on every rank than the compute and the collective take apart, where the ranks outnumber the
    cores (the scheduler runs some while the others wait a time slice, so the last arrives late): the
    median over ``trials`` of ``lockstep(compute + all-reduce) - lockstep(compute) - lockstep(all-reduce)``,
    a 4-byte all-reduce over the world after a transformer-like stretch (norm, linear, GELU, causal
    attention, backward). 0 without a process group, on a GPU, and where every local rank has a core."""
    import torch.nn.functional as F

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "nccl":
        return 0.0
    if int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) <= cpu_cores():
        return 0.0
    linear = torch.nn.Linear(256, 256)
    h = torch.randn(4, 64, 256, requires_grad=True)

    def unit() -> None:
        y = linear(F.gelu(F.layer_norm(h, (256,)), approximate="tanh")) + h
        q = y.view(4, 64, 4, 64).transpose(1, 2)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    repeat = max(1, round(stretch / lockstep_seconds(unit, 10)))  # the slowest rank's: the same everywhere

    def compute() -> None:
        for _ in range(repeat):
            unit()

    tiny = torch.zeros(1)

    def reduce() -> None:
        dist.all_reduce(tiny)

    def both() -> None:
        compute()
        reduce()

    skews = [lockstep_seconds(both, calls) - lockstep_seconds(compute, calls) - lockstep_seconds(reduce, 4 * calls)
             for _ in range(trials)]
    return max(statistics.median(skews), 0.0)


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


Table = dict[str, dict[int, tuple[tuple[int, float], ...]]]


def collective_table(repeats: int = 4, sizes: tuple[int, ...] = TABLE_SIZES, trials: int = 1,
                     between: Any = None) -> tuple[Table, Table]:
    """Seconds of each collective kind per group size and message, as a step meets them: every group of
    the world at once, each call after a burst of compute, on a fresh buffer, less the compute's own
    time, the slowest rank's. The compute's time is measured again beside every point (the same number
    of bursts just before its calls): subtracting one measured at the start let a point that ran in a
    faster moment than it come out as nothing (a job here measured 2-rank all-reduces up to 1 MiB at
    0 ms). No point is below the same calls back to back, without the bursts. Two tables
    (``Machine.collectives`` and ``Machine.crossed_collectives``): groups of consecutive ranks alone, and
    calls alternating between those and groups of the same size that cross them (strided ranks: a 2D
    grid's rows and columns), where a rank's partner in one group waits on its partner in the other.
    Each point is the median of ``trials`` timed runs (1: on this
    shared machine three tables taken a minute apart differed by up to 30% at a point, with or without
    the median of three, so the machine's drift, not a run's spread, sets the error; three triple the
    time). ``between``: the compute before each call (default: four GEMMs of 128 x 512 x 512). Every rank
    calls it and gets the same tables."""
    device = _device() if dist.get_backend() == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    a = torch.randn(128, 512, device=device)
    b = torch.randn(512, 512, device=device)

    def gemms() -> None:
        for _ in range(4):
            a @ b

    burst = between or gemms

    def points(kind: str, groups: list[Any], size: int) -> tuple[tuple[int, float], ...]:
        out = []
        for nbytes in sizes:
            whole = max(nbytes // 4 // size, 1) * size  # elements: the message, whole across the group
            bufs = [torch.ones(whole, device=device) for _ in range(2)]
            piece = torch.ones(whole // size, device=device)
            turn = [0]

            def bare() -> None:
                x, group = bufs[turn[0] % 2], groups[turn[0] % len(groups)]
                turn[0] += 1
                if kind == "all_reduce":
                    dist.all_reduce(x, group=group)
                elif kind == "all_gather":
                    all_gather_into(x, piece, group=group)
                elif kind == "reduce_scatter":
                    reduce_scatter_into(piece, x, group=group)
                elif dist.get_rank(group) == 0:
                    dist.send(x, dist.get_global_rank(group, 1) if group is not None else 1, group=group)
                else:
                    dist.recv(x, dist.get_global_rank(group, 0) if group is not None else 0, group=group)

            def call() -> None:
                burst()
                bare()

            calls = repeats * (4 if nbytes <= 1 << 20 else 1) * len(groups)  # small ones: cheap and noisier
            seconds = statistics.median(lockstep_seconds(call, calls, device) - lockstep_seconds(burst, calls, device)
                                        for _ in range(trials))
            out.append((whole * 4, max(seconds, lockstep_seconds(bare, calls, device), 1e-6)))
        return tuple(zip([b for b, _ in out], monotone([t for _, t in out])))

    table: Table = {k: {} for k in TABLE_KINDS}
    crossed: Table = {k: {} for k in TABLE_KINDS if k != "send"}
    for size in [g for g in range(2, world + 1) if world % g == 0]:
        made = []
        if size < world:
            stride = world // size
            made = [dist.new_subgroups(size, timeout=group_timeout())[0], dist.new_subgroups_by_enumeration(
                [[r for r in range(world) if r % stride == j] for j in range(stride)], timeout=group_timeout())[0]]
        consecutive = made[0] if made else None
        for kind in TABLE_KINDS:
            if kind != "send" or size == 2:
                table[kind][size] = points(kind, [consecutive], size)
            if made and kind in crossed:
                crossed[kind][size] = points(kind, made, size)
        dist.barrier()
        for group in made:
            dist.destroy_process_group(group)
    return {k: v for k, v in table.items() if v}, {k: v for k, v in crossed.items() if v}


def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators). A bigger message
    never costs less; a noisy measurement that says so is averaged with its neighbours."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(int(c))]


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
        table, crossed = collective_table()
        warm_up()
        flops, memory, saved, op = matmul_rate(), optimizer_rate(), activation_rate(), op_overhead()
        skew = arrival_skew_seconds()
        ranks = dist.get_world_size()
    else:
        rate, latency, flops, memory, saved, op, table, crossed, skew = _forked(ranks)
    device = _device()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    return Machine(name, flops_per_second=flops, memory_bytes=device_budget(device, local),
                   intra_bytes_per_second=rate, inter_bytes_per_second=rate, intra_latency=latency,
                   inter_latency=latency, gpus_per_node=local, collectives=table, crossed_collectives=crossed,
                   memory_bytes_per_second=memory, activation_bytes_per_second=saved, op_seconds=op,
                   cores=0 if device.type == "cuda" else cpu_cores(), skew_seconds=skew)


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _forked(ranks: int) -> tuple[float, float, float, float, float, float, Table, Table, float]:
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
        table, crossed = collective_table()
        warm_up()
        Path(out).write_bytes(pickle.dumps((rate, latency, matmul_rate(), optimizer_rate(), activation_rate(),
                                            op_overhead(), table, crossed, arrival_skew_seconds())))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (the parent reports the exit code)
        code = 1
    os._exit(code)


def write(machine: Machine, path: str) -> None:
    Path(path).write_text(machine.to_json())

