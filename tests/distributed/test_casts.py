"""Casting a parallel model's dtype (``model.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``), before and
after its first call, and building it in a dtype (``from_config(config, dtype=...)``, as ``from_pretrained``),
then training steps and ``generate()``. The oracle is the serial model under the same casts.

Tolerances: fp32 as in test_parity (1e-5 relative: float32 sums in another order) and greedy tokens equal. In
bf16 / fp16 the parallel sums round in another order than serial's, so a near-tie between two tokens may go
either way: each token greedy decoding chose must score within ``TOL[dtype]`` (of the logits' scale) of the
best token under the serial model fed the same sequence, and logits, losses and gradients must agree within
``TOL[dtype]`` relative (a few units of the dtype's rounding, 2^-8 for bf16, 2^-11 for fp16, over 2 layers).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.parallel_model import runtime_of
from autopar.errors import ParameterError
from autopar.examples import zoo
from tests import zoo_helpers as Z

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _pair(name: str, tensor: tuple, data: int, dtype: torch.dtype | None = None, pipeline: int = 1) -> tuple:
    """The zoo model built serially and inside auto_parallelize with the same seed (in ``dtype``: built in it,
    as ``from_pretrained(dtype=)`` does)."""
    import transformers

    config = zoo.build_model(name).config

    def build() -> torch.nn.Module:
        if dtype is None:
            return zoo.build_model(name)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)

    torch.manual_seed(0)
    serial = build()
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, data=data, pipeline=pipeline):
        model = build()
    return serial, model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _step(serial: torch.nn.Module, model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """One training forward and backward on both: loss and gradient errors relative to serial's."""
    serial.train(), model.train()
    (args, kwargs, target), = Z.batches("llama", steps=1, batch=4, seq=8)  # (token ids: any causal LM)
    want, got = Z.loss_of(serial, args, kwargs, target), Z.loss_of(model, args, kwargs, target)
    want.backward(), got.backward()
    grads = runtime_of(model).full_grads()
    names = [n for n, p in serial.named_parameters() if p.grad is not None]
    out = {"loss": abs(got.item() - want.item()) / abs(want.item()),
           "grads": _rel(torch.cat([grads[n].float().flatten() for n in names]),
                         torch.cat([serial.get_parameter(n).grad.float().flatten() for n in names])),
           "grad dtype": all(grads[n].dtype == dtype for n in names)}
    serial.zero_grad(), model.zero_grad()
    return out


def _generate(serial: torch.nn.Module, model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """Greedy decoding on both, and an eval forward's logits."""
    serial.eval(), model.eval()
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    got = model.generate(ids, max_new_tokens=4, do_sample=False)
    want = serial.generate(ids, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        logits = serial(got).logits[:, ids.shape[1] - 1:-1].float()  # serial's scores at each step parallel took
        chosen = logits.gather(-1, got[:, ids.shape[1]:, None]).squeeze(-1)
        gap = float((logits.max(-1).values - chosen).max() / logits.abs().max())
        forward = _rel(model(ids).logits.float(), serial(ids).logits.float())
    return {"tokens": bool(torch.equal(got, want)), "gap": gap, "logits": forward}


def _cast(serial: torch.nn.Module, model: torch.nn.Module, how: str) -> torch.dtype:
    """Applies the cast ``how`` (a method name, or a dtype's name for ``.to``) to both; returns the dtype."""
    for m in (serial, model):
        if hasattr(torch, how):
            m.to(getattr(torch, how))
        else:
            getattr(m, how)()
    return next(serial.parameters()).dtype


def cast_worker(name: str, tensor: tuple, data: int, scenarios: tuple[str, ...], full: bool = True) -> dict:
    """Each scenario on a fresh pair; returns {scenario: [(what, dtype, results)]} plus checks. ``full``: fp16 too,
    and every step in every dtype; without it bf16 and back, generating in bf16 only."""
    out: dict = {}
    for scenario in scenarios:
        steps = out[scenario] = []
        serial, model = _pair(name, tensor, data, torch.bfloat16 if scenario == "built" else None)
        ids = [id(p) for p in model.parameters()]
        if scenario == "before":  # cast before the first call, then back
            for how in ("bfloat16", "float"):
                dtype = _cast(serial, model, how)
                if full or dtype != torch.float32:
                    steps.append(("generate", dtype, _generate(serial, model, dtype)))
                steps.append(("train", dtype, _step(serial, model, dtype)))
        elif scenario == "after":  # an fp32 first call, then casts and back: the fp32 graph serves again
            steps.append(("train", torch.float32, _step(serial, model, torch.float32)))
            hooked = {"serial": 0, "parallel": 0}  # a script's gradient hook stays, as under serial casts
            for key, m in (("serial", serial), ("parallel", model)):
                m.get_parameter("model.norm.weight" if name == "llama" else "transformer.ln_f.weight").register_hook(
                    lambda g, key=key: hooked.__setitem__(key, hooked[key] + 1))
            for how in ("bfloat16", "half") if full else ("bfloat16",):
                dtype = _cast(serial, model, how)
                steps.append(("train", dtype, _step(serial, model, dtype)))
                steps.append(("generate", dtype, _generate(serial, model, dtype)))
            _cast(serial, model, "float32")
            for m in (serial, model):  # torch refuses integer casts of a module, serial and parallel alike
                with pytest.raises(TypeError):
                    m.to(torch.int32)
            graphs = sum(len(g) for g in runtime_of(model).executables.values())
            steps.append(("train", torch.float32, _step(serial, model, torch.float32)))
            out["recaptured"] = sum(len(g) for g in runtime_of(model).executables.values()) - graphs
            if full:
                steps.append(("generate", torch.float32, _generate(serial, model, torch.float32)))
            out["hooked"] = hooked
        else:  # built in bf16 (from_pretrained(dtype=)), then fp32
            for how in ("bfloat16", "float"):
                dtype = _cast(serial, model, how)
                steps.append(("train", dtype, _step(serial, model, dtype)))
                steps.append(("generate", dtype, _generate(serial, model, dtype)))
        out[f"{scenario} same parameters"] = ids == [id(p) for p in model.parameters()]
        out[f"{scenario} dtypes"] = [p.dtype for p in model.parameters()] == [p.dtype for p in serial.parameters()]
        if scenario == "after":  # a cast autopar cannot run: a clear error at the next call
            model.to(torch.complex64)
            try:
                model(torch.ones(4, 8, dtype=torch.long))
                out["complex"] = "no error"
            except ParameterError as e:
                out["complex"] = str(e)
    return out


def _check(results: list[dict], scenarios: tuple[str, ...]) -> None:
    for r in results:
        for scenario in scenarios:
            assert r[f"{scenario} same parameters"] and r[f"{scenario} dtypes"], scenario
            for what, dtype, got in r[scenario]:
                tol = TOL[dtype]
                if what == "train":
                    assert got["grad dtype"] and got["loss"] <= tol and got["grads"] <= tol, (scenario, dtype, got)
                else:
                    assert (got["tokens"] or dtype != torch.float32) and got["gap"] <= tol and got["logits"] <= tol, \
                        (scenario, dtype, got)
        if "after" in scenarios:
            assert r["recaptured"] == 0, r["recaptured"]  # back in fp32: the first call's graph, kept by dtype
            assert "complex" in r["complex"], r["complex"]
            assert r["hooked"]["parallel"] == r["hooked"]["serial"] > 0, r["hooked"]


def test_casts_match_serial_tensor_parallel(distributed):
    scenarios = ("before", "after")
    _check(distributed(cast_worker, 2, "llama", (2, 1, 1), 1, scenarios, False, timeout=600), scenarios)


@pytest.mark.slow
@pytest.mark.parametrize("name,tensor,data,scenarios,full", [
    ("llama", (2, 2, 1), 1, ("after",), True),
    ("llama", (1, 1, 2), 2, ("before", "after"), False),  # data x depth: gradients summed in buckets
    ("gpt2", (2, 1, 1), 1, ("before", "after", "built"), True),
    ("gpt2", (2, 2, 1), 1, ("after",), True),
    ("gpt2", (1, 1, 2), 2, ("after",), True),
], ids=["llama-2x2x1", "llama-d2x1x1x2", "gpt2-2x1x1", "gpt2-2x2x1", "gpt2-d2x1x1x2"])
def test_casts_match_serial_on_other_grids(distributed, name, tensor, data, scenarios, full):
    world = data * tensor[0] * tensor[1] * tensor[2]
    _check(distributed(cast_worker, world, name, tensor, data, scenarios, full, timeout=900), scenarios)


def pipeline_worker() -> list[tuple]:
    """Training steps of a 2-stage pipeline, through plain calls and through train_step, cast between steps
    (each rank holds one stage: the other's parameters are placeholders the cast goes through); (dtype, loss
    error, gradient error) per step."""
    out = []
    for use_train_step in (False, True):
        serial, model = _pair("llama", (1, 1, 1), 1, pipeline=2)
        (args, kwargs, target), = Z.batches("llama", steps=1, batch=4, seq=8)
        for how in ("bfloat16", "float", "half"):
            dtype = _cast(serial, model, how)
            serial.train(), model.train()
            want = Z.loss_of(serial, args, kwargs, target)
            want.backward()
            if use_train_step:
                got = autopar.train_step(model, args[0], target, lambda logits, t: F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), t.reshape(-1)))
            else:
                got = Z.loss_of(model, args, kwargs, target)
                got.backward()
            grads = runtime_of(model).full_grads()
            names = [n for n, p in serial.named_parameters() if p.grad is not None]
            out.append((use_train_step, dtype, abs(got.item() - want.item()) / abs(want.item()),
                        _rel(torch.cat([grads[n].float().flatten() for n in names]),
                             torch.cat([serial.get_parameter(n).grad.float().flatten() for n in names]))))
            serial.zero_grad(), model.zero_grad()
    return out


@pytest.mark.slow
def test_casts_between_pipeline_steps_match_serial(distributed):
    for r in distributed(pipeline_worker, 2, timeout=600):
        for use_train_step, dtype, loss, grads in r:
            assert loss <= TOL[dtype] and grads <= TOL[dtype], r


def _new_buffer_worker() -> dict:
    """A buffer given a new tensor after the first call (``model.to(device)`` does this to every buffer; a script
    may rescale RoPE): the next call reads the new one, as serial does (it read the first call's)."""
    serial, model = _pair("llama", (2, 1, 1), 1)
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    gaps = []
    with torch.no_grad():
        model(ids)
        for m in (serial, model):
            rotary = m.model.rotary_emb
            rotary.inv_freq = rotary.inv_freq * 0.5  # (a registered buffer: a new tensor in _buffers)
        want, got = serial(ids).logits, model(ids).logits
        gaps.append(float((got - want).abs().max() / want.abs().max()))
    return {"gap": max(gaps)}


def test_a_buffer_replaced_after_the_first_call_is_read(distributed):
    for got in distributed(_new_buffer_worker, 2):
        assert got["gap"] < 1e-5, got
