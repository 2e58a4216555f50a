"""PPO policy loss: token log-probabilities and the dual-clip clipped surrogate.

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


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """sum(values * mask) / sum(mask); 0 when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _aggregate(loss_mat: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Reduce per-token losses [B, S] to a scalar.

    token-mean: sum over masked tokens / number of masked tokens.
    seq-mean-token-sum: per-sequence sum over masked tokens, mean over the B sequences.
    seq-mean-token-mean: per-sequence mean over masked tokens, mean over the B sequences.
    A sequence with no masked tokens counts as 0 in the seq-mean modes.
    """
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
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"ppo.loss_agg_mode={loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
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
    loss = _aggregate(loss_mat, loss_mask, loss_agg_mode)

    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _masked_mean((pg2 > pg1).float(), loss_mask).item(),
            "pg_clipfrac_lower": _masked_mean(((clip1 > pg3) & negative).float(), loss_mask).item(),
            "ppo_kl": _masked_mean(-log_ratio, loss_mask).item(),
        }
    return loss, metrics
