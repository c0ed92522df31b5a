"""What ``compile=`` (``autopar.config.CompileConfig``) makes of one model's bound graphs on this rank
(``CompilePolicy``): the one place the runtime reads the option. A graph of static sizes runs compiled
(``autopar.runtime.compiled.graph``), in pieces where its synced gradients fill several buckets
(``autopar.runtime.compiled.pieces``), replayed as a CUDA graph (``autopar.runtime.compiled.cuda_graphs``), or as
it is; the ranks that run a compiled graph agree on it (``autopar.runtime.compiled.agreement``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from autopar import config as settings
from autopar.compat import default_store
from autopar.config import CompileConfig
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.compiled import cuda_graphs as graphed
from autopar.runtime.compiled import pieces as compiled_pieces
from autopar.runtime.compiled.agreement import CompileAgreement
from autopar.runtime.compiled.form import is_compiled
from autopar.runtime.compiled.graph import CompiledGraph
from autopar.runtime.compiled.pieces import CompiledPieces, cut_into_pieces
from passes.ir import InputKind


class CompilePolicy:
    """``compile`` for the graphs of the model named ``model_name`` on this rank (``mesh``); ``warn_once``: one
    warning line per distinct message, on rank 0."""

    def __init__(self, compile: CompileConfig, mesh: Mesh, warn_once: Callable[[str], None], model_name: str) -> None:
        self.compile, self.mesh, self.warn_once, self.model_name = compile, mesh, warn_once, model_name

    @property
    def training(self) -> bool:
        """Whether training graphs run compiled here: the plan counts a recomputed block's collectives as kept
        (``PlanOptions.compiled``), and an eager graph buckets its depth gathers instead."""
        return self.compile.enabled(self.mesh.device.type, training=True)

    def agreement(self, per_rank: bool) -> CompileAgreement | None:
        """Where an executable's compiled graphs are agreed on by the ranks that run them (None: not compiled,
        or a simulated world: no other rank to agree with)."""
        if self.compile.mode is False or self.mesh.simulated:
            return None
        return CompileAgreement(default_store(), self.mesh.rank, self.mesh.graph_peers(per_rank),
                                settings.COMPILE_AGREEMENT_TIMEOUT)

    def graph(self, gm: fx.GraphModule, name: str, replayed: bool = True, agreement: CompileAgreement | None = None,
              synced: Mapping[str, int] | None = None) -> Callable[..., Any]:
        """How a bound graph of static sizes runs: compiled or as it is; a training graph also replayed as a CUDA
        graph where ``compile="reduce-overhead"`` asks (``replayed``). A training graph whose ``synced``
        gradients (name -> bytes) fill more than one bucket is compiled in pieces, so that they reach their
        buckets during backward."""
        device, training = self.mesh.device.type, torch.is_grad_enabled()
        if not self.compile.enabled(device, training):
            return gm
        name = f"{name} of {self.model_name}"
        cuda_graphs = replayed and self.compile.cuda_graphs(device, training)
        cut = cut_into_pieces(gm, synced, compiled_pieces.piece_cap(synced)) if training and synced else None
        if cut is not None:
            return CompiledPieces(cut, lambda piece, k, n: CompiledGraph(
                piece, f"piece {k + 1} of {n} of {name}", self.mesh.device, self.warn_once, cuda_graphs=cuda_graphs,
                agreement=agreement))
        return CompiledGraph(gm, name, self.mesh.device, self.warn_once, cuda_graphs=cuda_graphs, agreement=agreement)

    def stage(self, gm: fx.GraphModule, name: str, agreement: CompileAgreement | None = None) -> Callable[..., Any]:
        """A pipeline stage's graph: compiled as ``graph`` does, never replayed as a CUDA graph (a schedule runs
        several micro-batches' forwards before their backwards, and accumulates their gradients)."""
        if self.compile.cuda_graphs(self.mesh.device.type, torch.is_grad_enabled()):
            self.warn_once("compile='reduce-overhead': pipeline stages are compiled but not replayed as CUDA graphs "
                           "(their micro-batches' gradients accumulate across replays); pass compile=True to "
                           "silence this.")
        return self.graph(gm, name, replayed=False, agreement=agreement)

    def call_graphs(self, gm: fx.GraphModule, inputs: tuple[tuple[InputKind, str], ...], run: Callable[..., Any],
                    agreement: CompileAgreement | None) -> graphed.CallGraphs | None:
        """How this graph's repeated evaluation calls replay as CUDA graphs: what is captured is the graph
        compiled for their sizes where ``compile`` says so, else the eager graph (None: no CUDA graphs here)."""
        capture = graphed.capture_for(self.mesh.device)
        if capture is None or self.compile.mode is False:
            return None
        written = graphed.written_inputs(gm)
        copied = [kind is InputKind.USER and i not in written for i, (kind, _) in enumerate(inputs)]
        name = f"the per-rank graph of {self.model_name}"
        warm = run if is_compiled(run) or not self.compile.enabled(self.mesh.device.type, False, True) \
            else CompiledGraph(gm, name, self.mesh.device, self.warn_once, agreement=agreement)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        unused = frozenset(i for i, n in enumerate(placeholders) if not n.users)
        names = [f"{kind.name.lower()} {target}" for kind, target in inputs]
        return graphed.CallGraphs(copied, capture, self.warn_once, name, warm, self.mesh.device.type,
                                  names=names, unused=unused)
