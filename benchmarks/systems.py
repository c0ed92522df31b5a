"""The systems the harness compares, each built the way its users write it.

Every system gets the same model (same seed), the same global batches and AdamW, and returns from each
training step its share of the global loss: the global loss is the sum of the shares over ranks (a rank
that computed the whole loss gives it on rank 0 and 0 elsewhere).

Peers: ``serial`` (rank 0 alone), ``ddp``, ``fsdp2`` (``fully_shard`` per block and the root),
``tp`` (DTensor ``parallelize_module`` with the model's Colwise/Rowwise plan) and ``pipe``
(torch.distributed.pipelining on the model's hand split). autopar runs a grid written like
``t2x2x1-d2-p2`` (tensor row x col x depth, data, pipeline; data defaults to the ranks left).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.models import BenchModel, NotApplicable

PEERS = ("serial", "ddp", "fsdp2", "tp", "pipe")
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


@dataclass(frozen=True)
class Grid:
    tensor: tuple[int, int, int]
    data: int
    pipeline: int
    compiled: bool = False
    """The token ``c``: ``auto_parallelize(compile=True)`` (else compile=False: eager, on every device)."""
    shard_optimizer: bool = False
    """The token ``z``: ``auto_parallelize(shard_optimizer=True)`` (each data rank keeps 1/data of Adam's state)."""
    sequence_parallel: bool = False
    """The token ``s``: ``auto_parallelize(sequence_parallel=True)`` (activations split along the tokens)."""
    expert_parallel: bool = False
    """The token ``e``: ``auto_parallelize(expert_parallel=True)`` (routed experts split over the data ranks)."""

    @property
    def label(self) -> str:
        parts = [f"t{'x'.join(map(str, self.tensor))}"] if self.tensor != (1, 1, 1) else []
        parts += [f"d{self.data}"] if self.data > 1 or not parts and self.pipeline == 1 else []
        parts += [f"p{self.pipeline}"] if self.pipeline > 1 else []
        parts += ["c"] if self.compiled else []
        parts += ["z"] if self.shard_optimizer else []
        parts += ["s"] if self.sequence_parallel else []
        parts += ["e"] if self.expert_parallel else []
        return "-".join(parts)

    @property
    def per_rank(self) -> bool:
        """Data parallelism alone: fed like DDP, each rank its slice of the batch (per-rank batches)."""
        return self.tensor == (1, 1, 1) and self.pipeline == 1

    def same_plan_peer(self) -> str | None:
        """The peer whose plan this grid is: DDP (data only), FSDP2 (depth only: weights gathered per
        layer, gradients reduce-scattered), Megatron-style TP (row only), pipelining (pipeline only)."""
        r, c, d = self.tensor
        axes = {"ddp": self.data, "fsdp2": d, "tp": r, "pipe": self.pipeline}
        used = [name for name, n in axes.items() if n > 1]
        if c > 1 or len(used) != 1:
            return None
        return used[0]


def parse_grid(text: str, world: int) -> Grid:
    """``t2x2x1-d2-p2`` -> Grid; tokens in any order, each at most once; data defaults to what is left; ``c``:
    the per-rank program compiled; ``z``: the optimizer state split over data; ``s``: sequence parallelism; ``e``:
    routed experts split over data."""
    found: dict[str, str] = {}
    for token in text.split("-"):
        m = re.fullmatch(r"(t)(\d+)x(\d+)x(\d+)|([dp])(\d+)|([czse])", token)
        if m is None or (m.group(1) or m.group(5) or m.group(7)) in found:
            raise ValueError(f"bad autopar grid {text!r} (token {token!r}). Write tokens t<row>x<col>x<depth>, "
                             "d<data>, p<pipeline>, c (compiled), z (optimizer state split over data), s (sequence "
                             "parallelism) and e (experts split over data) joined by '-', each at most once, e.g. "
                             "t2x2x1-d2")
        found[m.group(1) or m.group(5) or m.group(7)] = token
    tensor = tuple(int(v) for v in re.findall(r"\d+", found.get("t", "t1x1x1")))
    pipeline = int(found.get("p", "p1")[1:])
    inner = tensor[0] * tensor[1] * tensor[2] * pipeline
    data = int(found["d"][1:]) if "d" in found else max(world // inner, 1)
    if data * inner != world or min(*tensor, pipeline, data) < 1:
        raise ValueError(f"autopar grid {text!r} needs {data * inner} ranks (tensor {tensor}, data {data}, "
                         f"pipeline {pipeline}), not {world}. Make the product of the degrees {world}.")
    return Grid(tensor, data, pipeline, "c" in found, "z" in found, "s" in found, "e" in found)


def default_grids(world: int) -> list[str]:
    """Each peer's plan under autopar, plus a mixed 3D grid where the world has one."""
    if world == 1:
        return ["d1"]
    grids = [f"d{world}", f"t1x1x{world}", f"t{world}x1x1", f"p{world}"]
    if world % 4 == 0:
        grids.append("t2x2x1" if world == 4 else f"t2x2x1-d{world // 4}")
    return grids


@dataclass
class Context:
    world: int
    rank: int
    device: torch.device
    microbatches: int
    schedule: str
    lr: float = 1e-4


@dataclass
class Runner:
    """One built system on this rank."""

    train: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """One step (forward, backward, optimizer); returns this rank's share of the global loss."""
    modules: list[nn.Module]
    """What this rank holds (for parameter memory)."""
    info: dict[str, Any] = field(default_factory=dict)


def _optimized(params: Any, lr: float, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    opt = torch.optim.AdamW(params, lr=lr)

    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        share = step(x, y)
        opt.step()
        opt.zero_grad()
        return share

    return train


def _rank0(loss: torch.Tensor, ctx: Context) -> torch.Tensor:
    return loss.detach() if ctx.rank == 0 else torch.zeros((), device=ctx.device)


def _build(bm: BenchModel, ctx: Context) -> nn.Module:
    torch.manual_seed(0)
    return bm.build().to(ctx.device)


def serial(bm: BenchModel, ctx: Context) -> Runner:
    if ctx.rank != 0:
        return Runner(lambda x, y: torch.zeros((), device=ctx.device), [])
    model = _build(bm, ctx)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = bm.loss(model(x), y)
        loss.backward()
        return loss.detach()

    return Runner(_optimized(model.parameters(), ctx.lr, step), [model])


def _data_parallel_step(bm: BenchModel, model: nn.Module, ctx: Context
                        ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Per-rank slices of the global batch, as DDP and FSDP users feed them; share = loss x rows / batch."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xl, yl = x.tensor_split(ctx.world)[ctx.rank], y.tensor_split(ctx.world)[ctx.rank]
        loss = bm.loss(model(xl), yl)
        loss.backward()
        return loss.detach() * (xl.shape[0] / x.shape[0])

    return step


def ddp(bm: BenchModel, ctx: Context) -> Runner:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_build(bm, ctx), device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
    return Runner(_optimized(model.parameters(), ctx.lr, _data_parallel_step(bm, model, ctx)), [model])


def fsdp2(bm: BenchModel, ctx: Context) -> Runner:
    from torch.distributed.fsdp import fully_shard

    model = _build(bm, ctx)
    for block in bm.blocks(model):
        fully_shard(block)
    fully_shard(model)
    return Runner(_optimized(model.parameters(), ctx.lr, _data_parallel_step(bm, model, ctx)), [model])


def tp(bm: BenchModel, ctx: Context) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = _build(bm, ctx)
    plan = bm.tp_plan(model)
    parallelize_module(model, init_device_mesh(ctx.device.type, (ctx.world,)), plan)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # every rank takes the whole batch
        loss = bm.loss(model(x), y)
        loss.backward()
        return _rank0(loss, ctx)

    return Runner(_optimized(model.parameters(), ctx.lr, step), [model])


def pipe(bm: BenchModel, ctx: Context) -> Runner:
    import torch.distributed.pipelining as pp

    stage_module = bm.stages(_build(bm, ctx), ctx.world)[ctx.rank]  # the rest of the model is dropped
    stage = pp.PipelineStage(stage_module, ctx.rank, ctx.world, ctx.device)
    schedule = getattr(pp, SCHEDULES[ctx.schedule])(stage, ctx.microbatches, loss_fn=bm.loss)
    first, last = ctx.rank == 0, ctx.rank == ctx.world - 1

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        schedule.step(*([x] if first else []), **(dict(target=y, losses=losses) if last else {}))
        if last:  # equal micro-batches: the mean of their mean losses is the batch's
            return torch.stack(losses).detach().mean()
        return torch.zeros((), device=ctx.device)

    return Runner(_optimized(stage_module.parameters(), ctx.lr, step), [stage_module])


def autopar_grid(bm: BenchModel, ctx: Context, grid: Grid) -> Runner:
    """autopar on ``grid``. A data-only grid is fed as the DDP script feeds DDP (each rank its slice:
    per-rank batches, detected at the first call); any other grid gets the global batch on every rank."""
    import autopar

    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=grid.tensor, data=grid.data, pipeline=grid.pipeline, compile=grid.compiled,
                                  shard_optimizer=grid.shard_optimizer, sequence_parallel=grid.sequence_parallel,
                                  expert_parallel=grid.expert_parallel,
                                  **(dict(microbatches=ctx.microbatches, schedule=ctx.schedule)
                                     if grid.pipeline > 1 else {})):
        model = bm.build().to(ctx.device)
    if grid.per_rank:
        return Runner(_optimized(model.parameters(), ctx.lr, _data_parallel_step(bm, model, ctx)), [model],
                      {"model": model})

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if grid.pipeline > 1:  # pipelines run through train_step (it drives torch's schedules)
            loss = autopar.train_step(model, x, y, F.cross_entropy)
        else:  # the unchanged script: the full output on every rank
            loss = bm.loss(model(x), y)
            loss.backward()
        return _rank0(loss, ctx)

    return Runner(_optimized(model.parameters(), ctx.lr, step), [model], {"model": model})


BUILDERS: dict[str, Callable[[BenchModel, Context], Runner]] = {
    "serial": serial, "ddp": ddp, "fsdp2": fsdp2, "tp": tp, "pipe": pipe}


def build(system: str, bm: BenchModel, ctx: Context) -> Runner:
    """``system`` is a peer name or ``autopar:<grid>``."""
    if system.startswith("autopar:"):
        return autopar_grid(bm, ctx, parse_grid(system.split(":", 1)[1], ctx.world))
    return BUILDERS[system](bm, ctx)


def param_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the parameters this rank holds (its shards; a tied weight once)."""
    from torch.distributed.tensor import DTensor

    from autopar.runtime.params.layout import held_numel

    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            if not held_numel(p):  # another pipeline stage's parameter (autopar), or empty
                continue
            t = p.to_local() if isinstance(p, DTensor) else p
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


__all__ = ["PEERS", "Grid", "Context", "Runner", "NotApplicable", "parse_grid", "default_grids", "build",
           "param_bytes"]
