import math

import pytest
import torch

from ftrain.objectives.ppo import policy_loss, token_log_probs

# Two sequences of 4 tokens; column 0 and token (1, 3) are masked out.
# Per masked-in token (eps 0.2, clip_ratio_c 3), the loss by hand:
#   (0,1) A=+1 r=1.1: unclipped            -> -1.1
#   (0,2) A=+1 r=1.5: clipped high         -> -1.2
#   (0,3) A=-1 r=4.0: dual clip (-A*c = 3) ->  3.0
#   (1,1) A=-1 r=0.5: clipped low          ->  0.8
#   (1,2) A=+1 r=0.5: unclipped (no clip below 1-eps for A>0) -> -0.5
RATIOS = [[math.exp(10), 1.1, 1.5, 4.0], [1.0, 0.5, 0.5, 100.0]]
ADVANTAGES = [[5.0, 1.0, 1.0, -1.0], [3.0, -1.0, 1.0, 7.0]]
MASK = [[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]


def inputs(old_offset=0.0):
    """Log-probs such that exp(log_probs - old_log_probs) = RATIOS."""
    old = torch.full((2, 4), old_offset)
    log_probs = (old + torch.tensor(RATIOS).log()).requires_grad_()
    return log_probs, old, torch.tensor(ADVANTAGES), torch.tensor(MASK)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (-1.1 - 1.2 + 3.0 + 0.8 - 0.5) / 5),  # 0.2
        ("seq-mean-token-sum", ((-1.1 - 1.2 + 3.0) + (0.8 - 0.5)) / 2),  # 0.5
        ("seq-mean-token-mean", ((-1.1 - 1.2 + 3.0) / 3 + (0.8 - 0.5) / 2) / 2),
    ],
)
def test_policy_loss_by_hand(mode, expected):
    loss, metrics = policy_loss(*inputs(old_offset=-0.7), loss_agg_mode=mode)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)  # (0,2) and (1,1)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)  # (0,3)
    kl = -sum(math.log(r) for r in (1.1, 1.5, 4.0, 0.5, 0.5)) / 5
    assert metrics["ppo_kl"] == pytest.approx(kl, rel=1e-5)
    assert all(isinstance(v, float) for v in metrics.values())


def test_gradient_flows_only_through_unclipped_masked_in_tokens():
    log_probs, old, adv, mask = inputs()
    loss, _ = policy_loss(log_probs, old, adv, mask)
    loss.backward()
    # d(-A r)/d log r = -A r, divided by 5 tokens; clipped and masked tokens get 0.
    expected = torch.tensor([[0.0, -1.1 / 5, 0.0, 0.0], [0.0, 0.0, -0.5 / 5, 0.0]])
    torch.testing.assert_close(log_probs.grad, expected)


def test_masked_tokens_ignored():
    log_probs, old, adv, mask = inputs()
    base, base_metrics = policy_loss(log_probs, old, adv, mask)
    with torch.no_grad():
        log_probs[mask == 0] = torch.tensor([-5.0, 3.0, 8.0])
    adv[mask == 0] = -100.0
    loss, metrics = policy_loss(log_probs, old, adv, mask)
    assert loss.item() == pytest.approx(base.item(), rel=1e-6)
    assert metrics == pytest.approx(base_metrics)


def test_asymmetric_clip_and_scaling():
    one = torch.ones(1, 2)
    mask = torch.tensor([[0.0, 1.0]])
    log_probs = torch.tensor([[0.0, math.log(1.5)]])
    # A=2, r=1.5, eps_high=0.28: -2 * 1.28
    loss, _ = policy_loss(log_probs, 0 * one, 2 * one, mask, eps_clip_low=0.1, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-2.56, rel=1e-6)
    # A=-2, r=0.5, eps_low=0.1: max(2*0.5, 2*0.9) = 1.8 < -A*c = 4
    log_probs = torch.tensor([[0.0, math.log(0.5)]])
    loss, m = policy_loss(
        log_probs, 0 * one, -2 * one, mask, eps_clip_low=0.1, eps_clip_high=0.28, clip_ratio_c=2.0
    )
    assert loss.item() == pytest.approx(1.8, rel=1e-6)
    assert m["pg_clipfrac"] == 1.0 and m["pg_clipfrac_lower"] == 0.0
    # A=-2, r=3, c=2: dual clip caps at -A*c = 4 (instead of 6).
    log_probs = torch.tensor([[0.0, math.log(3.0)]])
    loss, m = policy_loss(log_probs, 0 * one, -2 * one, mask, clip_ratio_c=2.0)
    assert loss.item() == pytest.approx(4.0, rel=1e-6)
    assert m["pg_clipfrac_lower"] == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clip_ratio_c": 1.0}, "ppo.clip_ratio_c"),
        ({"eps_clip_low": 0.0}, "ppo.eps_clip_low"),
        ({"eps_clip_high": 1.0}, "ppo.eps_clip_high"),
        ({"loss_agg_mode": "seq-sum"}, "ppo.loss_agg_mode"),
    ],
)
def test_policy_loss_bad_config(kwargs, match):
    t = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        policy_loss(t, t, t, t, **kwargs)


def test_policy_loss_shape_mismatch():
    t = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(t, t, t, torch.zeros(2, 4))


def test_token_log_probs_matches_direct_computation():
    gen = torch.Generator().manual_seed(0)
    b, s, v = 3, 5, 7
    logits = torch.randn(b, s, v, generator=gen)
    ids = torch.randint(0, v, (b, s), generator=gen)
    out = token_log_probs(logits.bfloat16(), ids)
    assert out.dtype == torch.float32 and out.shape == (b, s)
    expected = torch.zeros(b, s, dtype=torch.float64)
    bf = logits.bfloat16().double()
    for i in range(b):
        for t in range(1, s):
            row = bf[i, t - 1]
            expected[i, t] = row[ids[i, t]] - torch.logsumexp(row, dim=0)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_token_log_probs_uniform_logits():
    ids = torch.tensor([[3, 1, 2]])
    out = token_log_probs(torch.zeros(1, 3, 4), ids)
    torch.testing.assert_close(out, torch.tensor([[0.0, math.log(0.25), math.log(0.25)]]))


def test_token_log_probs_shape_error():
    with pytest.raises(ValueError, match="logits"):
        token_log_probs(torch.zeros(1, 3, 4), torch.zeros(1, 4, dtype=torch.int64))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_global_loss_weights_make_each_mini_batch_exact_under_any_split(mode):
    """sum(loss * w) over the rows of any split of a mini-batch adds up to the mode's reduction
    over the whole mini-batch (rows of different token counts, one row with none)."""
    from ftrain.objectives.ppo import aggregate, global_loss_weights

    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(8, 6, generator=g) < 0.5).float()
    mask[3] = 0
    loss = torch.randn(8, 6, generator=g)
    w = global_loss_weights(mask, mode, mini_batch_size=4, scale=1.0)
    for k in range(2):
        rows = slice(4 * k, 4 * k + 4)
        expected = aggregate(loss[rows], mask[rows], mode)
        halves = sum((loss[r] * w[r]).sum() for r in (slice(4 * k, 4 * k + 1), slice(4 * k + 1, 4 * k + 4)))
        assert torch.allclose(halves, expected, atol=1e-6) and torch.allclose(
            aggregate(loss[rows], mask[rows], mode, w[rows]), expected, atol=1e-6)
    assert torch.allclose(global_loss_weights(mask, mode, 4, scale=3.0), 3.0 * w)


def test_ce_objective_is_the_global_token_mean_however_the_rows_are_split():
    from ftrain.data.training_batch import TrainingBatch
    from ftrain.objectives.ppo import ce_objective, global_loss_weights

    g = torch.Generator().manual_seed(3)
    log_probs = -torch.rand(8, 6, generator=g)
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    mask[:, 0] = 0
    batch = TrainingBatch(torch.zeros(8, 6, dtype=torch.long), torch.ones(8, 6, dtype=torch.long), mask, None,
                          loss_weights=global_loss_weights(mask, "token-mean", 8))
    whole, metrics = ce_objective(log_probs, batch)
    assert metrics == {} and whole.item() == pytest.approx(-(log_probs * mask).sum().item() / mask.sum().item())
    parts = sum(ce_objective(log_probs[i::2], batch.strided(i, 2))[0] for i in range(2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    unweighted, _ = ce_objective(log_probs, TrainingBatch(batch.input_ids, batch.attention_mask, mask, None))
    assert unweighted.item() == pytest.approx(whole.item(), rel=1e-6)


def _one_update_ppo(tmp_path, precomputed: bool) -> dict:
    """Three one-update PPO steps (global = mini batch) of config.yaml's model on one gloo
    rank; `precomputed`: old log-probs from a separate no-grad forward per micro-batch (the
    path before `behaviour_pass_needed`), else left to the engine. Returns the losses, the
    state digest and how many separate log-prob passes the engine ran."""
    import torch.distributed as dist

    from ftrain.config import load_config, resolve
    from ftrain.data.training_batch import synthetic_batch
    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines.torch_engine import TorchEngine

    cfg = resolve(load_config("config.yaml", ["cluster.num_workers=1", "cluster.num_spares=0",
                                              "train.mini_batch_size=16", f"run_dir={tmp_path}"]), num_gpus=0)
    t, e = cfg.train, TorchEngine(cfg)
    e.connect(dist.HashStore(), ParallelDims.from_world(1), 0)
    passes, log_probs = [], e._log_probs
    e._log_probs = lambda *a: (passes.append(1), log_probs(*a))[1]
    try:
        losses = []
        for step in (1, 2, 3):
            b = synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, cfg.model.vocab_size)
            if precomputed:
                with torch.no_grad():
                    b = b.with_old_log_probs(torch.cat([log_probs(e.module, mb) for mb in b.chunk(len(b) // t.micro_batch_size)]))
            losses.append(e.train_step(b, step)["loss"])
        return {"losses": losses, "digest": e.state_digest(), "passes": len(passes)}
    finally:
        dist.destroy_process_group()


def test_one_update_ppo_uses_the_training_forward_for_old_log_probs(tmp_path):
    """With one optimizer update per step the engine runs no separate old-log-prob forward,
    and its losses and final state are bitwise those of the path with that forward."""
    skipped = _one_update_ppo(tmp_path / "a", precomputed=False)
    separate = _one_update_ppo(tmp_path / "b", precomputed=True)
    assert skipped["passes"] == 0
    assert skipped["losses"] == separate["losses"]
    assert skipped["digest"] == separate["digest"]


def test_behaviour_pass_needed_only_for_multi_update_ppo():
    from types import SimpleNamespace as NS

    from ftrain.objectives.ppo import behaviour_pass_needed
    assert behaviour_pass_needed(NS(objective="ppo", global_batch_size=16, mini_batch_size=8))
    assert not behaviour_pass_needed(NS(objective="ppo", global_batch_size=16, mini_batch_size=16))
    assert not behaviour_pass_needed(NS(objective="ce", global_batch_size=16, mini_batch_size=8))
