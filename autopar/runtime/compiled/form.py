"""What an executable's run is under ``compile=``, answered in one place: the hub asks here instead of testing
the run's type (a plain bound graph, one ``CompiledGraph``, or ``CompiledPieces`` of a training graph)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autopar.runtime.compiled.graph import CompiledGraph
from autopar.runtime.compiled.pieces import CompiledPieces


def replays_cuda_graphs(run: Any) -> bool:
    """Whether ``run`` replays its training step as CUDA graphs (``compile="reduce-overhead"``): the gradients a
    replay leaves must be copied out before the next one overwrites them (``SurvivingGrads``)."""
    return isinstance(run, (CompiledGraph, CompiledPieces)) and run.cuda_graphs


def reads_parameters_in_one_node(run: Any) -> bool:
    """Whether ``run`` is one graph running compiled, which reads every parameter through one autograd node (so
    the hub hands it the local pieces in one call of ``local_views``)."""
    return isinstance(run, CompiledGraph) and run.failed is None


def compiled_of(runs: Iterable[Any]) -> list[CompiledGraph]:
    """The compiled graphs among ``runs`` (executables' runs, pipeline stages' and CUDA-graph warm-ups), pieces
    counted one by one."""
    out: list[CompiledGraph] = []
    for run in runs:
        out += [p for p in (run.pieces if isinstance(run, CompiledPieces) else [run]) if isinstance(p, CompiledGraph)]
    return out


def in_pieces(run: Any) -> bool:
    """Whether ``run`` is a training graph compiled in pieces (each piece reads its parameters where it uses them)."""
    return isinstance(run, CompiledPieces)


def is_compiled(run: Any) -> bool:
    """Whether ``run`` is one graph under torch.compile (a CUDA-graph capture warms up on it as it is)."""
    return isinstance(run, CompiledGraph)
