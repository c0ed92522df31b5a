"""Decode steps replayed as graphs (``autopar.runtime.compiled.cuda_graphs``), on the CPU through a stand-in for CUDA
graphs with their semantics: the capture runs nothing, a replay reruns the captured call on the captured
inputs and writes into the captured outputs. The oracle is the serial model: the same tokens through
``generate()`` with HF's static cache, the same logits at every step of a decode loop the script writes
(each step's logits kept), and the bytes of eager autopar. The real CUDA graphs run in ``gpu_check``'s
static-cache row and ``python -m benchmarks --simulate W --decode`` on a device."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from autopar.parallel_model import runtime_of
from autopar.runtime.comm import collectives as C
from autopar.runtime.compiled import cuda_graphs as graphed
from tests.distributed.test_generate import serial_and_parallel

pytestmark = pytest.mark.slow


def stand_in_capture(runner: Any, inputs: list[Any]) -> tuple[Any, Any]:
    """A CUDA graph on the CPU: ``runner`` runs once to make the outputs, and every tensor input gets its
    value back (a capture runs nothing); a replay runs it again on the same inputs, its collectives held
    (the caller counts the captured ones), and writes into the captured outputs."""
    before = [x.clone() if isinstance(x, torch.Tensor) else None for x in inputs]
    outputs = runner(*inputs)
    for x, was in zip(inputs, before):
        if was is not None:
            x.copy_(was)

    def replay() -> None:
        with C.held():
            again = runner(*inputs)
        for y, z in zip(outputs, again):
            if isinstance(y, torch.Tensor) and y is not z:
                y.copy_(z)
    return replay, outputs


def on_the_cpu(monkeypatch_target: Any = graphed) -> None:
    monkeypatch_target.capture_for = lambda device: stand_in_capture


def decode_loop(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """A script's own greedy loop over HF's StaticCache: every step's logits, kept."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 1)
    kept = []
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            out = model(token, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([ids.shape[1] + i]))
            kept.append(out.logits)
            token = out.logits[:, -1:].argmax(-1)
    return kept


def graphed_worker(name: str, tensor: tuple, tokens: int, compile: Any = "auto") -> dict:
    on_the_cpu()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("autopar").addHandler(handler)
    serial, model = serial_and_parallel(name, tensor, compile=compile)
    _, eager = serial_and_parallel(name, tensor, compile=False)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, cache_implementation="static")
    out: dict[str, Any] = {}
    want = serial.generate(ids, **kw)
    C.reset_comm_stats()
    got = model.generate(ids, **kw)
    graphed_bytes = C.comm_stats()
    C.reset_comm_stats()
    eager.generate(ids, **kw)
    out["bytes equal"] = graphed_bytes == C.comm_stats() and graphed_bytes["total"] > 0
    out["tokens"] = torch.equal(got, want)
    runtime = runtime_of(model)
    out["replays"] = runtime.graph_replays()
    out["again"] = torch.equal(model.generate(ids, **kw), want)  # a new cache: captured again
    out["replays again"] = runtime.graph_replays() - out["replays"]
    want_steps, got_steps = decode_loop(serial, ids, tokens), decode_loop(model, ids, tokens)
    out["loop"] = max(float((g - w).abs().max()) for g, w in zip(got_steps, want_steps))
    out["eager replays"] = runtime_of(eager).graph_replays()
    out["compiled runs"] = sum(g.compiled_runs for g in runtime.compiled_graphs())
    out["warnings"] = [w for w in warnings if "compile" in w or "CUDA graphs" in w]
    return out


@pytest.mark.parametrize("tensor,compile", [((2, 1, 1), "auto"), ((1, 2, 1), "auto"), ((2, 1, 1), True)],
                         ids=["t2x1x1", "t1x2x1", "t2x1x1-compile"])
def test_static_cache_decode_replays_with_serial_tokens(distributed: Any, tensor: tuple, compile: Any) -> None:
    """8 new tokens: the first from prefill, decode steps 1-2 warm, 3-7 replayed, in each generate(). Under
    compile=True the decode step that is captured (it returns the cache split) is the one Inductor compiled:
    it ran compiled at the warm step of each generate() and each decode loop, without a warning."""
    for got in distributed(graphed_worker, 2, "llama", tensor, 8, compile, timeout=600):
        assert not got["warnings"], got
        assert got["tokens"] and got["again"], got
        assert got["replays"] == 5 and got["replays again"] == 5, got
        assert got["loop"] < 1e-5, got  # each step's logits kept: a replay must not overwrite the last one's
        assert got["bytes equal"], got
        assert got["eager replays"] == 0, got
        assert (got["compiled runs"] >= 3) if compile is True else got["compiled runs"] == 0, got  # (the stand-in
        # capture and replays run the compiled graph too)
