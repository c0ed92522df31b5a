"""Sequence parallelism (``auto_parallelize(sequence_parallel=True)``, ``passes.analysis.layouts.sequence_split``):
a matmul that would all-reduce a whole output over row (or col) reduce-scatters it along the tokens, the
norms and residual adds after it run on 1/n of the tokens, and the next matmuls' all-gather reduce-scatters
their input gradient. Oracle: the serial model, same seed and data: losses (HF's ``labels=`` loss, in
forward), first-step gradients, final parameters, ``model(x)``'s logits and greedy ``generate()`` tokens;
and the plan's predicted bytes against ``comm_stats()``, on tensor, data x tensor, depth, checkpointed and
pipelined grids; the predicted activation bytes fall."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.examples import zoo
from autopar.parallel_model import plan_of, runtime_of
from autopar.planning.planner import plan_model
from tests.helpers import SettleCollectives, rel_err, train_with_labels

TOL = 1e-5


def _data(steps: int = 3, batch: int = 4, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, zoo.VOCAB, (batch, seq), generator=g) for _ in range(steps)]


def _build(name: str, frozen: tuple[str, ...] | Callable[[str], bool]) -> torch.nn.Module:
    """``frozen``: prefixes of the parameters to freeze, or whether to freeze a parameter by its name."""
    model = zoo.build_model(name)
    for n, p in model.named_parameters():
        if frozen(n) if callable(frozen) else any(n.startswith(f) for f in frozen):
            p.requires_grad_(False)
    return model


def _bias_only(name: str) -> bool:
    """Frozen but the first block's attention output bias and the last block: that bias's matmul (its output
    reduce-scattered) trains neither its input nor its weight, and backward all-gathers its gradient for it."""
    return name != "transformer.h.0.attn.c_proj.bias" and not name.startswith("transformer.h.1.")


def _case(name: str, tensor: tuple[int, int, int], options: dict) -> dict:
    options = dict(options)
    frozen = options.pop("frozen", ())
    data = _data()
    torch.manual_seed(0)
    serial = _build(name, frozen)
    want = train_with_labels(serial, data, lambda m: {n: p.grad.clone() for n, p in m.named_parameters()
                                                      if p.grad is not None}, 8)
    want_params = {k: v.detach().clone() for k, v in serial.state_dict().items()}
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, sequence_parallel=True, **options):
        model = _build(name, frozen)
    got = train_with_labels(model, data, lambda m: {k: v for k, v in runtime_of(m).full_grads().items()
                                                    if v is not None}, 8)
    final = autopar.full_state_dict(model)
    config = runtime_of(model).config
    with torch.device("meta"):
        shadow = _build(name, frozen)
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    _, report = plan_model(shadow, (ids,), config, kwargs={"labels": ids, "use_cache": False},
                           rank=dist.get_rank(), checkpoint=options.get("checkpoint", "auto"))
    out = {
        "loss": max(abs(a - b) for a, b in zip(want["losses"], got["losses"])),
        "grads": max(rel_err(want["grads"][k], got["grads"][k]) for k in want["grads"]),
        "params": max(rel_err(want_params[k], final[k]) for k in final if k in want_params),
        "logits": rel_err(want["logits"], got["logits"]),
        "tokens": torch.equal(want["tokens"], got["tokens"]),
        "config": str(plan_of(model).config),
        "comm": got["comm"],
        "predicted": float(report.comm_bytes_per_step),
        "scattered": sum(c.kind == "reduce_scatter" and c.axis in ("row", "col") and c.phase == "forward"
                         for c in report.collectives),
    }
    autopar.detach(model)
    return out


CASES = [("llama", (4, 1, 1), {}), ("gpt2", (1, 4, 1), {}), ("llama", (2, 1, 1), {"data": 2}),
         ("llama", (1, 2, 2), {}), ("llama", (2, 1, 1), {"data": 2, "checkpoint": "full"}),
         ("llama", (4, 1, 1), {"frozen": ("lm_head", "model.layers.0.mlp")}),
         ("gpt2", (1, 4, 1), {"frozen": _bias_only})]
"""Tensor over row and over col (HF Llama: tokens in dim 1; GPT-2's Conv1D: the rows of a 2-D product),
data x tensor, col x depth (depth buckets), every block recomputed, frozen weights (a gathered input its readers
need not keep: no regather), and a scattered matmul of which only the bias trains."""


def _worker() -> list[dict]:
    return [_case(name, tensor, options) for name, tensor, options in CASES]


def test_sequence_parallel_matches_serial_with_predicted_bytes(distributed):
    results = distributed(_worker, 4, timeout=600)
    for rank, per_case in enumerate(results):
        for (name, tensor, options), r in zip(CASES, per_case, strict=True):
            where = f"rank {rank}, {name} at {tensor} {options}"
            assert "sequence_parallel" in r["config"] and r["scattered"] > 0, (where, r["config"])
            for what in ("loss", "grads", "params", "logits"):
                assert r[what] < TOL, f"{where}: {what} differ by {r[what]:.2e}"
            assert r["tokens"], f"{where}: generate() tokens differ"
            if "checkpoint" not in options:  # (the step report leaves out a recomputed forward's collectives)
                assert all(c == r["predicted"] for c in r["comm"]), f"{where}: {r['comm']} != {r['predicted']}"


def _pipeline_worker() -> dict:
    """pipeline 2 x tensor (2, 1, 1) under ``train_step`` (1F1B, 4 micro-batches): stage boundaries carry
    activations split along the tokens."""
    data = _data(steps=3, batch=8)
    torch.manual_seed(0)
    serial = zoo.build_model("llama", layers=4)
    opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    want = []
    for ids in data:
        logits = serial(ids, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    want_params = {k: v.detach().clone() for k, v in serial.state_dict().items()}
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 1), pipeline=2, microbatches=4, sequence_parallel=True):
        model = zoo.build_model("llama", layers=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    got, calls = [], None
    for step, ids in enumerate(data):
        autopar.reset_comm_stats()
        loss = autopar.train_step(model, {"input_ids": ids, "use_cache": False}, ids, F.cross_entropy)
        if step == 1:
            calls = autopar.runtime.comm.collectives.comm_calls()
        opt.step()
        opt.zero_grad()
        got.append(float(loss))
    final = autopar.full_state_dict(model)
    return {"loss": max(abs(a - b) for a, b in zip(want, got)),
            "params": max(rel_err(want_params[k], final[k]) for k in final if k in want_params),
            "config": str(plan_of(model).config), "calls": calls}


def test_sequence_parallel_under_a_pipeline_matches_serial(distributed):
    for rank, r in enumerate(distributed(_pipeline_worker, 4, timeout=600)):
        assert "sequence_parallel" in r["config"] and r["calls"]["reduce_scatter"] > 0, (rank, r)
        assert r["loss"] < TOL and r["params"] < TOL, (rank, r)


def _activation_peak(sequence_parallel: bool) -> tuple[int, int]:
    """(measured activation peak of one step, the plan's prediction) on this rank: llama, 6 blocks, 8 x 64."""
    from autopar.memory import LiveBytes

    args = zoo.example_inputs("llama", 8, 64)
    target = torch.randint(0, zoo.VOCAB, (8, 64), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 1), checkpoint="none", sequence_parallel=sequence_parallel):
        model = zoo.build_model("llama", layers=6)
    model(*args)  # (shards outside the measurement)
    peaks = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with LiveBytes() as live, SettleCollectives():
            F.cross_entropy(zoo.logits_of(model(*args)).flatten(0, 1), target.flatten()).backward()
        peaks.append(live.peak_bytes(exclude=[p.grad for p in model.parameters() if p.grad is not None]))
    return min(peaks), plan_of(model).memory.activation_bytes


@pytest.mark.slow
def test_measured_activations_fall_as_the_plan_predicts(distributed):
    """Measured ~5.6-5.8 -> ~4.3-4.5 MB at tensor (2, 1, 1) (the toy's attention scores and logits, split by heads
    and vocabulary either way, are most of it). The plan over-predicts both by 3-11% (never under by more than
    2%): measured here, the same with and without the split."""
    plain = distributed(_activation_peak, 2, False)
    split = distributed(_activation_peak, 2, True)
    for rank, ((m0, p0), (m1, p1)) in enumerate(zip(plain, split)):
        for m, p in ((m0, p0), (m1, p1)):
            assert -0.02 * m <= p - m <= 0.12 * m, (rank, m0, p0, m1, p1)
        assert m1 < 0.8 * m0, (rank, m0, m1)


def _variants_worker() -> dict:
    """Losses of three steps with and without the split, in bf16 and compiled (compile=True: Inductor's
    partitioner decides what backward keeps; the gathers and reduce-scatters are graph nodes)."""
    from tests.zoo_helpers import batches, loss_of

    out = {}
    for name, options in (("bf16", {"precision": "bf16"}), ("compiled", {"compile": True})):
        for split in (False, True):
            torch.manual_seed(0)
            with autopar.auto_parallelize(tensor=(2, 1, 1), sequence_parallel=split, **options):
                model = zoo.build_model("llama")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for args, kwargs, target in batches("llama", steps=3):
                loss = loss_of(model, args, kwargs, target)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out[name, split] = losses
            autopar.detach(model)
    return out


@pytest.mark.slow
def test_sequence_parallel_in_bf16_and_compiled_gives_the_unsplit_losses(distributed):
    """Oracle: the same grid without the split (itself tested against serial): bf16 within its rounding (4e-5
    measured), compiled within 1e-5 (0 measured)."""
    for rank, r in enumerate(distributed(_variants_worker, 2, timeout=900)):
        assert max(abs(a - b) for a, b in zip(r["bf16", False], r["bf16", True])) < 2e-4, (rank, r)
        assert max(abs(a - b) for a, b in zip(r["compiled", False], r["compiled", True])) < TOL, (rank, r)
