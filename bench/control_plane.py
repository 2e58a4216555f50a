"""Control-plane benchmark: driver cost and recovery control time for N = 64 .. 1024 ranks.

The rank actors' engine does no math (`bench.control_rank.ControlRank`): this measures the
control plane only. The actors keep the real paths the driver uses: heartbeats (`ping`,
through one `node_agent.NodeAgent` per logical node of `--ranks-per-node` ranks, the agents in
their fan-out tree of arity `--fanout`: `agent_tree`), step calls sent through that tree
(`node_agent.NodeCalls`, as `ActorGroup.call` sends them: one call per root, the call's
arguments cut once, each agent forwarding it to its children and deriving its ranks' own with
`MeshDispatch.for_rank` over dims of tp=`--tp`, dp=N/tp, and answering with the one result per
DP replica the driver collects, its children's merged in) and waited on by
`health.HealthMonitor.wait` (batch put once), the
join barrier through the driver's TCPStore (`rendezvous`; no process group is made), the
abort round (`HealthMonitor.abort_survivors`) and the restore plan (the survivors' rollback
round, then `fault_tolerance.plan_restore`). Logical nodes: every actor runs on this Ray node
(num_cpus=0); the heartbeats group them into nodes of `--ranks-per-node` ranks, each with its
agent, as on a cluster of 8-GPU nodes.

Per N: driver CPU seconds (`time.process_time`: every thread of the driver process, the
heartbeat thread and Ray's included) per step through the tree and, on the same actors, through
the flat tree (`*_flat_s`: the driver calls every agent, as before the tree) and with
`--direct` one call per rank from the driver (`*_direct_s`: before the agents carried steps),
and per heartbeat round (an idle window divided by the rounds in it; tree and flat); per step
also the calling thread's CPU alone (`driver_thread_cpu_*`: the driver's own work: split,
send, wait, judge) and the process's less its idle rate over the step's wall time
(`driver_cpu_per_step_net*`: without the heartbeats that run meanwhile, which grow with the
step's wall time on an oversubscribed host); detect for a killed rank (`ray.kill` while every
rank is in a held step, until `WorkerFailure`) and for a silent one (SIGSTOP), both through the tree; abort; rebuild
(the barrier of a new generation with a spare in the killed rank's place); the restore plan;
recovery control = detect (killed) + abort + rebuild + plan. Growth exponent: the log-log slope of driver CPU per
step (and per round) against N, tree and flat. `--profile` prints the top functions (cProfile, CPU seconds of the calling thread) of each
steps phase.

Memory: per N, the proportional set size (PSS: shared pages split between the processes that
map them) of the rank actors (a sample), an agent and the driver. An actor that joins through
the store imports torch for its TCPStore client; `--no-store` skips the barrier (no torch in
the actors). A size whose projected rank PSS (the previous size's per-actor PSS times N)
exceeds 90% of MemAvailable is skipped and recorded, and so is one whose projected threads
(the previous size's threads per actor times the actors, each thread taking a pid) would take
the threads on the host past 95% of the smallest of kernel.pid_max, kernel.threads-max and the
cgroup's pids.max. Every actor runs with `ACTOR_ENV` (Ray's gRPC thread pools of one thread,
one BLAS / OpenMP thread): threads per rank actor and per agent are recorded.

Robust to a cut run: one progress line per phase per size (flushed), the JSON rewritten after
every size, and every phase run under `--phase-timeout-s`: a phase past it is recorded as that
size's failure (`failures` in the JSON) and the next size runs. Actors start in batches of
`--start-batch`, one line per batch.

Usage (repository root): python -m bench.control_plane [--sizes 64 256 1024] [--ranks-per-node 8]
    [--fanout 16] [--tp 1] [--steps 20] [--idle-s 5] [--health-timeout-s 3] [--no-store] [--direct]
    [--phase-timeout-s 180] [--start-batch 128] [--profile] [--out FILE]
Prints a table and writes bench/results/control_plane_cpu.json (top level: sizes (those
measured to the end), per size each of KEYS (driver_cpu_per_step_s and _flat_s, _direct_s,
driver_thread_cpu_per_step_s ..., driver_cpu_per_round_s and _flat_s, detect_kill_s,
detect_silent_s, abort_s, rebuild_s, restore_plan_s, recovery_control_s, start_s, rank_pss_mb,
agent_pss_mb, driver_pss_mb, rank_threads, agent_threads, tree_depth), growth_exponent_* of the
per-step and per-round CPU, failures, device, settings (actor_env among them)).
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import platform
import pstats
import signal
import sys
import threading
import time
from pathlib import Path

import ray

from bench import actor_env, write_json
from bench.control_rank import ControlRank
from bench.scale import loglog_slope, mem_available_gb, pss_mb
from dispatch import MeshDispatch
from ftrain.config import load_config
from ftrain.control.actor_slot import ActorSlot
from ftrain.control.agent_tree import FANOUT, depth
from ftrain.control.health import HealthMonitor
from ftrain.control.node_agent import NodeAgent, NodeCalls
from ftrain.distributed.fanout import dispatch_remote
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.failures import WorkerFailure
from ftrain.recovery.fault_tolerance import plan_restore
from ftrain.trainer import freeze_heap

ROOT = Path(__file__).resolve().parent.parent
NOTE = "control plane only: the rank actors' engine does no math"
SPARES = 2
HOLD_S = 120.0  # a held step (a rank in a collective) lasts until an abort frees it
PSS_SAMPLE = 32  # rank actors whose PSS is read per size
FLAT = 1 << 30   # a fanout no run reaches: every agent a root
MODES = {"": None, "_flat": FLAT, "_direct": None}  # key suffix -> the tree's fanout (None: --fanout)
STEP_KEYS = ("driver_cpu_per_step", "driver_thread_cpu_per_step", "driver_cpu_per_step_net", "step_wall")
KEYS = (*(f"{k}{m}_s" for k in STEP_KEYS for m in MODES), "driver_cpu_per_round_s", "driver_cpu_per_round_flat_s",
        "detect_kill_s", "detect_silent_s", "abort_s", "rebuild_s", "restore_plan_s", "recovery_control_s", "start_s",
        "rank_pss_mb", "agent_pss_mb", "driver_pss_mb", "rank_threads", "agent_threads", "tree_depth")
ACTOR_ENV = {"RAY_num_grpc_internal_threads": "1", "RAY_core_worker_num_server_call_thread": "1",
             "RAY_task_events_report_interval_ms": "0", "RAY_enable_metrics_collection": "0",
             "RAY_start_python_gc_manager_thread": "0",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
"""Every actor's environment (with `bench.actor_env`): a Ray worker's gRPC thread pools are
sized by the host's cores (~48 threads per rank actor on 16 cores; each thread takes a pid, and
1,155 actors then need ~56k of the 32,768 of kernel.pid_max). One gRPC internal thread
(`num_grpc_internal_threads`: the event engine's pool, 17 -> 3 threads, and the completion-queue
pollers, 8 -> 2) and one reply thread, no task-event buffer, no metrics export and no Python GC
thread (none of which the bench reads) bring it to ~24, for the driver's control plane
unchanged (measured on the 2-core VM with the cores reported as 16: RESULTS.md)."""


class PhaseTimeout(Exception):
    """A phase of one size ran past `--phase-timeout-s`."""


def phase(n: int, name: str, limit_s: float, fn, *args):
    """`fn(*args)` in a daemon thread, with a progress line when it starts and when it ends.
    Raises PhaseTimeout when it has not ended after `limit_s` seconds (the thread is left to the
    size's cleanup, which kills the actors it waits for), or what `fn` raised."""
    print(f"N={n} {name} ...", flush=True)
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=target, name=f"phase-{name}", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        print(f"N={n} {name}: not done after {limit_s:g} s", flush=True)
        raise PhaseTimeout(f"not done after {limit_s:g} s")
    if "error" in out:
        print(f"N={n} {name}: failed after {time.monotonic() - t0:.2f} s: {out['error']!r:.300}", flush=True)
        raise out["error"]
    print(f"N={n} {name}: {time.monotonic() - t0:.2f} s", flush=True)
    return out.get("value")


class Run:
    """N ranks + SPARES spares, their agents, the driver's store and health monitor."""

    def __init__(self, n: int, args, ft):
        self.n, self.args, self.ft = n, args, ft
        self.generation = 0
        self.actors, self.pids, self.agents = [], [], {}
        self.workers, self.spares = [], []
        self.health = self.calls = self.store = self.host = None

    def start(self) -> None:
        """Start the actors in batches of `--start-batch` (one line each), their agents, the
        store and the heartbeats; returns once every actor answered a ping."""
        ft, rpn = self.ft, self.args.ranks_per_node
        total, t0 = self.n + SPARES, time.monotonic()
        while len(self.actors) < total:
            batch = [ControlRank.remote(ft.rendezvous_timeout_s)
                     for _ in range(min(self.args.start_batch, total - len(self.actors)))]
            self.actors += batch
            self.pids += ray.get([a.pid.remote() for a in batch])
            print(f"N={self.n}   {len(self.actors)}/{total} rank actors up ({time.monotonic() - t0:.1f} s, "
                  f"MemAvailable {mem_available_gb():.1f} GB)", flush=True)
        ip, node = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        slots = [ActorSlot(a, ip, node, [], i) for i, a in enumerate(self.actors)]
        self.agents = {f"node{k}": NodeAgent.remote(ft.health_interval_s / 2) for k in range(-(-total // rpn))}
        ray.get([a.node_id.remote() for a in self.agents.values()])
        print(f"N={self.n}   {len(self.agents)} node agents up ({time.monotonic() - t0:.1f} s)", flush=True)
        self.workers, self.spares = slots[:self.n], slots[self.n:]
        # Heartbeats and step calls see logical nodes; raylet checks (`lost_ranks`) see the real one.
        self.health = HealthMonitor(ft, lambda: self.workers, lambda: self.spares, lambda: self.generation,
                                    lambda: self.agents, lambda s: f"node{s.bundle_index // rpn}", self.args.fanout)
        self.calls = NodeCalls(self.health.beats.node_of, self.health.beats.call_tree, self.health.agent_failed)
        if not self.args.no_store:
            import torch.distributed as dist

            self.store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=ft.rendezvous_timeout_s))
            self.host = ip
            ray.get([a.connect.remote(ip, self.store.port) for a in self.actors])
            print(f"N={self.n}   store clients connected ({time.monotonic() - t0:.1f} s)", flush=True)
        since = time.monotonic()
        self.health.start()
        # Measure the steady state: every actor has answered a ping through the tree (on a
        # loaded host an agent's first pings, and its children's, take seconds).
        handles = [s.handle for s in slots]
        while len(self.health.beats.settle(handles, since)[0]) < len(handles):
            if time.monotonic() - since > 60:
                raise RuntimeError("not every actor answered a ping within 60 s")
        print(f"N={self.n}   every actor answered a ping ({time.monotonic() - t0:.1f} s)", flush=True)
        freeze_heap()  # as the trainer does once the membership is set

    def join(self) -> float:
        """Form the next generation (the barrier through the store). Returns seconds."""
        t0 = time.monotonic()
        self.generation += 1
        port = 0 if self.store is None else self.store.port
        self.health.wait([s.handle.join.remote(self.generation, r, self.n, self.host, port)
                          for r, s in enumerate(self.workers)], self.ft.rendezvous_timeout_s)
        return time.monotonic() - t0

    def step(self, step: int, batch, hold_s: float = 0.0, direct: bool = False):
        """Start a step on every worker (batch put once; `MeshDispatch` over tp=`--tp`), as
        `ActorGroup.call` does: through the agents' tree (`NodeCalls`), or with `direct` one call
        per rank from the driver (as before the agents carried calls). Returns what
        `HealthMonitor.wait` takes."""
        dims = ParallelDims(tp=self.args.tp, pp=1, cp=1, dp=self.n // self.args.tp)
        args = (self.generation, step, batch, hold_s)
        if direct:
            return dispatch_remote([s.handle for s in self.workers], "train_step", dims, MeshDispatch, *args, put=ray.put)
        return self.calls.start(self.workers, "train_step", dims, MeshDispatch, args)

    def use(self, mode: str) -> None:
        """Heartbeats and step calls through the tree of arity `--fanout` from now on (`mode`
        ""), or the flat tree ("_flat": the driver calls every agent); then two heartbeat
        rounds, so that the agents have their branches."""
        self.health.beats.fanout = MODES[mode] or self.args.fanout
        time.sleep(2 * self.ft.health_interval_s)

    def steps(self, first: int, count: int, mode: str = "") -> dict[str, float]:
        """`count` steps waited on by the health monitor, `mode` a key of MODES (the tree, the
        flat tree, or "_direct": one call per rank, see `step`): driver CPU
        seconds (every thread of the driver process: the heartbeats' too, so this grows with the
        step's wall time), the calling thread's alone (the driver's own work of a step: split,
        send, wait, judge; not Ray's threads), and wall seconds per step. With `--profile`, prints the calling
        thread's top functions."""
        batch, direct = list(range(64)), mode == "_direct"
        if not direct:
            self.use(mode)
        profile = cProfile.Profile(time.thread_time) if self.args.profile else None
        c0, t0, w0 = time.process_time(), time.thread_time(), time.monotonic()
        if profile is not None:
            profile.enable()
        for s in range(first, first + count):
            self.health.wait(self.step(s, batch, direct=direct), self.ft.step_timeout_s)
        if profile is not None:
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return {f"driver_cpu_per_step{mode}_s": (time.process_time() - c0) / count,
                f"driver_thread_cpu_per_step{mode}_s": (time.thread_time() - t0) / count,
                f"step_wall{mode}_s": (time.monotonic() - w0) / count}

    def idle(self, seconds: float, mode: str = "") -> float:
        """Driver CPU seconds per heartbeat round over an idle window of `seconds`, through the
        tree or the flat tree (`use`)."""
        self.use(mode)
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        return (time.process_time() - c0) / ((time.monotonic() - w0) / self.ft.health_interval_s)

    def memory(self) -> dict[str, float]:
        """PSS (MB): mean of a sample of rank actors, of the agents, and the driver's; threads
        per rank actor and per agent (means of the samples); the depth of the agents' tree."""
        pids = self.pids[::max(1, len(self.pids) // PSS_SAMPLE)]
        agent_pids = ray.get([a.__ray_call__.remote(lambda _: os.getpid()) for a in list(self.agents.values())[:4]])
        return {"rank_pss_mb": sum(map(pss_mb, pids)) / len(pids),
                "agent_pss_mb": sum(map(pss_mb, agent_pids)) / len(agent_pids),
                "driver_pss_mb": pss_mb(os.getpid()),
                "rank_threads": threads(pids), "agent_threads": threads(agent_pids),
                "tree_depth": depth(self.health.beats.tree()[0])}

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

    def abort(self, failure: WorkerFailure) -> tuple[float, set[int]]:
        """Abort the survivors; (seconds, the failed ranks)."""
        t0 = time.monotonic()
        failed = set(failure.ranks) | self.health.abort_survivors(set(failure.ranks))
        return time.monotonic() - t0, failed

    def rebuild(self, failed: set[int]) -> float:
        """Put spares in the failed ranks' places and form a generation; seconds."""
        for r in sorted(failed):
            self.workers[r] = self.spares.pop(0)
        return self.join()

    def restore_plan(self, failed: set[int]) -> float:
        """The survivors' rollback round, then the restore plan; seconds."""
        t0 = time.monotonic()
        ranks = sorted(set(range(self.n)) - failed)
        done = self.health.wait([self.workers[r].handle.rollback.remote(self.generation, 0) for r in ranks],
                                self.ft.step_timeout_s, ranks)
        clean = {r for r, ok in zip(ranks, done) if ok}
        plan = plan_restore("auto", 0, [list(range(self.n))], set(ranks), clean, None, lambda: 0)
        assert plan.source == "peer", plan
        return time.monotonic() - t0

    def close(self) -> None:
        """Stop the heartbeats, kill every actor and wait (up to 60 s) for their processes to end."""
        if self.health is not None:
            self.health.stop()
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for a in [*self.actors, *self.agents.values()]:
            ray.kill(a)
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{pid}").exists() for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.5)


def threads(pids: list[int]) -> float:
    """Mean threads per process of `pids` (each a pid of the host's)."""
    return sum(len(os.listdir(f"/proc/{p}/task")) for p in pids) / len(pids)


def thread_limit() -> int:
    """The most threads (pids) this host allows: the smallest of kernel.pid_max,
    kernel.threads-max and the cgroup's pids.max (v2 or v1) where readable."""
    limits = []
    for f in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max", "/sys/fs/cgroup/pids.max",
              "/sys/fs/cgroup/pids/pids.max"):
        try:
            limits.append(int(Path(f).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max"
            pass
    return min(limits)


def threads_now() -> int:
    """Threads of every process on the host now."""
    total = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                total += len(os.listdir(p / "task"))
            except OSError:
                pass
    return total


def skip_reason(n: int, rpn: int, per_rank_mb: float, per_actor_threads: float) -> str | None:
    """Why size `n` would not fit this host, from the largest per-actor PSS (MB) and threads
    measured so far (0: not measured yet), or None."""
    if per_rank_mb and (need := (n + SPARES) * per_rank_mb / 1024) > 0.9 * (have := mem_available_gb()):
        return f"skipped: {need:.1f} GB of rank PSS projected, {have:.1f} GB available"
    actors = n + SPARES + -(-(n + SPARES) // rpn)
    if per_actor_threads and (need := threads_now() + actors * per_actor_threads) > 0.95 * (limit := thread_limit()):
        return f"skipped: {need:.0f} threads projected ({actors} actors x {per_actor_threads:.0f}), host limit {limit}"
    return None


def measure(n: int, args, ft) -> dict:
    """One size's row: KEYS that were measured, and `failed` ("phase: error") when a phase failed
    or ran past `--phase-timeout-s`."""
    run, row, limit = Run(n, args, ft), {"n": n}, args.phase_timeout_s
    name = "start"
    try:
        t0 = time.monotonic()
        phase(n, name, limit, run.start)
        row["start_s"] = time.monotonic() - t0
        name = "join"
        phase(n, name, limit, run.join)
        name = "warm steps"
        phase(n, name, limit, run.steps, 0, 3)
        first = 3
        for mode, what in (("_direct", "one call per rank"), ("_flat", "the flat tree (every agent called)"),
                           ("", f"the tree of fanout {args.fanout}")):
            if mode != "_direct" or args.direct:
                name = f"{args.steps} steps, {what}"
                row.update(phase(n, name, limit, run.steps, first, args.steps, mode))
                first += args.steps
        name = "memory"
        row.update(phase(n, name, limit, run.memory))
        for mode in ("_flat", ""):
            name = f"idle {args.idle_s:g} s, {'flat' if mode else 'tree'}"
            row[f"driver_cpu_per_round{mode}_s"] = phase(n, name, limit, run.idle, args.idle_s, mode)
        name = "detect killed"  # the last rank: under the deepest agent
        row["detect_kill_s"], failure = phase(n, name, limit, run.fail, n - 1, "kill")
        name = "abort"
        row["abort_s"], failed = phase(n, name, limit, run.abort, failure)
        name = "rebuild"
        row["rebuild_s"] = phase(n, name, limit, run.rebuild, failed)
        name = "restore plan"
        row["restore_plan_s"] = phase(n, name, limit, run.restore_plan, failed)
        row["recovery_control_s"] = row["detect_kill_s"] + row["abort_s"] + row["rebuild_s"] + row["restore_plan_s"]
        for mode in MODES:  # less what the driver spends while idle over the step's wall time
            if f"step_wall{mode}_s" in row:
                idle = row["driver_cpu_per_round_flat_s" if mode == "_flat" else "driver_cpu_per_round_s"]
                row[f"driver_cpu_per_step_net{mode}_s"] = row[f"driver_cpu_per_step{mode}_s"] - (
                    idle / ft.health_interval_s * row[f"step_wall{mode}_s"])
        name = "detect silent"
        row["detect_silent_s"], failure = phase(n, name, limit, run.fail, n - 2, "stop")
        name = "abort after silent"
        phase(n, name, limit, run.abort, failure)
    except Exception as e:  # noqa: BLE001 - recorded; the next size runs
        row["failed"] = f"{name}: {type(e).__name__}: {str(e)[:300]}"
    finally:
        try:
            phase(n, "close", limit, run.close)
        except Exception as e:  # noqa: BLE001 - a size that cannot be cleaned up is said so
            row.setdefault("failed", f"close: {type(e).__name__}: {str(e)[:300]}")
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return row


def summary(rows: list[dict], args) -> dict:
    """The JSON of the sizes measured so far: lists over the sizes measured to the end, and
    `failures` (each with what it measured before it failed)."""
    done = [r for r in rows if "failed" not in r]
    sizes = [r["n"] for r in done]

    measured = [k for k in KEYS if done and all(k in r for r in done)]

    def slope(key):
        return round(loglog_slope(sizes, [r[key] for r in done]), 3) if len(done) > 1 and key in measured else None

    return {"note": NOTE, "sizes": sizes, **{k: [round(r[k], 5) for r in done] for k in measured},
            **{f"growth_exponent_{k.removesuffix('_s').replace('_per_step', '')}": slope(k)
               for k in KEYS if k.startswith(("driver_cpu_per", "driver_thread_cpu"))},
            "failures": [r for r in rows if "failed" in r],
            "device": f"cpu: {os.cpu_count()} cores ({platform.node()})",
            "settings": {"ranks_per_node": args.ranks_per_node, "fanout": args.fanout, "actor_env": ACTOR_ENV,
                         "tp": args.tp, "steps": args.steps, "idle_s": args.idle_s,
                         "health_timeout_s": args.health_timeout_s, "health_interval_s": args.health_interval_s,
                         "join_through_store": not args.no_store, "phase_timeout_s": args.phase_timeout_s}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--fanout", type=int, default=FANOUT,
                   help="arity of the agents' tree (agent_tree.FANOUT); the flat tree is measured beside it")
    p.add_argument("--direct", action="store_true",
                   help="also measure steps sent as one call per rank from the driver (before the agents carried steps)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size of the step's layout (dp = N / tp): the driver collects one result per DP "
                        "replica; 1 (every rank a replica) is the most results per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--health-timeout-s", type=float, default=3.0)
    p.add_argument("--health-interval-s", type=float, default=0.5)
    p.add_argument("--no-store", action="store_true", help="skip the join barrier (no torch in the actors)")
    p.add_argument("--phase-timeout-s", type=float, default=180.0,
                   help="a phase of one size running longer is recorded as that size's failure")
    p.add_argument("--start-batch", type=int, default=128, help="rank actors started per batch")
    p.add_argument("--profile", action="store_true", help="print the top functions of each steps phase (cProfile, the calling thread's CPU seconds)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "control_plane_cpu.json"))
    args = p.parse_args(argv)
    if bad := [n for n in args.sizes if n % args.tp]:
        p.error(f"--sizes {bad} not a multiple of --tp={args.tp}: give sizes that tp divides")
    ft = load_config(str(ROOT / "config.yaml"), [
        f"fault_tolerance.health_timeout_s={args.health_timeout_s}",
        f"fault_tolerance.health_interval_s={args.health_interval_s}",
        "fault_tolerance.rendezvous_timeout_s=120", "fault_tolerance.step_timeout_s=120"]).fault_tolerance
    print(NOTE + ("; the rank actors import no torch (no join barrier: --no-store)" if args.no_store else
                  "; the rank actors import torch for the store client of the join barrier"), flush=True)
    # `timeout` sends SIGTERM: exit through Python's cleanup, which stops the local Ray started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": actor_env(ROOT, RAY_IGNORE_UNHANDLED_ERRORS="1", **ACTOR_ENV)})
    print(f"host: {os.cpu_count()} cores, {mem_available_gb():.1f} GB available, {threads_now()} threads "
          f"running, thread limit {thread_limit()}", flush=True)
    rows, per_rank_mb, per_actor_threads = [], 0.0, 0.0
    for n in args.sizes:
        if (why := skip_reason(n, args.ranks_per_node, per_rank_mb, per_actor_threads)) is not None:
            rows.append({"n": n, "failed": why})
            print(f"N={n}: {why}", flush=True)
        else:
            rows.append(measure(n, args, ft))
            per_rank_mb = max(per_rank_mb, rows[-1].get("rank_pss_mb", 0.0) + rows[-1].get("agent_pss_mb", 0.0)
                              / args.ranks_per_node)
            per_actor_threads = max(per_actor_threads, rows[-1].get("rank_threads", 0.0))
        result = summary(rows, args)
        write_json(args.out, result)  # a cut run keeps the sizes it measured
    keys = [k for k in KEYS if any(k in r for r in rows)]
    print(f"{'N':>6} " + " ".join(f"{k[:16]:>16}" for k in keys))
    for r in rows:
        print(f"{r['n']:>6} " + (" ".join(f"{r.get(k, float('nan')):>16.4f}" for k in keys)
                                  + (f"  FAILED {r['failed']}" if "failed" in r else "")))
    print(f"growth exponent of driver CPU per step: {result['growth_exponent_driver_cpu']} (flat: "
          f"{result['growth_exponent_driver_cpu_flat']}); per round: {result['growth_exponent_driver_cpu_per_round']} "
          f"(flat: {result['growth_exponent_driver_cpu_per_round_flat']})  ({NOTE})", flush=True)
    return result


if __name__ == "__main__":
    main()
