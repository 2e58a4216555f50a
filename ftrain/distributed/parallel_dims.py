"""Rank layout of a (tp, cp, dp, pp) device mesh, laid out as Megatron-Core lays it.

Megatron-Core's default order "tp-cp-ep-dp-pp" (with ep = 1) makes tp the fastest-varying
coordinate, then cp, dp and pp:

    rank = tp + TP * (cp + CP * (dp + DP * pp))

This module does the arithmetic itself (no Megatron import), so the driver can lay out
ranks, pick DP peers for recovery and fan out batches without loading Megatron. The groups
it returns equal `megatron.core.parallel_state.RankGenerator(tp, ep=1, dp, pp, cp,
order="tp-cp-ep-dp-pp").get_ranks(dim)` (checked in tests/test_parallel_dims.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ftrain.config import Config

# Fastest-varying first, as in Megatron's order "tp-cp-ep-dp-pp" with ep = 1.
_ORDER = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class RankCoords:
    """Coordinates of one global rank in the mesh; each is in [0, size of that dim)."""

    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the tensor-, pipeline-, context- and data-parallel dimensions.

    Use `ParallelDims.from_world` to derive dp from the world size, `from_config` for a run's.
    """

    tp: int
    pp: int
    cp: int
    dp: int

    def __post_init__(self) -> None:
        for name in _ORDER:
            if getattr(self, name) < 1:
                raise ValueError(f"parallel size {name}={getattr(self, name)} must be >= 1")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> ParallelDims:
        """Derive dp = world_size / (tp * pp * cp).

        Raises:
            ValueError: a size is < 1, or world_size is not a multiple of tp * pp * cp.
        """
        if min(world_size, tp, pp, cp) < 1:
            raise ValueError(
                f"cluster.num_workers={world_size}, parallel.tp={tp}, parallel.pp={pp}, "
                f"parallel.cp={cp}: all must be >= 1"
            )
        model_parallel = tp * pp * cp
        if world_size % model_parallel != 0:
            raise ValueError(
                f"cluster.num_workers={world_size} is not a multiple of "
                f"parallel.tp * parallel.pp * parallel.cp = {tp} * {pp} * {cp} = {model_parallel}; "
                f"change cluster.num_workers or the parallel sizes"
            )
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // model_parallel)

    @classmethod
    def from_config(cls, cfg: Config) -> ParallelDims:
        """The layout of a run: `from_world(cluster.num_workers, parallel.tp, parallel.pp,
        parallel.cp)` (a validated config always has one)."""
        return cls.from_world(cfg.cluster.num_workers, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of a global rank. Raises ValueError if rank is not in [0, world_size)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        values = {}
        for name in _ORDER:
            size = getattr(self, name)
            values[name] = rank % size
            rank //= size
        return RankCoords(**values)

    def rank_of(self, coords: RankCoords) -> int:
        """Global rank of coordinates; inverse of `coords`. Raises ValueError if out of range."""
        rank = 0
        for name in reversed(_ORDER):
            size, value = getattr(self, name), getattr(coords, name)
            if not 0 <= value < size:
                raise ValueError(f"coordinate {name}={value} is not in [0, {size})")
            rank = rank * size + value
        return rank

    def group_ranks(self, dim: str) -> list[list[int]]:
        """All groups of `dim`, e.g. "dp" or "dp-cp" (names joined by '-').

        A group is the set of ranks whose coordinates agree outside `dim`. Each group is a
        sorted list of global ranks; groups are ordered by their smallest rank (the order
        of Megatron's RankGenerator.get_ranks).

        Raises:
            ValueError: unknown or repeated dimension name.
        """
        names = dim.split("-")
        if len(set(names)) != len(names) or not set(names) <= set(_ORDER):
            raise ValueError(f"dim {dim!r} must be names from {_ORDER} joined by '-', each once")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(getattr(c, n) for n in _ORDER if n not in names)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """All ranks of DP replica `dp_rank` (every tp, cp, pp coordinate), sorted."""
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {self.dp})")
        return [r for r in range(self.world_size) if self.coords(r).dp == dp_rank]

    def shard_peers(self, rank: int) -> list[int]:
        """Ranks holding the same (tp, cp, pp) shard as `rank` in the other DP replicas, sorted."""
        c = self.coords(rank)
        return [
            self.rank_of(RankCoords(tp=c.tp, cp=c.cp, dp=d, pp=c.pp))
            for d in range(self.dp)
            if d != c.dp
        ]
