"""A tensor's pieces over the ranks of an axis: each rank's piece of every segment of a dim (``split_chunks``),
and the whole joined back from every rank's, in rank order."""

from __future__ import annotations

from typing import Any

import torch

from autopar.decisions import split_chunks
from autopar.runtime.comm import collectives as C


def take_pieces(t: torch.Tensor, dim: int, parts: tuple[int, ...], n: int, index: int,
                contiguous: bool = True) -> torch.Tensor:
    """Rank ``index``'s piece of every segment of ``dim`` (see ``split_chunks``), concatenated (a view
    when it is one segment and ``contiguous`` is False)."""
    if n == 1:
        return t
    chunks = [t.narrow(dim, start, k) for start, k in split_chunks(parts or (t.shape[dim],), n, index)]
    out = torch.cat(chunks, dim) if len(chunks) > 1 else chunks[0]
    return out.contiguous() if contiguous else out


def join_pieces(pieces: list[torch.Tensor], dim: int, parts: tuple[int, ...]) -> torch.Tensor:
    """The inverse of ``take_pieces`` given every rank's pieces, in rank order."""
    if len(pieces) == 1:
        return pieces[0]
    if len(parts) <= 1:
        return torch.cat(pieces, dim)
    sizes = [p // len(pieces) for p in parts]
    split = [t.split(sizes, dim) for t in pieces]
    return torch.cat([split[i][j] for j in range(len(sizes)) for i in range(len(pieces))], dim)


def gather_pieces(x: torch.Tensor, dim: int, parts: tuple[int, ...], full: int, group: Any, n: int) -> torch.Tensor:
    """Every rank's piece of ``dim`` (``full`` long, segments ``parts``), joined in rank order. A single segment
    split unevenly (``decisions.uneven_split``) travels padded to the largest piece and is cut back."""
    if n == 1:
        return x
    if len(parts) <= 1 and full % n:
        k = -(-full // n)
        lengths = [length for _, length in (split_chunks((full,), n, i)[0] for i in range(n))]
        if x.shape[dim] < k:
            pad = list(x.shape)
            pad[dim] = k - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim)
        stacked = C.all_gather(x.contiguous().unsqueeze(0), group, n)
        return torch.cat([stacked[i].narrow(dim, 0, lengths[i]) for i in range(n)], dim)
    stacked = C.all_gather(x.contiguous().unsqueeze(0), group, n)  # (n, *local)
    return join_pieces(list(stacked.unbind(0)), dim, parts)
