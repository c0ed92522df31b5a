"""The ranks agree on a compiled graph before any of them runs it: all compiled, or all eager.

A compiled per-rank graph holds collectives, and every rank of a group must issue the same ones in the
same order. Each rank compiles on its own, so the ranks can diverge: one rank's graph does not compile
(a corrupt cache file, a lowering that fails on its uneven piece only) and runs eagerly, launching its
collectives one by one while the others launch Inductor's buckets; or a compiler pass moves a collective
on one rank only (``tests/distributed/test_compiled.py``'s GPT-2 at depth). Either way the ranks wait
on each other forever, or, where sizes happen to match, sum the wrong tensors.

So each compile (forward and backward together: ``compat.inductor_backend`` lowers the backward with the
forward) ends with a short exchange over the c10d store, before the graph runs, among the ranks that run
this graph at the same call (``peers``, ``Mesh.graph_peers``):

1. each rank posts what it compiled: for each process group its graphs' collectives use, a hash of the
   collectives it issues there, in order (kind, bytes), with the kernels launched per kind; then its
   state (compiled, or why not);
2. each rank that compiled compares each group's hash with the group's first member's. Equality with
   one member is transitive, so a rank reads one key per group, however many ranks there are;
3. each rank adds 1 to the graph's count of bad ranks if it did not compile or differs, then arrives;
   the last to arrive writes the verdict from the count, which releases the others. If the count is above
   0, every rank runs the graph eagerly (``CompiledGraph``'s one warning line says which rank and why);
   otherwise every rank runs it compiled.

The verdict is one key written once (the store's compare-and-set): the last arrival's, or that of a rank
that waited longer than ``COMPILE_AGREEMENT_TIMEOUT`` for the others (a rank died while compiling, or a
rank ran the call without compiling and did not post). That rank raises ``AgreementError`` instead of
waiting forever, and its verdict (eager) is every rank's, the late ones' too: no rank runs the graph compiled
beside one that gave up on it. A rank that runs this call without compiling (a TorchDispatchMode is active
there: ``once``) posts so, and every rank runs this call eagerly and compiles at the next.

Store traffic per compile is a few keys per rank; nothing is exchanged while the graph runs. A simulated
world (``collectives.simulated``) or a graph only this rank runs agrees with itself.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from autopar.errors import AgreementError

ONCE = "this call only: "
"""How a verdict starts where a rank ran the call without compiling (``agree(once=True)``): every rank runs
this call eagerly, and compiles at the next."""

#: Groups are named by their global ranks; what a rank issues on one: (kind, bytes) in order, per graph.
Issued = dict[tuple[int, ...], list[tuple[str, int]]]


def digest(issued: Sequence[Issued], launched: Sequence[dict[str, int]]) -> dict[tuple[int, ...], str]:
    """Per group: a hash of what this rank's graphs (forward, backward) issue on it, and of how many
    collectives of each kind their code launches (Inductor's buckets)."""
    groups = sorted({g for graph in issued for g in graph})
    kernels = [sorted(counts.items()) for counts in launched]
    return {g: hashlib.sha256(repr(([graph.get(g, []) for graph in issued], kernels)).encode()).hexdigest()[:32]
            for g in groups}


class CompileAgreement:
    """Where the ranks of one set of peers agree on each compile (module docstring).

    Args:
        store: the c10d store every rank of the world reaches (``compat.default_store``).
        rank: this rank.
        peers: the ranks that run the same graphs at the same calls as this one (this rank among them).
        timeout: seconds a rank waits for the others.
    """

    def __init__(self, store: dist.Store, rank: int, peers: tuple[int, ...], timeout: float) -> None:
        self.store, self.rank, self.peers, self.timeout = store, rank, peers, timeout
        self.members = frozenset(peers)

    def agree(self, key: str, failed: str | None, groups: dict[tuple[int, ...], str], once: bool = False) -> str | None:
        """Posts this rank's compile of graph ``key`` (``failed``: why it did not compile; ``groups``: its
        ``digest``) and returns why every rank runs it eagerly, or None when every rank runs it compiled.
        A rank that did not compile does not wait: it runs eagerly whatever the others found. ``once``: this rank
        runs this call without compiling (``failed`` says why); every rank runs the call eagerly, and the
        verdict starts with ``ONCE`` (this rank waits for it: another rank's failed compile may stand instead)."""
        if len(self.peers) < 2:
            return failed
        base = f"autopar/compiled/{min(self.peers)}/{key}"
        for g, h in groups.items():
            self.store.set(f"{base}/group/{','.join(map(str, g))}/{self.rank}", h)
        self.store.set(f"{base}/state/{self.rank}", "failed" if failed else "compiled")
        if failed:
            why = f"{ONCE}rank {self.rank} {failed}" if once else f"rank {self.rank} could not compile it ({failed})"
        else:
            why = self._differs(base, groups)
        if why is not None:
            self.store.compare_set(f"{base}/why", "", why)
        self.store.add(f"{base}/bad", 1 if why else 0)
        if self.store.add(f"{base}/arrived", 1) == len(self.peers):  # the last: every count is in
            self._decide(base, "bad" if self.store.add(f"{base}/bad", 0) else "ok")
        if failed and not once:
            return failed
        self._wait(base, "the other ranks to finish compiling it")
        if self.store.get(f"{base}/verdict") != b"ok":
            return self.store.get(f"{base}/why").decode()
        return None

    def _decide(self, base: str, verdict: str) -> str:
        """Writes ``verdict`` unless one was written; returns the one that stands."""
        return self.store.compare_set(f"{base}/verdict", "", verdict).decode()

    def _differs(self, base: str, groups: dict[tuple[int, ...], str]) -> str | None:
        """Why this rank's collectives differ from a group's first member's (None: they do not)."""
        for g, h in groups.items():
            first = min(g)
            if first == self.rank or not self.members.issuperset(g):  # (a group reaching beyond the peers: they
                continue  # may compile other sizes at other calls, so they are not compared)
            self._wait(base, f"rank {first} to finish compiling it", f"{base}/state/{first}")
            if self.store.get(f"{base}/state/{first}") != b"compiled":
                continue  # (it counts itself bad, and says why)
            if self.store.get(f"{base}/group/{','.join(map(str, g))}/{first}").decode() != h:
                return (f"rank {self.rank}'s compiled code issues other collectives over ranks {list(g)} than "
                        f"rank {first}'s (another order, size or bucketing)")
        return None

    def _wait(self, base: str, what: str, key: str | None = None) -> None:
        """Waits for ``key`` (default: the verdict), or for the verdict where another rank gave up first. After
        ``timeout`` the verdict becomes eager for every rank, unless one stands, and this rank raises."""
        keys = [f"{base}/verdict"] if key is None else [key]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
            return
        except RuntimeError as e:
            error = e
        if key is not None and self.store.check([f"{base}/verdict"]):  # (another rank gave up: its verdict stands)
            raise AgreementError(f"rank {self.rank}: another rank gave up waiting for {what}; every rank runs it "
                                 "eagerly.")
        why = (f"rank {self.rank} waited {self.timeout:g} s for {what}: a rank stopped while compiling (its own "
               "error says why), compiles far slower, or ran the call without compiling")
        self.store.compare_set(f"{base}/why", "", why)
        if self._decide(base, "timeout") in ("ok", "bad") and key is None:
            return  # (the last rank arrived as the wait ended: its verdict stands)
        raise AgreementError(
            f"rank {self.rank} waited {self.timeout:g} s for {what}, with compile=True, and it did not come: "
            "a rank stopped while compiling (its own error says why) or compiles far slower than this one. "
            "Fix that rank's error, raise autopar.config.COMPILE_AGREEMENT_TIMEOUT, or pass compile=False "
            f"({error}).") from None


def store_key(parts: Sequence[Any]) -> str:
    """A store key from names that may hold '/' or spaces."""
    return "/".join(str(p).replace("/", "_").replace(" ", "_") for p in parts)
