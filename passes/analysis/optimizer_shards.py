"""How ``shard_optimizer`` splits a parameter's optimizer state (and gradient) over the data ranks (ZeRO stages 1-2).

The rule the runtime keeps the state by (``autopar.runtime.params.data_shards``) and the plan predicts with (bytes
kept by ``estimate_memory.static_memory``, bytes sent by ``estimate_costs.grad_sync_collectives``): the
state of a parameter's local piece is cut along its first dim that no tensor axis splits and that has more
than one row, into ``data`` chunks of ``ceil(rows / data)`` rows (``torch.chunk``'s split: the last ones
short or empty). A piece with no such dim (a weight split over row on one dim and col on the other) is cut
along its first dim that exactly one tensor axis splits evenly, where the piece's rows divide by ``data``:
each data rank then keeps an even chunk of the rows of that axis's block, the layout DTensor writes as
``_StridedShard(dim, split_factor=that axis's size)`` on the data dim (FSDP2's over a tensor-parallel
shard), unless that dim holds fused pieces (GPT-2's q, k and v, each split: ``fused``), whose blocks no
strided shard over them describes to DCP. A piece with neither keeps its whole state on every data rank.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


def state_split(shape: Sequence[int], split: Mapping[int, Sequence[int]], size: int,
                fused: Collection[int] = ()) -> tuple[int, int] | None:
    """(dim, split factor) of the cut of a parameter's state over ``size`` data ranks: ``shape`` the parameter's
    (global) shape, ``split`` each dim the tensor axes split and those axes' sizes, ``fused`` the split dims
    that hold fused pieces. The split factor is 1 for a dim no axis splits, else the size of the one axis
    splitting it; None: the state stays whole."""
    for dim, n in enumerate(shape):
        if dim not in split and n > 1:
            return dim, 1
    for dim, n in enumerate(shape):
        if dim in fused:
            continue
        axes = split.get(dim, ())
        if len(axes) == 1 and n % axes[0] == 0 and n // axes[0] >= size > 1 and n // axes[0] % size == 0:
            return dim, axes[0]
    return None


def _local_shape(shape: Sequence[int], split: Mapping[int, Sequence[int]]) -> list[int]:
    """The largest piece's shape (``decisions.ParamPlan.local_shape``)."""
    out = list(shape)
    for dim, axes in split.items():
        pieces = 1
        for a in axes:
            pieces *= a
        out[dim] = -(-out[dim] // pieces)
    return out


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


def kept_numel(shape: Sequence[int], split: Mapping[int, Sequence[int]], size: int, fused: Collection[int] = ()) -> int:
    """Elements of state a data rank keeps per state tensor of the piece (the first, largest chunk)."""
    local = _local_shape(shape, split)
    cut = state_split(shape, split, size, fused) if size > 1 else None
    if cut is None:
        return _numel(local)
    lo, hi = chunk_rows(local[cut[0]], size, 0)
    return _numel(local) // local[cut[0]] * (hi - lo)


def gathered_numel(shape: Sequence[int], split: Mapping[int, Sequence[int]], size: int,
                   fused: Collection[int] = ()) -> int:
    """Elements the all-gather of the updated piece brings (every chunk padded to the first's); 0 when its
    state is whole (nothing is gathered)."""
    local = _local_shape(shape, split)
    cut = state_split(shape, split, size, fused) if size > 1 else None
    if cut is None:
        return 0
    return _numel(local) // local[cut[0]] * -(-local[cut[0]] // size) * size
