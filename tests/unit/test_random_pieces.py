"""Random ops on the pieces of a split tensor (``autopar.runtime.ops.random_pieces``: ``DropoutOp``, ``RandomPieceOp``), one
rank at a time with a stand-in mesh: a dropout's piece is the whole tensor's mask cut to the piece; another
random op draws per piece index (different pieces differ; the same piece repeats; the generator moves alike
whatever the piece)."""

from __future__ import annotations

import torch

from autopar.decisions import Layout
from autopar.runtime.ops.random_pieces import DropoutOp, RandomPieceOp
from passes.ir import Sharding


class _Mesh:
    def __init__(self, size: int, index: int) -> None:
        self._size, self._index = size, index

    def size(self, axis: str) -> int:
        return self._size

    def index(self, axis: str) -> int:
        return self._index


SPEC = Sharding(Layout.COL, 1, (8,))


def test_dropout_piece_is_the_whole_tensors_mask_cut_to_the_piece():
    x = torch.randn(3, 8, 5)
    torch.manual_seed(3)
    whole = torch.ops.aten.dropout(x, 0.5, True)
    after = torch.random.get_rng_state()
    for index in range(2):
        torch.manual_seed(3)
        piece = DropoutOp(SPEC, _Mesh(2, index))(x[:, 4 * index:4 * index + 4], 0.5, True)
        assert torch.equal(piece, whole[:, 4 * index:4 * index + 4])
        assert torch.equal(torch.random.get_rng_state(), after)  # the generator moved as the whole op moves it


def _sdpa(index: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    torch.manual_seed(seed)
    out = RandomPieceOp(Sharding(Layout.COL, 1, (4,)), _Mesh(2, index))(
        torch.ops.aten.scaled_dot_product_attention.default, (q, k, v, None, 0.5, True), {})
    return out, torch.random.get_rng_state()


def test_random_op_draws_per_piece_and_moves_the_generator_alike():
    (a0, s0), (a0_again, _), (a1, s1) = _sdpa(0), _sdpa(0), _sdpa(1)
    assert torch.equal(a0, a0_again)  # (a recomputed block draws the same masks)
    assert not torch.equal(a0, a1)  # the pieces of the heads do not repeat one another's masks
    assert torch.equal(s0, s1)  # every rank's generator stays in step
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    assert not torch.equal(s0, before)  # and it moved: the next random op draws anew
    assert not torch.equal(_sdpa(0, seed=6)[0], a0)
