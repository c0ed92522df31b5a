"""The ranks' verdict on a compile (``autopar.runtime.compiled.agreement``), with threads for ranks.

Each thread stands in for a rank posting its compile of one graph to a shared in-memory c10d store; every
rank must come back with the same verdict: None (all run it compiled) or the same reason (all run it
eagerly). The distributed check, with real compiles that diverge, is ``tests/distributed/test_compiled.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from autopar.errors import AgreementError
from autopar.runtime.compiled.agreement import ONCE, CompileAgreement, digest

ROW_A, ROW_B, DEPTH_A, DEPTH_B = (0, 1), (2, 3), (0, 2), (1, 3)


def _groups(rank: int, gather_bytes: int = 64, launched: int = 1) -> dict:
    """Rank ``rank``'s digest at a 2x2 grid: an all-reduce over its row pair, an all-gather over its depth
    pair."""
    row = ROW_A if rank in ROW_A else ROW_B
    depth = DEPTH_A if rank in DEPTH_A else DEPTH_B
    forward = {row: [("all_reduce", 128)], depth: [("all_gather", gather_bytes)]}
    return digest([forward, {}], [{"all_reduce": 1, "all_gather": launched}, {}])


def _verdicts(posts: dict[int, tuple], timeout: float = 20.0, peers: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    store = dist.HashStore()
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        failed, groups = posts[r]
        try:
            out[r] = CompileAgreement(store, r, peers, timeout).agree("graph/0", failed, groups)
        except AgreementError as e:
            out[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in posts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


def test_equal_compiles_run_compiled_everywhere():
    assert _verdicts({r: (None, _groups(r)) for r in range(4)}) == {r: None for r in range(4)}


def test_one_rank_that_did_not_compile_turns_every_rank_eager():
    posts = {r: (None, _groups(r)) for r in range(4)}
    posts[3] = ("RuntimeError: its Inductor failed", {})
    got = _verdicts(posts)
    assert got[3] == "RuntimeError: its Inductor failed"
    for r in range(3):  # rank 0 shares no group with rank 3, and still hears of it
        assert got[r] == "rank 3 could not compile it (RuntimeError: its Inductor failed)", got


@pytest.mark.parametrize("how", ["bytes", "bucketing"])
def test_a_rank_that_issues_other_collectives_turns_every_rank_eager(how):
    posts = {r: (None, _groups(r)) for r in range(4)}
    posts[3] = (None, _groups(3, gather_bytes=32) if how == "bytes" else _groups(3, launched=2))
    got = _verdicts(posts)
    assert len(set(got.values())) == 1, got
    assert "rank 3's compiled code issues other collectives over ranks [1, 3] than rank 1's" in got[0]


def test_groups_on_other_rows_may_differ_in_size():
    """Ranks of different row pairs share no group: their all-reduces may carry other bytes (their batch
    slices differ), and that is no disagreement."""
    posts = {r: (None, _groups(r)) for r in range(4)}
    for r in ROW_B:
        forward = {ROW_B: [("all_reduce", 96)], DEPTH_A if r in DEPTH_A else DEPTH_B: [("all_gather", 64)]}
        posts[r] = (None, digest([forward, {}], [{"all_reduce": 1, "all_gather": 1}, {}]))
    assert _verdicts(posts) == {r: None for r in range(4)}


def test_groups_beyond_the_peers_are_not_compared():
    """Under per-rank batches the peers are the ranks of one batch shard (a row pair); the depth pairs reach
    the other shard (rank 0 and 1, the pairs' first members), which may compile other sizes at another call: not waited for, not compared."""
    posts = {r: (None, _groups(r, gather_bytes=32 if r == 3 else 64)) for r in ROW_B}
    assert _verdicts(posts, timeout=2.0, peers=ROW_B) == {2: None, 3: None}


def test_a_rank_that_never_posts_is_an_error_not_a_hang():
    """The first rank to give up raises; its verdict (eager) releases the others at once, each with its reason."""
    posts = {r: (None, _groups(r)) for r in range(3)}  # rank 3 died while compiling
    got = _verdicts(posts, timeout=1.0)
    errors = [r for r in range(3) if isinstance(got[r], AgreementError)]
    assert errors, got
    for r in range(3):
        text = str(got[r])
        assert "waited 1 s for the other ranks to finish compiling it" in text, got
        if r in errors:
            assert "compile=True" in text and "COMPILE_AGREEMENT_TIMEOUT" in text, got


def test_a_rank_that_arrives_after_the_others_gave_up_runs_eagerly_too():
    """A rank that compiled so slowly that the others gave up runs the graph eagerly as they do, though it finds
    every rank compiled: the verdict is written once. Mutation (the last arrival deciding from the count alone):
    it ran compiled beside three eager ranks (seen with a FLOP counter on one rank at the first call)."""
    store = dist.HashStore()
    early: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            early[r] = CompileAgreement(store, r, (0, 1, 2, 3), 1.0).agree("graph/0", None, _groups(r))
        except AgreementError as e:
            early[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(early[r] is not None for r in range(3)), early
    late = CompileAgreement(store, 3, (0, 1, 2, 3), 1.0).agree("graph/0", None, _groups(3))
    assert late is not None and "waited 1 s" in late, late


def test_a_rank_that_runs_the_call_without_compiling_makes_it_eager_for_that_call():
    """Rank 1 runs the call under a TorchDispatchMode (torch.compile does not run there) and posts so: every rank
    runs this call eagerly, with a verdict that says it is for this call only. Where another rank's compile
    fails at that call, that failure may stand instead, and rank 1 hears it."""
    posts = {r: (None, _groups(r)) for r in range(4)}
    store = dist.HashStore()
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        once = r == 1
        got[r] = CompileAgreement(store, r, (0, 1, 2, 3), 20.0).agree(
            "graph/0", "ran this call under a TorchDispatchMode" if once else None, posts[r][1], once=once)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(4):  # (rank 1 hears the verdict too: another rank's failed compile could have stood instead)
        assert got[r] == f"{ONCE}rank 1 ran this call under a TorchDispatchMode", got


def test_a_rank_alone_needs_no_store():
    assert CompileAgreement(None, 0, (0,), 1.0).agree("g", None, {}) is None
    assert CompileAgreement(None, 0, (0,), 1.0).agree("g", "why", {}) == "why"


def test_a_failed_compile_beside_a_rank_without_compiling_is_every_ranks_verdict():
    store = dist.HashStore()
    got: dict[int, object] = {}
    posts = {0: ("RuntimeError: its Inductor failed", False), 1: ("ran this call under a TorchDispatchMode", True)}

    def rank(r: int) -> None:
        failed, once = posts[r]
        got[r] = CompileAgreement(store, r, (0, 1), 20.0).agree("graph/0", failed, {}, once=once)
    threads = [threading.Thread(target=rank, args=(r,)) for r in posts]
    threads[0].start()
    threads[0].join(30)  # rank 0's failure is posted first: its reason stands
    threads[1].start()
    threads[1].join(30)
    assert got[0] == "RuntimeError: its Inductor failed"
    assert got[1] == "rank 0 could not compile it (RuntimeError: its Inductor failed)", got
