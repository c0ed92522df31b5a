"""End to end: the trace CLI and the README's main command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.trace import main as trace_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "autopar" / "examples" / "fc_net.py")


def test_trace_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert trace_main([EXAMPLE, "--tensor", "2", "2", "1", "--data", "2", "--batch-size", "32",
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layers.3.fc2" in text and "transposed" in text and "normal" in text
    assert "parameters:            142,686,218" in text
    d = json.loads(out.read_text())
    assert d["num_parameters"] == 142_686_218
    # 2*(fwd) + 4*(bwd) * rows * in * out per matmul; the first layer's input needs no gradient.
    per_row = sum(i * o for i, o in [(2048, 8192), (8192, 2048)] * 4) * 6 + 4096 * 2048 * 4 + 2048 * 10 * 6
    assert d["flops_per_step"] == 32 * per_row
    assert d["comm_bytes_per_step"] > 0 and len(d["layers"]) == 10
    assert d["param_bytes_per_rank"] < 142_686_218 * 4 / 3


def test_trace_shows_the_optimizer_state_sharded_over_data(tmp_path, capsys):
    """--shard-optimizer: Adam's moments quartered at data=4; the gradients' reduce-scatter and the step's
    all-gather send 3/4 of the parameter bytes each, what the all-reduce sent (DDP's bytes)."""
    got = {}
    for flag in ([], ["--shard-optimizer"]):
        out = tmp_path / f"plan{len(flag)}.json"
        assert trace_main([EXAMPLE, "--data", "4", "--batch-size", "32", "--json", str(out), *flag]) == 0
        got[bool(flag)] = json.loads(out.read_text())
    assert "data=4 tensor=(row=1, col=1, depth=1) shard_optimizer" in capsys.readouterr().out
    whole, split = got[False], got[True]
    params = whole["memory"]["param_bytes"]
    assert whole["memory"]["optimizer_bytes"] == 2 * params
    assert abs(split["memory"]["optimizer_bytes"] - params / 2) <= 0.001 * params  # (chunks padded to 4 rows)
    gathered = split["comm_bytes_by_kind"]["all_gather"] - whole["comm_bytes_by_kind"]["all_gather"]
    assert abs(gathered - 0.75 * params) <= 0.001 * params
    scattered = split["comm_bytes_by_kind"]["reduce_scatter"] - whole["comm_bytes_by_kind"].get("reduce_scatter", 0)
    assert abs(scattered - 0.75 * params) <= 0.001 * params
    assert whole["comm_bytes_by_kind"]["all_reduce"] - split["comm_bytes_by_kind"].get("all_reduce", 0) >= 1.5 * params
    assert abs(split["comm_bytes_per_step"] - whole["comm_bytes_per_step"]) <= 0.001 * params


def test_trace_shows_the_tokens_split_over_the_tensor_group(tmp_path, capsys):
    """--sequence-parallel on the zoo's Llama at tensor (2,1,1): the output projections scatter their tokens, the
    other matmuls read them gathered, the activations fall and the all-reduces become reduce-scatters."""
    zoo = str(ROOT / "autopar" / "examples" / "zoo.py")
    got = {}
    for flag in ([], ["--sequence-parallel"]):
        out = tmp_path / f"plan{len(flag)}.json"
        assert trace_main([zoo, "--tensor", "2", "1", "1", "--json", str(out), *flag]) == 0
        got[bool(flag)] = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "tensor=(row=2, col=1, depth=1) sequence_parallel" in text
    assert "transposed, out tokens over row" in text and "normal, tokens gathered over row" in text
    whole, split = got[False], got[True]
    assert split["memory"]["activation_bytes"] < 0.9 * whole["memory"]["activation_bytes"]  # (0.83: logits are most)
    assert split["comm_bytes_by_kind"]["reduce_scatter"] > 0 == whole["comm_bytes_by_kind"].get("reduce_scatter", 0)
    assert split["comm_bytes_by_kind"]["all_reduce"] < 0.1 * whole["comm_bytes_by_kind"]["all_reduce"]


def test_trace_runs_as_module_and_reports_bad_input():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ok = subprocess.run([sys.executable, "-m", "autopar.trace", EXAMPLE, "--tensor", "4", "1", "1"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "shown for rank 0" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "autopar.trace", "no_such_model.py"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def _readme_main_command() -> str:
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n```", text, re.S).group(1)
    assert first.startswith('pip install torch==2.13.0 -e ".[test]" && ')
    return first.split(" && ", 1)[1]


@pytest.mark.slow
def test_readme_main_command_trains_with_serial_losses():
    cmd = _readme_main_command()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, shell=True, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "autopar plan: data=1 tensor=(row=2, col=2, depth=1) on 4 ranks; 10/10 matmuls on 2-D weights sharded" in run.stdout
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 5
    serial = subprocess.run([sys.executable, "-m", "autopar.examples.train_fc_net", "--serial"],
                            capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    expected = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", serial.stdout)]
    assert len(expected) == 5
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, expected)), (losses, expected)
