"""`NodeAgent`: one actor per node of the run that pings the rank actors of its node and
answers the driver's heartbeat round with one summary, so that the driver sends one call per
node per round, not one per actor (`health.Heartbeats`); and that carries the driver's calls
of a step to the ranks of its node, one call per node per step (`NodeCalls`, the driver's side).

The agent keeps one ping in flight per actor (a frozen actor does not collect a queue of
pings), waits for its pings a bounded time each round, and reports each answer with the
driver's time of the round that sent the ping, so that the driver's "answered a ping sent
after t" keeps its meaning across processes. It judges nothing: the driver does.

A step's calls: the driver sends each agent one `call` with its ranks' arguments (ObjectRefs
put once by the driver pass through unresolved, so each rank fetches the batch itself); the
agent calls its ranks and answers with every rank's result or error (an actor's death, its
call's exception, each as Ray raised it), or, as soon as one of them failed, with those ended
so far; `more` then brings the rest. The driver judges each rank's outcome as if it had called
the rank itself (`health.HealthMonitor.wait`).
"""
from __future__ import annotations

import time
from typing import Callable

import ray

from health import CallLost, Calls, actor_key, ping_result

CALLS = "calls"
STALE_CHECK_S = 0.5
"""Seconds between an agent's checks, while it waits for its ranks' calls, that no newer call
has replaced them (the driver waits on one call at a time: a newer one means it gave this one
up, e.g. after a failure elsewhere), so a call abandoned on a stuck rank frees its thread."""


@ray.remote(num_cpus=0, concurrency_groups={CALLS: 4})
class NodeAgent:
    """Pings the actors it is given (those of its node) each time `round` is called; calls
    them for the driver (`call`, `more`), in a concurrency group of its own, so that a step's
    call that waits does not hold the heartbeats."""

    def __init__(self, wait_s: float):
        """`wait_s`: seconds a round waits for its pings before it answers (the rest are
        reported by a later round)."""
        self.wait_s = wait_s
        self._actors: dict[str, object] = {}
        self._in_flight: dict = {}   # ping ObjectRef -> (actor key, driver time of its round)
        self._callees: dict[str, object] = {}     # actor key -> handle, of the actors `call` reaches
        self._calls: dict[int, dict] = {}         # call id -> {ObjectRef of a rank's call: its index}
        self._latest = 0                           # the id of the newest call

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def round(self, sent: float, actors: list | None = None) -> dict[str, tuple]:
        """One heartbeat round. `sent`: the driver's clock at this call; `actors`: the handles
        to watch from now on (None: the same as before). Pings every watched actor with no ping
        in flight, waits up to `wait_s` for the pings in flight, and returns, per actor key
        whose ping ended: (answer or None, "" or the error that says its actor died, the
        driver time of the round that sent that ping); see `health.ping_result`."""
        if actors is not None:
            self._actors = {actor_key(h): h for h in actors}
            self._in_flight = {ref: v for ref, v in self._in_flight.items() if v[0] in self._actors}
        pinging = {v[0] for v in self._in_flight.values()}
        for key, h in self._actors.items():
            if key not in pinging:
                self._in_flight[h.ping.remote()] = (key, sent)
        out: dict[str, tuple] = {}
        end = time.monotonic() + self.wait_s
        waiting = list(self._in_flight)
        # Batched: every ping that ends within a slice is taken in one wait.
        while waiting and (left := end - time.monotonic()) > 0:
            ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=min(left, 0.05))
            for ref in ready:
                key, at = self._in_flight.pop(ref)
                out[key] = (*ping_result(ref, key), at)
        return out

    @ray.method(concurrency_group=CALLS)
    def call(self, call_id: int, method: str, calls: list[tuple[int, str, tuple, dict]],
             actors: list | None = None) -> dict[int, tuple[bool, object]]:
        """Call `method` on the ranks of this node. `call_id`: increasing per driver call;
        `calls`: (index, actor key, args, kwargs) per rank; `actors`: the handles to reach
        from now on (None: the same as before). Returns {index: (True, result) or (False, the
        exception its `ray.get` raised)} for every call once all ended, or for those ended
        when the first one failed (`more(call_id)` brings the rest)."""
        if actors is not None:
            self._callees = {actor_key(h): h for h in actors}
        self._latest = call_id  # the driver gave up any older call (a new driver counts from 1)
        self._calls = {call_id: {getattr(self._callees[key], method).remote(*args, **kwargs): i
                                for i, key, args, kwargs in calls}}
        return self._gather(call_id)

    @ray.method(concurrency_group=CALLS)
    def more(self, call_id: int) -> dict[int, tuple[bool, object]]:
        """The calls of `call_id` still out when it (or the last `more`) answered, as `call`;
        {} once a newer call replaced it."""
        return self._gather(call_id)

    def _gather(self, call_id: int) -> dict[int, tuple[bool, object]]:
        waiting = self._calls.get(call_id, {})
        out: dict[int, tuple[bool, object]] = {}
        while waiting and call_id == self._latest and all(ok for ok, _ in out.values()):
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=STALE_CHECK_S)
            if ready:  # and every other call that ended meanwhile
                ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
            for ref in ready:
                i = waiting.pop(ref)
                try:
                    out[i] = (True, ray.get(ref))
                except Exception as e:  # noqa: BLE001 - the rank's outcome, judged by the driver
                    out[i] = (False, e)
        if not waiting:
            self._calls.pop(call_id, None)
        return out


class AgentCalls(Calls):
    """A driver call on many ranks in flight as one `NodeAgent.call` per node (and one
    ObjectRef per rank whose node has no live agent), for `health.HealthMonitor.wait`."""

    def __init__(self, size: int, direct: dict, agents: dict, call_id: int, on_agent_error: Callable):
        """`direct`: ObjectRef -> call index; `agents`: ObjectRef of a `NodeAgent.call` ->
        (agent, the call indices it carries); `on_agent_error(agent, error)`: told when an
        agent's call failed (its calls are then lost: `CallLost`)."""
        super().__init__([])
        self.size, self._index, self._agents = size, direct, agents
        self._call_id, self._on_agent_error = call_id, on_agent_error

    def waitables(self) -> list:
        return [*self._index, *self._agents]

    def ended(self, ref) -> tuple[list[tuple[int, Callable]], list]:
        if ref in self._index:
            return super().ended(ref)
        agent, indices = self._agents.pop(ref)
        try:
            summary = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the agent's failure; its ranks are judged apart
            self._on_agent_error(agent, e)
            lost = CallLost(f"node agent failed: {str(e)[:200]}")
            return [(i, _raiser(lost)) for i in indices], []
        out = [(i, (lambda v=v: v) if ok else _raiser(v)) for i, (ok, v) in summary.items()]
        rest = indices - summary.keys()
        if not summary:  # a newer call replaced this one at the agent (another driver's)
            lost = CallLost("node agent took a newer call")
            return [(i, _raiser(lost)) for i in rest], []
        if not rest:
            return out, []
        more = agent.more.remote(self._call_id)
        self._agents[more] = (agent, rest)
        return out, [more]

    def indices(self, waiting: list) -> set[int]:
        return {i for ref in waiting for i in ([self._index[ref]] if ref in self._index else self._agents[ref][1])}


def _raiser(error: BaseException) -> Callable:
    def get():
        raise error
    return get


class NodeCalls:
    """The driver's side of `NodeAgent.call`: sends a call on many ranks as one call per node
    agent, each agent's roster (the handles it reaches) sent only when it changed. The ranks'
    grouping by node is kept while the slots are the same objects (held here, so that no new
    slot can take a held one's id)."""

    def __init__(self, node_of: Callable, live_agent: Callable, on_agent_error: Callable):
        """`node_of(slot)`: a slot's node; `live_agent(node)`: that node's live agent, or None
        (then its ranks are called from here: `Heartbeats.live_agent`); `on_agent_error(agent,
        error)`: told when an agent's call failed."""
        self._node_of, self._live_agent, self._on_agent_error = node_of, live_agent, on_agent_error
        self._rosters: dict[str, frozenset] = {}   # agent key -> the actor keys it was last sent
        self._layout: tuple = ([], (), {})         # (the slots, their ids, node -> its ranks: `_by_node`)
        self._next = 0

    def _by_node(self, slots: list) -> dict[str, tuple[list, frozenset, frozenset]]:
        """node -> ([(index, actor key, handle)] of its slots, their actor keys, their indices)."""
        ids = tuple(map(id, slots))
        if ids != self._layout[1]:
            ranks: dict[str, list] = {}
            for i, slot in enumerate(slots):
                ranks.setdefault(self._node_of(slot), []).append((i, actor_key(slot.handle), slot.handle))
            by_node = {node: (r, frozenset(k for _, k, _ in r), frozenset(i for i, _, _ in r))
                       for node, r in ranks.items()}
            self._layout = (list(slots), ids, by_node)
        return self._layout[2]

    def start(self, slots: list, method: str, per_rank: list[tuple[tuple, dict]]) -> AgentCalls:
        """Start `method(*args, **kwargs)` of `per_rank[i]` on `slots[i]`; returns the calls in
        flight, for `HealthMonitor.wait` (results by index i)."""
        self._next += 1
        direct, refs = {}, {}
        for node, (ranks, roster, indices) in self._by_node(slots).items():
            agent = self._live_agent(node)
            if agent is None:
                direct.update({getattr(h, method).remote(*per_rank[i][0], **per_rank[i][1]): i for i, _, h in ranks})
                continue
            akey = actor_key(agent)
            send = None if self._rosters.get(akey) == roster else [h for _, _, h in ranks]
            self._rosters[akey] = roster
            calls = [(i, key, *per_rank[i]) for i, key, _ in ranks]
            refs[agent.call.remote(self._next, method, calls, send)] = (agent, indices)
        return AgentCalls(len(slots), direct, refs, self._next, self._agent_error)

    def _agent_error(self, agent, error: BaseException) -> None:
        self._rosters.pop(actor_key(agent), None)  # resent with its next call
        self._on_agent_error(agent, error)
