"""``autopar.runtime.compiled.cuda_graphs`` without processes: which inputs a graph writes (read in place at a replay, never
copied), and the replay protocol on a stand-in capture (copy in, hand outputs back as copies or as the
caller's own tensors, count the captured collectives)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.runtime.comm import collectives as C
from autopar.runtime.compiled.cuda_graphs import CallGraphs, written_inputs


def step(cache: torch.Tensor, counter: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple:
    cache[:, 0].add_(x)  # through a view
    counter.add_(1)
    return x @ w, cache


def test_written_inputs_follow_views():
    gm = make_fx(step)(torch.zeros(2, 3), torch.zeros(()), torch.ones(2), torch.ones(2, 2))
    assert written_inputs(gm) == {0, 1}


def stand_in(runner, inputs):
    before = [x.clone() for x in inputs]
    outputs = runner(*inputs)
    for x, b in zip(inputs, before):
        x.copy_(b)  # a capture runs nothing

    def replay():
        with C.held():  # (a replay issues what the capture held: the caller counts it)
            again = runner(*inputs)
        for y, z in zip(outputs, again):
            if y is not z:
                y.copy_(z)
    return replay, outputs


def test_replays_copy_in_and_hand_back():
    def run(cache, counter, x, w):
        C.record("all_reduce", 2, 8)
        return list(step(cache, counter, x, w))
    graphs = CallGraphs([False, False, True, False], stand_in, print, "step", run, "cpu")
    cache, counter, w = torch.zeros(2, 3), torch.zeros(()), torch.eye(2)
    C.reset_comm_stats()
    kept = []
    for i in range(5):
        x = torch.full((2,), float(i))
        out = graphs.run(run, [cache, counter, x, w])
        assert out[1] is cache  # the caller's own tensor, written in place
        kept.append(out[0])
    assert graphs.replays() == 3
    assert all(torch.equal(y, torch.full((2,), float(i))) for i, y in enumerate(kept))  # copies, not overwritten
    assert float(counter) == 5 and torch.equal(cache[:, 0], torch.full((2,), 10.0))
    assert C.comm_calls()["all_reduce"] == 5


def test_input_names_from_the_spec_match_the_paths():
    from autopar.capture import input_names
    from autopar.compat import pytree

    for args, kwargs in [((torch.ones(2), [torch.ones(1), 3]), {"b": {"x": torch.ones(1), "y": None}, "a": 2}),
                         ((), {"ids": torch.ones(1)}), ((torch.ones(1),), {})]:
        spec = pytree.tree_flatten((tuple(args), dict(kwargs)))[1]
        assert input_names(args, kwargs, spec) == input_names(args, kwargs)
