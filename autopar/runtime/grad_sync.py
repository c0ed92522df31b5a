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
first keeps a copy of it), that plus the sum. Bucket buffers live from a bucket's first gradient to the
end of backward, as DDP's would, but are not held between steps.

Like DDP, only ``backward()`` synchronizes: ``torch.autograd.grad`` on the parameters returns this
rank's local gradients. While ``enabled()`` is false (DDP's ``no_sync``) backward keeps the gradients
local; the next backward that synchronizes reduces everything accumulated since (its bucket slot
holds ``p.grad`` plus the new gradient, and the sum replaces ``p.grad``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.compat import queue_backward_callback
from autopar.runtime import collectives as C
from autopar.runtime.param_layout import local_of

BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket cap."""


class _Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype | None) -> None:
        self.params, self.dtype = params, dtype
        """The reduction's dtype; None: the parameters' own at each backward (``model.to(dtype)`` changes it)."""
        self.offsets, self.sizes, n = [], [], 0
        for p in params:
            self.offsets.append(n)
            self.sizes.append(local_of(p).numel())
            n += self.sizes[-1]
        self.numel = n
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

    def slot(self, i: int) -> torch.Tensor:
        if self.buffer is None:  # allocated per backward: no memory held between steps
            dtype = self.dtype or functools.reduce(torch.promote_types, [p.dtype for p in self.params])
            self.buffer = torch.empty(self.numel, dtype=dtype, device=local_of(self.params[0]).device)
        return self.buffer[self.offsets[i]:self.offsets[i] + self.sizes[i]]


class GradSync:
    """Sums the gradients of ``params`` over ``group`` (``size`` ranks) once per backward."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, size: int,
                 reduce_dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES,
                 enabled: Callable[[], bool] = lambda: True) -> None:
        self.group, self.size, self.reduce_dtype, self.enabled = group, size, reduce_dtype, enabled
        self.unsynced: set[int] = set()
        """Parameters whose ``.grad`` holds gradients a no_sync backward kept local."""
        self.buckets: list[_Bucket] = []
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index in bucket)
        current: list[nn.Parameter] = []
        nbytes = 0
        for p in reversed(list(params)):  # backward produces the last parameters' gradients first
            dtype = reduce_dtype or p.dtype
            numel = local_of(p).numel()
            if current and (nbytes + numel * dtype.itemsize > bucket_bytes
                            or (reduce_dtype or current[0].dtype) != dtype):
                self._add(current)
                current, nbytes = [], 0
            current.append(p)
            nbytes += numel * dtype.itemsize
        if current:
            self._add(current)
        self.handles = [p.register_hook(self._before(p)) for p in params] + \
            [p.register_post_accumulate_grad_hook(self._hook(p)) for p in params]
        self._pending = False

    def _add(self, params: list[nn.Parameter]) -> None:
        k = len(self.buckets)
        for i, p in enumerate(params):
            self.where[id(p)] = (k, i)
        self.buckets.append(_Bucket(params, self.reduce_dtype))

    def _before(self, p: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
        """The first tensor hook of ``p`` (registered before any of the script's): keeps a copy of an earlier
        gradient ``p.grad`` holds, which autograd is about to add to, and which is not to be summed again."""
        k, i = self.where[id(p)]

        def hook(grad: torch.Tensor) -> torch.Tensor:
            bucket = self.buckets[k]
            if self.enabled() and p.grad is not None and id(p) not in self.unsynced and bucket.local[i] is None:
                bucket.local[i] = local_of(p.grad).detach().clone()
            return grad

        return hook

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
            grad = local_of(p.grad).reshape(-1)
            if id(p) in self.unsynced:  # reduce what no_sync kept local too; the sum replaces p.grad
                self.unsynced.discard(id(p))
                bucket.slot(i).copy_(grad)
                bucket.replace[i] = True
            elif bucket.local[i] is not None:  # an earlier gradient plus this one: only this one travels
                bucket.slot(i).copy_(grad - bucket.local[i].reshape(-1))
            else:
                bucket.slot(i).copy_(grad)
            bucket.got[i] = True
            bucket.missing -= 1
            if bucket.missing == 0:
                self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        """Launches complete buckets, in order, up to the first incomplete one."""
        for bucket in self.buckets:
            if bucket.launched:
                continue
            if bucket.missing:
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for i, got in enumerate(bucket.got):
            if not got:  # no gradient this backward: zeros keep every rank's buckets alike
                bucket.slot(i).zero_()
        bucket.slot(0)  # allocates the buffer if no gradient came
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
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            for i, p in enumerate(bucket.params):
                if not bucket.got[i] or p.grad is None:  # no gradient, or torch.autograd.grad
                    continue
                grad = local_of(p.grad)  # a DTensor parameter's gradient is one too: its local part
                reduced = bucket.slot(i).view_as(grad)
                with torch.no_grad():
                    if bucket.local[i] is None or bucket.replace[i]:
                        grad.copy_(reduced)
                    else:  # the earlier gradient, plus the sum of this backward's
                        grad.copy_(bucket.local[i] + reduced.to(grad.dtype))
            bucket.reset()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
