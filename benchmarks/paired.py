"""autopar grids against the peer that runs the same plan, their steps interleaved in one job.

    python -m benchmarks.paired --models gpt2 llama --grids d4 t4x1x1 --steps 40

``python -m benchmarks`` times each system after the previous one; on these shared 2-core machines
that order alone moves a ratio by up to 15%. Here each autopar grid and its same-plan peer (DDP for
``d<N>``, FSDP2 for ``t1x1x<N>``, DTensor TP for ``t<N>x1x1``, torch pipelining for ``p<N>``) are
built side by side and their steps alternate (peer, autopar, autopar, peer, ...), so every pair of
steps ran on the same machine state. Each side is fed exactly as in ``python -m benchmarks`` (a
data-only grid like the DDP script: each rank its slice). Reported: each side's median step (slowest
rank) and the median of the per-step ratios autopar / peer.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import interleaved
from benchmarks.teardown import end_job


def _job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.models import NotApplicable
    from benchmarks.systems import Context, build

    world, rank = interleaved.start()
    ctx = Context(world, rank, torch.device("cpu"), 2 * world, "1f1b")
    rows = []
    for model_name, bm, batches, text, grid in interleaved.cases(args, world):
        peer = grid.same_plan_peer()
        if peer is None:
            continue
        try:
            sides = {"peer": build(peer, bm, ctx), "autopar": build(f"autopar:{text}", bm, ctx)}
        except NotApplicable as e:
            rows.append((model_name, text, peer, None, None, None, str(e)))
            continue
        times: dict[str, list[float]] = {"peer": [], "autopar": []}
        for step, (x, y) in enumerate(batches):
            for side in (("peer", "autopar") if step % 2 == 0 else ("autopar", "peer")):
                dist.barrier()
                start = time.perf_counter()
                sides[side].train(x, y)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= args.warmup:
                    times[side].append(float(elapsed))
        ratios = [a / p for a, p in zip(times["autopar"], times["peer"])]
        rows.append((model_name, text, peer, statistics.median(times["peer"]), statistics.median(times["autopar"]),
                     statistics.median(ratios), ""))
        del sides
    if rank == 0:
        print("| model | grid | peer | peer step (ms) | autopar step (ms) | median per-step ratio autopar / peer |")
        print("|---|---|---|---:|---:|---:|")
        for m, g, peer, p, a, r, why in rows:
            if p is None:
                print(f"| {m} | {g} | {peer} | n/a: {why} | | |")
            else:
                print(f"| {m} | {g} | {peer} | {p * 1e3:.1f} | {a * 1e3:.1f} | {r:.3f} |")
    end_job()


def main(argv: list[str] | None = None) -> int:
    args = interleaved.parser(__doc__.split("\n\n")[0], ["d4", "t4x1x1", "t1x1x4", "p4"], 40).parse_args(argv)
    return interleaved.run("benchmarks.paired", args, _job)


if __name__ == "__main__":
    raise SystemExit(main())
