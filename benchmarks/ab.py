"""autopar against an earlier revision of itself, in the same processes: what a change costs per step.

    python -m benchmarks.ab --base c609322 --models gpt2 llama --grids t4x1x1 t2x2x1 --steps 20

Separate runs of ``python -m benchmarks`` on these shared 2-core machines differ by up to 30% with the
same code, so a few percent cannot be read off two runs. This script exports ``--base``'s ``autopar``
and ``passes`` as the packages ``autopar_base`` and ``passes_base`` (imports rewritten), and one
torchrun job builds the same model (same seed) under both, on the same grid, then times their
training steps interleaved (base, this checkout, this checkout, base, ...): every pair ran on the
same machine state. It reports each side's median step (slowest rank) and the median of the per-pair
ratios, and checks the two sides' losses agree (1e-4 relative).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import interleaved
from benchmarks.interleaved import ROOT
from benchmarks.teardown import end_job
_PACKAGES = ("autopar", "passes")


def export_base(rev: str, into: Path) -> None:
    """``rev``'s autopar and passes under ``into`` as autopar_base and passes_base."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *_PACKAGES], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    pattern = re.compile(r"\b(autopar|passes)(?=[.\s])")
    for name in _PACKAGES:
        (into / name).rename(into / f"{name}_base")
    for path in into.rglob("*.py"):
        lines = []
        for line in path.read_text().splitlines(keepends=True):
            if re.match(r"\s*(from|import)\s", line):
                line = pattern.sub(lambda m: m.group(1) + "_base", line)
            lines.append(line)
        path.write_text("".join(lines))


def _job(args: argparse.Namespace) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    world, rank = interleaved.start()
    sides = {"base": importlib.import_module("autopar_base"), "head": importlib.import_module("autopar")}
    rows = []
    for model_name, bm, batches, text, grid in interleaved.cases(args, world):
        built = {}
        for side, ap in sides.items():
            torch.manual_seed(0)
            extra = {k: True for k, on in (("shard_optimizer", grid.shard_optimizer),
                                           ("sequence_parallel", grid.sequence_parallel)) if on}
            with ap.auto_parallelize(tensor=grid.tensor, data=grid.data, pipeline=grid.pipeline, **extra):
                model = bm.build()
            built[side] = (ap, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        times: dict[str, list[float]] = {"base": [], "head": []}
        losses: dict[str, list[float]] = {"base": [], "head": []}
        for step, (x, y) in enumerate(batches):
            order = ("base", "head") if step % 2 == 0 else ("head", "base")
            for side in order:
                ap, model, opt = built[side]
                dist.barrier()
                start = time.perf_counter()
                if grid.pipeline > 1:
                    loss = ap.train_step(model, x, y, torch.nn.functional.cross_entropy)
                else:
                    loss = bm.loss(model(x), y)
                    loss.backward()
                opt.step()
                opt.zero_grad()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= args.warmup:
                    times[side].append(float(elapsed))
                losses[side].append(float(loss.detach()))
        ratios = [h / b for h, b in zip(times["head"], times["base"])]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses["head"], losses["base"]))
        rows.append((model_name, text, statistics.median(times["base"]), statistics.median(times["head"]),
                     statistics.median(ratios), loss_err))
        del built
    if rank == 0:
        print("| model | grid | base step (ms) | this checkout (ms) | median per-step ratio | losses agree |")
        print("|---|---|---:|---:|---:|---|")
        for m, g, b, h, r, e in rows:
            print(f"| {m} | {g} | {b * 1e3:.1f} | {h * 1e3:.1f} | {r:.3f} | {'yes' if e < 1e-4 else f'NO ({e:.1e})'} |")
    end_job()


def main(argv: list[str] | None = None) -> int:
    p = interleaved.parser(__doc__.split("\n\n")[0], ["t4x1x1", "t2x2x1", "t1x1x4", "p4", "d4"], 20)
    p.add_argument("--base", required=True, help="the git revision to compare against (e.g. a commit)")
    args = p.parse_args(argv)
    if args.job:
        return interleaved.run("benchmarks.ab", args, _job)
    with tempfile.TemporaryDirectory() as tmp:
        export_base(args.base, Path(tmp))
        return interleaved.run("benchmarks.ab", args, _job, extra=["--base", args.base], path=[tmp])


if __name__ == "__main__":
    raise SystemExit(main())
