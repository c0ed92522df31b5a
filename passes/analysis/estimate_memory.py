"""estimate_memory: what one training step keeps in memory on one rank, block by block.

The captured graph is run once on the meta device with autograd on, under saved-tensor hooks: every
tensor autograd keeps for backward is recorded with the node that produced it (its storage, so views
count once) and the node that saved it. Bytes are then made local with the layouts the plan gives:
a tensor split over row or col keeps ``1/row`` or ``1/col`` of its bytes (the batch is already this
rank's shard in the captured graph). A tensor a consumer re-lays out first (a gather before a
LayerNorm) is saved in the consumer's layout.

The meta run must take whatever eager takes: each output gets the strides the capture recorded (eager's;
a kernel picked on meta may lay out otherwise, and the capture drops ``.contiguous()`` calls eager's layout
made no-ops). An op that still does not run on meta gets stand-ins from its recorded value (what it saves
is not counted), and a graph the run cannot take at all a shapes-only estimate; either logs one warning.

Segments are the chain the checkpoint solver works on: the graph's nodes in order, cut where the
owning module moves to another block of a ModuleList (``model.layers.3``); nodes outside any block
(embeddings, the head, the loss) form segments that are never recomputed. Tensors saved by a segment
but made two or more segments earlier (attention masks, rotary tables, T5's position bias, graph
inputs) stay alive whatever is recomputed: they are counted once, in a first segment ``<shared>``.

The model's outputs, which the caller holds through backward, are counted in ``<shared>``; a last
segment ``<loss>`` is an allowance for the caller's loss (none where the model computes its own: a scalar
output, HF's ``labels=``).

Per segment:
- ``saved_bytes``: tensors it keeps for backward, each storage counted at its first saver;
- ``input_bytes``: what the segment before it produced and it reads: what a checkpoint adds to keep;
- ``peak_bytes``: the largest tensor it produces, twice (a gradient and its input's gradient are
  live at once in its backward), or what a gather before one of its ops builds: transient memory
  on top of what is kept;
- ``flops``: forward FLOPs of its matmuls and attention products on this rank (what recomputing it
  costs); ``attention_flops`` the attention's alone.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import operator
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.compat import pytree
from autopar.decisions import Plan
from passes.analysis.graph_facts import (MatmulMatch, attention_flops, causal_attention, module_of, param_name, rows_of, tensor_meta,
                                         writes_state)
from passes.analysis.layout_rules import LayoutResult
from passes.analysis.make_plan import layouts_for
from passes.analysis.optimizer_shards import kept_numel
from passes.ir import Sharding, graph_info, input_info, vocab_cross_entropy

log = logging.getLogger(__name__)

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_LOWER_PRECISION = frozenset({
    torch.ops.aten.linear.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default, torch.ops.aten.matmul.default, _SDPA,
})
_BUCKET_BYTES = 25 * 2**20
"""The gradient sync's bucket cap (``search_plans.BUCKET_BYTES``, which imports this module)."""
SCATTER_BUCKETS_HELD = 3
"""Buckets of whole gradients the gradient sync holds at most under ``shard_optimizer``: the one filling, and
those whose reduce-scatter still runs (``autopar.runtime.data_parallel.grad_sync.INFLIGHT`` is one less)."""
MAX_PIECES = 16
"""A compiled training graph is cut in at most this many pieces (``autopar.runtime.compiled.pieces``): each
piece costs a compiled call each way a step, so a large model's pieces hold more than a bucket each."""
_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class SegmentCost:
    name: str
    """The block's FQN (``model.layers.3``), or ``<outside>#k`` for the k-th run of nodes outside blocks."""
    checkpointable: bool
    saved_bytes: int
    input_bytes: int
    peak_bytes: int
    flops: int
    ops: int = 0
    """Operators its forward calls (each with its backward: a step's dispatch overhead)."""
    attention_flops: int = 0
    """Forward FLOPs of its attention products on this rank (``graph_facts.attention_flops``, over the
    heads this rank holds); also in ``flops``."""
    copies: int = 1
    """Micro-batches whose activations of it are held at once (a pipeline rank's in flight): each keeps
    what it saves (or, recomputed, its inputs); one at a time runs it, with its transients."""


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    segments: tuple[SegmentCost, ...]
    param_bytes: int
    """This rank's parameters (fp32)."""
    grad_bytes: int
    """Gradients of this rank's trainable parameters; under ``shard_optimizer`` without pipeline stages, 1/data
    of them and a few buckets' worth whole (``scattered_grad_bytes``); with stages, whole (they sum their
    gradients after the last micro-batch)."""
    optimizer_bytes: int
    """Optimizer state: two fp32 tensors per trainable parameter (Adam's moments)."""
    frozen: tuple[str, ...] = ()
    """Parameters that need no gradient."""
    largest_param_bytes: int = 0
    """The largest parameter, whole (fp32): deferred construction holds it besides this rank's pieces."""
    output_bytes: int = 0
    """The model's outputs, whole on every rank (counted in ``<shared>``)."""
    compiled_grad_bytes: int = 0
    """``grad_bytes`` where the backward is compiled (``compiled_recompute``); 0: the same. Under
    ``shard_optimizer``, besides what the sync holds (``scattered_grad_bytes``), the whole gradients one compiled
    piece returns at once (``autopar.runtime.compiled.pieces``: a bucket's worth), which live until the sync
    has packed each into its bucket."""

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def block_of(module: str) -> str | None:
    """The repeated block a module belongs to (``model.layers.3.mlp`` -> ``model.layers.3``), if any."""
    m = _BLOCK.match(module)
    return m.group(1) if m else None


def segment_names(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each computing node's segment. Nodes without module metadata (inserted by passes) join the
    segment of the node before them."""
    out: dict[fx.Node, str] = {}
    block, current, outside = "", "", -1
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.meta.get("nn_module_stack") or not current:
            block = block_of(module_of(node)) or ""
        if not current or (block or "<outside>") != (current if not current.startswith("<outside>")
                                                      else "<outside>"):
            if not block:
                outside += 1
            current = block or f"<outside>#{outside}"
        out[node] = current
    return out


def shard_fraction(s: Sharding, sizes: dict[str, int]) -> Fraction:
    return Fraction(1) if s.is_replicated else Fraction(1, sizes[s.axis])


def _storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _meta_inputs(gm: fx.GraphModule) -> list[Any]:
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        info = input_info(node)
        if isinstance(val, torch.Tensor):
            t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
            grad = info is not None and info.requires_grad and t.is_floating_point()
            out.append(t.requires_grad_(grad))
        else:
            out.append(val)
    return out


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else ""


def _eager_strides(out: Any, val: Any) -> Any:
    """``out`` with the strides the capture recorded (eager's), as a view of its own storage (counted once).

    A kernel picked on meta may lay its output out otherwise: SDPA's math path, which meta takes where
    CPU and GPU run a fused kernel, is contiguous where those keep the query's layout, and the capture
    drops a ``.contiguous()`` that eager's layout made a no-op, so a later ``view`` fails on meta only.
    """
    if isinstance(out, (tuple, list)) and isinstance(val, (tuple, list)) and len(out) == len(val):
        return type(out)([_eager_strides(o, v) for o, v in zip(out, val)])
    if not isinstance(out, torch.Tensor) or not isinstance(val, torch.Tensor) or out.shape != val.shape:
        return out
    stride = tuple(val.stride())
    if tuple(out.stride()) == stride or not all(type(s) is int for s in (*val.shape, *stride)):
        return out
    extent = 1 + sum((size - 1) * st for size, st in zip(val.shape, stride)) if val.numel() else 0
    if (out.storage_offset() + extent) * out.element_size() > out.untyped_storage().nbytes():
        return out  # that layout needs more than this storage (out is a broadcast view)
    return out.as_strided(val.shape, stride, out.storage_offset())


def _shape_only(rec: _Recorder, gm: fx.GraphModule) -> None:
    """The stride-free estimate, for a graph the meta run cannot take at all: every floating-point tensor an
    op makes (from its recorded value; views excluded) is taken as kept for backward by that op."""
    rec.saved.clear()
    rec.producer.clear()
    rec.largest.clear()
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "is_view", False):
            continue
        for t in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                key = -len(rec.producer) - 1  # not a storage: one key per tensor
                nbytes = int(t.numel()) * t.element_size()
                rec.producer[key] = node
                rec.saved.append((node, key, nbytes, None))
                rec.largest[node] = max(rec.largest.get(node, 0), nbytes)


class _Recorder(fx.Interpreter):
    """Runs the graph on meta tensors; remembers which node produced each storage and who saved what."""

    def __init__(self, gm: fx.GraphModule, dtype: torch.dtype | None = None,
                 shard_saving: frozenset[fx.Node] = frozenset(), device: str = "cpu") -> None:
        super().__init__(gm)
        self.dtype, self.shard_saving, self.device = dtype, shard_saving, device
        self.producer: dict[int, fx.Node] = {}
        self.saved: list[tuple[fx.Node, int, int, fx.Node | None]] = []
        """(saver, storage, bytes, the saver's input node holding that storage, if any)."""
        self._read: dict[int, fx.Node] = {}  # storages of the current node's inputs -> input node
        self.layout_source: dict[int, fx.Node] = {}
        """Copies an op makes of an input (autocast casts, SDPA's additive mask): laid out as that input."""
        self.current: fx.Node | None = None
        self.largest: dict[fx.Node, int] = {}
        """Bytes of each node's largest output, in the dtype it ran in."""
        self._alive: list[torch.Tensor] = []  # keeps storages (and their keys) alive
        self._subgraphs: dict[int, tuple[fx.GraphModule, fx.GraphModule]] = {}
        self.failed: list[str] = []
        """Nodes that did not run on meta (their recorded values stood in), described."""

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        # Tensors the model makes on its own device (torch.ones(n, device=...)) are made on meta here.
        args, kwargs = pytree.tree_map_only(torch.device, lambda _: torch.device("meta"), (args, kwargs))
        args, kwargs = pytree.tree_map_only(fx.GraphModule, self._on_meta, (args, kwargs))  # no_grad regions
        if self.dtype is not None and n.target in _LOWER_PRECISION:
            # What autocast does to matmuls and attention (CPU and CUDA alike): a cast copy goes in,
            # and that copy is what backward keeps. Other ops follow type promotion, as under autocast.
            # 3D-sharded matmuls keep the fp32 shard, not a cast copy: their copies count as the parameter.
            params = {id(self.env[a]): a for a in n.all_input_nodes
                      if n in self.shard_saving and param_name(a) is not None}

            def cast(t: torch.Tensor) -> torch.Tensor:
                if not t.is_floating_point():
                    return t
                out = t.to(self.dtype)
                self._alive.append(out)  # its storage key must not be reused by a later tensor
                if id(t) in params:
                    self.producer[_storage_key(out)] = params[id(t)]
                elif (source := self._read.get(_storage_key(t))) is not None and param_name(source) is None:
                    # A cast copy is laid out as its source. Weights of other matmuls are cast and kept
                    # by autocast itself: they count in the matmul's layout.
                    self.layout_source[_storage_key(out)] = source
                return out
            args, kwargs = pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))
        return args, kwargs

    def _on_meta(self, sub: fx.GraphModule) -> fx.GraphModule:
        """A copy of a higher-order op's subgraph that makes its tensors on meta."""
        if id(sub) not in self._subgraphs:
            graph = copy.deepcopy(sub.graph)
            for node in graph.nodes:
                if node.op == "call_function":
                    node.args, node.kwargs = pytree.tree_map_only(
                        torch.device, lambda _: torch.device("meta"), (node.args, node.kwargs))
            self._subgraphs[id(sub)] = (sub, fx.GraphModule(sub, graph))
        return self._subgraphs[id(sub)][1]

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        self._read = {}
        for a in n.all_input_nodes:
            for t in pytree.tree_leaves(self.env.get(a)):
                if isinstance(t, torch.Tensor):
                    self._read.setdefault(_storage_key(t), a)
        try:
            out = self._attention(n) if n.target is _SDPA else super().run_node(n)
        except Exception as e:  # noqa: BLE001  (an analysis must not stop a model that runs eagerly)
            out = self._recorded(n, e)
        out = _eager_strides(out, n.meta.get("val"))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                owner = self.producer.setdefault(_storage_key(t), n)
                self._alive.append(t)
                if owner.op != "placeholder":  # (a view of a parameter or an input allocates nothing: a transposed
                    # 3-D expert weight, DeepSeek-V3's 28 GiB whole, is no transient of its block)
                    self.largest[n] = max(self.largest.get(n, 0), t.numel() * t.element_size())
        return out

    def _recorded(self, n: fx.Node, error: Exception) -> Any:
        """Stand-ins for the outputs of a node that does not run on meta, made from the values the capture
        recorded (shapes, dtypes, eager's strides): the run goes on, without what that op itself saves."""
        if n.op in ("placeholder", "output"):
            raise error
        grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for a in n.all_input_nodes for t in pytree.tree_leaves(self.env.get(a)))

        def fresh(v: torch.Tensor) -> torch.Tensor:
            t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
            return t.requires_grad_(grad and (t.is_floating_point() or t.is_complex()))
        self.failed.append(f"{n.name} ({n.target}: {type(error).__name__}: {_first_line(error)})")
        return pytree.tree_map_only(torch.Tensor, fresh, n.meta.get("val"))

    def _attention(self, n: fx.Node) -> Any:
        """SDPA on meta takes the math path, which keeps the attention matrix; on CPU and GPU fused
        kernels run and keep only q, k, v, the output and the row log-sum-exp. Run the CPU one (which, as
        eager picks it, also takes grouped-query k and v with fewer heads, ``enable_gqa``)."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        params = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]), **kwargs)
        mask = params.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.requires_grad:
            return super().run_node(n)  # the math path runs for this on CPU too
        if args[2].shape[-1] != args[0].shape[-1]:  # (DeepSeek's MLA: values narrower than queries and keys)
            if self.device == "cuda" and args[1].shape[-3] == args[0].shape[-3] and mask is None:
                # a GPU's memory-efficient kernel takes them: it keeps q, k, v, the output and the log-sum-exp
                return torch.ops.aten._scaled_dot_product_efficient_attention(
                    *args[:3], None, True, params.get("dropout_p", 0.0), params.get("is_causal", False),
                    scale=params.get("scale"))[0]
            return super().run_node(n)  # the CPU's fused kernel takes one head size: eager runs the math path
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            source = self._read.get(_storage_key(mask))
            mask = mask.to(args[0].dtype)  # the kernel turns a boolean mask into an additive one, and keeps it
            self._alive.append(mask)
            if source is not None:  # laid out as the mask (not split by heads)
                self.layout_source[_storage_key(mask)] = source
        try:
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *args[:3], params.get("dropout_p", 0.0), params.get("is_causal", False),
                attn_mask=mask, scale=params.get("scale"))
        except RuntimeError:
            if not params.get("enable_gqa"):
                raise
            return super().run_node(n)  # a torch whose CPU kernel takes no grouped-query k/v: eager's math path
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.current is not None and self.current.op == "call_function":
            key = _storage_key(t)
            self.saved.append((self.current, key, t.untyped_storage().nbytes(), self._read.get(key)))
        return t


def _meta_run(gm: fx.GraphModule, compute_dtype: torch.dtype | None, three_d: frozenset[fx.Node],
              device: str = "cpu") -> _Recorder:
    """The graph run once on meta under saved-tensor hooks (what every tensor's producer and saver are);
    a graph the run cannot take gets the shapes-only record. Read only afterwards. ``device``: the device type
    training runs on (which attention kernel runs)."""
    rec = _Recorder(gm, compute_dtype, three_d, device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            rec.run(*_meta_inputs(gm))
    except Exception as e:  # noqa: BLE001  (an estimate must not stop a model that runs eagerly)
        _shape_only(rec, gm)
        log.warning("autopar: the memory estimate could not run %s on meta (%s: %s); it counts every tensor an "
                    "op makes as kept (shapes only)", type(gm).__name__, type(e).__name__, _first_line(e))
    else:
        if rec.failed:
            log.warning("autopar: the memory estimate could not run %s on meta; it uses the recorded shapes of "
                        "%d op(s) instead (what they save is not counted)", rec.failed[0], len(rec.failed))
    rec.env.clear()  # (the run's values: only its records are read)
    return rec


def estimate_memory(gm: fx.GraphModule, plan: Plan, compute_dtype: torch.dtype | None = None,
                    runs: dict[Any, Any] | None = None,
                    layouts: tuple[LayoutResult, dict[fx.Node, MatmulMatch]] | None = None,
                    device: str = "cpu") -> MemoryProfile:
    """Saved-for-backward bytes per segment of ``gm`` (captured for this rank's batch) under ``plan``, training
    on ``device`` (a device type: "cuda" runs an attention whose values are narrower than its keys, MLA's, on the
    memory-efficient kernel, which keeps no scores; a CPU runs it on the math path, which does).

    ``compute_dtype`` (bf16/fp16 precision) casts the inputs of matmuls and attention, as autocast does.
    ``runs``: a dict the caller keeps while ``gm`` stays unchanged (the plan search's captures): the meta run
    depends only on the graph, ``compute_dtype`` and which matmuls are 3D-sharded, so grids alike in those
    share one (planning the 1T GPT's grids ran it 17 times for 3 distinct runs). ``layouts``: ``layouts_for(gm,
    plan)`` where the caller has it (read only).
    """
    config = plan.config
    sizes = {"row": config.row, "col": config.col}
    tokens = Fraction(1, config.context)  # (of each sequence, on this rank: context parallelism)
    whole = frozenset(plan.context_whole)  # (nodes computing every context rank's tokens: not scaled by ``tokens``)
    res, by_node = layouts or layouts_for(gm, plan)
    seg_of = segment_names(gm)
    three_d = frozenset(n for n, o in res.orientations.items() if o.is_3d)
    key = ("meta run", gm, compute_dtype, three_d, device)
    if runs is not None and key in runs:
        rec = runs[key]
    else:
        rec = _meta_run(gm, compute_dtype, three_d, device)
        if runs is not None:
            runs[key] = rec
    params = {node for node in gm.graph.nodes if param_name(node) is not None}

    order = ["<shared>", *dict.fromkeys(seg_of[n] for n in gm.graph.nodes if n in seg_of)]
    previous = dict(zip(order[1:], order))
    saved = dict.fromkeys(order, Fraction(0))
    inputs = dict.fromkeys(order, Fraction(0))
    counted: set[int] = set()
    saved_by: dict[fx.Node, Fraction] = {}  # (what each saver is the first to keep)
    for saver, key, nbytes, via in rec.saved:
        producer = rec.producer.get(key)
        if key in counted or producer in params:
            continue  # parameters are not activations
        counted.add(key)
        # A conversion before the saver keeps the tensor in the saver's layout, except a gather for matmuls that
        # keep this rank's tokens and gather them again in backward (sequence parallelism:
        # ``autopar.runtime.ops.sequence_parallel.Regather``).
        # a cross-entropy over a vocabulary split over ranks (``vocab_parallel_losses``) keeps this rank's logits
        # shifted by the row maxima and their exponentials, its piece of the classes, where torch's keeps one
        # log-softmax of them all
        vocab_split = saver in res.local_args and res.local_args[saver][0] is vocab_cross_entropy
        if vocab_split and producer is None:
            sharding = res.sharding(saver.args[0])
        elif producer is None:  # made inside the op: a copy of an input, or new (SDPA's log-sum-exp)
            source = rec.layout_source.get(key)
            sharding = (_kept_layout(res, saver, source) if source is not None else res.sharding(saver))
        else:
            sharding = _kept_layout(res, saver, via if via is not None else producer)
        seg = seg_of.get(saver, order[1])
        if producer is not None and seg_of.get(producer) not in (seg, previous[seg]):
            seg = "<shared>"  # read from further back (a mask, rotary tables): alive whatever is recomputed
        # context parallelism: this rank's tokens of each activation; causal attention keeps this rank's tokens of
        # the keys and values and gathers them again in backward, another keeps them gathered whole
        # (``autopar.runtime.ops.context``)
        gathered = (saver.op == "call_function" and saver.target is _SDPA and producer in saver.args[1:3]
                    and not causal_attention(saver))
        share = 1 if gathered or saver.name in whole else tokens
        amount = nbytes * shard_fraction(sharding, sizes) * (2 if vocab_split and producer is None else 1) * share
        saved[seg] += amount
        saved_by[saver] = saved_by.get(saver, 0) + amount

    peak = dict.fromkeys(order, Fraction(0))
    flops = dict.fromkeys(order, Fraction(0))
    attention = dict.fromkeys(order, Fraction(0))
    ops = dict.fromkeys(order, 0)
    read: dict[str, set[fx.Node]] = {name: set() for name in order}
    stateful: set[str] = set()  # segments that must not run twice (``graph_facts.writes_state``)
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node, seg in seg_of.items():
        if node.op == "call_function" and node.target is not operator.getitem:
            ops[seg] += 1
            if writes_state(node):
                stateful.add(seg)
        if node in rec.largest:
            peak[seg] = max(peak[seg], 2 * rec.largest[node] * shard_fraction(res.sharding(node), sizes))
        for arg in node.all_input_nodes:
            # Inputs made further back (masks, rotary tables) are shared by every block; they are
            # kept once, by their first saver, and not counted again here.
            if (arg in seg_of and seg_of[arg] == previous.get(seg) and arg not in read[seg]
                    and (val := tensor_meta(arg)) is not None):
                read[seg].add(arg)
                inputs[seg] += val.numel() * val.element_size() * shard_fraction(res.sharding(arg), sizes)
            dst = res.conversions.get((node, arg))
            if dst is not None and not res.sharding(arg).is_replicated and arg in rec.largest:
                # A gather before this op builds the whole tensor (and its gradient in backward).
                peak[seg] = max(peak[seg], 2 * rec.largest[arg] * shard_fraction(dst, sizes)
                                + rec.largest[arg] * shard_fraction(res.sharding(arg), sizes))
        m = by_node.get(node)
        every = config.context if node.name in whole else 1  # (all the tokens, where ``tokens`` scales below)
        if m is not None:
            o = plan.matmul(m.weight).orientation
            flops[seg] += Fraction(2 * rows_of(tensor_meta(m.x)) * m.in_features * m.out_features * every,
                                   config.size(o.in_axis) * config.size(o.out_axis))
        if (a := attention_flops(node)):  # over the heads this rank holds
            attention[seg] += a * shard_fraction(res.sharding(node), sizes) * every
            if config.context > 1:
                # backward holds the gathered keys' and values' whole gradients, a block's gradients of them and, to
                # reduce-scatter them, a copy in the ranks' order (causal attention: the keys and values gathered
                # again, instead of the copy, as a block's gradients are freed first)
                kv = sum(tensor_meta(x).numel() * tensor_meta(x).element_size() * shard_fraction(res.sharding(x), sizes)
                         for x in node.args[1:3])
                # and this rank's queries' gradient and the output's; by then what the segment's later ops keep is
                # freed (their backward ran first)
                later = sum(b for n, b in saved_by.items() if seg_of.get(n) == seg and index[n] > index[node])
                q = tensor_meta(node.args[0])
                q = q.numel() * q.element_size() * shard_fraction(res.sharding(node.args[0]), sizes)
                peak[seg] = max(peak[seg], (3 * kv - later) / tokens + 2 * q)  # (peaks are scaled by ``tokens`` below)

    segments = tuple(SegmentCost(name, not name.startswith("<") and name not in stateful, int(saved[name]),
                                 int(inputs[name] * tokens),
                                 int(peak[name] * tokens), int((flops[name] + attention[name]) * tokens),
                                 ops=ops[name], attention_flops=int(attention[name] * tokens))
                     for name in order)
    # The caller holds the outputs through backward; its loss is assumed to keep one tensor the size of
    # the largest output and to need two more in its backward, as cross-entropy on logits does. A model that
    # computes its loss (HF's labels=: a scalar output) has it in the graph, counted with the rest: the caller
    # only calls backward on it.
    # An output split on this rank is gathered at the end of forward: over features (this rank's piece, and its
    # rows whole, made of the gathered pieces), then over the batch (the pieces gathered, joined into the output).
    outputs = _output_bytes(gm)
    largest = max(outputs, default=0)
    gathered = max(_gather_bytes(gm, res, sizes), default=0)
    ends = (SegmentCost("<output>", False, 0, 0, gathered, 0),) if gathered else ()
    loss = () if loss_in_graph(gm) else (SegmentCost("<loss>", False, largest, 0, 2 * largest, 0),)
    segments = (dataclasses.replace(segments[0], saved_bytes=segments[0].saved_bytes + sum(outputs)), *segments[1:],
                *ends, *loss)
    frozen = tuple(name for node in params if (name := param_name(node)) and not res.requires_grad.get(node))
    return dataclasses.replace(static_memory(segments, plan, frozen), output_bytes=sum(outputs))


def _kept_layout(res: LayoutResult, saver: fx.Node, read: fx.Node) -> Sharding:
    dst = res.conversions.get((saver, read))
    if dst is None or (read, dst) in res.partial_gathers:
        return res.sharding(read)
    return dst


def compiled_recompute(profile: MemoryProfile) -> MemoryProfile:
    """``profile`` as ``compile=True`` runs it: each piece of the backward returns its gradients at once
    (``MemoryProfile.compiled_grad_bytes``). A recomputed segment keeps only its inputs, as eagerly: its
    collectives are recomputed too (``passes.insert_checkpoints.recomputed`` tells torch's partitioner, which
    otherwise keeps a collective's output from forward)."""
    return dataclasses.replace(profile, grad_bytes=profile.compiled_grad_bytes or profile.grad_bytes)


def loss_in_graph(gm: fx.GraphModule) -> bool:
    """Whether the model computes its loss: one of its outputs is a floating-point scalar (HF's ``labels=``)."""
    return any(t.dim() == 0 and t.is_floating_point() for _, t in _tensor_outputs(gm))


def _tensor_outputs(gm: fx.GraphModule) -> list[tuple[fx.Node, torch.Tensor]]:
    """The graph's tensor outputs with their metadata, in order."""
    leaves = [out for out in pytree.tree_leaves(gm.graph.output_node().args) if isinstance(out, fx.Node)]
    return [(out, t) for out in leaves if (t := tensor_meta(out)) is not None]


def _output_bytes(gm: fx.GraphModule) -> list[int]:
    """Bytes of each tensor output, full on every rank (gathered over features and the batch)."""
    batch = graph_info(gm).batch
    sizes = []
    for _, t in _tensor_outputs(gm):
        nbytes = t.numel() * t.element_size()
        if batch is not None and t.dim() and t.shape[0] == batch.local_sizes[batch.index]:
            nbytes = nbytes * batch.global_size // batch.local_sizes[batch.index]
        sizes.append(nbytes)
    return sizes


def _gather_bytes(gm: fx.GraphModule, res: LayoutResult, axes: dict[str, int]) -> list[int]:
    """For each output a rank gathers, what the gathers hold beside the output (``GatherOutputOp``): over its
    features, this rank's piece and its rows whole; over the batch, this rank's rows and the pieces gathered."""
    batch = graph_info(gm).batch
    out_bytes = []
    for out, t in _tensor_outputs(gm):
        nbytes, held = t.numel() * t.element_size(), 0
        split = (fraction := shard_fraction(res.sharding(out), axes)) < 1
        if split:
            held += nbytes + int(nbytes * fraction)
        if batch is not None and t.dim() and t.shape[0] == batch.local_sizes[batch.index] and \
                batch.global_size > batch.local_sizes[batch.index]:
            held += nbytes * batch.global_size // batch.local_sizes[batch.index] + (0 if split else nbytes)
        out_bytes.append(held)
    return out_bytes


def static_memory(segments: tuple[SegmentCost, ...], plan: Plan, frozen: tuple[str, ...]) -> MemoryProfile:
    """The profile of ``segments`` with parameter, gradient and optimizer bytes from ``plan``."""
    config = plan.config
    local = {p.name: p.local_numel(config) * 4 for p in plan.params}  # fp32
    trainable = sum(b for name, b in local.items() if name not in frozen)
    state = grads = trainable
    compiled_grads = 0
    if config.shard_optimizer and config.data > 1:  # each data rank keeps one chunk of every piece's state
        state = sum(local[p.name] if p.splits_over_data(config)  # (experts: this rank's already)
                    else 4 * kept_numel(p.shape, p.split_axes(config), config.data, p.fused_dims(config))
                    for p in plan.params if p.name not in frozen)
        if config.pipeline == 1:  # and of its gradient: the gradient sync frees each whole one once in its
            # bucket, so at most a few buckets of them are whole at once (``scattered_grad_bytes``)
            grads = scattered_grad_bytes(state, trainable)
            # compiled, a piece's backward returns its gradients at once, a bucket's worth
            # (``autopar.runtime.compiled.pieces``), and autograd copies one to lay it out like its parameter
            largest_local = max((b for name, b in local.items() if name not in frozen), default=0)
            compiled_grads = grads + min(trainable, piece_bytes(trainable) + largest_local)
    largest = max((4 * math.prod(p.shape) for p in plan.params), default=0)
    return MemoryProfile(segments, sum(local.values()), grads, 2 * state, frozen, largest,
                         compiled_grad_bytes=compiled_grads)


def piece_bytes(synced: int, bucket: int = _BUCKET_BYTES) -> int:
    """The synced gradient bytes a compiled piece holds (``autopar.runtime.compiled.pieces``), of ``synced`` in
    all: a ``bucket``'s worth, or more where that would make more than ``MAX_PIECES`` pieces."""
    return max(bucket, -(-synced // MAX_PIECES))


def scattered_grad_bytes(chunks: int, whole: int) -> int:
    """Gradient bytes a rank holds at most under ``shard_optimizer`` without pipeline stages: its ``chunks``
    of the sums, plus the whole gradients on their way into the reduce-scatter: the buckets (of up to 25 MiB,
    DDP's cap, ``search_plans.BUCKET_BYTES``) the sync holds at once (``SCATTER_BUCKETS_HELD``). A whole
    gradient goes once its bucket holds it."""
    return chunks + min(whole, SCATTER_BUCKETS_HELD * _BUCKET_BYTES)
