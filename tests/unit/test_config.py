from fractions import Fraction

import pytest

from autopar.config import MemoryConfig, ParallelConfig
from autopar.decisions import Layout, Orientation, collective_bytes
from autopar.errors import AutoparError, ConfigError


def test_config_rejects_bad_degrees():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="Use an integer >= 1"):
            ParallelConfig(data=bad)


def test_shard_optimizer_is_a_bool_and_part_of_the_grid():
    for bad in (1, "yes", None):
        with pytest.raises(ConfigError, match="shard_optimizer=.* is invalid"):
            ParallelConfig(data=2, shard_optimizer=bad)
        with pytest.raises(ConfigError, match="shard_optimizer=.* is invalid"):
            MemoryConfig(shard_optimizer=bad)
    config = ParallelConfig.from_user(world_size=4, shard_optimizer=True)
    assert config.shard_optimizer and str(config).endswith(" shard_optimizer")
    assert "shard_optimizer" not in str(ParallelConfig(data=1, shard_optimizer=True))  # nothing to split over


def test_sequence_parallel_is_a_bool_and_part_of_the_grid():
    for bad in (1, "yes", None):
        with pytest.raises(ConfigError, match="sequence_parallel=.* is invalid"):
            ParallelConfig(row=2, sequence_parallel=bad)
        with pytest.raises(ConfigError, match="sequence_parallel=.* is invalid"):
            MemoryConfig(sequence_parallel=bad)
    config = ParallelConfig.from_user(tensor=(2, 1, 1), world_size=4, sequence_parallel=True)
    assert config.sequence_parallel and str(config).endswith(" sequence_parallel")
    assert "sequence_parallel" not in str(ParallelConfig(data=2, depth=2, sequence_parallel=True))  # no row/col


def test_config_from_user_infers_data_and_checks_world_size():
    assert ParallelConfig.from_user(world_size=8) == ParallelConfig(8, 1, 1, 1)
    assert ParallelConfig.from_user(tensor=(2, 2, 1), world_size=8) == ParallelConfig(2, 2, 2, 1)
    with pytest.raises(ConfigError, match=r"world size 8 does not match .* = 4"):
        ParallelConfig.from_user(tensor=(2, 2, 1), data=1, world_size=8)
    with pytest.raises(ConfigError, match="not divisible by row\\*col\\*depth"):
        ParallelConfig.from_user(tensor=(3, 1, 1), world_size=8)
    with pytest.raises(ConfigError, match="three integers"):
        ParallelConfig.from_user(tensor=(2, 2), world_size=4)
    assert issubclass(ConfigError, AutoparError) and issubclass(ConfigError, ValueError)


def test_config_coords_are_row_major_with_col_fastest():
    c = ParallelConfig(data=2, row=2, col=2, depth=1)
    assert c.coords(0) == dict(data=0, pipeline=0, context=0, depth=0, row=0, col=0)
    assert c.coords(1) == dict(data=0, pipeline=0, context=0, depth=0, row=0, col=1)
    assert c.coords(2) == dict(data=0, pipeline=0, context=0, depth=0, row=1, col=0)
    assert c.coords(7) == dict(data=1, pipeline=0, context=0, depth=0, row=1, col=1)
    d = ParallelConfig(data=2, row=1, col=1, depth=2)
    assert [d.batch_index(r) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ConfigError):
        c.coords(8)
    # pipeline sits between data and depth; ranks of one stage share the batch shards
    p = ParallelConfig(data=2, depth=2, pipeline=2)
    assert p.coords(2) == dict(data=0, pipeline=1, context=0, depth=0, row=0, col=0)
    assert [p.batch_index(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert all(p.rank_of(p.coords(r)) == r for r in range(8))
    # context sits between pipeline and depth: its ranks hold the same batch shard (they split its tokens)
    x = ParallelConfig(data=2, row=2, context=2)
    assert x.coords(2) == dict(data=0, pipeline=0, context=1, depth=0, row=0, col=0)
    assert [x.batch_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(x.rank_of(x.coords(r)) == r for r in range(8)) and x.world_size == 8


def test_config_batch_sizes_uneven_first_shards_larger():
    c = ParallelConfig(data=2, depth=2)
    assert c.batch_sizes(13) == (4, 3, 3, 3)
    assert sum(c.batch_sizes(9)) == 9


def test_collective_bytes_ring_formulas():
    assert collective_bytes("all_reduce", 4, 100) == Fraction(150)
    assert collective_bytes("all_gather", 4, 100) == Fraction(75)
    assert collective_bytes("reduce_scatter", 2, 100) == Fraction(50)
    assert collective_bytes("send", 2, 100) == Fraction(100)
    assert collective_bytes("all_reduce", 1, 100) == 0
    assert collective_bytes("all_reduce", 3, 10) == Fraction(40, 3)
    with pytest.raises(ValueError):
        collective_bytes("gossip", 2, 1)


def test_orientation_layouts_swap_row_and_col():
    assert (Orientation.NORMAL.in_layout, Orientation.NORMAL.out_layout) == (Layout.COL, Layout.ROW)
    assert (Orientation.TRANSPOSED.in_layout, Orientation.TRANSPOSED.out_layout) == (Layout.ROW, Layout.COL)
    assert repr(Layout.ROW) == "Layout.ROW"


def test_memory_options_are_validated():
    assert MemoryConfig(2**30, "bf16", "bf16").reduce_dtype == "bf16"
    for bad, match in [(dict(checkpoint="some"), "checkpoint='some'"), (dict(checkpoint=0), "checkpoint=0"),
                       (dict(precision="fp8"), "precision='fp8'"),
                       (dict(precision="bf16", reduce_dtype="fp16"), "reduce_dtype='fp16'")]:
        with pytest.raises(ConfigError, match=match):
            MemoryConfig(**bad)
