"""Mixed precision on gloo ranks: bf16/fp16 compute with fp32 master weights; fp16 overflow agreed by all ranks."""

from __future__ import annotations

import pytest
import torch

from autopar.examples import zoo
from tests import zoo_helpers as Z

# Stated tolerance: over 5 AdamW steps of the tiny zoo models, bf16/fp16 losses stay within 1% of fp32.
LOSS_RTOL = 1e-2


def _train(name: str, data: list, tensor: tuple[int, int, int], precision: str, reduce_dtype: str = "fp32") -> dict:
    import autopar

    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, precision=precision, reduce_dtype=reduce_dtype):
        model = zoo.build_model(name)
    args, kwargs, _ = data[0]
    logits = zoo.logits_of(model(*args, **kwargs))
    losses, _ = Z.train(model, data)
    return {"losses": losses, "logits_dtype": logits.dtype,
            "rounded": bool(torch.equal(logits.to(torch.bfloat16 if precision == "bf16" else torch.float16).float(),
                                        logits)),
            "param_dtypes": {p.dtype for p in model.parameters()}}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name,tensor", [("llama", (2, 1, 1)), ("gpt2", (1, 1, 2))])
def test_half_precision_tracks_fp32_losses(name, tensor, precision, distributed):
    data = Z.batches(name, steps=5)
    want, _ = Z.serial(name, data)
    for r in distributed(_train, 2, name, data, tensor, precision):
        assert r["logits_dtype"] == torch.float32 and r["rounded"]  # computed in half, returned as fp32
        assert r["param_dtypes"] == {torch.float32}  # master weights
        for got, ref in zip(r["losses"], want, strict=True):
            assert abs(got - ref) <= LOSS_RTOL * abs(ref), (r["losses"], want)


def test_gradients_reduced_in_bf16_still_track_fp32(distributed):
    data = Z.batches("llama", steps=5)
    want, _ = Z.serial("llama", data)
    for r in distributed(_train, 4, "llama", data, (2, 1, 2), "bf16", "bf16"):
        for got, ref in zip(r["losses"], want, strict=True):
            assert abs(got - ref) <= LOSS_RTOL * abs(ref), (r["losses"], want)


def _overflow_on_rank_0() -> dict:
    import torch.distributed as dist

    import autopar
    from autopar.decisions import ParamKind

    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 1), precision="fp16"):
        model = zoo.build_model("llama")
    (args, kwargs, target), = Z.batches("llama", steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    Z.loss_of(model, args, kwargs, target)  # compiles: parameters become shards
    split = [p for p in autopar.plan_of(model).params if p.kind is not ParamKind.REPLICATED][0]
    weight = dict(model.named_parameters())[split.name]
    if dist.get_rank() == 0:  # this rank's shard alone overflows
        weight.register_hook(lambda g: g * float("inf"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler.scale(Z.loss_of(model, args, kwargs, target)).backward()
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return {"unchanged": unchanged, "scale": scaler.get_scale()}


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(distributed):
    results = distributed(_overflow_on_rank_0, 2)
    assert all(r["unchanged"] for r in results), results
    assert {r["scale"] for r in results} == {2.0**9}  # both halved their scale


@pytest.mark.parametrize("name", zoo.NAMES)
def test_every_zoo_model_trains_in_bf16(name, distributed):
    # GPT-Neo casts q/k to float32 itself; export records a dtype assertion that autocast would trip.
    data = Z.batches(name, steps=3)
    want, _ = Z.serial(name, data)
    for r in distributed(_train, 2, name, data, (2, 1, 1), "bf16"):
        assert r["rounded"]
        for got, ref in zip(r["losses"], want, strict=True):
            assert abs(got - ref) <= LOSS_RTOL * abs(ref), (name, r["losses"], want)
