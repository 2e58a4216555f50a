"""Chaos soak: a seeded schedule of faults of every kind over one CPU training run, checked
against the same run without faults.

Engines (`--engine`): `torch` (the TorchEngine, 2 ranks at dp=2) or `megatron` (MegatronActors on
gloo: the tiny GPT at tp=2 x dp=2, the distributed optimizer and the shard keeper on, the path a
GPU cluster takes by default).

Fault kinds (round-robin over the schedule, points drawn from the seed):
  kill / exception / hang  of one rank at a step point (incl. inside the gradient all-reduce)
  node                     every actor on one Ray node killed (workers and spares)
  save_kill / save_error   a rank dies / raises while writing a checkpoint (before or between shards)
  recovery_failure         a rank dies, and the next rank raises while the new generation forms
  storage_outage           the S3 server (loopback, moto) is stopped for OUTAGE_S around a save
  corrupt_shard            bytes of the newest committed checkpoint flipped, then every rank
                           killed, so recovery must load a checkpoint and fall back past it
The cluster: `ray.cluster_utils.Cluster` with 3 logical nodes on this machine (`--nodes`); checkpoints go
to a loopback S3 server every INTERVAL steps. Before each fault the driver lets the refills
bring the pool back to world size + 1 spares (a correctness soak, not a recovery-time
measurement: `bench.recovery` times recoveries).

Usage (repository root): python -m bench.chaos [--engine torch] [--faults 50] [--seed 0] [--nodes 3] [--out PATH]
(default PATH: bench/results/chaos_cpu.json, chaos_megatron_cpu.json for megatron).
Prints a summary and writes {"engine", "faults", "recovered", "run_stopped", "steps_lost",
"max_abs_loss_diff", "checkpoints_lost", "max_stall_s"} (+ per-kind counts, the schedule and
every timeline); "run_stopped": the error that stopped the run, null when it trained every step.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from pathlib import Path

from bench import actor_env, logical_cluster

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")

KINDS = ("kill", "exception", "hang", "node", "save_kill", "save_error", "recovery_failure",
         "storage_outage", "corrupt_shard")
STEP_POINTS = ("step_start", "before_allreduce", "inside_allreduce", "after_optimizer_step")
GAP = 3          # steps between faults
INTERVAL = 2     # checkpoint interval (steps)
OUTAGE_S = 10.0  # storage outage length (s): the next save's retries all fall inside it


WORLD = {"torch": 2, "megatron": 4}  # ranks of each engine's layout (make_cfg)
TP = {"torch": 1, "megatron": 2}
TINY_MEGATRON = ["model.dtype=float32", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                 "model.ffn_hidden_size=128", "model.vocab_size=128", "model.max_seq_len=16", "train.seq_len=16",
                 "train.global_batch_size=4", "train.mini_batch_size=4", "train.micro_batch_size=1",
                 "checkpoint.async_save=false"]  # a GPT small enough for gloo on a few CPU cores


def schedule(n_faults: int, seed: int, world: int = 2) -> list[dict]:
    """Faults in step order; kinds round-robin, points and ranks (of `world`) from `seed`. Save
    faults land on save steps (multiples of INTERVAL)."""
    rng = random.Random(seed)
    out, step = [], 3
    for i in range(n_faults):
        kind = KINDS[i % len(KINDS)]
        if kind in ("save_kill", "save_error", "storage_outage") and step % INTERVAL:
            step += 1
        out.append({"kind": kind, "step": step, "rank": rng.randrange(world),
                    "point": rng.choice(STEP_POINTS if kind != "hang" else STEP_POINTS[:2])})
        step += GAP
    return out


def chaos_events(faults: list[dict], world: int = 2) -> list[dict]:
    """The actor-side part of the schedule (ranks of `world`), as `chaos.events` of the config."""
    ev = []
    for f in faults:
        s, r, k = f["step"], f["rank"], f["kind"]
        if k in ("kill", "exception", "hang"):
            ev.append({"step": s, "rank": r, "kind": k, "point": f["point"]})
        elif k == "node":
            ev.append({"step": s, "rank": r, "kind": "node"})
        elif k == "save_kill":
            ev.append({"step": s, "rank": 0, "kind": "kill", "point": "mid_save" if r else "during_save"})
        elif k == "save_error":
            ev.append({"step": s, "rank": r, "kind": "exception", "point": "during_save"})
        elif k == "recovery_failure":
            ev += [{"step": s, "rank": r, "kind": "kill", "point": "step_start"},
                   {"step": s, "rank": (r + 1) % world, "kind": "exception", "point": "during_recovery"}]
        elif k == "corrupt_shard":
            ev += [{"step": s + 1, "rank": q, "kind": "kill", "point": "step_start"} for q in range(world)]
    return ev


def make_cfg(uri: str, run_dir: str, steps: int, spares: int, events: list, engine: str = "torch", nodes: int = 3):
    """The soak's config: `engine`'s layout (WORLD ranks) on `nodes` nodes, checkpoints every INTERVAL
    steps at `uri`, short timeouts, `events` as chaos.events. Megatron: resolved as for a GPU,
    then put on CPU (gloo)."""
    from ftrain.config import load_config, resolve, resolve_megatron_on_cpu
    layout = [] if engine == "torch" else [*TINY_MEGATRON, f"parallel.tp={TP[engine]}", "model.distributed_optimizer=true",
                                           "fault_tolerance.shard_keeper=true"]
    cfg = load_config(ROOT / "config.yaml", [
        *layout, f"cluster.num_nodes={nodes}", f"cluster.num_workers={WORLD[engine]}", f"cluster.num_spares={spares}",
        "cluster.cpus_per_actor=0.5", f"train.steps={steps}", f"checkpoint.interval={INTERVAL}",
        "checkpoint.keep_last=3", "checkpoint.retry_budget_s=1.5", f"checkpoint.uri={uri}",
        f"run_dir={run_dir}", "fault_tolerance.health_timeout_s=5",
        "fault_tolerance.min_step_timeout_s=3", "fault_tolerance.rendezvous_timeout_s=20",
        "fault_tolerance.health_interval_s=0.2", f"chaos.events={json.dumps(events)}"])
    cfg = resolve(cfg, num_gpus=0) if engine == "torch" else resolve_megatron_on_cpu(cfg)
    assert cfg.model.engine == engine, cfg.model.engine
    return cfg


def corrupt_newest(ckpt) -> int:
    """Flip bytes in the largest file of the newest committed checkpoint; returns its step."""
    manifest = ckpt.latest_verified()
    f = max(manifest.files, key=lambda f: f.size)
    path = f"{ckpt.step_uri(manifest.step)}/{f.path}"
    data = bytearray(ckpt.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    ckpt.fs.pipe_file(path, bytes(data))
    return manifest.step


def pool_needed(faults: list[dict], world: int) -> int:
    """Spares the pool must hold before each fault: the most ranks one fault of the schedule
    replaces (every rank for a corrupt checkpoint or, at most, a node loss), plus one."""
    lost = {"recovery_failure": 2, "storage_outage": 0, "node": world, "corrupt_shard": world}
    return max((lost.get(f["kind"], 1) for f in faults), default=0) + 1


def spares_for(least: int, engine: str, nodes: int) -> int:
    """At least `least` spares, as many more as the placement needs: the actors spread evenly
    over `nodes` nodes, each node's count a multiple of tp (TP groups stay inside a node)."""
    n = least
    while TP[engine] > 1 and (WORLD[engine] + n) % (nodes * TP[engine]):
        n += 1
    return n


def run_soak(n_faults: int, seed: int, nodes: int = 3, engine: str = "torch") -> dict:
    """The soak of `n_faults` faults (`schedule` of `seed`) on a cluster of `nodes` logical nodes,
    checkpoints on a loopback S3 server; returns the result (the module's JSON)."""
    from ftrain.testbeds.local_storage import S3Server

    faults = schedule(n_faults, seed, WORLD[engine])
    s3 = S3Server().start()
    env = {"AWS_ENDPOINT_URL": s3.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "RAY_IGNORE_UNHANDLED_ERRORS": "1", **actor_env(ROOT)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    tag = f"chaos-{int(time.time())}"
    try:
        with logical_cluster(nodes, ROOT):
            return soak(faults, s3, tag, nodes, engine, seed)
    finally:
        s3.stop()
        for k, v in saved.items():  # callers (tests) keep their own storage endpoints
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def soak(faults: list[dict], s3, tag: str, nodes: int, engine: str, seed: int) -> dict:
    """The reference and the faulty run on the cluster `run_soak` made; returns the result."""
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    world = WORLD[engine]
    steps = faults[-1]["step"] + GAP
    ref_cfg = make_cfg(s3.uri(f"{tag}/ref"), f"/tmp/{tag}/ref", steps, spares_for(0, engine, nodes), [], engine, nodes)
    group = ActorGroup(MegatronActor, ref_cfg)
    try:
        ref = Trainer(ref_cfg, group, CheckpointManager.from_config(ref_cfg.checkpoint))
        ref.train(steps)
    finally:
        group.shutdown()

    need = pool_needed(faults, world)
    spares = need + 3 if any(f["kind"] == "node" for f in faults) else need  # a node loss takes its spares too
    cfg = make_cfg(s3.uri(f"{tag}/run"), f"/tmp/{tag}/run", steps, spares_for(spares, engine, nodes),
                   chaos_events(faults, world), engine, nodes)
    group = ActorGroup(MegatronActor, cfg)
    by_step = {f["step"]: f for f in faults}
    corrupted: set[int] = set()
    outage: list[threading.Thread] = []

    def restart_later():  # longer than a save's retries (a single attempt can take ~3 s)
        time.sleep(OUTAGE_S)
        s3.start()

    def after_step(trainer, step):
        nxt = step + 1
        if any(e["step"] == nxt for e in cfg.chaos.events) or nxt in by_step:
            for t in outage:  # the store must be back before the next fault
                t.join()
            outage.clear()
            deadline = time.monotonic() + 120
            while len(group.pool) < need and time.monotonic() < deadline:  # refills keep up
                group.poll_refills()
                time.sleep(0.2)
        f = by_step.get(step)
        if f and f["kind"] == "storage_outage":
            s3.stop()  # down before the next step, and so before the next save
            outage.append(threading.Thread(target=restart_later))
            outage[-1].start()
        elif f and f["kind"] == "corrupt_shard" and trainer.checkpoints:
            corrupted.add(corrupt_newest(trainer.ckpt))

    stopped = None
    try:
        t0 = time.perf_counter()
        run = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        try:
            run.train(steps, after_step=after_step)
        except Exception as e:  # noqa: BLE001 (the soak reports what stopped the run)
            stopped = f"{type(e).__name__}: {e}"
        wall = time.perf_counter() - t0
    finally:
        for t in outage:
            t.join()
        group.shutdown()
    retained = set(run.ckpt.committed_steps())
    lost = [s for s in retained - corrupted if run.ckpt.verify(s)]
    diffs = [abs(run.losses[s] - ref.losses[s]) for s in ref.losses if s in run.losses]
    result = {
        "engine": engine, "nodes": nodes, "faults": len(faults),
        "recovered": len(faults) if stopped is None and len(run.losses) == steps else 0,
        "run_stopped": stopped,
        "recoveries": len(run.recoveries),
        "steps_lost": sum(t.steps_lost for t in run.recoveries),
        "max_abs_loss_diff": max(diffs, default=0.0),
        "replays_equal": all(v == run.losses[s] for s, vs in run.replayed.items() for v in vs),
        "checkpoints_lost": len(lost),
        "checkpoints_corrupted_on_purpose": sorted(corrupted),
        "saves_skipped_by_storage_outage": run.failed_saves,
        "max_stall_s": max((t.total_s for t in run.recoveries), default=0.0),
        "steps": steps, "wall_s": wall,
        "kinds": {k: sum(f["kind"] == k for f in faults) for k in KINDS},
        "recovery_kinds": {k: sum(t.kind == k for t in run.recoveries) for k in ("crash", "exception", "hang")},
        "restore_sources": sorted({t.restore_source for t in run.recoveries}),
        "schedule": faults, "timelines": [t.to_dict() for t in run.recoveries],
        "seed": seed, "date": time.strftime("%Y-%m-%d"),
    }
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=sorted(WORLD), default="torch")
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--nodes", type=int, default=3, help="logical Ray nodes (a node loss needs 2 or more)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default: bench/results/chaos_cpu.json (torch), "
                                               "chaos_megatron_cpu.json (megatron)")
    args = p.parse_args(argv)
    out = args.out or str(ROOT / "bench" / "results" / ("chaos_cpu.json" if args.engine == "torch"
                                                          else f"chaos_{args.engine}_cpu.json"))
    r = run_soak(args.faults, args.seed, args.nodes, args.engine)
    for key in ("engine", "faults", "recovered", "run_stopped", "recoveries", "steps_lost", "max_abs_loss_diff",
                "checkpoints_lost", "max_stall_s", "steps", "wall_s"):
        print(f"{key:<20}{r[key]}")
    print(f"{'kinds':<20}{r['kinds']}\n{'restore sources':<20}{r['restore_sources']}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(r, indent=1))
    print(f"wrote {out}")
    return r


if __name__ == "__main__":
    main()
