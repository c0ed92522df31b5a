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
    """Where a SPLIT tensor holds the batch: dim ``dim``, whose size is (this rank's rows) x ``factor``,
    rows outermost (``(B, T, C) -> (B*T, C)`` gives dim 0, factor T)."""

    dim: int
    factor: Any = 1
    """An int, or a SymInt where a symbolic length is part of each row (a graph captured for every length)."""

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
        """One line per op that sees the whole batch (its inputs' rows are gathered)."""
        out = []
        for consumer in self.gathers:
            out.append(f"{describe(consumer)} works along the batch dim: its input rows are gathered over data "
                       "x depth and it runs on the whole batch on every rank")
        return tuple(out)


def describe(node: fx.Node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    return f"op {name} in module '{module_of(node) or '<root>'}'"
