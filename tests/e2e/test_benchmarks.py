"""End to end: ``python -m benchmarks`` on a small configuration (run as a command: tests never import
benchmarks/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          env=ENV, timeout=timeout)


@pytest.mark.slow
def test_benchmark_run_measures_every_system_and_its_checks_hold(tmp_path):
    done = _bench("--models", "fc_net", "--world-sizes", "2", "--peers", "ddp", "tp", "pipe",
                  "--grids", "d2", "t2x1x1", "p2", "--steps", "1", "--warmup", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    job, = results["jobs"]
    systems = {s["system"]: s for s in job["systems"]}
    assert list(systems) == ["serial", "ddp", "tp", "pipe", "autopar:d2", "autopar:t2x1x1", "autopar:p2"]
    assert all(s["status"] == "ok" for s in systems.values())
    serial = systems["serial"]["losses"]
    assert len(serial) == 2
    for s in systems.values():  # every system trains to serial's losses (fp32 reassociation only)
        assert s["losses"] == pytest.approx(serial, rel=1e-5)
        assert s["step_seconds"] > 0
        assert all(r["uncounted_ops"] == [] for r in s["ranks"])

    # DDP all-reduces every gradient once: 2(p-1)/p x the parameter bytes, counted from its own calls.
    ddp = systems["ddp"]["ranks"]
    assert [r["comm_bytes"] for r in ddp] == [r["param_bytes"] for r in ddp]  # p = 2
    # autopar's data parallelism, fed as the DDP script feeds DDP (each rank its slice: per-rank batches,
    # detected at the first call), sends exactly DDP's bytes: no output gather, no agreement.
    for r in systems["autopar:d2"]["ranks"]:
        assert r["comm_by_kind"] == {"all_reduce": ddp[0]["comm_bytes"]}
    for name in ("autopar:d2", "autopar:t2x1x1", "autopar:p2"):
        for r in systems[name]["ranks"]:
            assert r["comm_bytes"] == r["autopar_comm_stats"] == r["predicted_bytes"] > 0
            assert 0 < r["predicted_seconds"]
    # Tensor parallelism holds half the parameters; a pipeline stage holds one part of the model.
    whole = systems["serial"]["ranks"][0]["param_bytes"]
    assert all(r["param_bytes"] < 0.6 * whole for r in systems["autopar:t2x1x1"]["ranks"])
    assert sum(r["param_bytes"] for r in systems["pipe"]["ranks"]) == whole
    assert all(r["peak_bytes"] > r["param_bytes"] for s in systems.values() for r in s["ranks"][:1])

    table = (tmp_path / "table.md").read_text()
    assert "| autopar t2x1x1 |" in table and "DTensor TP's time" in table and "Checks" in table
    assert table in done.stdout


def test_benchmark_rejects_a_grid_that_does_not_fill_the_world(tmp_path):
    done = _bench("--models", "fc_net", "--world-sizes", "4", "--grids", "t2x2x2", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "autopar grid 't2x2x2' needs 8 ranks" in done.stderr
    done = _bench("--world-sizes", "2", "--grids", "x2", "--out", str(tmp_path))
    assert done.returncode == 2 and "bad autopar grid 'x2'" in done.stderr


@pytest.mark.slow
def test_inference_benchmark_times_every_system_with_serial_tokens(tmp_path):
    done = _bench("--inference", "--models", "llama", "--world-sizes", "2", "--grids", "t2x1x1", "--tokens", "4",
                  "--prompt", "6", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job = json.loads((tmp_path / "inference-llama-w2.json").read_text())
    systems = {s["system"]: s for s in job["systems"]}
    assert list(systems) == ["serial", "dtensor-tp", "autopar:t2x1x1"]
    for s in systems.values():
        assert s["tokens_equal_serial"], s
        assert 0 < s["warm_per_token_s"] and 0 < s["cold_first_token_s"] and 0 < s["new_length_first_token_s"]
    table = (tmp_path / "inference.md").read_text()
    assert "| llama | 2 | autopar:t2x1x1 |" in table and table in done.stdout


@pytest.mark.slow
def test_simulate_times_one_rank_of_each_grid_on_this_device(tmp_path):
    """``--simulate 4``: the serial step (eager and compiled), one rank's share as a model of its own
    (compiled), and rank 0 of a grid under torch's fake process group, eager and with ``compile=True``, each
    with its kernels per step, its host time per phase and (but the compiled models) the planner's predicted
    compute, on the batch ``--batch`` names; a rank of 4 does less work than serial, and compiled it runs fewer ops from Python
    than eagerly (its fused kernels are not aten ops)."""
    out = tmp_path / "simulate.json"
    done = _bench("--simulate", "4", "--size", "tiny", "--grids", "t4x1x1", "--repeats", "1", "--device", "cpu",
                  "--batch", "4x32", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"serial", "compiled", "share", "t4x1x1:eager", "t4x1x1:compiled"}
    for r in rows.values():
        assert r["ms"] > 0 and r["kernels"] > 0 and (r["row"] in ("compiled", "share") or r["predicted_ms"] > 0), r
    assert rows["t4x1x1:eager"]["predicted_ms"] < rows["serial"]["predicted_ms"]
    assert rows["t4x1x1:compiled"]["kernels"] < rows["t4x1x1:eager"]["kernels"] / 2
    assert "vs serial/4" in done.stdout and "compile=True" in done.stdout and "vs share" in done.stdout
    assert "batch 4x32" in done.stdout and "device ms" in done.stdout and "host ms (fwd, bwd, opt)" in done.stdout
    for r in rows.values():  # the host's time in each phase, within the step (which ends in a synchronize)
        assert set(r["host_ms"]) == {"forward", "backward", "optimizer"}, r
        assert 0 < sum(r["host_ms"].values()) <= 1.5 * r["ms"] + 5, r
    assert rows["share"]["kernels"] <= rows["compiled"]["kernels"]  # (the same model's graph, a quarter as wide)


@pytest.mark.slow
def test_simulate_decode_times_one_rank_per_token(tmp_path):
    """``--simulate 4 --decode``: per-token time of the whole model (eager, HF's compiled decode) and of rank 0
    of a grid; on the CPU nothing replays (CUDA graphs only)."""
    out = tmp_path / "decode.json"
    done = _bench("--simulate", "4", "--decode", "--size", "tiny", "--grids", "t4x1x1", "--modes", "eager", "graphs",
                  "--device", "cpu", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"serial", "serial-compiled", "t4x1x1:eager", "t4x1x1:graphs"}
    assert all(r["ms"] > 0 for r in rows.values()) and rows["t4x1x1:graphs"]["replays"] == 0
    assert "ms/token" in done.stdout
    done = _bench("--simulate", "4", "--decode", "--grids", "p4", "--device", "cpu")
    assert done.returncode == 2 and "fake process group" in done.stderr


def test_simulate_rejects_a_grid_of_another_world_and_a_pipeline():
    done = _bench("--simulate", "4", "--grids", "t2x1x1-d1", "--device", "cpu")
    assert done.returncode == 2 and "needs 2 ranks" in done.stderr
    done = _bench("--simulate", "4", "--grids", "p4", "--device", "cpu")
    assert done.returncode == 2 and "fake process group does not carry" in done.stderr
