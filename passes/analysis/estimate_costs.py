"""Predicts, for one rank, every collective a training step issues and the matmul FLOPs.

The runtime counts the bytes it really sends (autopar.runtime.comm.collectives); tests hold the two equal. The
accounting per op mirrors the implementations in autopar.runtime.ops (matmul, layouts, rows, vocabulary) one to one:

- sharded matmul (3D): forward all-gather of the weight block over depth, all-reduce of the output
  over the axis splitting the input features; backward all-gather of the block again, all-reduce of
  dX over the axis splitting the output features (only if the input needs a gradient),
  reduce-scatter of dW over depth. OUT_ROW/OUT_COL: only the backward all-reduce of dX.
- embedding: vocabulary-parallel all-reduces its output; hidden-parallel is free.
- partial sum/mean over a split dim: one all-reduce of the (small) result forward.
- layout conversion: gather = all-gather forward, free backward; slice = free forward, all-gather of
  the gradient backward (only if the input needs a gradient).
- output: features gathered, then batch rows gathered over data x depth (padded to the largest shard).
- a reduction over the batch inside forward (a loss): one all-reduce of the partial result (and its
  count) over data x depth forward, one of its gradient backward; an op working along the batch dim:
  an all-gather of its input's rows forward, an all-reduce of their gradient backward.
- after backward: each parameter's gradient all-reduced over its ``grad_axes``; under ``shard_optimizer``
  a gradient whose optimizer state is split is reduce-scattered over data instead
  (each data rank keeps its chunk; a chunk summed over depth too is then all-reduced over depth), and after
  the step every split parameter's updated chunks are all-gathered over data (``optimizer_shards``).
- routed experts split over ranks: all-to-alls of the per-expert counts, the rows out and the results back,
  and their gradients the other way (``passes.analysis.expert_costs``, balanced routing assumed).
- per call: the agreement (autopar.runtime.execution.call_check), one all-gather of ``AGREEMENT_BYTES`` per rank over
  the world.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch import fx

from autopar.config import AGREEMENT_BYTES, ParallelConfig
from autopar.decisions import EmbeddingMode, Orientation, ParamPlan, collective_bytes
from passes.analysis.batch_facts import BatchDim, BatchFacts
from passes.analysis.batch_rules import CLASS_LOSSES
from passes.analysis.graph_facts import (
    MatmulMatch,
    causal_attention,
    module_of,
    param_name,
    rows_of,
    tensor_meta,
)
from passes.analysis.layout_rules import LayoutResult, output_node
from passes.analysis.layouts import kept_split
from passes.analysis.optimizer_shards import gathered_numel
from passes.ir import BatchInfo, Sharding, graph_info, input_info, vocab_cross_entropy


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str
    axis: str
    """Mesh axis, or 'batch' for data x depth together."""
    group_size: int
    message_bytes: int
    phase: str
    """forward, backward, or step (gradient synchronization after backward)."""
    where: str
    """Module FQN or parameter name, for the plan table."""
    node: str = field(default="", compare=False)
    """Name of the graph node whose op issues it (its pipeline stage); '' for the gradient sync and the
    model's inputs and outputs."""

    @property
    def bytes(self) -> Fraction:
        return collective_bytes(self.kind, self.group_size, self.message_bytes)


CONTEXT = "<context>"
"""How ``Collective.where`` of attention's key and value gathers over the context ranks ends
(``context_collectives``: the attention module's name before it, so a repeated block's are copied with it)."""
AGREEMENT = "<agreement>"
"""``Collective.where`` of the per-call agreement (under a pipeline: once per train_step, not per micro-batch)."""


def axis_size(config: ParallelConfig, axis: str) -> int:
    if axis == "batch":
        return config.num_batch_shards
    size = 1
    for a in axis.split("+"):
        size *= config.size(a)
    return size


def matmul_collectives(m: MatmulMatch, orientation: Orientation, x_requires_grad: bool,
                       w_requires_grad: bool, config: ParallelConfig, scatter: bool = False,
                       partial_dx: bool = False, b_requires_grad: bool = False) -> list[Collective]:
    """``scatter``: its output is reduce-scattered along the tokens (and its gradient all-gathered back, for
    whichever of the input, weight and bias takes one) in place of the all-reduce; ``partial_dx``: the gather
    before it sums its input's gradient, not itself."""
    x = tensor_meta(m.x)
    b = x.element_size()
    rows = rows_of(x)
    out_split = config.size(orientation.out_axis)
    in_split = config.size(orientation.in_axis)
    block_bytes = m.out_features * m.in_features // (out_split * in_split) * b
    where = m.module or m.weight

    def c(kind: str, axis: str, nbytes: int, phase: str) -> Collective:
        return Collective(kind, axis, axis_size(config, axis), nbytes, phase, where, m.node.name)

    if not orientation.is_3d:
        if not x_requires_grad or partial_dx:
            return []
        out = [c("all_reduce", orientation.out_axis, rows * m.in_features * b, "backward")]
        return [x for x in out if x.group_size > 1]
    y_bytes = rows * m.out_features // out_split * b
    out = [c("all_gather", "depth", block_bytes, "forward"),
           c("reduce_scatter" if scatter else "all_reduce", orientation.in_axis, y_bytes, "forward")]
    if scatter and (x_requires_grad or w_requires_grad or b_requires_grad):
        out.append(c("all_gather", orientation.in_axis, y_bytes, "backward"))
    if x_requires_grad or w_requires_grad:
        out.append(c("all_gather", "depth", block_bytes, "backward"))
    if x_requires_grad and not partial_dx:
        out.append(c("all_reduce", orientation.out_axis, rows * m.in_features // in_split * b, "backward"))
    if w_requires_grad:
        out.append(c("reduce_scatter", "depth", block_bytes, "backward"))
    return [x for x in out if x.group_size > 1]


def _trains_weight(m: MatmulMatch | None, res: LayoutResult) -> bool:
    """Whether a matmul's weight gets a gradient (the one thing its regathered input serves)."""
    if m is None:
        return False
    w = m.weight_node if m.weight_node.op == "placeholder" else m.weight_node.args[0]
    return res.requires_grad.get(w, False)


def gathered_bytes(t: Any, s: Sharding, config: ParallelConfig) -> int:
    """The bytes an all-gather of ``t``'s pieces under ``s`` moves: the whole tensor, or (a segment split
    unevenly, ``decisions.uneven_split``) every rank's piece padded to the largest (``ops.gather_pieces``)."""
    nbytes = t.numel() * t.element_size()
    n = config.size(s.axis) if not s.is_replicated else 1
    if n > 1 and len(s.parts) == 1 and s.full_size % n:
        return nbytes // s.full_size * -(-s.full_size // n) * n
    return nbytes


def conversion_collectives(producer: fx.Node, src: Sharding, dst: Sharding, requires_grad: bool,
                           config: ParallelConfig, where: str, at: str = "",
                           partial: bool | str = False) -> list[Collective]:
    """``partial``: its readers are matmuls whose input gradients are partial sums, reduce-scattered back
    (``ConvertSpec.partial_grad``), and which keep this rank's tokens, gathered again in their backward
    (``autopar.runtime.ops.sequence_parallel.Regather``) when ``partial`` is "regather"."""
    t = tensor_meta(producer)
    out = []
    if not src.is_replicated:
        out.append(Collective("all_gather", src.axis, config.size(src.axis), gathered_bytes(t, src, config), "forward",
                              where, at))
    if partial == "regather":
        out.append(Collective("all_gather", src.axis, config.size(src.axis), gathered_bytes(t, src, config),
                              "backward", where, at))
    if partial and requires_grad:
        out.append(Collective("reduce_scatter", src.axis, config.size(src.axis), gathered_bytes(t, src, config),
                              "backward", where, at))
    if not dst.is_replicated and requires_grad:
        out.append(Collective("all_gather", dst.axis, config.size(dst.axis), gathered_bytes(t, dst, config),
                              "backward", where, at))
    return [c for c in out if c.group_size > 1]


def _all_reduce_of(node: fx.Node, axis: str, config: ParallelConfig, where: str) -> list[Collective]:
    t = tensor_meta(node)
    out = [Collective("all_reduce", axis, config.size(axis), t.numel() * t.element_size(), "forward", where,
                      node.name)]
    return [c for c in out if c.group_size > 1]


def output_collectives(producer: fx.Node, sharding: Sharding, batch_dim: BatchDim | None, batch: BatchInfo | None,
                       config: ParallelConfig) -> list[Collective]:
    t = tensor_meta(producer)
    out = []
    if not sharding.is_replicated:
        out.append(Collective("all_gather", sharding.axis, config.size(sharding.axis),
                              gathered_bytes(t, sharding, config), "forward", "<output>"))
    if batch_dim is not None and batch is not None:
        out.append(Collective("all_gather", "batch", config.num_batch_shards,
                              _padded_rows_bytes(t, batch_dim, batch), "forward", "<output>"))
    return [c for c in out if c.group_size > 1]


def _padded_rows_bytes(t: Any, bd: BatchDim, batch: BatchInfo) -> int:
    """What an all-gather of every batch shard's rows of ``t`` moves (shards padded to the largest)."""
    per_entry = t.numel() // max(t.shape[bd.dim], 1) * t.element_size()
    return max(batch.local_sizes) * bd.factor * len(batch.local_sizes) * per_entry


def batch_collectives(gm: fx.GraphModule, facts: BatchFacts, batch: BatchInfo, config: ParallelConfig
                      ) -> list[Collective]:
    """What ``passes.split_batch``'s markers issue for the reductions and gathers ``facts`` finds."""
    n = config.num_batch_shards
    out = []
    for node, r in facts.reductions.items():
        val = node.meta.get("val")
        t = val if not isinstance(val, (tuple, list)) else val[0]
        where = module_of(node) or str(node.target)
        counted = r.kind == "loss_mean" and node.target in CLASS_LOSSES and not tensor_meta(node.args[1]).is_floating_point()
        nbytes = (t.numel() + counted) * t.element_size()  # the count travels with the sums, both ways
        out.append(Collective("all_reduce", "batch", n, nbytes, "forward", where, node.name))
        if facts.requires_grad.get(node, False):
            out.append(Collective("all_reduce", "batch", n, nbytes, "backward", where, node.name))
    done = set()
    for consumer, producers in facts.gathers.items():
        for producer, bd in producers.items():
            if (producer, bd) in done:
                continue
            done.add((producer, bd))
            t = tensor_meta(producer)
            where = module_of(consumer) or str(consumer.target)
            out.append(Collective("all_gather", "batch", n, _padded_rows_bytes(t, bd, batch), "forward", where,
                                  producer.name))
            if facts.requires_grad.get(producer, False):
                whole = t.numel() // max(t.shape[bd.dim], 1) * sum(batch.local_sizes) * bd.factor * t.element_size()
                out.append(Collective("all_reduce", "batch", n, whole, "backward", where, producer.name))
    return [c for c in out if c.group_size > 1]


def input_collectives(node: fx.Node, batch: BatchInfo | None, config: ParallelConfig) -> list[Collective]:
    """The backward all-gather of a batch-split input's gradient (only inputs that need one)."""
    info = input_info(node)
    t = tensor_meta(node)
    if batch is None or batch.segments or info is None or not info.batch_split or not info.requires_grad or t is None:
        return []
    row_bytes = t.numel() // max(t.shape[0], 1) * t.element_size()
    padded = max(batch.local_sizes) * len(batch.local_sizes) * row_bytes
    out = [Collective("all_gather", "batch", config.num_batch_shards, padded, "backward", "<input>")]
    return [c for c in out if c.group_size > 1]


def loss_collectives(gm: fx.GraphModule, res: LayoutResult, config: ParallelConfig) -> list[Collective]:
    """What ``train_step``'s cross-entropy on the first output (the logits) issues for one (micro-)batch
    under pipelining, where the outputs are not gathered: logits split along the vocabulary only take
    the vocabulary-parallel path (the max, the sum of exponentials and the picked logit: one
    fp32 value per token, the last two in one buffer, forward); logits split another way are gathered."""
    outs = output_node(gm).args[0]  # export's flat outputs; the logits come first (a tensor, a tuple, HF output)
    leaves = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    logits = next((a for a in leaves if isinstance(a, fx.Node) and tensor_meta(a) is not None), None)
    if logits is None:
        return []
    context: list[Collective] = []
    if config.context > 1:  # the last stage's outputs gathered whole over context for the loss (``split_context``),
        # their gradients reduce-scattered back to each rank's tokens
        context = [Collective(kind, "context", config.context, nbytes, phase, "<loss>")
                   for nbytes in gathered_outputs(gm)
                   for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward"))]
    t, sharding = tensor_meta(logits), res.sharding(logits)
    if sharding.is_replicated:
        return context
    size = config.size(sharding.axis)
    if sharding.dim == t.dim() - 1 and len(sharding.parts) == 1:
        out = vocab_loss_collectives(t, t.dim() - 1, sharding.axis, config, "<loss>")
    else:
        out = [Collective("all_gather", sharding.axis, size, gathered_bytes(t, sharding, config), "forward", "<loss>")]
    return context + [c for c in out if c.group_size > 1]


def vocab_loss_collectives(logits: Any, class_dim: int, axis: str, config: ParallelConfig, where: str, at: str = "",
                           smoothing: bool = False) -> list[Collective]:
    """Vocabulary-parallel cross-entropy (autopar.runtime.ops.vocabulary.vocab_parallel_losses): the row maxima,
    then the sums of exponentials, the targets' logits (and the logits' sums with label smoothing) in one
    buffer; fp32, one value each per row, forward only (the loss is replicated)."""
    rows = logits.numel() // max(logits.shape[class_dim], 1)
    out = [Collective("all_reduce", axis, config.size(axis), rows * 4, "forward", where, at),
           Collective("all_reduce", axis, config.size(axis), rows * 4 * (3 if smoothing else 2), "forward", where, at)]
    return [c for c in out if c.group_size > 1]


def grad_sync_collectives(gm: fx.GraphModule, params: Mapping[str, ParamPlan],
                          config: ParallelConfig) -> list[Collective]:
    out = []
    for node in gm.graph.nodes:
        name = param_name(node)
        t = tensor_meta(node)
        info = input_info(node)
        if name is None or t is None or not node.users or not (info and info.requires_grad):
            continue
        plan = params[name]
        axes = config.grad_axes(plan.grad_axes)  # (the context ranks hold the same weights: Mesh.grad_group)
        axis = "+".join(axes)
        nbytes = plan.local_numel(config) * t.element_size()
        split = gathered_numel(plan.shape, plan.split_axes(config), config.data, plan.fused_dims(config)) \
            if config.shard_optimizer and config.data > 1 and not plan.splits_over_data(config) else 0
        if split:
            # each data rank keeps the sum of its chunk (GradSync's reduce-scatter), then sums it over the rest of
            # the gradient's axes (depth, context)
            out.append(Collective("reduce_scatter", "data", config.data, split * t.element_size(), "step", name))
            rest = "+".join(a for a in axes if a != "data")
            if rest:
                out.append(Collective("all_reduce", rest, axis_size(config, rest), split // config.data
                                      * t.element_size(), "step", name))
        else:
            out.append(Collective("all_reduce", axis, axis_size(config, axis), nbytes, "step", name))
        if split:  # the updated chunks, from every data rank
            out.append(Collective("all_gather", "data", config.data, split * t.element_size(), "step", name))
    return [c for c in out if c.group_size > 1]


def list_collectives(gm: fx.GraphModule, res: LayoutResult, matmuls: Iterable[MatmulMatch],
                     params: Mapping[str, ParamPlan] | None, config: ParallelConfig) -> list[Collective]:
    """Every collective this rank issues in one forward + backward + gradient sync, in graph order."""
    batch: BatchInfo | None = graph_info(gm).batch
    by_node = {m.node: m for m in matmuls}
    out: list[Collective] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out += input_collectives(node, batch, config)
    done: set[tuple[fx.Node, Sharding]] = set()
    output = output_node(gm)
    backward = {(producer, dst) for (consumer, producer), dst in res.conversions.items()
                if (producer, dst) in res.partial_gathers and _trains_weight(by_node.get(consumer), res)}
    for (consumer, producer), dst in res.conversions.items():
        if consumer is output or (producer, dst) in done:
            continue
        done.add((producer, dst))
        partial = (producer, dst) in res.partial_gathers and ("regather" if (producer, dst) in backward else True)
        out += conversion_collectives(producer, res.sharding(producer), dst, res.requires_grad.get(producer, False),
                                      config, module_of(consumer) or str(consumer.target), consumer.name, partial)
    summed: set[tuple[fx.Node, Sharding | None, str]] = set()
    for (consumer, producer), axis in res.grad_sums.items():
        key = (producer, res.conversions.get((consumer, producer)), axis)
        if key not in summed:
            summed.add(key)
            t = tensor_meta(producer)
            c = Collective("all_reduce", axis, config.size(axis), t.numel() * t.element_size(), "backward",
                           module_of(consumer) or str(consumer.target), producer.name)  # sum_grad follows the producer
            out += [c] if c.group_size > 1 else []
    for node, spec in res.reductions.items():
        out += _all_reduce_of(node, spec.axis, config, module_of(node) or str(node.target))
    for node, (target, args, _) in res.local_args.items():
        if target is vocab_cross_entropy:
            spec = args[-1]
            out += vocab_loss_collectives(tensor_meta(args[0]), spec.class_dim, spec.axis, config,
                                          module_of(node) or "cross_entropy", node.name, bool(spec.label_smoothing))
    for node, (mode, axis) in res.embeddings.items():
        where = module_of(node) or param_name(node.args[0])
        if node in res.seq_scatter:  # its rows reduce-scattered along the tokens; their gradients gathered back
            t = tensor_meta(node)
            table = node.args[0]
            out += [c for c in (Collective("reduce_scatter", axis, config.size(axis), t.numel() * t.element_size(),
                                           "forward", where, node.name),) if c.group_size > 1]
            if res.requires_grad.get(table, False):
                out.append(Collective("all_gather", axis, config.size(axis), t.numel() * t.element_size(), "backward",
                                      where, node.name))
        elif mode is EmbeddingMode.VOCAB:
            out += _all_reduce_of(node, axis, config, where)
    trained = {param_name(n) for n in gm.graph.nodes if n.op == "placeholder" and res.requires_grad.get(n, False)}
    for node, orientation in res.orientations.items():
        m = by_node[node]
        w_node = m.weight_node if m.weight_node.op == "placeholder" else m.weight_node.args[0]
        out += matmul_collectives(m, orientation, res.requires_grad[m.x], res.requires_grad[w_node], config,
                                  node in res.seq_scatter, node in res.partial_dx, m.bias in trained)
    seen: set[fx.Node] = set()
    pooled = len(batch.segments) if batch is not None and batch.segments else 0
    kept = kept_split(gm, res)  # returned split (a key/value cache): no gather
    for producer in output.all_input_nodes:
        if producer in seen or producer in kept or tensor_meta(producer) is None:
            continue
        seen.add(producer)
        bd = res.batch.batch_dim(producer) if res.batch is not None else None
        out += output_collectives(producer, res.sharding(producer), None if pooled else bd, batch, config)
        if pooled and res.requires_grad.get(producer, False):
            out += _pooled_output_collectives(producer, bd, res.batch, batch, pooled)
    if res.batch is not None and batch is not None:
        out += pooled_collectives(gm, res.batch, batch) if pooled else batch_collectives(gm, res.batch, batch, config)
    if config.context > 1:  # each rank holds 1/context of the tokens: its activations' collectives move that much
        # (not the weights' gathers over depth and their gradients' reduce-scatters, nor the sums of a weight's
        # gradient over a tensor axis (sequence parallelism's norms), nor the outputs' gather over the batch shards,
        # which comes after their gather over context)
        weights = {n.name for n in gm.graph.nodes if param_name(n) is not None}
        out = [dataclasses.replace(c, message_bytes=c.message_bytes // config.context)
               if c.phase != "step" and "depth" not in c.axis.split("+") and c.node not in weights
               and not (c.where == "<output>" and c.axis == "batch") else c for c in out]
        out += context_collectives(gm, res, config)
    if params is not None:
        out += grad_sync_collectives(gm, params, config)
    alone = batch is None and config.num_batch_shards > 1  # a batch of this rank's own, not split
    if config.world_size > 1 and not (alone and config.num_tensor == 1 and config.pipeline == 1
                                      and not config.expert_parallel and config.context == 1):
        # the runtime's check that every rank makes the same call (not made for data parallelism alone
        # under per-rank batches: its forward has no collective; experts split over data exchange rows in it)
        out.append(Collective("all_gather", "world", config.world_size, AGREEMENT_BYTES * config.world_size,
                              "forward", AGREEMENT))
    return out


def context_collectives(gm: fx.GraphModule, res: LayoutResult, config: ParallelConfig) -> list[Collective]:
    """What context parallelism adds (``passes.split_context``): each attention's keys and values all-gathered
    over the context ranks in forward (their whole size, over the heads this rank holds), and in backward again
    (``autopar.runtime.ops.context.CausalOverGathered`` keeps this rank's tokens of them) with their gradients
    reduce-scattered; each output gathered whole, and, where the graph returns no loss beside it
    (the caller's loss is on the output), its gradient reduce-scattered back in backward. The loss's sums over
    the context ranks (a few bytes) are left out."""
    n, out = config.context, []
    for node, kv, whole in attention_keys_values(gm, res, config):
        where = module_of(node) + CONTEXT
        out.append(Collective("all_gather", "context", n, whole, "forward", where, node.name))
        if res.requires_grad.get(kv, False):
            if causal_attention(node):  # (gathered again in backward: only this rank's tokens are kept)
                out.append(Collective("all_gather", "context", n, whole, "backward", where, node.name))
            out.append(Collective("reduce_scatter", "context", n, whole, "backward", where, node.name))
    producers = dict.fromkeys(output_node(gm).all_input_nodes)
    loss = any(tensor_meta(p) is not None and tensor_meta(p).dim() == 0 and res.requires_grad.get(p, False)
               for p in producers)
    for producer, nbytes in _gathered(gm):
        out.append(Collective("all_gather", "context", n, nbytes, "forward", "<output>"))
        if res.requires_grad.get(producer, False) and not loss:
            out.append(Collective("reduce_scatter", "context", n, nbytes, "backward", "<output>"))
    return out


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One attention's keys or values, as the plan search's screen prices a context degree for them
    (``StepReport.attention_kv``)."""

    module: str
    """The attention's module (its block's, for ``repeat_blocks``)."""
    kv_bytes: int
    """The keys' or values' bytes over every token of this rank's rows and the heads it holds (as captured)."""


def attention_shapes(gm: fx.GraphModule, res: LayoutResult, config: ParallelConfig) -> tuple[AttentionShape, ...]:
    """``attention_keys_values`` as ``AttentionShape`` records."""
    return tuple(AttentionShape(module_of(node), b) for node, _, b in attention_keys_values(gm, res, config))


def attention_keys_values(gm: fx.GraphModule, res: LayoutResult, config: ParallelConfig
                          ) -> list[tuple[fx.Node, fx.Node, int]]:
    """Each attention's keys and values in ``gm``: (the attention, the keys or values, their bytes over every
    token of this rank's rows and the heads it holds): what context parallelism gathers."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.scaled_dot_product_attention.default:
            continue
        for kv in node.args[1:3]:
            t = tensor_meta(kv)
            if t is not None:
                s = res.sharding(kv)
                out.append((node, kv, t.numel() * t.element_size() // (1 if s.is_replicated else config.size(s.axis))))
    return out


def gathered_outputs(gm: fx.GraphModule) -> list[int]:
    """The bytes of each floating output of two or more dimensions (logits): what context parallelism gathers
    whole over its ranks."""
    return [nbytes for _, nbytes in _gathered(gm)]


def _gathered(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    out = []
    for producer in dict.fromkeys(output_node(gm).all_input_nodes):
        t = tensor_meta(producer)
        if t is not None and t.dim() >= 2 and t.is_floating_point():
            out.append((producer, t.numel() * t.element_size()))
    return out


def pooled_collectives(gm: fx.GraphModule, facts: BatchFacts, batch: BatchInfo) -> list[Collective]:
    """Per-rank batches pooled by the ranks of one batch shard (``batch.segments``: their rows;
    autopar.runtime.data_parallel.per_rank): each batch input's rows all-gathered from the members forward, and each
    per-member loss's gradient all-gathered from them backward. No reduction crosses batch shards."""
    n = len(batch.segments)
    out = []
    for node in gm.graph.nodes:
        info = input_info(node) if node.op == "placeholder" else None
        t = tensor_meta(node)
        if info is not None and info.batch_split and t is not None:
            per_row = t.numel() // max(t.shape[0], 1) * t.element_size()
            out.append(Collective("all_gather", "shard", n, max(batch.segments) * n * per_row, "forward", "<input>"))
    for node in facts.reductions:
        val = node.meta.get("val")
        t = val if not isinstance(val, (tuple, list)) else val[0]
        if facts.requires_grad.get(node, False):
            out.append(Collective("all_gather", "shard", n, t.numel() * n * t.element_size(), "backward",
                                  module_of(node) or str(node.target), node.name))
    return [c for c in out if c.group_size > 1]


def _pooled_output_collectives(producer: fx.Node, bd: BatchDim | None, facts: BatchFacts | None,
                               batch: BatchInfo, n: int) -> list[Collective]:
    """Backward of an output under pooled per-rank batches: its rows' gradients all-gathered from their
    owners; an output computed without the batch: its gradient summed over the members."""
    t = tensor_meta(producer)
    if bd is not None:
        per_entry = t.numel() // max(t.shape[bd.dim], 1) * t.element_size()
        nbytes = max(batch.segments) * bd.factor * n * per_entry
        return [Collective("all_gather", "shard", n, nbytes, "backward", "<output>")]
    if facts is not None and facts.state(producer).value == "none":
        return [Collective("all_reduce", "shard", n, t.numel() * t.element_size(), "backward", "<output>")]
    return []


def total_bytes(collectives: Iterable[Collective]) -> Fraction:
    return sum(bytes_by_kind(collectives).values(), Fraction(0))


def bytes_by_kind(collectives: Iterable[Collective]) -> dict[str, Fraction]:
    """The bytes of ``collectives`` by kind, exactly: a collective's bytes are linear in its message, so the
    messages of one kind and group size are summed as integers and turned into bytes once (a plan of the 1T
    GPT sums ~5,000 collectives, each Fraction addition takes microseconds, and make_plan totals every trial
    of its roots)."""
    messages: dict[tuple[str, int], int] = {}
    for c in collectives:
        key = (c.kind, c.group_size)
        messages[key] = messages.get(key, 0) + c.message_bytes
    out: dict[str, Fraction] = {}
    for (kind, group), message in messages.items():
        out[kind] = out.get(kind, Fraction(0)) + collective_bytes(kind, group, message)
    return out


def matmul_split(config: ParallelConfig, orientation: Orientation) -> int:
    """Ranks of one batch shard that split a matmul's work: its weight's pieces (1 when replicated)."""
    if not orientation.is_sharded:
        return 1
    return config.size(orientation.in_axis) * config.size(orientation.out_axis)


def matmul_flops(m: MatmulMatch, x_requires_grad: bool, w_requires_grad: bool,
                 global_rows: int | None = None) -> int:
    """Forward + backward FLOPs of one matmul over ``global_rows`` rows (default: the captured rows)."""
    rows = rows_of(tensor_meta(m.x)) if global_rows is None else global_rows
    one = 2 * rows * m.in_features * m.out_features
    return one * (1 + int(x_requires_grad) + int(w_requires_grad))
