"""The rows a rank trains on, read by the rank itself: for `train.objective=ce` the driver sends
the step, not tokens.

DP replica d of dp trains rows d, d + dp, ... of the step's global batch (`data.Data.batch(step,
dp, d)`, the interleave `dispatch.MeshDispatch` cuts a driver's batch into), so every rank of
the replica (each tp, cp, pp rank) reads them from the dataset itself: the same bytes as a
driver-side read, at any dp. The next step's rows (step + 1, same dp rank) are read in a
background thread while this step trains; after a membership change (a recovery's rewind, a DP
shrink) the prefetched rows are of another address and are dropped. The step's `data_digest`
is computed where the rows are: each rank returns its rows' digests
(`TrainingBatch.row_digests`) and the driver combines them in global row order
(`global_digest`), bitwise the digest of the driver-side global batch.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from typing import Callable

import torch

from ftrain.data.training_batch import TrainingBatch, batch_digest
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.objectives.ppo import step_loss_weights


class RankRows:
    """One rank's reader of `data` (a `data.Data`, opened on this rank: its .idx files read,
    its windows built, its .bin files open for range reads) with a one-step prefetch.

    `batch(step, dp, d)`: the rows replica d of dp trains at `step` (the prefetched ones when
    they are of that address); then starts reading (step + 1, dp, d). `digests`: the
    `TrainingBatch.row_digests` of the rows the last `batch` call returned, hashed by the
    reader (the prefetch thread) rather than by the training thread. A read's DataError is
    raised by the `batch` call that asks for those rows (a prefetch nobody asks for is
    dropped with its error). Calls come from one thread (the actor's compute thread); `data` is
    only ever read by one thread at a time."""

    def __init__(self, data):
        self.data = data
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch-rows")
        self._ahead: tuple[tuple[int, int, int], concurrent.futures.Future] | None = None
        self.digests: list[bytes] = []

    def _read(self, step: int, dp: int, d: int) -> tuple[TrainingBatch, list[bytes]]:
        batch = self.data.batch(step, dp, d)
        return batch, batch.row_digests()

    def batch(self, step: int, dp: int, d: int) -> TrainingBatch:
        address, ahead, self._ahead = (step, dp, d), self._ahead, None
        if ahead is not None and ahead[0] == address:
            batch, self.digests = ahead[1].result()
        else:
            if ahead is not None:  # another address (a rewind, a new dp): let it end, drop it
                concurrent.futures.wait([ahead[1]])
            batch, self.digests = self._read(step, dp, d)
        self._ahead = ((step + 1, dp, d), self._pool.submit(self._read, step + 1, dp, d))
        return batch

    def train_batch(self, step: int, dims: ParallelDims, rank: int, train_cfg,
                    dp_sum: Callable[[torch.Tensor], torch.Tensor]) -> TrainingBatch:
        """This rank's rows of `step` with their `loss_weights` (token-mean over each global
        mini-batch, `ppo.step_loss_weights`), bitwise the rows and weights `MeshDispatch` cuts
        from the driver-side global batch. Each mini-batch's masked tokens over every replica:
        this replica's x dp when every row's mask is the same (`Data.fixed_mask`), else summed
        over the DP group by `dp_sum` (a collective, `Engine.dp_sum`). Raises DataError."""
        dp = dims.dp
        batch = self.batch(step, dp, dims.coords(rank).dp)
        counts = batch.loss_mask.view(train_cfg.global_batch_size // train_cfg.mini_batch_size, -1) \
            .sum(1, dtype=torch.float64)
        totals = counts * dp if self.data.fixed_mask else dp_sum(counts)
        return dataclasses.replace(batch, loss_weights=step_loss_weights(batch.loss_mask, train_cfg, "token-mean",
                                                                         dp, totals))


def global_digest(replica_row_digests: list[list[bytes]]) -> str:
    """The global batch's `data_digest` from each DP replica's row digests (in dp order, as
    `MeshDispatch.collect` returns results): row j of the step is row j // dp of replica
    j % dp."""
    # Replica d holds ceil((B - d) / dp) rows (lengths never grow with d): interleaving row k of
    # every replica, k = 0, 1, ..., and dropping the gaps of the shorter ones is that order (in C).
    rows = itertools.chain.from_iterable(itertools.zip_longest(*replica_row_digests))
    return batch_digest(list(filter(None, rows)))
