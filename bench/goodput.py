"""Goodput when failures come at any time: the trainer as `main.py train` runs it, failures drawn
from a seeded Poisson process and injected by wall time, beside the same run without failures.

Protocol, in one invocation on one set of actors (workers + spares):
  reference  `Trainer.train` of `--reference-steps` steps (default `--steps`) with no failure:
             its step time (its checkpoint saves included) and its losses;
  rewind     every rank back to its step-0 state (`rollback(0)`, as a restart from scratch
             does), the holders' kept copies dropped, the reference's checkpoints deleted;
  run        `Trainer.train` of `--steps` steps while an injector thread fires the schedule:
             failure i at `t_i` seconds after the run's start, inter-arrival times exponential
             with mean `--mtbf-s` (seed `--seed`), each a kind of `--mix` (crash, exception,
             hang; node loss with `--nodes` > 1), a point and a rank drawn uniformly. Nothing
             waits for a keeper, a spare, a refill or a save: a failure can land in the first
             steps, inside a save or a restore, inside a recovery, or right after another.
             crash at `now`: SIGKILL at that instant; any other point: the fault is armed on
             the rank and fires when its compute thread reaches the point (a crash there is
             a SIGKILL, an exception an InjectedFault, a hang a stuck compute thread).
  restart    after the actors are gone: one whole-job restart from the newest checkpoint timed
             (`bench.recovery.full_restart`: new actors, model build, load, first step), then
             applied to the same failure times (`restart_ettr`): the restart baseline most
             jobs run today.
  plain      GPU: the compiled plain PyTorch loop of the same model (`bench.reference_llama`)
             in its own process; CPU: the reference's tokens/s.

Reported (JSON, `--out`, default bench/results/goodput_<device>_seed<S>.json):
  goodput_vs_plain       tokens of the run's committed steps / its wall seconds, divided by
                         the plain loop's tokens/s (replayed steps add no tokens; a stopped run
                         is charged the reference's whole duration at least);
  ettr                   reference step seconds x committed steps / the run's wall seconds;
  ettr_restart_baseline  the same for the whole-job restart on the same failure times;
  failures, recoveries, steps_lost, max_steps_lost, run_stopped (null, or why), losses_equal
  (`main.losses_match` on every step both ran: bitwise on CPU), checkpoints_lost (committed
  checkpoints that fail verification), mtbf_s, seed, defaults_only (no `--set` of
  fault_tolerance, checkpoint or chaos: `bench.recovery.defaults_only`), device, schedule (each
  failure: t_s, kind, point, rank, and at injection the committed step and the newest step
  every rank's keeper held: `kept_step`), timelines (each recovery's RecoveryTimeline),
  save_stalls, startup_s (actors built, before the reference), reference, plain, restart.
The wall seconds of a run count from its first step to its last commit (start-up apart).

Usage (repository root):
  python -m bench.goodput [--engine auto|torch|megatron] [--steps 60] [--reference-steps N]
      [--mtbf-s 30] [--seed 0] [--mix crash=0.4,exception=0.4,hang=0.2] [--nodes 1]
      [--no-restart] [--plain-from JSON] [--config config.yaml] [--set a.b=v ...] [--out PATH]
`--engine megatron` on a machine without GPUs runs MegatronActors on gloo (CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from pathlib import Path

from bench import logical_cluster, write_json
from ftrain.ops.goodput import MIX, failure_schedule, parse_mix, restart_ettr

ROOT = Path(__file__).resolve().parent.parent

def stalls(seconds: list[float]) -> dict:
    """Checkpoint save stalls (seconds training waited for each save): count, total, largest."""
    return {"saves": len(seconds), "total_s": sum(seconds), "max_s": max(seconds, default=0.0)}


def kept_step(group) -> int | None:
    """The newest step that every rank's keeper holds a copy of in the current layout (None:
    no keeper, or one of them holds nothing). Read-only: holders that do not answer within
    the health timeout are skipped."""
    import ray
    layout = str(group.dims)
    refs = [h.steps.remote() for h in list(group.holders.values())]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=group.cfg.fault_tolerance.health_timeout_s)
    newest: dict[int, int] = {}
    for ref in ready:
        with contextlib.suppress(ray.exceptions.RayError):
            for key, steps in ray.get(ref).items():
                if key[1] == layout and steps:
                    newest[key[2]] = max(newest.get(key[2], 0), steps[-1])
    return min(newest.values()) if len(newest) == group.dims.world_size else None


class Injector(threading.Thread):
    """Fires `schedule` at its times (seconds after `start`) on `trainer`'s group: records, in
    each entry, the committed step and `kept_step` at that moment and what happened
    (`fired`, or why not); stops at `stop()`."""

    def __init__(self, trainer, schedule: list[dict]):
        super().__init__(daemon=True)
        self.trainer, self.schedule, self._done, self.t0 = trainer, schedule, threading.Event(), 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()
        super().start()

    def stop(self) -> None:
        self._done.set()
        self.join()

    def run(self) -> None:
        import ray
        group = self.trainer.group
        for f in self.schedule:
            if self._done.wait(max(0.0, self.t0 + f["t_s"] - time.perf_counter())):
                return
            f["committed_step"] = self.trainer.committed_step
            try:
                f["kept_step"] = kept_step(group)
                if f["kind"] == "node":
                    group.kill_node_of(f["rank"])
                elif f["point"] == "now":
                    group.kill([f["rank"]])
                else:
                    group.arm_fault(f["rank"], "kill" if f["kind"] == "crash" else f["kind"], f["point"])
                f["result"] = "fired"
            except (ray.exceptions.RayError, IndexError) as e:  # the rank is dead already, or gone by a shrink
                f["result"] = f"missed: {type(e).__name__}"
            print(f"t={f['t_s']:7.1f}s failure {f['kind']} at {f['point']} on rank {f['rank']} "
                  f"(committed step {f['committed_step']}, kept {f.get('kept_step')}): {f['result']}", flush=True)


def never_reached(group, schedule: list[dict]) -> None:
    """Mark the faults still armed on a live rank at the end (its point was not reached after
    the arming): `result` "armed, never reached"."""
    import ray
    armed = []
    for w in group.workers:
        try:
            armed.append(ray.get(w.handle.__ray_call__.remote(lambda a: dict(a.faults)),
                                 timeout=group.cfg.fault_tolerance.health_timeout_s))
        except ray.exceptions.RayError:  # dead or hung (a run that stopped): nothing to read
            armed.append({})
    for f in reversed(schedule):  # the last arming of a point is the one left
        if f.get("result") == "fired" and f["point"] in armed[f["rank"]]:
            armed[f["rank"]].pop(f["point"])
            f["result"] = "armed, never reached"


def rewind(group, ckpt, timeout_s: float) -> None:
    """Every rank back to its step-0 state, as a restart from scratch does (fault_tolerance:
    `rollback(0)`, the holders' later copies dropped), and the checkpoints deleted."""
    assert all(group.wait(group.submit("rollback", 0), timeout_s)), "a rank holds no step-0 state"
    group.drop_snapshots_after(0)
    if ckpt.fs.exists(ckpt.root):
        ckpt.fs.rm(ckpt.root, recursive=True)


def make_cfg(args, run_dir: str):
    """The run's config: `--config` with `--set`, the run dir and checkpoints under `run_dir`
    (unless set), `--nodes`; `--engine megatron` without GPUs: Megatron on gloo."""
    from ftrain.config import gpus_visible, load_config, resolve, resolve_megatron_on_cpu
    overrides = [f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt", f"cluster.num_nodes={args.nodes}",
                 *([] if args.engine == "auto" else [f"model.engine={args.engine}"]), *args.overrides]
    gpus = gpus_visible()
    if args.engine == "megatron" and not gpus:
        return resolve_megatron_on_cpu(load_config(args.config, overrides))
    return resolve(load_config(args.config, overrides), num_gpus=gpus)


@contextlib.contextmanager
def ray_cluster(cfg, nodes: int):
    """A local Ray for `cfg` (`main.start_ray`), or `nodes` > 1 logical nodes on this machine."""
    import ray

    from main import start_ray
    if nodes > 1:
        with logical_cluster(nodes, ROOT):
            yield
        return
    start_ray(cfg)
    try:
        yield
    finally:
        ray.shutdown()


def run(args) -> dict:
    from bench.recovery import defaults_only, device_name, full_restart
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.trainer import Trainer
    from main import losses_match
    from megatron_actor import MegatronActor

    run_dir = f"/tmp/bench_goodput_{int(time.time())}"
    cfg = make_cfg(args, run_dir)
    dims = ParallelDims.from_config(cfg)
    mix = parse_mix(args.mix, args.nodes)
    ref_steps = args.reference_steps or args.steps
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    result: dict = {"engine": cfg.model.engine, "device": device_name(cfg), "mtbf_s": args.mtbf_s, "seed": args.seed,
                    "mix": mix, "defaults_only": defaults_only(args.config, args.overrides), "steps": args.steps,
                    "layout": str(dims), "workers": cfg.cluster.num_workers, "spares": cfg.cluster.num_spares,
                    "nodes": args.nodes, "overrides": args.overrides, "date": time.strftime("%Y-%m-%d")}
    with ray_cluster(cfg, args.nodes):
        t0 = time.perf_counter()
        group = ActorGroup(MegatronActor, cfg)
        try:
            result["startup_s"] = time.perf_counter() - t0
            ref = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
            t0 = time.perf_counter()
            ref.train(ref_steps)
            ref_wall = time.perf_counter() - t0
            step_s = ref_wall / ref_steps
            result["reference"] = {"steps": ref_steps, "wall_s": ref_wall, "step_s": step_s,
                                   "tokens_per_s": tokens_per_step / step_s, "save_stalls": stalls(ref.save_stalls)}
            print(f"reference: {ref_steps} steps in {ref_wall:.1f} s ({step_s:.3f} s/step)", flush=True)
            rewind(group, ref.ckpt, cfg.fault_tolerance.step_timeout_s)

            horizon = 3 * args.steps * step_s + 10 * args.mtbf_s  # past any end the run can reach
            schedule = failure_schedule(args.mtbf_s, args.seed, horizon, mix, dims.world_size)
            trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
            injector = Injector(trainer, schedule)
            stopped = None
            injector.start()
            try:
                trainer.train(args.steps)
            except Exception as e:  # noqa: BLE001 (the bench reports what stopped the run)
                stopped = f"{type(e).__name__}: {e}"
            wall = time.perf_counter() - injector.t0
            injector.stop()
            never_reached(group, schedule)
        finally:
            group.shutdown()
        tried = [f for f in schedule if "result" in f]
        retained = trainer.ckpt.committed_steps()
        restart_s = full_restart(cfg, 0.0) if retained and args.restart else None
    committed = trainer.committed_step
    timelines = trainer.recoveries
    detect = {k: statistics.median([t.detect_s for t in timelines if t.kind == k] or [0.0]) for k in ("hang",)}
    charged = max(wall, args.steps * step_s) if stopped else wall  # a stopped run's time goes on
    result.update({
        "failures": sum(f["result"] == "fired" for f in tried), "recoveries": len(timelines), "run_stopped": stopped,
        "committed_steps": committed, "wall_s": wall,
        "steps_lost": sum(t.steps_lost for t in timelines),
        "max_steps_lost": max((t.steps_lost for t in timelines), default=0),
        "ettr": step_s * committed / charged,
        "goodput_tokens_per_s": committed * tokens_per_step / charged,
        "losses_equal": all(losses_match(ref.losses[s], trainer.losses[s], cfg) for s in ref.losses if s in trainer.losses),
        "replays_equal": all(v == trainer.losses[s] for s, vs in trainer.replayed.items() for v in vs),
        "checkpoints_lost": sum(1 for s in retained if trainer.ckpt.verify(s)),
        "save_stalls": stalls(trainer.save_stalls),
        "restore_sources": [t.restore_source for t in timelines],
        "schedule": tried, "timelines": [t.to_dict() for t in timelines],
    })
    if restart_s is not None:
        ettr, lost = restart_ettr([(f["t_s"], detect["hang"] if f["kind"] == "hang" else 0.0) for f in schedule],
                                  args.steps, step_s, cfg.checkpoint.interval, restart_s)
        result["restart"] = {"restart_s": restart_s, "steps_lost": lost, "hang_detect_s": detect["hang"]}
        result["ettr_restart_baseline"] = ettr
    else:
        result["ettr_restart_baseline"] = None
    result["plain"] = plain_loop(args, cfg, result["reference"]["tokens_per_s"])
    result["goodput_vs_plain"] = result["goodput_tokens_per_s"] / result["plain"]["tokens_per_s"]
    return result


def plain_loop(args, cfg, reference_tokens_per_s: float) -> dict:
    """The loop goodput is divided by: on GPU the compiled plain PyTorch loop of the same model
    and batch (`bench.reference_llama`, its own process), on CPU the reference run."""
    if args.plain_from:  # a `bench.reference_llama` JSON, or a goodput JSON's `plain`
        done = json.loads(Path(args.plain_from).read_text())
        return done.get("plain", {"what": f"compiled plain PyTorch loop ({args.plain_from})", **done})
    if cfg.cluster.device != "cuda":
        return {"what": "the reference run (CPU)", "tokens_per_s": reference_tokens_per_s}
    from bench.reference_llama import run_reference
    r = run_reference(args.config, args.overrides, cfg.train.global_batch_size, True, 8, 3, None)
    if "error" in r:
        return {"what": "compiled plain PyTorch loop: failed, the reference run used", "error": r["error"],
                "tokens_per_s": reference_tokens_per_s}
    return {"what": "compiled plain PyTorch loop (bench.reference_llama)", **r}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("auto", "torch", "megatron"), default="auto")
    p.add_argument("--steps", type=int, default=60, help="steps of the run with failures")
    p.add_argument("--reference-steps", type=int, default=None,
                   help="steps of the run without failures (default --steps; fewer compares fewer losses)")
    p.add_argument("--mtbf-s", type=float, default=30.0, help="mean seconds between failures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default=MIX, help=f"kind=weight,... of crash, exception, hang, node (default {MIX})")
    p.add_argument("--nodes", type=int, default=1, help="logical Ray nodes on this machine (node loss needs 2+)")
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="skip timing the whole-job restart (ettr_restart_baseline null)")
    p.add_argument("--plain-from", default=None,
                   help="the plain loop's numbers from a JSON of the same model, batch and device (a goodput "
                        "JSON's `plain`, or `bench.reference_llama --compile`'s output) instead of running it")
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        parse_mix(args.mix, args.nodes)
    except ValueError as e:
        p.error(str(e))
    r = run(args)
    for key in ("engine", "device", "failures", "recoveries", "run_stopped", "steps_lost", "max_steps_lost",
                "ettr", "ettr_restart_baseline", "goodput_vs_plain", "losses_equal", "checkpoints_lost", "wall_s"):
        print(f"{key:<24}{r[key]}")
    out = args.out or str(ROOT / "bench" / "results" / f"goodput_{'gpu' if 'cpu' not in r['device'] else 'cpu'}_"
                                                       f"{r['engine']}_seed{args.seed}.json")
    write_json(out, r)
    print(f"wrote {out}")
    return r


if __name__ == "__main__":
    main()
