"""The driver loop: batch -> MeshDispatch -> `train_step` on every rank -> results -> checkpoint,
and recovery when a `WorkerFailure` comes back.

`committed_step` is the last step every rank finished; a step in flight when a failure hits is
re-run after recovery with the same data (data are a pure function of (seed, step, dp rank)).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from checkpoint import CheckpointManager
from config import Config
from fault_tolerance import RecoveryTimeline, recover
from megatron_actor import MegatronActorGroup, WorkerFailure
from training_batch import synthetic_batch

log = logging.getLogger(__name__)


class Trainer:
    """Drives one run over a `MegatronActorGroup`.

    Attributes: `losses` (step -> mean over DP replicas of the replica's PPO loss, float),
    `replayed` (step -> loss of each re-run of a step that had been committed before),
    `recoveries` (list of RecoveryTimeline), `committed_step`, `checkpoints` (committed steps).
    """

    def __init__(self, cfg: Config, group: MegatronActorGroup):
        self.cfg, self.group = cfg, group
        self.ckpt = CheckpointManager(cfg.checkpoint.uri, cfg.checkpoint.keep_last)
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.committed_step = 0
        self.losses: dict[int, float] = {}
        self.replayed: dict[int, list[float]] = {}
        self.recoveries: list[RecoveryTimeline] = []
        self.checkpoints: list[int] = []
        self.failed_at: float | None = None  # set by fault injection: when the fault happened
        self._resume_t: float | None = None

    def batch(self, step: int):
        t, m = self.cfg.train, self.cfg.model
        return synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, m.vocab_size)

    def _step(self, step: int) -> float:
        results = self.group.call("train_step", step, self.batch(step), dispatch="mesh")
        return sum(r["loss"] for r in results) / len(results)

    def train(self, until_step: int, after_step=None) -> None:
        """Train until `committed_step == until_step`, recovering from failures on the way.
        `after_step(trainer, step)` is called after each committed step (demos inject faults
        there). Raises RecoveryError when recovery is impossible."""
        while self.committed_step < until_step:
            step = self.committed_step + 1
            try:
                loss = self._step(step)
                self._commit_step(step, loss)
                interval = self.cfg.checkpoint.interval
                if interval and step % interval == 0:
                    self.save(step)
            except WorkerFailure as failure:
                self.handle_failure(failure)
                continue
            if after_step is not None:
                after_step(self, step)

    def _commit_step(self, step: int, loss: float) -> None:
        if step in self.losses:
            self.replayed.setdefault(step, []).append(loss)
        else:
            self.losses[step] = loss
        self.committed_step = step
        log.info("step %d loss %.6f", step, loss)
        if self._resume_t is not None:
            self.recoveries[-1].first_step_s = time.perf_counter() - self._resume_t
            self.recoveries[-1].append_jsonl(self.run_dir / "recoveries.jsonl")
            self._resume_t = None

    def save(self, step: int) -> None:
        """Every rank writes its shards; the driver commits the manifest last."""
        t0 = time.perf_counter()
        per_rank = self.group.call("save_checkpoint", step)
        files = [f for rank_files in per_rank for f in rank_files]
        d = self.group.dims
        self.ckpt.commit(step, {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "cp": d.cp,
                                "dp": d.dp, "engine": self.cfg.model.engine}, files,
                         {"generation": self.group.generation})
        self.checkpoints.append(step)
        log.info("checkpoint step %d committed in %.2f s", step, time.perf_counter() - t0)

    def handle_failure(self, failure: WorkerFailure) -> RecoveryTimeline:
        """Recover from `failure` and move `committed_step` back to the restored step."""
        log.warning("failure detected: %s", failure)
        tl = recover(self.group, failure, self.ckpt, self.committed_step, self.failed_at)
        self.failed_at = None
        self.recoveries.append(tl)
        self.committed_step = tl.restored_step
        self._resume_t = time.perf_counter()
        log.warning("recovered: ranks %s replaced, restored step %d from %s, %d spare(s) left",
                    tl.failed_ranks, tl.restored_step, tl.restore_source, len(self.group.pool))
        return tl
