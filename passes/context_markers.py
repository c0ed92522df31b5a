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
- ``cut_before_scatter``: a tensor whole over context whose tokens sequence parallelism scattered over a tensor
  axis (an attention computed whole, then its output projection's reduce-scatter) is made this rank's by cutting
  the scatter's input, the ops after it visited again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx

from autopar.errors import PlanError
from passes.context_shapes import Unsplittable, ndim_of, shape_of
from passes.ir import (ContextDropoutSpec, ContextSpec, context_dropout, convert_layout, gather_output, sharded_matmul,
                       split_dropout)

aten = torch.ops.aten


class MarkerRules:
    """The rules of the tensor grid's markers, mixed into ``split_context``'s splitter (see the module's Requires)."""

    state: dict[fx.Node, Any]
    tokens: int
    ranks: int

    def cut_before_scatter(self, other: fx.Node, want: ContextSpec) -> bool:
        """Whether ``other``, whole over context with its tokens scattered over a tensor axis, is now this rank's
        tokens (split as ``want``), its scatter's input cut; False where it is not so made."""
        found = self._scattered_chain(other, want)
        if not found:
            return False
        chain, cut = found
        x = chain[0].args[0]
        chain[0].replace_input_with(x, self.slice_of(x, cut, chain[0]))
        for n in chain:
            self._visit(n)
        if self.state.get(other) == want:
            return True
        raise PlanError(f"context={self.ranks}: {other.name} holds the whole sequence's tokens split over a tensor "
                        "axis (sequence parallelism), which autopar could not cut to this rank's. Use "
                        "sequence_parallel=False or context=1 for this model.")

    def _scattered_chain(self, other: fx.Node, want: ContextSpec) -> tuple[list[fx.Node], ContextSpec] | None:
        """The ops from a matmul whose partial sums sequence parallelism reduce-scatters along the tokens, or a
        scatter of them (each rank of the tensor axis then holds part of every context rank's tokens), to ``other``
        (to be split as ``want``), each the one reader of the one before, through views, dropouts and copies; and
        how the matmul's input is to be split. None where ``other`` is not so made."""
        chain, node, spec = [], other, want
        while isinstance(node, fx.Node) and node.op == "call_function" and self.state.get(node) is None:
            chain.append(node)
            x = node.args[0] if node.args else None
            if node.target in (sharded_matmul, convert_layout):  # (a reduce-scatter, or a scatter, along the tokens)
                last = node.args[-1]
                at = last.scatter_dim if node.target is sharded_matmul else (
                    -1 if last.dst.is_replicated else last.dst.dim % ndim_of(node))
                return (chain[::-1], spec) if at == spec.dim and ndim_of(x) == ndim_of(node) else None
            if not isinstance(x, fx.Node) or len(x.users) != 1:
                return None
            if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
                try:
                    spec = self._token_dim(spec, shape_of(node), shape_of(x))
                except Unsplittable:
                    return None
            elif node.target not in (split_dropout, aten.dropout.default, aten.clone.default, aten.contiguous.default,
                                     aten.alias.default):
                return None
            node = x
        return None

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
