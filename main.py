"""Fault-tolerant training on Ray: `python main.py {demo,train,plan,stop} [options]`.

demo  : reference run without failure, then the same steps with one whole DP replica killed
        (train a step, checkpoint, train a step, kill, detect, recover from spares, replay,
        two more steps); prints both loss columns and the recovery timeline; exits 1 unless
        the losses match (bitwise on CPU).
train : `train.steps` steps with automatic failure detection and recovery (inject failures
        with `--set chaos.events=[...]`), a progress bar on a terminal, and a report at the end.
        A checkpoint.uri holding this run's checkpoints resumes it from the newest one that
        verifies (a driver lost, a job resubmitted); checkpoints of another run stop it with
        one line naming both; `--fresh` deletes them and starts over (docs/checkpoints.md).
        With fault_tolerance.driver_failover on a cluster, a new driver reattaches to the live
        detached actors of its run instead (no step lost; driver_failover.py).
stop  : `stop --run NAME`: remove the detached actors and placement group of run NAME.
data  : `data prepare` (jsonl / parquet -> Megatron .bin/.idx), `data inspect --step S` (what a
        step trains on; no Ray), `data stdlib` (offline demo corpus); data_prepare.py.

Both write to `run_dir`: recoveries.jsonl, loss.png, recoveries.png, train.json or demo.json.
Exit status: 0 ok, 1 demo losses differ, 2 config, cluster or data error (one line on stderr).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path

from ftrain.config import Config, ConfigError, gpus_visible, load_config, resolve
from ftrain.distributed.parallel_dims import ParallelDims

log = logging.getLogger("main")


def start_ray(cfg: Config, log_to_driver: bool = False) -> None:
    """Join `cluster.ray_address`, or start a local Ray with enough logical CPUs for every actor.
    `log_to_driver`: forward the actors' stdout/stderr to this process (--verbose)."""
    import os

    import ray

    # Results of calls aborted by recovery are discarded on purpose; don't log them as unhandled.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    c = cfg.cluster
    if c.ray_address:
        from ftrain.control.driver_failover import namespace
        ns = namespace(cfg.run_name) if cfg.fault_tolerance.driver_failover else None
        ray.init(address=c.ray_address, include_dashboard=False, log_to_driver=log_to_driver, namespace=ns)
        return
    ray.init(address="local", num_cpus=local_ray_cpus(cfg), include_dashboard=False, log_to_driver=log_to_driver)


def local_ray_cpus(cfg: Config) -> int:
    """Logical CPUs of the local Ray `start_ray` starts: `cluster.ray_num_cpus`, by default
    enough for every actor."""
    c = cfg.cluster
    return c.ray_num_cpus or max(math.ceil((c.num_workers + c.num_spares) * c.cpus_per_actor), 1)


def log_placement(group) -> None:
    """One `event=placement` line per rank and spare: node, device, bundle, (tp, cp, dp, pp)."""
    for r, slot in enumerate(group.workers):
        c = group.dims.coords(r)
        log.info("event=placement role=rank rank=%d tp=%d cp=%d dp=%d pp=%d node=%s node_ip=%s "
                 "device=%s bundle=%d", r, c.tp, c.cp, c.dp, c.pp, slot.node_id[:8], slot.node_ip,
                 slot.device[1], slot.bundle_index)
    for slot in group.pool.spares:
        log.info("event=placement role=spare node=%s node_ip=%s device=%s bundle=%d",
                 slot.node_id[:8], slot.node_ip, slot.device[1], slot.bundle_index)


def placement_plan(cfg: Config) -> list[dict]:
    """The planned placement, computed from the config without starting Ray: bundle i goes to
    node i % num_nodes (SPREAD, num_nodes > 1) or node 0 (PACK), and on GPU to the node's GPU
    (local index // actors per GPU), actors per GPU = 1 / cluster.gpus_per_actor; then the run's
    own `assign_roles` picks ranks (one per device first) and spares. Ray decides the real
    nodes and GPUs at run time; they are logged as `event=placement` lines."""
    from ftrain.control.actor_group import assign_roles
    from ftrain.control.actor_slot import ActorSlot

    c = cfg.cluster
    per_gpu = max(1, int(1 / c.gpus_per_actor + 1e-9))
    slots = []
    for i in range(c.num_workers + c.num_spares):
        node, local = i % c.num_nodes, i // c.num_nodes
        gpu = [local // per_gpu] if c.device == "cuda" else []
        slots.append(ActorSlot(None, f"node{node}", f"node{node}", gpu, i))
    workers, spares = assign_roles(slots, c.num_workers)
    dims = ParallelDims.from_config(cfg)
    rows = [{"role": "rank", "rank": r, **dataclasses.asdict(dims.coords(r)), "slot": s}
            for r, s in enumerate(workers)]
    return rows + [{"role": "spare", "slot": s} for s in spares]


def print_dry_run(cfg: Config) -> None:
    """Print the resolved config (YAML) and the planned placement; nothing is started."""
    import yaml

    print("# resolved config")
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    c, d = cfg.cluster, ParallelDims.from_config(cfg)
    print(f"\n# planned placement (from the config, Ray not started): tp={d.tp} cp={d.cp} dp={d.dp} "
          f"pp={d.pp}, {c.num_workers} ranks + {c.num_spares} spares, one placement-group bundle each "
          f"({c.cpus_per_actor} CPU" + (f", {c.gpus_per_actor} GPU)" if c.device == "cuda" else ")"))
    print(f"{'role':<6} {'rank':>4} {'tp':>3} {'cp':>3} {'dp':>3} {'pp':>3}  {'bundle':>6}  {'node':<8} device")
    for row in placement_plan(cfg):
        s = row["slot"]
        dev = f"GPU {s.gpu_ids[0]}" if s.gpu_ids else "CPU"
        coords = " ".join(f"{row[k]:>3}" for k in ("tp", "cp", "dp", "pp")) if row["role"] == "rank" else " " * 15
        print(f"{row['role']:<6} {row.get('rank', ''):>4} {coords}  {s.bundle_index:>6}  {s.node_id:<8} {dev}")
    if c.device == "cuda" and c.gpus_per_node:
        per_node = -(-(c.num_workers + c.num_spares) // c.num_nodes)
        need = -(-per_node // max(1, int(1 / c.gpus_per_actor + 1e-9)))
        if need > c.gpus_per_node:
            print(f"WARNING: {need} GPUs per node needed, cluster.gpus_per_node={c.gpus_per_node}: "
                  f"the placement group will not fit; lower cluster.num_spares or cluster.gpus_per_actor")


def write_plots(cfg: Config, series: dict, recoveries: list[dict], replayed: dict,
                rewards: tuple[dict, dict] | None = None) -> None:
    """loss.png, recoveries.png and, with `rewards` ({step: reward}, {step: replayed rewards}),
    reward.png in `run_dir` (see plots.py)."""
    from ftrain.ops.plots import plot_loss, plot_recoveries

    run_dir = Path(cfg.run_dir)
    paths = [plot_loss(run_dir / "loss.png", series, recoveries, replayed),
             plot_recoveries(run_dir / "recoveries.png", recoveries)]
    if rewards:
        paths.append(plot_loss(run_dir / "reward.png", {"mean reward": rewards[0]}, recoveries,
                               rewards[1], quantity="reward"))
    for path in paths:
        log.info("event=plot path=%s", path)


def run_steps(cfg: Config, kill_replica: int | None, kill_ranks: list[int] | None = None) -> dict:
    """The demo's scripted sequence on a fresh actor group; returns losses and timelines.
    After step 2 it kills the ranks `kill_ranks`, else every rank of DP replica `kill_replica`
    (None and None: no failure), once the spares have finished warming: the recovery it
    measures is the one of a warm pool."""
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    group = ActorGroup(MegatronActor, cfg)
    try:
        log_placement(group)
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        trainer.save(1)
        trainer.train(2)
        if kill_ranks or kill_replica is not None:
            ranks = kill_ranks or group.dims.replica_ranks(kill_replica)
            group.wait_spares_warm(cfg.fault_tolerance.step_timeout_s)
            log.warning("event=demo_kill ranks=%s nodes=%s step=3", ",".join(map(str, ranks)),
                        ",".join(sorted({group.workers[r].node_id[:8] for r in ranks})))
            group.kill(ranks)
        trainer.train(4)
        return {"losses": trainer.losses, "replayed": trainer.replayed,
                "recoveries": [t.to_dict() for t in trainer.recoveries],
                "spares_left": len(group.pool), "state_digests": group.state_digests()}
    finally:
        group.shutdown()


def losses_match(a: float, b: float, cfg: Config) -> bool:
    """Bitwise on CPU (float32, deterministic); on GPU within bf16 tolerance: relative 2e-2,
    about 2.5 bf16 ulps (bf16 has an 8-bit mantissa, ulp 2^-7 = 7.8e-3 relative)."""
    return a == b if cfg.cluster.device == "cpu" else math.isclose(a, b, rel_tol=2e-2, abs_tol=1e-3)


def print_report(ref: dict, run: dict, cfg: Config) -> bool:
    """Print the per-step loss table, the recovery timeline and whether the final training state
    (weights, optimizer state, schedule: a digest per rank) equals the reference's. True when
    all losses match and, on CPU, the final states are equal too. (The first update of a step
    runs at ratio 1, where the PPO loss does not depend on the weights: the state says more.)"""
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
        for phase in ("detect_s", "abort_s", "replace_s", "rebuild_s", "restore_s", "first_step_s",
                      "first_step_excess_s", "total_s"):
            print(f"  {phase[:-2]:<17} {tl[phase]:8.3f} s")
    if not run["recoveries"]:
        ok = False
        print("no recovery happened")
    print(f"\nlosses {'match' if ok else 'DIFFER'} "
          f"({'bitwise' if cfg.cluster.device == 'cpu' else 'bf16 tolerance'})")
    same = ref["state_digests"] == run["state_digests"]
    print(f"final training state (weights + optimizer, per rank): {'identical' if same else 'differs'}"
          + ("" if same or cfg.cluster.device == "cpu" else " (not required on GPU: bf16 kernels need not be bitwise)"))
    return ok and (same or cfg.cluster.device != "cpu")


def demo_scratch(cfg: Config, suffix: str) -> Config:
    """`cfg` with the demo's checkpoints at `checkpoint.uri` + `suffix`, emptied first, saved on
    the demo's script only (after step 1): the demo's runs never mix with each other, with an
    earlier demo or with a `train` run of checkpoint.uri (which would resume them)."""
    from checkpoint import CheckpointManager

    k = dataclasses.replace(cfg.checkpoint, interval=0, uri=cfg.checkpoint.uri.rstrip("/") + suffix)
    CheckpointManager.from_config(k).clear()
    return dataclasses.replace(cfg, checkpoint=k)


def cmd_demo(cfg: Config, args) -> int:
    # On GPUs the reference run keeps the (idle) spares: fractional GPU bundles then fill every
    # GPU the same way, so no two ranks of one process group share a GPU.
    ref_cfg = demo_scratch(cfg if cfg.cluster.device == "cuda" else dataclasses.replace(
        cfg, cluster=dataclasses.replace(cfg.cluster, num_spares=0)), "-reference")
    cfg = demo_scratch(cfg, "-demo")
    log.info("reference run (no failure, %d workers)", cfg.cluster.num_workers)
    ref = run_steps(ref_cfg, None)
    log.info("run with failure (%d workers + %d spares)", cfg.cluster.num_workers, cfg.cluster.num_spares)
    run = run_steps(cfg, args.kill_replica, args.kill_ranks)
    ok = print_report(ref, run, cfg)
    write_plots(cfg, {"with failure": run["losses"], "reference": ref["losses"]},
                run["recoveries"], run["replayed"])
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "demo.json").write_text(json.dumps({"reference": ref, "run": run, "match": ok}, indent=1))
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(demo_summary(ref, run, cfg, ok), indent=1))
    return 0 if ok else 1


def demo_summary(ref: dict, run: dict, cfg: Config, ok: bool) -> dict:
    """The demo's evidence record: device, layout, pass/fail, the largest |loss difference|
    (reference vs run and every replay), the first recovery's total and rebuild seconds and its
    timeline."""
    import torch

    gpus = torch.cuda.device_count() if cfg.cluster.device == "cuda" else 0
    diffs = [abs(a - b) for s, a in ref["losses"].items()
             for b in [run["losses"].get(s, math.nan)] + run["replayed"].get(s, [])]
    tl = run["recoveries"][0] if run["recoveries"] else {}
    d, m = ParallelDims.from_config(cfg), cfg.model
    return {"device": f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "layout": {"tp": d.tp, "pp": d.pp, "cp": d.cp, "dp": d.dp,
                       "workers": cfg.cluster.num_workers, "spares": cfg.cluster.num_spares,
                       "gpus_per_actor": cfg.cluster.gpus_per_actor, "engine": m.engine,
                       "dtype": m.dtype, "distributed_optimizer": m.distributed_optimizer,
                       "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                       "seq_len": cfg.train.seq_len},
            "passed": ok, "loss_max_abs_diff": max(diffs) if diffs else None,
            "state_identical": ref["state_digests"] == run["state_digests"],
            "recovery_s": tl.get("total_s"), "rebuild_s": tl.get("rebuild_s"), "timeline": tl,
            "losses": {"reference": ref["losses"], "with_failure": run["losses"],
                       "replayed": run["replayed"]}}


def plan_train_start(cfg: Config, fresh: bool):
    """How `train` starts (`run_identity.plan_start`), read from checkpoint.uri before Ray
    starts; with `fresh`, the checkpoints there are deleted first. Raises ConfigError (another
    run's checkpoints, storage past its retry budget)."""
    from checkpoint import CheckpointManager
    from ftrain.state.manifest import CheckpointError
    from ftrain.state.run_identity import plan_start

    ckpt = CheckpointManager.from_config(cfg.checkpoint)
    try:
        if fresh and (deleted := ckpt.clear()):
            log.warning("--fresh: deleted checkpoint steps %s under %s", deleted, ckpt.uri)
        return plan_start(cfg, ckpt.committed_manifests(), ckpt.uncommitted_steps())
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.uri: {e}") from None


def cmd_train(cfg: Config, args, start=None, data=None) -> int:
    """`train`: a run from step 0, or `start.run` resumed from its checkpoints (`start`: the
    `run_identity.StartPlan`, by default `plan_train_start` without --fresh); `data`: the
    opened `data.Data` (None: opened by the ActorGroup when train.objective=ce needs it); writes
    run_dir/train.json (run id, step resumed from, losses, data digests)."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from checkpoint import CheckpointManager
    from ftrain.control import driver_failover
    from ftrain.control.actor_group import ActorGroup
    from ftrain.control.run_lease import DriverLease, LeaseHeld, LeaseLost
    from ftrain.failures import first_generation
    from ftrain.ops.metrics import RunMetrics
    from ftrain.recovery.fault_tolerance import reattach
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    start = start or plan_train_start(cfg, fresh=False)
    cfg = start.cfg or cfg  # train.lr_decay_steps: the run's LR horizon
    ft, ns = cfg.fault_tolerance, driver_failover.namespace(cfg.run_name)
    failover = record = lease = None
    if cfg.cluster.ray_address:  # a shared cluster: one driver per run (a local Ray is this driver's own)
        lease = DriverLease(ns, ft.driver_lease_s, detached=ft.driver_failover)
        try:
            lease.claim()
        except LeaseHeld as e:
            raise ConfigError(f"run_name={cfg.run_name}: {e}") from None
    epoch = lease.epoch if lease else 0
    if ft.driver_failover:
        if not cfg.cluster.ray_address:
            log.warning("fault_tolerance.driver_failover without cluster.ray_address: the driver's own "
                        "local Ray dies with it, detached actors included; nothing to reattach to")
        record = driver_failover.find(cfg, start.run, start.resume_step is not None)  # ConfigError: another run's actors
        failover = driver_failover.DriverFailover(cfg, epoch)
    try:
        group = ActorGroup(MegatronActor, cfg, attach=record, first_generation=first_generation(epoch), data=data)
    except driver_failover.CannotReattach as e:
        log.warning("driver failover: cannot reattach (%s): removing what is left, starting as a new driver", e)
        driver_failover.remove(list(record["actors"]), ns, keep_lease=True)
        record, group = None, ActorGroup(MegatronActor, cfg, first_generation=first_generation(epoch), data=data)
    if lease is not None:
        group.fence = lease.check  # before anything it does to the actors, a reattach's too
    ended = superseded = False
    try:
        log_placement(group)
        with tqdm(total=cfg.train.steps, unit="step", dynamic_ncols=True,
                  disable=args.quiet or not sys.stderr.isatty()) as bar, logging_redirect_tqdm():
            trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint), RunMetrics(cfg.train.global_batch_size * cfg.train.seq_len, bar),
                              run=start.run)
            if trainer.data is not None:
                log.info(trainer.data.describe(cfg.train.steps))
            if record is not None:
                trainer.run = dataclasses.replace(trainer.run, id=record["run"]["id"])
                reattach(trainer, record["committed_step"], set(group.dead))
            elif start.resume_step is not None:
                trainer.resume(start.resume_step)
            else:
                log.info("event=start run=%s step=0", trainer.run.id)
            if failover is not None:
                failover.save(trainer)  # who is who, before the first step
            trainer.train(cfg.train.steps, after_step=lambda t, _: after_step(t, lease, failover))
        ended = True
        if trainer.resumed_from is not None:
            print(f"run {trainer.run.id} resumed from its checkpoint of step {trainer.resumed_from}")
        for step in sorted(trainer.losses):
            reward = f"  reward {trainer.rewards[step]:.4f}" if step in trainer.rewards else ""
            print(f"step {step:>5}  loss {trainer.losses[step]:.6f}{reward}")
        print(f"recoveries: {len(trainer.recoveries)}; spares left: {len(group.pool)}; "
              f"dp now {group.dims.dp}")
        if trainer.recoveries:
            print(trainer.report())
        if trainer.failed_saves and not trainer.checkpoints:
            print(trainer.no_commit_line(), file=sys.stderr)
        write_plots(cfg, {"loss": trainer.losses}, [t.to_dict() for t in trainer.recoveries],
                    trainer.replayed, (trainer.rewards, trainer.replayed_rewards) if trainer.rewards else None)
        if trainer.rewards:
            (Path(cfg.run_dir) / "rewards.json").write_text(json.dumps(
                {"rewards": trainer.rewards, "rollout_stats": trainer.rollout_stats}, indent=1))
        (Path(cfg.run_dir) / "train.json").write_text(json.dumps(
            {"run": trainer.run.id, "resumed_from": trainer.resumed_from, "losses": trainer.losses,
             "rewards": trainer.rewards, "replayed": trainer.replayed,
             "data_digests": trainer.data_digests}, indent=1))
    except LeaseLost as e:  # the run is another driver's now: leave its actors alone
        superseded = True
        print(f"driver superseded: {e}", file=sys.stderr)
        return 2
    finally:
        # With driver_failover, only a run that ended or failed for good removes its actors;
        # KeyboardInterrupt / SIGTERM of the driver leaves them for the next one.
        if not superseded and (failover is None or ended or
                               not isinstance(sys.exc_info()[1], (KeyboardInterrupt, SystemExit))):
            group.shutdown()
            if failover is not None:
                failover.shutdown()
            if lease is not None:
                lease.release(remove=failover is not None)
    return 1 if trainer.failed_saves and not trainer.checkpoints else 0


def after_step(trainer, lease, failover) -> None:
    """After each committed step: stop a driver whose lease another one took (`run_lease`),
    then record the step for a next driver (`driver_failover`)."""
    if lease is not None and lease.lost.is_set():
        lease.check()  # raises LeaseLost
    if failover is not None:
        failover.save(trainer)


def cmd_stop(cfg: Config) -> int:
    """`stop --run NAME`: remove the detached actors and placement group of run NAME
    (fault_tolerance.driver_failover) from the cluster `cluster.ray_address`."""
    import ray

    from ftrain.control import driver_failover

    ns = driver_failover.namespace(cfg.run_name)
    try:
        record = ray.get_actor(driver_failover.RECORD, namespace=ns)
    except ValueError:
        print(f"no detached actors of run {cfg.run_name} (namespace {ns})")
        return 0
    state = ray.get(record.get.remote(), timeout=cfg.fault_tolerance.health_timeout_s)
    killed = driver_failover.remove(list(state.get("actors", {})), ns)
    ray.kill(record, no_restart=True)
    log.info("event=stop run=%s actors=%d", state.get("run", {}).get("id", cfg.run_name), killed)
    print(f"run {cfg.run_name}: removed {killed} detached actor(s), its placement group and its record")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one subcommand per mode; options every mode has come from `common`."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("options of every mode")
    g.add_argument("--config", default="config.yaml", metavar="FILE",
                   help="YAML config file; every key is documented in it and in docs/configuration.md (default: config.yaml)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override one config value, parsed as YAML, e.g. --set train.steps=10 (repeatable)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the resolved config (YAML) and the planned placement (which rank and spare "
                        "goes to which bundle, node and GPU), computed from the config without starting "
                        "Ray, then exit. `auto` resolves for cluster.gpus_per_node GPUs when that is set, "
                        "so a GPU layout can be planned on a laptop")
    level = g.add_mutually_exclusive_group()
    level.add_argument("-q", "--quiet", action="store_true",
                       help="warnings and errors only, no progress bar")
    level.add_argument("-v", "--verbose", action="store_true",
                       help="debug logging, and the actors' own output forwarded to this terminal")
    g.add_argument("--log-level", default=None, metavar="LEVEL",
                   help="explicit logging level (DEBUG, INFO, WARNING, ERROR); overrides -q / -v")

    p = argparse.ArgumentParser(prog="main.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(common.format_help().splitlines()[2:])
                                + "\n\n`python main.py MODE --help` shows the options of MODE.")
    modes = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    demo = modes.add_parser("demo", parents=[common], help="failure-free reference vs run with a killed replica",
                            description="Reference run, then the same steps with ranks killed after step 2; "
                                        "prints both loss columns and the recovery timeline; exit 1 unless "
                                        "the losses match (bitwise on CPU).")
    d = demo.add_argument_group("demo options")
    d.add_argument("--kill-replica", type=int, default=1, metavar="D",
                   help="the DP replica whose ranks are killed after step 2 (default 1)")
    d.add_argument("--kill-ranks", type=int, nargs="+", default=None, metavar="R",
                   help="kill these global ranks instead of a whole replica (e.g. one TP rank)")
    d.add_argument("--summary", default=None, metavar="PATH",
                   help="also write a JSON summary (device, layout, passed, loss diff, timeline)")
    train = modes.add_parser("train", parents=[common], help="train.steps steps with detection and recovery",
                             description="Train `train.steps` steps, detecting failures and recovering from "
                                         "spares; a progress bar (step, loss, tokens/s, recoveries, spares) on a "
                                         "terminal; loss.png, recoveries.png and train.json in run_dir at the end. "
                                         "Resumes this run from checkpoint.uri when it holds its checkpoints.")
    train.add_argument_group("train options").add_argument(
        "--fresh", action="store_true",
        help="start at step 0 as a new run: first DELETE every checkpoint under checkpoint.uri (of this "
             "or another run). Without it, a checkpoint.uri holding this run's checkpoints (same run_name "
             "and config fingerprint) resumes the run; one holding another run's stops with one line")
    stop = modes.add_parser("stop", parents=[common], help="remove a run's detached actors (driver_failover)",
                            description="Remove the detached actors, placement group and record of a run "
                                        "(fault_tolerance.driver_failover) from cluster.ray_address; its driver, "
                                        "if still running, fails.")
    stop.add_argument_group("stop options").add_argument("--run", required=True, metavar="NAME",
                                                         help="the run_name of the run to remove")
    # Listed here for --help; their arguments go to planner.py / data_prepare.py untouched (see main()).
    modes.add_parser("data", add_help=False, help="datasets: prepare (jsonl/parquet -> Megatron .bin/.idx), "
                     "inspect --step S, stdlib (offline demo corpus); `main.py data --help`")
    modes.add_parser("plan", add_help=False, help="capacity planner: spares and checkpoint interval "
                     "for 1,000-100,000 GPUs (planner.py; `main.py plan --help`)")
    return p


def cmd_plan(plan_args: list[str]) -> int:
    """`main.py plan ARGS`: the capacity planner (planner.py) with ARGS (its own --help)."""
    from ftrain.ops import planner

    planner.main(plan_args)
    return 0


def setup_logging(args) -> None:
    """Key=value event lines on stderr at the level of --log-level, else -q / -v / INFO."""
    from ftrain.ops.metrics import KeyValueFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    level = args.log_level or ("WARNING" if args.quiet else "DEBUG" if args.verbose else "INFO")
    logging.basicConfig(level=level.upper(), handlers=[handler])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Megatron-Core warns at import, once per module, that Transformer Engine and Apex are
    # missing; it then uses its local implementations, the engine's documented set-up.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
    if argv[:1] == ["plan"]:
        return cmd_plan(argv[1:])
    if argv[:1] == ["data"]:
        from ftrain.data import prepare as data_prepare
        return data_prepare.main(argv[1:])
    args = build_parser().parse_args(argv)
    setup_logging(args)
    if args.mode == "stop":
        args.overrides = [*args.overrides, f"run_name={args.run}", "fault_tolerance.driver_failover=true"]
    try:
        raw = load_config(args.config, args.overrides)
        gpus = raw.cluster.gpus_per_node if args.dry_run and raw.cluster.gpus_per_node else None
        cfg = resolve(raw, num_gpus=gpus)
        if cfg.data.kind == "prompts" and "://" in cfg.data.path and not cfg.data.path.startswith("file://"):
            from ftrain.data.dataset import check_reachable
            check_reachable(cfg.data.path, "data.path")  # in one line, before the prompt set is read
        if cfg.rl.enabled:
            from ftrain.rl.rollouts import check_task
            check_task(cfg)
        dims = ParallelDims.from_config(cfg)
        if args.mode == "demo" and args.kill_ranks:
            bad = [r for r in args.kill_ranks if not 0 <= r < dims.world_size]
            if bad:
                raise ConfigError(f"--kill-ranks {bad}: must be in [0, world size={dims.world_size})")
        elif args.mode == "demo" and not 0 <= args.kill_replica < dims.dp:
            raise ConfigError(f"--kill-replica {args.kill_replica}: must be in [0, dp={dims.dp})")
        start = data = None
        if args.mode == "stop" and not cfg.cluster.ray_address:
            raise ConfigError("cluster.ray_address: `stop` removes a run's detached actors from a cluster; "
                              "pass --set cluster.ray_address=HOST:PORT")
        if not args.dry_run and args.mode != "stop":
            from checkpoint import check_uri
            check_uri(cfg.checkpoint)  # storage needs no cluster: checked before Ray starts
            if cfg.cluster.ray_address is None:
                from ftrain.control import local_ray
                from ftrain.control.actor_group import preflight

                # A local Ray's size is known before it starts: refuse a layout that cannot fit now.
                preflight(cfg, {"CPU": local_ray_cpus(cfg), "GPU": gpus_visible()})
                local_ray.reap(cfg.run_dir)  # what a killed driver of this run left running
            if cfg.data.kind in ("mock", "indexed", "sft"):  # every data file checked before Ray starts (prompts: check_task)
                from ftrain.data.dataset import open_data
                data = open_data(cfg)
            if args.mode == "train":
                start = plan_train_start(cfg, args.fresh)
                cfg = start.cfg  # train.lr_decay_steps: the run's LR horizon (a continued run keeps its own)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_dry_run(cfg)
        return 0
    from ftrain.failures import ClusterError, DataError, RecoveryError

    start_ray(cfg, log_to_driver=args.verbose)
    if args.mode == "stop":
        return cmd_stop(cfg)
    if cfg.cluster.ray_address is None:
        from ftrain.control import local_ray
        local_ray.record(cfg.run_dir)
    try:
        return cmd_demo(cfg, args) if args.mode == "demo" else cmd_train(cfg, args, start, data)
    except ConfigError as e:  # what needs the cluster (preflight) or a checkpoint (its model)
        print(f"config error: {e}", file=sys.stderr)
    except ClusterError as e:
        print(f"cluster error: {e}", file=sys.stderr)
    except RecoveryError as e:  # the run cannot go on: one line, no traceback
        print(f"recovery error: {e}", file=sys.stderr)
        return 1
    except DataError as e:  # a row unreadable mid-run: the data's fault, no spare spent on it
        print(f"data error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
