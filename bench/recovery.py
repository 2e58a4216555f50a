"""Recovery benchmark: our in-place recovery vs. a full job restart, measured in one run.

(i) Recovery: a DP replica (at dp = 1: rank 0) is killed with `ray.kill` in the middle of a
    step (`--kill-at` of a steady step after it started, one step after the pool holds a warm
    spare again, so the keepers' copies run as in steady training; with the local keeper also
    once that step is kept and the spare has mapped the kept arenas, as in a long job whose
    failures come minutes apart: `wait_for_kept`); the step detects it, a
    pre-warmed spare replaces it, groups are rebuilt, state comes from the cheapest source
    (peers, the keepers, snapshots, the checkpoint), the step runs.
    Time = detect + abort + replace + rebuild + restore + first step (RecoveryTimeline).
    The same steps also run without a failure first: `matches_reference` says whether the
    losses match (`main.losses_match`) and the final training states are bitwise identical.
(ii) Full restart, as a job restart would do it: detect (same as (i)), then every actor torn down
    and the placement group removed, a new placement group and actors (imports, model build),
    a new process-group generation, the newest checkpoint loaded, and the first step re-run.

Usage (repository root): python -m bench.recovery [--repeats 3] [--full-restarts N] [--kill-at 0.5]
                                                  [--no-reference] [--config config.yaml] [--set a.b=v ...]
Spares: with `fault_tolerance.refill_spares` (the default) one spare serves every repeat (each
kill waits for the refill of the freed bundle); without, `cluster.num_spares` >= repeats x the
replica's ranks.
Prints a table and writes bench/results/recovery_<device>.json:
{"recovery_s", "full_restart_s", "ratio", "steps_lost", "full_restart_steps_lost", "detect_s",
 "step_s", "save_stall_s", "restore_sources", "defaults_only", "device", "timeline",
 "matches_reference" (null with --no-reference), "runs", "config"} (medians over repeats;
 `timeline` is the median run's;
 `step_s`: the median step without a recovery, `Trainer.steady_step_s`, beside `first_step_s`;
 `steps_lost`: the most of any repeat; `save_stall_s`: the longest time training waited for one
 checkpoint save, `Trainer.save_stalls` (not the waits for the last writes when `train` returns,
 `final_save_wait_s`; saves postponed while one was written: `postponed_saves`; the slowest rank's
 seconds by part of starting each async save: `save_details`); `defaults_only`: no `--set` but the cluster size, the
 model's shape and the steps, and the default config file).
The JSON is first written before the full restarts (without their keys), so a run cut short
there keeps its recoveries; `--full-restarts 0` skips them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import ray

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.state.keeper import keeps_locally, local_key
from ftrain.trainer import Trainer
from main import losses_match, start_ray
from megatron_actor import MegatronActor

ROOT = Path(__file__).resolve().parent.parent
# What a run with the defaults may still set: the cluster's size, the model's shape, the
# parallel layout, the batch and the steps (the job, not how it is protected).
SIZE_KEYS = {"cluster.num_workers", "cluster.num_spares", "train.steps", "train.seq_len", "train.global_batch_size",
             "train.mini_batch_size", "train.micro_batch_size", "parallel.tp", "parallel.pp", "parallel.cp"} | {
    f"model.{k}" for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
                           "vocab_size", "max_seq_len")}


def defaults_only(config: str, overrides: list[str]) -> bool:
    """Whether a run of `config` with `--set` `overrides` keeps every default but the job's
    shape (`SIZE_KEYS`): the repository's config.yaml and no other key set."""
    return Path(config).resolve() == ROOT / "config.yaml" and all(o.split("=")[0] in SIZE_KEYS for o in overrides)


def kill_mid_step(trainer: Trainer, ranks: list[int], delay_s: float, committed_at_kill: list[int]) -> threading.Timer:
    """Kill `ranks` `delay_s` seconds from now, from a timer thread (the trainer's next step
    runs meanwhile), recording the committed step at that moment in `committed_at_kill`."""
    def kill():
        committed_at_kill.append(trainer.committed_step)
        trainer.group.kill(ranks)

    timer = threading.Timer(delay_s, kill)
    timer.start()
    return timer


def wait_for_spares(group: ActorGroup, need: int, timeout_s: float = 600.0) -> None:
    """Block until the pool holds `need` spares whose warm-up is done (refills of killed ranks'
    bundles are built in the background, `ActorGroup.poll_refills`). Raises TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while len(group.pool.spares) < need:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the spare pool did not get {need} spare(s) back within {timeout_s:.0f} s")
        group.poll_refills()
        time.sleep(0.5)
    # `noop` runs on a spare's compute thread once the warm-up queued there is done (GPU: `MegatronEngine.warm_up`).
    ray.get([s.handle.noop.remote() for s in group.pool.spares])


def wait_for_kept(group: ActorGroup, step: int, timeout_s: float = 600.0) -> None:
    """With the local keeper (keeper.py): block until every rank's node holder keeps that rank's
    state of `step` (a replacement's arenas are pinned and adopted some steps after it joins)
    and every spare has mapped its node's kept arenas (`keeper.LocalMaps`, seconds for tens of
    GB), as in a long job whose failures come minutes apart. Raises TimeoutError."""
    deadline = time.monotonic() + timeout_s

    def ready() -> bool:
        held = group.held_snapshots()
        return all(step in held.get(local_key(str(group.dims), r, w.node_id), ()) for r, w in enumerate(group.workers)) \
            and all(ray.get(s.handle.__ray_call__.remote(lambda a, listed: a._local_maps.covers(listed),
                                                         ray.get(group.holders[s.node_id].arenas.remote())))
                    for s in group.pool.spares if s.node_id in group.holders)

    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the local keeper's arenas of step {step} were not kept and mapped within {timeout_s:.0f} s")
        time.sleep(0.2)


def device_name(cfg) -> str:
    """The accelerator the ranks ran on, in words."""
    if cfg.cluster.device == "cuda":
        import torch
        return torch.cuda.get_device_name(0)
    return f"cpu: {os.cpu_count()} cores"


def full_restart(cfg, detect_s: float) -> float:
    """Seconds from the failure to the first step done after a whole-job restart from the newest
    checkpoint (the steps since that checkpoint are lost on top of this)."""
    t0 = time.perf_counter()
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        manifest = trainer.ckpt.latest_verified()
        group.call("load_checkpoint", manifest)
        trainer.committed_step = manifest.step
        trainer.train(manifest.step + 1)
        return detect_s + time.perf_counter() - t0
    finally:
        group.shutdown()


def reference_run(cfg, steps: int) -> tuple[dict, list[str]]:
    """The same steps without a failure (its own checkpoint URI, a local one deleted after: a
    large model's checkpoints would crowd the disk): (losses, state digests)."""
    uri = cfg.checkpoint.uri + "-reference"
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, uri=uri))
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(steps)
        return trainer.losses, group.state_digests()
    finally:
        group.shutdown()
        if "://" not in uri:
            shutil.rmtree(uri, ignore_errors=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--full-restarts", type=int, default=None,
                   help="whole-job restarts to time for comparison (default max(1, repeats - 1); 0: none)")
    p.add_argument("--kill-at", type=float, default=0.5,
                   help="when the kill lands in a step, as a fraction of the steady step time (default 0.5)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the run without failure (matches_reference null): half the time on a large model")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/recovery_<device>.json)")
    args = p.parse_args(argv)
    run_dir = f"/tmp/bench_recovery_{int(time.time())}"
    cfg = resolve(load_config(args.config, [f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt", *args.overrides]))
    dims = ParallelDims.from_config(cfg)
    replica = len(dims.replica_ranks(0))
    if not cfg.fault_tolerance.refill_spares and cfg.cluster.num_spares < args.repeats * replica:
        sys.exit(f"--repeats {args.repeats} needs cluster.num_spares >= {args.repeats * replica} "
                 f"without fault_tolerance.refill_spares")
    start_ray(cfg)
    steps = 3 + 3 * args.repeats
    ref_losses, ref_digests = (None, None) if args.no_reference else reference_run(cfg, steps)

    group = ActorGroup(MegatronActor, cfg)
    trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
    trainer.train(3)
    committed_at_kill = []
    for i in range(args.repeats):
        # Spares warm again (as in a long job), one steady step (its copies overlap the next
        # step, as in steady training), then the kill in the middle of the next step.
        wait_for_spares(group, replica)
        trainer.train(trainer.committed_step + 1)
        if keeps_locally(cfg.fault_tolerance.shard_keeper, dims.dp, cfg.cluster.num_spares):
            wait_for_kept(group, trainer.committed_step)
        kill = kill_mid_step(trainer, dims.replica_ranks(1 + i % (dims.dp - 1) if dims.dp > 1 else 0),
                             args.kill_at * trainer.steady_step_s(), committed_at_kill)
        trainer.train(3 + 3 * (i + 1))   # detect + recover + first step, then one more
        kill.join()
    timelines = trainer.recoveries
    step_s = trainer.steady_step_s()
    save_stalls = list(trainer.save_stalls)
    digests = group.state_digests()
    group.shutdown()
    matches = None if ref_losses is None else {
        "losses": all(losses_match(ref_losses[s], trainer.losses[s], cfg) for s in ref_losses),
        "state": digests == ref_digests}
    totals = [t.total_s for t in timelines]
    median_tl = sorted(timelines, key=lambda t: t.total_s)[len(timelines) // 2]
    result = {
        "recovery_s": statistics.median(totals),
        "steps_lost": max(t.steps_lost for t in timelines),
        "save_stall_s": max(save_stalls, default=0.0),
        "defaults_only": defaults_only(args.config, args.overrides),
        "device": device_name(cfg),
        "restore_sources": [t.restore_source for t in timelines],
        "detect_s": statistics.median(t.detect_s for t in timelines),
        "step_s": step_s,
        "save_stalls_s": save_stalls,
        "save_details": list(trainer.save_details),
        "postponed_saves": list(trainer.postponed_saves),
        "final_save_wait_s": trainer.final_save_wait_s,
        "timeline": median_tl.to_dict(),
        "matches_reference": matches,
        "runs": {"recoveries": [t.to_dict() for t in timelines], "full_restarts": []},
        "config": {"device": cfg.cluster.device, "engine": cfg.model.engine,
                   "workers": cfg.cluster.num_workers, "spares": cfg.cluster.num_spares,
                   "tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "dp": dims.dp,
                   "async_save": cfg.checkpoint.async_save, "shard_keeper": cfg.fault_tolerance.shard_keeper,
                   "distributed_optimizer": cfg.model.distributed_optimizer, "kill_at": args.kill_at,
                   "overrides": args.overrides, "date": time.strftime("%Y-%m-%d")},
    }
    print(f"\n{'phase':<14}{'seconds':>10}")
    for phase in (*median_tl.PHASES, "total_s"):
        print(f"{phase[:-2]:<14}{median_tl.to_dict()[phase]:>10.3f}")
    print(f"{'(steady step':<14}{step_s:>10.3f})")
    print(f"restored from {', '.join(result['restore_sources'])}; steps lost {result['steps_lost']}; longest "
          f"checkpoint save stall {result['save_stall_s']:.3f} s")
    if matches is not None:
        print(f"vs the run without failure: losses {'match' if matches['losses'] else 'DIFFER'}, final training "
              f"state (weights + optimizer) {'identical' if matches['state'] else 'differs'}")
    out = Path(args.out or ROOT / "bench" / "results" / f"recovery_{cfg.cluster.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))  # kept even when the restarts below are cut short
    n = max(1, len(timelines) - 1) if args.full_restarts is None else args.full_restarts
    restarts = result["runs"]["full_restarts"]
    for i, tl in enumerate(timelines[:n]):
        restarts.append({"full_restart_s": full_restart(cfg, tl.detect_s),
                         "steps_lost": committed_at_kill[i] % cfg.checkpoint.interval if cfg.checkpoint.interval
                         else committed_at_kill[i]})
    if restarts:
        result["full_restart_s"] = statistics.median(r["full_restart_s"] for r in restarts)
        result["full_restart_steps_lost"] = max(r["steps_lost"] for r in restarts)
        result["ratio"] = result["full_restart_s"] / result["recovery_s"]
        print(f"\n{'':<26}{'ours':>10}{'full restart':>14}")
        print(f"{'time to first step (s)':<26}{result['recovery_s']:>10.3f}{result['full_restart_s']:>14.3f}")
        print(f"{'steps lost':<26}{result['steps_lost']:>10}{result['full_restart_steps_lost']:>14}")
        print(f"ratio full restart / ours: {result['ratio']:.1f}x  (medians over {args.repeats} recoveries, "
              f"{len(restarts)} restarts)")
        out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoints (tens of GB on a large model) would fill the disk of the next run
    return result


if __name__ == "__main__":
    main()
