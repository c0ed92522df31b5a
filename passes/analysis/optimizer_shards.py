"""How ``shard_optimizer`` splits a parameter's optimizer state over the data ranks (ZeRO stage 1).

The rule the runtime keeps the state by (``autopar.runtime.data_shards``) and the plan predicts with (bytes
kept by ``estimate_memory.static_memory``, bytes sent by ``estimate_costs.grad_sync_collectives``): the
state of a parameter's local piece is cut along its first dim that no tensor axis splits and that has more
than one row, into ``data`` chunks of ``ceil(rows / data)`` rows (``torch.chunk``'s split: the last ones
short or empty). A piece with no such dim keeps its whole state on every data rank.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def state_split_dim(local_shape: Sequence[int], split: Collection[int]) -> int | None:
    """The dim a piece of ``local_shape`` (``split``: the dims tensor axes split) has its state cut along."""
    for dim, n in enumerate(local_shape):
        if dim not in split and n > 1:
            return dim
    return None


def chunk_rows(rows: int, size: int, index: int) -> tuple[int, int]:
    """Rows [lo, hi) of ``rows`` that chunk ``index`` of ``size`` holds (``torch.chunk``'s split)."""
    step = -(-rows // size)
    lo = min(rows, index * step)
    return lo, min(rows, lo + step)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def kept_numel(local_shape: Sequence[int], split: Collection[int], size: int) -> int:
    """Elements of state a data rank keeps per state tensor of the piece (the first, largest chunk)."""
    dim = state_split_dim(local_shape, split)
    if dim is None or size == 1:
        return _numel(local_shape)
    lo, hi = chunk_rows(local_shape[dim], size, 0)
    return _numel(local_shape) // local_shape[dim] * (hi - lo)


def gathered_numel(local_shape: Sequence[int], split: Collection[int], size: int) -> int:
    """Elements the all-gather of the updated piece brings (every chunk padded to the first's); 0 when its
    state is whole (nothing is gathered)."""
    dim = state_split_dim(local_shape, split)
    if dim is None or size == 1:
        return 0
    return _numel(local_shape) // local_shape[dim] * -(-local_shape[dim] // size) * size
