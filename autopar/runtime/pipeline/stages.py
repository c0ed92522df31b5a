"""Runs a graph split into pipeline stages (passes/split_stages) on this rank's stages.

Two ways to run the same stages:

- ``run_sequential`` (a plain ``model(x)`` call): the stages run one after another, each on its
  rank. Activations go forward and gradients come back through blocking send/recv inside autograd
  Functions, and the last stage's outputs are broadcast, so every rank returns the full output, as
  serially. Correct, but without overlap.
- ``PipelineRunner.step`` (``train_step``): torch.distributed.pipelining's ``PipelineStage`` and a
  schedule (GPipe, 1F1B, Interleaved1F1B, looped BFS) run the micro-batches. This module only
  adapts each stage (``StageAdapter``) to what PipelineStage expects: a module that takes the
  tensors the previous stage sent and returns the tensors the next stage needs.

A value a later stage reads from an earlier one (a batch input, a mask, a rotary table) travels
across every boundary in between (pass-through). Parameters, buffers, constants and inputs that
are not split by batch never travel: every rank binds its own.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autopar.compat import queue_backward_callback
from autopar.runtime.comm import collectives as C
from autopar.config import PipelineConfig
from autopar.errors import PlanError
from autopar.runtime.comm.mesh import Mesh
from passes.analysis.graph_facts import written_inputs
from passes.ir import InputKind, input_info


@dataclass
class StageSpec:
    """One stage of a split graph, as this module runs it."""

    index: int
    call: fx.Node
    """The ``call_module stage_<k>`` node of the top-level graph."""
    getitems: list[fx.Node]
    received: tuple[fx.Node, ...]
    """Values that arrive from the previous stage (stage 0: the batch inputs), in order."""
    sent: tuple[Any, ...]
    """Values sent to the next stage; for the last stage, the graph's output leaves."""


def stage_specs(gm: fx.GraphModule, travels: Callable[[fx.Node], bool]) -> list[StageSpec]:
    """The stages of a split graph and the values crossing each boundary.

    ``travels(placeholder)`` says whether a graph input is sent between stages (batch-split user
    inputs) or bound on every rank (parameters, buffers, constants, other inputs).
    """
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith("stage_")]
    if len(calls) < 2:
        raise PlanError("the graph has no pipeline stages; this is an autopar bug: please report it.")
    made_in: dict[fx.Node, int] = {}
    getitems: list[list[fx.Node]] = [[] for _ in calls]
    index = {c: k for k, c in enumerate(calls)}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if travels(n):
                made_in[n] = -1
        elif n in index or n.op == "get_attr":  # get_attr: a subgraph or constant, bound on every rank
            continue
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0] in index:
            made_in[n] = index[n.args[0]]
            getitems[index[n.args[0]]].append(n)
        elif n.op != "output":
            raise PlanError(f"node {n.name} ({n.op} {n.target}) lies outside every pipeline stage; this is an "
                            "autopar bug: please report it with the model.")
    outputs = tuple(gm.graph.output_node().args[0])
    last_use: dict[fx.Node, int] = {}
    for k, c in enumerate(calls):
        for a in c.args:
            last_use[a] = k
    for a in outputs:
        if isinstance(a, fx.Node):
            last_use[a] = len(calls) - 1
    specs = []
    for k, c in enumerate(calls):
        received = tuple(v for v, at in made_in.items() if at < k <= last_use.get(v, -1))
        if k == len(calls) - 1:
            sent: tuple[Any, ...] = outputs
        else:
            sent = tuple(v for v, at in made_in.items() if at <= k < last_use.get(v, -1))
        specs.append(StageSpec(k, c, getitems[k], received, sent))
    return specs


class StageAdapter(nn.Module):
    """One stage as a module: ``forward(*received) -> sent`` (what PipelineStage calls).

    ``bound`` holds every value that does not travel (parameters, buffers, constants, inputs not
    split by batch); the runtime refreshes it before each step.
    """

    def __init__(self, spec: StageSpec, stage: fx.GraphModule, bound: dict[fx.Node, Any],
                 precision: torch.dtype | None, device_type: str, is_last: bool,
                 run: Callable[..., Any] | None = None) -> None:
        """``run``: how the stage's graph runs (None: itself)."""
        super().__init__()
        self.spec, self.stage, self.bound = spec, stage, bound
        self.run = run or stage.__call__  # (a function, not a submodule)
        self.precision, self.device_type, self.is_last = precision, device_type, is_last
        self.count_sends = False

    def forward(self, *received: Any) -> tuple[Any, ...]:
        env = dict(self.bound)
        env.update((v, _number(v, t)) for v, t in zip(self.spec.received, received))
        args = [env[a] for a in self.spec.call.args]
        for t in received:
            if isinstance(t, torch.Tensor) and t.requires_grad:  # PipelineStage sends these gradients back,
                t.register_hook(_contiguous)  # and gloo and NCCL send only contiguous tensors
                if self.count_sends and self.spec.index > 0:
                    C.count_send(t)
        if self.precision is None:
            out = self.run(*args)
        else:
            with torch.autocast(self.device_type, dtype=self.precision):
                out = self.run(*args)
        for g in self.spec.getitems:
            env[g] = out[g.args[1]]
        sent = tuple(env[v] if isinstance(v, fx.Node) else v for v in self.spec.sent)
        if self.is_last and self.precision is not None:  # outputs in fp32, as serially
            sent = tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in sent)
        if not self.is_last:
            # a symbolic size a later stage reads (a graph captured for every length) travels as a 0-d tensor
            sent = tuple(torch.tensor(t, device=self.device_type) if _is_size(v, t)
                         else t.contiguous() if isinstance(t, torch.Tensor) else t  # (a view may cross a cut)
                         for v, t in zip(self.spec.sent, sent))
            for v, t in zip(self.spec.sent, sent):
                if not isinstance(t, torch.Tensor):
                    raise PlanError(f"value {v} ({type(t).__name__}) crosses pipeline boundary {self.spec.index}; "
                                    "only tensors can be sent between stages. Move the cut with another "
                                    "pipeline degree, or report the model.")
                if self.count_sends:
                    C.count_send(t)
        return sent


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _is_size(node: Any, value: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.SymInt) and isinstance(value, int)


def _number(node: fx.Node, value: Any) -> Any:
    """A received value as the stage reads it: a symbolic size arrives as a 0-d tensor (``_is_size``)."""
    if isinstance(node.meta.get("val"), torch.SymInt) and isinstance(value, torch.Tensor):
        return int(value)
    return value


# ---- the sequential path: a plain model(x) with stages on different ranks ---------------------------


@dataclass(frozen=True)
class _Meta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _meta(t: Any, grad: bool) -> Any:
    if isinstance(t, torch.Tensor):
        return _Meta(tuple(t.shape), t.dtype, grad and t.requires_grad)
    return ("value", t)


def _sizes_of(values: tuple[Any, ...], device: torch.device) -> torch.Tensor:
    """Every dim of the tensors among ``values``, in order: what a graph of symbolic sizes sends ahead of them
    at each call (their number of dims is the graph's; their sizes are the call's)."""
    dims = [d for v in values if isinstance(v, torch.Tensor) for d in v.shape]
    return torch.tensor(dims, dtype=torch.int64, device=device)


def _resized(metas: list[Any], sizes: torch.Tensor) -> list[Any]:
    """``metas`` with the sizes ``_sizes_of`` gave."""
    flat, out, at = sizes.tolist(), [], 0
    for m in metas:
        if isinstance(m, _Meta):
            n = len(m.shape)
            m = _Meta(tuple(flat[at:at + n]), m.dtype, m.requires_grad)
            at += n
        out.append(m)
    return out


def _size_count(metas: list[Any]) -> int:
    return sum(len(m.shape) for m in metas if isinstance(m, _Meta))


@dataclass
class Link:
    """A boundary between two stages on two ranks: who sends, who receives, what travels."""

    src: int
    dst: int
    group: dist.ProcessGroup
    device: torch.device
    metas: dict[bool, list[Any]] = field(default_factory=dict)
    """Per grad mode: each value's _Meta, sent once (what travels is fixed for one executable)."""
    symbolic: bool = False
    """The executable serves many sizes: each call's sizes travel ahead of the values (one small send)."""

    def send(self, values: tuple[Any, ...], needs_grad: tuple[bool, ...]) -> None:
        key = torch.is_grad_enabled()
        if key not in self.metas:
            self.metas[key] = [_meta(v, g) for v, g in zip(values, needs_grad)]
            dist.send_object_list([self.metas[key]], dst=self.dst, group=self.group, device=self.device)
        elif self.symbolic:
            C.send(_sizes_of(values, self.device), self.dst, self.group)
        for v in values:
            if isinstance(v, torch.Tensor):
                C.send(v, self.dst, self.group)

    def recv(self) -> tuple[list[Any], list[Any]]:
        key = torch.is_grad_enabled()
        if key not in self.metas:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=self.src, group=self.group, device=self.device)
            metas = self.metas[key] = box[0]
        elif self.symbolic:
            sizes = torch.empty(_size_count(self.metas[key]), dtype=torch.int64, device=self.device)
            metas = _resized(self.metas[key], C.recv(sizes, self.src, self.group))
        else:
            metas = self.metas[key]
        return _materialize(metas, self.device, lambda t: C.recv(t, self.src, self.group)), metas


def _materialize(metas: list[Any], device: torch.device, fill: Callable[[torch.Tensor], torch.Tensor]) -> list[Any]:
    """The values ``metas`` describe: tensors filled by ``fill`` (a recv or broadcast), other values as sent."""
    return [fill(torch.empty(m.shape, dtype=m.dtype, device=device)) if isinstance(m, _Meta) else m[1]
            for m in metas]


class _Send(torch.autograd.Function):
    """Forward: sends a stage's outputs. Backward: receives their gradients from the next stage.

    Returns a scalar token; the chain of tokens orders this rank's backward (see run_sequential)."""

    @staticmethod
    def forward(ctx: Any, link: Link, *values: Any) -> torch.Tensor:
        needs = tuple(ctx.needs_input_grad[1:])
        link.send(values, needs)
        ctx.link, ctx.needs = link, needs
        ctx.examples = [(v.shape, v.dtype) if isinstance(v, torch.Tensor) else None for v in values]
        return torch.zeros((), device=link.device)

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> tuple[Any, ...]:
        grads: list[Any] = []
        for need, ex in zip(ctx.needs, ctx.examples):
            if need:
                g = torch.empty(ex[0], dtype=ex[1], device=ctx.link.device)
                grads.append(C.recv(g, ctx.link.dst, ctx.link.group))
            else:
                grads.append(None)
        return (None, *grads)


class _Recv(torch.autograd.Function):
    """Forward: receives a stage's inputs. Backward: sends their gradients to the previous stage.

    ``anchor`` (the token of this rank's previous stage, or a fresh leaf) requires grad, so this
    backward runs, and runs after every later stage of this rank."""

    @staticmethod
    def forward(ctx: Any, link: Link, anchor: torch.Tensor) -> tuple[Any, ...]:
        values, metas = link.recv()
        ctx.link, ctx.metas = link, metas
        ctx.mark_non_differentiable(*[v for v, m in zip(values, metas)
                                      if isinstance(v, torch.Tensor) and not m.requires_grad])
        return tuple(values)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        for g, m in zip(grads, ctx.metas):
            if isinstance(m, _Meta) and m.requires_grad:
                g = g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=ctx.link.device)
                C.send(g.to(m.dtype), ctx.link.src, ctx.link.group)
        return None, torch.zeros((), device=ctx.link.device)


class _Publish(torch.autograd.Function):
    """The last stage's rank: broadcasts the outputs to the pipeline group; backward passes the
    gradients of its own loss through (every rank computes the same loss)."""

    @staticmethod
    def forward(ctx: Any, run: _FinalLink, *values: Any) -> tuple[Any, ...]:
        run.publish(values, tuple(ctx.needs_input_grad[1:]))
        ctx.run = run
        ctx.mark_non_differentiable(*[v for v, g in zip(values, ctx.needs_input_grad[1:])
                                      if isinstance(v, torch.Tensor) and not g])
        return tuple(v.view_as(v) if isinstance(v, torch.Tensor) else v for v in values)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.run.at_end_of_backward()
        return (None, *grads)


class _Receive(torch.autograd.Function):
    """Other ranks: receive the broadcast outputs. Backward ignores this rank's copy of the loss
    gradient and starts this rank's chain of stage backwards (through ``token``)."""

    @staticmethod
    def forward(ctx: Any, run: _FinalLink, token: torch.Tensor) -> tuple[Any, ...]:
        values, metas = run.receive()
        ctx.run = run
        ctx.mark_non_differentiable(*[v for v, m in zip(values, metas)
                                      if isinstance(v, torch.Tensor) and not m.requires_grad])
        return tuple(values)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.run.at_end_of_backward()
        return None, torch.zeros((), device=ctx.run.device)


@dataclass
class _FinalLink:
    src: int
    group: dist.ProcessGroup
    size: int
    device: torch.device
    at_end: Callable[[], None]
    metas: dict[bool, list[Any]] = field(default_factory=dict)

    symbolic: bool = False

    def publish(self, values: tuple[Any, ...], needs: tuple[bool, ...]) -> None:
        key = torch.is_grad_enabled()
        if key not in self.metas:
            self.metas[key] = [_meta(v, g) for v, g in zip(values, needs)]
            dist.broadcast_object_list([self.metas[key]], src=self.src, group=self.group, device=self.device)
        elif self.symbolic:
            C.broadcast(_sizes_of(values, self.device), self.src, self.group, self.size)
        for v in values:
            if isinstance(v, torch.Tensor):
                C.broadcast(v.contiguous(), self.src, self.group, self.size)

    def receive(self) -> tuple[list[Any], list[Any]]:
        key = torch.is_grad_enabled()
        if key not in self.metas:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.src, group=self.group, device=self.device)
            metas = self.metas[key] = box[0]
        elif self.symbolic:
            sizes = torch.empty(_size_count(self.metas[key]), dtype=torch.int64, device=self.device)
            metas = _resized(self.metas[key], C.broadcast(sizes, self.src, self.group, self.size))
        else:
            metas = self.metas[key]
        values = _materialize(metas, self.device, lambda t: C.broadcast(t, self.src, self.group, self.size))
        return values, metas

    def at_end_of_backward(self) -> None:
        queue_backward_callback(self.at_end)


def owner(stage: int, num_ranks: int) -> int:
    """The pipeline coordinate that runs ``stage`` (round robin: interleaved schedules)."""
    return stage % num_ranks


def written_buffers(gm: fx.GraphModule, specs: list[StageSpec], num_ranks: int) -> dict[str, int]:
    """Buffers the stages write in place (``graph_facts.written_inputs``) -> the pipeline rank holding the
    stage that writes it, in graph order."""
    out: dict[str, int] = {}
    for s in specs:
        stage = gm.get_submodule(str(s.call.target))
        inputs = [n for n in stage.graph.nodes if n.op == "placeholder"]
        at = {p: a for p, a in zip(inputs, s.call.args)}
        for node in stage.graph.nodes:
            for p in written_inputs(node):
                arg = at.get(p)
                info = input_info(arg) if isinstance(arg, fx.Node) and arg.op == "placeholder" else None
                if info is not None and info.kind is InputKind.BUFFER:
                    out.setdefault(info.target, owner(s.index, num_ranks))
    return out


class Program:
    """This rank's stages of one compiled executable, for both paths."""

    def __init__(self, gm: fx.GraphModule, travels: Callable[[fx.Node], bool], mesh: Mesh,
                 precision: torch.dtype | None, at_end_of_backward: Callable[[], None], symbolic: bool = False,
                 wrap: Callable[[fx.GraphModule, str], Callable[..., Any]] | None = None) -> None:
        """``symbolic``: ``gm`` was captured with symbolic sizes; each call's sizes travel with its values.
        ``wrap(stage, name)``: how each stage's graph runs (compiled: ``autopar.runtime.compiled.graph``)."""
        self.specs = stage_specs(gm, travels)
        self.mesh = mesh
        self.num_ranks = mesh.size("pipeline")
        self.me = mesh.index("pipeline")
        self.bound: dict[fx.Node, Any] = {}
        self.attrs = {n: _fetch(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
        num = len(self.specs)
        self.adapters = {s.index: StageAdapter(s, gm.get_submodule(str(s.call.target)), self.bound, precision,
                                               mesh.device.type, s.index == num - 1,
                                               wrap(gm.get_submodule(str(s.call.target)), f"stage {s.index}")
                                               if wrap is not None else None)
                         for s in self.specs if owner(s.index, self.num_ranks) == self.me}
        group = mesh.group("pipeline")
        self.links = [Link(mesh.peer(owner(k, self.num_ranks)), mesh.peer(owner(k + 1, self.num_ranks)), group,
                           mesh.device, symbolic=symbolic) for k in range(num - 1)]
        self.final = _FinalLink(mesh.peer(owner(num - 1, self.num_ranks)), group, self.num_ranks, mesh.device,
                                at_end_of_backward, symbolic=symbolic)
        self.written = written_buffers(gm, self.specs, self.num_ranks)
        """Buffers a stage writes in place (BatchNorm's running statistics) -> the pipeline rank holding it."""
        self.schedule: Any = None
        """train_step's torch schedule over this rank's stages, built at its first step."""
        self.micro_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
        """The current step's loss of one micro-batch (its denominator depends on the batch)."""

    @property
    def num_stages(self) -> int:
        return len(self.specs)

    def bind(self, values: dict[fx.Node, Any]) -> None:
        """Binds this step's values of everything that does not travel."""
        self.bound.clear()
        self.bound.update(self.attrs)
        self.bound.update({n: v for n, v in values.items() if n not in self.specs[0].received})

    def sync_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """After a call: each buffer a stage wrote, from the rank holding that stage to every pipeline rank, so
        that every rank's model (its state dict, a checkpoint, an evaluation) holds what serial's does
        (collective over the pipeline)."""
        group = self.mesh.group("pipeline")
        for name, holder in self.written.items():
            C.broadcast(buffers[name], self.mesh.peer(holder), group, self.num_ranks)

    def readers(self) -> dict[str, tuple[int, ...]]:
        """Every parameter the stages read -> the pipeline coordinates holding it (on every rank)."""
        out: dict[str, set[int]] = {}
        for s in self.specs:
            for a in s.call.args:
                info = input_info(a) if a.op == "placeholder" else None
                if info is not None and info.kind is InputKind.PARAMETER:
                    out.setdefault(info.target, set()).add(owner(s.index, self.num_ranks))
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def run_sequential(self, values: dict[fx.Node, Any],
                       record: dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] | None = None) -> tuple[Any, ...]:
        """A plain call: every stage in order, outputs on every rank (collective over the pipeline).

        ``record`` receives each of this rank's stages' (inputs, outputs)."""
        self.bind(values)
        grad = torch.is_grad_enabled()
        token: torch.Tensor | None = None
        outputs: tuple[Any, ...] = ()
        num = self.num_stages
        for k, adapter in sorted(self.adapters.items()):
            if k == 0:
                received = tuple(values[n] for n in self.specs[0].received)
            else:
                anchor = token if token is not None else torch.zeros((), device=self.mesh.device,
                                                                      requires_grad=grad)
                received = _Recv.apply(self.links[k - 1], anchor)
            sent = adapter(*received)
            if record is not None:
                record[k] = (tuple(received), tuple(sent))
            if k < num - 1:
                token = _Send.apply(self.links[k], *sent)
            else:
                outputs = sent
        if num - 1 in self.adapters:
            return _Publish.apply(self.final, *outputs)
        if token is None:
            token = torch.zeros((), device=self.mesh.device, requires_grad=grad)
        return _Receive.apply(self.final, token)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def schedule_class(name: str) -> type:
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleLoopedBFS)
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
            "looped-bfs": ScheduleLoopedBFS}[name]


def build_schedule(program: Program, pipe: PipelineConfig, num_microbatches: int, loss_fn: Callable,
                   examples: dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]]) -> Any:
    """torch's schedule over this rank's stages. ``examples[k]`` = (inputs, outputs) of stage k for one
    micro-batch (shapes, dtypes and requires_grad; values unused), so PipelineStage needs no
    shape inference."""
    from torch.distributed.pipelining import PipelineStage

    stages = []
    for k, adapter in sorted(program.adapters.items()):
        adapter.count_sends = True
        inputs, outputs = examples[k]
        stages.append(PipelineStage(adapter, k, program.num_stages, program.mesh.device,
                                    input_args=_metas(inputs), output_args=_metas(outputs),
                                    group=program.mesh.group("pipeline")))
    cls = schedule_class(pipe.schedule)
    if pipe.schedule in ("gpipe", "1f1b"):
        return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)


def _metas(values: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(v.shape, dtype=v.dtype, device="meta").requires_grad_(v.requires_grad)
                 for v in values if isinstance(v, torch.Tensor))
