"""Automatic detection and recovery under injected faults (real Ray actors, real gloo groups).

A `train` run with a chaos schedule of mixed faults (SIGKILL mid-step, exceptions, a hung
compute thread, a kill inside the gradient all-reduce together with a failure during the
recovery, a failure during a checkpoint save, a slow-but-progressing rank) finishes every step
with losses bitwise equal to the run without faults.
"""
import gc
import statistics

import pytest
import ray

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.failures import RecoveryError
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor

FAST = ["fault_tolerance.min_step_timeout_s=3", "fault_tolerance.health_timeout_s=2",
        "fault_tolerance.rendezvous_timeout_s=20", "fault_tolerance.health_interval_s=0.2"]
CHAOS = ("chaos.events=["
         "{step: 2, rank: 1, kind: kill, point: after_optimizer_step},"
         "{step: 2, rank: 0, kind: exception, point: during_save},"
         "{step: 3, rank: 0, kind: exception, point: before_allreduce},"
         "{step: 4, rank: 1, kind: hang, point: step_start},"
         "{step: 5, rank: 0, kind: kill, point: inside_allreduce},"
         "{step: 5, rank: 1, kind: exception, point: during_recovery},"
         "{step: 6, rank: 0, kind: slow, point: step_start}]")


def make_cfg(tmp_path, *overrides):
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "train.steps=6", f"run_dir={tmp_path}",
        f"checkpoint.uri={tmp_path}/ckpt", *FAST, *overrides]), num_gpus=0)


def train(cfg, frozen: bool = False):
    """Train `cfg` to its end: (trainer, state digests, dims). With `frozen`: also check that at
    the last step the members and each recovery's record (made during the recovery) are out of
    the cyclic collector's reach (`trainer.freeze_heap` after each membership change), and back
    in it once `train` returned (unfrozen)."""
    group = ActorGroup(MegatronActor, cfg)
    seen = []

    def untracked(t, step):
        if step == cfg.train.steps:
            tracked = {id(o) for o in gc.get_objects()}
            seen.append(not any(id(o) in tracked for o in (*group.workers, *t.recoveries)))
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(cfg.train.steps, untracked if frozen else None)
        if frozen:
            assert seen == [True], "not frozen while training"
            assert gc.get_freeze_count() == 0, "still frozen after train returned"
        return trainer, group.state_digests(), group.dims
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    trainer, digests, _ = train(make_cfg(tmp_path_factory.mktemp("ref"), "cluster.num_spares=0"))
    assert not trainer.recoveries
    return trainer.losses, digests


def test_mixed_chaos_recovers_with_identical_losses(reference, tmp_path):
    # A spare for each of the 6 ranks replaced, and no refills (6 actor starts competing with
    # the recoveries for CPU; the pool is not what this test checks).
    trainer, digests, _ = train(make_cfg(tmp_path, "cluster.num_spares=6", "fault_tolerance.refill_spares=false", CHAOS),
                                frozen=True)
    assert trainer.losses == reference[0]
    assert digests == reference[1]
    kinds = [t.kind for t in trainer.recoveries]
    assert kinds == ["crash", "exception", "exception", "hang", "crash"], trainer.report()
    hang = trainer.recoveries[3]
    assert hang.failed_ranks == [1]           # the hung rank, not its peer waiting in all-reduce
    assert hang.detect_s < 3 + 2 + 1          # within the step deadline + 2 s
    last = trainer.recoveries[4]
    assert last.attempts == 2 and last.failed_ranks == [0, 1]   # failure during recovery
    assert all(t.steps_lost == 0 for t in trainer.recoveries)
    # the slow rank of step 6 was not replaced: no sixth recovery
    assert trainer.checkpoints == [4, 6]      # the save of step 2 failed and was not committed


@pytest.mark.slow  # CI: the shrink of test_dp_grows_back_to_its_size_once_spares_are_back
def test_empty_pool_shrinks_dp_when_allowed(reference, tmp_path):
    cfg = make_cfg(tmp_path, "cluster.num_spares=0", "fault_tolerance.min_dp=1",
                   "fault_tolerance.refill_spares=false",
                   "chaos.events=[{step: 3, rank: 1, kind: kill, point: step_start}]")
    trainer, _, dims = train(cfg)
    assert dims.dp == 1 and len(trainer.losses) == 6
    assert [trainer.losses[s] for s in (1, 2)] == [reference[0][s] for s in (1, 2)]
    # after the shrink to dp=1: the training of the run that never shrank, within fp32 round-off
    assert [trainer.losses[s] for s in range(3, 7)] == pytest.approx([reference[0][s] for s in range(3, 7)], rel=1e-5)
    assert trainer.recoveries[0].restore_source == "peer"
    # step times: 1, 2, the re-run 3 (first after the recovery), 4, 5, 6. The steady step the
    # recovery is charged against is step 2 alone: neither the run's first step nor the re-run.
    tl, times = trainer.recoveries[0], trainer.step_times
    assert len(times) == 6 and tl.steady_step_s == times[1]
    assert trainer.steady_step_s() == statistics.median([times[1], *times[3:]])



def test_a_megatron_step_cut_short_is_rerun_from_the_committed_step_after_a_shrink(ray_session, tmp_path):
    """MegatronActors on CPU (gloo), dp=2 without the distributed optimizer, no spare,
    `fault_tolerance.min_dp=1`, two updates per step; rank 1 killed right after the first
    update of step 3 (`after_optimizer_step`), which the survivor had applied too. DP shrinks to
    1: the survivor carries its live state into the new layout still marked as cut short, so it
    rolls back to committed step 2 and step 3 is re-run from there; every loss equals the run
    that never shrank, within fp32 round-off (a half-applied step taken for step 2 would train
    step 3 from a state one update ahead)."""
    from conftest import megatron_cpu_cfg, reference_run

    base = ("cluster.num_workers=2", "cluster.num_spares=0", "fault_tolerance.min_dp=1",
            "fault_tolerance.refill_spares=false", "fault_tolerance.health_timeout_s=30", "train.steps=5",
            "train.global_batch_size=8", "train.mini_batch_size=4")
    ref_losses, _ = reference_run(megatron_cpu_cfg(tmp_path / "reference", *base), 5)
    cfg = megatron_cpu_cfg(tmp_path, *base, "chaos.events=[{step: 3, rank: 1, kind: kill, point: after_optimizer_step}]")
    trainer, _, dims = train(cfg)
    (tl,) = trainer.recoveries
    assert dims.dp == 1 and (tl.failed_ranks, tl.restored_step) == ([1], 2), tl
    assert [trainer.losses[s] for s in (1, 2)] == [ref_losses[s] for s in (1, 2)]
    assert [trainer.losses[s] for s in range(3, 6)] == pytest.approx([ref_losses[s] for s in range(3, 6)], rel=1e-5)


def test_a_failure_while_the_refill_is_being_built_waits_for_it(reference, tmp_path, caplog):
    """One spare, refills on: rank 1 killed at step 2 takes the spare (its bundle's refill is
    started after the next committed step and takes seconds to build), rank 0 killed as step 3
    starts, while the refill is still being built. The pool is empty but a spare is on its way:
    the recovery waits for it (`event=waiting_for_refill`) instead of stopping the run for lack
    of spares, and the run ends with the losses of the run without failure."""
    cfg = make_cfg(tmp_path, "cluster.num_spares=1",
                   "chaos.events=[{step: 2, rank: 1, kind: kill, point: step_start},"
                   "{step: 3, rank: 0, kind: kill, point: step_start}]")
    with caplog.at_level("WARNING", logger="ftrain.control.actor_group"):
        trainer, digests, _ = train(cfg)
    assert [t.failed_ranks for t in trainer.recoveries] == [[1], [0]]
    assert "event=waiting_for_refill" in caplog.text
    assert trainer.losses == reference[0] and digests == reference[1]


def assert_rank_1_hung_at_step_4_found_within(reference, tmp_path, point: str, detect_s: float, *sets: str):
    """Rank 1's compute thread hung at `point` of step 4 (1 spare, `sets`): one recovery, of a
    hang of rank 1 detected within `detect_s` seconds, and the run's losses and final states
    those of the run without failure."""
    cfg = make_cfg(tmp_path, "cluster.num_spares=1", *sets,
                   f"chaos.events=[{{step: 4, rank: 1, kind: hang, point: {point}}}]")
    trainer, digests, _ = train(cfg)
    (tl,) = trainer.recoveries
    assert tl.kind == "hang" and tl.failed_ranks == [1] and tl.detect_s < detect_s, tl.to_dict()
    assert trainer.losses == reference[0] and digests == reference[1]


def test_a_rank_its_peers_wait_for_is_found_hung_before_the_step_deadline(reference, tmp_path):
    """Rank 1's compute thread hangs as step 4 starts; rank 0 waits for it in the gradient
    all-reduce. With the step deadline's floor at 30 s, the hang is found once no progress
    counter moved for `Trainer.culprit_deadline` (here `health_timeout_s`, 2 s): rank 1 named,
    replaced, the run ends with the losses of the run without failure. (A slow rank's counters
    move and it is not replaced: `test_mixed_chaos_recovers_with_identical_losses`.)"""
    assert_rank_1_hung_at_step_4_found_within(reference, tmp_path, "step_start", 20,
                                              "fault_tolerance.min_step_timeout_s=30")


def test_a_hang_inside_a_save_is_found_by_the_saves_own_deadline(reference, tmp_path):
    """Checkpoints every 2 steps; rank 1's compute thread hangs inside the save of step 4. The
    save call's deadline comes from the pace of the saves before (`Trainer.save_deadline`, here
    the step deadline's floor, 3 s), not from `step_timeout_s` (120 s): the hang is found within
    seconds, the rank replaced, and the run ends with the losses of the run without failure."""
    assert_rank_1_hung_at_step_4_found_within(reference, tmp_path, "during_save", 30, "checkpoint.interval=2")


def test_empty_pool_without_shrink_stops_with_clear_error(ray_session, tmp_path):
    cfg = make_cfg(tmp_path, "cluster.num_spares=0", "fault_tolerance.refill_spares=false",
                   "chaos.events=[{step: 2, rank: 0, kind: kill, point: step_start}]")
    with pytest.raises(RecoveryError, match="fault_tolerance.min_dp"):
        train(cfg)


def test_snapshot_wire_format_round_trip(ray_session):
    """In-memory snapshots travel to the holder as numpy arrays (zero-copy in Ray): every dtype
    the engines keep comes back bitwise, bf16 included, through a real Ray object."""
    import torch

    from ftrain.state.snapshots import from_wire, to_wire

    g = torch.Generator().manual_seed(0)
    state = {"params": [torch.randn(5, 3, generator=g).to(torch.bfloat16), torch.randn(4, generator=g)],
             "optim": {"step": torch.tensor(7.0), "ids": torch.arange(6), "mask": torch.rand(3, generator=g) > 0.5},
             "sched_steps": 3, "note": "x"}
    back = from_wire(ray.get(ray.put(to_wire(state))))
    flat, spec = torch.utils._pytree.tree_flatten(state)
    flat_back, spec_back = torch.utils._pytree.tree_flatten(back)
    assert spec == spec_back
    for a, b in zip(flat, flat_back):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
            b.add_(1) if b.dtype != torch.bool else b.logical_not_()  # writable
        else:
            assert a == b


def test_recovery_total_is_the_control_phases_plus_the_first_steps_excess():
    """`RecoveryTimeline.total_s`: detect + abort + replace + rebuild + restore + the first step's
    excess over a steady step (all of the first step when no steady step ran)."""
    from ftrain.failures import RecoveryTimeline

    tl = RecoveryTimeline("crash", [1], ["n"], detect_s=1, abort_s=2, replace_s=3, rebuild_s=4, restore_s=5,
                          first_step_s=10, steady_step_s=4)
    assert (tl.first_step_excess_s, tl.total_s) == (6, 21)
    tl.steady_step_s = 0.0
    assert tl.total_s == 25
    tl.steady_step_s = 12.0  # a first step faster than the steady one costs nothing
    assert tl.total_s == 15


def test_dp_grows_back_to_its_size_once_spares_are_back(reference, tmp_path):
    """dp=2 and no spare: rank 0 is killed after step 2, DP shrinks to 1
    (`fault_tolerance.min_dp`; the survivor becomes rank 0), and the killed rank's bundle is
    refilled in the background. Once the refill is warm, DP grows back to 2 at the next step
    boundary (a new generation, the new replica restored from a DP peer, `event=grow`), and the
    run goes on at dp=2: the losses of every step equal the run that never shrank within fp32
    round-off, and both replicas end with the same state. (Also the DP shrink's end-to-end test
    in CI: `test_empty_pool_shrinks_dp_when_allowed` is slow.)"""
    from conftest import kill_then_await_refill

    cfg = make_cfg(tmp_path, "cluster.num_spares=0", "fault_tolerance.min_dp=1")

    after_step = kill_then_await_refill(timeout_s=120)

    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(6, after_step)
        assert group.dims.dp == 2 and len(group.workers) == 2
        (shrink,) = trainer.recoveries
        assert shrink.failed_ranks == [0] and shrink.steps_lost == 0 and shrink.restore_source == "peer"
        # the steady step the recovery is charged against: step 2 alone (not the run's first step)
        assert shrink.steady_step_s == trainer.step_times[1]
        (grow,) = trainer.grows
        assert (grow.kind, grow.committed_step, grow.restored_step, grow.restore_source) == ("grow", 4, 4, "peer")
        assert grow.failed_ranks == [1] and grow.generation == group.generation
        assert [trainer.losses[s] for s in (1, 2)] == [reference[0][s] for s in (1, 2)]
        assert [trainer.losses[s] for s in range(3, 7)] == pytest.approx([reference[0][s] for s in range(3, 7)], rel=1e-5)
        assert len(set(group.state_digests())) == 1
    finally:
        group.shutdown()
