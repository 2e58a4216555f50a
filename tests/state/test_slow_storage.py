"""Slow storage is not a hang: S3 on loopback behind a throttling relay (`throttled_link.py`)
so that one checkpoint save takes about 3x `fault_tolerance.step_timeout_s`. Checkpoint I/O
reports its progress (`checkpoint.IOProgress`, in every heartbeat) and the step deadline moves
with it: no rank is declared hung or replaced, the checkpoint commits, training goes on, and a
recovery restores from that storage."""
import contextlib
import logging

import pytest
import ray

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.testbeds.local_storage import S3Server
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor

from conftest import reference_run
from throttled_link import ThrottledRelay

STEP_TIMEOUT_S = 3.0  # the first step included: 2 s was passed once on a loaded 2-core CI host
SAVE_S = 3 * STEP_TIMEOUT_S  # what one save's upload takes through the relay


def make_cfg(tmp_path, s3_server, *overrides):
    """No refills: an actor start competing with the recovery (the pool is not checked here)."""
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "cluster.num_spares=1", "checkpoint.interval=0", "fault_tolerance.refill_spares=false",
        f"fault_tolerance.step_timeout_s={STEP_TIMEOUT_S}", "fault_tolerance.min_step_timeout_s=1",
        f"run_dir={tmp_path}", f"checkpoint.uri={s3_server.uri(tmp_path.name)}", *overrides]), num_gpus=0)


@contextlib.contextmanager
def throttled(server: S3Server, bytes_per_s: float):
    """Inside the block `server`'s port answers through a relay at `bytes_per_s` each way: the
    S3 server moves to another port behind it (moto's objects are process-global, so they stay)
    and is back on its own port at exit."""
    server.stop()
    inner = S3Server().start()
    try:
        with ThrottledRelay(server.port, inner.port, bytes_per_s):
            yield
    finally:
        inner.stop()
        server.start()


@pytest.fixture(scope="module")
def reference(ray_session, s3_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("ref")
    return reference_run(make_cfg(path, s3_server), 4)


def _link_rate(trainer, step: int) -> float:
    """Bytes per second at which the largest file of checkpoint `step` takes SAVE_S."""
    return max(f.size for f in trainer.ckpt.read_manifest(step).files) / SAVE_S


def _train_through_slow_saves(cfg, s3_server, kill_during_restore: bool):
    """Steps 1-2 with checkpoint 1 on fast storage; then on the slow link: save 2 (taking about
    3x the step deadline), step 3; with `kill_during_restore`, rank 1 is killed and the recovery
    restores checkpoint 2 through the slow link; then step 4. Returns (trainer, digests)."""
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        trainer.save(1)
        trainer.finish_save()
        rate = _link_rate(trainer, 1)
        trainer.train(2)
        with throttled(s3_server, rate):
            trainer.save(2)
            trainer.train(3)
            trainer.finish_save()
            if kill_during_restore:
                ray.kill(group.workers[1].handle, no_restart=True)
            trainer.train(4)
        return trainer, group.state_digests()
    finally:
        group.shutdown()


def test_a_save_slower_than_the_step_deadline_commits_and_a_restore_through_it_completes(reference, tmp_path, s3_server):
    cfg = make_cfg(tmp_path, s3_server, "fault_tolerance.restore=checkpoint")
    trainer, digests = _train_through_slow_saves(cfg, s3_server, kill_during_restore=True)
    assert trainer.checkpoints == [1, 2] and not trainer.failed_saves
    (tl,) = trainer.recoveries  # the kill only: no rank was declared hung by the slow I/O
    assert (tl.kind, tl.failed_ranks, tl.attempts, tl.restore_source) == ("crash", [1], 1, "checkpoint step 2")
    assert trainer.losses == reference[0] and digests == reference[1]


@pytest.mark.slow
def test_an_async_save_slower_than_the_step_deadline_commits(reference, tmp_path, s3_server):
    cfg = make_cfg(tmp_path, s3_server, "checkpoint.async_save=true")
    trainer, digests = _train_through_slow_saves(cfg, s3_server, kill_during_restore=False)
    assert trainer.checkpoints == [1, 2] and not trainer.failed_saves and not trainer.recoveries
    assert trainer.losses == reference[0] and digests == reference[1]


@pytest.mark.slow
def test_a_run_whose_saves_never_commit_says_so(ray_session, tmp_path, s3_server, caplog):
    """Storage is down through the whole run: each skipped save is a warning, and the end of
    `train` says in one line that no checkpoint was committed."""
    cfg = make_cfg(tmp_path, s3_server, "checkpoint.interval=1", "checkpoint.retry_budget_s=1",
                   "cluster.num_spares=0", "fault_tolerance.step_timeout_s=60")
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        s3_server.stop()
        try:
            with caplog.at_level(logging.WARNING, logger="ftrain.trainer"):
                trainer.train(2)
        finally:
            s3_server.start()
    finally:
        group.shutdown()
    assert trainer.failed_saves == [1, 2] and not trainer.checkpoints and not trainer.recoveries
    messages = [r.getMessage() for r in caplog.records if r.name == "ftrain.trainer"]
    assert sum("NOT committed" in m for m in messages) == 2
    assert any(m.startswith("no checkpoint was committed in this run") for m in messages), messages


def test_async_saves_due_while_one_is_written_are_postponed_not_waited_for(reference, tmp_path, s3_server, caplog):
    """`checkpoint.interval=1`, async: on the slow link a save takes SAVE_S / 3 (3 s), several steps. The saves due meanwhile are postponed (one warning), not waited for;
    the first step after the write's commit saves; the run's last step is saved at its end;
    training equals the run without checkpoints slowed down."""
    cfg = make_cfg(tmp_path, s3_server, "checkpoint.async_save=true", "checkpoint.interval=1",
                   "fault_tolerance.min_step_timeout_s=20", "fault_tolerance.step_timeout_s=20",  # not this test's point
                   "cluster.num_spares=0")
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        rate = 3 * _link_rate(trainer, 1)  # a save takes SAVE_S / 3: several steps
        with caplog.at_level(logging.WARNING, logger="ftrain.trainer"), throttled(s3_server, rate):
            trainer.train(4)
        digests = group.state_digests()
    finally:
        group.shutdown()
    assert trainer.checkpoints[:2] == [1, 2] and trainer.checkpoints[-1] == 4 and not trainer.failed_saves
    assert 3 in trainer.postponed_saves and set(trainer.checkpoints) | set(trainer.postponed_saves) == {1, 2, 3, 4}
    assert sum("postponed" in r.message for r in caplog.records) == 1 and not trainer.recoveries
    assert trainer.final_save_wait_s > 0  # the end waited for the last write: no training stall
    assert trainer.losses == reference[0] and digests == reference[1]
