"""The shard courier: a small actor on a rank's node that sends the rank's optimizer shard to its
keeper (keeper.py), so that the rank's process only starts the device-to-host copy. Why: a send
from a thread of the rank (serialising GBs into Ray's object store) competes with the training
thread for the GIL and for memory bandwidth while it launches kernels (docs/recovery.md,
"Shard keeper").

The rank copies its shard into a `host_memory.SharedArena` (shared, pinned host memory); once
the copy is complete it tells the courier "step k is in buffer b" with the buffer's layout
(`host_memory.regions`: offsets, shapes and dtypes, no bytes); the courier maps the arena
(`attach`), cuts the state into parts (`snapshots.wire_parts`) and puts them to the keeper's
`SnapshotHolder`.
The courier is owned by the rank, so Ray ends it when the rank's process ends; the arenas are
memory files without a name, freed by the kernel once neither process maps them.
"""
from __future__ import annotations

import ray
import torch

from ftrain.state.host_memory import attach_shared, from_regions
from ftrain.state.snapshots import PART_BYTES, wire_parts


@ray.remote(num_cpus=0)
class ShardCourier:
    """Sends a rank's optimizer shards from shared host memory to its keeper; one per rank, on
    the rank's node (`keeper.ShardSender` starts it). Calls run one at a time, in the order the
    rank made them."""

    IN_FLIGHT = 2  # parts put and not yet copied by the holder

    def __init__(self):
        self._arenas: dict[int, torch.Tensor] = {}

    def node_id(self) -> str:
        """The Ray node this courier runs on."""
        return ray.get_runtime_context().get_node_id()

    def attach(self, index: int, path: str, nbytes: int) -> None:
        """Map the rank's arena `index` (`SharedArena.path`, `nbytes` bytes), replacing the one
        mapped under that index before. Raises OSError when it cannot be opened."""
        self._arenas[index] = attach_shared(path, nbytes)

    def send(self, holder, key: tuple, step: int, index: int, layout, generation: int, timeout_s: float,
             part_bytes: int = PART_BYTES) -> None:
        """Put the state at `layout` (`host_memory.regions`) of arena `index`, complete when
        called, to `holder` (a `SnapshotHolder`) under (`key`, `step`) as a rank of membership
        `generation`, in parts of about `part_bytes` (`SnapshotHolder.put_part`), at most
        `IN_FLIGHT` of them at once: this process serialises the next part while the holder
        copies the previous one out of the object store, which bounds the store's share to that
        many parts. Raises what a holder call raises (the holder gone: the snapshot is then
        incomplete there, not shown), GetTimeoutError when a part is not taken within
        `timeout_s` seconds (the holder cut off or frozen)."""
        meta, parts = wire_parts(from_regions(layout, self._arenas[index]), part_bytes)
        pending = []
        for i, part in enumerate(parts):
            pending.append(holder.put_part.remote(key, step, i, len(parts), meta if i == 0 else None, part,
                                                  generation))
            if len(pending) == self.IN_FLIGHT:
                ray.get(pending.pop(0), timeout=timeout_s)
        ray.get(pending, timeout=timeout_s)
