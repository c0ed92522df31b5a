"""Random ops on this rank's piece of a tensor a tensor axis splits (``passes.ir.split_dropout``,
``passes.ir.split_random``): a dropout draws the whole tensor's mask and keeps its part; any other random op
draws from a generator state forked by the piece's index.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from autopar.runtime.comm.mesh import Mesh
from autopar.runtime.comm.pieces import take_pieces
from passes.ir import Sharding


class DropoutOp:
    """A bound ``passes.ir.split_dropout``: dropout draws the mask of the whole tensor (the op itself, on ones:
    the generator advances as the unsplit op advances it, on every rank alike) and this rank keeps its part.
    The whole mask lives only inside this call; backward keeps this rank's part."""

    def __init__(self, spec: Sharding, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        n, index = self.mesh.size(self.spec.axis), self.mesh.index(self.spec.axis)
        if n == 1 or not train:
            return torch.ops.aten.dropout(x, p, train)
        whole = list(x.shape)
        whole[self.spec.dim] = self.spec.full_size
        with torch.no_grad():
            scale = torch.ops.aten.dropout(x.new_ones(whole), p, True)  # 0 or 1 / (1 - p)
        return x * take_pieces(scale, self.spec.dim, self.spec.parts, n, index)


class RandomPieceOp:
    """A bound ``passes.ir.split_random``: the op runs on a generator state forked from the device's by this
    rank's piece index (a hash of the state and the index: alike on the ranks holding the same piece, and again
    when a checkpointed block is recomputed, which restores the state); the state is then put back and
    advanced by one draw, alike on every rank. Megatron-LM forks a tensor-parallel generator the same way for
    attention dropout; without it the pieces of the heads would repeat one another's masks. Compiled graphs
    draw through Inductor's generator instead (unforked)."""

    def __init__(self, spec: Sharding, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    def __call__(self, op: Any, args: tuple, kwargs: dict) -> Any:
        n, index = self.mesh.size(self.spec.axis), self.mesh.index(self.spec.axis)
        if n == 1 or torch.compiler.is_compiling():
            return op(*args, **kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        generator = torch.cuda.default_generators[device.index or torch.cuda.current_device()] \
            if device.type == "cuda" else torch.default_generator
        state = generator.get_state()
        digest = hashlib.blake2b(state.numpy().tobytes() + index.to_bytes(4, "little"), digest_size=8).digest()
        generator.manual_seed(int.from_bytes(digest, "little") >> 1)
        try:
            return op(*args, **kwargs)
        finally:
            generator.set_state(state)
            torch.empty(1, device=device).bernoulli_(0.5)  # (the next random op draws anew)
