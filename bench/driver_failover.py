"""Driver killed -> training resumed, three ways, in one run on CPU: reattach to the live detached
actors (`fault_tolerance.driver_failover`), resume from the newest checkpoint, restart from step 0.

This process hosts a local Ray (the "cluster"); each case runs `main.py train` as a driver
attached to it, SIGKILLs it once step KILL_AT is committed (while step KILL_AT + 1, slowed down, is in flight)
and starts the same command again (`--fresh` for the full restart). `<case>_s`: seconds from the
SIGKILL to the new driver's first committed step (its `event=step` log line, timestamped here
as it arrives; includes the new driver's start, Ray attach, actor start-up or takeover and
state restore); `<case>_steps_lost`: committed steps that are computed again
(committed at the kill - the step the new driver went on from); `<case>_caught_up_s`: seconds
from the SIGKILL until the step that was in flight is committed again (the lost steps redone).
Usage (repository root): python -m bench.driver_failover [--out bench/results/driver_failover_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import actor_env  # noqa: E402
from ftrain.control import driver_failover  # noqa: E402

STEPS, KILL_AT, INTERVAL = 10, 6, 4
SETS = ["cluster.num_workers=2", "cluster.num_spares=1", f"train.steps={STEPS}",
        f"checkpoint.interval={INTERVAL}", "train.micro_batch_size=4"]
STEP = re.compile(r"event=step step=(\d+)")


class Driver:
    """A `main.py train` subprocess whose `event=step` lines are timestamped as they arrive."""

    def __init__(self, argv: list[str], log: Path):
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.steps: list[tuple[int, float]] = []  # (step, time.monotonic() it was logged)
        self.lines: list[str] = []
        self._log = open(log, "w")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            self.lines.append(line)
            if m := STEP.search(line):
                self.steps.append((int(m.group(1)), time.monotonic()))

    def wait_step(self, step: int, timeout_s: float = 180) -> float:
        deadline = time.monotonic() + timeout_s
        while not any(s >= step for s, _ in self.steps):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the reader may be behind
                if not any(s >= step for s, _ in self.steps):
                    raise RuntimeError(f"driver exited {self.proc.returncode} before step {step}:\n"
                                       + "".join(self.lines[-40:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"no step {step} within {timeout_s} s")
            time.sleep(0.01)
        return next(t for s, t in self.steps if s >= step)


def argv(run_dir: Path, name: str, address: str, *sets: str) -> list[str]:
    out = [sys.executable, "main.py", "train"]
    for s in [*SETS, f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt", f"run_name={name}",
              f"cluster.ray_address={address}", *sets]:
        out += ["--set", s]
    return out


def committed(name: str) -> int:
    try:
        record = ray.get_actor(driver_failover.RECORD, namespace=driver_failover.namespace(name))
        return ray.get(record.get.remote(), timeout=5).get("committed_step", 0)
    except (ValueError, ray.exceptions.RayError):
        return 0


def case(kind: str, work: Path, address: str) -> dict:
    run_dir, name = work / kind / "run", f"bench-{kind}"
    sets = ["fault_tolerance.driver_failover=true"] if kind == "reattach" else []
    command = argv(run_dir, name, address, *sets)
    # Step KILL_AT + 1 is slow in the first driver only (+1 s per micro-batch on rank 0; the math
    # is untouched), so the kill lands inside it whatever this machine's speed.
    slow = f"chaos.events=[{{step: {KILL_AT + 1}, rank: 0, kind: slow, point: step_start}}]"
    first = Driver(command + ["--set", slow], work / f"{kind}-first.log")
    first.wait_step(KILL_AT)
    while kind == "reattach" and committed(name) < KILL_AT:  # recorded for the next driver
        time.sleep(0.01)
    killed_at = max(s for s, _ in first.steps)
    t_kill = time.monotonic()
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    second = Driver(command + (["--fresh"] if kind == "full_restart" else []), work / f"{kind}-second.log")
    t_step = second.wait_step(1)
    first_step = next(s for s, _ in second.steps)
    t_back = second.wait_step(killed_at + 1)
    if second.proc.wait(timeout=300) != 0:
        raise RuntimeError(f"{kind}: second driver exited {second.proc.returncode}:\n" + "".join(second.lines[-40:]))
    out = json.loads((run_dir / "train.json").read_text())
    resumed = out["resumed_from"] or 0
    reattached = any("event=reattach" in line for line in second.lines)
    return {"seconds": round(t_step - t_kill, 3), "caught_up_s": round(t_back - t_kill, 3), "steps_lost": killed_at - resumed, "killed_at_step": killed_at,
            "went_on_from": resumed, "first_step_after": first_step, "reattached": reattached,
            "losses": out["losses"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench/results/driver_failover_cpu.json"))
    args = p.parse_args()
    os.environ.update(actor_env(ROOT))
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": actor_env(ROOT)})
    address = ray.get_runtime_context().gcs_address
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("reattach", "checkpoint_resume", "full_restart"):
            results[kind] = case(kind, Path(tmp), address)
            print(f"{kind}: {results[kind]['seconds']:.2f} s, steps lost {results[kind]['steps_lost']}", flush=True)
    ray.shutdown()
    same = results["reattach"]["losses"] == {k: v for k, v in results["full_restart"]["losses"].items()
                                            if int(k) in map(int, results["reattach"]["losses"])}
    summary = {
        "reattach_s": results["reattach"]["seconds"], "reattach_steps_lost": results["reattach"]["steps_lost"],
        "checkpoint_resume_s": results["checkpoint_resume"]["seconds"],
        "checkpoint_resume_steps_lost": results["checkpoint_resume"]["steps_lost"],
        "full_restart_s": results["full_restart"]["seconds"],
        "full_restart_steps_lost": results["full_restart"]["steps_lost"],
        **{f"{k}_caught_up_s": results[k]["caught_up_s"] for k in results},
        "reattach_losses_equal_full_restart": same,
        "device": "cpu", "date": time.strftime("%Y-%m-%d"),
        "setup": {"workers": 2, "spares": 1, "steps": STEPS, "killed_after_step": KILL_AT,
                  "checkpoint_interval": INTERVAL, "config": "config.yaml + " + " ".join(SETS)},
        "definition": "<case>_s: seconds from the driver's SIGKILL to the new driver's first committed step; "
                      "steps lost: committed steps computed again; caught_up_s: from the SIGKILL until "
                      "the step in flight at the kill is committed again",
        "cases": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}, indent=1))


if __name__ == "__main__":
    main()
