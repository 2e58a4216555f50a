"""Driver failover (`fault_tolerance.driver_failover`): SIGKILL the driver of a `main.py train`
run attached to a cluster (this test's Ray) mid-step; the same command again reattaches to the
run's live detached actors: no checkpoint load, no committed step lost, the losses of the
uninterrupted run bitwise; once the run ends no detached actor or placement group of it is
left; the snapshot holders are taken over too. Too few survivors to reattach to, or an empty
record (the driver killed before its first one): what is left is removed and the run resumes
or starts as without failover. Detached actors whose driver does not come back remove
themselves (`driver_failover_timeout_s`), and `main.py stop --run NAME` removes them at once."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from ftrain.config import load_config, resolve
from ftrain.control import driver_failover

from conftest import uninterrupted_losses

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
# Step 3 is slow (+1 s per micro-batch on rank 0: alive, never replaced), so the kill lands
# while step 3 is in flight; the math is untouched.
SETS = ["cluster.num_workers=2", "cluster.num_spares=1", f"train.steps={STEPS}", "checkpoint.interval=2",
        "fault_tolerance.driver_lease_s=3",
        "train.micro_batch_size=4", "chaos.events=[{step: 3, rank: 0, kind: slow, point: step_start}]"]


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    """Losses of the uninterrupted run."""
    return uninterrupted_losses(tmp_path_factory.mktemp("reference"), SETS[:-1], STEPS)


def command(mode: str, run_dir: Path, name: str, *sets: str) -> list[str]:
    """`main.py MODE` of run `name` on this test's Ray; `sets` come last (they override SETS)."""
    argv = [sys.executable, "main.py", mode, "--set", f"cluster.ray_address={ray.get_runtime_context().gcs_address}"]
    if mode == "stop":
        return argv + [a for s in sets for a in ("--set", s)] + ["--run", name]
    for s in [*SETS, f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt", f"run_name={name}",
              "fault_tolerance.driver_failover=true", *sets]:
        argv += ["--set", s]
    return argv


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def record_of(name: str) -> dict:
    try:
        record = ray.get_actor(driver_failover.RECORD, namespace=driver_failover.namespace(name))
        return ray.get(record.get.remote(), timeout=5)
    except (ValueError, ray.exceptions.RayError):
        return {}


def run_to_end(argv: list[str], log: Path, meanwhile=lambda proc: None) -> str:
    """Start the driver (`start`), call `meanwhile(proc)`, and return its log once it exited 0
    within 120 s (fails with the log's tail otherwise; killed if still running)."""
    proc = start(argv, log)
    try:
        meanwhile(proc)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    return log.read_text()


def kill_mid_step_3(argv: list[str], name: str, log: Path) -> None:
    """Start the driver; SIGKILL it once step 2 is committed and recorded, inside step 3."""
    first = start(argv, log)
    deadline = time.monotonic() + 120
    while record_of(name).get("committed_step", 0) < 2:
        assert first.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "step 2 not recorded within 120 s"
        time.sleep(0.05)
    time.sleep(0.5)  # inside the slow step 3
    os.kill(first.pid, signal.SIGKILL)
    first.wait()


def leftovers() -> tuple[list, list]:
    """Detached actors alive and named placement groups not removed (this module's only)."""
    actors = [a["Name"] for a in ray._private.state.actors().values()
              if a["IsDetached"] and a["State"] != "DEAD"]
    groups = [g["name"] for g in ray.util.placement_group_table().values()
              if g["name"] == driver_failover.PLACEMENT_GROUP and g["state"] != "REMOVED"]
    return actors, groups


def wait_clean(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == ([], []), "detached actors or placement group of the run left"


def held_steps(name: str) -> dict[int, set[int]]:
    """rank -> steps of its in-memory snapshots that the run's holders (named in its record) hold."""
    held: dict[int, set[int]] = {}
    for holder in record_of(name).get("holders", {}).values():
        try:
            steps = ray.get(ray.get_actor(holder, namespace=driver_failover.namespace(name)).steps.remote(), timeout=5)
        except (ValueError, ray.exceptions.RayError):
            continue
        for (_, rank), s in steps.items():
            held.setdefault(rank, set()).update(s)
    return held


def wait_held(name: str, step: int, proc: subprocess.Popen | None = None, timeout_s: float = 120) -> None:
    """Until the holders hold both ranks' snapshots of `step` (sent in the background after it);
    fails should `proc` (a driver) exit first."""
    deadline = time.monotonic() + timeout_s
    while not all(step in held_steps(name).get(r, ()) for r in (0, 1)):
        assert proc is None or proc.poll() is None, f"driver ended, holders: {held_steps(name)}"
        assert time.monotonic() < deadline, f"no snapshots of step {step} within {timeout_s} s: {held_steps(name)}"
        time.sleep(0.05)


# In-memory snapshots every step; step 4 slow too, so the snapshot of step 3 (sent in the
# background during step 4) can be seen in the holder before the run ends and removes it.
SNAPSHOTS = ["fault_tolerance.memory_snapshot_interval=1",
             "chaos.events=[{step: 3, rank: 0, kind: slow, point: step_start}, "
             "{step: 4, rank: 0, kind: slow, point: step_start}]"]


@pytest.mark.parametrize("lost_rank", [None, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["all_alive", "rank_1_lost_too"])
def test_a_new_driver_reattaches_to_live_actors_and_loses_no_step(reference, tmp_path, lost_rank):
    """With `lost_rank`, that rank's actor is killed too while no driver runs: the new driver
    replaces it from the spare and restores it from its DP peer, still at the committed step.
    The snapshot holder is taken over too: the ranks' snapshots of step 3 reach it again once
    the new driver has run that step."""
    run_dir, name = tmp_path / "run", f"failover-{lost_rank}"
    argv = command("train", run_dir, name, *SNAPSHOTS)
    kill_mid_step_3(argv, name, tmp_path / "first.log")
    assert len(leftovers()[0]) == 6 and leftovers()[1], \
        "the actors (3, a holder, the record, the lease) must outlive their driver"
    # The ranks finish the step in flight without a driver and send its snapshot: once it is
    # there, empty the holder, so a snapshot of step 3 there later came after the reattach.
    wait_held(name, 3)
    for holder in record_of(name)["holders"].values():
        ray.get(ray.get_actor(holder, namespace=driver_failover.namespace(name)).clear.remote())
    assert held_steps(name) == {}
    if lost_rank is not None:
        actor = record_of(name)["workers"][lost_rank]
        ray.kill(ray.get_actor(actor, namespace=driver_failover.namespace(name)), no_restart=True)
    log = run_to_end(argv, tmp_path / "second.log", lambda second: wait_held(name, 3, second))
    replaced = [] if lost_rank is None else [lost_rank]
    assert "event=reattach" in log and f"step=2 committed=2 replaced={replaced} source=peer" in log, log[-3000:]
    assert "event=resume" not in log and "event=start" not in log  # no checkpoint loaded
    out = json.loads((run_dir / "train.json").read_text())
    assert out["resumed_from"] == 2 and out["replayed"] == {}
    assert {int(s): x for s, x in out["losses"].items()} == {s: reference[s] for s in (3, 4)}
    wait_clean(10)


def losses_of(run_dir: Path) -> dict[int, float]:
    return {int(s): x for s, x in json.loads((run_dir / "train.json").read_text())["losses"].items()}


def test_two_drivers_started_at_once_exactly_one_drives_the_run(reference, tmp_path):
    """The driver SIGKILLed mid-step, then the same command started twice at once: the run's
    lease (`run_lease`) goes to one of them, which reattaches and ends the run with the
    uninterrupted run's losses; the other exits 2 with one line, touching nothing."""
    run_dir, name = tmp_path / "run", "twice"
    argv = command("train", run_dir, name)
    kill_mid_step_3(argv, name, tmp_path / "first.log")
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [start(argv, log) for log in logs]
    codes = [p.wait(timeout=120) for p in procs]
    assert sorted(codes) == [0, 2], [log.read_text()[-2000:] for log in logs]
    winner, loser = (logs[0], logs[1]) if codes[0] == 0 else (logs[1], logs[0])
    lines = [line for line in loser.read_text().splitlines() if "another driver of this run" in line]
    assert len(lines) == 1 and lines[0].startswith("config error: run_name=twice: "), loser.read_text()[-2000:]
    assert "Traceback" not in loser.read_text() and "event=reattach" not in loser.read_text()
    assert "event=reattach" in winner.read_text(), winner.read_text()[-3000:]
    assert losses_of(run_dir) == {s: reference[s] for s in (3, 4)}
    wait_clean(10)


@pytest.mark.slow
def test_a_stalled_driver_taken_over_stops_and_leaves_the_run_to_the_new_one(reference, tmp_path):
    """The driver SIGSTOPped mid-step for longer than its lease: a second driver takes the run
    over (a later lease epoch, so later generations), and once the first runs again its calls
    are refused (the actors joined the later generation), its record updates and commits too:
    it exits 2 with one line, leaving the actors alone; the second ends the run with the
    uninterrupted run's losses."""
    run_dir, name = tmp_path / "run", "stalled"
    argv = command("train", run_dir, name)
    first = start(argv, tmp_path / "first.log")
    deadline = time.monotonic() + 120
    while record_of(name).get("committed_step", 0) < 2:
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(0.5)  # inside the slow step 3
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = start(argv, tmp_path / "second.log")
        while "event=reattach" not in (tmp_path / "second.log").read_text():
            assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "second.log").read_text()[-3000:]
            time.sleep(0.05)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=60) == 2, (tmp_path / "first.log").read_text()[-3000:]
    assert "driver superseded: " in (tmp_path / "first.log").read_text()
    assert second.wait(timeout=120) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert losses_of(run_dir) == {s: reference[s] for s in (3, 4)}
    wait_clean(10)


@pytest.mark.slow
def test_too_few_survivors_are_removed_and_the_run_resumes_from_its_checkpoint(reference, tmp_path):
    """Both ranks killed while no driver runs, one spare left: no reattach (CannotReattach);
    the new driver removes what is left, places new actors and resumes from the checkpoint of
    step 2 with the losses of the uninterrupted run; nothing of either driver is left."""
    run_dir, name = tmp_path / "run", "too-few"
    kill_mid_step_3(command("train", run_dir, name), name, tmp_path / "first.log")
    old = record_of(name)
    for actor in old["workers"]:
        ray.kill(ray.get_actor(actor, namespace=driver_failover.namespace(name)), no_restart=True)
    # No slow step 3 this time (nothing to kill in it); chaos is not part of the run's math.
    log = run_to_end(command("train", run_dir, name, "chaos.events=[]"), tmp_path / "second.log")
    assert "cannot reattach (2 rank(s) of the run did not survive its driver and 1 spare(s) did): " \
           "removing what is left, starting as a new driver" in log, log[-3000:]
    assert "event=reattach" not in log and "event=resume" in log, log[-3000:]
    out = json.loads((run_dir / "train.json").read_text())
    assert out["run"] == old["run"]["id"] and out["resumed_from"] == 2
    assert {int(s): x for s, x in out["losses"].items()} == {s: reference[s] for s in (3, 4)}
    wait_clean(10)


@pytest.mark.slow
def test_a_driver_dead_before_its_first_record_leaves_nothing_to_the_next(reference, tmp_path):
    """The driver SIGKILLed once its record actor and some of its detached actors exist but it
    has recorded nothing yet: the next driver says so in one line, removes them and starts the
    run as a new driver, with the losses of the uninterrupted run; nothing is left after it."""
    run_dir, name = tmp_path / "run", "unrecorded"
    argv = command("train", run_dir, name, "chaos.events=[]")  # no step to slow down: the kill is before step 1
    first = start(argv, tmp_path / "first.log")
    ns, deadline = driver_failover.namespace(name), time.monotonic() + 120

    def unrecorded() -> bool:
        try:
            ray.get_actor(driver_failover.RECORD, namespace=ns)
        except ValueError:
            return False
        return not record_of(name) and len(leftovers()[0]) > 1

    while not unrecorded():
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no detached actor within 120 s"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert record_of(name) == {}, "killed too late: the driver recorded its actors"
    log = run_to_end(argv, tmp_path / "second.log")
    assert "its driver died before it recorded its actors" in log and "event=start" in log, log[-3000:]
    out = json.loads((run_dir / "train.json").read_text())
    assert out["resumed_from"] is None and {int(s): x for s, x in out["losses"].items()} == reference
    wait_clean(10)


@pytest.mark.slow
def test_detached_actors_without_a_driver_remove_themselves_and_stop_removes_them(ray_session, tmp_path):
    run_dir, name = tmp_path / "run", "orphan"
    argv = command("train", run_dir, name, "fault_tolerance.driver_failover_timeout_s=4")
    kill_mid_step_3(argv, name, tmp_path / "first.log")
    t0 = time.monotonic()
    assert len(leftovers()[0]) == 5
    wait_clean(20)
    assert time.monotonic() - t0 > 1.0  # not at once: they wait for a driver first
    # `stop` removes them at once (the timeout would be 300 s).
    argv = command("train", tmp_path / "run2", "stopped")
    kill_mid_step_3(argv, "stopped", tmp_path / "again.log")
    assert len(leftovers()[0]) == 5
    stop = subprocess.run(command("stop", run_dir, "stopped"), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and "removed 3 detached actor(s)" in stop.stdout, stop.stdout + stop.stderr
    wait_clean(10)


def test_detached_actors_of_another_run_stop_the_driver_in_one_line_and_are_left_alone(ray_session, tmp_path):
    """A record of another config under the same run_name: ConfigError naming both, nothing touched."""
    from ftrain.config import ConfigError
    from ftrain.state.run_identity import RunIdentity

    cfg = resolve(load_config("config.yaml", [*SETS[:-1], f"run_dir={tmp_path}", "run_name=clash",
                                              "fault_tolerance.driver_failover=true"]), num_gpus=0)
    other = resolve(load_config("config.yaml", [*SETS[:-1], f"run_dir={tmp_path}", "run_name=clash",
                                                "train.seed=7"]), num_gpus=0)
    record = driver_failover.RunRecord.options(name=driver_failover.RECORD, namespace=driver_failover.namespace("clash"),
                                               lifetime="detached").remote(60.0, driver_failover.namespace("clash"))
    try:
        ray.get(record.update.remote({"run": RunIdentity.new(other).to_dict(), "committed_step": 3,
                                      "num_workers": 2, "num_spares": 1}, 1))
        with pytest.raises(ConfigError, match=r"^fault_tolerance.driver_failover: .* run clash-.* "
                                              r"\(config fingerprint .*\); `main.py stop --run clash` removes them"):
            driver_failover.find(cfg, RunIdentity.new(cfg), resuming=False)
        assert ray.get(record.get.remote())["committed_step"] == 3  # left alone
    finally:
        ray.kill(record, no_restart=True)


def test_a_record_is_reattached_to_only_when_it_names_this_runs_actors(tmp_path):
    """`check_record` (no cluster): an empty record (its driver died before its first save) means
    start as a new driver; a record of this run (even one written before step 1) means reattach;
    another run id than the checkpoints', or another layout, stops the driver."""
    from ftrain.config import ConfigError
    from ftrain.state.run_identity import RunIdentity

    cfg = resolve(load_config("config.yaml", [*SETS[:-1], f"run_dir={tmp_path}", "run_name=decide",
                                              "fault_tolerance.driver_failover=true"]), num_gpus=0)
    run = RunIdentity.new(cfg)
    first = {"run": run.to_dict(), "committed_step": 0, "generation": 1, "num_workers": 2, "num_spares": 1,
             "workers": ["actor-0-a", "actor-1-b"], "spares": ["actor-2-c"], "slots": {}, "holders": {}, "actors": {}}
    assert driver_failover.check_record({}, cfg, run, resuming=False) is False
    assert driver_failover.check_record({}, cfg, run, resuming=True) is False
    assert driver_failover.check_record(first, cfg, run, resuming=False) is True
    assert driver_failover.check_record(first, cfg, run, resuming=True) is True
    with pytest.raises(ConfigError, match=r"the checkpoints in checkpoint.uri are of run decide-"):
        driver_failover.check_record(first, cfg, RunIdentity.new(cfg), resuming=True)
    with pytest.raises(ConfigError, match=r"\(2 workers \+ 2 spares there, 2 \+ 1 here\)"):
        driver_failover.check_record({**first, "num_spares": 2}, cfg, run, resuming=False)


def test_an_actor_no_driver_ever_pinged_leaves_its_run_alone(ray_session, tmp_path):
    """A spare still being built when its driver died is in no record, so the driver that
    reattached never pings it: when its watchdog fires it exits alone and the run's placement
    group stays. An actor a driver did ping removes the placement group (no GPU kept)."""
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from megatron_actor import MegatronActor

    cfg = resolve(load_config(ROOT / "config.yaml", ["fault_tolerance.driver_failover=true",
                                                      "fault_tolerance.driver_failover_timeout_s=2",
                                                      f"run_dir={tmp_path}"]), num_gpus=0)
    pg = placement_group([{"CPU": 0.01}] * 2, name=driver_failover.PLACEMENT_GROUP)
    ray.get(pg.ready())

    def actor(bundle: int):
        return MegatronActor.options(num_cpus=0.01, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle)
                                     ).remote(cfg, bundle)

    def state() -> str:
        return placement_group_table(pg)["state"]

    try:
        orphan = actor(0)
        ray.get(orphan.info.remote())  # started (its watchdog runs), never pinged
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(orphan.__ray_call__.remote(lambda a: time.sleep(30)), timeout=30)
        assert state() == "CREATED"
        pinged = actor(1)
        ray.get(pinged.ping.remote())
        deadline = time.monotonic() + 30
        while state() != "REMOVED":
            assert time.monotonic() < deadline, "the pinged actor's watchdog did not remove the placement group"
            time.sleep(0.1)
    finally:
        if state() != "REMOVED":
            ray.util.remove_placement_group(pg)


def test_one_driver_holds_a_runs_lease_a_lapsed_one_goes_to_the_next_with_a_later_epoch(ray_session):
    """`run_lease` against a real lease actor: a second driver of a run whose driver renews its
    lease waits once, then stops (LeaseHeld); once the holder stops renewing, the lease lapses
    and the next driver takes it with the next epoch, whose generations lie above the first's;
    the first's renewal and its check before a commit are refused from then on (LeaseLost)."""
    from ftrain.control.run_lease import DriverLease, LeaseHeld, LeaseLost
    from ftrain.failures import first_generation

    ns = driver_failover.namespace("lease-unit")
    first, second = DriverLease(ns, 3.0, detached=True), DriverLease(ns, 3.0, detached=True)
    try:
        assert first.claim() == 1
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld, match=r"another driver of this run \(.*\) still renews it: one driver per run"):
            second.claim()
        assert time.monotonic() - t0 >= 3.0  # it waited for the lease to lapse first
        first._stop.set()  # the first driver stalls: no renewal
        assert second.claim() == 2 and first_generation(2) > first_generation(1) + 1000
        with pytest.raises(LeaseLost, match="lapsed and another driver took the run over"):
            first.check()
        second.check()  # the holder's check passes
    finally:
        second.release(remove=True)


def test_an_empty_record_is_not_reattached_to(ray_session, tmp_path):
    """A record no driver wrote into (its driver died before its first `save`): the new driver
    starts afresh."""
    cfg = resolve(load_config(ROOT / "config.yaml", ["fault_tolerance.driver_failover=true", "run_name=empty-record",
                                                      f"run_dir={tmp_path}"]), num_gpus=0)
    ns = driver_failover.namespace(cfg.run_name)
    silent = driver_failover.RunRecord.options(name=driver_failover.RECORD, namespace=ns, lifetime="detached").remote(60, ns)
    try:
        assert ray.get(silent.get.remote(), timeout=60) == {}  # started
        assert driver_failover.find(cfg, None, False) is None
    finally:
        ray.kill(silent, no_restart=True)
