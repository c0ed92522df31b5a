"""context_experts: routed-experts modules under context parallelism, for ``passes.split_context``: a module whose
routing ``passes.analysis.token_rows`` proves works token by token runs on this rank's tokens.

Requires: the splitter's ``state``, ``tokens``, ``ranks`` and ``spec()`` (``ExpertRules`` is mixed into it), and
the blocks ``passes.analysis.token_rows.expert_blocks`` found.
Ensures: ``after_inputs`` puts a block's ops after what it reads from outside, so the walk meets the block once
what it reads is known; ``expert_block`` cuts the block's row counts to this rank's tokens and marks what it hands
on as this rank's tokens, or says why it cannot (the splitter then reads the tokens whole there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from passes.analysis.token_rows import ExpertBlock, local_rows

aten = torch.ops.aten


def after_inputs(graph: fx.Graph, block: ExpertBlock) -> None:
    """Moves the ops of ``block`` that come before something it reads from outside (a marker a pass put right
    after the rows it reads) to after it, where only the block reads them: the walk then meets the block once
    everything it reads has its split known."""
    members = set(block.nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [a for n in block.nodes for a in n.all_input_nodes if a not in members]
    if not inputs:
        return
    anchor = max(inputs, key=order.__getitem__)
    early = [n for n in block.nodes if order[n] < order[anchor]]
    if any(u not in members and order[u] <= order[anchor] for n in early for u in n.users):
        return
    for n in early:
        anchor.append(n)
        anchor = n


class ExpertRules:
    """The routed-experts rule, mixed into ``split_context``'s splitter (see the module's Requires)."""

    state: dict[fx.Node, Any]
    tokens: int
    ranks: int

    def expert_block(self, block: ExpertBlock) -> str | None:
        """A routed-experts module run on this rank's tokens (``passes.analysis.token_rows``): its sizes made this
        rank's, what it hands on holding this rank's tokens; None, or why it cannot (it then reads them whole)."""
        members, entries, outer = set(block.nodes), {}, None
        for n in block.nodes:
            for a in n.all_input_nodes:
                s = self.state.get(a)
                if a in members or s is None:
                    continue
                if isinstance(s, tuple) or s.dim != 0 or (outer is not None and s.outer != outer):
                    return f"{a.name} holds this rank's tokens other than as rows"
                outer = s.outer
                entries[a] = s.inner
        if outer is None:
            return "it reads none of this rank's tokens as rows"
        found = local_rows(block, entries, outer * self.tokens)
        if isinstance(found, str):
            return found
        for n in found.sized:  # (its sizes counted every rank's tokens' rows)
            if n.target is aten.arange.default:
                n.args = (n.args[0] // self.ranks, *n.args[1:])
            else:
                size = list(n.args[1])
                size[0] //= self.ranks
                n.args = (n.args[0], size, *n.args[2:])
        for n, grain in found.exits.items():
            self.state[n] = self.spec(0, outer=outer, inner=grain)
        return None
