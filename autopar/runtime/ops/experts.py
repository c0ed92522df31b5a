"""Routed experts split over a group of ranks (expert parallelism): each rank holds ``experts / size`` whole
experts, and the rows routed to an expert go to its rank and come back (``ExpertExchange``).

A routed experts layer works on its tokens' picks as rows sorted by expert (``offsets``: the running count of
rows per expert, what transformers' grouped matmul experts and ``torch._grouped_mm`` read). ``dispatch`` sends
each rank the rows of its experts, from every rank of the group (one all-to-all of the per-expert counts, one
of the rows), and orders them by local expert, so the layer's grouped matmuls run on this rank's experts
with offsets of their own; ``combine`` sends the results back, in the order the rows left. Batched matmuls'
experts (Llama 4: ``[experts, rows, features]``, every expert a block of as many rows) move the same way
(``dispatch_blocks``), each local expert receiving its block from every rank. Nothing is
dropped and nothing is padded (no capacity factor): each row's result is computed by the expert serial's
layer computed it with, from the same numbers. Backward sends the gradients the other way (a dispatch's
backward is a combine, and a combine's a dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.mesh import Mesh
from passes.ir import ExpertSpec


@dataclass(frozen=True, slots=True)
class Routes:
    """How one dispatch moved the rows: the counts sent to each rank and received from each, and the order
    that turns the received rows (by source rank, then local expert) into rows by local expert."""

    send: tuple[int, ...]
    receive: tuple[int, ...]
    order: torch.Tensor
    """Received row at each position of the rows by local expert."""


class ExpertExchange:
    """Sends rows to the ranks holding their experts and back, over ``group`` (``size`` ranks, this rank at
    ``index``), for ``experts`` routed experts split in consecutive blocks of ``experts // size``."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, index: int, experts: int) -> None:
        if experts % size:
            raise ValueError(f"{experts} experts do not split over {size} ranks")
        self.group, self.size, self.index, self.experts = group, size, index, experts
        self.local = experts // size

    def routes(self, offsets: torch.Tensor) -> tuple[Routes, torch.Tensor]:
        """The routes of rows sorted by expert with running counts ``offsets``, and this rank's offsets (the
        running count of the rows it receives, per local expert, in ``offsets``' dtype)."""
        ends = offsets.to(torch.int64)
        counts = torch.diff(ends, prepend=ends.new_zeros(1)).view(self.size, self.local)
        received = C.all_to_all(counts, [1] * self.size, [1] * self.size, self.group, self.size, self.index)
        received = received.view(self.size, self.local)  # [source rank, local expert]
        flat = received.reshape(-1)
        starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) block starts among the received rows
        by_expert = received.t().reshape(-1)
        block_starts = starts.view(self.size, self.local).t().reshape(-1)
        order = torch.repeat_interleave(block_starts - (torch.cumsum(by_expert, 0) - by_expert), by_expert) \
            + torch.arange(int(by_expert.sum()), device=offsets.device)
        local_offsets = torch.cumsum(received.sum(0), 0).to(offsets.dtype)
        send = tuple(int(c) for c in counts.sum(1).tolist())
        receive = tuple(int(c) for c in received.sum(1).tolist())
        return Routes(send, receive, order), local_offsets

    def dispatch(self, x: torch.Tensor, offsets: torch.Tensor, *rows: torch.Tensor) -> tuple[Any, ...]:
        """(this rank's rows of ``x`` by local expert, its offsets, the same rows of each of ``rows``, the
        routes ``combine`` takes back)."""
        routes, local_offsets = self.routes(offsets)
        moved = [_Moved.apply(t, routes, self, True) for t in (x, *rows)]
        return (moved[0], local_offsets, *moved[1:], routes)

    def combine(self, y: torch.Tensor, routes: Routes) -> torch.Tensor:
        """The rows ``dispatch`` sent out, their results back in the order they left."""
        return _Moved.apply(y, routes, self, False)

    def dispatch_blocks(self, x: torch.Tensor, *rows: torch.Tensor) -> tuple[Any, ...]:
        """``dispatch`` of rows in blocks, one per expert (``[experts, rows, features]``, batched matmuls' experts):
        (this rank's ``[local experts, rows of every rank, features]``, the same of each of ``rows``, the
        routes)."""
        experts, per = x.shape[0], x.shape[1]
        offsets = torch.arange(1, experts + 1, device=x.device) * per
        moved, _, *others, routes = self.dispatch(x.flatten(0, 1), offsets, *(v.flatten(0, 1) for v in rows))
        shape = (self.local, moved.shape[0] // self.local)  # (each local expert: the rows of every rank)
        return (moved.unflatten(0, shape), *(v.unflatten(0, shape) for v in others), routes)

    def combine_blocks(self, y: torch.Tensor, routes: Routes) -> torch.Tensor:
        """``combine`` of ``dispatch_blocks``' rows: ``[experts, rows, features]`` back."""
        back = self.combine(y.flatten(0, 1), routes)
        return back.unflatten(0, (self.experts, back.shape[0] // self.experts))

    def send_out(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        received = C.all_to_all(x, routes.send, routes.receive, self.group, self.size, self.index)
        return received.index_select(0, routes.order)

    def send_back(self, y: torch.Tensor, routes: Routes) -> torch.Tensor:
        received = torch.empty_like(y).index_copy_(0, routes.order, y)
        return C.all_to_all(received, routes.receive, routes.send, self.group, self.size, self.index)


class ExpertOps:
    """The bound ``expert_dispatch`` / ``expert_combine`` of one layer (``spec``) on this rank."""

    def __init__(self, spec: ExpertSpec, mesh: Mesh) -> None:
        self.exchange = ExpertExchange(mesh.group(spec.axis), mesh.size(spec.axis), mesh.index(spec.axis),
                                       spec.experts)
        self.batched = spec.batched

    def dispatch(self, rows: torch.Tensor, offsets: torch.Tensor | None,
                 inputs: list[torch.Tensor]) -> tuple[Any, ...]:
        if not self.batched:
            return self.exchange.dispatch(rows, offsets, *inputs)
        x, *moved, routes = self.exchange.dispatch_blocks(rows, *inputs)
        return (x, None, *moved, routes)

    def combine(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        return self.exchange.combine_blocks(x, routes) if self.batched else self.exchange.combine(x, routes)


class _Moved(torch.autograd.Function):
    """Rows moved by ``routes``: out to the experts' ranks (``outward``) or back; the gradients go the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, routes: Routes, exchange: ExpertExchange, outward: bool) -> torch.Tensor:
        ctx.routes, ctx.exchange, ctx.outward = routes, exchange, outward
        return exchange.send_out(x, routes) if outward else exchange.send_back(x, routes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        move = ctx.exchange.send_back if ctx.outward else ctx.exchange.send_out
        return move(grad, ctx.routes), None, None, None
