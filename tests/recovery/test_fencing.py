"""A driver superseded inside a recovery (`run_lease`: another driver took the run over while
this one was detecting or recovering a failure) stops with LeaseLost and touches nothing: it
kills no actor, takes no spare, starts no refill, forms no generation and rewinds no holder.
Real Ray actors and gloo groups; the lease's own protocol is tested in test_driver_failover.py.
CI: the lease lost before the kill, and a later driver's generation met; slow: the lease lost
before the attempt and before the refill."""
import pytest
import ray

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.control.run_lease import LeaseLost
from ftrain.failures import WorkerFailure, first_generation
from ftrain.recovery.fault_tolerance import recover
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor


@pytest.fixture
def trained(ray_session, tmp_path):
    """A group of 3 ranks (dp=3) and 1 spare that trained one step."""
    cfg = resolve(load_config("config.yaml", [
        "cluster.num_workers=3", "cluster.num_spares=1", "train.global_batch_size=12", "train.mini_batch_size=12",
        "train.micro_batch_size=4", "checkpoint.interval=0", "fault_tolerance.health_timeout_s=3",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt"]), num_gpus=0)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        yield group, trainer
    finally:
        group.shutdown()


def untouched(group, workers: list, spares: list, generation: int) -> None:
    """Every actor alive, in the same place, the generation unchanged, no refill started."""
    assert group.workers == workers and group.pool.spares == spares and group.generation == generation
    assert not group._refills and not group._refills_due
    ray.get([s.handle.info.remote() for s in workers + spares], timeout=30)


@pytest.mark.parametrize("lost_at", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)],
                         ids=["before_the_attempt", "before_the_kill", "before_the_refill"])
def test_a_driver_whose_lease_is_lost_during_a_recovery_stops_before_its_next_change(trained, lost_at):
    """The lease is lost at the `lost_at`-th check of the recovery (`ActorGroup.fence`): at the
    attempt's start, after the abort (before the kill), after the kill (before the refill). It
    raises LeaseLost there; nothing after that check has happened."""
    group, trainer = trained
    workers, spares, generation = list(group.workers), list(group.pool.spares), group.generation
    checks = []

    def fence():
        checks.append(1)
        if len(checks) >= lost_at:
            raise LeaseLost("another driver took the run over")

    group.fence = fence
    with pytest.raises(LeaseLost):
        recover(group, WorkerFailure({1}, "hang"), trainer.ckpt, 1, group.cfg.fault_tolerance, lambda m: None)
    assert len(checks) == lost_at
    if lost_at < 3:
        untouched(group, workers, spares, generation)
    else:  # killed before the refill's check: its bundle is not refilled
        assert not group._refills and not group._refills_due and group.pool.spares == spares


def test_a_recovery_that_meets_a_later_drivers_generation_stops_and_kills_nothing(trained):
    """Another driver (the next lease epoch) took the run over and its generation formed on the
    same actors; this driver, recovering a failure of rank 1, aborts the survivors: they refuse
    (`StaleGenerationError`: a superseded driver's generation). That means "superseded": it
    stops with LeaseLost and kills none of them (a refused abort is not a failed rank)."""
    group, trainer = trained
    workers, spares, generation = list(group.workers), list(group.pool.spares), group.generation
    later = first_generation(1) + 1
    ray.get([s.handle.join.remote(later, r, group.dims, group.store_host, group.store_port)
             for r, s in enumerate(group.workers)], timeout=60)
    with pytest.raises(LeaseLost, match="serves another driver"):
        recover(group, WorkerFailure({1}, "hang"), trainer.ckpt, 1, group.cfg.fault_tolerance, lambda m: None)
    untouched(group, workers, spares, generation)
