"""Ranks the grids a world size allows for a model before any device runs it: ``python -m autopar.plan``.

    python -m autopar.plan MODEL.py[:NAME] --gpus N [--gpus-per-node G] [--hardware h100-80gb|a100-80gb|cpu|FILE.json]
        [--global-batch B] [--seq S] [--top K] [--evaluate "data=.. pipeline=.. tensor=R,C,D microbatches=.. chunks=.."]
        [--data D] [--pipeline P] [--row R] [--col C] [--depth D] [--chunks V] [--json FILE]

Each candidate grid (``passes.analysis.search_plans.candidates``) is planned as the runtime would plan it
(``autopar.trace.plan_model``: capture on meta, the plan, its exact collectives, the memory plan with the
blocks to recompute under the device's memory, the pipeline's stages), and scored by the predicted step
time on the described machine. The table lists the best ``--top`` plans and why each is slower than the
best; plans that do not fit memory come last, with the memory they need. ``MODEL.py`` follows the trace
CLI's convention: ``build_model()`` and ``example_inputs()`` (``:NAME`` is passed to both).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.compat import pytree
from autopar.calibrate import cpu_cores
from autopar.config import ParallelConfig, PipelineConfig
from autopar.errors import AutoparError, ConfigError, PlanError
from autopar.memory import device_budget
from autopar.trace import SLOWEST, load_model_file, meta_inputs, plan_model
from passes.analysis.machine import Machine
from passes.analysis.search_plans import (DEGREES, Candidate, Scored, candidates, factorizations, plan_seconds,
                                          rank_plans, screen, shape_of, why_slower)

BUILT_IN = ("h100-80gb", "a100-80gb", "cpu")


def load_machine(spec: str, gpus_per_node: int | None = None) -> Machine:
    """A built-in hardware description by name, or a JSON file of ``Machine``'s fields."""
    if spec in BUILT_IN:
        text = resources.files("autopar").joinpath("hardware", f"{spec}.json").read_text()
    elif Path(spec).is_file():
        text = Path(spec).read_text()
    else:
        raise ConfigError(f"unknown hardware {spec!r}: use one of {', '.join(BUILT_IN)} or a JSON file with the "
                          f"fields of autopar.plan.Machine")
    try:
        machine = Machine.from_json(text)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"hardware description {spec!r} is not valid: {e}") from e
    return machine if gpus_per_node is None else dataclasses.replace(machine, gpus_per_node=gpus_per_node)


def score(model: nn.Module, inputs: tuple, candidate: Candidate, machine: Machine, *,
          checkpoint: str = "auto", precision: str = "fp32", captures: dict[Any, Any] | None = None,
          kwargs: dict | None = None) -> Scored:
    """One grid's plan and its predicted step on ``machine``: rank 0's without a pipeline (every rank does
    the same work), else the rank whose stages compute most. ``kwargs``: the call's keyword inputs."""
    try:
        plan, report = plan_model(model, inputs, candidate.config, rank=SLOWEST, checkpoint=checkpoint, kwargs=kwargs,
                                  budget=machine.memory_bytes, precision=precision, pipeline=candidate.pipeline,
                                  microbatches=candidate.microbatches, chunks=candidate.chunks, captures=captures)
    except AutoparError as e:
        return Scored(candidate, None, 0, False, reason=str(e).splitlines()[0])
    # the step is the slowest rank's (plan_seconds reads its report), the memory the fullest rank's: under
    # a pipeline plan.memory is the rank that needs the most (usually the first: most micro-batches in flight),
    # and what it recomputes is every rank's choice
    memory = plan.memory
    peak = memory.static_bytes + memory.activation_bytes
    time = plan_seconds(plan, report, machine, precision)
    fits = memory.fits and peak <= machine.memory_bytes
    reason = "" if fits else (f"needs {_gib(peak)} per device (with every block recomputed) of "
                              f"{_gib(machine.memory_bytes)}")
    return Scored(candidate, time, peak, fits, memory.recompute, reason)


KEEP = 8
"""Grids the search plans exactly when there are more: the closed-form screen's best (at most)."""
NEAR = 1.5
MIN_KEEP = 4
"""Of those, the ones the screen puts within NEAR times its best, and at least MIN_KEEP."""
ROUNDS = 4
"""While no planned grid fits memory, the next KEEP the screen ranks are planned, up to ROUNDS x KEEP."""
SCREENED = "not planned"


@contextlib.contextmanager
def _collector_skips_what_exists() -> Iterator[None]:
    """While inside, the cyclic garbage collector's passes skip the objects that existed before (``gc.freeze``,
    undone after; left alone where the process froze objects itself): a search makes many short-lived
    objects, and each full pass would traverse every object of the process (~450,000 with torch and
    transformers imported: ~0.1 s a pass, a tenth of a 100-layer search)."""
    mine = gc.get_freeze_count() == 0
    if mine:
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


def search(model: nn.Module, inputs: tuple, world: int, machine: Machine, *, fixed: dict[str, int] | None = None,
           checkpoint: str = "auto", precision: str = "fp32", keep: int | None = KEEP,
           kwargs: dict | None = None) -> list[Scored]:
    """Every grid of ``world`` ranks, ranked (``rank_plans``); ``fixed`` degrees stay as given. With more
    than ``keep`` grids (None: plan every one), the closed-form screen (``search_plans.screen``, from one
    plan of the model on one rank) ranks them all and the best ``keep`` are planned exactly; the rest
    follow, unplanned, with their screened time as the reason. ``fixed["chunks"]``: the stages per
    pipeline rank (default: 1F1B's one or interleaved's two, whichever is faster)."""
    with _collector_skips_what_exists():
        return _search(model, inputs, world, machine, fixed=fixed, checkpoint=checkpoint, precision=precision,
                       keep=keep, kwargs=kwargs)


def _search(model: nn.Module, inputs: tuple, world: int, machine: Machine, *, fixed: dict[str, int] | None,
            checkpoint: str, precision: str, keep: int | None, kwargs: dict | None) -> list[Scored]:
    batch = _batch_size((inputs, kwargs))
    fixed = dict(fixed or {})
    chunks = (fixed.pop("chunks"),) if "chunks" in fixed else (1, 2)
    grids = candidates(world, batch, fixed=fixed, chunks=chunks)
    if not grids:
        fixed_text = ", ".join(f"{k}={v}" for k, v in (fixed or {}).items()) or "nothing"
        if not factorizations(world, fixed):
            raise PlanError(f"no grid of {world} ranks has {fixed_text}: the degrees multiply to the world size, so "
                            f"each must divide {world}. Grids of {world} ranks: {_grids(factorizations(world))}. "
                            "Fix degrees that divide the world size, or launch a multiple of them.")
        raise PlanError(f"no grid of {world} ranks fits a global batch of {batch} rows with {fixed_text} fixed: data "
                        f"x depth must be at most the batch. Grids of {world} ranks: "
                        f"{_grids(factorizations(world, fixed))}. Raise the batch or fix smaller degrees.")
    captures: dict[Any, Any] = {}  # grids whose batch shards get the same rows share a capture

    def planned(grids: list[Candidate]) -> list[Scored]:
        return [score(model, inputs, c, machine, checkpoint=checkpoint, precision=precision, captures=captures,
                      kwargs=kwargs) for c in grids]

    if keep is None or len(grids) <= keep:
        return rank_plans(planned(grids))
    # one plan of the whole model: data parallel when the batch splits evenly (its capture is that
    # grid's, which the screen likely keeps), else on one rank
    shards = world if batch % world == 0 else 1
    _, probe = plan_model(model, inputs, ParallelConfig(shards, 1, 1, 1), checkpoint="none", kwargs=kwargs,
                          precision=precision, captures=captures)
    shape = shape_of(probe, shards)
    half = precision in ("bf16", "fp16")
    screened = sorted(((*screen(shape, c, machine, half), c) for c in grids),
                      key=lambda t: (t[1] > machine.memory_bytes, t[0]))
    near = sum(t[0] <= NEAR * screened[0][0] for t in screened)  # the screen's best and those close to it
    first = min(keep, max(near, MIN_KEEP))
    scored = planned([c for *_, c in screened[:first]])
    # the screen counts no activations: while none of the planned grids fits, plan the next ones it would
    # fit, up to ROUNDS times as many
    done = first
    while not any(s.fits for s in scored) and done < min(len(screened), ROUNDS * keep):
        more = [c for _, memory, c in screened[done:done + keep] if memory <= machine.memory_bytes]
        done += keep
        scored += planned(more)
    return rank_plans(scored) + [
        Scored(c, None, memory, memory <= machine.memory_bytes, reason=_screened(seconds, memory, c, shape, machine))
        for seconds, memory, c in screened[done:]]


def _screened(seconds: float, memory: float, config: Candidate, shape, machine: Machine) -> str:
    """Why a grid the screen left out was not planned: it does not fit (by the screen's memory estimate),
    it has more stages than segments, or it is predicted slower."""
    if memory > machine.memory_bytes:
        return f"{SCREENED}: needs about {_gib(memory)} per device of {_gib(machine.memory_bytes)} (the screen's estimate)"
    if seconds == math.inf:
        return f"{SCREENED}: {config.pipeline} stages for {shape.segments} segments"
    return f"{SCREENED}: the screen predicts {seconds * 1e3:.3g} ms"


def _grids(options: list[dict[str, int]]) -> str:
    shown = [f"data={o['data']} pipeline={o['pipeline']} tensor={o['row']},{o['col']},{o['depth']}"
             for o in options[:6]]
    return "; ".join(shown) + (f"; ... ({len(options)} in all)" if len(options) > 6 else "")


def _batch_size(inputs: tuple) -> int:
    tensors = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return int(tensors[0].shape[0]) if tensors else 1


def local_machine(world: int) -> Machine:
    """This machine as the search sees it: the built-in description of its GPU (H100, A100; else H100's
    figures) with the device's memory, or the CPU's with its memory shared by the ranks."""
    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if gpu else ""
    base = load_machine("a100-80gb" if "A100" in name else "h100-80gb" if gpu else "cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return dataclasses.replace(base, memory_bytes=device_budget(device, world), gpus_per_node=max(local, 1),
                               cores=0 if gpu else cpu_cores())


def choose_grid(model: nn.Module, inputs: tuple, world: int, *, fixed: dict[str, int] | None = None,
                checkpoint: str = "auto", precision: str = "fp32", kwargs: dict | None = None,
                batch_size: int | None = None, budget: int | None = None) -> list[Scored]:
    """``auto_parallelize(plan="auto")``'s choice: every grid of ``world`` ranks for ``inputs`` (and keyword
    inputs ``kwargs``: one global batch; ``batch_size`` replaces its rows) on this machine, ranked; the first
    is the one to run. ``budget``: bytes per device the plan must fit (``checkpoint=<bytes>``'s) instead of
    the device's memory. Raises PlanError when none fits memory, with the closest."""
    machine = local_machine(world)
    if budget is not None:
        machine = dataclasses.replace(machine, memory_bytes=budget)
    if kwargs:
        both = meta_inputs((tuple(inputs), dict(kwargs)), batch_size)
        inputs, kwargs = both[0], both[1]
    else:
        inputs = meta_inputs(tuple(inputs), batch_size)
    ranked = search(model, inputs, world, machine, fixed=fixed, checkpoint=checkpoint, precision=precision,
                    kwargs=kwargs)
    if not ranked[0].fits:
        closest = "; ".join(f"{s.candidate.describe()}: {_gib(s.memory_bytes)}" for s in ranked[:3])
        raise PlanError(f"no grid of {world} ranks fits {_gib(machine.memory_bytes)} per device for this model "
                        f"and batch; the closest need {closest}. Use more devices, a smaller batch, or "
                        "precision='bf16'.")
    return ranked


def parse_evaluate(text: str, world: int) -> Candidate:
    """``"data=2 pipeline=1 tensor=2,1,1 microbatches=1 chunks=1"`` -> a Candidate (missing degrees 1)."""
    fields: dict[str, int] = {"data": 1, "pipeline": 1, "row": 1, "col": 1, "depth": 1, "microbatches": 0,
                              "chunks": 1}
    for part in text.split():
        key, _, value = part.partition("=")
        try:
            if key == "tensor":
                fields["row"], fields["col"], fields["depth"] = (int(v) for v in value.split(","))
            elif key in fields:
                fields[key] = int(value)
            else:
                raise ValueError(key)
        except ValueError:
            raise ConfigError(f"--evaluate takes 'data=D pipeline=P tensor=R,C,D microbatches=M chunks=V'; {part!r} "
                              "is not one of them") from None
    fields["microbatches"] = fields["microbatches"] or fields["pipeline"]
    candidate = Candidate(**fields)
    if candidate.pipeline > 1:  # the schedule's own conditions
        PipelineConfig(candidate.microbatches, schedule_of(candidate), candidate.chunks).num_microbatches(
            candidate.pipeline)
    elif candidate.chunks > 1:
        raise ConfigError(f"--evaluate's chunks={candidate.chunks} needs a pipeline (pipeline=P > 1).")
    size = candidate.data * candidate.pipeline * candidate.row * candidate.col * candidate.depth
    if size != world:
        raise ConfigError(f"--evaluate's grid has {size} ranks ({candidate.describe()}), not --gpus {world}.")
    return candidate


def plan_json(s: Scored) -> dict[str, Any]:
    c = s.candidate
    return {"data": c.data, "pipeline": c.pipeline, "tensor": [c.row, c.col, c.depth],
            "microbatches": c.microbatches, "schedule": schedule_of(c),
            "chunks": c.chunks,
            "checkpoint": list(s.recompute), "predicted_step_seconds": None if s.time is None else s.seconds,
            "memory_bytes_per_device": s.memory_bytes, "fits": s.fits, **({"reason": s.reason} if s.reason else {})}


def schedule_of(c: Candidate) -> str | None:
    """The torch schedule ``auto_parallelize`` runs the candidate's pipeline with (None without one)."""
    return None if c.pipeline == 1 else "interleaved" if c.chunks > 1 else "1f1b"


def format_table(ranked: list[Scored], top: int, machine: Machine, world: int) -> str:
    best = ranked[0]
    planned = sum(not s.reason.startswith(SCREENED) for s in ranked)
    how = "" if planned == len(ranked) else f" ({planned} planned exactly, the others ranked by the closed-form screen)"
    lines = [f"{world} x {machine.name} ({machine.gpus_per_node} per node): {len(ranked)} grids{how}, best first",
             "", f"{'#':>3}  {'grid':<48} {'step':>10} {'memory':>10}  why slower than #1"]
    for i, s in enumerate(ranked[:top], 1):
        step = "-" if s.time is None else f"{s.seconds * 1e3:.3g} ms"
        why = "" if i == 1 else why_slower(best, s)
        lines.append(f"{i:>3}  {s.candidate.describe():<48} {step:>10} {_gib(s.memory_bytes):>10}  {why}")
    if best.recompute:
        lines.append(f"\n#1 recomputes {len(best.recompute)} blocks in backward to fit memory.")
    if not best.fits:
        lines.append(f"\nno grid fits: the closest needs {_gib(best.memory_bytes)} per device of "
                     f"{_gib(machine.memory_bytes)}. Use more devices or a smaller batch.")
    return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.plan", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="MODEL.py[:NAME] defining build_model() and example_inputs()")
    parser.add_argument("--gpus", type=int, default=None, help="world size: devices in all")
    parser.add_argument("--calibrate", metavar="FILE", default=None,
                        help="measure this machine (matmul rate; all-reduces over --gpus ranks, default 2) and write "
                             "its hardware description to FILE, for --hardware FILE")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware description's")
    parser.add_argument("--hardware", default="h100-80gb", help=f"{', '.join(BUILT_IN)} or a JSON file")
    parser.add_argument("--global-batch", type=int, default=None, help="rows per step (default: example_inputs')")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: example_inputs')")
    parser.add_argument("--top", type=int, default=10, help="plans to list (default 10)")
    parser.add_argument("--evaluate", default=None, metavar="GRID",
                        help='score this grid with the same model: '
                             '"data=D pipeline=P tensor=R,C,D microbatches=M [chunks=V]"')
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--keep", type=int, default=KEEP,
                        help=f"grids to plan exactly, the closed-form screen's best (default {KEEP})")
    parser.add_argument("--exhaustive", action="store_true", help="plan every grid exactly (slow at scale)")
    for degree in DEGREES:
        parser.add_argument(f"--{degree}", type=int, default=None, help=f"fix the {degree} degree")
    parser.add_argument("--chunks", type=int, default=None,
                        help="fix the stages per pipeline rank (1: 1F1B, more: interleaved; default: either)")
    parser.add_argument("--json", metavar="FILE", help='also write {"plans": [...], "evaluated": {...}}')
    args = parser.parse_args(argv)
    if args.calibrate:
        from autopar.calibrate import calibrate, write

        try:
            machine = calibrate(args.gpus or 2)
        except AutoparError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        write(machine, args.calibrate)
        print(f"{args.calibrate}: {machine.flops_per_second / 1e9:.3g} GFLOP/s matmul, all-reduce "
              f"{machine.intra_bytes_per_second / 1e9:.3g} GB/s + {machine.intra_latency * 1e6:.3g} us per call, "
              f"{_gib(machine.memory_bytes)} per device")
        return 0
    if args.model is None or args.gpus is None:
        parser.error("MODEL.py and --gpus are needed (or --calibrate FILE)")
    try:
        machine = load_machine(args.hardware, args.gpus_per_node)
        module = load_model_file(args.model)
        with torch.device("meta"):
            model = module.build_model()
        inputs = module.example_inputs()
        inputs = meta_inputs(inputs if isinstance(inputs, tuple) else (inputs,), args.global_batch, args.seq)
        fixed = {d: getattr(args, d) for d in (*DEGREES, "chunks") if getattr(args, d) is not None}
        ranked = search(model, inputs, args.gpus, machine, fixed=fixed, precision=args.precision,
                        keep=None if args.exhaustive else max(args.keep, 1))
        evaluated = None
        if args.evaluate:
            evaluated = score(model, inputs, parse_evaluate(args.evaluate, args.gpus), machine,
                              precision=args.precision)
    except AutoparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(ranked, args.top, machine, args.gpus))
    if evaluated is not None:
        step = "-" if evaluated.time is None else f"{evaluated.seconds * 1e3:.3g} ms"
        print(f"\nevaluated: {evaluated.candidate.describe()}: {step}, {_gib(evaluated.memory_bytes)} per device"
              + ("" if evaluated.fits else f" (does not fit: {evaluated.reason})")
              + (f"; vs #1: {why_slower(ranked[0], evaluated)}" if evaluated.candidate != ranked[0].candidate else ""))
    if args.json:
        out = {"plans": [plan_json(s) for s in ranked[:args.top]],
               "evaluated": plan_json(evaluated) if evaluated is not None else None}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
