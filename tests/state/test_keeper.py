"""The shard keeper (keeper.py) with the torch engine's ZeRO-1 (`model.distributed_optimizer=true`):
every rank's optimizer shard is on no DP peer; its keeper (the holder of the next node) keeps a
copy after every step, and a replaced rank is restored from a DP peer (parameters) plus its
keeper (shard): 0 committed steps lost, no checkpoint read, the final state bitwise equal to the
run without failure. On one node the keeper adopts the rank's shared arenas (no courier, no
bytes through Ray); on two, the shard leaves the rank through shared memory and a courier process
(courier.py): a courier killed is replaced, and no arena outlives the run or a SIGKILLed rank.
At dp=1 the local keeper (the defaults) keeps each rank's whole state in arenas its node's holder
adopts: a SIGKILLed rank comes back from them with 0 steps lost, one killed inside the copy
window of the newest step re-runs that step from the previous one (never mixed state).
Real Ray actors, gloo groups and holders."""
import contextlib
import inspect
import os
import signal
import time

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.recovery.fault_tolerance import plan_restore
from ftrain.state.host_memory import SEAL_BYTES, SharedArena, attach_shared, carve, from_regions, regions
from ftrain.state.keeper import LocalMaps, adopts, keeper_node, local_key, shard_key
from ftrain.state.snapshots import SnapshotHolder, from_wire, wire_parts
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor

from conftest import megatron_cpu_cfg, own_ray, reference_run, run_bench, wait_for_shards

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
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


@pytest.mark.parametrize("nodes", [["a"], ["a", "b"], ["c", "a", "b"]])
def test_the_keeper_adopts_the_arenas_only_on_the_rank_s_own_node(nodes):
    """The holder adopts a rank's arenas (no courier) exactly when it runs on the rank's node:
    in the ring, only when there is one node; every keeper of another node gets them sent."""
    assert adopts("a", "a") and not adopts("b", "a")
    assert [adopts(keeper_node(n, nodes), n) for n in nodes] == [len(nodes) == 1] * len(nodes)


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
    """Pids of the processes that map a shard arena of the rank with pid `pid` or hold a
    descriptor of one (a holder that adopted it)."""
    tag, out = f"memfd:shard-keeper-{pid}-", []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/maps") as f:
                held = tag in f.read()
            held = held or any(tag in os.readlink(f"/proc/{p}/fd/{fd}") for fd in os.listdir(f"/proc/{p}/fd"))
        except OSError:  # gone, or another user's
            continue
        if held:
            out.append(int(p))
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


def holder_copy(holder, wrap) -> None:
    """Replace, in `holder`'s process, its copy of an adopted arena for `get`
    (`snapshots._cloned`, as its methods see it) by `wrap(the original, the holder)`."""
    def patch(h):
        names = inspect.unwrap(type(h).get).__globals__  # Ray wraps the methods
        names["_cloned"] = wrap(names["_cloned"], h)
    ray.get(holder.__ray_call__.remote(patch))


# slow: the killed-courier test restores a ZeRO-1 rank at dp=2 from peer + keeper in CI, and the
# Megatron distributed-optimizer test the keeper of its own node
@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 3])
def test_a_lost_zero_rank_comes_back_from_a_peer_and_the_keeper_of_its_node(dp, reference, tmp_path):
    """dp=2 and 3, ZeRO-1, one node: each rank's keeper is its own node's holder, which
    adopts the rank's shard arenas (no courier started; every step listed once sealed). Rank 1
    killed after step 2: parameters from rank 0, the shard through a mapping of the arena the
    holder adopted (the holder's copy path fails if asked), 0 steps lost, losses and every
    rank's final state bitwise as the run without failure; then the holder lists the newest two
    steps of every rank, the replacement's included (the dead rank's arenas dropped)."""
    sets = ("train.global_batch_size=12", "train.mini_batch_size=6") if dp == 3 else ()
    ref = reference if dp == 2 else reference_run(make_cfg(tmp_path / "ref", *sets, workers=3), 4)
    with two_steps(make_cfg(tmp_path / "run", *sets, workers=dp)) as (group, trainer):
        (holder,) = group.holders.values()
        keys = [shard_key(str(group.dims), r) for r in range(dp)]
        ray.get([w.handle.__ray_call__.remote(lambda a: a._shards.wait()) for w in group.workers])
        counts = ray.get([w.handle.__ray_call__.remote(lambda a: (a._shards.counts(), a._shards.adopt,
                                                                  a._shards.couriers)) for w in group.workers])
        assert counts == [({"sent": 2, "skipped": 0, "failed": 0}, True, 0)] * dp
        assert ray.get(holder.steps.remote()) == {k: [1, 2] for k in keys}
        def never_copied(original, h):  # nested: pickled by value into the holder's process
            def copy(state):
                raise AssertionError("the holder copied an adopted shard: a restore on its node maps it")
            return copy

        holder_copy(holder, never_copied)
        ray.kill(group.workers[1].handle, no_restart=True)
        trainer.train(4)
        (tl,) = trainer.recoveries
        assert (tl.restore_source, tl.steps_lost, tl.restored_step) == ("peer+keeper", 0, 2)
        assert trainer.losses == ref[0]
        assert group.state_digests() == ref[1]
        assert len(set(ref[1])) == dp  # ZeRO: the ranks hold different shards
        ray.get([w.handle.__ray_call__.remote(lambda a: a._shards.wait()) for w in group.workers])
        assert ray.get(holder.steps.remote()) == {k: [3, 4] for k in keys}
        assert not any(ray.get(w.handle.__ray_call__.remote(lambda a: a._shards.couriers)) for w in group.workers)


def written(state: dict, step: int, name: str) -> tuple[SharedArena, object]:
    """A retired `SharedArena` with `state`'s tensors written after its seal bytes, as a
    `ShardSender` writes one, and the layout (`regions`) of `state` at `step` in it."""
    arena = SharedArena(4096, f"test-adopt-{name}")
    into = carve(state, arena.tensor[SEAL_BYTES:])
    for d, x in zip(state_leaves(into), state_leaves(state)):
        d.copy_(x)
    arena.retire()
    return arena, regions({**into, "step": step}, arena.tensor)


def state_leaves(state) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(state) if isinstance(x, torch.Tensor)]


def test_an_adopted_shard_reaches_another_node_as_a_copy_never_from_a_retired_arena(ray_session):
    """An optimizer shard its keeper adopted (the keeper on the rank's node) is listed with the
    steps sent to the same key; `get` (what a replacement on another node calls) serves it as a
    copy in wire form, bytes, dtypes and python leaves as written, while sealed; not once
    retired, nor when retired while the holder copies it; a sent step is served as before."""
    holder, key = SnapshotHolder.remote(), shard_key("L", 1)
    state = {"optimizer": {"state": {0: {"exp_avg": torch.randn(3, 5), "step": torch.tensor(7.0)}},
                           "bf16": [torch.randn(4).to(torch.bfloat16)]}, "step": 7}
    meta, parts = wire_parts({**state, "step": 6})  # step 6 sent by a courier
    ray.get(holder.put_part.remote(key, 6, 0, len(parts), meta, parts[0]))
    a, layout = written(state, 7, "shard")
    ray.get(holder.adopt.remote(key, 1, 0, a.path, a.nbytes, 7, layout))
    assert ray.get(holder.steps.remote()) == {key: [6]} and ray.get(holder.get.remote(key, 7)) is None
    a.seal(7)
    assert ray.get(holder.steps.remote()) == {key: [6, 7]}
    got = from_wire(ray.get(holder.get.remote(key, 7)))
    assert got["step"] == 7 and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(state_leaves(got), state_leaves(state)))
    assert from_wire(ray.get(holder.get.remote(key, 6)))["step"] == 6
    a.retire()
    assert ray.get(holder.get.remote(key, 7)) is None and ray.get(holder.steps.remote()) == {key: [6]}
    a.seal(7)

    def retiring(original, h):  # the owner retires the arena while the holder copies it
        def copy(state):
            out = original(state)
            for x in h._local[key].values():
                os.pwrite(x.arena.fd, (-1).to_bytes(8, "little", signed=True), 0)
            return out
        return copy

    holder_copy(holder, retiring)
    assert ray.get(holder.get.remote(key, 7)) is None and a.sealed() == -1
    ray.kill(holder)


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
    """`python -m bench.keeper` on the torch engine: every step's shard kept, adopted by the holder
    of this host (no courier started), the JSON's keys."""
    import json

    out = tmp_path / "keeper.json"
    run_bench("keeper", "--blocks", "2", "--block-steps", "2", "--warmup", "1", "--breakdown", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["shard_fraction"] == 0.125 and r["kept_every_step"] is True and r["redundancy_overhead_ratio"] > 0
    kept = r["cases"]["1.0"]["kept"]
    assert kept["kept"] == {"sent": 6, "skipped": 0, "failed": 0} and "cpu" in r["device"]
    assert kept["adopted"] is True and kept["couriers"] == 0
    assert len(kept["steps_s"]) == 4 and set(r["cases"]["0.125"]) >= {"off", "kept", "rollback", "copy"}
    assert 0 < kept["cpu_s"] and kept["gc_s"] >= 0



# -- the local keeper (dp=1) -----------------------------------------------------------------------
def local_cfg(tmp_path, *overrides):
    """The defaults at dp=1 (1 worker + 1 spare; `fault_tolerance.shard_keeper` on, no sharded
    optimizer), checkpoints only where a test saves one. A spare silent for 30 s (not 5) is
    dropped: on a loaded test machine the one spare missed its pings and the recovery had none."""
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=1", "cluster.num_spares=1", "checkpoint.interval=0",
        "fault_tolerance.refill_spares=false", "fault_tolerance.health_timeout_s=30",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", *overrides]), num_gpus=0)


def wait_for_local(group, step: int, timeout_s: float = 30.0) -> None:
    """Block until every rank's node's holder keeps that rank's state of `step` complete (the
    copy runs beside the next step: a kill right after the step could land inside it)."""
    deadline = time.monotonic() + timeout_s
    while not all(step in group.held_snapshots().get(local_key(str(group.dims), r, s.node_id), ())
                  for r, s in enumerate(group.workers)):
        assert time.monotonic() < deadline, f"state of step {step} not kept: {group.held_snapshots()}"
        time.sleep(0.05)


def test_a_holder_serves_an_adopted_arena_only_while_sealed_and_drops_it_for_a_newer_owner(ray_session):
    """`SnapshotHolder.adopt`: an arena is served for a step only once sealed with it, through
    the holder's own descriptor (the owner's closed), with the bytes and python leaves written;
    a replacement owner's arenas replace it once one of them holds a newer complete step; a
    rewind drops the later steps."""
    holder, key = SnapshotHolder.remote(), local_key("L", 0, "node")
    state = {"model": [torch.randn(3, 5), torch.randn(4).to(torch.bfloat16)], "step": 7}
    a, layout = written(state, 7, "a")
    ray.get(holder.adopt.remote(key, 1, 0, a.path, a.nbytes, 7, layout))
    assert ray.get(holder.steps.remote()) == {}  # not sealed: being written
    a.seal(7)
    assert ray.get(holder.steps.remote()) == {key: [7]} and ray.get(holder.local.remote(key, 6)) is None
    found = ray.get(holder.local.remote(key, 7))
    path, nbytes, layout = found["path"], found["nbytes"], found["layout"]
    assert (found["owner"], found["index"], found["arenas"]) == (1, 0, {0: path})
    a.close()
    got = from_regions(layout, attach_shared(path, nbytes))
    assert got["step"] == 7 and all(torch.equal(x, y) for x, y in zip(got["model"], state["model"]))
    maps = LocalMaps(5.0)  # a spare's mappings of them, made ahead
    maps.refresh(ray.get(holder.arenas.remote()))
    assert len(maps) == 1 and torch.equal(maps.view(path), attach_shared(path, nbytes))
    maps.refresh({})
    assert len(maps) == 0 and maps.view(path) is None
    b, layout_b = written(state, 8, "b")
    ray.get(holder.adopt.remote(key, 2, 0, b.path, b.nbytes, 8, layout_b))
    b.seal(8)
    assert ray.get(holder.steps.remote()) == {key: [7, 8]}  # the old owner's stays until the new one has two
    c, layout_c = written(state, 9, "c")
    ray.get(holder.adopt.remote(key, 2, 1, c.path, c.nbytes, 9, layout_c))
    assert ray.get(holder.steps.remote()) == {key: [8]}
    c.seal(9)
    ray.get(holder.drop_after.remote(8, 1))
    assert ray.get(holder.steps.remote()) == {key: [8]}
    ray.kill(holder)


@pytest.fixture(scope="module")
def reference1(ray_session, tmp_path_factory):
    return reference_run(local_cfg(tmp_path_factory.mktemp("ref1")), 5)


def test_at_dp1_a_sigkilled_rank_comes_back_from_its_nodes_holder(reference1, tmp_path):
    """The defaults at dp=1, the rank SIGKILLed after step 3 (a checkpoint of step 1 exists):
    restored from the arena its node's holder adopted (source `local`, no checkpoint read),
    0 steps lost, losses and final state bitwise as the run without failure. The spare loads
    from its own mapping of the dead rank's arena, made ahead, and then keeps the next steps in
    the dead rank's two arenas (`ShardSender.take_over`: the holder lists the same memory
    files); none is left anywhere after the run."""
    group = ActorGroup(MegatronActor, local_cfg(tmp_path))
    try:
        trainer = Trainer(group.cfg, group, CheckpointManager.from_config(group.cfg.checkpoint))
        trainer.train(1)
        trainer.save(1)
        trainer.train(3)
        wait_for_local(group, 3)
        spare = group.pool.spares[0].handle
        deadline = time.monotonic() + 30  # liveness bound: the spare maps them within a second
        while ray.get(spare.__ray_call__.remote(lambda a: len(a._local_maps))) < 2:
            assert time.monotonic() < deadline, "the spare did not map its node's two kept arenas"
            time.sleep(0.2)
        (holder,) = group.holders.values()
        kept = set(ray.get(holder.arenas.remote()))
        pid = ray.get(group.workers[0].handle.__ray_call__.remote(lambda a: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        trainer.train(5)
        (tl,) = trainer.recoveries
        assert (tl.restore_source, tl.steps_lost, tl.restored_step) == ("local", 0, 3)
        assert not any("mapped at restore time" in n for n in tl.notes) and set(tl.restore_detail) == {
            "plan_s", "find_s", "load_s", "unmap_s"}
        assert not any("did not take over" in n for n in tl.notes)
        assert ray.get(spare.__ray_call__.remote(lambda a: len(a._local_maps))) == 0  # taken over or unmapped
        assert trainer.losses == reference1[0] and not trainer.replayed
        assert group.state_digests() == reference1[1]
        assert set(ray.get(holder.arenas.remote())) == kept  # steps 4, 5 kept in the dead rank's arenas
        pids = [pid, ray.get(group.workers[0].handle.__ray_call__.remote(lambda a: os.getpid()))]
    finally:
        group.shutdown()
    assert unmapped(pids)


def kill_inside_the_copy_window(rank, step: int) -> None:
    """SIGKILL the rank actor `rank` as if its keeper copy of `step` were still in flight: the
    arena sealed with that step retired first (the holder no longer serves it)."""
    ray.get(rank.__ray_call__.remote(
        lambda a: [f.result().retire() for f in a._shards._arenas if f.result().sealed() == step]))
    os.kill(ray.get(rank.__ray_call__.remote(lambda a: os.getpid())), signal.SIGKILL)


@pytest.mark.slow
def test_at_dp1_a_rank_lost_inside_the_copy_window_reruns_one_step_from_its_holder(reference1, tmp_path):
    """As above, but the arena of step 3 retired as the copy of step 3 leaves it while in
    flight: the holder serves step 2 (source `local step 2`), step 3 is run again, and losses
    (the re-run's too) and the final state are bitwise as the run without failure."""
    group = ActorGroup(MegatronActor, local_cfg(tmp_path))
    try:
        trainer = Trainer(group.cfg, group, CheckpointManager.from_config(group.cfg.checkpoint))
        trainer.train(3)
        wait_for_local(group, 3)
        kill_inside_the_copy_window(group.workers[0].handle, 3)
        trainer.train(5)
        (tl,) = trainer.recoveries
        assert (tl.restore_source, tl.steps_lost, tl.restored_step) == ("local step 2", 1, 2)
        assert trainer.losses == reference1[0] and trainer.replayed == {3: [reference1[0][3]]}
        assert group.state_digests() == reference1[1]
    finally:
        group.shutdown()


@pytest.mark.slow
def test_the_recovery_bench_measures_the_defaults_at_dp1_on_cpu(tmp_path):
    """`python -m bench.recovery` as issue item 8's measurement, small: the defaults, 1 worker
    + 1 spare (refilled between repeats), the rank killed mid-step twice: restored from its
    node's holder, the JSON's keys, bitwise as the run without failure."""
    import json

    out = tmp_path / "recovery.json"
    run_bench("recovery", "--repeats", "2", "--full-restarts", "0", "--set", "cluster.num_workers=1",
              "--set", "cluster.num_spares=1", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["defaults_only"] is True and "cpu" in r["device"] and r["save_stall_s"] > 0
    assert len(r["restore_sources"]) == 2 and all(s.startswith("local") for s in r["restore_sources"])
    assert r["steps_lost"] <= 1 and r["recovery_s"] > 0  # 1: a kill inside the copy window of the newest step
    assert r["matches_reference"] == {"losses": True, "state": True}


def _local_keeper_rank(proc: int, world: int, store, tp: int) -> dict:
    """Rank `proc` of a Megatron engine at tp=`tp`, dp=1 on gloo: trains steps 1-2, copies its
    whole state into a shared arena as the local keeper does (`start_shard_copy(whole=True)`,
    sealed), records the uninterrupted steps 3-4, then a fresh engine in a new generation (every
    rank position replaced) loads the arena through another mapping and trains steps 3-4."""
    import torch.distributed as dist
    from test_megatron_peer_restore import _cfg, _train

    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines.megatron_engine import MegatronEngine

    torch.set_num_threads(1)
    cfg = _cfg(1, tp)
    dims = ParallelDims.from_config(cfg)

    def joined(gen):
        engine = MegatronEngine(cfg)
        engine.connect(dist.PrefixStore(f"gen{gen}", store), dims, proc)
        return engine

    e = joined(1)
    _train(e, cfg, dims, proc, (1, 2))
    arena = SharedArena(e.shard_nbytes(True) + SEAL_BYTES, "shard-keeper-test-megatron")
    arena.retire()
    copy = e.start_shard_copy(arena.tensor[SEAL_BYTES:], True)
    layout = regions(copy.state, arena.tensor)
    reference = _train(e, cfg, dims, proc, (3, 4))
    copy.wait()
    arena.seal(2)
    e = None
    dist.destroy_process_group()
    e = joined(2)
    e.load_state(from_regions(layout, attach_shared(arena.path, arena.nbytes)))
    out = {"step": e.step, "reference": reference, "resumed": _train(e, cfg, dims, proc, (3, 4))}
    dist.destroy_process_group()
    return out


def _rollback_rank(proc: int, world: int, store) -> dict:
    """A Megatron engine at dp=1 on gloo (no distributed optimizer: it keeps a rollback
    snapshot) whose local keeper copied step 2's whole state into an arena: the snapshot at the
    start of step 3 copies no tensor again (it takes them from the arena), and a rollback to
    step 2 from it is bitwise step 2; once the step has changed (the rollback sets it) the next
    snapshot copies the state into its own buffers again, and rolls back as bitwise."""
    import torch.distributed as dist
    from test_megatron_engine import _batch, _digest
    from test_megatron_peer_restore import _cfg, _train

    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.state.host_memory import state_tensors

    torch.set_num_threads(1)
    cfg = _cfg(1, 1)
    dims = ParallelDims.from_config(cfg)
    e = MegatronEngine(cfg)
    e.connect(dist.PrefixStore("gen1", store), dims, proc)
    _train(e, cfg, dims, proc, (1, 2))
    step2 = _digest(e)
    arena = SharedArena(e.shard_nbytes(True) + SEAL_BYTES, "shard-keeper-test-rollback")
    e.start_shard_copy(arena.tensor[SEAL_BYTES:], True)
    lo, hi = arena.tensor.data_ptr(), arena.tensor.data_ptr() + arena.nbytes

    def in_arena() -> list[bool]:
        return sorted({lo <= x.data_ptr() < hi for x in state_tensors(e._snapshot)})

    out = {}
    for case in ("kept", "own"):
        e.snapshot()
        out[case] = in_arena()
        first = e.train_step(_batch(cfg, 3, dims, proc), 3)
        out[case, "rollback"] = e.rollback(2) and _digest(e) == step2
        again = e.train_step(_batch(cfg, 3, dims, proc), 3)
        out[case, "same_step_3"] = (first["loss"], first["grad_norm"]) == (again["loss"], again["grad_norm"])
        e.rollback(2)
    dist.destroy_process_group()
    return out


def assert_restored_after_step_3(cfg, kill, source: str) -> None:
    """Train `cfg` to step 3, `kill(group)` (after waiting for what the kill must not race),
    train to step 5: one recovery, from `source`, of step 3 (0 steps lost), and the losses and
    final states bitwise as the run of `cfg` without failure."""
    ref_losses, ref_digests = reference_run(cfg, 5)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(3)
        kill(group)
        trainer.train(5)
        (tl,) = trainer.recoveries
        assert (tl.restore_source, tl.steps_lost, tl.restored_step) == (source, 0, 3)
        assert trainer.losses == ref_losses and group.state_digests() == ref_digests
    finally:
        group.shutdown()


def _distributed_optimizer_rank(proc: int, world: int, store) -> dict:
    """Rank `proc` of dp=2 with Megatron's distributed optimizer on gloo (`cpu_stand_ins`): it
    trains as the plain optimizer does (the update is elementwise; only the gradient reduction
    differs: losses within fp32 round-off); the rollback snapshot at the start of step 3 copies
    no tensor: it takes the optimizer shard from the keeper's copy of step 2 (a shared arena)
    and no params (they are the cast of the shard's main params); after a rollback to step 2 a
    step is refused until `sync_params` (both ranks) rebuilt the params, then the state is
    bitwise step 2's, and step 3 trains the same again."""
    import torch.distributed as dist
    from test_megatron_engine import _batch, _digest
    from test_megatron_peer_restore import _cfg, _train

    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.state.host_memory import state_tensors

    torch.set_num_threads(1)
    out = {}
    for gen, dist_opt in enumerate((False, True)):
        cfg = _cfg(world, 1, dist_opt)
        dims = ParallelDims.from_config(cfg)
        e = MegatronEngine(cfg)
        e.connect(dist.PrefixStore(f"gen{gen}", store), dims, proc)
        out[dist_opt] = _train(e, cfg, dims, proc, (1, 2))
        if dist_opt:
            step2 = _digest(e)
            arena = SharedArena(e.shard_nbytes(), "shard-keeper-test-distopt")
            e.start_shard_copy(arena.tensor)
            e.snapshot()
            lo, hi = arena.tensor.data_ptr(), arena.tensor.data_ptr() + arena.nbytes
            out["in_arena"] = {part: sorted({lo <= x.data_ptr() < hi for x in state_tensors(e._snapshot[part])})
                               for part in ("model", "optimizer") if part in e._snapshot}
            first = e.train_step(_batch(cfg, 3, dims, proc), 3)
            out["rollback"] = e.rollback(2)
            try:
                e.train_step(_batch(cfg, 3, dims, proc), 3)
            except RuntimeError as exc:
                out["refused"] = "sync_params" in str(exc)
            e.sync_params()
            out["restored"] = _digest(e) == step2
            again = e.train_step(_batch(cfg, 3, dims, proc), 3)
            out["same_step_3"] = (first["loss"], first["grad_norm"]) == (again["loss"], again["grad_norm"])
        e.disconnect()  # ends its process group
    return out


def test_megatron_s_distributed_optimizer_rolls_back_from_the_keepers_copy_on_cpu():
    from ranks import spawn_ranks

    for r in spawn_ranks(_distributed_optimizer_rank, 2, timeout_s=300):
        flat = {k: [x for step in r[k] for x in step] for k in (True, False)}  # (loss, grad norm) per step
        assert flat[True] == pytest.approx(flat[False], rel=1e-5), r
        assert r["in_arena"] == {"optimizer": [True]} and r["rollback"] and r["refused"], r
        assert r["restored"] and r["same_step_3"], r


@pytest.mark.parametrize("tp, dp, killed", [
    (1, 2, (1,)),
    pytest.param(2, 3, (3,), marks=pytest.mark.slow),
    pytest.param(1, 3, (0, 2), marks=pytest.mark.slow),
])
def test_megatron_actors_with_the_distributed_optimizer_restore_killed_ranks_from_peers_and_keepers(
        ray_session, tmp_path, tp, dp, killed):
    """The default GPU configuration's path (the Megatron engine, its distributed optimizer, the
    shard keeper) with `MegatronActor`s on CPU (gloo, `conftest.megatron_cpu_cfg`), tp x dp
    workers + one spare per rank killed after step 3: the killed ranks come back as
    `peer+keeper` (the params from a DP peer, each optimizer shard from its keeper; survivors
    rolled back from their snapshots, whose shards are their own keeper copies), 0 steps lost,
    losses and final states bitwise as the run without failure. CI: dp=2; slow: tp=2 at dp=3,
    and two ranks of one DP group at dp=3."""
    cfg = megatron_cpu_cfg(tmp_path, "model.distributed_optimizer=true", f"parallel.tp={tp}",
                           f"cluster.num_workers={tp * dp}", f"cluster.num_spares={len(killed)}", "train.steps=5",
                           "fault_tolerance.refill_spares=false", f"train.global_batch_size={2 * dp}",
                           f"train.mini_batch_size={2 * dp}")

    def kill(group):
        wait_for_shards(group, 3)
        for r in killed:
            ray.kill(group.workers[r].handle, no_restart=True)
    assert_restored_after_step_3(cfg, kill, "peer+keeper")


def test_megatron_s_rank_lost_inside_its_keepers_copy_window_reruns_one_step_from_the_keepers(ray_session, tmp_path):
    """Megatron's distributed optimizer at dp=2 (gloo) with the shard keeper; rank 1's copy of
    step 3 is lost in flight (its arena retired before the holder listed it) and rank 1 is
    SIGKILLed: no keeper holds its shard of step 3, so no peer restore; every rank loads its
    shard of step 2 from its keeper and takes its params from the shards (`keeper step 2`):
    one step re-run instead of the steps since the checkpoint, and the losses (the re-run's
    too) and every rank's final state bitwise as the run without failure."""
    cfg = megatron_cpu_cfg(tmp_path, "model.distributed_optimizer=true", "cluster.num_workers=2",
                           "cluster.num_spares=1", "train.steps=5", "fault_tolerance.refill_spares=false",
                           "checkpoint.interval=0")
    ref_losses, ref_digests = reference_run(cfg, 5)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(3)
        assert trainer.kept_step >= 1  # what a rank lost now comes back to (`event=step ... kept_step`)
        wait_for_shards(group, 3)
        kill_inside_the_copy_window(group.workers[1].handle, 3)
        trainer.train(5)
        (tl,) = trainer.recoveries
        assert (tl.restore_source, tl.steps_lost, tl.restored_step) == ("keeper step 2", 1, 2), tl.notes
        assert trainer.kept_step in (3, 4, 5)  # the new membership's copies: from its first step (3) on
        assert trainer.losses == ref_losses and trainer.replayed == {3: [ref_losses[3]]}
        assert group.state_digests() == ref_digests
    finally:
        group.shutdown()


def test_the_rollback_snapshot_takes_what_the_keeper_copied_of_the_same_step():
    from ranks import spawn_ranks

    (r,) = spawn_ranks(_rollback_rank, 1, timeout_s=300)
    assert r == {"kept": [True], ("kept", "rollback"): True, ("kept", "same_step_3"): True,
                 "own": [False], ("own", "rollback"): True, ("own", "same_step_3"): True}, r


@pytest.mark.slow
def test_megatron_at_tp2_dp1_resumes_bitwise_from_its_whole_state_in_an_arena():
    """The Megatron engine's side of the local keeper (CPU, gloo, fp32, no distributed
    optimizer: at dp=1 the local keeper copies the whole state either way): both rank positions of tp=2 at dp=1 replaced and loaded
    from their arenas train steps 3-4 exactly as the uninterrupted run."""
    from ranks import spawn_ranks

    for r in spawn_ranks(_local_keeper_rank, 2, 2, timeout_s=300):
        assert r["step"] == 2 and r["resumed"] == r["reference"]


@pytest.mark.slow
def test_megatron_actors_at_tp2_dp1_restore_a_sigkilled_rank_from_its_nodes_holder(ray_session, tmp_path):
    """The protocol with `MegatronActor`s running the Megatron engine on CPU (gloo; the config is
    resolved as for a GPU and set to the CPU after: `conftest.megatron_cpu_cfg`), tp=2,
    dp=1, 2 workers + 1 spare: rank 1 SIGKILLed after step 3 comes back from its node's holder
    (`local`, 0 steps lost; rank 0 rolled back locally), losses and final states bitwise as the
    run without failure."""
    cfg = megatron_cpu_cfg(tmp_path, "cluster.num_workers=2", "cluster.num_spares=1", "parallel.tp=2",
                           "train.steps=5", "fault_tolerance.refill_spares=false")

    def kill(group):
        wait_for_local(group, 3)
        os.kill(ray.get(group.workers[1].handle.__ray_call__.remote(lambda a: os.getpid())), signal.SIGKILL)
    assert_restored_after_step_3(cfg, kill, "local")


# -- two nodes: the courier ------------------------------------------------------------------------
@pytest.fixture
def two_nodes():
    """Two Ray nodes on this machine (`ray.cluster_utils.Cluster`; a Ray of this test's own,
    last in the module), so each rank's keeper is the holder of the other node."""
    own_ray()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=4)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield c
    ray.shutdown()
    c.shutdown()


def test_a_killed_courier_is_replaced_and_a_sigkilled_rank_leaves_no_arena(reference, two_nodes, tmp_path):
    """dp=2, ZeRO-1, two nodes: every rank's shard is sent by its courier to the holder of the
    other node. Rank 1's courier killed after step 2 (a new one sends step 3, nothing failed or
    skipped); then rank 1 SIGKILLed once step 3's shards are kept: restored from peer + keeper
    with 0 steps lost, losses and final states bitwise as the run without failure. Its arenas go
    with it (its courier ends with its owner; no process maps them), and after the run no
    rank's arenas are mapped anywhere."""
    with two_steps(make_cfg(tmp_path, "cluster.num_nodes=2")) as (group, trainer):
        assert all(ray.get(group.holder_for(w.node_id).node_id.remote()) != w.node_id for w in group.workers)
        rank1 = group.workers[1].handle
        courier = ray.get(rank1.__ray_call__.remote(lambda a: a._shards.courier))
        ray.kill(courier, no_restart=True)
        trainer.train(3)
        wait_for_shards(group, 3)
        pids = ray.get([w.handle.__ray_call__.remote(lambda a: os.getpid()) for w in group.workers])
        # A keeper holds a shard a moment before the rank's send thread counts it: counted once ended.
        ray.get([w.handle.__ray_call__.remote(lambda a: a._shards.wait()) for w in group.workers])
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
