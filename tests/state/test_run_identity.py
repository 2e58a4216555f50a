"""Run identity: every checkpoint names its run (name, id, config fingerprint); a new `train` in
a checkpoint.uri of another run stops with one line naming both, before Ray starts; recovery
loads only its own run's checkpoints (the regression: a second run with another seed and lr,
pointed at an earlier run's checkpoint.uri, loaded that run's step-6 checkpoint after a kill)."""
import dataclasses
import logging
import subprocess
import sys

import pytest
import torch

from checkpoint import CheckpointManager
from ftrain.config import ConfigError, load_config, resolve
from ftrain.state.manifest import model_signature
from ftrain.state.run_identity import RunIdentity, math_fields, plan_start


def make_cfg(tmp_path, *overrides):
    return resolve(load_config("config.yaml", [f"run_dir={tmp_path}/run", f"checkpoint.uri={tmp_path}/ckpt",
                                                *overrides]), num_gpus=0)


def commit(cfg, step: int, run: RunIdentity | None, layout: dict | None = None):
    """A tiny committed checkpoint of `step` under cfg's checkpoint.uri, recording `run`."""
    m = CheckpointManager(cfg.checkpoint.uri)
    extra = {"model": model_signature(cfg), **({"run": run.to_dict()} if run else {})}
    return m.commit(step, layout or {"tp": 1, "pp": 1, "cp": 1, "dp": 4},
                    m.save_shard(step, "s", {"x": torch.ones(1)}), extra)


def test_the_fingerprint_covers_the_math_not_the_placement(tmp_path):
    base = math_fields(make_cfg(tmp_path))
    assert {"train.seed", "train.lr", "train.lr_decay_steps", "model.hidden_size", "ppo.eps_clip_low"} <= set(base)
    assert "train.steps" not in base and base["train.lr_decay_steps"] == 4  # unset: train.steps
    same = ["cluster.num_workers=2", "cluster.num_spares=0", "train.micro_batch_size=1", "run_dir=/elsewhere",
            "checkpoint.interval=5", "fault_tolerance.restore=checkpoint", "rl.temperature=0.5"]
    for override in same:  # placement, paths, recovery, RL knobs with RL off: the same run
        assert math_fields(make_cfg(tmp_path, override)) == base, override
    for override in ("train.seed=7", "train.lr=0.002", "train.steps=8", "train.lr_decay_steps=8",
                     "model.num_layers=3", "rl.enabled=true"):
        assert math_fields(make_cfg(tmp_path, override)) != base, override
    # how far a run goes is not its math: its LR horizon is
    assert math_fields(make_cfg(tmp_path, "train.steps=8", "train.lr_decay_steps=4")) == base
    a, b = RunIdentity.new(make_cfg(tmp_path)), RunIdentity.new(make_cfg(tmp_path))
    assert a.fingerprint == b.fingerprint and a.id != b.id and a.name == "run"


def test_plan_start_resumes_its_own_run_and_starts_fresh_without_one(tmp_path, caplog):
    cfg = make_cfg(tmp_path)
    m = CheckpointManager(cfg.checkpoint.uri)
    plan = plan_start(cfg, m.committed_manifests(), m.uncommitted_steps())
    assert plan.resume_step is None
    m.save_shard(3, "s", {"x": torch.ones(1)})  # a save that never committed
    with caplog.at_level(logging.WARNING, logger="ftrain.state.run_identity"):
        plan = plan_start(cfg, m.committed_manifests(), m.uncommitted_steps())
    assert plan.resume_step is None and "only uncommitted steps [3]" in caplog.text
    earlier = RunIdentity.new(cfg)
    commit(cfg, 2, earlier)
    commit(cfg, 4, earlier)
    # another DP size and micro-batch split is the same run
    plan = plan_start(make_cfg(tmp_path, "cluster.num_workers=2", "train.micro_batch_size=1"),
                      m.committed_manifests(), m.uncommitted_steps())
    assert (plan.resume_step, plan.run.id) == (4, earlier.id)


def test_raising_train_steps_past_the_lr_horizon_stops_unless_the_horizon_is_given(tmp_path):
    """A finished 4-step run (horizon unset: 4 recorded) and the same config at train.steps=6:
    steps 5-6 would train at learning rate 0, so the command stops with one line naming the
    horizon and what to set. With train.lr_decay_steps=4 given, the same run resumes at its step
    4 on the horizon it started with; within the horizon nothing needs setting. An explicit other
    horizon is another run."""
    cfg = make_cfg(tmp_path)
    m = CheckpointManager(cfg.checkpoint.uri)
    first = plan_start(cfg, [], [])
    assert first.cfg.train.lr_decay_steps == 4 and first.run.fields["train.lr_decay_steps"] == 4
    commit(cfg, 2, first.run)
    assert plan_start(make_cfg(tmp_path), m.committed_manifests(), []).resume_step == 2  # within the horizon
    commit(cfg, 4, first.run)
    with pytest.raises(ConfigError, match=r"^train.steps: 6 goes past this run's LR horizon of 4 steps .*steps 5-6 "
                                          r"would train at learning rate 0; set train.lr_decay_steps=4") as e:
        plan_start(make_cfg(tmp_path, "train.steps=6"), m.committed_manifests(), [])
    assert "\n" not in str(e.value)
    plan = plan_start(make_cfg(tmp_path, "train.steps=6", "train.lr_decay_steps=4"), m.committed_manifests(), [])
    assert (plan.resume_step, plan.run.id) == (4, first.run.id)
    assert plan.cfg.train.steps == 6 and plan.cfg.train.lr_decay_steps == 4
    with pytest.raises(ConfigError, match="train.lr_decay_steps: 4 there, 6 here"):
        plan_start(make_cfg(tmp_path, "train.steps=6", "train.lr_decay_steps=6"), m.committed_manifests(), [])


@pytest.mark.parametrize("overrides, named", [
    (("train.seed=7", "train.lr=0.002"), "train.lr: 0.001 there, 0.002 here; train.seed: 1234 there, 7 here"),
    (("run_name=other",), "run_name: run there, other here"),
])
def test_a_checkpoint_of_another_run_stops_naming_both(tmp_path, overrides, named):
    earlier = RunIdentity.new(make_cfg(tmp_path))
    commit(make_cfg(tmp_path), 6, earlier)
    m = CheckpointManager(f"{tmp_path}/ckpt")
    with pytest.raises(ConfigError) as e:
        plan_start(make_cfg(tmp_path, *overrides), m.committed_manifests(), [])
    line = str(e.value)
    assert line.startswith(f"checkpoint.uri: {tmp_path}/ckpt holds run {earlier.id} (checkpoint step 6)")
    assert named in line and "--fresh" in line and "\n" not in line


def test_a_checkpoint_without_a_run_or_of_a_layout_it_cannot_load_stops(tmp_path):
    cfg = make_cfg(tmp_path)
    commit(cfg, 1, None)
    m = CheckpointManager(cfg.checkpoint.uri)
    with pytest.raises(ConfigError, match=r"^checkpoint.uri: .* step 1, which names no run"):
        plan_start(cfg, m.committed_manifests(), [])
    m.clear()
    commit(cfg, 2, RunIdentity.new(cfg), {"tp": 2, "pp": 1, "cp": 1, "dp": 2})
    with pytest.raises(ConfigError, match=r"^parallel: .*tp=pp=cp=1"):
        plan_start(cfg, m.committed_manifests(), [])


def test_fresh_deletes_the_checkpoints_and_starts_a_new_run(tmp_path, caplog):
    from main import plan_train_start

    cfg = make_cfg(tmp_path, "train.seed=7")
    commit(cfg, 2, RunIdentity.new(make_cfg(tmp_path)))  # another run's
    CheckpointManager(cfg.checkpoint.uri).save_shard(3, "s", {"x": torch.ones(1)})
    with caplog.at_level(logging.WARNING, logger="main"):
        plan = plan_train_start(cfg, fresh=True)
    assert plan.resume_step is None and "deleted checkpoint steps [2, 3]" in caplog.text
    assert CheckpointManager(cfg.checkpoint.uri).committed_steps() == []


def test_the_manager_skips_checkpoints_of_other_runs(tmp_path, caplog):
    cfg = make_cfg(tmp_path)
    ours, theirs = RunIdentity.new(cfg), RunIdentity.new(cfg)
    commit(cfg, 2, ours)
    commit(cfg, 4, theirs)
    m = CheckpointManager(cfg.checkpoint.uri)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert [x.step for x in m.committed_manifests(ours.id)] == [2]
        assert m.latest_verified(ours.id).step == 2 and m.latest_verified().step == 4
    assert f"written by run {theirs.id}, not by this run {ours.id}" in caplog.text


def test_the_cli_refuses_another_runs_checkpoint_uri_before_ray_starts(tmp_path):
    earlier = RunIdentity.new(make_cfg(tmp_path))
    commit(make_cfg(tmp_path), 6, earlier)
    out = subprocess.run([sys.executable, "main.py", "train", "--set", f"run_dir={tmp_path}/run",
                          "--set", f"checkpoint.uri={tmp_path}/ckpt", "--set", "train.seed=7",
                          "--set", "train.lr=0.002"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "Ray" not in out.stderr, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"config error: checkpoint.uri: {tmp_path}/ckpt holds run {earlier.id}"), line


@pytest.mark.slow
def test_recovery_loads_no_checkpoint_of_another_run(ray_session, tmp_path):
    """The regression: run A (6 steps, checkpoints at 4 and 6) and then run B (another seed and
    lr) in the same checkpoint.uri, a rank of B killed at step 2 and restored from checkpoint.
    B must not load A's step 6: it has no checkpoint of its own yet, so it restarts at step 0
    (`allow_restart_from_scratch`; without it the run stops), and its replayed steps equal its
    first ones."""
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    sets = ("cluster.num_workers=2", "cluster.num_spares=0", "checkpoint.interval=2", "train.steps=6")
    a_cfg = make_cfg(tmp_path, *sets)
    group = ActorGroup(MegatronActor, a_cfg)
    try:
        Trainer(a_cfg, group, CheckpointManager.from_config(a_cfg.checkpoint)).train(6)
    finally:
        group.shutdown()
    assert CheckpointManager(a_cfg.checkpoint.uri).committed_steps() == [4, 6]
    b_cfg = make_cfg(tmp_path, *sets, "cluster.num_spares=1", "train.seed=7", "train.lr=0.002",
                     "fault_tolerance.restore=checkpoint", "fault_tolerance.allow_restart_from_scratch=true",
                     "train.steps=3",
                     "chaos.events=[{step: 2, rank: 1, kind: kill, point: step_start}]")
    group = ActorGroup(MegatronActor, b_cfg)
    try:
        b = Trainer(b_cfg, group, CheckpointManager.from_config(b_cfg.checkpoint))
        b.train(3)
    finally:
        group.shutdown()
    (tl,) = b.recoveries
    assert (tl.restored_step, tl.restore_source) == (0, "initial"), dataclasses.asdict(tl)
    assert b.replayed == {1: [b.losses[1]]} and set(b.losses) == {1, 2, 3}
