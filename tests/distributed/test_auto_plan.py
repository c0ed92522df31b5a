"""``auto_parallelize(plan="auto")``: the grid is chosen by the plan search (the one ``python -m autopar.plan``
ranks first for this machine) at the end of the block with example inputs, else at the model's first call;
degrees the user gave stay, and training on the chosen grid gives serial's losses and parameters."""

from __future__ import annotations

import io
from contextlib import nullcontext

import pytest
import torch

import autopar
from autopar.errors import CheckpointError, PlanError
from autopar.parallel_model import runtime_of
from autopar.examples.nanogpt import GPTConfig, NanoGPT
from autopar.planning.search import choose_grid

CONFIG = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=False)


def auto_worker(tensor: tuple | None) -> dict:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g))
               for _ in range(3)]
    torch.manual_seed(0)
    serial = NanoGPT(GPTConfig(**CONFIG))
    torch.manual_seed(0)
    with autopar.auto_parallelize(plan="auto", example_inputs=batches[0], tensor=tensor) as yielded:
        model = NanoGPT(GPTConfig(**CONFIG))
    with torch.device("meta"):
        shadow = NanoGPT(GPTConfig(**CONFIG))
    fixed = dict(zip(("row", "col", "depth"), tensor)) if tensor else None
    best = choose_grid(shadow, batches[0], torch.distributed.get_world_size(), fixed=fixed)[0].candidate
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, serial)}
    gap = loss_gap(optimizers, batches, lambda m, x, y: m(x, y)[1])
    params = autopar.full_state_dict(model)
    error = max(float((params[n] - p).abs().max()) for n, p in serial.named_parameters())
    c = autopar.plan_of(model).config
    return {"chosen": (c.data, c.pipeline, c.row, c.col, c.depth), "yielded": yielded,
            "best": (best.data, best.pipeline, best.row, best.col, best.depth), "loss": gap, "param": error}


@pytest.mark.parametrize("tensor", [None, (2, 1, 1)])
def test_plan_auto_runs_the_searchs_best_grid_with_serials_numbers(distributed, tensor):
    for got in distributed(auto_worker, 4, tensor, timeout=600):
        assert got["yielded"] is None and got["chosen"] == got["best"], got
        if tensor:
            assert got["chosen"][2:] == tensor, got
        assert got["loss"] < 1e-5 and got["param"] < 1e-5, got


def first_call_worker(fixed: dict, per_rank: bool) -> dict:
    """plan="auto" without example inputs: the optimizer is built and a serial state dict loaded before the
    first call, which runs inside no_sync() (gradient accumulation over two micro-steps) with clipping."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g))
               for _ in range(4)]
    torch.manual_seed(0)
    serial = NanoGPT(GPTConfig(**CONFIG))
    torch.manual_seed(1)  # other initial values: the loaded state dict must win
    with autopar.auto_parallelize(plan="auto", **fixed) as yielded:
        model = NanoGPT(GPTConfig(**CONFIG))
    provisional = runtime_of(model)
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, serial)}  # (model's first
    model.load_state_dict(serial.state_dict())  # call reads the loaded tensors: before serial's step writes them)
    losses = []
    for step in range(2):
        pair = batches[2 * step: 2 * step + 2]
        got = {}
        for m, opt in optimizers.items():
            total = 0.0
            for micro, (x, y) in enumerate(pair):
                if m is model and per_rank:  # DDP-style: each rank its rows of the global batch
                    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
                context = m.no_sync() if m is model and micro == 0 else nullcontext()
                with context:
                    loss = m(x, y)[1] / len(pair)
                    loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            got[m] = total
        if per_rank:  # this rank's loss is its rows' mean: the mean over ranks is serial's
            t = torch.tensor(got[model])
            torch.distributed.all_reduce(t)
            got[model] = t.item() / world
        losses.append(abs(got[model] - got[serial]) / abs(got[serial]))
    params = autopar.full_state_dict(model)
    error = max(float((params[n] - p).abs().max()) for n, p in serial.named_parameters())
    c = autopar.plan_of(model).config
    with torch.device("meta"):
        shadow = NanoGPT(GPTConfig(**CONFIG))
    best = choose_grid(shadow, batches[0], world, fixed={**fixed_degrees(fixed), "pipeline": 1})[0].candidate
    dtensor = isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor)
    return {"chosen": (c.data, c.pipeline, c.row, c.col, c.depth), "yielded": yielded, "dtensor": dtensor,
            "one runtime": runtime_of(model) is provisional and provisional.open_degrees is None,
            "best": (best.data, best.pipeline, best.row, best.col, best.depth), "loss": max(losses), "param": error}


def loss_gap(optimizers: dict, batches: list, loss_of) -> float:
    """Trains each model of ``optimizers`` ({parallel model: optimizer, serial model: optimizer}) on
    ``batches`` (``loss_of(model, x, y)``: its loss; backward here unless it ran it); the largest relative
    gap between their losses."""
    (parallel, _), (serial, _) = optimizers.items()
    gaps = []
    for x, y in batches:
        losses = {}
        for m, opt in optimizers.items():
            loss = loss_of(m, x, y)
            if loss.requires_grad:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses[m] = loss.item()
        gaps.append(abs(losses[parallel] - losses[serial]) / abs(losses[serial]))
    return max(gaps)


def fixed_degrees(fixed: dict) -> dict:
    out = dict(zip(("row", "col", "depth"), fixed.get("tensor", ())))
    if "data" in fixed:
        out["data"] = fixed["data"]
    return out


@pytest.mark.parametrize("fixed,per_rank", [({}, False), ({"tensor": (2, 1, 1)}, False), ({"data": 4}, True),
                                            ({"tensor": (1, 2, 1)}, True)])
def test_plan_auto_without_example_inputs_chooses_at_the_first_call(distributed, fixed, per_rank):
    for got in distributed(first_call_worker, 4, fixed, per_rank, timeout=600):
        assert got["yielded"] is None and got["chosen"] == got["best"], got
        assert got["dtensor"], got  # parameters any grid can shard in place, the optimizer's objects
        # the model's runtime took the grid (no second runtime: the old successor swap fails this)
        assert got["one runtime"], got
        if "tensor" in fixed:
            assert got["chosen"][2:] == fixed["tensor"], got
        assert got["loss"] < 1e-5 and got["param"] < 1e-5, got


def no_grid_worker() -> str:
    with autopar.auto_parallelize(plan="auto", tensor=(3, 1, 1)):
        model = NanoGPT(GPTConfig(**CONFIG))
    try:
        model(torch.zeros(8, 16, dtype=torch.long))
    except PlanError as e:  # on every rank: rank 0's search failed, and the others do not wait for it
        return str(e)
    return "no error"


def test_plan_auto_at_the_first_call_with_no_grid_raises_on_every_rank(distributed):
    for got in distributed(no_grid_worker, 2, timeout=120):
        assert got.startswith("no grid of 2 ranks has row=3") and "data=2 pipeline=1 tensor=1,1,1" in got, got


def interleaved_worker(options: dict) -> dict:
    """plan="auto" whose choice runs interleaved: a pipeline grid of two stages per rank (the search ranks
    it first here; on this CPU it rarely wins on its own), trained through ``train_step`` against serial;
    with ``options`` (the user's schedule) the search keeps that schedule's stages per rank."""
    import torch.nn.functional as F

    import autopar.planning.search as P
    from autopar.examples.fc_net import FC_Net, synthetic_mnist
    from tests.helpers import rel_err

    real, asked = P.choose_grid, []

    def interleaved_first(*args, **kwargs):
        asked.append(dict(kwargs["fixed"]))
        ranked = real(*args, **kwargs)
        return sorted(ranked, key=lambda s: not (s.fits and s.candidate.pipeline == 2 and s.candidate.chunks == 2))

    P.choose_grid = interleaved_first
    net = dict(num_layers=8, hidden=64, image_size=8)
    data = list(synthetic_mnist(3, 16, net["image_size"], 0))
    torch.manual_seed(0)
    serial = FC_Net(**net)
    torch.manual_seed(0)
    with autopar.auto_parallelize(plan="auto", example_inputs=(data[0][0],), **options):
        model = FC_Net(**net)
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, serial)}
    gap = loss_gap(opts, data, lambda m, x, y: autopar.train_step(m, x, y, F.cross_entropy) if m is model
                   else F.cross_entropy(m(x), y))
    final = autopar.full_state_dict(model)
    plan = autopar.plan_of(model)
    return {"asked": asked, "loss": gap, "chunks": plan.pipeline.chunks_per_rank,
            "schedule": plan.pipeline.schedule, "pipeline": plan.config.pipeline,
            "param": max(rel_err(final[n], p) for n, p in serial.named_parameters())}


@pytest.mark.parametrize("options", [{}, {"schedule": "interleaved"}])
def test_plan_auto_runs_an_interleaved_choice_with_serials_numbers(distributed, options):
    """The search's candidate of two stages per rank becomes torch's Interleaved1F1B (mutation: keeping
    the user's default 1F1B runs one stage per rank and fails); a schedule the user names fixes the
    stages per rank the search may choose."""
    for rank, got in enumerate(distributed(interleaved_worker, 4, options, timeout=600)):
        assert got["pipeline"] == 2 and got["chunks"] == 2 and got["schedule"] == "interleaved", got
        assert got["asked"] == ([{"chunks": 2} if options else {}] if rank == 0 else []), got  # rank 0 searches
        assert got["loss"] < 1e-5 and got["param"] < 1e-5, got


def no_degrees_worker(budget_share: float | None, example: bool) -> dict:
    """``auto_parallelize()`` with no degrees: data parallel with plain tensors (DDP's contract) while the
    model's training state fits half the budget; a bigger one gets the search's grid (``checkpoint=<bytes>``
    sets the budget here), with one warning line."""
    import logging

    from autopar.grid_choice import training_state_bytes

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autopar").addHandler(handler)
    logging.getLogger("autopar").setLevel(logging.INFO)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g))
               for _ in range(3)]
    with torch.device("meta"):
        shadow = NanoGPT(GPTConfig(**CONFIG))
    budget = None if budget_share is None else int(budget_share * training_state_bytes(shadow))
    options = {} if budget is None else {"checkpoint": budget}
    torch.manual_seed(0)
    serial = NanoGPT(GPTConfig(**CONFIG))
    torch.manual_seed(0)
    with autopar.auto_parallelize(**options, example_inputs=batches[0] if example else None):
        model = NanoGPT(GPTConfig(**CONFIG))
    dtensor = isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor)
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, serial)}
    gap = loss_gap(optimizers, batches, lambda m, x, y: m(x, y)[1])
    params = autopar.full_state_dict(model)
    error = max(float((params[n] - p).abs().max()) for n, p in serial.named_parameters())
    saved = "saved"
    try:  # nanoGPT's rank-0 checkpoint: model and optimizer state in one torch.save
        torch.save({"model": model.state_dict(), "optimizer": optimizers[model].state_dict()}, io.BytesIO())
    except CheckpointError as e:
        saved = str(e)
    best = choose_grid(shadow, batches[0], torch.distributed.get_world_size(), budget=budget,
                       fixed=None if example else {"pipeline": 1})[0].candidate  # (a pipeline: train_step's)
    c = autopar.plan_of(model).config
    return {"chosen": (c.data, c.pipeline, c.row, c.col, c.depth, c.shard_optimizer), "dtensor": dtensor, "loss": gap,
            "param": error, "best": (best.data, best.pipeline, best.row, best.col, best.depth, best.shard_optimizer),
            "saved": saved,
            "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING and "no degrees" in r.getMessage()],
            "infos": [r.getMessage() for r in records if r.levelno == logging.INFO and "no degrees" in r.getMessage()]}


@pytest.mark.parametrize("budget_share,example", [(None, False), (1.25, False), (1.25, True)])
def test_no_degrees_mean_data_parallel_unless_the_model_is_too_big_for_it(distributed, budget_share, example):
    """A model whose training state (16 bytes per parameter) fits half the device stays data parallel with
    plain tensors, as under DDP; at 1.25x its state (data parallel needs 1.38x with its activations, its blocks
    recomputed; nanoGPT computes its loss in forward, so no allowance for the caller's) the search's grid (data 4
    with Adam's moments split over it here, 10 bytes a parameter) is chosen, at the first call or at the end of the block with example inputs,
    and trains with serial's numbers. Mutation: ignoring the model's size (data parallel always) leaves the
    too-big model on data=4 with its whole state and fails."""
    for rank, got in enumerate(distributed(no_degrees_worker, 4, budget_share, example, timeout=600)):
        assert got["loss"] < 1e-5 and got["param"] < 1e-5, got
        if budget_share is None:
            assert got["chosen"] == (4, 1, 1, 1, 1, False) and not got["dtensor"] and not got["warnings"], got
            assert got["saved"] == "saved", got  # DDP's contract: a rank-0 torch.save of both states works
            assert len(got["infos"]) == 1 and "data parallel over 4 ranks" in got["infos"][0], got
        else:
            assert got["chosen"] == got["best"] != (4, 1, 1, 1, 1, False), got
            assert len(got["warnings"]) == (rank == 0), got
            assert all("exceeds half of a device" in w and "full_state_dict" in w for w in got["warnings"]), got
            assert "full_state_dict" in got["saved"], got  # as the warning says: raises, naming the way
