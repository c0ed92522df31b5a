"""``python -m benchmarks``: autopar against serial, DDP, FSDP2, DTensor TP and torch pipelining.

For every model and world size one torchrun job (``benchmarks/job.py``; gloo, or NCCL with CUDA) runs
every system on the same model, global batch and AdamW, and measures per system: the median step time
(slowest rank, after warm-up), peak memory and parameter memory per rank, the bytes each rank sends
per step, and the loss at every step. It writes, under ``--out``: one JSON file per job, ``table.md``
(the tables, autopar's ratios to every peer, where autopar is slower than the peer with the same plan,
and the checks), ``step_time.png`` and ``memory.png``. It exits with 1 when a check fails: a loss that
left serial's, autopar's bytes unequal to its own count or to the trace's prediction, a job that died.
``--out`` (default ``benchmarks/results/``) is not committed; ``--readme`` copies the plots the doc shows to
``docs/images/``.

The default (3 tiny models on 4 ranks) takes a few minutes on a 2-core CPU:

    python -m benchmarks
    python -m benchmarks --models llama --world-sizes 2 4 --grids t2x1x1 p2 --steps 10
    python -m benchmarks --models mixtral --grids d4 d4-e d4-e-z --steps 10   # MoE: experts split over data (e)
    python -m benchmarks --size small --models gpt2     # GPT-2 124M (heavy on CPU: meant for GPUs)
    python -m benchmarks --readme                        # also rewrites docs/benchmarks.md's results section
    python -m benchmarks --inference                     # generate() latency (benchmarks/inference.py)
    python -m benchmarks --faults                        # the input check and checkpoints' cost (benchmarks/faults.py)
    python -m benchmarks --simulate 4                    # rank 0 of 4-rank grids on this one device
    python -m benchmarks --simulate 4 --decode           # one rank's static-cache decoding, per token
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from benchmarks import report
from benchmarks.models import DEFAULT_MODELS, MODELS, SIZES
from benchmarks.systems import PEERS, SCHEDULES, default_grids, parse_grid

ROOT = Path(__file__).resolve().parents[1]
README_BEGIN, README_END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{os.cpu_count()} cores ({cpu}){gpu}, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, "
            f"{datetime.date.today().isoformat()}")


class _Progress:
    """tqdm's bar when it is installed, else one line per finished system."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="system", dynamic_ncols=True)
        except ImportError:
            self.bar, self.done, self.total = None, 0, total

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)
        else:
            self.done += 1
            print(f"[{self.done}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_job(model: str, world: int, systems: list[str], args: argparse.Namespace, out: Path,
            progress: _Progress) -> dict[str, Any]:
    """Launches one torchrun job; returns its report, with the systems it did not finish marked as errors."""
    stem = f"{model}-{args.size}-w{world}"
    result, log_path = out / f"{stem}.json", out / "logs" / f"{stem}.log"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "benchmarks.job", "--model", model, "--size", args.size, "--systems", *systems,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--schedule", args.schedule,
               "--out", str(result)]
    for flag in ("batch", "microbatches"):
        if getattr(args, flag) is not None:
            command += [f"--{flag}", str(getattr(args, flag))]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    failure = ""
    with open(log_path, "w") as log, subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                       stderr=subprocess.STDOUT, text=True,
                                                       start_new_session=True) as proc:
        watchdog = threading.Timer(args.timeout, os.killpg, (proc.pid, signal.SIGKILL))
        watchdog.start()
        for line in proc.stdout:
            log.write(line)
            if line.startswith("@@done "):
                progress.step(f"{model} w{world} {report.label(line.split()[1])}")
            elif line.startswith("@@failed "):
                failure = line.split(maxsplit=1)[1].strip()
        code = proc.wait()
        if not watchdog.is_alive() and code != 0:
            failure = f"timed out after {args.timeout} s"
        watchdog.cancel()
    job = json.loads(result.read_text()) if result.exists() else {
        "model": model, "size": args.size, "world": world, "systems": []}
    finished = {s["system"] for s in job["systems"]}
    if code != 0:
        tail = [line for line in log_path.read_text().splitlines() if "Error" in line][-1:]
        reason = f"{failure or 'the job'} exited with {code}: {tail[0] if tail else ''} (log: {log_path})"
        for s in systems:
            if s not in finished:
                job["systems"].append({"system": s, "status": "error", "reason": reason})
                progress.step(f"{model} w{world} {report.label(s)} FAILED")
    return job


#: The document whose results section ``--readme`` rewrites (the README links to it).
RESULTS_DOC = ROOT / "docs" / "benchmarks.md"
IMAGES = ROOT / "docs" / "images"
"""Where ``--readme`` puts the plots the doc shows (committed with it)."""


def _update_readme(text: str, command: str) -> None:
    path = RESULTS_DOC
    readme = path.read_text()
    if README_BEGIN not in readme or README_END not in readme:
        raise SystemExit(f"{path.relative_to(ROOT)} has no {README_BEGIN} ... {README_END} section to rewrite")
    head, rest = readme.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    path.write_text(f"{head}{README_BEGIN}\n{text}{README_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--simulate" in argv and "--decode" in argv:  # one rank's decoding: benchmarks/simulate_decode.py
        from benchmarks import simulate_decode

        argv.remove("--decode")
        return simulate_decode.main(argv)
    if "--simulate" in argv:  # one rank of W on this device: benchmarks/simulate.py
        from benchmarks import simulate

        return simulate.main(argv)
    if "--faults" in argv:  # the input check and sync/async checkpoints against a plain step: benchmarks/faults.py
        from benchmarks import faults

        argv.remove("--faults")
        return faults.main(argv)
    if "--inference" in argv:  # generate() latency: benchmarks/inference.py
        from benchmarks import inference

        argv.remove("--inference")
        return inference.main(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(MODELS))
    p.add_argument("--size", default="tiny", choices=SIZES, help="tiny (default) or small (GPT-2 124M class)")
    p.add_argument("--world-sizes", nargs="+", type=int, default=[4], metavar="W")
    p.add_argument("--grids", nargs="+", default=None, metavar="GRID",
                   help="autopar grids, e.g. d4 t2x2x1 t1x1x4 p2-d2 d4-e (tokens t<row>x<col>x<depth>, d<data>, "
                        "p<pipeline>, c compiled, z shard_optimizer, s sequence_parallel, e expert_parallel; data "
                        "defaults to the ranks left). Default: each peer's plan and a 3D "
                        "grid, per world size")
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS,
                   help="serial always runs: it is every loss's reference")
    p.add_argument("--steps", type=int, default=5, help="measured steps per system (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default 2)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the model's)")
    p.add_argument("--microbatches", type=int, default=None, help="pipelines (default 2 x world)")
    p.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per job")
    p.add_argument("--readme", action="store_true", help="rewrite docs/benchmarks.md's results section")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")

    plan: list[tuple[str, int, list[str]]] = []
    for world in args.world_sizes:
        grids = args.grids or default_grids(world)
        try:
            labels = [parse_grid(g, world).label for g in grids]
        except ValueError as e:
            p.error(str(e))
        peers = ["serial"] + [x for x in args.peers if x != "serial"]
        systems = peers + [f"autopar:{g}" for g in dict.fromkeys(labels)]
        plan += [(model, world, systems) for model in args.models]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)

    command = "python -m benchmarks" + "".join(f" {shlex.quote(a)}" for a in argv)
    progress = _Progress(sum(len(s) for _, _, s in plan))
    jobs = [run_job(model, world, systems, args, args.out, progress) for model, world, systems in plan]
    progress.close()
    text = report.markdown(jobs, command, machine())
    (args.out / "table.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"command": command, "machine": machine(), "jobs": jobs},
                                                      indent=1))
    written = report.plots(jobs, args.out)
    if args.readme:  # results are not committed (benchmarks/results/ is ignored): the doc's plots go with the doc
        IMAGES.mkdir(exist_ok=True)
        shown = [Path(shutil.copy(w, IMAGES / f"benchmarks-{w.name}")) for w in written]
        images = "".join(f"\n![{w.stem}]({os.path.relpath(w, RESULTS_DOC.parent)})" for w in shown)
        _update_readme(text + images + ("\n" if images else ""), command)
    print(text)
    print(f"written: {', '.join(str(x) for x in [args.out / 'table.md', args.out / 'results.json', *written])}")
    return 1 if any(report.checks(job) for job in jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
