"""Integration: real local Ray, real gloo process groups, real checkpoints on disk.

The demo scenario with 2 workers + 2 spares: a DP replica is killed with `ray.kill`, detected,
replaced by a pre-warmed spare, groups rebuilt, state restored (from peers, or from the newest
committed checkpoint with replay), and the per-step losses equal a no-failure run bitwise.
"""

import contextlib
import dataclasses
import threading

import pytest
import ray

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor

from conftest import reference_run, wait_for_senders, wait_for_snapshots


def make_cfg(tmp_path, *overrides, spares: int = 1):
    """`spares`: what the test needs, no more (each spare is an actor start of seconds); no
    refills (an actor start competing with the recovery; the spare pool is not checked here)."""
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", f"cluster.num_spares={spares}", "checkpoint.interval=0",
        "fault_tolerance.refill_spares=false",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", *overrides]), num_gpus=0)


def run(cfg, kill_rank=None, half_written_step=None, kill_ranks=(), after_step_2=None, at_end=None):
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        wait_for_senders(group)
        trainer.train(1)
        trainer.save(1)
        trainer.train(2)
        if half_written_step is not None:  # every rank writes its shards; the driver never commits
            group.call("save_checkpoint", half_written_step)
        if after_step_2 is not None:
            after_step_2(trainer)
        if cfg.fault_tolerance.memory_snapshot_interval:  # step 2's snapshots are held before step 3
            wait_for_snapshots(group, 2)
        for r in [kill_rank] if kill_rank is not None else kill_ranks:
            ray.kill(group.workers[r].handle, no_restart=True)
        trainer.train(4)
        if at_end is not None:
            at_end(trainer)
        digests = group.state_digests()
        return trainer, digests, len(group.pool)
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    return reference_run(make_cfg(tmp_path_factory.mktemp("ref")), 4)


def _model_ids(group) -> list[int]:
    """Each rank's id() of its engine's model object (`__ray_call__` runs in the actor)."""
    return ray.get([s.handle.__ray_call__.remote(lambda actor: id(actor.engine.module)) for s in group.workers])


def _agent_calls(group) -> list[int]:
    """The newest call id each node agent took (`NodeAgent.call`): the driver's step calls it carried."""
    return ray.get([a.__ray_call__.remote(lambda agent: agent._latest) for a in group.agents.values()])


def test_peer_restore_matches_bitwise(reference, tmp_path):
    """A rank killed after step 2: the steps, sent through the node's agent (which derives each
    rank's arguments and answers with one summary), end bitwise equal to the run without."""
    ids = {}
    trainer, digests, spares = run(make_cfg(tmp_path, spares=2), kill_rank=1,
                                   after_step_2=lambda t: ids.setdefault("before", _model_ids(t.group)),
                                   at_end=lambda t: ids.update(after=_model_ids(t.group), calls=_agent_calls(t.group)))
    assert trainer.losses == reference[0]
    assert ids["calls"] and min(ids["calls"]) >= 4  # every step (4, one re-run after the kill) through the agent
    assert ids["before"][0] == ids["after"][0]  # the survivor kept its model object
    assert digests == reference[1]  # final weights identical on every rank
    (tl,) = trainer.recoveries
    assert (tl.kind, tl.failed_ranks, tl.restore_source, tl.steps_lost) == ("crash", [1], "peer", 0)
    assert spares == 1
    assert (tmp_path / "recoveries.jsonl").read_text().count("\n") == 1


@pytest.mark.slow
def test_memory_restore_when_every_rank_is_lost(reference, tmp_path):
    """Both ranks (every DP replica) are killed: no peer holds the state, the in-memory
    snapshots of step 2 held by the SnapshotHolder are restored: 0 steps lost, bitwise equal."""
    trainer, digests, spares = run(make_cfg(tmp_path, "fault_tolerance.memory_snapshot_interval=1", spares=2),
                                   kill_ranks=(0, 1))
    (tl,) = trainer.recoveries
    assert (tl.failed_ranks, tl.restore_source, tl.restored_step, tl.steps_lost) == ([0, 1], "memory", 2, 0)
    assert trainer.losses == reference[0] and not trainer.replayed
    assert digests == reference[1]


def test_checkpoint_restore_skips_half_written_and_replays(reference, tmp_path):
    trainer, digests, _ = run(make_cfg(tmp_path, "fault_tolerance.restore=checkpoint"),
                              kill_rank=0, half_written_step=2)
    (tl,) = trainer.recoveries
    assert tl.restore_source == "checkpoint step 1" and tl.restored_step == 1 and tl.steps_lost == 1
    assert trainer.losses == reference[0]
    assert trainer.replayed == {2: [reference[0][2]]}  # the replayed step computed the same loss
    assert digests == reference[1]


def test_a_checkpoint_that_does_not_load_falls_back_to_an_older_one(reference, tmp_path, caplog):
    """Checkpoint step 2 verifies (its manifest lists the files as they are) but its model shard
    lacks the model's keys: the load fails naming the step and a key, no spare is spent on it,
    recovery loads step 1 instead and replays step 2, bitwise as the run without failure."""
    def commit_a_bad_step_2(trainer):
        ckpt = trainer.ckpt
        trainer.save(2)
        m = ckpt.read_manifest(2)
        files = [f for f in m.files if not f.path.startswith("model/")] + ckpt.save_shard(2, "model", {"step": 2})
        ckpt.commit(2, m.layout, files, m.extra)
        assert ckpt.verify(2) == []

    trainer, digests, spares = run(make_cfg(tmp_path, "fault_tolerance.restore=checkpoint", spares=2), kill_rank=0,
                                   after_step_2=commit_a_bad_step_2)
    (tl,) = trainer.recoveries
    assert (tl.failed_ranks, tl.restore_source, tl.attempts) == ([0], "checkpoint step 1", 1)
    assert "checkpoint step 2 does not load" in tl.notes and spares == 1
    warning = next(r.getMessage() for r in caplog.records if "does not load" in r.getMessage())
    assert "step_00000002/model" in warning and "Missing key" in warning, warning
    assert trainer.losses == reference[0] and trainer.replayed == {2: [reference[0][2]]}
    assert digests == reference[1]


@pytest.mark.parametrize("allow", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_no_source_of_the_committed_step_stops_unless_a_restart_from_scratch_is_allowed(reference, tmp_path, allow):
    """Every rank is killed after step 2 with no checkpoint and no memory snapshot: nothing holds
    the committed step. By default the run stops with a RecoveryError naming the field to set;
    with `fault_tolerance.allow_restart_from_scratch` every rank restarts from the initial state
    and steps 1-2 are replayed, bitwise as the run without failure."""
    from ftrain.failures import RecoveryError

    cfg = make_cfg(tmp_path, f"fault_tolerance.allow_restart_from_scratch={str(allow).lower()}", spares=2)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(2)
        for r in (0, 1):
            ray.kill(group.workers[r].handle, no_restart=True)
        if not allow:
            with pytest.raises(RecoveryError, match="committed step 2.*allow_restart_from_scratch=true"):
                trainer.train(4)
            assert trainer.committed_step == 2
            return
        trainer.train(4)
        (tl,) = trainer.recoveries
        assert (tl.restore_source, tl.restored_step, tl.steps_lost) == ("initial", 0, 2)
        assert trainer.losses == reference[0] and trainer.replayed == {s: [reference[0][s]] for s in (1, 2)}
        assert group.state_digests() == reference[1]
    finally:
        group.shutdown()


def test_a_memory_restore_after_a_rewind_never_takes_the_abandoned_timeline(reference, tmp_path):
    """Steps 2-4 run with other data (another seed: an abandoned timeline, held by the snapshot
    holders), then every rank rewinds to checkpoint step 1 (`resume`) and steps 2-4 run again
    with the run's data. Rank 0 is killed half-way through its snapshot of step 3, so a memory
    restore must not give it the abandoned timeline's step 3 (held since before the rewind) while
    rank 1 holds the new one's: the holders dropped it at the rewind, the restore takes step 2
    of this timeline for every rank, and the final state is bitwise the run without failure."""
    cfg = make_cfg(tmp_path, "fault_tolerance.memory_snapshot_interval=1", "fault_tolerance.restore=memory")
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        wait_for_senders(group)
        trainer.train(1)
        trainer.save(1)
        trainer.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=cfg.train.seed + 1))
        trainer.train(4)
        wait_for_snapshots(group, 4)
        trainer.cfg = cfg
        assert trainer.resume(1) == 1
        trainer.train(2)
        wait_for_senders(group)  # step 2's send is over: the fault hits step 3's
        group.arm_fault(0, "kill", "mid_snapshot")
        trainer.train(4)
        (tl,) = trainer.recoveries
        assert tl.failed_ranks == [0] and tl.restored_step <= 2
        assert {s: trainer.replayed[s][-1] for s in (2, 3, 4)} == {s: reference[0][s] for s in (2, 3, 4)}
        assert group.state_digests() == reference[1]
    finally:
        group.shutdown()


# slow: test_slow_storage.py restores from S3 in CI (through a throttled link), and
# test_checkpoint.py saves and loads through both fsspec backends
@pytest.mark.slow
@pytest.mark.parametrize("storage", ["s3", "gcs"])
def test_checkpoint_restore_from_object_storage(reference, tmp_path, storage, request):
    """Resumed from an S3 / GCS checkpoint (loopback servers), async save: same losses as the
    run without failure (and so as a resume from local disk, tested above)."""
    server = request.getfixturevalue(f"{storage}_server")
    cfg = make_cfg(tmp_path, "fault_tolerance.restore=checkpoint", "checkpoint.async_save=true",
                   f"checkpoint.uri={server.uri(tmp_path.name)}")
    trainer, digests, _ = run(cfg, kill_rank=1)
    (tl,) = trainer.recoveries
    assert tl.restore_source == "checkpoint step 1" and trainer.checkpoints == [1]
    assert trainer.losses == reference[0] and digests == reference[1]


@contextlib.contextmanager
def _s3_outage(server, seconds: float | None = None):
    """The S3 server is down inside the block, or for `seconds` from its start (restarted by a
    timer thread, while the block may still run); up again when the block ends."""
    server.stop()
    timer = threading.Timer(seconds, server.start) if seconds is not None else None
    if timer is not None:
        timer.start()
    try:
        yield
    finally:
        if timer is None:
            server.start()
        else:
            timer.join()


def test_storage_outage_skips_save_and_training_goes_on(reference, tmp_path, s3_server):
    cfg = make_cfg(tmp_path, "checkpoint.interval=1", "checkpoint.retry_budget_s=2",
                   f"checkpoint.uri={s3_server.uri(tmp_path.name)}", spares=0)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(2)
        with _s3_outage(s3_server):
            trainer.train(3)
        trainer.train(4)
    finally:
        group.shutdown()
    assert not trainer.recoveries                    # a storage outage is not a worker failure
    assert trainer.failed_saves == [3] and trainer.checkpoints == [1, 2, 4]
    assert trainer.ckpt.latest_verified().step == 4
    assert trainer.losses == reference[0]


@pytest.mark.slow  # CI keeps the synchronous save through an outage (test_storage_outage_skips_save...)
def test_an_async_save_writes_beside_training_through_a_storage_outage(reference, tmp_path, s3_server, caplog):
    """Storage is down when step 2's async save starts and comes back after 4 s: the write
    retries in the background while step 3 trains (the driver does not wait for it after
    step 3), and the checkpoint commits after step 4, before step 4's save (one async save in
    flight). No rank failure; the same losses."""
    import logging

    cfg = make_cfg(tmp_path, "checkpoint.interval=2", "checkpoint.async_save=true",
                   f"checkpoint.uri={s3_server.uri(tmp_path.name)}", spares=0)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        with _s3_outage(s3_server, 4.0), caplog.at_level(logging.INFO, logger="ftrain.trainer"):
            trainer.train(4)
    finally:
        group.shutdown()
    commits = [r.getMessage() for r in caplog.records if "committed" in r.getMessage()]
    assert commits[0].startswith("checkpoint step 2 committed") and commits[0].endswith("after step 4"), commits
    assert not trainer.recoveries and trainer.checkpoints == [2, 4] and not trainer.failed_saves
    assert trainer.ckpt.latest_verified().step == 4
    assert trainer.losses == reference[0]


def test_a_snapshot_cut_short_by_a_kill_is_never_restored(reference, tmp_path):
    """Rank 0 is killed half-way through its host copy of step 3 (`mid_snapshot`), so its
    holder never gets step 3: the in-memory restore takes step 2, which every rank's holder
    has, and replays step 3, bitwise as the run without failure."""
    trainer, digests, _ = run(make_cfg(tmp_path, "fault_tolerance.memory_snapshot_interval=1",
                                       "fault_tolerance.restore=memory",
                                       "chaos.events=[{step: 3, rank: 0, kind: kill, point: mid_snapshot}]"))
    (tl,) = trainer.recoveries
    assert (tl.failed_ranks, tl.restored_step) == ([0], 2) and tl.restore_source.startswith("memory")
    assert trainer.losses == reference[0] and digests == reference[1]


def test_a_spare_on_the_failed_device_is_taken_only_after_its_probe_passes(ray_session, tmp_path, caplog):
    """Rank 0 killed; the only spare shares rank 0's device (as with cluster.gpus_per_actor=0.5:
    here the slots are made to name one GPU). The device is quarantined by the recovery; the
    spare is probed (`MegatronActor.probe`: a real matmul on its device), passes, the
    quarantine is lifted and the spare takes rank 0. A spare there that cannot be probed (its
    actor dead) is dropped and the device stays quarantined."""
    import logging

    cfg = make_cfg(tmp_path, "fault_tolerance.refill_spares=false", spares=1)
    group = ActorGroup(MegatronActor, cfg)
    try:
        spare, failed = group.pool.spares[0], group.workers[0]
        spare.node_id, spare.gpu_ids, failed.gpu_ids = failed.node_id, [0], [0]
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        ray.kill(failed.handle, no_restart=True)
        with caplog.at_level(logging.INFO, logger="ftrain.control.actor_group"):
            trainer.train(2)
        assert group.workers[0] is spare and group.quarantined == {}
        assert "device 0 of node" in caplog.text and "quarantined until a probe passes (rank 0 failed on it)" in caplog.text
        assert "passed its probe: quarantine lifted" in caplog.text
        # Again, with a spare there that cannot answer the probe (that actor killed, put in the pool).
        group.quarantine([0])
        ray.kill(spare.handle, no_restart=True)
        group.pool.spares = [spare]
        group.prune_pool()
        assert group.pool.spares == [] and spare.device in group.quarantined
    finally:
        group.shutdown()


@pytest.mark.slow  # its outage must overlap the restore: timing-dependent on a loaded 2-core machine
def test_a_checkpoint_restore_rides_out_a_storage_outage(reference, tmp_path, s3_server):
    """Storage goes down as rank 1 is killed and comes back after 5 s, longer than one
    storage operation's retries (`checkpoint.retry_budget_s=3`; a refused connection fails
    at once, so the operation's attempts span at most that): the checkpoint restore is tried
    again until it answers (for up to the budget again after the first error); no other rank
    is blamed, no second spare spent; the same losses and final state as the run without
    failure."""
    cfg = make_cfg(tmp_path, "fault_tolerance.restore=checkpoint", "checkpoint.retry_budget_s=3",
                   f"checkpoint.uri={s3_server.uri(tmp_path.name)}", "fault_tolerance.refill_spares=false")
    outage = contextlib.ExitStack()

    def down_at_the_kill(trainer):
        outage.enter_context(_s3_outage(s3_server, 5.0))

    with outage:
        trainer, digests, spares = run(cfg, kill_rank=1, after_step_2=down_at_the_kill)
    (tl,) = trainer.recoveries
    assert (tl.failed_ranks, tl.restore_source, tl.attempts, spares) == ([1], "checkpoint step 1", 1, 0)
    assert any(n.startswith("checkpoint restore retried: storage failing") for n in tl.notes), tl.notes
    assert trainer.losses == reference[0] and digests == reference[1]


def test_a_checkpoint_restore_during_a_long_outage_stops_with_one_line(ray_session, tmp_path, s3_server):
    """Storage stays down through the recovery: the run stops with a RecoveryError of one line
    naming the URI and `checkpoint.retry_budget_s` (not a CheckpointError traceback), and no
    rank but the killed one was replaced."""
    from ftrain.failures import RecoveryError

    cfg = make_cfg(tmp_path, "fault_tolerance.restore=checkpoint", "checkpoint.retry_budget_s=1",
                   f"checkpoint.uri={s3_server.uri(tmp_path.name)}", spares=2)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        trainer.save(1)
        ray.kill(group.workers[0].handle, no_restart=True)
        with _s3_outage(s3_server), pytest.raises(RecoveryError) as raised:
            trainer.train(2)
        assert len(group.pool) == 1  # one spare for the killed rank; storage cost none
    finally:
        group.shutdown()
    line = str(raised.value)
    assert "\n" not in line and s3_server.uri(tmp_path.name) in line and "checkpoint.retry_budget_s=1" in line, line


@pytest.mark.slow  # the CI test beside it names a missing key on the driver
def test_keys_only_the_checkpoint_holds_are_named_on_the_driver(reference, tmp_path, caplog):
    """Checkpoint step 2's model shard holds a key the model does not have: it loads (the
    rest fits), and the driver, not only the rank's worker log, warns naming the key."""
    import logging

    import torch

    def commit_step_2_with_an_extra_key(trainer):
        ckpt = trainer.ckpt
        trainer.save(2)
        m = ckpt.read_manifest(2)
        state = ray.get(trainer.group.workers[0].handle.__ray_call__.remote(lambda a: a.engine._train_state()))
        state["stray_key"] = torch.zeros(3)
        files = [f for f in m.files if not f.path.startswith("model/")] + ckpt.save_shard(2, "model", state)
        ckpt.commit(2, m.layout, files, m.extra)

    with caplog.at_level(logging.WARNING, logger="ftrain.recovery.fault_tolerance"):
        trainer, digests, _ = run(make_cfg(tmp_path, "fault_tolerance.restore=checkpoint"), kill_rank=0,
                                  after_step_2=commit_step_2_with_an_extra_key)
    (tl,) = trainer.recoveries
    assert tl.restore_source == "checkpoint step 2"
    driver = [r.getMessage() for r in caplog.records if r.name == "fault_tolerance" and "stray_key" in r.getMessage()]
    assert driver and "does not load" in driver[0] and "step_00000002/model" in driver[0], driver
    assert any("stray_key" in n for n in tl.notes)
    assert trainer.losses == reference[0] and digests == reference[1]


def test_a_checkpoint_whose_bytes_changed_is_found_while_loading_and_the_older_one_restored(reference, tmp_path):
    """Checkpoint step 2's model file has a byte changed at the same size: the ranks' check
    before the load (sizes) passes it, the hash beside the load finds it; the state loaded from
    it is discarded, step 1 is loaded instead and step 2 replayed, with no spare spent on it:
    bitwise as the run without failure."""
    def corrupt_step_2(trainer):
        trainer.save(2)
        victim = next(f for f in trainer.ckpt.read_manifest(2).files
                      if f.path.startswith("model/") and f.path.endswith(".distcp"))
        path = tmp_path / "ckpt" / "step_00000002" / victim.path
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    trainer, digests, spares = run(make_cfg(tmp_path, "fault_tolerance.restore=checkpoint", spares=2), kill_rank=0,
                                   after_step_2=corrupt_step_2)
    (tl,) = trainer.recoveries
    assert (tl.failed_ranks, tl.restore_source, tl.attempts, spares) == ([0], "checkpoint step 1", 1, 1)
    assert "checkpoint step 2 does not load" in tl.notes
    assert trainer.losses == reference[0] and trainer.replayed == {2: [reference[0][2]]}
    assert digests == reference[1]
