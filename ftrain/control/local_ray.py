"""What a driver's own local Ray (`cluster.ray_address: null`) leaves behind when the driver
is killed, and how the next driver of the run removes it.

Ray's fate sharing takes the GCS, the raylet and every worker process (the run's actors, so
its placement group too) down at once when the driver that started them dies, even by
SIGKILL. Its dashboard agent and runtime-env agent notice but stay up to 60 s more: they
report the raylet's unexpected death to the dead GCS first, with a 60 s timeout (Ray 2.60,
`ray._private.process_watcher.report_raylet_error_logs`). So a driver records its local Ray's
processes in `run_dir/local_ray.json` (`record`), and the next driver of the run kills what is
left of them before it starts its own Ray (`reap`). A process is named by (pid, start time),
so a reused pid is never killed.

Attached to a cluster (`cluster.ray_address`), nothing is recorded: the run's actors and
placement group are not detached, and Ray removes them when the driver's job ends.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import psutil

from ftrain.config import ConfigError

log = logging.getLogger(__name__)
RECORD = "local_ray.json"


def _same(pid: int, started: float) -> psutil.Process | None:
    """The running process `pid` if it started at `started` (Unix seconds), else None."""
    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - started) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def record(run_dir: str) -> None:
    """Write `run_dir/local_ray.json`: this driver and every process under it (call right
    after starting the local Ray: its GCS, raylet, agents and their helpers)."""
    me = psutil.Process()
    procs = []
    for p in me.children(recursive=True):
        try:
            procs.append([p.pid, p.create_time(), p.name()])
        except psutil.NoSuchProcess:
            pass
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / RECORD).write_text(json.dumps(
        {"driver": [me.pid, me.create_time()], "processes": procs}, indent=1))


def reap(run_dir: str) -> list[str]:
    """Kill (SIGKILL) the recorded processes of the local Ray of this run's previous driver
    that are still running once that driver is gone; returns their names (logged). Raises
    ConfigError when that driver is still running (two drivers would train one run)."""
    path = Path(run_dir) / RECORD
    try:
        rec = json.loads(path.read_text())
        (pid, started), procs = rec["driver"], rec["processes"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if pid == os.getpid():  # an earlier Ray of this very process: Ray's own shutdown ends it
        return []
    if _same(pid, started) is not None:
        raise ConfigError(f"run_dir: {run_dir} belongs to a driver that is still running (pid {pid}); "
                          f"stop it first, or set run_dir (and checkpoint.uri) elsewhere")
    killed = []
    for p_pid, p_started, name in procs:
        p = _same(p_pid, p_started)
        if p is not None:
            try:
                p.kill()
                killed.append(f"{name} (pid {p_pid})")
            except psutil.NoSuchProcess:
                pass
    path.unlink()
    if killed:
        log.warning("event=reap_stale_ray driver_pid=%d killed=%s (left behind by this run's previous "
                    "driver, which is gone)", pid, ", ".join(killed))
    return killed
