"""Driver failover: a new driver reattaches to the live actors of its run instead of reloading.

With `fault_tolerance.driver_failover: true` every actor of the run (ranks, spares, snapshot
holders), its placement group and a small `RunRecord` actor are named and detached in the Ray
namespace `ftrain-<run_name>` (`namespace`), so they outlive the driver. The record holds what a
new driver needs: the run identity, the committed step, the layout and which named actor is
which rank or spare; the driver rewrites it after every committed step (`DriverFailover.save`).

A new `main.py train` with the same config, attached to the same cluster, finds the record
(`find`), checks it is the same run (name and config fingerprint, run id of the checkpoints,
layout), takes the actors by name (`ActorGroup(cfg, attach=record)`), makes its own rendezvous
store and a new generation, and every surviving rank rolls back to the committed step from its
own live state (`fault_tolerance.reattach`: zero steps lost, no checkpoint read); ranks that did not survive
are replaced from spares and restored from a DP peer as in any recovery. More dead ranks than
live spares (`CannotReattach`), or an empty record (its driver died before its first `save`,
`check_record`): the new driver removes what is left and starts as one without failover would,
from the checkpoints. The record of another run under the same name stops the driver with one
line (`main.py stop --run NAME` removes it).

The record is also the run's janitor: the driver touches it every second; when no driver has
touched it for `fault_tolerance.driver_failover_timeout_s` it kills every named actor of the
run, removes the placement group and exits (no GPU held forever). A run that ends or fails for
good removes them itself (`remove`), as does `main.py stop --run NAME`. Each rank and spare
also watches the driver's heartbeat pings (`MegatronActor._driver_watchdog`), should the record
be lost.

Detached actors outlive only a driver that attached to a cluster (`cluster.ray_address`): a
driver's own local Ray dies with it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import ray

from ftrain.config import Config, ConfigError
from ftrain.control.run_lease import LEASE

log = logging.getLogger(__name__)

RECORD = "run-record"
PLACEMENT_GROUP = "placement-group"


class CannotReattach(RuntimeError):
    """Too few of the run's detached actors survived to reattach (the message says how many);
    the new driver removes what is left and starts as without them (from the checkpoints)."""


def namespace(run_name: str) -> str:
    """The Ray namespace of a run's detached actors."""
    return f"ftrain-{run_name}"


def new_name(kind: str, index: int) -> str:
    """A fresh actor name (a refill on the same bundle never collides with a dying actor)."""
    return f"{kind}-{index}-{uuid.uuid4().hex[:6]}"


def remove(names: list[str], ns: str | None = None, keep_lease: bool = False) -> int:
    """Kill the named actors (those that exist, in namespace `ns`) and, unless `keep_lease` (the
    caller is a driver holding it), the run's lease (`run_lease`), and remove the run's
    placement group; returns how many actors were killed. Works from the driver and from inside
    the run's actors: Ray looks placement groups up in the caller's namespace, which for every
    caller here is the run's."""
    killed = 0
    for name in names if keep_lease else [*names, LEASE]:
        try:
            ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)
            killed += name != LEASE
        except ValueError:
            pass
    try:
        from ray.util import get_placement_group, remove_placement_group
        remove_placement_group(get_placement_group(PLACEMENT_GROUP))
    except ValueError:
        pass
    return killed


@ray.remote(num_cpus=0)
class RunRecord:
    """The run's record for a next driver, and its janitor: a watchdog thread removes every
    named actor of the run and its placement group, then this actor, once no driver has
    touched it for `timeout_s` seconds."""

    def __init__(self, timeout_s: float, ns: str):
        self.state: dict = {}
        self.epoch = 0  # lease epoch of the driver that wrote `state` (`run_lease`)
        self.timeout_s, self.ns = timeout_s, ns
        self.last = time.monotonic()  # last call of any kind
        threading.Thread(target=self._watch, daemon=True).start()

    def touch(self) -> None:
        self.last = time.monotonic()

    def update(self, state: dict, epoch: int) -> bool:
        """Record `state` of the driver of lease epoch `epoch`; refused (False) for a driver
        superseded by a later epoch."""
        if epoch < self.epoch:
            return False
        self.state, self.epoch, self.last = state, epoch, time.monotonic()
        return True

    def get(self) -> dict:
        self.last = time.monotonic()  # a driver taking over: the janitor waits
        return self.state

    def _watch(self) -> None:
        while time.monotonic() - self.last < self.timeout_s:
            time.sleep(min(1.0, self.timeout_s / 4))
        names = list(self.state.get("actors", {}))
        print(f"event=driver_failover_timeout no driver for {self.timeout_s:g} s: removing "
              f"{len(names)} actor(s) and the placement group", flush=True)
        remove(names, self.ns)
        os._exit(0)


def find(cfg: Config, run, resuming: bool) -> dict | None:
    """The record of this run's detached actors in the cluster, None when there is none (or it
    went away meanwhile). An empty one (`check_record`) is logged in one line and its placement
    group removed (every actor of the run is in it, so they go too): the caller starts as a new
    driver. Call it holding the run's lease (`run_lease`): no other driver runs the run then.
    Raises ConfigError as `check_record` (another run or layout). `run`, `resuming`: as for
    `check_record`."""
    try:
        record = ray.get_actor(RECORD, namespace=namespace(cfg.run_name))
    except ValueError:
        return None
    try:
        state = ray.get(record.get.remote(), timeout=cfg.fault_tolerance.health_timeout_s)
    except ray.exceptions.RayActorError:
        log.warning("driver failover: the record of run %s went away (no driver for "
                    "fault_tolerance.driver_failover_timeout_s): starting as a new driver", cfg.run_name)
        return None
    if not check_record(state, cfg, run, resuming):
        log.warning("driver failover: the record of run %s is empty (its driver died before it recorded "
                    "its actors): removing its placement group, starting as a new driver", cfg.run_name)
        remove([], namespace(cfg.run_name), keep_lease=True)
        return None
    return state


def check_record(state: dict, cfg: Config, run, resuming: bool) -> bool:
    """Whether a new driver reattaches with the record `state` (`DriverFailover.save`): True
    when it is this run's with this layout, False when it is empty (the driver died before its
    first `save`: nothing says who is who). `run`: this driver's RunIdentity (from
    `plan_start`); `resuming`: its id is that of the run's checkpoints, which must be the
    record's. Raises ConfigError when the record is of another run or layout."""
    if not state:
        return False
    theirs = state["run"]
    c = cfg.cluster
    why = []
    if (theirs["name"], theirs["fingerprint"]) != (run.name, run.fingerprint):
        why.append(f"config fingerprint {theirs['fingerprint']} there, {run.fingerprint} here")
    elif resuming and run.id != theirs["id"]:
        why.append(f"the checkpoints in checkpoint.uri are of run {run.id}")
    if [state["num_workers"], state["num_spares"]] != [c.num_workers, c.num_spares]:
        why.append(f"{state['num_workers']} workers + {state['num_spares']} spares there, "
                   f"{c.num_workers} + {c.num_spares} here")
    if why:
        raise ConfigError(f"fault_tolerance.driver_failover: the cluster holds detached actors of run "
                          f"{theirs['id']} in namespace {namespace(cfg.run_name)} ({'; '.join(why)}); "
                          f"`main.py stop --run {cfg.run_name}` removes them, or choose another run_name")
    return True


class DriverFailover:
    """The driver's side: the record actor, kept up to date and touched every second.
    `epoch`: this driver's lease epoch (`run_lease`); a record written by a later one refuses
    this driver's updates."""

    def __init__(self, cfg: Config, epoch: int):
        self.cfg, self.epoch = cfg, epoch
        self.ns = namespace(cfg.run_name)
        ft = cfg.fault_tolerance
        self.record = RunRecord.options(name=RECORD, namespace=self.ns, lifetime="detached",
                                        get_if_exists=True).remote(ft.driver_failover_timeout_s, self.ns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ping, name="driver-failover", daemon=True)
        self._thread.start()

    def _ping(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.record.touch.remote()
            except Exception as e:  # noqa: BLE001 (a failed touch only makes the silence longer)
                log.debug("record touch failed: %s", e)

    def save(self, trainer) -> None:
        """Record the committed step, the run and who is which rank or spare (after a commit)."""
        g, c = trainer.group, self.cfg.cluster
        self.record.update.remote({
            "run": trainer.run.to_dict(), "committed_step": trainer.committed_step,
            "generation": g.generation, "num_workers": c.num_workers, "num_spares": c.num_spares,
            "workers": [g.name_of(s) for s in g.workers], "spares": [g.name_of(s) for s in g.pool.spares],
            "slots": {g.name_of(s): [s.node_ip, s.node_id, s.gpu_ids, s.bundle_index]
                      for s in g.workers + g.pool.spares},
            "holders": {node: g.name_of(h) for node, h in g.holders.items()},
            "actors": {name: True for name in g.names.values()}}, self.epoch)

    def shutdown(self) -> None:
        """The run ended or failed for good: remove the record too (the group removes the rest)."""
        self._stop.set()
        ray.kill(self.record, no_restart=True)
