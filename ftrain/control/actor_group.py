"""The driver's actor group: placement, roles, membership generations and the backup pool.

`ActorGroup` is the only owner of the worker list (index = rank) and of the pool of pre-warmed
spares: it places one actor per placement-group bundle, splits them into workers and spares
over failure domains (`assign_roles`), forms each process-group generation through the
rendezvous store it hosts, kills failed actors, puts spares in their place, shrinks DP when
no spare is left, and refills the pool in the background. Failure detection is its
`HealthMonitor` (`health.py`); the recovery protocol that drives it is `fault_tolerance.py`.
"""
from __future__ import annotations

import datetime
import logging
import time
from typing import Callable

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ftrain.config import Config, require
from ftrain.control.actor_slot import ActorSlot, exited_on_its_gpus
from ftrain.control.driver_failover import PLACEMENT_GROUP, CannotReattach, new_name
from ftrain.control.health import HealthMonitor
from ftrain.control.node_agent import NodeAgent, NodeCalls
from ftrain.control.ray_batch import getters
from ftrain.distributed.fanout import Dispatch, dispatch_of
from ftrain.distributed.parallel_dims import ParallelDims, RankCoords
from ftrain.failures import ClusterError, slowest
from ftrain.state.keeper import keeper_node, keeps_locally, keeps_shards
from ftrain.state.snapshots import SnapshotHolder

log = logging.getLogger(__name__)


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


def assign_roles(slots: list[ActorSlot], num_workers: int, tp: int = 1) -> tuple[list[ActorSlot], list[ActorSlot]]:
    """Split placed actors into workers (index = rank) and spares, spreading spares over nodes
    (failure domains) and keeping each tensor-parallel group inside one node.

    Losing node n loses its w_n workers and its s_n spares; the spares left elsewhere cover its
    ranks when S - s_n >= w_n, i.e. when the pool S is at least the node's slot count. Given
    that, the split maximises the pool left after the worst node loss: spares are handed out one
    at a time to the node holding the fewest so far (ties: the node with more slots, then the
    later node), never leaving a node more workers than devices while free devices exist.
    With `tp` > 1 each node's worker count is then made a multiple of `tp` (`_whole_tp_groups`),
    so that the TP groups (consecutive ranks) never span nodes and their all-reduce stays on
    the node's links. Within a node, workers take one slot per device round-robin, so no two
    ranks share a GPU while there are free GPUs. Ranks follow (node IP, node id, GPU id, bundle
    index): Ray does not return bundles in node order, and tp neighbours share a node.
    `placement_report(workers, spares)` explains the result, one line per node. Raises
    ValueError when the TP groups cannot all stay inside a node.
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
    if tp > 1:
        spares_on = _whole_tp_groups(spares_on, {n: len(v) for n, v in nodes.items()}, devices, tp)
    workers, spares = [], []
    for n, v in ordered.items():
        k = len(v) - spares_on[n]
        workers += v[:k]
        spares += v[k:]
    return sorted(workers, key=_slot_key), spares


def _whole_tp_groups(spares_on: dict[str, int], slots_on: dict[str, int], devices: dict[str, int],
                     tp: int) -> dict[str, int]:
    """Spares per node such that every node's worker count is a multiple of `tp`: each node's
    workers are rounded down to whole TP groups, and the groups taken away go, one at a time,
    to the node with the most spares that has room for a group (on free devices first).
    Raises ValueError when they do not fit."""
    workers = {n: (slots_on[n] - k) // tp * tp for n, k in spares_on.items()}
    missing = sum(slots_on[n] - k for n, k in spares_on.items()) - sum(workers.values())
    while missing > 0:
        room = [n for n in workers if slots_on[n] - workers[n] >= tp]
        if not room:
            raise ValueError(f"the tensor-parallel groups of {tp} ranks cannot all stay inside one node: "
                             f"nodes hold {sorted(slots_on.values())} actor(s)")
        n = max(room, key=lambda n: (workers[n] + tp <= devices[n], slots_on[n] - workers[n]))
        workers[n] += tp
        missing -= tp
    return {n: slots_on[n] - w for n, w in workers.items()}


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


class BackupPool:
    """Pre-warmed spare actors: placed, imports done, device context made, model built, but in
    no process group."""

    def __init__(self, spares: list[ActorSlot]):
        self.spares = list(spares)

    def __len__(self) -> int:
        return len(self.spares)

    def take(self, avoid_nodes: set[str], busy_devices: set[tuple], home: str | None = None) -> ActorSlot | None:
        """Remove and return the best spare: with a `home` node (where the rank's TP peers run),
        one there on a device not in `busy_devices`; then one on another node than
        `avoid_nodes` and on a free device, then any on a free device, then any; among equals,
        one from the node holding the most spares (the pool stays spread over failure domains).
        None if empty."""
        per_node: dict[str, int] = {}
        for s in self.spares:
            per_node[s.node_id] = per_node.get(s.node_id, 0) + 1
        for ok in (lambda s: s.node_id == home and s.device not in busy_devices,
                   lambda s: s.node_id not in avoid_nodes and s.device not in busy_devices,
                   lambda s: s.device not in busy_devices, lambda s: True):
            fits = [s for s in self.spares if ok(s)]
            if fits:  # from the node with the most spares: the pool stays spread over nodes
                s = max(fits, key=lambda s: per_node[s.node_id])
                self.spares.remove(s)
                return s
        return None

    def take_for(self, failed: set[int], workers: list[ActorSlot],
                 dims: ParallelDims | None = None) -> dict[int, ActorSlot]:
        """A spare for each rank of `failed` (rank -> spare, removed from the pool), chosen by
        `take` rank by rank in order: with tp > 1 (`dims`), on the node of the rank's TP
        group (its surviving peers, or the spare already chosen for a peer), so the group's
        all-reduce stays inside a node; otherwise away from the failed ranks' nodes; always on
        a device that no surviving rank (nor an earlier choice) uses. A replacement that must
        put a TP group across nodes is logged as a warning with the reason. `workers`: the
        slots by rank. Raises ValueError, taking nothing, when the pool holds fewer spares than
        `failed` ranks."""
        if len(self.spares) < len(failed):
            raise ValueError(f"{len(failed)} rank(s) failed and {len(self.spares)} spare(s) are left")
        failed_nodes = {workers[r].node_id for r in failed}
        busy = {s.device for r, s in enumerate(workers) if r not in failed}
        chosen: dict[int, ActorSlot] = {}
        tp_groups = dims.group_ranks("tp") if dims is not None and dims.tp > 1 else []
        for r in sorted(failed):
            peers = next((g for g in tp_groups if r in g), [])
            homes = {(chosen[p] if p in chosen else workers[p]).node_id for p in peers
                     if p != r and (p in chosen or p not in failed)}
            home = homes.pop() if len(homes) == 1 else None
            chosen[r] = self.take(failed_nodes, busy, home)
            busy.add(chosen[r].device)
            if home is not None and chosen[r].node_id != home:
                log.warning("rank %d replaced on node %s but its TP group %s runs on node %s (no spare on a free "
                            "device there): the group's all-reduce crosses nodes from now on; more spares per node "
                            "(cluster.num_spares) avoid it", r, chosen[r].node_id[:8], peers, home[:8])
        return chosen


def preflight(cfg: Config, resources: dict) -> None:
    """Checks that need the cluster, run before any actor starts. `resources`: Ray's
    `cluster_resources()` (logical CPU / GPU totals). Raises ConfigError naming the field when the
    cluster cannot hold every worker and spare. (The checkpoint URI needs no cluster:
    `checkpoint.check_uri`, before Ray starts.)"""
    c = cfg.cluster
    n = c.num_workers + c.num_spares
    need = {"CPU": n * c.cpus_per_actor}
    if c.device == "cuda":
        need["GPU"] = n * c.gpus_per_actor
        require(c.num_workers <= resources.get("GPU", 0.0) + 1e-9, "cluster.num_workers",
                f"{c.num_workers} ranks on {resources.get('GPU', 0.0):g} GPUs would put two ranks of the "
                f"process group on one GPU; lower cluster.num_workers (and the parallel sizes) or add GPUs")
    for res, amount in need.items():
        have = resources.get(res, 0.0)
        require(amount <= have + 1e-9, "cluster.num_workers",
                f"{c.num_workers} workers + {c.num_spares} spares need {amount:g} {res} "
                f"({'cpus' if res == 'CPU' else 'gpus'}_per_actor each) but the cluster has {have:g} "
                f"{res}; lower cluster.num_spares / cluster.{res.lower()}s_per_actor or add nodes")


class ActorGroup:
    """All actors of a run: workers indexed by rank plus the pool of pre-warmed spares.

    Creates one placement group of (num_workers + num_spares) bundles, one actor per bundle,
    sorts them by (node, GPU), builds every engine (workers and spares alike), hosts the
    rendezvous store and forms generation 1. Raises ConfigError (`preflight`: the cluster's
    totals are too small) or ClusterError (the bundles could not be placed within
    `placement_timeout_s` seconds), naming what was asked and what the cluster has.

    `fence` (a no-op unless set: `run_lease.DriverLease.check`) is called before every change
    of membership or of the actors (a kill, refill, replacement, shrink, grow, new generation)
    and every holder rewind (`drop_snapshots_after`): it raises to stop a driver another one
    took the run over from, before it touches the new driver's actors.
    """

    REFILL_ATTEMPTS = 3  # starts of a spare on a freed bundle (one that dies, e.g. on a lost node, is retried)

    def __init__(self, actor_cls, cfg: Config, placement_timeout_s: float = 60.0, attach: dict | None = None,
                 first_generation: int = 0, data=None):
        """`actor_cls`: the Ray actor class of a rank (the example's `megatron_actor.MegatronActor`),
        started as `actor_cls.options(...).remote(cfg, bundle_index)` on each bundle; its methods
        declare how `call` fans out to the ranks (`ftrain.distributed.fanout.dispatch_of`).
        `attach`: the record of a run whose driver died (`driver_failover.find`): its named
        actors and placement group are taken over (none is started or built); the caller then
        forms a generation and restores (`fault_tolerance.reattach`). `self.dead`: the ranks
        of that record whose actor is gone. `first_generation`: generations are numbered from
        the one after it (`failures.first_generation`: a later driver's are above an earlier one's).
        `data`: with train.objective=ce, the run's opened `data.Data` (None: opened here,
        `data.open_data`), which every actor, spares included, opens as it builds: ranks read
        their own rows (`MegatronActor.train_step`); `self.data` (None for other objectives)."""
        import torch.distributed as dist

        self.actor_cls = actor_cls
        self.cfg, self.dims = cfg, ParallelDims.from_config(cfg)
        preflight(cfg, ray.cluster_resources())  # before anything is placed or started
        if cfg.train.objective == "ce" and data is None:
            from ftrain.data.dataset import open_data
            data = open_data(cfg)
        self.data = data if cfg.train.objective == "ce" else None
        self._data_ref = None if self.data is None else ray.put(self.data)  # sent once, opened by each actor
        c = cfg.cluster
        n = c.num_workers + c.num_spares
        bundle = {"CPU": c.cpus_per_actor}
        if c.device == "cuda":
            bundle["GPU"] = c.gpus_per_actor
        self.detached = cfg.fault_tolerance.driver_failover
        self.generation = first_generation
        self.names: dict[str, str] = {}  # actor id -> name, of the named (detached) actors
        self.dead: set[int] = set()
        self.quarantined: dict[tuple, str] = {}  # device -> why: no rank goes there before a probe passes
        self.agents: dict[str, object] = {}  # node id -> its NodeAgent (heartbeats and step calls through their tree: agent_tree)
        self.fence: Callable[[], None] = lambda: None
        self._exited: list[ActorSlot] = []  # failed ranks replaced since the last generation formed
        if attach is not None:
            self._attach(attach)
            return
        self.placement_group = placement_group(
            [dict(bundle) for _ in range(n)], strategy="SPREAD" if c.num_nodes > 1 else "PACK",
            **({"name": PLACEMENT_GROUP, "lifetime": "detached"} if self.detached else {}))
        ready, _ = ray.wait([self.placement_group.ready()], timeout=placement_timeout_s)
        if not ready:
            remove_placement_group(self.placement_group)
            raise ClusterError(
                f"cluster too small: {n} bundles of {bundle} (cluster.num_workers={c.num_workers} + "
                f"cluster.num_spares={c.num_spares}) could not be placed within {placement_timeout_s:.0f} s; "
                f"cluster has {ray.cluster_resources()}. Lower cluster.num_spares / cpus_per_actor / "
                f"gpus_per_actor or add nodes")
        self._refills: dict = {}  # build ObjectRef -> (handle, bundle index, attempt) of a spare being refilled
        self._refills_due: list[int] = []  # bundles of deferred refills (`refill(defer=True)`)
        self._warming: dict[int, object] = {}  # id(spare slot) -> its prepare_spare ObjectRef
        self.workers: list[ActorSlot] = []
        self.pool = BackupPool([])
        self._watch()
        self.injected_at: float | None = None  # wall-clock time of the last injected fault (`kill`)
        handles = [self._new_actor(i) for i in range(n)]
        infos = ray.get([h.info.remote() for h in handles])
        slots = [ActorSlot(h, i["node_ip"], i["node_id"], i["gpu_ids"], i["bundle_index"], i["pid"])
                 for h, i in zip(handles, infos)]
        try:
            self.workers, spares = assign_roles(slots, c.num_workers, self.dims.tp)
        except ValueError as e:
            raise ClusterError(f"placement: {e}; give every node a multiple of parallel.tp={self.dims.tp} "
                               f"actors (cluster.num_workers, cluster.num_spares) or lower parallel.tp") from None
        self.placement_report = placement_report(self.workers, spares)
        for line in self.placement_report:
            log.info("placement: %s", line)
        self.pool = BackupPool(spares)
        # One heartbeat agent per node, in a bundle of the placement group on that node (as the
        # snapshot holders below); not awaited: until one answers, its node is pinged from here.
        bundles = {s.node_id: s.bundle_index for s in slots}
        self.agents = {node: NodeAgent.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.placement_group, b)).remote(cfg.fault_tolerance.health_interval_s / 2) for node, b in bundles.items()}
        self.health.start()
        self.build_s = max(ray.get([s.handle.build.remote(self._data_ref) for s in slots]))
        self.store_host = ray.util.get_node_ip_address()
        # Port 0: the OS picks a free port at bind time (no probe-then-bind race with other
        # programs). One store serves every generation, so no port is ever re-bound.
        self.store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=cfg.fault_tolerance.step_timeout_s))
        self.store_port = self.store.port
        # In-memory snapshots: one holder per node of the placement group; each rank sends its
        # copies to the holder of another node, so they outlive the rank's node.
        self.holders: dict[str, object] = {}
        if cfg.fault_tolerance.memory_snapshot_interval > 0 or keeps_shards(
                cfg.model.distributed_optimizer, cfg.fault_tolerance.shard_keeper, self.dims.dp) or \
                keeps_locally(cfg.fault_tolerance.shard_keeper, self.dims.dp, c.num_spares):
            # In a bundle of the placement group on that node: reserved, so the holder is where
            # its key says (a soft node affinity may fall back to another node, e.g. for a node
            # just added, and a rank's copies would then sit on its own node). Keyed by the node
            # it runs on.
            bundles = {s.node_id: s.bundle_index for s in sorted(slots, key=lambda s: -s.bundle_index)}
            handles = [self._remember(SnapshotHolder.options(**self._named("holder", i), scheduling_strategy=(
                PlacementGroupSchedulingStrategy(self.placement_group, bundles[node]))).remote())
                for i, node in enumerate(sorted(bundles))]
            self.holders = dict(zip(ray.get([h.node_id.remote() for h in handles]), handles))
        self.form_generation()
        self.host_nbytes = self._host_nbytes()
        self._prepare(self.pool.spares)

    def _watch(self) -> None:
        """The health monitor of the workers and spares, and the step calls through the node
        agents (`NodeCalls`: one call per root of the agents' tree per `call`, `agent_tree`)."""
        self.health = HealthMonitor(self.cfg.fault_tolerance, lambda: self.workers, lambda: self.pool.spares,
                                    lambda: self.generation, lambda: self.agents)
        self.node_calls = NodeCalls(self.health.beats.node_of, self.health.beats.call_tree, self.health.agent_failed)

    def _named(self, kind: str, index: int) -> dict:
        """Ray options naming a detached actor of the run (`driver_failover`); {} when off.
        The name is recorded at creation, see `name_of`."""
        if not self.detached:
            return {}
        self._next_name = new_name(kind, index)
        return {"name": self._next_name, "lifetime": "detached"}

    def _remember(self, handle):
        if self.detached:
            self.names[handle._actor_id.hex()] = self._next_name
        return handle

    def name_of(self, slot_or_handle) -> str:
        """The name of a detached actor (an ActorSlot or a handle)."""
        h = getattr(slot_or_handle, "handle", slot_or_handle)
        return self.names[h._actor_id.hex()]

    def _attach(self, record: dict) -> None:
        """Take over the named actors of `record` (see `__init__`)."""
        import torch.distributed as dist

        cfg = self.cfg
        self.placement_group = get_placement_group(PLACEMENT_GROUP)
        self._refills, self._refills_due, self._warming = {}, [], {}
        self.injected_at = None
        timeout = cfg.fault_tolerance.health_timeout_s

        def slot(name: str) -> ActorSlot:
            ip, node, gpus, bundle = record["slots"][name]
            try:
                handle = ray.get_actor(name)
                ray.get(handle.info.remote(), timeout=timeout)
                self.names[handle._actor_id.hex()] = name
            except (ValueError, ray.exceptions.RayError):
                log.warning("driver failover: actor %s (bundle %d, %s) did not survive", name, bundle, ip)
                handle = None
            return ActorSlot(handle, ip, node, gpus, bundle)

        self.workers = [slot(n) for n in record["workers"]]
        self.dead = {r for r, s in enumerate(self.workers) if s.handle is None}
        self.pool = BackupPool([s for s in map(slot, record["spares"]) if s.handle is not None])
        if len(self.dead) > len(self.pool):
            raise CannotReattach(f"{len(self.dead)} rank(s) of the run did not survive its driver and "
                                 f"{len(self.pool)} spare(s) did")
        self.placement_report = placement_report(self.workers, self.pool.spares)
        self.holders = {}
        for node, name in record["holders"].items():
            try:
                self.holders[node] = ray.get_actor(name)
                self.names[self.holders[node]._actor_id.hex()] = name
            except ValueError:
                pass
        self._watch()
        self.build_s = 0.0  # health starts once no rank is None (fault_tolerance.reattach)
        self.store_host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=cfg.fault_tolerance.step_timeout_s))
        self.store_port = self.store.port
        self.generation = max(self.generation, record["generation"])
        self.host_nbytes = self._host_nbytes()
        self._prepare(self.pool.spares)

    @property
    def num_spares(self) -> int:
        """The configured pool size (`cluster.num_spares`)."""
        return self.cfg.cluster.num_spares

    def _host_nbytes(self) -> tuple[int, int]:
        """The largest worker's (rollback snapshot, async save copy) bytes, which spares reserve
        (`MegatronActor.host_nbytes`)."""
        sizes = ray.get([s.handle.host_nbytes.remote() for s in self.workers if s.handle is not None])
        return max(s[0] for s in sizes), max(s[1] for s in sizes)

    def _prepare(self, spares: list) -> None:
        """Spares, in the background: connect to the driver's store, reserve the rollback
        snapshot's host memory (the largest rank's size) and warm up
        (`MegatronActor.prepare_spare`), so none of these slows a recovery or its first steps;
        with the local keeper, each keeps its node holder's arenas mapped (`keeper.LocalMaps`)."""
        ft = self.cfg.fault_tolerance
        local = keeps_locally(ft.shard_keeper, self.dims.dp, self.cfg.cluster.num_spares)
        for s in spares:
            self._warming[id(s)] = s.handle.prepare_spare.remote(
                self.host_nbytes, self.store_host, self.store_port,
                self.holders.get(s.node_id) if local else None)

    def wait_spares_warm(self, timeout: float) -> float:
        """Wait until every spare of the pool has finished warming (`_prepare`), at most
        `timeout` seconds; returns the seconds waited."""
        t0 = time.perf_counter()
        refs = [self._warming[id(s)] for s in self.pool.spares if id(s) in self._warming]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        return time.perf_counter() - t0

    @property
    def handles(self) -> list:
        return [s.handle for s in self.workers]

    def form_generation(self) -> dict[str, float]:
        """Start the next membership generation: every worker joins new process groups.
        Returns the slowest rank's seconds for each part of its join (`MegatronActor.join`),
        and `spare_warm_wait_s` when a spare taken from the pool was still warming (its join
        waits for that). Raises WorkerFailure if a member dies while joining."""
        self.fence()
        self.generation += 1
        self._forget_lost_holders()
        warming = [self._warming.pop(id(s)) for s in self.workers if id(s) in self._warming]
        t0 = time.perf_counter()
        if warming:
            ray.wait(warming, num_returns=len(warming), timeout=self.cfg.fault_tolerance.step_timeout_s)
        waited = time.perf_counter() - t0
        refs = [s.handle.join.remote(self.generation, r, self.dims, self.store_host, self.store_port,
                                     self.holder_for(s.node_id), self.holders.get(s.node_id),
                                     exited_on_its_gpus(s, self._exited))
                for r, s in enumerate(self.workers)]
        parts = self.wait(refs, self.cfg.fault_tolerance.rendezvous_timeout_s)
        self._exited = []
        return {**slowest(parts), **({"spare_warm_wait_s": round(waited, 4)} if warming else {})}

    def state_digests(self) -> list[str]:
        """Each rank's `Engine.state_digest` (weights, optimizer state, schedule, step), by rank."""
        return ray.get([s.handle.state_digest.remote() for s in self.workers],
                       timeout=self.cfg.fault_tolerance.step_timeout_s)

    def wait(self, refs: list, timeout: float, ranks: list[int] | None = None, culprit_s: float | None = None) -> list:
        """Results of `refs` (one per rank, or one per rank of `ranks`); raises WorkerFailure
        naming the failed ranks (`HealthMonitor.wait`)."""
        return self.health.wait(refs, timeout, ranks, culprit_s)

    def _forget_lost_holders(self) -> None:
        """Drop the holders of lost nodes (raylet refusing connections, or no longer listed alive:
        `HealthMonitor.lost_nodes`) from the ring before a generation forms, so that no member
        is given one of them as its keeper or snapshot holder."""
        for node in self.health.lost_nodes(set(self.holders)):
            log.warning("snapshot holder of lost node %s leaves the keepers' ring", node)
            del self.holders[node]

    def holder_for(self, node_id: str):
        """The SnapshotHolder a rank on `node_id` sends its snapshots to: the next node's in
        sorted order (its own node's only when there is one node, `keeper.keeper_node`); None
        when no holder runs (no memory snapshots and no shard keeper)."""
        if not self.holders:
            return None
        return self.holders[keeper_node(node_id, list(self.holders))]

    def drop_snapshots_after(self, step: int) -> None:
        """After a rewind to committed step `step` (a checkpoint restore, a resume, a restart or
        an in-memory restore of an older step): every live holder drops the snapshots of later
        steps and the late parts of sends from older generations (`SnapshotHolder.drop_after`),
        so no later in-memory restore mixes the abandoned timeline into this one. A holder that
        does not answer within health_timeout_s is skipped (`held_snapshots` forgets dead ones)."""
        self.fence()
        refs = [h.drop_after.remote(step, self.generation) for h in self.holders.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.cfg.fault_tolerance.health_timeout_s)

    def held_snapshots(self) -> dict[tuple, set[int]]:
        """(layout, rank) -> steps held by some live holder. Holders that died (with their
        node) are forgotten; one that does not answer within health_timeout_s is skipped."""
        held: dict[tuple, set[int]] = {}
        refs = {node: holder.steps.remote() for node, holder in self.holders.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.cfg.fault_tolerance.health_timeout_s)
        got = getters(ready)
        for node, ref in refs.items():
            if ref not in got:  # no answer in time
                continue
            try:
                steps = got[ref]()
            except ray.exceptions.RayActorError:
                del self.holders[node]
                continue
            for key, s in steps.items():
                held.setdefault(tuple(key), set()).update(s)
        return held

    def submit(self, method: str, *args, ranks: list[int] | None = None) -> list:
        """Start `method(generation, *args)` on the workers of `ranks` (default: every rank, in
        rank order) without waiting; returns their ObjectRefs in that order, for `wait`."""
        ranks = range(len(self.workers)) if ranks is None else ranks
        return [getattr(self.workers[r].handle, method).remote(self.generation, *args) for r in ranks]

    def call(self, method: str, *args, dispatch: type[Dispatch] | None = None, timeout: float | None = None,
             culprit_s: float | None = None):
        """Call `method(generation, *args)` on every worker as its dispatch splits it (the one the
        method declares, `dispatch_of`, unless `dispatch` is given), sent through the node
        agents' fan-out tree with the call's arguments cut once (`NodeCalls`: one call per root;
        each agent forwards it to its children and derives its ranks' arguments,
        `Dispatch.for_rank`; directly to a rank whose node has no agent in the tree), wait with a
        deadline (`timeout`; `culprit_s`: `HealthMonitor.wait`'s), and return the dispatch's
        collected results. Raises WorkerFailure, and TypeError when `method` declares no dispatch."""
        kind = dispatch or dispatch_of(self.actor_cls, method)
        results = self.wait(self.node_calls.start(self.workers, method, self.dims, kind, (self.generation, *args)),
                            timeout or self.cfg.fault_tolerance.step_timeout_s, culprit_s=culprit_s)
        return kind.collect(self.dims, results)

    def _new_actor(self, bundle_index: int):
        c = self.cfg.cluster
        return self._remember(self.actor_cls.options(
            num_cpus=c.cpus_per_actor, num_gpus=c.gpus_per_actor if c.device == "cuda" else 0,
            max_restarts=0, **self._named("actor", bundle_index),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, bundle_index),
        ).remote(self.cfg, bundle_index))

    def refill(self, bundle_indices: list[int], attempt: int = 1, defer: bool = False) -> None:
        """Start new spares on the bundles of killed actors, in the background: Ray places each
        when its bundle is free again (on the same node, or re-placed after a node loss).
        `defer` (a recovery): start them at the next `poll_refills` instead, which training
        calls after the next committed step, so the restore and the first step after a
        recovery run without new processes starting, building a model and mapping host memory
        beside them on the node."""
        self.fence()
        if defer:
            self._refills_due += bundle_indices
            return
        for i in bundle_indices:
            handle = self._new_actor(i)
            self._refills[handle.build.remote(self._data_ref)] = (handle, i, attempt)

    def poll_refills(self) -> int:
        """Start the deferred refills (`refill(defer=True)`), and move refilled spares whose
        model is built into the pool (non-blocking); returns how many were moved."""
        due, self._refills_due = self._refills_due, []
        self.refill(due)
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
            slot = ActorSlot(handle, i["node_ip"], i["node_id"], i["gpu_ids"], i["bundle_index"], i["pid"])
            if not self._probe_quarantined([slot]):
                continue
            self.pool.spares.append(slot)
            self._prepare(self.pool.spares[-1:])
            added += 1
        if added:
            log.info("spare pool refilled: %d spare(s) now", len(self.pool))
        return added

    def wait_for_refills(self, spares: int, timeout_s: float) -> float:
        """Wait until the pool holds `spares` spares while refills are being built or due
        (`refill`, `poll_refills`, every `health_interval_s`), at most `timeout_s` seconds:
        a spare that is on its way is not a spare that is missing. Logs
        `event=waiting_for_refill` when it waits. Returns seconds waited (0.0: the pool holds
        them, or no refill is on its way)."""
        t0 = time.monotonic()
        if len(self.pool) >= spares or not (self._refills or self._refills_due):
            return 0.0
        log.warning("event=waiting_for_refill spares=%d needed=%d refills=%d timeout_s=%.0f", len(self.pool), spares,
                    len(self._refills) + len(self._refills_due), timeout_s)
        while len(self.pool) < spares and (self._refills or self._refills_due) and time.monotonic() - t0 < timeout_s:
            if not self.poll_refills():
                time.sleep(self.cfg.fault_tolerance.health_interval_s)
        waited = time.monotonic() - t0
        log.info("waited %.1f s for refills: %d spare(s) now", waited, len(self.pool))
        return waited

    def prune_pool(self) -> None:
        """Drop spares that are dead or unreachable from the pool, and start replacements on
        their bundles in the background (`fault_tolerance.refill_spares`). Spares on a node
        whose raylet refuses connections are dead without a ping (`HealthMonitor.lost_nodes`);
        the others are judged by their heartbeats, all at once (`Heartbeats.settle`): a spare
        that answered within the last `health_interval_s` is kept at once, one silent for
        `health_timeout_s` (e.g. on a cut-off host) is dropped; only a spare that went silent
        just now costs a wait, up to `health_timeout_s`."""
        self.fence()
        ft = self.cfg.fault_tolerance
        lost = self.health.lost_nodes({s.node_id for s in self.pool.spares})
        candidates = [s for s in self.pool.spares if s.node_id not in lost]
        ok, _, _ = self.health.beats.settle([s.handle for s in candidates], time.monotonic() - ft.health_interval_s)
        alive = [candidates[i] for i in sorted(ok)]
        dead = [s for s in self.pool.spares if not any(s is a for a in alive)]
        if dead:
            log.warning("spare pool: dropping %d dead or unreachable spare(s) on %s", len(dead),
                        sorted({s.node_ip for s in dead}))
        self.pool.spares = self._probe_quarantined(alive)
        if dead and ft.refill_spares:
            for s in dead:
                ray.kill(s.handle, no_restart=True)  # an unanswering one may still hold its bundle
            self.refill([s.bundle_index for s in dead])

    def quarantine(self, ranks) -> None:
        """Quarantine the devices of failed `ranks`: no spare there is taken, and no refill
        there joins the pool, until it passes a health probe (`_probe_quarantined`)."""
        for r in ranks:
            s = self.workers[r]
            self.quarantined[s.device] = f"rank {r} failed on it"
            log.info("device %s of node %s quarantined until a probe passes (rank %d failed on it)",
                     s.device[1], s.node_ip, r)

    def _probe_quarantined(self, spares: list[ActorSlot]) -> list[ActorSlot]:
        """`spares` without those on a quarantined device that fail its health probe
        (`MegatronActor.probe`) or do not answer it within `health_timeout_s`: they are killed,
        and the device stays quarantined. A passed probe lifts the device's quarantine."""
        suspects = [s for s in spares if s.device in self.quarantined]
        if not suspects:
            return spares
        refs = [s.handle.probe.remote() for s in suspects]
        ray.wait(refs, num_returns=len(refs), timeout=self.cfg.fault_tolerance.health_timeout_s)
        failed = []
        for s, ref in zip(suspects, refs):
            try:
                why = ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError) as e:
                why = f"no answer to the probe ({type(e).__name__})"
            if why is None:
                self.quarantined.pop(s.device, None)
                log.info("device %s of node %s passed its probe: quarantine lifted", s.device[1], s.node_ip)
            else:
                failed.append(s)
                log.warning("device %s of node %s stays quarantined, its actor is dropped: %s",
                            s.device[1], s.node_ip, why)
                ray.kill(s.handle, no_restart=True)
        return [s for s in spares if not any(s is f for f in failed)]

    def kill(self, ranks, injected: bool = True) -> None:
        """Kill the actors of `ranks` (SIGKILL through Ray; they stay in the worker list until
        replaced). `injected`: a fault injected on purpose (demo, benchmark, chaos), whose time
        is recorded in `injected_at` for the recovery's `detect_s`."""
        self.fence()
        for r in ranks:
            ray.kill(self.workers[r].handle, no_restart=True)
        if injected:
            self.mark_injected()

    def kill_node_of(self, rank: int) -> list[int]:
        """Fault injection: kill every actor (workers and spares) on the node of `rank`, as a
        node loss looks to the control plane, and record the time (`kill`). Returns the worker
        ranks killed."""
        node = self.workers[rank].node_id
        ranks = [r for r, s in enumerate(self.workers) if s.node_id == node]
        for s in self.pool.spares:
            if s.node_id == node:
                ray.kill(s.handle, no_restart=True)
        self.kill(ranks)
        return ranks

    def arm_fault(self, rank: int, kind: str, point: str) -> None:
        """Fault injection: arm `kind` at `point` on `rank` (`MegatronActor.arm_fault`), and
        record the time (`kill`)."""
        ray.get(self.workers[rank].handle.arm_fault.remote(kind, point))
        self.mark_injected()

    def mark_injected(self) -> None:
        """Record that a fault is injected now (also for one injected outside the group, such
        as a node removed from the cluster): the next recovery's `detect_s` counts from here."""
        self.injected_at = time.time()

    def take_injected_at(self) -> float | None:
        """The time of the fault injected since the last call (None: none), then forget it."""
        t, self.injected_at = self.injected_at, None
        return t

    def replace(self, failed: set[int]) -> None:
        """Put a spare at each rank of `failed` (`BackupPool.take_for`). Raises ValueError when
        the pool holds fewer spares than `failed` ranks. The failed slots are remembered until
        a generation forms: a member on one of their GPUs waits for their process's exit."""
        self.fence()
        self._exited += [self.workers[r] for r in failed]
        for r, spare in self.pool.take_for(failed, self.workers, self.dims).items():
            self.workers[r] = spare

    def shrink(self, failed: set[int]) -> None:
        """Drop every DP replica holding a failed rank (used when no spare is left). Living
        members of dropped replicas become spares. The global batch is unchanged: each replica
        gets a larger share, so more micro-batches accumulate. Raises ValueError when the batch
        sizes do not divide by the smaller dp; the caller turns that into a RecoveryError."""
        self.fence()
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

    def grow(self, dp: int) -> list[int]:
        """Add DP replicas from the pool up to `dp` (the inverse of `shrink`, once spares are
        back): the members keep their (tp, cp, pp, dp) positions, replicas dp_now..dp-1 are
        spares (`BackupPool.take`, each on a device no member uses where one is free). The
        global batch is unchanged: each replica gets a smaller share. Returns the new members'
        ranks (they hold no state yet). Raises ValueError when the pool holds fewer spares than
        the new replicas need, or when `dp` is not above the current dp."""
        self.fence()
        old = self.dims
        new = ParallelDims(tp=old.tp, pp=old.pp, cp=old.cp, dp=dp)
        if dp <= old.dp or len(self.pool) < new.world_size - old.world_size:
            raise ValueError(f"cannot grow dp {old.dp} -> {dp} with {len(self.pool)} spare(s)")
        workers: list = [None] * new.world_size
        for r, s in enumerate(self.workers):
            workers[new.rank_of(old.coords(r))] = s
        added = [r for r in range(new.world_size) if workers[r] is None]
        for r in added:
            workers[r] = self.pool.take(set(), {s.device for s in workers if s is not None})
        log.warning("spares are back: growing dp %d -> %d (ranks %s added)", old.dp, dp, added)
        self.workers, self.dims = workers, new
        return added

    def shutdown(self) -> None:
        """Kill every actor (spares and refills too) and release the placement group."""
        self.health.stop()
        for s in self.workers + self.pool.spares:
            if s.handle is not None:  # None: a detached actor that did not survive its driver
                ray.kill(s.handle, no_restart=True)
        for handle in [*(h for h, _, _ in self._refills.values()), *self.holders.values()]:
            ray.kill(handle, no_restart=True)
        remove_placement_group(self.placement_group)
