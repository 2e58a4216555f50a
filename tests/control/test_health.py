"""Failure detection (`health.py`). Against real Ray errors: a briefly unavailable actor is not a
dead one, and one bad ping answer costs no other actor its heartbeat round (minimal actors with
the control methods the health monitor calls, so that Ray produces its errors on demand: an
actor with `max_restarts=1` killed inside a call makes Ray raise `ActorUnavailableError` for
that call while it restarts). Which rank a hang blames: pure tables of collective counts, and a
real run whose restore source hangs while a fresh spare waits in its broadcast."""
import os
import signal
import time

import pytest
import ray

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.control.actor_slot import ActorSlot
from ftrain.control.health import BLAMELESS_HANGS, HealthMonitor, Heartbeats, actor_key, hang_culprits, suspected_node
from ftrain.failures import WorkerFailure
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor


@ray.remote(num_cpus=0, max_restarts=1)
class Rank:
    """Control methods as `MegatronActor` has them. `die_once(marker)`: SIGKILL of this process
    the first time (the marker file records it), so Ray restarts the actor and the call in flight
    raises `ActorUnavailableError`; later calls return "done"."""

    def __init__(self, marker: str = "", broken_ping: bool = False, no_restart: bool = False):
        if no_restart and marker and os.path.exists(marker):
            raise RuntimeError("this actor does not come back")  # its restart fails: Ray marks it dead
        self.marker, self.broken_ping, self.broken_echo = marker, broken_ping, False

    def ping(self) -> dict:
        if self.broken_ping:
            raise RuntimeError("ping is broken")
        return {"progress": 0, "step_progress": 0}

    def _die_once(self) -> None:
        if self.marker and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    def abort(self, generation: int) -> float:
        self._die_once()
        return 0.0

    def work(self) -> str:
        self._die_once()
        return "done"

    def noop(self) -> bool:
        return True

    def echo(self, value, batch) -> tuple:
        """(value, batch); raises ValueError once `fail_next` was called."""
        if self.broken_echo:
            self.broken_echo = False
            raise ValueError("bad value")
        return value, batch

    def rows(self, batch, other) -> tuple:
        """(the first input id of each row of the TrainingBatch `batch`, other): plain lists,
        so that the node agent reading the result needs no torch."""
        return batch.input_ids[:, 0].tolist(), other

    def fail_next(self) -> None:
        """The next `echo` raises."""
        self.broken_echo = True

    def pid(self) -> int:
        return os.getpid()


def _slots(handles) -> list[ActorSlot]:
    node = ray.get_runtime_context().get_node_id()
    return [ActorSlot(h, "127.0.0.1", node, [], i) for i, h in enumerate(handles)]


def _ft(timeout_s: float):
    return load_config("config.yaml", [f"fault_tolerance.health_timeout_s={timeout_s}",
                                       "fault_tolerance.health_interval_s=0.2"]).fault_tolerance


def _monitor(handles, timeout_s: float = 20.0) -> HealthMonitor:
    slots = _slots(handles)
    return HealthMonitor(_ft(timeout_s), lambda: slots)


def test_a_call_lost_to_actor_unavailable_replaces_nobody(ray_session, tmp_path):
    """Rank 1's step call is lost while its actor restarts (`ActorUnavailableError`): the
    failure names no rank (re-form, nothing replaced), not a crash of rank 1."""
    ranks = [Rank.remote(), Rank.remote(str(tmp_path / "died"))]
    health = _monitor(ranks)
    health.start()
    try:
        with pytest.raises(WorkerFailure) as failure:
            health.wait([r.work.remote() for r in ranks], timeout=30)
        assert failure.value.ranks == set(), failure.value
        assert failure.value.kind == "exception"
        ray.get(ranks[1].noop.options(max_task_retries=-1).remote())  # restarted: answers again
        assert health.wait([r.work.remote() for r in ranks], timeout=30) == ["done", "done"]
    finally:
        health.stop()
        for r in ranks:
            ray.kill(r)


def test_a_call_lost_with_an_actor_that_does_not_come_back_is_a_crash_of_its_rank(ray_session, tmp_path):
    """Rank 1 dies inside its step call, whose answer is lost (`ActorUnavailableError` while Ray
    restarts it), and its restart fails: the actor is dead, so the failure is a crash of rank 1
    (replaced), not a blameless re-form naming no rank."""
    ranks = [Rank.remote(), Rank.remote(str(tmp_path / "died"), no_restart=True)]
    health = _monitor(ranks)
    health.start()
    try:
        with pytest.raises(WorkerFailure) as failure:
            health.wait([r.work.remote() for r in ranks], timeout=30)
        assert (failure.value.ranks, failure.value.kind) == ({1}, "crash"), failure.value
    finally:
        health.stop()
        for r in ranks:
            ray.kill(r)


def test_an_abort_lost_to_actor_unavailable_is_asked_again(ray_session, tmp_path):
    """Rank 1's abort is lost while its actor restarts: it is asked again, and not failed."""
    ranks = [Rank.remote(), Rank.remote(str(tmp_path / "died"))]
    ray.get([r.noop.remote() for r in ranks])
    health = _monitor(ranks)
    try:
        assert health.abort_survivors(set()) == set()
        assert os.path.exists(tmp_path / "died")
    finally:
        for r in ranks:
            ray.kill(r)


def test_a_ping_that_raises_costs_no_other_actor_its_round(ray_session):
    """The first actor's ping raises at every round: the others are still seen alive."""
    ranks = [Rank.remote(broken_ping=True), Rank.remote(), Rank.remote()]
    ray.get([r.noop.remote() for r in ranks])
    beats = Heartbeats(lambda: ranks, interval_s=0.1, timeout_s=3.0)
    beats.start()
    try:
        since = time.monotonic()
        alive, dead, silent = beats.settle(ranks, since)
    finally:
        beats.stop()
        for r in ranks:
            ray.kill(r)
    assert (alive, dead, silent) == ({1, 2}, set(), {0})


# -- who a hang blames: collectives entered per group (`comms.collective_counts`), by rank -----

def test_a_hung_rank_is_blamed_not_its_tp_peer_nor_the_other_replica():
    """tp=2, dp=2 (ranks 0,1 and 2,3 are TP groups; 0,2 and 1,3 DP groups). Rank 0 stopped
    before its TP all-reduce 5: rank 1 waits inside it, ranks 2 and 3 finished the step's TP
    all-reduces and wait in the gradient reduce. Only rank 0 is blamed (a rule of "progress
    below the others" blames rank 1 too)."""
    counts = {0: {"0,1#0": 4, "0,2#0": 0, "0,1,2,3#0": 0},
              1: {"0,1#0": 5, "1,3#0": 0, "0,1,2,3#0": 0},
              2: {"2,3#0": 6, "0,2#0": 1, "0,1,2,3#0": 0},
              3: {"2,3#0": 6, "1,3#0": 1, "0,1,2,3#0": 0}}
    assert hang_culprits(counts) == {0}


@pytest.mark.parametrize("hung, counts", [
    # stage 0 (rank 0) stopped before sending micro-batch 2: stage 1 (rank 2) waits in its receive
    (0, {0: {"0,2#0": 2, "0,1#0": 0}, 1: {"1,3#0": 8, "0,1#0": 1},
         2: {"0,2#0": 3, "2,3#0": 0}, 3: {"1,3#0": 8, "2,3#0": 1}}),
    # stage 1 (rank 2) stopped in its backward: stage 0 (rank 0) waits to receive its gradient
    (2, {0: {"0,2#0": 7, "0,1#0": 0}, 1: {"1,3#0": 8, "0,1#0": 1},
         2: {"0,2#0": 6, "2,3#0": 0}, 3: {"1,3#0": 8, "2,3#0": 1}}),
])
def test_a_hung_pipeline_stage_is_blamed_not_the_stage_waiting_on_it(hung, counts):
    """pp=2, dp=2 (ranks 0,1 stage 0, ranks 2,3 stage 1; PP groups 0,2 and 1,3; p2p counted, as
    gloo counts it). The other replica went on to its gradient reduce."""
    assert hang_culprits(counts) == {hung}


def test_the_restore_source_is_blamed_not_the_fresh_spare_waiting_in_its_broadcast():
    """A fresh generation (no collective yet on the world group); rank 1, a fresh spare, entered
    the broadcast of the restore group {0, 1}, its source (rank 0) did not."""
    counts = {0: {"0,1,2#0": 0, "0,1#0": 0}, 1: {"0,1,2#0": 0, "0,1#0": 1}, 2: {"0,1,2#0": 0}}
    assert hang_culprits(counts) == {0}


@pytest.mark.parametrize("counts", [
    {0: {"0,1#0": 0}, 1: {"0,1#0": 0}},                  # spares joining: nothing entered yet
    {0: {"0,1#0": 7}, 1: {"0,1#0": 7}},                  # a save, or a collective both entered
    {0: {"0,1,2#0": 3}, 1: {"0,1,2#0": 3}},              # rank 2 frozen: no answer (heartbeats find it)
    {0: {"0,1#0": 3, "0,1#1": 2}, 1: {"0,1#0": 2, "0,1#1": 3}},  # each waits on the other: no culprit
])
def test_no_rank_is_blamed_when_no_group_has_a_laggard_that_waits_nowhere(counts):
    assert hang_culprits(counts) == set()


def test_a_large_group_is_named_in_constant_size_and_the_same_on_every_member():
    """A ping names each of its rank's groups (`comms.collective_counts`): a small group by its
    members, a large one (every DP replica) by a name whose size does not grow with the ranks,
    the same for the same members in the same order and different for other members."""
    from ftrain.distributed.comms import GROUP_NAME_RANKS, group_name

    assert group_name([0, 1, 2, 3]) == "0,1,2,3"
    big = list(range(1024))
    assert len(group_name(big)) < 40 and group_name(big) == group_name(list(range(1024)))
    assert group_name(big).startswith("n=1024:0..1023:")
    assert group_name(big) != group_name(big[:-2] + [1023, 1022])
    assert group_name(list(range(GROUP_NAME_RANKS))) == ",".join(map(str, range(GROUP_NAME_RANKS)))


def test_a_node_is_suspected_after_a_bounded_number_of_hangs_with_no_culprit():
    assert suspected_node([{"a": 1, "b": 1}] * 2, bound=3) is None
    assert suspected_node([{"a": 1, "b": 1}, {"b": 1}, {"a": 1, "b": 2}], bound=3) == "b"  # in the most
    assert suspected_node([{"a": 1, "b": 2}] * 3, bound=3) == "b"   # tie: more stuck ranks
    assert suspected_node([{"b": 1, "a": 1}] * 3, bound=3) == "a"   # tie: the smallest id


def test_hangs_that_blame_nobody_exclude_the_node_at_the_bound(ray_session):
    """Hangs where every rank answers its abort and its compute thread is free (a stalled link):
    the first BLAMELESS_HANGS - 1 replace nobody (the membership is formed again), the next
    replaces the ranks of the node they pointed at, and says so."""
    ranks = [Rank.remote(), Rank.remote()]
    ray.get([r.noop.remote() for r in ranks])
    health = _monitor(ranks)
    health.start()
    try:
        failures = [health._hang_failure({0, 1}, 1.0, time.time()) for _ in range(BLAMELESS_HANGS)]
    finally:
        health.stop()
        for r in ranks:
            ray.kill(r)
    assert [f.ranks for f in failures[:-1]] == [set()] * (BLAMELESS_HANGS - 1), failures
    assert failures[-1].ranks == {0, 1} and failures[-1].kind == "hang"  # one node here: both
    assert "excluded after" in failures[-1].detail, failures[-1].detail


@pytest.mark.slow
def test_a_hung_restore_source_is_replaced_not_the_spare_it_stalls(ray_session, tmp_path):
    """Rank 2 is killed at step 3; in the peer restore, the source (rank 0, the lowest survivor)
    hangs before its broadcast while the fresh spare waits inside it (a second group besides the
    world: the source and the spare). Exactly the killed rank and the hung source are replaced:
    two spares suffice (blaming the spare would take a third, and the run would stop)."""
    cfg = resolve(load_config("config.yaml", [
        "cluster.num_workers=3", "cluster.num_spares=2", "train.steps=4", "checkpoint.interval=1",
        "train.global_batch_size=12", "train.mini_batch_size=6", "train.micro_batch_size=1",
        "fault_tolerance.refill_spares=false", "fault_tolerance.health_timeout_s=3",
        "fault_tolerance.health_interval_s=0.2", "fault_tolerance.min_step_timeout_s=4",
        "fault_tolerance.step_timeout_s=6", "fault_tolerance.rendezvous_timeout_s=20",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt",
        "chaos.events=[{step: 3, rank: 2, kind: kill, point: step_start},"
        "{step: 3, rank: 0, kind: hang, point: during_restore}]"]), num_gpus=0)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(cfg.train.steps)
    finally:
        group.shutdown()
    (recovery,) = trainer.recoveries
    assert recovery.attempts == 2, recovery.notes
    assert recovery.failed_ranks == [0, 2], recovery.notes
    assert "hang of rank(s) [0]" in recovery.notes[0], recovery.notes


# -- driver work per round: batched waits ---------------------------------------------------

def _counting_waits(monkeypatch) -> list:
    """Count the driver's `ray.wait` calls from here on (each still runs Ray's own)."""
    calls, real = [], ray.wait
    monkeypatch.setattr(ray, "wait", lambda *a, **kw: calls.append(len(a[0])) or real(*a, **kw))
    return calls


def _counting_gets(monkeypatch) -> list:
    """Count the `ray.get` calls from here on (the number of refs each one fetches)."""
    calls, real = [], ray.get
    monkeypatch.setattr(ray, "get", lambda refs, *a, **kw: calls.append(
        len(refs) if isinstance(refs, list) else 1) or real(refs, *a, **kw))
    return calls


def test_a_heartbeat_round_takes_every_ready_answer_in_one_wait(ray_session, monkeypatch):
    """Four answered pings are recorded after one batch (`ray_batch.batch_wait`: a wait for the
    first answer, one for the rest), not one wait per answer, and fetched with one get."""
    ranks = [Rank.remote() for _ in range(4)]
    try:
        beats = Heartbeats(lambda: ranks, interval_s=5.0, timeout_s=10.0)
        in_flight = beats._send(time.monotonic())
        ray.wait(list(in_flight), num_returns=len(in_flight))  # every answer is in
        calls, gets = _counting_waits(monkeypatch), _counting_gets(monkeypatch)
        beats._collect(in_flight, time.monotonic() + 5.0)
        assert calls == [4, 3] and gets == [4]
        assert all(beats.beat(r).info == {"progress": 0, "step_progress": 0} for r in ranks)
    finally:
        for r in ranks:
            ray.kill(r)


def test_a_step_wait_takes_every_finished_call_in_one_wait(ray_session, monkeypatch):
    """Four finished calls are judged after one batch (`ray_batch.batch_wait`), not one wait per
    call, and fetched with one get."""
    ranks = [Rank.remote() for _ in range(4)]
    try:
        refs = [r.work.remote() for r in ranks]
        ray.wait(refs, num_returns=len(refs))
        calls, gets = _counting_waits(monkeypatch), _counting_gets(monkeypatch)
        assert _monitor(ranks).wait(refs, timeout=30) == ["done"] * 4
        assert calls == [4, 3] and gets == [4]
    finally:
        for r in ranks:
            ray.kill(r)


def test_one_failed_answer_in_a_batch_costs_no_other_its_value(ray_session):
    """`ray_batch.getters`: each ended ref's own outcome, a value or the error its get raised,
    when one of the batch raised (the batch's one get raises: each is then fetched alone)."""
    from ftrain.control.ray_batch import getters

    ranks = [Rank.remote() for _ in range(3)]
    try:
        ray.get(ranks[1].fail_next.remote())
        refs = [r.echo.remote(i, None) for i, r in enumerate(ranks)]
        ray.wait(refs, num_returns=len(refs))
        got = getters(refs)
        assert list(got) == refs
        assert got[refs[0]]() == (0, None) and got[refs[2]]() == (2, None)
        with pytest.raises(ray.exceptions.RayTaskError):
            got[refs[1]]()
        assert getters([]) == {}
    finally:
        for r in ranks:
            ray.kill(r)


# -- heartbeats through per-node agents (`node_agent.NodeAgent`) -----------------------------

def test_node_agents_carry_heartbeats_one_call_per_node(ray_session):
    """With an agent on the node, a round is one call to it, not a ping per actor; its summary
    carries each actor's answer (progress, collectives), a killed actor is dead at the next
    round, a SIGSTOPped one goes silent after timeout_s, and once the agent dies its node's
    actors are pinged from the driver and still seen alive; an agent gone from the roster is
    forgotten (no key of it kept over a long run)."""
    from ftrain.control.node_agent import NodeAgent

    ranks = [Rank.remote() for _ in range(4)]
    pids = ray.get([r.pid.remote() for r in ranks])
    slots = _slots(ranks)
    agent = NodeAgent.remote(0.05)
    roster = {slots[0].node_id: agent}
    beats = Heartbeats(lambda: slots, interval_s=0.2, timeout_s=2.0, agents=lambda: dict(roster))
    try:
        in_flight = beats._send(time.monotonic())
        # One round per node; besides it only the agent's first probe (once: a starting agent
        # is never taken for gone).
        assert sorted(map(str, in_flight.values())) == sorted(["round", str(("probe", actor_key(agent)))])
        beats.start()
        alive, dead, silent = beats.settle(ranks, time.monotonic())
        assert (alive, dead, silent) == ({0, 1, 2, 3}, set(), set())
        assert beats.beat(ranks[0]).info == {"progress": 0, "step_progress": 0}
        ray.kill(ranks[0])
        os.kill(pids[1], signal.SIGSTOP)
        alive, dead, silent = beats.settle(ranks, time.monotonic())
        assert (alive, dead, silent) == ({2, 3}, {0}, {1})
        ray.kill(agent)
        time.sleep(0.5)   # the driver learns the agent died
        assert beats._dead_agents == {actor_key(agent)}
        assert beats.settle(ranks[2:], time.monotonic()) == ({0, 1}, set(), set())
        roster.clear()  # the dead agent left the roster: nothing of it is kept
        time.sleep(0.5)
        assert beats._dead_agents == set() and beats._started == set() and beats._probes == {}
    finally:
        beats.stop()
        os.kill(pids[1], signal.SIGCONT)
        for r in ranks:
            ray.kill(r)


def test_node_agents_carry_step_calls_one_call_per_node(ray_session):
    """A call on every rank goes out as one `NodeAgent.call` per node (two logical nodes of two
    ranks here), with the call's arguments cut once: each agent derives its ranks' own (each DP
    replica its rows of a TrainingBatch, an ObjectRef put once passing through), and the results
    the dispatch collects come back in rank order, as from one call per rank. A rank whose call
    raises is that rank's 'exception', a killed rank that rank's 'crash'; a spare in its place
    is reached (the agent's layout resent); a dead agent replaces nobody (its calls are lost,
    its node's raylet answers) and later calls reach its node's ranks from the driver."""
    from test_dispatch import numbered_batch

    from dispatch import MeshDispatch, PassThroughDispatch
    from ftrain.control.node_agent import NodeAgent, NodeCalls
    from ftrain.distributed.fanout import dispatch_args
    from ftrain.distributed.parallel_dims import ParallelDims

    slots = _slots([Rank.remote() for _ in range(4)])
    agents = {"n0": NodeAgent.remote(0.05), "n1": NodeAgent.remote(0.05)}
    health = HealthMonitor(_ft(5.0), lambda: slots, agents=lambda: agents,
                           node_of=lambda s: f"n{s.bundle_index // 2}")
    calls = NodeCalls(health.beats.node_of, health.beats.call_tree, health.agent_failed)
    batch = ray.put([1, 2, 3])
    # A rank's first TrainingBatch imports torch there (seconds of silence on a loaded host): before the heartbeats.
    ray.get([*(s.handle.rows.remote(numbered_batch(1), 0) for s in slots), *(a.node_id.remote() for a in agents.values())])
    pass_through = ParallelDims(tp=1, pp=1, cp=1, dp=4)

    def call(value, dims=pass_through, dispatch=PassThroughDispatch, method="echo"):
        sent = calls.start(slots, method, dims, dispatch, (value, batch))
        return len(sent.waitables()), health.wait(sent, timeout=30)

    health.start()
    try:
        assert call("v") == (2, [("v", [1, 2, 3])] * 4)
        # tp=2, dp=2 (ranks 0, 1 on node n0 are replica 0): each replica gets its rows, as the
        # driver-side split gives them, and only one result per replica comes back
        mesh = ParallelDims(tp=2, pp=1, cp=1, dp=2)
        split = [a[0].input_ids[:, 0].tolist() for a, _ in dispatch_args(mesh, MeshDispatch, numbered_batch(4))]
        assert split == [[0, 2], [0, 2], [1, 3], [1, 3]]
        assert call(numbered_batch(4), mesh, MeshDispatch, "rows") == (2, [(split[0], [1, 2, 3]), None,
                                                                      (split[2], [1, 2, 3]), None])
        ray.get(slots[2].handle.fail_next.remote())
        with pytest.raises(WorkerFailure) as failure:
            call("v")
        assert (failure.value.ranks, failure.value.kind) == ({2}, "exception"), failure.value
        ray.kill(slots[3].handle)
        with pytest.raises(WorkerFailure) as failure:
            call("v")
        assert (failure.value.ranks, failure.value.kind) == ({3}, "crash"), failure.value
        slots[3] = _slots([Rank.remote()] * 4)[3]
        ray.get(slots[3].handle.rows.remote(numbered_batch(1), 0))   # its torch import, before its heartbeats count
        assert call("v") == (2, [("v", [1, 2, 3])] * 4)
        ray.kill(agents["n0"])
        with pytest.raises(WorkerFailure) as failure:
            call("v")
        assert (failure.value.ranks, failure.value.kind) == (set(), "exception"), failure.value
        assert call("v") == (3, [("v", [1, 2, 3])] * 4)   # ranks 0, 1 from the driver
        n, results = call(numbered_batch(4), mesh, MeshDispatch, "rows")   # derived there
        assert n == 3 and MeshDispatch.collect(mesh, results) == [(split[0], [1, 2, 3]), (split[2], [1, 2, 3])]
    finally:
        health.stop()
        for a in [*agents.values(), *(s.handle for s in slots)]:
            ray.kill(a)
