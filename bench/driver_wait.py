"""The driver's own per-step work at N ranks, without N actors: `health.HealthMonitor.wait` over
the answers of the agents' tree (`node_agent.AgentCalls`, one summary per root, as the roots
answer a step's call) and the trainer's reduction of the results (`rank_rows.global_digest` of
the row digests, the mean loss).

Where `bench.control_plane` runs N rank actors and their node agents on one host (on the
16-core host at N = 1,024, 1,155 processes share the cores and the driver's CPU per step grows
with the contention as much as with its work), this isolates the work itself: every summary is
already in Ray's object store (put once), so each step costs the driver what reading the
answers, judging them and reducing them costs, on an idle host. Not measured here: sending the
step's call (one call per root: O(roots)) and Ray's own threads.

Each size is measured twice in the same run, in a driver that imported what the driver imports
(`trainer`: Ray, torch): with Python's default garbage collection, whose full collections,
triggered by each step's short-lived results, traverse the whole long-lived heap; and after
`trainer.freeze_heap` (what the trainer does once the membership is set).

Per N (logical nodes of `--ranks-per-node` ranks, tp = 1: every rank is a DP replica whose result
the driver reads; at most `agent_tree.FANOUT` roots, each answering for its subtree's ranks):
the calling thread's CPU seconds per step of the wait and of the reduction, and fitted growth
exponents (log-log slope against N), default collection (`*_gc_default`) and frozen heap.

Usage (repository root): python -m bench.driver_wait [--sizes 64 256 1024] [--ranks-per-node 8]
    [--rows-per-replica 4] [--steps 200] [--out bench/results/driver_wait_cpu.json]
Prints a table and writes the JSON (top level: sizes, wait_cpu_per_step_s, reduce_cpu_per_step_s,
driver_cpu_per_step_s (their sum), growth_exponent_driver_cpu, each also with `_gc_default`,
roots, heap_objects, device, settings).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import platform
import time

import ray

from bench import write_json
from bench.scale import loglog_slope
from ftrain.config import FaultToleranceConfig
from ftrain.control.agent_tree import FANOUT
from ftrain.control.health import HealthMonitor
from ftrain.control.node_agent import AgentCalls
from ftrain.data.rank_rows import global_digest
from ftrain.trainer import freeze_heap


def step_results(n: int, rows: int, step: int) -> list[dict]:
    """Rank r's result of a `ce` step, as `MegatronEngine.train_step` returns it (the fields the
    trainer reads): its loss, the gradient norm, one SHA-256 digest per row it trained on."""
    return [{"loss": 2.0 + r / n, "grad_norm": 1.5, "row_digests": [
        hashlib.sha256(f"{step}:{r}:{j}".encode()).digest() for j in range(rows)]} for r in range(n)]


def summaries(results: list[dict], roots: int) -> list[tuple]:
    """One `NodeAgent.call` answer per root, put into Ray's object store: (ObjectRef, the call
    indices it answers for). Root k answers for a contiguous share of the ranks (its subtree)."""
    n, out = len(results), []
    for k in range(roots):
        mine = range(k * n // roots, (k + 1) * n // roots)
        answer = {"results": {i: results[i] for i in mine}, "errors": {}, "failed_agents": [],
                  "left": [], "replaced": False}
        out.append((ray.put(answer), set(mine)))
    return out


def measure(n: int, rpn: int, rows: int, steps: int) -> dict:
    """Calling-thread CPU seconds per step at `n` ranks: the wait and the trainer's reduction."""
    roots = min(-(-n // rpn), FANOUT)
    answers = summaries(step_results(n, rows, 1), roots)
    health = HealthMonitor(FaultToleranceConfig(), lambda: [None] * n)
    wait_s = reduce_s = 0.0
    for _ in range(steps):
        t0 = time.thread_time()
        calls = AgentCalls(n, {}, {ref: (None, mine, set()) for ref, mine in answers}, 1, lambda a, e: None)
        results = health.wait(calls, timeout=30)
        t1 = time.thread_time()
        digest = global_digest([r["row_digests"] for r in results])
        loss = sum(r["loss"] for r in results) / len(results)
        reduce_s += time.thread_time() - t1
        wait_s += t1 - t0
    assert len(digest) == 64 and loss > 0
    return {"wait_cpu_per_step_s": wait_s / steps, "reduce_cpu_per_step_s": reduce_s / steps,
            "driver_cpu_per_step_s": (wait_s + reduce_s) / steps, "roots": roots}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--rows-per-replica", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="bench/results/driver_wait_cpu.json")
    a = p.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    heap = len(gc.get_objects())
    default = [measure(n, a.ranks_per_node, a.rows_per_replica, a.steps) for n in a.sizes]
    freeze_heap()
    rows = [measure(n, a.ranks_per_node, a.rows_per_replica, a.steps) for n in a.sizes]
    keys = ("wait_cpu_per_step_s", "reduce_cpu_per_step_s", "driver_cpu_per_step_s")
    total = "driver_cpu_per_step_s"
    out = {"sizes": a.sizes, **{k: [r[k] for r in rows] for k in keys},
           **{k[:-2] + "_gc_default_s": [r[k] for r in default] for k in keys},
           "growth_exponent_driver_cpu": round(loglog_slope(a.sizes, [r[total] for r in rows]), 3),
           "growth_exponent_driver_cpu_gc_default": round(loglog_slope(a.sizes, [r[total] for r in default]), 3),
           "roots": [r["roots"] for r in rows], "heap_objects": heap,
           "device": f"cpu: {os.cpu_count()} cores ({platform.node()})",
           "settings": {"ranks_per_node": a.ranks_per_node, "rows_per_replica": a.rows_per_replica,
                        "steps": a.steps, "fanout": FANOUT, "tp": 1},
           "note": "the driver's own work per step (wait + reduce) on answers already in the object store"}
    print(f"driver heap: {heap} objects; calling-thread CPU ms per step, default GC | frozen heap")
    print(f"{'N':>6} {'roots':>6} {'wait':>7} {'reduce':>7} {'total':>7} {'vs first':>9} | "
          f"{'wait':>7} {'reduce':>7} {'total':>7} {'vs first':>9}")
    for n, d, r in zip(a.sizes, default, rows):
        cols = [f"{1e3 * x[k]:>7.3f}" for x in (d, r) for k in keys]
        print(f"{n:>6} {r['roots']:>6} {' '.join(cols[:3])} {d[total] / default[0][total]:>8.2f}x | "
              f"{' '.join(cols[3:])} {r[total] / rows[0][total]:>8.2f}x")
    print(f"growth exponent: default GC {out['growth_exponent_driver_cpu_gc_default']}, "
          f"frozen heap {out['growth_exponent_driver_cpu']}")
    write_json(a.out, out)
    ray.shutdown()


if __name__ == "__main__":
    main()
