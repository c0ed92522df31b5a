"""Long sequences on a few ranks: context parallelism (``context=4``) against tensor parallelism with sequence
parallelism (``tensor=(4,1,1)``, ``sequence_parallel=True``) and both (context 2 x tensor 2 with sequence
parallelism) on the same small Llama (hidden 64, 4 heads and 4 key/value heads, so that tensor 4 splits attention
too), batch 1 x 32,768 tokens, in one torchrun job: per grid, the loss of each step (all must equal each other),
the median step time (slowest rank) and the activation peak per rank of one step (``autopar.memory.LiveBytes``),
and the plan's prediction.

    python -m benchmarks.context                       # 4 ranks, 32,768 tokens (a few minutes on 2 CPU cores)
    python -m benchmarks.context --tokens 4096 --steps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRIDS = {"context=4": {"context": 4}, "tensor=(4,1,1) + SP": {"tensor": (4, 1, 1), "sequence_parallel": True},
         "context=2 x tensor=(2,1,1) + SP": {"context": 2, "tensor": (2, 1, 1), "sequence_parallel": True}}


def job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import transformers

    import autopar
    from autopar.memory import LiveBytes
    from autopar.parallel_model import plan_of

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=args.tokens)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, grid in GRIDS.items():
        torch.manual_seed(0)
        with autopar.auto_parallelize(checkpoint="none", **grid):
            model = transformers.LlamaForCausalLM(config)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses, times, peak = [], [], 0
        for step in range(args.warmup + args.steps):
            dist.barrier()
            start = time.perf_counter()
            with LiveBytes() as live:
                loss = model(ids, labels=ids, use_cache=False).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            slowest = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            losses.append(loss.item())
            if step >= args.warmup:
                times.append(float(slowest))
                peak = max(peak, live.peak_bytes(exclude=[p.grad for p in model.parameters() if p.grad is not None]))
        rows.append((name, statistics.median(times), peak, plan_of(model).memory.activation_bytes, losses))
        autopar.detach(model)
    if rank == 0:
        print(f"llama ({args.layers} layers, hidden 64, 4 heads), batch 1 x {args.tokens:,} tokens, "
              f"{dist.get_world_size()} ranks, median of {args.steps} steps")
        print("| grid | step (s) | activation peak per rank (MiB) | planned (MiB) | losses |")
        print("|---|---|---|---|---|")
        for name, t, peak, planned, losses in rows:
            print(f"| {name} | {t:.2f} | {peak / 2**20:.1f} | {planned / 2**20:.1f} | "
                  f"{', '.join(f'{x:.6f}' for x in losses)} |")
        base = rows[1]
        for name, t, peak, _, losses in (rows[0], rows[2]):
            print(f"{name} / tensor+SP: step {t / base[1]:.2f}x, activations {peak / base[2]:.2f}x; losses differ "
                  f"by at most {max(abs(a - b) for a, b in zip(losses, base[4])):.1e}")
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        job(args)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
               "benchmarks.context", "--job", "--tokens", str(args.tokens), "--layers", str(args.layers),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return subprocess.run(command, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
