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

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from checkpoint import CheckpointManager, FileEntry, Manifest
from config import Config
from dispatch import dispatch_remote, get_dispatch_type
from parallel_dims import ParallelDims

log = logging.getLogger(__name__)
CONTROL = "control"


class StaleGenerationError(RuntimeError):
    """A compute call belongs to a process-group generation this actor is no longer in."""


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
        self.ckpt = CheckpointManager(cfg.checkpoint.uri, cfg.checkpoint.keep_last)
        os.environ.setdefault("OMP_NUM_THREADS", "1")

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
        return {"generation": self.generation, "rank": self.rank,
                "progress": self.engine.progress if self.engine else 0,
                "step": self.engine.step if self.engine else 0}

    @ray.method(concurrency_group=CONTROL)
    def abort(self) -> float:
        """Abort (not destroy) this actor's communicators: non-blocking, and it frees a compute
        thread stuck in a collective whose peer died. Returns seconds taken."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _abort_process_group

        t0 = time.perf_counter()
        self.generation = None
        if dist.is_initialized():
            _abort_process_group()
        return time.perf_counter() - t0

    # -- compute -----------------------------------------------------------------------------
    def build(self) -> float:
        """Pre-warm: imports, device context, model and optimizer built. Returns seconds."""
        t0 = time.perf_counter()
        if self.cfg.cluster.device == "cuda":
            import torch
            torch.cuda.set_device(0)
            from megatron_engine import MegatronEngine as Engine
        else:
            from torch_engine import TorchEngine as Engine
        self.engine = Engine(self.cfg)
        return time.perf_counter() - t0

    def join(self, generation: int, rank: int, dims: ParallelDims, host: str, port: int) -> float:
        """Join process-group generation `generation` as `rank` of `dims.world_size` through the
        driver's store at host:port (prefix `gen{generation}`). Returns seconds."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        self.engine.disconnect()
        if dist.is_initialized():  # only after a clean shutdown; a failure path aborted it
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=self.cfg.fault_tolerance.step_timeout_s)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        cuda = self.cfg.cluster.device == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo",
                                store=dist.PrefixStore(f"gen{generation}", store),
                                rank=rank, world_size=dims.world_size, timeout=timeout,
                                device_id=torch.device("cuda", 0) if cuda else None)
        self.engine.connect(dims, rank)
        self.generation, self.rank, self.dims = generation, rank, dims
        return time.perf_counter() - t0

    def _check(self, generation: int) -> None:
        if generation != self.generation:
            raise StaleGenerationError(
                f"rank {self.rank}: call for generation {generation}, actor is in {self.generation}")

    def train_step(self, generation: int, step: int, batch) -> dict:
        """Run train step `step` on this rank's part of the batch (see the engine). Snapshots
        the committed state (step - 1) to host memory first, for peer restore."""
        self._check(generation)
        self.engine.snapshot()
        return self.engine.train_step(batch, step)

    def save_checkpoint(self, generation: int, step: int) -> list[FileEntry]:
        """Write this rank's shards of step `step`; returns the files written."""
        self._check(generation)
        return self.engine.save_checkpoint(self.ckpt, step, self.dims, self.rank)

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

    def broadcast_state(self, generation: int, src_rank: int) -> None:
        """Collective over this rank's DP group: receive the training state of `src_rank`."""
        self._check(generation)
        self.engine.broadcast_from(src_rank)

    def state_digest(self) -> str:
        """SHA-256 over the model parameters (for tests: replicas must agree bitwise)."""
        import hashlib

        import torch
        h = hashlib.sha256()
        for name, p in sorted(self.engine.model.state_dict().items()):
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
        return (self.node_ip, self.gpu_ids[0] if self.gpu_ids else f"b{self.bundle_index}")


class WorkerFailure(RuntimeError):
    """Ranks of the current generation failed. `ranks`: failed global ranks; `kind`:
    'crash' (actor died), 'hang' (deadline passed without progress) or 'exception'."""

    def __init__(self, ranks: set[int], kind: str, detail: str = ""):
        super().__init__(f"{kind} of rank(s) {sorted(ranks)}: {detail}")
        self.ranks, self.kind, self.detail = set(ranks), kind, detail
        self.detected_at = time.time()


def assign_roles(slots: list[ActorSlot], num_workers: int) -> tuple[list[ActorSlot], list[ActorSlot]]:
    """Split placed actors into workers (index = rank) and spares.

    Slots are sorted by (node IP, GPU id, bundle index): Ray does not return bundles in node
    order. Workers are taken one per device round-robin, so no two ranks share a GPU while
    there are free GPUs; ranks follow the sorted order, so tp neighbours share a node.
    """
    by_device: dict[tuple, list[ActorSlot]] = {}
    for s in sorted(slots, key=lambda s: (s.node_ip, s.device[1] if s.gpu_ids else 0, s.bundle_index)):
        by_device.setdefault(s.device, []).append(s)
    rounds = max(len(v) for v in by_device.values())
    ordered = [v[i] for i in range(rounds) for v in by_device.values() if i < len(v)]
    workers = sorted(ordered[:num_workers], key=lambda s: (s.node_ip, s.device[1] if s.gpu_ids else 0, s.bundle_index))
    return workers, ordered[num_workers:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MegatronActorGroup:
    """All actors of a run: workers indexed by rank plus the pool of pre-warmed spares.

    Creates one placement group of (num_workers + num_spares) bundles, one actor per bundle,
    sorts them by (node, GPU), builds every engine (workers and spares alike), hosts the
    rendezvous store and forms generation 1. Raises RuntimeError with the resources needed
    when the cluster cannot place the bundles within `placement_timeout_s` seconds.
    """

    def __init__(self, cfg: Config, placement_timeout_s: float = 60.0):
        import torch.distributed as dist
        from fault_tolerance import BackupPool

        self.cfg, self.dims = cfg, cfg.dims
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
        handles = [MegatronActor.options(
            num_cpus=c.cpus_per_actor, num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i)
        ).remote(cfg, i) for i in range(n)]
        infos = ray.get([h.info.remote() for h in handles])
        slots = [ActorSlot(h, i["node_ip"], i["node_id"], i["gpu_ids"], i["bundle_index"])
                 for h, i in zip(handles, infos)]
        self.workers, spares = assign_roles(slots, c.num_workers)
        self.build_s = max(ray.get([s.handle.build.remote() for s in slots]))
        self.pool = BackupPool(spares)
        self.store_host = ray.util.get_node_ip_address()
        self.store_port = _free_port()
        self.store = dist.TCPStore(self.store_host, self.store_port, is_master=True,
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=cfg.fault_tolerance.step_timeout_s))
        self.generation = 0
        self.form_generation()

    @property
    def handles(self) -> list:
        return [s.handle for s in self.workers]

    def describe(self) -> list[str]:
        """One line per rank and spare: where it runs (for logs and --dry-run)."""
        lines = [f"rank {r} {self.dims.coords(r)} on {s.node_ip} device {s.device[1]}"
                 for r, s in enumerate(self.workers)]
        return lines + [f"spare on {s.node_ip} device {s.device[1]}" for s in self.pool.spares]

    def form_generation(self) -> float:
        """Start the next membership generation: every worker joins new process groups.
        Returns seconds. Raises WorkerFailure if a member dies while joining."""
        self.generation += 1
        t0 = time.perf_counter()
        refs = [s.handle.join.remote(self.generation, r, self.dims, self.store_host, self.store_port)
                for r, s in enumerate(self.workers)]
        self.wait(refs, self.cfg.fault_tolerance.step_timeout_s)
        return time.perf_counter() - t0

    def call(self, method: str, *args, dispatch: str = "pass_through", timeout: float | None = None):
        """Call `method(generation, *args)` on every worker as the named dispatch splits it, wait
        with a deadline, and return the dispatch's collected results. Raises WorkerFailure."""
        kind = get_dispatch_type(dispatch)
        refs = dispatch_remote(self.handles, method, self.dims, kind, self.generation, *args)
        results = self.wait(refs, timeout or self.cfg.fault_tolerance.step_timeout_s)
        return kind.collect(self.dims, results)

    def wait(self, refs: list, timeout: float) -> list:
        """Results of `refs` (one per rank), or WorkerFailure naming the failed ranks.

        A rank whose actor died is a 'crash'. A rank whose call raised while no actor died is an
        'exception'. If the deadline passes, ranks not done are probed: dead -> crash, alive
        -> 'hang'.
        """
        index = {r.hex(): i for i, r in enumerate(refs)}
        results: list = [None] * len(refs)
        pending, deadline = list(refs), time.monotonic() + timeout
        errors: dict[int, Exception] = {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break
            i = index[done[0].hex()]
            try:
                results[i] = ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise WorkerFailure({i} | self.probe(), "crash", str(e)[:300]) from None
            except ray.exceptions.RayTaskError as e:
                errors[i] = e
                break
        if errors or pending:
            dead = self.probe()
            if dead:
                raise WorkerFailure(dead, "crash", "actor(s) died")
            if errors:
                i, e = next(iter(errors.items()))
                raise WorkerFailure(set(errors), "exception", f"rank {i}: {str(e)[:300]}")
            raise WorkerFailure({index[r.hex()] for r in pending}, "hang",
                                f"no result within {timeout:.1f} s")
        return results

    def probe(self) -> set[int]:
        """Ranks whose actor does not answer a control-group ping within
        `fault_tolerance.health_timeout_s` seconds, or is dead."""
        refs = [s.handle.ping.remote() for s in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.fault_tolerance.health_timeout_s)
        dead = set()
        for r, ref in enumerate(refs):
            if ref not in ready:
                dead.add(r)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.add(r)
        return dead

    def shutdown(self) -> None:
        """Kill every actor and release the placement group."""
        for s in self.workers + self.pool.spares:
            ray.kill(s.handle, no_restart=True)
        remove_placement_group(self.placement_group)
