"""Checkpoints as unchanged scripts write them, against the run that was never interrupted.

Every resume starts a new model and optimizer (another seed, no step taken), loads, and trains on:
its next losses must equal the uninterrupted run's (bitwise at the same grid, within 1e-6 across
grids: only the order of float32 sums differs), also from a run with ``sequence_parallel``. GPT-2 covers
the fused c_attn (its q/k/v pieces are each split: several boxes per rank) and the tied wte/lm_head (on
the first and the last pipeline stage).
"""

from __future__ import annotations

import copy
import io
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

import autopar
from autopar.compat import DTENSOR_HANDLES_FUSED_PIECES
from autopar.errors import CheckpointError, ContextError, StateDictError
from autopar.examples import zoo
from autopar.parallel_model import plan_of
from autopar.runtime.comm.collectives import comm_calls
from autopar.runtime.params.layout import local_of
from tests.zoo_helpers import batches as zoo_batches

RESUME_TOL = 1e-6
FULL = StateDictOptions(full_state_dict=True)


def _shared_dir() -> str:
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


def _build(grid: tuple, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    tensor, data, pipeline, *sp = grid  # (a fourth True: sequence_parallel)
    torch.manual_seed(seed)
    with autopar.auto_parallelize(tensor=tensor, data=data, pipeline=pipeline, sequence_parallel=bool(sp)):
        model = zoo.build_model("gpt2")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple, pipeline: int) -> float:
    args, kwargs, target = batch
    if pipeline > 1:
        loss = autopar.train_step(model, args[0], target, F.cross_entropy)
    else:
        logits = zoo.logits_of(model(*args, **kwargs))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


SAVE = {"t211-d2": ((2, 1, 1), 2, 1), "p2-d2": ((1, 1, 1), 2, 2), "t411-sp": ((4, 1, 1), 1, 1, True)}
RESUMES = [  # (saved at, loaded at, how)
    ("t211-d2", ((2, 1, 1), 2, 1), "dcp"),       # the same grid: bitwise
    ("t211-d2", ((1, 2, 1), 1, 2), "dcp"),       # tensor -> pipeline x col
    ("p2-d2", ((2, 1, 2), 1, 1), "dcp"),         # pipeline -> row x depth
    ("t211-d2", ((1, 1, 1), 4, 1), "dcp"),       # tensor -> data only (plain tensors)
    ("p2-d2", ((2, 2, 1), 1, 1), "file"),        # one serial-format file, saved from rank 0
    ("t211-d2", ((1, 1, 1), 2, 2), "file"),
    ("t211-d2", ((1, 1, 1), 2, 2), "torch file"),  # torch's set_model/optimizer_state_dict(full_state_dict=True)
    ("t211-d2", ((2, 1, 1), 2, 1), "model only"),  # the mutation: the optimizer state is not loaded
    ("t411-sp", ((4, 1, 1), 1, 1, True), "dcp"),  # sequence parallelism (GPT-2's rows: no batch split): bitwise
    ("t411-sp", ((2, 1, 1), 2, 1), "dcp"),        # ... into a grid without it
]


def resume_worker() -> dict:
    root = _shared_dir()
    data = zoo_batches("gpt2", steps=6, batch=8)
    out: dict = {"uninterrupted": {}, "resumed": [], "pickle": {}}
    for name, grid in SAVE.items():
        model, opt = _build(grid, 0)
        autopar.reset_comm_stats()
        for b in data[:3]:
            _step(model, opt, b, grid[2])
        if len(grid) > 3:  # the run saved really split its activations along the tokens
            out["sequence_parallel"] = (str(plan_of(model).config), comm_calls().get("reduce_scatter", 0))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, name))
        # The single-file idiom done right: gathered on every rank, written by rank 0.
        full = {"model": autopar.full_state_dict(model), "optimizer": autopar.full_optimizer_state_dict(model, opt)}
        if grid[2] == 1:  # torch's own full helpers (they cannot reach other pipeline stages' parameters)
            torch_full = {"model": get_model_state_dict(model, options=FULL),
                          "optimizer": get_optimizer_state_dict(model, opt, options=FULL)}
        else:
            try:  # it holds placeholders for other stages' parameters: saving it raises
                torch.save(get_model_state_dict(model, options=FULL), io.BytesIO())
                out["pipeline_full"] = "no error"
            except CheckpointError as e:
                out["pipeline_full"] = str(e)
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(root, name + ".pt"))
            if grid[2] == 1:
                torch.save(torch_full, os.path.join(root, name + ".torch.pt"))
            # ... and done wrong: rank 0 pickles its own shards.
            for what, sd in (("model", model.state_dict()), ("optimizer", opt.state_dict())):
                try:
                    torch.save(sd, io.BytesIO())
                    out["pickle"][what] = "saved"
                except CheckpointError as e:
                    out["pickle"][what] = str(e)
        dist.barrier()
        out["uninterrupted"][name] = [_step(model, opt, b, grid[2]) for b in data[3:]]
    for name, grid, how in RESUMES:
        model, opt = _build(grid, 1)
        if how == "dcp":
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=os.path.join(root, name))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        elif how == "torch file":
            ckpt = torch.load(os.path.join(root, name + ".torch.pt"))
            set_model_state_dict(model, ckpt["model"], options=FULL)
            set_optimizer_state_dict(model, opt, ckpt["optimizer"], options=FULL)
        else:
            ckpt = torch.load(os.path.join(root, name + ".pt"))
            model.load_state_dict(ckpt["model"])
            if how == "file":
                autopar.load_full_optimizer_state_dict(model, opt, ckpt["optimizer"])
        out["resumed"].append([_step(model, opt, b, grid[2]) for b in data[3:]])
    if dist.get_rank() == 0:  # the DCP checkpoint in the serial format, for the serial model
        dcp_to_torch_save(os.path.join(root, "t211-d2"), os.path.join(root, "serial.pt"))
        out["serial_state"] = torch.load(os.path.join(root, "serial.pt"))["model"]
    return out


@pytest.mark.slow
def test_resumes_continue_the_uninterrupted_run(distributed):
    results = distributed(resume_worker, 4, timeout=600)
    for r in results:
        for (name, grid, how), resumed in zip(RESUMES, r["resumed"]):
            want = r["uninterrupted"][name]
            if how == "model only":  # the checks see a lost optimizer state
                assert max(abs(a - b) / abs(b) for a, b in zip(resumed, want)) > 1e-3
                continue
            if SAVE[name] == grid:
                assert resumed == want, (name, grid, how, resumed, want)
            err = max(abs(a - b) / abs(b) for a, b in zip(resumed, want))
            assert err < RESUME_TOL, (name, grid, how, err)
    for r in results:
        config, scatters = r["sequence_parallel"]
        assert "sequence_parallel" in config and scatters > 0, (config, scatters)
    for r in results:  # torch's full gather under a pipeline cannot be saved without other stages' values
        assert "pipeline rank(s)" in r["pipeline_full"], r["pipeline_full"]
    pickled = results[0]["pickle"]
    for what in ("model", "optimizer"):
        assert "torch.distributed.checkpoint" in pickled[what] and "autopar.full_state_dict" in pickled[what], pickled
    # dcp_to_torch_save gives the serial state dict: the serial model loads it, every key and value.
    torch.manual_seed(0)
    serial = zoo.build_model("gpt2")
    assert not serial.load_state_dict(results[0]["serial_state"], strict=True).missing_keys


def helpers_worker() -> dict:
    torch.manual_seed(0)
    serial = zoo.build_model("gpt2")
    data = zoo_batches("gpt2", steps=2, batch=8)
    model, opt = _build(((2, 1, 1), 2, 1), 0)
    _step(model, opt, data[0], 1)
    out = {}
    full = get_model_state_dict(model, options=FULL)
    ours = autopar.full_state_dict(model)
    out["model_full_equal"] = full.keys() == ours.keys() and all(torch.equal(full[k], ours[k]) for k in ours)
    tosd = get_optimizer_state_dict(model, opt, options=FULL)
    aosd = autopar.full_optimizer_state_dict(model, opt)
    out["optim_full_equal"] = tosd["state"].keys() == aosd["state"].keys() and all(
        torch.equal(torch.as_tensor(tosd["state"][k][j]), torch.as_tensor(v)) for k, e in aosd["state"].items()
        for j, v in e.items())
    # A serial state dict in, through torch's helper: this rank's pieces of it, the serial values back out.
    set_model_state_dict(model, serial.state_dict(), options=FULL)
    back = autopar.full_state_dict(model)
    out["set_full_equal"] = all(torch.equal(back[k], v) for k, v in serial.state_dict().items())
    # dcp.save(model.state_dict()) / dcp.load(model.state_dict()) at one grid, the plainest DCP idiom.
    root = _shared_dir()
    dcp.save(model.state_dict(), checkpoint_id=root)
    model2, _ = _build(((1, 2, 1), 2, 1), 3)
    model2(*data[0][0])  # sharded: the load reshards
    sd = model2.state_dict()
    dcp.load(sd, checkpoint_id=root)
    model2.load_state_dict(sd)
    again = autopar.full_state_dict(model2)
    out["dcp_reshard_equal"] = all(torch.equal(again[k], v) for k, v in back.items())
    return out


def test_torch_state_dict_helpers_and_plain_dcp(distributed):
    r = distributed(helpers_worker, 4)[0]
    assert r == {"model_full_equal": True, "optim_full_equal": True, "set_full_equal": True,
                 "dcp_reshard_equal": True}, r


def bad_worker() -> dict:
    torch.manual_seed(0)
    serial = zoo.build_model("gpt2")
    model, opt = _build(((2, 1, 1), 2, 1), 0)
    batch = zoo_batches("gpt2", steps=1, batch=8)[0]
    _step(model, opt, batch, 1)
    out = {}

    def error(fn) -> str:
        try:
            fn()
        except (StateDictError, CheckpointError) as e:
            return str(e)
        return "no error"

    shard = dict(serial.state_dict())
    key = "transformer.h.0.mlp.c_fc.weight"
    shard[key] = local_of(model.get_parameter(key)).clone()  # one rank's piece, as rank 0's torch.save kept it
    out["shard"] = error(lambda: model.load_state_dict(shard))
    meta = dict(serial.state_dict())
    meta[key] = torch.empty_like(meta[key], device="meta")
    out["meta"] = error(lambda: model.load_state_dict(meta))
    out["assign"] = error(lambda: model.load_state_dict(serial.state_dict(), assign=True))
    osd = autopar.full_optimizer_state_dict(model, opt)
    osd["state"][key]["exp_avg"] = osd["state"][key]["exp_avg"][:3]
    out["optim_shape"] = error(lambda: autopar.load_full_optimizer_state_dict(model, opt, osd))
    out["optim_groups"] = error(lambda: autopar.load_full_optimizer_state_dict(
        model, opt, {"state": {}, "param_groups": [{"params": []}, {"params": []}]}))
    return out


def test_bad_checkpoints_raise_naming_the_key_and_the_fix(distributed):
    r = distributed(bad_worker, 4)[0]
    key = "transformer.h.0.mlp.c_fc.weight"
    assert key in r["shard"] and "(32, 128)" in r["shard"] and "torch.distributed.checkpoint" in r["shard"], r["shard"]
    assert key in r["meta"] and "meta" in r["meta"], r["meta"]
    assert "assign=True" in r["assign"]
    assert key in r["optim_shape"] and "(3, 128)" in r["optim_shape"], r["optim_shape"]
    assert "2 parameter groups" in r["optim_groups"], r["optim_groups"]


def data_parallel_worker() -> list[float]:
    """Pure data parallelism keeps plain tensors: nanoGPT's rank-0 torch.save works as under DDP."""
    root = _shared_dir()
    data = zoo_batches("gpt2", steps=4, batch=8)
    model, opt = _build(((1, 1, 1), 4, 1), 0)
    for b in data[:2]:
        _step(model, opt, b, 1)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(root, "ckpt.pt"))
    dist.barrier()
    uninterrupted = [_step(model, opt, b, 1) for b in data[2:]]
    model, opt = _build(((1, 1, 1), 4, 1), 1)
    ckpt = torch.load(os.path.join(root, "ckpt.pt"))
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return [uninterrupted, [_step(model, opt, b, 1) for b in data[2:]]]


def test_data_parallel_rank0_torch_save_resumes_like_ddp(distributed):
    for uninterrupted, resumed in distributed(data_parallel_worker, 4):
        assert resumed == uninterrupted


class FusedAttention(nn.Module):
    """One fused q/k/v projection that the module's own state-dict hooks save as wq, wk, wv (and merge on
    load), as torchtitan-style code does; the hooks must see the serial, full-shape weight."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self._register_state_dict_hook(FusedAttention._split)
        self._register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        w = state_dict.pop(prefix + "wqkv.weight")
        assert tuple(w.shape) == (3 * module.dim, module.dim), w.shape  # serial shape, as in serial
        for name, part in zip(("wq", "wk", "wv"), w.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.weight"] = part

    def _merge(self, state_dict: dict, prefix: str, *args: object) -> None:
        if prefix + "wq.weight" in state_dict:
            state_dict[prefix + "wqkv.weight"] = torch.cat([state_dict.pop(f"{prefix}{n}.weight") for n in ("wq", "wk", "wv")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.wqkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        return x + self.wo(y)


def _hook_model() -> nn.Module:
    return nn.Sequential(FusedAttention(), FusedAttention(), nn.Linear(32, 16))


def hooks_worker() -> dict:
    root = _shared_dir()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, 32, generator=g), torch.randint(0, 16, (8, 6), generator=g)
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 1, 1), data=2):
        model = _hook_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1)).backward()
    opt.step()
    sd = model.state_dict()
    out = {"keys": sorted(sd), "full": autopar.full_state_dict(model),
           "sharded": tuple(local_of(model[0].wqkv.weight).shape)}
    dcp.save(sd, checkpoint_id=root)
    torch.manual_seed(1)
    with autopar.auto_parallelize(tensor=(1, 2, 1), data=2):
        other = _hook_model()
    other(x)
    sd2 = other.state_dict()
    dcp.load(sd2, checkpoint_id=root)
    other.load_state_dict(sd2)
    out["reloaded"] = autopar.full_state_dict(other)
    if dist.get_rank() == 0:
        dcp_to_torch_save(root, os.path.join(root, "serial.pt"))
        out["serial_file"] = torch.load(os.path.join(root, "serial.pt"))
    return out


def test_model_state_dict_hooks_see_serial_tensors_and_reshard(distributed):
    r = distributed(hooks_worker, 4)[0]
    torch.manual_seed(0)
    serial = _hook_model()
    assert r["keys"] == sorted(serial.state_dict()), r["keys"]  # wq/wk/wv, as serially
    # this rank's q, k and v pieces of the fused weight (whole where torch's DTensor mishandles pieces)
    assert r["sharded"] == ((48, 32) if DTENSOR_HANDLES_FUSED_PIECES else (96, 32))
    for k, v in r["full"].items():
        assert torch.equal(r["reloaded"][k], v), k
        assert torch.equal(r["serial_file"][k], v), k
    serial.load_state_dict(r["serial_file"])  # through the serial model's own merge hook
    assert all(torch.equal(serial.state_dict()[k], v) for k, v in r["full"].items())


def meta_worker() -> str:
    """Built on meta without the block's recording (defer_init=False): nothing could give it values."""
    try:
        with autopar.auto_parallelize(tensor=(2, 1, 1), defer_init=False):
            with torch.device("meta"):
                model = zoo.build_model("gpt2")  # noqa: F841  (kept alive: the block parallelizes it)
    except ContextError as e:
        return str(e)
    return "no error"


def test_a_model_built_on_meta_is_refused_before_anything_loads_into_it(distributed):
    for message in distributed(meta_worker, 2):
        assert "meta device" in message and "transformer.wte.weight" in message, message


def snapshot_worker() -> dict:
    """Idioms of scripts that keep checkpoints in memory or write them from rank 0 through torch's helpers."""
    data = zoo_batches("gpt2", steps=6, batch=8)
    grid = ((2, 1, 1), 2, 1)
    model, opt = _build(grid, 0)
    for b in data[:3]:
        _step(model, opt, b, 1)
    out: dict = {}
    # "keep the best model": a deep copy of the sharded state dicts, loaded into a new model at the same grid.
    best_model, best_optim = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    out["uninterrupted"] = [_step(model, opt, b, 1) for b in data[3:]]
    other, other_opt = _build(grid, 5)
    try:  # before its first call the new model is not sharded: the pieces cannot go anywhere yet
        other.load_state_dict(best_model)
        out["unsharded"] = "no error"
    except StateDictError as e:
        out["unsharded"] = str(e)
    other(*data[0][0], **data[0][1])
    other.load_state_dict(best_model)
    other_opt.load_state_dict(best_optim)
    out["resumed"] = [_step(other, other_opt, b, 1) for b in data[3:]]
    # torch's rank-0 recipe: full_state_dict with cpu_offload gives rank 0 the serial tensors, the others nothing.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["full_on_rank"] = {k: tuple(v.shape) for k, v in full.items()}
    if dist.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save(full, buffer)
        out["full_saved"] = buffer.tell() > 0
    # A DCP checkpoint of a serial model (plain tensors) loads into the sharded one.
    root = _shared_dir()
    torch.manual_seed(7)
    serial = zoo.build_model("gpt2")
    dcp.save(serial.state_dict(), checkpoint_id=root)
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=root)
    other.load_state_dict(sd)
    back = autopar.full_state_dict(other)
    out["serial_dcp_equal"] = all(torch.equal(back[k], v) for k, v in serial.state_dict().items())
    return out


def test_in_memory_snapshots_rank0_full_state_and_serial_dcp(distributed):
    results = distributed(snapshot_worker, 4)
    torch.manual_seed(0)
    shapes = {k: tuple(v.shape) for k, v in zoo.build_model("gpt2").state_dict().items()}
    for rank, r in enumerate(results):
        assert r["resumed"] == r["uninterrupted"], r
        assert "not sharded yet" in r["unsharded"] and "example_inputs" in r["unsharded"], r["unsharded"]
        assert r["full_on_rank"] == (shapes if rank == 0 else {}), r["full_on_rank"]
        assert r["serial_dcp_equal"]
    assert results[0]["full_saved"]
