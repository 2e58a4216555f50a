"""Failure detection on the driver, in one place: heartbeats (control-group pings from a
driver thread), waiting for the ranks' calls with a deadline that progress extends, telling
crashes from unreachable ranks from exceptions from hangs, naming the hung ranks, finding lost
nodes by their raylet, and the abort round that frees survivors.

A slow rank is not a dead one: while any rank's progress counter moves, the deadline moves
with it. A rank whose actor died (or whose node's raylet refuses connections) is a 'crash';
one that answered no ping for `health_timeout_s` is 'unreachable' (cut off, frozen or too slow:
a host whose packets vanish refuses nothing, so no error ever comes); one whose call raised is
an 'exception'; ranks that made no progress past the deadline are a 'hang'.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import ray

from ftrain.control.agent_tree import FANOUT, Rounds, actor_key, branches, shape, summary, without
from ftrain.control.ray_batch import BATCH_S, batch_wait, getters
from ftrain.control.run_lease import LeaseLost
from ftrain.distributed.comms import refuses_connections
from ftrain.failures import DataError, StaleGenerationError, WorkerFailure

if TYPE_CHECKING:
    from ftrain.config import FaultToleranceConfig
    from ftrain.control.actor_slot import ActorSlot

log = logging.getLogger(__name__)

BLAMELESS_HANGS = 3
"""Hangs with no culprit (every rank freed by the abort: a stalled link, not a hung rank) after
which the node they point at is excluded (`suspected_node`), rather than the same membership
being formed again forever."""


def ping_result(get: Callable, key: str) -> tuple[dict | None, str]:
    """(answer, "") of the ended ping of actor `key` whose outcome `get` returns or raises
    (`ray_batch.getters`); (None, the error) when Ray says its actor died; (None, "") when it
    gave no answer this time (briefly unavailable, e.g. its node's Ray agent restarting, or the
    ping raised: logged)."""
    try:
        return get(), ""
    except ray.exceptions.ActorUnavailableError:
        return None, ""
    except ray.exceptions.RayActorError as e:
        return None, str(e)[:300]
    except Exception as e:  # noqa: BLE001 - e.g. the ping raised: no answer this time
        log.warning("ping of actor %s failed: %s", key[:12], str(e)[:300])
        return None, ""


class CallLost(Exception):
    """A rank's call whose answer is lost with the node agent that carried it (the agent died
    or its call failed): the rank itself is judged by its heartbeats and its node's raylet."""


class Calls:
    """Calls in flight, one per rank (index i: the i-th rank of the wait), as
    `HealthMonitor.wait` gathers them; here one ObjectRef per call, made by the caller.
    `node_agent.AgentCalls` sends them as one call per root of the agents' tree instead."""

    def __init__(self, refs: list):
        self.size = len(refs)
        self._index = {ref: i for i, ref in enumerate(refs)}

    def waitables(self) -> list:
        """The ObjectRefs to wait on first."""
        return list(self._index)

    def ended(self, ref, get: Callable) -> tuple[list[tuple[int, Callable]], list]:
        """For the ended waitable `ref` whose outcome `get` returns or raises: ([(call index, a
        function returning its result or raising its error)], the waitables to wait on next in
        its place)."""
        return [(self._index[ref], get)], []

    def ended_all(self, refs: list) -> tuple[list[tuple[int, Callable]], list]:
        """`ended` of each of `refs`, together (fetched with one `ray.get`: `ray_batch.getters`)."""
        out, more = [], []
        for ref, get in getters(refs).items():
            o, m = self.ended(ref, get)
            out += o
            more += m
        return out, more

    def taken(self, refs: list) -> tuple[dict, list[tuple[int, Callable]], list]:
        """`ended_all` of `refs` with the results already known to be good apart, so that a
        caller takes them in bulk: (call index -> its result, [(call index, a function
        returning its result or raising its error)] of the others, the waitables to wait on
        next). Here every result is behind its function (`ray.get` may raise)."""
        out, more = self.ended_all(refs)
        return {}, out, more

    def cut_off(self, gone: set[str]) -> tuple[list[tuple[int, Callable]], set]:
        """(the calls lost with the node agents of `gone` (actor keys): [(call index, a function
        raising `CallLost`)], the waitables they drop); none here (`node_agent.AgentCalls`)."""
        return [], set()

    def indices(self, waiting: list) -> set[int]:
        """The call indices whose results the waitables `waiting` would bring."""
        return {self._index[ref] for ref in waiting}


@dataclass
class Beat:
    """What the heartbeats know of one actor. Times: `time.monotonic()`, `seen_wall` wall clock."""
    seen: float                   # its last answer arrived (tracking start, before any answer)
    seen_wall: float
    seen_sent: float = -1.0       # when the ping it last answered was sent
    info: dict = field(default_factory=dict)   # that answer (`MegatronActor.ping`)
    dead: str = ""                # Ray said its actor died (the error), else ""
    ref: object = None            # the ping in flight
    sent: float = 0.0
    moved: float = -1.0           # when an answer's work counter (`work`) last rose over the one before

    def answered(self, info: dict, now: float) -> None:
        """Record `info`, the answer that arrived at `now`, as its newest; `moved` = `now` when
        its work counter rose."""
        if (new := work(info)) is not None and (old := work(self.info)) is not None and new > old:
            self.moved = now
        self.info = info


def work(info: dict) -> int | None:
    """The work counter of a ping's answer: its `progress` plus its checkpoint I/O's
    (`io_progress`: a slow save, verify or load is not a hang); None when it has no `progress`."""
    return info["progress"] + info.get("io_progress", 0) if "progress" in info else None


def hang_culprits(counts: dict[int, dict[str, int]]) -> set[int]:
    """The ranks a stuck call waits for, from each rank's collectives entered per process group.

    `counts`: rank -> {group key: collectives entered in that group} (`comms.collective_counts`:
    the key names the group's members, so the members of one group report the same key).
    In a group whose members' counts differ, those at its highest count entered a collective
    that the others have not: they wait inside it; the others are behind. A rank behind in some
    group and waiting in none stopped outside any collective (a hung compute thread, a frozen
    process, storage that does not answer): it is a culprit. The others are its victims: its
    TP peers inside their all-reduce, DP peers in the gradient reduce, a downstream pipeline
    stage in its receive (where p2p is counted: gloo), a spare in its first broadcast. Groups
    whose members agree say nothing (a fresh generation, a save, a collective every member
    entered). Returns the empty set when no group differs or every laggard also waits."""
    groups: dict[str, dict[int, int]] = {}
    for r, per_group in counts.items():
        for key, n in per_group.items():
            groups.setdefault(key, {})[r] = n
    behind, waiting = set(), set()
    for members in groups.values():
        top = max(members.values())
        if min(members.values()) < top:
            waiting |= {r for r, n in members.items() if n == top}
            behind |= {r for r, n in members.items() if n < top}
    return behind - waiting


def suspected_node(hangs: list[dict[str, int]], bound: int = BLAMELESS_HANGS) -> str | None:
    """The node to exclude after hangs that named no rank, or None while fewer than `bound`.
    `hangs`: per such hang, node id -> how many of its ranks the stuck call still waited for.
    The node in the most of them; ties: the one with the most stuck ranks over all of them,
    then the smallest id (the same answer on every run)."""
    if len(hangs) < bound:
        return None
    score: dict[str, tuple[int, int]] = {}
    for hang in hangs:
        for node, n in hang.items():
            times, ranks = score.get(node, (0, 0))
            score[node] = (times + 1, ranks + n)
    return min(score, key=lambda node: (-score[node][0], -score[node][1], node)) if score else None


class Heartbeats:
    """Liveness of actors: a driver thread pings every actor `actors()` returns through its
    control group every `interval_s` seconds, one ping in flight per actor, and records the
    answers. An actor is alive when it answered a recent ping, dead when Ray says its actor
    died, and silent once no answer came for `timeout_s` seconds. Pings never block the caller:
    a ping that gets no answer only makes the silence longer. `start` / `stop` the thread.

    `actors()`: handles, or slots (`.handle`, `.node_id`). `agents()`: node id -> its
    `node_agent.NodeAgent`; `node_of(slot)`: the node id of a slot (default its `node_id`).
    The agents form a fan-out tree of arity `fanout` (`tree`, `agent_tree.shape`): the driver
    sends a round to each root, which pings its node's actors, forwards the round down its
    subtree and answers with every answer of it (the driver sends at most `fanout` calls per
    round). The actors of a node with no agent in the tree are pinged from here. An agent
    leaves the tree while Ray says it died, or while it is stalled: its round (as a root) or its
    parent's report of its round is late by more than `AGENT_LATE_INTERVALS` intervals (not
    started yet, frozen); a stalled agent is probed and rejoins once it answers. Meanwhile its
    node's actors are pinged from here and its children answer to its parent
    (`agent_tree.without`); step calls leave it only once it is gone (`call_tree`)."""

    AGENT_LATE_INTERVALS = 2

    def __init__(self, actors: Callable[[], list], interval_s: float, timeout_s: float,
                 agents: Callable[[], dict] = dict, node_of: Callable | None = None, fanout: int = FANOUT):
        self._actors, self.interval_s, self.timeout_s = actors, interval_s, timeout_s
        self._agents, self.node_of, self.fanout = agents, node_of or (lambda slot: slot.node_id), fanout
        self._beats: dict[str, Beat] = {}
        self._roots = Rounds("driver")        # the rounds to the roots of the tree
        self._pings: dict = {}                # ping in flight from here -> actor key
        self._dead_agents: set[str] = set()   # agent keys whose actor died
        self._stalled: dict[str, float] = {}  # agent key -> when it was stalled (late rounds)
        # Agents that answered a probe: one not started yet (a process starting under load can
        # take longer than timeout_s) is stalled but never gone; Ray queues its calls meanwhile.
        self._started: set[str] = set()
        # One probe (`NodeAgent.node_id`) in flight per agent not started yet or stalled:
        # agent key -> its ObjectRef (`_probed`).
        self._probes: dict[str, object] = {}
        self._roster: tuple = ((), [], {}, {})  # (actor ids, the actors, key -> handle, node -> [(key, handle)])
        self._trees: dict[bool, tuple] = {}    # for calls? -> (what it was made of, the tree)
        self._plan: tuple = (None, None, [], [])  # (roster ids, tree, root branches, actor keys pinged from here)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)

    def tree(self) -> tuple[dict, dict]:
        """The heartbeats' tree of agents now: (`agent_tree.shape` over every agent's node, in
        node-id order, `without` the nodes whose agent died or is stalled; node -> its agent, of
        the nodes in it). The same object while unchanged."""
        with self._lock:
            return self._tree_without(False, self._dead_agents | set(self._stalled))

    def call_tree(self) -> tuple[dict, dict]:
        """The tree that step calls take (`node_agent.NodeCalls`), as `tree` but without only
        the agents that died or are gone (`gone_agents`): a stalled agent that may still answer
        (slow, starting) keeps its calls, which wait for it."""
        gone = self.gone_agents()
        with self._lock:
            return self._tree_without(True, gone)

    def _tree_without(self, calls: bool, out: set[str]) -> tuple[dict, dict]:
        agents = self._agents()
        keys = tuple(sorted((n, actor_key(a)) for n, a in agents.items()))
        gone = frozenset(n for n, k in keys if k in out)
        made, tree = self._trees.get(calls, (None, None))
        if made != (self.fanout, keys, gone):
            tree = (without(shape([n for n, _ in keys], self.fanout), gone), {n: agents[n] for n, _ in keys if n not in gone})
            self._trees[calls] = ((self.fanout, keys, gone), tree)
        return tree

    def gone_agents(self) -> set[str]:
        """Keys of the agents that died, or that were stalled `timeout_s` ago and have not
        answered a probe since (as a silent rank): the calls they carry are lost. (A slow agent
        answers its probe: it rejoins the tree, and its calls go on. One that has not answered
        its first probe is starting, not gone: its calls wait for it.)"""
        now = time.monotonic()
        with self._lock:
            return self._dead_agents | {k for k, since in self._stalled.items()
                                        if now - since >= self.timeout_s and k in self._started}

    def agent_died(self, agent) -> None:
        """Ask `agent` nothing more: its node's actors are pinged (and called) from here."""
        with self._lock:
            self._dead_agents.add(actor_key(agent))
            self._stalled.pop(actor_key(agent), None)

    def _run(self) -> None:
        while not self._stop.is_set() and ray.is_initialized():
            t0 = time.monotonic()
            try:
                self._round()
            except Exception as e:  # noqa: BLE001 - a bad round must not end liveness tracking
                log.debug("heartbeat round failed: %s", e)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def _round(self) -> None:
        """Send a ping to each actor with none in flight, then record answers for up to one
        interval."""
        now = time.monotonic()
        self._collect(self._send(now), now + self.interval_s)

    def _roster_of(self) -> tuple[dict, dict]:
        """(key -> handle, node -> [(key, handle)]) of the actors now (node None: no slot);
        start tracking new actors and forget those gone when they changed."""
        actors = self._actors()
        ids = tuple(map(id, actors))
        if ids != self._roster[0]:
            handles, by_node = {}, {}
            for a in actors:
                h, node = (a.handle, self.node_of(a)) if hasattr(a, "handle") else (a, None)
                k = actor_key(h)
                handles[k] = h
                by_node.setdefault(node, []).append((k, h))
            self._roster = (ids, list(actors), handles, by_node)
            now, wall = time.monotonic(), time.time()
            with self._lock:
                for k in set(self._beats) - set(handles):
                    del self._beats[k]
                for k in handles:
                    self._beats.setdefault(k, Beat(now, wall))
        return self._roster[2], self._roster[3]

    def _send(self, now: float) -> dict:
        """Start tracking new actors, forget those gone, stall the roots whose round is late,
        send a round (at `now`, monotonic) to each root of the tree with none in flight, a ping
        to each actor with none in flight whose node has no agent in the tree, and a probe to
        each stalled agent with none in flight. Returns every call in flight: ref -> actor key
        (a ping), "round" (a root's round) or ("probe", agent key)."""
        handles, by_node = self._roster_of()
        late_s = self.AGENT_LATE_INTERVALS * self.interval_s
        late = self._roots.late(now, late_s)
        if late:
            self._stall(late)
        tree = self.tree()
        if self._plan[0] != self._roster[0] or self._plan[1] is not tree:
            shape_, agents = tree
            direct = [k for node, actors in by_node.items() if node not in agents for k, _ in actors]
            self._plan = (self._roster[0], tree, branches(shape_, agents, by_node), direct)
        self._roots.set(self._plan[2])
        in_flight: dict = {ref: "round" for ref in self._roots.send(now, None, late_s)}
        with self._lock:
            for k in self._plan[3]:
                b = self._beats[k]
                if b.ref is None and not b.dead:
                    b.ref, b.sent = handles[k].ping.remote(), now
                    self._pings[b.ref] = k
            in_flight.update(self._pings)
            by_key = {actor_key(a): a for a in self._agents().values()}
            # agents gone from the roster are forgotten
            for known in (self._started, self._dead_agents):
                known.intersection_update(by_key)
            for known in (self._stalled, self._probes):
                for k in known.keys() - by_key.keys():
                    del known[k]
            unsure = (by_key.keys() - self._started) | self._stalled.keys()  # not started, or stalled
            for k in unsure - self._dead_agents - self._probes.keys():
                self._probes[k] = by_key[k].node_id.remote()
            in_flight.update({ref: ("probe", k) for k, ref in self._probes.items()})
        return in_flight

    def _stall(self, late: dict[str, float]) -> None:
        """The agents of `late` (key -> the driver time of their round unanswered) leave the
        tree until they answer a probe."""
        now = time.monotonic()
        with self._lock:
            for k in late:
                if k not in self._stalled and k not in self._dead_agents:
                    self._stalled[k] = now
                    log.warning("node agent %s answers no round: its node's actors are pinged from the driver, "
                                "its children re-parented", k[:12])

    def _collect(self, in_flight: dict, end: float) -> None:
        """Record the answers of the calls `in_flight` (`_send`) that come before `end`
        (monotonic), in batches (`batch_wait`): each takes every answer ready within `BATCH_S`
        of the first, so a silent actor delays no other by more than that, and a round costs
        O(calls) per batch."""
        waiting = list(in_flight)
        while waiting and end - time.monotonic() > 0:
            ready, waiting = batch_wait(waiting, end)
            for ref, get in getters(ready).items():
                what = in_flight[ref]
                if what == "round":
                    answer = summary()
                    if self._roots.ended(ref, answer, get):
                        self._record_round(answer)
                elif isinstance(what, tuple):
                    self._probed(what[1], ref, get)
                else:
                    self._record(what, ref, get)

    def _probed(self, key: str, ref, get: Callable) -> None:
        """The probe `ref` of agent `key` ended (`get`: its outcome). Answered: the agent has
        started, and, if stalled, rejoins the tree. Raised that its actor died: it is dead. Any
        other outcome (unavailable, not started yet): it is probed again next round."""
        try:
            get()
            dead = ""
        except ray.exceptions.ActorUnavailableError:
            dead = None
        except ray.exceptions.RayActorError as e:
            dead = str(e)[:200]
        except Exception:  # noqa: BLE001 - no answer this time: probed again
            dead = None
        with self._lock:
            if self._probes.get(key) is ref:
                del self._probes[key]
            if dead is None:
                return
            stalled = self._stalled.pop(key, None) is not None
            if dead:
                self._dead_agents.add(key)
            else:
                self._started.add(key)
        if dead or stalled:
            log.warning("node agent %s %s", key[:12], f"died: {dead}" if dead else "answers again: it rejoins the tree")

    def _record_round(self, answer: dict) -> None:
        """Record a root's round summary (`agent_tree.summary`): each answer as if its ping had
        been sent from here at the round's time; agents found dead leave the tree, those found
        late are stalled."""
        for k, why in answer["dead"].items():
            log.warning("node agent %s died; its node's actors are pinged by the driver: %s", k[:12], why)
        with self._lock:
            self._dead_agents.update(answer["dead"])
        self._stall(answer["late"])
        now, wall = time.monotonic(), time.time()
        beats = self._beats
        with self._lock:
            for key, info, at in zip(answer["keys"], answer["infos"], answer["ats"]):
                b = beats.get(key)
                if b is not None and at >= b.seen_sent:
                    b.seen, b.seen_wall, b.seen_sent = now, wall, at
                    b.answered(info, now)
            for key, dead in answer["died"].items():
                if (b := beats.get(key)) is not None:
                    b.dead = dead

    def _record(self, key: str, ref, get: Callable) -> None:
        """Record the answer of `ref`, the ping of actor `key` (`get`: its outcome), and clear
        its ping in flight whatever the answer was, so that one bad answer costs no other actor
        its round."""
        info, dead = ping_result(get, key)
        with self._lock:
            self._pings.pop(ref, None)
            b = self._beats.get(key)
            if b is None:
                return
            if info is not None:
                b.seen, b.seen_wall, b.seen_sent = time.monotonic(), time.time(), b.sent
                b.answered(info, b.seen)
            b.dead, b.ref = dead, None

    def beat(self, handle) -> Beat | None:
        with self._lock:
            return self._beats.get(actor_key(handle))

    def look(self, keys: list[str], since: float, timeout_s: float) -> tuple[set[int], bool]:
        """One pass over the actors of `keys` (`actor_key`), under one lock: (the indices of
        those silent for `timeout_s` or longer (`silence_s`), whether the work counter of any
        of them rose in an answer that arrived after `since`, monotonic: `Beat.moved`)."""
        now, silent, moved = time.monotonic(), set(), False
        with self._lock:
            for i, key in enumerate(keys):
                if (b := self._beats.get(key)) is not None:
                    if now - b.seen >= timeout_s:
                        silent.add(i)
                    moved = moved or b.moved > since
        return silent, moved

    def silence_s(self, handle) -> float:
        """Seconds since `handle` last answered (since tracking started, before any answer)."""
        b = self.beat(handle)
        return 0.0 if b is None else time.monotonic() - b.seen

    def settle(self, handles: list, since: float) -> tuple[set[int], set[int], set[int]]:
        """(alive, dead, silent): indices into `handles`, each actor put in one as soon as it
        answered a ping sent at or after `since` (monotonic), Ray said it died, or it has been
        silent `timeout_s`. Returns within about `timeout_s` (every actor, concurrently)."""
        alive, dead, silent = set(), set(), set()
        todo = set(range(len(handles)))
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s  # an untracked actor
        while todo:
            now = time.monotonic()
            for i in list(todo):
                b = self.beat(handles[i])
                if b is not None and b.seen_sent >= since:
                    alive.add(i)
                elif b is not None and b.dead:
                    dead.add(i)
                elif (b is not None and now - b.seen >= self.timeout_s) or now >= deadline:
                    silent.add(i)
                else:
                    continue
                todo.discard(i)
            if todo:
                time.sleep(0.01)
        return alive, dead, silent


class HealthMonitor:
    """Detection over the workers `workers()` returns (index = rank; the actor group owns the
    list and may change it between calls), with the timeouts of `ft`. Its heartbeats
    (`Heartbeats`) track the workers and the spares `spares()` returns; `start` / `stop` them.
    `generation()`: the group's current generation, sent with each abort (`MegatronActor.abort`).
    `agents()`, `node_of`, `fanout`: the node agents, the node of a slot and the arity of the
    agents' tree (`Heartbeats`)."""

    def __init__(self, ft: FaultToleranceConfig, workers: Callable[[], list[ActorSlot]],
                 spares: Callable[[], list[ActorSlot]] = list, generation: Callable[[], int] = lambda: 0,
                 agents: Callable[[], dict] = dict, node_of: Callable | None = None, fanout: int = FANOUT):
        self.ft, self._workers, self._generation = ft, workers, generation
        self._raylets: dict[str, tuple[str, int]] = {}  # node id -> its raylet's (host, port)
        self._blameless: list[dict[str, int]] = []      # hangs that named no rank (`suspected_node`)
        self.beats = Heartbeats(lambda: [*workers(), *spares()], ft.health_interval_s, ft.health_timeout_s, agents,
                                node_of, fanout)

    def start(self) -> None:
        self.beats.start()

    def agent_failed(self, agent, error: BaseException) -> None:
        """A call through `agent` failed with `error`: once Ray says the agent died, its node's
        ranks are pinged and called from here (`Heartbeats.agent_died`)."""
        if isinstance(error, ray.exceptions.RayActorError) and not isinstance(
                error, ray.exceptions.ActorUnavailableError):
            log.warning("node agent %s died; its node's ranks are called from the driver: %s",
                        actor_key(agent)[:12], str(error)[:200])
            self.beats.agent_died(agent)

    def stop(self) -> None:
        self.beats.stop()

    def last_seen(self, ranks: set[int]) -> float | None:
        """Wall-clock time of the earliest last answer among `ranks` (None: none answered):
        the last sign of life of a failure that took them."""
        workers = self._workers()
        beats = [self.beats.beat(workers[r].handle) for r in ranks if r < len(workers)]
        times = [b.seen_wall for b in beats if b is not None]
        return min(times) if times else None

    def _failure(self, ranks: set[int], kind: str, detail: str, **kw) -> WorkerFailure:
        return WorkerFailure(ranks, kind, detail, last_seen=kw.pop("last_seen", None) or self.last_seen(ranks), **kw)

    def wait(self, refs: list | Calls, timeout: float, ranks: list[int] | None = None,
             culprit_s: float | None = None) -> list:
        """Results of `refs` (ObjectRefs or `Calls`: one call per rank, or one per rank of
        `ranks`), or WorkerFailure naming the failed ranks.

        A rank whose actor died is a 'crash'; a rank whose heartbeats have been silent for
        `health_timeout_s` is 'unreachable' (checked every `health_interval_s`, whatever the
        call); a rank whose call raised while no actor died is an 'exception', except a DataError
        (a row of the training data could not be read), which is raised as it is: the run stops. The deadline is
        at least `timeout` seconds after the heartbeats last showed a progress counter move
        (slow is not dead; a ping without answer shows nothing). When it passes without
        progress, the hung ranks are named ('hang', `_hang_failure`): those that did not enter
        a collective their group's other members wait in, else those whose compute thread
        still does not answer once every rank's communicators are aborted (an empty set: the
        collective itself stalled and every rank was freed). With `culprit_s`, such a culprit
        is a hang as soon as no progress counter moved for `culprit_s` seconds (a rank that
        stopped outside any collective while its peers wait for it; a slow rank's counters
        move), before the deadline. A call whose answer is lost to
        `ActorUnavailableError` re-forms without blame, as does one lost with a node agent that
        carried it (`CallLost`: the agent's call failed, or the agent died or stopped answering
        its rounds, `Heartbeats.gone_agents`) on a node whose raylet still answers (one that
        refuses: a crash of the node's ranks), unless a fresh ping then finds a rank's actor dead:
        a crash of that rank. Results are gathered in batches (`BATCH_S`)."""
        ft, workers = self.ft, self._workers()
        calls = refs if isinstance(refs, Calls) else Calls(refs)
        rank_of = list(ranks) if ranks is not None else list(range(calls.size))
        results: list = [None] * calls.size
        transient: dict[int, BaseException] = {}  # call index -> its answer lost or its wait for a peer timed out
        pending, deadline = calls.waitables(), time.monotonic() + timeout
        looked, moved_at, keys = time.monotonic(), time.time(), None
        still_since = time.monotonic()  # no progress counter moved since
        next_look = time.monotonic() + ft.health_interval_s
        while pending:
            # Batched: every call that ends within BATCH_S of the first is taken in one pass
            # (one wait per call would scan the pending list once per call); no wait while
            # none ends (a step's wall time costs no polls).
            done, pending = batch_wait(pending, min(next_look, deadline))
            raised, lost_calls = [], []
            good, ended, more = calls.taken(done)
            for i, result in good.items():
                results[i] = result
            cut, dropped = calls.cut_off(self.beats.gone_agents())
            pending = [ref for ref in pending + more if ref not in dropped] if dropped else pending + more
            for i, get in ended + cut:
                try:
                    results[i] = get()
                except CallLost as e:
                    lost_calls.append((i, e))
                except ray.exceptions.ActorUnavailableError as e:
                    # Silent, not dead (e.g. its node's agent restarting): the call's answer is
                    # lost, the rank is judged by its heartbeats; a transient re-forms without blame.
                    log.warning("rank %d: call lost, actor unavailable: %s", rank_of[i], str(e)[:300])
                    transient[i] = e
                    deadline = min(deadline, time.monotonic() + self.ft.health_timeout_s)
                except ray.exceptions.RayActorError as e:
                    # No ping round, and only this rank's node is checked (a lost node takes all
                    # its ranks): the abort round that follows calls every other rank anyway and
                    # names those that died too (`abort_survivors`).
                    lost = self.lost_ranks({workers[rank_of[i]].node_id})
                    raise self._failure({rank_of[i]} | lost, "crash", str(e)[:300]) from None
                except ray.exceptions.RayTaskError as e:
                    raised.append((i, e))
            if lost_calls:  # with their node agent: a crash where the ranks' raylet is gone, else judged later
                lost = self.lost_ranks({workers[rank_of[i]].node_id for i, _ in lost_calls})
                if lost:
                    raise self._failure(lost, "crash", f"node(s) lost: raylet refuses connections; {lost_calls[0][1]}")
                for i, e in lost_calls:
                    transient[i] = e
                deadline = min(deadline, time.monotonic() + self.ft.health_timeout_s)
            for i, e in raised:
                if isinstance(e.cause, DataError):  # the data's fault, not the rank's: no spare can help
                    raise e.cause from None
            if raised:
                # Often a peer's death seen first as this rank's connection error: judge every
                # rank by a ping sent after the errors (one probe per batch), not by one before.
                crashed, silent = self._probe(fresh=True)
                if crashed | silent:
                    raise self._failure(crashed | silent, "crash" if crashed else "unreachable",
                                        "actor(s) died" if crashed else self._silence_detail(silent)) from None
                for i, e in raised:
                    if not isinstance(e.cause, (TimeoutError, StaleGenerationError)):
                        log.debug("rank %d raised: %s", rank_of[i], e)
                        raise self._failure({rank_of[i]}, "exception",
                                            f"rank {rank_of[i]}: {type(e.cause).__name__}: {str(e.cause)[:500]}",
                                            last_seen=time.time()) from None
                    transient[i] = e  # this rank gave up waiting for a peer: judge the others soon
                deadline = min(deadline, time.monotonic() + self.ft.health_timeout_s)
            if not pending or time.monotonic() < min(next_look, deadline):
                continue
            next_look = time.monotonic() + ft.health_interval_s
            keys = keys or [actor_key(s.handle) for s in workers]  # at the first look: a short call needs none
            look = time.monotonic()
            silent, moved = self.beats.look(keys, looked, ft.health_timeout_s)
            if silent:  # a silent rank whose raylet refuses connections lost its node: a crash
                lost = self.lost_ranks({workers[r].node_id for r in silent})
                if lost:
                    raise self._failure(silent | lost, "crash", "node(s) lost: raylet refuses connections")
                raise self._failure(silent, "unreachable", self._silence_detail(silent))
            if moved:  # no O(ranks) snapshot per call: the beats time each rise
                deadline, moved_at, still_since = max(deadline, time.monotonic() + timeout), time.time(), look
            looked = look
            if culprit_s is not None and look - still_since >= culprit_s and \
                    (culprits := hang_culprits(counts := self._collectives())):
                raise WorkerFailure(culprits, "hang", f"no progress for {look - still_since:.1f} s; rank(s) "
                                    f"{sorted(culprits)} did not enter a collective their group's other members "
                                    f"wait in; collectives {counts}", last_seen=moved_at)
            if time.monotonic() < deadline:
                continue
            raise self._hang_failure({rank_of[i] for i in calls.indices(pending)}, timeout, moved_at)
        if transient:  # everyone arrived late but did arrive: a transient; re-form without blame
            lost = sorted(rank_of[i] for i, e in transient.items() if not isinstance(e, ray.exceptions.RayTaskError))
            if lost:  # unless a lost call's actor died meanwhile (a call lost with it): a crash of its rank
                crashed, _ = self._probe(fresh=True)
                if crashed:
                    raise self._failure(crashed, "crash", f"actor(s) died; rank(s) {lost}'s call lost")
            gave_up = sorted(rank_of[i] for i, e in transient.items() if isinstance(e, ray.exceptions.RayTaskError))
            raise WorkerFailure(set(), "exception", "; ".join(
                ([f"rank(s) {gave_up} timed out waiting for peers"] if gave_up else []) +
                ([f"rank(s) {lost} briefly unavailable (call lost)"] if lost else [])))
        return results

    def _silence_detail(self, silent: set[int]) -> str:
        """Each silent rank's node, the lifecycle state it last reported (`lifecycle.py`) and
        how long it has not answered."""
        workers = self._workers()

        def last_state(r: int) -> str:
            b = self.beats.beat(workers[r].handle)
            return (b.info if b is not None else {}).get("state", "never answered")
        return "; ".join(f"rank {r} ({workers[r].node_ip}, last {last_state(r)}) answered no ping for "
                         f"{self.beats.silence_s(workers[r].handle):.1f} s" for r in sorted(silent))

    def _progress(self, key: str = "progress") -> dict[int, int]:
        """rank -> progress counter (`progress`: monotonic; `step_progress`: within the current
        step) from each rank's last heartbeat answer; ranks that never answered are left out."""
        out = {}
        for r, s in enumerate(self._workers()):
            b = self.beats.beat(s.handle)
            if b is not None and key in b.info:
                out[r] = b.info[key]
        return out

    def _collectives(self) -> dict[int, dict[str, int]]:
        """rank -> collectives entered per process group (`comms.collective_counts`) from each
        rank's last heartbeat answer, for the ranks in the newest generation any rank reports
        (a rank still answering from an older one, or from none, is left out)."""
        infos = {r: b.info for r, s in enumerate(self._workers())
                 if (b := self.beats.beat(s.handle)) is not None and "collectives" in b.info}
        newest = max((i["generation"] for i in infos.values() if i.get("generation") is not None), default=None)
        return {r: i["collectives"] for r, i in infos.items() if i.get("generation") == newest}

    def work_done(self) -> dict[int, int]:
        """rank -> its `progress` plus its checkpoint I/O's (`io_progress`: bytes moved, and
        ticks while an I/O operation is within its own deadline; `checkpoint.IOProgress`), from
        its last answer (`work`); ranks that never answered are left out."""
        return {r: w for r, s in enumerate(self._workers())
                if (b := self.beats.beat(s.handle)) is not None and (w := work(b.info)) is not None}

    def _hang_failure(self, pending: set[int], timeout: float, moved_at: float) -> WorkerFailure:
        """Name the hung ranks of a call that made no progress since `moved_at` (wall clock).
        A rank that did not enter a collective the other members of its group wait in is hung
        (`hang_culprits`, from the heartbeats' fresh answers); its peers are not. With no such
        rank, every rank is aborted (freeing ranks blocked in a collective, as NCCL does) and
        the ranks whose abort fails or whose compute thread still does not answer are hung; the
        failure is then marked `aborted`, so recovery does not abort the survivors again. When
        that names nobody either (a stalled link), the hang is remembered; after
        `BLAMELESS_HANGS` of them, the ranks of the node they point at are replaced
        (`suspected_node`), with one warning line."""
        crashed, silent = self._probe()
        if crashed | silent:
            return self._failure(crashed | silent, "crash" if crashed else "unreachable",
                                 "actor(s) died" if crashed else self._silence_detail(silent))
        why = f"no progress for {timeout:.1f} s on rank(s) {sorted(pending)}"
        counts = self._collectives()
        culprits = hang_culprits(counts)
        if culprits:
            return WorkerFailure(culprits, "hang", f"{why}; rank(s) {sorted(culprits)} did not enter a "
                                 f"collective their group's other members wait in; collectives {counts}",
                                 last_seen=moved_at)
        workers = self._workers()
        unanswered = self.abort_survivors(set())
        refs = {r: s.handle.noop.remote() for r, s in enumerate(workers) if r not in unanswered}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.ft.health_timeout_s)
        ready = set(ready)
        stuck = unanswered | {r for r, ref in refs.items() if ref not in ready}
        if not stuck:
            hang: dict[str, int] = {}
            for r in pending:
                hang[workers[r].node_id] = hang.get(workers[r].node_id, 0) + 1
            self._blameless.append(hang)
            node = suspected_node(self._blameless)
            if node is not None:
                self._blameless = []
                stuck = {r for r, s in enumerate(workers) if s.node_id == node}
                ip = next(s.node_ip for s in workers if s.node_id == node)
                log.warning("excluding node %s (ranks %s): %d hangs with no hung rank pointed at it",
                            ip, sorted(stuck), BLAMELESS_HANGS)
                return WorkerFailure(stuck, "hang", f"{why}; node {ip} excluded after {BLAMELESS_HANGS} "
                                     "hangs with no hung rank", aborted=True, last_seen=moved_at)
        return WorkerFailure(stuck, "hang", f"{why}; compute thread still stuck after abort on {sorted(stuck)}",
                             aborted=True, last_seen=moved_at)

    def probe(self) -> set[int]:
        """Ranks whose actor is dead, whose node is lost, or that answered no ping for
        `fault_tolerance.health_timeout_s` seconds (`_probe`)."""
        crashed, silent = self._probe()
        return crashed | silent

    def _probe(self, fresh: bool = False) -> tuple[set[int], set[int]]:
        """(crashed, silent) ranks: an actor is judged alive once it answers a ping sent within
        the last `health_interval_s` (`fresh`: sent after this call, about one interval later),
        crashed when Ray says it died, silent once its heartbeats have been silent
        `health_timeout_s`; every rank at once, so this returns within about
        `health_timeout_s`. An actor that is temporarily unreachable (`ActorUnavailableError`,
        e.g. its node's agent restarting) is not judged until then.

        Lost nodes are found sooner: when a node's raylet refuses connections
        (`refuses_connections`), its process is gone, and with it every actor of that node
        (Ray's workers exit when their raylet dies; until then they may still answer pings).
        Every rank on that node is then crashed at once, without waiting. Why: otherwise the
        node's ranks are found one at a time (see docs/recovery.md, "Detect"). Caveat (not
        tested here): a firewall that rejects, rather than drops, connections from the driver's
        node to a raylet port would make that node look lost."""
        workers = self._workers()
        lost = self.lost_ranks()
        todo = [r for r in range(len(workers)) if r not in lost]
        since = time.monotonic() - (0.0 if fresh else self.ft.health_interval_s)
        _, dead, silent = self.beats.settle([workers[r].handle for r in todo], since)
        return lost | {todo[i] for i in dead}, {todo[i] for i in silent}

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
        `MegatronActor.abort`): they are failed too. Raises LeaseLost, killing nothing, when
        a rank refuses the abort as of a superseded driver (`StaleGenerationError`: it joined
        a later driver's generation). A rank whose actor is briefly unavailable
        (`ActorUnavailableError`: silent, not dead) is asked again every `health_interval_s`
        until `health_timeout_s` has passed."""
        workers = self._workers()
        deadline = time.monotonic() + self.ft.health_timeout_s
        todo, unanswered = [r for r in range(len(workers)) if r not in failed], set()
        while todo:
            refs = {r: workers[r].handle.abort.remote(self._generation()) for r in todo}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                                timeout=max(0.0, deadline - time.monotonic()))
            got = getters(ready)  # one get for all (a dict: no O(ranks^2) membership tests)
            todo = []
            for r, ref in refs.items():
                try:
                    if ref not in got:
                        raise TimeoutError
                    got[ref]()
                except ray.exceptions.ActorUnavailableError as e:
                    if time.monotonic() + self.ft.health_interval_s < deadline:
                        todo.append(r)
                        continue
                    log.warning("rank %d is replaced: unavailable for %.1f s %s", r,
                                self.ft.health_timeout_s, str(e)[-300:])
                    unanswered.add(r)
                except (TimeoutError, ray.exceptions.RayError) as e:
                    if isinstance(getattr(e, "cause", None), StaleGenerationError):  # joined a later driver's generation
                        raise LeaseLost(f"rank {r} serves another driver now ({e.cause}); this driver stops "
                                        f"and leaves the run to it") from None
                    why = ("its abort timed out" if isinstance(e, TimeoutError) else
                           "its actor died" if isinstance(e, ray.exceptions.RayActorError) else
                           "its abort failed")
                    log.warning("rank %d is replaced: %s %s", r, why, str(e)[-300:])
                    unanswered.add(r)
            if todo:
                time.sleep(self.ft.health_interval_s)
        return unanswered
