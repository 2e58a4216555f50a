"""Run metrics, event log lines and the progress bar: what an operator watches during a run.

`RunMetrics` is called by the `Trainer` at three points (a committed step, a finished recovery,
a checkpoint save) and fans each out to
- Ray metrics (`ray.util.metrics`): the node's metrics agent exports them to Prometheus and the
  Ray dashboard under the names below with a `ray_` prefix (e.g. `ray_ft_step_seconds_bucket`);
- one structured log line per event (`event=step step=3 loss=... tokens_per_s=...`), rendered
  by `KeyValueFormatter` as `key=value` pairs;
- an optional tqdm progress bar (step, loss, tokens/s, recoveries so far, spares left).

| metric | type | unit / tags |
|---|---|---|
| `ft_step_seconds` | histogram | seconds per committed train step |
| `ft_throughput_tokens_per_s` | gauge | tokens/s of the last step (global batch x seq_len / step time) |
| `ft_loss` | gauge | loss of the last committed step |
| `ft_reward` | gauge | RL: mean reward of the last committed step's samples |
| `ft_recoveries` | counter | recoveries finished; tag `kind` (crash, unreachable, hang, exception: `failures.WorkerFailure.KINDS`) |
| `ft_recovery_phase_seconds` | histogram | seconds per recovery phase; tag `phase` (detect ... first_step, first_step_excess, total) |
| `ft_spares_available` | gauge | spares in the backup pool |
| `ft_checkpoint_save_stall_seconds` | histogram | seconds training waited for a checkpoint save |
"""
from __future__ import annotations

import json
import logging

from ray.util.metrics import Counter, Gauge, Histogram

log = logging.getLogger("events")

SECONDS_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


class KeyValueFormatter(logging.Formatter):
    """`time=2026-11-29T21:30:00 level=INFO logger=events event=step step=3 loss=...`: messages
    that start with `event=` are already key=value pairs; any other message becomes `msg="..."`.
    `logger` is the last part of the logger's name (`ftrain.control.health` -> `health`)."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if not msg.startswith("event="):
            msg = "msg=" + json.dumps(msg)
        line = (f"time={self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} level={record.levelname} "
                f"logger={record.name.rsplit('.', 1)[-1]} {msg}")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class RunMetrics:
    """Records a run's metrics (see the module table). `tokens_per_step`: tokens of one global
    batch (train.global_batch_size x train.seq_len). `progress`: a tqdm bar to update, or None."""

    def __init__(self, tokens_per_step: int, progress=None):
        self.tokens_per_step, self.progress = tokens_per_step, progress
        self.step_seconds = Histogram("ft_step_seconds", "Seconds per committed train step",
                                      boundaries=SECONDS_BUCKETS)
        self.throughput = Gauge("ft_throughput_tokens_per_s", "Tokens per second of the last step")
        self.loss = Gauge("ft_loss", "Loss of the last committed step")
        self.reward = Gauge("ft_reward", "RL: mean reward of the last committed step's samples")
        self.recoveries = Counter("ft_recoveries", "Recoveries finished", tag_keys=("kind",))
        self.phase_seconds = Histogram("ft_recovery_phase_seconds", "Seconds per recovery phase",
                                       boundaries=SECONDS_BUCKETS, tag_keys=("phase",))
        self.spares = Gauge("ft_spares_available", "Spare actors in the backup pool")
        self.kept = Gauge("ft_kept_step", "Newest step every rank's keeper holds (what a lost rank comes back to)")
        self.save_stall = Histogram("ft_checkpoint_save_stall_seconds",
                                    "Seconds training waited for a checkpoint save",
                                    boundaries=SECONDS_BUCKETS)
        self.num_recoveries = 0

    def on_step(self, step: int, loss: float, step_s: float, spares: int,
                reward: float | None = None, data_digest: str = "", kept_step: int | None = None,
                keeper_wait_s: float = 0.0) -> None:
        """Step `step` committed with `loss` after `step_s` seconds; `spares` in the pool;
        `reward`: RL runs' mean reward of the step (None otherwise); `data_digest`: its global
        batch's digest (logged as its first 16 hex digits); `kept_step`: with the keeper on, the
        newest step every rank's keeper holds whole, what a rank lost now comes back to (-1:
        one holds nothing yet, logged `kept_step=none`); None: no keeper. `keeper_wait_s`: the
        longest a rank waited in this step for its previous keeper send (a send slower than a
        step), logged when above 0."""
        tokens_per_s = self.tokens_per_step / step_s if step_s > 0 else 0.0
        self.step_seconds.observe(step_s)
        self.throughput.set(tokens_per_s)
        self.loss.set(loss)
        self.spares.set(spares)
        extra = {} if reward is None else {"reward": f"{reward:.4f}"}
        if reward is not None:
            self.reward.set(reward)
        if kept_step is not None:
            extra["kept_step"] = kept_step if kept_step >= 0 else "none"
            self.kept.set(kept_step)
        if keeper_wait_s > 0:
            extra["keeper_wait_s"] = f"{keeper_wait_s:.3f}"
        log.info("event=step step=%d loss=%.6f step_s=%.3f tokens_per_s=%.0f spares=%d%s%s",
                 step, loss, step_s, tokens_per_s, spares, "".join(f" {k}={v}" for k, v in extra.items()),
                 f" data_digest={data_digest[:16]}" if data_digest else "")
        if self.progress is not None:
            self.progress.n = step
            self.progress.set_postfix(loss=f"{loss:.4f}", **extra, tok_s=f"{tokens_per_s:.0f}",
                                      recoveries=self.num_recoveries, spares=spares, refresh=False)
            self.progress.refresh()

    def on_recovery(self, timeline) -> None:
        """A recovery finished (its first step after resuming is done): `timeline` is its
        `failures.RecoveryTimeline`."""
        self.num_recoveries += 1
        self.recoveries.inc(1, tags={"kind": timeline.kind})
        for phase in timeline.PHASES:
            self.phase_seconds.observe(getattr(timeline, phase), tags={"phase": phase[:-2]})
        self.phase_seconds.observe(timeline.first_step_excess_s, tags={"phase": "first_step_excess"})
        self.phase_seconds.observe(timeline.total_s, tags={"phase": "total"})
        nodes = ",".join(n[:8] for n in timeline.failed_nodes)
        log.warning("event=recovery kind=%s ranks=%s nodes=%s step=%d restored_step=%d source=%s "
                    "steps_lost=%d total_s=%.3f %s", timeline.kind,
                    ",".join(map(str, timeline.failed_ranks)), nodes, timeline.committed_step + 1,
                    timeline.restored_step, json.dumps(timeline.restore_source), timeline.steps_lost,
                    timeline.total_s, " ".join(f"{p}={getattr(timeline, p):.3f}" for p in timeline.PHASES))

    def on_save(self, step: int, stall_s: float) -> None:
        """Training waited `stall_s` seconds for the save of step `step`."""
        self.save_stall.observe(stall_s)
        log.info("event=checkpoint_save step=%d stall_s=%.3f", step, stall_s)
