"""In-memory snapshots kept off the rank's node: the wire format of a host training state (numpy
arrays that Ray moves zero-copy, in parts of about `PART_BYTES`), `SnapshotHolder`, the actor
that keeps the newest complete copies of the ranks it serves in memory of its own (each part
copied out of Ray's object store on arrival, so the store holds only the parts in flight), and
`SnapshotSender`, a rank's background sender (at most one send in flight, one part at a time;
a snapshot due while one is in flight is skipped and counted, so a slow holder never stalls
training and host memory stays bounded).

Consistency: the holder makes a snapshot visible only when every part of it has arrived, so a
send cut short (the rank died, the holder's node went away) leaves nothing `get` returns; the
sender sends a copy only after its device-to-host copy completed (`HostCopy.wait`), and the
engines order every later change of the live state after that copy.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import ray

from ftrain.failures import StaleGenerationError, epoch_of

log = logging.getLogger(__name__)
PART_BYTES = 256 << 20  # bytes per holder call: bounds one call's serialisation, not the total


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


class _Slot:
    """Where leaf `index` of a state goes (the holder joins the parts without a pytree spec:
    pickling torch's TreeSpec is slow and deprecated in Ray's serializer)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def wire_parts(state, part_bytes: int = PART_BYTES) -> tuple[object, list[list]]:
    """`state` cut for sending: (meta, parts). meta: `state` with each tensor replaced by its
    slot; parts: lists of (slot index, `_WireTensor`), consecutive tensors of about
    `part_bytes` each (a larger tensor is a part of its own), at least one part. No bytes are
    copied: the wire tensors view the host tensors of `state`."""
    import torch

    tensors = []

    def slot(x):
        if not isinstance(x, torch.Tensor):
            return x
        tensors.append(x)
        return _Slot(len(tensors) - 1)

    meta = torch.utils._pytree.tree_map(slot, state)
    parts, size = [[]], 0
    for i, x in enumerate(tensors):
        n = x.numel() * x.element_size()
        if parts[-1] and size + n > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append((i, _WireTensor(x)))
        size += n
    return meta, parts


def join_parts(meta, parts: list[list]):
    """Inverse of `wire_parts`: the state with `_WireTensor` leaves (`from_wire` makes tensors)."""
    import torch

    wires = {i: x for part in parts for i, x in part}
    return torch.utils._pytree.tree_map(lambda x: wires[x.index] if isinstance(x, _Slot) else x, meta)


@ray.remote(num_cpus=0)
class SnapshotHolder:
    """Keeps in-memory snapshots of ranks on other nodes: per (layout, rank), the host copies
    of that rank's training state (model + optimizer shard, engine `start_host_copy`) of the
    newest `keep` steps whose parts all arrived. Ranks send them in the background after a step
    (`SnapshotSender`); a replacement fetches its rank's copy (`get`) when no DP peer holds the
    state.

    Memory: every arriving part is copied out of Ray's object store into arrays the holder owns,
    so the store holds only the parts in flight (Ray frees each once `put_part` returns); a
    holder that kept zero-copy views pinned its snapshots in the store, which filled it at a few
    GB of state and made Ray fall back to disk-backed allocations (docs/recovery.md, "Memory
    snapshots, step by step"). Per (layout, rank): up to `keep` + 1 x that rank's state size
    (the newest complete copies plus one arriving, or plus the spare buffers: the arrays of the
    last dropped snapshot, which the next arrival copies into so that steady-state sends
    touch no fresh pages). Calls run one at a time (a plain actor) and `get`'s result leaves
    the actor serialised (a copy), so buffers are reused only once no visible snapshot uses
    them."""

    def __init__(self, keep: int = 2):
        import torch  # noqa: F401 (the parts hold torch dtypes: imported now, not in the first put)

        self.keep, self.snaps, self._partial, self._spare = keep, {}, {}, {}
        self._fence = 0  # parts sent in an older generation than the last rewind's are dropped
        self._epoch = 0  # the newest driver's lease epoch seen: an older one's calls are refused
        self._local: dict[tuple, dict[tuple[int, int], _Kept]] = {}  # key -> (owner pid, index) -> arena

    def node_id(self) -> str:
        """The Ray node this holder runs on."""
        return ray.get_runtime_context().get_node_id()

    def put_part(self, key: tuple, step: int, index: int, count: int, meta, part: list,
                 generation: int = 0) -> None:
        """Part `index` of `count` of (`key`, `step`) (`wire_parts`; `meta` with part 0), sent by a
        rank in membership `generation`; dropped when that is older than the last rewind's
        (`drop_after`: a send of the abandoned timeline still in flight) or of a superseded
        driver (`_admits`), else copied
        into holder-owned arrays (the spare buffers of `key` where a slot's shape and dtype
        match, else fresh ones) before returning. The snapshot becomes visible when all `count`
        parts are here; it then drops the oldest beyond `keep` (their arrays become `key`'s
        spare buffers) and the older partial ones of `key` (their senders died or gave up)."""
        import numpy as np

        if not self._admits(generation):
            return
        spare = self._spare.get(key, {})
        for slot, wire in part:
            buf = spare.pop(slot, None)
            if buf is None or buf.shape != wire.array.shape or buf.dtype != wire.array.dtype:
                buf = np.empty_like(wire.array)
            np.copyto(buf, wire.array)
            wire.array = buf  # the view of Ray's buffer goes: the store frees the part
        got = self._partial.setdefault((key, step), {})
        got[index] = (meta, part)
        if len(got) < count:
            return
        del self._partial[(key, step)]
        steps = self.snaps.setdefault(key, {})
        retired = [steps.pop(step)] if step in steps else []  # the same step sent again
        steps[step] = join_parts(got[0][0], [got[i][1] for i in range(count)])
        retired += [steps.pop(old) for old in sorted(steps)[:-self.keep]]
        if retired:
            self._spare[key] = _arrays(retired[-1])
        for k, s in list(self._partial):
            if k == key and s <= step:
                del self._partial[(k, s)]

    def adopt(self, key: tuple, owner: int, index: int, path: str, nbytes: int, step: int, layout,
              generation: int = 0) -> None:
        """The local keeper, or a shard keeper on its rank's node (keeper.py): process `owner` of
        this node is copying the state (or optimizer shard) of step `step` (laid out as `layout`,
        `host_memory.regions`) into its arena `index` (`host_memory.SharedArena` at `path`,
        `nbytes` bytes) for the rank position `key`, as a rank of membership `generation`. The holder adopts the arena (opens it once:
        `AdoptedArena`; its memory then outlives the owner's process) and serves it for `step`
        while the arena's seal says that step (`SharedArena.seal`: the owner seals it once the
        copy is complete and retires it before overwriting it). Dropped like `put_part`'s parts
        when `generation` is older than the last rewind's, or when the owner is gone already.
        The owner's arenas at another key go (it holds another position now); another owner's
        at `key` (the rank it replaced) go once this owner has a newer complete step."""
        from ftrain.state.host_memory import AdoptedArena

        if not self._admits(generation):
            return
        kept = self._local.setdefault(key, {})
        old = kept.get((owner, index))
        try:
            arena = old.arena if old is not None and old.arena.is_file(path) else AdoptedArena(path, nbytes)
        except OSError:  # the owner died before this call ran
            return
        kept[(owner, index)] = _Kept(arena, step, layout)
        newest = max((x.step for (o, _), x in kept.items() if o == owner and x.complete()), default=-1)
        for k, arenas in self._local.items():
            for (o, i), x in list(arenas.items()):
                if (o == owner and k != key) or (o != owner and k == key and x.step < newest):
                    arenas.pop((o, i)).arena.close()

    def local(self, key: tuple, step: int) -> dict | None:
        """The adopted arena (`adopt`: a local keeper's whole state, or an optimizer shard whose
        keeper is on its rank's node) complete for (`key`, `step`), None when none is:
        {"path", "nbytes", "layout"}: another process of this node maps it through `path`
        (`host_memory.attach_shared`); "index": its index among its owner's arenas; "owner":
        that process's pid; "arenas": index -> path of every arena of that owner at `key` (a
        replacement may take them over: `ShardSender.take_over`)."""
        kept = self._local.get(key, {})
        for (owner, index), x in kept.items():
            if x.step == step and x.complete():
                return {"path": x.arena.path, "nbytes": x.arena.nbytes, "layout": x.layout, "index": index,
                        "owner": owner, "arenas": {i: y.arena.path for (o, i), y in kept.items() if o == owner}}
        return None

    def arenas(self) -> dict[int, tuple[str, int]]:
        """Every adopted arena (`adopt`), complete or not: its memory file's inode -> (path,
        nbytes), for a spare of this node to map before it is needed (`keeper.LocalMaps`)."""
        return {x.arena.ino: (x.arena.path, x.arena.nbytes) for arenas in self._local.values() for x in arenas.values()}

    def get(self, key: tuple, step: int) -> dict | None:
        """The complete snapshot of (`key`, `step`) in wire form (`from_wire`), or None: one sent
        (`put_part`), else a copy of an adopted arena (`adopt`), for a process of another node
        (a replacement there of a rank whose keeper was on its own node). The copy is served
        only when the arena's seal says `step` before and after it (its owner, still writing,
        may retire it meanwhile)."""
        sent = self.snaps.get(key, {}).get(step)
        if sent is not None:
            return sent
        from ftrain.state.host_memory import attach_shared, from_regions

        for x in self._local.get(key, {}).values():
            if x.step == step and x.complete():
                view = from_regions(x.layout, attach_shared(x.arena.path, x.arena.nbytes))
                state = to_wire(_cloned(view))
                return state if x.complete() else None
        return None

    def steps(self) -> dict:
        """key -> complete steps held, oldest first: (layout, rank) of full snapshots, the
        keeper's keys for optimizer shards (sent and adopted ones together) and adopted arenas
        (keeper.py)."""
        held = {k: set(v) for k, v in self.snaps.items()}
        for k, arenas in self._local.items():
            held.setdefault(k, set()).update(x.step for x in arenas.values() if x.complete())
        return {k: sorted(v) for k, v in held.items() if v}

    def _admits(self, generation: int) -> bool:
        """Whether a send of membership `generation` is taken: not older than the last rewind's
        (`drop_after`), nor of an older lease epoch than the newest seen (`failures.epoch_of`: a
        superseded driver's ranks). The newest epoch seen moves up with it."""
        self._epoch = max(self._epoch, epoch_of(generation))
        return generation >= self._fence and epoch_of(generation) == self._epoch

    def drop_after(self, step: int, generation: int) -> None:
        """A rewind to committed step `step` in membership `generation`: drop every snapshot and
        partial one of a later step (the abandoned timeline: the steps run again may compute
        other states) and, from now on, the parts sent in an older generation. Snapshots up to
        `step` are history both timelines share and stay. Raises StaleGenerationError, dropping
        nothing, for a generation older than the last rewind's or of a superseded driver (an
        older lease epoch than a send or rewind seen here): its rewind would drop the steps
        the driver that took the run over has committed since."""
        if not self._admits(generation):
            raise StaleGenerationError(f"snapshot holder: rewind of generation {generation} refused: this holder "
                                       f"has seen generation {self._fence} and lease epoch {self._epoch}")
        self._fence = generation
        for steps in self.snaps.values():
            for s in [s for s in steps if s > step]:
                del steps[s]
        for k, s in [(k, s) for k, s in self._partial if s > step]:
            del self._partial[(k, s)]
        for arenas in self._local.values():
            for a in [a for a, x in arenas.items() if x.step > step]:
                arenas.pop(a).arena.close()

    def clear(self) -> None:
        """Drop every snapshot, partial one, spare buffer and adopted arena (frees the holder's
        memory)."""
        self.snaps.clear()
        self._partial.clear()
        self._spare.clear()
        for arenas in self._local.values():
            for x in arenas.values():
                x.arena.close()
        self._local.clear()


class _Kept:
    """An arena the holder adopted (`SnapshotHolder.adopt`): the state of `step` at `layout`."""

    __slots__ = ("arena", "step", "layout")

    def __init__(self, arena, step: int, layout):
        self.arena, self.step, self.layout = arena, step, layout

    def complete(self) -> bool:
        """Whether the arena holds every byte of `step` now (its seal)."""
        return self.arena.sealed() == self.step


def _cloned(state):
    """`state` with every tensor copied (into memory of this process)."""
    import torch

    return torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)


def _arrays(snapshot) -> dict:
    """slot index -> numpy array of a joined snapshot's `_WireTensor` leaves (the i-th in tree
    order is slot i: `wire_parts` numbers them in that order)."""
    import torch

    wires = [x for x in torch.utils._pytree.tree_leaves(snapshot) if isinstance(x, _WireTensor)]
    return {i: x.array for i, x in enumerate(wires)}


class SnapshotSender:
    """A rank's background sends of its snapshots to a `SnapshotHolder`, at most one in flight.
    A snapshot due while the previous one is still being copied or sent is skipped, not waited
    for: training never waits for a holder (`skipped` counts them, each logged). A send that
    fails (holder gone, copy interrupted, a call not answered within `timeout_s` seconds: the
    holder cut off or frozen) is logged and counted in `failed`; the holder then keeps no part
    of that step (see `SnapshotHolder.put_part`)."""

    def __init__(self, timeout_s: float, part_bytes: int = PART_BYTES, what: str = "memory snapshot"):
        self.timeout_s, self.part_bytes, self.what = timeout_s, part_bytes, what  # `what`: how the logs name a send
        self.sent = self.skipped = self.failed = 0
        self._thread: threading.Thread | None = None

    def busy(self) -> bool:
        """Whether a copy or send is still in flight (its host buffers are in use)."""
        return self._thread is not None and self._thread.is_alive()

    def connect(self, holder) -> None:
        """Make the first call to `holder` in the background (`busy()` meanwhile): a caller's
        first call to an actor sets up its connection (about a second on a busy machine),
        which would otherwise delay the first snapshot and make the next ones skipped."""
        if not self.busy():
            self._thread = threading.Thread(target=self._first_call, args=(holder,), daemon=True,
                                            name="snapshot-connect")
            self._thread.start()

    def _first_call(self, holder) -> None:
        try:
            ray.get(holder.node_id.remote(), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 (the first send will fail, counted and logged)
            log.warning("%s holder did not answer: %r", self.what, exc)

    def skip(self, step: int, why: str = "the previous one is still being sent") -> None:
        """Count (and log, with `why`) the snapshot of `step` as skipped."""
        self.skipped += 1
        log.warning("%s of step %d skipped: %s (%d skipped, %d sent so far)", self.what, step, why,
                    self.skipped, self.sent)

    def send(self, holder, key: tuple, step: int, copy, before_last_part: Callable[[], None] = lambda: None,
             generation: int = 0) -> None:
        """Send `copy` (a `host_memory.HostCopy` of the state after `step`, possibly still being
        copied) to `holder` under (`key`, `step`), as a rank of membership `generation`
        (`SnapshotHolder.drop_after`), from a background thread: wait for the copy,
        then put its parts one at a time; `before_last_part()` runs once the copy is done and
        all parts but the last have been put (fault injection: a send cut short). Call only
        when not `busy()`."""
        if self.busy():
            raise RuntimeError("SnapshotSender.send while a send is in flight: check busy() first")

        def run():
            try:
                copy.wait()
                meta, parts = wire_parts(copy.state, self.part_bytes)
                for i, part in enumerate(parts):
                    if i == len(parts) - 1:
                        before_last_part()
                    ray.get(holder.put_part.remote(key, step, i, len(parts), meta if i == 0 else None, part,
                                                   generation), timeout=self.timeout_s)
                self.sent += 1
            except Exception as exc:  # noqa: BLE001 (a lost snapshot is not a failure of the rank)
                self.failed += 1
                log.warning("%s of step %d not sent: %r", self.what, step, exc)

        self._thread = threading.Thread(target=run, daemon=True, name="snapshot-send")
        self._thread.start()

    def wait(self) -> None:
        """Block until the copy or send in flight, if any, has ended (sent or failed)."""
        if self._thread is not None:
            self._thread.join()

    def counts(self) -> dict:
        """{"sent", "skipped", "failed"} so far."""
        return {"sent": self.sent, "skipped": self.skipped, "failed": self.failed}
