"""What the batch analysis finds: where each tensor holds the batch (``BatchDim``), whether it is this
rank's rows or the whole batch (``State``), the reductions over the batch, and the gathers a graph needs
(``BatchFacts``). The data of ``batch_dims`` (the walk) and ``batch_rules`` (the per-op rules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import fx

from passes.analysis.graph_facts import module_of


@dataclass(frozen=True, slots=True)
class BatchDim:
    """Where a SPLIT tensor holds the batch: dim ``dim``, whose size is ``outer`` x (this rank's rows) x
    ``factor``, in that order (``(B, T, C) -> (B*T, C)`` gives dim 0, factor T; a sequence-first
    ``(T, B, C) -> (T*B, C)`` gives dim 0, outer T)."""

    dim: int
    factor: Any = 1
    """An int, or a SymInt where a symbolic length is part of each row (a graph captured for every length)."""
    outer: int = 1
    """Blocks of every row that come before the rows in ``dim`` (an int: a view that interleaves the rows with
    a symbolic length is not followed)."""

    def at(self, dim: int) -> BatchDim:
        """The same rows in another dim (a transpose, a broadcast)."""
        return BatchDim(dim, self.factor, self.outer)

    def flat(self) -> BatchDim:
        """For an op to which the order of the entries does not matter (a sum over them): every entry of the
        dim counted as the rows' (``factor`` x ``outer`` per row)."""
        return self if self.outer == 1 else BatchDim(self.dim, self.factor * self.outer)

    def static_factor(self) -> int:
        """The entries per row as a number, or 0 where they are symbolic: the runtime's batch ops count them
        at each call (``int()`` would fix the length the graph was captured for)."""
        f = self.factor
        if isinstance(f, torch.SymInt):
            known = f.node.maybe_as_int()
            return 0 if known is None else int(known)
        return int(f)


@dataclass(frozen=True, slots=True)
class Reduction:
    """A reduction over the batch dim that a partial sum completes."""

    kind: str
    """"sum", "mean" (over ``dims``), or the loss op's reduction: "loss_sum", "loss_mean"."""
    batch: BatchDim
    """Where the reduced input holds the batch."""
    dims: tuple[int, ...] = ()
    """sum/mean: the reduced dims (the batch dim among them)."""
    keepdim: bool = False


class State(StrEnum):
    SPLIT = "split"
    WHOLE = "whole"
    NONE = "none"
    LOCAL = "local"
    """This rank's rows, computed as the model computes a smaller batch (as DDP computes it), laid out in a way
    the analysis does not follow (after a sort of the rows, an index by data): no marker touches it."""


@dataclass
class BatchFacts:
    dims: dict[fx.Node, Any] = field(default_factory=dict)
    """Per node: its BatchDim when SPLIT, else None (a tuple of them for ops returning several tensors)."""
    states: dict[fx.Node, State] = field(default_factory=dict)
    requires_grad: dict[fx.Node, bool] = field(default_factory=dict)
    reductions: dict[fx.Node, Reduction] = field(default_factory=dict)
    gathers: dict[fx.Node, dict[fx.Node, BatchDim]] = field(default_factory=dict)
    """Consumer -> {SPLIT producer: its batch dim}: the producer's rows are gathered for the consumer."""
    scatters: dict[fx.Node, BatchDim] = field(default_factory=dict)
    """Gathered consumers whose output keeps their input's shape: each rank takes its rows back."""
    local_rows: dict[fx.Node, BatchDim | None] = field(default_factory=dict)
    """Per LOCAL value that holds rows (or may: where that is unknown): its one dim that holds them, as a
    BatchDim that takes them outermost (what the analysis can say of a layout it did not follow), or None
    where several dims hold them or which is unknown. A LOCAL value that holds no rows (a statistic of this
    rank's rows) is not here."""
    across_rows: list[fx.Node] = field(default_factory=list)
    """Attention ops whose attended dims hold the split rows: those are no batch (``split_batch`` refuses)."""
    local_starts: dict[fx.Node, str] = field(default_factory=dict)
    """Ops where a LOCAL region starts: the op that works along the batch dim but cannot be gathered, and why."""
    row_index: dict[fx.Node, int] = field(default_factory=dict)
    """``arange(rows)`` (and views of it): tensors enumerating this rank's rows along the given dim.
    Indexing a SPLIT tensor's rows with one (HF's masks: ``mask[arange(B)[:, None], ...]``) stays on
    this rank's rows."""

    def batch_dim(self, node: Any) -> BatchDim | None:
        d = self.dims.get(node) if isinstance(node, fx.Node) else None
        return d if isinstance(d, BatchDim) else None

    def state(self, node: Any) -> State:
        return self.states.get(node, State.NONE) if isinstance(node, fx.Node) else State.NONE

    def notes(self) -> tuple[str, ...]:
        """One line per op that sees the whole batch (its inputs' rows are gathered), and one per kind of op
        from which the model runs on each rank's own rows (a LOCAL region), naming its modules."""
        out = []
        for name, where in _by_op(self.gathers).items():
            out.append(f"op {name} in {where} works along the batch dim: its input rows are gathered over data x "
                       "depth and it runs on the whole batch on every rank (correct, but that op is not "
                       "data-parallel)")
        for (name, why), where in _by_op(self.local_starts, lambda n: self.local_starts[n]).items():
            out.append(f"op {name} in {where} works along the batch dim and cannot be split over data x depth "
                       f"({why}): from there until its result meets this rank's rows again, each rank runs the "
                       "model on its own rows, as DDP does (serial's numbers where each row's result depends on "
                       "that row alone, as in routing tokens to experts; DDP's where it does not)")
        return tuple(out)


def _by_op(nodes: Any, why: Any = None) -> dict[Any, str]:
    """The ops in ``nodes`` by name (and ``why(node)``): the modules they are in, a few named."""
    groups: dict[Any, list[str]] = {}
    for node in nodes:
        name = getattr(node.target, "__name__", str(node.target)).removesuffix(".default")
        modules = groups.setdefault((name, why(node)) if why else name, [])
        if (module_of(node) or "<root>") not in modules:
            modules.append(module_of(node) or "<root>")
    return {key: ", ".join(f"'{m}'" for m in modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3
                                                             else "")
            for key, modules in groups.items()}


def describe(node: fx.Node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    return f"op {name} in module '{module_of(node) or '<root>'}'"
