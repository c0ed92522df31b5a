"""Ranks the grids a world size allows for a model before any device runs it: ``python -m autopar.plan``.

    python -m autopar.plan MODEL.py[:NAME] --gpus N [--gpus-per-node G] [--hardware h100-80gb|a100-80gb|cpu|FILE.json]
        [--global-batch B] [--seq S] [--top K] [--evaluate "data=.. pipeline=.. tensor=R,C,D microbatches=.. chunks=..
        [shard_optimizer] [sequence_parallel] [expert_parallel[=data+tensor]] [checkpoint=auto|none|full] [compile|eager]"]
        [--without shard_optimizer,sequence_parallel,expert_parallel,context]
        [--data D] [--pipeline P] [--row R] [--col C] [--depth D] [--context X] [--chunks V] [--json FILE]

Each candidate grid (``passes.analysis.search_plans.candidates``) is planned as the runtime would plan it
(``autopar.planning.planner.plan_model``: capture on meta, the plan, its exact collectives, the memory plan with the
blocks to recompute under the device's memory, the pipeline's stages), and scored by the predicted step
time on the described machine. The table lists the best ``--top`` plans and why each is slower than the
best; plans that do not fit memory come last, with the memory they need. ``MODEL.py`` follows the trace
CLI's convention: ``build_model()`` and ``example_inputs()`` (``:NAME`` is passed to both).

``--evaluate`` scores one configuration by the same model: a grid in the words the ranked list prints, its
features, the checkpoint policy (``checkpoint=full`` recomputes every block, as Megatron's full recompute;
``none`` nothing; ``auto``, the default, what memory needs) and ``compile`` or ``eager`` (default ``--compile``'s).
``--without`` holds the search to plans without the named features, so a run made without them (a framework
that lacks one) is compared with the best plan of its own kind. The search also tries context parallelism
(``context=X``, with or without a pipeline) where a sequence has 16,384 tokens or more (``--context`` fixes its degree,
1 for none).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopar.config import TENSOR_EXPERTS, CompileConfig, PipelineConfig
from autopar.errors import AutoparError, ConfigError
from autopar.model_file import load_model_file, meta_inputs
from autopar.planning.machines import BUILT_IN, compile_arg, device_type_of, load_machine
from autopar.planning.search import KEEP, SCREENED, gib, score, search
from passes.analysis.machine import Machine
from passes.analysis.search_plans import DEGREES, Candidate, Scored, why_slower



FEATURES = ("shard_optimizer", "sequence_parallel", "expert_parallel")
"""The words of a plan that are features, not degrees (``Candidate.describe`` prints them bare)."""
CHECKPOINTS = ("auto", "none", "full")
"""``checkpoint=``'s policies (``auto_parallelize``'s words)."""


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What ``--evaluate`` scores: a grid with its features, how it recomputes, and whether it is compiled."""

    candidate: Candidate
    checkpoint: str = "auto"
    compiled: bool | None = None
    """None: as ``--compile`` says."""

    def describe(self) -> str:
        return (self.candidate.describe() + (f" checkpoint={self.checkpoint}" if self.checkpoint != "auto" else "")
                + ("" if self.compiled is None else " compile" if self.compiled else " eager"))


def parse_evaluate(text: str, world: int) -> Evaluation:
    """``"data=2 pipeline=1 tensor=2,1,1 microbatches=1 chunks=1 expert_parallel checkpoint=full compile"`` -> what
    to score (missing degrees 1): the words the ranked list prints, features (``FEATURES``) as bare words
    (``expert_parallel=data+tensor`` too), the
    checkpoint policy (``CHECKPOINTS``) and ``compile`` or ``eager``."""
    fields: dict[str, Any] = {"data": 1, "pipeline": 1, "row": 1, "col": 1, "depth": 1, "microbatches": 0,
                              "chunks": 1, "context": 1}
    checkpoint, compiled = "auto", None
    for part in text.split():
        key, _, value = part.partition("=")
        try:
            if key in FEATURES and not value:
                fields[key] = True
            elif key == "expert_parallel" and value == TENSOR_EXPERTS:
                fields[key] = value
            elif key == "checkpoint" and value in CHECKPOINTS:
                checkpoint = value
            elif key in ("compile", "eager") and not value:
                compiled = key == "compile"
            elif key == "tensor":
                fields["row"], fields["col"], fields["depth"] = (int(v) for v in value.split(","))
            elif key in fields:
                fields[key] = int(value)
            else:
                raise ValueError(key)
        except ValueError:
            raise ConfigError(f"--evaluate takes 'data=D pipeline=P context=X tensor=R,C,D microbatches=M chunks=V', the "
                              f"words {', '.join(FEATURES)} (expert_parallel={TENSOR_EXPERTS}: whole experts over data x "
                              f"the tensor axis), checkpoint={'|'.join(CHECKPOINTS)} and compile or "
                              f"eager; {part!r} is not one of them") from None
    fields["microbatches"] = fields["microbatches"] or fields["pipeline"]
    candidate = Candidate(**fields)
    if candidate.pipeline > 1:  # the schedule's own conditions
        PipelineConfig(candidate.microbatches, schedule_of(candidate), candidate.chunks).num_microbatches(
            candidate.pipeline)
    elif candidate.chunks > 1:
        raise ConfigError(f"--evaluate's chunks={candidate.chunks} needs a pipeline (pipeline=P > 1).")
    candidate.config  # (ParallelConfig's checks: context with what it does not combine with yet)
    size = candidate.data * candidate.pipeline * candidate.context * candidate.row * candidate.col * candidate.depth
    if size != world:
        raise ConfigError(f"--evaluate's grid has {size} ranks ({candidate.describe()}), not --gpus {world}.")
    return Evaluation(candidate, checkpoint, compiled)


def parse_without(text: str) -> frozenset[str]:
    """``"shard_optimizer,sequence_parallel"`` -> the features the search must not use."""
    words = frozenset(w.strip() for w in text.replace(" ", ",").split(",") if w.strip())
    unknown = sorted(words - {*FEATURES, "context"})
    if unknown:
        raise ConfigError(f"--without takes the features {', '.join(FEATURES)} and context (comma-separated); "
                          f"{', '.join(map(repr, unknown))} is not one of them")
    return words


def plan_json(s: Scored) -> dict[str, Any]:
    c = s.candidate
    return {"data": c.data, "pipeline": c.pipeline, "context": c.context, "tensor": [c.row, c.col, c.depth],
            "microbatches": c.microbatches, "schedule": schedule_of(c),
            "chunks": c.chunks, **{f: getattr(c, f) for f in FEATURES},
            "checkpoint": list(s.recompute), "predicted_step_seconds": None if s.time is None else s.seconds,
            "memory_bytes_per_device": s.memory_bytes, "fits": s.fits, **({"reason": s.reason} if s.reason else {})}


def schedule_of(c: Candidate) -> str | None:
    """The torch schedule ``auto_parallelize`` runs the candidate's pipeline with (None without one)."""
    return None if c.pipeline == 1 else "interleaved" if c.chunks > 1 else "1f1b"


def format_table(ranked: list[Scored], top: int, machine: Machine, world: int, compiled: bool = False,
                 without: frozenset[str] = frozenset()) -> str:
    best = ranked[0]
    planned = sum(not s.reason.startswith(SCREENED) for s in ranked)
    how = "" if planned == len(ranked) else f" ({planned} planned exactly, the others ranked by the closed-form screen)"
    kind = ("compile" if compiled else "eager") + (f", without {', '.join(sorted(without))}" if without else "")
    lines = [f"{world} x {machine.name} ({machine.gpus_per_node} per node, {kind}): {len(ranked)} grids{how}, "
             "best first",
             "", f"{'#':>3}  {'grid':<48} {'step':>10} {'memory':>10}  why slower than #1"]
    for i, s in enumerate(ranked[:top], 1):
        step = "-" if s.time is None else f"{s.seconds * 1e3:.3g} ms"
        why = "" if i == 1 else why_slower(best, s)
        lines.append(f"{i:>3}  {s.candidate.describe():<48} {step:>10} {gib(s.memory_bytes):>10}  {why}")
    if best.recompute:
        lines.append(f"\n#1 recomputes {len(best.recompute)} blocks in backward to fit memory.")
    if not best.fits:
        lines.append(f"\nno grid fits: the closest needs {gib(best.memory_bytes)} per device of "
                     f"{gib(machine.memory_bytes)}. Use more devices or a smaller batch.")
    return "\n".join(lines)


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
                        help='score this configuration with the same model: '
                             '"data=D pipeline=P tensor=R,C,D microbatches=M [chunks=V] [shard_optimizer] '
                             '[sequence_parallel] [expert_parallel[=data+tensor]] [checkpoint=auto|none|full] [compile|eager]" '
                             '(the words the ranked list prints)')
    parser.add_argument("--without", default="", metavar="FEATURES",
                        help=f"plans without these features only (comma-separated: {','.join(FEATURES)},context)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--compile", default="auto", choices=("auto", "true", "false", "reduce-overhead"),
                        help="auto_parallelize's compile= (default auto: compiled on GPUs): a compiled piece of "
                             "backward returns a bucket's gradients at once, which the memory plans count")
    parser.add_argument("--keep", type=int, default=KEEP,
                        help=f"grids to plan exactly, the closed-form screen's best (default {KEEP})")
    parser.add_argument("--exhaustive", action="store_true", help="plan every grid exactly (slow at scale)")
    for degree in DEGREES:
        parser.add_argument(f"--{degree}", type=int, default=None, help=f"fix the {degree} degree")
    parser.add_argument("--context", type=int, default=None,
                        help="fix the context degree (1: none; default: tried from 16,384 tokens per sequence)")
    parser.add_argument("--chunks", type=int, default=None,
                        help="fix the stages per pipeline rank (1: 1F1B, more: interleaved; default: either)")
    parser.add_argument("--json", metavar="FILE", help='also write {"plans": [...], "evaluated": {...}}')
    args = parser.parse_args(argv)
    if args.calibrate:
        from autopar.planning.calibrate import calibrate, write

        try:
            machine = calibrate(args.gpus or 2)
        except AutoparError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        write(machine, args.calibrate)
        print(f"{args.calibrate}: {machine.flops_per_second / 1e9:.3g} GFLOP/s matmul, all-reduce "
              f"{machine.intra_bytes_per_second / 1e9:.3g} GB/s + {machine.intra_latency * 1e6:.3g} us per call, "
              f"{gib(machine.memory_bytes)} per device")
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
        fixed = {d: getattr(args, d) for d in (*DEGREES, "context", "chunks") if getattr(args, d) is not None}
        compiled = CompileConfig(compile_arg(args.compile)).enabled(device_type_of(machine), training=True)
        asked = parse_evaluate(args.evaluate, args.gpus) if args.evaluate else None  # (its errors first)
        ranked = search(model, inputs, args.gpus, machine, fixed=fixed, precision=args.precision,
                        keep=None if args.exhaustive else max(args.keep, 1), compiled=compiled,
                        without=parse_without(args.without))
        evaluated = None
        if asked is not None:
            evaluated = score(model, inputs, asked.candidate, machine, checkpoint=asked.checkpoint,
                              precision=args.precision, compiled=compiled if asked.compiled is None else asked.compiled)
    except AutoparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(ranked, args.top, machine, args.gpus, compiled, parse_without(args.without)))
    if evaluated is not None:
        step = "-" if evaluated.time is None else f"{evaluated.seconds * 1e3:.3g} ms"
        recomputed = f", recomputing {len(evaluated.recompute)} blocks" if evaluated.recompute else ""
        print(f"\nevaluated: {asked.describe()}: {step}, {gib(evaluated.memory_bytes)} per device{recomputed}"
              + ("" if evaluated.fits else f" (does not fit: {evaluated.reason})")
              + (f"; vs #1: {why_slower(ranked[0], evaluated)}" if evaluated.candidate != ranked[0].candidate else ""))
    if args.json:
        out = {"plans": [plan_json(s) for s in ranked[:args.top]],
               "evaluated": {**plan_json(evaluated), "checkpoint_policy": asked.checkpoint,
                             "compiled": compiled if asked.compiled is None else asked.compiled}
               if evaluated is not None else None}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
