"""`MegatronActor` (one Ray actor per GPU, or per CPU slot) and `MegatronActorGroup` (the
driver's view of all actors: placement, rank layout, process-group generations, spares).

Control plane vs data plane: compute methods (`build`, `join`, `train_step`, checkpoint and
restore) run on the actor's default thread and may block inside a collective; control methods
(`info`, `ping`, `abort`) run in the separate `control` concurrency group, so the driver can
reach an actor whose compute thread is stuck.

Process groups come from a `TCPStore` hosted by the driver (losing rank 0 does not lose the
store) with a fresh `PrefixStore` prefix per membership generation, so keys and ports of an
aborted generation are never reused. Every compute call carries the generation it belongs to;
an actor refuses calls of another generation (`StaleGenerationError`), and the driver discards
results of an aborted generation even when no error came (an aborted NCCL collective returns).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import faulthandler
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from checkpoint import CheckpointError, Manifest
from config import CHAOS_KINDS, CHAOS_POINTS, Config, preflight
from dispatch import dispatch_remote, get_dispatch_type
from comms import (abort_process_groups, close_open_nccl_groups, left_collective, recording_new_sockets,
                   refuses_connections, shutdown_sockets)
from parallel_dims import ParallelDims

log = logging.getLogger(__name__)
CONTROL = "control"
# Every gloo group's set-up reads each rank's address record from the driver's store. gloo's
# defaults (transport/tcp/context.cc): one blocking get per peer, and records that hold one
# sequence number per rank, so each rank reads O(N^2) bytes in N round trips and the store
# serves O(N^3) bytes. These make it one batched `multi_get` of records of constant size.
# Measured (torch 2.13, 2 cores, slowest rank's `init_process_group`): 110 -> 50 ms at N=32.
# Set for the CPU engine only: the GPU runs (whose Megatron makes gloo groups too) were not
# re-run with it.
GLOO_ENV = {"GLOO_ENABLE_STORE_V2_API": "1", "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "1"}


class StaleGenerationError(RuntimeError):
    """A compute call belongs to a process-group generation this actor is no longer in."""


class _WireTensor:
    """A host tensor as a numpy array (bf16 viewed as int16: numpy has no bf16) plus its
    dtype. Ray serializes numpy arrays out of band into its object store (zero-copy), torch
    tensors by pickling their bytes: measured on the CPU machine, 0.15-0.64 s/GiB against
    5.7-12.7 s/GiB for a 1 GiB tensor sent to an actor."""

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


def slowest(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the largest of the ranks' seconds (rounded to 0.1 ms): the slowest rank's time."""
    return {k: round(max(p[k] for p in parts), 4) for k in parts[0]}


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


class InjectedFault(RuntimeError):
    """An exception raised on purpose by fault injection (`MegatronActor.arm_fault`)."""


FAULT_KINDS = tuple(k for k in CHAOS_KINDS if k != "node")  # node loss is done by the driver


@ray.remote(concurrency_groups={CONTROL: 4})
class MegatronActor:
    """One rank (or one pre-warmed spare). Engine: `TorchEngine` (CPU, gloo) or the Megatron
    engine (GPU, NCCL), chosen by the resolved `model.engine`."""

    def __init__(self, cfg: Config, bundle_index: int):
        self.cfg, self.bundle_index = cfg, bundle_index
        self.engine = None
        self.generation: int | None = None
        self.rank: int | None = None
        self.dims: ParallelDims | None = None
        self.ckpt = cfg.checkpoint_manager()
        self.faults: dict[str, str] = {}  # point -> kind, armed by arm_fault
        self._abort_epoch = 0             # bumped by abort(): cancels a join in progress
        self._store = None                # ((host, port), TCPStore client of the driver's store)
        self._gloo_sockets: dict[int, str] = {}  # what this generation's gloo groups opened
        self._pending_save = None         # futures of an async checkpoint write
        self._holder = None               # SnapshotHolder this rank sends its snapshots to
        self._send: threading.Thread | None = None  # the in-memory snapshot being sent
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if cfg.cluster.device != "cuda":
            for k, v in GLOO_ENV.items():
                os.environ.setdefault(k, v)

    def fault_point(self, point: str) -> None:
        """Fire the fault armed at `point`, once: SIGKILL of this process, an InjectedFault
        exception, or a hang of the calling (compute) thread."""
        kind = self.faults.pop(point, None)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "exception":
            raise InjectedFault(f"injected exception at {point} on rank {self.rank}")
        elif kind == "hang":
            threading.Event().wait()
        elif kind == "slow":
            self.engine.delay_s = 1.0

    # -- control group -----------------------------------------------------------------------
    @ray.method(concurrency_group=CONTROL)
    def info(self) -> dict:
        """Where this actor runs: node IP/id, GPU ids Ray gave it, pid, bundle index."""
        ctx = ray.get_runtime_context()
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "gpu_ids": [int(g) for g in ray.get_gpu_ids()], "pid": os.getpid(),
                "bundle_index": self.bundle_index}

    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> dict:
        """Liveness + progress, answered even while the compute thread is in a collective."""
        e = self.engine
        return {"generation": self.generation, "rank": self.rank,
                "progress": e.progress if e else 0,
                "step_progress": e.progress - e.step_start_progress if e else 0,
                "step": self.engine.step if self.engine else 0}

    @ray.method(concurrency_group=CONTROL)
    def arm_fault(self, kind: str, point: str) -> None:
        """Fault injection: `kind` in FAULT_KINDS fires when the compute thread reaches `point`
        (CHAOS_POINTS). Raises ValueError for unknown kinds or points."""
        if kind not in FAULT_KINDS or point not in CHAOS_POINTS:
            raise ValueError(f"fault {kind!r} at {point!r}: kinds {FAULT_KINDS}, points {CHAOS_POINTS}")
        self.faults[point] = kind

    @ray.method(concurrency_group=CONTROL)
    def abort(self) -> float:
        """Abort (not destroy) this actor's communicators: non-blocking, and it frees a compute
        thread stuck in a collective whose peer died. Returns seconds taken.

        Raises RuntimeError when the compute thread is still inside a collective
        `health_timeout_s / 2` seconds later (`left_collective`): the caller must replace
        this actor, whose step would otherwise return only at the process-group timeout."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        self.generation = None
        self._abort_epoch += 1
        if self.engine is not None:
            self.engine.interrupt()
        shutdown_sockets(self._gloo_sockets)
        self._gloo_sockets = {}
        if dist.is_initialized():
            # An abort that does not return gets this actor replaced; leave the stacks of every
            # thread in its log so the cause can be read afterwards.
            faulthandler.dump_traceback_later(self.cfg.fault_tolerance.health_timeout_s / 2)
            try:
                abort_process_groups()
            finally:
                faulthandler.cancel_dump_traceback_later()
        grace = self.cfg.fault_tolerance.health_timeout_s / 2
        if self.engine is not None and not left_collective(self.engine, grace):
            raise RuntimeError(f"rank {self.rank}: compute thread still inside a collective {grace:g} s after "
                               "the abort (a gloo send queued behind a partial write is not failed by the "
                               "shutdown of its connection)")
        return time.perf_counter() - t0

    # -- compute -----------------------------------------------------------------------------
    def build(self) -> float:
        """Pre-warm: imports, device context, model and optimizer built. Returns seconds."""
        t0 = time.perf_counter()
        if self.cfg.cluster.device == "cuda":
            import torch

            from megatron_engine import MegatronEngine as Engine, configure_host_allocator
            configure_host_allocator()
            if self.cfg.fault_tolerance.nccl_split_share:
                # NCCL reads it at its first communicator, so set before any. Aborting 17
                # communicators took 0.54 s with it and 1.02 s without (threaded; one after
                # another 0.53 vs 9.0 s): bench/results/gpu/abort_probe*_2026-11-30d.json.
                os.environ["NCCL_COMM_SPLIT_SHARE_RESOURCES"] = "1"
            torch.cuda.set_device(0)
        else:
            from torch_engine import TorchEngine as Engine
        self.engine = Engine(self.cfg)
        self.engine.fault_point = self.fault_point
        return time.perf_counter() - t0

    def snapshot_nbytes(self) -> int:
        """Bytes of this rank's rollback snapshot (Megatron engine; 0 when it keeps none)."""
        return self.engine.snapshot_nbytes()

    def reserve_host_memory(self, nbytes: int) -> None:
        """Spare: pin `nbytes` of host memory in the background for the rollback snapshot it
        will need once it joins; skipped, with a warning, when the host lacks the memory
        (`MegatronEngine.reserve_host_memory`)."""
        self.engine.reserve_host_memory(nbytes)

    def warm_up(self) -> float:
        """Spare (Megatron engine), before any failure: run a throwaway training step so the
        first step after it joins does not pay the process's one-time costs
        (`MegatronEngine.warm_up`). Returns seconds."""
        return self.engine.warm_up()

    def noop(self) -> bool:
        """A compute-thread call that returns at once: answers only if that thread is free."""
        return True

    def join(self, generation: int, rank: int, dims: ParallelDims, host: str, port: int,
             holder=None) -> dict[str, float]:
        """Join process-group generation `generation` as `rank` of `dims.world_size` through the
        driver's store at host:port (prefix `gen{generation}`); `holder`: the SnapshotHolder to
        send in-memory snapshots to (None: off). Returns seconds by part: `rendezvous_s` (until
        every member arrived), `process_group_s` (init_process_group), then the engine's
        `connect_phases` (Megatron: groups, model build, state copy) or `connect_s`."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        epoch = self._abort_epoch
        self.fault_point("during_recovery")
        self.engine.disconnect()
        if dist.is_initialized():  # a generation whose forming was cancelled by an abort
            abort_process_groups()
        self._gloo_sockets = {}
        cuda = self.cfg.cluster.device == "cuda"
        if cuda:
            close_open_nccl_groups()
        ft = self.cfg.fault_tolerance
        if self._store is None or self._store[0] != (host, port):
            self._store = ((host, port), dist.TCPStore(
                host, port, is_master=False, timeout=datetime.timedelta(seconds=ft.rendezvous_timeout_s)))
        store = dist.PrefixStore(f"gen{generation}", self._store[1])
        # Abortable barrier before the (uninterruptible) rendezvous inside init_process_group:
        # a member that never arrives must not strand the others in a blocking store wait.
        # A polling barrier on purpose: a `store.wait` that times out leaves a stale reply on the
        # client's socket (measured: the following init_process_group then stalls), so it cannot
        # be cut into abortable slices. Polling every 10 ms is cheap next to the rendezvous
        # (measured with 48 ranks: barrier release 0.04 s, gloo init 0.22 s).
        store.add("arrived", 1)
        deadline = time.monotonic() + ft.rendezvous_timeout_s
        while store.add("arrived", 0) < dims.world_size:
            if self._abort_epoch != epoch:
                raise StaleGenerationError(f"rank {rank}: generation {generation} aborted while forming")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: generation {generation} did not form within "
                                   f"fault_tolerance.rendezvous_timeout_s={ft.rendezvous_timeout_s} s")
            time.sleep(0.01)
        t1 = time.perf_counter()
        with recording_new_sockets(self._gloo_sockets) if not cuda else contextlib.nullcontext():
            dist.init_process_group("nccl" if cuda else "gloo", store=store,
                                    rank=rank, world_size=dims.world_size,
                                    timeout=datetime.timedelta(seconds=ft.step_timeout_s),
                                    device_id=torch.device("cuda", 0) if cuda and ft.nccl_eager_init else None)
        t2 = time.perf_counter()
        self.engine.connect(dims, rank)
        self.generation, self.rank, self.dims, self._holder = generation, rank, dims, holder
        connect = getattr(self.engine, "connect_phases", None) or {"connect_s": time.perf_counter() - t2}
        return {"rendezvous_s": t1 - t0, "process_group_s": t2 - t1, **connect}

    def _check(self, generation: int) -> None:
        if generation != self.generation:
            raise StaleGenerationError(
                f"rank {self.rank}: call for generation {generation}, actor is in {self.generation}")

    def train_step(self, generation: int, step: int, batch) -> dict:
        """Run train step `step` on this rank's part of the batch (see the engine). Snapshots
        the committed state (step - 1) to host memory first, for peer restore."""
        self._check(generation)
        self.engine.snapshot()
        self.fault_point("step_start")
        result = self.engine.train_step(batch, step)
        k = self.cfg.fault_tolerance.memory_snapshot_interval
        if self._holder is not None and step % k == 0:
            # The host copy is taken here (the next step changes the live tensors); sending it
            # to the holder runs in the background while training goes on. At most one send is
            # in flight: a send slower than k steps makes this step wait for it (bounded host
            # memory: one copy being sent, one being taken) instead of piling copies up; a send
            # stuck past health_timeout_s (holder unreachable) makes this step skip its snapshot.
            if self._send is not None:
                self._send.join(timeout=self.cfg.fault_tolerance.health_timeout_s)
            if self._send is None or not self._send.is_alive():
                state = to_wire(self.engine.host_state())
                holder, key = self._holder, (str(self.dims), self.rank)
                self._send = threading.Thread(target=lambda: ray.get(holder.put.remote(key, step, state)),
                                              daemon=True, name="snapshot-send")
                self._send.start()
        return result

    def restore_snapshot(self, generation: int, step: int, holders: list) -> bool:
        """Load this rank's in-memory snapshot of committed step `step` from the first of
        `holders` (SnapshotHolder handles) that has it. False when none has."""
        self._check(generation)
        key = (str(self.dims), self.rank)
        for holder in holders:
            state = ray.get(holder.get.remote(key, step))
            if state is not None:
                self.engine.load_state(from_wire(state))
                return True
        return False

    def generate(self, generation: int, step: int, prompts) -> dict:
        """RL rollout of step `step`: sample completions of this DP replica's prompt rows (a
        TrainingBatch of right-padded prompts, rows d, d+dp, ... of the global batch as
        `MeshDispatch` interleaves them) with the current policy. Reads the state, changes
        nothing; see `TorchEngine.generate` for the result."""
        self._check(generation)
        dp, d = self.dims.dp, self.dims.coords(self.rank).dp
        return self.engine.generate(prompts, step, list(range(d, d + len(prompts) * dp, dp)))

    def save_checkpoint(self, generation: int, step: int, async_save: bool = False) -> list | str | None:
        """Write this rank's shards of step `step`; returns the files written, or the message of
        a storage error (CheckpointError: storage down past the retry budget), which is not a
        failure of this rank. With `async_save` the state is snapshotted to host memory and
        written in the background: returns None; `finish_checkpoint` returns the files."""
        self._check(generation)
        self.fault_point("during_save")
        try:
            if not async_save:
                return self.engine.save_checkpoint(self.ckpt, step, self.dims, self.rank)
            self._pending_save = self.engine.save_checkpoint(self.ckpt, step, self.dims, self.rank, True)
        except CheckpointError as e:
            return str(e)
        return None

    def finish_checkpoint(self, generation: int) -> list | str:
        """Wait for the background write started by `save_checkpoint(async_save=True)`; returns
        its files, or the message of its storage error."""
        self._check(generation)
        futures, self._pending_save = self._pending_save or [], None
        try:
            return [f for future in futures for f in future.result()]
        except CheckpointError as e:
            return str(e)

    def verify_checkpoint(self, generation: int, manifest: Manifest, part: int, parts: int) -> list[str] | str:
        """Check part `part` of `parts` of the manifest's files (every `parts`-th file from
        `part`: sizes, sha256; the ranks share the reading). Returns the problems found, or the
        message of a storage error (storage down past the retry budget: not a bad checkpoint)."""
        self._check(generation)
        try:
            return self.ckpt.verify_files(manifest.step, manifest.files[part::parts])
        except CheckpointError as e:
            return str(e)

    def load_checkpoint(self, generation: int, manifest: Manifest) -> int:
        """Load this rank's state from a committed, verified checkpoint; returns its step."""
        self._check(generation)
        self.engine.load_checkpoint(self.ckpt, manifest, self.rank)
        return manifest.step

    def rollback(self, generation: int, step: int) -> bool:
        """Return to committed step `step` from local state (in-memory snapshot, or the initial
        state for step 0). False when this rank cannot (a spare that holds no trained state)."""
        self._check(generation)
        return self.engine.rollback(step)

    def broadcast_state(self, generation: int, src_rank: int, ranks: list[int] | None = None) -> None:
        """Collective over this rank's DP group: receive the training state of `src_rank`.
        `ranks` (CPU engine): only these members of the DP group take part (the source and the
        replaced ranks; survivors already hold the state), over a group made among them alone,
        so restore costs O(replaced ranks), not O(DP size)."""
        self._check(generation)
        engine = self.engine
        if ranks is None or self.cfg.model.engine != "torch":
            engine.broadcast_from(src_rank)
            return
        import torch.distributed as dist
        with recording_new_sockets(self._gloo_sockets):
            group = dist.new_group(sorted(ranks), use_local_synchronization=True)
        full, engine.dp_group = engine.dp_group, group
        try:
            engine.broadcast_from(src_rank)
        finally:
            engine.dp_group = full

    def state_digest(self) -> str:
        """SHA-256 over the model parameters (for tests: replicas must agree bitwise)."""
        import hashlib

        import torch
        h = hashlib.sha256()
        for name, p in sorted(self.engine.model.state_dict().items()):
            if not torch.is_tensor(p):  # Megatron modules hold `_extra_state` entries
                continue
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


@dataclass
class ActorSlot:
    """A placed actor and where it runs. `device` is (node IP, GPU id) on GPU machines and
    (node IP, bundle index) on CPU, the unit that must not hold two ranks of one group."""
    handle: object
    node_ip: str
    node_id: str
    gpu_ids: list
    bundle_index: int

    @property
    def device(self) -> tuple:
        return (self.node_id, self.gpu_ids[0] if self.gpu_ids else f"b{self.bundle_index}")


class WorkerFailure(RuntimeError):
    """Ranks of the current generation failed. `ranks`: failed global ranks; `kind`:
    'crash' (actor died), 'hang' (deadline passed without progress) or 'exception'."""

    def __init__(self, ranks: set[int], kind: str, detail: str = ""):
        super().__init__(f"{kind} of rank(s) {sorted(ranks)}: {detail}")
        self.ranks, self.kind, self.detail = set(ranks), kind, detail
        self.detected_at = time.time()


def _device_order(slots: list[ActorSlot]) -> list[ActorSlot]:
    """Slots of one node, one per device round-robin (first slot of every device, then the
    second, ...), so workers taken from the front never share a device while one is free."""
    by_device: dict[tuple, list[ActorSlot]] = {}
    for s in sorted(slots, key=lambda s: (s.device[1] if s.gpu_ids else 0, s.bundle_index)):
        by_device.setdefault(s.device, []).append(s)
    rounds = max(len(v) for v in by_device.values())
    return [v[i] for i in range(rounds) for v in by_device.values() if i < len(v)]


def _slot_key(s: ActorSlot) -> tuple:
    return (s.node_ip, s.node_id, s.device[1] if s.gpu_ids else 0, s.bundle_index)


def assign_roles(slots: list[ActorSlot], num_workers: int) -> tuple[list[ActorSlot], list[ActorSlot]]:
    """Split placed actors into workers (index = rank) and spares, spreading spares over nodes
    (failure domains).

    Losing node n loses its w_n workers and its s_n spares; the spares left elsewhere cover its
    ranks when S - s_n >= w_n, i.e. when the pool S is at least the node's slot count. Given
    that, the split maximises the pool left after the worst node loss: spares are handed out one
    at a time to the node holding the fewest so far (ties: the node with more slots, then the
    later node), never leaving a node more workers than devices while free devices exist.
    Within a node, workers take one slot per device round-robin, so no two ranks share a GPU
    while there are free GPUs. Ranks follow (node IP, node id, GPU id, bundle index): Ray does
    not return bundles in node order, and tp neighbours share a node.
    `placement_report(workers, spares)` explains the result, one line per node.
    """
    if not 0 <= num_workers <= len(slots):
        raise ValueError(f"{num_workers} workers asked for {len(slots)} placed actors")
    nodes: dict[str, list[ActorSlot]] = {}
    for s in sorted(slots, key=_slot_key):
        nodes.setdefault(s.node_id, []).append(s)
    ordered = {n: _device_order(v) for n, v in nodes.items()}
    devices = {n: len({s.device for s in v}) for n, v in nodes.items()}
    spares_on = {n: max(0, len(v) - devices[n]) for n, v in nodes.items()}  # workers <= devices
    num_spares = len(slots) - num_workers
    while sum(spares_on.values()) > num_spares:  # too few slots for one worker per device
        n = max((n for n in nodes if spares_on[n]), key=lambda n: (spares_on[n], list(nodes).index(n)))
        spares_on[n] -= 1
    order = list(nodes)
    while sum(spares_on.values()) < num_spares:
        n = min((n for n in nodes if spares_on[n] < len(nodes[n])),
                key=lambda n: (spares_on[n], -len(nodes[n]), -order.index(n)))
        spares_on[n] += 1
    workers, spares = [], []
    for n, v in ordered.items():
        k = len(v) - spares_on[n]
        workers += v[:k]
        spares += v[k:]
    return sorted(workers, key=_slot_key), spares


def placement_report(workers: list[ActorSlot], spares: list[ActorSlot]) -> list[str]:
    """One line per node: its workers and spares, and whether the spares on other nodes cover
    its ranks if the node is lost (the failure-domain rule of `assign_roles`)."""
    nodes: dict[str, list[int]] = {}
    for s in workers:
        nodes.setdefault(s.node_id, [0, 0])[0] += 1
    for s in spares:
        nodes.setdefault(s.node_id, [0, 0])[1] += 1
    ip = {s.node_id: s.node_ip for s in workers + spares}
    lines = []
    for n, (w, sp) in nodes.items():
        elsewhere = len(spares) - sp
        verdict = (f"covered by the {elsewhere} spare(s) on other nodes" if elsewhere >= w else
                   f"NOT covered: {elsewhere} spare(s) on other nodes < {w} ranks (pool of {len(spares)} "
                   f"< {w + sp} slots of this node; raise cluster.num_spares or fault_tolerance.min_dp)")
        lines.append(f"node {n[:8]} ({ip[n]}): {w} worker(s), {sp} spare(s); if lost, its ranks are {verdict}")
    return lines


class MegatronActorGroup:
    """All actors of a run: workers indexed by rank plus the pool of pre-warmed spares.

    Creates one placement group of (num_workers + num_spares) bundles, one actor per bundle,
    sorts them by (node, GPU), builds every engine (workers and spares alike), hosts the
    rendezvous store and forms generation 1. Raises RuntimeError with the resources needed
    when the cluster cannot place the bundles within `placement_timeout_s` seconds.
    """

    REFILL_ATTEMPTS = 3  # starts of a spare on a freed bundle (one that dies, e.g. on a lost node, is retried)

    def __init__(self, cfg: Config, placement_timeout_s: float = 60.0):
        import torch.distributed as dist
        from fault_tolerance import BackupPool

        self.cfg, self.dims = cfg, cfg.dims
        preflight(cfg, ray.cluster_resources())  # before anything is placed or started
        c = cfg.cluster
        n = c.num_workers + c.num_spares
        bundle = {"CPU": c.cpus_per_actor}
        if c.device == "cuda":
            bundle["GPU"] = c.gpus_per_actor
        self.placement_group = placement_group([dict(bundle) for _ in range(n)],
                                               strategy="SPREAD" if c.num_nodes > 1 else "PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=placement_timeout_s)
        if not ready:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"cluster too small: {n} bundles of {bundle} (cluster.num_workers={c.num_workers} + "
                f"cluster.num_spares={c.num_spares}) could not be placed within {placement_timeout_s:.0f} s; "
                f"cluster has {ray.cluster_resources()}. Lower cluster.num_spares / cpus_per_actor / "
                f"gpus_per_actor or add nodes")
        self._refills: dict = {}  # build ObjectRef -> (handle, bundle index, attempt) of a spare being refilled
        self._raylets: dict[str, tuple[str, int]] = {}  # node id -> its raylet's (host, port)
        handles = [self._new_actor(i) for i in range(n)]
        infos = ray.get([h.info.remote() for h in handles])
        slots = [ActorSlot(h, i["node_ip"], i["node_id"], i["gpu_ids"], i["bundle_index"])
                 for h, i in zip(handles, infos)]
        self.workers, spares = assign_roles(slots, c.num_workers)
        self.placement_report = placement_report(self.workers, spares)
        for line in self.placement_report:
            log.info("placement: %s", line)
        self.build_s = max(ray.get([s.handle.build.remote() for s in slots]))
        self.pool = BackupPool(spares)
        self.store_host = ray.util.get_node_ip_address()
        # Port 0: the OS picks a free port at bind time (no probe-then-bind race with other
        # programs). One store serves every generation, so no port is ever re-bound.
        self.store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=cfg.fault_tolerance.step_timeout_s))
        self.store_port = self.store.port
        self.generation = 0
        # In-memory snapshots: one holder per node of the placement group; each rank sends its
        # copies to the holder of another node, so they outlive the rank's node.
        self.holders: dict[str, object] = {}
        if cfg.fault_tolerance.memory_snapshot_interval > 0:
            # In a bundle of the placement group on that node: reserved, so the holder is where
            # its key says (a soft node affinity fell back to another node for a node just added,
            # and a rank's copies then sat on the rank's own node). Keyed by the node it runs on.
            bundles = {s.node_id: s.bundle_index for s in sorted(slots, key=lambda s: -s.bundle_index)}
            handles = [SnapshotHolder.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, bundles[node])).remote() for node in sorted(bundles)]
            self.holders = dict(zip(ray.get([h.node_id.remote() for h in handles]), handles))
        self.form_generation()
        self.snapshot_nbytes = 0
        if c.device == "cuda":
            self.snapshot_nbytes = max(ray.get([s.handle.snapshot_nbytes.remote() for s in self.workers]))
        self._prepare(self.pool.spares)

    def _prepare(self, spares: list) -> None:
        """GPU spares, in the background: pin the rollback snapshot memory (Megatron without the
        distributed optimizer keeps one per rank; the largest rank's size) and run a warm-up
        step, so neither slows the first steps after a recovery (pinning holds a CUDA driver
        lock the step's kernel launches wait on: bench/results/gpu/first_step_probe_*). CPU
        spares need neither (a fresh torch engine's first step is as fast as its next ones)."""
        if self.cfg.cluster.device != "cuda":
            return
        for s in spares:
            if self.snapshot_nbytes:
                s.handle.reserve_host_memory.remote(self.snapshot_nbytes)
            s.handle.warm_up.remote()

    @property
    def handles(self) -> list:
        return [s.handle for s in self.workers]

    def describe(self) -> list[str]:
        """One line per rank and spare: where it runs (for logs and --dry-run)."""
        lines = [f"rank {r} {self.dims.coords(r)} on node {s.node_id[:8]} ({s.node_ip}) device {s.device[1]}"
                 for r, s in enumerate(self.workers)]
        return lines + [f"spare on node {s.node_id[:8]} ({s.node_ip}) device {s.device[1]}"
                        for s in self.pool.spares]

    def form_generation(self) -> dict[str, float]:
        """Start the next membership generation: every worker joins new process groups.
        Returns the slowest rank's seconds for each part of its join (`MegatronActor.join`).
        Raises WorkerFailure if a member dies while joining."""
        self.generation += 1
        refs = [s.handle.join.remote(self.generation, r, self.dims, self.store_host, self.store_port,
                                     self.holder_for(s.node_id))
                for r, s in enumerate(self.workers)]
        parts = self.wait(refs, self.cfg.fault_tolerance.step_timeout_s)
        return slowest(parts)

    def holder_for(self, node_id: str):
        """The SnapshotHolder a rank on `node_id` sends its snapshots to: the next node's in
        sorted order (its own node's only when there is one node); None when snapshots are off."""
        if not self.holders:
            return None
        nodes = sorted(self.holders)
        return self.holders[nodes[(nodes.index(node_id) + 1) % len(nodes)] if node_id in nodes else nodes[0]]

    def held_snapshots(self) -> dict[tuple, set[int]]:
        """(layout, rank) -> steps held by some live holder. Holders that died (with their
        node) are forgotten; one that does not answer within health_timeout_s is skipped."""
        held: dict[tuple, set[int]] = {}
        refs = {node: holder.steps.remote() for node, holder in self.holders.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.cfg.fault_tolerance.health_timeout_s)
        for node, ref in refs.items():
            try:
                steps = ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                del self.holders[node]
                continue
            except ray.exceptions.GetTimeoutError:
                continue
            for key, s in steps.items():
                held.setdefault(tuple(key), set()).update(s)
        return held

    def call(self, method: str, *args, dispatch: str = "pass_through", timeout: float | None = None):
        """Call `method(generation, *args)` on every worker as the named dispatch splits it, wait
        with a deadline, and return the dispatch's collected results. Raises WorkerFailure."""
        kind = get_dispatch_type(dispatch)
        refs = dispatch_remote(self.handles, method, self.dims, kind, self.generation, *args)
        results = self.wait(refs, timeout or self.cfg.fault_tolerance.step_timeout_s)
        return kind.collect(self.dims, results)

    def wait(self, refs: list, timeout: float, ranks: list[int] | None = None) -> list:
        """Results of `refs` (one per rank, or one per rank of `ranks`), or WorkerFailure naming
        the failed ranks.

        A rank whose actor died is a 'crash'; a rank whose call raised while no actor died is an
        'exception'. While waiting, progress counters are polled every `health_interval_s`; the
        deadline is at least `timeout` seconds after the last poll that saw any counter move
        (slow is not dead). When it passes without progress: every rank's
        communicators are aborted, which frees ranks blocked in a collective; ranks whose compute
        thread still does not answer are the hung ones ('hang'; an empty set means the
        collective itself stalled and every rank was freed).
        """
        ft = self.cfg.fault_tolerance
        rank_of = list(ranks) if ranks is not None else list(range(len(refs)))
        index = {r.hex(): i for i, r in enumerate(refs)}
        results: list = [None] * len(refs)
        pending, deadline = list(refs), time.monotonic() + timeout
        progress: dict[int, int] = {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=max(0.0, min(ft.health_interval_s, deadline - time.monotonic())))
            if done:
                i = index[done[0].hex()]
                try:
                    results[i] = ray.get(done[0])
                except ray.exceptions.RayActorError as e:
                    # No ping round, and only this rank's node is checked (a lost node takes all
                    # its ranks): the abort that follows calls every other rank anyway and
                    # replaces those that died too (`fault_tolerance._abort_and_kill`).
                    lost = self.on_lost_nodes({self.workers[rank_of[i]].node_id})
                    raise WorkerFailure({rank_of[i]} | lost, "crash", str(e)[:300]) from None
                except ray.exceptions.RayTaskError as e:
                    dead = self.probe()
                    if dead:
                        raise WorkerFailure(dead, "crash", "actor(s) died") from None
                    if not isinstance(e.cause, (TimeoutError, StaleGenerationError)):
                        log.debug("rank %d raised: %s", rank_of[i], e)
                        raise WorkerFailure({rank_of[i]}, "exception",
                                            f"rank {rank_of[i]}: {type(e.cause).__name__}: {str(e.cause)[:500]}") from None
                    # This rank gave up waiting for a peer: judge the ranks still pending soon.
                    results[i] = e
                    deadline = min(deadline, time.monotonic() + self.cfg.fault_tolerance.health_timeout_s)
                continue
            now = self._progress()
            if any(now[r] > progress.get(r, -1) for r in now):  # moved since the last poll
                progress, deadline = now, max(deadline, time.monotonic() + timeout)
            if time.monotonic() < deadline:
                continue
            raise self._hang_failure({rank_of[index[r.hex()]] for r in pending}, timeout)
        gave_up = [rank_of[i] for i, r in enumerate(results) if isinstance(r, ray.exceptions.RayTaskError)]
        if gave_up:  # everyone arrived late but did arrive: a transient; re-form without blame
            raise WorkerFailure(set(), "exception", f"rank(s) {gave_up} timed out waiting for peers")
        return results

    def _progress(self, key: str = "progress") -> dict[int, int]:
        """rank -> progress counter (`progress`: monotonic; `step_progress`: within the current
        step), for ranks that answer a control ping in time."""
        refs = {r: s.handle.ping.remote() for r, s in enumerate(self.workers)}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                            timeout=self.cfg.fault_tolerance.health_timeout_s)
        out = {}
        for r, ref in refs.items():
            if ref in ready:
                try:
                    out[r] = ray.get(ref)[key]
                except ray.exceptions.RayError:
                    pass
        return out

    def _hang_failure(self, pending: set[int], timeout: float) -> WorkerFailure:
        """Name the hung ranks of a call that made no progress. Ranks whose progress counter lags
        the others are stuck before a collective their peers wait in: those are hung. With no
        laggard, every rank is aborted (freeing ranks blocked in a collective, as NCCL does) and
        the ranks whose compute thread still does not answer are hung."""
        dead = self.probe()
        if dead:
            return WorkerFailure(dead, "crash", "actor(s) died")
        why = f"no progress for {timeout:.1f} s on rank(s) {sorted(pending)}"
        progress = self._progress("step_progress")
        top = max(progress.values(), default=0)
        lagging = {r for r in pending if progress.get(r, -1) < top}
        if lagging:
            return WorkerFailure(lagging, "hang", f"{why}; progress {progress}")
        ray.wait([s.handle.abort.remote() for s in self.workers], num_returns=len(self.workers),
                 timeout=self.cfg.fault_tolerance.health_timeout_s)
        refs = [s.handle.noop.remote() for s in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.fault_tolerance.health_timeout_s)
        stuck = {r for r, ref in enumerate(refs) if ref not in ready}
        return WorkerFailure(stuck, "hang", f"{why}; compute thread still stuck after abort on {sorted(stuck)}")

    def probe(self) -> set[int]:
        """Ranks whose actor is dead or does not answer a control-group ping within
        `fault_tolerance.health_timeout_s` seconds. An actor that is temporarily unreachable
        (`ActorUnavailableError`, e.g. its node's agent restarting) is retried until then and
        not reported if it answers; one still unreachable then is (its node is likely gone:
        Ray marks a lost node dead only after ~15 s, measured with `Cluster.remove_node`).

        Lost nodes are found sooner: when a node's raylet refuses connections
        (`refuses_connections`), its process is gone, and with it every actor of that node
        (Ray's workers exit when their raylet dies; until then they may still answer pings).
        Every rank on that node is then dead at once, without waiting for the timeout:
        measured with `Cluster.remove_node` at N=8 (bench/scale.py), the node's ranks were
        otherwise found one after 10 s (health_timeout_s) and the other only when its abort
        call failed 1.5 s later. Caveat (not tested here): a firewall that rejects, rather than
        drops, connections from the driver's node to a raylet port would make that node look lost."""
        ft = self.cfg.fault_tolerance
        deadline = time.monotonic() + ft.health_timeout_s
        dead = self.on_lost_nodes()
        todo = set(range(len(self.workers))) - dead
        while todo:
            refs = {r: self.workers[r].handle.ping.remote() for r in todo}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                                timeout=max(0.0, deadline - time.monotonic()))
            retry = set()
            for r, ref in refs.items():
                if ref not in ready:
                    dead.add(r)
                    continue
                try:
                    ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    retry.add(r)
                except ray.exceptions.RayActorError:
                    dead.add(r)
            lost = self._lost_nodes({self.workers[r].node_id for r in retry})
            dead |= {r for r in retry if self.workers[r].node_id in lost}
            retry -= dead
            if retry and time.monotonic() >= deadline:
                dead |= retry  # still unreachable after health_timeout_s: not a transient
                break
            if retry:
                time.sleep(min(0.1, ft.health_interval_s))
            todo = retry
        return dead

    def on_lost_nodes(self, node_ids: set[str] | None = None) -> set[int]:
        """Ranks on a node (of `node_ids`; default: every worker's) whose raylet refuses
        connections (`_lost_nodes`): dead, no ping needed."""
        lost = self._lost_nodes({s.node_id for s in self.workers} if node_ids is None else node_ids)
        return {r for r, s in enumerate(self.workers) if s.node_id in lost}

    def _lost_nodes(self, node_ids: set[str]) -> set[str]:
        """Those of `node_ids` whose raylet refuses connections (its address from `ray.nodes()`,
        cached), or that Ray no longer lists as alive. The nodes are tried in parallel (32
        threads): one that does not answer costs 0.5 s, not 0.5 s per node."""
        if not node_ids:
            return set()
        if not node_ids <= self._raylets.keys():
            self._raylets.update({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"])
                                  for n in ray.nodes() if n["Alive"]})
        known = [n for n in node_ids if n in self._raylets]
        with concurrent.futures.ThreadPoolExecutor(min(32, len(known) or 1)) as pool:
            refused = pool.map(refuses_connections, [self._raylets[n] for n in known])
        return (node_ids - set(known)) | {n for n, r in zip(known, refused) if r}

    def _new_actor(self, bundle_index: int):
        c = self.cfg.cluster
        return MegatronActor.options(
            num_cpus=c.cpus_per_actor, num_gpus=c.gpus_per_actor if c.device == "cuda" else 0,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, bundle_index),
        ).remote(self.cfg, bundle_index)

    def refill(self, bundle_indices: list[int], attempt: int = 1) -> None:
        """Start new spares on the bundles of killed actors, in the background: Ray places each
        when its bundle is free again (on the same node, or re-placed after a node loss)."""
        for i in bundle_indices:
            handle = self._new_actor(i)
            self._refills[handle.build.remote()] = (handle, i, attempt)

    def poll_refills(self) -> int:
        """Move refilled spares whose model is built into the pool (non-blocking); returns how many."""
        if not self._refills:
            return 0
        ready, _ = ray.wait(list(self._refills), num_returns=len(self._refills), timeout=0)
        added = 0
        for ref in ready:
            handle, bundle, attempt = self._refills.pop(ref)
            try:
                ray.get(ref)
                i = ray.get(handle.info.remote(), timeout=self.cfg.fault_tolerance.health_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as e:
                # E.g. placed on a lost node before Ray marked it dead (~15 s): Ray re-places
                # the bundle on a live node once it has room, so try again there.
                again = attempt < self.REFILL_ATTEMPTS
                log.warning("refill spare on bundle %d failed (attempt %d of %d%s): %s", bundle, attempt,
                            self.REFILL_ATTEMPTS, ", retrying" if again else "", str(e)[:200])
                if again:
                    ray.kill(handle, no_restart=True)
                    self.refill([bundle], attempt + 1)
                continue
            self.pool.spares.append(ActorSlot(handle, i["node_ip"], i["node_id"], i["gpu_ids"], i["bundle_index"]))
            self._prepare(self.pool.spares[-1:])
            added += 1
        if added:
            log.info("spare pool refilled: %d spare(s) now", len(self.pool))
        return added

    def prune_pool(self) -> None:
        """Drop spares that are dead (e.g. lost with their node) from the pool, and start
        replacements on their bundles in the background (`fault_tolerance.refill_spares`).
        Spares on a node whose raylet refuses connections are dead without a ping (`probe`):
        their pings could otherwise keep the recovery waiting until the workers exit (replace
        1.7-1.9 s at N=32 and 64 in bench/scale.py's node rows)."""
        lost = self._lost_nodes({s.node_id for s in self.pool.spares})
        candidates = [s for s in self.pool.spares if s.node_id not in lost]
        refs = [s.handle.ping.remote() for s in candidates]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.fault_tolerance.health_timeout_s)
        alive = []
        for s, ref in zip(candidates, refs):
            try:
                if ref in ready:
                    ray.get(ref)
                    alive.append(s)
            except ray.exceptions.RayActorError:
                pass
        dead = [s for s in self.pool.spares if not any(s is a for a in alive)]
        self.pool.spares = alive
        if dead and self.cfg.fault_tolerance.refill_spares:
            for s in dead:
                ray.kill(s.handle, no_restart=True)  # an unanswering one may still hold its bundle
            self.refill([s.bundle_index for s in dead])

    def kill_node_of(self, rank: int) -> list[int]:
        """Fault injection: kill every actor (workers and spares) on the node of `rank`, as a
        node loss looks to the control plane. Returns the worker ranks killed."""
        node = self.workers[rank].node_id
        ranks = [r for r, s in enumerate(self.workers) if s.node_id == node]
        for s in self.workers + self.pool.spares:
            if s.node_id == node:
                ray.kill(s.handle, no_restart=True)
        return ranks

    def shrink(self, failed: set[int]) -> None:
        """Drop every DP replica holding a failed rank (used when no spare is left). Living
        members of dropped replicas become spares. The global batch is unchanged: each replica
        gets a larger share, so more micro-batches accumulate. Raises ValueError when the batch
        sizes do not divide by the smaller dp; the caller turns that into a RecoveryError."""
        from parallel_dims import RankCoords

        old, t = self.dims, self.cfg.train
        lost = sorted({old.coords(r).dp for r in failed})
        kept = [d for d in range(old.dp) if d not in lost]
        new = ParallelDims(tp=old.tp, pp=old.pp, cp=old.cp, dp=len(kept))
        if not kept or t.mini_batch_size % new.dp or (t.mini_batch_size // new.dp) % t.micro_batch_size:
            raise ValueError(f"cannot shrink to dp={new.dp}: train.mini_batch_size={t.mini_batch_size} "
                             f"must split into micro-batches of {t.micro_batch_size} over {new.dp} replicas")
        workers: list = [None] * new.world_size
        for r, s in enumerate(self.workers):
            c = old.coords(r)
            if c.dp in lost:
                if r not in failed:
                    self.pool.spares.append(s)
            else:
                workers[new.rank_of(RankCoords(tp=c.tp, cp=c.cp, dp=kept.index(c.dp), pp=c.pp))] = s
        log.warning("no spare left: shrinking dp %d -> %d (replicas %s dropped)", old.dp, new.dp, lost)
        self.workers, self.dims = workers, new

    def shutdown(self) -> None:
        """Kill every actor (spares and refills too) and release the placement group."""
        for s in self.workers + self.pool.spares:
            ray.kill(s.handle, no_restart=True)
        for handle in [*(h for h, _, _ in self._refills.values()), *self.holders.values()]:
            ray.kill(handle, no_restart=True)
        remove_placement_group(self.placement_group)
