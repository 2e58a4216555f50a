"""Exact auto-resume (real Ray actors, gloo groups, checkpoints on disk): a driver that starts
where a stopped one left (`run_identity.plan_start`, `Trainer.resume`, as `main.py train` does)
continues from the run's newest verified checkpoint and computes what the uninterrupted run
computes: the same losses (and rewards), bitwise, and the same final training state; at another
DP size from the saved weights; past a corrupt newest checkpoint to the one before it."""
import json
import logging
import shutil
from pathlib import Path

import pytest

from checkpoint import CheckpointManager
from ftrain.config import ConfigError, load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.state.run_identity import plan_start
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor

from conftest import ROOT, megatron_cpu_cfg, reference_run

FIXTURES = Path(ROOT) / "tests" / "fixtures"


def make_cfg(path, *overrides, config: str = "config.yaml"):
    return resolve(load_config(config, [
        "cluster.num_workers=2", "cluster.num_spares=0", "train.steps=4", "checkpoint.interval=2",
        f"run_dir={path}", f"checkpoint.uri={path}/ckpt", *overrides]), num_gpus=0)


def drive(cfg, until: int, on_resume=None):
    """One driver's life, as `main.py train` lives it: plan the start from checkpoint.uri, start
    the actors, resume when the plan says so (then `on_resume(group)`), train to step `until`,
    stop. Returns (trainer, final state digest of each rank)."""
    m = CheckpointManager.from_config(cfg.checkpoint)
    plan = plan_start(cfg, m.committed_manifests(), m.uncommitted_steps())
    cfg = plan.cfg  # the run's LR horizon set
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint), run=plan.run)
        if plan.resume_step is not None:
            trainer.resume(plan.resume_step)
            if on_resume is not None:
                on_resume(group)
        trainer.train(until)
        return trainer, group.state_digests()
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    """(losses, each rank's final state digest) of the run to step 4 without a stop."""
    return reference_run(make_cfg(tmp_path_factory.mktemp("full")), 4)


def test_a_run_stopped_between_checkpoints_resumes_bitwise(uninterrupted, tmp_path):
    cfg = make_cfg(tmp_path)
    first, _ = drive(cfg, 3)  # checkpoint at 2; step 3 is lost with the driver
    second, digests = drive(cfg, 4)
    full, full_digests = uninterrupted
    assert second.resumed_from == 2 and second.run.id == first.run.id
    assert {s: second.losses[s] for s in (3, 4)} == {s: full[s] for s in (3, 4)}
    assert {s: first.losses[s] for s in range(1, 4)} == {s: full[s] for s in range(1, 4)}
    assert digests == full_digests  # weights, optimizer state, LR schedule, step



@pytest.mark.parametrize("engine", ["torch", pytest.param("megatron", marks=pytest.mark.slow)])
def test_a_checkpoint_written_before_the_layout_move_resumes_as_its_run(ray_session, tmp_path, engine):
    """A step-2 checkpoint written by the code before the package layout (tests/fixtures/
    pre_layout: the modules then at the repository root) resumes under this code as its run:
    same run id, steps 3-4 with the losses of that code's uninterrupted run (bitwise on the
    machine that wrote the fixture, to fp32 round-off on another CPU). Torch engine at dp=2 (CI); MegatronActors on gloo
    at dp=2 with the distributed optimizer (slow)."""
    fixture = FIXTURES / "pre_layout" / engine
    expected = json.loads((fixture / "expected.json").read_text())
    shutil.copytree(fixture / "ckpt", tmp_path / "ckpt")
    sets = ("train.steps=4", "run_name=pre-layout")
    cfg = make_cfg(tmp_path, *sets) if engine == "torch" else \
        megatron_cpu_cfg(tmp_path, "cluster.num_workers=2", "cluster.num_spares=0", "checkpoint.interval=2",
                         "model.distributed_optimizer=true", *sets)
    resumed, digests = drive(cfg, 4)
    assert resumed.resumed_from == 2 and resumed.run.id == expected["run_id"]
    # The fixture's losses were computed on the machine that wrote it: bitwise there; another
    # CPU's kernels sum in another order (last bits; the resumes above are bitwise on one machine).
    assert [resumed.losses[s] for s in (3, 4)] == pytest.approx([expected["losses"][s] for s in ("3", "4")], rel=1e-5)
    assert len(set(digests)) == len(set(expected["digests"]))  # the ranks' states as alike as they were

@pytest.mark.slow
def test_raising_train_steps_continues_a_finished_run_bitwise(ray_session, tmp_path):
    """A finished 4-step run, then the same config with train.steps=6 and its LR horizon given
    (train.lr_decay_steps=4, recorded at the first run's start; unset, the command stops:
    test_run_identity.py): it resumes from step 4, trains steps 5-6 only, and they (and the final
    state) equal those of a 6-step run with the same LR horizon."""
    first, _ = drive(make_cfg(tmp_path), 4)
    second, digests = drive(make_cfg(tmp_path, "train.steps=6", "train.lr_decay_steps=4"), 6)
    full, full_digests = reference_run(make_cfg(tmp_path / "full", "train.steps=6", "train.lr_decay_steps=4"), 6)
    assert second.resumed_from == 4 and second.run.id == first.run.id and set(second.losses) == {5, 6}
    assert {s: second.losses[s] for s in (5, 6)} == {s: full[s] for s in (5, 6)}
    assert {s: first.losses[s] for s in range(1, 5)} == {s: full[s] for s in range(1, 5)}
    assert digests == full_digests


def test_a_corrupt_newest_checkpoint_falls_back_and_none_left_stops(uninterrupted, tmp_path, caplog):
    """Every checkpoint of the run corrupt: the resume stops with one line. The older one
    repaired: the resume skips the corrupt newest with a warning naming it, and continues
    from the older one as the uninterrupted run did."""
    cfg = make_cfg(tmp_path, "checkpoint.interval=1")
    drive(cfg, 3)  # checkpoints at 2 and 3 (keep_last 2)
    m = CheckpointManager(cfg.checkpoint.uri)
    paths = {s: f"{m.step_uri(s)}/{m.read_manifest(s).files[0].path}" for s in (2, 3)}
    good = shutil.copy(paths[2], tmp_path / "good")
    for path in paths.values():
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(b"rot")
    m = CheckpointManager.from_config(cfg.checkpoint)
    plan = plan_start(cfg, m.committed_manifests(), m.uncommitted_steps())
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint), run=plan.run)
        with pytest.raises(ConfigError) as e:
            trainer.resume(plan.resume_step)
        assert str(e.value).startswith(f"checkpoint.uri: no checkpoint of run {plan.run.id} ") and \
            "--fresh" in str(e.value) and "\n" not in str(e.value)
        shutil.copy(good, paths[2])
        with caplog.at_level(logging.WARNING, logger="ftrain.recovery.fault_tolerance"):
            assert trainer.resume(plan.resume_step) == 2
        assert f"checkpoint {m.step_uri(3)} does not load" in caplog.text  # found while loading (sizes fit)
        trainer.train(4)
        digests = group.state_digests()
    finally:
        group.shutdown()
    full, full_digests = uninterrupted
    assert {s: trainer.losses[s] for s in (3, 4)} == {s: full[s] for s in (3, 4)}
    assert digests == full_digests


@pytest.mark.slow
def test_an_rl_run_resumes_bitwise(ray_session, tmp_path):
    """PPO on its own samples (configs/ppo_cpu.yaml) with GAE's value head and a KL term to the
    reference policy: rollouts, rewards and losses after the resume equal the uninterrupted run's."""
    sets = ("train.steps=4", "rl.advantage=gae", "rl.kl_coef=0.05", "checkpoint.interval=2")
    full, full_digests = drive(make_cfg(tmp_path / "full", *sets, config="configs/ppo_cpu.yaml"), 4)
    cfg = make_cfg(tmp_path / "stopped", *sets, config="configs/ppo_cpu.yaml")
    drive(cfg, 3)
    resumed, digests = drive(cfg, 4)
    assert resumed.resumed_from == 2
    assert {s: (resumed.losses[s], resumed.rewards[s]) for s in (3, 4)} == \
           {s: (full.losses[s], full.rewards[s]) for s in (3, 4)}
    assert digests == full_digests


@pytest.mark.slow
def test_a_resume_at_another_dp_size_starts_from_the_saved_weights(uninterrupted, tmp_path):
    """Saved at dp=4 after step 2, resumed at dp=2: right after the load every rank holds the
    saved state bitwise; steps 3-4 then train as the uninterrupted dp=2 run (fp32 round-off:
    the gradient sums run in another order)."""
    _, saved = drive(make_cfg(tmp_path, "cluster.num_workers=4"), 2)
    loaded = []
    resumed, _ = drive(make_cfg(tmp_path), 4,
                       on_resume=lambda group: loaded.extend(group.state_digests()))
    assert resumed.resumed_from == 2 and set(loaded) == set(saved) and len(set(saved)) == 1
    dp2 = uninterrupted[0]
    assert {s: resumed.losses[s] for s in (3, 4)} == pytest.approx({s: dp2[s] for s in (3, 4)},
                                                                    rel=1e-5, abs=1e-6)
