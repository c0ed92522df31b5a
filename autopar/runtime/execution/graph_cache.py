"""Compiled graphs of one parallel model, by input signature.

A signature is the inputs' structure, shapes, dtypes, whether they need gradients, training or not (and
the global batch); a dim captured as a symbolic size (``autopar.capture.symbolic_dims``) is None in it,
and several graphs may then share one signature: each says which sizes it takes (``accepts``), and a
call runs the most recently used one that takes its sizes. The cache is bounded, least recently used
first out.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from autopar.compat import pytree
from passes.ir import InputKind

if TYPE_CHECKING:
    from autopar.runtime.compiled.cuda_graphs import CallGraphs
    from autopar.runtime.execution.kept_state import KeptOutputs, OutputTree
    from autopar.runtime.pipeline.stages import Program
    from passes.runner import PassRecord

MAX_EXECUTABLES = 64
"""Input signatures whose compiled graphs a model keeps."""
GRAPHS_PER_KEY = 8
"""Graphs kept for one signature with symbolic sizes (export fixed a size another call does not have)."""


@dataclass
class Executable:
    """One compiled graph for one input signature."""

    gm: fx.GraphModule
    inputs: tuple[tuple[InputKind, str], ...]
    out_spec: pytree.TreeSpec
    constants: dict[str, Any]
    records: tuple[PassRecord, ...]
    output_specs: list[Any]
    """Per output leaf: its GatherOutputSpec (how the rank's value is laid out), or None if whole."""
    program: Program | None = None
    """pipeline > 1: this rank's stages."""
    split: dict[int, int] = dataclasses.field(default_factory=dict)
    """Input leaves split by batch rows: leaf index -> its batch dim."""
    accepts: Callable[[list[Any]], bool] | None = None
    """Captured with symbolic sizes: whether it takes input leaves of these sizes (None: static)."""
    rows: Any = None
    """The ``ops.BatchRows`` its batch ops read: each batch shard's rows, set before each run."""
    run: Callable[..., Any] | None = None
    """How ``gm`` runs: compiled (``autopar.runtime.compiled.graph``), or (None) ``gm`` itself."""
    graphs: CallGraphs | None = None
    """Its evaluation calls replayed as CUDA graphs where they repeat (``autopar.runtime.compiled.cuda_graphs``); None:
    never (the CPU, ``compile=False``, a pipeline)."""
    kept: KeptOutputs | None = None
    """Its outputs kept split (a cache), made DTensors after it runs; None: it keeps none."""
    tree: OutputTree | None = None
    """Its outputs in the model's structure, the cache moved into the caller's (None: ``out_spec`` as is)."""
    reads_params: bool = False
    """``run`` takes the parameters themselves and reads each one's local piece where it is first used
    (``binding.reading_params_at_use``: an eager graph); False: it takes the local pieces."""

    def __post_init__(self) -> None:
        if self.run is None:
            self.run = self.gm


def signature(x: Any, dynamic: dict[int, Any] | None = None) -> Any:
    """One input leaf's part of a signature; the dims in ``dynamic`` are None."""
    if isinstance(x, torch.Tensor):
        shape = tuple(None if dynamic and d in dynamic else s for d, s in enumerate(x.shape))
        if isinstance(x, DTensor):  # a cache returned split: the graph reads its local piece
            return ("dtensor", shape, x.dtype, x.requires_grad, tuple(x.placements))
        return ("tensor", shape, x.dtype, x.requires_grad)
    try:
        hash(x)
    except TypeError:
        return ("object", repr(x))
    return ("value", type(x), x)


class Executables(OrderedDict):
    """Signature -> its compiled graphs, least recently used signature first."""

    def find(self, key: Any, local: Callable[[], list[Any]]) -> Executable | None:
        """The graph for ``key`` that takes these inputs, most recently used first (``local()``: the input
        leaves as this rank's graph sees them, its rows of the batch); None if there is none."""
        graphs = self.get(key)
        if not graphs:
            return None
        self.move_to_end(key)
        leaves = None
        for exe in reversed(graphs):
            if exe.accepts is None:
                return exe
            leaves = local() if leaves is None else leaves
            if exe.accepts(leaves):
                return exe
        return None

    def keep(self, key: Any, exe: Executable) -> bool:
        """Adds ``exe`` under ``key`` (at most ``GRAPHS_PER_KEY`` per key); whether a signature had to go."""
        graphs = self.setdefault(key, [])
        graphs.append(exe)
        del graphs[:-GRAPHS_PER_KEY]
        self.move_to_end(key)
        if len(self) <= MAX_EXECUTABLES:
            return False
        self.popitem(last=False)
        return True
