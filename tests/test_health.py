"""Failure detection (`health.py`) against real Ray errors: a briefly unavailable actor is not a
dead one, and one bad ping answer costs no other actor its heartbeat round. The actors here are
minimal ones with the control methods the health monitor calls (`ping`, `abort`), so that Ray
produces its errors on demand: an actor with `max_restarts=1` killed inside a call makes Ray
raise `ActorUnavailableError` for that call while it restarts."""
import os
import signal
import time

import pytest
import ray

from actor_group import ActorSlot
from config import load_config
from failures import WorkerFailure
from health import Heartbeats, HealthMonitor


@ray.remote(num_cpus=0, max_restarts=1)
class Rank:
    """Control methods as `MegatronActor` has them. `die_once(marker)`: SIGKILL of this process
    the first time (the marker file records it), so Ray restarts the actor and the call in flight
    raises `ActorUnavailableError`; later calls return "done"."""

    def __init__(self, marker: str = "", broken_ping: bool = False):
        self.marker, self.broken_ping = marker, broken_ping

    def ping(self) -> dict:
        if self.broken_ping:
            raise RuntimeError("ping is broken")
        return {"progress": 0, "step_progress": 0}

    def _die_once(self) -> None:
        if self.marker and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    def abort(self) -> float:
        self._die_once()
        return 0.0

    def work(self) -> str:
        self._die_once()
        return "done"

    def noop(self) -> bool:
        return True


def _slots(handles) -> list[ActorSlot]:
    node = ray.get_runtime_context().get_node_id()
    return [ActorSlot(h, "127.0.0.1", node, [], i) for i, h in enumerate(handles)]


def _monitor(handles, timeout_s: float = 20.0) -> HealthMonitor:
    ft = load_config("config.yaml", [f"fault_tolerance.health_timeout_s={timeout_s}",
                                     "fault_tolerance.health_interval_s=0.2"]).fault_tolerance
    slots = _slots(handles)
    return HealthMonitor(ft, lambda: slots)


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
        assert health.wait([r.work.remote() for r in ranks], timeout=30) == ["done", "done"]
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
