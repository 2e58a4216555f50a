"""On-policy RL: sampling, task rewards, advantages against hand-computed values, config errors,
and loops on real Ray actors (reward rises; a run recovered from peers or resumed from a
checkpoint samples and trains exactly as the run without failure)."""
import json
import random

import pytest
import torch

from ftrain.config import ConfigError, load_config, resolve
from ftrain.objectives.ppo import gae_advantages, group_advantages, kl_penalty, token_entropy, value_loss, whiten
from ftrain.rl.rollouts import (EOS_ID, PAD_ID, Prompt, Rollouts, Task, Tokenizer, check_task, digit_task, make_task,
                                register_task, row_seed, sample, top_p_filter, unstride)

V = 8


def fixed_logits(eos_after: dict[int, int] | None = None):
    """A fake model: logits depend only on the row's own tokens (their sum), so a row samples the
    same whatever else is in the batch. Row whose first token is k emits <eos> once it has
    eos_after[k] tokens."""
    def fn(ids, mask):
        B, L = ids.shape
        base = torch.linspace(-1, 1, V).repeat(B, L, 1) + (ids.cumsum(1) % 3)[..., None] * 0.1
        if eos_after:
            for b in range(B):
                n = int(mask[b].sum())
                k = int(ids[b, 0])
                if k in eos_after and n - 1 >= eos_after[k]:
                    base[b, n - 1] = -1e4
                    base[b, n - 1, EOS_ID] = 1e4
        return base
    return fn


def prompts(rows: list[list[int]], S: int):
    ids = torch.full((len(rows), S), PAD_ID)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return ids, (ids != PAD_ID).long()


def test_sampling_respects_masks_max_length_and_eos():
    ids, mask = prompts([[3, 4], [5, 6, 7], [4]], S=8)
    out = sample(fixed_logits({5: 3}), ids, mask, [1, 2, 3], max_new_tokens=3, stop_ids=EOS_ID,
                 pad_id=PAD_ID)
    n = mask.sum(-1)
    for b in range(3):
        row_mask, loss_mask = out["attention_mask"][b], out["loss_mask"][b]
        assert torch.equal(out["input_ids"][b, :n[b]], ids[b, :n[b]])  # prompt untouched
        assert loss_mask[:n[b]].sum() == 0                               # no loss on the prompt
        k = int(loss_mask.sum())
        assert 1 <= k <= 3                                              # max_new_tokens
        assert torch.equal(loss_mask.nonzero().squeeze(1), torch.arange(n[b], n[b] + k))
        assert torch.equal(row_mask, (torch.arange(8) < n[b] + k).long())
        assert (out["input_ids"][b, n[b] + k:] == PAD_ID).all()          # padding after
        assert (out["log_probs"][b] * (1 - loss_mask) == 0).all() and (out["log_probs"][b] <= 0).all()
    # row 1 (first token 5) emits <eos> once it has 4 tokens: one token, then <eos> (log-prob 0)
    assert out["loss_mask"][1].sum() == 2 and out["input_ids"][1, 4] == EOS_ID
    assert out["log_probs"][1, 3] < 0 and out["log_probs"][1, 4] == 0
    # the buffer end bounds a completion too
    ids, mask = prompts([[3, 4, 5, 6, 7, 3, 4]], S=8)
    out = sample(fixed_logits(), ids, mask, [1], max_new_tokens=5, stop_ids=EOS_ID, pad_id=PAD_ID)
    assert out["loss_mask"].sum() == 1 and out["attention_mask"].sum() == 8


def test_sampling_is_per_row_pure():
    """A row's completion depends on its seed and prompt only: not on the other rows, their
    order or the batch size (DP size, which replica runs it)."""
    rows = [[3, 4], [5, 6, 7], [4], [6, 6]]
    seeds = [row_seed(1, 7, i) for i in range(4)]
    ids, mask = prompts(rows, S=10)
    full = sample(fixed_logits(), ids, mask, seeds, 5, EOS_ID, PAD_ID, temperature=1.3, top_p=0.9)
    for part in ([0, 2], [3, 1]):
        ids, mask = prompts([rows[i] for i in part], S=10)
        out = sample(fixed_logits(), ids, mask, [seeds[i] for i in part], 5, EOS_ID, PAD_ID,
                     temperature=1.3, top_p=0.9)
        for j, i in enumerate(part):
            assert torch.equal(out["input_ids"][j], full["input_ids"][i])
    assert row_seed(1, 7, 0) != row_seed(1, 8, 0) != row_seed(2, 7, 0)


def test_real_model_samples_the_same_at_any_dp():
    """Through the preset's HF model: each DP replica sampling its interleaved rows gives
    bitwise the completions and log-probs of one replica sampling all rows (dp = 1, 2, 4, 8)."""
    from ftrain.engines.torch_engine import build_hf_model

    cfg = resolve(load_config("configs/ppo_cpu.yaml"), num_gpus=0)
    model = build_hf_model(cfg).eval()
    ro = Rollouts(cfg)
    batch = ro.prompt_batch(ro.prompts(5))
    n = len(batch)

    def draw(d, dp):
        return sample(lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits,
                      batch.input_ids[d::dp], batch.attention_mask[d::dp],
                      [row_seed(cfg.train.seed, 5, i) for i in range(d, n, dp)],
                      cfg.rl.max_new_tokens, EOS_ID, PAD_ID)

    full = draw(0, 1)
    for dp in (2, 4, 8):
        parts = [draw(d, dp) for d in range(dp)]
        merged = unstride(parts)
        for key in ("input_ids", "log_probs", "loss_mask"):
            assert torch.equal(merged[key], full[key]), (dp, key)


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    sorted_p, order = top_p_filter(probs, 0.7)
    assert order[0, :2].tolist() == [1, 2]
    assert torch.allclose(sorted_p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    sorted_p, _ = top_p_filter(probs, 0.01)  # at least one token
    assert sorted_p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    ids, mask = prompts([[3]] * 4, S=6)  # tiny top_p: greedy, whatever the seed
    out = sample(fixed_logits(), ids, mask, [1, 2, 3, 4], 3, EOS_ID, PAD_ID, top_p=1e-6)
    assert (out["input_ids"][:, 1:4] == V - 1).all()


def test_task_rewards_on_hand_made_cases():
    rev = digit_task("reverse", digits=3)
    tok = rev.tokenizer
    p = Prompt([tok.bos_id] + tok.encode("123="), "321")
    assert rev.reward(p, tok.encode("321") + [EOS_ID]) == 1.0
    assert rev.reward(p, tok.encode("3")) == 0.25
    assert rev.reward(p, tok.encode("391") + [EOS_ID]) == 0.75
    assert rev.reward(p, []) == 0.0
    exact = digit_task("reverse", digits=3, partial=False)
    assert exact.reward(p, tok.encode("391") + [EOS_ID]) == 0.0
    assert exact.reward(p, tok.encode("321") + [EOS_ID]) == 1.0
    add = digit_task("add", digits=2)
    q = add.prompt(random.Random(0))
    x, y = "".join(tok.decode(q.tokens[1:-1])).split("+")
    assert len(x) == len(y) == 2 and int(q.answer) == int(x) + int(y)
    assert add.reward(q, tok.encode(q.answer) + [EOS_ID]) == 1.0
    copy = make_task("copy", {"digits": 2})
    c = copy.prompt(random.Random(3))
    assert c.answer == "".join(tok.decode(c.tokens[1:3])) and len(c.tokens) <= copy.max_prompt_len


def test_user_task_registry():
    def parity(**_):
        """'<bos> d' -> 'd mod 2'."""
        tok = Tokenizer(list("0123456789"))
        return Task(tok, lambda rng: Prompt([tok.bos_id, tok.ids[str(rng.randrange(10))]]),
                    lambda p, r: float(r[:1] == [tok.ids[str(int(tok.vocab[p.tokens[1]]) % 2)]]), 2)
    register_task("parity-test", parity)
    task = make_task("parity-test")
    assert task.reward(Prompt([1, task.tokenizer.ids["7"]]), [task.tokenizer.ids["1"]]) == 1.0
    with pytest.raises(ValueError, match="already registered"):
        register_task("parity-test", lambda **_: None)
    with pytest.raises(KeyError, match="unknown task"):
        make_task("nope")


def test_group_advantages_hand_computed():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 1.0, 1.0])
    adv = group_advantages(scores, 4)
    # mean 0.5 in both groups; unbiased std sqrt((.25+.25+0+0)/3), then sqrt(4 * .25/3)
    std1, std2 = (0.5 / 3) ** 0.5, (1 / 3) ** 0.5
    expected = torch.tensor([0.5 / (std1 + 1e-6), -0.5 / (std1 + 1e-6), 0.0, 0.0,
                             -0.5 / (std2 + 1e-6), -0.5 / (std2 + 1e-6), 0.5 / (std2 + 1e-6), 0.5 / (std2 + 1e-6)])
    assert torch.allclose(adv, expected)
    assert torch.allclose(group_advantages(scores, 4, norm_std=False),
                          torch.tensor([0.5, -0.5, 0.0, 0.0, -0.5, -0.5, 0.5, 0.5]))
    assert torch.equal(group_advantages(torch.ones(4), 2), torch.zeros(4))  # no signal, no NaN
    with pytest.raises(ValueError):
        group_advantages(scores, 3)


def test_gae_hand_computed():
    # one row: prompt at 0-1, response tokens at 2, 3, 4, then padding at 5
    mask = torch.tensor([[0, 0, 1, 1, 1, 0.]])
    values = torch.tensor([[9, 9, 0.5, 0.2, 0.4, 7.]])   # outside the mask: ignored
    rewards = torch.tensor([[0, 0, 0, 0, 1.0, 0]])
    g, lam = 0.9, 0.8
    d4 = 1.0 - 0.4
    d3 = 0 + g * 0.4 - 0.2
    d2 = 0 + g * 0.2 - 0.5
    a4, a3 = d4, d3 + g * lam * d4
    a2 = d2 + g * lam * a3
    adv, ret = gae_advantages(rewards, values, mask, g, lam)
    assert torch.allclose(adv, torch.tensor([[0, 0, a2, a3, a4, 0]]))
    assert torch.allclose(ret, torch.tensor([[0, 0, a2 + 0.5, a3 + 0.2, a4 + 0.4, 0]]))
    # lam = 1, gamma = 1: advantage = final reward - V_t (Monte-Carlo)
    adv, ret = gae_advantages(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(adv[0, 2:5], torch.tensor([0.5, 0.8, 0.6]))
    assert torch.allclose(ret[0, 2:5], torch.ones(3))
    w = whiten(torch.tensor([[0, 1.0, 2, 3]]), torch.tensor([[0, 1.0, 1, 1]]))
    assert torch.allclose(w, torch.tensor([[0, -1.2247, 0, 1.2247]]), atol=1e-4)


def test_kl_entropy_value_terms():
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert torch.allclose(kl_penalty(lp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    r = torch.tensor([-0.5, 1.0])
    assert torch.allclose(kl_penalty(lp, ref, "k3"), (r.exp() - r - 1)[None])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k2")
    ent = token_entropy(torch.zeros(1, 3, 4))  # uniform over 4 tokens: log 4; column 0 = 0
    log4 = torch.log(torch.tensor(4.0)).item()
    assert torch.allclose(ent, torch.tensor([[0.0, log4, log4]]))
    m = torch.ones(1, 2)
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 1.0]])
    # token 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 3.24; token 1: 1 -> mean 0.5*(3.24+1)/2
    assert torch.isclose(value_loss(v, old, ret, m, 0.2), torch.tensor(0.5 * (3.24 + 1) / 2))
    assert torch.isclose(value_loss(v, old, ret, m, 0.0), torch.tensor(0.5 * (1 + 1) / 2))


def test_unstride_inverts_mesh_split():
    from dispatch import MeshDispatch
    from ftrain.data.training_batch import TrainingBatch
    from ftrain.distributed.parallel_dims import ParallelDims

    ids = torch.arange(12).view(6, 2)
    b = TrainingBatch(ids, torch.ones_like(ids), torch.zeros(6, 2), torch.zeros(6, 2))
    parts = MeshDispatch.split(ParallelDims.from_world(3, 1, 1, 1), (b,), {})
    merged = unstride([{"input_ids": a[0].input_ids, "values": None} for a, _ in parts])
    assert torch.equal(merged["input_ids"], ids) and "values" not in merged


RL = ["cluster.num_workers=2", "rl.enabled=true", "rl.task=copy", "rl.task_args={digits: 1}", "model.vocab_size=16",
      "train.seq_len=8", "model.max_seq_len=16", "rl.max_new_tokens=3", "train.global_batch_size=32",
      "train.mini_batch_size=16", "train.micro_batch_size=8", "rl.group_size=8", "train.lr=0.003"]


def test_config_errors_name_the_field():
    def bad(*overrides, gpus=0):
        with pytest.raises(ConfigError) as e:
            check_task(resolve(load_config(None, [*RL, *overrides]), num_gpus=gpus))
        return str(e.value)

    assert bad("parallel.cp=2", gpus=1).startswith(
        "parallel.cp: 2: RL rollouts (generation) do not support context parallelism")
    assert bad("rl.task=nope").startswith("rl.task: unknown task 'nope'")
    assert bad("rl.task_args={digits: 0}").startswith("rl.task_args:")
    assert bad("rl.task_args={colour: 1}").startswith("rl.task_args:")
    assert bad("rl.task_module=no_such_module").startswith("rl.task_module:")
    assert bad("rl.max_new_tokens=7").startswith("train.seq_len: 8 cannot hold")
    assert bad("model.vocab_size=8").startswith("model.vocab_size:")
    assert bad("rl.group_size=1").startswith("rl.group_size:")
    assert bad("rl.group_size=5").startswith("rl.group_size:")
    assert bad("rl.top_p=0").startswith("rl.top_p:")
    assert bad("rl.temperature=0").startswith("rl.temperature:")
    assert bad("rl.advantage=ppo").startswith("rl.advantage:")
    assert bad("rl.kl_estimator=k2").startswith("rl.kl_estimator:")
    assert bad("rl.gamma=1.5").startswith("rl.gamma:")
    check_task(resolve(load_config(None, [*RL, "rl.group_size=1", "rl.advantage=gae"]), num_gpus=0))


def test_prompts_are_a_pure_function_of_seed_and_step():
    cfg = resolve(load_config(None, RL), num_gpus=0)
    a, b = Rollouts(cfg), Rollouts(cfg)
    assert [p.tokens for p in a.prompts(3)] == [p.tokens for p in b.prompts(3)]
    assert [p.tokens for p in a.prompts(3)] != [p.tokens for p in a.prompts(4)]
    batch = a.prompt_batch(a.prompts(3))
    assert len(batch) == 32 and torch.equal(batch.input_ids[0], batch.input_ids[7])
    assert batch.loss_mask.sum() == 0


# -- real Ray actors ---------------------------------------------------------------------------

def make_cfg(tmp_path, *overrides, spares=0):
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", f"cluster.num_spares={spares}", "checkpoint.interval=0",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", *RL, *overrides]), num_gpus=0)


def run(cfg, steps):
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(steps)
        return trainer, group.state_digests()
    finally:
        group.shutdown()


def test_reward_rises_in_main_train(ray_session, tmp_path):
    """`main.py train` with RL on: 40 steps, mean reward rises; rewards.json and reward.png."""
    import argparse
    import json

    import main

    assert main.cmd_train(make_cfg(tmp_path, "train.steps=40"), argparse.Namespace(quiet=True)) == 0
    rewards = json.loads((tmp_path / "rewards.json").read_text())["rewards"]
    r = [rewards[s] for s in sorted(rewards, key=int)]
    assert len(r) == 40 and (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first, last = sum(r[:5]) / 5, sum(r[-5:]) / 5
    assert last > first + 0.3, r


# GAE critic, KL to the reference policy and an entropy bonus: all of it must be restored.
FULL = ["rl.advantage=gae", "rl.kl_coef=0.05", "rl.entropy_coef=0.01", "rl.group_size=4"]


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    return run(make_cfg(tmp_path_factory.mktemp("rl-ref"), *FULL), 5)


@pytest.mark.parametrize("restore", ["peer", "checkpoint"])
def test_recovered_run_samples_and_trains_as_uninterrupted(reference, tmp_path, restore):
    """A rank killed at the start of step 4 (after that step's rollout): restored from its peer,
    or every rank resumed from the checkpoint of step 2 (step 3 replayed). Rewards (so the
    sampled completions), losses (policy, value, KL, entropy) and weights equal the run without
    failure, bitwise."""
    ref, ref_digests = reference
    trainer, digests = run(make_cfg(tmp_path, *FULL, "checkpoint.interval=2",
                                    f"fault_tolerance.restore={restore}", "fault_tolerance.refill_spares=false",
                                    "chaos.events=[{step: 4, rank: 1, kind: kill, point: step_start}]",
                                    spares=1), 5)
    (tl,) = trainer.recoveries
    assert tl.restore_source == ("peer" if restore == "peer" else "checkpoint step 2")
    assert trainer.rewards == ref.rewards and trainer.losses == ref.losses
    assert trainer.rollout_stats == ref.rollout_stats
    if restore == "checkpoint":
        assert trainer.replayed_rewards == {3: [ref.rewards[3]]}
        assert trainer.replayed == {3: [ref.losses[3]]}
    assert digests == ref_digests


# -- GRPO on a prompt set in veRL's layout --------------------------------------------------------

@pytest.fixture(scope="module")
def prompt_set(stdlib_corpus, tmp_path_factory):
    """Overrides of a GRPO run on a generated arithmetic prompt set (plain prompts, the fixture
    tokenizer, veRL's flexible GSM8K reward with 0.1 for a wrong number)."""
    from ftrain.data.prompt_set import write_arithmetic_prompts

    path = write_arithmetic_prompts(str(tmp_path_factory.mktemp("prompts") / "train.parquet"), rows=40, chat=False)
    return ["data.kind=prompts", f"data.path={path}", f"data.tokenizer={stdlib_corpus[0]}", "model.vocab_size=2048",
            "model.max_seq_len=32", "train.seq_len=32", "rl.max_new_tokens=4",
            "rl.reward_args={method: flexible, format_score: 0.1}"]


@pytest.fixture(scope="module")
def prompt_reference(ray_session, prompt_set, tmp_path_factory):
    return run(make_cfg(tmp_path_factory.mktemp("prompts-ref"), *prompt_set), 6)


@pytest.mark.slow
def test_grpo_on_a_prompt_set_with_two_kills_equals_the_run_without_failure(prompt_reference, prompt_set, tmp_path):
    """Rank 1 killed at the start of step 3 (after its rollout), rank 0 inside the gradient
    all-reduce of step 5; both replaced from spares: prompts (data digests), rewards, losses and
    weights bitwise equal to the run without failure."""
    ref, ref_digests = prompt_reference
    trainer, digests = run(make_cfg(tmp_path, *prompt_set, "chaos.events=[{step: 3, rank: 1, kind: kill, point: "
                                    "step_start}, {step: 5, rank: 0, kind: kill, point: inside_allreduce}]",
                                    spares=2), 6)
    assert len(trainer.recoveries) == 2
    assert trainer.data_digests == ref.data_digests and len(ref.data_digests) == 6
    assert trainer.rewards == ref.rewards and trainer.losses == ref.losses
    assert trainer.rollout_stats == ref.rollout_stats and digests == ref_digests
    assert any(r > 0 for r in ref.rewards.values())   # the reward function saw real completions


def test_recorded_rewards_are_reused_by_a_replay(stdlib_corpus, prompt_set, tmp_path):
    """rl.record_rewards with a reward that is not deterministic: the rewards a step committed
    are stored, and a replay of the same completions (here: a new driver) uses them; other
    completions are scored again."""
    (tmp_path / "noisy.py").write_text("import random\n"
                                       "def score(data_source, solution_str, ground_truth, extra_info):\n"
                                       "    return random.random()\n")
    cfg = make_cfg(tmp_path, *prompt_set, f"rl.reward={tmp_path}/noisy.py:score", "rl.reward_args={}",
                   "rl.record_rewards=true")
    ro = Rollouts(cfg)
    prompts = ro.prompts(1)
    ids = ro.prompt_batch(prompts).input_ids
    mask = torch.zeros(ids.shape)
    mask[:, -2:] = 1
    first = ro.score(1, prompts, ids, mask)
    ro.commit(1)
    again = Rollouts(cfg)
    assert torch.equal(again.score(1, prompts, ids, mask), first)
    assert not torch.equal(again.score(1, prompts, ids, 1 - mask), first)   # other completions: scored again
    assert [json.loads(line)["step"] for line in (tmp_path / "recorded_rewards.jsonl").read_text().splitlines()] == [1]
