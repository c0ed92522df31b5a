"""Lightning Fabric's loop on ``AutoparStrategy`` (autopar/integrations/lightning.py) equals a serial Fabric loop.

The script is the SC'24 tutorial's shape: ``init_module(empty_init=True)``, ``fabric.setup(model, optimizer)``,
DistributedSampler-style rows per rank, ``no_backward_sync`` for 2-step accumulation, ``fabric.backward``,
``fabric.clip_gradients``, ``fabric.save`` / ``fabric.load`` (sharded and full) reloaded on another grid.
The oracle is the same loop on one process (plain torch, the whole batch). Skipped without lightning.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("lightning")

import lightning as L  # noqa: E402

import autopar  # noqa: E402
from autopar.decisions import ParamKind  # noqa: E402
from autopar.examples.nanogpt import GPTConfig, NanoGPT  # noqa: E402
from autopar.lightning import AutoparStrategy  # noqa: E402
from autopar.runtime.comm.collectives import comm_calls  # noqa: E402
from autopar.runtime.construction.memory_mapped import mapped_record  # noqa: E402
from autopar.runtime.params.store import local_of  # noqa: E402
from autopar.runtime.construction.pending import LazyRead  # noqa: E402

CONFIG = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=False)
STEPS, ACCUMULATE, ROWS = 3, 2, 8
NORMS, CLIP_VALUE = (2.0, float("inf")), 1e-3
"""Clipping by step: the 2-norm, the inf-norm, then by value."""


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 128, (ROWS, 16), generator=g), torch.randint(0, 128, (ROWS, 16), generator=g))
            for _ in range(STEPS * ACCUMULATE)]


def _serial() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches, losses = _batches(), []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUMULATE):
            x, y = batches[step * ACCUMULATE + micro]
            loss = model(x, y)[1] / ACCUMULATE
            loss.backward()
            total += loss.item()
        if step == 2:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=CLIP_VALUE)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05, norm_type=NORMS[step])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


ENVIRONMENTS = {
    # how each launcher tells the ranks who they are (the process group itself is the fixture's)
    "LightningEnvironment": lambda rank, world: dict(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0",
                                                     WORLD_SIZE=str(world)),
    "TorchElasticEnvironment": lambda rank, world: dict(TORCHELASTIC_RUN_ID="test", LOCAL_RANK=str(rank),
                                                        RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
                                                        LOCAL_WORLD_SIZE=str(world)),
    "SLURMEnvironment": lambda rank, world: dict(SLURM_NTASKS=str(world), SLURM_PROCID=str(rank),
                                                 SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                                                 SLURM_JOB_NAME="autopar-test", SLURM_NTASKS_PER_NODE=str(world)),
}


def _fabric(environment: str = "LightningEnvironment", **strategy: object) -> L.Fabric:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(ENVIRONMENTS[environment](rank, world))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=AutoparStrategy(**strategy), precision="32-true")
    fabric.launch()
    found = type(fabric.strategy.cluster_environment).__name__
    if found != environment or (fabric.global_rank, fabric.world_size) != (rank, world):
        raise AssertionError(f"{environment}: Fabric found {found}, rank {fabric.global_rank} of {fabric.world_size}")
    return fabric


def fabric_worker(strategy: dict, reload: dict, tmp: str, inside: bool, environment: str) -> dict:
    fabric = _fabric(environment, **strategy)
    rank, world = fabric.global_rank, fabric.world_size
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True) if inside else contextlib.nullcontext():
        model = NanoGPT(GPTConfig(**CONFIG))  # (outside: built whole, parallelized by fabric.setup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    sampler = fabric.strategy.distributed_sampler_kwargs
    batches, losses = _batches(), []
    reduces: dict[bool, list[int]] = {True: [], False: []}  # all-reduces per micro-step, by no_backward_sync
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(ACCUMULATE):
            x, y = batches[step * ACCUMULATE + micro]
            rows = slice(sampler["rank"], None, sampler["num_replicas"])  # DistributedSampler's rows, collated
            autopar.reset_comm_stats()
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = model(x[rows].contiguous(), y[rows].contiguous())[1] / ACCUMULATE
                fabric.backward(loss, model=model) if step == 1 else fabric.backward(loss)
            reduces[micro < ACCUMULATE - 1].append(comm_calls().get("all_reduce", 0))
            total += loss.detach()
        if step == 2:
            fabric.clip_gradients(model, optimizer, clip_val=CLIP_VALUE)
        else:
            fabric.clip_gradients(model, optimizer, max_norm=0.05, norm_type=NORMS[step])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(total, reduce_op="mean").item())
    fabric.barrier()
    collectives = {"gathered": fabric.all_gather(torch.tensor([rank])).flatten().tolist(),
                   "broadcast": fabric.broadcast({"from": rank}, src=world - 1),
                   "sum": fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()}
    out = {"losses": losses, "params": autopar.full_state_dict(model), "sampler": sampler, "reduces": reduces,
           "collectives": collectives,
           "plan": autopar.plan_of(model).config, "world": world, "rank": rank}
    # checkpoints: sharded (DCP directory) and full (one serial-format file), reloaded on another grid
    optimizer_state = autopar.full_optimizer_state_dict(model, optimizer)
    fabric.save(os.path.join(tmp, "sharded"), {"model": model, "optimizer": optimizer, "step": STEPS})
    fabric.strategy._save_distributed_checkpoint = False
    fabric.save(os.path.join(tmp, "full.pt"), {"model": model, "optimizer": optimizer, "step": STEPS})
    fabric.save(os.path.join(tmp, "norms.pt"), {"model": model}, filter={"model": lambda name, value: "ln_" in name})
    out["filtered"] = sorted(torch.load(os.path.join(tmp, "norms.pt"))["model"])
    for kind in ("sharded", "full.pt"):
        other = _fabric(environment, **reload)
        torch.manual_seed(3)
        with other.init_module(empty_init=True):
            fresh = NanoGPT(GPTConfig(**CONFIG))
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh, fresh_optimizer = other.setup(fresh, fresh_optimizer)
        x, y = batches[0]
        with torch.no_grad():
            fresh(x[rank::world].contiguous(), y[rank::world].contiguous())  # the first call builds it (the load then goes to the pieces)
        state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        try:  # strict: every object asked for must be in the checkpoint
            other.load(os.path.join(tmp, kind), {**state, "epoch": 0})
            out[f"{kind} strict"] = "no error"
        except KeyError as e:
            out[f"{kind} strict"] = str(e)
        rest = other.load(os.path.join(tmp, kind), state)
        got = autopar.full_state_dict(fresh)
        got_optimizer = autopar.full_optimizer_state_dict(fresh, fresh_optimizer)["state"]
        out[kind] = {
            "step": state["step"], "rest": sorted(rest),
            "params": max(float((got[k] - v).abs().max()) for k, v in out["params"].items()),
            "optimizer": max(float((got_optimizer[n][s] - t).abs().max())
                             for n, states in optimizer_state["state"].items() for s, t in states.items()),
        }
    return out


GRIDS = [(4, {"tensor": (2, 1, 1), "data": 2}, True, "LightningEnvironment"),
         (4, {"G_intra_c": 2, "data": 2}, True, "TorchElasticEnvironment"),
         (4, {"G_intra_z": 2}, True, "SLURMEnvironment"), (2, {"data": 2}, True, "LightningEnvironment"),
         (4, {"tensor": (2, 1, 1), "data": 2}, False, "LightningEnvironment"),
         (4, {"plan": "auto", "tensor": (1, 2, 1)}, True, "LightningEnvironment"),
         (4, {"plan": "auto", "tensor": (2, 1, 1)}, False, "LightningEnvironment")]


@pytest.mark.parametrize("world,strategy,inside,environment", GRIDS)
def test_fabric_loop_equals_serial_and_checkpoints_reload_on_another_grid(distributed, tmp_path, world, strategy,
                                                                          inside, environment):
    """``inside``: built in ``fabric.init_module(empty_init=True)``; else built plainly and handed to
    ``fabric.setup(model, optimizer)`` with an optimizer over the plain parameters. ``environment``: the
    launcher's variables (Fabric's own and SLURM's srun and torchrun's), which Fabric must recognize."""
    losses, params = _serial()
    reload = {"tensor": (1, 2, 1)} if world == 4 else {"tensor": (2, 1, 1)}
    for got in distributed(fabric_worker, world, strategy, reload, str(tmp_path), inside, environment, timeout=600):
        assert got["sampler"] == {"num_replicas": world, "rank": got["rank"]}
        assert got["collectives"] == {"gathered": list(range(world)), "broadcast": {"from": world - 1},
                                      "sum": float(world)}, got["collectives"]
        # no_backward_sync skips the gradients' reduction over data: fewer all-reduces in those micro-steps
        assert max(got["reduces"][True]) < min(got["reduces"][False]), got["reduces"]
        c = got["plan"]
        want = strategy.get("tensor") or (1, strategy.get("G_intra_c", 1), strategy.get("G_intra_z", 1))
        assert (c.row, c.col, c.depth) == tuple(want), c
        for a, b in zip(got["losses"], losses):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], losses)
        for k, v in params.items():
            assert torch.allclose(got["params"][k], v, atol=1e-5), (k, float((got["params"][k] - v).abs().max()), float(v.abs().max()))
        assert got["filtered"] == sorted(k for k in params if "ln_" in k), got["filtered"]
        for kind in ("sharded", "full.pt"):
            assert "'epoch'" in got[f"{kind} strict"], got[f"{kind} strict"]
            assert got[kind]["step"] == STEPS and got[kind]["rest"] == [], got[kind]
            assert got[kind]["params"] == 0 and got[kind]["optimizer"] == 0, got[kind]


def test_tensor_degrees_given_twice_are_refused():
    with pytest.raises(autopar.AutoparError, match="given twice"):
        AutoparStrategy(tensor=(2, 1, 1), G_intra_r=2)
    assert AutoparStrategy(G_intra_x=2, G_intra_z=2).tensor == (2, 1, 2)
    assert L.Fabric(accelerator="cpu", devices=1, strategy="autopar").strategy.__class__ is AutoparStrategy


LITGPT = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=128, padded_vocab_size=128)
EPS = 1e-6
"""Adam's eps: litgpt's key biases get gradients that are zero up to rounding (~1e-10; softmax ignores a
shift shared by every key), which Adam's default eps (1e-8) turns into +-lr/100 steps of either sign, on
serial as on any grid; 1e-6 keeps such steps below the comparison's 1e-5."""


def _litgpt_loop(model: torch.nn.Module, step: Callable[[], None], backward: Callable, rows: slice,
                 no_sync: Callable[[bool], Any]) -> list[torch.Tensor]:
    """3 steps of 2 accumulated micro-batches (the first without the gradients' reduction)."""
    import torch.nn.functional as F

    losses, batches = [], _batches()
    for k in range(STEPS):
        total = torch.zeros(())
        for micro in range(ACCUMULATE):
            x, y = batches[k * ACCUMULATE + micro]
            with no_sync(micro < ACCUMULATE - 1):
                logits = model(x[rows].contiguous())
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[rows].contiguous().reshape(-1))
                backward(loss / ACCUMULATE)
            total += loss.detach() / ACCUMULATE
        step()
        losses.append(total)
    return losses


def litgpt_worker(strategy: dict, path: str) -> dict:
    from litgpt import GPT, Config
    from litgpt.utils import load_checkpoint

    fabric = _fabric(**strategy)
    torch.manual_seed(7)  # another init: the checkpoint must win
    with fabric.init_module(empty_init=True):
        model = GPT(Config(**LITGPT))
    model = fabric.setup(model)
    load_checkpoint(fabric, model, path)  # litgpt's own loader (its lazy_load + load_state_dict here)
    # nothing read yet: each tensor is read at the first call, when this rank's pieces are known
    # (data parallelism alone builds the parameters whole at the block's end: the load reads them at once)
    unread = all(isinstance(getattr(local_of(p), "loaded", None), LazyRead) for p in model.parameters())
    # ... and each will be read as a view of the file's pages (only this rank's pieces' pages are read)
    mapped = unread and all(mapped_record(local_of(p).loaded.source) is not None for p in model.parameters())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS))

    def step() -> None:
        fabric.clip_gradients(model, optimizer, max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()

    rank, world = fabric.global_rank, fabric.world_size
    losses = _litgpt_loop(model, step, fabric.backward, slice(rank, None, world),
                          lambda enabled: fabric.no_backward_sync(model, enabled=enabled))
    return {"losses": [fabric.all_reduce(t, reduce_op="mean").item() for t in losses],
            "params": autopar.full_state_dict(model), "unread": unread,
            "mapped": mapped}


@pytest.mark.parametrize("world,strategy", [(4, {"tensor": (2, 1, 1), "data": 2}), (4, {"G_intra_y": 2, "data": 2}),
                                            (4, {"G_intra_z": 2, "data": 2}), (2, {"data": 2})])
def test_litgpt_loaded_by_its_own_load_checkpoint_trains_as_serial(distributed, tmp_path, world, strategy):
    pytest.importorskip("litgpt")
    from litgpt import GPT, Config

    torch.manual_seed(0)
    serial = GPT(Config(**LITGPT))
    path = tmp_path / "lit_model.pth"
    torch.save(serial.state_dict(), path)
    optimizer = torch.optim.AdamW(serial.parameters(), lr=1e-2, eps=EPS)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()

    losses = [t.item() for t in _litgpt_loop(serial, step, lambda loss: loss.backward(), slice(None),
                                             lambda enabled: contextlib.nullcontext())]
    for got in distributed(litgpt_worker, world, strategy, str(path), timeout=600):
        assert got["unread"] == ("data" not in strategy or len(strategy) > 1), got["unread"]
        assert got["mapped"] == got["unread"]
        for a, b in zip(got["losses"], losses):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], losses)
        for k, v in serial.state_dict().items():
            assert torch.allclose(got["params"][k], v, atol=1e-5), (k, float((got["params"][k] - v).abs().max()), float(v.abs().max()))


def _fabric_precision(precision: str, **strategy: object) -> L.Fabric:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    strategy_ = AutoparStrategy(**strategy)
    if precision == "16-mixed":  # (Fabric's string turns into bf16-mixed on CPU; the plugin itself is fp16)
        from lightning.fabric.plugins.precision import MixedPrecision

        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy_,
                          plugins=[MixedPrecision("16-mixed", device="cpu")])
    else:
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy_, precision=precision)
    fabric.launch()
    return fabric


def _half_serial(precision: str) -> list[float]:
    """The serial loop as Fabric runs it on one device: under autocast ("bf16-mixed"), or with bf16
    parameters ("bf16-true")."""
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig(**CONFIG))
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches()[:STEPS]:
        context = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
        with context:
            loss = model(x, y)[1]
        loss.float().backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.float().item())
    return losses


def precision_worker(strategy: dict) -> dict:
    out: dict = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    for precision in ("bf16-mixed", "bf16-true"):
        fabric = _fabric_precision(precision, **strategy)
        torch.manual_seed(0)
        with fabric.init_module(empty_init=True):
            model = NanoGPT(GPTConfig(**CONFIG))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for x, y in _batches()[:STEPS]:
            loss = model(x[rank::world].contiguous(), y[rank::world].contiguous())[1]
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach().float(), reduce_op="mean").item())
        out[precision] = {"losses": losses, "dtype": str(next(iter(model.parameters())).dtype)}
    # 16-mixed: an overflow in one rank's backward (rank 0's piece of a split weight's gradient made inf at the
    # second step) makes every rank's GradScaler skip that step and lower its scale; the next step trains
    fabric = _fabric_precision("16-mixed", **strategy)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = NanoGPT(GPTConfig(**CONFIG))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = fabric.strategy.precision.scaler
    scales, unchanged = [], []
    for step, (x, y) in enumerate(_batches()[:3]):
        if step == 1 and rank == 0:  # this rank's shard of a split weight alone overflows
            split = [p for p in autopar.plan_of(model).params if p.kind is not ParamKind.REPLICATED][0]
            handle = dict(model.module.named_parameters())[split.name].register_hook(lambda g: g * float("inf"))
        before = autopar.full_state_dict(model) if step else {}
        loss = model(x[rank::world].contiguous(), y[rank::world].contiguous())[1]
        fabric.backward(loss)
        if step == 1 and rank == 0:
            handle.remove()
        optimizer.step()
        optimizer.zero_grad()
        after = autopar.full_state_dict(model)
        scales.append(scaler.get_scale())
        unchanged.append(bool(before) and all(torch.equal(after[k], v) for k, v in before.items()))
    out["16-mixed"] = {"scales": scales, "unchanged": unchanged}
    return out


@pytest.mark.parametrize("world,strategy", [(4, {"tensor": (2, 1, 1), "data": 2}), (2, {"G_intra_c": 2})])
def test_fabric_precisions_match_serial_and_an_overflow_on_one_rank_skips_everywhere(distributed, world, strategy):
    serial = {p: _half_serial(p) for p in ("bf16-mixed", "bf16-true")}
    for got in distributed(precision_worker, world, strategy, timeout=600):
        for precision, losses in serial.items():
            for a, b in zip(got[precision]["losses"], losses):
                assert abs(a - b) <= 1e-2 * abs(b), (precision, got[precision]["losses"], losses)
        assert got["bf16-true"]["dtype"] == "torch.bfloat16" and got["bf16-mixed"]["dtype"] == "torch.float32"
        scales = got["16-mixed"]["scales"]
        assert got["16-mixed"]["unchanged"] == [False, True, False], got["16-mixed"]  # stepped, skipped, stepped
        assert scales[:2] == [2.0 ** 16, 2.0 ** 15], scales  # GradScaler's 2**16, halved at the skipped step
