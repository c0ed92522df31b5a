"""One benchmark job: every system on one model and one world size, under torchrun.

    torchrun --nproc-per-node W -m benchmarks.job --model fc_net --systems serial ddp autopar:d4 --out r.json

``python -m benchmarks`` launches these; run one by hand to debug a configuration. For each system, on
every rank: build it (same seed), time ``warmup + steps`` training steps (the median over the measured
steps of the slowest rank's time), then run one more step under ``measure.Instrument`` for the
communicated bytes and the peak memory. Rank 0 rewrites the JSON file after each system and prints
``@@done <system>`` for the launcher's progress bar.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import json
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.planning.calibrate import cpu_cores
from autopar.memory import device_budget
from passes.analysis.machine import Machine
from passes.analysis.search_plans import plan_seconds

from autopar.memory import bytes_in_use
from benchmarks.measure import Instrument, calibrate, compute_rates, slowest_median, timed
from benchmarks.models import SIZES, BenchModel, NotApplicable, bench_model
from benchmarks.systems import Context, build, param_bytes, parse_grid
from benchmarks.teardown import end_job


def _gathered(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _global_losses(shares: list[torch.Tensor], device: torch.device) -> list[float]:
    t = torch.stack([s.to(device=device, dtype=torch.float64) for s in shares])
    dist.all_reduce(t)
    return t.tolist()


def _predicted(bm: BenchModel, system: str, ctx: Context, x: torch.Tensor, hardware: Machine
               ) -> dict[str, float | None]:
    """What ``python -m autopar.trace`` predicts for this rank: bytes sent per step, and the step time
    under this machine's calibrated rates."""
    from autopar.planning.planner import plan_model

    grid = parse_grid(system.split(":", 1)[1], ctx.world)
    with torch.device("meta"):
        shadow = bm.build()
    config = autopar.ParallelConfig(grid.data, *grid.tensor, pipeline=grid.pipeline,
                                    shard_optimizer=grid.shard_optimizer, sequence_parallel=grid.sequence_parallel,
                                    expert_parallel=grid.expert_parallel)
    if grid.per_rank:  # fed like DDP: this rank's slice is its own batch
        x = x.tensor_split(ctx.world)[ctx.rank]
    plan, report = plan_model(shadow, (x,), config, rank=ctx.rank, pipeline=grid.pipeline,
                              microbatches=ctx.microbatches if grid.pipeline > 1 else 1, per_rank=grid.per_rank)
    step = plan_seconds(plan, report, hardware)
    return {"predicted_bytes": float(report.comm_bytes_per_step), "predicted_seconds": step.total,
            "predicted_all_to_all": float(report.comm_bytes_by_kind.get("all_to_all", 0))}


def _preload(bm: BenchModel, device: torch.device) -> None:
    """Imports and the first collective's setup, before any memory baseline: no system pays for them."""
    for name in ("torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.tensor.parallel",
                 "autopar.planning.planner"):
        importlib.import_module(name)
    with torch.device("meta"):
        bm.build()  # imports the model's modules (transformers)
    dist.all_reduce(torch.zeros(1, device=device))


def run_system(system: str, bm: BenchModel, ctx: Context, batches: list, warmup: int,
               hardware: Machine) -> dict[str, Any]:
    gc.collect()
    rates = compute_rates(ctx.device) if system.startswith("autopar:") else {}
    base = bytes_in_use(ctx.device)
    try:
        runner = build(system, bm, ctx)
    except NotApplicable as e:  # raised on every rank alike, before any collective
        return {"system": system, "status": "n/a", "reason": str(e)}
    times, shares = [], []
    for x, y in batches[:-1]:
        seconds, share = timed(functools.partial(runner.train, x, y), ctx.device)
        times.append(seconds)
        shares.append(share)
    result: dict[str, Any] = {"system": system, "status": "ok",
                              "step_seconds": slowest_median(times[warmup:], ctx.device),
                              "losses": _global_losses(shares, ctx.device)}
    model = runner.info.get("model")
    if model is not None:  # this grid's prediction on the rates measured just before it ran
        hardware = dataclasses.replace(hardware, **rates)
        result["calibration"] = rates
    autopar.reset_comm_stats()
    with Instrument(ctx.device) as inst:
        runner.train(*batches[-1])
    rank = {"peak_bytes": inst.peak - base,
            "param_bytes": param_bytes(runner.modules),
            "comm_bytes": float(inst.total),
            "comm_by_kind": {k: float(v) for k, v in inst.bytes.items()},
            "comm_calls": inst.calls,
            "uncounted_ops": sorted(inst.unknown)}
    if model is not None:
        rank["autopar_comm_stats"] = autopar.comm_stats()["total"]
        rank.update(_predicted(bm, system, ctx, batches[0][0], hardware))
        rank["plan"] = autopar.plan_of(model).summary() if ctx.rank == 0 else None
    result["ranks"] = _gathered(rank)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--size", default="tiny", choices=SIZES)
    p.add_argument("--systems", nargs="+", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx = Context(world, rank, device, args.microbatches or 2 * world, args.schedule)
    bm = bench_model(args.model, args.size)
    _preload(bm, device)
    rates = calibrate(device)
    # the plan search's machine model on this run's rates (one node: every link alike)
    hardware = Machine("measured", rates["flops_per_second"], device_budget(device, world),
                       intra_bytes_per_second=rates["bytes_per_second"], inter_bytes_per_second=rates["bytes_per_second"],
                       intra_latency=rates["collective_seconds"], inter_latency=rates["collective_seconds"],
                       gpus_per_node=world, memory_bytes_per_second=rates["memory_bytes_per_second"],
                       activation_bytes_per_second=rates["activation_bytes_per_second"], op_seconds=rates["op_seconds"],
                       collectives=rates["collectives"], crossed_collectives=rates["crossed_collectives"],
                       cores=0 if cuda else cpu_cores(), skew_seconds=rates.get("skew_seconds", 0.0))
    batches = [(x.to(device), y.to(device)) for x, y in bm.make_batches(args.warmup + args.steps + 1,
                                                                         args.batch or bm.batch)]
    report: dict[str, Any] = {"model": bm.name, "size": bm.size, "world": world, "batch": args.batch or bm.batch,
                              "steps": args.steps, "warmup": args.warmup, "microbatches": ctx.microbatches,
                              "schedule": ctx.schedule, "device": str(device.type),
                              "backend": dist.get_backend(), "threads": torch.get_num_threads(), "calibration": rates, "systems": []}
    for system in args.systems:
        try:
            result = run_system(system, bm, ctx, batches, args.warmup, hardware)
        except Exception:
            # Another rank may be inside a collective: stop the job (torchrun ends the others).
            print(f"@@failed {system}\n{traceback.format_exc()}", flush=True)
            raise
        report["systems"].append(result)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
            print(f"@@done {system}", flush=True)
    end_job()


if __name__ == "__main__":
    main()
