"""`MegatronActor`: the Ray actor of one rank (or of one pre-warmed spare). It drives an engine
(`engine.Engine`: `TorchEngine` on CPU, `MegatronEngine` on GPU) through one membership
generation after another; the driver's `ftrain.control.actor_group.ActorGroup` creates and calls it
(`ActorGroup(MegatronActor, cfg)`), each call split over the ranks as the method declares
(`dispatch.register`).

Control plane vs data plane: compute methods (`build`, `join`, `train_step`, checkpoint and
restore) run on the actor's default thread and may block inside a collective; control methods
(`info`, `ping`, `abort`, `arm_fault`) run in the separate `control` concurrency group, so the
driver can reach an actor whose compute thread is stuck.

Process groups come from a `TCPStore` hosted by the driver (losing rank 0 does not lose the
store) with a fresh `PrefixStore` prefix per membership generation, so keys and ports of an
aborted generation are never reused. Every compute call carries the generation it belongs to;
an actor refuses calls of another generation (`StaleGenerationError`), and the driver discards
results of an aborted generation even when no error came (an aborted NCCL collective returns).
"""
from __future__ import annotations

import concurrent.futures
import datetime
import faulthandler
import logging
import os
import signal
import threading
import time

import ray

from checkpoint import CheckpointManager
from dispatch import register
from ftrain.config import CHAOS_KINDS, CHAOS_POINTS, Config
from ftrain.control.device_probe import wait_for_exit
from ftrain.control.lifecycle import ABORTED, JOINING, SPARE, WARM, WARMING, Lifecycle
from ftrain.control.rendezvous import arrive, release, wait_formed
from ftrain.distributed.comms import collective_counts, use_node_interface
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.failures import InjectedFault, StaleGenerationError
from ftrain.state.checkpoint_io import io_progress
from ftrain.state.host_memory import SharedArena, process_gone
from ftrain.state.keeper import (MAPPED_AHEAD, LocalMaps, ShardSender, keeps_locally, keeps_shards, load_adopted_shard,
                                 load_local, local_key, shard_key)
from ftrain.state.manifest import CheckpointError, CheckpointMismatch, Manifest
from ftrain.state.snapshots import SnapshotSender, from_wire

log = logging.getLogger(__name__)
CONTROL = "control"
FAULT_KINDS = tuple(k for k in CHAOS_KINDS if k != "node")  # node loss is done by the driver


@ray.remote(concurrency_groups={CONTROL: 4})
class MegatronActor:
    """One rank (or one pre-warmed spare). Engine: `TorchEngine` (CPU, gloo) or the Megatron
    engine (GPU, NCCL), chosen by the resolved `model.engine`."""

    def __init__(self, cfg: Config, bundle_index: int):
        self.cfg, self.bundle_index = cfg, bundle_index
        self.engine = None
        self.generation: int | None = None
        self.life = Lifecycle()           # spare, warming, joining, member of a generation, aborted
        self.joined = 0                   # highest generation joined: lower ones are a superseded driver's
        self.rank: int | None = None
        self.dims: ParallelDims | None = None
        self.ckpt = CheckpointManager.from_config(cfg.checkpoint)
        self.faults: dict[str, str] = {}  # point -> kind, armed by arm_fault
        self._abort_epoch = 0             # bumped by abort(): cancels a join in progress
        self._store = None                # ((host, port), TCPStore client of the driver's store)
        self._control_store = None        # ((host, port), a second client, for `abort` during a join)
        self._joining = None              # (generation, host, port) while join waits for its members
        self._pending_save = None         # futures of an async checkpoint write
        self._holder = None               # SnapshotHolder this rank sends its snapshots to
        answer_s = cfg.fault_tolerance.health_timeout_s  # for every holder call (a part of a send too)
        self._sender = SnapshotSender(answer_s)
        self._shards = ShardSender(answer_s)  # sends this rank's optimizer shard to its keeper (keeper.py)
        self._keeper = None               # the holder keeping it (None: not kept)
        self._local_maps = LocalMaps(answer_s)  # a spare's mappings of its node's kept arenas (keeper.py)
        self.rows = None                  # rank_rows.RankRows: this rank reads its own rows (ce)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        use_node_interface(ray.util.get_node_ip_address())  # before any process group is made
        self._last_ping, self._pinged = time.monotonic(), False
        if cfg.fault_tolerance.driver_failover:  # detached: gone with no driver for too long
            threading.Thread(target=self._driver_watchdog, name="driver-watchdog", daemon=True).start()

    def _driver_watchdog(self) -> None:
        """With driver_failover: once no driver has pinged this actor for
        `driver_failover_timeout_s`, remove the run's placement group (every actor of the run in
        it goes too, so no GPU stays reserved) and exit (`driver_failover.py`). An actor no
        driver ever pinged exits alone: e.g. a spare still being built when its driver died is
        in no record, so the driver that reattached to the run never pings it, and its silence
        says nothing about that run."""
        timeout = self.cfg.fault_tolerance.driver_failover_timeout_s
        while time.monotonic() - self._last_ping < timeout:
            time.sleep(min(1.0, timeout / 4))
        if self._pinged:
            from ftrain.control.driver_failover import remove
            remove([])
        os._exit(0)

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
        """Liveness + progress, answered even while the compute thread is in a collective:
        `collectives` counts the collectives entered per process group (`collective_counts`),
        which names the rank a stuck collective waits for. Also feeds the driver watchdog
        (`_driver_watchdog`)."""
        self._last_ping, self._pinged = time.monotonic(), True
        e = self.engine
        return {"generation": self.generation, "rank": self.rank, "state": self.life.state,
                "progress": e.progress if e else 0,
                "step_progress": e.progress - e.step_start_progress if e else 0,
                "io_progress": io_progress(),  # a slow save / verify / load is not a hang
                "step": self.engine.step if self.engine else 0,
                "collectives": collective_counts()}

    @ray.method(concurrency_group=CONTROL)
    def arm_fault(self, kind: str, point: str) -> None:
        """Fault injection: `kind` in FAULT_KINDS fires when the compute thread reaches `point`
        (CHAOS_POINTS). Raises ValueError for unknown kinds or points."""
        if kind not in FAULT_KINDS or point not in CHAOS_POINTS:
            raise ValueError(f"fault {kind!r} at {point!r}: kinds {FAULT_KINDS}, points {CHAOS_POINTS}")
        self.faults[point] = kind

    @ray.method(concurrency_group=CONTROL)
    def abort(self, generation: int) -> float:
        """Leave the current generation and abort (not destroy) the engine's communicators,
        which frees a compute thread stuck in a collective whose peer died (`Engine.abort`).
        `generation`: the caller's current generation. Returns seconds taken. Raises
        StaleGenerationError, aborting nothing, when the actor has joined a later driver's
        generation (`run_lease`), and RuntimeError when the compute thread is still inside a
        collective `health_timeout_s / 2` seconds later: the caller must replace this actor."""
        t0 = time.perf_counter()
        self._check_driver(generation)
        self.life.move(ABORTED)
        self.generation = None
        self._abort_epoch += 1
        if (joining := self._joining) is not None:  # free every member waiting in this generation's barrier
            g, host, port = joining
            release(self._control_store_client(host, port), f"gen{g}")
        if self.engine is not None:
            grace = self.cfg.fault_tolerance.health_timeout_s / 2
            # An abort that does not return gets this actor replaced; leave the stacks of every
            # thread in its log so the cause can be read afterwards.
            faulthandler.dump_traceback_later(grace)
            try:
                self.engine.abort(grace)
            except RuntimeError as e:
                raise RuntimeError(f"rank {self.rank}: {e}") from None
            finally:
                faulthandler.cancel_dump_traceback_later()
        return time.perf_counter() - t0

    # -- compute -----------------------------------------------------------------------------
    def build(self, data=None) -> float:
        """Pre-warm: imports, device context, model and optimizer built; on GPU also the
        process's one-time costs of a first step and a first save (`Engine.warm_up`), so that
        neither the first steps nor the first checkpoint save of a worker or of a replacement
        pays them. `data`: the run's `data.Data` when ranks read their own rows
        (`train.objective=ce`), opened here (its files mapped and opened, its windows built) as
        Ray hands it over, spares included, so a replacement's first step does not pay for it.
        Returns seconds."""
        t0 = time.perf_counter()
        if data is not None:
            from ftrain.data.rank_rows import RankRows
            self.rows = RankRows(data)
        if self.cfg.model.engine == "megatron":
            from ftrain.engines.megatron_engine import MegatronEngine as Engine
        else:
            from ftrain.engines.torch_engine import TorchEngine as Engine
        self.engine = Engine(self.cfg)
        self.engine.fault_point = self.fault_point
        if self.cfg.cluster.device == "cuda":
            self.engine.warm_up(CheckpointManager)
        self.life.move(SPARE)
        return time.perf_counter() - t0

    def host_nbytes(self) -> tuple[int, int]:
        """Bytes of this rank's rollback snapshot and of its async saves' host copy (0 when its
        engine keeps none: `Engine.snapshot_nbytes`, `Engine.save_nbytes`)."""
        return self.engine.snapshot_nbytes(), self.engine.save_nbytes()

    def prepare_spare(self, host_nbytes: tuple[int, int], host: str, port: int, local_holder=None) -> None:
        """Spare, before any failure: connect to the driver's store at host:port (the first
        connect may wait on a reverse-DNS lookup), reserve host memory for the rollback
        snapshot and the async saves' copy it will keep once it joins (`host_nbytes`, the
        largest rank's `host_nbytes`), and pay the process's one-time first-step costs,
        so none of these slows a recovery or its first steps (`Engine.reserve_host_memory`,
        `Engine.warm_up`, `CheckpointManager.warm_client`). `local_holder`: this node's
        holder of the local keeper's arenas, which the spare keeps mapped until it joins
        (`keeper.LocalMaps`), so that restoring a rank from one is a copy at bus speed."""
        self.life.move(WARMING)
        self._store_client(host, port)
        self.engine.reserve_host_memory(*host_nbytes)
        self.engine.warm_up(CheckpointManager)
        self.ckpt.warm_client()
        if local_holder is not None:  # last, in the background: only a faster restore waits on it
            self._local_maps.start(local_holder)
        self.life.move(WARM)

    @ray.method(concurrency_group=CONTROL)
    def probe(self) -> str | None:
        """Health probe of this actor's device (`device_probe.probe_device`): None when it is
        healthy, else the reason in one line."""
        import torch

        from ftrain.control.device_probe import probe_device

        # Ray's CUDA_VISIBLE_DEVICES leaves an actor its own GPU(s) only: device 0 is its own.
        return probe_device(torch.device("cuda", 0) if self.cfg.cluster.device == "cuda" else torch.device("cpu"))

    def noop(self) -> bool:
        """A compute-thread call that returns at once: answers only if that thread is free."""
        return True

    def join(self, generation: int, rank: int, dims: ParallelDims, host: str, port: int,
             holder=None, local_holder=None, exited: list[int] = ()) -> dict[str, float]:
        """Join process-group generation `generation` as `rank` of `dims.world_size` through the
        driver's store at host:port (prefix `gen{generation}`); `holder`: the SnapshotHolder to
        send in-memory snapshots to (None: off); `local_holder`: this node's, which keeps this
        rank's state at dp = 1 (the local keeper, keeper.py); `exited`: pids of failed ranks
        that ran on this actor's GPU, whose exit (their memory freed) is awaited before the
        process groups are made, at most `rendezvous_timeout_s / 2` (`exit_wait_s`,
        `device_probe.wait_for_exit`). Returns seconds by part: `rendezvous_s` (until
        every member arrived), then the engine's (`Engine.connect`: `process_group_s`, ...).
        Raises StaleGenerationError for a generation below one joined before (`run_lease`), or
        when an abort came during the join."""
        self._check_driver(generation)
        self.joined = generation
        self.life.move(JOINING)
        try:
            phases = self._join(generation, rank, dims, host, port, holder, local_holder, exited)
        except BaseException:
            self._local_maps.close()
            self.life.move(ABORTED)
            raise
        if not self.life.joined(generation):
            self.generation = None
            raise StaleGenerationError(f"rank {rank}: generation {generation} aborted while joining")
        return phases

    def _join(self, generation: int, rank: int, dims: ParallelDims, host: str, port: int, holder,
              local_holder, exited: list[int]) -> dict[str, float]:
        """The join itself (`join`): barrier, process groups, snapshot and keeper connections."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        epoch = self._abort_epoch
        self.fault_point("during_recovery")
        self.engine.disconnect()
        ft = self.cfg.fault_tolerance
        self._local_maps.stop()  # what is mapped now stays for this join's restore (`restore_local`)
        store = dist.PrefixStore(f"gen{generation}", self._store_client(host, port))
        # Abortable barrier before the rendezvous inside init_process_group (`rendezvous`).
        arrive(store, dims.world_size)
        self._joining = (generation, host, port)
        try:
            formed = epoch == self._abort_epoch and wait_formed(store, ft.rendezvous_timeout_s)
        except TimeoutError:
            self._store = None  # its socket holds the timed-out wait's stale reply
            raise TimeoutError(f"rank {rank}: generation {generation} did not form within "
                               f"fault_tolerance.rendezvous_timeout_s={ft.rendezvous_timeout_s} s") from None
        finally:
            self._joining = None
        if self._abort_epoch != epoch or not formed:
            raise StaleGenerationError(f"rank {rank}: generation {generation} aborted while forming")
        t1 = time.perf_counter()
        waited = {}
        if exited:
            waited["exit_wait_s"] = wait_for_exit(exited, ft.rendezvous_timeout_s / 2)
            if waited["exit_wait_s"] >= ft.rendezvous_timeout_s / 2:
                log.warning("rank %d: the failed rank process(es) %s on this GPU did not exit within %.1f s: "
                            "their memory may still be held", rank, exited, waited["exit_wait_s"])
        phases = {**waited, **self.engine.connect(store, dims, rank)}
        if holder is not None and self.cfg.fault_tolerance.memory_snapshot_interval:
            # Before the first snapshot step, in the background.
            self.engine.prepare_host_copy()
            self._sender.connect(holder)
        local = local_holder is not None and keeps_locally(ft.shard_keeper, dims.dp,
                                                           self.cfg.cluster.num_spares)
        self._keeper = local_holder if local else holder if keeps_shards(
            self.cfg.model.distributed_optimizer, ft.shard_keeper, dims.dp) else None
        if self._keeper is not None:
            self._shards.connect(self._keeper, whole=local)
            # Both arenas from the first steps on, not one at a time. Not the torch engine at step
            # 0: its optimizer state is made by the first update, and reading it sooner (DCP's
            # `_init_optim_state`: a zero-grad step) would change that update.
            if self.engine.step or self.cfg.model.engine == "megatron":
                self._shards.prepare(self.engine)
        else:
            self._shards.close()  # no shard kept in this layout: its courier and arenas go
        self.generation, self.rank, self.dims, self._holder = generation, rank, dims, holder
        return {"rendezvous_s": t1 - t0, **phases}

    def _store_client(self, host: str, port: int):
        """This actor's client of the driver's TCPStore at host:port, made on first use."""
        import torch.distributed as dist

        if self._store is None or self._store[0] != (host, port):
            timeout = datetime.timedelta(seconds=self.cfg.fault_tolerance.rendezvous_timeout_s)
            self._store = ((host, port), dist.TCPStore(host, port, is_master=False, timeout=timeout))
            self._control_store_client(host, port)
        return self._store[1]

    def _control_store_client(self, host: str, port: int):
        """A second client of the driver's store, for the control group (`abort`), made when
        the first is (`_store_client`): one client's socket must not be shared by two threads."""
        import torch.distributed as dist

        if self._control_store is None or self._control_store[0] != (host, port):
            timeout = datetime.timedelta(seconds=self.cfg.fault_tolerance.health_timeout_s)
            self._control_store = ((host, port), dist.TCPStore(host, port, is_master=False, timeout=timeout))
        return self._control_store[1]

    def _check_driver(self, generation: int) -> None:
        """Refuse a superseded driver: one whose generations lie below one this actor joined."""
        if generation < self.joined:
            raise StaleGenerationError(f"rank {self.rank}: generation {generation} is of a superseded driver; "
                                       f"this actor joined generation {self.joined}")

    def _check(self, generation: int) -> None:
        if generation != self.generation:
            raise StaleGenerationError(
                f"rank {self.rank}: call for generation {generation}, actor is in {self.generation}")

    @register("mesh")
    def train_step(self, generation: int, step: int, batch=None) -> dict:
        """Run train step `step` on this rank's part of the batch (see the engine); `batch`
        None: this rank reads its DP replica's rows itself (`RankRows.train_batch`; a row that
        cannot be read raises DataError) and the result carries their `row_digests`. Snapshots
        the committed state (step - 1) to host memory first, for peer restore. Every
        `memory_snapshot_interval` steps, starts the in-memory snapshot of step `step`: the
        engine's host copy overlaps the next step, the send to the holder runs in the
        background (`SnapshotSender`); skipped (counted, logged) while the previous one is in
        flight or the host buffers are not pinned yet. The result carries the sender's counts
        as `memory_snapshots` when snapshots are on. With the shard keeper (keeper.py) the
        optimizer shard of step `step` is then sent to its keeper, and the result carries
        `kept_shards` ({"sent", "skipped", "failed"}), `kept_step` (the newest step whose
        copy its keeper holds whole; None: none yet in this membership) and `kept_wait_s` (the
        seconds this step waited for the previous send to end: a send slower than a step)."""
        self._check(generation)
        self._local_maps.close()  # a spare's mappings of other ranks' arenas: no use once training
        self.engine.snapshot()
        self.fault_point("step_start")
        own = batch is None
        if own:
            batch = self.own_batch(step)
        result = self.engine.train_step(batch, step)
        if own:
            result["row_digests"] = self.rows.digests  # of the rows just trained, hashed where read
        interval = self.cfg.fault_tolerance.memory_snapshot_interval
        if self._holder is not None and interval and step % interval == 0:
            copy = None if self._sender.busy() else self.engine.start_host_copy()
            if copy is None:
                self._sender.skip(step)
            else:
                self._sender.send(self._holder, (str(self.dims), self.rank), step, copy,
                                  before_last_part=lambda: self.fault_point("mid_snapshot"),
                                  generation=self.generation)
            result["memory_snapshots"] = self._sender.counts()
        if self._keeper is not None:
            result["kept_shards"] = self._shards.after_step(self.engine, self._keeper, self._kept_key(), step,
                                                            self.generation)
            result["kept_step"], result["kept_wait_s"] = self._shards.kept_step, self._shards.last_wait_s
        return result

    def _kept_key(self) -> tuple:
        """The holder key of what this rank's keeper keeps (`keeper.local_key`, `shard_key`)."""
        if self._shards.whole:
            return local_key(str(self.dims), self.rank, ray.get_runtime_context().get_node_id())
        return shard_key(str(self.dims), self.rank)

    def own_batch(self, step: int):
        """This rank's rows of `step` with their loss weights (`RankRows.train_batch`: the rows
        of its DP replica in the current layout, read here). Raises DataError."""
        return self.rows.train_batch(step, self.dims, self.rank, self.cfg.train, self.engine.dp_sum)

    def restore_snapshot(self, generation: int, step: int, holders: list, shard: bool = False,
                         rewind: bool = False) -> bool:
        """Load this rank's in-memory snapshot of committed step `step` from the first of
        `holders` (SnapshotHolder handles) that has it; `shard`: only its optimizer shard, kept
        by its keeper (keeper.py), into a state that is already at `step`
        (`Engine.load_shard`), or with `rewind` into any state (`Engine.load_state`: the
        Megatron engine then takes its params from the shards, `sync_params`): a holder of this
        node that adopted it is read through a mapping of the arena
        (`keeper.load_adopted_shard`), the others send it. False when none has; a holder that
        is gone or does not answer within `health_timeout_s` (its copy: half of
        `step_timeout_s`) is skipped."""
        self._check(generation)
        ft = self.cfg.fault_tolerance
        key = shard_key(str(self.dims), self.rank) if shard else (str(self.dims), self.rank)
        node = ray.get_runtime_context().get_node_id()
        for holder in holders:
            try:
                if shard and ray.get(holder.node_id.remote(), timeout=ft.health_timeout_s) == node and \
                        load_adopted_shard(self.engine, holder, key, step, ft.health_timeout_s, rewind) is not None:
                    return True
                # Half the driver's deadline for this call: a holder stalled mid-copy leaves time for the next.
                state = ray.get(holder.get.remote(key, step), timeout=ft.step_timeout_s / 2)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
                log.warning("rank %d: snapshot holder did not serve step %d (%r): trying the next", self.rank, step,
                            exc)
                continue
            if state is not None:
                (self.engine.load_shard if shard and not rewind else self.engine.load_state)(from_wire(state))
                return True
        return False

    def restore_local(self, generation: int, step: int) -> dict | None:
        """Load this rank's state of committed step `step` from the arena its node's holder
        adopted (the local keeper, `keeper.load_local`); returns {"how": `keeper.MAPPED_AHEAD`
        (by this spare) or `MAPPED_NOW`, "taken_over", and seconds by part}, None when that
        holder has no complete copy of it (or this rank keeps none locally). A spare that had
        every arena of the replaced rank mapped ahead, whose process is gone, takes them over
        as its own (`ShardSender.take_over`: "taken_over" True); the other mappings go
        ("unmap_s")."""
        self._check(generation)
        got = None
        try:
            if not self._shards.whole:
                return None
            got = load_local(self.engine, self._keeper, self._kept_key(), step, self.cfg.fault_tolerance.health_timeout_s,
                             self._local_maps)
            if got is None:
                return None
            views = {i: self._local_maps.view(path) for i, path in got["arenas"].items()}
            got["taken_over"] = got["how"] == MAPPED_AHEAD and all(v is not None for v in views.values()) and \
                process_gone(got["owner"])  # a live owner may still write into them
            if got["taken_over"]:
                self._shards.take_over({i: SharedArena.reopen(got["arenas"][i], v) for i, v in views.items()},
                                       got["index"])
        finally:
            t0 = time.perf_counter()
            self._local_maps.close()
            if got is not None:
                got["unmap_s"] = time.perf_counter() - t0
        return {k: got[k] for k in ("how", "taken_over", "find_s", "load_s", "unmap_s")}

    @register("mesh")
    def generate(self, generation: int, step: int, prompts, stop_ids: tuple[int, ...], pad_id: int) -> dict:
        """RL rollout of step `step`: sample completions of this DP replica's prompt rows (a
        TrainingBatch of right-padded prompts, rows d, d+dp, ... of the global batch as
        `MeshDispatch` interleaves them) with the current policy, stopping at the task's
        `stop_ids`, padded with its `pad_id`. Reads the state, changes nothing; see
        `TorchEngine.generate` for the result."""
        self._check(generation)
        dp, d = self.dims.dp, self.dims.coords(self.rank).dp
        return self.engine.generate(prompts, step, list(range(d, d + len(prompts) * dp, dp)), stop_ids, pad_id)

    @register("pass_through")
    def save_checkpoint(self, generation: int, step: int, async_save: bool = False) -> list | str | dict:
        """Write this rank's shards of step `step`; returns the files written, or the message of
        a storage error (CheckpointError: storage down past the retry budget), which is not a
        failure of this rank. With `async_save` the state is snapshotted to host memory and
        written in the background: returns the seconds by part of this call
        (`Engine.save_phases`, and "end_abandoned_s": the wait for a save a recovery abandoned);
        `finish_checkpoint` returns the files."""
        self._check(generation)
        t0 = time.perf_counter()
        self._end_abandoned_save()
        waited = time.perf_counter() - t0
        self.fault_point("during_save")
        try:
            if not async_save:
                return self.engine.save_checkpoint(self.ckpt, step, self.dims, self.rank)
            self._pending_save = self.engine.save_checkpoint(self.ckpt, step, self.dims, self.rank, True)
        except CheckpointError as e:
            return str(e)
        return {**self.engine.save_phases, "end_abandoned_s": waited}

    def _end_abandoned_save(self) -> None:
        """An async save still pending here at the next save was abandoned by a recovery (the
        driver drops it and never asks `finish_checkpoint`): wait for its background write to
        end, so that it cannot write or upload into the files of a new save of the same step
        (which, at rank 0, also empties that step's directory first), and give its pinned
        arena back (`PendingSave.abandon`; the torch engine's write is a plain Future)."""
        pending, self._pending_save = self._pending_save or [], None
        for save in pending:
            if hasattr(save, "abandon"):
                save.abandon()
            else:
                concurrent.futures.wait([save])

    @register("pass_through")
    @ray.method(concurrency_group=CONTROL)
    def checkpoint_written(self, generation: int) -> bool:
        """Whether the background part of the async save in flight, if any, has ended (written,
        uploaded or failed), so that `finish_checkpoint` returns without waiting for it.
        Answered beside training (control group)."""
        self._check(generation)
        return all(f.done() for f in self._pending_save or [])

    @register("pass_through")
    def finish_checkpoint(self, generation: int) -> list | str:
        """Wait for the background write started by `save_checkpoint(async_save=True)`; returns
        its files, or the message of its storage error."""
        self._check(generation)
        futures, self._pending_save = self._pending_save or [], None
        try:
            files = [f for future in futures for f in future.result()]
        except CheckpointError as e:
            return str(e)
        self.fault_point("mid_save")  # written, not yet committed
        return files

    def verify_checkpoint(self, generation: int, manifest: Manifest) -> list[str] | str:
        """Check this rank's share of the manifest's files (`Manifest.share`: sizes, and sha256 where the engine does not hash while loading; the ranks share
        the reading). Returns the problems found, or the message of a storage error (storage
        down past the retry budget: not a bad checkpoint)."""
        self._check(generation)
        try:
            return self.ckpt.verify_files(manifest.step, manifest.share(self.rank, self.dims.world_size),
                                          hash_files=not self.engine.checks_while_loading)
        except CheckpointError as e:
            return str(e)

    @register("pass_through")
    def load_checkpoint(self, generation: int, manifest: Manifest) -> dict | str:
        """Load this rank's state from a committed, verified checkpoint; returns {"step": its
        step, "warnings": what the load noticed without stopping (keys only the checkpoint holds),
        for the driver to log}, or the message of the CheckpointMismatch that stopped the load (a
        key missing or of another shape): a bad checkpoint, not a failure of this rank; or
        {"storage": message} when storage failed past the retry budget (not a failure either)."""
        self._check(generation)
        self.ckpt.load_warnings.clear()
        try:
            self.engine.load_checkpoint(self.ckpt, manifest, self.rank)
        except CheckpointMismatch as e:
            return str(e)
        except CheckpointError as e:
            return {"storage": str(e)}
        return {"step": manifest.step, "warnings": list(self.ckpt.load_warnings)}

    @register("pass_through")
    def rollback(self, generation: int, step: int) -> bool:
        """Return to committed step `step` from local state (in-memory snapshot, or the initial
        state for step 0). False when this rank cannot (a spare that holds no trained state)."""
        self._check(generation)
        return self.engine.rollback(step)

    def sync_params(self, generation: int) -> None:
        """Collective over this rank's DP group: rebuild the params from the optimizer shards
        after a restore that set the shards only (`Engine.sync_params`)."""
        self._check(generation)
        self.engine.sync_params()

    def broadcast_state(self, generation: int, src_rank: int, ranks: list[int] | None = None) -> None:
        """Collective over this rank's DP group: receive the training state of `src_rank`.
        `ranks`: only these members take part (the source and the replaced ranks; survivors
        already hold the state), so restore costs O(replaced ranks) where the engine can form
        such a group (`Engine.broadcast_from`)."""
        self._check(generation)
        self.engine.broadcast_from(src_rank, ranks)

    def state_digest(self) -> str:
        """SHA-256 over this rank's training state: weights, optimizer state, schedule, step."""
        return self.engine.state_digest()
