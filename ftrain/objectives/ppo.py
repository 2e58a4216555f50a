"""PPO policy loss: token log-probabilities and the dual-clip clipped surrogate; the
cross-entropy objective (`ce_objective`) shares their global-batch reduction.

References:
    PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
    Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
        Reinforcement Learning", arXiv:1912.09729.
    Asymmetric clip range (clip-higher): Yu et al. 2025, "DAPO", arXiv:2503.14476.
Semantics follow verl's `compute_policy_loss` and `agg_loss` (verl/trainer/ppo/core_algos.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# Bound on |log ratio| before exp, as in verl, so a stale or padded token cannot give inf.
_MAX_LOG_RATIO = 20.0


def token_log_probs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Log-probability of each token under the model that produced `logits`.

    Args:
        logits: float [B, S, V]; position t holds the logits that predict token t + 1.
        input_ids: int64 [B, S].

    Returns:
        float32 [B, S]; column t = log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1,
        column 0 = 0 (nothing predicts the first token). Computed in float32.

    Raises:
        ValueError: shapes do not match.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [B, S, V] with [B, S] = input_ids "
            f"{tuple(input_ids.shape)}"
        )
    log_p = F.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, S-1, V]
    picked = log_p.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, S-1]
    return F.pad(picked, (1, 0))


def _check_agg_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"ppo.loss_agg_mode={mode!r} is not one of {LOSS_AGG_MODES}")


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """sum(values * mask) / sum(mask); 0 when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _aggregate(loss_mat: Tensor, mask: Tensor, mode: str, weights: Tensor | None = None) -> Tensor:
    """Reduce per-token losses [B, S] to a scalar.

    token-mean: sum over masked tokens / number of masked tokens.
    seq-mean-token-sum: per-sequence sum over masked tokens, mean over the B sequences.
    seq-mean-token-mean: per-sequence mean over masked tokens, mean over the B sequences.
    A sequence with no masked tokens counts as 0 in the seq-mean modes.
    With `weights` (float32 [B, S], from `global_loss_weights`): sum(loss_mat * weights), the
    part of the mode's reduction over a larger batch that these rows contribute.
    """
    if weights is not None:
        return (loss_mat * weights).sum()
    if mode == "token-mean":
        return _masked_mean(loss_mat, mask)
    seq_sum = (loss_mat * mask).sum(dim=-1)  # [B]
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    return (seq_sum / mask.sum(dim=-1).clamp(min=1)).mean()


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Dual-clip PPO policy loss (to minimise).

    Per token, with r = exp(log_probs - old_log_probs) and A = advantages:
        clip1 = max(-A * r, -A * clamp(r, 1 - eps_clip_low, 1 + eps_clip_high))
        loss  = min(clip1, -A * clip_ratio_c) if A < 0 else clip1
    then reduced over the tokens where loss_mask = 1 by `loss_agg_mode` (see `_aggregate`).

    Args:
        log_probs: float32 [B, S], current policy (carries the gradient).
        old_log_probs: float32 [B, S], behaviour policy.
        advantages: float32 [B, S].
        loss_mask: float32 [B, S], 1 = token trained on.
        loss_weights: float32 [B, S] or None: reduce by sum(loss * loss_weights) instead of
            the mode over these rows (`global_loss_weights`: the mode over the global batch).

    Returns:
        (loss, metrics): loss is a scalar tensor; metrics are python floats over masked tokens:
        pg_clipfrac (fraction where the clipped term was taken), pg_clipfrac_lower (fraction
        where the dual clip bound was taken), ppo_kl (mean of old_log_probs - log_probs).

    Raises:
        ValueError: shapes differ, eps_clip_* not in (0, 1), clip_ratio_c <= 1, or an
            unknown loss_agg_mode.
    """
    if not (0 < eps_clip_low < 1 and 0 < eps_clip_high < 1):
        raise ValueError(
            f"ppo.eps_clip_low={eps_clip_low} and ppo.eps_clip_high={eps_clip_high} "
            f"must be in (0, 1)"
        )
    if clip_ratio_c <= 1:
        raise ValueError(f"ppo.clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip lower bound)")
    _check_agg_mode(loss_agg_mode)
    shapes = {t.shape for t in (log_probs, old_log_probs, advantages, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(
            f"log_probs, old_log_probs, advantages and loss_mask must share one shape, got "
            f"{[tuple(s) for s in shapes]}"
        )

    log_ratio = (log_probs - old_log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clip1, pg3), clip1)
    loss = _aggregate(loss_mat, loss_mask, loss_agg_mode, loss_weights)

    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _masked_mean((pg2 > pg1).float(), loss_mask).item(),
            "pg_clipfrac_lower": _masked_mean(((clip1 > pg3) & negative).float(), loss_mask).item(),
            "ppo_kl": _masked_mean(-log_ratio, loss_mask).item(),
        }
    return loss, metrics


# -- advantages, value loss, KL and entropy terms (on-policy RL, see rl.py) --------------------


def group_advantages(scores: Tensor, group_size: int, norm_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages: each sample's reward normalised within its prompt's group.

    Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2 (outcome supervision):
        A_i = (r_i - mean(r_group)) / std(r_group)
    with std the unbiased sample standard deviation (as verl), plus `eps`. `norm_std=False`
    drops the division (Liu et al. 2025, "Dr. GRPO", arXiv:2503.20783).

    Args:
        scores: float32 [B], one reward per sample; rows [g*G, (g+1)*G) are the G =
            `group_size` samples of prompt g.

    Returns:
        float32 [B]: one advantage per sample (the caller broadcasts it over the response).

    Raises:
        ValueError: B is not a multiple of group_size, or group_size < 2.
    """
    if group_size < 2 or scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(f"scores {tuple(scores.shape)} must be [B] with B a multiple of "
                         f"group_size={group_size} >= 2")
    groups = scores.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if norm_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                   lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over each sequence's response tokens.

    Schulman et al. 2015, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", arXiv:1506.02438, eqs. (11)-(16):
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = sum_l (gamma * lam)^l * delta_{t+l}   (A_t = delta_t + gamma * lam * A_{t+1})
        R_t     = A_t + V_t   (the value target, lambda-return)
    with V_{t+1} = 0 after the last response token (the episode ends there).

    Args:
        rewards: float32 [B, S], per-token rewards (usually the outcome reward on the last
            response token, 0 elsewhere).
        values: float32 [B, S], V_t of the state before response token t (aligned like
            `token_log_probs`: column t belongs to the action token t).
        mask: float32 [B, S], 1 on response tokens (contiguous per row).

    Returns:
        (advantages, returns): float32 [B, S], 0 outside the mask.
    """
    values = values * mask
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    seq = values.shape[1]
    for t in reversed(range(seq)):
        nxt_mask = mask[:, t + 1] if t + 1 < seq else torch.zeros_like(last)
        nxt_value = values[:, t + 1] * nxt_mask if t + 1 < seq else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * nxt_value - values[:, t]
        last = delta + gamma * lam * last * nxt_mask
        advantages[:, t] = last
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked entries (the usual PPO advantage normalisation);
    0 outside the mask. values, mask: float32 [B, S]."""
    mean = _masked_mean(values, mask)
    var = _masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


KL_ESTIMATORS = ("k1", "k3")


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), with
    log_ratio = ref_log_probs - log_probs:
        k1 = -log_ratio                          (unbiased, high variance, can be negative)
        k3 = exp(log_ratio) - log_ratio - 1      (unbiased, >= 0; GRPO's penalty,
                                                  DeepSeekMath arXiv:2402.03300 eq. 4)
    Args: float32 [B, S] each. Returns float32 [B, S]. Raises ValueError for another estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"rl.kl_estimator={estimator!r} is not one of {KL_ESTIMATORS}")
    log_ratio = (ref_log_probs - log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_ratio
    return torch.exp(log_ratio) - log_ratio - 1


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each position's next-token distribution, aligned like `token_log_probs`:
    column t = H(p(. | input_ids[:, :t])) for t >= 1, column 0 = 0.
    logits: float [B, S, V]. Returns float32 [B, S]."""
    log_p = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return F.pad(-(log_p.exp() * log_p).sum(-1), (1, 0))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float, loss_agg_mode: str = "token-mean", weights: Tensor | None = None) -> Tensor:
    """Clipped value loss of PPO (Schulman et al. 2017, arXiv:1707.06347, as in the OpenAI
    baselines implementation and verl's `compute_value_loss`):
        V_clip = old_V + clamp(V - old_V, -clip, clip)
        loss   = 0.5 * max((V - R)^2, (V_clip - R)^2), aggregated over the mask.
    values, old_values, returns, mask: float32 [B, S]. clip <= 0 disables clipping. `weights`:
    as `_aggregate`'s. Returns a scalar tensor."""
    err = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return _aggregate(0.5 * err, mask, loss_agg_mode, weights)


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", weights: Tensor | None = None) -> Tensor:
    """Public form of the loss reduction used by `policy_loss` (see `_aggregate`)."""
    return _aggregate(loss_mat, mask, mode, weights)


def global_loss_weights(loss_mask: Tensor, mode: str, mini_batch_size: int, scale: float = 1.0,
                        totals: Tensor | None = None) -> Tensor:
    """Per-token weights that make `loss_agg_mode` exact over each mini-batch of the global
    batch, however its rows are split over DP replicas and micro-batches.

    Mini-batch k is rows [k * mini_batch_size, (k + 1) * mini_batch_size) of `loss_mask`
    (float32 [B, S] of the global batch; `dispatch.MeshDispatch` keeps it so at any dp). For
    its rows, with m = mini_batch_size, T = its masked tokens and n_b row b's masked tokens:
    token-mean w = mask / T; seq-mean-token-sum w = mask / m; seq-mean-token-mean
    w = mask / (n_b * m) (an empty row or mini-batch weighs 0). Then sum(loss * w) over any
    split of the mini-batch's rows adds up to the mode's reduction over the whole mini-batch.
    `scale` multiplies every weight: an engine that averages over its micro-batches and DDP
    over its dp replicas needs scale = dp * micro-batches per replica to restore the sum.
    `totals` (token-mean only): float64 [K], each mini-batch's masked tokens over all its rows,
    when `loss_mask` holds a part of each (one DP replica's rows; mini_batch_size is then the
    part's rows per mini-batch): the weights are those rows of the whole batch's, bitwise.
    Returns float32 [B, S]. Raises ValueError for an unknown mode or B % mini_batch_size != 0."""
    _check_agg_mode(mode)
    if loss_mask.shape[0] % mini_batch_size:
        raise ValueError(f"a batch of {loss_mask.shape[0]} rows has no whole mini-batches of {mini_batch_size}")
    minis = loss_mask.view(-1, mini_batch_size, loss_mask.shape[1])     # [K, m, S]
    if mode == "token-mean":  # counted exactly (float64), as `totals` are
        norm = (minis.sum(dim=(1, 2), dtype=torch.float64) if totals is None else totals).float().view(-1, 1, 1)
    elif mode == "seq-mean-token-sum":
        norm = torch.full((minis.shape[0], 1, 1), float(mini_batch_size))
    else:
        norm = minis.sum(dim=2, keepdim=True) * mini_batch_size          # [K, m, 1]
    return (minis * scale / norm.clamp(min=1)).view_as(loss_mask)


def step_loss_weights(loss_mask: Tensor, train_cfg, mode: str, dp: int, totals: Tensor | None = None) -> Tensor:
    """`global_loss_weights` for a step trained at DP size dp (`train_cfg`: mini- and
    micro-batch sizes): the scale undoes the engines' mean over a replica's micro-batches and
    DDP's mean over dp. `loss_mask`: the global batch's (totals None), or one replica's rows
    with `totals` (token-mean: each mini-batch's masked tokens over every replica)."""
    scale = dp * (train_cfg.mini_batch_size // dp // train_cfg.micro_batch_size)
    rows = train_cfg.mini_batch_size if totals is None else train_cfg.mini_batch_size // dp
    return global_loss_weights(loss_mask, mode, rows, scale, totals)


def ce_objective(log_probs: Tensor, mb) -> tuple[Tensor, dict[str, float]]:
    """Next-token cross entropy of one micro-batch: -sum(log_probs * w), w = the micro-batch's
    `loss_weights` (`global_loss_weights` with token-mean: its share of the token-mean over
    the global mini-batch, Megatron's per-token loss), else the token-mean over its own mask.
    log_probs: float32 [B, S] (`token_log_probs`, carries the gradient); mb: a TrainingBatch
    (loss_mask, loss_weights). Returns (loss, {}): a scalar tensor, no metrics."""
    return -_aggregate(log_probs, mb.loss_mask, "token-mean", mb.loss_weights), {}


def behaviour_pass_needed(train_cfg) -> bool:
    """Whether a step needs the old (pre-update) policy's log-probs from a forward pass of
    its own: PPO with more than one optimizer update per step (global_batch_size >
    mini_batch_size; later mini-batches train a policy that has moved). With one update the
    training forward runs the pre-update policy: its detached log-probs are the old ones
    (`ppo_objective`), bitwise those of a separate pass. `ce` has no old log-probs."""
    return train_cfg.objective == "ppo" and train_cfg.global_batch_size != train_cfg.mini_batch_size


def ppo_objective(log_probs: Tensor, mb, ppo_cfg, rl_cfg=None, values: Tensor | None = None,
                  entropy: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The loss of one micro-batch, as both engines train it: the dual-clip PPO policy loss
    (`policy_loss`), and with RL (`rl_cfg` given) plus `value_coef` x the clipped value loss
    (when `values` are given: GAE's value head), `kl_coef` x KL(policy || reference) (when the
    micro-batch has `ref_log_probs`), and - `entropy_coef` x the entropy (when `entropy` is
    given), each aggregated with `ppo_cfg.loss_agg_mode`: over the micro-batch alone, or with
    the micro-batch's `loss_weights` (`global_loss_weights`) as its share of the global batch's.

    Args:
        log_probs: float32 [B, S] of the current policy (carries the gradient).
        mb: the micro-batch (`training_batch.TrainingBatch`: old_log_probs, advantages,
            loss_mask, loss_weights, and for RL old_values, returns, ref_log_probs).
            old_log_probs None: one optimizer update per step (`behaviour_pass_needed`
            false), whose behaviour policy is the policy being trained: `log_probs.detach()`.
        values: float32 [B, S] or None; entropy: float32 [B, S] (`token_entropy`) or None.

    Returns:
        (loss, metrics): a scalar tensor and python floats (`policy_loss`'s, plus with RL
        `pg_loss` and `vf_loss` / `kl` / `entropy` for the terms that are on).
    """
    p, r, w = ppo_cfg, rl_cfg, mb.loss_weights
    old = log_probs.detach() if mb.old_log_probs is None else mb.old_log_probs
    loss, metrics = policy_loss(log_probs, old, mb.advantages, mb.loss_mask,
                                p.eps_clip_low, p.eps_clip_high, p.clip_ratio_c, p.loss_agg_mode, w)
    if r is None:
        return loss, metrics
    metrics["pg_loss"] = loss.item()
    if values is not None:
        vf = value_loss(values, mb.old_values, mb.returns, mb.loss_mask, r.value_clip, p.loss_agg_mode, w)
        loss = loss + r.value_coef * vf
        metrics["vf_loss"] = vf.item()
    if mb.ref_log_probs is not None:
        kl = _aggregate(kl_penalty(log_probs, mb.ref_log_probs, r.kl_estimator), mb.loss_mask, p.loss_agg_mode, w)
        loss = loss + r.kl_coef * kl
        metrics["kl"] = kl.item()
    if entropy is not None:
        ent = _aggregate(entropy, mb.loss_mask, p.loss_agg_mode, w)
        loss = loss - r.entropy_coef * ent
        metrics["entropy"] = ent.item()
    return loss, metrics
