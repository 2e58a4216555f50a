"""Failure detection on the driver, in one place: waiting for the ranks' calls with a deadline
that progress extends, telling crashes from exceptions from hangs, naming the hung ranks,
probing liveness, finding lost nodes by their raylet, and the abort round that frees survivors.

A slow rank is not a dead one: while any rank's progress counter moves, the deadline moves
with it. A rank whose actor died is a 'crash'; one whose call raised is an 'exception'; ranks
that made no progress past the deadline are a 'hang'.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Callable

import ray

from comms import refuses_connections
from failures import StaleGenerationError, WorkerFailure

if TYPE_CHECKING:
    from actor_group import ActorSlot
    from config import FaultToleranceConfig

log = logging.getLogger(__name__)


class HealthMonitor:
    """Detection over the workers `workers()` returns (index = rank; the actor group owns the
    list and may change it between calls), with the timeouts of `ft`."""

    def __init__(self, ft: FaultToleranceConfig, workers: Callable[[], list[ActorSlot]]):
        self.ft, self._workers = ft, workers
        self._raylets: dict[str, tuple[str, int]] = {}  # node id -> its raylet's (host, port)

    def wait(self, refs: list, timeout: float, ranks: list[int] | None = None) -> list:
        """Results of `refs` (one per rank, or one per rank of `ranks`), or WorkerFailure naming
        the failed ranks.

        A rank whose actor died is a 'crash'; a rank whose call raised while no actor died is an
        'exception'. While waiting, progress counters are polled every `health_interval_s`; the
        deadline is at least `timeout` seconds after the last poll that saw any counter move
        (slow is not dead). When it passes without progress: every rank's
        communicators are aborted, which frees ranks blocked in a collective; ranks whose compute
        thread still does not answer are the hung ones ('hang'; an empty set means the
        collective itself stalled and every rank was freed).
        """
        ft, workers = self.ft, self._workers()
        rank_of = list(ranks) if ranks is not None else list(range(len(refs)))
        index = {r.hex(): i for i, r in enumerate(refs)}
        results: list = [None] * len(refs)
        pending, deadline = list(refs), time.monotonic() + timeout
        progress: dict[int, int] = {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=max(0.0, min(ft.health_interval_s, deadline - time.monotonic())))
            if done:
                i = index[done[0].hex()]
                try:
                    results[i] = ray.get(done[0])
                except ray.exceptions.RayActorError as e:
                    # No ping round, and only this rank's node is checked (a lost node takes all
                    # its ranks): the abort round that follows calls every other rank anyway and
                    # names those that died too (`abort_survivors`).
                    lost = self.lost_ranks({workers[rank_of[i]].node_id})
                    raise WorkerFailure({rank_of[i]} | lost, "crash", str(e)[:300]) from None
                except ray.exceptions.RayTaskError as e:
                    dead = self.probe()
                    if dead:
                        raise WorkerFailure(dead, "crash", "actor(s) died") from None
                    if not isinstance(e.cause, (TimeoutError, StaleGenerationError)):
                        log.debug("rank %d raised: %s", rank_of[i], e)
                        raise WorkerFailure({rank_of[i]}, "exception",
                                            f"rank {rank_of[i]}: {type(e.cause).__name__}: {str(e.cause)[:500]}") from None
                    # This rank gave up waiting for a peer: judge the ranks still pending soon.
                    results[i] = e
                    deadline = min(deadline, time.monotonic() + self.ft.health_timeout_s)
                continue
            now = self._progress()
            if any(now[r] > progress.get(r, -1) for r in now):  # moved since the last poll
                progress, deadline = now, max(deadline, time.monotonic() + timeout)
            if time.monotonic() < deadline:
                continue
            raise self._hang_failure({rank_of[index[r.hex()]] for r in pending}, timeout)
        gave_up = [rank_of[i] for i, r in enumerate(results) if isinstance(r, ray.exceptions.RayTaskError)]
        if gave_up:  # everyone arrived late but did arrive: a transient; re-form without blame
            raise WorkerFailure(set(), "exception", f"rank(s) {gave_up} timed out waiting for peers")
        return results

    def _progress(self, key: str = "progress") -> dict[int, int]:
        """rank -> progress counter (`progress`: monotonic; `step_progress`: within the current
        step), for ranks that answer a control ping in time."""
        refs = {r: s.handle.ping.remote() for r, s in enumerate(self._workers())}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                            timeout=self.ft.health_timeout_s)
        out = {}
        for r, ref in refs.items():
            if ref in ready:
                try:
                    out[r] = ray.get(ref)[key]
                except ray.exceptions.RayError:
                    pass
        return out

    def _hang_failure(self, pending: set[int], timeout: float) -> WorkerFailure:
        """Name the hung ranks of a call that made no progress. Ranks whose progress counter lags
        the others are stuck before a collective their peers wait in: those are hung. With no
        laggard, every rank is aborted (freeing ranks blocked in a collective, as NCCL does) and
        the ranks whose abort fails or whose compute thread still does not answer are hung; the
        failure is then marked `aborted`, so recovery does not abort the survivors again."""
        dead = self.probe()
        if dead:
            return WorkerFailure(dead, "crash", "actor(s) died")
        why = f"no progress for {timeout:.1f} s on rank(s) {sorted(pending)}"
        progress = self._progress("step_progress")
        top = max(progress.values(), default=0)
        lagging = {r for r in pending if progress.get(r, -1) < top}
        if lagging:
            return WorkerFailure(lagging, "hang", f"{why}; progress {progress}")
        workers = self._workers()
        unanswered = self.abort_survivors(set())
        refs = {r: s.handle.noop.remote() for r, s in enumerate(workers) if r not in unanswered}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.ft.health_timeout_s)
        stuck = unanswered | {r for r, ref in refs.items() if ref not in ready}
        return WorkerFailure(stuck, "hang", f"{why}; compute thread still stuck after abort on {sorted(stuck)}",
                             aborted=True)

    def probe(self) -> set[int]:
        """Ranks whose actor is dead or does not answer a control-group ping within
        `fault_tolerance.health_timeout_s` seconds. An actor that is temporarily unreachable
        (`ActorUnavailableError`, e.g. its node's agent restarting) is retried until then and
        not reported if it answers; one still unreachable then is (its node is likely gone:
        Ray marks a lost node dead only some seconds later; see docs/recovery.md, "Detect").

        Lost nodes are found sooner: when a node's raylet refuses connections
        (`refuses_connections`), its process is gone, and with it every actor of that node
        (Ray's workers exit when their raylet dies; until then they may still answer pings).
        Every rank on that node is then dead at once, without waiting for the timeout. Why:
        otherwise the node's ranks are found one at a time, each at its own timeout or failed
        abort call (see docs/recovery.md, "Detect"). Caveat (not tested here): a firewall that
        rejects, rather than drops, connections from the driver's node to a raylet port would
        make that node look lost."""
        ft, workers = self.ft, self._workers()
        deadline = time.monotonic() + ft.health_timeout_s
        dead = self.lost_ranks()
        todo = set(range(len(workers))) - dead
        while todo:
            refs = {r: workers[r].handle.ping.remote() for r in todo}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                                timeout=max(0.0, deadline - time.monotonic()))
            retry = set()
            for r, ref in refs.items():
                if ref not in ready:
                    dead.add(r)
                    continue
                try:
                    ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    retry.add(r)
                except ray.exceptions.RayActorError:
                    dead.add(r)
            lost = self.lost_nodes({workers[r].node_id for r in retry})
            dead |= {r for r in retry if workers[r].node_id in lost}
            retry -= dead
            if retry and time.monotonic() >= deadline:
                dead |= retry  # still unreachable after health_timeout_s: not a transient
                break
            if retry:
                time.sleep(min(0.1, ft.health_interval_s))
            todo = retry
        return dead

    def lost_ranks(self, node_ids: set[str] | None = None) -> set[int]:
        """Ranks on a node (of `node_ids`; default: every worker's) whose raylet refuses
        connections (`lost_nodes`): dead, no ping needed."""
        workers = self._workers()
        lost = self.lost_nodes({s.node_id for s in workers} if node_ids is None else node_ids)
        return {r for r, s in enumerate(workers) if s.node_id in lost}

    def lost_nodes(self, node_ids: set[str]) -> set[str]:
        """Those of `node_ids` whose raylet refuses connections (its address from `ray.nodes()`,
        cached), or that Ray no longer lists as alive. The nodes are tried in parallel (32
        threads): one that does not answer costs 0.5 s, not 0.5 s per node."""
        if not node_ids:
            return set()
        if not node_ids <= self._raylets.keys():
            self._raylets.update({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"])
                                  for n in ray.nodes() if n["Alive"]})
        known = [n for n in node_ids if n in self._raylets]
        with concurrent.futures.ThreadPoolExecutor(min(32, len(known) or 1)) as pool:
            refused = pool.map(refuses_connections, [self._raylets[n] for n in known])
        return (node_ids - set(known)) | {n for n, r in zip(known, refused) if r}

    def abort_survivors(self, failed: set[int]) -> set[int]:
        """Abort the communicators of every rank not in `failed`, in parallel through the
        control group (this also frees a rank stuck in a collective). Returns the ranks that
        died too (detection names the first death only), did not answer within
        `health_timeout_s`, or whose abort raised (compute thread still in a collective:
        `MegatronActor.abort`): they are failed too."""
        workers = self._workers()
        refs = {r: s.handle.abort.remote() for r, s in enumerate(workers) if r not in failed}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.ft.health_timeout_s)
        unanswered = set()
        for r, ref in refs.items():
            try:
                if ref not in ready:
                    raise TimeoutError
                ray.get(ref)
            except (TimeoutError, ray.exceptions.RayError) as e:
                why = ("its abort timed out" if isinstance(e, TimeoutError) else
                       "its actor died or is unreachable" if isinstance(e, ray.exceptions.RayActorError) else
                       "its abort failed")
                log.warning("rank %d is replaced: %s %s", r, why, str(e)[-300:])
                unanswered.add(r)
        return unanswered
