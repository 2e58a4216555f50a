"""The shard keeper (keeper.py) with the torch engine's ZeRO-1 (`model.distributed_optimizer=true`):
every rank's optimizer shard is on no DP peer; its keeper (the holder of another node) gets a
copy after every step, and a replaced rank is restored from a DP peer (parameters) plus its
keeper (shard): 0 committed steps lost, no checkpoint read, the final state bitwise equal to the
run without failure. The shard leaves the rank through shared memory and a courier process
(courier.py): a courier killed is replaced, and no arena outlives the run or a SIGKILLed rank.
Real Ray actors, gloo groups and holders."""
import contextlib
import os
import signal
import time

import pytest
import ray
import torch

from conftest import reference_run, run_bench, wait_for_shards
from config import load_config, resolve
from actor_group import ActorGroup
from courier import from_regions, regions
from host_memory import SharedArena, attach_shared, carve
from fault_tolerance import plan_restore
from keeper import keeper_node, shard_key
from trainer import Trainer

ZERO = "model.distributed_optimizer=true"


def make_cfg(tmp_path, *overrides, workers: int = 2, spares: int = 1):
    """No refills: an actor start competing with the recovery (the pool is not checked here)."""
    return resolve(load_config("config.yaml", [
        f"cluster.num_workers={workers}", f"cluster.num_spares={spares}", "checkpoint.interval=0",
        "fault_tolerance.refill_spares=false",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", ZERO, *overrides]), num_gpus=0)


@contextlib.contextmanager
def two_steps(cfg):
    """An ActorGroup and Trainer that trained 2 steps (a checkpoint of step 1 committed) and,
    with the keeper, whose keepers hold step 2's shards; the group is shut down on exit."""
    group = ActorGroup(cfg)
    try:
        trainer = Trainer(cfg, group)
        trainer.train(1)
        trainer.save(1)
        trainer.train(2)
        if cfg.fault_tolerance.shard_keeper:
            wait_for_shards(group, 2)
        yield group, trainer
    finally:
        group.shutdown()


def run(cfg, kill_ranks=(), steps: int = 4):
    """`two_steps`, kill `kill_ranks`, train to `steps`. Returns (trainer, final digests)."""
    with two_steps(cfg) as (group, trainer):
        for r in kill_ranks:
            ray.kill(group.workers[r].handle, no_restart=True)
        trainer.train(steps)
        return trainer, group.state_digests()


# -- pure decisions ------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes", [["a"], ["a", "b"], ["c", "a", "b"], [f"n{i}" for i in range(8)]])
def test_every_node_keeps_another_nodes_shards_in_one_ring(nodes):
    """Each node's shards go to another node whenever there are two or more, and every node
    keeps exactly one node's shards (a ring), whatever the order the nodes come in."""
    keepers = [keeper_node(n, nodes) for n in nodes]
    assert sorted(keepers) == sorted(nodes)
    assert all(k != n for n, k in zip(nodes, keepers)) or len(nodes) == 1
    assert keeper_node("elsewhere", nodes) in nodes
    with pytest.raises(ValueError):
        keeper_node("a", [])


def test_a_sharded_optimizer_needs_the_keepers_copy_of_the_committed_step():
    """dp=4, rank 2 lost: with a sharded optimizer the peer restore is `peer+keeper` only when
    the keeper holds rank 2's shard of the committed step; one of an older step does not do
    (it would not match the peer's parameters): the checkpoint is next."""
    group, survivors = [[0, 1, 2, 3]], {0, 1, 3}

    def plan(kept, committed=5):
        return plan_restore("auto", committed, group, survivors, survivors, None, lambda: 0, kept)

    assert plan(None).source == "peer"  # replicated optimizer
    p = plan(lambda: [set(), set(), {4, 5}, set()])
    assert (p.source, p.step, p.ranks, p.broadcasts) == ("peer+keeper", 5, [2], [(0, [0, 2], [0, 2])])
    p = plan(lambda: [set(), set(), {3, 4}, set()])
    assert p.source == "checkpoint" and "optimizer shard of step 5 of rank(s) [2]" in p.notes[0]
    assert plan(lambda: [set()] * 4, committed=0).source == "peer"  # step 0: every rank resets


def test_a_shard_crosses_processes_as_regions_of_a_shared_arena():
    """The courier's view of a shard: the layout (offsets, shapes, dtypes, python leaves) of a
    state carved from a shared arena rebuilds, over another mapping of that arena, tensors equal
    to those written, dtypes included; a tensor outside the arena is refused."""
    state = {"optimizer": [[torch.randn(3, 5), torch.tensor(7.0), torch.zeros(0)],
                           [torch.randn(4).to(torch.bfloat16)]], "sched_steps": 3, "step": 9}
    arena = SharedArena(4096, "test-regions")
    into = carve(state, arena.tensor)
    for d, s in zip(torch.utils._pytree.tree_leaves(into), torch.utils._pytree.tree_leaves(state)):
        if isinstance(s, torch.Tensor):
            d.copy_(s)
    other = from_regions(regions(into, arena.tensor), attach_shared(arena.path, arena.nbytes))
    assert other["step"] == 9 and other["sched_steps"] == 3
    for a, b in zip(torch.utils._pytree.tree_leaves(other), torch.utils._pytree.tree_leaves(state)):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(ValueError, match="not in the arena"):
        regions(state, arena.tensor)


def arena_mappers(pid: int) -> list[int]:
    """Pids of the processes that map or hold a shard arena of the rank with pid `pid`."""
    tag, out = f"memfd:shard-keeper-{pid}-", []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/maps") as f:
                if tag in f.read():
                    out.append(int(p))
        except OSError:  # gone, or another user's
            pass
    return out


def unmapped(pids: list[int], timeout_s: float = 60.0) -> bool:
    """Whether, within `timeout_s` (a liveness bound: a process ends a moment after Ray says
    so), no process maps an arena of the ranks with pids `pids`."""
    deadline = time.monotonic() + timeout_s
    while any(arena_mappers(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# -- real runs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    return reference_run(make_cfg(tmp_path_factory.mktemp("ref")), 4)


def test_a_lost_zero_rank_comes_back_from_a_peer_and_its_keeper(reference, tmp_path):
    """dp=2, ZeRO-1, rank 1 killed after step 2: parameters from rank 0, the optimizer shard
    from the keeper; losses and every rank's final state bitwise as the run without failure."""
    trainer, digests = run(make_cfg(tmp_path), kill_ranks=(1,))
    (tl,) = trainer.recoveries
    assert (tl.restore_source, tl.steps_lost, tl.restored_step) == ("peer+keeper", 0, 2)
    assert trainer.losses == reference[0]
    assert digests == reference[1]
    assert len(set(digests)) == 2  # ZeRO: the ranks hold different shards


@pytest.mark.slow
def test_without_the_keeper_a_zero_rank_comes_back_from_the_checkpoint(reference, tmp_path):
    """The same failure with `fault_tolerance.shard_keeper=false`: no peer holds rank 1's shard,
    so the checkpoint of step 1 (one optimizer shard per DP rank) is loaded and step 2 replayed,
    still bitwise (the test fails on today's engine if ZeRO's shards were broadcast as replicas)."""
    trainer, digests = run(make_cfg(tmp_path, "fault_tolerance.shard_keeper=false"), kill_ranks=(1,))
    (tl,) = trainer.recoveries
    assert (tl.restore_source, tl.steps_lost) == ("checkpoint step 1", 1)
    assert trainer.losses == reference[0]
    assert digests == reference[1]


@pytest.mark.slow
def test_dp4_two_lost_zero_ranks_come_back_from_peers_and_keepers(ray_session, tmp_path):
    """dp=4, ZeRO-1, ranks 1 and 2 killed: 0 steps lost, bitwise as the run without failure."""
    ref = reference_run(make_cfg(tmp_path / "ref", workers=4), 4)
    trainer, digests = run(make_cfg(tmp_path / "run", workers=4, spares=2), kill_ranks=(1, 2))
    (tl,) = trainer.recoveries
    assert (tl.restore_source, tl.steps_lost) == ("peer+keeper", 0)
    assert trainer.losses == ref[0]
    assert digests == ref[1]


@pytest.mark.slow
def test_the_keeper_bench_runs_on_cpu(tmp_path):
    """`python -m bench.keeper` on the torch engine: every step's shard kept, the JSON's keys."""
    import json

    out = tmp_path / "keeper.json"
    run_bench("keeper", "--blocks", "2", "--block-steps", "2", "--warmup", "1", "--breakdown", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["shard_fraction"] == 0.125 and r["kept_every_step"] is True and r["redundancy_overhead_ratio"] > 0
    kept = r["cases"]["1.0"]["kept"]
    assert kept["kept"] == {"sent": 6, "skipped": 0, "failed": 0} and kept["couriers"] == 1 and "cpu" in r["device"]
    assert len(kept["steps_s"]) == 4 and set(r["cases"]["0.125"]) >= {"off", "kept", "rollback", "copy"}
    assert 0 < kept["cpu_s"] and kept["gc_s"] >= 0



def test_a_killed_courier_is_replaced_and_a_sigkilled_rank_leaves_no_arena(reference, tmp_path):
    """dp=2, ZeRO-1: rank 1's courier killed after step 2 (a new one sends step 3, nothing
    failed or skipped); then rank 1 SIGKILLed once step 3's shards are kept: restored from peer
    + keeper with 0 steps lost, losses and final states bitwise as the run without failure.
    Its arenas go with it (its courier ends with its owner; no process maps them), and after
    the run no rank's arenas are mapped anywhere."""
    with two_steps(make_cfg(tmp_path)) as (group, trainer):
        rank1 = group.workers[1].handle
        courier = ray.get(rank1.__ray_call__.remote(lambda a: a._shards.courier))
        ray.kill(courier, no_restart=True)
        trainer.train(3)
        wait_for_shards(group, 3)
        pids = ray.get([w.handle.__ray_call__.remote(lambda a: os.getpid()) for w in group.workers])
        counts = ray.get([w.handle.__ray_call__.remote(lambda a: (a._shards.counts(), a._shards.couriers))
                          for w in group.workers])
        assert counts == [({"sent": 3, "skipped": 0, "failed": 0}, 1), ({"sent": 3, "skipped": 0, "failed": 0}, 2)]
        assert arena_mappers(pids[1])  # the rank and its courier
        new_courier = ray.get(rank1.__ray_call__.remote(lambda a: a._shards.courier))
        os.kill(pids[1], signal.SIGKILL)
        trainer.train(4)
        (tl,) = trainer.recoveries
        assert (tl.restore_source, tl.steps_lost, tl.restored_step) == ("peer+keeper", 0, 3)
        assert trainer.losses == reference[0]
        assert group.state_digests() == reference[1]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(new_courier.node_id.remote(), timeout=60)  # ended with the rank that owned it
        assert unmapped([pids[1]])
        pids += ray.get([w.handle.__ray_call__.remote(lambda a: os.getpid()) for w in group.workers])
    assert unmapped(pids)
