"""``autopar.runtime.compiled.pieces`` on its own: where a graph is cut, what each piece holds, and that the
graph in pieces computes what the graph did (outputs and every gradient). The pieces run as they are here
(a stand-in for ``CompiledGraph``); tests/distributed/test_compiled.py compiles them on data grids."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from autopar.runtime.compiled.pieces import CompiledPieces, cut_into_pieces
from passes.ir import InputInfo, InputKind, input_info

NAMES = ("w0", "w1", "w2", "w3", "head", "scale")


def _apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Tanh()

    def forward(self, x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                head: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.linear(x, w0)
        h = self.block(F.linear(h, w1)) + h
        h = F.linear(h, w2)
        h = self.block(F.linear(h, w3)) + h
        return F.linear(h, head).sum(), h, scale  # (a value read after the pieces; a parameter returned as it is)


def _graph() -> fx.GraphModule:
    """The graph of ``_Net``, the block's two calls made through one ``get_attr`` node (as a checkpointed
    segment is called: ``passes.insert_checkpoints``), which the cut gives two pieces."""
    gm = fx.symbolic_trace(_Net())
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    with gm.graph.inserting_before(calls[0]):
        block = gm.graph.get_attr("block")
    for call in calls:
        with gm.graph.inserting_before(call):
            applied = gm.graph.call_function(_apply, (block, *call.args))
        call.replace_all_uses_with(applied)
        gm.graph.erase_node(call)
    gm.recompile()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind = InputKind.PARAMETER if node.target in NAMES else InputKind.USER
            node.meta["autopar"] = InputInfo(kind, node.target if kind is InputKind.PARAMETER else "0", True)
    return gm


class _Eager:
    """A stand-in for ``CompiledGraph``: the piece run as it is."""

    cuda_graphs = False

    def __init__(self, gm: fx.GraphModule, k: int, n: int) -> None:
        self.gm, self.name = gm, f"piece {k + 1} of {n}"

    def __call__(self, *args: torch.Tensor) -> object:
        return self.gm(*args)


def test_pieces_are_filled_from_the_end_up_to_the_cap_and_compute_what_the_graph_did():
    gm = _graph()
    synced = {name: 100 for name in NAMES if name != "scale"}
    assert cut_into_pieces(gm, synced, 500) is None  # (one piece holds every gradient)
    assert cut_into_pieces(gm, {"head": 100}, 100) is None  # (only the head is synced)
    cut = cut_into_pieces(gm, synced, 200)  # from the end: (w3, head), (w1, w2), (w0)
    pieces = [m for name, m in cut.named_children() if name.startswith("piece_")]
    read = [sorted(str(input_info(n).target) for n in p.graph.nodes if n.op == "placeholder" and
                   input_info(n) is not None and input_info(n).kind is InputKind.PARAMETER) for p in pieces]
    assert read == [["w0"], ["w1", "w2"], ["head", "w3"]], read
    # each piece holds the submodule it calls (the block, called in the second piece and the third)
    assert [sum(n.op == "get_attr" for n in p.graph.nodes) for p in pieces] == [0, 1, 1]
    assert all(isinstance(getattr(p, "block", None), nn.Module) for p in pieces[1:])

    run = CompiledPieces(cut, _Eager)
    assert [p.name for p in run.pieces] == ["piece 1 of 3", "piece 2 of 3", "piece 3 of 3"]
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(8, 8) / 3) for _ in NAMES]
    x = torch.randn(4, 8)
    want = gm(x, *weights)
    (want[0] + want[1].square().sum()).backward()
    grads = [None if w.grad is None else w.grad.clone() for w in weights]
    for w in weights:
        w.grad = None
    got = run(x, *weights)
    (got[0] + got[1].square().sum()).backward()
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, a, w in zip(NAMES, grads, weights):
        assert (a is None) == (w.grad is None), name
        if a is not None:
            torch.testing.assert_close(a, w.grad, rtol=0, atol=0, msg=name)


def test_a_node_reading_more_than_the_cap_is_a_piece_of_its_own():
    gm = _graph()
    cut = cut_into_pieces(gm, {"w0": 100, "w1": 100, "w2": 1000, "w3": 100, "head": 100}, 300)
    pieces = [m for name, m in cut.named_children() if name.startswith("piece_")]
    read = [sorted(str(input_info(n).target) for n in p.graph.nodes if n.op == "placeholder" and
                   input_info(n) is not None and input_info(n).kind is InputKind.PARAMETER) for p in pieces]
    assert read == [["w0", "w1"], ["w2"], ["head", "w3"]], read
