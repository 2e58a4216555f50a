"""Node loss: several Ray nodes on one machine (`ray.cluster_utils.Cluster`), one removed while
training; its actors (a worker and the spares on it) die, the lost rank is replaced by a spare
on another node, and the losses equal the run without failure."""
import os
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor

from conftest import own_ray, reference_run, wait_for_senders, wait_for_shards, wait_for_snapshots

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cluster():
    own_ray()
    # Ray judges a node whose raylet is gone dead after 4 failed health checks 1 s apart (its
    # default: 5, 3 s apart), so a lost node's bundles are re-placed sooner.
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": {
        "health_check_period_ms": 1000, "health_check_failure_threshold": 4}})
    nodes = [c.add_node(num_cpus=2) for _ in range(3)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def make_cfg(tmp_path, spares, *overrides):
    return resolve(load_config("config.yaml", [
        "cluster.num_nodes=3", "cluster.num_workers=2", f"cluster.num_spares={spares}",
        "cluster.cpus_per_actor=0.5", "train.steps=4", "fault_tolerance.health_timeout_s=2",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", *overrides]), num_gpus=0)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    return reference_run(make_cfg(tmp_path_factory.mktemp("ref"), 0), 4)[0]


def three_live_nodes(cluster) -> list:
    """The cluster's worker nodes, topped up to 3 (an earlier test may have removed one)."""
    c, nodes = cluster
    nodes[:] = [n for n in nodes if n in c.worker_nodes]  # ray.nodes() lists a removed node alive for ~15 s
    while len(nodes) < 3:
        nodes.append(c.add_node(num_cpus=2))
    c.wait_for_nodes()
    return nodes


def test_refuses_connections_only_when_nothing_listens():
    """A port with a listener connects (False); the same port once closed refuses (True)."""
    import socket

    from ftrain.distributed.comms import refuses_connections

    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    assert not refuses_connections(address)
    listener.close()
    assert refuses_connections(address)


@pytest.mark.slow
def test_a_lost_node_is_found_at_once_with_all_its_actors(cluster, tmp_path):
    """A node whose raylet is killed (no graceful shutdown: its workers outlive it for a while
    and may still answer pings, and Ray lists the node as alive for seconds): one probe names
    all its ranks, and pruning the pool drops its spare, through the raylet's refused
    connections, long before health_timeout_s (60 s here) would have judged them."""
    c, nodes = cluster[0], three_live_nodes(cluster)
    cfg = make_cfg(tmp_path, 3, "cluster.num_workers=4", "fault_tolerance.health_timeout_s=60")
    group = ActorGroup(MegatronActor, cfg)
    try:
        # 7 actors spread over 3 nodes: one holds 2 ranks and a spare, the others 1 rank and a spare
        ranks_on: dict[str, set[int]] = {}
        for r, s in enumerate(group.workers):
            ranks_on.setdefault(s.node_id, set()).add(r)
        victim, on_victim = max(ranks_on.items(), key=lambda kv: len(kv[1]))
        assert len(on_victim) == 2 and sum(s.node_id == victim for s in group.pool.spares) == 1
        c.remove_node(next(n for n in nodes if n.node_id == victim), allow_graceful=False)
        t0 = time.monotonic()
        assert group.health.probe() == on_victim
        group.prune_pool()
        assert len(group.pool) == 2 and all(s.node_id != victim for s in group.pool.spares)
        assert time.monotonic() - t0 < 30
        # A replacement node joins. The lost spare's refill went to its bundle on the lost node
        # (listed alive for seconds) and died there; it is retried once Ray re-places the bundle.
        nodes.append(c.add_node(num_cpus=2))
        deadline = time.monotonic() + 120
        while len(group.pool) < 3 and time.monotonic() < deadline:
            group.poll_refills()
            time.sleep(0.5)
        assert len(group.pool) == 3 and all(s.node_id != victim for s in group.pool.spares)
    finally:
        group.shutdown()


def test_node_removed_mid_run_recovers_on_other_node(cluster, reference, tmp_path):
    # One spare, no refills: 3 actors, one per node (SPREAD), so the spare is on neither rank's
    # node (each actor start is seconds of CPU; the refills are the slow tests' subject).
    c, nodes = cluster[0], three_live_nodes(cluster)
    cfg = make_cfg(tmp_path / "run", 1, "fault_tolerance.refill_spares=false")
    group = ActorGroup(MegatronActor, cfg)
    try:
        assert len({s.node_id for s in group.workers + group.pool.spares}) == 3  # SPREAD
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(2)
        victim = group.workers[1].node_id
        (node,) = [n for n in nodes if n.node_id == victim]
        c.remove_node(node)
        trainer.train(4)
        (tl,) = trainer.recoveries
        assert tl.kind == "crash" and 1 in tl.failed_ranks and tl.failed_nodes[0] == victim
        assert all(s.node_id != victim for s in group.workers)
        assert trainer.losses == reference
    finally:
        group.shutdown()


@pytest.mark.slow
def test_memory_snapshots_outlive_the_node_of_their_rank(cluster, reference, tmp_path):
    """Each rank's in-memory snapshots live in the holder of another node: when rank 1's node
    is removed, rank 1's replacement loads its step-2 snapshot (0 steps lost) from there."""
    c, nodes = cluster[0], three_live_nodes(cluster)
    # health_timeout_s 5 (not 2): it also bounds the query of the holders during recovery, and
    # right after a node removal a loaded 2-core CI machine answered slower than 2 s once.
    # One spare: 3 actors, one per node, so a holder on each (which spare replaces rank 1 is
    # the test above's).
    cfg = make_cfg(tmp_path, 1, "fault_tolerance.memory_snapshot_interval=1", "fault_tolerance.restore=memory",
                   "fault_tolerance.health_timeout_s=5")
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        wait_for_senders(group)
        trainer.train(2)
        wait_for_snapshots(group, 2)
        victim = group.workers[1].node_id
        assert len(group.holders) == 3 and group.holder_for(victim) is not group.holders[victim]
        assert ray.get(group.holder_for(victim).node_id.remote()) != victim  # really elsewhere
        c.remove_node(next(n for n in nodes if n.node_id == victim))
        trainer.train(4)
        (tl,) = trainer.recoveries
        assert (tl.restore_source, tl.restored_step, tl.steps_lost) == ("memory", 2, 0)
        assert trainer.losses == reference
    finally:
        group.shutdown()


@pytest.mark.slow
def test_a_lost_node_s_optimizer_shards_come_back_from_their_keepers(cluster, tmp_path):
    """dp=4 with a sharded optimizer (the torch engine's ZeRO-1): each rank's shard is kept by
    the holder of another node (keeper.py). The node holding two ranks is removed: both come
    back from a DP peer (parameters) and their keeper (shard), 0 steps lost, no checkpoint read,
    losses and final state bitwise as the run without failure; after the recovery every rank's
    shard is kept again (the lost node's holder left the ring before the new generation formed)."""
    c, nodes = cluster[0], three_live_nodes(cluster)
    sets = ("cluster.num_workers=4", "model.distributed_optimizer=true", "fault_tolerance.health_timeout_s=5")
    ref = reference_run(make_cfg(tmp_path / "ref", 0, *sets), 4)
    cfg = make_cfg(tmp_path / "run", 2, *sets)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(2)
        wait_for_shards(group, 2)
        ranks_on: dict[str, set[int]] = {}
        for r, s in enumerate(group.workers):
            ranks_on.setdefault(s.node_id, set()).add(r)
        victim, lost = max(ranks_on.items(), key=lambda kv: len(kv[1]))
        assert len(lost) == 2 and ray.get(group.holder_for(victim).node_id.remote()) != victim
        c.remove_node(next(n for n in nodes if n.node_id == victim), allow_graceful=False)
        trainer.train(4)
        (tl,) = trainer.recoveries
        assert set(tl.failed_ranks) == lost and tl.failed_nodes == [victim]
        assert (tl.restore_source, tl.restored_step, tl.steps_lost) == ("peer+keeper", 2, 0)
        assert trainer.losses == ref[0]
        assert group.state_digests() == ref[1]
        wait_for_shards(group, 4)  # every rank kept again after the recovery: none given the lost node's holder
    finally:
        group.shutdown()
