"""The DTensor placements autopar gives a parameter describe exactly the piece it stores, on every rank.

``placements`` (what DTensor, clipping, DCP and the state-dict helpers believe) and ``local_piece``
(what the sharded matmuls read) are written independently; here both cut an arange of the serial
tensor for every coordinate of every small grid and must agree element for element. No processes:
the mesh is a stand-in with sizes and coordinates.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Shard

from autopar.config import MESH_AXES, ParallelConfig
from autopar.decisions import Orientation, ParamKind, ParamPlan
from autopar.runtime.params.layout import DIMS, local_indices, local_piece, placements


class _Coordinates:
    """The parts of ``Mesh`` that ``local_piece`` reads: sizes and this rank's coordinates."""

    def __init__(self, config: ParallelConfig, rank: int) -> None:
        self.config, self.coords = config, config.coords(rank)

    def size(self, axis: str) -> int:
        return self.config.size(axis)

    def index(self, axis: str) -> int:
        index = 0
        for a in axis.split("+") if axis else ():  # (as Mesh.index: joined axes outermost first)
            index = index * self.config.size(a) + self.coords[a]
        return index


def _plans() -> list[ParamPlan]:
    out = []
    for o in (Orientation.NORMAL, Orientation.TRANSPOSED):
        for in_out in (False, True):
            for parts in ((), (24, 24)):
                if parts and not in_out:  # (out, in) storage: pieces on dim 0, checked separately below
                    continue
                shape = (48, 24) if not in_out else (24, 48)
                out.append(ParamPlan("w", shape, ParamKind.WEIGHT_3D, o, in_out, ("data",), parts))
    out.append(ParamPlan("w", (48, 24), ParamKind.WEIGHT_3D, Orientation.NORMAL, False, ("data",), (24, 24)))
    for o in (Orientation.NORMAL, Orientation.TRANSPOSED):
        out += [ParamPlan("b", (48,), ParamKind.BIAS, o), ParamPlan("b", (48,), ParamKind.BIAS, o, parts=(16, 16, 16))]
    for axis in ("row", "col"):
        out += [ParamPlan("e", (48, 24), ParamKind.SPLIT, split_axis=axis, split_dim=0),
                ParamPlan("e", (48, 24), ParamKind.SPLIT, split_axis=axis, split_dim=1),
                ParamPlan("qkv", (24, 48), ParamKind.SPLIT, Orientation.OUT_ROW, True, parts=(16, 16, 16),
                          split_axis=axis, split_dim=1)]
    out.append(ParamPlan("ln", (24,), ParamKind.REPLICATED))
    return out


def _grids() -> list[ParallelConfig]:
    return [ParallelConfig(1, r, c, d) for r, c, d in itertools.product((1, 2, 4), (1, 2), (1, 2, 4))
            if r * c * d <= 8]


def _disagreements(layout_of=placements) -> list[tuple]:
    bad = []
    for config, pp in itertools.product(_grids(), _plans()):
        if pp.kind is ParamKind.WEIGHT_3D and len(pp.parts) > 1 and not pp.weight_in_out \
                and config.size(pp.orientation.out_axis) > 1 and config.depth > 1:
            continue  # make_plan refuses this layout (pieces split over an axis and again over depth)
        full = torch.arange(torch.Size(pp.shape).numel()).view(pp.shape)
        mesh_shape = [config.size(a) for a in DIMS]
        for rank in range(config.world_size):
            mesh = _Coordinates(config, rank)
            ours = local_piece(full, pp, mesh)
            ix = local_indices(pp.shape, mesh_shape, [mesh.index(a) for a in DIMS], layout_of(pp, DIMS, config))
            theirs = full[torch.tensor(ix[0])] if len(ix) == 1 else full[torch.tensor(ix[0])][:, torch.tensor(ix[1])]
            if not torch.equal(ours, theirs):
                bad.append((config.tensor, pp.kind, pp.orientation, pp.weight_in_out, pp.parts, rank))
    return bad


def test_placements_describe_the_stored_piece_on_every_rank_of_every_grid():
    assert MESH_AXES[-4:] == ("context", "depth", "row", "col")  # the param mesh keeps the grid's axis order
    assert not _disagreements()


def test_a_plain_shard_for_depth_inside_row_blocks_is_caught():
    def mutated(pp, dims, config):  # the mutation: depth's StridedShard written as a plain Shard(0)
        return tuple(Shard(0) if d == "depth" and config.depth > 1 and pp.kind is ParamKind.WEIGHT_3D else p
                     for d, p in zip(dims, placements(pp, dims, config)))
    assert _disagreements(mutated)


@pytest.mark.parametrize("parts", [(24, 24), (16, 16, 16)])
def test_fused_pieces_are_strided_shards(parts):
    pp = ParamPlan("qkv", (24, 48), ParamKind.SPLIT, Orientation.OUT_ROW, True, parts=parts, split_axis="row",
                   split_dim=1)
    (row,) = [p for d, p in zip(DIMS, placements(pp, DIMS, ParallelConfig(1, 2, 1, 1))) if d == "row"]
    assert row.split_factor == len(parts)


@pytest.mark.parametrize("axis", ["data", "data+row", "data+col", "row"])
def test_experts_split_over_joined_axes_are_shards_of_each(axis):
    """Experts over data x a tensor axis ("data+row", ``expert_parallel="data+tensor"``): the piece a rank stores
    (data outermost) is what DTensor's Shard(0) on both mesh dims describes, so DCP and the state-dict helpers see
    each expert where it is."""
    config = ParallelConfig(2, 2, 2)  # (data 2 x row 2 x col 2: placements read the axes of the split only)
    pp = ParamPlan("e", (8, 3, 5), ParamKind.SPLIT, split_axis=axis, split_dim=0)
    full = torch.arange(8 * 3 * 5).view(8, 3, 5)
    mesh_shape = [config.size(a) for a in DIMS]
    held = []
    for rank in range(config.world_size):
        mesh = _Coordinates(config, rank)
        ours = local_piece(full, pp, mesh)
        ix = local_indices(pp.shape, mesh_shape, [mesh.index(a) for a in DIMS], placements(pp, DIMS, config))
        assert torch.equal(ours, full[torch.tensor(ix[0])]), (axis, rank)
        held.append(tuple(ix[0]))
    assert len(set(held)) == config.size(axis)  # (each expert on the ranks of the other axes only)
