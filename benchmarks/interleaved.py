"""What ``benchmarks.ab`` and ``benchmarks.paired`` share: their command line and the torchrun job they
re-launch themselves in (``--job``), one process per rank."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parser(description: str, grids: Sequence[str], steps: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", nargs="+", default=["fc_net", "gpt2", "llama"])
    p.add_argument("--grids", nargs="+", default=list(grids))
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    return p


def start() -> tuple[int, int]:
    """Inside the job: the gloo group, one thread per rank; (world size, rank)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_world_size(), dist.get_rank()


def cases(args: argparse.Namespace, world: int) -> Iterator[tuple[str, Any, list, str, Any]]:
    """(model name, its bench model, the batches of warm-up and measured steps, grid text, grid) for every
    model and grid asked for."""
    from benchmarks.models import bench_model
    from benchmarks.systems import parse_grid

    for model_name in args.models:
        bm = bench_model(model_name, "tiny")
        batches = bm.make_batches(args.warmup + args.steps, bm.batch)
        for text in args.grids:
            yield model_name, bm, batches, text, parse_grid(text, world)


def run(module: str, args: argparse.Namespace, job: Callable[[argparse.Namespace], None],
        extra: Sequence[str] = (), path: Sequence[str] = ()) -> int:
    """With ``--job`` (inside torchrun): runs ``job``. Otherwise launches ``module --job`` on
    ``--world-size`` ranks with the same options (``extra`` added; ``path`` first on PYTHONPATH)."""
    if args.job:
        job(args)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [*path, str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
               "-m", module, "--job", *extra, "--models", *args.models, "--grids", *args.grids,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return subprocess.run(command, env=env, cwd=ROOT).returncode
