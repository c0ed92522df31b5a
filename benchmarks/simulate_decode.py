"""``python -m benchmarks --simulate W --decode``: one rank's greedy decoding of W-rank grids, on this one device.

As ``benchmarks.simulate`` does for a training step, each grid's rank 0 runs under torch's fake process group
(every collective a no-op): the time per token is what this device spends as one of W ranks, before any
communication. The model is ``autopar.examples.gpu_check``'s HF Llama in fp32 (issue 34's decode
measurement), decoding greedily with HF's static cache (``generate(..., cache_implementation="static")``),
batch 1, a 16-token prompt, 48 new tokens. Rows, each in a child process:

- the whole model: eager, and as HF compiles it (``generate`` with a static cache on CUDA compiles the
  forward with ``torch.compile(mode="reduce-overhead")``: Inductor and CUDA graphs);
- each grid's rank 0 with ``compile=False`` (op by op), ``compile="auto"`` (the default: the decode step
  compiled by Inductor for its sizes and replayed as a CUDA graph, ``autopar.runtime.compiled.cuda_graphs``) and
  ``compile=True`` (the same, and the prompt's call compiled too).

The fake process group computes nothing across ranks (a gathered logit row holds only this rank's share),
so these rows time a rank; they do not check its tokens (``gpu_check`` and the tests do).

ms/token is the median time between consecutive forwards of a warm ``generate()`` (each stamped after a
device synchronize), so steps that compile or capture do not count; the table also gives it against the
whole model's compiled decode (the issue's goal: a rank of 4 at <= 0.5x). On CUDA, "device busy" is the
kernels' time per token of one more ``generate()`` (torch.profiler): ms/token minus it is roughly the
Python per step. On the CPU there are no CUDA graphs: only the eager and Inductor rows differ.

    python -m benchmarks --simulate 4 --decode
    python -m benchmarks --simulate 4 --decode --size tiny --device cpu --grids t4x1x1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from autopar.examples.gpu_check import SIZES, build_llama, pick_device, profile_step
from benchmarks.simulate import check_grids, markdown, parser, report, run_child, settle
from benchmarks.systems import parse_grid

SERIAL, HF_COMPILED = "serial", "serial-compiled"
MODES = {"eager": False, "graphs": "auto", "compiled": True}
PROMPT, NEW_TOKENS = 16, 48
GENERATE = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")


def per_token_ms(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    """Median ms between consecutive forwards of a greedy static-cache ``generate()`` (after one warm-up call)."""
    kw = GENERATE
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


def device_ms_per_token(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> float | None:
    """The device's busy time per token of one more ``generate()`` (its kernels' time over the new tokens,
    summed as the training table sums it: ``gpu_check.profile_step``, without ``record_function`` spans):
    what the time per token would be without Python. None on the CPU."""
    if device.type != "cuda":
        return None

    def generate() -> None:
        with torch.no_grad():
            model.generate(ids, **GENERATE)

    try:
        total = profile_step(generate, device)["device_ms"]
    except Exception as e:  # noqa: BLE001 (a profiler that cannot trace here: the column stays empty)
        print(f"device busy time not measured: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return total / NEW_TOKENS


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
        return {"ms": ms, "device_ms": device_ms_per_token(model, ids, device)}
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
    busy = device_ms_per_token(model, ids, device)  # (a third generate(): replayed too, if the profiler allows)
    runtime = runtime_of(model)
    return {"ms": ms, "replays": runtime.graph_replays(), "notes": notes[:3], "device_ms": busy,
            "compiled_runs": sum(g.compiled_runs for g in runtime.compiled_graphs())}


def table(rows: list[dict[str, Any]], header: str) -> str:
    compiled = next((r["ms"] for r in rows if r["row"] == HF_COMPILED and "ms" in r), None)
    cols = ("row", "ms/token", "vs whole model compiled", "replayed steps", "device busy ms/token")
    body = []
    for r in rows:
        if "error" in r:
            body.append((r["label"], f"failed: {r['error']}", "", "", ""))
            continue
        busy = r.get("device_ms")
        body.append((r["label"], f"{r['ms']:.2f}", f"{r['ms'] / compiled:.2f}x" if compiled else "",
                     str(r["replays"]) if "replays" in r else "", f"{busy:.2f}" if busy is not None else ""))
    return markdown(header, cols, body)


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m benchmarks --simulate W --decode", __doc__.splitlines()[0], "medium",
               "tensor grids (default: t<W>x1x1 t1x<W>x1)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=tuple(MODES))
    args = p.parse_args(argv)
    device = settle(args, "medium")
    if args.child is not None:
        print(json.dumps(child(args)))
        return 0
    grids = args.grids or [f"t{args.world}x1x1", f"t1x{args.world}x1"]
    check_grids(p, grids, args.world)
    rows = [(SERIAL, "whole model, eager"), (HF_COMPILED, "whole model, HF's compiled decode (reduce-overhead)")]
    rows += [(f"{g}:{m}", f"autopar {g} rank 0, compile={MODES[m]!r}") for g in grids for m in args.modes]
    out = []
    for key, label in rows:
        got = {"row": key, "label": label, **run_child("benchmarks.simulate_decode", key, args)}
        out.append(got)
        print(f"  {label}: {got.get('ms', got.get('error'))} {' | '.join(got.get('notes', []))}", file=sys.stderr,
              flush=True)
    return report(args, device, out, "simulated decode,",
                  f"fp32, batch 1, prompt {PROMPT}, {NEW_TOKENS} new tokens, static cache", lambda h: table(out, h))

if __name__ == "__main__":
    sys.exit(main())
