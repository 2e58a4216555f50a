"""What can go wrong in a run and what a recovery cost: the failure types the control plane
raises and catches, the generation numbers that fence a superseded driver off (`epoch_of`), and
`RecoveryTimeline`, the record of one recovery (phases in seconds). Imports nothing of the
project.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

GENERATIONS_PER_EPOCH = 1_000_000  # generations one driver may form; above any real run's count


def first_generation(epoch: int) -> int:
    """The generation number before the first one a driver of lease epoch `epoch`
    (`control.run_lease`) forms: the generations of epoch e lie in (e * GENERATIONS_PER_EPOCH,
    (e + 1) * GENERATIONS_PER_EPOCH], so a later driver's are above every one of an earlier's."""
    return epoch * GENERATIONS_PER_EPOCH


def epoch_of(generation: int) -> int:
    """The lease epoch of the driver that formed membership `generation` (`first_generation`);
    0 for generation 0 (no membership yet)."""
    return max(0, (generation - 1) // GENERATIONS_PER_EPOCH)


class StaleGenerationError(RuntimeError):
    """A call belongs to a process-group generation this actor is no longer in, or to a driver
    superseded by a later one (a generation of an older lease epoch)."""


class InjectedFault(RuntimeError):
    """An exception raised on purpose by fault injection (`MegatronActor.arm_fault`)."""


class WorkerFailure(RuntimeError):
    """Ranks of the current generation failed. `ranks`: failed global ranks; `kind`: one of
    KINDS: 'crash' (actor died or its node is lost), 'unreachable' (alive or not, it answered no
    ping in time: cut off, frozen or too slow), 'hang' (deadline passed without progress) or
    'exception'. `aborted`: detection already aborted every rank's communicators (to find the
    hung ranks), so recovery must not abort them a second time. `detected_at`: wall-clock
    seconds; `last_seen`: wall-clock seconds of the failed ranks' last sign of life (last
    heartbeat answer, or last progress for a hang; None: unknown)."""

    KINDS = ("crash", "unreachable", "hang", "exception")

    def __init__(self, ranks: set[int], kind: str, detail: str = "", aborted: bool = False,
                 last_seen: float | None = None):
        super().__init__(f"{kind} of rank(s) {sorted(ranks)}: {detail}")
        self.ranks, self.kind, self.detail, self.aborted = set(ranks), kind, detail, aborted
        self.detected_at = time.time()
        self.last_seen = last_seen


class ClusterError(RuntimeError):
    """The cluster cannot hold the run (its placement group cannot be placed); the message says
    what was asked, what the cluster has and what to change."""


class DataError(RuntimeError):
    """A row of the training data could not be read mid-run (a file truncated or replaced after
    the run's checks): the data's fault, not the reading rank's, so no spare is spent on it and
    the run stops; the message names the step, the row and the document."""


class RecoveryError(RuntimeError):
    """Recovery is impossible (no spare left, nothing to restore from); the message says why."""


@dataclass
class RecoveryTimeline:
    """One recovery, phases in seconds. `detect_s` runs from the failure to its detection: from
    the failed ranks' last sign of life (heartbeat or progress), or from the injection of an
    injected fault when that is later; `steps_lost` counts committed steps redone.
    `total_s` is the time the failure cost the run, the MTTR that goodput counts: the control
    phases (detect .. restore) plus the first step's excess over a steady step. The rest of
    that first step is training the run would have done anyway."""
    kind: str
    failed_ranks: list[int]
    failed_nodes: list[str]
    generation: int = 0
    detect_s: float = 0.0
    abort_s: float = 0.0
    replace_s: float = 0.0
    rebuild_s: float = 0.0
    restore_s: float = 0.0
    first_step_s: float = 0.0
    steady_step_s: float = 0.0   # median step without a recovery before the first step; 0: none ran
    restore_source: str = ""
    committed_step: int = 0
    restored_step: int = 0
    attempts: int = 1
    notes: list[str] = field(default_factory=list)
    rebuild_detail: dict = field(default_factory=dict)      # slowest rank's seconds per part of its join
    first_step_detail: dict = field(default_factory=dict)   # slowest rank's seconds per part of the step
    restore_detail: dict = field(default_factory=dict)      # seconds to plan it, slowest rank's per part of its restore

    CONTROL = ("detect_s", "abort_s", "replace_s", "rebuild_s", "restore_s")
    PHASES = (*CONTROL, "first_step_s")

    @property
    def steps_lost(self) -> int:
        return self.committed_step - self.restored_step

    @property
    def first_step_excess_s(self) -> float:
        """The first step's seconds beyond a steady step (all of it when no steady step ran)."""
        return max(0.0, self.first_step_s - self.steady_step_s)

    @property
    def total_s(self) -> float:
        return sum(getattr(self, p) for p in self.CONTROL) + self.first_step_excess_s

    def to_dict(self) -> dict:
        return {**asdict(self), "steps_lost": self.steps_lost, "first_step_excess_s": self.first_step_excess_s,
                "total_s": self.total_s}

    def append_jsonl(self, path) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(self.to_dict()) + "\n")


def slowest(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the largest of the ranks' seconds (rounded to 0.1 ms) among the ranks that have
    it (a survivor and a spare report different parts): the slowest rank's time."""
    keys = dict.fromkeys(k for p in parts for k in p)
    return {k: round(max(p[k] for p in parts if k in p), 4) for k in keys}
