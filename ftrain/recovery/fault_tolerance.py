"""The recovery protocol, `recover()`, and its decisions as pure functions.

Protocol (one failure or many; docs/recovery.md has the detail):
1. Detect: `ActorGroup.wait` (`HealthMonitor`) raises `WorkerFailure` (actor death, exception,
   or a missed deadline).
2. Abort: survivors abort their communicators through the control concurrency group (this also
   frees a survivor stuck in a collective); survivors that die or do not answer join the failed
   set; the failed actors are killed. A hang's detection already aborted every rank: not again.
3. Replace: a spare from the pool takes each failed rank, preferring a node other than the
   failed ones and a device no surviving rank uses (`BackupPool.take_for`). Too few spares:
   shrink DP if `fault_tolerance.min_dp` allows, else `RecoveryError`.
4. Rebuild: a new membership generation (fresh store prefix) is formed.
5. Restore, cheapest source first (`plan_restore`): (a) peers (survivors roll back to their
   host-memory snapshot of the committed step, then every DP group with a new member broadcasts
   from a survivor; with a sharded optimizer a replaced rank then loads its optimizer shard from
   its keeper, keeper.py); (b) at dp = 1, the state each rank's own node's holder keeps (the local
   keeper, keeper.py); in-memory snapshots held by `SnapshotHolder` actors on other nodes
   (needed when a whole DP replica is gone or the optimizer state is sharded); (c) the newest
   verified checkpoint of this run (all ranks load it; the steps after it are replayed; a run
   resuming after its driver was lost loads it the same way, `restore_checkpoint`), else step 0
   when nothing was committed or `fault_tolerance.allow_restart_from_scratch`, else RecoveryError.
6. Resume; the trainer records `first_step_s` when the next step completes.
A failure during any phase restarts the protocol with the larger set of failed ranks.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import ray

from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.failures import RecoveryError, RecoveryTimeline, WorkerFailure, slowest
from ftrain.state.keeper import MAPPED_NOW, keeps_locally, local_key, shard_key
from ftrain.state.manifest import CheckpointError, Manifest, check_compatible

if TYPE_CHECKING:
    from ftrain.config import FaultToleranceConfig
    from ftrain.control.actor_group import ActorGroup

log = logging.getLogger(__name__)
NO_MEMORY_RESTORE = ("fault_tolerance.restore=memory but no in-memory snapshot of a step newer than the "
                     "newest checkpoint is held for every rank; use restore=auto")


# -- decisions (pure functions of the failed set, layout, held snapshots and checkpoints) ------
@dataclass
class RestorePlan:
    """Where the state of committed step `step` comes from. `source`: 'peer' (`broadcasts`:
    one (source rank, calling ranks, members) per DP group with a new member, `members` being
    the calling ranks when they are a strict subset of the DP group, else None: the whole
    group), 'peer+keeper' (those broadcasts, then `ranks` load their optimizer shard of `step`
    from their keeper, keeper.py), 'keeper' (`ranks` load their optimizer shard of `step` from
    their keeper and take their params from the shards: every rank when `step` is older than the
    committed one), 'local' (`ranks` load their state of `step` from the arena
    their node's holder adopted: the local keeper at dp = 1, keeper.py), 'memory' (`ranks` load
    their in-memory snapshot of `step`) or 'checkpoint' (the
    newest verified checkpoint, else step 0; `step` is not known yet). `notes`: the cheaper
    sources tried and why they were impossible."""
    source: str
    step: int | None = None
    broadcasts: list[tuple[int, list[int], list[int] | None]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_peer_restore(dp_groups: list[list[int]], survivors: set[int], clean: set[int],
                      subgroups: bool = True) -> list[tuple[int, list[int], list[int] | None]] | None:
    """The broadcasts of a peer restore, or None when it is impossible: a survivor could not
    roll back to the committed step (`clean` lacks it) or a DP group lost every member.
    Per DP group with new members: (its lowest surviving rank, the ranks that call, members),
    the callers being [source, *new members] (members: the same list) or, when that is the
    whole group (only the source survived) or the engine cannot broadcast within a subgroup
    (`subgroups` False: the Megatron engine), the group (members None). Ranks that do not
    call keep their rolled-back state (bitwise the same)."""
    if clean != survivors or not all(set(g) & survivors for g in dp_groups):
        return None
    plan = []
    for g in dp_groups:
        new = sorted(set(g) - survivors)
        if new:
            src = min(set(g) & survivors)
            members = [src, *new] if subgroups and len(new) + 1 < len(g) else None
            plan.append((src, members or list(g), members))
    return plan


def same_shard(before: list, before_dims: ParallelDims, after: list, after_dims: ParallelDims) -> set[int]:
    """Ranks of the membership `after` whose member (the same object) held the same model shard
    in the membership `before`: a rank of the same (tp, pp, cp) coordinates (its DP index may
    differ, as after a shrink). A member that holds another shard now (a survivor of a dropped
    replica reused as a spare in the same recovery) is not among them: its state is another
    shard's, so it must receive the committed state, never serve it."""
    held = {id(s): before_dims.coords(r) for r, s in enumerate(before)}
    out = set()
    for r, s in enumerate(after):
        old, new = held.get(id(s)), after_dims.coords(r)
        if old is not None and (old.tp, old.pp, old.cp) == (new.tp, new.pp, new.cp):
            out.add(r)
    return out


def plan_memory_restore(committed: int, clean: set[int], held: list[set[int]],
                        floor: Callable[[], int]) -> tuple[int, list[int]] | None:
    """(step, ranks to load) of an in-memory restore, or None when none fits. `held[r]`: the
    steps of rank r's snapshots some holder has. The committed step for the ranks not in
    `clean` (the others rolled back locally), or when some lack it, the newest step below it
    that every rank's snapshot has, for every rank, not older than `floor()` (the newest
    checkpoint's step: a checkpoint of that step is as good and loses no more; asked only
    then: it reads the storage, seconds at scale or beside a checkpoint being written)."""
    world = range(len(held))
    need = [r for r in world if r not in clean]
    if all(committed in held[r] for r in need):
        return committed, need
    older = [s for s in set.intersection(*held) if s < committed]
    lowest = floor() if older else committed
    step = max((s for s in older if lowest <= s), default=None)
    return None if step is None else (step, list(world))


def plan_restore(mode: str, committed: int, dp_groups: list[list[int]], survivors: set[int],
                 clean: set[int], held: Callable[[], list[set[int]]] | None,
                 floor: Callable[[], int], kept: Callable[[], list[set[int]]] | None = None,
                 subgroups: bool = True, local: Callable[[], list[set[int]]] | None = None,
                 params_from_shards: bool = False) -> RestorePlan:
    """The cheapest restore source `mode` ('auto', 'peer', 'memory', 'checkpoint':
    `fault_tolerance.restore`) allows. `held()` (each rank's held snapshot steps; None: no
    holders) and `floor()` (the newest checkpoint's step) are `plan_memory_restore`'s inputs,
    asked for only when a memory restore is considered (they cost a round of remote calls).
    `kept`: None when every DP peer holds the whole optimizer state; with a sharded optimizer,
    `kept()` gives the steps of each rank's optimizer shard its keeper holds (all empty without
    keepers), and a peer restore needs the committed step's shard of every replaced rank
    (`peer+keeper`): a shard of another step would not match the peer's parameters.
    `subgroups`: as `plan_peer_restore`'s.
    `params_from_shards`: the engine can make its params from the optimizer shards alone (the
    Megatron engine's `sync_params`); then, where no peer restore serves, the keepers are tried
    next with `plan_memory_restore`'s rule over `kept()`: the replaced ranks load the committed
    step's shards (a whole DP group lost), or, when a replaced rank's copy of it was still in
    flight, every rank loads the newest step all keepers hold, none older than the newest
    checkpoint (one step re-run instead of the steps since the checkpoint).
    `local`: None without the local keeper; else `local()` gives, per rank, the steps the holder
    of the node that rank now runs on keeps of that rank position's whole state (a replacement
    on another node has none there); tried before the in-memory snapshots, with the same rule
    (`plan_memory_restore`: the committed step for the ranks that need it, else the newest
    step every rank position has, none older than the newest checkpoint).
    Raises RecoveryError when `mode` names a source that cannot serve this failure."""
    notes = []
    if mode in ("auto", "peer"):
        broadcasts = plan_peer_restore(dp_groups, survivors, clean, subgroups)
        if broadcasts is not None and (kept is None or committed == 0):  # step 0: every rank resets
            return RestorePlan("peer", committed, broadcasts=broadcasts)
        if broadcasts is not None:
            new, shards = sorted({r for g in dp_groups for r in g} - survivors), kept()
            if not (missing := [r for r in new if committed not in shards[r]]):
                return RestorePlan("peer+keeper", committed, broadcasts=broadcasts, ranks=new)
            notes.append(f"no keeper holds the optimizer shard of step {committed} of rank(s) {missing}")
        if mode == "peer":
            raise RecoveryError("fault_tolerance.restore=peer but a whole DP group was lost, a survivor "
                                "holds no snapshot of the committed step or no keeper holds a replaced "
                                "rank's optimizer shard of it; use restore=auto")
        notes.append("peer restore impossible")
    if mode == "auto" and kept is not None and params_from_shards:
        found = plan_memory_restore(committed, clean, kept(), floor)
        if found is not None:
            return RestorePlan("keeper", found[0], ranks=found[1], notes=notes)
        notes.append("keeper restore impossible")
    if mode in ("auto", "memory"):
        for source, steps in (("local", local), ("memory", held)):
            if steps is not None:
                found = plan_memory_restore(committed, clean, steps(), floor)
                if found is not None:
                    return RestorePlan(source, found[0], ranks=found[1], notes=notes)
                notes.append(f"{'local keeper' if source == 'local' else 'in-memory'} restore impossible")
        if mode == "memory" and held is not None:
            raise RecoveryError(NO_MEMORY_RESTORE)
    return RestorePlan("checkpoint", notes=notes)


def scratch_restart_refusal(committed: int, allowed: bool, notes: list[str]) -> str | None:
    """Why a recovery that found no source of committed step `committed` (no peer, no
    in-memory snapshot, no checkpoint that verifies and loads; `notes`: what was tried) must
    stop rather than restart from the initial state, or None when the restart loses nothing
    (`committed` 0) or `fault_tolerance.allow_restart_from_scratch` (`allowed`) opts in."""
    if committed == 0 or allowed:
        return None
    tried = f" ({'; '.join(notes)})" if notes else ""
    return (f"no peer, in-memory snapshot or checkpoint holds committed step {committed} or any step after "
            f"step 0{tried}: stopping rather than silently restarting from the initial state; set "
            f"fault_tolerance.allow_restart_from_scratch=true to restart from step 0, or keep a source "
            f"(checkpoint.interval, fault_tolerance.memory_snapshot_interval, cluster.num_spares)")


# -- the protocol --------------------------------------------------------------------------------
def _replace(group: ActorGroup, failed: set[int], ft: FaultToleranceConfig) -> None:
    """Put a spare at each failed rank; with too few spares, and once the refills on their way
    have come (`ActorGroup.wait_for_refills`, at most `step_timeout_s`), shrink DP if
    `fault_tolerance.min_dp` allows, else RecoveryError. The failed ranks' devices are
    quarantined first: a spare or refill there is used only once it passes a health probe."""
    group.quarantine(failed)
    group.prune_pool()
    if len(group.pool) < len(failed):  # refills of earlier recoveries on their way are awaited first
        group.wait_for_refills(len(failed), ft.step_timeout_s)
    if len(group.pool) >= len(failed):
        group.replace(failed)
        return
    lost = len({group.dims.coords(r).dp for r in failed})
    if ft.min_dp is None or group.dims.dp - lost < ft.min_dp:
        raise RecoveryError(
            f"{len(failed)} rank(s) failed and {len(group.pool)} spare(s) are left "
            f"(cluster.num_spares={group.num_spares}); set fault_tolerance.min_dp to "
            f"let DP shrink (now dp={group.dims.dp}) or raise cluster.num_spares")
    try:
        group.shrink(failed)
    except ValueError as e:
        raise RecoveryError(str(e)) from None


def _restore(group: ActorGroup, ckpt, committed: int, survivor_slots: list,
             ft: FaultToleranceConfig, check_manifest: Callable[[Manifest], None],
             timeline: RecoveryTimeline, run_id: str | None) -> int:
    """Bring every rank to one committed step (`plan_restore`); returns that step.
    `survivor_slots`: the ActorSlots that were in the last committed step and are still members;
    `run_id`: only checkpoints of this run count (None: any)."""
    t0 = time.perf_counter()
    dims, timeout = group.dims, ft.step_timeout_s
    survivors = {r for r, s in enumerate(group.workers) if any(s is v for v in survivor_slots)}
    clean = set()  # ranks holding the committed step's state after rolling back locally
    if ft.restore != "checkpoint":
        ranks = sorted(survivors)
        clean = {r for r, ok in zip(ranks, group.wait(group.submit("rollback", committed, ranks=ranks),
                                                       timeout, ranks)) if ok}
    manifests = None

    def floor() -> int:
        nonlocal manifests
        manifests = ckpt.committed_manifests(run_id)
        return manifests[-1].step if manifests else 0

    def held() -> list[set[int]]:
        snaps = group.held_snapshots()
        return [snaps.get((str(dims), r), set()) for r in range(dims.world_size)]

    def kept() -> list[set[int]]:
        snaps = group.held_snapshots()
        return [snaps.get(shard_key(str(dims), r), set()) for r in range(dims.world_size)]

    def local() -> list[set[int]]:
        snaps = group.held_snapshots()
        return [snaps.get(local_key(str(dims), r, s.node_id), set()) for r, s in enumerate(group.workers)]

    sharded = group.cfg.model.distributed_optimizer and dims.dp > 1

    def synced(step: int) -> int:
        """`step`, once every rank made its params consistent with its restored optimizer shard
        (a collective: a sharded optimizer's rollback and broadcast set the shards only)."""
        if sharded:
            group.wait(group.submit("sync_params"), timeout)
        return step

    # Megatron broadcasts over its DP groups as made: a subgroup of NCCL communicators split from
    # the eagerly initialised world is a collective of every rank (docs/recovery.md, "Restore").
    plan = plan_restore(ft.restore, committed, dims.group_ranks("dp"), survivors, clean,
                        held if group.holders else None, floor, kept if sharded else None,
                        subgroups=group.cfg.model.engine != "megatron",
                        local=local if group.holders and keeps_locally(
                            ft.shard_keeper, dims.dp, group.cfg.cluster.num_spares) else None,
                        # RL: a replacement's rollout position is in no shard (a peer gives it)
                        params_from_shards=group.cfg.model.engine == "megatron" and not group.cfg.rl.enabled)
    timeline.notes += plan.notes
    timeline.restore_detail = {"plan_s": round(time.perf_counter() - t0, 4)}  # survivors' rollbacks included
    if plan.source in ("peer", "peer+keeper"):
        if committed > 0:
            refs, ranks = [], []
            for src, callers, members in plan.broadcasts:
                ranks += callers
                refs += group.submit("broadcast_state", src, members, ranks=callers)
            group.wait(refs, timeout, ranks)
        else:
            group.wait(group.submit("rollback", 0), timeout)
        if plan.source == "peer" or all(group.wait(
                group.submit("restore_snapshot", committed, list(group.holders.values()), True, ranks=plan.ranks),
                timeout, plan.ranks)):
            timeline.restore_source = plan.source
            if plan.source == "peer+keeper":  # fence off survivors' shards of the abandoned steps
                group.drop_snapshots_after(committed)
            return synced(committed)
        timeline.notes.append("a keeper lost the optimizer shard it held")  # on to the checkpoint
    if plan.source in ("keeper", "local", "memory"):
        call = {"local": ("restore_local", plan.step),
                "memory": ("restore_snapshot", plan.step, list(group.holders.values())),
                "keeper": ("restore_snapshot", plan.step, list(group.holders.values()), True, True)}[plan.source]
        ok = group.wait(group.submit(*call, ranks=plan.ranks), timeout, plan.ranks)
        if all(ok):
            if plan.source == "local":
                timeline.restore_detail.update(slowest([{k: v for k, v in r.items() if k.endswith("_s")} for r in ok]))
                if any(r["how"] == MAPPED_NOW for r in ok):  # seconds slower: faulted in, copied from pageable memory
                    timeline.notes.append("a kept arena was mapped at restore time, not ahead by the spare")
                elif not all(r["taken_over"] for r in ok):  # new arenas pinned beside the next steps
                    timeline.notes.append("a replacement did not take over the replaced rank's arenas")
            timeline.restore_source = plan.source if plan.step == committed else f"{plan.source} step {plan.step}"
            if plan.step < committed or plan.source != "memory":  # fence off survivors' copies of later steps
                group.drop_snapshots_after(plan.step)
            return synced(plan.step)
        if ft.restore == "memory":
            raise RecoveryError(NO_MEMORY_RESTORE)
        timeline.notes.append(f"{plan.source} restore impossible")
    step = restore_checkpoint_through_outage(
        group, ckpt, lambda: manifests if manifests is not None else ckpt.committed_manifests(run_id),
        timeout, check_manifest, timeline.notes)
    if step is not None:
        timeline.restore_source = f"checkpoint step {step}"
        return step
    if refusal := scratch_restart_refusal(committed, ft.allow_restart_from_scratch, timeline.notes):
        raise RecoveryError(refusal)
    log.warning("restarting from the initial state (step 0): no source holds committed step %d "
                "(fault_tolerance.allow_restart_from_scratch)", committed)
    timeline.restore_source = "initial"
    group.wait(group.submit("rollback", 0), timeout)
    group.drop_snapshots_after(0)
    return 0


def restore_checkpoint(group: ActorGroup, ckpt, manifests: list[Manifest],
                       timeout: float, check_manifest: Callable[[Manifest], None],
                       notes: list[str]) -> int | None:
    """Every rank loads the newest of the committed `manifests` (ascending) whose files verify
    (`_verified_by_ranks`) and which loads on every rank; returns its step, None when none does
    (the ranks' state is then undefined); the snapshot holders then drop the later steps
    (`ActorGroup.drop_snapshots_after`). One that does not load (`CheckpointMismatch` on a
    rank) is a bad checkpoint, not a bad rank: no spare is spent, a warning and a note in
    `notes` name it, and the next older one is tried. Used by recovery and by a resuming run.
    Raises ConfigError (`check_manifest`: another model or layout), WorkerFailure,
    CheckpointError (storage down past the retry budget)."""
    for manifest in _verified_by_ranks(group, ckpt, manifests, timeout):
        check_manifest(manifest)  # ConfigError: stop, don't retry
        ref = ray.put(manifest)  # serialized once, not once per rank
        loaded = group.wait(group.submit("load_checkpoint", ref), timeout)
        if down := [f"rank {r}: {x['storage']}" for r, x in enumerate(loaded) if isinstance(x, dict) and "storage" in x]:
            raise CheckpointError("; ".join(down))
        if errors := [f"rank {r}: {e}" for r, e in enumerate(loaded) if isinstance(e, str)]:
            log.warning("checkpoint %s does not load, trying an older one: %s",
                        ckpt.step_uri(manifest.step), "; ".join(errors))
            notes.append(f"checkpoint step {manifest.step} does not load")
            continue
        group.drop_snapshots_after(manifest.step)  # a rewind: the later snapshots are another timeline's
        for warning in sorted({w for x in loaded for w in x["warnings"]}):  # else only in a worker's log
            log.warning("checkpoint step %d loaded, but %s", manifest.step, warning)
            notes.append(f"checkpoint step {manifest.step}: {warning}")
        return manifest.step
    return None


def restore_checkpoint_through_outage(group: ActorGroup, ckpt,
                                      manifests: Callable[[], list[Manifest]], timeout: float,
                                      check_manifest: Callable[[Manifest], None], notes: list[str]) -> int | None:
    """`restore_checkpoint` of `manifests()` (listed again at each try), tried again while
    storage is down (a CheckpointError: some operation past its own retries), with doubling
    waits for at most `ckpt.retry_budget_s` after the first such error: an outage of up to
    about twice `checkpoint.retry_budget_s` is ridden out, and no rank is blamed or replaced
    for it. Past that, RecoveryError with one line naming the URI, the error and the field to
    change (the other sources were tried before this one; step 0 is no substitute for a
    checkpoint that exists). Other errors as `restore_checkpoint`."""
    first, attempt = None, 0
    while True:
        try:
            return restore_checkpoint(group, ckpt, manifests(), timeout, check_manifest, notes)
        except CheckpointError as e:
            first = time.monotonic() if first is None else first
            waited = time.monotonic() - first
            delay = min(ckpt.retry_backoff_s * 2 ** attempt, ckpt.retry_budget_s - waited)
            cause = " ".join(str(e).split())[:300]
            if delay <= 0:
                raise RecoveryError(
                    f"checkpoint restore from {ckpt.uri}: storage still failing {waited:.1f} s after "
                    f"its retries ran out (checkpoint.retry_budget_s={ckpt.retry_budget_s}): {cause}; restart "
                    f"the run once storage is back (it resumes from its checkpoints) or raise "
                    f"checkpoint.retry_budget_s") from None
            attempt += 1
            log.warning("checkpoint restore: storage failing (%s); trying again in %.1f s", cause, delay)
            notes.append(f"checkpoint restore retried: storage failing ({cause[:100]})")
            time.sleep(delay)


def _verified_by_ranks(group: ActorGroup, ckpt, manifests: list, timeout: float):
    """The committed `manifests` whose files all verify (sizes, sha256), newest first, every
    rank reading its share of the files in parallel (the driver reads only manifests); a step
    with problems is skipped with a warning naming them. Raises CheckpointError when storage is
    down past the retry budget (an outage is not "no checkpoint")."""
    for manifest in reversed(manifests):
        ref = ray.put(manifest)  # serialized once, not once per rank
        results = group.wait(group.submit("verify_checkpoint", ref), timeout)
        if errors := [f"rank {r}: {e}" for r, e in enumerate(results) if isinstance(e, str)]:
            raise CheckpointError("; ".join(errors))
        problems = [p for ps in results for p in ps]
        if not problems:
            yield manifest
        else:
            log.warning("skipping checkpoint %s: %s", ckpt.step_uri(manifest.step), "; ".join(problems))


def grow_back_size(dp: int, configured_dp: int, spares: int, ranks_per_replica: int) -> int | None:
    """The dp to grow back to after a shrink, or None: `configured_dp` when the current `dp` is
    below it and the pool's `spares` fill every missing replica (`ranks_per_replica` = tp x pp
    x cp ranks each). Only the full configured width: a partial grow could leave a dp that
    does not divide the batch, and would re-form the groups twice."""
    if dp >= configured_dp or spares < (configured_dp - dp) * ranks_per_replica:
        return None
    return configured_dp


def grow_back(group: ActorGroup, ckpt, committed_step: int, dp: int,
              ft: FaultToleranceConfig, check_manifest: Callable[[Manifest], None],
              run_id: str | None = None) -> RecoveryTimeline:
    """A planned membership change at a step boundary: add DP replicas from the pool up to
    `dp` (`ActorGroup.grow`), form a new generation and restore the new members like a
    recovery restores replacements (`_restore` with restore=auto, whatever
    `fault_tolerance.restore` says: from a DP peer, every DP group having a member at the
    committed step). Returns its timeline (kind 'grow', `failed_ranks`: the ranks added). Raises WorkerFailure when a member fails meanwhile (the caller recovers
    from it as from any failure), RecoveryError when no source serves the new members."""
    survivors = list(group.workers)
    t0 = time.perf_counter()
    added = group.grow(dp)
    t1 = time.perf_counter()
    tl = RecoveryTimeline("grow", added, sorted({group.workers[r].node_id for r in added}),
                          committed_step=committed_step)
    tl.rebuild_detail = group.form_generation()
    t2 = time.perf_counter()
    # The cheapest source, whatever `restore` forces for failures: a planned change loses no step.
    tl.restored_step = _restore(group, ckpt, committed_step, survivors, dataclasses.replace(ft, restore="auto"),
                                check_manifest, tl, run_id)
    tl.replace_s, tl.rebuild_s, tl.restore_s = t1 - t0, t2 - t1, time.perf_counter() - t2
    tl.generation = group.generation
    return tl


def recover(group: ActorGroup, failure: WorkerFailure, ckpt, committed_step: int,
            ft: FaultToleranceConfig, check_manifest: Callable[[Manifest], None],
            max_attempts: int = 5, run_id: str | None = None) -> RecoveryTimeline:
    """Run the recovery protocol for `failure`; returns the timeline (restored step included).

    `ft`: the `fault_tolerance` config (timeouts, restore mode, min_dp, refill); `check_manifest`
    raises ConfigError when a checkpoint belongs to another model or layout (the run stops);
    `run_id`: a checkpoint restore loads only this run's checkpoints (`Manifest.run_id`; those
    of other runs are skipped with a warning), None: any.
    `detect_s` counts from the failed ranks' last sign of life (`WorkerFailure.last_seen`), or
    from the fault the group injected (`ActorGroup.kill`) when that came later.
    Raises RecoveryError when the pool is empty or recovery keeps failing `max_attempts` times,
    and LeaseLost, with no actor killed or replaced, when another driver took the run over
    (`ActorGroup.fence` before each attempt and each change; a rank refusing the abort as of a
    superseded driver: `HealthMonitor.abort_survivors`).
    """
    failed, aborted = set(failure.ranks), failure.aborted
    survivors = [s for r, s in enumerate(group.workers) if r not in failed]
    committed_members = list(group.workers), group.dims  # who held which shard at the committed step
    tl = RecoveryTimeline(failure.kind, sorted(failed), sorted({group.workers[r].node_id for r in failed}),
                          committed_step=committed_step)
    # Both are lower bounds of when the failure happened: the later one is the closer.
    since = max((t for t in (group.take_injected_at(), failure.last_seen) if t is not None), default=None)
    if since is not None:
        tl.detect_s = max(0.0, failure.detected_at - since)
    for attempt in range(1, max_attempts + 1):
        tl.attempts = attempt
        try:
            group.fence()  # a driver superseded meanwhile stops here (LeaseLost), touching nothing
            t0 = time.perf_counter()
            if not aborted:
                failed |= group.health.abort_survivors(failed)
            group.kill(failed, injected=False)
            killed = [group.workers[r] for r in failed]
            survivors = [s for s in survivors if not any(s is k for k in killed)]
            t1 = time.perf_counter()
            _replace(group, failed, ft)
            if ft.refill_spares:  # after the replacement: its wait is for the refills of earlier recoveries only
                group.refill([s.bundle_index for s in killed], defer=True)
            t2 = time.perf_counter()
            tl.rebuild_detail = group.form_generation()
            t3 = time.perf_counter()
            # Survivors anew after this attempt's membership change: one moved to another shard is new.
            kept = same_shard(*committed_members, group.workers, group.dims)
            stayed = [group.workers[r] for r in kept if any(group.workers[r] is s for s in survivors)]
            tl.restored_step = _restore(group, ckpt, committed_step, stayed, ft, check_manifest, tl, run_id)
            t4 = time.perf_counter()
        except WorkerFailure as again:
            log.warning("failure during recovery (attempt %d): %s", attempt, again)
            tl.notes.append(f"attempt {attempt}: {again}")
            failed, aborted = set(again.ranks), again.aborted  # ranks of the new membership
            tl.failed_ranks = sorted(set(tl.failed_ranks) | failed)
            continue
        tl.abort_s, tl.replace_s, tl.rebuild_s, tl.restore_s = t1 - t0, t2 - t1, t3 - t2, t4 - t3
        tl.generation = group.generation
        tl.failed_ranks = sorted(set(tl.failed_ranks) | failed)
        return tl
    raise RecoveryError(f"recovery failed {max_attempts} times: {tl.notes[-1]}")


def reattach(trainer, committed_step: int, dead: set[int]) -> None:
    """Bring a group taken over from a dead driver (`ActorGroup(cfg, attach=...)`) back to
    training at `committed_step`: abort the old generation's communicators, replace the ranks
    that did not survive (`dead`) from spares, form a new generation on this driver's store and
    restore every rank from its own live state (rollback), a replaced one from a DP peer
    (`recover`'s restore). Logs `event=reattach`. `trainer`: the driver's `trainer.Trainer`."""
    t0 = time.perf_counter()
    group = trainer.group
    trainer.committed_step = committed_step
    try:
        dead |= group.health.abort_survivors(dead)
        survivors = [s for r, s in enumerate(group.workers) if r not in dead]
        if dead:
            if trainer.cfg.fault_tolerance.refill_spares:
                group.refill([group.workers[r].bundle_index for r in dead], defer=True)
            group.replace(dead)
        group.health.start()
        group.form_generation()
        tl = RecoveryTimeline("crash", sorted(dead), [])
        step = _restore(group, trainer.ckpt, committed_step, survivors, trainer.cfg.fault_tolerance,
                       lambda manifest: check_compatible(trainer.cfg, manifest), tl, trainer.run.id)
    except WorkerFailure as failure:
        step = trainer.handle_failure(failure).restored_step
        tl = trainer.recoveries[-1]
    trainer.committed_step = trainer.resumed_from = step
    log.info("event=reattach run=%s step=%d committed=%d replaced=%s source=%s seconds=%.3f",
             trainer.run.id, step, committed_step, sorted(dead), tl.restore_source, time.perf_counter() - t0)
