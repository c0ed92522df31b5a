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
    """The bound ``expert_dispatch`` / ``expert_combine`` of one layer (``spec``) on this rank. Under a lent
    tensor axis (``spec.lent``: whole experts over data x row) the ranks of that axis hold the same rows: each
    sends only its block of them (``RowBlocks``), and the results come back gathered over the axis."""

    def __init__(self, spec: ExpertSpec, mesh: Mesh) -> None:
        self.exchange = ExpertExchange(mesh.group(spec.axis), mesh.size(spec.axis), mesh.index(spec.axis),
                                       spec.experts)
        self.batched = spec.batched
        lent = spec.lent if spec.lent and mesh.size(spec.lent) > 1 else ""
        self.blocks = RowBlocks(mesh.group(lent), mesh.size(lent), mesh.index(lent), 1 if spec.batched else 0) \
            if lent else None

    def dispatch(self, rows: torch.Tensor, offsets: torch.Tensor | None,
                 inputs: list[torch.Tensor]) -> tuple[Any, ...]:
        total = 0
        if self.blocks is not None:  # (this rank's block of the rows every rank of the lent axis holds)
            total = rows.shape[self.blocks.dim]
            start, stop = self.blocks.bounds(total)
            rows, *inputs = (self.blocks.block(t, total) for t in (rows, *inputs))
            if offsets is not None:  # (rows sorted by expert: each expert's rows of the block)
                offsets = (offsets - start).clamp(0, stop - start)
        if not self.batched:
            *out, routes = self.exchange.dispatch(rows, offsets, *inputs)
        else:
            x, *moved, routes = self.exchange.dispatch_blocks(rows, *inputs)
            out = [x, None, *moved]
        return (*out, (routes, total))

    def combine(self, x: torch.Tensor, routes: tuple[Routes, int]) -> torch.Tensor:
        moved, total = routes
        y = self.exchange.combine_blocks(x, moved) if self.batched else self.exchange.combine(x, moved)
        return self.blocks.gathered(y, total) if self.blocks is not None else y


class RowBlocks:
    """The rows the ranks of a tensor axis (``group``, ``size`` ranks, this one at ``index``) all hold, cut along
    ``dim`` into consecutive blocks, one per rank (the first ``total % size`` one row larger)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, index: int, dim: int) -> None:
        self.group, self.size, self.index, self.dim = group, size, index, dim

    def bounds(self, total: int, index: int | None = None) -> tuple[int, int]:
        """Where rank ``index``'s block (this rank's by default) of ``total`` rows starts and stops."""
        i = self.index if index is None else index
        per, extra = divmod(total, self.size)
        start = i * per + min(i, extra)
        return start, start + per + (1 if i < extra else 0)

    def block(self, t: torch.Tensor, total: int) -> torch.Tensor:
        """This rank's block of ``t`` (``total`` rows along ``dim``, the same on every rank), differentiably: the
        gradient comes back whole, gathered from every rank's block."""
        return _Block.apply(t, self, total)

    def gathered(self, t: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's block (this rank's is ``t``) whole, differentiably: the gradient (the same on every rank)
        comes back as this rank's block of it."""
        return _Gathered.apply(t, self, total)

    def take(self, t: torch.Tensor, total: int) -> torch.Tensor:
        start, stop = self.bounds(total)
        return t.narrow(self.dim, start, stop - start)

    def gather(self, t: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's block (this rank's is ``t``), whole along ``dim`` (one all-gather, blocks padded to
        the largest)."""
        largest = -(-total // self.size)
        moved = t.movedim(self.dim, 0)
        if moved.shape[0] < largest:
            moved = torch.cat([moved, moved.new_zeros((largest - moved.shape[0], *moved.shape[1:]))])
        every = C.all_gather(moved, self.group, self.size)
        pieces = [every.narrow(0, i * largest, stop - start)
                  for i, (start, stop) in enumerate(self.bounds(total, i) for i in range(self.size))]
        whole = torch.cat(pieces)  # (a tensor of its own, never a view: the model may write into the result)
        return whole.movedim(0, self.dim).clone(memory_format=torch.contiguous_format) if self.dim else whole


class _Block(torch.autograd.Function):
    """This rank's block of rows every rank of a lent axis holds; backward gathers the blocks' gradients whole
    (the rows' gradient, the same on every rank of the axis, as a replicated value's is)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, blocks: RowBlocks, total: int) -> torch.Tensor:
        ctx.blocks, ctx.total = blocks, total
        return blocks.take(t, total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.blocks.gather(grad, ctx.total), None, None


class _Gathered(torch.autograd.Function):
    """Every rank's block of results, whole on each rank of a lent axis; backward keeps this rank's block of the
    gradient (the same on every rank of the axis)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, blocks: RowBlocks, total: int) -> torch.Tensor:
        ctx.blocks, ctx.total = blocks, total
        return blocks.gather(t, total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.blocks.take(grad, ctx.total).contiguous(), None, None


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
