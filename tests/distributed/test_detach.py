"""Every change autopar makes outside its own objects is undone: ``autopar.detach(model)`` gives the plain
module back, and torch's process-wide tables lose autopar's entries with the last parallel model, also when
an exception is raised inside a scope (the block, a forward, an optimizer step)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import patches
from autopar.compat import (dtensor_op_handlers, fx_builtin_names, module_hook_tables, optimizer_global_hooks,
                            post_accumulate_grad_hooks, pytree_node_types, tensor_hooks)
from autopar.examples.fc_net import FC_Net
from passes.ir import SPEC_TYPES
from tests.helpers import SMALL, batches, rel_err


def globals_now() -> dict:
    """torch's process-wide tables autopar may change, and autopar's own record of its changes."""
    pre, post = optimizer_global_hooks()
    return {"optimizer pre-hooks": len(pre), "optimizer post-hooks": len(post),
            "autopar's DTensor handlers": sorted(str(op) for op, handler in dtensor_op_handlers().items()
                                                 if getattr(handler, "__module__", "").startswith("autopar")),
            "fx names of autopar's specs": sorted(fx_builtin_names() & {t.__name__ for t in SPEC_TYPES}),
            "HF caches as pytrees": sorted(c.__qualname__ for c in pytree_node_types()
                                           if c.__module__.startswith("transformers") and "Cache" in c.__name__),
            "torch.distributed collectives wrapped": sorted(n for n in dir(dist) if getattr(getattr(dist, n),
                                                                                  "names_parted_ranks", False)),
            "patches": patches.inventory()}


def module_now(model: nn.Module) -> dict:
    """What autopar may change on a module: instance attributes, hooks, parameter types and hooks."""
    return {"attributes": sorted(k for k in vars(model) if not k.startswith("_")),
            "state_dict hooks": len(module_hook_tables(model)["state_dict"]),
            "load hooks": sum(len(module_hook_tables(m)["load_state_dict_pre"]) for m in model.modules()),
            "parameter types": sorted({type(p).__name__ for p in model.parameters()}),
            "parameter hooks": sum(len(tensor_hooks(p) or {}) + len(post_accumulate_grad_hooks(p) or {})
                                   for p in model.parameters())}


def refuse(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    raise RuntimeError("refused by the script")


def steps(model: nn.Module, opt: torch.optim.Optimizer, data: list, fail_at: int | None = None) -> list[float]:
    """AdamW steps with clipping; at step ``fail_at`` a forward raises (inputs of the wrong width) and the
    step raises (a step pre-hook of the script's), as they would on the serial model, and then it runs."""
    losses = []
    for i, (x, y) in enumerate(data):
        if i == fail_at:
            try:
                model(x[:, :3])
            except Exception:
                pass
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if i == fail_at:  # the script's own step hook raises after autopar's ran: the step does not happen
            handle = opt.register_step_pre_hook(refuse)
            try:
                opt.step()
            except RuntimeError:
                pass
            handle.remove()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def detach_worker(grid: dict) -> dict:
    out = {}
    data = batches(steps=3, batch=8, last=8)
    torch.manual_seed(0)
    serial = FC_Net(**SMALL)
    plain_module = module_now(serial)
    before = globals_now()
    serial_losses = steps(serial, torch.optim.AdamW(serial.parameters(), lr=1e-2), data, fail_at=1)

    # an exception inside the block: nothing stays installed
    try:
        with autopar.auto_parallelize(**grid):
            FC_Net(**SMALL)
            raise RuntimeError("user bug")
    except RuntimeError:
        pass
    gc.collect()
    out["after a failed block"] = globals_now() == before

    torch.manual_seed(0)
    with autopar.auto_parallelize(**grid):
        model = FC_Net(**SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = steps(model, opt, data, fail_at=1)
    out["installed"] = globals_now()["patches"]
    out["optimizer holds the model's parameters"] = all(
        a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters()))
    out["optimizer state keys"] = all(any(k is p for p in model.parameters()) for k in opt.state)
    out["loss gap"] = max(abs(a - b) for a, b in zip(losses, serial_losses))

    plain = autopar.detach(model)
    out["same module"] = plain is model
    out["module"] = module_now(model) == plain_module, module_now(model), plain_module
    out["parameter gap"] = max(rel_err(p, q) for p, q in zip(model.parameters(), serial.parameters()))
    x = data[0][0]
    out["output gap"] = rel_err(model(x), serial(x))
    out["globals restored"] = globals_now() == before, globals_now(), before
    try:
        autopar.plan_of(model)
    except autopar.AutoparError:
        out["no runtime"] = True

    # a model dropped without detach: the process's changes go with it
    with autopar.auto_parallelize(**grid):
        other = FC_Net(**SMALL)
    opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    steps(other, opt, data[:1])
    out["installed again"] = bool(globals_now()["patches"]["process"])
    del other, opt
    gc.collect()
    out["globals after drop"] = globals_now() == before

    # the detached module parallelized again, then detached again
    autopar.parallelize_module(model, **grid)
    out["again"] = rel_err(model(x), serial(x))
    autopar.detach(model)
    out["globals after the second detach"] = globals_now() == before and module_now(model) == plain_module
    return out


GRIDS = [dict(tensor=(2, 1, 1)), dict(data=2), dict(tensor=(1, 1, 2)),
         pytest.param(dict(pipeline=2), marks=pytest.mark.slow)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: ",".join(f"{k}={v}" for k, v in g.items()))
def test_detach_gives_the_plain_module_back_and_undoes_every_patch(distributed, grid):
    """Build, train (with clipping and a step that raises), detach: the module, its parameters and torch's
    tables are as before autopar, with serial's values; a model dropped without detach undoes the
    process's changes too. Mutations: an undo left out of ModelPatches or of the process's set, or the
    optimizer step run on the script's optimizer with twins, each fail it."""
    for out in distributed(detach_worker, 2, grid):
        assert out["after a failed block"]
        assert "torch.optim step hooks" in out["installed"]["process"] or grid == dict(data=2)
        assert out["optimizer holds the model's parameters"] and out["optimizer state keys"]
        assert out["loss gap"] < 1e-5
        assert out["same module"]
        assert out["module"][0], out["module"][1:]
        assert out["parameter gap"] < 1e-5 and out["output gap"] < 1e-5
        assert out["globals restored"][0], out["globals restored"][1:]
        assert out["no runtime"]
        assert out["installed again"] or grid == dict(data=2)
        assert out["globals after drop"]
        assert out["again"] < 1e-5 and out["globals after the second detach"]


def hf_worker() -> dict:
    from autopar.examples import zoo

    out = {}
    torch.manual_seed(0)
    serial = zoo.build_model("llama").eval()
    plain_module = module_now(serial)
    before = globals_now()
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 1)):
        model = zoo.build_model("llama")
    model.eval()
    ids = torch.randint(1, 100, (2, 8))
    want = serial.generate(ids, max_new_tokens=6, do_sample=False)
    out["tokens while parallel"] = torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    out["caches registered"] = bool(globals_now()["HF caches as pytrees"])
    autopar.detach(model)
    out["tokens after detach"] = torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    out["module"] = module_now(model) == plain_module, module_now(model), plain_module
    out["globals restored"] = globals_now() == before, globals_now(), before
    return out


def test_detach_an_hf_model_after_generate(distributed):
    """HF's Llama at tensor (2,1,1): generate() as serial's, then detach: the plain module generates serial's
    tokens with its own generate(), and HF's cache classes are no longer pytrees (mutation: the pytree
    registration left in place fails it)."""
    for out in distributed(hf_worker, 2):
        assert out["tokens while parallel"] and out["caches registered"]
        assert out["tokens after detach"]
        assert out["module"][0], out["module"][1:]
        assert out["globals restored"][0], out["globals restored"][1:]
