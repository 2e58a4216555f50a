"""The optimizer update does not depend on the DP size (real Ray actors, real gloo groups): the
loss of each global mini-batch is its `ppo.loss_agg_mode` over the whole mini-batch
(`ppo.global_loss_weights`), however its rows are split over replicas and micro-batches. Runs at
dp=4, 2 and 1 from one seed, a checkpoint saved at dp=4 resumed at dp=2, and RL runs at dp=2
and 1 agree within fp32 round-off (the sums run in another order), in losses, gradient norms
and weights."""
import pytest
import ray
import torch

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor


def make_cfg(tmp_path, workers: int, *overrides, config: str = "config.yaml"):
    return resolve(load_config(config, [
        f"cluster.num_workers={workers}", "cluster.num_spares=0", "train.steps=4",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", "checkpoint.interval=2", *overrides]), num_gpus=0)


def weights(group) -> torch.Tensor:
    """Rank 0's parameters, flat (every replica holds the same)."""
    return ray.get(group.workers[0].handle.__ray_call__.remote(
        lambda actor: torch.cat([p.detach().reshape(-1) for p in actor.engine.module.parameters()])))


def run(cfg, until: int, resume_from: str | None = None):
    """Train to step `until` (from the checkpoint of step 2 under `resume_from`, when given);
    returns (losses, weights)."""
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        if resume_from is not None:
            (manifest,) = [m for m in CheckpointManager(resume_from).committed_manifests() if m.step == 2]
            trainer.committed_step = min(r["step"] for r in group.call("load_checkpoint", manifest))
        trainer.train(until)
        return trainer.losses, weights(group), trainer.grad_norms
    finally:
        group.shutdown()


def close(a, b) -> bool:
    """Losses and gradient norms within fp32 round-off (Adam's update hardly depends on the
    gradient's scale; the norm does; a loss near 0, as GRPO's, gets an absolute bound), weights
    within a fraction of one update (lr 1e-3)."""
    same = all(a[i][s] == pytest.approx(b[i][s], rel=1e-5, abs=1e-6) for i in (0, 2) for s in a[0])
    return same and (a[1] - b[1]).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def trained(ray_session, tmp_path_factory):
    """`trained(workers, *overrides)`: `run` of that config to step 4 (checkpoints at steps 2
    and 4) and its checkpoint directory, run once per module: the dp=4 token-mean run serves
    both tests below."""
    done = {}

    def get(workers: int, *overrides: str):
        key = (workers, overrides)
        if key not in done:
            path = tmp_path_factory.mktemp(f"dp{workers}")
            done[key] = run(make_cfg(path, workers, *overrides), 4), path / "ckpt"
        return done[key]
    return get


# CI: dp=2 against dp=1 (the rows split over replicas and over micro-batches); slow: dp=4 too.
@pytest.mark.parametrize("mode, sizes", [pytest.param("token-mean", (4, 2, 1), marks=pytest.mark.slow, id="token-mean"),
                                         pytest.param("seq-mean-token-mean", (2, 1), id="seq-mean-token-mean")])
def test_runs_at_other_dp_sizes_train_the_same(trained, mode, sizes):
    runs = {n: trained(n, f"ppo.loss_agg_mode={mode}")[0] for n in sizes}
    first = runs[sizes[0]]
    assert all(close(r, first) for r in runs.values()), {n: r[0] for n, r in runs.items()}


@pytest.mark.slow  # CI keeps the resume at another dp in test_data.py (ce, the same rows and losses)
def test_a_checkpoint_saved_at_dp4_resumes_at_dp2_as_the_run_at_dp4(trained, tmp_path):
    full, ckpt = trained(4, "ppo.loss_agg_mode=token-mean")
    resumed = run(make_cfg(tmp_path / "dp2", 2, f"checkpoint.uri={ckpt}"), 4, resume_from=str(ckpt))
    assert set(resumed[0]) == {3, 4} and close(resumed, full)


def test_rl_runs_at_dp_2_and_1_sample_and_train_the_same(ray_session, tmp_path):
    """PPO on the policy's own samples (configs/ppo_cpu.yaml, the copy task, GAE's value head
    and a KL term on): the rollouts are a function of (seed, step, row), and the update of the
    DP size's split does not change them either."""
    sets = ("train.steps=3", "rl.advantage=gae", "rl.kl_coef=0.05", "checkpoint.interval=0")
    runs = {n: run(make_cfg(tmp_path / str(n), n, *sets, config="configs/ppo_cpu.yaml"), 3) for n in (2, 1)}
    assert close(runs[1], runs[2]), {n: r[0] for n, r in runs.items()}
