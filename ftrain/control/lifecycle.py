"""A rank actor's life, in one place: the states a `MegatronActor` goes through and the moves
between them, checked as they happen.

    created --build--> spare --prepare_spare--> warming --> warm
    spare / warming / warm / member / aborted --join--> joining --> member (of generation g)
    joining / member / any built state --abort--> aborted --join--> joining ...
    warming / warm / aborted --prepare_spare--> warming (warmed again for a new driver's store)

A spare is built (model and optimizer made) but in no process group; `warming` pays the
process's one-time costs (`MegatronActor.prepare_spare`); `joining` forms generation g's
process groups; `member` trains in generation g; `aborted` left its generation (its
communicators aborted) and waits to join the next one, as a survivor or, after a DP shrink, as a
spare. Being replaced is the driver's decision (`ActorGroup.replace`): the actor is killed and
has no state after that. Each heartbeat carries the state (`MegatronActor.ping`); a rank that
goes silent is reported with the state it last had (`HealthMonitor`).
"""
from __future__ import annotations

import threading

CREATED, SPARE, WARMING, WARM, JOINING, MEMBER, ABORTED = (
    "created", "spare", "warming", "warm", "joining", "member", "aborted")

MOVES: dict[str, set[str]] = {
    CREATED: {SPARE},
    SPARE: {WARMING, JOINING, ABORTED},
    WARMING: {WARMING, WARM, JOINING, ABORTED},  # a warm-up that raised leaves it warming
    WARM: {WARMING, JOINING, ABORTED},  # a reattaching driver warms its spares for its own store
    JOINING: {MEMBER, ABORTED},
    MEMBER: {JOINING, ABORTED},
    ABORTED: {WARMING, JOINING, ABORTED},  # a member dropped by a DP shrink is a spare
}
"""state -> the states it may move to."""


class IllegalMove(RuntimeError):
    """A move the lifecycle does not allow (a bug in the caller, not a fault of the cluster)."""


class Lifecycle:
    """The state of one rank actor; `move` is called from its compute and control threads."""

    def __init__(self):
        self.state, self.generation = CREATED, None
        self._lock = threading.Lock()

    def move(self, to: str, generation: int | None = None) -> None:
        """Move to state `to` (`generation`: the one joined, for `member`). Raises IllegalMove
        when `MOVES` does not allow it."""
        with self._lock:
            self.move_locked(to, generation)

    def move_locked(self, to: str, generation: int | None = None) -> None:
        if to not in MOVES[self.state]:
            raise IllegalMove(f"lifecycle: {self.state} -> {to} is not a move of a rank actor")
        self.state = to
        self.generation = generation if to == MEMBER else None

    def joined(self, generation: int) -> bool:
        """joining -> member of `generation`, unless an abort came during the join (the state is
        then `aborted`, and stays): returns whether the actor is a member now."""
        with self._lock:
            if self.state == ABORTED:
                return False
            self.move_locked(MEMBER, generation)
            return True

    def __repr__(self) -> str:
        return f"{self.state}" + (f"({self.generation})" if self.generation is not None else "")
