"""split_context: every sequence's tokens split over the context ranks for the whole graph (context parallelism).

Requires: a captured graph with static sizes, after the passes that shard it (its markers are read as the ops
they stand for); ``plan.config.context`` = C > 1.
Ensures: the token ids an embedding looks up (``embedding`` / ``sharded_embedding`` of a user input with two or
more dims: its last dim is the sequence, S tokens) are cut to this rank's tokens (``passes.ir.context_slice``: two
of 2C equal chunks, ``ContextSpec``), and the split follows the ops forward:

- ops that work token by token (elementwise ops, matmuls on the features, norms and softmaxes over the features,
  views that keep the tokens in one dim (``passes.context_shapes``), embedding lookups, per-token losses) run on
  this rank's tokens, their size arguments cut to them; so do sequence parallelism's gathers and scatters of the
  tokens over a tensor axis (``convert_layout``, their sizes cut: ``passes.context_markers``), and a lookup whose rows it scatters along the
  tokens has its ids cut; a whole-sequence operand they meet (position ids, rotary tables, labels, an attention
  mask's query rows) is cut to this rank's tokens where they meet (``context_slice``);
- ``scaled_dot_product_attention`` of this rank's queries becomes ``context_attention``: keys and values
  gathered over the context ranks, a causal mask made from the tokens' positions;
- a sum or mean over the tokens (a loss) is completed over the context ranks: ``cross_entropy_loss`` with
  reduction "mean" (and ``vocab_cross_entropy``, ``batch_reduce``) becomes per-token losses and a
  ``batch_reduce`` with its counts over every rank holding a part (``BatchReduceSpec.context``); other sums by
  ``context_reduce``;
- a routed-experts module (``passes.analysis.token_rows``: grouped matmuls, expert exchanges) whose routing is
  proved to work token by token runs on this rank's tokens, its row counts cut to them; one that cannot be (Llama
  4's batched experts) reads every context rank's tokens, as its exchange does (one note);
- any other op reading this rank's tokens (one that works along the sequence: a shift, a cumulative sum, a
  sort) reads the whole sequence, gathered back (``context_gather``), and computes the whole;
- a dropout in training on this rank's tokens (and on its piece over a tensor axis: ``split_dropout``) becomes
  ``context_dropout``: the whole tensor's mask drawn on every rank, this rank's part kept (serial's masks). SDPA's
  own attention dropout, and any random op on a tensor split over a tensor axis (``split_random``), draw inside
  the op: they read the whole sequence;
- where a whole tensor meets this rank's tokens it is cut before the matmuls that made it token by token (an
  attention computed whole: before its output projection), and before sequence parallelism's scatter of its
  tokens over a tensor axis (``passes.context_markers``);
- each output holding this rank's tokens is gathered, and every output with a gradient goes through
  ``context_output`` (the caller's gradient kept on one rank: see ``autopar.runtime.ops.context``).

Refused (``PlanError``, naming the op): ``native_dropout`` in training on this rank's tokens, a mean over the
tokens without counts of more than one dim. A graph with no such embedding, or whose
sequence does not divide into 2C chunks (a decode step of one token, a prompt of 6), is left whole, every
context rank computing all of it (one note); its outputs still go through ``context_output``.

Before -> After (HF Llama, S = 16, C = 2; this rank holds tokens 0-3 and 12-15)::

    ids = input_ids                                  ids = context_slice(input_ids, [dim 1 of 16, 2 ranks])
    h = embedding(W, ids)                            h = embedding(W, ids)                      # [B, 8, H]
    q = view(linear(h, Wq), [B, 16, 4, 8])     ->    q = view(linear(h, Wq), [B, 8, 4, 8])
    q = mul(q, cos)                                  q = mul(q, context_slice(cos, [dim 2 ...]))
    o = sdpa(q, k, v, None, 0.0, True)               o = context_attention(q, k, v, None, [causal])
    loss = cross_entropy_loss(lg, lb, None, 1)       per = cross_entropy_loss(lg, context_slice(lb), None, 0)
                                                     loss = batch_reduce(per, ne(lb', -100), [context])
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

import torch
from torch import fx

from autopar.compat import OpOverload
from autopar.decisions import Plan
from autopar.errors import PlanError
from passes.analysis.graph_facts import graph_copy, module_of, tensor_meta, token_lookups
from passes.analysis.token_rows import ExpertBlock, blocks_by_node, expert_blocks
from passes.context_experts import ExpertRules, after_inputs
from passes.context_markers import MarkerRules
from passes.context_shapes import SHAPE_OPS, ShapeRules, Unsplittable, ndim_of, shape_of
from passes.ir import (BatchReduceSpec, ContextAttentionSpec, ContextSpec, batch_reduce, context_attention,
                       context_gather, context_output, context_reduce, context_slice, convert_layout, expert_combine,
                       expert_dispatch, gather_output, gather_rows, reduce_partial, scatter_rows, sharded_embedding,
                       sharded_matmul, split_dropout, split_random, sum_grad, vocab_cross_entropy)
from passes.runner import PassResult

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default
_SAME = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
         aten.lift_fresh_copy.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
         aten.type_as.default, aten.dropout.default, aten.native_dropout.default, aten.masked_fill.Scalar,
         aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther,
         aten.silu.default, aten.gelu.default, aten.relu.default, aten.ones_like.default, aten.zeros_like.default,
         aten.full_like.default, aten.empty_like.default}
_LOSSES = {aten.cross_entropy_loss.default}
#: Ops that read this rank's tokens whole, never per op: split_batch's gathers and scatters of the batch's rows,
#: and the expert exchanges of a module ``passes.analysis.token_rows`` could not prove per-token.
_WHOLE = {gather_rows, scatter_rows, expert_dispatch, expert_combine}
#: Gathers and scatters along a dim (their argument 1): token by token along another (DeepSeek-V3's router).
_INDEXED = {aten.gather.default, aten.scatter.value, aten.scatter.src, aten.scatter_.value, aten.scatter_.src}
#: Markers that work token by token (their specs name feature dims only).
_MARKERS = {reduce_partial, sum_grad, gather_output, convert_layout}


def split_context(gm: fx.GraphModule, plan: Plan | None = None) -> PassResult:
    ranks = plan.config.context if plan is not None else 1
    if ranks <= 1:
        return PassResult(gm, False)
    _, notes = _split(gm, ranks)
    for node in list(gm.graph.nodes):  # (cuts made for an op that then read the whole sequence)
        if node.target is context_slice and not node.users:
            gm.graph.erase_node(node)
    return PassResult(gm, True, notes)


def whole_reads(gm: fx.GraphModule, ranks: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What ``split_context`` would say of ``gm`` at context ``ranks`` (on a copy: ``gm`` is not changed), and
    the names of the nodes that would compute every context rank's tokens: those after a read of the whole
    sequence until its result meets this rank's tokens again, or every node where the sequence does not split.
    The plan prices them whole and says where they are (``autopar.planning.planner.decide_plan``)."""
    copy = graph_copy(gm)
    splitter, notes = _split(copy, ranks)
    if not splitter.seeded:
        return notes, tuple(n.name for n in copy.graph.nodes if n.op == "call_function")
    todo = [u for g in splitter.gathered.values() for u in g.users]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or splitter.state.get(n) is not None or n.target in (
                context_slice, context_output):
            continue
        seen.add(n)
        todo.extend(n.users)
    return notes, tuple(sorted(n.name for n in seen))


def _split(gm: fx.GraphModule, ranks: int) -> tuple[_Splitter, tuple[str, ...]]:
    """The splitter's walk over ``gm`` (changed in place), and its notes."""
    seeds = token_lookups(gm)
    tokens = {int(tensor_meta(ids).shape[-1]) for _, ids in seeds}
    if len(tokens) > 1:
        raise PlanError(f"context={ranks}: the model embeds sequences of different lengths {sorted(tokens)}; "
                        "autopar splits one sequence. Use context=1 for this model.")
    length = next(iter(tokens), 0)
    notes: tuple[str, ...] = ()
    if not seeds:
        symbolic = any(node.target in (aten.embedding.default, sharded_embedding)
                       and (val := tensor_meta(node.args[1])) is not None and val.dim() >= 2
                       and not isinstance(val.shape[-1], int) for node in gm.graph.nodes if node.op == "call_function")
        why = ("is captured for every sequence length (a symbolic length: evaluation, or training on a second "
               "length)" if symbolic else "looks up no token ids of a user input")
        notes = (f"context={ranks}: this call's graph {why}; every context rank computes all of it",)
    elif length % (2 * ranks):
        notes = (f"context={ranks}: a call of {length} tokens, which do not split into 2 x {ranks} = {2 * ranks} "
                 f"equal chunks (each rank holds two, for causal attention's balance), runs whole on every context "
                 f"rank; pad sequences to a multiple of {2 * ranks} to split them",)
        seeds = []
    # (whole or split, every output goes through context_output: the caller's gradient, the same on every
    # context rank, counts once)
    splitter = _Splitter(gm, length, ranks)
    splitter.run(seeds)
    return splitter, notes + tuple(splitter.notes) + tuple(splitter.whole_notes())


class _Splitter(ShapeRules, MarkerRules, ExpertRules):
    def __init__(self, gm: fx.GraphModule, tokens: int, ranks: int) -> None:
        self.gm, self.graph, self.tokens, self.ranks = gm, gm.graph, tokens, ranks
        self.state: dict[fx.Node, Any] = {}  # node -> ContextSpec (this rank's tokens), tuple of them, or absent
        self.sliced: dict[tuple[fx.Node, ContextSpec], fx.Node] = {}
        self.gathered: dict[fx.Node, fx.Node] = {}
        blocks = expert_blocks(gm)
        for block in blocks:
            after_inputs(gm.graph, block)
        self.blocks = blocks_by_node(blocks)
        self.notes: list[str] = []
        self.unproved: dict[fx.Node, tuple[ExpertBlock, str]] = {}  # a node of a block not proved -> it, why
        self.read_whole: dict[ExpertBlock, str] = {}  # such blocks some of whose ops then read every token
        self.whole_reads: dict[str, set[str]] = {}  # module -> the ops there that read the whole sequence
        self.seeded = False  # whether any token lookup was cut (else the graph runs whole)

    def spec(self, dim: int, outer: int = 1, inner: int = 1) -> ContextSpec:
        return ContextSpec(dim, self.tokens, self.ranks, outer, inner)

    # -- inserting markers -------------------------------------------------------------------------------------
    def _marker(self, target: Any, args: tuple, before: fx.Node, like: fx.Node) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args)
        if "val" in like.meta:  # (the logical value, as every rewritten node keeps)
            node.meta["val"] = like.meta["val"]
        return node

    def slice_of(self, whole: fx.Node, spec: ContextSpec, user: fx.Node) -> fx.Node:
        key = (whole, spec)
        if key not in self.sliced:
            after = whole.next if whole.op != "placeholder" else self._after_placeholders()
            self.sliced[key] = self._marker(context_slice, (whole, spec), after, whole)
            self.state[self.sliced[key]] = spec
        return self.sliced[key]

    def _after_placeholders(self) -> fx.Node:
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        return last.next

    def whole_of(self, node: fx.Node) -> fx.Node:
        if node not in self.gathered:
            self.gathered[node] = self._marker(context_gather, (node, self.state[node]), node.next, node)
        return self.gathered[node]

    # -- the walk ----------------------------------------------------------------------------------------------
    def run(self, seeds: list[tuple[fx.Node, fx.Node]]) -> None:
        self.seeded = bool(seeds)
        for emb, ids in seeds:
            spec = self.spec(ndim_of(ids) - 1)
            emb.replace_input_with(ids, self.slice_of(ids, spec, emb))
            self.state[emb] = spec
        seeded = {emb for emb, _ in seeds}
        done: set[fx.Node] = set()
        tried: set[ExpertBlock] = set()
        for node in list(self.graph.nodes):
            if node in done:
                continue
            if node.op == "output":
                self._outputs(node)
            elif node.op == "call_function" and node not in seeded and node.target not in (
                    context_slice, context_gather):
                if any(self.state.get(a) is not None for a in node.all_input_nodes):
                    block = self.blocks.get(node)
                    if block is not None and block not in tried:
                        tried.add(block)
                        why = self.expert_block(block)
                        if why is None:
                            done.update(block.nodes)
                            continue
                        self.unproved.update((n, (block, why)) for n in block.nodes)
                    self._visit(node)

    def _visit(self, node: fx.Node) -> None:
        target = node.target
        if target in _WHOLE:  # (the rows of the whole batch, or every token routed: of the whole sequence)
            for a in node.all_input_nodes:
                if isinstance(self.state.get(a), ContextSpec):
                    node.replace_input_with(a, self.whole_of(a))
                    self._read_whole(node)
            return
        try:
            self.state[node] = self._rule(node)
        except Unsplittable:
            for a in node.all_input_nodes:
                if self.state.get(a) is not None and not isinstance(self.state[a], tuple):
                    node.replace_input_with(a, self.whole_of(a))
                    self._read_whole(node)
                elif isinstance(self.state.get(a), tuple):
                    raise PlanError(f"context={self.ranks}: {node.name} ({target}) reads a tuple of this rank's "
                                    "tokens along the sequence; autopar cannot gather it. Use context=1.") from None
            self.state.pop(node, None)

    def _read_whole(self, node: fx.Node) -> None:
        if node in self.unproved:  # (said of its block: what its routing could not prove)
            block, why = self.unproved[node]
            self.read_whole[block] = why
            return
        if node.target is gather_output:  # (an output gathered over the batch: outputs are gathered whole anyway)
            return
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if node.target is split_random or (node.target is SDPA and dict(zip(("attn_mask", "dropout_p"), node.args[3:]),
                                                                        **node.kwargs).get("dropout_p", 0.0)):
            name = f"{'attention' if SDPA in (node.target, node.args[0]) else 'a random op'}'s dropout, drawn whole"
        self.whole_reads.setdefault(module_of(node) or "the model's top level", set()).add(name)

    def whole_notes(self) -> list[str]:
        """One note per routed-experts module that read every context rank's tokens, and one per kind of other
        module (its repeats' indices as ``*``) whose ops read the whole sequence: every context rank computes all
        the tokens there."""
        out = [f"context={self.ranks}: {block.module} computes the tokens of every context rank (its experts "
               f"read them whole): {why}" for block, why in self.read_whole.items()]
        kinds: dict[str, set[str]] = {}
        for module, ops in self.whole_reads.items():
            kinds.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", module), set()).update(ops)
        return out + [f"context={self.ranks}: {kind} reads the whole sequence ({', '.join(sorted(names)[:4])}): every "
                      "context rank computes all its tokens there (serial's numbers, C times the work)"
                      for kind, names in sorted(kinds.items())]

    def _rule(self, node: fx.Node) -> Any:
        t = node.target
        if t is operator.getitem:
            src, i = node.args
            parts = self.state.get(src)
            return parts[i] if isinstance(parts, tuple) else self._unsplittable()
        if t in (aten.embedding.default, sharded_embedding):
            return self._embedding(node)
        if t is SDPA:
            return self._attention(node)
        if t in _LOSSES or t is vocab_cross_entropy:
            return self._loss(node)
        if t is batch_reduce:
            return self._batch_reduce(node)
        if t in (aten.linear.default, sharded_matmul):
            return self._linear(node)
        if t in (aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default):
            return self._matmul(node)
        if t in SHAPE_OPS:
            return self.shape_rule(node)
        if t in (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default, aten.amax.default,
                 aten.var.correction, aten.std.correction):
            return self._reduction(node)
        if t in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default):
            return self._along(node, node.args[1])
        if t is aten.topk.default:  # (a router's picks along the experts)
            spec = self._along(node, node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1))
            return (spec, spec)
        if t in _INDEXED:
            return self._indexed(node)
        if t in (aten.layer_norm.default, aten.rms_norm.default):
            return self._normed(node)
        if t in (split_dropout, aten.dropout.default):
            return self.dropout_rule(node)
        if t is aten.native_dropout.default:
            self.refuse_dropout(node)
            return self._elementwise(node)
        if t in _MARKERS:
            return self.marker_rule(node)
        if t in _SAME or (isinstance(t, OpOverload) and torch.Tag.pointwise in t.tags):
            return self._elementwise(node)
        return self._unsplittable()

    @staticmethod
    def _unsplittable() -> Any:
        raise Unsplittable

    # -- rules -------------------------------------------------------------------------------------------------
    def _aligned(self, node: fx.Node, src: ContextSpec, src_ndim: int, other: Any) -> Any:
        """``other`` (an operand broadcast against a tensor of ``src_ndim`` dims split as ``src``) as this rank's
        tokens: cut where it is whole and has the tokens' dim; None where it broadcasts over it."""
        if not isinstance(other, fx.Node) or ndim_of(other) is None:
            return other
        at = src.dim - (src_ndim - ndim_of(other))
        if at < 0:
            return other
        have = self.state.get(other)
        if have is not None:
            if isinstance(have, tuple) or have != dataclasses.replace(src, dim=at):
                raise Unsplittable
            return other
        size = shape_of(other)[at]
        if size == 1:
            return other
        if size != src.outer * self.tokens * src.inner:
            raise Unsplittable
        want = dataclasses.replace(src, dim=at)
        if (other.target is sharded_embedding and other.args[3].scatter_dim == at and len(other.users) == 1
                and isinstance(ids := other.args[1], fx.Node) and ndim_of(ids) == ndim_of(other) - 1
                and self.state.get(ids) is None):
            # a lookup whose rows sequence parallelism scatters over a tensor axis along the tokens (nanoGPT's
            # positions' table): its ids are cut instead, so that it scatters this rank's tokens
            other.replace_input_with(ids, self.slice_of(ids, want, other))
            self.state[other] = want
            return other
        if self.cut_early(other, want):  # (before a scatter over a tensor axis, or the matmuls that made it)
            return other
        return self.slice_of(other, want, node)

    def _split_of(self, x: Any) -> ContextSpec:
        """How ``x`` holds this rank's tokens; raises ``Unsplittable`` where it is whole or a tuple."""
        spec = self.state.get(x) if isinstance(x, fx.Node) else None
        if spec is None or isinstance(spec, tuple):
            raise Unsplittable
        return spec

    def _first_split(self, node: fx.Node) -> tuple[fx.Node, ContextSpec]:
        for a in node.all_input_nodes:
            s = self.state.get(a)
            if s is not None:
                if isinstance(s, tuple):
                    raise Unsplittable
                return a, s
        raise Unsplittable

    def _replace_args(self, node: fx.Node, fn: Any) -> None:
        args, kwargs = tuple(fn(a) for a in node.args), {k: fn(v) for k, v in node.kwargs.items()}
        node.args, node.kwargs = args, kwargs

    def _elementwise(self, node: fx.Node) -> ContextSpec:
        out = ndim_of(node)
        if out is None:
            raise Unsplittable
        src, spec = self._first_split(node)
        at = spec.dim + (out - ndim_of(src))
        result = dataclasses.replace(spec, dim=at)

        def cut(a: Any) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(cut(x) for x in a)
            return self._aligned(node, result, out, a) if isinstance(a, fx.Node) else a
        self._replace_args(node, cut)
        return result

    def _linear(self, node: fx.Node) -> ContextSpec:
        x = node.args[0]
        spec = self._split_of(x)
        if spec.dim == ndim_of(x) - 1:
            raise Unsplittable
        if any(self.state.get(a) is not None for a in node.all_input_nodes if a is not x):
            raise Unsplittable
        return spec

    def _matmul(self, node: fx.Node) -> ContextSpec:
        t = node.target
        a, b = (node.args[1], node.args[2]) if t is aten.addmm.default else (node.args[0], node.args[1])
        spec = self._split_of(a)
        if (spec.dim != ndim_of(a) - 2 or self.state.get(b) is not None or (ndim_of(b) or 0) < 2
                or (ndim_of(b) > 2 and t not in (aten.bmm.default, aten.matmul.default))
                or (t is aten.addmm.default and self.state.get(node.args[0]) is not None)):
            raise Unsplittable  # (a whole right operand's batch dims are not the tokens': Llama 4's experts)
        return dataclasses.replace(spec, dim=ndim_of(node) - 2)

    def _embedding(self, node: fx.Node) -> ContextSpec:
        ids = node.args[1]
        spec = self._split_of(ids)
        if self.state.get(node.args[0]) is not None:
            raise Unsplittable
        return spec

    def _reduction(self, node: fx.Node) -> Any:
        x = node.args[0]
        spec = self._split_of(x)
        n = ndim_of(x)
        t = node.target
        if t in (aten.sum.default, aten.mean.default):
            dims, keep = list(range(n)), False
        else:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            dims = list(range(n)) if dims is None or dims == [] else [d % n for d in dims]
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if spec.dim not in dims:
            return dataclasses.replace(spec, dim=spec.dim if keep else spec.dim - sum(1 for d in dims if d < spec.dim))
        if t not in (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default):
            raise Unsplittable
        # a sum over the tokens: this rank's part, completed over the context ranks; a mean: the whole count's
        if t in (aten.mean.dim, aten.mean.default):
            whole = 1
            shape = shape_of(x)
            for d in dims:
                whole *= shape[d]
            local = whole // self.ranks
            with self.graph.inserting_after(node):
                scaled = self.graph.call_function(aten.mul.Tensor, (node, local / whole))
            scaled.meta["val"] = node.meta.get("val")
            done = scaled
        else:
            done = node
        with self.graph.inserting_after(done):
            total = self.graph.call_function(context_reduce, (done, spec))
        total.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(total, delete_user_cb=lambda u: u not in (total, done))
        self.state[total] = None
        return None

    def _along(self, node: fx.Node, dim: int) -> ContextSpec:
        x = node.args[0]
        spec = self._split_of(x)
        if dim % ndim_of(x) == spec.dim:
            raise Unsplittable
        return spec

    def _indexed(self, node: fx.Node) -> ContextSpec:
        src, spec = self._first_split(node)
        n = ndim_of(node)
        if n is None or ndim_of(src) != n or node.args[1] % n == spec.dim:
            raise Unsplittable
        self._replace_args(node, lambda a: self._aligned(node, spec, n, a) if isinstance(a, fx.Node) else a)
        return spec

    def _normed(self, node: fx.Node) -> ContextSpec:
        x, shape = node.args[0], node.args[1]
        spec = self._split_of(x)
        if spec.dim >= ndim_of(x) - len(shape):
            raise Unsplittable
        if any(self.state.get(a) is not None for a in node.all_input_nodes if a is not x):
            raise Unsplittable
        return spec

    def _attention(self, node: fx.Node) -> ContextSpec:
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        params = dict(zip(names, node.args[3:]), **node.kwargs)
        q, k, v = node.args[:3]
        sq, sk, sv = (self.state.get(x) for x in (q, k, v))
        n = ndim_of(q)
        want = self.spec(n - 2)
        if sq != want or (sk is None) != (sv is None) or (sk is not None and (sk != want or sv != want)):
            raise Unsplittable
        if params.get("dropout_p", 0.0):  # (its mask is drawn inside the kernel: whole, it is serial's)
            raise Unsplittable
        mask = params.get("attn_mask")
        if isinstance(mask, fx.Node):
            if self.state.get(mask) is not None:
                raise Unsplittable
            if shape_of(mask)[-2] != 1:
                mask = self.slice_of(mask, self.spec(ndim_of(mask) - 2), node)
        if shape_of(q)[-2] != self.tokens or (sk is None and shape_of(k)[-2] != self.tokens
                                              and params.get("is_causal")):
            raise Unsplittable
        spec = ContextAttentionSpec(self.tokens, self.ranks, bool(params.get("is_causal")), params.get("scale"),
                                    bool(params.get("enable_gqa")), gather_kv=sk is not None)
        with self.graph.inserting_before(node):
            new = self.graph.call_function(context_attention, (q, k, v, mask, spec))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        self.state[new] = want
        return want

    def _loss(self, node: fx.Node) -> Any:
        x, target = node.args[0], node.args[1]
        spec = self._split_of(x)
        if ndim_of(x) != 2 or spec.dim != 0:
            raise Unsplittable
        if node.target is vocab_cross_entropy:
            loss = node.args[2]
            reduction, ignore = loss.reduction, loss.ignore_index
        else:
            names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
            given = dict(zip(names, node.args), **node.kwargs)
            args = [given.get(k, d) for k, d in zip(names, (None, None, None, 1, -100, 0.0))]
            if args[2] is not None:
                raise Unsplittable  # (class weights: the mean's count is their sum)
            reduction, ignore = args[3], args[4]
        cut = self._aligned(node, dataclasses.replace(spec, dim=0), 1, target)
        if cut is not target:
            node.replace_input_with(target, cut)
            if node.target is not vocab_cross_entropy:
                args[1] = cut
        if reduction == 0:
            return spec
        if node.target is vocab_cross_entropy:
            node.args = (node.args[0], node.args[1], dataclasses.replace(node.args[2], reduction=0))
        else:
            args[3] = 0
            node.args, node.kwargs = tuple(args), {}
        with self.graph.inserting_before(node.next):
            valid = self.graph.call_function(aten.ne.Scalar, (cut, ignore))
            counts = self.graph.call_function(aten._to_copy.default, (valid,), {"dtype": torch.float32})
            total = self.graph.call_function(batch_reduce, (node, counts if reduction == 1 else None,
                                                            BatchReduceSpec(reduction == 1, context=True)))
        total.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(total, delete_user_cb=lambda u: u is not total and u is not valid)
        self.state[valid] = self.state[counts] = spec
        return spec

    def _batch_reduce(self, node: fx.Node) -> None:
        values, counts, spec = node.args
        have = self.state.get(values)
        if have is None or isinstance(have, tuple) or have.dim != 0:
            raise Unsplittable
        if counts is None and spec.mean:
            if ndim_of(values) != 1:
                raise PlanError(f"context={self.ranks}: {node.name} takes a mean over the tokens of per-token values "
                                "with more than one dim; autopar cannot count them. Use context=1 for this model.")
            with self.graph.inserting_before(node):
                counts = self.graph.call_function(aten.ones_like.default, (values,))
            counts.meta["val"] = values.meta.get("val")
            self.state[counts] = have
        elif isinstance(counts, fx.Node):
            counts = self._aligned(node, have, ndim_of(values), counts)
        node.args = (values, counts, dataclasses.replace(spec, context=True))
        return None

    def _outputs(self, out: fx.Node) -> None:
        def fix(a: Any) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(fix(x) for x in a)
            if isinstance(a, dict):
                return {k: fix(v) for k, v in a.items()}
            if not isinstance(a, fx.Node) or tensor_meta(a) is None:
                return a
            spec = self.state.get(a)
            if isinstance(spec, tuple):
                raise PlanError(f"context={self.ranks}: output {a.name} is a tuple of this rank's tokens; autopar "
                                "cannot gather it. Use context=1 for this model.")
            if spec is None and not tensor_meta(a).is_floating_point():
                return a  # (context_output keeps a floating output's gradient on one rank when it has one)
            source = a.args[0] if a.target is gather_output else a
            whole = ContextSpec(0, self.tokens, self.ranks, split=False,
                                reduced=getattr(source, "target", None) is batch_reduce)
            whole = whole if spec is None else spec
            return self._marker(context_output, (a, whole), out, a)
        out.args = fix(out.args)
