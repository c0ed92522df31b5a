"""Shows autopar working on this machine's device, in one table.

    python -m autopar.examples.gpu_check                 # CUDA if there is one, else the CPU
    python -m autopar.examples.gpu_check --device cpu --size tiny --steps 2

1. train: a small HF Llama trained a few AdamW steps under ``auto_parallelize()`` (one process: NCCL on
   CUDA, gloo on the CPU) inside the script's own ``torch.autocast``; losses against the same script
   without autopar (same seed, same data).
2. generate: ``generate()``'s greedy tokens (fp32) against the plain model's.
2b. train with ``compile="reduce-overhead"`` (CUDA only: training steps replayed as CUDA graphs), fp32, two
   batches' gradients accumulated per optimizer step, against a plain model of its own.
3. simulated W ranks: rank 0 of W-rank tensor grids run on this one device under torch's fake process
   group (every collective is a no-op, so a step is one rank's compute plus autopar's own overhead): step
   time, kernels launched per step (torch.profiler; on the CPU, the aten ops called from Python) and peak
   memory, against the serial model's whole step and that step / W (the ideal split). Each simulated grid
   runs in a child process (a process has one default process group).

Exit status 1 when a parity check fails. The numbers of a simulated rank are not the model's (its
collectives did nothing): only its times and counts mean something.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

#: Model sizes: (hidden, layers, heads, kv heads, intermediate, vocab). "small" is ~20M parameters; "medium"
#: has TinyLlama-1.1B's layer shape with 8 layers, ~0.5B parameters (issue 34's model).
SIZES = {"tiny": (64, 2, 4, 2, 128, 256), "small": (512, 4, 8, 4, 1376, 8192),
         "medium": (2048, 8, 32, 4, 5632, 32000)}
#: The dtype of the script's autocast (bf16 runs on CUDA and on the CPU).
AUTOCAST = torch.bfloat16
#: Tokens per step: (batch, sequence) for each size.
BATCH = {"tiny": (8, 32), "small": (8, 512), "medium": (8, 1024)}


def build_llama(size: str, ways: int = 1) -> torch.nn.Module:
    """An HF Llama of the given size with random weights (no dropout). ``ways`` > 1: one tensor rank's share of
    it as a model of its own (heads, key/value heads, intermediate size and vocabulary divided by ``ways``,
    the hidden size and head size kept): the compute a rank of a ``ways``-way tensor group cannot avoid
    (its matmuls' share, and the norms, residual and rotary every rank repeats) with no communication."""
    import transformers

    hidden, layers, heads, kv, ffn, vocab = SIZES[size]
    config = transformers.LlamaConfig(vocab_size=-(-vocab // ways), hidden_size=hidden,
                                      intermediate_size=-(-ffn // ways), num_hidden_layers=layers,
                                      num_attention_heads=max(1, heads // ways), num_key_value_heads=max(1, kv // ways),
                                      head_dim=hidden // heads, max_position_embeddings=1024, attention_dropout=0.0)
    return transformers.LlamaForCausalLM(config)


def batches(size: str, steps: int, seed: int = 0, shape: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """``steps`` batches of random token ids, ``shape`` (batch, sequence) or the size's own (``BATCH``)."""
    g = torch.Generator().manual_seed(seed)
    b, s = shape or BATCH[size]
    return [torch.randint(0, SIZES[size][5], (b, s), generator=g) for _ in range(steps)]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda, but torch.cuda.is_available() is False on this machine.")
    return torch.device(name, 0) if name == "cuda" else torch.device(name)


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A process group of this one process (NCCL on CUDA, gloo on the CPU), unless torchrun made one."""
    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def train(model: torch.nn.Module, data: list[torch.Tensor], device: torch.device, accumulate: int = 1,
          dtype: torch.dtype | None = AUTOCAST) -> list[float]:
    """The script's loop: AdamW, the loss from HF's ``labels=``, under the script's autocast (``dtype``; None:
    fp32), the optimizer stepping after every ``accumulate`` batches' gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i, ids in enumerate(data):
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(ids, labels=ids).loss
        loss.backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def parity(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Checks 1 and 2 in a world of one process."""
    import autopar
    from autopar.parallel_model import runtime_of

    rows = []
    with world_of_one(device):
        torch.manual_seed(0)
        serial = build_llama(args.size).to(device)
        torch.manual_seed(0)
        with autopar.auto_parallelize():
            model = build_llama(args.size)
        model.to(device)
        data = batches(args.size, args.steps)
        want, got = train(serial, data, device), train(model, data, device)
        gap = max(abs(a - b) for a, b in zip(got, want))
        tol = 2e-2 * max(abs(w) for w in want)  # bf16 autocast: ~3 significant digits; fp32 was < 1e-5 here
        graphs = runtime_of(model).compiled_graphs()
        how = (f"compiled ({sum(g.compiled_runs for g in graphs)} compiled runs"
               f"{', fell back: ' + graphs[0].failed[:80] if any(g.failed for g in graphs) else ''})"
               if graphs else "eager")
        rows.append({"check": f"train ({str(AUTOCAST).removeprefix('torch.')} autocast, {args.steps} steps, {how})",
                     "result": f"max |loss - eager| {gap:.2g}", "ok": gap <= tol})
        serial.eval()
        model.eval()
        prompt = data[0][:2, :8].to(device)
        kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens, do_sample=False,
                  pad_token_id=0)
        want_ids, got_ids = serial.generate(prompt, **kw), model.generate(prompt, **kw)
        same = torch.equal(want_ids, got_ids)
        rows.append({"check": f"generate (greedy, {args.new_tokens} tokens, fp32)",
                     "result": "tokens equal" if same else "tokens differ", "ok": same})
        kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  cache_implementation="static")
        serial.generation_config.disable_compile = True  # (the oracle runs op by op)
        want_ids, got_ids = serial.generate(prompt, **kw), model.generate(prompt, **kw)
        same, replays = torch.equal(want_ids, got_ids), runtime_of(model).graph_replays()
        rows.append({"check": f"generate (greedy, static cache, {args.new_tokens} tokens, fp32, "
                              f"{replays} steps replayed as CUDA graphs)",
                     "result": "tokens equal" if same else "tokens differ", "ok": same})
        rows.append(reduce_overhead(args, device))
    return rows


def profile_step(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Kernels ``fn`` launches on CUDA (on the CPU, the aten ops called from outside another aten op) as
    ``kernels`` (not the GPU spans of ``record_function`` ranges, "Optimizer.step#AdamW.step"); on CUDA also
    ``device_ms``, the kernels' summed time (the step's time if the host never made the device wait), and
    ``top``, the 8 kernels that took longest in all (name, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    if device.type != "cuda":
        return {"kernels": sum(1 for e in events if e.name.startswith("aten::")
                               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))}
    ranges = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU}  # their GPU spans
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in ranges]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]
    return {"kernels": len(kernels), "device_ms": sum(sum(v) for v in by_name.values()) / 1e3,
            "top": [(name[:90], len(v), round(sum(v) / 1e3, 3)) for name, v in top]}


def time_steps(step: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``step`` after two warm-up steps."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(model: torch.nn.Module, ids: torch.Tensor, device: torch.device, repeats: int) -> dict[str, Any]:
    """Step time, kernels per step and peak memory of a bf16-autocast training step of ``model``; ``host_ms``:
    the median host time of each phase (forward, backward, ``opt.step()`` with ``zero_grad``), read without a
    synchronize (on CUDA the time the host takes to issue the phase's work, unless it waits on the device)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    phases: list[tuple[float, float, float]] = []

    def step() -> None:
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=AUTOCAST):
            loss = model(ids, labels=ids).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        opt.zero_grad()
        phases.append((forward - start, backward - forward, time.perf_counter() - backward))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = time_steps(step, device, repeats)
    host = [sorted(p[i] for p in phases[-repeats:])[repeats // 2] * 1e3 for i in range(3)]
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"ms": seconds * 1e3, **profile_step(step, device), "peak_mib": peak,
            "host_ms": dict(zip(("forward", "backward", "optimizer"), host))}


def simulated_rank(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One grid's rank 0 under the fake process group (run in a child process); or the serial model."""
    from autopar.compat import fake_store

    ids = batches(args.size, 1)[0].to(device)
    torch.manual_seed(0)
    if args.grid == "serial":
        return measure(build_llama(args.size).to(device), ids, device, args.repeats)
    import autopar

    row, col, depth = (int(x) for x in args.grid.split(","))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=args.simulate)
    with autopar.auto_parallelize(tensor=(row, col, depth), data=args.simulate // (row * col * depth)):
        model = build_llama(args.size)
    model.to(device)
    return measure(model, ids, device, args.repeats)


def reduce_overhead(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Check 2b: ``compile="reduce-overhead"`` (training steps replayed as CUDA graphs) against the serial model,
    fp32, with gradients accumulated over two batches (a kept ``p.grad`` must survive the next replay). CUDA
    only: on the CPU that mode compiles as ``compile=True`` does, which check 1 covers."""
    label = f"train compile='reduce-overhead' (fp32, {2 * args.steps} batches, 2 per optimizer step"
    if device.type != "cuda":
        return {"check": label + ")", "result": "skipped: CUDA graphs need CUDA", "ok": True}
    import autopar
    from autopar.parallel_model import runtime_of

    torch.manual_seed(1)
    oracle = build_llama(args.size).to(device)
    torch.manual_seed(1)
    with autopar.auto_parallelize(compile="reduce-overhead"):
        model = build_llama(args.size)
    model.to(device)
    data = batches(args.size, 2 * args.steps, seed=1)
    want, got = train(oracle, data, device, 2, None), train(model, data, device, 2, None)
    gap = max(abs(a - b) / max(abs(a), 1.0) for a, b in zip(got, want))
    graphs = runtime_of(model).compiled_graphs()
    replayed = sum(g.compiled_runs for g in graphs if g.cuda_graphs)
    return {"check": f"{label}, {replayed} runs replayed as CUDA graphs)",
            "result": f"max relative |loss - eager| {gap:.2g}", "ok": gap <= 1e-4 and replayed > 0}


def simulate(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Check 3: the serial step and each grid's rank 0, each in a child process."""
    w = args.simulate
    grids = {"serial (whole model, whole batch)": "serial", f"tensor ({w},1,1)": f"{w},1,1",
             f"tensor (1,{w},1)": f"1,{w},1", f"tensor (1,1,{w})": f"1,1,{w}"}
    rows, serial_ms = [], None
    for label, grid in grids.items():
        cmd = [sys.executable, "-m", "autopar.examples.gpu_check", "--child", grid, "--simulate", str(w),
               "--size", args.size, "--device", device.type, "--repeats", str(args.repeats)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            rows.append({"check": f"simulated {w} ranks: {label}", "result": f"failed: {tail[0][:90]}", "ok": False})
            continue
        got = json.loads(done.stdout.strip().splitlines()[-1])
        if grid == "serial":
            serial_ms = got["ms"]
        ratio = "" if serial_ms is None or grid == "serial" else f"{got['ms'] / (serial_ms / w):.2f}x serial/{w}"
        rows.append({"check": f"simulated {w} ranks: {label}", "result": ratio, "ok": True, **got})
    return rows


def table(rows: list[dict[str, Any]], header: str) -> str:
    cols = ("check", "result", "step ms", "kernels/step", "peak MiB", "")
    body = [(r["check"], r["result"], f"{r['ms']:.1f}" if "ms" in r else "", str(r.get("kernels", "")),
             f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else "", "ok" if r["ok"] else "FAIL")
            for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([header, line(cols), line(["-" * w for w in widths]), *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help="default: small on CUDA, tiny on the CPU")
    p.add_argument("--steps", type=int, default=5, help="training steps of the parity check")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--simulate", type=int, default=4, help="simulated world size (0: skip)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per simulated grid (median)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each simulated grid's child")
    p.add_argument("--child", dest="grid", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    args.size = args.size or ("small" if device.type == "cuda" else "tiny")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.grid is not None:
        print(json.dumps(simulated_rank(args, device)))
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    b, s = BATCH[args.size]
    header = (f"autopar gpu_check: {name}, torch {torch.__version__}, {args.size} Llama "
              f"(hidden {SIZES[args.size][0]}, {SIZES[args.size][1]} layers), batch {b}x{s}")
    rows = parity(args, device)
    if args.simulate > 1:
        rows += simulate(args, device)
    print(table(rows, header))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
