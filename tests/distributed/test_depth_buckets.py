"""Depth grids gather each block's weights in one all-gather and reduce-scatter their gradients in one
(``autopar.runtime.ops.depth_buckets``): the same losses, gradients and bytes as one collective per weight, in
fewer calls; with recomputed blocks and under autocast too."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from autopar.examples import zoo
from autopar.parallel_model import runtime_of
from autopar.runtime.comm.collectives import comm_calls
from tests.helpers import rel_err
from tests.zoo_helpers import batches as zoo_batches


def _worker(bucketed: bool) -> dict:
    from autopar.runtime.execution import builder

    if not bucketed:  # one collective per weight, as before the buckets
        builder.bucket_depth_gathers = lambda gm, mesh: 0
    out = {}
    for name, options in (("fp32", {}), ("recompute", {"checkpoint": "full"}), ("bf16", {"precision": "bf16"})):
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=(1, 1, 4), **options):
            model = zoo.build_model("llama")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step, (args, kwargs, target) in enumerate(zoo_batches("llama", steps=3, batch=8)):
            autopar.reset_comm_stats()
            logits = model(*args, **kwargs).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
            loss.backward()
            if step == 0:
                out[name, "calls"] = comm_calls()
                out[name, "bytes"] = autopar.comm_stats()
                out[name, "grads"] = runtime_of(model).full_grads()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name, "losses"] = losses
        out[name, "params"] = {k: v.clone() for k, v in autopar.full_state_dict(model).items()}
        autopar.detach(model)
    return out


def test_bucketed_depth_collectives_give_the_per_weight_numbers_in_fewer_calls(distributed):
    whole = distributed(_worker, 4, False)[0]
    got = distributed(_worker, 4, True)
    for r, res in enumerate(got):
        for name in ("fp32", "recompute", "bf16"):
            assert max(abs(a - b) for a, b in zip(res[name, "losses"], whole[name, "losses"])) < 1e-5, (name, r)
            for k, v in whole[name, "grads"].items():
                assert rel_err(res[name, "grads"][k], v) < 1e-5, (name, r, k)
            for k, v in whole[name, "params"].items():
                assert rel_err(res[name, "params"][k], v) < 1e-5, (name, r, k)
            assert res[name, "bytes"]["total"] == whole[name, "bytes"]["total"], (name, r)
            for kind in ("all_gather", "reduce_scatter"):  # the llama's blocks: 7 weights each
                assert res[name, "calls"][kind] * 3 < whole[name, "calls"][kind], (name, r, kind, res[name, "calls"])


def _pipeline_worker(bucketed: bool) -> dict:
    from autopar.runtime.execution import builder

    if not bucketed:
        builder.bucket_depth_gathers = lambda gm, mesh: 0
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(1, 1, 2), pipeline=2, microbatches=4):
        model = zoo.build_model("llama", layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"losses": []}
    for step, (args, kwargs, target) in enumerate(zoo_batches("llama", steps=3, batch=8)):
        autopar.reset_comm_stats()
        loss = autopar.train_step(model, args[0], target, F.cross_entropy)
        if step == 1:  # (the first step captures)
            out["calls"], out["bytes"] = comm_calls(), autopar.comm_stats()
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss))
    out["params"] = {k: v.clone() for k, v in autopar.full_state_dict(model).items()}
    return out


def test_pipeline_stages_bucket_their_blocks_too(distributed):
    """pipeline 2 x depth 2 under ``train_step`` (1F1B, 4 micro-batches): each stage's blocks gather and
    reduce-scatter their weights together, with the per-weight numbers and bytes."""
    whole = distributed(_pipeline_worker, 4, False)
    got = distributed(_pipeline_worker, 4, True)
    for r, (res, want) in enumerate(zip(got, whole)):
        assert max(abs(a - b) for a, b in zip(res["losses"], want["losses"])) < 1e-5, (r, res["losses"])
        for k, v in want["params"].items():
            assert rel_err(res["params"][k], v) < 1e-5, (r, k)
        assert res["bytes"]["total"] == want["bytes"]["total"], r
        assert res["calls"]["all_gather"] * 3 < want["calls"]["all_gather"], (r, res["calls"], want["calls"])
