"""What the fault guards cost a step: the per-call input check, and a checkpoint saved sync or async.

``python -m benchmarks.faults`` runs one torchrun job of 4 gloo ranks (the FC_Net example at tensor (2,1,1) x
data 2) and prints, as ratios to the plain step measured in the same job, interleaved so that drift on a
shared machine falls on both alike:

- ``check_inputs=True`` (every call's inputs compared across the ranks) against ``check_inputs=False``;
- a step that saves a DCP checkpoint (``autopar.save_checkpoint``) synchronously, and one that saves it with
  ``async_save=True`` (the step pays the copy to host memory; a thread writes), against a step without.

    python -m benchmarks --faults [--hidden 1024 --layers 4 --steps 12]   (or python -m benchmarks.faults)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import autopar
    from autopar.examples.fc_net import FC_Net, synthetic_mnist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = list(synthetic_mnist(4, args.batch, args.image, seed=0))
    models = {}
    for check in (True, False):
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=(2, 1, 1), data=2, check_inputs=check):
            model = FC_Net(args.layers, args.hidden, args.image)
        models[check] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    box = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(box)
    root = box[0]

    def step(check: bool, save: str | None, n: int) -> float:
        model, opt = models[check]
        x, y = data[n % len(data)]
        dist.barrier()
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if save is not None:
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            autopar.save_checkpoint(state, os.path.join(root, save), n, keep=2, async_save=save == "async")
        seconds = time.perf_counter() - start
        out = torch.tensor([seconds])
        dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest rank's step
        return float(out)

    kinds = {"checked": (True, None), "unchecked": (False, None), "sync save": (False, "sync"),
             "async save": (False, "async")}
    for name, (check, save) in kinds.items():  # warm-up: capture, plan, the first save's directories
        step(check, save, 0)
    autopar.wait_for_checkpoint()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for n in range(1, args.steps + 1):
        order = list(kinds.items())
        for name, (check, save) in order[n % 4:] + order[:n % 4]:  # (rotated: no kind always follows a save)
            times[name].append(step(check, save, n))
            if save == "async":
                autopar.wait_for_checkpoint()  # (outside the timed step: the write overlaps the next step's work)
    if rank == 0:
        median = {k: statistics.median(v) for k, v in times.items()}
        params = sum(p.numel() for p in FC_Net(args.layers, args.hidden, args.image).parameters())
        print(f"FC_Net {params / 1e6:.1f}M parameters, tensor (2,1,1) x data 2, 4 gloo ranks, median of {args.steps}")
        print(f"plain step (check_inputs=False): {median['unchecked'] * 1e3:.1f} ms")
        print(f"check_inputs=True:  {median['checked'] / median['unchecked']:.3f}x the plain step")
        print(f"step + sync save:   {median['sync save'] / median['unchecked']:.2f}x")
        print(f"step + async save:  {median['async save'] / median['unchecked']:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--image", type=int, default=28)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "benchmarks.faults",
           "--worker", *argv]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
