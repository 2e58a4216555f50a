"""The fan-out tree of node agents: the driver calls at most `FANOUT` agents (the roots), each
agent forwards a heartbeat round or a step's call to at most `FANOUT` child agents and merges
their answers into its own, so that the driver's work per round and per step is O(FANOUT) calls
plus what it must read (the failures, and the results `collect` needs), whatever the nodes.

The shape is a pure function of the node list (`shape`): the first `FANOUT` nodes are the
roots and node i's children are nodes FANOUT*(i+1) .. FANOUT*(i+1)+FANOUT-1 (a heap of
arity `FANOUT` under the driver), so every node is in it once, a parent comes before its
children and the depth is at most ceil(log_FANOUT(nodes)); with at most `FANOUT` nodes every
node is a root (the flat tree: the driver calls every agent, as without the tree). An agent
that died or stalls is taken out by `without`: its children move up to its parent, nothing
else moves (a repair, not a new shape: no other agent's branch changes).

What a parent sends a child is its `Branch`: the child's own members (its node's ranks or
actors) and its children's branches, only when it changed since this parent last sent it (each
agent keeps the branch of each sender apart, so a re-parented agent never mistakes another
parent's branch for its own). `Rounds` is a parent's side of the heartbeat rounds (the driver's
for the roots, an agent's for its children): one round in flight per child, the children's
summaries merged, a child whose round raised that its actor died reported `dead`, one whose
round is late by more than `late_s` (driver clock) reported `late`. The driver takes a dead or
late agent out of the tree (`without`, `health.Heartbeats.tree`): its own node's ranks are pinged
and called from the driver, its children move up to its parent, so a dead or silent agent never
hides its subtree. A parent still merges the answer of a round in flight to a child that moved
away. A call carried by a dead agent is lost (`health.CallLost`: its parent reports it at
once; the ranks are judged by their heartbeats), and so is a call whose path holds an agent
left out of the tree for lateness that has answered no probe for `health_timeout_s` (the driver
gives up that root's call). `Fanout` forwards one call to each branch's agent with the call's
arguments cut to the parts of that branch's ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import ray

from ftrain.distributed.fanout import Cut, Dispatch
from ftrain.distributed.parallel_dims import ParallelDims

FANOUT = 4
"""Agents a parent (the driver or an agent) calls at most: the driver's calls per round and per
step. At most this many nodes: the flat tree (every agent called by the driver). Small on
purpose: each call a parent sends costs its calling thread about the same CPU (serialising,
submitting), and the driver's is the one thread every step waits on; a tree's latency grows as
fanout x log_fanout(nodes) calls in sequence, least near 3, so 4 costs little time per level
(1,024 nodes: 5 levels) and keeps the driver's calls per step fixed at 4 (`bench.control_plane`
`--fanout` measures other arities)."""


def actor_key(handle) -> str:
    """A stable key of an actor handle (its actor id), computed once per handle object (kept
    on it, as Ray keeps its hash: the driver asks for the keys of its agents and ranks every
    round and every step)."""
    d = getattr(handle, "__dict__", None)
    if d is not None and (key := d.get("_ft_actor_key")) is not None:
        return key
    key = handle._actor_id.hex()
    if d is not None:
        d["_ft_actor_key"] = key
    return key


def shape(nodes: Sequence[Hashable], fanout: int = FANOUT) -> dict:
    """The tree over `nodes` (distinct, in the caller's order): parent -> its children in order,
    None standing for the driver (its children are the roots); a node without children has no
    entry. Position i's children are positions fanout*(i+1) .. fanout*(i+1)+fanout-1. Raises
    ValueError when `fanout` < 2."""
    if fanout < 2:
        raise ValueError(f"fanout must be at least 2, got {fanout}")
    nodes = list(nodes)
    out = {None: nodes[:fanout]}
    for i, node in enumerate(nodes[:max(0, -(-len(nodes) // fanout) - 1)]):
        if kids := nodes[fanout * (i + 1):fanout * (i + 2)]:
            out[node] = kids
    return out


def without(tree: dict, gone: set) -> dict:
    """`tree` without the nodes of `gone`: each one's children (or, where gone too, theirs) take
    its place in its parent's list, so that only a gone node's parent and children change (a
    parent may then hold more than `fanout`; a gone root's children are called by the driver)."""
    def kids(node) -> list:
        return [k for c in tree.get(node, []) for k in (kids(c) if c in gone else [c])]
    out = {}
    for node in tree:
        if node not in gone and (k := kids(node)):
            out[node] = k
    return out


def depth(tree: dict) -> int:
    """Levels of agents under the driver (0: no node; 1: the flat tree)."""
    def down(node) -> int:
        return 1 + max((down(c) for c in tree.get(node, [])), default=0)
    return down(None) - 1


def depth_bound(nodes: int, fanout: int = FANOUT) -> int:
    """The most levels `shape` gives `nodes` nodes: ceil(log_fanout(nodes)), at least 1."""
    return 0 if nodes == 0 else max(1, math.ceil(math.log(nodes, fanout) - 1e-9))


@dataclass(frozen=True, eq=False)
class Branch:
    """A node agent and what it does in one tree: its own members (`own`: (member, actor handle)
    of its node; a member is a rank for calls, an actor key for heartbeats) and its children's
    branches. `ident`: what it is without handles (agent key, (member, actor key) of each of its
    own, its children's idents), to tell a changed branch; `members`, `agents`: the members and
    the agent keys of the whole subtree."""
    agent: object
    key: str
    own: tuple
    children: tuple
    ident: tuple = field(repr=False)
    members: frozenset = field(repr=False)
    agents: frozenset = field(repr=False)


def branches(tree: dict, agents: dict, own: dict) -> list[Branch]:
    """The roots' branches of `tree` (`shape`): `agents`: node -> its agent's handle; `own`: node
    -> [(member, actor handle)] of that node. A subtree with no member anywhere is left out."""
    def build(node) -> Branch | None:
        kids = tuple(b for c in tree.get(node, []) if (b := build(c)) is not None)
        mine = tuple(own.get(node, ()))
        if not mine and not kids:
            return None
        agent = agents[node]
        key = actor_key(agent)
        ident = (key, tuple((m, actor_key(h)) for m, h in mine), tuple(k.ident for k in kids))
        members = frozenset(m for m, _ in mine).union(*(k.members for k in kids))
        return Branch(agent, key, mine, kids, ident, members, frozenset([key]).union(*(k.agents for k in kids)))
    return [b for root in tree.get(None, []) if (b := build(root)) is not None]


def summary() -> dict:
    """An empty heartbeat summary: the answered pings as columns (`keys`: actor keys, `infos`:
    each one's answer, `ats`: the driver time of the round that sent that ping), `died` (actor
    key -> the error that says its actor died: `health.ping_result`), `dead` (agent key -> the
    error that says it died), `late` (agent key -> the driver time of its round still
    unanswered). Columns of plain values, not an entry per actor: Ray encodes and decodes
    them as they are (msgpack), with no pickled object per answer, and the driver reads one
    round's answers of every rank in one pass (`health.Heartbeats._record_round`). A ping with
    no answer this time is in none of them."""
    return {"keys": [], "infos": [], "ats": [], "died": {}, "dead": {}, "late": {}}


def merge(into: dict, other: dict) -> None:
    """Add the heartbeat summary `other` to `into` (answers in order: of an actor answered twice,
    the reader keeps the one of the latest round)."""
    for k in ("keys", "infos", "ats"):
        into[k] += other[k]
    for k in ("died", "dead", "late"):
        into[k].update(other[k])


class Rounds:
    """A parent's heartbeat rounds to its child agents (the driver's to the roots, an agent's to
    its children): one round in flight per child, sent with its branch when that changed."""

    def __init__(self, sender: str):
        """`sender`: this parent's key, sent with each round (each agent keeps each sender's branch)."""
        self.sender = sender
        self._state: dict[str, list] = {}   # agent key -> [branch, ref in flight or None, sent, branch to send]
        self._refs: dict = {}               # ref -> agent key
        self._dead: set[str] = set()

    def set(self, children: Sequence[Branch]) -> None:
        """The children from now on. A round in flight to a child no longer here is still
        waited for, and its answer merged (the latest one per child: a re-parented child's
        answers are not lost)."""
        new = {b.key: b for b in children if b.key not in self._dead}
        for k in set(self._state) - set(new):
            if (ref := self._state.pop(k)[1]) is not None:
                self._refs = {r: key for r, key in self._refs.items() if key != k or r == ref}
        for k, b in new.items():
            st = self._state.setdefault(k, [b, None, 0.0, True])
            if st[0].ident != b.ident:
                st[0], st[3] = b, True

    def send(self, sent: float, wait_s: float | None, late_s: float) -> list:
        """A round (`NodeAgent.round`) to each child with none in flight, at driver time `sent`;
        returns every round in flight."""
        for k, st in self._state.items():
            if st[1] is None:
                st[1] = st[0].agent.round.remote((sent, self.sender, st[0] if st[3] else None, wait_s, late_s))
                st[2], st[3] = sent, False
                self._refs[st[1]] = k
        return list(self._refs)

    def ended(self, ref, into: dict, get: Callable) -> bool:
        """Merge the answer of `ref` (`get` returns it or raises its error: `ray_batch.getters`)
        into the summary `into`; False when `ref` is no round of a child here. A child whose
        actor died is reported `dead` and asked nothing more; one whose round raised otherwise
        gets its branch with its next round."""
        k = self._refs.pop(ref, None)
        if k is None:
            return False
        st = self._state.get(k)
        if st is None or st[1] is not ref:  # of a child no longer here (or of an older round)
            try:
                merge(into, get())
            except Exception:  # noqa: BLE001 - that child's parent now judges it
                pass
            return True
        st[1] = None
        try:
            merge(into, get())
        except ray.exceptions.ActorUnavailableError:
            st[3] = True
        except ray.exceptions.RayActorError as e:
            into["dead"][k] = str(e)[:200]
            self._dead.add(k)
            del self._state[k]
        except Exception:  # noqa: BLE001 - answered nothing this time: the branch goes again
            st[3] = True
        return True

    def late(self, sent: float, late_s: float) -> dict[str, float]:
        """Children whose round in flight was sent more than `late_s` before driver time `sent`:
        agent key -> when it was sent."""
        return {k: st[2] for k, st in self._state.items() if st[1] is not None and sent - st[2] > late_s}


class Fanout:
    """Sends a call to the agents of branches (`NodeAgent.call`): the driver's to the roots, an
    agent's to its children; each with its branch only when it changed since this sender last
    sent it, and with each `Cut` argument holding only the parts of that branch's ranks."""

    def __init__(self, sender: str):
        self.sender = sender
        self._sent: dict[str, tuple] = {}      # agent key -> (dims, ident) last sent
        self._keys: dict[tuple, set] = {}      # (ident, dispatch, dims) -> part keys of the branch's ranks

    def send(self, call_id: int, method: str, cls: type[Dispatch], dims: ParallelDims, args: tuple, kwargs: dict,
             children: Sequence[Branch]) -> dict:
        """One call per branch; returns ObjectRef -> (agent, its branch's ranks, its branch's agent keys)."""
        cut = any(isinstance(v, Cut) for v in (*args, *kwargs.values()))
        refs = {}
        for b in children:
            layout = None if self._sent.get(b.key) == (dims, b.ident) else (dims, b)
            self._sent[b.key] = (dims, b.ident)
            a, kw = (args, kwargs) if not cut else self._only(b, cls, dims, args, kwargs)
            refs[b.agent.call.remote((call_id, self.sender, method, cls, a, kw, layout))] = (b.agent, b.members, b.agents)
        return refs

    def _only(self, b: Branch, cls: type[Dispatch], dims: ParallelDims, args: tuple, kwargs: dict):
        keys = self._keys.get((b.ident, cls, dims))
        if keys is None:
            if len(self._keys) > 4 * FANOUT:  # layouts change rarely: old ones go at once
                self._keys.clear()
            keys = self._keys[(b.ident, cls, dims)] = {cls.part_key(dims, r) for r in b.members}

        def mine(v):
            return v.only(keys) if isinstance(v, Cut) else v
        return tuple(map(mine, args)), {k: mine(v) for k, v in kwargs.items()}

    def forget(self, key: str) -> None:
        """The agent `key`'s call failed: its branch goes with its next call."""
        self._sent.pop(key, None)
