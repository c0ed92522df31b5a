"""Step time and bytes of autopar grids against DDP on FC_Net, measured in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/comm_vs_ddp.py --tensor 2 2 1

Prints, on rank 0, the median step time of autopar and of DDP (same model, batch and world size)
and their ratio, plus autopar's bytes per step. gloo on 2 shared cores: read ratios, not seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar.examples.fc_net import FC_Net, synthetic_mnist


def timed_steps(model: torch.nn.Module, batches: list, warmup: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tensor", type=int, nargs=3, default=(2, 2, 1))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batches = list(synthetic_mnist(args.steps, args.batch_size, 28))

    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=args.tensor):
        model = FC_Net(args.num_layers, args.hidden, 28)
    autopar.reset_comm_stats()
    ours = timed_steps(model, batches, args.warmup)
    bytes_per_step = autopar.comm_stats()["total"] / args.steps

    torch.manual_seed(0)
    ddp = DistributedDataParallel(FC_Net(args.num_layers, args.hidden, 28))
    # DDP takes a per-rank batch: give it this rank's slice of the same global batch.
    world, rank = dist.get_world_size(), dist.get_rank()
    local = [(x.tensor_split(world)[rank], y.tensor_split(world)[rank]) for x, y in batches]
    theirs = timed_steps(ddp, local, args.warmup)
    if rank == 0:
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"autopar tensor={tuple(args.tensor)}: {a * 1e3:.1f} ms/step, {bytes_per_step:,.0f} B/step/rank")
        print(f"DDP on {world} ranks:        {b * 1e3:.1f} ms/step")
        print(f"ratio autopar/DDP: {a / b:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
