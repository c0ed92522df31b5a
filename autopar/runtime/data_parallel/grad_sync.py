"""Gradient sync in buckets, overlapped with backward (what DDP's reducer does, for autopar's groups).

One all-reduce per parameter pays a collective's fixed cost per parameter (28 calls for FC_Net where
DDP makes 3). ``GradSync`` instead packs the gradients of one group into buckets of about
``BUCKET_BYTES``, in the order backward produces them (the reverse of the parameters' order), and
launches a bucket's all-reduce asynchronously as soon as its last gradient arrives, while backward
goes on. At the end of backward (an autograd engine callback) it waits for every bucket and adds
each parameter's reduced gradient in place of its local one.

Every rank launches the same buckets in the same order: bucket k is launched only after bucket
k - 1, and a bucket whose parameters got no gradient this backward is launched at the end with zeros
there. A post-accumulate-grad hook copies the new local gradient into its bucket: after autograd added
it to ``p.grad``, so the script's own tensor hooks on the parameter (``p.register_hook``: clipping or
masking a gradient) have shaped it, as under DDP. The end callback overwrites ``p.grad`` with the sum,
or, when ``p.grad`` held an earlier gradient (accumulation without no_sync; a tensor hook registered
first keeps a copy of it), that plus the sum. A gradient the bucket took whole (no earlier one, the
bucket's dtype) becomes a view of its slot at once, as DDP's ``gradient_as_bucket_view`` makes it: its own
memory goes, and the sum arrives in place, so backward holds the gradients once, not twice (48 layers of
4 MiB: a peak of 196 MiB where the copies made it 384). The buffers are the gradients from then on, freed
with them (``zero_grad``).

Like DDP, only ``backward()`` synchronizes: ``torch.autograd.grad`` on the parameters returns this
rank's local gradients (and leaves ``p.grad`` as it was). While ``enabled()`` is false (DDP's ``no_sync``)
backward keeps the gradients local; the next backward that synchronizes reduces everything accumulated
since (its bucket slot holds ``p.grad`` plus the new gradient, and the sum replaces ``p.grad``). A sum
``p.grad`` held when the no_sync backwards began is kept aside and added once, not summed again.

Under ``shard_optimizer`` (``shards``), a bucket of parameters whose optimizer state is split over data is
reduce-scattered instead: each data rank receives the sum of its chunk of every gradient
(``DataShards.pack`` lays the buffer out), and ``p.grad`` becomes that chunk, a DTensor split over data. An
earlier chunk in ``p.grad`` is taken out before autograd adds the new whole gradient (the first tensor
hook), then added to the new chunk. The whole gradient is dropped as soon as its bucket holds it, and at
most ``INFLIGHT`` such buckets keep their whole buffers while their reduce-scatters run (launching another
waits for the oldest), so backward's peak holds the chunks and a few buckets, not every whole gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.compat import queue_backward_callback
from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.collectives import BUCKET_BYTES
from autopar.runtime.params.data_shards import DataShards, Layout, split_over_data
from autopar.runtime.params.layout import local_of, replace_local
from passes.analysis.estimate_memory import SCATTER_BUCKETS_HELD


INFLIGHT = SCATTER_BUCKETS_HELD - 1
"""Reduce-scattered buckets whose whole buffers backward keeps at once: launching another waits for the oldest
(with the bucket filling, the plan's ``SCATTER_BUCKETS_HELD``)."""


class _Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype | None,
                 layouts: list[Layout] | None = None, flags: bool = False) -> None:
        self.params, self.dtype = params, dtype
        """The reduction's dtype; None: the parameters' own at each backward (``model.to(dtype)`` changes it)."""
        self.layouts = layouts
        """Reduce-scattered over data (``shard_optimizer``): each parameter's split; None: all-reduced."""
        self.offsets, self.sizes, n = [], [], 0
        for i, p in enumerate(params):
            self.offsets.append(n)
            self.sizes.append(local_of(p).numel() if layouts is None else layouts[i].width)
            n += self.sizes[-1]
        self.numel = n
        """Elements of the gradients in the buffer; of one data rank's row when reduce-scattered."""
        self.flags = flags
        self.width = n + len(params) * flags
        """Elements of the buffer (of a row): the gradients, then with ``flags`` one per parameter, 1 where this
        rank got its gradient this backward (summed: whether any rank did)."""
        self.reset()

    def reset(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.got = [False] * len(self.params)
        self.missing = len(self.params)
        """Parameters still without a gradient this backward (a counter: checked at every hook)."""
        self.local: list[torch.Tensor | None] = [None] * len(self.params)
        """What ``p.grad`` held before this backward added to it (accumulation without no_sync)."""
        self.replace = [False] * len(self.params)
        """The slot holds ``p.grad`` too (gradients accumulated under no_sync): the sum replaces ``p.grad``."""
        self.work: Any = None
        self.launched = False
        self.mine: torch.Tensor | None = None
        """Reduce-scattered: this rank's row of the sums."""

    def alloc(self, rows: int = 1) -> torch.Tensor:
        """The buffer (allocated per backward: no memory held between steps); ``rows`` x ``numel``."""
        if self.buffer is None:
            dtype = self.dtype or functools.reduce(torch.promote_types, [p.dtype for p in self.params])
            self.buffer = torch.empty(rows * self.width, dtype=dtype, device=local_of(self.params[0]).device)
        return self.buffer

    def slot(self, i: int) -> torch.Tensor:
        return self.alloc()[self.offsets[i]:self.offsets[i] + self.sizes[i]]


class GradSync:
    """Sums the gradients of ``params`` over ``group`` (``size`` ranks) once per backward. With ``shards`` (the
    data group under ``shard_optimizer``), a parameter whose optimizer state is split over data gets only
    this rank's chunk of the sum (a reduce-scatter, then with ``rest`` an all-reduce of the chunks over the
    depth ranks), as ``p.grad`` split over data; the others all-reduce."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, size: int,
                 reduce_dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES,
                 enabled: Callable[[], bool] = lambda: True, shards: DataShards | None = None,
                 rest: tuple[dist.ProcessGroup, int] | None = None, branches: bool = False) -> None:
        """``branches``: the ranks may run different code (the uncaptured model's forward), so a parameter may
        get a gradient on some ranks only: each bucket also sums a flag per parameter saying which did, and a
        rank that got none takes the sum (without it the ranks' parameters would part)."""
        self.group, self.size, self.reduce_dtype, self.enabled = group, size, reduce_dtype, enabled
        self.branches = branches
        self.params = tuple(params)
        """The parameters whose gradients it sums."""
        self.shards = shards
        self.rest = rest
        """The other axis the gradients are summed over (depth), after the reduce-scatter over data: an
        all-reduce of the chunks."""
        self.unsynced: set[int] = set()
        """Parameters whose ``.grad`` holds gradients a no_sync backward kept local."""
        self.carried: dict[int, torch.Tensor] = {}
        """The sum ``p.grad`` held when a no_sync backward began (a chunk where reduce-scattered; zeros after
        ``zero_grad(set_to_none=False)``): not summed again, added once to the next sum."""
        self.layouts: dict[int, Layout] = {}
        if shards is not None:
            for p in params:
                layout = shards.grad_layout(p)
                if layout is not None:
                    self.layouts[id(p)] = layout
        self.buckets: list[_Bucket] = []
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index in bucket)
        current: list[nn.Parameter] = []
        nbytes = 0
        for p in reversed(list(params)):  # backward produces the last parameters' gradients first
            dtype = reduce_dtype or p.dtype
            numel = local_of(p).numel()
            if current and (nbytes + numel * dtype.itemsize > bucket_bytes
                            or (reduce_dtype or current[0].dtype) != dtype
                            or (id(p) in self.layouts) != (id(current[0]) in self.layouts)):
                self._add(current)
                current, nbytes = [], 0
            current.append(p)
            nbytes += numel * dtype.itemsize
        if current:
            self._add(current)
        self.handles = [p.register_hook(self._before(p)) for p in params] + \
            [p.register_post_accumulate_grad_hook(self._hook(p)) for p in params]
        self._pending = False
        self._inflight: list[_Bucket] = []
        """Reduce-scattered buckets launched this backward whose whole buffer is still held."""

    def _add(self, params: list[nn.Parameter]) -> None:
        k = len(self.buckets)
        for i, p in enumerate(params):
            self.where[id(p)] = (k, i)
        scattered = id(params[0]) in self.layouts
        self.buckets.append(_Bucket(params, self.reduce_dtype,
                                    [self.layouts[id(p)] for p in params] if scattered else None, self.branches))

    def _before(self, p: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
        """The first tensor hook of ``p`` (registered before any of the script's): keeps a copy of an earlier
        gradient ``p.grad`` holds, which autograd is about to add to, and which is not to be summed again.
        A reduce-scattered parameter's earlier gradient is a chunk: it is taken out of ``p.grad`` (autograd
        then keeps the new whole gradient there, which the bucket reads) and added back to the new chunk."""
        k, i = self.where[id(p)]
        layout = self.layouts.get(id(p))

        def hook(grad: torch.Tensor) -> torch.Tensor:
            bucket = self.buckets[k]
            if p.grad is None or id(p) in self.unsynced:  # (whole gradients no_sync kept: autograd adds to them)
                return grad
            if layout is not None:
                if not self.enabled() and not split_over_data(p.grad):
                    return grad
                earlier = local_of(p.grad).detach()
                if not split_over_data(p.grad):  # (set by the script) its chunk only: the rest is summed away
                    earlier = layout.chunk(earlier).clone()
                if self.enabled():
                    bucket.local[i] = earlier
                else:
                    self.carried[id(p)] = earlier
                p.grad = None
            elif not self.enabled():  # a sum already: kept once, whatever no_sync backwards add to it
                self.carried[id(p)] = local_of(p.grad).detach().clone()
            elif bucket.local[i] is None:
                bucket.local[i] = local_of(p.grad).detach().clone()
            else:
                return grad
            queue_backward_callback(functools.partial(self._settle, p, k, i))
            return grad

        return hook

    def _settle(self, p: nn.Parameter, k: int, i: int) -> None:
        """At the end of a backward whose first hook kept ``p``'s earlier gradient: if no new gradient came
        (``torch.autograd.grad``, or ``p`` unused), the earlier one is not to be added to anything; a chunk
        taken out of ``p.grad`` goes back."""
        bucket = self.buckets[k]
        if bucket.got[i] or id(p) in self.unsynced:  # it came: finish (or the next synced backward) adds it
            return
        earlier = bucket.local[i] if id(p) not in self.carried else self.carried.pop(id(p))
        bucket.local[i] = None
        if id(p) in self.layouts and p.grad is None and earlier is not None:
            p.grad = self.shards.split_grad(p, earlier, self.layouts[id(p)])

    def _hook(self, p: nn.Parameter) -> Callable[[nn.Parameter], None]:
        k, i = self.where[id(p)]

        def hook(param: nn.Parameter) -> None:
            if not self.enabled():
                self.unsynced.add(id(p))
                return
            bucket = self.buckets[k]
            if bucket.launched or bucket.got[i]:
                raise RuntimeError(f"autopar: a second gradient of a parameter of shape {tuple(p.shape)} arrived "
                                   "in one backward, after its bucket was reduced; this is an autopar bug: please "
                                   "report it with the model.")
            if not self._pending:
                self._pending = True
                queue_backward_callback(self.finish)
            whole = local_of(p.grad)
            if id(p) in self.unsynced:  # reduce what no_sync kept local too; the sum replaces p.grad
                self.unsynced.discard(id(p))
                bucket.replace[i] = True
                carried = self.carried.get(id(p)) if bucket.layouts is None else None
                new = whole if carried is None else whole - carried  # (an earlier sum does not travel)
            elif bucket.local[i] is not None and bucket.layouts is None:  # an earlier gradient plus this one
                new = whole - bucket.local[i]  # (only this one travels)
            else:
                new = whole
            if bucket.layouts is None:
                slot = bucket.slot(i)
                slot.copy_(new.reshape(-1))
                if new is whole and slot.dtype == whole.dtype and whole.is_contiguous():
                    self._view_bucket(p, slot.view_as(whole))
                del whole, new
            else:
                rows = bucket.alloc(self.size).view(self.size, bucket.width)
                self.shards.pack(new, bucket.layouts[i], rows, bucket.offsets[i])
                p.grad = None  # (in the bucket now: the whole gradient's memory goes; finish puts the chunk)
                del whole, new
            bucket.got[i] = True
            bucket.missing -= 1
            if bucket.missing == 0:
                self._launch_ready()

        return hook

    @staticmethod
    def _view_bucket(p: nn.Parameter, view: torch.Tensor) -> None:
        """``p.grad`` becomes ``view``, its slot of the bucket (which holds the same values): the gradient's own
        memory goes at once, and the sum arrives there in place (DDP's ``gradient_as_bucket_view``)."""
        if isinstance(p.grad, DTensor):
            replace_local(p.grad, view)
        else:
            p.grad = view

    def _launch_ready(self) -> None:
        """Launches complete buckets, in order, up to the first incomplete one."""
        for bucket in self.buckets:
            if bucket.launched:
                continue
            if bucket.missing:
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.layouts is not None:
            rows = bucket.alloc(self.size).view(self.size, bucket.width)
            for i, got in enumerate(bucket.got):
                if not got:  # no gradient this backward: zeros keep every rank's buckets alike
                    rows[:, bucket.offsets[i]:bucket.offsets[i] + bucket.sizes[i]].zero_()
            if bucket.flags:
                rows[:, bucket.numel:].copy_(torch.tensor(bucket.got, dtype=rows.dtype))  # (every rank's row)
            bucket.mine = rows.new_empty(bucket.width)
            bucket.work = C.reduce_scatter_async(bucket.mine, bucket.buffer, self.group, self.size)
            bucket.launched = True
            self._inflight.append(bucket)
            while len(self._inflight) > INFLIGHT:  # the oldest one's whole buffer goes once it is reduced
                done = self._inflight.pop(0)
                C.wait(done.work)
                done.work, done.buffer = None, None
            return
        for i, got in enumerate(bucket.got):
            if not got:  # no gradient this backward: zeros keep every rank's buckets alike
                bucket.slot(i).zero_()
        bucket.slot(0)  # allocates the buffer if no gradient came
        if bucket.flags:
            bucket.buffer[bucket.numel:].copy_(torch.tensor(bucket.got, dtype=bucket.buffer.dtype))
        bucket.work = C.all_reduce_async(bucket.buffer, self.group, self.size)
        bucket.launched = True

    def finish(self) -> None:
        """Waits for every bucket and puts each reduced gradient in ``p.grad`` (idempotent)."""
        if not self._pending:
            return
        self._pending = False
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        self._inflight.clear()
        for bucket in self.buckets:
            if bucket.work is not None:
                C.wait(bucket.work)
            if bucket.layouts is not None and self.rest is not None:
                C.all_reduce(bucket.mine, *self.rest)
            # a parameter this rank's backward did not reach (a branch it did not take) that another's did: its
            # gradient is the sum too, or the ranks' parameters would part (read only where one is missing)
            elsewhere = [False] * len(bucket.params) if all(bucket.got) or not bucket.flags else \
                [x > 0 for x in (bucket.mine if bucket.layouts is not None else bucket.buffer)[bucket.numel:].tolist()]
            for i, p in enumerate(bucket.params):
                if bucket.layouts is not None:
                    if bucket.got[i] or elsewhere[i]:
                        self._put_chunk(p, bucket, i)
                    continue
                if not bucket.got[i] and elsewhere[i] and p.grad is None:
                    with torch.no_grad():
                        p.grad = torch.zeros_like(p)
                    bucket.got[i] = True
                if not bucket.got[i] or p.grad is None:  # no gradient, or torch.autograd.grad
                    continue
                grad = local_of(p.grad)  # a DTensor parameter's gradient is one too: its local part
                reduced = bucket.slot(i).view_as(grad)
                earlier = self.carried.pop(id(p), None) if bucket.replace[i] else bucket.local[i]
                with torch.no_grad():
                    if earlier is None:
                        if grad.data_ptr() != reduced.data_ptr() or grad.dtype != reduced.dtype:
                            grad.copy_(reduced)  # (else p.grad is the bucket's slot: the sum is there)
                    else:  # the earlier gradient (or sum), plus the sum of this backward's (and no_sync's)
                        grad.copy_(earlier + reduced.to(grad.dtype))
            bucket.reset()

    def _put_chunk(self, p: nn.Parameter, bucket: _Bucket, i: int) -> None:
        """``p.grad`` becomes this rank's chunk of the sum (plus an earlier chunk), split over data."""
        piece = local_of(p)
        layout = bucket.layouts[i]
        chunk = self.shards.unpack(bucket.mine, bucket.offsets[i], layout, piece.shape)
        earlier = self.carried.pop(id(p), None) if bucket.replace[i] else bucket.local[i]
        with torch.no_grad():
            if earlier is not None:
                chunk = earlier + chunk.to(p.dtype)
            elif chunk.dtype != p.dtype:
                chunk = chunk.to(p.dtype)
        p.grad = self.shards.split_grad(p, chunk, layout)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
