"""`NodeAgent`: one actor per node of the run that pings the rank actors of its node and
answers the driver's heartbeat round with one summary, so that the driver sends one call per
node per round, not one per actor (`health.Heartbeats`); and that carries the driver's calls
of a step to the ranks of its node, one call per node per step (`NodeCalls`, the driver's side).

The agent keeps one ping in flight per actor (a frozen actor does not collect a queue of
pings), waits for its pings a bounded time each round, and reports each answer with the
driver's time of the round that sent the ping, so that the driver's "answered a ping sent
after t" keeps its meaning across processes. It judges nothing: the driver does.

A step's calls: the driver sends each agent one `call` per step: the method, the dispatch, the
call's arguments cut once for all ranks (`dispatch.call_args`: scalars such as the step and
generation as they are, other values put once, a value cut per DP replica as only the parts
this node's ranks need), and the layout (dims, its ranks) only when it changed. The agent
derives each of its ranks' arguments itself with the dispatch's pure function
(`Dispatch.for_rank`, the same the driver's `dispatch_args` uses), calls its ranks and answers
with one summary: the results of the ranks whose results the caller reads
(`Dispatch.collects`: one per DP replica for `MeshDispatch`), every failed rank's error (its
actor's death, its call's exception, each as Ray raised it) and the ranks still out; at once
when one of them failed (`more` then brings the rest). The driver judges each failed rank's
outcome as if it had called the rank itself (`health.HealthMonitor.wait`); a rank that ended
well costs it nothing, so its work per step grows with the nodes, not the ranks.
"""
from __future__ import annotations

import time
from typing import Callable

import ray

from dispatch import Cut, Dispatch, call_args, get_dispatch_type
from health import CallLost, Calls, actor_key, ping_result
from parallel_dims import ParallelDims

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
        self._layout: tuple = (None, [])          # (dims, [(global rank, handle)] of this node's ranks)
        self._calls: dict[int, tuple] = {}        # call id -> ({ObjectRef of a rank's call: its rank}, ranks read)
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
    def call(self, call_id: int, message: tuple) -> dict:
        """Call `method` on the ranks of this node, each with its own arguments:
        `dispatch.for_rank(dims, rank, args, kwargs)`. `call_id`: increasing per driver call;
        `message`: (method, dispatch (a `Dispatch` class), args, kwargs, layout), one argument
        (Ray serializes each argument apart: one costs the driver ~20% less per agent than
        five); `args`, `kwargs`: the call's, cut once (`dispatch.call_args`); `layout`: (dims,
        [(global rank, handle)] of this node's ranks) from now on (None: the same as before).

        Returns the summary of the calls ended, once all ended or as soon as one failed
        (`more(call_id)` brings the rest): {"results": {rank: result} of the ended ranks whose
        result the dispatch collects (`Dispatch.collects`), "errors": {rank: the exception its
        `ray.get` raised}, "left": the ranks still out, sorted (None: unknown, the call was
        replaced before), "replaced": a newer call replaced this one (the driver gave it up)}.
        A rank that ended well and is not collected is in none of them."""
        method, dispatch, args, kwargs, layout = message
        if layout is not None:
            self._layout = layout
        dims, ranks = self._layout
        self._latest = call_id  # the driver gave up any older call (a new driver counts from 1)
        calls = {}
        for rank, handle in ranks:
            a, kw = dispatch.for_rank(dims, rank, args, kwargs)
            calls[getattr(handle, method).remote(*a, **kw)] = rank
        self._calls = {call_id: (calls, {r for r, _ in ranks if dispatch.collects(dims, r)})}
        return self._gather(call_id)

    @ray.method(concurrency_group=CALLS)
    def more(self, call_id: int) -> dict:
        """The calls of `call_id` still out when it (or the last `more`) answered, as `call`."""
        return self._gather(call_id)

    def _gather(self, call_id: int) -> dict:
        if call_id not in self._calls:  # a newer call replaced it
            return {"results": {}, "errors": {}, "left": None, "replaced": True}
        waiting, collected = self._calls[call_id]
        results, errors = {}, {}
        while waiting and call_id == self._latest and not errors:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=STALE_CHECK_S)
            if ready:  # and every other call that ended meanwhile
                ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
            for ref in ready:
                rank = waiting.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the rank's outcome, judged by the driver
                    errors[rank] = e
                    continue
                if rank in collected:
                    results[rank] = result
        if not waiting:
            self._calls.pop(call_id, None)
        return {"results": results, "errors": errors, "left": sorted(waiting.values()),
                "replaced": call_id != self._latest}


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
        """Only the ranks collected or failed (a `NodeAgent.call` summary): a rank that ended
        well and is not collected costs nothing here (its result stays None)."""
        if ref in self._index:
            return super().ended(ref)
        agent, indices = self._agents.pop(ref)
        try:
            summary = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the agent's failure; its ranks are judged apart
            self._on_agent_error(agent, e)
            lost = CallLost(f"node agent failed: {str(e)[:200]}")
            return [(i, _raiser(lost)) for i in indices], []
        out = [(i, (lambda v=v: v)) for i, v in summary["results"].items()]
        out += [(i, _raiser(e)) for i, e in summary["errors"].items()]
        left = summary["left"]
        if summary["replaced"]:  # at the agent, by a newer call (another driver's)
            lost = CallLost("node agent took a newer call")
            return out + [(i, _raiser(lost)) for i in (indices if left is None else left)], []
        if not left:
            return out, []
        more = agent.more.remote(self._call_id)
        self._agents[more] = (agent, set(left))
        return out, [more]

    def indices(self, waiting: list) -> set[int]:
        return {i for ref in waiting for i in ([self._index[ref]] if ref in self._index else self._agents[ref][1])}


def _put(value):
    """`value` in Ray's object store: its ObjectRef (an ObjectRef given is one already)."""
    return value if isinstance(value, ray.ObjectRef) else ray.put(value)


def _raiser(error: BaseException) -> Callable:
    def get():
        raise error
    return get


class NodeCalls:
    """The driver's side of `NodeAgent.call`: sends a call on many ranks as one call per node
    agent, with the call's arguments cut once (`dispatch.call_args`; of a value cut per DP
    replica, only the parts of the agent's ranks) and the agent's layout (dims, its ranks) only
    when it changed. The ranks' grouping by node is kept while the slots are the same objects
    (held here, so that no new slot can take a held one's id)."""

    def __init__(self, node_of: Callable, live_agent: Callable, on_agent_error: Callable):
        """`node_of(slot)`: a slot's node; `live_agent(node)`: that node's live agent, or None
        (then its ranks are called from here: `Heartbeats.live_agent`); `on_agent_error(agent,
        error)`: told when an agent's call failed."""
        self._node_of, self._live_agent, self._on_agent_error = node_of, live_agent, on_agent_error
        self._sent: dict[str, tuple] = {}         # agent key -> the (dims, roster) it was last sent
        self._layout: tuple = ([], (), {})         # (the slots, their ids, node -> its ranks: `_by_node`)
        self._keys: dict[tuple, set] = {}          # (node, dispatch, dims) -> the part keys of its ranks
        self._next = 0

    def _by_node(self, slots: list) -> dict[str, tuple[list, tuple, frozenset]]:
        """node -> ([(index, handle)] of its slots, its roster ((index, actor key) of each), their
        indices)."""
        ids = tuple(map(id, slots))
        if ids != self._layout[1]:
            ranks: dict[str, list] = {}
            for i, slot in enumerate(slots):
                ranks.setdefault(self._node_of(slot), []).append((i, slot.handle))
            by_node = {node: (r, tuple((i, actor_key(h)) for i, h in r), frozenset(i for i, _ in r))
                       for node, r in ranks.items()}
            self._layout, self._keys = (list(slots), ids, by_node), {}
        return self._layout[2]

    def start(self, slots: list, method: str, dims: ParallelDims, dispatch: str | type[Dispatch],
              args: tuple, kwargs: dict | None = None) -> AgentCalls:
        """Start `method` on every `slots[r]` (global rank r of `dims`) with the arguments
        `dispatch` gives rank r of `(args, kwargs)` (`Dispatch.for_rank`; each value but a
        scalar put into Ray's object store once, an ObjectRef passed as it is); returns the calls in flight, for
        `HealthMonitor.wait` (results by rank; of a rank not collected by the dispatch that
        ended well: None). Raises ValueError when len(slots) != dims.world_size or an argument
        cannot be cut (`Dispatch.cut`)."""
        if len(slots) != dims.world_size:
            raise ValueError(f"got {len(slots)} ranks for a group of {dims.world_size}")
        cls = get_dispatch_type(dispatch) if isinstance(dispatch, str) else dispatch
        args, kwargs = call_args(dims, cls, *args, put=_put, **(kwargs or {}))
        cut = any(isinstance(v, Cut) for v in (*args, *kwargs.values()))
        self._next += 1
        direct, refs = {}, {}
        for node, (ranks, roster, indices) in self._by_node(slots).items():
            agent = self._live_agent(node)
            if agent is None:
                for i, h in ranks:
                    a, kw = cls.for_rank(dims, i, args, kwargs)
                    direct[getattr(h, method).remote(*a, **kw)] = i
                continue
            akey = actor_key(agent)
            send = None if self._sent.get(akey) == (dims, roster) else (dims, ranks)
            self._sent[akey] = (dims, roster)
            a, kw = (args, kwargs) if not cut else self._only(node, cls, dims, indices, args, kwargs)
            refs[agent.call.remote(self._next, (method, cls, a, kw, send))] = (agent, indices)
        return AgentCalls(len(slots), direct, refs, self._next, self._agent_error)

    def _only(self, node: str, cls: type[Dispatch], dims: ParallelDims, indices: frozenset, args: tuple,
              kwargs: dict) -> tuple[tuple, dict]:
        """`args`, `kwargs` with each `Cut` holding only the parts of `node`'s ranks."""
        keys = self._keys.get((node, cls, dims))
        if keys is None:
            keys = self._keys[(node, cls, dims)] = {cls.part_key(dims, i) for i in indices}

        def mine(v):
            return v.only(keys) if isinstance(v, Cut) else v
        return tuple(map(mine, args)), {k: mine(v) for k, v in kwargs.items()}

    def _agent_error(self, agent, error: BaseException) -> None:
        self._sent.pop(actor_key(agent), None)  # resent with its next call
        self._on_agent_error(agent, error)
