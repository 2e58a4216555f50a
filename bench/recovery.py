"""Recovery benchmark: our in-place recovery vs. a full job restart, measured in one run.

(i) Recovery: a DP replica is killed with `ray.kill` between steps; the next step detects it,
    a pre-warmed spare replaces it, groups are rebuilt, state comes from peers, the step runs.
    Time = detect + abort + replace + rebuild + restore + first step (RecoveryTimeline).
    The same steps also run without a failure first: `matches_reference` says whether the
    losses match (`main.losses_match`) and the final training states are bitwise identical.
(ii) Full restart, as a job restart would do it: detect (same as (i)), then every actor torn down
    and the placement group removed, a new placement group and actors (imports, model build),
    a new process-group generation, the newest checkpoint loaded, and the first step re-run.

Usage (repository root): python -m bench.recovery [--repeats 3] [--full-restarts N] [--config config.yaml]
                                                  [--set a.b=v ...]
Prints a table and writes bench/results/recovery_<device>.json:
{"recovery_s", "full_restart_s", "ratio", "steps_lost", "full_restart_steps_lost", "detect_s",
 "step_s", "timeline", "matches_reference", "runs", "config"} (medians over repeats; `timeline` is the median run's;
 `step_s`: the median step without a recovery, `Trainer.steady_step_s`, beside `first_step_s`).
The JSON is first written before the full restarts (without their keys), so a run cut short
there keeps its recoveries; `--full-restarts 0` skips them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import ray

from actor_group import ActorGroup
from config import load_config, resolve
from main import losses_match, start_ray
from parallel_dims import ParallelDims
from trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


def kill_replica(trainer: Trainer, replica: int) -> None:
    trainer.group.kill(trainer.group.dims.replica_ranks(replica))


def full_restart(cfg, detect_s: float) -> float:
    """Seconds from the failure to the first step done after a whole-job restart from the newest
    checkpoint (the steps since that checkpoint are lost on top of this)."""
    t0 = time.perf_counter()
    group = ActorGroup(cfg)
    try:
        trainer = Trainer(cfg, group)
        manifest = trainer.ckpt.latest_verified()
        group.call("load_checkpoint", manifest)
        trainer.committed_step = manifest.step
        trainer.train(manifest.step + 1)
        return detect_s + time.perf_counter() - t0
    finally:
        group.shutdown()


def reference_run(cfg, steps: int) -> tuple[dict, list[str]]:
    """The same steps without a failure (its own checkpoint URI): (losses, state digests)."""
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, uri=cfg.checkpoint.uri + "-reference"))
    group = ActorGroup(cfg)
    try:
        trainer = Trainer(cfg, group)
        trainer.train(steps)
        return trainer.losses, group.state_digests()
    finally:
        group.shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--full-restarts", type=int, default=None,
                   help="whole-job restarts to time for comparison (default max(1, repeats - 1); 0: none)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/recovery_<device>.json)")
    args = p.parse_args(argv)
    run_dir = f"/tmp/bench_recovery_{int(time.time())}"
    cfg = resolve(load_config(args.config, [f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt",
                                            "checkpoint.interval=2", *args.overrides]))
    dims = ParallelDims.from_config(cfg)
    if cfg.cluster.num_spares < args.repeats * len(dims.replica_ranks(0)):
        sys.exit(f"--repeats {args.repeats} needs cluster.num_spares >= {args.repeats * len(dims.replica_ranks(0))}")
    start_ray(cfg)
    steps = 3 + 2 * args.repeats
    ref_losses, ref_digests = reference_run(cfg, steps)

    group = ActorGroup(cfg)
    trainer = Trainer(cfg, group)
    trainer.train(3)  # kills land between checkpoints (every 2 steps), as failures do
    # Spares finish pre-warming first (GPU: `MegatronEngine.warm_up`), as in a long job: `noop`
    # runs on a spare's compute thread once the warm-up queued there is done.
    ray.get([s.handle.noop.remote() for s in group.pool.spares])
    committed_at_kill = []
    for i in range(args.repeats):
        kill_replica(trainer, 1 + i % (dims.dp - 1) if dims.dp > 1 else 0)
        committed_at_kill.append(trainer.committed_step)
        trainer.train(trainer.committed_step + 2)   # detect + recover + first step, then one more
    timelines = trainer.recoveries
    step_s = trainer.steady_step_s()
    digests = group.state_digests()
    group.shutdown()
    matches = {"losses": all(losses_match(ref_losses[s], trainer.losses[s], cfg) for s in ref_losses),
               "state": digests == ref_digests}
    totals = [t.total_s for t in timelines]
    median_tl = sorted(timelines, key=lambda t: t.total_s)[len(timelines) // 2]
    result = {
        "recovery_s": statistics.median(totals),
        "steps_lost": max(t.steps_lost for t in timelines),
        "detect_s": statistics.median(t.detect_s for t in timelines),
        "step_s": step_s,
        "timeline": median_tl.to_dict(),
        "matches_reference": matches,
        "runs": {"recoveries": [t.to_dict() for t in timelines], "full_restarts": []},
        "config": {"device": cfg.cluster.device, "engine": cfg.model.engine,
                   "workers": cfg.cluster.num_workers, "spares": cfg.cluster.num_spares,
                   "tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "dp": dims.dp,
                   "date": time.strftime("%Y-%m-%d")},
    }
    print(f"\n{'phase':<14}{'seconds':>10}")
    for phase in (*median_tl.PHASES, "total_s"):
        print(f"{phase[:-2]:<14}{median_tl.to_dict()[phase]:>10.3f}")
    print(f"{'(steady step':<14}{step_s:>10.3f})")
    print(f"vs the run without failure: losses {'match' if matches['losses'] else 'DIFFER'}, final training "
          f"state (weights + optimizer) {'identical' if matches['state'] else 'differs'}")
    out = Path(args.out or ROOT / "bench" / "results" / f"recovery_{cfg.cluster.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))  # kept even when the restarts below are cut short
    n = max(1, len(timelines) - 1) if args.full_restarts is None else args.full_restarts
    restarts = result["runs"]["full_restarts"]
    for i, tl in enumerate(timelines[:n]):
        restarts.append({"full_restart_s": full_restart(cfg, tl.detect_s),
                         "steps_lost": committed_at_kill[i] % cfg.checkpoint.interval})
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
    return result


if __name__ == "__main__":
    main()
