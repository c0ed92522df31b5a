"""token_rows: whether a routed-experts module computes each token from that token alone, so that under context
parallelism it can run on this rank's tokens (``passes.split_context``), and which of its sizes count them.

A grouped-matmul experts module as transformers 5.x captures it takes the tokens as rows (``[tokens, hidden]``, the
batch's rows and the sequence merged) with each token's picked experts and weights (``[tokens, k]``), and gives a
row per token back. Between, its ops move rows around: the picks are flattened (``[tokens * k]``), sorted by
expert (``sort``), the rows taken in that order (``index`` by the sort's positions, ``// k``), counted per expert
(``histc``, ``cumsum``: the grouped matmuls' offsets), multiplied, and put back in the picks' order by the inverse
of the sort (``index_put_`` of an ``arange`` at the sort's positions, then ``index``); under ``expert_parallel`` the
rows also go to their experts' ranks and back (``expert_dispatch``, ``expert_combine``). Run on any subset of the
tokens, those ops give each token of the subset the row the whole would; the proof is a walk over the module's ops
that gives every value a kind and refuses any op it cannot type:

- ``Rows(order, grain)``: dim 0 holds rows of the tokens, ``grain`` of them per token (``tokens * grain`` whole);
  ``order`` is ``NATURAL`` (each token's rows together, in the tokens' order: what enters and what leaves) or the op
  that put them in another (a sort's, an exchange's). A row-wise op (pointwise ops, matmuls by weights, a softmax
  or top-k along the features, views that keep each token's rows together) keeps its rows' kind, the operands' the
  same;
- ``Positions(into, own)``: integers in ``own``'s rows that are positions of rows of ``into`` (a sort's indices;
  ``// d`` of positions into ``d`` rows per token gives positions into the tokens; the inverse of a sort,
  ``index_put_(empty_like(p), [p], arange(n))``, gives positions into the sorted rows): ``index(x, [p])`` of rows
  ``x`` of ``into`` gives rows of ``own``; a subset's positions are its own rows', whatever the subset;
- ``Counts(order)``: counts of rows per expert (``histc``, ``bincount``, ``cumsum`` of them), read only as the
  grouped matmuls' offsets of rows in that order (a statistic of the rows anywhere else would be the subset's);
- weights and constants (nothing computed from the tokens): anything reads them.

The module's outputs must be ``Rows(NATURAL, g)``, each token's rows where the module found them. Pure.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import fx

from autopar.compat import OpOverload
from passes.analysis.experts import is_batched_expert_matmul, is_grouped_matmul
from passes.analysis.graph_facts import module_of, param_name, tensor_meta
from passes.ir import convert_layout, expert_combine, expert_dispatch, reduce_partial, sum_grad

aten = torch.ops.aten

NATURAL = "natural"

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.contiguous.default, aten.alias.default,
          aten.clone.default, aten.type_as.default}
_FEATURES = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unsqueeze.default,
             aten.slice.Tensor, aten.narrow.default, aten.sum.dim_IntList, aten.mean.dim, aten.softmax.int,
             aten._softmax.default, aten.topk.default, aten.transpose.int, aten.select.int}
"""Ops along a dim (its argument 1, or ``dim``): row-wise where that dim is not 0."""
_MARKERS = {reduce_partial, sum_grad, convert_layout}


@dataclasses.dataclass(frozen=True, slots=True)
class Rows:
    order: Any
    grain: int | None
    """Rows per token (``None`` after an exchange: rows of other ranks' tokens, as many as were routed here)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Positions:
    into: Rows
    own: Rows


@dataclasses.dataclass(frozen=True, slots=True)
class Counts:
    order: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Routes:
    order: Any
    back: Rows


@dataclasses.dataclass(frozen=True, slots=True)
class _Empty:
    like: fx.Node


@dataclasses.dataclass(frozen=True, slots=True)
class _Arange:
    end: int


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertBlock:
    """A routed-experts module's ops (and those passes inserted among them: exchanges, markers), graph order."""

    module: str
    nodes: tuple[fx.Node, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class LocalBlock:
    """``local_rows``'s answer where the block runs on a subset of the tokens."""

    exits: dict[fx.Node, int]
    """Each node read outside the block -> its rows per token (its dim 0: ``tokens * grain``)."""
    sized: tuple[fx.Node, ...]
    """The views and ``arange``s whose sizes count the whole's rows (dim 0 / the end): a subset's are its own."""


def expert_blocks(gm: fx.GraphModule) -> list[ExpertBlock]:
    """The routed-experts modules of ``gm``: each module a grouped matmul's op was recorded in, with every op
    recorded in it or in its submodules, and the ops without a module record that read one of them (what the
    passes inserted: the exchanges, the tensor split's markers)."""
    modules = {module_of(n) for n in gm.graph.nodes if is_grouped_matmul(n) or is_batched_expert_matmul(n)}
    modules.discard("")
    out = []
    for module in sorted(modules):
        nodes: list[fx.Node] = []
        members: set[fx.Node] = set()
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            where = module_of(n)
            inserted = not n.meta.get("nn_module_stack") and any(a in members for a in n.all_input_nodes)
            if where == module or where.startswith(module + ".") or inserted:
                nodes.append(n)
                members.add(n)
        out.append(ExpertBlock(module, tuple(nodes)))
    return out


class _Refused(Exception):
    pass


def local_rows(block: ExpertBlock, entries: Mapping[fx.Node, int], tokens: int) -> LocalBlock | str:
    """Whether ``block`` computes each token's rows from that token's alone (module docstring), given what it reads
    holding the tokens' rows (``entries``: each -> its rows per token, dim 0 ``tokens * grain``; ``tokens``: the
    rows of every token, the batch's and the sequence's merged); everything else it reads must hold none. The
    exits and the sizes to make the subset's (``LocalBlock``), or why not."""
    try:
        return _Walk(block, entries, tokens).run()
    except _Refused as e:
        return str(e)


class _Walk:
    def __init__(self, block: ExpertBlock, entries: Mapping[fx.Node, int], tokens: int) -> None:
        self.block, self.tokens = block, tokens
        self.members = set(block.nodes)
        self.kind: dict[fx.Node, Any] = {n: Rows(NATURAL, g) for n, g in entries.items()}
        self.sized: list[fx.Node] = []

    def run(self) -> LocalBlock:
        for n in self.block.nodes:
            for a in n.all_input_nodes:
                if a not in self.members and a not in self.kind:
                    self._outside(a)
            kind = self._rule(n)
            if kind is not None:
                self.kind[n] = kind
        exits = {}
        for n in self.block.nodes:
            if any(u not in self.members for u in n.users):
                kind = self.kind.get(n)
                if not (isinstance(kind, Rows) and kind.order == NATURAL):
                    raise _Refused(f"{n.name}, read after the module, does not hold the tokens' rows in their order")
                exits[n] = kind.grain
        return LocalBlock(exits, tuple(self.sized))

    def _outside(self, a: fx.Node) -> None:
        if param_name(a) is not None or a.op == "get_attr":
            return
        t = tensor_meta(a)
        if t is not None and t.dim() and int(t.shape[0]) % self.tokens == 0 and int(t.shape[0]) >= self.tokens:
            raise _Refused(f"{a.name} (read from before the module) is as long as the tokens' rows but does not "
                           "hold this rank's")

    # -- kinds ---------------------------------------------------------------------------------------------
    def _of(self, a: Any) -> Any:
        return self.kind.get(a) if isinstance(a, fx.Node) else None

    def _grain(self, n: fx.Node) -> int:
        t = tensor_meta(n)
        if t is None or not t.dim() or int(t.shape[0]) % self.tokens:
            raise _Refused(f"{n.name}'s dim 0 does not count rows of the tokens")
        return int(t.shape[0]) // self.tokens

    def _rows_operands(self, n: fx.Node) -> Rows | None:
        """The one ``Rows`` kind of ``n``'s operands (None if none holds rows); refuses anything else."""
        found = None
        for a in n.all_input_nodes:
            k = self.kind.get(a)
            if k is None:
                continue
            if not isinstance(k, Rows) or (found is not None and k != found):
                raise _Refused(f"{n.name} ({_name(n)}) mixes rows of different orders, or positions or counts")
            found = k
        return found

    def _rule(self, n: fx.Node) -> Any:
        t = n.target
        kinds = [self.kind.get(a) for a in n.all_input_nodes]
        if all(k is None for k in kinds) and t is not aten.arange.default:
            return None  # (weights' transposes and casts: nothing of the tokens)
        if t is operator.getitem:
            src, i = n.args
            k = self.kind[src]
            return k[i] if isinstance(k, tuple) else k
        if t in _CASTS:
            k = self.kind.get(n.args[0])
            if isinstance(k, (_Empty, _Arange)):
                raise _Refused(f"{n.name} casts a value autopar follows only into index_put_")
            return k
        if t is aten.arange.default:
            if len(n.args) != 1 or not isinstance(n.args[0], int) or n.kwargs.get("dtype") not in (None, torch.int64):
                raise _Refused(f"{n.name} is an arange autopar does not follow")
            return _Arange(n.args[0])
        if t is aten.empty_like.default:
            if not isinstance(self.kind.get(n.args[0]), Positions):
                raise _Refused(f"{n.name} is an empty_like of something other than positions")
            return _Empty(n.args[0])
        if t is aten.sort.default:
            return self._sort(n)
        if t is aten.floor_divide.default:
            return self._divide(n)
        if t is aten.index.Tensor:
            return self._index(n)
        if t in (aten.index_put_.default, aten.index_put.default):
            return self._inverse(n)
        if t in (aten.histc.default, aten.bincount.default):
            k = self.kind.get(n.args[0])
            if not isinstance(k, Rows):
                raise _Refused(f"{n.name} counts something other than rows")
            return Counts(k.order)
        if t is aten.cumsum.default:
            k = self.kind.get(n.args[0])
            if isinstance(k, Counts):
                return k
            return self._along(n, n.args[1] if len(n.args) > 1 else n.kwargs.get("dim"))
        if is_grouped_matmul(n):
            return self._grouped(n)
        if t is expert_dispatch:
            return self._dispatch(n)
        if t is expert_combine:
            x, routes = self.kind.get(n.args[0]), self.kind.get(n.args[1])
            if not isinstance(routes, Routes) or x != Rows(routes.order, None):
                raise _Refused(f"{n.name} combines rows the exchange did not bring")
            return routes.back
        if t in _VIEWS or t is aten.expand.default:
            return self._view(n)
        if t in _FEATURES:
            dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            if t in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.topk.default):
                dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0 if t is not aten.topk.default else -1)
            if t is aten.transpose.int:
                dim = n.args[1] if n.args[1] % _ndim(n.args[0]) == 0 else n.args[2]
            if t in (aten.sum.dim_IntList, aten.mean.dim):
                dims = n.args[1] if len(n.args) > 1 else None
                if dims is None or any(d % _ndim(n.args[0]) == 0 for d in dims):
                    raise _Refused(f"{n.name} sums over the rows")
                dim = dims[0]
            if t is aten.unsqueeze.default:
                if dim % (_ndim(n.args[0]) + 1) == 0:
                    raise _Refused(f"{n.name} puts a dim before the rows")
                return self._along(n, None)  # (after the rows)
            return self._along(n, dim)
        if t in (aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default):
            x = n.args[1] if t is aten.addmm.default else n.args[0]
            others = [a for a in n.all_input_nodes if a is not x]
            if any(self.kind.get(a) is not None for a in others) or _ndim(x) < 2:
                raise _Refused(f"{n.name} multiplies rows by rows")
            return self.kind.get(x)
        if t in _MARKERS:
            return self._marker(n)
        if isinstance(t, OpOverload) and torch.Tag.pointwise in t.tags:
            k = self._rows_operands(n)
            if k is None:
                raise _Refused(f"{n.name} ({_name(n)}) reads positions or counts")
            for a in n.all_input_nodes:  # (an operand of other rows broadcast against them would not be a row's)
                if self.kind.get(a) is None and _ndim(a) >= _ndim(n) and _ndim(n) and _dim0(a) not in (1,):
                    raise _Refused(f"{n.name} ({_name(n)}) reads {a.name} along the rows")
            return k
        raise _Refused(f"{n.name} ({_name(n)}) is an op autopar does not follow in an experts module")

    def _along(self, n: fx.Node, dim: Any) -> Any:
        """``n`` works along ``dim`` of its first operand (None: along none of its dims)."""
        x = n.args[0]
        if dim is not None and (not isinstance(dim, int) or dim % max(_ndim(x), 1) == 0):
            raise _Refused(f"{n.name} ({_name(n)}) works along the rows")
        k = self._rows_operands(n)
        if k is None:
            raise _Refused(f"{n.name} ({_name(n)}) reads positions or counts")
        vals = n.meta.get("val")
        return tuple(k for _ in vals) if isinstance(vals, (list, tuple)) else k

    def _sort(self, n: fx.Node) -> Any:
        x = self.kind.get(n.args[0])
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", -1)
        if _ndim(n.args[0]) > 1 and dim % _ndim(n.args[0]) != 0:
            return self._along(n, dim)
        if not isinstance(x, Rows) or x.grain is None or n.kwargs.get("stable") is False:
            raise _Refused(f"{n.name} sorts something other than rows of the tokens")
        order = Rows(n, x.grain)
        return order, Positions(x, order)

    def _divide(self, n: fx.Node) -> Positions:
        p, d = self.kind.get(n.args[0]), n.args[1]
        if not isinstance(p, Positions) or not isinstance(d, int) or d <= 0 or p.into.order != NATURAL \
                or p.into.grain is None or p.into.grain % d:
            raise _Refused(f"{n.name} divides something other than positions of a token's {d} rows")
        return Positions(Rows(NATURAL, p.into.grain // d), p.own)

    def _index(self, n: fx.Node) -> Rows:
        x, indices = n.args[0], n.args[1]
        if len(indices) != 1 or not isinstance(indices[0], fx.Node):
            raise _Refused(f"{n.name} indexes more than the rows")
        k, p = self.kind.get(x), self.kind.get(indices[0])
        if isinstance(p, Positions):
            if k != p.into:
                raise _Refused(f"{n.name} takes rows at positions of other rows")
            return p.own
        if k is None and isinstance(p, Rows):  # a weight's entry for each row (an expert bias by expert id)
            return p
        raise _Refused(f"{n.name} indexes rows by something other than positions")

    def _inverse(self, n: fx.Node) -> Positions:
        dst, indices, values = n.args[0], n.args[1], n.args[2]
        accumulate = n.args[3] if len(n.args) > 3 else n.kwargs.get("accumulate", False)
        empty, arange = self.kind.get(dst), self.kind.get(values)
        if accumulate or len(indices) != 1 or not isinstance(empty, _Empty) or indices[0] is not empty.like \
                or not isinstance(arange, _Arange):
            raise _Refused(f"{n.name} is an index_put autopar does not follow (only a sort's inverse)")
        p = self.kind[indices[0]]
        if p.own.grain is None or arange.end != self.tokens * p.own.grain:
            raise _Refused(f"{n.name} puts positions of another count")
        self.sized.append(values)
        return Positions(p.own, p.into)

    def _grouped(self, n: fx.Node) -> Rows:
        x = self.kind.get(n.args[0])
        offsets = n.kwargs.get("offs", n.args[2] if len(n.args) > 2 else None)
        counts = self.kind.get(offsets) if isinstance(offsets, fx.Node) else None
        if not isinstance(x, Rows) or not isinstance(counts, Counts) or counts.order != x.order:
            raise _Refused(f"{n.name} multiplies rows by offsets counted from other rows")
        if any(self.kind.get(a) is not None for a in n.all_input_nodes if a is not n.args[0] and a is not offsets):
            raise _Refused(f"{n.name} multiplies rows by rows")
        return x

    def _dispatch(self, n: fx.Node) -> tuple:
        rows, offsets, inputs = n.args[0], n.args[1], n.args[2]
        x, counts = self.kind.get(rows), self.kind.get(offsets) if isinstance(offsets, fx.Node) else None
        if not isinstance(x, Rows) or (offsets is not None and counts != Counts(x.order)) \
                or any(self.kind.get(i) != x for i in inputs):
            raise _Refused(f"{n.name} sends rows with offsets or values of other rows")
        here = Rows(n, None)
        return (here, Counts(n), *(here for _ in inputs), Routes(n, x))

    def _view(self, n: fx.Node) -> Rows:
        x = self.kind.get(n.args[0])
        if not isinstance(x, Rows):
            raise _Refused(f"{n.name} views positions or counts")
        size = list(n.args[1])
        if x.order != NATURAL or x.grain is None:  # (rows in another order: only views keeping dim 0)
            if _dim0(n) != _dim0(n.args[0]) or (size and size[0] not in (-1, _dim0(n))):
                raise _Refused(f"{n.name} reshapes rows out of the tokens' order")
            if size and size[0] != -1:
                self.sized.append(n)
            return x
        grain = self._grain(n)
        if size and size[0] != -1:
            if size[0] != _dim0(n):
                raise _Refused(f"{n.name}'s size is not its result's")
            self.sized.append(n)
        return Rows(NATURAL, grain)

    def _marker(self, n: fx.Node) -> Any:
        spec = n.args[-1]
        for field in ("src", "dst", "sharding"):
            sharding = getattr(spec, field, None)
            if sharding is not None and not sharding.is_replicated and sharding.dim % _ndim(n.args[0]) == 0:
                raise _Refused(f"{n.name} splits the rows over a tensor axis")
        return self.kind.get(n.args[0])


def _ndim(node: Any) -> int:
    t = tensor_meta(node) if isinstance(node, fx.Node) else None
    return t.dim() if t is not None else 0


def _dim0(node: Any) -> int | None:
    t = tensor_meta(node) if isinstance(node, fx.Node) else None
    return int(t.shape[0]) if t is not None and t.dim() else None


def _name(n: fx.Node) -> str:
    return getattr(n.target, "__name__", str(n.target))


def blocks_by_node(blocks: Iterable[ExpertBlock]) -> dict[fx.Node, ExpertBlock]:
    return {n: b for b in blocks for n in b.nodes}
