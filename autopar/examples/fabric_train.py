"""The SC'24 AxoNN tutorial's Lightning Fabric loop, on autopar (a tiny nanoGPT on random tokens).

    python -m autopar.examples.fabric_train --devices 4 --tensor 2 1 1     # Fabric launches the processes
    torchrun --nproc-per-node 4 -m autopar.examples.fabric_train --devices 4 --tensor 2 1 1
    python -m autopar.examples.fabric_train --devices 1                     # the serial run to compare
    python -m autopar.examples.fabric_train --accelerator cuda --devices 2 --tensor 2 1 1   # GPUs (NCCL)

The loop is the tutorial's: ``init_module(empty_init=True)``, ``fabric.setup``, a DistributedSampler over
every rank with ``gbs // acc // world_size`` rows per device, ``no_backward_sync`` for accumulation,
``fabric.backward``, ``fabric.clip_gradients``, ``fabric.save``. Rank 0 prints each step's loss (averaged
over the ranks), the same with any grid as with ``--devices 1``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from autopar.examples.nanogpt import GPTConfig, NanoGPT
from autopar.lightning import AutoparStrategy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"), help="cuda: a GPU per rank, NCCL")
    p.add_argument("--tensor", type=int, nargs=3, default=(1, 1, 1), metavar=("ROW", "COL", "DEPTH"))
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save", default=None, help="a directory for fabric.save's checkpoint")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    row, col, depth = args.tensor
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, precision="32-true",
                      strategy=AutoparStrategy(G_intra_r=row, G_intra_c=col, G_intra_d=depth))
    fabric.launch()
    acc = args.gradient_accumulation_steps
    per_device = args.global_batch_size // acc // fabric.world_size

    g = torch.Generator().manual_seed(0)
    rows = args.global_batch_size * args.steps
    tokens = torch.randint(0, 128, (rows, 17), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=per_device)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=True)

    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = NanoGPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)

    total = torch.zeros((), device=fabric.device)
    for i, (x, y) in enumerate(loader):
        last = (i + 1) % acc == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = model(x, y)[1] / acc
            fabric.backward(loss)
        total += loss.detach()
        if last:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            mean = fabric.all_reduce(total, reduce_op="mean")
            fabric.print(f"step {(i + 1) // acc} loss {mean.item():.6f}")
            total = torch.zeros((), device=fabric.device)
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": args.steps})
        fabric.print(f"saved {args.save}")


if __name__ == "__main__":
    main()
