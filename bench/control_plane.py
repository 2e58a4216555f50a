"""Control-plane benchmark: driver cost and recovery control time for N = 64 .. 1024 ranks.

The rank actors' engine does no math (`bench.control_rank.ControlRank`): this measures the
control plane only. The actors keep the real paths the driver uses: heartbeats (`ping`,
through one `node_agent.NodeAgent` per logical node of `--ranks-per-node` ranks), step calls
waited on by `health.HealthMonitor.wait` (batch put once: `dispatch.dispatch_remote`), the
join barrier through the driver's TCPStore (`rendezvous`; no process group is made), the
abort round (`HealthMonitor.abort_survivors`) and the restore plan (the survivors' rollback
round, then `fault_tolerance.plan_restore`). Logical nodes: every actor runs on this Ray node
(num_cpus=0); the heartbeats group them into nodes of `--ranks-per-node` ranks, each with its
agent, as on a cluster of 8-GPU nodes.

Per N: driver CPU seconds (`time.process_time`: every thread of the driver process, the
heartbeat thread and Ray's included) per step and per heartbeat round (an idle window divided
by the rounds in it); detect for a killed rank (`ray.kill` while every rank is in a held step,
until `WorkerFailure`) and for a silent one (SIGSTOP); abort; rebuild (the barrier of a new
generation with a spare in the killed rank's place); the restore plan; recovery control =
detect (killed) + abort + rebuild + plan. Growth exponent: the log-log slope of driver CPU per
step against N.

Memory: an actor that joins through the store imports torch (~200 MB PSS each); `--no-store`
skips the barrier (no torch in the actors, ~50 MB each) so that 1,024 ranks fit one host.

Usage (repository root): python -m bench.control_plane [--sizes 64 256 1024] [--ranks-per-node 8]
    [--steps 20] [--idle-s 5] [--health-timeout-s 3] [--no-store] [--out FILE]
Prints a table and writes bench/results/control_plane_cpu.json (top level: sizes,
driver_cpu_per_step_s, driver_cpu_per_round_s, recovery_control_s, detect_kill_s,
detect_silent_s, abort_s, rebuild_s, restore_plan_s, growth_exponent_driver_cpu, device, ...).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import time
from pathlib import Path

import ray

from actor_slot import ActorSlot
from bench import write_json
from bench.control_rank import ControlRank
from bench.scale import loglog_slope
from config import load_config
from dispatch import dispatch_remote
from failures import WorkerFailure
from fault_tolerance import plan_restore
from health import Heartbeats, HealthMonitor
from node_agent import NodeAgent
from parallel_dims import ParallelDims

ROOT = Path(__file__).resolve().parent.parent
NOTE = "control plane only: the rank actors' engine does no math"
SPARES = 2
HOLD_S = 120.0  # a held step (a rank in a collective) lasts until an abort frees it


class Run:
    """N ranks + SPARES spares, their agents, the driver's store and health monitor."""

    def __init__(self, n: int, args, ft):
        self.n, self.args, self.ft = n, args, ft
        self.generation = 0
        ip, node = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        actors = [ControlRank.remote(ft.rendezvous_timeout_s) for _ in range(n + SPARES)]
        self.pids = ray.get([a.pid.remote() for a in actors])
        rpn = args.ranks_per_node
        slots = [ActorSlot(a, ip, node, [], i) for i, a in enumerate(actors)]
        # Heartbeats see logical nodes; raylet checks (`lost_ranks`) see the real one.
        self.logical = {s.bundle_index: ActorSlot(s.handle, ip, f"node{s.bundle_index // rpn}", [], s.bundle_index)
                        for s in slots}
        self.agents = {f"node{k}": NodeAgent.remote(ft.health_interval_s / 2)
                       for k in range((n + SPARES + rpn - 1) // rpn)}
        self.workers, self.spares = slots[:n], slots[n:]
        self.health = HealthMonitor(ft, lambda: self.workers, lambda: self.spares, lambda: self.generation)
        self.health.beats = Heartbeats(lambda: [self.logical[s.bundle_index] for s in self.workers + self.spares],
                                       ft.health_interval_s, ft.health_timeout_s, lambda: self.agents)
        self.store = None
        if not args.no_store:
            import torch.distributed as dist
            self.store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=ft.rendezvous_timeout_s))
        self.host = None if self.store is None else ip
        if self.store is not None:
            ray.get([a.connect.remote(ip, self.store.port) for a in actors])
        self.health.start()

    def join(self) -> float:
        """Form the next generation (the barrier through the store). Returns seconds."""
        t0 = time.monotonic()
        self.generation += 1
        port = 0 if self.store is None else self.store.port
        self.health.wait([s.handle.join.remote(self.generation, r, self.n, self.host, port)
                          for r, s in enumerate(self.workers)], self.ft.rendezvous_timeout_s)
        return time.monotonic() - t0

    def step(self, step: int, batch, hold_s: float = 0.0) -> list:
        dims = ParallelDims(tp=1, pp=1, cp=1, dp=self.n)
        return dispatch_remote([s.handle for s in self.workers], "train_step", dims, "pass_through",
                               self.generation, step, batch, hold_s, put=ray.put)

    def fail(self, rank: int, how: str) -> tuple[float, WorkerFailure]:
        """Hold every rank in a step, then kill (or SIGSTOP) `rank`; seconds until detected."""
        refs = self.step(10_000, list(range(64)), HOLD_S)
        time.sleep(1.0)  # every rank inside its held step
        t0 = time.monotonic()
        if how == "kill":
            ray.kill(self.workers[rank].handle)
        else:
            os.kill(self.pids[self.workers[rank].bundle_index], signal.SIGSTOP)
        try:
            self.health.wait(refs, HOLD_S)
        except WorkerFailure as failure:
            return time.monotonic() - t0, failure
        raise RuntimeError(f"{how} of rank {rank} was not detected")

    def recover(self, failure: WorkerFailure) -> dict[str, float]:
        """Abort the survivors, put spares in the failed ranks' places, form a generation,
        plan the restore. Seconds by phase."""
        t0 = time.monotonic()
        failed = set(failure.ranks) | self.health.abort_survivors(set(failure.ranks))
        t1 = time.monotonic()
        for r in sorted(failed):
            self.workers[r] = self.spares.pop(0)
        rebuild = self.join()
        t2 = time.monotonic()
        survivors = set(range(self.n)) - failed
        ranks = sorted(survivors)
        done = self.health.wait([self.workers[r].handle.rollback.remote(self.generation, 0) for r in ranks],
                                self.ft.step_timeout_s, ranks)
        clean = {r for r, ok in zip(ranks, done) if ok}
        plan = plan_restore("auto", 0, [list(range(self.n))], survivors, clean, None, lambda: 0)
        assert plan.source == "peer", plan
        return {"abort_s": t1 - t0, "rebuild_s": rebuild, "restore_plan_s": time.monotonic() - t2}

    def close(self) -> None:
        self.health.stop()
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for s in self.logical.values():
            ray.kill(s.handle)
        for a in self.agents.values():
            ray.kill(a)


def measure(n: int, args, ft) -> dict:
    run = Run(n, args, ft)
    try:
        run.join()
        batch = list(range(64))
        for s in range(3):  # warm: first calls, heartbeats settled
            run.health.wait(run.step(s, batch), ft.step_timeout_s)
        c0 = time.process_time()
        for s in range(args.steps):
            run.health.wait(run.step(s, batch), ft.step_timeout_s)
        cpu_step = (time.process_time() - c0) / args.steps
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(args.idle_s)
        cpu_round = (time.process_time() - c0) / ((time.monotonic() - w0) / ft.health_interval_s)
        detect_kill, failure = run.fail(1, "kill")
        phases = run.recover(failure)
        detect_silent, failure = run.fail(2, "stop")
        run.health.abort_survivors(set(failure.ranks))
    finally:
        run.close()
    return {"n": n, "driver_cpu_per_step_s": cpu_step, "driver_cpu_per_round_s": cpu_round,
            "detect_kill_s": detect_kill, "detect_silent_s": detect_silent, **phases,
            "recovery_control_s": detect_kill + sum(phases.values())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--health-timeout-s", type=float, default=3.0)
    p.add_argument("--health-interval-s", type=float, default=0.5)
    p.add_argument("--no-store", action="store_true", help="skip the join barrier (no torch in the actors)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "control_plane_cpu.json"))
    args = p.parse_args(argv)
    ft = load_config(str(ROOT / "config.yaml"), [
        f"fault_tolerance.health_timeout_s={args.health_timeout_s}",
        f"fault_tolerance.health_interval_s={args.health_interval_s}",
        "fault_tolerance.rendezvous_timeout_s=120", "fault_tolerance.step_timeout_s=120"]).fault_tolerance
    print(NOTE)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_IGNORE_UNHANDLED_ERRORS": "1"}})
    rows = []
    for n in args.sizes:
        rows.append(measure(n, args, ft))
        print({k: round(v, 4) for k, v in rows[-1].items()}, flush=True)
    keys = [k for k in rows[0] if k != "n"]
    result = {"note": NOTE, "sizes": [r["n"] for r in rows], **{k: [round(r[k], 5) for r in rows] for k in keys},
              "growth_exponent_driver_cpu": round(loglog_slope([r["n"] for r in rows],
                                                               [r["driver_cpu_per_step_s"] for r in rows]), 3),
              "growth_exponent_driver_cpu_per_round": round(loglog_slope([r["n"] for r in rows],
                                                                         [r["driver_cpu_per_round_s"] for r in rows]), 3),
              "device": f"cpu: {os.cpu_count()} cores ({platform.node()})",
              "settings": {"ranks_per_node": args.ranks_per_node, "steps": args.steps, "idle_s": args.idle_s,
                           "health_timeout_s": args.health_timeout_s, "health_interval_s": args.health_interval_s,
                           "join_through_store": not args.no_store}}
    print(f"{'N':>6} " + " ".join(f"{k[:16]:>16}" for k in keys))
    for r in rows:
        print(f"{r['n']:>6} " + " ".join(f"{r[k]:>16.4f}" for k in keys))
    print(f"growth exponent of driver CPU per step: {result['growth_exponent_driver_cpu']}; "
          f"per round: {result['growth_exponent_driver_cpu_per_round']}  ({NOTE})")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
