"""make_plan: decides how every matmul, embedding table and parameter is sharded for one ParallelConfig.

Orientation choice. A matmul whose input is already sharded takes the orientation that reads that
layout as it is (so chained matmuls never re-lay out). Only a matmul whose input is replicated (the
first after a norm, the embedding) has a free choice; those "roots" are decided greedily in graph
order by the predicted bytes of the whole step. Roots of repeated blocks (``layers.3.mlp.up``) are
decided once for the block and applied to every copy, which keeps planning fast at real depth.

Roles. An output head (a matmul whose result reaches a model output through no other matmul) is
split over its output features only (vocabulary-parallel: OUT_ROW/OUT_COL), so logits come out
split over the vocabulary with no forward communication. A weight tied to an embedding table is the
head's weight: the table is split over the vocabulary on the same axis. Other embedding tables are
split over their features (hidden-parallel: no forward communication, but the activations leave the
table split over the hidden dim) or over the vocabulary (one all-reduce, the activations leave it
whole), or, when smaller than the model's largest table (positions, token types), kept whole (no
communication; Megatron keeps its position table so): each table takes the split, axis included, whose
plan sends the fewest bytes. At row = 2 this
picks Megatron's alternation for a Llama (whole activations between blocks, one all-reduce per
attention and per MLP) where the hidden split led every q/k/v and gate/up to all-reduce its output.
A fused projection whose output is split apart (q/k/v, gate/up) keeps each piece sharded on its own
(``out_parts``).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from autopar.compat import DTENSOR_HANDLES_FUSED_PIECES
from autopar.config import ParallelConfig
from autopar.decisions import (EmbeddingMode, EmbeddingPlan, ExpertPlan, Layout, MatmulPlan, Orientation, ParamKind,
                                ParamPlan, Plan, lent_axis, uneven_split)
from autopar.errors import PlanError
from passes.analysis.batch_dims import analyze_batch
from passes.analysis.estimate_costs import list_collectives, total_bytes
from passes.analysis.graph_facts import (
    MatmulMatch,
    find_matmuls,
    module_of,
    param_name,
    param_uses,
    tensor_meta,
)
from passes.analysis.layout_rules import LayoutResult, output_node
from passes.analysis.layouts import node_flags, propagate_layouts
from passes.analysis.experts import find_expert_layers, tensor_split
from passes.analysis.whole_matmuls import find_whole_matmuls
from passes.ir import Sharding, graph_info

aten = torch.ops.aten

_3D = (Orientation.NORMAL, Orientation.TRANSPOSED)
_OUT = (Orientation.OUT_ROW, Orientation.OUT_COL)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
_SAME_LAST = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def fused_parts(m: MatmulMatch) -> tuple[int, ...]:
    """Segments of a matmul's output features that its consumers split apart (fused q/k/v), or ()."""
    n = m.out_features
    bounds, frontier = {0, n}, [m.node]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            val = user.meta.get("val")
            if user.target in _SAME_LAST and isinstance(val, torch.Tensor) and val.shape[-1] == n:
                frontier.append(user)
            elif user.target in _SPLITS and isinstance(val, (list, tuple)):
                dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
                if dim % tensor_meta(node).dim() == tensor_meta(node).dim() - 1:
                    start = 0
                    for v in val:
                        start += int(v.shape[-1])
                        bounds.add(start)
            elif user.target is aten.slice.Tensor and len(user.args) > 1:
                t = tensor_meta(node)
                if user.args[1] % t.dim() == t.dim() - 1:
                    for b in user.args[2:4]:
                        if isinstance(b, int):
                            bounds.add(max(0, min(b + n if b < 0 else b, n)))
    edges = sorted(bounds)
    parts = tuple(b - a for a, b in itertools.pairwise(edges))
    return parts if len(parts) > 1 else ()


def _divides(m: MatmulMatch, o: Orientation, parts: tuple[int, ...], config: ParallelConfig) -> str:
    """'' if orientation ``o`` divides this matmul's sizes, else why not."""
    out_split, in_split = config.size(o.out_axis), config.size(o.in_axis)
    if o in _OUT and out_split == 1:
        return f"{o.value}: {o.out_axis}=1"
    for p in parts or (m.out_features,):
        if p % out_split and not (o in _OUT and not parts and uneven_split(p, out_split)):
            what = f"output piece {p}" if parts else f"out_features {p}"
            return f"{o.value}: {what} not divisible by {o.out_axis}={out_split}"
    if m.in_features % in_split:
        return f"{o.value}: in_features {m.in_features} not divisible by {o.in_axis}={in_split}"
    # Parameters are DTensors (autopar.runtime.params.store): every rank's piece must be a DTensor layout.
    if out_split > 1 and len(parts) > 1 and not DTENSOR_HANDLES_FUSED_PIECES:
        return (f"{o.value}: fused output pieces ({'+'.join(map(str, parts))}) split over {o.out_axis}={out_split} "
                "need torch >= 2.13's DTensor (this torch computes wrong values on that layout)")
    if out_split > 1 and len(set(parts)) > 1:
        return (f"{o.value}: fused output pieces of unequal sizes ({'+'.join(map(str, parts))}) split over "
                f"{o.out_axis}={out_split} are not a DTensor layout")
    if o in _3D and config.depth > 1:
        rows = m.in_features // in_split if m.weight_in_out else m.out_features // out_split
        if rows % config.depth:
            return (f"{o.value}: weight block of {m.out_features // out_split}x{m.in_features // in_split} "
                    f"has {rows} rows, not divisible by depth={config.depth}")
        if len(parts) > 1 and out_split > 1 and not m.weight_in_out:
            return (f"{o.value}: fused output pieces ({'+'.join(map(str, parts))}) split over {o.out_axis} and "
                    f"again over depth={config.depth} are not a DTensor layout")
    return ""


def _heads(gm: fx.GraphModule, matmul_nodes: set[fx.Node]) -> set[fx.Node]:
    """Matmuls whose output reaches a model output without passing through another matmul."""
    reaches: set[fx.Node] = set()
    out = output_node(gm)
    for node in reversed(list(gm.graph.nodes)):
        if node is out:
            continue
        if any(u is out or (u in reaches and u not in matmul_nodes) for u in node.users):
            reaches.add(node)
    return {n for n in matmul_nodes if n in reaches}


def _block_key(weight: str) -> str:
    return re.sub(r"\.\d+\.", ".#.", weight)


def matmul_decider(plan: Plan) -> Callable[[MatmulMatch, Sharding], tuple[Orientation, tuple[int, ...]]]:
    def decide(m: MatmulMatch, _: Sharding) -> tuple[Orientation, tuple[int, ...]]:
        mp = plan.matmul(m.weight)
        return mp.orientation, mp.parts
    return decide


def embedding_decider(plan: Plan) -> Callable[[str], tuple[EmbeddingMode, str]]:
    def decide(weight: str) -> tuple[EmbeddingMode, str]:
        e = plan.embedding(weight)
        return (EmbeddingMode.REPLICATED, "") if e is None else (e.mode, e.axis)
    return decide


def local_batch_of(gm: fx.GraphModule) -> int | None:
    batch = graph_info(gm).batch
    split = batch is not None and (len(batch.local_sizes) > 1 or len(batch.segments) > 1)
    return batch.local_sizes[batch.index] if split else None


def layouts_for(gm: fx.GraphModule, plan: Plan) -> tuple[LayoutResult, dict[fx.Node, MatmulMatch]]:
    """The layouts ``plan`` gives this graph (shared by the transform and the step report)."""
    matches = find_matmuls(gm)
    for m in matches:
        if plan.matmul(m.weight) is None:
            raise PlanError(f"the graph has a matmul on '{m.weight}' that the plan does not know. The model "
                            "changed after it was planned; build a new model inside auto_parallelize.")
    by_node = {m.node: m for m in matches}
    sizes = {"row": plan.config.row, "col": plan.config.col}
    res = propagate_layouts(gm, by_node, matmul_decider(plan), sizes, local_batch_of(gm), embedding_decider(plan),
                            plan.config.sequence_parallel)
    tensor = {e.module: e.tensor_axis for e in plan.experts if e.tensor_axis}
    lent = {e.module: e.lent for e in plan.experts if e.lent}
    for layer in find_expert_layers(gm) if tensor or lent else ():
        if layer.module in lent:  # (whole experts over data x a tensor axis: each of its ranks a block of the rows)
            dim = layer.row_dims - 1
            for node in layer.region:
                t = tensor_meta(node)
                if node is not layer.output and t is not None and t.dim() > dim and \
                        all(u in layer.region for u in node.users):
                    res.shardings[node] = Sharding(Layout(lent[layer.module]), dim, (int(t.shape[dim]),))
            continue
        if layer.module not in tensor:
            continue
        for node in layer.region:  # (each expert split over a tensor axis: its hidden features are, between the
            t = tensor_meta(node)  # grouped matmuls, as passes.split_experts computes them)
            if node is not layer.output and t is not None and t.dim() == layer.row_dims + 1 and \
                    all(u in layer.region for u in node.users):
                res.shardings[node] = Sharding(Layout(tensor[layer.module]), t.dim() - 1, (int(t.shape[-1]),))
    return res, by_node


class _Planner:
    def __init__(self, gm: fx.GraphModule, config: ParallelConfig, shared: dict[Any, Any] | None = None) -> None:
        self.gm, self.config = gm, config
        self.sizes = {"row": config.row, "col": config.col}
        self.matches = find_matmuls(gm)
        self.by_node = {m.node: m for m in self.matches}
        self.local_batch = local_batch_of(gm)
        self.batch = analyze_batch(gm) if self.local_batch is not None else None  # (one graph, every propagation)
        self.flags = node_flags(gm, self.local_batch, self.batch)  # (likewise)
        uses = param_uses(gm)
        lookups: dict[str, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            if node.target is aten.embedding.default and (name := param_name(node.args[0])) is not None:
                lookups.setdefault(name, []).append(node)
        self.lookups = lookups
        heads = _heads(gm, set(self.by_node))
        self.feasible: dict[str, tuple[Orientation, ...]] = {}
        self.reasons: dict[str, str] = {}
        self.parts: dict[str, tuple[int, ...]] = {}
        self.tied: set[str] = set()
        self.table_splits: dict[str, tuple[EmbeddingMode, str]] = {}  # chosen by choose(); else the first option
        self.memo: dict[tuple, tuple] = {}  # cost's results by (roots, table splits): pure of them
        # propagate's results: pure of (roots, table splits) and, of the config, of the tensor axes and sequence
        # parallelism alone, so they are shared with other grids planned on this graph (``make_plan``'s ``shared``)
        layouts_key = ("make_plan layouts", gm, config.row, config.col, config.depth, config.sequence_parallel)
        self.layouts: dict[tuple, tuple] = {} if shared is None else shared.setdefault(layouts_key, {})
        for m in self.matches:
            num_lookups = len(lookups.get(m.weight, ()))
            matmul_uses = uses.get(m.weight, 1) - num_lookups
            self.parts[m.weight] = fused_parts(m)
            if config.num_tensor == 1:  # nothing to split: the model's own op (a sharded op at degree 1 costs more)
                self.feasible[m.weight] = ()
                self.reasons[m.weight] = "no tensor parallelism (row = col = depth = 1)"
                continue
            if matmul_uses > 1:
                self.feasible[m.weight] = ()
                self.reasons[m.weight] = f"weight read by {matmul_uses} matmuls (shared weights stay replicated)"
                continue
            if num_lookups:
                if m.weight_in_out:
                    self.feasible[m.weight] = ()
                    self.reasons[m.weight] = "tied to an embedding table but stored (in, out)"
                    continue
                self.tied.add(m.weight)
            candidates = _OUT if num_lookups else _3D + _OUT if m.node in heads else _3D
            ok, why = [], []
            for o in candidates:
                problem = _divides(m, o, self.parts[m.weight], config)
                (why if problem else ok).append(problem or o)
            self.feasible[m.weight] = tuple(ok)
            self.reasons[m.weight] = "; ".join(why)

    def memoized(self, memo: dict[tuple, tuple], fn: Callable[[dict[str, Orientation]], tuple],
                 roots: dict[str, Orientation]) -> tuple:
        """``fn(roots)``, kept in ``memo`` by (roots, table splits), which it is pure of; callers only read the
        result."""
        key = frozenset(roots.items()), frozenset(self.table_splits.items())
        if key not in memo:
            memo[key] = fn(roots)
        return memo[key]

    def propagate(self, roots: dict[str, Orientation]) -> tuple[LayoutResult, dict[str, Orientation]]:
        """The layouts ``roots`` lead to (the greedy root choice asks for the same roots again: planning the 1T
        GPT's grids asked for 438 propagations, 361 distinct per grid and 261 distinct over the grids)."""
        return self.memoized(self.layouts, self.propagated, roots)

    def propagated(self, roots: dict[str, Orientation]) -> tuple[LayoutResult, dict[str, Orientation]]:
        chosen: dict[str, Orientation] = {}

        def orientation_of(m: MatmulMatch, s: Sharding) -> tuple[Orientation, tuple[int, ...]]:
            options = self.feasible[m.weight]
            contiguous_last = (not s.is_replicated and len(s.parts) == 1
                               and s.dim == tensor_meta(m.x).dim() - 1)
            if not options:
                o = Orientation.REPLICATED
            elif len(options) == 1:
                o = options[0]
            elif contiguous_last and any(x.in_layout is s.layout for x in options):
                o = next(x for x in options if x.in_layout is s.layout)
            else:
                o = roots.get(m.weight) or self.reads_tokens(m, s, options) or options[0]
            chosen[m.weight] = o
            return o, self.parts[m.weight] if o.is_sharded else ()

        res = propagate_layouts(self.gm, self.by_node, orientation_of, self.sizes, self.local_batch,
                                self.embedding_of(chosen), self.config.sequence_parallel, self.batch, self.flags)
        return res, chosen

    def embedding_of(self, chosen: dict[str, Orientation]) -> Callable[[str], tuple[EmbeddingMode, str]]:
        def decide(weight: str) -> tuple[EmbeddingMode, str]:
            mode, axis, _ = self.embedding_decision(weight, chosen)
            return mode, axis
        return decide

    def embedding_decision(self, weight: str, chosen: dict[str, Orientation]) -> tuple[EmbeddingMode, str, str]:
        table = tensor_meta(self.lookups[weight][0].args[0])
        num, dim = int(table.shape[0]), int(table.shape[1])
        if weight in self.tied:
            o = chosen.get(weight, Orientation.REPLICATED)
            if o.is_sharded:
                return EmbeddingMode.VOCAB, o.out_axis, ""
            return EmbeddingMode.REPLICATED, "", "tied to an output head that stays replicated"
        if weight in self.feasible:
            return EmbeddingMode.REPLICATED, "", "also read by a matmul"
        options = self.table_options(weight)
        if options:
            mode, axis = self.table_splits.get(weight, options[0])
            kept = "kept whole: smaller than the largest table, and whole its lookup needs no all-reduce (fewest bytes)"
            return mode, axis, kept if mode is EmbeddingMode.REPLICATED else ""
        if self.config.row == self.config.col == 1:
            return EmbeddingMode.REPLICATED, "", "no row or col split"
        return EmbeddingMode.REPLICATED, "", f"neither {dim} features nor {num} rows divide by row or col"

    def table_options(self, weight: str) -> list[tuple[EmbeddingMode, str]]:
        """The splits an embedding table read only by lookups can take: hidden first, larger axis first; a
        table smaller than the model's largest (positions, token types) may also stay whole, as Megatron
        keeps its position table: its lookup then needs no all-reduce of its own."""
        if weight in self.tied or weight in self.feasible:
            return []
        table = tensor_meta(self.lookups[weight][0].args[0])
        num, dim = int(table.shape[0]), int(table.shape[1])
        axes = sorted(("row", "col"), key=lambda a: -self.config.size(a))
        # the vocabulary may split unevenly (50257 rows over 4); the hidden dim only evenly (every op after the
        # lookup would see pieces of unequal widths)
        options = [(mode, axis) for mode, size in ((EmbeddingMode.HIDDEN, dim), (EmbeddingMode.VOCAB, num))
                   for axis in axes if self.config.size(axis) > 1 and (
                       size % self.config.size(axis) == 0
                       or mode is EmbeddingMode.VOCAB and uneven_split(size, self.config.size(axis)))]
        largest = max(tensor_meta(nodes[0].args[0]).numel() for nodes in self.lookups.values())
        if options and table.numel() < largest:
            options.append((EmbeddingMode.REPLICATED, ""))
        return options

    def cost(self, roots: dict[str, Orientation]) -> tuple:
        return self.memoized(self.memo, self.costed, roots)

    def costed(self, roots: dict[str, Orientation]) -> tuple:
        res, chosen = self.propagate(roots)
        plan = self.plan(chosen)
        coll = list_collectives(self.gm, res, self.matches, {p.name: p for p in plan.params}, self.config)
        return total_bytes(coll), len(res.conversions)

    def choose(self) -> Plan:
        """Each table's split by the bytes of the plan it leads to (the matmuls' roots decided for each),
        tables in graph order, ties to the first option (hidden-parallel)."""
        roots = None
        for weight in self.lookups:
            options = self.table_options(weight)
            if len(options) < 2:
                continue
            trials = []
            for split in options:
                self.table_splits[weight] = split
                trial = self.choose_roots()
                trials.append((self.cost(trial), trial))
            best = min(range(len(options)), key=lambda i: (*trials[i][0], i))
            self.table_splits[weight], roots = options[best], trials[best][1]  # (later tables decide on top)
        res, chosen = self.propagate(self.choose_roots() if roots is None else roots)
        return self.plan(chosen, res)

    def choose_roots(self) -> dict[str, Orientation]:
        """Orientations of the matmuls whose input is replicated, greedily in graph order (module docstring)."""
        roots: dict[str, Orientation] = {}
        res, _ = self.propagate(roots)
        decided: set[str] = set()
        for node in res.orientations:
            m = self.by_node[node]
            options = self.feasible[m.weight]
            key = _block_key(m.weight)
            if len(options) < 2 or not self.free_input(res.sharding(m.x), m) or key in decided:
                continue
            decided.add(key)
            group = [x.weight for x in self.matches if _block_key(x.weight) == key and self.feasible[x.weight] == options]
            # Fewest bytes, then fewest re-layouts (they still cost a copy at degree 1), then the first option.
            best = min(options, key=lambda o: (*self.cost({**roots, **dict.fromkeys(group, o)}), options.index(o)))
            roots.update(dict.fromkeys(group, best))
        return roots

    def free_input(self, s: Sharding, m: MatmulMatch) -> bool:
        """A matmul whose input no orientation reads as it is: whole, or (sequence parallelism) split along
        its tokens; its orientation is a root's choice."""
        return s.is_replicated or self.config.sequence_parallel and s.dim != tensor_meta(m.x).dim() - 1

    def reads_tokens(self, m: MatmulMatch, s: Sharding, options: tuple[Orientation, ...]) -> Orientation | None:
        """Under sequence parallelism, for an input split along its tokens over an axis: the orientation that
        reads it gathered and splits its output over that axis (Megatron's column-parallel layer after a
        sequence-parallel norm), as the default the roots' choice starts from."""
        if not self.config.sequence_parallel or s.is_replicated or s.dim == tensor_meta(m.x).dim() - 1:
            return None
        return next((o for o in options if self.config.size(o.in_axis) == 1 and o.out_axis == s.axis), None)

    def plan(self, chosen: dict[str, Orientation], res: LayoutResult | None = None) -> Plan:
        """The plan of orientations ``chosen``; with ``res`` (the layouts they lead to), its notes say where
        heads that do not divide are gathered."""
        matmuls = {}
        for m in self.matches:
            o = chosen.get(m.weight, Orientation.REPLICATED)
            reason = "" if o.is_sharded else (self.reasons[m.weight] or "its input layout has no sharded option")
            matmuls[m.weight] = MatmulPlan(m.weight, m.module, m.op, m.in_features, m.out_features, m.weight_in_out,
                                           m.bias, o, reason, self.parts[m.weight] if o.is_sharded else ())
        embeddings = []
        for weight, nodes in self.lookups.items():
            table = tensor_meta(nodes[0].args[0])
            mode, axis, reason = self.embedding_decision(weight, chosen)
            embeddings.append(EmbeddingPlan(weight, module_of(nodes[0]), int(table.shape[0]), int(table.shape[1]),
                                            mode, axis, reason))
        why = [(m.weight, m.reason) for m in matmuls.values() if m.reason]
        why += [(e.weight, f"(embedding) {e.reason}") for e in embeddings if e.reason]
        experts = self.expert_plans()
        split = {w for e in experts if e.axis or e.tensor_axis for w in e.weights}
        notes = replicated_notes(why) + whole_notes(self.gm, split) + \
            (uneven_head_notes(res, self.config) if res is not None else ()) + \
            (self.batch.notes() if self.batch is not None and self.config.num_batch_shards > 1 else ())
        notes += tuple(f"{e.module}: {e.reason}" if e.reason.startswith("each expert") else
                       f"{e.module}: its experts stay whole on every rank: {e.reason}" for e in experts if e.reason)
        return Plan(self.config, tuple(matmuls.values()), param_plans(self.gm, matmuls, embeddings, experts), notes,
                    tuple(embeddings), experts=experts)

    def expert_plans(self) -> tuple[ExpertPlan, ...]:
        """Each routed-experts layer (``find_expert_layers``): under ``expert_parallel``, its experts split over
        the data ranks, where the layer splits and its experts divide; and on a tensor grid each expert split over
        the larger of the row and col axes (``tensor_split``), where its hidden features divide. Under
        ``expert_parallel="data+tensor"``, whole experts over data x the tensor axis where they divide (else
        as without it)."""
        c = self.config
        ep = c.expert_axis
        axis = max(("row", "col"), key=c.size)
        if not ep and c.size(axis) == 1:
            return ()
        out = []
        layers = find_expert_layers(self.gm)
        blocks = {layer.module for layer in layers if layer.batched}
        for layer in layers:
            size = c.size(axis)
            why = tensor_split(layer, size).why_whole if size > 1 else ""
            tensor_axis = axis if size > 1 and not why else ""
            whole_over_tensor = f"each expert stays whole over {axis}={size}: {why}" if why else ""
            if lent_axis(ep):  # whole experts over data x the tensor axis, where they divide; else as without it
                n = c.size(ep)
                reason = layer.why_whole or (f"its {layer.experts} experts do not divide over {ep}={n}"
                                             if layer.experts % n else "")
                if not reason:
                    out.append(ExpertPlan(layer.module, layer.weights, layer.experts, ep))
                    continue
                out.append(ExpertPlan(layer.module, layer.weights, layer.experts, "",
                                      f"each expert split over {axis}, not over {ep}: {reason}" if tensor_axis
                                      else reason, tensor_axis))
                continue
            if ep:
                reason = layer.why_whole or (f"its {layer.experts} experts do not divide over data={c.data}"
                                             if layer.experts % c.data else "")
                if not reason:  # over data, and each over the tensor axis where it splits
                    out.append(ExpertPlan(layer.module, layer.weights, layer.experts, "data", whole_over_tensor,
                                          tensor_axis))
                elif tensor_axis:
                    out.append(ExpertPlan(layer.module, layer.weights, layer.experts, "",
                                          f"each expert split over {axis}, not over data: {reason}", tensor_axis))
                else:
                    out.append(ExpertPlan(layer.module, layer.weights, layer.experts, "", reason))
                continue
            out.append(ExpertPlan(layer.module, layer.weights, layer.experts, "", whole_over_tensor, tensor_axis))
        return tuple(dataclasses.replace(e, batched=True) if e.module in blocks else e for e in out)


def uneven_head_notes(res: LayoutResult, config: ParallelConfig) -> tuple[str, ...]:
    """One line per region (repeated blocks share one, ``#`` for the block's index) where a split features dim
    is cut into heads that do not divide over its axis (``LayoutResult.uneven_heads``): gathered there, the
    attention runs whole on each rank of the axis."""
    groups: dict[tuple[str, str], dict[str, None]] = {}
    for view, (s, size) in res.uneven_heads.items():
        where = _block_key((module_of(view) or view.name) + ".").rstrip(".")
        heads = "+".join(str(p // size) for p in s.parts)
        groups.setdefault((where, s.axis), {})[f"{heads} heads of {size}"] = None
    return tuple(f"{where}: {', '.join(cuts)} split over {axis}={config.size(axis)} do not divide: gathered there, "
                 f"so the attention runs whole on each {axis} rank" for (where, axis), cuts in groups.items())


def whole_notes(gm: fx.GraphModule, split: set[str] | frozenset[str] = frozenset()) -> tuple[str, ...]:
    """One line per kind of matmul-like op left whole (``whole_matmuls``: 3-D expert weights, convolutions),
    naming its weights (``#`` for a repeated block's index) and their share of the model's parameters;
    ``split``: expert weights an expert layout splits (not whole)."""
    found = [w for w in find_whole_matmuls(gm) if w.weight not in split]
    if not found:
        return ()
    sizes = {param_name(n): tensor_meta(n).numel() for n in gm.graph.nodes if param_name(n) and n.users}
    total = sum(sizes.values()) or 1
    out = []
    for reason in dict.fromkeys(w.reason for w in found):
        weights = list(dict.fromkeys(w.weight for w in found if w.reason == reason))
        names = list(dict.fromkeys(_block_key(w) for w in weights))
        share = sum(sizes.get(w, 0) for w in weights) / total
        out.append(f"{', '.join(names[:4])}{' and more' if len(names) > 4 else ''}: {reason} ({len(weights)} "
                   f"weights, {share:.0%} of the parameters)")
    return tuple(out)


def replicated_notes(why: list[tuple[str, str]]) -> tuple[str, ...]:
    """One line per region that stays replicated; copies in repeated blocks share a line."""
    groups: dict[tuple[str, str], list[str]] = {}
    for weight, reason in why:
        groups.setdefault((_block_key(weight), reason), []).append(weight)
    out = []
    for (key, reason), weights in groups.items():
        name = weights[0] if len(weights) == 1 else f"{key} ({len(weights)} blocks)"
        out.append(f"{name} stays replicated: {reason}")
    return tuple(out)


def param_plans(gm: fx.GraphModule, matmul_plans: dict[str, MatmulPlan],
                embeddings: list[EmbeddingPlan] | tuple[EmbeddingPlan, ...] = (),
                experts: tuple[ExpertPlan, ...] = ()) -> tuple[ParamPlan, ...]:
    sharded = {m.weight: m for m in matmul_plans.values() if m.orientation.is_sharded}
    biases = {m.bias: m for m in sharded.values() if m.bias is not None}
    tables = {e.weight: e for e in embeddings if e.mode is not EmbeddingMode.REPLICATED}
    split_experts = {w: e for e in experts if e.axis for w in e.weights}
    tensor_experts: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    if any(e.tensor_axis for e in experts):
        by_module = {e.module: e for e in experts if e.tensor_axis}
        for layer in find_expert_layers(gm):
            e = by_module.get(layer.module)
            if e is not None:
                for weight, dim, parts in tensor_split(layer, 1).weights:
                    tensor_experts[weight] = (e.tensor_axis, dim, parts)
    out = []
    for node in gm.graph.nodes:
        name = param_name(node)
        if name is None or not node.users:  # unused, or an alias export lists for a tied weight
            continue
        shape = tuple(int(s) for s in tensor_meta(node).shape)
        if name in sharded and sharded[name].orientation.is_3d:
            m = sharded[name]
            out.append(ParamPlan(name, shape, ParamKind.WEIGHT_3D, m.orientation, m.weight_in_out, ("data",),
                                 m.out_parts))
        elif name in sharded:
            m = sharded[name]
            out.append(ParamPlan(name, shape, ParamKind.SPLIT, m.orientation, m.weight_in_out, parts=m.out_parts,
                                 split_axis=m.orientation.out_axis, split_dim=1 if m.weight_in_out else 0))
        elif name in biases and biases[name].orientation.is_3d:
            out.append(ParamPlan(name, shape, ParamKind.BIAS, biases[name].orientation, parts=biases[name].out_parts))
        elif name in biases:
            m = biases[name]
            out.append(ParamPlan(name, shape, ParamKind.SPLIT, m.orientation, parts=m.out_parts,
                                 split_axis=m.orientation.out_axis, split_dim=0))
        elif name in split_experts:  # each rank its experts (dim 0), their gradients complete from every rank's rows
            axis, dim, parts = tensor_experts.get(name, ("", 0, ()))  # (and its piece of each expert's features)
            out.append(ParamPlan(name, shape, ParamKind.SPLIT, grad_axes=("depth",),
                                 split_axis=split_experts[name].axis, split_dim=0, second_axis=axis, second_dim=dim,
                                 second_parts=parts))
        elif name in tensor_experts:  # each expert's hidden features split (its gradients: this rank's part)
            axis, dim, parts = tensor_experts[name]
            out.append(ParamPlan(name, shape, ParamKind.SPLIT, parts=parts, split_axis=axis, split_dim=dim))
        elif name in tables:
            e = tables[name]
            out.append(ParamPlan(name, shape, ParamKind.SPLIT, split_axis=e.axis,
                                 split_dim=0 if e.mode is EmbeddingMode.VOCAB else 1))
        else:
            out.append(ParamPlan(name, shape, ParamKind.REPLICATED))
    return tuple(out)


def make_plan(gm: fx.GraphModule, config: ParallelConfig, shared: dict[Any, Any] | None = None) -> Plan:
    """Chooses orientations and embedding splits (see module docstring) and every parameter's storage.
    ``shared``: a dict the caller keeps while ``gm`` stays unchanged (the plan search's captures), where grids
    planned on this graph share the layouts they propagate."""
    return _Planner(gm, config, shared).choose()

