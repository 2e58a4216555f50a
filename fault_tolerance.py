"""Recovery protocol: backup pool, recovery timeline, and `recover()`.

Protocol (one failure or many; see README "Recovery protocol"):
1. Detect: `MegatronActorGroup.wait` raises `WorkerFailure` (actor death, exception, or a
   missed deadline).
2. Abort: survivors abort their communicators through the control concurrency group (this also
   frees a survivor stuck in a collective); the failed actors are killed.
3. Replace: a spare from the pool takes each failed rank, preferring a node other than the
   failed one and a device no surviving rank uses. No spare left: `RecoveryError`.
4. Rebuild: a new membership generation (fresh store prefix) is formed.
5. Restore, cheapest source first: (a) peers (survivors roll back to their host-memory snapshot
   of the committed step, then every DP group broadcasts from a survivor); (b) in-memory
   snapshots held by `SnapshotHolder` actors on other nodes (needed when a whole DP replica is
   gone or the optimizer state is sharded); (c) the newest verified checkpoint (all ranks load
   it; the steps after it are replayed).
6. Resume; the caller records `first_step_s` when the next step completes.
A failure during any phase restarts the protocol with the larger set of failed ranks.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

import ray

from checkpoint import CheckpointError, CheckpointManager
from config import check_compatible
from megatron_actor import ActorSlot, MegatronActorGroup, WorkerFailure

log = logging.getLogger(__name__)


class RecoveryError(RuntimeError):
    """Recovery is impossible (no spare left, nothing to restore from); the message says why."""


class BackupPool:
    """Pre-warmed spare actors: placed, imports done, device context made, model built, but in
    no process group."""

    def __init__(self, spares: list[ActorSlot]):
        self.spares = list(spares)

    def __len__(self) -> int:
        return len(self.spares)

    def take(self, avoid_nodes: set[str], busy_devices: set[tuple]) -> ActorSlot | None:
        """Remove and return the best spare: first one on another node than `avoid_nodes` and on
        a device not in `busy_devices`, then any on a free device, then any; among equals, one from
        the node holding the most spares (the pool stays spread over failure domains). None if
        empty."""
        per_node: dict[str, int] = {}
        for s in self.spares:
            per_node[s.node_id] = per_node.get(s.node_id, 0) + 1
        for ok in (lambda s: s.node_id not in avoid_nodes and s.device not in busy_devices,
                   lambda s: s.device not in busy_devices, lambda s: True):
            fits = [s for s in self.spares if ok(s)]
            if fits:  # from the node with the most spares: the pool stays spread over nodes
                s = max(fits, key=lambda s: per_node[s.node_id])
                self.spares.remove(s)
                return s
        return None


@dataclass
class RecoveryTimeline:
    """One recovery, phases in seconds. `detect_s` runs from the failure (when its time is known,
    e.g. an injected kill) to its detection; `steps_lost` counts committed steps redone.
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


def _abort_and_kill(group: MegatronActorGroup, failed: set[int]) -> set[int]:
    """Abort survivors' communicators (control group, in parallel), kill failed actors.
    Returns survivors that died too, did not answer the abort in time, or whose abort raised
    (compute thread still stuck in a collective: `MegatronActor.abort`), to be treated as failed."""
    survivors = [r for r in range(group.dims.world_size) if r not in failed]
    refs = {r: group.workers[r].handle.abort.remote() for r in survivors}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                        timeout=group.cfg.fault_tolerance.health_timeout_s)
    unanswered = set()
    for r, ref in refs.items():
        try:
            if ref not in ready:
                raise TimeoutError
            ray.get(ref)
        except (TimeoutError, ray.exceptions.RayError) as e:
            # RayActorError: it died too (detection names the first death only).
            why = ("its abort timed out" if isinstance(e, TimeoutError) else
                   "its actor died or is unreachable" if isinstance(e, ray.exceptions.RayActorError) else
                   "its abort failed")
            log.warning("rank %d is replaced: %s %s", r, why, str(e)[-300:])
            unanswered.add(r)
    for r in failed | unanswered:
        ray.kill(group.workers[r].handle, no_restart=True)
    return unanswered


def _replace(group: MegatronActorGroup, failed: set[int]) -> None:
    """Put a spare at each failed rank; with too few spares, shrink DP if
    `fault_tolerance.min_dp` allows, else RecoveryError."""
    group.prune_pool()
    if len(group.pool) < len(failed):
        min_dp = group.cfg.fault_tolerance.min_dp
        lost = len({group.dims.coords(r).dp for r in failed})
        if min_dp is None or group.dims.dp - lost < min_dp:
            raise RecoveryError(
                f"{len(failed)} rank(s) failed and {len(group.pool)} spare(s) are left "
                f"(cluster.num_spares={group.cfg.cluster.num_spares}); set fault_tolerance.min_dp to "
                f"let DP shrink (now dp={group.dims.dp}) or raise cluster.num_spares")
        try:
            group.shrink(failed)
        except ValueError as e:
            raise RecoveryError(str(e)) from None
        return
    failed_nodes = {group.workers[r].node_id for r in failed}
    busy = {s.device for r, s in enumerate(group.workers) if r not in failed}
    for r in sorted(failed):
        spare = group.pool.take(failed_nodes, busy)
        busy.add(spare.device)
        group.workers[r] = spare


def _restore(group: MegatronActorGroup, ckpt: CheckpointManager, committed: int,
             survivor_slots: list, mode: str, timeline: RecoveryTimeline) -> int:
    """Bring every rank to one committed step; returns that step. `survivor_slots`: the
    ActorSlots that were in the last committed step and are still members."""
    dims, gen = group.dims, group.generation
    survivors = {r for r, s in enumerate(group.workers) if any(s is v for v in survivor_slots)}
    clean = set()  # ranks holding the committed step's state after rolling back locally
    if mode != "checkpoint":
        clean = {r for r, ok in zip(sorted(survivors), ray.get(
            [group.workers[r].handle.rollback.remote(gen, committed) for r in sorted(survivors)])) if ok}
    if mode in ("auto", "peer"):
        dp_groups = dims.group_ranks("dp")
        if clean == survivors and all(set(g) & survivors for g in dp_groups):
            if committed > 0:
                # Only the replaced ranks need the state: each DP group with a new member makes
                # a broadcast among its source survivor and its new members; the other ranks
                # keep their rolled-back state (bitwise the same) and make no call.
                refs, ranks = [], []
                for g in dp_groups:
                    new = sorted(set(g) - survivors)
                    if new:
                        src = min(set(g) & survivors)
                        members = [src, *new] if len(new) + 1 < len(g) else None
                        ranks += members or list(g)
                        refs += [group.workers[r].handle.broadcast_state.remote(gen, src, members)
                                 for r in (members or g)]
                group.wait(refs, group.cfg.fault_tolerance.step_timeout_s, ranks)
            else:
                group.wait([s.handle.rollback.remote(gen, 0) for s in group.workers],
                           group.cfg.fault_tolerance.step_timeout_s)
            timeline.restore_source = "peer"
            return committed
        if mode == "peer":
            raise RecoveryError("fault_tolerance.restore=peer but a whole DP group was lost or a "
                                "survivor holds no snapshot of the committed step; use restore=auto")
        timeline.notes.append("peer restore impossible")
    manifests = ckpt.committed_manifests()
    if mode in ("auto", "memory") and group.holders:
        step = _restore_from_memory(group, committed, clean, manifests[-1].step if manifests else 0)
        if step is not None:
            timeline.restore_source = "memory" if step == committed else f"memory step {step}"
            return step
        if mode == "memory":
            raise RecoveryError("fault_tolerance.restore=memory but no in-memory snapshot of a step "
                                "newer than the newest checkpoint is held for every rank; use restore=auto")
        timeline.notes.append("in-memory restore impossible")
    manifest = _newest_verified_by_ranks(group, ckpt, manifests)
    if manifest is not None:
        check_compatible(group.cfg, manifest)  # ConfigError: stop, don't retry
    if manifest is None:
        timeline.restore_source = "initial"
        group.wait([s.handle.rollback.remote(gen, 0) for s in group.workers],
                   group.cfg.fault_tolerance.step_timeout_s)
        return 0
    timeline.restore_source = f"checkpoint step {manifest.step}"
    return min(group.wait([s.handle.load_checkpoint.remote(gen, manifest) for s in group.workers],
                          group.cfg.fault_tolerance.step_timeout_s))


def _newest_verified_by_ranks(group: MegatronActorGroup, ckpt: CheckpointManager, manifests: list):
    """The newest of the committed `manifests` whose files all verify (sizes, sha256), every rank
    reading its share of the files in parallel (the driver reads only manifests); a step with
    problems is skipped with a warning naming them. None if there is none. Raises
    CheckpointError when storage is down past the retry budget (an outage is not "no
    checkpoint")."""
    world = group.dims.world_size
    for manifest in reversed(manifests):
        results = group.wait([s.handle.verify_checkpoint.remote(group.generation, manifest, r, world)
                              for r, s in enumerate(group.workers)],
                             group.cfg.fault_tolerance.step_timeout_s)
        if errors := [f"rank {r}: {e}" for r, e in enumerate(results) if isinstance(e, str)]:
            raise CheckpointError("; ".join(errors))
        problems = [p for ps in results for p in ps]
        if not problems:
            return manifest
        log.warning("skipping checkpoint %s: %s", ckpt.step_uri(manifest.step), "; ".join(problems))
    return None


def _restore_from_memory(group: MegatronActorGroup, committed: int, clean: set[int],
                         floor: int) -> int | None:
    """Restore from the SnapshotHolders: the committed step for the ranks not in `clean`, or,
    when some lack it, the newest step below it that every rank's snapshot has, for every rank
    (not older than `floor`, the newest checkpoint's step). Returns the step, None if none fits."""
    held = group.held_snapshots()
    world = range(group.dims.world_size)
    has = [held.get((str(group.dims), r), set()) for r in world]
    need = [r for r in world if r not in clean]
    if all(committed in has[r] for r in need):
        step = committed
    else:
        step = max((s for s in set.intersection(*has) if floor <= s < committed), default=None)
        need = list(world)
    if step is None:
        return None
    holders = list(group.holders.values())
    ok = group.wait([group.workers[r].handle.restore_snapshot.remote(group.generation, step, holders)
                     for r in need], group.cfg.fault_tolerance.step_timeout_s, need)
    return step if all(ok) else None


def recover(group: MegatronActorGroup, failure: WorkerFailure, ckpt: CheckpointManager,
            committed_step: int, failed_at: float | None = None, max_attempts: int = 5) -> RecoveryTimeline:
    """Run the recovery protocol for `failure`; returns the timeline (restored step included).

    `failed_at`: wall-clock time of the failure when known (injected faults), for `detect_s`.
    Raises RecoveryError when the pool is empty or recovery keeps failing `max_attempts` times.
    """
    failed = set(failure.ranks)
    survivors = [s for r, s in enumerate(group.workers) if r not in failed]
    tl = RecoveryTimeline(failure.kind, sorted(failed),
                          sorted({group.workers[r].node_id for r in failed}),
                          committed_step=committed_step)
    if failed_at is not None:
        tl.detect_s = max(0.0, failure.detected_at - failed_at)
    for attempt in range(1, max_attempts + 1):
        tl.attempts = attempt
        try:
            t0 = time.perf_counter()
            failed |= _abort_and_kill(group, failed)
            killed = [group.workers[r] for r in failed]
            survivors = [s for s in survivors if not any(s is k for k in killed)]
            t1 = time.perf_counter()
            if group.cfg.fault_tolerance.refill_spares:
                group.refill([s.bundle_index for s in killed])
            _replace(group, failed)
            t2 = time.perf_counter()
            tl.rebuild_detail = group.form_generation()
            t3 = time.perf_counter()
            tl.restored_step = _restore(group, ckpt, committed_step, survivors,
                                        group.cfg.fault_tolerance.restore, tl)
            t4 = time.perf_counter()
        except WorkerFailure as again:
            log.warning("failure during recovery (attempt %d): %s", attempt, again)
            tl.notes.append(f"attempt {attempt}: {again}")
            failed = set(again.ranks)  # ranks of the new membership; earlier ones are replaced
            tl.failed_ranks = sorted(set(tl.failed_ranks) | failed)
            continue
        tl.abort_s, tl.replace_s, tl.rebuild_s, tl.restore_s = t1 - t0, t2 - t1, t3 - t2, t4 - t3
        tl.generation = group.generation
        tl.failed_ranks = sorted(set(tl.failed_ranks) | failed)
        return tl
    raise RecoveryError(f"recovery failed {max_attempts} times: {tl.notes[-1]}")
