"""`TrainingBatch`, the unit of data a PPO update consumes, and a deterministic synthetic one."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TrainingBatch:
    """A batch of token sequences for a PPO update. B = sequences, S = tokens per sequence.

    input_ids: int64 [B, S].
    attention_mask: int64 [B, S] (1 = real token, 0 = padding).
    loss_mask: float32 [B, S] (1 where the token at t is a response token trained on;
        column 0 is always 0, since no logit predicts the first token).
    advantages: float32 [B, S], or None for the ce objective (next-token cross entropy).
    old_log_probs: float32 [B, S] or None (log p(input_ids[:, t] | input_ids[:, :t]) under
        the behaviour policy, column 0 = 0); None until the old policy has been evaluated.
    returns: float32 [B, S] or None: value targets (GAE lambda-returns, rl.py); None without
        a value head.
    old_values: float32 [B, S] or None: the value head's estimates at rollout time (for value
        clipping), aligned like old_log_probs.
    ref_log_probs: float32 [B, S] or None: log-probs under the frozen reference policy (KL
        penalty); computed by the engine when needed.
    loss_weights: float32 [B, S] or None: each token's weight in the loss of its mini-batch of
        the global batch (`ppo.global_loss_weights`, set by the trainer), so the update does not
        depend on how the rows are split; None: the loss aggregates over the micro-batch alone.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    advantages: Tensor | None
    old_log_probs: Tensor | None = None
    returns: Tensor | None = None
    old_values: Tensor | None = None
    ref_log_probs: Tensor | None = None
    loss_weights: Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __reduce__(self):
        # Pickled (Ray task arguments, results) as numpy arrays: Ray pickles a torch tensor's
        # bytes, slowly for small ones too, and the driver submits one call per rank every step
        # (see bench/results/HISTORY.md). Tensors numpy cannot hold (GPU, bf16) stay tensors.
        tensors = [getattr(self, f.name) for f in dataclasses.fields(self)]
        if any(t is not None and (t.device.type != "cpu" or t.dtype == torch.bfloat16) for t in tensors):
            return TrainingBatch, tuple(tensors)
        return _batch_from_numpy, tuple(None if t is None else t.detach().numpy() for t in tensors)

    def _map(self, fn) -> TrainingBatch:
        """Apply fn to every tensor field (None stays None)."""
        return TrainingBatch(
            **{
                f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                for f in dataclasses.fields(self)
            }
        )

    def row_digests(self) -> list[bytes]:
        """Per row: SHA-256 (32 bytes) of its input_ids (as int64) then its loss_mask (as float32)."""
        ids = self.input_ids.to("cpu", torch.int64).contiguous().numpy()
        mask = self.loss_mask.to("cpu", torch.float32).contiguous().numpy()
        return [hashlib.sha256(i.tobytes() + m.tobytes()).digest() for i, m in zip(ids, mask)]

    def digest(self) -> str:
        """The step's `data_digest`: `batch_digest` of `row_digests`. Equal digests, equal tokens
        trained on with equal masks; a rank reading its own rows digests them where it reads
        them, and the driver combines the rows' digests in global order to the same value."""
        return batch_digest(self.row_digests())

    def strided(self, i: int, n: int) -> TrainingBatch:
        """Rows i, i+n, i+2n, ... (part i of n interleaved parts). Raises ValueError unless
        0 <= i < n and B % n == 0."""
        if not 0 <= i < n or len(self) % n != 0:
            raise ValueError(f"cannot take part {i} of {n} interleaved parts of a batch of {len(self)} sequences")
        return self._map(lambda x: x[i::n].contiguous())

    def chunk(self, n: int) -> list[TrainingBatch]:
        """Split into n equal parts along B, in order. Raises ValueError if n < 1 or B % n != 0."""
        if n < 1 or len(self) % n != 0:
            raise ValueError(f"cannot split a batch of {len(self)} sequences into {n} equal parts")
        size = len(self) // n
        return [self.slice(i * size, (i + 1) * size) for i in range(n)]

    @staticmethod
    def concat(batches: list[TrainingBatch]) -> TrainingBatch:
        """Concatenate along B. Raises ValueError if empty or old_log_probs is set in only some."""
        if not batches:
            raise ValueError("concat needs at least one TrainingBatch")
        has_old = {b.old_log_probs is not None for b in batches}
        if len(has_old) != 1:
            raise ValueError("old_log_probs is set in some batches and None in others")
        return TrainingBatch(
            **{
                f.name: None
                if getattr(batches[0], f.name) is None
                else torch.cat([getattr(b, f.name) for b in batches])
                for f in dataclasses.fields(TrainingBatch)
            }
        )

    def slice(self, start: int, end: int) -> TrainingBatch:
        """Sequences [start, end) (views, no copy)."""
        return self._map(lambda t: t[start:end])

    def to(self, device: torch.device | str) -> TrainingBatch:
        return self._map(lambda t: t.to(device))

    def with_old_log_probs(self, old_log_probs: Tensor) -> TrainingBatch:
        """A copy with old_log_probs (float32 [B, S]) set; the other tensors are shared."""
        return dataclasses.replace(self, old_log_probs=old_log_probs)

    def validate(self, vocab_size: int | None = None) -> None:
        """Check shapes, dtypes, token id range and NaNs.

        Raises:
            ValueError: naming the offending field.
        """
        dtypes = {
            "input_ids": torch.int64,
            "attention_mask": torch.int64,
            "loss_mask": torch.float32,
            "advantages": torch.float32,
            "old_log_probs": torch.float32,
            "returns": torch.float32,
            "old_values": torch.float32,
            "ref_log_probs": torch.float32,
            "loss_weights": torch.float32,
        }
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(self.input_ids.shape)}")
        if self.input_ids.numel() == 0:
            raise ValueError(f"empty batch: input_ids has shape {tuple(self.input_ids.shape)}")
        for name, dtype in dtypes.items():
            t = getattr(self, name)
            if t is None:
                continue
            if t.shape != self.input_ids.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, "
                    f"input_ids has {tuple(self.input_ids.shape)}"
                )
            if t.dtype != dtype:
                raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
            if dtype.is_floating_point and torch.isnan(t).any():
                raise ValueError(f"{name} contains NaN")
        if vocab_size is not None:
            lo, hi = self.input_ids.min().item(), self.input_ids.max().item()
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"input_ids range [{lo}, {hi}] is outside [0, {vocab_size})")
        if (self.loss_mask[:, 0] != 0).any():
            raise ValueError("loss_mask column 0 must be 0 (no logit predicts the first token)")


def batch_digest(row_digests: list[bytes]) -> str:
    """SHA-256 (hex) of the rows' digests (`TrainingBatch.row_digests`) in global row order."""
    return hashlib.sha256(b"".join(row_digests)).hexdigest()


def _seed_of(seed: int, step: int) -> int:
    """A 63-bit generator seed that is a pure function of (seed, step)."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def synthetic_batch(
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    prompt_len: int | None = None,
) -> TrainingBatch:
    """A random batch that is a pure function of (seed, step); the global RNG is not used.

    Each sequence is `prompt_len` prompt tokens (loss_mask 0), then a response of random
    length in [1, seq_len - prompt_len] (loss_mask 1), then padding (input_ids 0,
    attention_mask 0, loss_mask 0). Advantages are one N(0, 1) draw per sequence broadcast
    over its response tokens (0 elsewhere); old_log_probs is None.

    Args:
        prompt_len: defaults to seq_len // 2.

    Raises:
        ValueError: batch_size < 1, vocab_size < 1, or prompt_len not in [1, seq_len).
    """
    prompt_len = seq_len // 2 if prompt_len is None else prompt_len
    if batch_size < 1 or vocab_size < 1 or not 1 <= prompt_len < seq_len:
        raise ValueError(
            f"need batch_size >= 1, vocab_size >= 1 and 1 <= prompt_len < seq_len; got "
            f"batch_size={batch_size}, vocab_size={vocab_size}, prompt_len={prompt_len}, "
            f"seq_len={seq_len}"
        )
    gen = torch.Generator().manual_seed(_seed_of(seed, step))
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    response_len = torch.randint(1, seq_len - prompt_len + 1, (batch_size, 1), generator=gen)
    advantage = torch.randn(batch_size, 1, generator=gen)

    pos = torch.arange(seq_len).unsqueeze(0)  # [1, S]
    real = pos < prompt_len + response_len  # [B, S]
    response = real & (pos >= prompt_len)
    return TrainingBatch(
        input_ids=ids * real,
        attention_mask=real.long(),
        loss_mask=response.float(),
        advantages=advantage * response,
    )


def _batch_from_numpy(*arrays) -> TrainingBatch:
    """Inverse of `TrainingBatch.__reduce__` (copies arrays that Ray hands over read-only)."""
    return TrainingBatch(*(None if a is None else torch.from_numpy(a if a.flags.writeable else a.copy())
                           for a in arrays))
