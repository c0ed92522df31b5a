"""The plan search: every grid a world size allows for a model, planned (``autopar.planning.planner``) and ranked by
the predicted step time on a described machine (``passes.analysis.search_plans``). ``python -m autopar.plan``
prints it; ``auto_parallelize(plan="auto")`` runs its first grid (``choose_grid``)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autopar.compat import pytree
from autopar.config import ParallelConfig
from autopar.errors import AutoparError, PlanError
from autopar.planning.machines import device_type_of, local_machine
from autopar.model_file import meta_inputs
from autopar.planning.planner import SLOWEST, plan_model
from passes.analysis.choose_stages import Hardware
from passes.analysis.machine import Machine
from passes.analysis.screen import screen_grids, shape_of, with_context_whole
from passes.analysis.search_plans import (Candidate, Scored, candidates, context_degrees, factorizations, plan_seconds,
                                         rank_plans)


def score(model: nn.Module, inputs: tuple, candidate: Candidate, machine: Machine, *,
          checkpoint: str = "auto", precision: str = "fp32", captures: dict[Any, Any] | None = None,
          kwargs: dict | None = None, compiled: bool = False) -> Scored:
    """One grid's plan and its predicted step on ``machine``: rank 0's without a pipeline (every rank does
    the same work), else the rank whose stages compute most. ``kwargs``: the call's keyword inputs;
    ``compiled``: training runs compiled (``plan_model``'s)."""
    try:
        plan, report = plan_model(model, inputs, candidate.config, rank=SLOWEST, checkpoint=checkpoint, kwargs=kwargs,
                                  budget=machine.memory_bytes, precision=precision, pipeline=candidate.pipeline,
                                  microbatches=candidate.microbatches, chunks=candidate.chunks, captures=captures,
                                  hardware=Hardware.of(machine, candidate.config), compiled=compiled,
                                  device=device_type_of(machine))
    except AutoparError as e:
        return Scored(candidate, None, 0, False, reason=str(e).splitlines()[0])
    # the step is the slowest rank's (plan_seconds reads its report), the memory the fullest rank's: under
    # a pipeline plan.memory is the rank that needs the most (usually the first: most micro-batches in flight),
    # and what it recomputes is every rank's choice
    memory = plan.memory
    peak = memory.static_bytes + memory.activation_bytes
    time = plan_seconds(plan, report, machine, precision)
    fits = memory.fits and peak <= machine.memory_bytes
    reason = "" if fits else (f"needs {gib(peak)} per device (with every block recomputed) of "
                              f"{gib(machine.memory_bytes)}")
    return Scored(candidate, time, peak, fits, memory.recompute, reason)


KEEP = 8
"""Grids the search plans exactly when there are more: the closed-form screen's best (at most)."""
NEAR = 1.5
MIN_KEEP = 4
"""Of those, the ones the screen puts within NEAR times its best, and at least MIN_KEEP."""
ROUNDS = 4
"""While no planned grid fits memory, the next KEEP the screen ranks are planned, up to ROUNDS x KEEP."""
RELIEF = 1.25
"""A fitting grid that recomputes blocks is also planned with its optimizer state split over data where its step
is within this factor of the best one's (``_search``'s ``relieved``): the RELIEF_TRIES fastest such grids."""
RELIEF_TRIES = 3
SEQUENCE_TRIES = 2
"""The screen's best grids of one tensor axis also planned where none is among its best (``_search``): sequence
parallelism may fit them with fewer blocks recomputed, and the screen counts no activations."""
SCREENED = "not planned"


@contextlib.contextmanager
def _collector_skips_what_exists() -> Iterator[None]:
    """While inside, the cyclic garbage collector's passes skip the objects that existed before (``gc.freeze``,
    undone after; left alone where the process froze objects itself): a search makes many short-lived
    objects, and each full pass would traverse every object of the process (~450,000 with torch and
    transformers imported: ~0.1 s a pass, a tenth of a 100-layer search)."""
    mine = gc.get_freeze_count() == 0
    if mine:
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


def search(model: nn.Module, inputs: tuple, world: int, machine: Machine, *, fixed: dict[str, int] | None = None,
           checkpoint: str = "auto", precision: str = "fp32", keep: int | None = KEEP,
           kwargs: dict | None = None, compiled: bool = False, expert_parallel: bool | str | None = None,
           without: frozenset[str] = frozenset()) -> list[Scored]:
    """Every grid of ``world`` ranks, ranked (``rank_plans``); ``fixed`` degrees stay as given. With more
    than ``keep`` grids (None: plan every one), the closed-form screen (``passes.analysis.screen``, from one
    plan of the model on one rank) ranks them all and the best ``keep`` are planned exactly, each pipeline
    grid under both schedules (the screen does not price the interleaved schedule's recomputation); the
    rest follow, unplanned, with their screened time as the reason. ``fixed["chunks"]``: the stages per
    pipeline rank (default: 1F1B's one or interleaved's two, whichever is faster). ``compiled``: training runs
    compiled (``plan_model``'s; the screen's too). ``expert_parallel``: of a mixture-of-experts model (one with
    routed-experts layers an expert layout can split), each grid whose data degree divides the experts is
    also tried with them split over data, and each of one tensor axis whose data x tensor ranks divide them with
    whole experts over those ("data+tensor"; ``candidates``'s ``expert_layouts``): beside the unsplit grid
    (None), only so (True: either; "data+tensor": that one), or never (False). ``without``: features no
    plan may use (``Candidate``'s: ``shard_optimizer``, ``sequence_parallel``, ``expert_parallel``, ``context``), as a
    framework that lacks them runs. Where a sequence has ``CONTEXT_FROM`` tokens or more, the grids (pipelines
    included) are also tried with context degrees (``context_degrees``; ``fixed["context"]`` keeps one, 1 none)."""
    if "expert_parallel" in without:
        if expert_parallel:
            raise PlanError("the search was asked for experts split over data and held to plans without them")
        expert_parallel = False
    with _collector_skips_what_exists():
        return _search(model, inputs, world, machine, fixed=fixed, checkpoint=checkpoint, precision=precision,
                       keep=keep, kwargs=kwargs, compiled=compiled, expert_parallel=expert_parallel,
                       without=without)


def _search(model: nn.Module, inputs: tuple, world: int, machine: Machine, *, fixed: dict[str, int] | None,
            checkpoint: str, precision: str, keep: int | None, kwargs: dict | None,
            compiled: bool = False, expert_parallel: bool | str | None = None,
            without: frozenset[str] = frozenset()) -> list[Scored]:
    shard, sequence = "shard_optimizer" not in without, "sequence_parallel" not in without
    batch = _batch_size((inputs, kwargs))
    contexts = () if "context" in without else context_degrees(world, _sequence_length((inputs, kwargs)))
    fixed = dict(fixed or {})
    chunks = (fixed.pop("chunks"),) if "chunks" in fixed else (1, 2)
    captures: dict[Any, Any] = {}  # grids whose batch shards get the same rows share a capture
    # one plan of the whole model: data parallel when the batch splits evenly (its capture is that
    # grid's, which the screen likely keeps), else on one rank; the screen reads it, and it finds the
    # routed-experts layers an expert layout can split (a model with 3-D parameters only)
    shards = world if batch % world == 0 else 1
    probe: list[Any] = []

    def probed() -> Any:
        if not probe:
            probe.append(plan_model(model, inputs, ParallelConfig(shards, 1, 1, 1), checkpoint="none", kwargs=kwargs,
                                    precision=precision, captures=captures, device=device_type_of(machine))[1])
        return probe[0]

    experts: tuple[int, ...] = ()
    if expert_parallel is not False and any(p.dim() >= 3 for p in model.parameters()):
        experts = tuple(e.experts for e in probed().experts)
    grids = candidates(world, batch, fixed=fixed, chunks=chunks, experts=experts, expert_parallel=expert_parallel,
                       contexts=contexts)
    if not grids:
        fixed_text = ", ".join(f"{k}={v}" for k, v in (fixed or {}).items()) or "nothing"
        if not factorizations(world, fixed):
            raise PlanError(f"no grid of {world} ranks has {fixed_text}: the degrees multiply to the world size, so "
                            f"each must divide {world}. Grids of {world} ranks: {_grids(factorizations(world))}. "
                            "Fix degrees that divide the world size, or launch a multiple of them.")
        raise PlanError(f"no grid of {world} ranks fits a global batch of {batch} rows with {fixed_text} fixed: data "
                        f"x depth must be at most the batch. Grids of {world} ranks: "
                        f"{_grids(factorizations(world, fixed))}. Raise the batch or fix smaller degrees.")
    def scored_one(c: Candidate) -> Scored:
        return score(model, inputs, c, machine, checkpoint=checkpoint, precision=precision, captures=captures,
                     kwargs=kwargs, compiled=compiled)

    def planned(grids: list[Candidate]) -> list[Scored]:
        """Each grid's plan; one that does not fit, with its optimizer state split over data when that needs
        less memory (ZeRO stages 1-2: the bytes of DDP's all-reduce in twice the collectives, and gradients
        split over data: only where memory needs it),
        then with its activations split along the tokens (sequence parallelism: the same bytes in twice the
        collectives)."""
        out = []
        for c in grids:
            s = scored_one(c)
            if shard and not s.fits and s.time is not None and _state_splits(c):
                split = scored_one(dataclasses.replace(c, shard_optimizer=True))
                if split.fits or (split.time is not None and split.memory_bytes < s.memory_bytes):
                    s = split
            if sequence and not s.fits and s.time is not None and _tokens_split(c):
                seq = scored_one(dataclasses.replace(s.candidate, sequence_parallel=True))
                if seq.fits or (seq.time is not None and seq.memory_bytes < s.memory_bytes):
                    s = seq
            out.append(s)
        return out

    def relieved(scored: list[Scored]) -> list[Scored]:
        """``scored`` where a fitting grid near the best (within ``RELIEF``) recomputes blocks: with its optimizer
        state split over data too, then with its activations split along the tokens, each when that is faster (the
        memory freed recomputes fewer blocks: BLOOM's ZeRO-1 grid), checked for those grids only."""
        best = min((s.seconds for s in scored if s.fits), default=math.inf)
        out = list(scored)
        for feature, applies, allowed in (("shard_optimizer", _state_splits, shard),
                                          ("sequence_parallel", _tokens_split, sequence)):
            eligible = sorted((s.seconds, i) for i, s in enumerate(out) if allowed and s.fits and s.recompute
                              and applies(s.candidate) and s.seconds <= RELIEF * best)
            for _, i in eligible[:RELIEF_TRIES]:
                split = scored_one(dataclasses.replace(out[i].candidate, **{feature: True}))
                if split.fits and split.seconds < out[i].seconds:
                    out[i] = split
        return out

    if keep is None or len(grids) <= keep:
        return rank_plans(relieved(planned(grids)))
    shape = shape_of(probed(), shards)
    if any(c.context > 1 for c in grids):  # (what a context degree leaves whole, from a plan of the least one)
        least = min(c.context for c in grids if c.context > 1)
        at = plan_model(model, inputs, ParallelConfig(shards, 1, 1, 1, context=least), checkpoint="none",
                        kwargs=kwargs, precision=precision, captures=captures, device=device_type_of(machine))[1]
        shape = with_context_whole(shape, at, shards, least)
    half = precision in ("bf16", "fp16")
    def screened_one(c: Candidate, own: tuple[float, int], split: tuple[float, int] | None
                     ) -> tuple[float, int, Candidate]:
        if shard and own[1] > machine.memory_bytes and split is not None and split[1] < own[1]:
            return split[0], split[1], dataclasses.replace(c, shard_optimizer=True)  # (the state split over data)
        return own[0], own[1], c

    screened = sorted((screened_one(c, *pair) for c, pair in zip(grids, screen_grids(shape, grids, machine, half,
                                                                                       compiled=compiled))),
                      key=lambda t: (t[1] > machine.memory_bytes, t[0]))
    near = sum(t[0] <= NEAR * screened[0][0] for t in screened)  # the screen's best and those close to it
    first = min(keep, max(near, MIN_KEEP))
    in_screen = {c: t for t, _, c in screened}
    chosen: dict[Candidate, None] = {}

    def choose(grids: list[Candidate]) -> list[Candidate]:
        """``grids`` and the other schedules of each (1F1B's and the interleaved one, same micro-batches):
        the screen does not price the recomputation that the interleaved schedule's extra micro-batches in
        flight may need, so exact planning chooses between them."""
        new = []
        for c in grids:
            for other in (c, *(dataclasses.replace(c, chunks=v) for v in chunks if v != c.chunks)):
                if other not in in_screen:  # screened with the optimizer state split over data, or not
                    other = dataclasses.replace(other, shard_optimizer=not other.shard_optimizer)
                if other in in_screen and other not in chosen and (other == c or in_screen[other] < math.inf):
                    # (another schedule the screen already finds no plan, more stages than links: not planned)
                    chosen[other] = None
                    new.append(other)
        return new

    # and the screen's best grid without tensor axes and with them, where the first are all of one kind: the
    # screen prices the two kinds by different closed forms (AxoNN's per-layer collectives, experts split over
    # a tensor axis) and errs differently on each (Qwen3-30B-A3B on 16 H100s: data 2 x pipeline 8 screened at
    # 893 ms behind tensor grids screened under 730, planned at 667 against their 812); and its SEQUENCE_TRIES best
    # grids of one tensor axis (a grid and its row/column mirror counted once), where sequence parallelism may
    # split their activations: the screen counts none, so it cannot see the blocks that saves from recomputing
    # (Llama-3-405B at 8,192 tokens on 16,384 H100s: tensor 8 with it 14.2 s, the screen's 2 x 4 grids 16.8 s)
    kinds_of = [(lambda c: c.row * c.col * c.depth == 1, 1), (lambda c: c.row * c.col * c.depth > 1, 1)]
    if sequence:
        kinds_of.append((_tokens_split, SEQUENCE_TRIES))
    kinds: dict[Candidate, None] = {}
    for kind, tries in kinds_of:
        if any(kind(c) for *_, c in screened[:first]):
            continue
        shapes: set[Candidate] = set()
        for _, memory, c in screened[first:]:
            if len(shapes) == tries:
                break
            mirrored = kind(c) and dataclasses.replace(c, row=c.col, col=c.row) in shapes
            if kind(c) and memory <= machine.memory_bytes and not mirrored:
                shapes.add(c)
                kinds[c] = None
    scored = planned(choose([c for *_, c in screened[:first]] + list(kinds)))
    # the screen counts no activations: while none of the planned grids fits, plan the next ones it would
    # fit, up to ROUNDS times as many
    done = first
    while not any(s.fits for s in scored) and done < min(len(screened), ROUNDS * keep):
        more = [c for _, memory, c in screened[done:done + keep] if memory <= machine.memory_bytes]
        done += keep
        scored += planned(choose(more))
    scored = relieved(scored)
    device = gib(machine.memory_bytes)
    return rank_plans(scored) + [
        Scored(c, None, memory, memory <= machine.memory_bytes,
               reason=_screened(seconds, memory, c, shape, machine, device))
        for seconds, memory, c in screened[done:] if c not in chosen]


def _state_splits(c: Candidate) -> bool:
    """Whether ``c``'s optimizer state may also be split over its data ranks (``shard_optimizer``)."""
    return c.data > 1 and not c.shard_optimizer


def _tokens_split(c: Candidate) -> bool:
    """Whether ``c``'s activations may also be split along the tokens (``sequence_parallel``): where one of row and
    col reduces a whole output (exactly one of them > 1); not with experts split over data, whose exchange under
    token-split activations is not built."""
    return (c.row > 1) != (c.col > 1) and not c.sequence_parallel and not c.expert_parallel


def _screened(seconds: float, memory: float, config: Candidate, shape, machine: Machine, device: str) -> str:
    """Why a grid the screen left out was not planned: it does not fit (by the screen's memory estimate),
    it has more stages than segments, or it is predicted slower. ``device``: the machine's memory, as text."""
    if memory > machine.memory_bytes:
        return f"{SCREENED}: needs about {gib(memory)} per device of {device} (the screen's estimate)"
    if seconds == math.inf:
        return f"{SCREENED}: {config.pipeline} stages for {shape.segments} segments"
    return f"{SCREENED}: the screen predicts {seconds * 1e3:.3g} ms"


def _grids(options: list[dict[str, int]]) -> str:
    shown = [f"data={o['data']} pipeline={o['pipeline']} tensor={o['row']},{o['col']},{o['depth']}"
             for o in options[:6]]
    return "; ".join(shown) + (f"; ... ({len(options)} in all)" if len(options) > 6 else "")


def _sequence_length(inputs: tuple) -> int:
    """The tokens per row of the first input of two or more dimensions (a language model's ids); 0 without one."""
    tensors = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() >= 2]
    return int(tensors[0].shape[1]) if tensors else 0


def _batch_size(inputs: tuple) -> int:
    tensors = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return int(tensors[0].shape[0]) if tensors else 1


def choose_grid(model: nn.Module, inputs: tuple, world: int, *, fixed: dict[str, int] | None = None,
                checkpoint: str = "auto", precision: str = "fp32", kwargs: dict | None = None,
                batch_size: int | None = None, budget: int | None = None, compiled: bool = False,
                expert_parallel: bool | str | None = None) -> list[Scored]:
    """``auto_parallelize(plan="auto")``'s choice: every grid of ``world`` ranks for ``inputs`` (and keyword
    inputs ``kwargs``: one global batch; ``batch_size`` replaces its rows) on this machine, ranked; the first
    is the one to run. ``budget``: bytes per device the plan must fit (``checkpoint=<bytes>``'s) instead of
    the device's memory; ``compiled``: the runtime compiles training there (its ``compile=`` on this device);
    ``expert_parallel``: ``search``'s.
    Raises PlanError when none fits memory, with the closest."""
    machine = local_machine(world)
    if budget is not None:
        machine = dataclasses.replace(machine, memory_bytes=budget)
    if kwargs:
        both = meta_inputs((tuple(inputs), dict(kwargs)), batch_size)
        inputs, kwargs = both[0], both[1]
    else:
        inputs = meta_inputs(tuple(inputs), batch_size)
    ranked = search(model, inputs, world, machine, fixed=fixed, checkpoint=checkpoint, precision=precision,
                    kwargs=kwargs, compiled=compiled, expert_parallel=expert_parallel)
    if not ranked[0].fits:
        closest = "; ".join(f"{s.candidate.describe()}: {gib(s.memory_bytes)}" for s in ranked[:3])
        raise PlanError(f"no grid of {world} ranks fits {gib(machine.memory_bytes)} per device for this model "
                        f"and batch; the closest need {closest}. Use more devices, a smaller batch, or "
                        "precision='bf16'.")
    return ranked


def gib(n: float) -> str:
    """Bytes as GiB (MiB below one GiB), for reports."""
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"
