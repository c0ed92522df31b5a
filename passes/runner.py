"""run_passes: the one way passes are applied (lint, recompile, timing, error naming the pass)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx

from autopar.decisions import Plan
from autopar.errors import PlanError
from passes.ir import spec_names

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PassResult:
    gm: fx.GraphModule
    changed: bool
    notes: tuple[str, ...] = ()
    """One line per user-visible decision."""


Pass = Callable[[fx.GraphModule, Plan], PassResult]


@dataclass(frozen=True, slots=True)
class PassRecord:
    name: str
    changed: bool
    seconds: float
    notes: tuple[str, ...]
    code: str | None = None


def run_passes(gm: fx.GraphModule, plan: Plan, passes: Sequence[Pass], *,
               dump_code: bool = False) -> tuple[fx.GraphModule, tuple[PassRecord, ...]]:
    """Applies ``passes`` in order; after a pass that changed the graph, lints and recompiles it (with the spec
    types named to fx's code generator: ``passes.ir.spec_names``)."""
    with spec_names():
        return _run(gm, plan, passes, dump_code)


def _run(gm: fx.GraphModule, plan: Plan, passes: Sequence[Pass], dump_code: bool
         ) -> tuple[fx.GraphModule, tuple[PassRecord, ...]]:
    records: list[PassRecord] = []
    for p in passes:
        name = getattr(p, "__name__", repr(p))
        start = time.perf_counter()
        try:
            result = p(gm, plan)
            gm = result.gm
            if result.changed:
                gm.graph.lint()
                gm.recompile()
        except PlanError:
            raise
        except Exception as e:
            before = ", ".join(r.name for r in records) or "none"
            raise PlanError(f"pass {name} failed ({type(e).__name__}: {e}); passes before it: {before}. "
                            "This is an autopar bug: please report it with the model.") from e
        records.append(PassRecord(name, result.changed, time.perf_counter() - start, result.notes,
                                  gm.code if dump_code else None))
        log.debug("pass %s: changed=%s in %.3fs", name, result.changed, records[-1].seconds)
    return gm, tuple(records)
