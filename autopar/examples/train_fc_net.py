"""Trains the AxoNN tutorial's FC_Net on synthetic MNIST-shaped data with autopar.

    torchrun --nproc-per-node 4 -m autopar.examples.train_fc_net --tensor 2 2 1 --data 1

The training loop is the serial one, unchanged: every rank reads the same global batch, and the
printed losses are the serial script's (run it with --serial to compare).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.examples.fc_net import TUTORIAL, FC_Net, synthetic_mnist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor", type=int, nargs=3, default=(1, 1, 1), metavar=("ROW", "COL", "DEPTH"))
    p.add_argument("--data", type=int, default=None, help="default: the ranks tensor= leaves")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-layers", type=int, default=TUTORIAL["num_layers"])
    p.add_argument("--hidden", type=int, default=TUTORIAL["hidden"])
    p.add_argument("--image-size", type=int, default=TUTORIAL["image_size"])
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serial", action="store_true", help="run the plain serial script (one process)")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    torch.manual_seed(args.seed)
    if args.serial:
        model = FC_Net(args.num_layers, args.hidden, args.image_size)
        rank = 0
    else:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank = dist.get_rank()
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        with autopar.auto_parallelize(tensor=args.tensor, data=args.data):
            model = FC_Net(args.num_layers, args.hidden, args.image_size)
        if torch.cuda.is_available():
            model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    device = next(model.parameters()).device
    for step, (x, y) in enumerate(synthetic_mnist(args.steps, args.batch_size, args.image_size, args.seed)):
        start = time.perf_counter()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and not args.serial and rank == 0:
            print(autopar.plan_of(model).summary(), flush=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} time {time.perf_counter() - start:.3f}s", flush=True)
    if not args.serial:
        dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
