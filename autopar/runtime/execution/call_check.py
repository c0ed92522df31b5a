"""What the ranks are about to run, compared before any collective of a call (no hang, no silent mix-up).

A parallel model's forward is collective: every rank of the grid must call it with the same kind of
call (training, or evaluation under ``no_grad``) and inputs that fit together. A script that
evaluates on rank 0 only (``if master_process: estimate_loss()``) would otherwise hang in the first
collective with no message, and ranks feeding another batch than the others would train on a mix.

So each call of a model with collectives in forward first all-gathers, over a gloo group of the whole
world (CPU: no device synchronization), a few numbers describing it (``Descriptor``): the kind of call,
a hash of the inputs' structure, shapes and dtypes (the batch rows apart), this rank's rows and,
when the batch mode is being decided or checked, a fingerprint of the input values. An evaluation
call (and any call that needs the others' rows) waits for the answer at most ``timeout`` seconds;
a training call does not wait: its answer is checked at the next call. A mismatch or a timeout
raises ``AgreementError`` naming the ranks and the fix.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.compat import default_store, pytree
from autopar.config import AGREEMENT_BYTES
from autopar.errors import AgreementError, InputError
from autopar.runtime.comm import collectives as C
from autopar.runtime.comm.faults import Watch, is_comm_failure, ranks_text, watch

TRAIN, EVAL = 1.0, 2.0
_FIELDS = AGREEMENT_BYTES // 8


@dataclass(frozen=True)
class Descriptor:
    """One rank's call, as numbers (float64) every rank can compare."""

    kind: float
    """TRAIN (gradients enabled) or EVAL (no_grad / inference_mode)."""
    signature: tuple[float, float]
    """A hash of the inputs' structure, shapes (batch rows apart) and dtypes, in two exact halves."""
    rows: float
    """This rank's batch rows (dim 0 of the batch inputs; 0 without any)."""
    fingerprint: tuple[float, float] = (math.nan, math.nan)
    """Sums over the input values (plain, and weighted by each element's place), when they are to be compared
    (NaN: not computed)."""
    new: float = 0.0
    """1 when this rank has not seen this signature before."""

    def numbers(self) -> list[float]:
        return [self.kind, *self.signature, self.rows, *self.fingerprint, self.new]

    @staticmethod
    def of(row: Sequence[float]) -> Descriptor:
        return Descriptor(row[0], (row[1], row[2]), row[3], (row[4], row[5]), row[6])


def describe(kind: float, leaves: list[Any], spec: Any, split: dict[int, int], *, fingerprint: bool,
             new: bool) -> Descriptor:
    """This rank's descriptor of a call with flattened inputs ``leaves`` (``split``: the batch inputs)."""
    parts = [repr(spec)]
    rows = 0
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            shape = tuple(x.shape)
            if i in split:
                d = split[i]
                rows = shape[d]
                shape = (*shape[:d], "rows", *shape[d + 1:])
            parts.append(f"{shape}{x.dtype}{x.requires_grad}")
        else:
            parts.append(repr(x))
    digest = int.from_bytes(hashlib.sha256("|".join(parts).encode()).digest()[:13], "big")
    signature = (float(digest >> 52), float(digest & ((1 << 52) - 1)))
    fp = (math.nan, math.nan)
    if fingerprint:
        sums = []
        with torch.no_grad():
            for i, x in enumerate(leaves):
                if isinstance(x, torch.Tensor) and x.numel() and not isinstance(x, DTensor):  # a cache we split
                    v = torch.nan_to_num(x.detach().double(), nan=0.0, posinf=1e300, neginf=-1e300).flatten()
                    place = torch.arange(v.numel(), dtype=torch.float64, device=v.device).remainder_(65521).add_(1)
                    # a sum, and one weighted by place: rows in another order (a batch shuffled otherwise) differ
                    sums.append(torch.stack([v.sum(), (v * place).sum()]).cpu() * (i + 1))  # (a sync per device input)
        fp = tuple(torch.stack(sums).sum(0).tolist()) if sums else (0.0, 0.0)
    return Descriptor(kind, signature, float(rows), fp, 1.0 if new else 0.0)


class Agreement:
    """The world's descriptors of each call, gathered on a gloo group made once (see module docstring)."""

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self.group, self.timeout = group, timeout
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self._pending: tuple[Any, list[torch.Tensor], Descriptor] | None = None
        self.watch: Watch = watch(None if group is None else default_store(), self.rank, self.world)
        """This process's calls, told to the others when the ranks part (``autopar.runtime.comm.faults``)."""

    def exchange(self, mine: Descriptor, *, wait: bool) -> list[Descriptor] | None:
        """Posts this rank's descriptor; with ``wait``, returns every rank's (in rank order). In a simulated
        world (``collectives.simulated``) every rank's is this rank's."""
        if self.group is None and C.simulated():
            return [mine] * self.world if wait else None
        send = torch.tensor(mine.numbers(), dtype=torch.float64)
        out = [torch.empty(_FIELDS, dtype=torch.float64) for _ in range(self.world)]
        work = C.all_gather_async(out, send, self.group, self.world)
        if not wait:
            self._pending = (work, out, mine)
            return None
        return self._finish(work, out, mine)

    def pending(self) -> list[Descriptor] | None:
        """Every rank's descriptors of the last call that did not wait (None if there is none)."""
        if self._pending is None:
            return None
        work, out, mine = self._pending
        self._pending = None
        return self._finish(work, out, mine)

    def _finish(self, work: Any, out: list[torch.Tensor], mine: Descriptor) -> list[Descriptor]:
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            what = "evaluation" if mine.kind == EVAL else "training"
            lead = (f"rank {self.rank} waited {round(time.monotonic() - start):g} s for the other ranks to call the "
                    f"model ({what}), and not all of them did. A model split over ranks needs every rank in every "
                    "call: run evaluation and sampling on every rank (not only under `if rank == 0:` / `if "
                    "master_process:`), then use rank 0's result. If the ranks are only slow to arrive (one rank "
                    "writing a checkpoint first), raise auto_parallelize(eval_timeout=...) and the timeout of "
                    "init_process_group.")
            raise self.watch.failed(e, "the call's agreement (every rank's description of it)",
                                    lead if self.watch.raised_in is None else None) from None
        return [Descriptor.of(t.tolist()) for t in out]


def check_kinds(every: list[Descriptor]) -> None:
    """Raises unless every rank made the same kind of call (training or evaluation)."""
    if len({d.kind for d in every}) > 1:
        raise AgreementError(_kinds_message(every))


def _kinds_message(every: list[Descriptor]) -> str:
    evals = [r for r, d in enumerate(every) if d.kind == EVAL]
    trains = [r for r, d in enumerate(every) if d.kind == TRAIN]
    return (f"the ranks called the model differently: rank(s) {ranks_text(evals)} for evaluation (no_grad) while "
            f"rank(s) {ranks_text(trains)} called it for training. A model split over ranks needs every rank in "
            "every call: run evaluation and sampling on every rank (not only under `if rank == 0:` / `if "
            "master_process:`), then use rank 0's result.")


GLOBAL, PER_RANK = "global", "per-rank"


class CallCheck:
    """Decides how the ranks feed the model (one global batch, or a batch per rank) and checks every call
    of a model with collectives in forward against the other ranks (module docstring).

    Args:
        group: the gloo group the descriptors travel on (``Mesh.control``).
        batch: "auto", "global" or "per-rank" (``InputConfig.batch``).
        timeout: seconds a waiting call waits (``InputConfig.eval_timeout``).
        members: the ranks that pool their rows under per-rank batches (``Mesh.shard_members``).
        pure_data: no collective in forward under per-rank batches (data parallelism only): such calls
            are not checked, as under DDP.
        values: compare the input values of every call under a global batch (``InputConfig.check_inputs``),
            not only of each new signature's first.
    """

    def __init__(self, group: dist.ProcessGroup, batch: str, timeout: float, members: list[int],
                 pure_data: bool, values: bool = True) -> None:
        self.agreement = Agreement(group, timeout)
        self.watch = self.agreement.watch
        self.mode: str | None = None if batch == "auto" else batch
        self.members, self.pure_data, self.values = members, pure_data, values
        self._seen: set[Any] = set()
        self._following: int | None = None
        """Inside ``following()``: the calls made there so far."""

    @contextlib.contextmanager
    def following(self) -> Iterator[None]:
        """Calls that follow from the first one's outputs alone, the same on every rank (a greedy
        ``generate()``): the first is checked, and the rest are not (one collective less per decode step)."""
        outer, self._following = self._following, 0
        try:
            yield
        finally:
            self._following = outer

    def check(self, leaves: list[Any], spec: Any, split: dict[int, int], grad: bool
              ) -> tuple[str, list[Descriptor] | None]:
        """The batch mode, and every rank's descriptor of this call when it waited for them."""
        self.settle()
        parted = self.watch.unfinished()  # (this rank's last call raised: did the others go on too?)
        self.watch.begin(grad)
        if self.mode == PER_RANK and self.pure_data:
            return PER_RANK, None
        if self._following is not None:
            self._following += 1
            if self._following > 1 and self.mode == GLOBAL:
                return GLOBAL, None
        key = (repr(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves))
        new = key not in self._seen
        self._seen.add(key)
        detect = self.mode is None
        fingerprint = detect or (self.mode == GLOBAL and (new or self.values))
        pooled = self.mode == PER_RANK and len(self.members) > 1
        mine = describe(TRAIN if grad else EVAL, leaves, spec, split, fingerprint=fingerprint, new=new)
        every = self.agreement.exchange(mine, wait=not grad or detect or (fingerprint and new) or pooled or parted)
        if every is None:
            return self.mode, None
        self.watch.raised_in = None
        if detect:
            same = all(e.signature == every[0].signature and e.rows == every[0].rows
                       and e.fingerprint == every[0].fingerprint for e in every)
            self.mode = GLOBAL if same else PER_RANK
        self._validate(every)
        return self.mode, every

    def settle(self, outputs: Any = None) -> None:
        """Checks the last call's descriptors if it did not wait for them (a training call): called when its
        forward returns, so a call the ranks made differently (other inputs, one rank's extra call meeting the
        others' next) raises before its outputs or gradients are used; its exchange has long arrived by then.
        ``outputs``: the call's, whose backward is followed (``Watch.follow_backward``)."""
        previous = self.agreement.pending()
        if previous is not None:
            self._validate(previous)
        self.watch.returned()
        if outputs is not None and torch.is_grad_enabled():
            self.watch.follow_backward([t for t in pytree.tree_leaves(outputs)
                                        if isinstance(t, torch.Tensor) and t.requires_grad])

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around a call's execution: an error raised inside is told to the others (they may be waiting in its
        collectives) and the next call waits to see every rank make it; a collective that failed where
        ``collectives`` could not tell it (inside a compiled graph, torch's pipeline schedule) becomes
        ``RanksPartedError``."""
        try:
            yield
        except BaseException as e:
            if is_comm_failure(e):
                raise self.watch.failed(e) from e
            if not isinstance(e, AgreementError):
                self.watch.raised(e)
            raise

    def _validate(self, every: list[Descriptor]) -> None:
        check_kinds(every)
        if self.mode == GLOBAL:
            first = every[0]
            other = [r for r, e in enumerate(every) if e.signature != first.signature or e.rows != first.rows
                     or not (math.isnan(e.fingerprint[0]) or math.isnan(first.fingerprint[0])
                             or e.fingerprint == first.fingerprint)]
            if other:
                raise InputError(
                    f"rank(s) {ranks_text(other)} passed other inputs than rank 0 (other shapes or values), but the "
                    "model takes one global batch, the same on every rank (batch='global', or decided at the first "
                    "call, where the ranks' inputs were equal). If each rank feeds its own batch (DistributedSampler, "
                    "seed_offset = rank, as under DDP), pass auto_parallelize(batch='per-rank').")
        elif self.mode == PER_RANK and len(self.members) > 1:
            signatures = {every[r].signature for r in self.members}
            if len(signatures) > 1:
                raise InputError(
                    f"ranks {ranks_text(self.members)} pool their per-rank batches (they split the model between "
                    "them), so their inputs must have the same shapes apart from the batch rows (dim 0); they differ "
                    "(e.g. another sequence length). Pad every rank's batch to one length, or use a grid whose "
                    "tensor and pipeline degrees are 1.")
