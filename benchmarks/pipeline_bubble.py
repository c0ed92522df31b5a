"""Measured pipeline bubble against the prediction (p-1)/(m+p-1), in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/pipeline_bubble.py

Each rank first times the serial model's step (forward + backward of the whole batch, one rank
alone per core); then autopar runs the same model and batch on ``pipeline=P`` ranks through
``train_step`` for each schedule and micro-batch count. With perfectly balanced stages and free
transfers a pipelined step would take serial / P, so the measured idle share is

    1 - serial / (P x pipelined step)

which also holds the stages' imbalance, the transfers and the smaller matmuls of micro-batches.
The prediction is the plan's ``bubble_fraction``. gloo on 2 shared cores: read ratios, not seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.examples.fc_net import FC_Net, synthetic_mnist
from benchmarks.teardown import end_job


def median_step(step, batches: list, warmup: int) -> float:
    times = []
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        step(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    shape = dict(num_layers=args.layers, hidden=args.hidden, image_size=32)
    batches = list(synthetic_mnist(args.steps, args.batch, 32, 0))

    torch.manual_seed(0)
    serial = FC_Net(**shape)

    def serial_step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(serial(x), y).backward()
        serial.zero_grad()

    t_serial = median_step(serial_step, batches, args.warmup)
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in args.microbatches:
            if schedule == "1f1b" and m < world:
                continue
            torch.manual_seed(0)
            with autopar.auto_parallelize(pipeline=world, microbatches=m, schedule=schedule):
                model = FC_Net(**shape)

            def step(x: torch.Tensor, y: torch.Tensor, model=model) -> None:
                autopar.train_step(model, x, y, F.cross_entropy)
                model.zero_grad()

            t = median_step(step, batches, args.warmup)
            plan = autopar.plan_of(model).pipeline
            rows.append((schedule, m, plan.bubble_fraction, 1 - t_serial / (world * t), t / t_serial,
                         plan.bottleneck_seconds / plan.lower_bound_seconds))
    if dist.get_rank() == 0:
        print(f"FC_Net layers={args.layers} hidden={args.hidden} batch={args.batch}, pipeline={world}; "
              f"serial step {t_serial * 1e3:.1f} ms")
        print("| schedule | micro-batches | predicted bubble | measured idle share | step / serial | "
              "planned bottleneck / lower bound |")
        print("|---|---|---|---|---|---|")
        for schedule, m, predicted, measured, ratio, balance in rows:
            print(f"| {schedule} | {m} | {predicted:.1%} | {measured:.1%} | {ratio:.2f} | {balance:.3f} |")
    end_job()


if __name__ == "__main__":
    main()
