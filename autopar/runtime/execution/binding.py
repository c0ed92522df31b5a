"""Binds an emitted graph to this rank: marker ops become implementations over this rank's groups.

``ParallelRuntime`` compiles a graph per input signature; after the passes ``bind_markers`` replaces
each marker op (``passes.ir``) with the op of ``autopar.runtime.ops`` (or ``per_rank``) that carries
it out on this rank, and meta devices with this rank's. The small helpers here read the bound graph:
its placeholders, how each output is laid out, which inputs travel between pipeline stages.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch import fx

from autopar.errors import PlanError
from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.params.layout import local_view
from autopar.runtime.ops.context import ContextOps
from autopar.runtime.ops.experts import ExpertOps
from autopar.runtime.ops.layouts import ConvertOp, GatherFeaturesOp, ReduceOp, SumGradOp
from autopar.runtime.ops.matmul import MatmulOp
from autopar.runtime.ops.rows import BatchReduceOp, BatchRows, GatherOutputOp, GatherRowsOp, ScatterRowsOp
from autopar.runtime.ops.vocabulary import EmbeddingOp, VocabCrossEntropyOp
from autopar.runtime.data_parallel.per_rank import SegmentReduceOp
from autopar.runtime.ops.random_pieces import DropoutOp, RandomPieceOp
from passes.ir import (InputKind, batch_reduce, context_attention, context_dropout, context_gather, context_output,
                       context_reduce, context_slice, convert_layout, expert_combine, expert_dispatch, gather_output,
                       gather_rows, input_info, reduce_partial, scatter_rows, sharded_embedding, sharded_matmul,
                       split_dropout, split_random, sum_grad, vocab_cross_entropy)


def bind_markers(gm: fx.GraphModule, mesh: Mesh, rows: BatchRows, reduce: torch.dtype | None, pipeline: int,
                 local_outputs: bool = False, per_rank: tuple[tuple[int, ...], int] | None = None) -> None:
    """Replaces marker ops with implementations over this rank's groups; meta devices with ours.

    ``rows``: each batch shard's rows, which the runtime sets before each run; ``reduce``: the dtype gradients
    are reduced in (None: their own); ``pipeline``: the pipeline degree."""
    device = mesh.device
    if per_rank is not None:  # outputs: features gathered here, own rows taken by ParallelRuntime._run_per_rank
        local_outputs = False
    makers = {  # marker -> implementation, from the marker's last argument (its spec)
        sharded_matmul: lambda spec: MatmulOp(spec, mesh, reduce).__call__,
        convert_layout: lambda spec: ConvertOp(spec, mesh).__call__,
        gather_output: lambda spec: _identity if local_outputs else GatherOutputOp(spec, mesh, rows).__call__,
        sharded_embedding: lambda spec: EmbeddingOp(spec, mesh).__call__,
        sum_grad: lambda axis: SumGradOp(axis, mesh).__call__,
        reduce_partial: lambda spec: ReduceOp(spec, mesh).__call__,
        batch_reduce: lambda spec: BatchReduceOp(spec, mesh, rows).__call__,
        gather_rows: lambda spec: GatherRowsOp(spec, mesh, rows).__call__,
        scatter_rows: lambda spec: ScatterRowsOp(spec, mesh, rows).__call__,
        vocab_cross_entropy: lambda spec: VocabCrossEntropyOp(spec, mesh).__call__,
        split_dropout: lambda spec: DropoutOp(spec, mesh).__call__,
        split_random: lambda spec: RandomPieceOp(spec, mesh).__call__,
        expert_dispatch: lambda spec: ExpertOps(spec, mesh).dispatch,
        expert_combine: lambda spec: ExpertOps(spec, mesh).combine,
    }
    if mesh.size("context") > 1:
        ctx = ContextOps(mesh, per_rank is not None)
        makers.update({
            context_slice: lambda spec: lambda x: ctx.slice(x, spec),
            context_gather: lambda spec: lambda x: ctx.gather(x, spec),
            context_reduce: lambda spec: lambda x: ctx.reduce(x, spec),
            context_output: lambda spec: lambda x: ctx.output(x, spec),
            context_attention: lambda spec: lambda q, k, v, mask: ctx.attention(q, k, v, mask, spec),
            context_dropout: lambda spec: lambda x, p, train: ctx.dropout(x, p, train, spec),
        })
    if per_rank is not None:
        members, member = per_rank
        makers[gather_output] = lambda spec: GatherFeaturesOp(spec, mesh).__call__
        makers[batch_reduce] = lambda spec: SegmentReduceOp(spec, mesh, members, member).__call__
        makers[gather_rows] = makers[scatter_rows] = lambda spec: _pooled_rows_refused
        if pipeline > 1 and any(n.target is batch_reduce for m in gm.modules()
                                if isinstance(m, fx.GraphModule) for n in m.graph.nodes):
            raise PlanError("a loss inside forward under per-rank batches with pipeline parallelism: the last "
                            "stage computes every member's loss, and autopar does not yet send each rank its own. "
                            "Compute the loss outside the model, or use pipeline=1.")
    for sub in gm.modules():  # gm itself, then subgraphs of higher-order ops (no_grad regions)
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            make = makers.get(node.target)
            if make is not None:
                node.target, node.args = make(node.args[-1]), node.args[:-1]
            elif node.op == "call_function":
                node.args = retarget_device(node.args, device)
                node.kwargs = retarget_device(node.kwargs, device)
        sub.recompile()


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _pooled_rows_refused(x: torch.Tensor) -> torch.Tensor:
    raise PlanError("the model works along the batch dim (e.g. batch statistics or a softmax over rows) and is fed a "
                    "batch per rank, which the ranks splitting the model pool: under DDP each rank would see only its "
                    "own rows. Use a grid whose tensor and pipeline degrees are 1 for this model, or feed the same "
                    "global batch on every rank (batch='global').")


def reading_params_at_use(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of eager graph ``gm`` that takes the parameters themselves and reads each one's local piece
    (``local_view``) just before its first use, rather than every piece being read before the graph runs.

    Autograd runs a backward node after every node made later in forward (its sequence number): a parameter
    read up front is read by a node older than the whole graph, so its gradient reached ``p.grad``, and its
    data-parallel bucket (``GradSync``), only once all of backward had run. Read where its layer runs, each
    gradient lands as soon as its layer's backward did: buckets are reduced while backward goes on, as DDP's
    are, and a reduce-scattered gradient (``shard_optimizer``) goes as it arrives rather than all of them
    living at once (48 layers of 4 MiB at data 4: backward's peak went from 228 MiB to 120, the chunks and
    three buckets). A plain (not DTensor) parameter reads as itself, as before."""
    graph = copy.deepcopy(gm.graph)  # (nodes copied, their meta shared)
    order = {n: i for i, n in enumerate(graph.nodes)}  # (inserting before a node keeps the others' order)
    for node in list(graph.nodes):
        info = input_info(node) if node.op == "placeholder" else None
        if info is None or info.kind is not InputKind.PARAMETER or not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        with graph.inserting_before(first):
            piece = graph.call_function(local_view, (node,))
        if "val" in node.meta:
            piece.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(piece, delete_user_cb=lambda user: user is not piece)
    return fx.GraphModule(gm, graph)


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def gather_spec(gm: fx.GraphModule, a: Any) -> Any:
    """The GatherOutputSpec of one output of ``gm`` (looking inside a pipeline stage), or None."""
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target is operator.getitem \
            and a.args[0].op == "call_module":
        stage = gm.get_submodule(str(a.args[0].target))
        a = stage.graph.output_node().args[0][a.args[1]]
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target is context_output:
        a = a.args[0]  # (the context ranks' tokens made whole after it: passes.split_context)
    return a.args[1] if isinstance(a, fx.Node) and a.target is gather_output else None


def travels(node: fx.Node, split: dict[int, int]) -> bool:
    """Pipeline: batch-split inputs are sent from stage to stage; everything else is bound locally."""
    info = input_info(node)
    return info is not None and info.kind is InputKind.USER and int(info.target) in split


def retarget_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    if isinstance(value, (tuple, list)):
        return type(value)(retarget_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: retarget_device(v, device) for k, v in value.items()}
    return value
