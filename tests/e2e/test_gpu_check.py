"""The one-command device check (``python -m autopar.examples.gpu_check``) runs and passes: on the CPU
here (gloo, a fake process group for the simulated ranks), and on CUDA where a GPU is present."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ARGS = ["--steps", "2", "--new-tokens", "4", "--simulate", "2", "--repeats", "1"]


def _run(*extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "autopar.examples.gpu_check", *ARGS, *extra],
                          capture_output=True, text=True, env=env, timeout=600)


def _check(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("autopar gpu_check:")
    rows = {line.split("  ")[0]: line for line in lines[3:]}
    assert any(k.startswith("train (bfloat16 autocast") for k in rows), done.stdout
    assert "tokens equal" in done.stdout
    assert any(k.startswith("train compile='reduce-overhead'") for k in rows), done.stdout  # (CUDA: replayed)
    for grid in ("serial (whole model, whole batch)", "tensor (2,1,1)", "tensor (1,2,1)", "tensor (1,1,2)"):
        line = rows[f"simulated 2 ranks: {grid}"]
        assert line.rstrip().endswith("ok") and "failed" not in line, line
    assert "FAIL" not in done.stdout


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu():
    _check(_run("--device", "cpu", "--size", "tiny"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_check_runs_on_cuda():
    _check(_run("--device", "cuda"))
