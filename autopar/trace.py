"""``python -m autopar.trace model.py --tensor R C D --data D``: the plan, without processes or GPUs.

``model.py`` defines ``build_model()`` and ``example_inputs()``. The model is built on the meta
device (no weights are allocated), captured for one rank's batch shard, planned, and reported: a
per-matmul table (module, op, shapes, parameters, FLOPs, sharding, bytes per step) and totals.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch

from autopar.compat import pytree
from autopar.config import CompileConfig, ParallelConfig
from autopar.decisions import Plan
from autopar.errors import AutoparError
from autopar.planning.machines import BUILT_IN, compile_arg, device_type_of, load_machine
from autopar.model_file import load_model_file, meta_inputs
from autopar.planning.planner import plan_model
from passes.analysis.choose_stages import Hardware
from passes.analysis.report import StepReport

log = logging.getLogger(__name__)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def format_report(plan: Plan, report: StepReport, *, batch_size: int, rank: int) -> str:
    c = plan.config
    lines = [f"autopar plan for {c} = {c.world_size} ranks, global batch {batch_size}, shown for rank {rank}",
             ""]
    header = f"{'module':<22} {'op':<7} {'in shape':<16} {'out shape':<16} {'params':>9} {'FLOPs':>9}  {'sharding':<12} {'comm/step':>11}"
    lines += [header, "-" * len(header)]
    for r in (*report.layers, *report.whole):
        lines.append(f"{r.module or '<root>':<22} {r.op:<7} {list(r.in_shape)!s:<16} {list(r.out_shape)!s:<16} "
                     f"{_fmt_count(r.num_parameters):>9} {_fmt_count(r.flops):>9}  {r.sharding:<12} "
                     f"{_fmt_bytes(float(r.comm_bytes)):>11}")
    for what, nbytes in report.other_comm:
        lines.append(f"{what:<80} {_fmt_bytes(float(nbytes)):>11}")
    lines.append("-" * len(header))
    share = report.matmul_flops_sharded / report.flops_per_step if report.flops_per_step else 1.0
    kinds = ", ".join(f"{k} {_fmt_bytes(float(v))}" for k, v in report.comm_bytes_by_kind.items())
    lines += [
        f"parameters:            {report.num_parameters:,}",
        f"matmul FLOPs per step: {report.flops_per_step:,} (fwd+bwd, global batch; {share:.1%} sharded)",
        f"parameter bytes/rank:  {report.param_bytes_per_rank:,} ({_fmt_bytes(report.param_bytes_per_rank)})",
        f"construction peak:     {report.construction_bytes_per_rank:,} ({_fmt_bytes(report.construction_bytes_per_rank)}"
        f"; this rank's pieces + the largest parameter whole while it is initialized)",
        f"comm bytes/step/rank:  {float(report.comm_bytes_per_step):,.0f} ({kinds or 'none'})",
    ]
    for reason, flops in coverage_gaps(report):
        lines.append(f"not sharded: {flops / report.flops_per_step:.1%} of matmul FLOPs: {reason}")
    if plan.memory is not None:
        lines += plan.memory.summary().splitlines()
    if plan.pipeline is not None:
        lines += plan.pipeline.summary().splitlines()
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def coverage_gaps(report: StepReport) -> list[tuple[str, int]]:
    """(reason, FLOPs) of the matmul FLOPs that stay replicated, largest first."""
    gaps: dict[str, int] = {}
    for r in (*report.layers, *report.whole):
        if r.sharding.startswith("replicated"):
            reason = f"{r.module or '<root>'}: {r.sharding.removeprefix('replicated: ')}"
            gaps[reason] = gaps.get(reason, 0) + r.flops
    return sorted(gaps.items(), key=lambda kv: -kv[1])


def report_json(plan: Plan, report: StepReport, *, batch_size: int, rank: int) -> dict[str, Any]:
    return {
        "config": {"data": plan.config.data, "context": plan.config.context, "tensor": list(plan.config.tensor),
                   "world_size": plan.config.world_size},
        "batch_size": batch_size,
        "rank": rank,
        "num_parameters": report.num_parameters,
        "flops_per_step": report.flops_per_step,
        "param_bytes_per_rank": report.param_bytes_per_rank,
        "construction_bytes_per_rank": report.construction_bytes_per_rank,
        "comm_bytes_per_step": float(report.comm_bytes_per_step),
        "memory": plan.to_dict()["memory"],
        "comm_bytes_by_kind": {k: float(v) for k, v in report.comm_bytes_by_kind.items()},
        "matmul_flops_sharded": report.matmul_flops_sharded,
        "not_sharded": [{"why": w, "flops": f} for w, f in coverage_gaps(report)],
        "layers": [{"module": r.module, "op": r.op, "in_shape": list(r.in_shape), "out_shape": list(r.out_shape),
                    "num_parameters": r.num_parameters, "flops": r.flops, "sharding": r.sharding,
                    "comm_bytes": float(r.comm_bytes)} for r in (*report.layers, *report.whole)],
        "other_comm": [{"what": w, "comm_bytes": float(b)} for w, b in report.other_comm],
        "plan": plan.to_dict(),
    }


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '2e9' -> 2e9."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GB, 80GiB or 2e9")
    try:
        return int(float(m.group(1)) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GB, 80GiB or 2e9") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.trace", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .py file defining build_model() and example_inputs()")
    parser.add_argument("--tensor", type=int, nargs=3, default=(1, 1, 1), metavar=("ROW", "COL", "DEPTH"))
    parser.add_argument("--data", type=int, default=1)
    parser.add_argument("--context", type=int, default=1, metavar="C",
                        help="context parallelism: every sequence's tokens split over C ranks (attention gathers "
                             "the keys and values)")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch (default: example_inputs')")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose bytes and shapes are shown")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--pipeline", type=int, default=1, metavar="P",
                        help="pipeline ranks: the blocks are cut into P stages by cost, as "
                             "auto_parallelize(pipeline=P) runs them (world size data x P x tensor)")
    parser.add_argument("--chunks", type=int, default=1, metavar="V",
                        help="stages per pipeline rank for an interleaved schedule (default 1)")
    parser.add_argument("--microbatches", type=int, default=None, metavar="M",
                        help="micro-batches per step for --pipeline (default: P, as auto_parallelize's); each "
                             "batch shard's rows must divide by it")
    parser.add_argument("--checkpoint", default="auto", choices=("auto", "none", "full"),
                        help="activation checkpointing policy, as auto_parallelize's checkpoint= (default auto)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="compute dtype, as auto_parallelize's precision= (activations in the memory plan)")
    parser.add_argument("--memory-per-device", type=parse_bytes, default=None, metavar="SIZE",
                        help="memory budget per device for --checkpoint auto, e.g. 80GB, 80GiB or 2e9 "
                             "(default: this machine's memory shared by the ranks)")
    parser.add_argument("--hardware", default=None, metavar="NAME|JSON",
                        help=f"the machine whose rates cut --pipeline's stages: {', '.join(BUILT_IN)} or a JSON file "
                             "(python -m autopar.plan --calibrate writes one); default: this machine, as "
                             "auto_parallelize here would cut them")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="each data rank keeps 1/data of the optimizer state and of the gradients (a "
                             "reduce-scatter) and all-gathers the updated parameters, as "
                             "auto_parallelize(shard_optimizer=True) runs it (ZeRO stages 1-2)")
    parser.add_argument("--expert-parallel", nargs="?", const=True, default=False, choices=("data+tensor",),
                        help="split the routed experts over the data ranks (rows exchanged by all-to-all), as "
                             "auto_parallelize(expert_parallel=True) runs it; --expert-parallel data+tensor: whole "
                             "experts over data x the tensor axis (expert_parallel=\"data+tensor\")")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split the activations between matmuls along the tokens over the tensor group, as "
                             "auto_parallelize(sequence_parallel=True) runs it")
    parser.add_argument("--compile", default="auto", choices=("auto", "true", "false", "reduce-overhead"),
                        help="auto_parallelize's compile= (default auto: compiled on GPUs, so with a GPU --hardware "
                             "or on a machine with CUDA): a compiled piece of backward returns a bucket's gradients at "
                             "once, which the memory plan counts")
    parser.add_argument("--capture-all-blocks", action="store_true",
                        help="capture every repeated block instead of three (slower; the plan is the same "
                             "whenever the shortcut applies)")
    args = parser.parse_args(argv)
    try:
        config = ParallelConfig(args.data, *args.tensor, pipeline=max(args.pipeline, 1),
                                shard_optimizer=args.shard_optimizer, sequence_parallel=args.sequence_parallel,
                                expert_parallel=args.expert_parallel, context=args.context)
        module = load_model_file(args.model)
        with torch.device("meta"):
            model = module.build_model()
        inputs = module.example_inputs()
        inputs = meta_inputs(inputs if isinstance(inputs, tuple) else (inputs,), args.batch_size)
        leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > 0]
        batch_size = leaves[0].shape[0] if leaves else 0
        machine = None if args.hardware is None else load_machine(args.hardware)
        hardware = None if machine is None else Hardware.of(machine, config)
        device = device_type_of(machine) if machine is not None else "cuda" if torch.cuda.is_available() else "cpu"
        plan, report = plan_model(model, inputs, config, rank=args.rank, repeat=not args.capture_all_blocks,
                                  checkpoint=args.checkpoint, budget=args.memory_per_device,
                                  precision=args.precision, pipeline=args.pipeline,
                                  microbatches=args.microbatches or args.pipeline, chunks=args.chunks,
                                  hardware=hardware, device=device,
                                  compiled=CompileConfig(compile_arg(args.compile)).enabled(device, training=True))
    except AutoparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(plan, report, batch_size=batch_size, rank=args.rank))
    if args.json:
        Path(args.json).write_text(json.dumps(report_json(plan, report, batch_size=batch_size, rank=args.rank),
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
