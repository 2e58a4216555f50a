"""Scale benchmark of the control plane: recovery phases for N = 8 .. 64 actors on one machine.

A Ray cluster is started on this machine (`ray.cluster_utils.Cluster`, logical CPUs; the head
node holds no actors): `--nodes` nodes, or N / `--ranks-per-node` when that is more, so that a
lost node holds as many ranks at every N, as on a cluster of 8-GPU nodes. N actors are placed
on it: 3/4 of them workers (CPU engine, smallest model, gloo, pure DP), 1/4 spares spread over
the nodes by `assign_roles`. For each N:
(a) one killed actor (`ray.kill` of a worker between steps), the pool is then refilled;
(b) one killed node (`Cluster.remove_node` of a node holding workers, chosen so the spares left on
    other nodes cover its ranks); a replacement node then joins and the pool is refilled.
Each recovery's phases come from its `RecoveryTimeline`: detect (kill -> WorkerFailure), abort,
replace, rebuild (new process-group generation), restore (peer), control = the sum of those five,
first step (the whole step after resuming) and its excess over the steady step, and total =
control + that excess (`RecoveryTimeline.total_s`, the time the failure cost the run). The
steady step is data-plane compute: N ranks share this machine's cores, so it grows with N here
whatever the control plane does; only its excess counts.
`detect_s` of a node loss is timed from the return of `remove_node` (the node's processes are
gone by then).

Memory: every actor imports torch + transformers. Before the run the benchmark measures the
proportional set size (PSS, shared library pages split between processes) of the actors of the
first N and refuses to start an N whose projected total exceeds `--max-mem-gb` (default 12).

Usage (repository root): python -m bench.scale [--sizes 8 16 32 64] [--nodes 4] [--ranks-per-node R] [--repeats 1]
                                               [--failures actor node] [--set a.b=v ...] [--out FILE]
                         python -m bench.scale --merge RUN.json ... --out FILE
Prints a table and a log-log fit (slope of each phase against N) and writes
bench/results/scale_cpu.json: a list of {"n", "failure", "detect_s", "abort_s", "replace_s",
"rebuild_s", "restore_s", "first_step_s", "first_step_excess_s", "total_s", "nodes", ...} (one
row per recovery); the fit and the run's settings go to bench/results/scale_cpu_fit.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from bench import actor_env
from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.failures import RecoveryTimeline
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor

ROOT = Path(__file__).resolve().parent.parent

PHASES = (*RecoveryTimeline.CONTROL, "control_s", "first_step_s", "first_step_excess_s", "total_s")


def pss_mb(pid: int) -> float:
    """Proportional set size of a process in MB (Linux), 0 if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def mem_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def make_cfg(n: int, nodes: int, run_dir: str, overrides: list[str]):
    workers, spares = n - n // 4, n // 4
    return resolve(load_config(str(ROOT / "config.yaml"), [
        f"cluster.num_nodes={nodes}", f"cluster.num_workers={workers}", f"cluster.num_spares={spares}",
        f"cluster.cpus_per_actor={nodes / n}",
        "model.hidden_size=16", "model.num_layers=1", "model.num_heads=2", "model.ffn_hidden_size=32",
        "model.vocab_size=64", "model.max_seq_len=8", "train.seq_len=8", "train.steps=1000",
        f"train.global_batch_size={workers}", f"train.mini_batch_size={workers}", "train.micro_batch_size=1",
        "checkpoint.interval=0", "fault_tolerance.health_timeout_s=10",
        "fault_tolerance.min_step_timeout_s=60", "fault_tolerance.rendezvous_timeout_s=120",
        f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt", *overrides]), num_gpus=0)


def wait_refilled(group: ActorGroup, want: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(group.pool) < want and time.monotonic() < deadline:
        group.poll_refills()
        time.sleep(0.2)
    if len(group.pool) < want:
        print(f"pool not refilled within {timeout:.0f} s: {len(group.pool)} of {want} spares", flush=True)


def run_n(n: int, nodes: int, repeats: int, overrides: list[str], env: dict,
          failures: tuple[str, ...] = ("actor", "node")) -> tuple[list[dict], float]:
    """Start a cluster, run the (a) "actor" and (b) "node" failures of `failures` for N actors;
    returns rows and the PSS of one actor (MB)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    node_handles = [cluster.add_node(num_cpus=1) for _ in range(nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": actor_env(ROOT, RAY_IGNORE_UNHANDLED_ERRORS="1", **env)})
    rows, actor_mb = [], 0.0
    run_dir = f"/tmp/bench_scale_{n}_{int(time.time())}"
    cfg = make_cfg(n, nodes, run_dir, overrides)
    group = None
    try:
        t0 = time.perf_counter()
        group = ActorGroup(MegatronActor, cfg, placement_timeout_s=120)
        start_s = time.perf_counter() - t0
        pids = ray.get([s.handle.info.remote() for s in group.workers + group.pool.spares])
        actor_mb = statistics.mean(pss_mb(i["pid"]) for i in pids)
        print(f"N={n}: group up in {start_s:.1f} s, actor PSS {actor_mb:.0f} MB, "
              f"{len(group.workers)} workers + {len(group.pool)} spares, MemAvailable {mem_available_gb():.1f} GB",
              flush=True)
        for line in group.placement_report:
            print("  " + line)
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(4)  # steps 2-4: the steady step time
        spares = len(group.pool)
        for i in range(repeats if "actor" in failures else 0):  # (a) one killed actor
            victim = (1 + 5 * i) % len(group.workers)
            group.kill([victim])
            trainer.train(trainer.committed_step + 2)
            rows.append({"n": n, "failure": "actor", **_row(trainer)})
            wait_refilled(group, spares)
        for i in range(repeats if "node" in failures else 0):  # (b) one killed node
            by_node: dict[str, int] = {}
            for s in group.workers:
                by_node[s.node_id] = by_node.get(s.node_id, 0) + 1
            alive = {h.node_id for h in node_handles if h in cluster.worker_nodes}
            choices = [nid for nid in by_node if nid in alive and
                       sum(s.node_id != nid for s in group.pool.spares) >= by_node[nid]]
            if not choices:
                print(f"N={n}: no node whose ranks the spares elsewhere could cover; node failure skipped")
                break
            victim = max(choices, key=lambda nid: by_node[nid])
            (handle,) = [h for h in node_handles if h.node_id == victim]
            cluster.remove_node(handle, allow_graceful=False)
            group.mark_injected()
            recoveries = len(trainer.recoveries)
            # The node's workers exit some time after its raylet is gone: with short steps the
            # run can commit a step or two before the failure shows; train until it does.
            for _ in range(50):
                trainer.train(trainer.committed_step + 1)
                if len(trainer.recoveries) > recoveries:
                    break
            else:
                raise RuntimeError(f"N={n}: no recovery within 50 steps of removing node {victim[:8]}")
            trainer.train(trainer.committed_step + 1)
            rows.append({"n": n, "failure": "node", "node_ranks": by_node[victim], **_row(trainer)})
            # A replacement node joins (as on a cluster): the lost node's bundles are placed
            # there again and the pool refilled, so the next repetition finds the same cluster.
            node_handles.append(cluster.add_node(num_cpus=1))
            wait_refilled(group, spares)
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
        cluster.shutdown()
    for r in rows:
        r["actor_pss_mb"], r["nodes"] = round(actor_mb, 1), nodes
    return rows, actor_mb


def _row(trainer: Trainer) -> dict:
    """The last recovery's phases and the run's steady step time, as one table row."""
    tl = trainer.recoveries[-1]
    d = tl.to_dict()
    d["control_s"] = sum(d[p] for p in tl.CONTROL)
    return {**{p: d[p] for p in PHASES}, "failed_ranks": len(tl.failed_ranks), "restore_source": tl.restore_source,
            "steps_lost": tl.steps_lost, "attempts": tl.attempts, "rebuild_detail": d.get("rebuild_detail", {}),
            "step_s": round(trainer.steady_step_s(), 4)}


def loglog_slope(ns: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(n): y ~ n^slope (0 = flat, 1 = linear)."""
    pts = [(math.log(n), math.log(max(y, 1e-4))) for n, y in zip(ns, ys)]
    if len(pts) < 2:
        return 0.0
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else 0.0


def fit(rows: list[dict]) -> dict:
    """Per failure kind and phase: log-log slope and the ratio largest-N / smallest-N (medians)."""
    out = {}
    for failure in sorted({r["failure"] for r in rows}):
        sub = [r for r in rows if r["failure"] == failure]
        ns = sorted({r["n"] for r in sub})
        med = {p: [statistics.median(r[p] for r in sub if r["n"] == n) for n in ns] for p in PHASES}
        out[failure] = {"n": ns, "median": med,
                        "slope": {p: round(loglog_slope(ns, med[p]), 3) for p in PHASES},
                        "ratio_max_min": {p: round(med[p][-1] / max(med[p][0], 1e-9), 3) for p in PHASES}}
    return out


def print_table(rows: list[dict], fits: dict) -> None:
    head = ("n", "failure", "ranks", *[p[:-2] for p in PHASES])
    lines = [head] + [(str(r["n"]), r["failure"], str(r["failed_ranks"]), *[f"{r[p]:.3f}" for p in PHASES])
                      for r in rows]
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(x.rjust(w) for x, w in zip(line, widths)))
    print("\nlog-log slope (phase ~ N^slope) and ratio largest N / smallest N:")
    for failure, f in fits.items():
        print(f"  {failure:<6}" + "  ".join(f"{p[:-2]} {f['slope'][p]:+.2f} ({f['ratio_max_min'][p]:.2f}x)"
                                            for p in PHASES))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--nodes", type=int, default=4, help="logical nodes (at least)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="use N / this many nodes when that is more than --nodes (0: always --nodes)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--failures", nargs="+", choices=("actor", "node"), default=["actor", "node"])
    p.add_argument("--max-mem-gb", type=float, default=12.0,
                   help="skip an N whose projected actor memory (PSS) exceeds this")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the actors' environment "
                   "(e.g. TORCH_GLOO_LAZY_INIT=1)")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale_cpu.json"))
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="run nothing: fit and write the rows of these earlier runs (of one host: "
                   "the 'cores' of their _fit.json files must agree) together")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    rows, cores = [], os.cpu_count()
    if args.merge:
        metas = [json.loads(Path(f).with_name(Path(f).stem + "_fit.json").read_text()) for f in args.merge]
        if len({m["cores"] for m in metas}) != 1:
            raise SystemExit(f"--merge: runs of different hosts (cores {[m['cores'] for m in metas]})")
        rows, cores = [r for f in args.merge for r in json.loads(Path(f).read_text())], metas[0]["cores"]
    actor_mb, skipped = 0.0, []
    env = dict(e.split("=", 1) for e in args.env)
    for n in sorted(args.sizes) if not args.merge else []:
        if actor_mb and n * actor_mb / 1024 > args.max_mem_gb:
            skipped.append(n)
            print(f"N={n}: skipped, projected {n * actor_mb / 1024:.1f} GB of actor PSS > --max-mem-gb "
                  f"{args.max_mem_gb}")
            continue
        nodes = max(args.nodes, -(-n // args.ranks_per_node) if args.ranks_per_node else 0)
        got, mb = run_n(n, nodes, args.repeats, args.overrides, env, tuple(args.failures))
        actor_mb = max(actor_mb, mb)
        rows += got
        Path(args.out).write_text(json.dumps(rows, indent=1))  # partial results survive a crash
    fits = fit(rows)
    print_table(rows, fits)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    fit_out = out.with_name(out.stem + "_fit.json")
    settings = ({"merged_from": args.merge} if args.merge else
                {"skipped_n": skipped, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                 "env": args.env, "overrides": args.overrides})
    fit_out.write_text(json.dumps({"fit": fits, **settings, "cores": cores, "date": time.strftime("%Y-%m-%d")},
                                  indent=1))
    print(f"wrote {out} and {fit_out}")
    return rows


if __name__ == "__main__":
    main()
