"""Command line: `python main.py demo|train [--config FILE] [--set a.b=value ...]`.

demo  : reference run without failure, then the same steps with one whole DP replica killed
        (train a step, checkpoint, train a step, kill, detect, recover from spares, replay,
        two more steps); prints both loss columns and the recovery timeline; exits 1 unless
        the losses match (bitwise on CPU).
train : `train.steps` steps with automatic failure detection and recovery.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time

from config import Config, ConfigError, load_config, resolve

log = logging.getLogger("main")


def start_ray(cfg: Config) -> None:
    """Join `cluster.ray_address`, or start a local Ray with enough logical CPUs for every actor."""
    import os

    import ray

    # Results of calls aborted by recovery are discarded on purpose; don't log them as unhandled.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    c = cfg.cluster
    if c.ray_address:
        ray.init(address=c.ray_address, include_dashboard=False, log_to_driver=False)
        return
    needed = math.ceil((c.num_workers + c.num_spares) * c.cpus_per_actor)
    ray.init(num_cpus=c.ray_num_cpus or max(needed, 1), include_dashboard=False,
             log_to_driver=False)


def run_steps(cfg: Config, kill_replica: int | None, kill_ranks: list[int] | None = None) -> dict:
    """The demo's scripted sequence on a fresh actor group; returns losses and timelines.
    After step 2 it kills the ranks `kill_ranks`, else every rank of DP replica `kill_replica`
    (None and None: no failure)."""
    import ray
    from megatron_actor import MegatronActorGroup
    from trainer import Trainer

    group = MegatronActorGroup(cfg)
    try:
        for line in group.describe():
            log.info("placement: %s", line)
        trainer = Trainer(cfg, group)
        trainer.train(1)
        trainer.save(1)
        trainer.train(2)
        if kill_ranks or kill_replica is not None:
            ranks = kill_ranks or group.dims.replica_ranks(kill_replica)
            log.warning("demo: killing rank(s) %s with ray.kill", ranks)
            for r in ranks:
                ray.kill(group.workers[r].handle, no_restart=True)
            trainer.failed_at = time.time()
        trainer.train(4)
        return {"losses": trainer.losses, "replayed": trainer.replayed,
                "recoveries": [t.to_dict() for t in trainer.recoveries],
                "spares_left": len(group.pool)}
    finally:
        group.shutdown()


def losses_match(a: float, b: float, cfg: Config) -> bool:
    """Bitwise on CPU (float32, deterministic); on GPU within bf16 tolerance: relative 2e-2,
    about 2.5 bf16 ulps (bf16 has an 8-bit mantissa, ulp 2^-7 = 7.8e-3 relative)."""
    return a == b if cfg.cluster.device == "cpu" else math.isclose(a, b, rel_tol=2e-2, abs_tol=1e-3)


def print_report(ref: dict, run: dict, cfg: Config) -> bool:
    """Print the per-step loss table and the recovery timeline; True when all losses match."""
    ok = True
    print(f"\n{'step':>4}  {'reference loss':>22}  {'with failure':>22}  {'replays':>22}  match")
    for step in sorted(ref["losses"]):
        a, b = ref["losses"][step], run["losses"].get(step, float("nan"))
        replays = run["replayed"].get(step, [])
        match = losses_match(a, b, cfg) and all(losses_match(a, r, cfg) for r in replays)
        ok &= match
        print(f"{step:>4}  {a:>22.17g}  {b:>22.17g}  {', '.join(f'{r:.17g}' for r in replays):>22}  "
              f"{'yes' if match else 'NO'}")
    for tl in run["recoveries"]:
        print(f"\nrecovery ({tl['kind']}): ranks {tl['failed_ranks']} on {tl['failed_nodes']}, "
              f"restored step {tl['restored_step']} from {tl['restore_source']}, "
              f"steps lost {tl['steps_lost']}, attempts {tl['attempts']}")
        for phase in ("detect_s", "abort_s", "replace_s", "rebuild_s", "restore_s", "first_step_s", "total_s"):
            print(f"  {phase[:-2]:<11} {tl[phase]:8.3f} s")
    if not run["recoveries"]:
        ok = False
        print("no recovery happened")
    print(f"\nlosses {'match' if ok else 'DIFFER'} "
          f"({'bitwise' if cfg.cluster.device == 'cpu' else 'bf16 tolerance'})")
    return ok


def cmd_demo(cfg: Config, args) -> int:
    # The demo's checkpoint schedule is scripted (after step 1), not periodic.
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, interval=0))
    # On GPUs the reference run keeps the (idle) spares: fractional GPU bundles then fill every
    # GPU the same way, so no two ranks of one process group share a GPU.
    ref_cfg = cfg if cfg.cluster.device == "cuda" else dataclasses.replace(
        cfg, cluster=dataclasses.replace(cfg.cluster, num_spares=0))
    log.info("reference run (no failure, %d workers)", cfg.cluster.num_workers)
    ref = run_steps(dataclasses.replace(ref_cfg, checkpoint=dataclasses.replace(
        cfg.checkpoint, uri=cfg.checkpoint.uri.rstrip("/") + "-reference")), None)
    log.info("run with failure (%d workers + %d spares)", cfg.cluster.num_workers, cfg.cluster.num_spares)
    run = run_steps(cfg, args.kill_replica, args.kill_ranks)
    ok = print_report(ref, run, cfg)
    from pathlib import Path
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "demo.json").write_text(json.dumps({"reference": ref, "run": run, "match": ok}, indent=1))
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(demo_summary(ref, run, cfg, ok), indent=1))
    return 0 if ok else 1


def demo_summary(ref: dict, run: dict, cfg: Config, ok: bool) -> dict:
    """The demo's evidence record: device, layout, pass/fail, the largest |loss difference|
    (reference vs run and every replay), the first recovery's total seconds and timeline."""
    import torch

    gpus = torch.cuda.device_count() if cfg.cluster.device == "cuda" else 0
    diffs = [abs(a - b) for s, a in ref["losses"].items()
             for b in [run["losses"].get(s, math.nan)] + run["replayed"].get(s, [])]
    tl = run["recoveries"][0] if run["recoveries"] else {}
    d, m = cfg.dims, cfg.model
    return {"device": f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "layout": {"tp": d.tp, "pp": d.pp, "cp": d.cp, "dp": d.dp,
                       "workers": cfg.cluster.num_workers, "spares": cfg.cluster.num_spares,
                       "gpus_per_actor": cfg.cluster.gpus_per_actor, "engine": m.engine,
                       "dtype": m.dtype, "distributed_optimizer": m.distributed_optimizer,
                       "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                       "seq_len": cfg.train.seq_len},
            "passed": ok, "loss_max_abs_diff": max(diffs) if diffs else None,
            "recovery_s": tl.get("total_s"), "timeline": tl,
            "losses": {"reference": ref["losses"], "with_failure": run["losses"],
                       "replayed": run["replayed"]}}


def cmd_train(cfg: Config, args) -> int:
    from megatron_actor import MegatronActorGroup
    from trainer import Trainer

    group = MegatronActorGroup(cfg)
    try:
        trainer = Trainer(cfg, group)
        trainer.train(cfg.train.steps)
        for step in sorted(trainer.losses):
            print(f"step {step:>5}  loss {trainer.losses[step]:.6f}")
        print(f"recoveries: {len(trainer.recoveries)}; spares left: {len(group.pool)}; "
              f"dp now {group.dims.dp}")
        if trainer.recoveries:
            print(trainer.report())
    finally:
        group.shutdown()
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["demo", "train"], help="what to run")
    p.add_argument("--config", default="config.yaml", help="YAML config file (default: config.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override one config value, e.g. --set train.steps=10 (repeatable)")
    p.add_argument("--kill-replica", type=int, default=1, metavar="D",
                   help="demo: the DP replica whose ranks are killed after step 2 (default 1)")
    p.add_argument("--kill-ranks", type=int, nargs="+", default=None, metavar="R",
                   help="demo: kill these global ranks instead of a whole replica (e.g. one TP rank)")
    p.add_argument("--summary", default=None, metavar="PATH",
                   help="demo: also write a JSON summary (device, layout, passed, loss diff, timeline)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = resolve(load_config(args.config, args.overrides))
        if args.mode == "demo" and args.kill_ranks:
            bad = [r for r in args.kill_ranks if not 0 <= r < cfg.dims.world_size]
            if bad:
                raise ConfigError(f"--kill-ranks {bad}: must be in [0, world size={cfg.dims.world_size})")
        elif args.mode == "demo" and not 0 <= args.kill_replica < cfg.dims.dp:
            raise ConfigError(f"--kill-replica {args.kill_replica}: must be in [0, dp={cfg.dims.dp})")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    start_ray(cfg)
    return {"demo": cmd_demo, "train": cmd_train}[args.mode](cfg, args)


if __name__ == "__main__":
    sys.exit(main())
