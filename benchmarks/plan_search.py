"""Wall time of the plan search (``autopar.plan.search``, what ``python -m autopar.plan`` and
``auto_parallelize(plan="auto")`` run), the model built on the meta device and captured included.

Each case runs in its own process: ``cold`` is the first search there (it pays torch.export's lazy
imports), ``warm`` the best of two more on a freshly built model (each search captures anew).
``exhaustive`` plans every grid instead of the closed-form screen's best, for the same best plan.

    python -m benchmarks.plan_search [--exhaustive]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = {
    "fc_net-100-layers": dict(world=8, hardware="h100-80gb"),
    "llama-100-layers": dict(world=8, hardware="h100-80gb"),
    "llama-2-70b": dict(world=1024, hardware="h100-80gb", batch=512, seq=2048),
    # Megatron-LM's 145.6B and 1T GPT (Narayanan et al. 2021, Table 1), bf16 (tests/passes/test_published_plans.py)
    "gpt-145.6b": dict(world=1536, hardware="a100-80gb", batch=2304, seq=2048, gpt=(80, 12288, 96), precision="bf16"),
    "gpt-1008b": dict(world=3072, hardware="a100-80gb", batch=3072, seq=2048, gpt=(128, 25600, 160), precision="bf16"),
}


def _build(case: str):  # noqa: ANN202  (a model and its meta inputs)
    import torch

    from autopar.examples import zoo
    from autopar.examples.fc_net import FC_Net
    from autopar.model_file import meta_inputs

    with torch.device("meta"):
        if case == "fc_net-100-layers":
            return FC_Net(num_layers=100, hidden=1024, image_size=28), (torch.empty(64, 784, device="meta"),)
        if case == "llama-100-layers":
            return zoo.build_model("llama", layers=100), meta_inputs(zoo.example_inputs("llama"), 16, 128)
        spec = CASES[case]
        if "gpt" in spec:
            import transformers

            layers, hidden, heads = spec["gpt"]
            config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=4 * hidden,
                                             vocab_size=51200, n_positions=spec["seq"], use_cache=False)
            return transformers.GPT2LMHeadModel(config), (torch.empty(spec["batch"], spec["seq"], dtype=torch.long),)
        return zoo.build_model(case), meta_inputs(zoo.example_inputs(case), spec["batch"], spec["seq"])


def run_case(case: str, exhaustive: bool) -> dict:
    from autopar.planning.machines import load_machine
    from autopar.planning.search import search

    spec = CASES[case]
    machine = load_machine(spec["hardware"])
    times, ranked = [], []
    for _ in range(1 if exhaustive else 3):
        start = time.perf_counter()
        model, inputs = _build(case)
        ranked = search(model, inputs, spec["world"], machine, keep=None if exhaustive else 8,
                        precision=spec.get("precision", "fp32"))
        times.append(time.perf_counter() - start)
    best = ranked[0]
    return {"case": case, "world": spec["world"], "grids": len(ranked),
            "planned": sum(s.time is not None for s in ranked), "cold_seconds": times[0],
            "warm_seconds": min(times[1:]) if len(times) > 1 else None, "best": best.candidate.describe(),
            "best_seconds": best.seconds, "fits": best.fits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--exhaustive", action="store_true", help="also plan every grid of the two small cases")
    args = parser.parse_args()
    if args.case:  # the child: one case, JSON on stdout
        print(json.dumps(run_case(args.case, args.exhaustive)))
        return
    runs = [(case, False) for case in CASES] + ([(c, True) for c in CASES if CASES[c]["world"] <= 8]
                                               if args.exhaustive else [])
    print("| case | GPUs | grids | planned exactly | cold (s) | warm (s) | best plan | predicted step |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for case, exhaustive in runs:
        out = subprocess.run([sys.executable, "-m", "benchmarks.plan_search", "--case", case]
                             + (["--exhaustive"] if exhaustive else []), capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        warm = "" if r["warm_seconds"] is None else f"{r['warm_seconds']:.2f}"
        print(f"| {case}{' (exhaustive)' if exhaustive else ''} | {r['world']} | {r['grids']} | {r['planned']} | "
              f"{r['cold_seconds']:.2f} | {warm} | {r['best']} | {r['best_seconds'] * 1e3:.3g} ms"
              f"{'' if r['fits'] else ' (does not fit)'} |", flush=True)


if __name__ == "__main__":
    main()
