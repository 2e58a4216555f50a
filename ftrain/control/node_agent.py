"""`NodeAgent`: one actor per node of the run that pings the rank actors of its node and
answers a heartbeat round with one summary, and that carries the calls of a step to the ranks
of its node; both through the fan-out tree of agents (`agent_tree`): an agent also forwards the
round or the call to its child agents and merges their answers into its own, so that the
driver sends at most `agent_tree.FANOUT` calls per round and per step (`health.Heartbeats`;
`NodeCalls`, the driver's side of a step's calls). With at most FANOUT nodes every agent is
called by the driver (the flat tree).

The agent keeps one ping in flight per actor (a frozen actor does not collect a queue of
pings), waits for its pings and its children's rounds a bounded time each round (a child gets
half of it), and reports each answer with the driver's time of the round that sent the ping,
so that the driver's "answered a ping sent after t" keeps its meaning across processes. It
judges nothing but its children's rounds: a child whose actor died is reported `dead`, one
whose round is late `late` (`agent_tree.Rounds`); the driver does the rest (the tree without
them).

A step's calls: each agent gets one `call` per step: the method, the dispatch, the call's
arguments cut once for all ranks (`dispatch.call_args`: scalars such as the step and generation
as they are, other values put once, a value cut per DP replica as only the parts its subtree's
ranks need), and its branch (dims, its ranks, its children's branches) only when it changed.
The agent derives each of its ranks' arguments itself with the dispatch's pure function
(`Dispatch.for_rank`, the same the driver's `dispatch_args` uses), calls its ranks, forwards
the call to its children (`agent_tree.Fanout`) and answers with one summary: the results of the
ranks whose results the caller reads (`Dispatch.collects`: one per DP replica for
`MeshDispatch`), every failed rank's error (its actor's death, its call's exception, each as Ray
raised it; `health.CallLost` for the ranks under a child agent whose call failed), the child
agents that failed, and the ranks still out; at once when one of them failed
(`more` then brings the rest). The driver judges each failed rank's outcome as if it had called
the rank itself (`health.HealthMonitor.wait`); a rank that ended well costs it nothing.
"""
from __future__ import annotations

import time
from typing import Callable

import ray

from ftrain.control.agent_tree import Fanout, Rounds, actor_key, branches, summary
from ftrain.control.health import CallLost, Calls, ping_result
from ftrain.control.ray_batch import BATCH_S, getters, raiser, returner
from ftrain.distributed.fanout import Dispatch, call_args
from ftrain.distributed.parallel_dims import ParallelDims

CALLS = "calls"
STALE_CHECK_S = 0.5
"""Seconds between an agent's checks, while it waits for its ranks' calls, that no newer call
has replaced them (the driver waits on one call at a time: a newer one means it gave this one
up, e.g. after a failure elsewhere), so a call abandoned on a stuck rank (or child agent) frees
its thread."""
DRIVER = "driver"  # the sender key of the driver's rounds and calls


@ray.remote(num_cpus=0, concurrency_groups={CALLS: 4})
class NodeAgent:
    """Pings the actors of its branch (those of its node) and forwards to its child agents
    each time `round` is called; calls its ranks and forwards to its children for the driver
    (`call`, `more`), in a concurrency group of its own, so that a step's call that waits does
    not hold the heartbeats. Keeps the branch each sender (the driver or a parent agent) last
    sent, for rounds and for calls apart."""

    def __init__(self, wait_s: float):
        """`wait_s`: seconds a round from the driver waits for its pings and its children's
        rounds before it answers (the rest are reported by a later round)."""
        self.wait_s = wait_s
        key = ray.get_runtime_context().get_actor_id()
        self._actors: dict[str, object] = {}
        self._in_flight: dict = {}   # ping ObjectRef -> (actor key, driver time of its round)
        self._rounds = Rounds(key)   # to the child agents
        self._branch = None          # the round branch in use
        self._branches: dict[str, object] = {}     # sender -> its round branch
        self._layouts: dict[str, tuple] = {}       # sender -> (dims, its call branch)
        self._fanout = Fanout(key)
        self._calls: dict[int, dict] = {}          # call id -> its state (`call`)
        self._latest = 0                           # the id of the newest call

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def round(self, message: tuple) -> dict:
        """One heartbeat round. `message`: (sent, sender, branch, wait_s, late_s), one argument
        (one costs the caller about a third less per call than five). `sent`: the driver's
        clock at the round; `sender`: who calls (`DRIVER` or the parent agent's key);
        `branch`: the `agent_tree.Branch` to follow from now on for that sender (None: the same
        as before); `wait_s`: None: this agent's; `late_s`: a child's round unanswered that long
        (driver time) is reported `late`. Pings every actor of the branch with no ping in
        flight, sends each child with no round in flight a round (waiting half of `wait_s`),
        waits up to `wait_s` for the pings and rounds in flight, and returns their summary
        (`agent_tree.summary`): each ping answered (actor key, answer, the driver time of the
        round that sent that ping) and each actor whose ping says it died (the error: see
        `health.ping_result`), merged with the children's; the child agents found dead or late."""
        sent, sender, branch, wait_s, late_s = message
        if branch is not None:
            self._branches[sender] = branch
        if (b := self._branches.get(sender)) is not None and b is not self._branch:
            self._branch = b
            self._actors = {actor_key(h): h for _, h in b.own}
            self._in_flight = {ref: v for ref, v in self._in_flight.items() if v[0] in self._actors}
            self._rounds.set(b.children)
        wait_s = self.wait_s if wait_s is None else wait_s
        pinging = {v[0] for v in self._in_flight.values()}
        for key, h in self._actors.items():
            if key not in pinging:
                self._in_flight[h.ping.remote()] = (key, sent)
        out = summary()
        waiting = [*self._in_flight, *self._rounds.send(sent, wait_s / 2, late_s)]
        end = time.monotonic() + wait_s
        # Batched: every answer that ends within a slice is taken in one wait.
        while waiting and (left := end - time.monotonic()) > 0:
            ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=min(left, BATCH_S))
            for ref, get in getters(ready).items():
                if ref in self._in_flight:
                    key, at = self._in_flight.pop(ref)
                    info, died = ping_result(get, key)
                    if info is not None:
                        out["keys"].append(key)
                        out["infos"].append(info)
                        out["ats"].append(at)
                    elif died:
                        out["died"][key] = died
                else:
                    self._rounds.ended(ref, out, get)
        out["late"].update(self._rounds.late(sent, late_s))
        return out

    @ray.method(concurrency_group=CALLS)
    def call(self, message: tuple) -> dict:
        """Call `method` on the ranks of this node, each with its own arguments
        (`dispatch.for_rank(dims, rank, args, kwargs)`), and forward it to the child agents.
        `message`: (call_id, sender, method, dispatch (a `Dispatch` class), args, kwargs,
        layout), one argument (Ray serializes each argument apart: one costs the caller ~20%
        less per agent than several); `call_id`: increasing per driver call; `args`, `kwargs`: the
        call's, cut once (`dispatch.call_args`); `layout`: (dims, `agent_tree.Branch` of this
        agent: its ranks (global rank, handle), its children's branches) from now on for that
        sender (None: the same as before).

        Returns the summary of the calls ended, its children's merged in, once all ended or as
        soon as one failed (`more(call_id)` brings the rest): {"results": {rank: result} of the
        ended ranks whose result the dispatch collects (`Dispatch.collects`), "errors": {rank:
        the exception its `ray.get` raised, or `CallLost` for a rank under a child agent whose
        call failed}, "failed_agents": [(child agent handle, the
        error its call raised)], "left": the ranks still out, sorted (None: unknown, the call
        was replaced before), "replaced": a newer call replaced this one (the driver gave it
        up)}. A rank that ended well and is not collected is in none of them."""
        call_id, sender, method, cls, args, kwargs, layout = message
        if layout is not None:
            self._layouts[sender] = layout
        dims, branch = self._layouts[sender]
        self._latest = call_id  # the driver gave up any older call (a new driver counts from 1)
        failed: list = []

        def child_failed(agent, error):
            self._fanout.forget(actor_key(agent))
            failed.append((agent, error))
        # The children first: their subtrees' calls are the longer way (a step's wall time).
        children = self._fanout.send(call_id, method, cls, dims, args, kwargs, branch.children)
        direct = {}
        for rank, handle in branch.own:
            a, kw = cls.for_rank(dims, rank, args, kwargs)
            direct[getattr(handle, method).remote(*a, **kw)] = rank
        calls = AgentCalls(0, direct, children, call_id, child_failed)
        own = set(direct.values())
        unread = {r for r in own if not cls.collects(dims, r)}  # the children's summaries hold collected ranks only
        self._calls = {call_id: {"calls": calls, "pending": calls.waitables(), "unread": unread, "failed": failed}}
        return self._gather(call_id)

    @ray.method(concurrency_group=CALLS)
    def more(self, call_id: int) -> dict:
        """The calls of `call_id` still out when it (or the last `more`) answered, as `call`."""
        return self._gather(call_id)

    def _gather(self, call_id: int) -> dict:
        state = self._calls.get(call_id)
        if state is None:  # a newer call replaced it
            return {"results": {}, "errors": {}, "failed_agents": [], "left": None, "replaced": True}
        calls, pending = state["calls"], state["pending"]
        results, errors = {}, {}
        while pending and call_id == self._latest and not errors:
            ready, _ = ray.wait(pending, num_returns=1, timeout=STALE_CHECK_S)
            if ready:  # and every other call that ended meanwhile
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ended, more = calls.ended_all(ready)
            pending += more
            for rank, get in ended:
                try:
                    result = get()
                except Exception as e:  # noqa: BLE001 - the rank's outcome, judged by the driver
                    errors[rank] = e
                    continue
                if rank not in state["unread"]:
                    results[rank] = result
        state["pending"] = pending
        if not pending:
            self._calls.pop(call_id, None)
        failed, state["failed"][:] = list(state["failed"]), []
        return {"results": results, "errors": errors, "failed_agents": failed,
                "left": sorted(calls.indices(pending)), "replaced": call_id != self._latest}


class AgentCalls(Calls):
    """A call on many ranks in flight as one `NodeAgent.call` per agent called (the roots for
    the driver, the children for an agent) and one ObjectRef per rank called directly (of a
    node with no agent in the tree; an agent's own ranks), for `health.HealthMonitor.wait` and
    `NodeAgent._gather`."""

    def __init__(self, size: int, direct: dict, agents: dict, call_id: int, on_agent_error: Callable):
        """`direct`: ObjectRef -> call index; `agents`: ObjectRef of a `NodeAgent.call` ->
        (agent, the call indices of its subtree, the agent keys of its subtree); `on_agent_error(agent, error)`: told when an
        agent's call failed (its calls are then lost: `CallLost`), and of each failed agent an
        answer names."""
        super().__init__([])
        self.size, self._index, self._agents = size, direct, agents
        self._call_id, self._on_agent_error = call_id, on_agent_error

    def waitables(self) -> list:
        return [*self._index, *self._agents]

    def ended(self, ref, get: Callable) -> tuple[list[tuple[int, Callable]], list]:
        """Only the ranks collected or failed (a `NodeAgent.call` summary): a rank that ended
        well and is not collected costs nothing here (its result stays None)."""
        if ref in self._index:
            return super().ended(ref, get)
        ok, out, more = self._summary(ref, get)
        return [(i, returner(v)) for i, v in ok.items()] + out, more

    def taken(self, refs: list) -> tuple[dict, list[tuple[int, Callable]], list]:
        """As `ended_all`, the results of the agents' summaries apart (`health.Calls.taken`):
        no function per result."""
        ok, out, more = {}, [], []
        for ref, get in getters(refs).items():
            if ref in self._index:
                o, m = super().ended(ref, get)
                out += o
            else:
                r, o, m = self._summary(ref, get)
                ok.update(r)
                out += o
            more += m
        return ok, out, more

    def _summary(self, ref, get: Callable) -> tuple[dict, list[tuple[int, Callable]], list]:
        """The ended `NodeAgent.call` (or `more`) `ref` (`get`: its outcome): (call index ->
        result of the ranks that ended well and are collected, [(call index, a function raising
        its error)] of the failed or lost ones, [the `more` call in its place] while ranks are
        still out)."""
        agent, indices, keys = self._agents.pop(ref)
        try:
            summary = get()
        except Exception as e:  # noqa: BLE001 - the agent's failure; its ranks are judged apart
            self._on_agent_error(agent, e)
            return {}, _lost(indices, f"node agent failed: {str(e)[:200]}"), []
        for child, error in summary["failed_agents"]:
            self._on_agent_error(child, error)
        out = [(i, raiser(e)) for i, e in summary["errors"].items()]
        left = summary["left"]
        if summary["replaced"]:  # at the agent, by a newer call (another driver's)
            return summary["results"], out + _lost(indices if left is None else left, "node agent took a newer call"), []
        if not left:
            return summary["results"], out, []
        more = agent.more.remote(self._call_id)
        self._agents[more] = (agent, set(left), keys)
        return summary["results"], out, [more]

    def cut_off(self, gone: set[str]) -> tuple[list[tuple[int, Callable]], set]:
        """The calls of each agent called whose subtree holds an agent of `gone` (keys) are lost
        (`CallLost`): that agent's answer may never come."""
        out, dropped = [], set()
        for ref, (agent, indices, keys) in list(self._agents.items()) if gone else []:
            if lost := keys & gone:
                del self._agents[ref]
                dropped.add(ref)
                out += _lost(indices, f"node agent {min(lost)[:12]} died or answers no round")
        return out, dropped

    def indices(self, waiting: list) -> set[int]:
        return {i for ref in waiting for i in ([self._index[ref]] if ref in self._index else self._agents[ref][1])}


def _put(value):
    """`value` in Ray's object store: its ObjectRef (an ObjectRef given is one already)."""
    return value if isinstance(value, ray.ObjectRef) else ray.put(value)


def _lost(indices, why: str) -> list[tuple[int, Callable]]:
    lost = CallLost(why)
    return [(i, raiser(lost)) for i in indices]


class NodeCalls:
    """The driver's side of `NodeAgent.call`: sends a call on many ranks as one call per root
    of the agents' tree (`agent_tree.Fanout`), with the call's arguments cut once
    (`dispatch.call_args`) and each root's branch only when it changed; the ranks of a node
    with no agent in the tree are called from here. The plan (branches, ranks called directly)
    is kept while the slots are the same objects (held here, so that no new slot can take a
    held one's id) and the tree is the same."""

    def __init__(self, node_of: Callable, tree: Callable, on_agent_error: Callable):
        """`node_of(slot)`: a slot's node; `tree()`: the agents' tree for calls now, the same object
        while unchanged (`health.Heartbeats.call_tree`: (shape, node -> agent)); `on_agent_error(agent,
        error)`: told when an agent's call failed."""
        self._node_of, self._tree, self._on_agent_error = node_of, tree, on_agent_error
        self._fanout = Fanout(DRIVER)
        self._plan: tuple = ((), None, [], [], [])   # (slot ids, tree, the slots, root branches, [(index, handle)] direct)
        self._next = 0

    def _plan_of(self, slots: list) -> tuple[list, list]:
        """(the roots' branches, [(index, handle)] of the ranks called from here)."""
        ids, tree = tuple(map(id, slots)), self._tree()
        if ids != self._plan[0] or tree is not self._plan[1]:
            by_node: dict = {}
            for i, slot in enumerate(slots):
                by_node.setdefault(self._node_of(slot), []).append((i, slot.handle))
            shape, agents = tree
            direct = [r for node, ranks in by_node.items() if node not in agents for r in ranks]
            self._plan = (ids, tree, list(slots), branches(shape, agents, by_node), direct)
        return self._plan[3], self._plan[4]

    def start(self, slots: list, method: str, dims: ParallelDims, dispatch: type[Dispatch],
              args: tuple, kwargs: dict | None = None) -> AgentCalls:
        """Start `method` on every `slots[r]` (global rank r of `dims`) with the arguments
        `dispatch` gives rank r of `(args, kwargs)` (`Dispatch.for_rank`; each value but a
        scalar put into Ray's object store once, an ObjectRef passed as it is); returns the
        calls in flight, for `HealthMonitor.wait` (results by rank; of a rank not collected by
        the dispatch that ended well: None). Raises ValueError when len(slots) !=
        dims.world_size or an argument cannot be cut (`Dispatch.cut`)."""
        if len(slots) != dims.world_size:
            raise ValueError(f"got {len(slots)} ranks for a group of {dims.world_size}")
        args, kwargs = call_args(dims, dispatch, *args, put=_put, **(kwargs or {}))
        roots, direct = self._plan_of(slots)
        self._next += 1
        refs = {}
        for i, h in direct:
            a, kw = dispatch.for_rank(dims, i, args, kwargs)
            refs[getattr(h, method).remote(*a, **kw)] = i
        return AgentCalls(len(slots), refs, self._fanout.send(self._next, method, dispatch, dims, args, kwargs, roots),
                          self._next, self._agent_error)

    def _agent_error(self, agent, error: BaseException) -> None:
        self._fanout.forget(actor_key(agent))  # its branch goes with its next call
        self._on_agent_error(agent, error)
