"""`NodeAgent`: one actor per node of the run that pings the rank actors of its node and
answers the driver's heartbeat round with one summary, so that the driver sends one call per
node per round, not one per actor (`health.Heartbeats`).

The agent keeps one ping in flight per actor (a frozen actor does not collect a queue of
pings), waits for its pings a bounded time each round, and reports each answer with the
driver's time of the round that sent the ping, so that the driver's "answered a ping sent
after t" keeps its meaning across processes. It judges nothing: the driver does.
"""
from __future__ import annotations

import time

import ray

from health import actor_key, ping_result


@ray.remote(num_cpus=0)
class NodeAgent:
    """Pings the actors it is given (those of its node) each time `round` is called."""

    def __init__(self, wait_s: float):
        """`wait_s`: seconds a round waits for its pings before it answers (the rest are
        reported by a later round)."""
        self.wait_s = wait_s
        self._actors: dict[str, object] = {}
        self._in_flight: dict = {}   # ping ObjectRef -> (actor key, driver time of its round)

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
