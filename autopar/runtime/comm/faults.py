"""When the ranks part: what each rank was doing, gathered through the c10d store into one error.

A collective that some rank never joins fails on the ranks that did after the process group's timeout (the
script's ``init_process_group(timeout=)``, which autopar's groups take too), with the backend's words ("Timed out
waiting 6000ms for recv", "Connection closed by peer"), which name neither the rank nor what it did. So:

- each call of a parallel model counts itself (``begin``); a call that raised on this rank posts that to the
  store (``raised``: one write, on the error path only), as it leaves the others waiting in its collectives;
- a rank whose collective fails inside autopar (``guarded``) posts what it was doing, reads the other ranks'
  posts for a few seconds, and raises ``RanksPartedError``: which ranks waited in which call, which raised and
  went on, and which sent nothing (stalled, dead, or running other code: a barrier, a checkpoint, a call made
  on some ranks only);
- torch.distributed's collectives, called by the script between the model's calls (its own ``dist.barrier()``,
  a checkpoint's gathers), raise the same account when they fail (``name_parted_ranks_in_script_collectives``,
  installed by ``autopar.patches`` while a parallel model lives).

Nothing is written to the store while the ranks agree: a step costs one counter increment.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from autopar.compat import queue_backward_callback
from autopar.errors import AutoparError, RanksPartedError

GRACE = 5.0
"""Seconds a failed rank waits for the others' posts (they fail at about the same moment, one timeout apart at
most when they started waiting at other calls)."""
_FRESH = 3600.0
"""Posts older than this (an earlier failure of the same job) are not read."""
_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "connectfullmesh",
          "socket", "nccl error", "watchdog", "aborted")


@dataclass(frozen=True)
class Post:
    """One rank's account of itself, as posted to the store."""

    rank: int
    call: int
    kind: str
    what: str
    at: float

    def line(self) -> str:
        return f"{self.call}|{self.kind}|{self.at:.3f}|{self.what}"

    @staticmethod
    def parse(rank: int, text: str) -> Post | None:
        parts = text.split("|", 3)
        if len(parts) != 4:
            return None
        try:
            return Post(rank, int(parts[0]), parts[1], parts[3], float(parts[2]))
        except ValueError:
            return None


class Watch:
    """This process's calls of parallel models, and the store the ranks post to when they part."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.call, self.kind, self.phase = 0, "training", "forward"
        self.raised_in: int | None = None
        """The call that raised on this rank (the next call checks the others went on too)."""
        self.in_backward: int | None = None
        """The call whose backward started on this rank and has not finished (raised, if the next call comes)."""

    def begin(self, training: bool) -> None:
        """A call of a parallel model starts (every rank counts the same calls)."""
        self.call += 1
        self.kind, self.phase = ("training" if training else "evaluation"), "forward"

    def returned(self) -> None:
        """The call's forward returned: collectives from here on are its backward's (or the next call's)."""
        self.phase = "backward"

    def follow_backward(self, outputs: list[Any]) -> None:
        """Marks this call's backward started when a gradient reaches any of its ``outputs``, and finished when the
        autograd engine ends it (a backward that raises never finishes: the next call then holds back)."""
        call = self.call

        def finished() -> None:
            if self.in_backward == call:
                self.in_backward = None

        def started(grad: Any) -> Any:
            if self.in_backward != call:
                self.in_backward = call
                queue_backward_callback(finished)
            return grad

        for t in outputs:
            t.register_hook(started)

    def unfinished(self) -> bool:
        """Whether this rank's last call raised or left its backward unfinished (told to the others, once)."""
        if self.in_backward is not None and self.raised_in is None:
            self.raised_in = self.in_backward
            self._post("left its backward unfinished (it raised)")
        self.in_backward = None
        return self.raised_in is not None

    def raised(self, error: BaseException) -> None:
        """This rank's call raised ``error`` (not a failed collective): posted for the ranks it leaves waiting."""
        self.raised_in = self.call
        text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        self._post(f"raised {text}")

    def failed(self, error: BaseException, where: str | None = None, lead: str | None = None,
               outside: bool = False) -> RanksPartedError:
        """The error to raise for a collective that failed with ``error`` while this rank waited in ``where`` (by
        default a collective of its call's forward or backward; ``outside``: between calls, after the last one);
        ``lead`` replaces the message's first sentence."""
        backend = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        mine = f"waited in {where or f'a collective of the {self.phase}'}"
        if self.raised_in is not None:
            mine += f" after its call {self.raised_in} had raised"
        else:
            self._post(mine)
        posts = self._read()
        call = f"{'after ' if outside else ''}its {self.kind} call {self.call}"
        return RanksPartedError(_message(self.rank, call, mine, backend, posts, self.world, lead))

    def _post(self, what: str) -> None:
        if self.store is None:
            return
        with contextlib.suppress(Exception):  # (a store that is gone: the message says less, nothing hangs)
            self.store.set(_key(self.rank), Post(self.rank, self.call, self.kind, what, time.time()).line())

    def _read(self) -> dict[int, Post]:
        """The other ranks' fresh posts, waiting up to ``GRACE`` seconds for the missing ones."""
        posts: dict[int, Post] = {}
        if self.store is None:
            return posts
        deadline = time.monotonic() + GRACE
        while True:
            for r in range(self.world):
                if r == self.rank or r in posts:
                    continue
                with contextlib.suppress(Exception):
                    if self.store.check([_key(r)]):
                        post = Post.parse(r, self.store.get(_key(r)).decode())
                        if post is not None and time.time() - post.at < _FRESH:
                            posts[r] = post
            if len(posts) == self.world - 1 or time.monotonic() > deadline:
                return posts
            time.sleep(0.1)


def _key(rank: int) -> str:
    return f"autopar/parted/{rank}"


def _message(rank: int, call: str, mine: str, backend: str, posts: dict[int, Post], world: int,
             lead: str | None) -> str:
    lines = [lead or "the ranks stopped making the same calls of the parallel model.",
             f"Rank {rank} {mine} ({call}; the collective failed: {backend})."]
    raised = sorted(r for r, p in posts.items() if p.what.startswith(("raised", "left")))
    for r in raised:
        p = posts[r]
        lines.append(f"Rank {r}'s {p.kind} call {p.call} {p.what} and the script went on without it (a skip-bad-batch "
                     "loop?): the others were left waiting in that call's collectives.")
    waited: dict[tuple[int, str], list[int]] = {}
    for r, p in posts.items():
        if r not in raised:
            waited.setdefault((p.call, p.what), []).append(r)
    for (c, what), ranks in sorted(waited.items()):
        lines.append(f"Rank(s) {ranks_text(ranks)} {what} ({'after ' if OUTSIDE in what else ''}call {c}).")
    silent = [r for r in range(world) if r != rank and r not in posts]
    if silent:
        lines.append(f"Rank(s) {ranks_text(silent)} sent no account within {GRACE:g} s: they did not make this call "
                     "(stalled, died, or ran other code: a barrier, a checkpoint, a call made on some ranks only).")
    lines.append("Every rank must make every call of a model split over ranks, forward and backward: run evaluation "
                 "on every rank; to skip a bad batch, decide it on every rank together (all_reduce a flag before "
                 "the call); let any other error end the run, and restart it from the last checkpoint (torchrun "
                 "--max-restarts; docs/guide/operators.md).")
    return " ".join(lines)


def ranks_text(ranks: list[int]) -> str:
    """Ranks as a message names them: the first eight, then an ellipsis."""
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


_watch: Watch | None = None


def watch(store: Any, rank: int, world: int) -> Watch:
    """The process's watch (made once; the store is the default process group's)."""
    global _watch
    if _watch is None or _watch.store is not store or _watch.world != world:
        _watch = Watch(store, rank, world)
    return _watch


def is_comm_failure(error: BaseException) -> bool:
    """Whether ``error`` is a backend's failure of a collective (a timeout, a lost peer), not a mistake in it."""
    if isinstance(error, AutoparError) or not isinstance(error, RuntimeError):
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return any(w in text for w in _WORDS)


_inside = 0
"""Depth of autopar's own collectives (``guarded``): torch's collectives called there are not the script's."""


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Turns a collective that fails inside into ``RanksPartedError`` (where a watch exists)."""
    global _inside
    _inside += 1
    try:
        yield
    except RuntimeError as e:
        if _watch is None or not is_comm_failure(e):
            raise
        raise _watch.failed(e) from e
    finally:
        _inside -= 1


OUTSIDE = "outside the model's calls"
SCRIPT_COLLECTIVES = ("barrier", "monitored_barrier", "all_reduce", "broadcast", "reduce", "all_gather",
                      "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                      "all_to_all_single", "gather", "scatter", "all_gather_object", "broadcast_object_list",
                      "gather_object", "scatter_object_list")
"""torch.distributed's collectives a script (or a library it calls: DCP) waits in between the model's calls."""


def name_parted_ranks_in_script_collectives() -> Callable[[], None]:
    """Makes torch.distributed's collectives, called by the script outside the model's calls (a ``dist.barrier()``
    after the step, a metric's ``all_reduce``, a checkpoint's gathers), raise ``RanksPartedError`` when they fail
    for a rank that parted: the account of every rank, as inside the model's calls (else those ranks got only the
    backend's timeout, while the rank that made an extra call named them). Only a synchronous call's failure is
    translated (an ``async_op`` call's ``wait()`` is torch's), and ``RanksPartedError`` is a ``RuntimeError``, as
    torch's was. Returns how to undo it (``autopar.patches.install`` holds it)."""
    plain = {name: getattr(dist, name) for name in SCRIPT_COLLECTIVES if hasattr(dist, name)}

    def named(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def collective(*args: Any, **kwargs: Any) -> Any:
            global _inside
            if _inside or _watch is None:
                return call(*args, **kwargs)
            _inside += 1  # (a collective built of others, all_gather_object's all_gather: told once, by its name)
            try:
                return call(*args, **kwargs)
            except RuntimeError as e:
                if not is_comm_failure(e):
                    raise
                raise _watch.failed(e, f"dist.{name} (the script's or a library's), {OUTSIDE}",
                                    outside=True) from e
            finally:
                _inside -= 1
        collective.names_parted_ranks = True  # (tests find autopar's wrappers by it)
        return collective

    for name, call in plain.items():
        setattr(dist, name, named(name, call))

    def undo() -> None:
        for name, call in plain.items():
            setattr(dist, name, call)
    return undo
