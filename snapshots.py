"""In-memory snapshots kept off the rank's node: the wire format of a host training state (numpy
arrays that Ray moves zero-copy) and `SnapshotHolder`, the actor that keeps the newest copies
of the ranks it serves, plus `SnapshotSender`, a rank's background sender (at most one send in
flight, so host memory stays bounded).
"""
from __future__ import annotations

import threading
from typing import Callable

import ray


class _WireTensor:
    """A host tensor as a numpy array (bf16 viewed as int16: numpy has no bf16) plus its
    dtype. Why: Ray moves numpy arrays out of band through its object store (zero-copy) but
    pickles a torch tensor's bytes, an order of magnitude slower per GiB (docs/recovery.md,
    "In-memory snapshot")."""

    __slots__ = ("array", "dtype")

    def __init__(self, tensor):
        import torch

        self.dtype = tensor.dtype
        tensor = tensor.detach()
        self.array = (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()

    def tensor(self):
        import torch

        t = torch.from_numpy(self.array.copy() if not self.array.flags.writeable else self.array)
        return t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t


def to_wire(state):
    """`state` (nested dicts/lists/tuples with host tensors) with every tensor a `_WireTensor`."""
    import torch

    return torch.utils._pytree.tree_map(lambda x: _WireTensor(x) if isinstance(x, torch.Tensor) else x, state)


def from_wire(state):
    """Inverse of `to_wire`: writable host tensors (copies where Ray's buffer is read-only)."""
    import torch

    return torch.utils._pytree.tree_map(lambda x: x.tensor() if isinstance(x, _WireTensor) else x, state)


@ray.remote(num_cpus=0)
class SnapshotHolder:
    """Keeps in-memory snapshots of ranks on other nodes: per (layout, rank), the host copies
    of that rank's training state (model + optimizer shard, engine `host_state()`) of the
    newest `keep` steps. Ranks send them asynchronously after a step (MegatronActor.train_step);
    a replacement fetches its rank's copy (`get`) when no DP peer holds the state. Host memory:
    `keep` x the sum of the state sizes of the ranks it serves."""

    def __init__(self, keep: int = 2):
        self.keep, self.snaps = keep, {}

    def node_id(self) -> str:
        """The Ray node this holder runs on."""
        return ray.get_runtime_context().get_node_id()

    def put(self, key: tuple, step: int, state: dict) -> None:
        steps = self.snaps.setdefault(key, {})
        steps[step] = state
        for old in sorted(steps)[:-self.keep]:
            del steps[old]

    def get(self, key: tuple, step: int) -> dict | None:
        return self.snaps.get(key, {}).get(step)

    def steps(self) -> dict:
        """(layout, rank) -> steps held, oldest first."""
        return {k: sorted(v) for k, v in self.snaps.items()}


class SnapshotSender:
    """A rank's background sends of its snapshots to a `SnapshotHolder`, at most one in flight:
    a send slower than the snapshot interval makes the next `send` wait for it (bounded host
    memory: one copy being sent, one being taken) instead of piling copies up, and a send
    stuck past `timeout_s` (holder unreachable) makes that snapshot skipped."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None

    def send(self, holder, key: tuple, step: int, take_state: Callable[[], dict]) -> bool:
        """Take the state now (`take_state()`: a host copy; the caller's next step changes the
        live tensors) and put it in `holder` under (`key`, `step`) in a background thread.
        Returns False when the previous send is still running after `timeout_s` (skipped)."""
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
            if self._thread.is_alive():
                return False
        state = to_wire(take_state())
        self._thread = threading.Thread(target=lambda: ray.get(holder.put.remote(key, step, state)),
                                        daemon=True, name="snapshot-send")
        self._thread.start()
        return True
