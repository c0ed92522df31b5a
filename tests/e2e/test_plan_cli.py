"""End to end: ``python -m autopar.plan`` ranks the grids of a world size for a model file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autopar.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "autopar" / "examples" / "fc_net.py")


def test_plan_ranks_grids_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert plan_main([EXAMPLE, "--gpus", "4", "--hardware", "h100-80gb", "--global-batch", "64", "--top", "50",
                      "--evaluate", "data=2 tensor=2,1,1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "best first" in text and "why slower than #1" in text and "evaluated: data=2" in text
    d = json.loads(out.read_text())
    plans = d["plans"]
    assert len(plans) >= 20  # every factorization of 4 over five degrees, pipelines with their micro-batches
    for p in plans:
        assert set(p) >= {"data", "pipeline", "tensor", "microbatches", "schedule", "checkpoint",
                          "predicted_step_seconds", "memory_bytes_per_device", "fits"}
        assert p["data"] * p["pipeline"] * p["tensor"][0] * p["tensor"][1] * p["tensor"][2] == 4
    fitting = [p["predicted_step_seconds"] for p in plans if p["fits"] and p["predicted_step_seconds"] is not None]
    assert fitting == sorted(fitting) and plans[0]["fits"] and len(fitting) >= 4  # the screen's best, planned
    screened = plans[len(fitting):]
    assert all(p["predicted_step_seconds"] is None and p["reason"].startswith("not planned") for p in screened)
    assert d["evaluated"]["data"] == 2 and d["evaluated"]["tensor"] == [2, 1, 1]
    assert d["evaluated"]["predicted_step_seconds"] >= plans[0]["predicted_step_seconds"]


def test_interleaved_plans_are_listed_evaluated_and_fixed(tmp_path, capsys):
    """Pipelines come in 1F1B and interleaved (two stages per rank) versions; --evaluate scores either,
    --chunks fixes the stages per rank, and a schedule's own conditions are errors."""
    out = tmp_path / "plans.json"
    assert plan_main([EXAMPLE, "--gpus", "2", "--hardware", "h100-80gb", "--top", "50", "--evaluate",
                      "pipeline=2 microbatches=4 chunks=2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    schedules = {(p["schedule"], p["chunks"]) for p in d["plans"]}
    assert {(None, 1), ("1f1b", 1), ("interleaved", 2)} <= schedules, schedules
    assert (d["evaluated"]["schedule"], d["evaluated"]["chunks"]) == ("interleaved", 2)
    assert "chunks=2" in capsys.readouterr().out
    assert plan_main([EXAMPLE, "--gpus", "2", "--hardware", "h100-80gb", "--chunks", "2", "--top", "50", "--json",
                      str(out)]) == 0
    assert {p["chunks"] for p in json.loads(out.read_text())["plans"] if p["pipeline"] > 1} == {2}
    for grid, message in (("data=2 chunks=2", "needs a pipeline"),
                          ("pipeline=2 microbatches=5 chunks=2", "divisible by")):
        capsys.readouterr()
        assert plan_main([EXAMPLE, "--gpus", "2", "--evaluate", grid]) == 2
        assert message in capsys.readouterr().err, grid


def test_degrees_given_stay_and_a_plan_that_does_not_fit_says_what_it_needs(tmp_path, capsys):
    assert plan_main([EXAMPLE, "--gpus", "4", "--hardware", "h100-80gb", "--row", "2", "--json",
                      str(tmp_path / "a.json")]) == 0
    assert all(p["tensor"][0] == 2 for p in json.loads((tmp_path / "a.json").read_text())["plans"])
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"name": "tiny", "flops_per_second": 1e12, "memory_bytes": 2**20,
                                 "intra_bytes_per_second": 1e10, "inter_bytes_per_second": 1e9}))
    capsys.readouterr()
    assert plan_main([EXAMPLE, "--gpus", "2", "--hardware", str(small), "--json", str(tmp_path / "b.json")]) == 0
    text = capsys.readouterr().out
    assert "no grid fits: the closest needs" in text
    plans = json.loads((tmp_path / "b.json").read_text())["plans"]
    assert not any(p["fits"] for p in plans) and all("needs" in p["reason"] for p in plans)


def test_evaluate_takes_the_checkpoint_policy_and_compile_and_the_search_goes_without_features(tmp_path, capsys):
    """--evaluate scores a configuration as it was run: ``checkpoint=full`` recomputes every block (less memory,
    more time than ``none``), ``compile``/``eager`` override --compile; its words print back as given. --without
    holds the search to plans without the named features (a machine too small for any plan: the search tries the
    optimizer state split over data, and under --without it does not)."""
    from autopar.plan import parse_evaluate, parse_without
    from autopar.errors import ConfigError
    import pytest

    asked = parse_evaluate("pipeline=2 microbatches=2 shard_optimizer checkpoint=full compile", 2)
    assert (asked.checkpoint, asked.compiled) == ("full", True)
    assert parse_evaluate(asked.describe(), 2) == asked
    for bad in ("data=2 checkpoint=some", "data=2 compile=yes"):
        with pytest.raises(ConfigError, match="checkpoint=auto|none|full"):
            parse_evaluate(bad, 2)
    with pytest.raises(ConfigError, match="'zero3' is not one of them"):
        parse_without("shard_optimizer,zero3")
    assert parse_without("context,sequence_parallel") == {"context", "sequence_parallel"}
    got = {}
    for policy in ("none", "full"):
        out = tmp_path / f"{policy}.json"
        assert plan_main([EXAMPLE, "--gpus", "2", "--hardware", "h100-80gb", "--evaluate",
                          f"data=2 checkpoint={policy} eager", "--json", str(out)]) == 0
        got[policy] = json.loads(out.read_text())["evaluated"]
        assert f"evaluated: data=2 pipeline=1 tensor=1,1,1 checkpoint={policy} eager:" in capsys.readouterr().out
    assert got["none"]["checkpoint"] == [] and got["full"]["checkpoint"]  # every block recomputed
    assert got["full"]["memory_bytes_per_device"] < got["none"]["memory_bytes_per_device"]
    assert got["full"]["predicted_step_seconds"] > got["none"]["predicted_step_seconds"]
    assert (got["full"]["checkpoint_policy"], got["full"]["compiled"]) == ("full", False)
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"name": "tiny", "flops_per_second": 1e12, "memory_bytes": 2**20,
                                 "intra_bytes_per_second": 1e10, "inter_bytes_per_second": 1e9}))
    features = {}
    for without in ([], ["--without", "shard_optimizer,sequence_parallel"]):
        out = tmp_path / "w.json"
        assert plan_main([EXAMPLE, "--gpus", "4", "--hardware", str(small), "--exhaustive", "--top", "100",
                          "--json", str(out), *without]) == 0
        features[bool(without)] = {p["shard_optimizer"] for p in json.loads(out.read_text())["plans"]}
    assert features == {False: {False, True}, True: {False}}  # (mutation: --without ignored: both kinds listed)
    assert "without sequence_parallel, shard_optimizer" in capsys.readouterr().out


def test_plan_runs_as_module_and_reports_bad_input():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ok = subprocess.run([sys.executable, "-m", "autopar.plan", EXAMPLE, "--gpus", "2", "--hardware", "cpu", "--top", "20"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "data=2 pipeline=1 tensor=1,1,1" in ok.stdout
    for args, message in ((["--hardware", "tpu"], "unknown hardware"),
                          (["--evaluate", "data=4"], "not --gpus 2"),
                          (["--global-batch", "1", "--data", "2"], "no grid of 2 ranks")):
        bad = subprocess.run([sys.executable, "-m", "autopar.plan", EXAMPLE, "--gpus", "2", *args],
                             capture_output=True, text=True, env=env, timeout=300)
        assert bad.returncode == 2 and message in bad.stderr, (args, bad.stderr)


def test_calibrate_writes_a_description_the_search_reads(tmp_path, capsys):
    """--calibrate measures this machine (a GEMM, an AdamW step, a chain of elementwise ops, an op's
    overhead; all-reduces over 2 forked gloo ranks fitted as latency + bytes / bandwidth, and the table
    of each collective kind by message size) and writes a file --hardware takes."""
    from autopar.planning.machines import load_machine

    out = tmp_path / "here.json"
    assert plan_main(["--calibrate", str(out), "--gpus", "2"]) == 0
    machine = load_machine(str(out))
    assert machine.flops_per_second > 1e8 and machine.intra_bytes_per_second > 1e6 and 0 < machine.intra_latency < 0.1
    assert machine.memory_bytes_per_second > 1e8 and machine.activation_bytes_per_second > 1e7
    assert 0 < machine.op_seconds < 1e-3
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "send"):
        points = machine.collectives[kind][2]  # 2 ranks: groups of 2, nothing crosses
        assert len(points) == 7 and all(t1 >= t0 > 0 for (_, t0), (_, t1) in zip(points, points[1:])), (kind, points)
    assert plan_main([EXAMPLE, "--gpus", "2", "--hardware", str(out)]) == 0
    assert "2 x calibrated" in capsys.readouterr().out
