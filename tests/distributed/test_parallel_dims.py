import itertools

import pytest
from megatron.core.parallel_state import RankGenerator

from ftrain.distributed.parallel_dims import ParallelDims, RankCoords

DIMS = ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp", "cp-dp-pp", "tp-cp-dp-pp"]


def all_layouts(max_world=16):
    for tp, cp, dp, pp in itertools.product(range(1, max_world + 1), repeat=4):
        if tp * cp * dp * pp <= max_world:
            yield ParallelDims(tp=tp, pp=pp, cp=cp, dp=dp)


def test_groups_match_megatron_rank_generator_for_every_layout():
    layouts = list(all_layouts())
    assert len(layouts) > 100
    for dims in layouts:
        gen = RankGenerator(
            tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order="tp-cp-ep-dp-pp"
        )
        for dim in DIMS:
            assert dims.group_ranks(dim) == gen.get_ranks(dim), (dims, dim)


def test_coords_rank_of_round_trip_and_megatron_order():
    for dims in all_layouts():
        seen = set()
        for rank in range(dims.world_size):
            c = dims.coords(rank)
            assert dims.rank_of(c) == rank
            seen.add(c)
            # tp fastest, then cp, dp, pp.
            assert rank == c.tp + dims.tp * (c.cp + dims.cp * (c.dp + dims.dp * c.pp))
        assert len(seen) == dims.world_size


def test_explicit_layout():
    dims = ParallelDims(tp=2, pp=2, cp=1, dp=2)
    assert dims.coords(5) == RankCoords(tp=1, cp=0, dp=0, pp=1)
    assert dims.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.replica_ranks(1) == [2, 3, 6, 7]
    assert dims.shard_peers(5) == [7]


def test_replica_and_shard_peers_partition_the_world():
    for dims in all_layouts():
        replicas = [dims.replica_ranks(d) for d in range(dims.dp)]
        assert sorted(r for rep in replicas for r in rep) == list(range(dims.world_size))
        dp_groups = {tuple(g) for g in dims.group_ranks("dp")}
        for rank in range(dims.world_size):
            peers = dims.shard_peers(rank)
            assert rank not in peers and len(peers) == dims.dp - 1
            assert tuple(sorted(peers + [rank])) in dp_groups
            c = dims.coords(rank)
            assert all(
                (p.tp, p.cp, p.pp) == (c.tp, c.cp, c.pp) for p in map(dims.coords, peers)
            )


def test_from_world():
    assert ParallelDims.from_world(16, tp=2, pp=2, cp=2) == ParallelDims(tp=2, pp=2, cp=2, dp=2)
    assert ParallelDims.from_world(12, tp=3).world_size == 12
    match = r"cluster\.num_workers=6.*parallel\.tp.*parallel\.pp.*parallel\.cp"
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_world(6, tp=4)
    with pytest.raises(ValueError, match=r"parallel\.cp=0"):
        ParallelDims.from_world(4, cp=0)
    with pytest.raises(ValueError, match="cluster.num_workers=0"):
        ParallelDims.from_world(0)


def test_errors():
    dims = ParallelDims(tp=2, pp=1, cp=1, dp=2)
    with pytest.raises(ValueError):
        dims.coords(4)
    with pytest.raises(ValueError):
        dims.rank_of(RankCoords(tp=2, cp=0, dp=0, pp=0))
    with pytest.raises(ValueError, match="ep"):
        dims.group_ranks("ep")
    with pytest.raises(ValueError):
        dims.group_ranks("dp-dp")
    with pytest.raises(ValueError):
        dims.replica_ranks(2)
    with pytest.raises(ValueError):
        ParallelDims(tp=0, pp=1, cp=1, dp=1)
