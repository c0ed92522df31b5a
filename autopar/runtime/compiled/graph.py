"""The per-rank program compiled: ``torch.compile`` (Inductor) over a bound graph, collectives as nodes.

``auto_parallelize(compile=True)`` hands each bound per-rank graph (a whole executable, or each pipeline
stage of one) to ``torch.compile`` with Inductor, whole (``fullgraph``: one graph or none):

- The marker ops' autograd Functions (``autopar.runtime.ops``) are traced, forward and backward, so
  AOTAutograd builds one joint forward+backward graph and partitions it: Inductor fuses the elementwise
  work around the matmuls (norms, rotary, SwiGLU, autocast casts) in both directions. This is
  torch.compile's own joint graph, not one autopar exports: the runtime around it (per-rank batches,
  pipeline schedules, gradient hooks, the optimizer) stays as eager autopar runs it.
- Traced, the collectives (``autopar.runtime.comm.collectives``) are torch's functional collectives
  (``all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` + ``wait_tensor``), which
  the graph holds as nodes and Inductor's compute/communication reordering may move
  (``compat.inductor_overlap_options``, on CUDA where this torch has it).
- Inductor's bucketing passes merge the collectives that do not depend on each other, on every device, in
  buckets of up to ``BUCKET_BYTES`` (``compat.inductor_bucketing_options``): a depth grid's weight
  all-gathers, a block's or more at once, as FSDP2 gathers a block's parameters (eager graphs get
  ``depth_buckets`` instead), and their gradients' reduce-scatters. On this 2-core CPU, FC_Net at depth 2
  compiled: 13 all-gathers and 6 reduce-scatters a step became 2 and 1, with the same losses and bytes
  (its steps, 2 ranks, one run each: 8-12 ms against 44-83 ms; the benchmark's tiny models at depth 4 did
  not change measurably, docs/guide/compile.md).
- Bytes: every graph Inductor compiles (forward, backward) is read for the collectives it holds, and
  counts them in ``comm_stats()`` each time it runs, as eager autopar counts each call. ``comm_calls()``
  counts those too: the collectives as autopar wrote them, before bucketing;
  ``CompiledGraph.launches`` has what the generated code launches.

``compile="reduce-overhead"``: a training graph (not a pipeline stage) on CUDA is also replayed as a CUDA
graph, by Inductor's CUDA graph trees (``compat.inductor_cuda_graph_options``): its outputs live in the
trees' memory pool, and the next replay overwrites them (torch raises when one is read after that).
Gradients are such outputs when autograd keeps them as ``p.grad``; ``SurvivingGrads`` copies out those a
step keeps (accumulation) before the next replay, so ``p.grad`` holds the sum as it would eagerly.

A graph that does not compile (dynamo cannot trace it, Inductor fails) runs eagerly, with one warning line
naming why; the error is raised before the graph runs (``fullgraph``), so every rank falls back at the
same point with nothing issued. Sizes are static (``dynamic=False``): each signature the runtime caches
is its own graph.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from autopar.compat import (FUNCTIONAL_COLLECTIVES, collective_launches, compile_errors, dispatch_mode_active,
                            dispatch_modes_entered, dispatch_modes_set_aside,
                            inductor_backend, inductor_bucketing_options, inductor_cuda_graph_options,
                            inductor_overlap_options, resolve_process_group, size_hint, tracing_modes_active)
from autopar.runtime.comm import collectives as C
from autopar.runtime.compiled.agreement import ONCE, CompileAgreement, Issued, digest, store_key
from autopar.runtime.comm.faults import guarded
from autopar.runtime.params.layout import local_of, replace_local

log = logging.getLogger(__name__)


def _nbytes(value: Any) -> int:
    return int(size_hint(value.numel())) * value.element_size()


def _collectives(graph: fx.GraphModule) -> list[tuple[str, dist.ProcessGroup, int]]:
    """The collectives a compiled graph holds, in order: (kind, group, bytes as ``comm_stats`` counts them:
    the input of an all-reduce or reduce-scatter, the output of an all-gather)."""
    out = []
    for node in graph.graph.nodes:
        kind = FUNCTIONAL_COLLECTIVES.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        value = node.meta["val"] if kind == "all_gather" else node.args[0].meta["val"]
        out.append((kind, resolve_process_group(node.args[-1]), _nbytes(value)))
    return out


def collectives_of(graph: fx.GraphModule) -> tuple[tuple[str, int, int], ...]:
    """The collectives a compiled graph holds, in order: (kind, group size, bytes)."""
    return tuple((kind, group.size(), nbytes) for kind, group, nbytes in _collectives(graph))


def issued_by_group(graph: fx.GraphModule) -> Issued:
    """The collectives a compiled graph holds, in order, by the group they go over (its global ranks):
    (kind, bytes), what every member of the group must issue alike (``compile_agreement``)."""
    out: Issued = {}
    for kind, group, nbytes in _collectives(graph):
        out.setdefault(tuple(dist.get_process_group_ranks(group)), []).append((kind, nbytes))
    return out


def _counted(launches: list[tuple[dict[str, int], dict[str, int]]], issued: list[tuple[Issued, dict[str, int]]],
             graph: fx.GraphModule) -> Callable[[Callable], Callable]:
    """What wraps ``graph`` compiled: it counts the graph's collectives each time it runs (as the graph holds
    them, before Inductor buckets them: the same bytes), and notes in ``launches`` how many of each kind it
    holds and how many the generated code launches (after bucketing), where that code can be read; and in
    ``issued``, what it issues on each group with those launches (what the ranks agree on)."""
    held = collectives_of(graph)
    tally = C.Tally(held)
    by_group = issued_by_group(graph) if held and not C.simulated() else {}

    def around(run: Callable) -> Callable:
        found = collective_launches(run)
        issued.append((by_group, found or {}))
        if found is not None:
            launches.append(({kind: calls for kind, _, calls in tally.sums}, found))
        if not held:  # Inductor's own compiled graph, unwrapped
            return run

        def counted(inputs: list[Any]) -> Any:
            C.record_tally(tally)
            with guarded():  # (the backward's too: a rank that never came is named, not only gloo's timeout)
                return run(inputs)
        counted._boxed_call = True  # (Inductor's calling convention: one list of inputs)
        return counted
    return around


class CompileDisagreement(RuntimeError):
    """Raised inside the compile of a graph that another rank runs eagerly or compiled otherwise
    (``compile_agreement``): torch.compile then fails on every rank alike, and each runs the graph eagerly
    (``once``: this call only; the next compiles again)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.once = why.startswith(ONCE)


_made: dict[str, int] = {}
"""CompiledGraphs made in this process, by name: the n-th of a name is the same graph on every peer."""


class CompiledGraph:
    """A bound graph (or pipeline stage) run through ``torch.compile``; eager after a failed compile.

    ``agreement``: the ranks that run this graph at the same calls, which agree on each compile before any
    of them runs it (``autopar.runtime.compiled.agreement``); None: this rank alone decides."""

    def __init__(self, gm: fx.GraphModule, name: str, device: torch.device, warn: Callable[[str], None],
                 cuda_graphs: bool = False, agreement: CompileAgreement | None = None) -> None:
        self.gm, self.name, self.warn, self.agreement = gm, name, warn, agreement
        options = {**inductor_bucketing_options(C.BUCKET_BYTES),
                   **(inductor_overlap_options() if device.type == "cuda" else {})}
        graphs = inductor_cuda_graph_options() if cuda_graphs and device.type == "cuda" else {}
        self.cuda_graphs = bool(graphs)
        """Whether the compiled graph replays as a CUDA graph (its outputs overwritten by the next replay)."""
        options = {**options, **graphs}
        self.launches: list[tuple[dict[str, int], dict[str, int]]] = []
        """Per graph Inductor compiled here (forward, backward): the collectives of each kind it holds, and those
        its code launches (fewer where Inductor bucketed them: ``compat.inductor_bucketing_options``)."""
        self._issued: list[tuple[Issued, dict[str, int]]] = []
        self._key = store_key((name, _made.setdefault(name, 0)))
        _made[name] += 1
        self._rounds = 0
        """Compiles this rank posted to ``agreement`` (the next one's key)."""
        inductor = inductor_backend(functools.partial(_counted, self.launches, self._issued), options)
        def backend(graph: fx.GraphModule, example_inputs: Any) -> Callable:  # (a function: copies of
            return self._agreed(inductor, graph, example_inputs)  # torch.compile's arguments keep it, as Fabric's)
        # (its forward, not the module: a module's call runs the global module hooks, which a user's tool may
        # add (a FLOP counter's module tracker) and dynamo would trace; they are for the user's modules)
        self.compiled = torch.compile(gm.forward, backend=backend, fullgraph=True, dynamic=False)
        self.failed: str | None = None
        """Why the graph runs eagerly (None: it runs compiled)."""
        self.compiled_runs = 0
        """Calls that ran compiled (the plan report and tests read it)."""
        self._modes: list[Any] = []
        """The user's dispatch modes set aside for this call's entry into torch.compile (``_modes_set_aside``)."""
        self._said_modes = False

    def _agreed(self, inductor: Callable, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        """Inductor's compile of ``gm``, run only where every peer compiled the same collectives."""
        start = len(self._issued)
        try:
            run = inductor(gm, example_inputs)
        except Exception as e:
            self._agree(_why(e), [])
            raise
        why = self._agree(None, self._issued[start:])
        if why is not None:
            raise CompileDisagreement(why)
        return self._under_modes(run)

    def _under_modes(self, run: Callable) -> Callable:
        """``run`` (a compiled forward), inside the user's dispatch modes this call set aside for torch.compile's
        entry, if any (``_modes_set_aside``)."""
        @functools.wraps(run)  # (keeps its calling convention: ``_boxed_call``)
        def call(*args: Any) -> Any:
            if not self._modes:
                return run(*args)
            with dispatch_modes_entered(self._modes):
                return run(*args)
        return call

    def _collectives_held(self) -> bool:
        """Whether the code compiled for this graph (forward or backward) issues collectives over groups."""
        return any(by_group for by_group, _ in self._issued)

    def _agree(self, failed: str | None, issued: list[tuple[Issued, dict[str, int]]], once: bool = False) -> str | None:
        """This compile's verdict from the peers (``CompileAgreement.agree``); None: run it compiled."""
        if self.agreement is None:
            return failed
        key = f"{self._key}/{self._rounds}"
        self._rounds += 1
        return self.agreement.agree(key, failed, digest([i for i, _ in issued], [n for _, n in issued]), once)

    def __call__(self, *args: Any) -> Any:
        mode = dispatch_mode_active() if self.failed is None else None
        under = (mode is not None and self.compiled_runs > 0 and self._collectives_held()
                 and not tracing_modes_active())  # (fake tensors: eager, as before)
        if mode is not None and not under:  # (torch.compile does not run under a user's mode)
            self._without_compiling(mode)
        elif self.failed is None:
            rounds = self._rounds
            try:
                with self._modes_set_aside(mode) if under else contextlib.nullcontext():
                    out = self.compiled(*args)
                self.compiled_runs += 1
                return out
            except compile_errors() as e:
                disagreement = _cause(e, CompileDisagreement)
                if disagreement is None and self._rounds == rounds:  # (dynamo's: the peers still wait to hear)
                    self._agree(_why(e), [])
                if disagreement is not None and disagreement.once:
                    self.warn(f"compile=True: {self.name} ran a call eagerly on every rank before it first ran "
                              f"compiled: {str(disagreement)[len(ONCE):][:300]}. It compiles again at the next call "
                              "(each such call costs the other ranks a compile); enter such a mode on every rank, "
                              "or after the graph's first call, to avoid it.")
                    return self.gm(*args)
                self._eager_for_good(str(disagreement) if disagreement is not None else _why(e))
                log.debug("autopar: why %s does not compile", self.name, exc_info=True)
        return self.gm(*args)

    @contextlib.contextmanager
    def _modes_set_aside(self, mode: Any) -> Iterator[None]:
        """A call under a user's TorchDispatchMode (a FLOP counter) of a graph that already ran compiled and
        issues collectives runs compiled, as the other ranks run it whether or not a mode is on there. Run
        eagerly, its collectives would differ from theirs where Inductor bucketed or reordered them (a depth
        grid's gathers), and the ranks would wait on each other for good. torch.compile does not enter under
        a mode, so the modes are set aside for its entry and entered again around the compiled code
        (``_under_modes``): they see the ops that code dispatches (matmuls, attention, collectives; not what
        Inductor fused). One warning line says so."""
        if not self._said_modes:
            self._said_modes = True
            self.warn(f"compile=True: {self.name} ran compiled under a TorchDispatchMode ({type(mode).__name__}) "
                      "after its first compiled call, as every rank runs it: the mode sees the ops the compiled "
                      "code dispatches (matmuls, attention, collectives), not the elementwise work Inductor "
                      "fused. Enter the mode on every rank before the graph's first call to see every op, or "
                      "pass compile=False.")
        with dispatch_modes_set_aside() as modes:
            self._modes = modes
            try:
                yield
            finally:
                self._modes = []

    def _without_compiling(self, mode: Any) -> None:
        """This call runs eagerly under a user's TorchDispatchMode (a FLOP counter). Before the graph first ran
        compiled, the peers compile at this call and wait to hear from this rank: it tells them to run this
        call eagerly too, so that no rank waits out ``COMPILE_AGREEMENT_TIMEOUT`` nor runs compiled beside this
        one; they compile again at the next call (every rank under such a mode for the first steps: every rank
        compiles after them). Where another rank's compile failed at this call, that verdict stands here too."""
        if self.compiled_runs or self.agreement is None:
            return
        why = self._agree(f"ran this call under a TorchDispatchMode ({type(mode).__name__}), where torch.compile "
                          "does not run", [], once=True)
        if why is not None and not why.startswith(ONCE):  # (another rank's compile failed at this call)
            self._eager_for_good(why)

    def _eager_for_good(self, why: str) -> None:
        """Every rank runs this graph eagerly from now on (``why``: the verdict); one warning line says why."""
        self.failed = why
        self.warn(f"compile=True: {self.name} does not compile ({why[:300]}); it runs eagerly (same results, "
                  "launched op by op). Report the model, or pass compile=False to silence this.")


def _why(e: BaseException) -> str:
    """An error's type and first line (what the backend raised, where torch.compile wrapped it)."""
    e = getattr(e, "inner_exception", None) or e
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {reason}"


def _cause(e: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The first of ``e``'s chain of causes (or what torch.compile wrapped) of type ``kind``."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None


class SurvivingGrads:
    """Gradients that would outlive a CUDA graph replay, copied out before it (``compile="reduce-overhead"``).

    Autograd keeps a compiled backward's output as ``p.grad`` when there was none; under CUDA graph trees
    that is the trees' memory, which the next step's replay overwrites. A step that keeps ``p.grad``
    (accumulation: no ``zero_grad`` between backwards) would then add to an overwritten tensor. So before each
    replayed training call, every ``p.grad`` still there is copied into memory of its own, once: a gradient
    copied before (the same tensor) is not copied again. The usual loop (``zero_grad`` before the next
    forward) copies nothing."""

    def __init__(self, params: Callable[[], Any]) -> None:
        self.params = params
        self.owned: dict[int, weakref.ref] = {}
        """id(parameter) -> its gradient's local tensor this copied (not to be copied again)."""

    def copy_out(self) -> int:
        """Copies each surviving gradient not copied before; returns how many it copied."""
        copied = 0
        for p in self.params():
            if p.grad is None:
                continue
            local = local_of(p.grad)
            held = self.owned.get(id(p))
            if held is not None and held() is local:
                continue
            own = local.clone()
            if local is p.grad:
                p.grad = own
            else:
                replace_local(p.grad, own)
            self.owned[id(p)] = weakref.ref(own)
            copied += 1
        return copied
