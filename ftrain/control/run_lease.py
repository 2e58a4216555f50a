"""One driver per run: a lease with an epoch (a fencing token) in the cluster.

Two drivers of one run on one cluster (the same `main.py train` started twice, a driver that
stalled and was taken over) must never both drive it: their calls would interleave and the
run's checkpoints would hold state mixed by both. Every driver of a run that attaches to a
cluster (`cluster.ray_address`) first claims the run's lease, a named `RunLease` actor in the
run's namespace, and renews it every second from a thread:

- `claim` succeeds when no driver holds the lease or its holder has not renewed it for
  `fault_tolerance.driver_lease_s` seconds; each successful claim takes the next epoch.
  A driver that finds the lease live waits once for it to lapse; if its holder keeps it (or
  another driver takes it meanwhile) it stops with one line (`LeaseHeld`), touching nothing.
- The epoch fences everything the driver does: its membership generations are numbered from
  `failures.first_generation(epoch)`, so a later driver's generations are above every generation of an
  earlier one, and a rank actor refuses to join a generation below one it has joined
  (`MegatronActor.join`). A superseded driver's compute calls carry a generation its actors no
  longer serve (`StaleGenerationError`), its record updates are refused
  (`driver_failover.RunRecord.update`), and before each checkpoint commit it checks that it
  still holds the lease (`DriverLease.check`: `LeaseLost`).
- A superseded driver (its renewal refused) stops at its next step boundary with one line and
  leaves the run's actors to the driver that holds the lease.

With `fault_tolerance.driver_failover` the lease actor is detached (it outlives its driver, so a
new driver can take the run over once the lease lapses); without, it belongs to its driver and
goes with it. A driver with its own local Ray has its own namespace and needs no lease.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

import ray

log = logging.getLogger(__name__)

LEASE = "run-lease"
RENEW_S = 1.0                    # s between renewals; `driver_lease_s` must be well above it
ENDED = "one that ended since"  # the holder named when the lease was taken and released meanwhile


class LeaseHeld(RuntimeError):
    """Another driver holds the run's lease (the message says which and how to proceed)."""


class LeaseLost(RuntimeError):
    """This driver's lease lapsed and another driver took the run over: stop, touch nothing."""


@ray.remote(num_cpus=0)
class RunLease:
    """The lease of one run. Ray runs an actor's calls one at a time, so a claim is atomic."""

    def __init__(self):
        self.epoch, self.holder, self.renewed = 0, None, 0.0

    def claim(self, driver: str, lease_s: float, seen: int | None = None) -> tuple[int, str | None, float, int]:
        """Take the lease for `driver` when it is free or lapsed (not renewed for `lease_s`),
        and, with `seen`, only if no other driver took it since the caller saw epoch `seen`
        (one that took it and already ended the run released it). Returns (epoch, holder,
        seconds until it lapses, the current epoch): epoch > 0 when `driver` holds it now."""
        now = time.monotonic()
        if seen is not None and self.epoch != seen and self.holder != driver:
            return 0, self.holder or ENDED, 0.0, self.epoch
        if self.holder not in (None, driver) and now - self.renewed < lease_s:
            return 0, self.holder, lease_s - (now - self.renewed), self.epoch
        if self.holder != driver:
            self.epoch, self.holder = self.epoch + 1, driver
        self.renewed = now
        return self.epoch, driver, lease_s, self.epoch

    def renew(self, driver: str, epoch: int) -> bool:
        """Keep the lease; False when another driver took it (the caller is superseded)."""
        if (self.holder, self.epoch) != (driver, epoch):
            return False
        self.renewed = time.monotonic()
        return True

    def release(self, driver: str, epoch: int) -> None:
        """Give the lease up at the end of a run (a next driver need not wait for it to lapse)."""
        if (self.holder, self.epoch) == (driver, epoch):
            self.holder = None

    def current(self) -> tuple[int, str | None]:
        return self.epoch, self.holder


class DriverLease:
    """The driver's side: claim the run's lease (`claim`), renew it every `RENEW_S` seconds.
    `epoch`: this driver's fencing token; `lost`: set once a renewal was refused."""

    def __init__(self, ns: str, lease_s: float, detached: bool):
        self.ns, self.lease_s, self.detached = ns, lease_s, detached
        self.driver = f"{ray.util.get_node_ip_address()}:{uuid.uuid4().hex[:8]}"
        self.actor = None
        self.epoch = 0
        self.lost = threading.Event()
        self._stop = threading.Event()

    def _claim(self, timeout_s: float, seen: int | None = None) -> tuple[int, str | None, float, int]:
        """One claim (`RunLease.claim`); the lease actor is made if there is none, and made
        again if it went away (a driver's own lease goes with it when not detached)."""
        opts = {"lifetime": "detached"} if self.detached else {}

        def once():
            self.actor = RunLease.options(name=LEASE, namespace=self.ns, get_if_exists=True, **opts).remote()
            return ray.get(self.actor.claim.remote(self.driver, self.lease_s, seen), timeout=timeout_s)
        try:
            return once()
        except ray.exceptions.RayActorError:
            return once()

    def claim(self, timeout_s: float = 30.0) -> int:
        """Take the lease, waiting once for a live holder's lease to lapse (a driver that was
        just killed). Returns the epoch. Raises LeaseHeld when its holder keeps it or another
        driver takes it meanwhile."""
        epoch, holder, left, seen = self._claim(timeout_s)
        if not epoch:
            log.info("driver lease: held by driver %s, lapses in %.1f s unless renewed: waiting", holder, left)
            time.sleep(left + RENEW_S)
            first = holder
            epoch, holder, left, _ = self._claim(timeout_s, seen)
            if not epoch:
                if holder == ENDED:  # the lease this driver waited for went with its run: leave none behind
                    ray.kill(self.actor, no_restart=True)
                how = "still renews it" if holder == first else "took it over meanwhile"
                raise LeaseHeld(f"another driver of this run ({holder}) {how}: one driver per run; stop it "
                                f"first (`main.py stop --run NAME` removes the run), or choose another run_name")
        self.epoch = epoch
        threading.Thread(target=self._renew, name="driver-lease", daemon=True).start()
        log.info("event=lease driver=%s epoch=%d", self.driver, epoch)
        return epoch

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if not ray.get(self.actor.renew.remote(self.driver, self.epoch), timeout=self.lease_s):
                    self.lost.set()
                    return
            except Exception as e:  # noqa: BLE001 (a renewal that fails only lets the lease lapse)
                log.debug("lease renewal failed: %s", e)

    def check(self) -> None:
        """Raise LeaseLost unless this driver still holds the lease (asked of the lease actor
        now, not only the last renewal's answer): called before each checkpoint commit."""
        if self.lost.is_set() or not ray.get(self.actor.renew.remote(self.driver, self.epoch),
                                             timeout=self.lease_s):
            self.lost.set()
            raise LeaseLost(f"driver {self.driver}: its lease (epoch {self.epoch}) lapsed and another driver "
                            f"took the run over; this driver stops and leaves the run to it")

    def release(self, remove: bool) -> None:
        """Stop renewing and give the lease up (the run ended or failed for good); `remove`:
        kill the lease actor too (a detached one outlives its driver otherwise)."""
        self._stop.set()
        if not self.lost.is_set():
            try:
                ray.get(self.actor.release.remote(self.driver, self.epoch), timeout=self.lease_s)
            except ray.exceptions.RayError as e:
                log.debug("lease release failed: %s", e)
        if remove:
            ray.kill(self.actor, no_restart=True)
