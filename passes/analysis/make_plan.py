"""make_plan: decides how every matmul and parameter is sharded for one ParallelConfig.

Orientation choice. A matmul whose input is already sharded takes the orientation that reads that
layout as it is (so chained matmuls never re-lay out). Only a matmul whose input is replicated (the
first after a LayerNorm, the embedding) has a free choice; those "roots" are decided greedily in
graph order by the predicted bytes of the whole step, which makes a residual branch end in the
layout of the residual stream (FC_Net: fc1 transposed, fc2 normal, no conversion at the add).
"""

from __future__ import annotations

import torch.fx as fx

from autopar.config import (Layout, MatmulPlan, Orientation, ParallelConfig, ParamKind, ParamPlan, Plan)
from passes.analysis.estimate_costs import list_collectives, total_bytes
from passes.analysis.graph_facts import MatmulMatch, find_matmuls, param_name, param_uses, tensor_meta
from passes.analysis.layouts import LayoutResult, propagate_layouts

_SHARDED = (Orientation.NORMAL, Orientation.TRANSPOSED)


def feasible_orientations(m: MatmulMatch, uses: int, config: ParallelConfig) -> tuple[tuple[Orientation, ...], str]:
    """The orientations whose cuts divide this matmul's sizes, and why the others do not."""
    if uses > 1:
        return (), f"weight read by {uses} ops (shared weights are not sharded yet)"
    ok, why = [], []
    for o in _SHARDED:
        out_split, in_split = config.size(o.out_axis), config.size(o.in_axis)
        if m.out_features % out_split:
            why.append(f"{o.value}: out_features {m.out_features} not divisible by {o.out_axis}={out_split}")
        elif m.in_features % in_split:
            why.append(f"{o.value}: in_features {m.in_features} not divisible by {o.in_axis}={in_split}")
        elif (m.out_features // out_split * m.in_features // in_split) % config.depth:
            why.append(f"{o.value}: weight block of {m.out_features // out_split}x{m.in_features // in_split} "
                       f"not divisible by depth={config.depth}")
        else:
            ok.append(o)
    return tuple(ok), "; ".join(why)


def _propagate(gm: fx.GraphModule, matmuls: dict[fx.Node, MatmulMatch],
               feasible: dict[str, tuple[Orientation, ...]], roots: dict[str, Orientation],
               local_batch: int | None) -> tuple[LayoutResult, dict[str, Orientation]]:
    chosen: dict[str, Orientation] = {}

    def orientation_of(m: MatmulMatch, in_layout: Layout) -> Orientation:
        options = feasible[m.weight]
        if not options:
            o = Orientation.REPLICATED
        elif len(options) == 1:
            o = options[0]
        elif in_layout is Layout.REPLICATED:
            o = roots.get(m.weight, Orientation.NORMAL)
        else:
            o = next(x for x in options if x.in_layout is in_layout)
        chosen[m.weight] = o
        return o

    return propagate_layouts(gm, matmuls, orientation_of, local_batch), chosen


def local_batch_of(gm: fx.GraphModule) -> int | None:
    batch = gm.meta.get("autopar_batch")
    return batch.local_sizes[batch.index] if batch is not None and len(batch.local_sizes) > 1 else None


def param_plans(gm: fx.GraphModule, matmul_plans: dict[str, MatmulPlan]) -> tuple[ParamPlan, ...]:
    sharded_weight = {m.weight: m for m in matmul_plans.values() if m.orientation in _SHARDED}
    sharded_bias = {m.bias: m for m in sharded_weight.values() if m.bias is not None}
    out = []
    for node in gm.graph.nodes:
        name = param_name(node)
        if name is None:
            continue
        shape = tuple(int(s) for s in tensor_meta(node).shape)
        if name in sharded_weight:
            m = sharded_weight[name]
            out.append(ParamPlan(name, shape, ParamKind.WEIGHT_3D, m.orientation, m.weight_in_out, ("data",)))
        elif name in sharded_bias:
            out.append(ParamPlan(name, shape, ParamKind.BIAS, sharded_bias[name].orientation))
        else:
            out.append(ParamPlan(name, shape, ParamKind.REPLICATED))
    return tuple(out)


def make_plan(gm: fx.GraphModule, config: ParallelConfig) -> Plan:
    """Chooses orientations (see module docstring) and derives every parameter's storage."""
    matches = find_matmuls(gm)
    by_node = {m.node: m for m in matches}
    uses = param_uses(gm)
    feasible: dict[str, tuple[Orientation, ...]] = {}
    reasons: dict[str, str] = {}
    for m in matches:
        feasible[m.weight], reasons[m.weight] = feasible_orientations(m, uses.get(m.weight, 1), config)
    local_batch = local_batch_of(gm)

    def cost(roots: dict[str, Orientation]) -> tuple[object, dict[str, Orientation]]:
        res, chosen = _propagate(gm, by_node, feasible, roots, local_batch)
        plans = _matmul_plans(matches, chosen, reasons)
        coll = list_collectives(gm, res, matches, {p.name: p for p in param_plans(gm, plans)}, config)
        return (total_bytes(coll), len(res.conversions)), chosen

    roots: dict[str, Orientation] = {}
    res, _ = _propagate(gm, by_node, feasible, roots, local_batch)
    for node in res.orientations:
        m = by_node[node]
        if len(feasible[m.weight]) == 2 and res.layouts[m.x] is Layout.REPLICATED:
            # Fewest bytes, then fewest re-layouts (they still cost a copy at degree 1), then NORMAL.
            roots[m.weight] = min(_SHARDED, key=lambda o: (*cost({**roots, m.weight: o})[0],
                                                            o is not Orientation.NORMAL))
    _, chosen = _propagate(gm, by_node, feasible, roots, local_batch)
    plans = _matmul_plans(matches, chosen, reasons)
    notes = tuple(f"{m.weight} stays replicated: {m.reason}" for m in plans.values() if m.reason)
    return Plan(config, tuple(plans.values()), param_plans(gm, plans), notes)


def _matmul_plans(matches: list[MatmulMatch], chosen: dict[str, Orientation],
                  reasons: dict[str, str]) -> dict[str, MatmulPlan]:
    out = {}
    for m in matches:
        o = chosen.get(m.weight, Orientation.REPLICATED)
        out[m.weight] = MatmulPlan(m.weight, m.module, m.op, m.in_features, m.out_features, m.weight_in_out,
                                   m.bias, o, reasons[m.weight] if o is Orientation.REPLICATED else "")
    return out
