"""Batched Ray waits and gets over many ObjectRefs (pings, rounds, a step's calls): the driver and
the node agents take every answer that ended in one `ray.wait` and fetch them with one `ray.get`,
since Ray's fixed cost per call, not the answers, is most of what a get of a small answer costs
the caller (about 4x the CPU per ref of one get for many)."""
from __future__ import annotations

import time
from typing import Callable

import ray

BATCH_S = 0.05
"""Seconds a batched `ray.wait` gathers answers (pings, calls) that are then judged in one pass:
the driver's work per wait is O(actors), and a wait per answer would make it O(actors^2)."""


def batch_wait(pending: list, until: float) -> tuple[list, list]:
    """(ended, still pending) of the ObjectRefs `pending`: blocks until one ends or the
    monotonic time `until`, then takes every other that ends within `BATCH_S` of it (and
    before `until`) in the same pass. A wait that returns only when something ended or the
    time is up: no polls while nothing does (each poll costs the caller CPU, more so on a
    loaded host)."""
    done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, until - time.monotonic()))
    if done and pending:
        more, pending = ray.wait(pending, num_returns=len(pending),
                                 timeout=max(0.0, min(BATCH_S, until - time.monotonic())))
        done += more
    return done, pending


def getters(refs: list) -> dict:
    """ObjectRef -> a function returning its value or raising what `ray.get` raised for it, for
    each of the ended ObjectRefs `refs` (a ref not yet ended blocks until it ends): one
    `ray.get` for all of them; one each only when one of them raised."""
    if not refs:
        return {}
    try:
        return {ref: returner(v) for ref, v in zip(refs, ray.get(list(refs)))}
    except Exception:  # noqa: BLE001 - each ref's own outcome, below
        out = {}
        for ref in refs:
            try:
                out[ref] = returner(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - kept for its reader to raise
                out[ref] = raiser(e)
        return out


def returner(value) -> Callable:
    """A function that returns `value`."""
    return lambda: value


def raiser(error: BaseException) -> Callable:
    """A function that raises `error`."""
    def get():
        raise error
    return get
