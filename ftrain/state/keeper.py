"""The shard keeper: with a sharded optimizer (`model.distributed_optimizer`: Megatron's distributed
optimizer, the torch engine's ZeRO-1) each DP rank holds an optimizer shard that no DP peer has.
After every step each rank copies its shard to host memory (overlapped with the next step) for
its keeper: the `snapshots.SnapshotHolder` of the next node (`keeper_node`), so the copy outlives
the rank's process and, with two or more nodes, its node. A recovery then gives a replaced rank
the parameters from a DP peer (a broadcast) and its shard from its keeper
(`fault_tolerance.plan_restore`, source `peer+keeper`): no committed step lost, no checkpoint read.

Every step's shard is kept: the rank copies it into one of two shared host arenas. A keeper on
another node gets it from a courier process on the rank's node (courier.py), which sends it while
the next steps run; a rank waits only when its arena's previous send (that of step k-2) has not
ended, i.e. when sends are slower than steps. A keeper on the rank's own node (a one-node job:
the ring has one node) adopts the arenas instead, as the local keeper below does (`adopts`): no
courier, no bytes through Ray. The keeper has step k's shard about one send (or one copy) after
step k ends; a rank lost inside that window is restored from the newest checkpoint instead (the
shard of another step would not match the peer's parameters).

The local keeper, at dp = 1 (no DP peer holds any part of a rank's state): each rank copies its
whole training state into the same two arenas, which the `SnapshotHolder` of its own node adopts
(`SnapshotHolder.adopt`: it opens the memory file once and keeps its descriptor, so the memory
outlives the rank's process). The rank seals an arena with the step once its copy is complete
and retires it before overwriting it (`host_memory.SharedArena.seal`, `retire`: a write into the
shared memory, no call), so the holder serves only complete steps. A replacement on the same
node maps the arena through the holder's descriptor and loads it (`load_local`, source `local`;
an adopted shard: `load_adopted_shard`): zero bytes through Ray. A rank lost inside the copy
window of step k is restored to step k-1 (every rank position to the newest step all of them
hold) and re-runs one step; a replacement on another node (a node lost) falls back to the next
source (an adopted shard is copied to it: `SnapshotHolder.get`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ftrain.state.courier import ShardCourier
from ftrain.state.host_memory import SEAL_BYTES, SharedArena, attach_shared, from_regions, regions, share_in_background
from ftrain.state.snapshots import PART_BYTES

log = logging.getLogger(__name__)

SHARD = "shard"  # first element of a kept shard's holder key (full snapshots have none)
LOCAL = "local"  # first element of a locally kept state's holder key


def keeps_shards(distributed_optimizer: bool, shard_keeper: bool, dp: int) -> bool:
    """Whether ranks send their optimizer shards to keepers: a sharded optimizer over dp >= 2
    ranks (at dp = 1 the rank holds the whole state and no peer holds the parameters) with
    `fault_tolerance.shard_keeper` on."""
    return distributed_optimizer and shard_keeper and dp >= 2


def keeps_locally(shard_keeper: bool, dp: int, spares: int) -> bool:
    """Whether ranks keep their whole training state with their own node's holder (the local
    keeper): `fault_tolerance.shard_keeper` on at dp = 1, where no DP peer holds any of it, and
    `cluster.num_spares` > 0 (without a spare no replacement would load it)."""
    return shard_keeper and dp == 1 and spares > 0


def shard_key(layout: str, rank: int) -> tuple:
    """The holder key of `rank`'s kept shard in `layout` (`str(ParallelDims)`)."""
    return SHARD, layout, rank


def local_key(layout: str, rank: int, node: str) -> tuple:
    """The holder key of `rank`'s state in `layout` kept by the local keeper of Ray node `node`
    (only a process of that node can map it)."""
    return LOCAL, layout, rank, node


MAPPED_AHEAD, MAPPED_NOW = "mapped ahead", "mapped now"  # how `load_local` read an arena


def load_local(engine, holder, key: tuple, step: int, timeout_s: float, maps: LocalMaps | None = None) -> dict | None:
    """Load the state of `step` that `holder` (this node's `SnapshotHolder`) keeps under `key`
    (`local_key`) into `engine` (`Engine.load_state`), mapping the arena through the holder's
    descriptor (`MAPPED_NOW`) or taking `maps`' mapping of it, made ahead (`MAPPED_AHEAD`): no
    bytes through Ray. Returns `SnapshotHolder.local`'s answer with "how" (which of the two)
    and seconds by part: "find_s" (the holder's answer), "load_s" (mapping and loading); None
    when the holder has no complete copy of that step, does not answer within `timeout_s`
    seconds, or when the arena was retired while it was read (the engine's state is then to be
    restored from another source)."""
    return _load_adopted(engine.load_state, holder, key, step, timeout_s, maps)


def load_adopted_shard(engine, holder, key: tuple, step: int, timeout_s: float, rewind: bool = False) -> dict | None:
    """`load_local` of an optimizer shard: the shard of `step` that `holder` (this node's
    `SnapshotHolder`) adopted under `key` (`shard_key`) loaded into `engine`, whose other state
    is at `step` already (`Engine.load_shard`), or with `rewind` whatever its state
    (`Engine.load_state`: the shard's step and schedule become the live state's, the params
    wait for `sync_params`), through a mapping of the arena. Returns as `load_local` (None: no
    complete copy, no answer in time, or retired while read)."""
    return _load_adopted(engine.load_state if rewind else engine.load_shard, holder, key, step, timeout_s)


def _load_adopted(load, holder, key: tuple, step: int, timeout_s: float,
                  maps: LocalMaps | None = None) -> dict | None:
    """`load_local` with `load` (an engine's `load_state` or `load_shard`) taking the state."""
    t0 = time.perf_counter()
    try:
        found = ray.get(holder.local.remote(key, step), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        log.warning("the holder of this node did not answer within %.1f s: restoring from another source", timeout_s)
        return None
    if found is None:
        return None
    t1 = time.perf_counter()
    arena, how = maps.view(found["path"]) if maps is not None else None, MAPPED_AHEAD
    if arena is None:
        arena, how = attach_shared(found["path"], found["nbytes"]), MAPPED_NOW
    load(from_regions(found["layout"], arena))
    if int(arena[:8].view(torch.int64)) != step:
        return None
    return {**found, "how": how, "find_s": t1 - t0, "load_s": time.perf_counter() - t1}


class LocalMaps:
    """A spare's mappings of the arenas its node's holder adopted (the local keeper), made while
    it waits: `start` maps each arena the holder lists (`SnapshotHolder.arenas`) every
    `PERIOD_S` seconds, page-locked (`attach_shared(pin=True)`), and unmaps those it no longer
    lists. Why: a replacement that maps a dead rank's arena at restore time first faults in
    every page of a fresh mapping and copies from pageable memory (a few GB/s: seconds for tens
    of GB); from these mappings the copy to the device runs at full bus speed. `stop` (at the
    spare's join) keeps the mappings for its restore, whose rank then takes them over as its
    own arenas (`ShardSender.take_over`); `close` unmaps them (they would keep a replaced
    rank's memory alive)."""

    PERIOD_S = 1.0

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s  # for the holder's answer (a stop waits at most this long for it)
        self._error = ""  # the last failure to map, logged once
        self._maps: dict[int, torch.Tensor] = {}  # memory file inode -> its mapping
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, holder) -> None:
        """Map what `holder` (this node's `SnapshotHolder`) holds, at once and then every
        `PERIOD_S`, in a thread of this process, until `stop`: the caller does not wait for
        tens of GB to be mapped."""
        self.stop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(holder,), name="local-maps", daemon=True)
        self._thread.start()

    def _run(self, holder) -> None:
        while True:
            self._refresh_from(holder)
            if self._stop.wait(self.PERIOD_S):
                return

    def _refresh_from(self, holder) -> None:
        try:
            self.refresh(ray.get(holder.arenas.remote(), timeout=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 (a holder gone: the restore maps at its time)
            if repr(exc) != self._error:  # once, not every period
                log.warning("local keeper: could not map the arenas of this node's holder ahead: %r", exc)
            self._error = repr(exc)

    def refresh(self, listed: dict[int, tuple[str, int]]) -> None:
        """Map the arenas of `listed` (`SnapshotHolder.arenas`) not mapped yet and unmap those
        not in it; an arena whose owner and holder let go meanwhile is skipped."""
        with self._lock:
            for ino in [i for i in self._maps if i not in listed]:
                del self._maps[ino]
            for ino, (path, nbytes) in listed.items():
                if ino not in self._maps and not self._stop.is_set():
                    try:
                        self._maps[ino] = attach_shared(path, nbytes, pin=True)
                    except OSError:
                        continue

    def view(self, path: str) -> torch.Tensor | None:
        """The mapping of the memory file at `path`, or None when there is none."""
        try:
            ino = os.stat(path).st_ino
        except OSError:
            return None
        with self._lock:
            return self._maps.get(ino)

    def stop(self) -> None:
        """Stop mapping (the thread ends, after the arena it may be mapping: at a join right
        after a recovery that can take seconds); the mappings stay."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """`stop`, and unmap every arena."""
        self.stop()
        with self._lock:
            self._maps.clear()

    def covers(self, listed: dict[int, tuple[str, int]]) -> bool:
        """Whether every arena of `listed` (`SnapshotHolder.arenas`) is mapped here."""
        with self._lock:
            return all(ino in self._maps for ino in listed)

    def __len__(self) -> int:
        return len(self._maps)


def keeper_node(node: str, nodes: list[str]) -> str:
    """The node whose holder keeps the shards of the ranks on `node`: the next of `nodes` (the
    holders' nodes) in sorted order after `node`, so every node's shards are on another node
    when there are two or more, and the nodes form one ring (each holder keeps one node's
    shards). A node without a holder maps to the first. Raises ValueError for no nodes."""
    if not nodes:
        raise ValueError("keeper_node: no holder nodes")
    ring = sorted(nodes)
    return ring[(ring.index(node) + 1) % len(ring)] if node in ring else ring[0]


def adopts(holder_node: str, node: str) -> bool:
    """Whether the keeper holder on Ray node `holder_node` adopts the arenas of a rank on `node`
    (`SnapshotHolder.adopt`) rather than the rank's courier sending their bytes through Ray: when
    both are the same node, where the holder can open the rank's memory files (a one-node job,
    whose ring has one node; the local keeper, whose holder is its node's). A holder on another
    node can only receive the bytes."""
    return holder_node == node


class ShardSender:
    """A rank's side of the keeper: after each step, copy the optimizer shard (`whole`: the whole
    training state, for the local keeper) into one of two shared host arenas
    (`Engine.start_shard_copy`, asynchronous on GPU) and return; a thread of the rank waits for
    the copy and then either hands the send to the rank's `courier.ShardCourier` (a process of its
    own on this node), so the training thread neither serialises nor sends, or, with `adopt` (the
    holder runs on this node, `adopts`), has the holder adopt the arena (`SnapshotHolder.adopt`,
    while the copy runs) and seals it once the copy is complete: nothing is sent, no courier runs.
    Double-buffered: step k+1 copies into the other arena while step k's is being sent; a rank
    waits (counted in `waits`, `wait_s`) only when a send is slower than a step, so no step's
    shard is skipped. A copy whose arena is still being allocated (pinned after a join) is
    skipped and counted. A courier that dies is replaced and the send retried once from the same
    arena (`couriers` counts the couriers started); a send that fails anyway (its keeper gone)
    is counted in `failed` and logged.

    Every call to the holder (and each part the courier puts to it) must be answered within
    `timeout_s` seconds: a holder that does not (cut off, frozen) fails that send, and the
    copies of the next `QUIET_TIMEOUTS` x `timeout_s` seconds are skipped (counted, logged once)
    rather than sent to it, so a rank never waits on a silent keeper for longer than one
    timeout; the next `connect` (a new membership, whose keeper the driver chose) ends the
    quiet at once."""

    BUFFERS = 2
    QUIET_TIMEOUTS = 6

    def __init__(self, timeout_s: float, part_bytes: int = PART_BYTES):
        self.timeout_s, self.part_bytes = timeout_s, part_bytes
        self.sent = self.skipped = self.failed = self.waits = self.couriers = 0
        self.wait_s = self.last_wait_s = 0.0  # seconds waited for a send: in all, in the last `after_step`
        self.kept_step: int | None = None  # newest step of this membership whose copy the keeper holds whole
        self._quiet_until = 0.0  # time.monotonic() before which no copy is sent: the keeper did not answer
        self.courier, self.whole, self.adopt = None, False, False
        self._attached: dict[int, object] = {}  # arena index -> the SharedArena the courier maps there
        self._arenas: list[concurrent.futures.Future | None] = [None] * self.BUFFERS
        self._sends: list[concurrent.futures.Future | None] = [None] * self.BUFFERS
        self._next = 0
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-send")

    def connect(self, holder, whole: bool = False, adopt: bool | None = None) -> None:
        """Keep what `after_step` copies with `holder` from now on: the optimizer shard, or with
        `whole` the whole training state (the local keeper; `holder` is this node's). `adopt`:
        whether `holder` adopts the arenas (no courier); None: when it runs on this node
        (`adopts`). The decision, the courier's start and the first calls to it and to `holder`
        run in the background (the send thread, before any send): an actor's start and a first
        call take seconds on a busy machine, which the first steps' sends would otherwise wait
        for."""
        self.whole, self._quiet_until, self.kept_step = whole, 0.0, None
        self._thread.submit(self._connect, holder, adopt)

    def _connect(self, holder, adopt: bool | None) -> None:
        """Send thread: `connect`'s decision and first calls; a courier no longer needed ends."""
        try:
            node = ray.get(holder.node_id.remote(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._silent("connect", -1)
            return
        self.adopt = adopts(node, ray.get_runtime_context().get_node_id()) if adopt is None else adopt
        if not self.adopt:
            ray.get(self._courier().node_id.remote())
        elif self.courier is not None:  # e.g. the holder of the other node gone: this node's keeps
            ray.kill(self.courier)
            self.courier, self._attached = None, {}

    def _courier(self):
        """This rank's courier, started on this node when there is none (send thread only)."""
        if self.courier is None:
            node = ray.get_runtime_context().get_node_id()
            self.courier = ShardCourier.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node, soft=False)).remote()
            self._attached, self.couriers = {}, self.couriers + 1
        return self.courier

    def arena(self, engine, index: int):
        """Arena `index` (a `SharedArena` of at least the shard's bytes), or None while it is
        being allocated (pinned in the background on GPU; at once on CPU, where nothing is
        pinned), its first `SEAL_BYTES` bytes for the seal. Call only when no send reads it."""
        need, future = engine.shard_nbytes(self.whole) + SEAL_BYTES, self._arenas[index]
        if future is not None and future.done() and future.exception():
            log.warning("%s: host arena %d of %.2f GB could not be allocated (%r): trying again", self._what(),
                        index, need / 1e9, future.exception())
        if future is None or future.done() and (future.exception() or future.result().nbytes < need):
            name = f"shard-keeper-{os.getpid()}-{index}"
            if torch.cuda.is_available():
                future = share_in_background(need, name)
            else:  # nothing to pin: allocated at once, else this step's shard would be skipped
                future = concurrent.futures.Future()
                future.set_result(SharedArena(need, name))
            self._arenas[index] = future
        return future.result() if future.done() else None

    def take_over(self, arenas: dict[int, SharedArena], newest: int) -> None:
        """Use `arenas` (index -> `SharedArena.reopen` of a replaced rank's arenas, whose state
        this rank restored) as its own instead of allocating new ones: no tens of GB zeroed and
        page-locked beside the first steps after a recovery, and the node's spares keep their
        mappings of the same memory. The arena of index `newest` holds the restored step and is
        overwritten last (a loss inside the next copy window restores it again). Call before
        the first `after_step` of this membership."""
        for index, arena in arenas.items():
            done = concurrent.futures.Future()
            done.set_result(arena)
            self._arenas[index], self._sends[index] = done, None
        self._next = (newest + 1) % self.BUFFERS

    def prepare(self, engine) -> None:
        """Start allocating both arenas for the engine's current state (in the background on
        GPU), so that both are ready as early as the first steps after a join rather than one
        at a time, each when its first copy is due."""
        for i in range(self.BUFFERS):
            if self._sends[i] is None or self._sends[i].done():  # none replaced under a send reading it
                self.arena(engine, i)

    def after_step(self, engine, holder, key: tuple, step: int, generation: int = 0) -> dict:
        """Send the shard of committed step `step` to `holder` (a `SnapshotHolder`) under `key`,
        as a rank of membership `generation` (`SnapshotHolder.drop_after`); returns the counts
        so far (`counts`)."""
        index, self.last_wait_s = self._next, 0.0
        if self._sends[index] is not None:
            if not self._sends[index].done():
                t0 = time.perf_counter()
                self._sends[index].result()
                self.last_wait_s = time.perf_counter() - t0
                self.waits, self.wait_s = self.waits + 1, self.wait_s + self.last_wait_s
            self._sends[index] = None
        if time.monotonic() < self._quiet_until:
            self.skipped += 1
            return self.counts()
        arena = self.arena(engine, index)
        if arena is None:
            self.skipped += 1
            log.warning("%s of step %d skipped: its host buffers are still being allocated "
                        "(%d skipped, %d sent so far)", self._what(), step, self.skipped, self.sent)
            return self.counts()
        arena.retire()  # before a byte changes: the holder serves it no more
        copy = engine.start_shard_copy(arena.tensor[SEAL_BYTES:], self.whole)
        layout = regions(copy.state, arena.tensor)
        self._sends[index] = self._thread.submit(self._send, holder, key, step, index, arena, copy, layout,
                                                 generation)
        self._next = (index + 1) % self.BUFFERS
        return self.counts()

    def _kept(self, step: int) -> None:
        """Send thread: the copy of `step` is the keeper's, whole."""
        self.sent += 1
        self.kept_step = max(step, self.kept_step or 0)

    def _send(self, holder, key, step, index, arena, copy, layout, generation) -> None:
        """Send thread: with `adopt` have the holder adopt the arena and seal it once the copy is
        complete, else wait for the copy and have the courier send it (a new courier, once, if
        it died); counts the outcome."""
        try:
            if self.adopt:  # adopted while the copy runs, served once sealed
                ray.get(holder.adopt.remote(key, os.getpid(), index, arena.path, arena.nbytes, step, layout,
                                            generation), timeout=self.timeout_s)
                copy.wait()
                arena.seal(step)
                self._kept(step)
                return
            copy.wait()
            for attempt in range(2):
                courier = self._courier()
                try:
                    if self._attached.get(index) is not arena:
                        ray.get(courier.attach.remote(index, arena.path, arena.nbytes))
                        self._attached[index] = arena
                    ray.get(courier.send.remote(holder, key, step, index, layout, generation, self.timeout_s,
                                                self.part_bytes))
                    self._kept(step)
                    return
                except ray.exceptions.RayActorError as exc:
                    if isinstance(exc, ray.exceptions.RayTaskError) or attempt:
                        raise  # raised in the courier (its holder call), or a second courier lost
                    log.warning("the shard courier died (%r): starting another, sending step %d again", exc, step)
                    self.courier = None
        except ray.exceptions.GetTimeoutError:  # also raised in the courier: its holder's silence
            self.failed += 1
            self._silent("send", step)
        except Exception as exc:  # noqa: BLE001 (a lost shard is not a failure of the rank)
            self.failed += 1
            log.warning("%s of step %d not kept: %r", self._what(), step, exc)

    def _silent(self, call: str, step: int) -> None:
        """The keeper did not answer `call` (of `step`; -1: none) in time: skip sends for a while."""
        quiet_s = self.QUIET_TIMEOUTS * self.timeout_s
        self._quiet_until = time.monotonic() + quiet_s
        log.warning("%s%s not kept: its keeper did not answer a %s within %.1f s; the copies of the next %.0f s "
                    "are skipped", self._what(), f" of step {step}" if step >= 0 else "s", call, self.timeout_s,
                    quiet_s)

    def _what(self) -> str:
        """What the logs call a copy: the whole state (`whole`) or the optimizer shard."""
        return "training state" if self.whole else "optimizer shard"

    def wait(self) -> None:
        """Block until every send started, and the connection (`connect`), have ended."""
        self._thread.submit(lambda: None).result()  # the send thread runs them in order

    def close(self) -> None:
        """Wait for the sends, end the courier and free the arenas (a rank that keeps no more
        shards). The sender can be used again (a new courier and arenas)."""
        self.wait()
        if self.courier is not None:
            ray.kill(self.courier)
        self.courier, self._attached = None, {}
        self._arenas, self._sends = [None] * self.BUFFERS, [None] * self.BUFFERS

    def counts(self) -> dict:
        """{"sent", "skipped", "failed"} so far."""
        return {"sent": self.sent, "skipped": self.skipped, "failed": self.failed}
