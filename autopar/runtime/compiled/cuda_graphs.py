"""Evaluation calls replayed as CUDA graphs: a decode step launched as one graph, not op by op.

A decode step with HF's static cache (``generate(..., cache_implementation="static")``) has the same sizes
at every token, and at a rank's share of the model its kernels are too small to hide their launches. So on
CUDA, an evaluation call (no gradients, no pipeline) whose inputs repeat exactly (user inputs' shapes,
strides and dtypes; the storage of everything read in place; the values of non-tensor inputs) is:

1. run as usual, twice (the second time through the runner it will be captured with: unless
   ``compile=False``, the graph compiled by Inductor for these sizes, else the eager per-rank graph), so that
   compiling, autotuning and lazy initialization happen outside the capture;
2. captured as a CUDA graph at the third call (``torch.cuda.CUDAGraph``; the capture runs nothing), then
   replayed for it and every later call.

What a replay needs, checked at each call (a call that does not match runs without a graph, launched op by op,
and its inputs start the count again):

- **Tensors read in place keep their storage.** Parameters, buffers, constants, and every input the graph
  writes (a static cache's ``index_copy_`` and its length counter, found in the graph: ``written_inputs``)
  must be the memory the graph was captured on (their data pointers are part of the key). A static cache
  lives for one ``generate()``: the next one allocates another, and its third step captures again.
- **Other inputs** (token ids, positions, the mask) are copied into the graph's own buffers.
- **Outputs** live in the graph's memory, which the next replay overwrites: each is copied out (one step's
  logits, batch x 1 x vocabulary), except those that are (views of) inputs written in place, returned as
  the caller's tensors (or views of them; a cache kept split becomes a DTensor after the graph,
  ``kept.KeptOutputs``).
- **Every tensor input is on the CUDA device**; a capture that fails (a host sync or a host copy inside
  the graph) leaves that executable without graphs, with one warning line naming why.
- **Collectives** issued while capturing are counted in ``comm_stats()`` at each replay
  (``collectives.held``). With NCCL the collectives are captured into the graph: torch's NCCL process
  group supports capture (NCCL >= 2.9.6); every rank must replay the same graphs in the same order,
  which holds because every rank makes the same calls (``agreement``) and the rule above depends only on
  what every rank sees alike. Under the fake process group (``python -m benchmarks --simulate``) they
  are no-ops, as in eager runs.

Keeping the captured inputs' storage in the key, rather than the tensors themselves, keeps no cache alive:
when a pointer matches, that memory holds the caller's tensor of the same shape, which the graph reads
and writes exactly as it did at capture.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from autopar.compat import dispatch_mode_active, op_schema, storage_key
from autopar.runtime.comm import collectives as C

log = logging.getLogger(__name__)

WARM_CALLS = 2
"""Calls with the same inputs that run before they are captured (the second through the captured runner)."""
GRAPHS_KEPT = 4
"""CUDA graphs one executable keeps (least recently used dropped): a decode step of each live cache."""
Capture = Callable[[Callable[..., Any], list[Any]], tuple[Callable[[], None], Any]]
"""(runner, inputs) -> (replay, outputs): records ``runner(*inputs)`` without running it."""


def written_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of the placeholders an op of ``gm`` writes in place, directly or through a view of one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    root: dict[fx.Node, int] = {n: i for i, n in enumerate(placeholders)}
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        schema = op_schema(node.target)
        if schema is None:
            continue
        for arg, value in zip(schema.arguments, (*node.args, *node.kwargs.values())):
            info = arg.alias_info
            if info is not None and info.is_write and isinstance(value, fx.Node) and value in root:
                written.add(root[value])
        returned = schema.returns[0].alias_info if schema.returns else None
        first = node.args[0] if node.args else None
        if returned is not None and isinstance(first, fx.Node) and first in root:
            root[node] = root[first]  # a view (or the written tensor itself) of a placeholder
    return frozenset(written)


def cuda_capture(runner: Callable[..., Any], inputs: list[Any]) -> tuple[Callable[[], None], Any]:
    """``runner(*inputs)`` recorded as a CUDA graph (nothing runs). Under the caller's autocast, casts are not
    cached across the capture (a cached cast would live in the graph's memory, freed after it). Nothing here
    runs on the CPU: ``tests/distributed/test_graphed.py`` stands in for it with the same semantics."""
    graph = torch.cuda.CUDAGraph()
    device = "cuda"
    autocast = (torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)
                if torch.is_autocast_enabled(device) else contextlib.nullcontext())
    with autocast, torch.cuda.graph(graph, capture_error_mode="thread_local"):  # (NCCL's watchdog thread
        # queries its events while this thread captures: only this thread's unsafe calls are errors)
        outputs = runner(*inputs)
    return graph.replay, outputs


def capture_for(device: torch.device) -> Capture | None:
    """How calls on ``device`` are captured; None where there are no graphs to replay (the CPU)."""
    return cuda_capture if device.type == "cuda" else None


@dataclass
class Source:
    """An output that is an input read in place (the cache a step writes), or a view of one."""

    index: int
    """The input's position."""
    view: tuple | None
    """None: the input itself; else (size, stride, storage offset from the input's)."""

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """The output on this call's input ``x`` (the same memory as at capture)."""
        return x if self.view is None else x.as_strided(self.view[0], self.view[1], x.storage_offset() + self.view[2])


@dataclass
class Graphed:
    """One captured call: what to copy in, what to hand back."""

    replay: Callable[[], None]
    owned: dict[int, torch.Tensor]
    """Input position -> the graph's own buffer for it (copied into at each replay)."""
    outputs: list[Any]
    """The captured outputs (tensors in the graph's memory, or values)."""
    sources: list[Source | None]
    """Per output: where it is in an input read in place; None for an output in the graph's memory."""
    read_in_place: frozenset[int]
    """The storages (base pointers) of the inputs read in place: a copied-in input must not share one."""
    collectives: C.Tally
    """The collectives issued while capturing, counted at each replay."""
    replays: int = 0


@dataclass
class _Seen:
    calls: int = 0
    graphed: Graphed | None = None
    refused: bool = False
    """These inputs cannot be captured (a host tensor among them): they run as they are."""


@dataclass
class CallGraphs:
    """The CUDA graphs of one executable's evaluation calls (``Executable.graphs``)."""

    kinds: Sequence[bool]
    """Per placeholder: whether it is a user input the graph does not write (copied in, not read in place)."""
    capture: Capture
    warn: Callable[[str], None]
    name: str
    warm: Callable[..., Any]
    """What is captured (the graph compiled for these sizes, ``CompileConfig.enabled``; else as it runs)."""
    device_type: str = "cuda"
    """Where every tensor input must be (a host tensor would be read once, at capture)."""
    seen: OrderedDict[Any, _Seen] = field(default_factory=OrderedDict)
    failed: str | None = None
    """Why this executable runs without graphs (None: it may capture)."""

    names: Sequence[str] = ()
    """Per placeholder: what it is, for messages."""
    unused: frozenset[int] = frozenset()
    """Placeholders the graph never reads: not part of the key, not checked."""

    def __post_init__(self) -> None:
        self.copied = [i for i, c in enumerate(self.kinds) if c and i not in self.unused]
        self.in_place = [i for i, c in enumerate(self.kinds) if not c and i not in self.unused]

    def key(self, flat: list[Any]) -> Any:
        """What must repeat for a replay (the inputs copied in: their sizes; those read in place: their memory;
        other values: themselves); None when these inputs cannot be graphed (an unhashable value)."""
        key = (tuple((x.shape, x.stride(), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else x
                     for x in map(flat.__getitem__, self.copied)),
               tuple((x.data_ptr(), x.shape, x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x
                     for x in map(flat.__getitem__, self.in_place)))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def run(self, runner: Callable[..., Any], flat: list[Any]) -> Any:
        """This call's outputs: ``runner`` (the executable as it runs) for the first call of these inputs,
        ``warm`` (what is captured) for the second, a replay from the third."""
        key = None if self.failed or dispatch_mode_active() else self.key(flat)  # (a replay skips a dispatch mode)
        if key is None:
            return runner(*flat)
        seen = self.seen.pop(key, None) or _Seen()
        self.seen[key] = seen  # most recently used last
        while len(self.seen) > GRAPHS_KEPT:
            self.seen.popitem(last=False)
        seen.calls += 1
        if seen.calls < WARM_CALLS:
            return runner(*flat)
        if seen.calls == WARM_CALLS:
            return self.warm(*flat)
        if seen.graphed is None:
            seen.graphed = None if seen.refused else self._capture(flat)
            if seen.graphed is None:
                seen.refused = True
                return runner(*flat)
        out = self._replay(seen.graphed, flat)
        return runner(*flat) if out is None else out

    def _capture(self, flat: list[Any]) -> Graphed | None:
        elsewhere = [f"{self.names[i] if i < len(self.names) else i} ({x.device}"
                     f"{', requires grad' if x.requires_grad else ''})" for i, x in enumerate(flat)
                     if i not in self.unused and isinstance(x, torch.Tensor)
                     and (x.device.type != self.device_type or x.requires_grad)]
        if elsewhere:  # (a host tensor would be read once, at capture; autograd cannot track a replay)
            self.warn(f"CUDA graphs: {self.name} is not captured for these inputs: {', '.join(elsewhere[:4])} "
                      f"not on {self.device_type} or needing gradients; these calls run op by op (same results).")
            return None
        owned = {i: x.clone() for i in self.copied if isinstance(x := flat[i], torch.Tensor)}
        inputs = [owned.get(i, x) for i, x in enumerate(flat)]
        try:
            with C.held() as collectives:
                replay, outputs = self.capture(self.warm, inputs)
        except Exception as e:  # noqa: BLE001 (any capture failure: the executable runs as it did)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.failed = f"{type(e).__name__}: {reason}"
            self.warn(f"CUDA graphs: {self.name} could not be captured ({self.failed[:300]}); its evaluation "
                      "calls run op by op (same results). Report the model, or pass compile=False to silence this.")
            log.debug("autopar: why %s could not be captured", self.name, exc_info=True)
            return None
        storages = {storage_key(x): (i, x) for i, x in enumerate(flat)
                    if isinstance(x, torch.Tensor) and i not in owned}
        flat_out = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        sources: list[Source | None] = []
        for y in flat_out:
            found = storages.get(storage_key(y)) if isinstance(y, torch.Tensor) else None
            if found is None or found[1].dtype != y.dtype:
                sources.append(None)  # (a reinterpreting view of an input: handed back as a copy)
                continue
            i, x = found
            same = y.shape == x.shape and y.stride() == x.stride() and y.storage_offset() == x.storage_offset()
            sources.append(Source(i, None if same else (tuple(y.shape), y.stride(), y.storage_offset() - x.storage_offset())))
        return Graphed(replay, owned, flat_out, sources, frozenset(storages), C.Tally(collectives))

    def _replay(self, graphed: Graphed, flat: list[Any]) -> list[Any] | None:
        """The outputs of a replay on ``flat``; None when an input to copy in shares the storage of one read
        in place (the graph would read the copy, not what it writes)."""
        if any(storage_key(flat[i]) in graphed.read_in_place for i in graphed.owned):
            return None
        for i, buffer in graphed.owned.items():
            buffer.copy_(flat[i])
        graphed.replay()
        graphed.replays += 1
        C.record_tally(graphed.collectives)
        out = []
        for y, source in zip(graphed.outputs, graphed.sources):
            if source is not None:  # the caller's own tensor (or a view of it), read in place by the graph
                out.append(source.of(flat[source.index]))
            elif isinstance(y, torch.Tensor):
                out.append(y.clone())
            else:
                out.append(y)
        return out

    def replays(self) -> int:
        """Calls replayed so far, over the graphs kept."""
        return sum(s.graphed.replays for s in self.seen.values() if s.graphed is not None)
