"""The driver is a process like any other: SIGKILL `python main.py train` mid-run (after a
checkpoint committed), run the same command again, and it resumes the run and finishes with the
losses of the uninterrupted run; nothing of the dead driver (actors, placement group, Ray
processes) is left once the new one has started. Two ways to run: the driver's own local Ray,
and a driver attached to a running cluster (here: this test's Ray)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

from conftest import uninterrupted_losses

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
# Step 3 is slow (+1 s per micro-batch on rank 0, 2 s: alive, never replaced), so the kill
# lands while the run is still going whatever this machine's speed; the math is untouched.
SETS = ["cluster.num_workers=2", "cluster.num_spares=0", f"train.steps={STEPS}", "checkpoint.interval=2",
        "train.micro_batch_size=4", "chaos.events=[{step: 3, rank: 0, kind: slow, point: step_start}]"]


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    """Losses of the uninterrupted run."""
    return uninterrupted_losses(tmp_path_factory.mktemp("reference"), SETS[:-1], STEPS)


def train_command(run_dir: Path, *sets: str) -> list[str]:
    argv = [sys.executable, "main.py", "train"]
    for s in [*SETS, f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt", *sets]:
        argv += ["--set", s]
    return argv


def start(argv: list[str], run_dir: Path, name: str) -> subprocess.Popen:
    log = open(run_dir.parent / f"{name}.log", "w")
    return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_for(cond, proc: subprocess.Popen, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (found := cond()):
        assert proc.poll() is None, f"the driver exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)
    return found


def kill_after_first_checkpoint(argv: list[str], run_dir: Path, before_kill=lambda: None):
    """Start the driver, SIGKILL it once its step-2 checkpoint is committed; returns every
    process under it just before the kill (its local Ray, if any, and the actors' workers) and
    what `before_kill()` returned then."""
    first = start(argv, run_dir, "first")
    wait_for(lambda: (run_dir / "ckpt" / "step_00000002" / "manifest.json").is_file(), first,
             "checkpoint of step 2")
    procs, seen = psutil.Process(first.pid).children(recursive=True), before_kill()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    return procs, seen


def check_resumed(second: subprocess.Popen, run_dir: Path, reference: dict) -> None:
    assert second.wait(timeout=180) == 0, (run_dir.parent / "second.log").read_text()[-3000:]
    out = json.loads((run_dir / "train.json").read_text())
    resumed = out["resumed_from"]
    assert resumed == 2, out
    assert {int(s): x for s, x in out["losses"].items()} == {s: reference[s] for s in range(resumed + 1, STEPS + 1)}


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.name()} (pid {p.pid})")
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_a_killed_driver_with_its_own_ray_resumes_and_leaves_no_process(reference, tmp_path):
    run_dir = tmp_path / "run"
    argv = train_command(run_dir)
    procs, _ = kill_after_first_checkpoint(argv, run_dir)
    assert any(p.name() == "raylet" for p in procs) and any(p.name() == "gcs_server" for p in procs)
    second = start(argv, run_dir, "second")
    try:
        # The new driver records its own Ray once it is up (after removing what was left).
        wait_for(lambda: json.loads((run_dir / "local_ray.json").read_text())["driver"][0] == second.pid
                 if (run_dir / "local_ray.json").is_file() else False, second, "the new driver's Ray")
        assert alive(procs) == [], "left behind by the killed driver"
        check_resumed(second, run_dir, reference)
    finally:
        if second.poll() is None:
            second.kill()


def test_a_killed_driver_on_a_cluster_leaves_no_actor_or_placement_group(reference, tmp_path):
    """Attached to a running cluster (this test's Ray), the killed driver's actors and placement
    group are not detached: Ray removes them when the driver's job dies."""
    run_dir = tmp_path / "run"
    ours = ray.get_runtime_context().get_job_id()

    def actors(state: str) -> set[str]:
        return {a for a, info in ray._private.state.actors().items()
                if info["State"] == state and info["JobID"] != ours}

    def groups(state: str) -> set[str]:
        return {g for g, info in ray.util.placement_group_table().items() if info["state"] == state}

    argv = train_command(run_dir, f"cluster.ray_address={ray.get_runtime_context().gcs_address}")
    old_groups = groups("CREATED")
    _, (killed_actors, killed_groups) = kill_after_first_checkpoint(
        argv, run_dir, lambda: (actors("ALIVE"), groups("CREATED") - old_groups))
    # 2 rank actors (worker, spare), the node's heartbeat agent, the run's lease (run_lease.py)
    assert len(killed_actors) == 4 and len(killed_groups) == 1
    second = start(argv, run_dir, "second")
    try:
        wait_for(lambda: len(actors("ALIVE") - killed_actors) == 4, second, "the new driver's actors")
        assert actors("ALIVE") & killed_actors == set(), "actors of the killed driver still alive"
        assert groups("CREATED") - old_groups - killed_groups and not groups("CREATED") & killed_groups
        check_resumed(second, run_dir, reference)
    finally:
        if second.poll() is None:
            second.kill()


def test_reap_kills_only_what_a_dead_driver_recorded_and_refuses_a_live_one(tmp_path):
    """`local_ray.reap` against real processes: a recorded driver still running stops the new
    one; once it is gone, its recorded processes still running are killed, a process whose pid
    matches but whose start time does not is left alone."""
    from ftrain.config import ConfigError
    from ftrain.control import local_ray

    driver, leftover, bystander = (subprocess.Popen(["sleep", "60"]) for _ in range(3))
    try:
        def entry(p, skew=0.0):
            q = psutil.Process(p.pid)
            return [q.pid, q.create_time() + skew, q.name()]

        record = {"driver": entry(driver)[:2], "processes": [entry(leftover), entry(bystander, skew=5.0)]}
        (tmp_path / local_ray.RECORD).write_text(json.dumps(record))
        with pytest.raises(ConfigError, match=rf"^run_dir: .* still running \(pid {driver.pid}\)"):
            local_ray.reap(str(tmp_path))
        driver.kill()
        driver.wait()
        assert local_ray.reap(str(tmp_path)) == [f"sleep (pid {leftover.pid})"]
        assert leftover.wait(timeout=10) == -signal.SIGKILL and bystander.poll() is None
        assert not (tmp_path / local_ray.RECORD).exists() and local_ray.reap(str(tmp_path)) == []
    finally:
        for p in (driver, leftover, bystander):
            p.kill()
            p.wait()
