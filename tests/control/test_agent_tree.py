"""The node agents' fan-out tree (`agent_tree`): its shape as a pure function of the node list
(every node once, parent before child, depth bound, flat up to FANOUT nodes), and, with real
Ray actors on seven logical nodes and FANOUT 2 (three levels: roots n0, n1; n0 -> n2, n3;
n1 -> n4, n5; n2 -> n6), a step's call and a heartbeat round through it: the driver calls the
two roots only, every rank's result comes back (each rank's part of a cut argument derived two
hops down), a rank's exception and a killed rank under the deepest agent are that rank's; a
killed or frozen interior agent hides no rank: its calls in flight are lost (a re-form
without blame, not a hang), it is taken out of the tree (its child moves up to its parent,
nothing else moves), its node's ranks are pinged and called from the driver, and a killed rank under it is still dead, a
SIGSTOPped one silent."""
import os
import signal
import sys
import time

import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch import PassThroughDispatch
from ftrain.config import load_config
from ftrain.control.actor_slot import ActorSlot
from ftrain.control.agent_tree import Branch, actor_key, branches, depth, depth_bound, merge, shape, summary, without
from ftrain.control.health import Beat, HealthMonitor
from ftrain.control.node_agent import NodeAgent, NodeCalls
from ftrain.distributed.fanout import Cut
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.failures import WorkerFailure

NODES = 7  # FANOUT 2: three levels


# -- the shape: pure --------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.integers(0, 400), st.integers(2, 20))
def test_shape_holds_every_node_once_parent_first_within_the_depth_bound(n, fanout):
    nodes = [f"n{i}" for i in range(n)]
    tree = shape(nodes, fanout)
    placed = [c for kids in tree.values() for c in kids]
    assert sorted(placed) == sorted(nodes)                              # every node exactly once
    assert all(len(kids) <= fanout for kids in tree.values())
    position = {node: i for i, node in enumerate(nodes)}
    assert all(position[p] < position[c] for p, kids in tree.items() if p is not None for c in kids)
    assert depth(tree) <= depth_bound(n, fanout)
    if n <= fanout:
        assert tree == {None: nodes}                                    # flat: the driver calls every agent


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 120), st.integers(2, 6), st.data())
def test_a_gone_node_is_replaced_by_its_children_and_nothing_else_moves(n, fanout, data):
    nodes = list(range(n))
    gone = set(data.draw(st.lists(st.sampled_from(nodes), unique=True))) if nodes else set()
    tree = shape(nodes, fanout)
    parent = {c: p for p, kids in tree.items() for c in kids}
    repaired = without(tree, gone)
    new_parent = {c: p for p, kids in repaired.items() for c in kids}
    assert sorted(new_parent) == sorted(set(nodes) - gone)             # every node left, once

    def nearest(node):  # its nearest ancestor not gone (None: the driver)
        p = parent[node]
        return p if p is None or p not in gone else nearest(p)
    assert all(new_parent[c] == nearest(c) for c in new_parent)
    assert all(p is None or p < c for c, p in new_parent.items())      # parent still before child


def test_shape_of_seven_nodes_at_fanout_two_and_a_bad_fanout():
    assert shape([f"n{i}" for i in range(NODES)], 2) == {None: ["n0", "n1"], "n0": ["n2", "n3"],
                                                          "n1": ["n4", "n5"], "n2": ["n6"]}
    assert depth(shape(range(NODES), 2)) == 3 and depth_bound(1024 // 8, 16) == 2
    assert without(shape([f"n{i}" for i in range(NODES)], 2), {"n2"}) == {   # n6 moves up to n0
        None: ["n0", "n1"], "n0": ["n6", "n3"], "n1": ["n4", "n5"]}
    with pytest.raises(ValueError):
        shape(["n0"], 1)


class _Handle:
    def __init__(self, key):
        self._actor_id = bytes.fromhex(key)


def test_branches_leave_out_subtrees_without_members_and_tell_a_change():
    agents = {f"n{i}": _Handle(f"a{i}") for i in range(NODES)}
    tree = shape(list(agents), 2)
    own = {"n6": [(6, _Handle("06"))], "n1": [(1, _Handle("01"))]}
    roots = branches(tree, agents, own)
    assert [b.key for b in roots] == ["a0", "a1"]                       # n0 only relays, to n2 -> n6
    assert [c.key for c in roots[0].children] == ["a2"] and roots[0].members == {6}
    assert roots[1].children == () and roots[1].members == {1}
    moved = branches(tree, agents, {**own, "n6": [(6, _Handle("66"))]})  # a spare in rank 6's place
    assert moved[0].ident != roots[0].ident and moved[1].ident == roots[1].ident
    assert isinstance(roots[0], Branch)


def test_round_summaries_merge_as_columns_and_the_latest_round_of_an_actor_counts():
    """Two summaries merged keep every answer in order (columns of plain values, no entry
    object per actor); the driver records, of an actor answered twice, the answer of the latest
    round (its ping's driver time), whichever came first, and an actor whose ping says it died
    is dead."""
    from ftrain.control.health import Heartbeats

    a, b = summary(), summary()
    a["keys"], a["infos"], a["ats"] = ["k1", "k2"], [{"progress": 5}, {"progress": 1}], [2.0, 2.0]
    b["keys"], b["infos"], b["ats"] = ["k1"], [{"progress": 3}], [1.0]   # an older round's answer, merged later
    b["died"], b["dead"], b["late"] = {"k3": "actor died"}, {"agent9": "gone"}, {"agent8": 1.5}
    merge(a, b)
    assert a["keys"] == ["k1", "k2", "k1"] and a["ats"] == [2.0, 2.0, 1.0]
    assert a["died"] == {"k3": "actor died"} and a["dead"] == {"agent9": "gone"} and a["late"] == {"agent8": 1.5}
    beats = Heartbeats(list, interval_s=0.5, timeout_s=5.0)
    now = time.monotonic()
    for k in ("k1", "k2", "k3"):
        beats._beats[k] = Beat(now, time.time())
    beats._record_round(a)
    assert beats._beats["k1"].info == {"progress": 5} and beats._beats["k1"].seen_sent == 2.0
    assert beats._beats["k2"].info == {"progress": 1} and beats._beats["k3"].dead == "actor died"
    assert "agent9" in beats._dead_agents and "agent8" in beats._stalled


# -- through real agents -------------------------------------------------------------------------

@ray.remote(num_cpus=0, concurrency_groups={"control": 1})
class Rank:
    """The control methods the health monitor and the tree call (`ping` answers during `echo`,
    as a rank's control group does during a step)."""

    def __init__(self):
        self.broken = False

    @ray.method(concurrency_group="control")
    def ping(self) -> dict:
        return {"progress": 0, "step_progress": 0}

    def echo(self, value, hold_s: float = 0.0):
        """`value`; raises ValueError once `fail_next` was called; sleeps `hold_s` first."""
        time.sleep(hold_s)
        if self.broken:
            self.broken = False
            raise ValueError("bad value")
        return value

    def fail_next(self) -> None:
        self.broken = True

    def pid(self) -> int:
        return os.getpid()


class ByRank(PassThroughDispatch):
    """Each rank its own element of a list argument (a `Cut` by rank). Sent to the agents by
    value (this module is not importable there)."""

    @classmethod
    def part_key(cls, dims, rank):
        return rank

    @classmethod
    def cut(cls, dims, value):
        return Cut(dict(enumerate(value))) if isinstance(value, list) else None


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def tree_run(ray_session):
    """Eight ranks on seven logical nodes (n6 holds ranks 6 and 7), an agent per node, the
    health monitor with FANOUT 2 (heartbeats started) and the driver's `NodeCalls`."""
    node = ray.get_runtime_context().get_node_id()
    ranks = [Rank.remote() for _ in range(NODES + 1)]
    slots = [ActorSlot(h, "127.0.0.1", node, [], i) for i, h in enumerate(ranks)]
    agents = {f"n{i}": NodeAgent.remote(0.1) for i in range(NODES)}
    pids = ray.get([r.pid.remote() for r in ranks])
    ray.get([a.node_id.remote() for a in agents.values()])
    ft = load_config("config.yaml", ["fault_tolerance.health_timeout_s=3",
                                     "fault_tolerance.health_interval_s=0.2"]).fault_tolerance
    health = HealthMonitor(ft, lambda: slots, agents=lambda: agents,
                           node_of=lambda s: f"n{min(s.bundle_index, NODES - 1)}", fanout=2)
    calls = NodeCalls(health.beats.node_of, health.beats.call_tree, health.agent_failed)
    health.start()
    yield slots, agents, pids, health, calls
    health.stop()
    for p in pids:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass
    for a in [*agents.values(), *ranks]:
        ray.kill(a)


def _step(health, calls, slots, value="v", dispatch=PassThroughDispatch, hold_s=0.0, timeout=30):
    sent = calls.start(slots, "echo", ParallelDims(tp=1, pp=1, cp=1, dp=len(slots)), dispatch, (value, hold_s))
    return len(sent.waitables()), health.wait(sent, timeout=timeout)


def test_a_step_through_the_tree_returns_every_ranks_result_and_names_a_failed_rank(tree_run):
    slots, agents, pids, health, calls = tree_run
    assert _step(health, calls, slots) == (2, ["v"] * 8)                # the driver calls the two roots only
    assert _step(health, calls, slots, list(range(100, 108)), ByRank) == (2, list(range(100, 108)))
    alive, dead, silent = health.beats.settle([s.handle for s in slots], time.monotonic())
    assert (alive, dead, silent) == (set(range(8)), set(), set())      # heartbeats relayed up three levels
    assert sorted(health.beats._roots._state) == sorted(actor_key(agents[n]) for n in ("n0", "n1"))
    ray.get(slots[6].handle.fail_next.remote())
    with pytest.raises(WorkerFailure) as failure:
        _step(health, calls, slots)
    assert (failure.value.ranks, failure.value.kind) == ({6}, "exception"), failure.value
    ray.kill(slots[7].handle)                                           # under n6, three hops down
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as failure:
        _step(health, calls, slots)
    assert (failure.value.ranks, failure.value.kind) == ({7}, "crash"), failure.value
    assert time.monotonic() - t0 < 5


def _held_step_losing(health, calls, slots, hold_s: float, fault) -> None:
    """A step whose ranks hold `hold_s`, `fault()` done while it runs: the calls through the
    agent it hits are lost, so the step re-forms without blame (not a hang), within seconds."""
    t0 = time.monotonic()
    sent = calls.start(slots, "echo", ParallelDims(tp=1, pp=1, cp=1, dp=8), PassThroughDispatch, ("v", hold_s))
    time.sleep(0.5)
    fault()
    with pytest.raises(WorkerFailure) as failure:
        health.wait(sent, timeout=60)
    assert (failure.value.ranks, failure.value.kind) == (set(), "exception"), failure.value
    assert time.monotonic() - t0 < hold_s + 8


def test_a_frozen_or_killed_interior_agent_hides_no_rank(tree_run):
    slots, agents, pids, health, calls = tree_run
    everyone = [s.handle for s in slots]
    key = actor_key(agents["n2"])                                       # interior: parent n0, child n6
    agent_pid = ray.get(agents["n2"].__ray_call__.remote(lambda _: os.getpid()))
    assert _step(health, calls, slots) == (2, ["v"] * 8)
    try:  # frozen: left out of the tree once its round is late, its calls given up after health_timeout_s
        _held_step_losing(health, calls, slots, 3.0, lambda: os.kill(agent_pid, signal.SIGSTOP))
        assert key in health.beats.gone_agents()
        assert health.beats.settle(everyone, time.monotonic()) == (set(range(8)), set(), set())
        assert _step(health, calls, slots) == (3, ["v"] * 8)           # rank 2 from the driver, n6 re-parented
    finally:
        os.kill(agent_pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while key in health.beats.gone_agents() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _step(health, calls, slots) == (2, ["v"] * 8)               # probed, back in the tree
    # killed: its parent reports its calls lost at once; the tree is rebuilt without it
    _held_step_losing(health, calls, slots, 2.0, lambda: ray.kill(agents["n2"]))
    assert key in health.beats.gone_agents()
    assert _step(health, calls, slots) == (3, ["v"] * 8)
    assert health.beats.settle(everyone, time.monotonic()) == (set(range(8)), set(), set())
    ray.kill(slots[7].handle)
    with pytest.raises(WorkerFailure) as failure:
        _step(health, calls, slots)
    assert (failure.value.ranks, failure.value.kind) == ({7}, "crash"), failure.value
    os.kill(pids[6], signal.SIGSTOP)                                    # silent, not dead
    assert health.beats.settle(everyone, time.monotonic()) == (set(range(6)), {7}, {6})
