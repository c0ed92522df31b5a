"""Context parallelism (``auto_parallelize(context=C)``, ``passes.split_context``): every sequence's tokens split
over the context ranks for the whole model, attention over the keys and values gathered from them, the loss
completed over them. Oracle: the serial model, same seed and data: losses (HF's ``labels=`` loss, nanoGPT's loss
in forward, the caller's cross-entropy on the logits), first-step gradients, final parameters, ``model(x)``'s
logits and greedy ``generate()`` tokens (a prompt that does not split runs whole); on context alone and with data
and tensor grids, on HF Llama, Qwen3 (q/k norms) and nanoGPT (``F.scaled_dot_product_attention(is_causal=True)``
called directly, learned positions); with a pipeline, its stages run in order by ``model(x)`` and by
``autopar.train_step``'s schedules; a DDP script's per-rank batches against DDP's step; mixture-of-experts families
(each context rank routing its own tokens) with experts over data or a tensor axis, and through a script's
idioms (clipping, AdamW under ``shard_optimizer``, a DCP checkpoint across layouts, a per-rank loader). Mutations: an output
whose caller's gradient is kept on every context rank (not one) doubles the gradients; a pipeline's stages cut from
the whole sequence's graph (before 2026-12-05 they were: every context rank computed all the tokens, silently off by
100%); an expert's gradient not summed over the context ranks; the comparisons see them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.examples import zoo
from autopar.examples.nanogpt import GPTConfig, NanoGPT
from autopar.parallel_model import plan_of, runtime_of
from autopar.runtime.comm.collectives import comm_calls
from autopar.runtime.execution import builder
from autopar.runtime.ops import context as context_ops
from passes.split_context import split_context
from tests import zoo_helpers as Z
from tests.helpers import rel_err

TOL = 1e-5


def _data(steps: int = 3, batch: int = 4, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, zoo.VOCAB, (batch, seq), generator=g) for _ in range(steps)]


def _loss(model: torch.nn.Module, name: str, ids: torch.Tensor, how: str) -> torch.Tensor:
    if name == "nanogpt":
        return model(ids, ids)[1]
    if how == "labels":
        return model(ids, labels=ids, use_cache=False).loss
    logits = model(ids, use_cache=False).logits  # (the caller's loss on the gathered logits)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _train(model: torch.nn.Module, name: str, how: str, grads_of) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], None
    data = _data()
    for i, ids in enumerate(data):
        loss = _loss(model, name, ids, how)
        loss.backward()
        if i == 0:
            grads = grads_of(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "grads": grads}
    if name != "nanogpt":
        with torch.no_grad():
            out["logits"] = model(data[0], use_cache=False).logits
        model.eval()
        out["tokens"] = model.generate(data[0][:2, :6], max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out


def _build(name: str) -> torch.nn.Module:
    if name == "nanogpt":  # (nanoGPT's forward, unchanged: the loss of its targets inside)
        return NanoGPT(GPTConfig(vocab_size=zoo.VOCAB, block_size=zoo.POSITIONS, n_layer=2, n_head=zoo.HEADS,
                                 n_embd=zoo.HIDDEN, dropout=0.0))
    return zoo.build_model(name)


def _case(name: str, grid: dict, how: str = "labels") -> dict:
    torch.manual_seed(0)
    serial = _build(name)
    want = _train(serial, name, how, lambda m: {n: p.grad.clone() for n, p in m.named_parameters()})
    want_params = {k: v.detach().clone() for k, v in serial.state_dict().items()}
    torch.manual_seed(0)
    with autopar.auto_parallelize(**grid):
        model = _build(name)
    got = _train(model, name, how, lambda m: {k: v for k, v in runtime_of(m).full_grads().items() if v is not None})
    final = autopar.full_state_dict(model)
    out = {
        "loss": max(abs(a - b) for a, b in zip(want["losses"], got["losses"])),
        "grads": max(rel_err(got["grads"][k], want["grads"][k]) for k in got["grads"] if k in want["grads"]),
        "params": max(rel_err(final[k], want_params[k]) for k in final if k in want_params),
        "config": str(plan_of(model).config),
    }
    if "logits" in want:
        out["logits"] = rel_err(got["logits"], want["logits"])
        out["tokens"] = torch.equal(got["tokens"], want["tokens"])
    autopar.detach(model)
    return out


CASES = [("llama", {"context": 4}, "labels"), ("llama", {"context": 2, "tensor": (2, 1, 1)}, "labels"),
         ("qwen3", {"context": 2, "data": 2}, "labels"), ("nanogpt", {"context": 2, "data": 2}, "labels"),
         ("llama", {"context": 2, "data": 2}, "caller"), ("llama", {"context": 2, "plan": "auto"}, "labels"),
         ("llama", {"context": 2, "tensor": (1, 1, 2)}, "labels"),
         ("llama", {"context": 2, "data": 2, "shard_optimizer": True}, "labels"),
         ("llama", {"context": 2, "tensor": (2, 1, 1), "sequence_parallel": True}, "caller"),
         ("nanogpt", {"context": 2, "tensor": (1, 2, 1), "sequence_parallel": True}, "labels"),
         ("llama", {"context": 2, "pipeline": 2}, "labels")]
"""Context alone (4 ranks: 8 chunks of 2 tokens), with a row-split tensor grid (heads and vocabulary split too),
with data (Qwen3's per-head q/k norms; nanoGPT's own attention call and loss); the caller's loss on the logits
(the output gathered over the context ranks); the rest of the grid chosen by the search at the first call; with
depth (a weight split over depth has its gradient summed over data x context only: summed over the depth ranks
too, as before 2026-12-05, its gradients were off by 100%); with the optimizer state split over data (each data
rank's chunk of a gradient then summed over context); with sequence parallelism (this rank's tokens split again
over the tensor axis between matmuls; nanoGPT's positions' lookup scatters this rank's tokens); with a pipeline (its
stages run in order: each sends its context rank's tokens to the next)."""


STEP_CASES = [{"context": 2, "pipeline": 2}, {"context": 2, "pipeline": 2, "schedule": "interleaved", "microbatches": 4}]
"""Context with a pipeline through ``autopar.train_step`` (torch's schedules over micro-batches; the last stage's
logits gathered over context for the caller's cross-entropy)."""


def _step_case(grid: dict) -> dict:
    data = [(args, {}, target) for args, _, target in Z.batches("llama", batch=4, seq=16)]
    losses, grads = Z.serial("llama", data)
    torch.manual_seed(0)
    with autopar.auto_parallelize(**grid):
        model = zoo.build_model("llama")
    got, got_grads = Z.train(model, data, lambda m: runtime_of(m).full_grads(),
                             lambda m, args, kwargs, target: autopar.train_step(m, args, target, F.cross_entropy))
    autopar.detach(model)
    return {"loss": max(abs(a - b) for a, b in zip(got, losses)),
            "grads": max(rel_err(got_grads[k], grads[k]) for k in grads)}


def _per_rank_case(grid: dict, how: str) -> dict:
    """A DDP script's loader (each rank its own batch, ``DistributedSampler``'s): the oracle is DDP's step, the
    gradient of the mean of every rank's own loss; each rank's loss is its own batch's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = [[torch.randint(0, zoo.VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 + r))
             for _ in range(3)] for r in range(world)]
    torch.manual_seed(0)
    serial = _build("llama")
    opt = torch.optim.SGD(serial.parameters(), lr=0.1)
    want = []
    for step in range(3):
        losses = [_loss(serial, "llama", mine[r][step], how) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
        want.append(losses[rank].item())
    want_params = {k: v.detach().clone() for k, v in serial.state_dict().items()}
    torch.manual_seed(0)
    with autopar.auto_parallelize(batch="per-rank", **grid):
        model = _build("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    for step in range(3):
        loss = _loss(model, "llama", mine[rank][step], how)
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
    final = autopar.full_state_dict(model)
    autopar.detach(model)
    return {"loss": max(abs(a - b) for a, b in zip(want, got)),
            "params": max(rel_err(final[k], want_params[k]) for k in final if k in want_params)}


PER_RANK = [({"context": 2, "data": 2}, "labels"), ({"context": 4}, "caller")]
"""Per-rank batches pooled by the context ranks: each rank's own loss completed over them (``SegmentReduceOp``),
and the caller's loss on its own rows' logits."""


def _lengths() -> list[float]:
    """Training calls of two lengths (16, 24, 16 tokens): each length its own graph, split (a symbolic length
    would run whole); the loss of each against serial's."""
    torch.manual_seed(0)
    serial = _build("llama")
    torch.manual_seed(0)
    with autopar.auto_parallelize(context=2, data=2):
        model = _build("llama")
    out = []
    for seq in (16, 24, 16):
        ids = torch.randint(0, zoo.VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
        autopar.reset_comm_stats()
        loss = model(ids, labels=ids, use_cache=False).loss
        gathers = comm_calls().get("all_gather", 0)  # (a split graph gathers each layer's keys and values)
        out.append(abs(serial(ids, labels=ids, use_cache=False).loss.item() - loss.item()) if gathers >= 4 else 1.0)
    autopar.detach(model)
    return out


def _evaluation(split_from: int) -> dict:
    """An evaluation call of a long sequence (``EVAL_CONTEXT_FROM`` tokens or more, here lowered to ``split_from``)
    is captured at its length and split (before 2026-12-05 every evaluation ran whole on every context rank): HF's
    default call returning its cache, the ``labels=`` loss, and ``generate()`` from prompts of 6 tokens (whole)
    and 16 (the prefill split, the cache gathered whole for the decode steps)."""
    from autopar.runtime import parallel_runtime

    torch.manual_seed(0)
    serial = _build("llama").eval()
    torch.manual_seed(0)
    with autopar.auto_parallelize(context=2, data=2):
        model = _build("llama")
    model.eval()
    ids = _data()[0]
    whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # (a cache returned split over data)
    before, parallel_runtime.EVAL_CONTEXT_FROM = parallel_runtime.EVAL_CONTEXT_FROM, split_from
    try:
        with torch.no_grad():
            autopar.reset_comm_stats()
            got, want = model(ids), serial(ids)
            out = {"gathers": comm_calls().get("all_gather", 0), "logits": rel_err(got.logits, want.logits),
                   "cache": max(rel_err(whole(a.keys), b.keys) + rel_err(whole(a.values), b.values)
                                for a, b in zip(got.past_key_values.layers, want.past_key_values.layers)),
                   "loss": abs(model(ids, labels=ids).loss.item() - serial(ids, labels=ids).loss.item())}
        out["tokens"] = all(torch.equal(model.generate(ids[:2, :n], max_new_tokens=4, do_sample=False, pad_token_id=0),
                                        serial.generate(ids[:2, :n], max_new_tokens=4, do_sample=False, pad_token_id=0))
                            for n in (6, 16))
    finally:
        parallel_runtime.EVAL_CONTEXT_FROM = before
    autopar.detach(model)
    return out


BYTES = [({"context": 2, "data": 2, "shard_optimizer": True}, "labels"),
         ({"context": 2, "tensor": (2, 1, 1)}, "labels"), ({"context": 2, "tensor": (1, 1, 2)}, "labels"),
         ({"context": 2, "tensor": (2, 1, 1), "sequence_parallel": True}, "labels"),
         ({"context": 2, "data": 2}, "caller"), ({"context": 2, "tensor": (2, 1, 1)}, "caller")]
"""Grids whose bytes of one training step (forward, backward, AdamW's step) are compared with the plan's; with
the caller's loss on the logits, their gradient reduce-scattered back over context (left out of the plan before
2026-12-05: the measured reduce-scatters were 2-3x the plan's)."""


def _bytes(grid: dict, how: str) -> dict[str, tuple[float, float]]:
    """Bytes sent per collective kind in the second step on ``grid`` (measured, the plan's prediction)."""
    from autopar.planning.planner import plan_model

    torch.manual_seed(0)
    with autopar.auto_parallelize(**grid):
        model = _build("llama")
    ids = _data()[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        autopar.reset_comm_stats()
        _loss(model, "llama", ids, how).backward()
        opt.step()
        opt.zero_grad()
    got = autopar.comm_stats()
    with torch.device("meta"):
        shadow = _build("llama")
    kwargs = {"labels": ids, "use_cache": False} if how == "labels" else {"use_cache": False}
    _, report = plan_model(shadow, (ids,), runtime_of(model).config, rank=dist.get_rank(), kwargs=kwargs)
    autopar.detach(model)
    want: dict[str, float] = {}
    for c in report.collectives:
        want[c.kind] = want.get(c.kind, 0.0) + float(c.bytes)
    return {k: (got.get(k, 0.0), want.get(k, 0.0)) for k in ("all_gather", "reduce_scatter", "all_reduce")}


def _worker() -> dict:
    results = [_case(*c) for c in CASES]
    steps = [_step_case(g) for g in STEP_CASES]
    sent = [_bytes(*c) for c in BYTES]
    per_rank = [_per_rank_case(*c) for c in PER_RANK]
    lengths = _lengths()
    evaluation = {"split": _evaluation(16), "whole": _evaluation(1 << 30)}
    original = context_ops.ContextOps.output

    def keep_everywhere(self, x, spec):  # mutation: every context rank keeps the caller's gradient
        return self.gather(x, spec) if spec.split else x
    context_ops.ContextOps.output = keep_everywhere
    try:
        mutated = _case("llama", {"context": 2, "data": 2}, "caller")
    finally:
        context_ops.ContextOps.output = original
    passes = builder.PIPELINE_PASSES  # mutation: a pipeline's stages cut from the whole sequence's graph
    builder.PIPELINE_PASSES = tuple(p for p in passes if p is not split_context)
    try:
        staged = _step_case({"context": 2, "pipeline": 2})
    finally:
        builder.PIPELINE_PASSES = passes
    return {"cases": results, "per_rank": per_rank, "lengths": lengths, "mutated": mutated, "bytes": sent,
            "steps": steps, "staged": staged, "evaluation": evaluation}


def test_context_parallel_matches_serial(distributed):
    for rank, r in enumerate(distributed(_worker, 4, timeout=600)):
        for (name, grid, how), got in zip(CASES, r["cases"], strict=True):
            where = f"rank {rank}, {name} at {grid} ({how} loss)"
            assert f"context={grid['context']}" in got["config"], (where, got["config"])
            for what in ("loss", "grads", "params", "logits"):
                if what in got:
                    assert got[what] < TOL, f"{where}: {what} differ by {got[what]:.2e}"
            assert got.get("tokens", True), f"{where}: generate() tokens differ"
        for (grid, how), got in zip(PER_RANK, r["per_rank"], strict=True):
            for what in ("loss", "params"):
                assert got[what] < TOL, f"rank {rank}, per-rank batches at {grid} ({how}): {what} {got[what]:.2e}"
        assert max(r["lengths"]) < TOL, f"rank {rank}: losses at 16, 24, 16 tokens differ by {r['lengths']}"
        for how, got in r["evaluation"].items():
            assert max(got["logits"], got["cache"], got["loss"]) < TOL and got["tokens"], (rank, how, got)
        # (split: each layer's keys and values gathered too)
        assert r["evaluation"]["split"]["gathers"] >= r["evaluation"]["whole"]["gathers"] + 4, (rank, r["evaluation"])
        assert r["mutated"]["grads"] > 0.5, f"rank {rank}: the mutation went unseen ({r['mutated']})"
        for grid, got in zip(STEP_CASES, r["steps"], strict=True):
            for what in ("loss", "grads"):
                assert got[what] < TOL, f"rank {rank}, train_step at {grid}: {what} differ by {got[what]:.2e}"
        assert r["staged"]["grads"] > 0.5, f"rank {rank}: stages of the whole sequence went unseen ({r['staged']})"
        for (grid, _), sent in zip(BYTES, r["bytes"], strict=True):
            # (the keys' and values' gathers, the outputs', the weights' over depth, the gradients' syncs: to the
            # byte; the loss's sums over context, a few bytes, are left out of the plan)
            for kind in ("all_gather", "reduce_scatter"):
                assert sent[kind][0] == sent[kind][1], (rank, grid, kind, sent[kind])
            assert 0 <= sent["all_reduce"][0] - sent["all_reduce"][1] <= 64, (rank, grid, sent["all_reduce"])


EXPERT_CASES = [("mixtral", {"context": 2, "data": 2, "expert_parallel": True}),
                ("mixtral+aux", {"context": 2, "data": 2, "expert_parallel": True}),
                ("qwen3_moe", {"context": 2, "tensor": (2, 1, 1)}),
                ("gpt_oss", {"context": 2, "tensor": (2, 1, 1), "expert_parallel": "data+tensor"}),
                ("llama4", {"context": 2, "tensor": (2, 1, 1)}),
                ("llama4", {"context": 2, "data": 2, "expert_parallel": True})]
"""Mixture-of-experts families under context parallelism: whole experts over data (each expert's gradient summed
over the context ranks, who routed other tokens to it), with the load-balancing loss (its router statistics
completed over the context ranks), each expert split over row, whole experts over row (GPT-OSS: biases, clamped
SwiGLU, attention sinks). Each context rank routes its own tokens (``passes.analysis.token_rows``): no note, and
only the attention's keys and values (and the caller's logits) gathered; Llama 4's batched experts and complex
rotary split op by op, but its exchange of experts' blocks reads every context rank's tokens (a note)."""


def _experts_case(name: str, grid: dict) -> dict:
    from tests import unlike_models as U

    want = U.serial(name)
    torch.manual_seed(0)
    with autopar.auto_parallelize(**grid):
        model = U.build(name)
    got = U.train(name, model, U.batches(name), state=autopar.full_state_dict, generate=True)
    notes = [n for exes in runtime_of(model).executables.values() for e in exes for r in e.records
             if r.name == "split_context" for n in r.notes if "computes the tokens of every context rank" in n]
    config = str(plan_of(model).config)
    autopar.detach(model)
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"])),
            "params": max(rel_err(got["state"][k], want["state"][k]) for k in want["state"]),
            "tokens": torch.equal(got["tokens"], want["tokens"]), "notes": notes,
            "config": config}


def _experts_worker() -> dict:
    from autopar.config import ParallelConfig

    results = [_experts_case(*c) for c in EXPERT_CASES]
    original = ParallelConfig.grad_axes
    # mutation: an expert's gradient (split over data: summed over depth) not summed over the context ranks
    ParallelConfig.grad_axes = lambda self, axes: axes if axes == ("depth",) else original(self, axes)
    try:
        mutated = _experts_case(*EXPERT_CASES[0])
    finally:
        ParallelConfig.grad_axes = original
    return {"cases": results, "mutated": mutated}


def test_context_splits_moe_families_tokens_with_serials_numbers(distributed):
    """Context with experts (before 2026-12-05 refused with expert parallelism, and every MoE layer's tokens were
    gathered whole: each context rank computed every token's experts): losses, every final parameter and
    generate's tokens are serial's; the mutation (an expert's gradient summed over data only, not the context
    ranks) is seen."""
    for rank, r in enumerate(distributed(_experts_worker, 4, timeout=900)):
        for (name, grid), got in zip(EXPERT_CASES, r["cases"], strict=True):
            where = f"rank {rank}, {name} at {grid}"
            assert "context=2" in got["config"], (where, got["config"])
            assert got["loss"] < TOL and got["params"] < TOL and got["tokens"], (where, got)
            assert bool(got["notes"]) == (name == "llama4" and "data" in grid), (where, got["notes"])
        assert r["mutated"]["params"] > 1e-3, f"rank {rank}: the mutation went unseen ({r['mutated']})"


def test_context_composes_with_every_other_axis():
    from autopar.config import ParallelConfig
    from autopar.errors import ConfigError

    config = ParallelConfig.from_user(world_size=8, context=2, expert_parallel=True)
    assert (config.data, config.expert_axis) == (4, "data")
    assert config.grad_axes(("depth",)) == ("context", "depth")  # experts over data: summed over context too
    assert config.grad_axes(("data", "depth")) == ("data", "context", "depth")
    assert config.grad_axes(()) == ()  # (a weight held by one rank of each group: nothing to sum)
    assert ParallelConfig.from_user(world_size=8, context=2, pipeline=2).data == 2
    with pytest.raises(ConfigError, match="context"):
        ParallelConfig.from_user(world_size=6, context=4)
    assert ParallelConfig.from_user(world_size=8, context=2, tensor=(2, 1, 1)).data == 2


IDIOM_GRID = {"context": 2, "data": 2, "expert_parallel": True}


def _idioms_worker() -> dict:
    """Mixtral with whole experts over data under context 2, through a script's idioms: ``clip_grad_norm_``
    (and the mutation: every rank counting its copies), AdamW with clipping under ``shard_optimizer``, a DCP
    checkpoint loaded under three other layouts, a DDP-style loader's per-rank rows."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    from autopar.runtime.interop import norms
    from tests import unlike_models as U

    rank, world = dist.get_rank(), dist.get_world_size()
    (x, y), out = U.batches("mixtral")[0], {}

    def build(seed: int = 0, **grid) -> torch.nn.Module:
        torch.manual_seed(seed)
        with autopar.auto_parallelize(**grid):
            return U.build("mixtral")

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, rows=lambda t: t, clip: bool = False) -> dict:
        losses = []
        for xx, yy in U.batches("mixtral"):
            loss = U.loss_of("mixtral", model, rows(xx), rows(yy))
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        state = autopar.full_state_dict(model)
        autopar.detach(model)
        return {"losses": losses, "state": state}

    norms_of = []
    for mutated in (False, True):
        model = build(**IDIOM_GRID)
        U.loss_of("mixtral", model, x, y).backward()
        original = norms.designated
        if mutated:
            norms.designated = lambda t: True
        try:
            norms_of.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        finally:
            norms.designated = original
        autopar.detach(model)
    out["norm"], out["mutated norm"] = norms_of
    model = build(shard_optimizer=True, **IDIOM_GRID)
    out["adamw"] = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), clip=True)
    model = build(batch="per-rank", **IDIOM_GRID)
    out["per-rank"] = train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            rows=lambda t: t.chunk(world)[rank])
    box = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(box)
    saved_model = build(**IDIOM_GRID)
    U.loss_of("mixtral", saved_model, x, y)  # (the first call shards the experts)
    dcp.save(saved_model.state_dict(), checkpoint_id=box[0])
    saved = autopar.full_state_dict(saved_model)
    autopar.detach(saved_model)
    out["dcp"] = {}
    for seed, grid in enumerate(({"data": 4}, IDIOM_GRID, {"context": 2, "tensor": (2, 1, 1)}), start=1):
        other = build(seed, **grid)
        U.loss_of("mixtral", other, x, y)
        sd = other.state_dict()
        dcp.load(sd, checkpoint_id=box[0])
        other.load_state_dict(sd)
        back = autopar.full_state_dict(other)
        out["dcp"][str(grid)] = all(torch.equal(back[k], v) for k, v in saved.items())
        autopar.detach(other)
    return out


def test_context_with_split_experts_keeps_serials_numbers_through_a_scripts_idioms(distributed):
    """Context 2 x data 2 with the experts over data: ``clip_grad_norm_``'s total norm is serial's (the mutation,
    every rank counting its copies, is seen); AdamW with clipping under ``shard_optimizer`` trains to serial's
    parameters; a DDP-style per-rank loader trains as DDP (for equal rows and a mean loss: serial); a DCP
    checkpoint loads to the bit with the experts whole over data 4, with the same layout, and each split over row
    under context."""
    from tests import unlike_models as U

    torch.manual_seed(0)
    serial = U.build("mixtral")
    x, y = U.batches("mixtral")[0]
    U.loss_of("mixtral", serial, x, y).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05))
    torch.manual_seed(0)
    serial = U.build("mixtral")
    opt = torch.optim.AdamW(serial.parameters(), lr=1e-3)
    adamw = []
    for xx, yy in U.batches("mixtral"):
        loss = U.loss_of("mixtral", serial, xx, yy)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        adamw.append(loss.item())
    wants = {"adamw": {"losses": adamw, "state": serial.state_dict()}, "per-rank": U.serial("mixtral")}
    for rank, r in enumerate(distributed(_idioms_worker, 4, timeout=900)):
        assert abs(r["norm"] - norm) <= 1e-5 * norm, (rank, r["norm"], norm)
        assert r["mutated norm"] > 1.2 * norm, (rank, "the mutation went unseen", r["mutated norm"], norm)
        for idiom, want in wants.items():
            got = r[idiom]
            assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"])) < TOL, (rank, idiom)
            assert max(rel_err(got["state"][k], want["state"][k]) for k in want["state"]) < TOL, (rank, idiom)
        assert all(r["dcp"].values()), (rank, r["dcp"])


DROPOUT_CASES = {2: [("nanogpt", {"context": 2}), ("gpt2", {"context": 2}), ("gpt2-eager", {"context": 2}),
                     ("gpt-neo", {"context": 2}),
                     ("gpt2", {"tensor": (2, 1, 1), "sequence_parallel": True})],
                 4: [("gpt2-eager", {"context": 2, "tensor": (1, 2, 1), "sequence_parallel": True}),
                     ("gpt2", {"context": 2, "tensor": (2, 1, 1), "sequence_parallel": True})]}
"""Dropout in training under context (refused before 2026-12-06): nanoGPT (SDPA's own attention dropout, and
hidden dropout on this rank's tokens), GPT-2 with SDPA and with eager attention (its dropout an op on the
probabilities), GPT-Neo (its attention written out: computed whole, cut before its output projection), with
the tensor axes and sequence parallelism (heads over col; the tokens over row, cut from the
attention's whole output). The last case's attention dropout draws per piece of the heads (``split_random``), as
without context: its oracle is the same tensor grid without context (on 2 ranks)."""


def _dropout_build(name: str) -> torch.nn.Module:
    if name == "nanogpt":
        return NanoGPT(GPTConfig(vocab_size=zoo.VOCAB, block_size=zoo.POSITIONS, n_layer=2, n_head=zoo.HEADS,
                                 n_embd=zoo.HIDDEN, dropout=0.1))
    model = zoo.build_model("gpt-neo" if name == "gpt-neo" else "gpt2", dropout=True)
    if name == "gpt2-eager":
        model.config._attn_implementation = "eager"
    return model


def _dropout_losses(model: torch.nn.Module, name: str) -> list[float]:
    torch.manual_seed(1)  # (the masks' generator, alike on every rank and in serial)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for ids in _data():
        loss = _loss(model, "nanogpt" if name == "nanogpt" else "hf", ids, "labels")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _dropout_worker(ranks: int) -> dict:
    out = {}
    for mutated in (False, True) if ranks == 2 else (False,):
        original = context_ops.ContextOps.dropout
        if mutated:  # each rank draws a mask for its own tokens only
            context_ops.ContextOps.dropout = lambda self, x, p, train, spec: torch.ops.aten.dropout(x, p, train)
        try:
            for name, grid in DROPOUT_CASES[ranks][:1] if mutated else DROPOUT_CASES[ranks]:
                torch.manual_seed(0)
                serial = _dropout_build(name)
                want = _dropout_losses(serial, name)
                torch.manual_seed(0)
                with autopar.auto_parallelize(**grid):
                    model = _dropout_build(name)
                got = _dropout_losses(model, name)
                notes = [n for exes in runtime_of(model).executables.values() for e in exes for r in e.records
                         if r.name == "split_context" for n in r.notes]
                out[("mutated " if mutated else "") + name + str(grid)] = {"want": want, "got": got, "notes": notes}
                autopar.detach(model)
        finally:
            context_ops.ContextOps.dropout = original
    return out


def test_dropout_under_context_draws_serials_masks(distributed):
    """Each context rank draws the whole tensor's mask and keeps its tokens' part (``context_dropout``); an
    attention whose dropout is drawn inside SDPA reads the whole sequence (a note: serial's masks, C times the
    work). Losses equal serial's (to float rounding: the masks are the same numbers); the mutation (each rank's
    mask drawn for its own tokens) is seen."""
    two = distributed(_dropout_worker, 2, 2)[0]
    four = distributed(_dropout_worker, 4, 4)[0]
    for key, r in {**two, **four}.items():
        if key.startswith("mutated"):
            assert max(abs(a - b) for a, b in zip(r["got"], r["want"])) > 1e-3, (key, r)
            continue
        want = two["gpt2{'tensor': (2, 1, 1), 'sequence_parallel': True}"]["got"] if "(2, 1, 1)" in key else r["want"]
        assert max(abs(a - b) / b for a, b in zip(r["got"], want)) < TOL, (key, r["got"], want)
        if "context" in key:
            assert any("reads the whole sequence" in n and "attn" in n for n in r["notes"]), (key, r["notes"])
            sdpa = "eager" not in key and "neo" not in key
            assert any("attention's dropout, drawn whole" in n for n in r["notes"]) == sdpa, (key, r["notes"])
