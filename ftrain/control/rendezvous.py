"""The barrier a membership generation forms behind, through the driver's TCPStore, before the
(uninterruptible) rendezvous inside `init_process_group`: a member that never arrives must not
strand the others, and an abort must free them.

Each member adds itself to the key "arrived" of the generation's prefix; the one that brings it
to the world size sets "formed" to "ok"; every member blocks in one `store.wait` on "formed"
(no polling). An abort of any member sets "formed" to "aborted" through a second client
(`release`: the first one's socket is busy with the wait), which frees them all. A wait that
times out leaves a stale reply on its client's socket, so the caller must drop that client
(`wait_formed` says so by raising TimeoutError). torch is imported by the callers' store
clients, not here.
"""
from __future__ import annotations

import datetime

FORMED = "formed"


def arrive(store, world_size: int) -> None:
    """Count this member in (`store`: the generation's PrefixStore); the last one to arrive
    marks the generation formed."""
    if store.add("arrived", 1) == world_size:
        store.set(FORMED, "ok")


def wait_formed(store, timeout_s: float) -> bool:
    """Block until the generation is formed (True) or aborted (False). Raises TimeoutError after
    `timeout_s` seconds: the client of `store` then holds a stale reply and must be dropped."""
    try:
        store.wait([FORMED], datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # c10d's DistStoreError: the wait timed out
        raise TimeoutError from None
    return store.get(FORMED) == b"ok"


def release(client, prefix: str) -> None:
    """Free every member waiting in the barrier of the generation at `prefix` (abort), through
    `client` (a store client not in use by a wait)."""
    client.set(f"{prefix}/{FORMED}", "aborted")
