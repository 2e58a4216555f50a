"""The shard keeper: with a sharded optimizer (`model.distributed_optimizer`: Megatron's distributed
optimizer, the torch engine's ZeRO-1) each DP rank holds an optimizer shard that no DP peer has.
After every step each rank copies its shard to host memory (overlapped with the next step) and
sends it in the background to its keeper: the `snapshots.SnapshotHolder` of another node
(`keeper_node`), so the copy outlives the rank's process and its node. A recovery then gives a
replaced rank the parameters from a DP peer (a broadcast) and its shard from its keeper
(`fault_tolerance.plan_restore`, source `peer+keeper`): no committed step lost, no checkpoint read.

Every step's shard is kept: the send of step k overlaps step k+1, and a rank waits for it before
it copies step k+1's shard (a wait only when a send is slower than a step). The keeper has step
k's shard about one send time after step k ends; a rank lost inside that window is restored from
the newest checkpoint instead (the shard of another step would not match the peer's parameters).
"""
from __future__ import annotations

from typing import Callable

from snapshots import SnapshotSender

SHARD = "shard"  # first element of a kept shard's holder key (full snapshots have none)


def keeps_shards(distributed_optimizer: bool, shard_keeper: bool, dp: int) -> bool:
    """Whether ranks send their optimizer shards to keepers: a sharded optimizer over dp >= 2
    ranks (at dp = 1 the rank holds the whole state and no peer holds the parameters) with
    `fault_tolerance.shard_keeper` on."""
    return distributed_optimizer and shard_keeper and dp >= 2


def shard_key(layout: str, rank: int) -> tuple:
    """The holder key of `rank`'s kept shard in `layout` (`str(ParallelDims)`)."""
    return SHARD, layout, rank


def keeper_node(node: str, nodes: list[str]) -> str:
    """The node whose holder keeps the shards of the ranks on `node`: the next of `nodes` (the
    holders' nodes) in sorted order after `node`, so every node's shards are on another node
    when there are two or more, and the nodes form one ring (each holder keeps one node's
    shards). A node without a holder maps to the first. Raises ValueError for no nodes."""
    if not nodes:
        raise ValueError("keeper_node: no holder nodes")
    ring = sorted(nodes)
    return ring[(ring.index(node) + 1) % len(ring)] if node in ring else ring[0]


class ShardSender:
    """A rank's side of the keeper: after each step, copy the optimizer shard (`Engine.
    start_shard_copy`) and send it to the keeper in the background (`SnapshotSender`), having
    first waited for the previous step's send, so no step's shard is skipped. A copy whose host
    buffers are not ready yet (still being pinned after a join) is skipped and counted."""

    def __init__(self):
        self.sender = SnapshotSender(what="optimizer shard")

    def connect(self, holder) -> None:
        """First call to the keeper, in the background (see `SnapshotSender.connect`)."""
        self.sender.connect(holder)

    def after_step(self, engine, holder, key: tuple, step: int,
                   before_last_part: Callable[[], None] = lambda: None) -> dict:
        """Send the shard of committed step `step` to `holder` under `key`; returns the counts
        so far ({"sent", "skipped", "failed"})."""
        self.sender.wait()
        copy = engine.start_shard_copy()
        if copy is None:
            self.sender.skip(step, "its host buffers are still being allocated")
        else:
            self.sender.send(holder, key, step, copy, before_last_part)
        return self.sender.counts()
