"""``python -m benchmarks --inference``: greedy ``generate()`` latency of serial, DTensor TP and autopar grids.

One torchrun job per model (gloo on CPU, NCCL with CUDA) runs every system on the same model and prompt
(batch 2) and measures, timing each forward of HF's own greedy loop (a forward pre-hook):

- ``cold first token``: the first ``generate()`` of a fresh model, prompt to its first new token
  (autopar captures and plans here);
- ``warm per token``: the median time between tokens of a second ``generate()`` with that prompt;
- ``new length first token``: a third ``generate()`` with a prompt of another length, to its first new
  token (a new shape: autopar's captures with symbolic sequence sizes should make it as fast as warm);
- ``tokens/s`` of the warm run, and whether its tokens equal serial's.

    python -m benchmarks --inference
    python -m benchmarks --inference --models llama --world-sizes 2 --grids t2x1x1 t1x2x1 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.teardown import end_job

ROOT = Path(__file__).resolve().parents[1]


def _timed(model: Any, ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, float, list[float]]:
    """Generates ``tokens`` greedily; returns the output, the first token's latency, and each later token's
    time (a forward per token, timed around HF's own loop through a forward pre-hook)."""
    stamps: list[float] = []
    handle = model.register_forward_pre_hook(lambda *a: stamps.append(time.perf_counter()))
    try:
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        end = time.perf_counter()
    finally:
        handle.remove()
    stamps.append(end)
    first = stamps[1] - start if len(stamps) > 1 else end - start  # the prefill forward: to the first token
    return out, first, [b - a for a, b in zip(stamps[1:], stamps[2:])]


def _dtensor_tp(model: Any, world: int) -> Any:
    """Megatron-style TP with torch's own ``parallelize_module`` (q/k/v and gate/up column-wise, o/down
    row-wise; embeddings and head replicated), for Llama-like models; None for others."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return None
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world,))
    for layer in layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return model


def job(args: argparse.Namespace) -> None:
    """One model, every system, on the ranks torchrun started."""
    import torch.distributed as dist

    import autopar
    from autopar.examples import zoo
    from benchmarks.systems import parse_grid

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    prompts = [torch.randint(1, 100, (2, n), generator=torch.Generator().manual_seed(n)) for n in (args.prompt,
                                                                                                    args.prompt + 5)]
    rows, reference = [], None
    for system in ["serial", "dtensor-tp", *[f"autopar:{g}" for g in args.grids]]:
        torch.manual_seed(0)
        if system.startswith("autopar:"):
            grid = parse_grid(system.split(":", 1)[1], world)
            with autopar.auto_parallelize(tensor=grid.tensor, data=grid.data):
                model = zoo.build_model(args.model)
        else:
            model = zoo.build_model(args.model)
            if system == "dtensor-tp" and _dtensor_tp(model, world) is None:
                continue
        model.eval()
        with torch.no_grad():
            out, cold, _ = _timed(model, prompts[0], args.tokens)
            out, _, per_token = _timed(model, prompts[0], args.tokens)
            _, new_length, _ = _timed(model, prompts[1], args.tokens)
        reference = out if reference is None else reference
        warm = statistics.median(per_token)
        rows.append({"system": system, "cold_first_token_s": cold, "warm_per_token_s": warm,
                     "new_length_first_token_s": new_length, "tokens_per_s": prompts[0].shape[0] / warm,
                     "tokens_equal_serial": bool(torch.equal(out, reference))})
        dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"model": args.model, "world": world, "tokens": args.tokens,
                                              "prompt": args.prompt, "systems": rows}, indent=1))
    end_job()


def table(results: list[dict]) -> str:
    lines = ["| model | ranks | system | cold first token | warm per token | new length first token | tokens/s "
             "| tokens = serial |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for s in r["systems"]:
            lines.append(f"| {r['model']} | {r['world']} | {s['system']} | {s['cold_first_token_s'] * 1e3:.0f} ms "
                         f"| {s['warm_per_token_s'] * 1e3:.1f} ms | {s['new_length_first_token_s'] * 1e3:.0f} ms "
                         f"| {s['tokens_per_s']:.0f} | {'yes' if s['tokens_equal_serial'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks --inference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama", "gpt2"])
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2], metavar="W")
    p.add_argument("--grids", nargs="+", default=None, help="autopar grids (default: t<W>x1x1 and t1x<W>x1)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per generate() (default 32)")
    p.add_argument("--prompt", type=int, default=16, help="prompt length (default 16; the new-length run adds 5)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        job(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    results, failed = [], False
    for world in args.world_sizes:
        grids = args.grids or [f"t{world}x1x1", f"t1x{world}x1"]
        for model in args.models:
            out = args.out / f"inference-{model}-w{world}.json"
            out.unlink(missing_ok=True)
            code = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc-per-node={world}", "-m", "benchmarks.inference", "--job",
                                    "--model", model, "--tokens", str(args.tokens), "--prompt", str(args.prompt),
                                    "--grids", *grids, "--out", str(out)], cwd=ROOT, env=env)
            if code != 0 or not out.exists():
                print(f"{model} on {world} ranks failed (exit {code})", file=sys.stderr)
                failed = True
                continue
            results.append(json.loads(out.read_text()))
    text = table(results)
    (args.out / "inference.md").write_text(text)
    print(text)
    return 1 if failed or any(not s["tokens_equal_serial"] for r in results for s in r["systems"]) else 0


if __name__ == "__main__":
    sys.exit(main())
