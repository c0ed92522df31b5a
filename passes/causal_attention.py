"""causal_attention: attention whose mask is a constant causal one runs with ``is_causal=True`` instead.

Under capture a transformer cannot look at its inputs' values, so HF's mask utilities cannot prove
their mask causal and skip it (as they do eagerly): the graph builds a ``[batch, 1, seq, seq]`` mask
from ``arange``s (HF 5.x also ANDs in a packed-sequence test on the position ids) and hands it to every
layer's attention, which turns it into a float bias it keeps for backward and which keeps a GPU off its
flash-attention kernel.

Requires: a captured graph with static shapes (each node's ``meta["val"]``).
Ensures: every ``scaled_dot_product_attention`` whose ``attn_mask`` is computed from no graph input
(parameters, buffers, constants and the user's inputs all count as inputs) by pure ops, and whose mask
equals the causal mask of its query and key lengths (boolean: ``j <= i``; additive: 0 there, -inf or
below half the dtype's lowest value elsewhere) on every broadcast row, is called with ``attn_mask=None,
is_causal=True``; the mask's nodes no other node reads are removed. Whether a mask is causal is decided
by running its nodes on CPU, so no pattern of HF's code is assumed: any other mask (a padding mask from
the user's ``attention_mask``, position ids the user passed, sliding windows, a decode step's
bottom-right mask) stays as it was. A mask over ``max_elements`` elements (a long sequence's) is evaluated
by blocks of query rows where its large values are computed row-wise (``_blockwise``: HF's comparisons of
position aranges), up to ``LIMIT`` elements (of one batch row and head where everything it is computed from is
the same along them: one is evaluated, and its decision remembered for the same ops on the same values, as the
next capture of a search brings them: ``_DECIDED``); otherwise, or with symbolic sizes, it stays too. Like every pass it leaves recompiling the changed graph to its caller (``passes.runner``; capture
recompiles once for this and its own cleanup).

Before -> After (HF Llama, seq 16)::

    pos = arange(16); ...                                   q, k, v = ...
    mask = and(le(index(pos, ..), index(pos, ..)), ...)  ->  o = sdpa(q, k, v, None, 0.0, True, scale=s)
    o = sdpa(q, k, v, mask, scale=s)
"""

from __future__ import annotations

import hashlib
import logging
import operator
from typing import Any

import torch
from torch import fx

from autopar.compat import OpOverload, op_schema, pytree
from passes.analysis.graph_facts import tensor_meta
from passes.runner import PassResult

SDPA = torch.ops.aten.scaled_dot_product_attention.default
log = logging.getLogger(__name__)

_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

#: Largest mask this pass evaluates (elements: 16 rows of 4,096 tokens). The evaluation holds about three
#: tensors of the mask's size at once; a mask left in place costs its size in every forward, and a float
#: bias of four times it in every layer.
MAX_ELEMENTS = 1 << 28


def causal_attention(gm: fx.GraphModule, plan: Any = None, *, max_elements: int = MAX_ELEMENTS) -> PassResult:
    computed: dict[fx.Node, list[fx.Node] | None] = {}  # a causal mask -> the nodes computing it; else None
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        params = dict(zip(_ARGS, node.args[3:]), **node.kwargs)
        mask = params.get("attn_mask")
        if not isinstance(mask, fx.Node) or params.get("is_causal"):
            continue
        if mask not in computed:  # (HF's layers share one mask: decided once)
            computed[mask] = _causal_nodes(mask, node, max_elements)
        if computed[mask] is None:
            continue
        node.args = (*node.args[:3], None, params.get("dropout_p", 0.0), True)
        node.kwargs = {k: params[k] for k in ("scale", "enable_gqa") if k in params}
        rewritten += 1
    if not rewritten:
        return PassResult(gm, False)
    doomed = {n for nodes in computed.values() if nodes for n in nodes}
    for n in reversed(list(gm.graph.nodes)):  # the masks' nodes nothing else reads
        if n in doomed and not n.users:
            gm.graph.erase_node(n)
    return PassResult(gm, True, (f"{rewritten} attention(s) run with is_causal=True: their mask was the causal one",))


def _ancestors(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and the nodes it is computed from, in graph order; None if any is not a pure op."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op != "call_function" or not _pure(n.target):
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _pure(target: Any) -> bool:
    if target is operator.getitem:
        return True
    if not isinstance(target, OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in op_schema(target).arguments)


def _static(n: fx.Node) -> bool:
    return all(isinstance(t, torch.Tensor) and all(isinstance(s, int) for s in t.shape)
               for t in pytree.tree_leaves(n.meta.get("val")))


def _evaluate(nodes: list[fx.Node], keep: frozenset[fx.Node] = frozenset(),
              env: dict[fx.Node, Any] | None = None) -> dict[fx.Node, Any]:
    """Runs ``nodes`` on CPU (reading the values of ``env`` too), dropping each value after its last reader
    among them unless it is the last node or in ``keep``; returns the values kept."""
    last_use: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        for i in n.all_input_nodes:
            last_use[i] = n
    env = dict(env or {})
    ours = set(nodes) - keep - {nodes[-1]}

    def value(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    for n in nodes:
        args, kwargs = pytree.tree_map(value, (tuple(n.args), dict(n.kwargs)))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        env[n] = n.target(*args, **kwargs)
        for i in n.all_input_nodes:
            if last_use.get(i) is n and i in ours:
                del env[i]
    return env


#: Ops a mask larger than the evaluation may build can be computed with, block of query rows by block: each
#: element of the result reads the elements at its own position of its (broadcast) inputs (``torch.Tag.pointwise``
#: and these), so a block of rows reads the same rows of its inputs.
_BLOCKWISE = frozenset({torch.ops.aten.__and__.Tensor, torch.ops.aten.__or__.Tensor, torch.ops.aten.__xor__.Tensor,
                        torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
                        torch.ops.aten.where.Scalar, torch.ops.aten.where.ScalarSelf, torch.ops.aten.where.ScalarOther,
                        torch.ops.aten.expand.default})

#: The largest mask evaluated at all (elements; by blocks of rows above ``max_elements``): 2^36 is 262,144
#: tokens a side, about a minute of CPU.
LIMIT = 1 << 36

#: Elements of a block of rows (at most ``max_elements``): a few values of its size live at once (64 MiB each
#: as booleans), whatever the sequence.
BLOCK = 1 << 26


def _blockwise(n: fx.Node, rows: int) -> bool:
    t = n.meta.get("val")
    return (isinstance(n.target, OpOverload) and (torch.Tag.pointwise in n.target.tags or n.target in _BLOCKWISE)
            and isinstance(t, torch.Tensor) and t.dim() >= 2 and int(t.shape[-2]) == rows)


def _rows_of(x: Any, start: int, stop: int, rows: int) -> Any:
    """The rows ``start:stop`` of a value broadcast into a ``[..., rows, keys]`` result (right-aligned: its dim -2,
    where it has ``rows`` of them; else it is read whole)."""
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] == rows:
        return x.narrow(x.dim() - 2, start, stop - start)
    return x


def _inputs(nodes: list[fx.Node], big: list[fx.Node]) -> dict[fx.Node, Any]:
    """The values the ``big`` nodes read from the others, which are evaluated (each at most ``max_elements``)."""
    large = set(big)
    small = [n for n in nodes if n not in large]
    needed = frozenset(i for n in big for i in n.all_input_nodes if i not in large)
    env = _evaluate(small, keep=needed) if small else {}
    return {i: env[i] for i in needed}


def _one_row(values: dict[fx.Node, Any]) -> dict[fx.Node, Any] | None:
    """``values`` cut to one along every dim before their last two (the batch's rows, the heads) where each is
    the same along them (HF's position ids of a batch without padding), so the mask they make is too; None where
    one is not."""
    out = {}
    for i, v in values.items():
        if isinstance(v, torch.Tensor) and v.dim() > 2 and any(d > 1 for d in v.shape[:-2]):
            first = v[(slice(0, 1),) * (v.dim() - 2)]
            if not torch.equal(v, first.expand_as(v)):
                return None
            v = first
        out[i] = v
    return out


def _mask_blocks(nodes: list[fx.Node], big: list[fx.Node], rows: int, per_block: int, values: dict[fx.Node, Any],
                 one: bool = False) -> Any:
    """The mask (``nodes[-1]``, one of ``big``) in blocks of ``per_block`` query rows from ``values`` (``_inputs``),
    the ``big`` nodes (``_blockwise``) evaluated per block. Yields (first row, the block). ``one``: ``values`` are
    one along the dims before the last two (``_one_row``), and so is each block (its ``expand``s to one there)."""
    for start in range(0, rows, per_block):
        stop = min(rows, start + per_block)
        block = {i: _rows_of(v, start, stop, rows) for i, v in values.items()}
        for n in big:
            if n.target is torch.ops.aten.expand.default:
                sizes = list(n.args[1])
                sizes[-2] = stop - start
                if one:
                    sizes[:-2] = [1] * (len(sizes) - 2)
                block[n] = block[n.args[0]].expand(sizes)
                continue
            block = _evaluate([n], env=block)
        yield start, block[nodes[-1]]


def _causal_nodes(mask: fx.Node, attention: fx.Node, max_elements: int) -> list[fx.Node] | None:
    """The nodes computing ``mask`` when it is ``attention``'s causal mask (module docstring), else None."""
    nodes = _ancestors(mask)
    q, k = (tensor_meta(a) for a in attention.args[:2])
    m = tensor_meta(mask)
    if nodes is None or q is None or k is None or m is None or m.dim() < 2 or not all(map(_static, nodes)):
        return None
    length, keys = int(q.shape[-2]), int(k.shape[-2])
    if tuple(m.shape[-2:]) != (length, keys):
        return None
    big = [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() > max_elements]
    if big:  # (a long sequence's mask: by blocks of query rows, where every large value is computed row-wise
        # and no small one is computed from a large one, as HF's comparisons of position aranges are)
        large = set(big)
        if not all(_blockwise(n, length) for n in big) or \
                any(i in large for n in nodes if n not in large for i in n.all_input_nodes):
            return None
    try:
        if big:
            # where what they read is the same for every row of the batch and head, the mask is: one is evaluated
            # (BLOOM's search captured a [2048, 1, 2048, 2048] mask: 2^33 elements, for 2^22 to decide)
            values = _inputs(nodes, big)
            reduced = _one_row(values)
            elements = length * keys if reduced is not None else m.numel()
            if elements > LIMIT:
                return None
            per_block = max(1, min(max_elements, BLOCK) // (elements // length))
            key = _decision_key(nodes, big, reduced, length, keys) if reduced is not None else None
            if key is not None and key in _DECIDED:
                return nodes if _DECIDED[key] else None
            blocks = _mask_blocks(nodes, big, length, per_block, reduced if reduced is not None else values,
                                  reduced is not None)
        else:
            key, blocks = None, [(0, _evaluate(nodes)[nodes[-1]])]
        causal = all(_causal_rows(value, start, keys) for start, value in blocks)
        if key is not None:
            if len(_DECIDED) >= DECIDED_KEPT:
                _DECIDED.clear()
            _DECIDED[key] = causal
    except Exception as e:  # noqa: BLE001  (the mask then stays as the model made it: still exact)
        log.warning("autopar: could not evaluate %s's mask on CPU (%s: %s); it stays a mask", attention.name,
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    return nodes if causal else None


#: Long masks decided on one batch row (``_one_row``), by what decides them (``_decision_key``): a search captures
#: one graph per count of rows a batch shard gets, each with the same mask of another batch (Llama-3.1-405B at
#: 131,072 tokens: 2^34 elements to evaluate, ~12 s, for each of up to eight captures). At most DECIDED_KEPT.
_DECIDED: dict[tuple, bool] = {}
DECIDED_KEPT = 64


def _decision_key(nodes: list[fx.Node], big: list[fx.Node], values: dict[fx.Node, Any], length: int, keys: int
                  ) -> tuple | None:
    """What a mask evaluated on one batch row (``_mask_blocks`` with ``one``) is a function of: the large ops (their
    targets, and their arguments with nodes by place and an ``expand``'s sizes but its last two as the evaluation
    takes them) and the values they read (dtype, shape and bytes); None where an argument is not plain."""
    order = {n: i for i, n in enumerate(nodes)}
    read_first = sorted(values, key=order.__getitem__)  # (graph order: the same in every capture)
    place = {n: ("node", i) for i, n in enumerate(big)}
    place.update({n: ("value", i) for i, n in enumerate(read_first)})
    ops = []
    for n in big:
        args: list[Any] = []
        for a in pytree.tree_leaves((tuple(n.args), dict(n.kwargs))):
            if isinstance(a, fx.Node):
                if a not in place:
                    return None
                args.append(place[a])
            elif a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout)):
                args.append(repr(a))
            else:
                return None
        if n.target is torch.ops.aten.expand.default:
            args = args[:1] + args[-2:]  # (the evaluation expands to one along the dims before the last two)
        ops.append((str(n.target), tuple(args)))
    read = []
    for v in (values[n] for n in read_first):
        if not isinstance(v, torch.Tensor):
            return None
        digest = hashlib.sha1(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        read.append((str(v.dtype), tuple(v.shape), digest))
    return length, keys, tuple(ops), tuple(read)


def _causal_rows(value: torch.Tensor, start: int, keys: int) -> bool:
    """Whether ``value`` (query rows ``start:`` of a mask over ``keys`` keys, broadcast) is the causal mask's."""
    rows = int(value.shape[-2])
    allowed = torch.arange(keys)[None, :] <= torch.arange(start, start + rows)[:, None]
    if value.dtype == torch.bool:
        return torch.equal(value, allowed.expand_as(value))
    if value.is_floating_point():
        lowest = torch.finfo(value.dtype).min / 2
        return bool(((value == 0) == allowed).all() and (value[..., ~allowed] <= lowest).all())
    return False
