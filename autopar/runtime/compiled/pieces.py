"""A training graph compiled in pieces, so that gradients reach their data-parallel buckets during backward.

A graph compiled whole (``autopar.runtime.compiled.graph``) is one autograd node in backward: it returns every
gradient when all of its backward has run. The data-parallel sync (``GradSync``) then gets every gradient at
once at the end: no bucket's all-reduce overlaps backward, and under ``shard_optimizer`` every whole gradient
lives at once beside the chunks (48 layers of 4 MiB at data 4, the heap at backward's peak: 328 MiB, where
eager holds 170 and the pieces 202). Dynamo's
``DDPOptimizer`` meets the same problem for DDP and splits the graph it compiles at bucket boundaries; this
does that for autopar's per-rank graph:

- ``cut_into_pieces`` cuts the bound graph into consecutive pieces holding up to ``BUCKET_BYTES`` of synced
  gradients each (more where that would make more than ``MAX_PIECES`` pieces: each costs a compiled call each
  way), counted from the end (the order backward produces them, the order ``GradSync`` fills its buckets),
  each cut just before the node that first reads a parameter. The last piece's backward runs first and
  returns its gradients while the others' backward still has to run.
- ``CompiledPieces`` runs the outer graph eagerly: before each piece it reads the local pieces of the
  parameters that piece first uses (one autograd node per piece, ``local_views``), then calls the piece
  compiled (a ``CompiledGraph`` each: its own compile, fallback and agreement). Autograd runs each reading
  node as soon as the piece after it has run backward, so each piece's gradients land there and then.

The cut is decided from the plan (each parameter's local elements, the same on every rank) so that every
rank cuts alike and compiles the same pieces. A graph whose synced gradients fit one piece is not cut.
Inductor sees a piece at a time: it fuses and buckets collectives within a piece only.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping
from typing import Any

from torch import fx

from autopar.runtime.comm.collectives import BUCKET_BYTES
from autopar.runtime.compiled.graph import CompiledGraph
from autopar.runtime.params.layout import local_views
from passes.analysis.estimate_memory import piece_bytes
from passes.ir import InputKind, input_info
from passes.outline import outline

PIECE_BYTES = BUCKET_BYTES
"""The synced gradient bytes a piece holds at most: the gradient sync's bucket cap, so that a piece's backward
fills about a bucket (more where that would make more than ``MAX_PIECES`` pieces: ``piece_cap``, and
``estimate_memory.piece_bytes``, which the plan counts)."""


def piece_cap(synced: Mapping[str, int]) -> int:
    """The synced gradient bytes each piece holds at most (a node reading more: a piece of its own), for about
    ``MAX_PIECES`` pieces at most."""
    return piece_bytes(sum(synced.values()), PIECE_BYTES)


def cut_into_pieces(gm: fx.GraphModule, synced: Mapping[str, int], cap: int) -> fx.GraphModule | None:
    """A copy of ``gm`` whose nodes are in consecutive submodules ``piece_0`` ... (called in order, with
    ``getitem`` of their outputs between them), each the first to read parameters with up to ``cap`` bytes of
    ``synced`` (parameter name -> bytes of its gradient here; a node reading more is a piece of its own),
    filled from the graph's end as the gradient sync fills its buckets; None where that makes one piece."""
    graph = _with_private_attrs(gm.graph)
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    first: dict[int, int] = {}  # node index -> synced bytes of the parameters it is the first to read
    for n in nodes:
        info = input_info(n) if n.op == "placeholder" else None
        if info is None or info.kind is not InputKind.PARAMETER or not n.users or info.target not in synced:
            continue
        at = min(order[u] for u in n.users)
        first[at] = first.get(at, 0) + synced[info.target]
    cuts, held, last = [], 0, None
    for at in sorted(first, reverse=True):  # (as GradSync fills its buckets: one closes before it would pass cap)
        if held and held + first[at] > cap:
            while nodes[last - 1].op == "get_attr":  # (a submodule goes with its call)
                last -= 1
            cuts.append(last)
            held = 0
        held += first[at]
        last = at
    if not cuts:
        return None
    out = fx.GraphModule(gm, graph)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    where = {n: i for i, n in enumerate(body)}
    bounds = [0, *sorted(where[nodes[at]] for at in cuts), len(body)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        outline(out, body[a:b], f"piece_{k}")
    out.graph.lint()
    out.recompile()
    return out


def _with_private_attrs(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` in which each ``get_attr`` node has one user, just before it (a copy per user): a
    piece then holds the submodules it calls rather than receiving them from another piece."""
    graph = copy.deepcopy(graph)  # (nodes copied, their meta shared)
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        for user in list(node.users):
            with graph.inserting_before(user):
                mine = graph.get_attr(node.target)
            mine.meta = node.meta
            user.replace_input_with(node, mine)
        graph.erase_node(node)
    return graph


class CompiledPieces:
    """``gm`` cut into pieces (``cut_into_pieces``), each run as a ``CompiledGraph``, the graph between them
    eager. Takes the parameters themselves (``Executable.reads_params``): it reads each one's local piece just
    before the piece that first uses it.

    ``compiled(piece, k, n)``: the CompiledGraph of piece ``k`` of ``n``."""

    def __init__(self, cut: fx.GraphModule, compiled: Callable[[fx.GraphModule, int, int], CompiledGraph]) -> None:
        calls = [n for n in cut.graph.nodes if n.op == "call_module" and str(n.target).startswith("piece_")]
        self.pieces = [compiled(cut.get_submodule(str(n.target)), k, len(calls)) for k, n in enumerate(calls)]
        """Each piece's compiled graph, in the order they run."""
        graph = cut.graph  # (taken over: the cut module is not run)
        order = {n: i for i, n in enumerate(graph.nodes)}
        first: dict[fx.Node, list[fx.Node]] = {}  # the node first reading parameters -> those parameters
        for n in graph.nodes:
            if n.op == "placeholder" and n.users and (info := input_info(n)) is not None \
                    and info.kind is InputKind.PARAMETER:
                first.setdefault(min(n.users, key=order.__getitem__), []).append(n)
        for node, piece in zip(calls, self.pieces):
            node.op, node.target = "call_function", piece.__call__
        for node, params in first.items():  # (a piece; the output, for a parameter the graph returns as it is)
            with graph.inserting_before(node):
                read = graph.call_function(local_views, (params,))
            for j, p in enumerate(params):
                with graph.inserting_before(node):
                    view = graph.call_function(operator.getitem, (read, j))
                p.replace_all_uses_with(view, delete_user_cb=lambda user: user is not read)
        graph.lint()
        self.gm = fx.GraphModule(cut, graph)
        """The graph between the pieces: parameter reads, piece calls, their outputs."""

    @property
    def cuda_graphs(self) -> bool:
        """Whether the pieces replay as CUDA graphs (their outputs overwritten by the next replay)."""
        return any(p.cuda_graphs for p in self.pieces)

    def __call__(self, *args: Any) -> Any:
        return self.gm(*args)

