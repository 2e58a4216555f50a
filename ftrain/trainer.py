"""The driver loop: batch -> MeshDispatch -> `train_step` on every rank -> results -> checkpoint,
and recovery when a `WorkerFailure` comes back.

With `rl.enabled` the batch is experience: prompts of the step -> `generate` on every DP
replica -> rewards and advantages on the driver (rl.Rollouts) -> `train_step`. The rollout is
part of the step: a step re-run after recovery samples the same completions again (sampling is a
pure function of the committed weights and (seed, step, row)).

`committed_step` is the last step every rank finished; a step in flight when a failure hits is
re-run after recovery with the same data (data are a pure function of (seed, step, dp rank)).
A new driver of a run continues it with `resume` (its newest verified checkpoint, loaded as
recovery loads one); its checkpoints and recoveries only ever use the run's own (`run`).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import statistics
import time
from pathlib import Path

from ftrain.config import Config, ConfigError
from ftrain.control.actor_group import ActorGroup
from ftrain.data.dataset import data_fingerprint
from ftrain.data.rank_rows import global_digest
from ftrain.data.training_batch import synthetic_batch
from ftrain.failures import RecoveryTimeline, WorkerFailure, slowest
from ftrain.objectives.ppo import step_loss_weights
from ftrain.ops.metrics import RunMetrics
from ftrain.recovery.fault_tolerance import grow_back, grow_back_size, recover, restore_checkpoint_through_outage
from ftrain.state.manifest import CheckpointError, check_compatible, model_signature
from ftrain.state.run_identity import RunIdentity

log = logging.getLogger(__name__)


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic garbage collector's reach
    (`gc.freeze`): the driver's long-lived heap (Ray, torch, the group's handles: hundreds of
    thousands of objects) is then not traversed by the full collections that each step's
    short-lived results trigger, which at 1,024 ranks cost as much as reading the results
    (`bench.driver_wait`). Called when the membership is set (training starts, a recovery or a
    grow ends); `Trainer.train` unfreezes when it ends. A frozen object is still freed when its
    last reference goes; one that becomes unreachable only through a reference cycle waits for
    the unfreeze."""
    gc.collect()
    gc.freeze()


class Trainer:
    """Drives one run over an `ActorGroup`.

    Attributes: `losses` (step -> the step's PPO loss: mean over its mini-batches of each one's
    `ppo.loss_agg_mode` over the global mini-batch, float), `grad_norms` (step -> the largest
    gradient norm before clipping of its mini-batches),
    `rewards` (RL: step -> mean reward of the step's samples), `replayed_rewards`,
    `rollout_stats` (RL: step -> reward, exact, response_len),
    `replayed` (step -> loss of each re-run of a step that had been committed before),
    `data_digests` (step -> SHA-256 of its global batch's tokens and loss mask, as first
    committed; a replay that reads other data logs `event=data_mismatch`), `data` (the
    `data.Data` the ranks read, train.objective=ce: `ActorGroup.data`; else None),
    `recoveries` (list of RecoveryTimeline), `grows` (RecoveryTimeline of kind 'grow' of each
    return to the configured DP size after a shrink), `committed_step`, `checkpoints` (committed steps),
    `run` (the RunIdentity its checkpoints record; a new run unless given), `resumed_from`
    (the step `resume` continued from, else None). The group's `fence` (`ActorGroup.fence`) is
    called before each checkpoint commit and each recovery too.
    """

    def __init__(self, cfg: Config, group: ActorGroup, ckpt, metrics: RunMetrics | None = None,
                 run: RunIdentity | None = None, data=None):
        """`ckpt`: the run's checkpoint manager (the example's `checkpoint.CheckpointManager` of
        `cfg.checkpoint`): saves are committed, and checkpoint restores read, through it."""
        self.cfg, self.group, self.ckpt = cfg, group, ckpt
        self.data = data if data is not None else group.data  # data.Data, or None for synthetic batches
        self.data_fingerprint = data_fingerprint(cfg)  # recorded by every checkpoint (None: synthetic)
        self.run = run or RunIdentity.new(cfg)
        self.resumed_from: int | None = None
        self.metrics = metrics or RunMetrics(cfg.train.global_batch_size * cfg.train.seq_len)
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.committed_step = 0
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}  # step -> the largest gradient norm of its mini-batches
        self.replayed: dict[int, list[float]] = {}
        self.data_digests: dict[int, str] = {}  # step -> its global batch's digest (TrainingBatch.digest)
        self._digest = ""  # digest of the step in flight
        self.rewards: dict[int, float] = {}
        self.replayed_rewards: dict[int, list[float]] = {}
        self.rollout_stats: dict[int, dict] = {}
        self._stats: dict = {}  # rollout stats of the step in flight
        self.rollouts = None
        if cfg.rl.enabled:
            from ftrain.rl.rollouts import Rollouts
            self.rollouts = Rollouts(cfg)
        self.recoveries: list[RecoveryTimeline] = []
        self.grows: list[RecoveryTimeline] = []
        self.checkpoints: list[int] = []
        self.failed_saves: list[int] = []   # steps whose save hit a storage error
        self._resume_t: float | None = None
        self.step_times: list[float] = []
        self._steady_times: list[float] = []  # step times, without the first and the first after a recovery
        self.save_stalls: list[float] = []   # seconds training waited for each save
        self._save_call_times: list[float] = []  # seconds of each save call that returned (`save_deadline`)
        self.save_details: list[dict] = []   # async saves: the slowest rank's seconds by part of starting each
        self.final_save_wait_s = 0.0         # seconds the end of `train` waited for the last writes
        self._pending_save: tuple[int, float] | None = None  # (step, start) of an async save
        self._save_due = False               # a due save postponed (`_postpone`)
        self.postponed_saves: list[int] = []  # steps whose due save waited for the previous one's write
        self._chaos_fired: set[int] = set()
        self.kept_step: int | None = None  # newest step every rank's keeper held at the last step's end (-1: none; None: no keeper)
        self.keeper_wait_s = 0.0  # the last step's longest wait of a rank for its previous keeper send

    def batch(self, step: int):
        """The global batch of `step` for PPO on synthetic data (`synthetic_batch`), validated
        against the vocabulary. (With train.objective=ce the ranks read their own rows.)"""
        t, m = self.cfg.train, self.cfg.model
        batch = synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, m.vocab_size)
        batch.validate(m.vocab_size)  # a malformed batch fails here, before any rank sees it
        return batch

    def with_loss_weights(self, batch):
        """`batch` with `loss_weights` for the current DP size (`ppo.global_loss_weights`): the
        loss of each mini-batch is its `ppo.loss_agg_mode` over the whole global mini-batch, so
        the update does not depend on dp or the micro-batch split (a shrink, a reshard). The
        scale undoes the engines' mean over a replica's micro-batches and DDP's mean over dp."""
        weights = step_loss_weights(batch.loss_mask, self.cfg.train, self.cfg.ppo.loss_agg_mode, self.group.dims.dp)
        return dataclasses.replace(batch, loss_weights=weights)

    def step_deadline(self) -> float:
        """Seconds a step may take before it is a hang: `hang_factor` x the median of the last
        20 step times, at least `min_step_timeout_s`, at most (and before any step)
        `step_timeout_s`. The deadline is extended while progress counters move."""
        ft = self.cfg.fault_tolerance
        if not self.step_times:
            return ft.step_timeout_s
        median = statistics.median(self.step_times[-20:])
        return min(ft.step_timeout_s, max(ft.min_step_timeout_s, ft.hang_factor * median))

    def culprit_deadline(self) -> float | None:
        """Seconds without any progress after which a rank that its peers wait for in a
        collective is hung (`HealthMonitor.wait`'s `culprit_s`: found before the step deadline
        and its `min_step_timeout_s` floor): `hang_factor` x the median step time, at least
        `health_timeout_s` (the silence that makes an actor dead), at most the step deadline.
        None before a steady step ran and for the first step after a recovery, which may build
        and warm up without progress."""
        ft = self.cfg.fault_tolerance
        if not self._steady_times or self._resume_t is not None:
            return None
        median = statistics.median(self.step_times[-20:])
        return min(self.step_deadline(), max(ft.health_timeout_s, ft.hang_factor * median))

    def save_deadline(self) -> float:
        """Seconds a save call may go without progress before it is a hang (`HealthMonitor.wait`
        extends it while any progress counter moves, checkpoint I/O included: slow storage that
        moves stays alive): `hang_factor` x the median of the last 20 save calls' seconds, at
        least the step deadline (`step_deadline`), at most `step_timeout_s`; before a save call
        returned, `step_timeout_s` (a first save plans its layout, a collective of every rank
        that moves no byte)."""
        ft = self.cfg.fault_tolerance
        if not self._save_call_times:
            return ft.step_timeout_s
        pace = ft.hang_factor * statistics.median(self._save_call_times[-20:])
        return min(ft.step_timeout_s, max(self.step_deadline(), pace))

    def _save_call(self, method: str, *args):
        """`group.call(method, *args)` of a save within `save_deadline`, its seconds recorded."""
        t0 = time.perf_counter()
        out = self.group.call(method, *args, timeout=self.save_deadline())
        self._save_call_times.append(time.perf_counter() - t0)
        return out

    def steady_step_s(self) -> float:
        """Median seconds of the steps run so far, without this trainer's first step and the
        first step after each recovery: what the first step after a recovery would cost with no
        recovery (that step's excess is the recovery's). Raises statistics.StatisticsError when
        no such step ran."""
        return statistics.median(self._steady_times)

    def _arm_chaos(self, step: int) -> None:
        """Arm the `chaos.events` of this step (each fires once, even if the step is re-run)."""
        for i, ev in enumerate(self.cfg.chaos.events):
            if ev["step"] != step or i in self._chaos_fired:
                continue
            self._chaos_fired.add(i)
            log.warning("chaos: %s", ev)
            if ev["kind"] == "node":
                self.group.kill_node_of(ev["rank"])
            else:
                self.group.arm_fault(ev["rank"], ev["kind"], ev["point"])

    def experience(self, step: int):
        """RL: the step's prompts, sampled by every DP replica (`generate`, interleaved rows as
        `MeshDispatch` splits them), scored and turned into a TrainingBatch with advantages.
        Sets `self._stats` (reward, exact, response_len). Raises WorkerFailure."""
        prompts, task = self.rollouts.prompts(step), self.rollouts.task
        parts = self.group.call("generate", step, self.rollouts.prompt_batch(prompts), task.stop_ids, task.pad_id,
                                timeout=self.step_deadline())
        batch, self._stats = self.rollouts.experience(step, prompts, parts)
        return batch

    def _step(self, step: int) -> float:
        self._arm_chaos(step)
        t0 = time.perf_counter()
        if self.data is not None:  # ce: each rank reads its own rows (`rank_rows`)
            results = self.group.call("train_step", step, timeout=self.step_deadline(),
                                      culprit_s=self.culprit_deadline())
            self._digest = global_digest([r.pop("row_digests") for r in results])
        else:
            batch = self.with_loss_weights(self.batch(step) if self.rollouts is None else self.experience(step))
            self._digest = batch.digest()
            results = self.group.call("train_step", step, batch, timeout=self.step_deadline(),
                                      culprit_s=self.culprit_deadline())
        self.step_times.append(time.perf_counter() - t0)
        if self._resume_t is not None:  # first step after a recovery: where its time went
            parts = [r["phases"] for r in results if "phases" in r]
            if parts:
                self.recoveries[-1].first_step_detail = slowest(parts)
        elif len(self.step_times) > 1:
            self._steady_times.append(self.step_times[-1])
        self.grad_norms[step] = results[0]["grad_norm"]  # after the all-reduce: the same on every replica
        kept = [r.get("kept_step") for r in results if "kept_shards" in r]
        self.kept_step = None if not kept else -1 if None in kept else min(kept)
        self.keeper_wait_s = max((r.get("kept_wait_s", 0.0) for r in results), default=0.0)
        return sum(r["loss"] for r in results) / len(results)

    def train(self, until_step: int, after_step=None) -> None:
        """Train until `committed_step == until_step`, recovering from failures on the way.
        `after_step(trainer, step)` is called after each committed step (demos inject faults
        there). Raises RecoveryError when recovery is impossible. The driver's heap is frozen
        while it trains (`freeze_heap`) and unfrozen when it returns or raises, so that what
        became cyclic garbage meanwhile (a replaced group's objects) is collected again."""
        freeze_heap()
        try:
            self._train(until_step, after_step)
        finally:
            gc.unfreeze()

    def _train(self, until_step: int, after_step) -> None:
        while True:
            try:
                if self.committed_step >= until_step:
                    if self._save_due:  # a postponed save: the last step is saved, as without postponing
                        self.save(self.committed_step, final=True)
                    self.finish_save(stall=False)
                    if self.failed_saves and not self.checkpoints:
                        log.warning("%s", self.no_commit_line())
                    return
                step = self.committed_step + 1
                loss = self._step(step)
                self._commit_step(step, loss)
                self.finish_save(wait=False)
                interval = self.cfg.checkpoint.interval
                if interval and step % interval == 0 or self._save_due:
                    if self._pending_save is not None:  # still being written: no wait, save later
                        self._postpone(step)
                    else:
                        self.save(step)
            except WorkerFailure as failure:
                self.handle_failure(failure)
                continue
            self.group.poll_refills()
            try:
                self.grow_back()
            except WorkerFailure as failure:
                self.handle_failure(failure)
                continue
            if after_step is not None:
                after_step(self, step)

    def grow_back(self) -> RecoveryTimeline | None:
        """At a step boundary after a DP shrink: once the pool holds spares for every missing
        replica (refills done, a node added back), grow DP back to the configured size
        (`fault_tolerance.grow_back`: a new generation, the new replicas restored from a DP
        peer; not with Megatron's distributed optimizer, whose shards no peer holds); the async
        save in flight, of the smaller layout, is committed first. Logs
        `event=grow` with the timeline and returns it (also in `grows`); None when there is
        nothing to grow. Raises WorkerFailure when a member fails meanwhile."""
        m = self.cfg.model
        if m.engine == "megatron" and m.distributed_optimizer:
            return None  # the new replicas' optimizer shards are on no peer: growing would rewind
        d = self.group.dims
        per_replica = d.tp * d.pp * d.cp
        dp = grow_back_size(d.dp, self.cfg.cluster.num_workers // per_replica, len(self.group.pool), per_replica)
        if dp is None:
            return None
        self.finish_save()
        old_dp = d.dp
        tl = grow_back(self.group, self.ckpt, self.committed_step, dp, self.cfg.fault_tolerance,
                       lambda manifest: check_compatible(self.cfg, manifest), run_id=self.run.id)
        self.grows.append(tl)
        self.committed_step = tl.restored_step
        log.warning("event=grow dp=%d->%d ranks=%s generation=%d step=%d source=%s timeline=%s", old_dp, dp,
                    ",".join(map(str, tl.failed_ranks)), tl.generation, tl.restored_step, tl.restore_source,
                    json.dumps(dataclasses.asdict(tl)))
        freeze_heap()
        return tl

    def _commit_step(self, step: int, loss: float) -> None:
        reward = self._stats.get("reward")
        if step in self.data_digests and self.data_digests[step] != self._digest:
            log.error("event=data_mismatch step=%d first=%s replay=%s: a replayed step read other data",
                      step, self.data_digests[step][:16], self._digest[:16])
        self.data_digests.setdefault(step, self._digest)
        if self.rollouts is not None:
            self.rollouts.commit(step)
        if step in self.losses:
            self.replayed.setdefault(step, []).append(loss)
            if reward is not None:
                self.replayed_rewards.setdefault(step, []).append(reward)
        else:
            self.losses[step] = loss
            if reward is not None:
                self.rewards[step], self.rollout_stats[step] = reward, dict(self._stats)
        self.committed_step = step
        if self._resume_t is not None:
            self.recoveries[-1].first_step_s = time.perf_counter() - self._resume_t
            self.recoveries[-1].steady_step_s = self.steady_step_s() if self._steady_times else 0.0
            self.recoveries[-1].append_jsonl(self.run_dir / "recoveries.jsonl")
            self.metrics.on_recovery(self.recoveries[-1])
            self._resume_t = None
        self.metrics.on_step(step, loss, self.step_times[-1], len(self.group.pool), reward, self._digest,
                             self.kept_step, self.keeper_wait_s)

    def _postpone(self, step: int) -> None:
        """A save is due at `step` while the previous async save is still being written: rather
        than stall training until that write ends (a checkpoint of tens of GB per rank takes
        longer than a few steps to write), save at the first step after its commit (`train`).
        Saves then come as often as storage can take them; warned once per run."""
        if not self.postponed_saves:
            log.warning("checkpoint of step %d postponed: the save of step %d is still being written; saves "
                        "now come as often as storage takes them (raise checkpoint.interval to save less often)",
                        step, self._pending_save[0])
        self._save_due = True
        self.postponed_saves.append(step)

    def save(self, step: int, final: bool = False) -> None:
        """Every rank writes its shards; the driver commits the manifest last. With
        `checkpoint.async_save` the ranks only snapshot to host memory here and write in the
        background; the commit follows once every rank's write has ended (`finish_save`). At
        most one async save is in flight: this waits for the previous one first (`train`
        postpones a due save instead, `_postpone`). `final`: no step follows (the end of `train`),
        so the wait for the previous one is no stall of training (`finish_save`)."""
        self._save_due = False
        self.finish_save(stall=not final)
        t0 = time.perf_counter()
        if self.cfg.checkpoint.async_save:
            started = self._save_call("save_checkpoint", step, True)
            self.save_details.append({"step": step, **slowest([r for r in started if isinstance(r, dict)])})
            self._pending_save = (step, t0)
        else:
            self._commit_save(step, self._save_call("save_checkpoint", step), t0)
        self.save_stalls.append(time.perf_counter() - t0)
        if not self.cfg.checkpoint.async_save:
            self.metrics.on_save(step, self.save_stalls[-1])

    def finish_save(self, wait: bool = True, stall: bool = True) -> None:
        """Commit the pending async save. `wait=False` (after each step): only when every rank's
        background write has already ended (`checkpoint_written`, answered beside training), so
        training goes on while a write takes longer than a step; `wait=True` (before the next
        save, at the end of `train`): waits for the writes. The time spent here counts in that
        save's stall (`save_stalls`, `event=checkpoint_save`), or with `stall=False` (the end of
        `train`: no step waits) in `final_save_wait_s`."""
        if self._pending_save is None:
            return
        t0 = time.perf_counter()
        if wait:
            self._wait_written()
        elif not all(self.group.call("checkpoint_written")):
            self.save_stalls[-1] += time.perf_counter() - t0
            return
        (step, started), self._pending_save = self._pending_save, None
        self._commit_save(step, self._save_call("finish_checkpoint"), started)
        if stall:
            self.save_stalls[-1] += time.perf_counter() - t0
        else:
            self.final_save_wait_s += time.perf_counter() - t0
        self.metrics.on_save(step, self.save_stalls[-1])

    def _wait_written(self) -> None:
        """Poll `checkpoint_written` (answered beside training) until every rank's background
        write has ended, so that `finish_checkpoint`, whose finalize is a collective, never waits
        there for a slow upload (NCCL's watchdog would end a rank waiting in it). Stops polling
        once no rank's progress (checkpoint I/O included) moved for `save_deadline`: the call
        to `finish_checkpoint` then finds the hang."""
        ft, last, moved_at, limit = self.cfg.fault_tolerance, None, time.monotonic(), self.save_deadline()
        while not all(self.group.call("checkpoint_written")):
            if (now := self.group.health.work_done()) != last:
                last, moved_at = now, time.monotonic()
            elif time.monotonic() - moved_at > limit:
                break
            time.sleep(ft.health_interval_s)

    def _commit_save(self, step: int, per_rank: list, t0: float) -> None:
        """Commit unless a rank's write or the commit hit a storage error: then the save is
        skipped with a warning, training goes on and the previous checkpoint stays."""
        errors = [r for r in per_rank if isinstance(r, str)]
        d = self.group.dims
        try:
            if errors:
                raise CheckpointError(errors[0])
            self.group.fence()
            self.ckpt.commit(step, {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "cp": d.cp,
                                    "dp": d.dp, "engine": self.cfg.model.engine},
                             [f for rank_files in per_rank for f in rank_files],
                             {"generation": self.group.generation, "model": model_signature(self.cfg),
                              "run": self.run.to_dict(), "data": self.data_fingerprint})
        except CheckpointError as e:
            log.warning("checkpoint step %d NOT committed (training goes on): %s", step, e)
            self.failed_saves.append(step)
            return
        self.checkpoints.append(step)
        log.info("checkpoint step %d committed %.2f s after the save started, after step %d", step,
                 time.perf_counter() - t0, self.committed_step)

    def no_commit_line(self) -> str:
        """The line a run ends with when it tried to save and committed no checkpoint."""
        return (f"no checkpoint was committed in this run: {len(self.failed_saves)} save(s) skipped "
                f"(steps {self.failed_saves}; the warnings above say why), so a failure has no checkpoint "
                f"of it to restore from; check checkpoint.uri and its storage")

    def report(self) -> str:
        """A table of every recovery's phases (seconds), source and steps lost; total = the
        control phases + the first step's excess over a steady step (`RecoveryTimeline.total_s`)."""
        head = ("kind", "ranks", "detect", "abort", "replace", "rebuild", "restore", "first step",
                "(excess)", "total", "source", "lost")
        rows = [(t.kind, ",".join(map(str, t.failed_ranks)), *(f"{getattr(t, p):.3f}" for p in t.PHASES),
                 f"{t.first_step_excess_s:.3f}", f"{t.total_s:.3f}", t.restore_source, str(t.steps_lost))
                for t in self.recoveries]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in (head, *rows))

    def handle_failure(self, failure: WorkerFailure) -> RecoveryTimeline:
        """Recover from `failure` and move `committed_step` back to the restored step."""
        log.warning("failure detected: %s", failure)
        self.group.fence()  # a superseded driver's calls fail: it stops instead of recovering
        self._pending_save = None  # its shards stay uncommitted: never loaded, later deleted
        tl = recover(self.group, failure, self.ckpt, self.committed_step, self.cfg.fault_tolerance,
                     lambda manifest: check_compatible(self.cfg, manifest), run_id=self.run.id)
        self.recoveries.append(tl)
        self.committed_step = tl.restored_step
        self._resume_t = time.perf_counter()
        log.warning("recovered: ranks %s replaced, restored step %d from %s, %d spare(s) left",
                    tl.failed_ranks, tl.restored_step, tl.restore_source, len(self.group.pool))
        freeze_heap()
        return tl

    def resume(self, newest_step: int) -> int:
        """Continue this run (`run`, an identity found in checkpoint.uri: `run_identity.plan_start`)
        from its newest checkpoint that verifies and loads on every rank: `newest_step` (its
        newest committed one) or an older one, each skipped with a warning, as recovery's
        checkpoint restore does (`fault_tolerance.restore_checkpoint`). Model, optimizer, LR
        schedule, RNG, RL state and the step counter come back; data and rollouts are a pure
        function of (seed, step), so the steps after it compute what they would have. Returns
        the step resumed from. Raises ConfigError when none of the run's checkpoints verifies
        and loads, or one is of another model or layout; RecoveryError when storage stays down
        (`fault_tolerance.restore_checkpoint_through_outage`)."""
        # A failure during the load recovers to this step; no rank holds it but by the load
        # itself, so recovery restores it from the checkpoints too.
        self.committed_step = newest_step
        notes: list[str] = []
        try:
            step = restore_checkpoint_through_outage(
                self.group, self.ckpt, lambda: self.ckpt.committed_manifests(self.run.id),
                self.cfg.fault_tolerance.step_timeout_s, lambda manifest: check_compatible(self.cfg, manifest), notes)
        except WorkerFailure as failure:
            step = self.handle_failure(failure).restored_step
        if step is None:
            raise ConfigError(f"checkpoint.uri: no checkpoint of run {self.run.id} under {self.ckpt.uri} "
                              f"verifies and loads (the warnings above say why); pass --fresh to delete them "
                              f"and start over, or point checkpoint.uri elsewhere")
        self.committed_step = self.resumed_from = step
        log.info("event=resume run=%s step=%d newest_committed=%d%s", self.run.id, step, newest_step,
                 f" notes={'; '.join(notes)}" if notes else "")
        return step
