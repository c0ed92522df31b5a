"""estimate_step: the per-layer table and totals that ``python -m autopar.trace`` prints.

Everything is for one training step (forward + backward + gradient sync) on one rank, from a graph
captured for that rank's batch shard and the Plan; communicated bytes use the same accounting as
``autopar.comm_stats()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence

from torch import fx

from autopar.config import Orientation, Plan
from passes.analysis.choose_stages import Hardware
from passes.analysis.estimate_costs import (
    Collective,
    bytes_by_kind,
    list_collectives,
    matmul_flops,
    matmul_split,
    total_bytes,
)
from passes.analysis.graph_facts import param_name, rows_of, tensor_meta
from passes.analysis.make_plan import layouts_for


@dataclass(frozen=True, slots=True)
class LayerRow:
    module: str
    weight: str
    bias: str | None
    op: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    """Logical (unsharded) shapes on this rank's batch shard."""
    num_parameters: int
    flops: int
    """Forward + backward over the global batch."""
    sharding: str
    comm_bytes: Fraction
    """This rank's bytes for the matmul and the gradient sync of its weight and bias."""

    @property
    def is_sharded(self) -> bool:
        return not self.sharding.startswith("replicated")


@dataclass(frozen=True, slots=True)
class StepReport:
    layers: tuple[LayerRow, ...]
    other_comm: tuple[tuple[str, Fraction], ...]
    """Communication not attributed to a matmul: (what, bytes)."""
    num_parameters: int
    flops_per_step: int
    matmul_flops_sharded: int
    param_bytes_per_rank: int
    comm_bytes_per_step: Fraction
    comm_bytes_by_kind: dict[str, Fraction] = field(default_factory=dict)
    collectives: tuple[Collective, ...] = ()


def estimate_step(gm: fx.GraphModule, plan: Plan) -> StepReport:
    config = plan.config
    res, by_node = layouts_for(gm, plan)
    matches = list(by_node.values())
    params = {p.name: p for p in plan.params}
    colls = list_collectives(gm, res, matches, params, config)
    batch = gm.meta.get("autopar_batch")
    scale = Fraction(batch.global_size, batch.local_sizes[batch.index]) if batch is not None else Fraction(1)

    shapes: dict[str, tuple[int, ...]] = {}
    grad_of: dict[str, bool] = {}
    num_parameters = 0
    for node in gm.graph.nodes:
        name = param_name(node)
        if name is not None:
            shapes[name] = tuple(int(s) for s in tensor_meta(node).shape)
            grad_of[name] = res.requires_grad[node]
            if node.users:  # an unused placeholder is export's alias of a tied weight, counted once
                num_parameters += _numel(shapes[name])

    by_where: dict[str, Fraction] = {}
    for c in colls:
        by_where[c.where] = by_where.get(c.where, Fraction(0)) + c.bytes
    rows, attributed = [], set()
    for m in matches:
        mp = plan.matmul(m.weight)
        global_rows = int(rows_of(tensor_meta(m.x)) * scale)
        flops = matmul_flops(m, res.requires_grad[m.x], grad_of[m.weight], global_rows)
        where = m.module or m.weight
        comm = by_where.get(where, Fraction(0)) if where not in attributed else Fraction(0)
        for p in (m.weight, m.bias):
            if p is not None:
                comm += by_where.get(p, Fraction(0))
                attributed.add(p)
        attributed.add(where)
        nparams = _numel(shapes[m.weight]) + (_numel(shapes[m.bias]) if m.bias else 0)
        sharding = (f"replicated: {mp.reason}" if mp.orientation is Orientation.REPLICATED
                    else mp.orientation.value)
        rows.append(LayerRow(m.module, m.weight, m.bias, m.op, tuple(tensor_meta(m.x).shape),
                             tuple(tensor_meta(m.node).shape), nparams, flops, sharding, comm))
    return summarize(rows, colls, num_parameters, plan)


def summarize(rows: Sequence[LayerRow], colls: Sequence[Collective], num_parameters: int,
              plan: Plan) -> StepReport:
    """Totals over the per-matmul rows and every collective; the rest of the bytes by where they occur."""
    attributed = {n for r in rows for n in (r.module or r.weight, r.weight, r.bias) if n}
    other: dict[str, Fraction] = {}
    for c in colls:
        if c.where in attributed:
            continue
        label = {"<output>": "output gather", "<input>": "input gradient gather"}.get(c.where)
        if label is None:
            label = "gradient sync of replicated parameters" if c.phase == "step" else f"layout conversion at {c.where}"
        other[label] = other.get(label, Fraction(0)) + c.bytes
    param_bytes = sum(p.local_numel(plan.config) * 4 for p in plan.params)  # fp32 parameters
    return StepReport(tuple(rows), tuple(other.items()), num_parameters, sum(r.flops for r in rows),
                      sum(r.flops for r in rows if r.is_sharded), param_bytes, total_bytes(colls),
                      bytes_by_kind(colls), tuple(colls))


def estimate_step_seconds(report: StepReport, plan: Plan, hardware: Hardware) -> float:
    """One rank's training step (pipeline = 1) under ``hardware``: its share of the matmul FLOPs at the
    sustained rate, plus every collective it joins (its bytes at the tensor-parallel bandwidth, plus the
    fixed cost per call).

    What is left out (elementwise ops and norms, attention's score and value matmuls, the optimizer,
    overlap of compute with communication) is what a measured step has on top: ``python -m benchmarks``
    reports the ratio.
    """
    config = plan.config
    compute = sum(r.flops / (config.num_batch_shards * matmul_split(config, plan.matmul(r.weight).orientation))
                  for r in report.layers)
    comm = sum(float(c.bytes) / hardware.tensor_bytes_per_second + hardware.collective_seconds
               for c in report.collectives if c.group_size > 1)
    return compute / hardware.flops_per_second + comm


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
