"""context_markers: where this rank's tokens go through the markers the tensor grid's passes put in, for
``passes.split_context``: sequence parallelism's gathers and scatters of the tokens over a tensor axis, the
outputs' gathers, and dropouts.

Requires: the splitter's ``state``, ``tokens``, ``ranks``, ``slice_of()``, ``_split_of()``, ``_elementwise()`` and
``_visit()``, with ``passes.context_shapes.ShapeRules`` (``MarkerRules`` is mixed into the splitter beside it).
Ensures:
- ``convert_layout`` along the tokens has its segment cut to this rank's tokens; other markers splitting the
  tokens' dim, and an output gathered over the batch, are ``Unsplittable``;
- a dropout in training on this rank's tokens (a tensor axis's ``split_dropout`` too) becomes
  ``context_dropout`` (the whole tensor's mask, this rank's part); ``native_dropout`` there is refused
  (``PlanError``);
- ``cut_early``: a whole tensor about to be cut to this rank's tokens is cut before the ops that made it token by
  token instead (an attention computed whole: before its output projection, and before sequence parallelism's
  scatter of its tokens over a tensor axis, which must be), the ops after the cut visited again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx

from autopar.errors import PlanError
from passes.context_shapes import Unsplittable, ndim_of, shape_of
from passes.ir import (ContextDropoutSpec, ContextSpec, context_dropout, context_gather, convert_layout, gather_output,
                       sharded_matmul, split_dropout)

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_COPIES = {split_dropout, aten.dropout.default, aten.clone.default, aten.contiguous.default, aten.alias.default}
#: Matmuls on the features (token by token): the first operand's rows are the tokens (``addmm``'s second).
_PRODUCTS = {aten.linear.default, sharded_matmul, aten.addmm.default}


class MarkerRules:
    """The rules of the tensor grid's markers, mixed into ``split_context``'s splitter (see the module's Requires)."""

    state: dict[fx.Node, Any]
    tokens: int
    ranks: int

    def cut_early(self, other: fx.Node, want: ContextSpec) -> bool:
        """Whether ``other`` (whole, the one reader of it about to take this rank's tokens, split as ``want``) is
        now this rank's tokens, cut before the ops that made it (``_chain_back``): before a scatter of its tokens
        over a tensor axis (it holds part of every context rank's tokens, which no cut of it takes), and before
        matmuls that work token by token (an attention's output projection after it read the whole sequence:
        run on this rank's tokens, not all). False where there is no such chain: ``other`` is cut itself."""
        found = self._chain_back(other, want)
        if not found:
            return False
        chain, cut = found
        x = chain[0].args[1] if chain[0].target is aten.addmm.default else chain[0].args[0]
        chain[0].replace_input_with(x, self.slice_of(x, cut, chain[0]))
        for n in chain:
            self._visit(n)
        if self.state.get(other) == want:
            return True
        raise PlanError(f"context={self.ranks}: {other.name} was made from the whole sequence by ops autopar could "
                        f"not cut to this rank's tokens ({', '.join(n.name for n in chain)}). Use context=1 for this "
                        "model, or sequence_parallel=False.")

    def _chain_back(self, other: fx.Node, want: ContextSpec) -> tuple[list[fx.Node], ContextSpec] | None:
        """The ops, each the one reader of the one before, that made ``other`` token by token from a tensor whole
        over context: views, dropouts, copies and matmuls on the features, back to a scatter of the tokens over a
        tensor axis (sequence parallelism's, which must be cut before) or to the first op that is none of these
        or whose input has other readers; and how that first op's input is to be split. None where there is no
        scatter and no matmul among them (cutting ``other`` costs as little)."""
        if len(other.users) != 1:
            return None
        chain, node, spec, worth = [], other, want, False
        while isinstance(node, fx.Node) and node.op == "call_function" and self.state.get(node) is None:
            t = node.target
            x = node.args[1] if t is aten.addmm.default else node.args[0] if node.args else None
            if not isinstance(x, fx.Node) or ndim_of(x) is None or x.target is context_gather:
                break  # (after a gather: the op read the whole sequence, no rule taking this rank's tokens)
            if t in (sharded_matmul, convert_layout):
                last = node.args[-1]
                at = last.scatter_dim if t is sharded_matmul else (
                    -1 if last.dst.is_replicated else last.dst.dim % ndim_of(node))
                if at >= 0:  # (a scatter: its output holds part of every context rank's tokens)
                    if at != spec.dim or ndim_of(x) != ndim_of(node):
                        return None
                    return [node, *chain[::-1]], spec
                if t is convert_layout:
                    break
            if t in _VIEWS:
                if any(not isinstance(d, int) for d in node.args[1]):
                    break  # (a symbolic size: no rule cuts it)
                try:
                    before = self._token_dim(spec, shape_of(node), shape_of(x))
                except Unsplittable:
                    break
            elif t in _COPIES or (t in _PRODUCTS and spec.dim < ndim_of(node) - 1 and ndim_of(x) == ndim_of(node)):
                before = spec
            else:
                break
            chain.append(node)
            spec, worth = before, worth or t in _PRODUCTS
            if len(x.users) != 1:
                break
            node = x
        return (chain[::-1], spec) if worth else None

    def marker_rule(self, node: fx.Node) -> ContextSpec:
        x = node.args[0]
        spec = self._split_of(x)
        last = node.args[-1]
        if node.target is convert_layout:  # sequence parallelism's gather or scatter of the tokens over a tensor axis
            cut = {}
            for field in ("src", "dst"):
                sharding = getattr(last, field)
                if not sharding.is_replicated and sharding.dim % ndim_of(x) == spec.dim:
                    whole = spec.outer * self.tokens * spec.inner  # (rows of a flattened batch x tokens, too)
                    if sharding.parts != (whole,):
                        raise Unsplittable
                    cut[field] = dataclasses.replace(sharding, parts=(whole // self.ranks,))  # this rank's
            if cut:
                node.args = (*node.args[:-1], dataclasses.replace(last, **cut))
                return spec
        for sharding in (getattr(last, "src", None), getattr(last, "dst", None), getattr(last, "sharding", None)):
            if sharding is not None and not sharding.is_replicated and sharding.dim % ndim_of(x) == spec.dim:
                raise Unsplittable
        if node.target is gather_output and (last.batch_split or last.keep_split):
            raise Unsplittable
        return spec

    def dropout_rule(self, node: fx.Node) -> ContextSpec:
        """A dropout on this rank's tokens in training: ``context_dropout`` (the whole tensor's mask, this rank's
        part of it: serial's masks)."""
        spec = self._elementwise(node)
        x, p, train = node.args[:3]
        if not (isinstance(p, (int, float)) and p > 0 and train is not False):
            return spec
        piece = node.args[3] if node.target is split_dropout else None
        if piece is not None and piece.dim % ndim_of(x) == spec.dim:  # (the tokens over a tensor axis, too)
            whole = spec.outer * self.tokens * spec.inner
            if piece.parts != (whole,):
                raise Unsplittable
            piece = dataclasses.replace(piece, parts=(whole // self.ranks,))
        node.target, node.args = context_dropout, (x, p, train, ContextDropoutSpec(spec, piece))
        return spec

    def refuse_dropout(self, node: fx.Node) -> None:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if isinstance(p, (int, float)) and p > 0 and train is not False:
            raise PlanError(f"context={self.ranks}: dropout (p={p}) at {node.name} on this rank's tokens would not "
                            "draw serial's mask. Set the model's dropout to 0 for training under context "
                            "parallelism, or use context=1.")
