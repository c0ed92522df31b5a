"""``python -m benchmarks --simulate W``: one rank's training step of W-rank grids, on this one device.

Each grid's rank 0 runs under torch's fake process group (backend "fake": every collective is a no-op),
so its step is that rank's own compute plus autopar's overhead: what this device spends per step as one of
W ranks, before any communication. The model is ``autopar.examples.gpu_check``'s HF Llama, trained as a
script does (AdamW, HF's ``labels=`` loss, the script's bf16 autocast). Rows: the serial model (whole
model, whole batch), the serial model under ``torch.compile``, and each grid's rank 0 with autopar's eager
per-rank program and with ``compile=True`` (``autopar.runtime.compiled.graph``), each in a child process (a
process has one default process group). Columns:

- step ms (median of ``--repeats`` after two warm-up steps), device ms (CUDA: the kernels' summed time in
  one step, what the step would take if the host never kept the device waiting; the JSON also lists the 8
  longest kernels), host ms of each phase (forward, backward, ``opt.step()``: the host's time to issue it,
  read without a synchronize; where they add up to the step, the host bounds it), kernels per step (CUDA kernels; on the CPU, the aten ops called from Python), peak MiB
  (CUDA);
- the step against serial / W and compiled serial / W (the ideal split of the work), and, for a tensor
  grid of all W ranks, against "one rank's share" (``SHARE``): the serial model with 1/W of its heads,
  key/value heads, intermediate size and vocabulary (``build_llama(ways=W)``), compiled, on the same batch.
  That is what a W-way tensor rank computes at best with no communication: its matmuls' share, and the
  norms, residual stream and rotary every tensor rank repeats (issue 34's goal: <= 1.2x of it);
- the planner's predicted compute for that rank (matmuls, elementwise work, per-op overhead and the
  optimizer update, ``passes.analysis.search_plans.plan_seconds`` on ``autopar.planning.machines.local_machine``).

    python -m benchmarks --simulate 4                        # CUDA if there is one, else the CPU
    python -m benchmarks --simulate 4 --size tiny --grids t4x1x1 t2x2x1 --repeats 3 --device cpu

A simulated rank's losses are not the model's (its collectives did nothing): only times and counts mean
something. Absolute times are this machine's; compare rows of one run. Pipeline grids are refused: a
pipeline rank needs the other stages' activations, which the fake process group does not carry.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist

from autopar.examples.gpu_check import AUTOCAST, BATCH, SIZES, batches, build_llama, measure, pick_device
from benchmarks.systems import parse_grid

SERIAL, COMPILED, SHARE, GRAPHS = "serial", "compiled", "share", "reduce-overhead"
COMPILE = {"eager": False, COMPILED: True, GRAPHS: GRAPHS}
"""A row's mode -> ``auto_parallelize(compile=...)``."""


def default_grids(world: int) -> list[str]:
    """Each 1-D tensor grid, data parallelism, and a 2x2 tensor grid where the world has one."""
    grids = [f"t{world}x1x1", f"t1x{world}x1", f"t1x1x{world}", f"d{world}"]
    if world % 4 == 0 and world > 4:
        grids.append(f"t2x2x1-d{world // 4}")
    elif world == 4:
        grids.append("t2x2x1")
    return grids


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One row, in this (child) process: the serial model, compiled or not, or a grid's rank 0."""
    from autopar.compat import fake_store

    device = pick_device(args.device)
    ids = batches(args.size, 1, shape=args.batch)[0].to(device)
    torch.manual_seed(0)
    if args.child in (SERIAL, COMPILED):
        model = build_llama(args.size).to(device)
        return measure(torch.compile(model) if args.child == COMPILED else model, ids, device, args.repeats)
    if args.child == SHARE:  # one rank's share of a W-way tensor group as a model of its own, compiled
        model = build_llama(args.size, ways=args.world).to(device)
        return measure(torch.compile(model), ids % model.config.vocab_size, device, args.repeats)
    import autopar

    text, _, mode = args.child.partition(":")
    grid = parse_grid(text, args.world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=args.world)
    with autopar.auto_parallelize(tensor=grid.tensor, data=grid.data, pipeline=grid.pipeline,
                                  compile=COMPILE[mode], shard_optimizer=grid.shard_optimizer,
                                  sequence_parallel=grid.sequence_parallel):
        model = build_llama(args.size)
    model.to(device)
    return measure(model, ids, device, args.repeats)


def predicted_ms(size: str, grid_text: str, world: int, shape: tuple[int, int] | None = None) -> float | None:
    """The planner's compute (+ optimizer update) for the grid's slowest rank, in ms; None if it fails."""
    from autopar.planning.machines import local_machine
    from autopar.planning.search import score
    from passes.analysis.search_plans import Candidate

    grid = parse_grid(grid_text, world) if grid_text != SERIAL else parse_grid("d1", 1)
    with torch.device("meta"):
        model = build_llama(size)
    b, s = shape or BATCH[size]
    ids = torch.empty(b, s, dtype=torch.long, device="meta")
    candidate = Candidate(grid.data, grid.pipeline, *grid.tensor, microbatches=grid.pipeline,
                          shard_optimizer=grid.shard_optimizer, sequence_parallel=grid.sequence_parallel)
    scored = score(model, (ids,), candidate, local_machine(world if grid_text != SERIAL else 1),
                   precision="bf16" if AUTOCAST is torch.bfloat16 else "fp16", kwargs={"labels": ids})
    if scored.time is None:
        return None
    return (scored.time.compute + scored.time.optimizer) * 1e3


def batch_shape(text: str) -> tuple[int, int]:
    """``32x1024`` -> (32, 1024)."""
    try:
        b, s = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch takes BATCHxSEQUENCE, e.g. 32x1024, not {text!r}") from None
    if min(b, s) < 1:
        raise argparse.ArgumentTypeError(f"--batch {text!r}: both sizes must be at least 1")
    return b, s


def run_child(module: str, key: str, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """One row of ``module`` (``--child key``) in a child process (a process has one default process group):
    its JSON line, or the error that ended it."""
    cmd = [sys.executable, "-m", module, "--child", key, "--world", str(args.world), "--size", args.size,
           "--device", args.device, *extra]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"error": tail[0][:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_row(args: argparse.Namespace, grid: str) -> dict[str, Any]:
    return run_child("benchmarks.simulate", grid, args, "--repeats", str(args.repeats),
                     *(["--batch", "x".join(map(str, args.batch))] if args.batch else []))


def check_grids(p: argparse.ArgumentParser, grids: list[str], world: int) -> None:
    """Every grid parses for this world and has no pipeline (or the parser exits naming why)."""
    for g in grids:
        try:
            grid = parse_grid(g, world)
        except ValueError as e:
            p.error(str(e))
        if grid.pipeline > 1:  # rank 0 would wait on the other stages' activations, which no rank sends
            p.error(f"grid {g!r} has a pipeline: a pipeline rank's step needs the other stages' activations, which "
                    "the fake process group does not carry. Simulate tensor and data grids (t..., d...).")


def markdown(header: str, cols: tuple[str, ...], body: list[tuple[str, ...]]) -> str:
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([header, "", line(cols), line(["-" * w for w in widths]), *map(line, body)])


def table(rows: list[dict[str, Any]], world: int, header: str) -> str:
    serial = next((r["ms"] for r in rows if r["row"] == SERIAL and "ms" in r), None)
    compiled = next((r["ms"] for r in rows if r["row"] == COMPILED and "ms" in r), None)
    share = next((r["ms"] for r in rows if r["row"] == SHARE and "ms" in r), None)
    cols = ("row", "step ms", "device ms", "host ms (fwd, bwd, opt)", "kernels/step", "peak MiB",
            f"vs serial/{world}", f"vs compiled/{world}", "vs share", "predicted compute ms")
    body = []
    for r in rows:
        if "error" in r:
            body.append((r["label"], f"failed: {r['error']}", *[""] * (len(cols) - 2)))
            continue
        host = ", ".join(f"{v:.1f}" for v in r["host_ms"].values()) if r.get("host_ms") else ""
        per_rank = r["row"] not in (SERIAL, COMPILED, SHARE)
        tensor = per_rank and math.prod(parse_grid(r["row"].partition(":")[0], world).tensor) == world
        body.append((r["label"], f"{r['ms']:.1f}", f"{r['device_ms']:.1f}" if r.get("device_ms") is not None else "",
                     host, str(r["kernels"]),
                     f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else "",
                     f"{r['ms'] / (serial / world):.2f}x" if per_rank and serial else "",
                     f"{r['ms'] / (compiled / world):.2f}x" if per_rank and compiled else "",
                     f"{r['ms'] / share:.2f}x" if tensor and share else "",
                     f"{r['predicted_ms']:.1f}" if r.get("predicted_ms") is not None else ""))
    return markdown(header, cols, body)


def parser(prog: str, description: str, cuda_size: str, grids_help: str) -> argparse.ArgumentParser:
    """The options of every simulated benchmark: the world, model size, grids, device, timeout, JSON, child."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--world", "--simulate", dest="world", type=int, default=4, help="simulated world size W")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help=f"default: {cuda_size} on CUDA, tiny on the CPU")
    p.add_argument("--grids", nargs="+", default=None, metavar="GRID", help=grids_help)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each row's child process")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def settle(args: argparse.Namespace, cuda_size: str) -> torch.device:
    """The device the rows run on; ``args``' device and size made concrete, torch's threads set."""
    device = pick_device(args.device)
    args.device = device.type
    args.size = args.size or (cuda_size if device.type == "cuda" else "tiny")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return device


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m benchmarks --simulate", __doc__.splitlines()[0], "small",
               "autopar grids as python -m benchmarks takes them (t<row>x<col>x<depth>, d<data>, p<pipeline>)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per row (median)")
    p.add_argument("--batch", type=batch_shape, default=None, metavar="BxS",
                   help="batch x sequence length, e.g. 32x1024 (default: the size's own, 8x1024 for medium)")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out the compiled rows: serial under torch.compile, autopar with compile=True")
    p.add_argument("--reduce-overhead", action="store_true",
                   help="also each grid with compile='reduce-overhead' (CUDA: training steps replayed as CUDA graphs)")
    args = p.parse_args(argv)
    device = settle(args, "small")
    if args.child is not None:
        print(json.dumps(child(args)))
        return 0
    if args.world < 2:
        p.error("--simulate takes a world size of at least 2")
    grids = args.grids or default_grids(args.world)
    check_grids(p, grids, args.world)
    rows = [(SERIAL, "serial (whole model, whole batch)")]
    rows += [] if args.no_compile else [(COMPILED, "serial, torch.compile"),
                                        (SHARE, f"one rank's share as a model (1/{args.world} of the heads, "
                                                "intermediate, vocabulary), torch.compile")]
    for g in grids:
        rows.append((f"{g}:eager", f"autopar {g}, rank 0"))
        rows += [] if args.no_compile else [(f"{g}:{COMPILED}", f"autopar {g}, rank 0, compile=True")]
        rows += [(f"{g}:{GRAPHS}", f"autopar {g}, rank 0, compile='reduce-overhead'")] if args.reduce_overhead else []
    out = []
    for key, label in rows:
        got = {"row": key, "label": label, **run_row(args, key)}
        if key not in (COMPILED, SHARE):
            try:
                got["predicted_ms"] = predicted_ms(args.size, key.partition(":")[0], args.world, args.batch)
            except Exception as e:  # the prediction is a column; a failure shows as an empty cell
                got["predicted_error"] = str(e).splitlines()[0][:120]
        out.append(got)
        print(f"  {label}: {got.get('ms', got.get('error'))}", file=sys.stderr, flush=True)
    b, s = args.batch or BATCH[args.size]
    return report(args, device, out, "simulated", f"batch {b}x{s}, bf16 autocast",
                  lambda header: table(out, args.world, header))


def report(args: argparse.Namespace, device: torch.device, out: list[dict[str, Any]], what: str, setting: str,
           render: Any) -> int:
    """Prints the table (``render(header)``), writes ``--json``; the exit status (1 when a row failed)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    hidden, layers = SIZES[args.size][:2]
    print(render(f"{what} rank 0 of {args.world} ranks on one {name} (torch {torch.__version__}): {args.size} "
                 f"Llama (hidden {hidden}, {layers} layers), {setting}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "size": args.size, "device": name, "rows": out}, f, indent=1)
    return 1 if any("error" in r for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())
