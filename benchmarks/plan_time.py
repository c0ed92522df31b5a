"""Wall time and peak memory of ``python -m autopar.trace`` on Llama-2-70B (meta device), with and without
the repeated-block shortcut. Each variant runs in its own process; peak RSS is that process's.

    python -m benchmarks.plan_time [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ZOO = Path(__file__).resolve().parents[1] / "autopar" / "examples" / "zoo.py"
COMMAND = [sys.executable, "-m", "autopar.trace", f"{ZOO}:llama-2-70b", "--tensor", "8", "1", "1",
           "--batch-size", "1"]


def measure(extra: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one CLI run."""
    start = time.perf_counter()
    proc = subprocess.Popen(COMMAND + extra, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"autopar.trace failed:\n{proc.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{' '.join(COMMAND[1:])}  (median of {args.repeats})")
    for label, extra in (("three blocks captured", []), ("all 80 blocks captured", ["--capture-all-blocks"])):
        runs = [measure(extra) for _ in range(args.repeats)]
        wall = statistics.median(r[0] for r in runs)
        peak = max(r[1] for r in runs)
        print(f"  {label:<24} wall {wall:6.2f} s   peak RSS {peak:6.0f} MiB")


if __name__ == "__main__":
    main()
