"""context_shapes: where this rank's tokens go through the ops that reshape, reorder, cut or join a tensor, for
``passes.split_context``.

Requires: the splitter's ``state`` (node -> ``ContextSpec``: the dim holding this rank's tokens, with the extents
``outer`` and ``inner`` folded around them), ``tokens``, ``ranks``, ``spec()``, ``_split_of()`` and ``_aligned()``
(``ShapeRules`` is mixed into it).
Ensures: for views, ``expand``, ``flatten``, ``repeat``, ``view_as_complex`` / ``view_as_real``, transposes,
permutes, (un)squeezes, selects, slices, ``index_select``, splits, ``cat`` and ``stack`` (``SHAPE_OPS``), the
``ContextSpec`` of the result (a tuple of them for a split), a view's size argument cut to this rank's tokens and a
cat's whole operands cut where they meet; ``Unsplittable`` where the op cuts, reorders or mixes the tokens along
the sequence (a view folding them over two dims, a slice of some of them, a cat along them): the splitter then
reads the whole sequence there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx

from passes.analysis.graph_facts import tensor_meta
from passes.ir import ContextSpec

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_REINDEX = {aten.transpose.int, aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.squeeze.default, aten.select.int, aten.slice.Tensor, aten.index_select.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
_COMPLEX = {aten.view_as_complex.default, aten.view_as_real.default}
SHAPE_OPS = frozenset(_VIEWS | _REINDEX | _SPLITS | _COMPLEX | {aten.flatten.using_ints, aten.repeat.default,
                                                                 aten.cat.default, aten.stack.default})
"""The ops ``ShapeRules.shape_rule`` follows the tokens through."""


class Unsplittable(Exception):
    """The op reads this rank's tokens in a way no rule covers: it reads the whole sequence instead."""


def ndim_of(node: Any) -> int | None:
    val = tensor_meta(node) if isinstance(node, fx.Node) else None
    return val.dim() if val is not None else None


def shape_of(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in tensor_meta(node).shape)


class ShapeRules:
    """The rules of ``SHAPE_OPS``, mixed into ``split_context``'s splitter (see the module's Requires)."""

    state: dict[fx.Node, Any]
    tokens: int
    ranks: int

    def shape_rule(self, node: fx.Node) -> Any:
        t = node.target
        if t in _VIEWS:
            return self._view(node)
        if t is aten.flatten.using_ints:  # (no sizes to cut)
            return self._token_dim(self._split_of(node.args[0]), shape_of(node.args[0]), shape_of(node))
        if t in _COMPLEX:  # (Llama 4's rotary: pairs of features)
            spec = self._split_of(node.args[0])
            if t is aten.view_as_complex.default and spec.dim == ndim_of(node.args[0]) - 1:
                raise Unsplittable
            return spec
        if t is aten.repeat.default:  # (copies of every token: Llama 4's rows for each expert)
            return self._repeat(node)
        if t in _REINDEX:
            return self._reindex(node)
        if t in _SPLITS:
            return self._split(node)
        return self._cat(node)

    def _view(self, node: fx.Node) -> ContextSpec:
        x, size = node.args[0], list(node.args[1])
        spec = self._split_of(x)
        before, after = shape_of(x), shape_of(node)
        if node.target is aten.expand.default:
            at = spec.dim + (len(after) - len(before))
            found = dataclasses.replace(spec, dim=at)
        else:
            found = self._token_dim(spec, before, after)
        if not isinstance(size[found.dim], int):  # (the tokens' size is cut: other sizes may be symbolic)
            raise Unsplittable
        if size[found.dim] != -1:
            size[found.dim] = size[found.dim] // self.ranks
        node.args = (x, size, *node.args[2:])
        return found

    def _repeat(self, node: fx.Node) -> ContextSpec:
        x, times = node.args[0], list(node.args[1])
        spec = self._split_of(x)
        at = spec.dim + len(times) - ndim_of(x)
        return dataclasses.replace(spec, dim=at, outer=spec.outer * times[at])

    def _token_dim(self, spec: ContextSpec, before: tuple[int, ...], after: tuple[int, ...]) -> ContextSpec:
        """The dim of ``after`` (a view of ``before``, split as ``spec``) that holds the tokens whole, by the
        tokens' stride in the flat order: None where a view cuts them over two dims."""
        stride = spec.inner
        for s in before[spec.dim + 1:]:
            stride *= s
        extent = stride * self.tokens
        suffix = 1
        for e in range(len(after) - 1, -1, -1):
            size = after[e]
            if suffix <= stride and extent <= suffix * size and stride % suffix == 0 and (suffix * size) % extent == 0:
                return self.spec(e, outer=(suffix * size) // extent, inner=stride // suffix)
            suffix *= size
        raise Unsplittable

    def _reindex(self, node: fx.Node) -> ContextSpec:
        t, x = node.target, node.args[0]
        spec = self._split_of(x)
        n, d = ndim_of(x), spec.dim
        if t is aten.t.default:
            return dataclasses.replace(spec, dim=1 - d)
        if t is aten.transpose.int:
            a, b = (i % n for i in node.args[1:3])
            return dataclasses.replace(spec, dim=b if d == a else a if d == b else d)
        if t is aten.permute.default:
            dims = [i % n for i in node.args[1]]
            return dataclasses.replace(spec, dim=dims.index(d))
        if t is aten.unsqueeze.default:
            at = node.args[1] % (n + 1)
            return dataclasses.replace(spec, dim=d + 1 if at <= d else d)
        if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            shape = shape_of(x)
            if t is aten.squeeze.default:
                gone = [i for i in range(n) if shape[i] == 1]
            else:
                dims = node.args[1] if t is aten.squeeze.dims else [node.args[1]]
                gone = [i % n for i in dims if shape[i % n] == 1]
            if d in gone:
                raise Unsplittable
            return dataclasses.replace(spec, dim=d - sum(1 for i in gone if i < d))
        dim = (node.args[1] if len(node.args) > 1 else 0) % n
        if dim == d and t is aten.slice.Tensor and self._whole_slice(node, shape_of(x)[d]):
            return spec
        if dim == d:
            raise Unsplittable
        if t is aten.select.int:
            return dataclasses.replace(spec, dim=d - 1 if dim < d else d)
        if t is aten.index_select.default and self.state.get(node.args[2]) is not None:
            raise Unsplittable
        return spec

    @staticmethod
    def _whole_slice(node: fx.Node, size: int) -> bool:
        """A ``slice`` that keeps every entry (HF's ``hidden_states[:, slice(-0, None), :]`` before the head)."""
        start, end, step = (list(node.args[2:5]) + [None, None, 1][len(node.args[2:5]):])
        return start in (None, 0) and (end is None or end >= size) and step in (None, 1)

    def _split(self, node: fx.Node) -> tuple:
        x = node.args[0]
        spec = self._split_of(x)
        n = ndim_of(x)
        if node.target is aten.unbind.int:
            dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % n
        else:
            dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % n
        if dim == spec.dim:
            raise Unsplittable
        out = dataclasses.replace(spec, dim=spec.dim - 1 if node.target is aten.unbind.int and dim < spec.dim
                                  else spec.dim)
        count = len(node.meta["val"]) if isinstance(node.meta.get("val"), (list, tuple)) else 0
        return tuple(out for _ in range(count))

    def _cat(self, node: fx.Node) -> ContextSpec:
        parts = node.args[0]
        first = next((p for p in parts if self.state.get(p) is not None), None)
        spec = self._split_of(first)
        n = ndim_of(first)
        dim = (node.args[1] if len(node.args) > 1 else 0)
        stack = node.target is aten.stack.default
        dim %= (n + 1) if stack else n
        if not stack and dim == spec.dim:
            raise Unsplittable
        cut = [self._aligned(node, spec, n, p) for p in parts]
        node.args = (cut, *node.args[1:])
        return dataclasses.replace(spec, dim=spec.dim + 1 if stack and dim <= spec.dim else spec.dim)
