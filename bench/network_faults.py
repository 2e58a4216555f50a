"""Real network faults of a host, on the namespace test bed (`network_testbed.py`; root, Linux).

Three hosts: host 0 runs the Ray head and this driver (no actors), hosts 1 and 2 each a worker
and a spare (2 workers, dp=2, 2 spares). Each fault hits the host of rank 1 on a fresh test bed,
and training runs on to the last step:
- cut_step: its link is cut 0.5 s into step 3 (rank 1 is made slow in that step, so the cut
  lands inside it: the survivor waits in the gradient all-reduce);
- cut_save: its link is cut as the driver sends the checkpoint save of step 2;
- brownout: its link goes through a relay that delays every frame 0.2 s and drops 30 %, both
  directions, from after step 2 on;
- freeze: every process of the host is stopped (SIGSTOP) after step 2;
- kill: every process of the host is killed after step 2.

Each row: `fault`, `kind` (the recovery's label; "" when none), `detect_s` and `total_s` (the
recovery timeline's), `stall_s` (wall clock: from the fault to the end of the run, less a
steady step for each step finished after the fault), `step_deadline_s`, `steps_lost`,
`losses_equal` (bitwise, against a run without fault on the same test bed), `hostname_ip`
(what this machine's hostname resolves to on the test bed).

Usage (repository root, as root): python -m bench.network_faults [--faults cut_step,cut_save,...]
                                                                  [--out bench/results/network_faults_cpu.json]
Prints a table and writes the JSON list of rows.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import actor_env

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ("cut_step", "cut_save", "brownout", "freeze", "kill")
STEPS = 6
CPUS = [0, 2, 2]  # host 0: head and driver only
SETTINGS = ["cluster.num_nodes=2", "cluster.num_workers=2", "cluster.num_spares=2", "cluster.cpus_per_actor=1",
            f"train.steps={STEPS}", "fault_tolerance.health_timeout_s=2", "fault_tolerance.health_interval_s=0.2",
            "fault_tolerance.min_step_timeout_s=10", "fault_tolerance.rendezvous_timeout_s=30",
            "checkpoint.interval=0"]


def make_cfg(run_dir: str, *overrides: str):
    from ftrain.config import load_config, resolve

    return resolve(load_config(str(ROOT / "config.yaml"), [
        *SETTINGS, f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt", *overrides]), num_gpus=0)


def run_case(bed, fault: str | None, run_dir: str) -> dict:
    """Train STEPS steps on the test bed (driver thread already inside host 0), with `fault`
    on the host of rank 1 (None: no fault). Returns the losses and the measurements."""
    import ray

    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    cfg = make_cfg(run_dir, *(["checkpoint.interval=2"] if fault == "cut_save" else []))
    group = ActorGroup(MegatronActor, cfg)
    # The spares warm up in the background (store connect, warm-up step); a fault this early in
    # a run would otherwise meet them still warming: wait until their compute threads are free.
    ray.get([s.handle.noop.remote() for s in group.pool.spares], timeout=120)
    fault_at: list[float] = []
    ends: list[float] = []
    row: dict = {}
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        host = next(i for i, h in enumerate(bed.hosts) if h.ip == group.workers[1].node_ip)

        def hit(action) -> None:
            action(host)
            fault_at.append(time.time())
            row["step_deadline_s"] = round(trainer.step_deadline(), 3)  # the deadline the fault meets

        if fault == "cut_save":
            call = group.call

            def call_with_cut(method, *args, **kw):  # the cut lands as the save is sent
                if method == "save_checkpoint" and not fault_at:
                    hit(bed.cut)
                return call(method, *args, **kw)
            group.call = call_with_cut

        def after_step(tr, step: int) -> None:
            ends.append(time.time())
            if step != 2 or fault_at or fault in (None, "cut_save"):
                return
            if fault == "cut_step":
                group.arm_fault(1, "slow", "step_start")
                threading.Timer(0.5, hit, (bed.cut,)).start()
            else:
                hit({"brownout": lambda i: bed.brownout(i, 0.2, 0.3), "freeze": bed.freeze,
                     "kill": bed.kill}[fault])

        trainer.train(STEPS, after_step)
        row["losses"] = trainer.losses
        if fault is None:
            return row
        steady = trainer.steady_step_s()
        after = [t for t in ends if t > fault_at[0]]
        tl = trainer.recoveries[0] if trainer.recoveries else None
        row.update(fault=fault, kind=tl.kind if tl else "", detect_s=round(tl.detect_s, 3) if tl else None,
                   total_s=round(tl.total_s, 3) if tl else None,
                   stall_s=round(ends[-1] - fault_at[0] - steady * len(after), 3),
                   steps_lost=tl.steps_lost if tl else 0, steady_step_s=round(steady, 4),
                   recoveries=len(trainer.recoveries), timeline=tl.to_dict() if tl else None)
        return row
    finally:
        group.shutdown()


def measure(faults: list[str]) -> list[dict]:
    from ftrain.testbeds.network_testbed import RAY_ENV, TestBed, available

    reason = available()
    if reason:
        raise SystemExit(f"network_faults: {reason}")
    os.environ.update(RAY_ENV)  # before Ray is imported: it reads the auth mode then
    import ray
    env = actor_env(ROOT)
    reference, rows = None, []
    for fault in faults:
        with TestBed(3, prefix="ftnet") as bed, tempfile.TemporaryDirectory(prefix="ftnet-") as tmp:
            bed.start_ray(CPUS, env)
            with bed.enter(0):
                ray.init(address=bed.address, log_to_driver=False, runtime_env={"env_vars": env})
                try:
                    if reference is None:
                        reference = run_case(bed, None, f"{tmp}/ref")["losses"]
                    row = run_case(bed, fault, f"{tmp}/run")
                    row["hostname_ip"] = socket.gethostbyname(socket.gethostname())
                finally:
                    ray.shutdown()
        row["losses_equal"] = row.pop("losses") == reference
        rows.append(row)
        print(f"{fault}: {json.dumps({k: v for k, v in row.items() if k != 'timeline'})}", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {FAULTS}")
    p.add_argument("--out", default=str(ROOT / "bench/results/network_faults_cpu.json"))
    args = p.parse_args(argv)
    faults = args.faults.split(",")
    if not set(faults) <= set(FAULTS):
        raise SystemExit(f"--faults: unknown {sorted(set(faults) - set(FAULTS))}; choose from {FAULTS}")
    sys.path.insert(0, str(ROOT))
    rows = measure(faults)
    cols = ("fault", "kind", "detect_s", "stall_s", "total_s", "step_deadline_s", "steps_lost", "losses_equal")
    print("  ".join(f"{c:>15}" for c in cols))
    for r in rows:
        print("  ".join(f"{str(r[c]):>15}" for c in cols))
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
