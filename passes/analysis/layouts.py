"""Layout propagation: how every tensor is sharded, and where a re-layout is needed.

Given the decisions for the sharded matmuls and embedding tables, per-op rules fix every other
tensor's ``Sharding`` (replicated, or one dim split over row or col; see ``passes.ir.Sharding``):

- a sharded matmul reads its input split on the last dim over ``orientation.in_layout`` and writes
  its output split over ``out_layout`` (in segments for a fused projection);
- pointwise ops keep the sharding of their first sharded operand; replicated operands that span
  the split dim are sliced (free), broadcast ones are left alone;
- views, reshapes, expands, transposes, permutes, (un)squeezes, slices, splits and cats move the
  split dim, and get this rank's local sizes as arguments (``local_args``);
- scaled-dot-product attention and batched matmuls keep a split head/batch dim; softmax, norms and
  reductions keep a split dim they do not reduce over; a sum or mean over the split dim is
  computed locally and completed by one all-reduce (``reductions``);
- cross-entropy on logits split along the classes (a vocabulary-split LM head) stays split: it becomes
  ``passes.ir.vocab_cross_entropy`` (one all-reduce of the row maxima, one of the sums of exponentials
  and the targets' logits; the full logits are never built);
- every other op sees replicated inputs: a sharded input is gathered first. Correct first.

The planner and the transform both call ``propagate_layouts``, so the costs the planner compares
are those of the graph that is emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from autopar.decisions import EmbeddingMode, Layout, Orientation
from passes.analysis.batch_dims import analyze_batch
from passes.analysis.batch_facts import BatchFacts, State
from passes.analysis.graph_facts import (MatmulMatch, carries_grad, param_name, symbolic_dim, tensor_inputs,
                                        tensor_meta)
from passes.ir import REPLICATED, Sharding, graph_info, input_info, last_dim

from passes.analysis.layout_rules import Decision, LayoutResult, LayoutRules, output_node

aten = torch.ops.aten


def propagate_layouts(gm: fx.GraphModule, matmuls: Mapping[fx.Node, MatmulMatch],
                      orientation_of: Callable[[MatmulMatch, Sharding], tuple[Orientation, tuple[int, ...]]],
                      sizes: Mapping[str, int], local_batch: int | None = None,
                      embedding_of: Callable[[str], tuple[EmbeddingMode, str]] | None = None,
                      sequence_parallel: bool = False, batch: BatchFacts | None = None,
                      flags: tuple[dict[fx.Node, bool], dict[fx.Node, bool]] | None = None) -> LayoutResult:
    """Walks ``gm`` in order and assigns shardings.

    Args:
        matmuls: the matmul nodes that may be sharded.
        orientation_of: called with each matmul and its input's sharding as it arrives; returns the
            orientation (REPLICATED leaves it unsharded) and the output segments.
        sizes: ranks per mesh axis ('row', 'col').
        local_batch: rows of the batch-split inputs on this rank; None when the batch is not split
            (then ``res.batch`` is None: nothing is batch-split).
        embedding_of: the decision for an embedding table (by parameter name), if any.
        sequence_parallel: a matmul that would all-reduce a whole output over one axis reduce-scatters it
            along its tokens instead (``sequence_split``), and a gather whose every reader is a matmul that
            sums its input's gradient over the gathered axis reduce-scatters that gradient for them
            (``mark_partial_gathers``).
        batch: ``analyze_batch(gm)``, where the caller has it (make_plan propagates one graph many times);
            read only.
        flags: ``node_flags(gm, local_batch, batch)``, where the caller has it (the same for every
            propagation of a graph); read only.
    """
    res = LayoutResult()
    if local_batch is None:
        batch = None
    elif batch is None:
        batch = analyze_batch(gm)
    res.batch = batch
    requires_grad, batch_split = node_flags(gm, local_batch, batch) if flags is None else flags
    res.requires_grad, res.batch_split = dict(requires_grad), dict(batch_split)
    rules = LayoutRules(res, sizes)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            info = input_info(node)
            res.shardings[node] = info.sharding if info is not None and info.sharding is not None else REPLICATED
            continue
        if node.op == "output":
            continue
        val = tensor_meta(node)
        decision = None
        match = matmuls.get(node)
        if match is not None:
            orientation, parts = orientation_of(match, res.sharding(match.x))
            if orientation.is_sharded:
                res.orientations[node] = orientation
                ndim = tensor_meta(match.x).dim()
                need = last_dim(orientation.in_layout, match.in_features, ndim)
                decision = Decision(last_dim(orientation.out_layout, match.out_features, val.dim(), parts),
                                     {match.x: need})
                tokens = sequence_split(node, orientation, sizes, batch) if sequence_parallel else None
                if tokens is not None:
                    decision.out = Sharding(orientation.in_layout, tokens, (int(val.shape[tokens]),))
                    res.seq_scatter[node] = tokens
        elif (node.target is aten.embedding.default and embedding_of is not None
              and (name := param_name(node.args[0])) is not None):
            mode, axis = embedding_of(name)
            if mode is not EmbeddingMode.REPLICATED:
                res.embeddings[node] = (mode, axis)
                out = last_dim(Layout(axis), val.shape[-1], val.dim()) if mode is EmbeddingMode.HIDDEN else REPLICATED
                tokens = (lookup_split(node, axis, sizes, batch)
                          if sequence_parallel and mode is EmbeddingMode.VOCAB else None)
                if tokens is not None:  # its all-reduce becomes a reduce-scatter along the tokens
                    out = Sharding(Layout(axis), tokens, (int(val.shape[tokens]),))
                    res.seq_scatter[node] = tokens
                decision = Decision(out, {node.args[1]: REPLICATED})
        elif node.op == "call_function":
            decision = rules.decide(node)
        if decision is None:
            decision = Decision(REPLICATED, {i: REPLICATED for i in tensor_inputs(node)})
        for producer, need in decision.needs.items():
            if isinstance(producer, fx.Node) and res.sharding(producer) != need:
                res.conversions[(node, producer)] = need
        out_axis = decision.out.axis if isinstance(decision.out, Sharding) else ""
        for producer in decision.broadcast:
            if out_axis and res.requires_grad.get(producer, False):
                res.grad_sums[(node, producer)] = out_axis
        if decision.args is not None:
            res.local_args[node] = decision.args
        if decision.reduce is not None:
            res.reductions[node] = decision.reduce
        res.shardings[node] = decision.out
    if sequence_parallel:
        mark_partial_gathers(res, matmuls, sizes)
    out_node = output_node(gm)
    for out in tensor_inputs(out_node):
        if not res.sharding(out).is_replicated:
            res.conversions.setdefault((out_node, out), REPLICATED)
    return res


def node_flags(gm: fx.GraphModule, local_batch: int | None = None, batch: BatchFacts | None = None
               ) -> tuple[dict[fx.Node, bool], dict[fx.Node, bool]]:
    """Whether each node (but the output) needs a gradient, and whether it holds a batch split (``local_batch``
    and ``batch`` as ``propagate_layouts`` takes them): facts of the graph alone, whatever the layouts."""
    if local_batch is None:
        batch = None
    elif batch is None:
        batch = analyze_batch(gm)
    requires_grad: dict[fx.Node, bool] = {}
    batch_split: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            info = input_info(node)
            requires_grad[node] = bool(info and info.requires_grad)
            batch_split[node] = bool(batch is not None and info and info.batch_split)
        elif node.op != "output":
            requires_grad[node] = carries_grad(node, requires_grad)
            batch_split[node] = batch is not None and batch.state(node) is State.SPLIT
    return requires_grad, batch_split


def sequence_split(node: fx.Node, orientation: Orientation, sizes: Mapping[str, int], batch: Any) -> int | None:
    """The dim a sharded matmul's output is reduce-scattered along under sequence parallelism, or None.

    Its output must be whole after the all-reduce it replaces (nothing splits its features: the output axis
    has one rank, as in Megatron's row-parallel layer) and hold tokens (``token_dim``)."""
    if not orientation.is_3d or sizes.get(orientation.out_axis, 1) != 1:
        return None
    return token_dim(node, sizes.get(orientation.in_axis, 1), batch)


def lookup_split(node: fx.Node, axis: str, sizes: Mapping[str, int], batch: Any) -> int | None:
    """The dim a vocabulary-split lookup's rows are reduce-scattered along under sequence parallelism (its
    tokens, ``token_dim``), or None."""
    return token_dim(node, sizes.get(axis, 1), batch)


def token_dim(node: fx.Node, n: int, batch: Any) -> int | None:
    """The dim of ``node``'s tokens when they split evenly over ``n`` > 1 ranks: the dim before the features
    (of a 2-D tensor, its rows: GPT-2's Conv1D flattens batch x tokens), not the batch's when the batch is
    split. A decode step (one token) has none, nor a length captured symbolically (training on varying
    lengths: the plan, made on example sizes, and the graph that runs must agree)."""
    val = tensor_meta(node)
    if n < 2 or val is None or val.dim() < 2:
        return None
    tokens = val.dim() - 2
    length = val.shape[tokens]
    if not isinstance(length, int) or symbolic_dim(node, tokens) or length < n or length % n:
        return None
    rows = batch.batch_dim(node) if batch is not None else None
    return None if rows is not None and rows.dim == tokens else tokens


def mark_partial_gathers(res: LayoutResult, matmuls: Mapping[fx.Node, MatmulMatch], sizes: Mapping[str, int]) -> None:
    """Marks each gather of an evenly split tensor into a whole one whose every reader is a matmul that reads
    it whole and splits its output over the gathered axis: their input gradients are partial sums over that
    axis, so the gather's backward reduce-scatters them (``res.partial_gathers``) and the matmuls skip their
    own all-reduce (``res.partial_dx``): one reduce-scatter where there were an all-reduce and a slice."""
    readers: dict[tuple[fx.Node, Sharding], list[fx.Node]] = {}
    for (consumer, producer), dst in res.conversions.items():
        readers.setdefault((producer, dst), []).append(consumer)
    for (producer, dst), consumers in readers.items():
        src = res.sharding(producer)
        if (src.is_replicated or len(src.parts) != 1 or src.full_size % sizes.get(src.axis, 1)
                or not dst.is_replicated and sizes.get(dst.axis, 1) != 1):
            continue
        ok = True
        for c in consumers:
            o, m = res.orientations.get(c), matmuls.get(c)
            if (o is None or m is None or m.x is not producer or sizes.get(o.in_axis, 1) != 1
                    or o.out_axis != src.axis):
                ok = False
                break
        if ok:
            res.partial_gathers.add((producer, dst))
            res.partial_dx.update(consumers)


def kept_split(gm: fx.GraphModule, res: LayoutResult) -> set[fx.Node]:
    """The output producers returned split, not gathered: at the positions in ``GraphInfo.kept_outputs``
    (state the caller passes back in, such as a key/value cache), split over one axis in one piece, or
    holding this rank's rows of a batch split evenly (one entry per row), or both
    (``GatherOutputSpec.keep_split``)."""
    at = graph_info(gm).kept_outputs
    if not at:
        return set()
    info = graph_info(gm).batch
    even = info is None or (len(set(info.local_sizes)) == 1 and not info.segments)
    out = output_node(gm).args[0]
    kept = set()
    for i, n in enumerate(out):
        if i not in at or not isinstance(n, fx.Node):
            continue
        s = res.sharding(n)
        if not s.is_replicated and len(s.parts) != 1:
            continue
        rows = res.batch.batch_dim(n) if res.batch is not None else None
        if res.batch is not None and (rows is None or rows.factor != 1 or rows.outer != 1 or not even):
            continue  # (the batch is split: kept only with its rows split evenly)
        if rows is not None or not s.is_replicated:
            kept.add(n)
    return kept
