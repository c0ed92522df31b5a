"""The user API: errors before any collective, context hygiene, state dicts, initial parameters."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.runtime.params.layout import local_of
from autopar.parallel_model import runtime_of
from autopar.errors import ConfigError, ContextError, InputError, NotInitializedError, StateDictError
from autopar.examples.fc_net import FC_Net
from tests.helpers import SMALL, batches, rel_err, train


def test_auto_parallelize_without_process_group_raises():
    assert not dist.is_initialized()
    with pytest.raises(NotInitializedError, match="torchrun"):
        with autopar.auto_parallelize(tensor=(2, 1, 1)):
            pass


def errors_worker() -> dict:
    out = {}
    try:  # wrong world size: raised at entry, before any collective
        with autopar.auto_parallelize(tensor=(2, 2, 1), data=1):
            pass
    except ConfigError as e:
        out["world"] = str(e)
    try:
        with autopar.auto_parallelize(tensor=(2, 1, 1)):
            with autopar.auto_parallelize(tensor=(2, 1, 1)):
                pass
    except ContextError as e:
        out["nested"] = str(e)
    # Raising inside the block: nothing is parallelized, hooks are gone, a new block works.
    try:
        with autopar.auto_parallelize(tensor=(2, 1, 1)):
            broken = FC_Net(**SMALL)
            raise RuntimeError("user bug")
    except RuntimeError:
        pass
    out["broken_is_plain"] = "forward" not in vars(broken)
    stray = nn.Linear(4, 4)  # built outside any block
    out["stray_is_plain"] = "forward" not in vars(stray)
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 1)) as config:
        model = FC_Net(**SMALL)
    out["config"] = (config.data, config.tensor)
    x, y = batches(steps=2)[0]
    out["output_shape"] = tuple(model(x).shape)
    try:
        model(x[:1])
    except InputError:
        out["small_batch"] = "not reached: data*depth is 1 here"
    # data inferred: 2 ranks, tensor (1,1,1) -> data 2; batch of 1 row cannot be split.
    with autopar.auto_parallelize() as config:
        dp = FC_Net(**SMALL)
    out["default"] = (config.data, config.tensor)
    out["signature"] = str(inspect.signature(dp.forward))
    try:
        dp(x[:1])
    except InputError as e:
        out["small_batch"] = str(e)
    return out


def test_errors_and_context_hygiene(distributed):
    r = distributed(errors_worker, 2)[0]
    assert "world size 2 does not match" in r["world"] and "nproc-per-node 4" in r["world"]
    assert "nested" in r["nested"]
    assert r["broken_is_plain"] and r["stray_is_plain"]
    assert r["config"] == (1, (2, 1, 1))
    assert r["output_shape"] == (13, 10)
    assert r["default"] == (2, (1, 1, 1))
    assert r["signature"] == "(x: 'torch.Tensor') -> 'torch.Tensor'"  # FC_Net's own (postponed) annotations
    assert "smaller than data*depth = 2" in r["small_batch"]


def state_worker() -> dict:
    torch.manual_seed(0)
    serial = FC_Net(**SMALL)
    serial_sd = {k: v.clone() for k, v in serial.state_dict().items()}
    x, y = batches(steps=2)[0]
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 2), data=1, example_inputs=(x,)):
        model = FC_Net(**SMALL)
    out = {}
    # Sharded at the end of the block (example_inputs), equal to serial exactly.
    full = autopar.full_state_dict(model)
    out["init_exact"] = all(torch.equal(full[k], serial_sd[k]) for k in serial_sd)
    out["sharded"] = sum(local_of(p).numel() for p in model.parameters()) < sum(v.numel() for v in serial_sd.values())
    out["serial_count"] = sum(p.numel() for p in model.parameters()) == sum(v.numel() for v in serial_sd.values())
    # Load a different serial state dict (e.g. a checkpoint) and get it back exactly.
    torch.manual_seed(1)
    other = FC_Net(**SMALL).state_dict()
    model.load_state_dict(other)
    back = autopar.full_state_dict(model)
    out["load_roundtrip"] = all(torch.equal(back[k], other[k]) for k in other)
    serial.load_state_dict(other)
    out["same_output_after_load"] = rel_err(model(x), serial(x)) < 1e-5
    bad = dict(other)
    bad["layers.0.fc1.weight"] = torch.zeros(3, 3)
    try:
        model.load_state_dict(bad)
    except StateDictError as e:
        out["bad_shape"] = str(e)
    return out


def test_state_dicts_round_trip_serial_format(distributed):
    r = distributed(state_worker, 4)[0]
    assert r["init_exact"] and r["sharded"] and r["serial_count"]
    assert r["load_roundtrip"] and r["same_output_after_load"]
    assert "layers.0.fc1.weight" in r["bad_shape"] and "(64, 16)" in r["bad_shape"]


def unseeded_worker() -> dict:
    torch.manual_seed(dist.get_rank())  # a script that forgot a common seed
    with autopar.auto_parallelize(tensor=(2, 1, 1)):
        model = FC_Net(**SMALL)
    x, y = batches(steps=2)[0]
    loss = F.cross_entropy(model(x), y)
    return {"loss": loss.item(), "full": {k: v.numpy() for k, v in autopar.full_state_dict(model).items()}}


def test_unseeded_ranks_agree_on_rank0_parameters(distributed):
    r0, r1 = distributed(unseeded_worker, 2)
    assert r0["loss"] == r1["loss"]
    torch.manual_seed(0)
    serial = FC_Net(**SMALL).state_dict()
    assert all((torch.from_numpy(r0["full"][k]) == serial[k]).all() for k in serial)


def eval_worker() -> dict:
    """eval mode and no_grad re-capture; an unused input shape keeps the same plan."""
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(1, 2, 1), data=2):
        model = FC_Net(**SMALL)
    x, _ = batches(steps=2)[0]
    model.eval()
    with torch.no_grad():
        y1 = model(x)
    model.train()
    y2 = model(x[:7])
    torch.manual_seed(0)
    serial = FC_Net(**SMALL)
    return {"eval": rel_err(y1, serial(x)), "train": rel_err(y2, serial(x[:7])),
            "executables": len(runtime_of(model).executables)}


def test_eval_and_new_shapes_recompile(distributed):
    r = distributed(eval_worker, 4)[0]
    assert r["eval"] < 1e-6 and r["train"] < 1e-6
    assert r["executables"] == 2


def _clip(step: int, model: nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the script's own clipping, before its step


def built_outside_worker() -> dict:
    torch.manual_seed(0)
    model = FC_Net(**SMALL)  # built outside any block, whole on every rank
    out = {"same": autopar.parallelize_module(model, tensor=(2, 1, 1)) is model,
           "tensor": tuple(runtime_of(model).config.tensor)}
    out["losses"] = train(model, batches(steps=3, batch=8, last=8), on_step=_clip)
    out["params"] = autopar.full_state_dict(model)
    try:
        autopar.parallelize_module(model, tensor=(2, 1, 1))
    except ContextError as e:
        out["again"] = str(e)
    return out


def test_a_model_built_outside_a_block_is_parallelized_by_parallelize_module(distributed):
    """``autopar.parallelize_module`` (what Fabric's setup does for a model built outside init_module): the
    same keywords as auto_parallelize, the same training as serial (losses, parameters after 3 AdamW steps
    with the script's clip_grad_norm_)."""
    torch.manual_seed(0)
    serial = FC_Net(**SMALL)
    losses = train(serial, batches(steps=3, batch=8, last=8), on_step=_clip)
    for r in distributed(built_outside_worker, 2):
        assert r["same"] and r["tensor"] == (2, 1, 1) and "already parallelized" in r["again"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], losses)), (r["losses"], losses)
        for k, v in serial.state_dict().items():
            assert rel_err(r["params"][k], v) < 1e-5, k
