"""``python -m benchmarks --simulate W --decode``: one rank's greedy decoding of W-rank grids, on this one device.

As ``benchmarks.simulate`` does for a training step, each grid's rank 0 runs under torch's fake process group
(every collective a no-op): the time per token is what this device spends as one of W ranks, before any
communication. The model is ``autopar.examples.gpu_check``'s HF Llama in fp32 (issue 34's decode
measurement), decoding greedily with HF's static cache (``generate(..., cache_implementation="static")``),
batch 1, a 16-token prompt, 48 new tokens. Rows, each in a child process:

- the whole model: eager, and as HF compiles it (``generate`` with a static cache on CUDA compiles the
  forward with ``torch.compile(mode="reduce-overhead")``: Inductor and CUDA graphs);
- each grid's rank 0 with ``compile=False`` (op by op), ``compile="auto"`` (the default: the decode step
  replayed as a CUDA graph of the eager per-rank graph, ``autopar.runtime.graphed``) and ``compile=True``
  (Inductor for the decode step's sizes, then replayed as a CUDA graph).

ms/token is the median time between consecutive forwards of a warm ``generate()`` (each stamped after a
device synchronize), so steps that compile or capture do not count; the table also gives it against the
whole model's compiled decode (the issue's goal: a rank of 4 at <= 0.5x). On the CPU there are no CUDA
graphs: only the eager and Inductor rows differ.

    python -m benchmarks --simulate 4 --decode
    python -m benchmarks --simulate 4 --decode --size tiny --device cpu --grids t4x1x1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from autopar.examples.gpu_check import SIZES, build_llama, pick_device
from benchmarks.systems import parse_grid

SERIAL, HF_COMPILED = "serial", "serial-compiled"
MODES = {"eager": False, "graphs": "auto", "compiled": True}
PROMPT, NEW_TOKENS = 16, 48


def per_token_ms(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    """Median ms between consecutive forwards of a greedy static-cache ``generate()`` (after one warm-up call)."""
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")
    stamps: list[float] = []

    def stamp(*_: Any) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stamps.append(time.perf_counter())

    with torch.no_grad():
        model.generate(ids, **kw)  # compiles, captures (a second generate captures again: a new cache)
        handle = model.register_forward_pre_hook(stamp)
        try:
            out = model.generate(ids, **kw)
        finally:
            handle.remove()
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # decode steps (the first forward is the prompt's)
    return statistics.median(steps) * 1e3, out


def child(args: argparse.Namespace) -> dict[str, Any]:
    from autopar.compat import fake_store

    device = pick_device(args.device)
    vocab = SIZES[args.size][5]
    ids = torch.randint(1, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    torch.manual_seed(0)
    if args.child in (SERIAL, HF_COMPILED):
        model = build_llama(args.size).to(device).eval()
        if args.child == SERIAL:
            model.generation_config.disable_compile = True
        ms, _ = per_token_ms(model, ids, device)
        return {"ms": ms}
    import autopar
    from autopar.parallel_model import runtime_of

    text, _, mode = args.child.partition(":")
    grid = parse_grid(text, args.world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=args.world)
    with autopar.auto_parallelize(tensor=grid.tensor, data=grid.data, compile=MODES[mode]):
        model = build_llama(args.size)
    model.to(device).eval()
    notes: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: notes.append(record.getMessage()[:300])  # type: ignore[method-assign]
    logging.getLogger("autopar").addHandler(handler)
    ms, _ = per_token_ms(model, ids, device)
    runtime = runtime_of(model)
    return {"ms": ms, "replays": runtime.graph_replays(), "notes": notes[:3],
            "compiled_runs": sum(g.compiled_runs for g in runtime.compiled_graphs())}


def run_row(args: argparse.Namespace, key: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.simulate_decode", "--child", key, "--world", str(args.world),
           "--size", args.size, "--device", args.device]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"error": tail[0][:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]], header: str) -> str:
    compiled = next((r["ms"] for r in rows if r["row"] == HF_COMPILED and "ms" in r), None)
    cols = ("row", "ms/token", "vs whole model compiled", "replayed steps")
    body = []
    for r in rows:
        if "error" in r:
            body.append((r["label"], f"failed: {r['error']}", "", ""))
            continue
        body.append((r["label"], f"{r['ms']:.2f}", f"{r['ms'] / compiled:.2f}x" if compiled else "",
                     str(r["replays"]) if "replays" in r else ""))
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([header, "", line(cols), line(["-" * w for w in widths]), *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks --simulate W --decode", description=__doc__.splitlines()[0])
    p.add_argument("--world", "--simulate", dest="world", type=int, default=4, help="simulated world size W")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help="default: medium on CUDA, tiny on the CPU")
    p.add_argument("--grids", nargs="+", default=None, metavar="GRID", help="tensor grids (default: t<W>x1x1 t1x<W>x1)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=tuple(MODES))
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each row's child process")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    args.device = device.type
    args.size = args.size or ("medium" if device.type == "cuda" else "tiny")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.child is not None:
        print(json.dumps(child(args)))
        return 0
    grids = args.grids or [f"t{args.world}x1x1", f"t1x{args.world}x1"]
    for g in grids:
        try:
            grid = parse_grid(g, args.world)
        except ValueError as e:
            p.error(str(e))
        if grid.pipeline > 1:
            p.error(f"grid {g!r} has a pipeline, which the fake process group cannot carry: simulate t... and d... grids.")
    rows = [(SERIAL, "whole model, eager"), (HF_COMPILED, "whole model, HF's compiled decode (reduce-overhead)")]
    rows += [(f"{g}:{m}", f"autopar {g} rank 0, compile={MODES[m]!r}") for g in grids for m in args.modes]
    out = []
    for key, label in rows:
        got = {"row": key, "label": label, **run_row(args, key)}
        out.append(got)
        print(f"  {label}: {got.get('ms', got.get('error'))} {' | '.join(got.get('notes', []))}", file=sys.stderr,
              flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    hidden, layers = SIZES[args.size][:2]
    header = (f"simulated decode, rank 0 of {args.world} ranks on one {name} (torch {torch.__version__}): {args.size} "
              f"Llama (hidden {hidden}, {layers} layers), fp32, batch 1, prompt {PROMPT}, {NEW_TOKENS} new tokens, "
              "static cache")
    print(table(out, header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "size": args.size, "device": name, "rows": out}, f, indent=1)
    return 1 if any("error" in r for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())
