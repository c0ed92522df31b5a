"""Shared fixtures. ``run_distributed`` forks gloo ranks from this pre-imported process.

The pytest process imports torch, torch._dynamo and autopar once and never creates a process
group, so forked children start in well under a second (spawning costs ~2.5 s of CPU per child).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: forked ranks share 2 cores

import multiprocessing as mp
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import autopar.context  # noqa: F401  (the runtime, and the passes it imports)
from autopar.compat import import_compiler

import_compiler()  # before forking: the first collective would import it in every rank

torch.set_num_threads(1)


def _child(fn: Callable, rank: int, world_size: int, store: str, out: str, args: tuple, kwargs: dict) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001  (re-raised in the parent)
        payload = ("error", traceback.format_exc())
        code = 1
    try:
        Path(out).write_bytes(pickle.dumps(payload))
    finally:
        os._exit(code)  # skip atexit handlers inherited from pytest


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, **kwargs: Any) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` forked gloo ranks; returns each rank's result.

    A child's exception is re-raised here with its traceback; a rank that has not finished after
    ``timeout`` seconds fails the test (all ranks are killed), so a hang never blocks the suite. A run
    whose ranks could not connect (gloo's loopback rendezvous closing a connection, seen about once in
    six suite runs on a loaded machine, before ``fn`` starts) is run once more.
    """
    try:
        return _run_once(fn, world_size, args, kwargs, timeout)
    except _NotConnected:
        return _run_once(fn, world_size, args, kwargs, timeout)


class _NotConnected(AssertionError):
    """Every failing rank failed in init_process_group's connection setup (fn never ran)."""


def _context() -> mp.context.BaseContext:
    """Fork from this pre-imported process (ranks ready in 0.3 s), except on a CUDA build of torch (the
    wheels GPU machines and PyPI ship, 2.11 in CI's floor run): once a test here has run backward, its
    autograd engine holds device threads a forked child cannot use ("Unable to handle autograd's threading
    in combination with fork-based multiprocessing"). There a fork server, started clean with the same
    imports, forks the ranks (the workers are module-level functions: they pickle)."""
    if not torch.backends.cuda.is_built():
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.conftest"])
    return ctx


def _run_once(fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, store, outs[r], args, kwargs))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result ({'timed out' if r in hung else f'exit code {procs[r].exitcode}'})")
                continue
            status, value = pickle.loads(Path(path).read_bytes())
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
            results.append(value)
        if errors:
            message = "distributed run failed:\n" + "\n".join(errors)
            if all("connectFullMesh failed" in e and "init_process_group" in e for e in errors):
                raise _NotConnected(message)
            raise AssertionError(message)
        return results


@pytest.fixture
def distributed() -> Callable[..., list[Any]]:
    """The ``run_distributed(fn, world_size, *args, timeout=..., **kwargs)`` helper."""
    return run_distributed
