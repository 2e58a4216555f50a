"""Training speed: tokens/s and MFU of the same train steps with the fault-tolerance machinery
switched on and off, measured in one run on the same actors.

What the machinery costs per step (read from the code):
  health    the driver awaits each step in `ActorGroup.wait` with a deadline
            (`Trainer.step_deadline`: hang_factor x median step time) and, every
            `health_interval_s` without a result, pings every rank's control group for its
            progress counter (`_progress`);
  rollback  `MegatronActor.train_step` first calls `engine.snapshot()`: a host-memory copy of
            the last committed step's state (model + optimizer), for peer restore. The torch
            engine deep-copies it; the Megatron engine copies into reused pinned buffers, and
            skips the copy with `model.distributed_optimizer` unless the shard keeper is on
            (`fault_tolerance.shard_keeper`, dp >= 2; it then also sends each step's optimizer
            shard to its keeper: keeper.py, measured alone by bench/keeper.py);
  memory    with `fault_tolerance.memory_snapshot_interval: k`, every k steps each rank starts
            a host copy of its state (`engine.start_host_copy()`: Megatron, a side-stream copy
            into pinned buffers pinned at join, overlapped with the next step, whose update
            waits for it; torch, a copy thread) and a background thread sends it, in parts, as
            numpy arrays, to a `SnapshotHolder` actor; at most one in flight: a snapshot due
            while one is in flight is skipped and counted (`memory_snapshots` in the JSON);
  saves     checkpoints every `checkpoint.interval` steps (off here unless --set: saves are a
            cost of any training job, measured by bench/checkpoint_io.py);
  driver    Trainer bookkeeping: metrics (`RunMetrics.on_step`), refill polling.

Phases, on the same actors and the same steps 1..warmup+steps (same data, same updates):
  off           the engines driven directly: `engine.train_step` through Ray's `__ray_call__`
                on each actor, the batch split by `MeshDispatch`, a plain `ray.get`; no
                deadline or polling, no host snapshot, no holder send, no metrics;
  on_no_memory  `Trainer.train` step by step with the actors' holder unset (only when memory
                snapshots are on): health + rollback snapshot + bookkeeping;
  on            `Trainer.train` step by step as `python main.py train` runs, with memory
                snapshots every step (`fault_tolerance.memory_snapshot_interval=1` unless --set).
Nothing outside this file is changed: the bench sets actor attributes (`_holder`) and holder
state between phases through `__ray_call__`. Before every phase but the first, every engine is
reset to its step-0 state (`rollback(0)`); losses of all phases are compared (bitwise on CPU).
The first `--warmup` steps of each phase (compilation, NCCL/CUDA allocations, the first pinned
snapshot buffers) run untimed. After `on` the bench waits until the holders hold the last
step's snapshots (`snapshot_lag_s`: the backlog of background sends) before anything else
runs. A phase stops early, noted in the JSON, when host memory use passes --max-host-mem (or
would after one more step growing as much as the last), instead of exhausting the machine.

Data: read inside every timed step: synthetic batches made by the driver (`Trainer.batch`),
or with train.objective=ce each rank reads its own rows from the `.bin` (range reads, the next
step's prefetched while this one trains: `MegatronActor.own_batch`, rank_rows.py; data.kind
indexed: `main.py data stdlib` makes an offline corpus); PPO with
global_batch_size == mini_batch_size makes one update per step and no old-log-prob pass.

Model FLOPs per step, F_step, and the parameter counts: flops.py (`model_flops` applies them to
the config; the old-log-prob pass counts only where it runs).

MFU = F_step / (step_s * peak * gpus); peak = 989e12 FLOP/s per GPU (dense bf16, H100 SXM and
H200, NVIDIA datasheets; 1979e12 is with 2:4 sparsity); gpus = distinct GPUs of the workers.
On CPU the peak is unknown: MFU is null unless --peak-tflops (the machine's peak) is given.

Usage (repository root): python -m bench.train_speed [--steps 8] [--warmup 2] [--repeats 1]
                                                     [--config config.yaml] [--set a.b=v ...] [--out PATH]
                                                     [--reference both|eager|none]
A micro-batch sweep is one run per size: --set train.micro_batch_size=N (the reference follows it).
The plain-PyTorch reference (--reference, default both): after the phases, when the actors are
gone, bench/reference_llama.py trains an HF `LlamaForCausalLM` of the same shape with the
plainest fast loop (SDPA, bf16 autocast, fused AdamW), eager and under torch.compile, each in a
process of its own on the driver's machine (its first GPU), on one GPU's share of the global
batch (global_batch_size / gpus rows; micro-batches of train.micro_batch_size), for the same
--warmup and --steps. Its MFU counts no old-log-prob pass (r = 0: it runs none).

Prints a table and writes bench/results/train_speed_<device>.json:
{"device", "engine", "tokens_per_s_vs_compiled" (off tokens/s per GPU / the compiled
 reference's), "objective" (train.objective), "data_kind" (data.kind), "updates_per_step",
 "old_logprob_pass" (whether the engine runs one), "layout", "params", "tokens_per_step", "flops_per_step",
 "mfu" (the engine's step MFU: off.mfu), "reference_eager_mfu", "reference_compiled_mfu",
 "reference": {"eager": {...}, "compiled": {...}} (bench/reference_llama.py's JSON, or {"error"}),
 "tokens_per_s_per_gpu_vs_reference": {"eager", "compiled"} (off tokens/s per GPU / the reference's),
 "off": {"step_s", "tokens_per_s", "mfu", ...}, "on": {...}, "on_no_memory": {...} | null,
 "overhead_ratio", "overhead_ratio_no_memory", "components", "config", ...,
 "memory_snapshot_every_step_ratio" (on.step_s / on_no_memory.step_s with snapshots every step),
 "memory_snapshots" ({sent, skipped, failed} in ON phases), "state_gb" (largest rank's state),
 "async_save_stall_s" (slowest save stall with checkpoint.async_save and checkpoints on; else
 null), "save_vs_raw" (null: bench/checkpoint_io.py)}
(step_s: median seconds per timed step; overhead_ratio = on.step_s / off.step_s; MFU null on
CPU without --peak-tflops).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.reference_llama import run_reference
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.objectives.ppo import behaviour_pass_needed
from ftrain.ops.flops import FORMULA, flops_per_token, matmul_params, total_params
from ftrain.state.keeper import keeps_shards

ROOT = Path(__file__).resolve().parent.parent
PEAK_BF16_FLOPS = 989e12  # FLOP/s per GPU: H100 SXM / H200 dense bf16 (no sparsity)


# -- model size and FLOPs ----------------------------------------------------------------------
def model_flops(cfg) -> dict:
    """{"params", "params_matmul", "tokens_per_step", "flops_per_token", "flops_per_step",
    "vocab"} of a resolved config; FLOPs in FLOP, tokens in tokens. The old-log-prob pass is
    counted only where the engines run it (`ppo.behaviour_pass_needed`)."""
    from ftrain.engines.megatron_model import padded_vocab_size  # pure function, no Megatron import

    m, t = cfg.model, cfg.train
    vocab = padded_vocab_size(m.vocab_size) if m.engine == "megatron" else m.vocab_size
    n = matmul_params(m.num_layers, m.hidden_size, m.ffn_hidden_size, vocab)
    tokens = t.global_batch_size * t.seq_len
    per_token = flops_per_token(n, m.num_layers, m.hidden_size, t.seq_len, behaviour_pass_needed(t))
    return {"params": total_params(m.num_layers, m.hidden_size, m.ffn_hidden_size, vocab),
            "params_matmul": n, "vocab": vocab, "tokens_per_step": tokens,
            "flops_per_token": per_token, "flops_per_step": per_token * tokens}


# -- the two ways of running a step -------------------------------------------------------------
def lean_step(trainer, step: int) -> float:
    """OFF: step `step` by calling `engine.train_step` on every rank directly (same batch split
    as `MeshDispatch`, or with ce each rank's own rows); no deadline, no progress polling, no snapshots. Returns the mean loss
    over DP replicas. Blocks until every rank is done."""
    import ray

    from dispatch import MeshDispatch
    from ftrain.distributed.fanout import dispatch_remote

    def engine_step(actor, step, batch):  # runs on the actor's compute thread
        return actor.engine.train_step(actor.own_batch(step) if batch is None else batch, step)

    group = trainer.group
    batch = None if trainer.data is not None else trainer.with_loss_weights(trainer.batch(step))  # ce: ranks read
    refs = dispatch_remote(group.handles, "__ray_call__", group.dims, MeshDispatch, engine_step, step, batch)
    results = MeshDispatch.collect(group.dims, ray.get(refs))
    return sum(r["loss"] for r in results) / len(results)


def ft_step(trainer, step: int) -> float:
    """ON: one step of the production loop (`Trainer.train`): deadline + health polling,
    host snapshot, holder send, metrics, checkpoint when due. Returns its loss."""
    trainer.train(step)
    return trainer.losses[step]


def host_mem_frac() -> float:
    """Fraction of host memory in use: 1 - available / total (psutil), or, when this process
    runs under a lower cgroup memory limit (v2 or v1), the cgroup's usage less its inactive page
    cache over that limit (as Ray's memory monitor counts), whichever is higher."""
    import psutil

    vm = psutil.virtual_memory()
    frac = 1.0 - vm.available / vm.total
    for d, limit_f, usage_f, inactive in (("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
                                          ("/sys/fs/cgroup/memory", "memory.limit_in_bytes",
                                           "memory.usage_in_bytes", "total_inactive_file")):
        try:
            limit = (Path(d) / limit_f).read_text().strip()
            if limit == "max" or int(limit) >= vm.total:
                break
            stat = dict(line.split() for line in (Path(d) / "memory.stat").read_text().splitlines())
            used = int((Path(d) / usage_f).read_text()) - int(stat.get(inactive, 0))
            frac = max(frac, used / int(limit))
            break
        except (OSError, ValueError):
            continue
    return frac


def run_phase(name: str, step_fn, trainer, warmup: int, steps: int, max_mem: float) -> dict:
    """Run steps 1..warmup+steps with `step_fn(trainer, step)`; time the last `steps` (s).
    Stops early when host memory use passes `max_mem` (fraction), or would after one more step
    that grows it as much as the last timed one did (a warm-up step's growth is one-time:
    compilation, buffers pinned in the background since the ranks joined). Returns {"step_s_all" (s per timed step),
    "losses" (step -> loss), "host_mem_peak_frac", "stopped_early" (why, or None)}."""
    times, losses, stopped = [], {}, None
    mem = peak = host_mem_frac()
    for step in range(1, warmup + steps + 1):
        t0 = time.perf_counter()
        losses[step] = step_fn(trainer, step)
        dt = time.perf_counter() - t0
        if step > warmup:
            times.append(dt)
        prev, mem = mem, host_mem_frac()
        peak = max(peak, mem)
        print(f"{name:>12} step {step:>3}{'' if step > warmup else ' (warm-up)':<10} {dt:9.3f} s  "
              f"loss {losses[step]:.6f}  host memory {100 * mem:.0f}%", flush=True)
        growth = max(0.0, mem - prev) if step > warmup else 0.0
        if step < warmup + steps and mem + growth > max_mem:
            stopped = (f"host memory {100 * mem:.0f}% (+{100 * (mem - prev):.0f}% in the last step), "
                       f"limit --max-host-mem {100 * max_mem:.0f}%, after step {step}")
            print(f"{name}: stopped early: {stopped}", flush=True)
            break
    return {"step_s_all": times, "losses": losses, "host_mem_peak_frac": peak, "stopped_early": stopped}


def snapshot_lag(group, step: int, timeout_s: float) -> float | None:
    """Seconds from now until the SnapshotHolders hold every rank's newest snapshot sent up to
    step `step` (the backlog of background sends after the last step); None when memory
    snapshots are off or it takes longer than `timeout_s`."""
    k = group.cfg.fault_tolerance.memory_snapshot_interval
    if not group.holders or not k or step < k:
        return None
    step -= step % k
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        held = group.held_snapshots()
        if all(step in held.get((str(group.dims), r), ()) for r in range(group.dims.world_size)):
            return time.perf_counter() - t0
        time.sleep(0.05)
    return None


def sender_counts(group) -> dict:
    """Every rank's `SnapshotSender` counts (sent, skipped, failed), each read once its send in
    flight has ended, summed, then reset to 0."""
    import ray

    def take(actor):
        # A holder holds a snapshot once its last part is put, a moment before the send's thread
        # counts it as sent: without the wait, a loaded machine reads a send not yet counted.
        actor._sender.wait()
        counts = actor._sender.counts()
        actor._sender.sent = actor._sender.skipped = actor._sender.failed = 0
        return counts

    per_rank = ray.get([h.__ray_call__.remote(take) for h in group.handles])
    return {k: sum(c[k] for c in per_rank) for k in ("sent", "skipped", "failed")}


def state_bytes(group) -> int:
    """Bytes of the largest rank's training state (tensors: model + optimizer shard)."""
    import ray

    def nbytes(actor):
        from ftrain.state.host_memory import state_nbytes
        return state_nbytes(actor.engine._train_state())

    return max(ray.get([h.__ray_call__.remote(nbytes) for h in group.handles]))


def set_holders(group, enabled: bool) -> None:
    """Point every rank at its SnapshotHolder (as `join` does) or at none (no sends), and drop
    every snapshot the holders hold (frees their memory; the next lag is of that phase's sends)."""
    import ray

    refs = [s.handle.__ray_call__.remote(lambda actor, h: setattr(actor, "_holder", h),
                                         group.holder_for(s.node_id) if enabled else None)
            for s in group.workers]
    refs += [h.clear.remote() for h in group.holders.values()]
    ray.get(refs)


def components(group, reps: int) -> dict:
    """Seconds of each piece of the machinery, measured alone after the phases (median over
    `reps`, slowest rank): `engine.snapshot()` (the rollback copy, queued; ~0 with the Megatron
    distributed optimizer), `engine.start_host_copy()` (what the training thread spends on a
    memory snapshot's copy), `host_copy_s` (that copy from start to done; on GPU after the
    rollback copy queued before it on the same side stream), and one
    health poll of every rank's control group from the driver (`HealthMonitor._progress`)."""
    import ray

    def timed(actor, reps):  # runs on each actor's compute thread
        import time as _time
        keys = ("snapshot_s", "start_host_copy_s", "host_copy_s")
        out = {k: [] for k in keys}
        actor.engine.prepare_host_copy()
        for _ in range(reps):
            t0 = _time.perf_counter()
            actor.engine.snapshot()
            out["snapshot_s"].append(_time.perf_counter() - t0)
            t0 = _time.perf_counter()
            copy = actor.engine.start_host_copy()
            out["start_host_copy_s"].append(_time.perf_counter() - t0)
            if copy is not None:
                copy.wait()
            out["host_copy_s"].append(_time.perf_counter() - t0 if copy is not None else float("nan"))
        return out

    per_rank = ray.get([h.__ray_call__.remote(timed, reps) for h in group.handles])
    res = {k: max(statistics.median(r[k]) for r in per_rank) for k in per_rank[0]}
    polls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        group.health._progress()
        polls.append(time.perf_counter() - t0)
    res["health_poll_s"] = statistics.median(polls)
    return res


def live_params(group) -> int | None:
    """Parameters of rank 0's model: the whole model when tp = pp = 1, else None."""
    import ray

    if group.dims.tp * group.dims.pp != 1:
        return None
    return ray.get(group.handles[0].__ray_call__.remote(
        lambda actor: sum(p.numel() for p in actor.engine.model.parameters())))


def gpu_name(group) -> str:
    """torch.cuda.get_device_name of rank 0's GPU, asked on the actor (the driver makes no CUDA
    context)."""
    import ray

    def name(actor):
        import torch
        return torch.cuda.get_device_name(0)

    return ray.get(group.handles[0].__ray_call__.remote(name))


def merge(runs: list[dict]) -> dict:
    """One phase's repeats as one: timed steps pooled, losses of each repeat, the highest memory
    peak, the first early stop; ON phases also the largest holder lag (None if one timed out or
    snapshots were off), recoveries and checkpoint save stalls (s)."""
    out = {"step_s_all": [x for r in runs for x in r["step_s_all"]],
           "memory_snapshots": None if runs[0].get("memory_snapshots") is None else
           {k: sum(r["memory_snapshots"][k] for r in runs) for k in ("sent", "skipped", "failed")},
           "losses": [r["losses"] for r in runs],
           "host_mem_peak_frac": max(r["host_mem_peak_frac"] for r in runs),
           "stopped_early": next((r["stopped_early"] for r in runs if r["stopped_early"]), None)}
    if "recoveries" in runs[0]:
        lags = [r["snapshot_lag_s"] for r in runs]
        out.update(snapshot_lag_s=None if None in lags else max(lags), snapshot_lag_s_all=lags,
                   recoveries=sum(r["recoveries"] for r in runs),
                   save_stalls_s=[x for r in runs for x in r["save_stalls_s"]])
    return out


def summarize(phase: dict, fl: dict, peak: float | None, gpus: int) -> dict:
    """Adds step_s (median s per timed step), step_s_mean (s), tokens_per_s (tokens per step /
    median step), mfu (None without a peak FLOP/s or GPUs) and timed_steps to a merged phase;
    all None when no step was timed."""
    times = phase["step_s_all"]
    if not times:
        return {"step_s": None, "step_s_mean": None, "tokens_per_s": None, "mfu": None,
                "timed_steps": 0, **phase}
    step_s = statistics.median(times)
    return {"step_s": step_s, "step_s_mean": statistics.fmean(times),
            "tokens_per_s": fl["tokens_per_step"] / step_s,
            "mfu": fl["flops_per_step"] / (step_s * peak * gpus) if peak and gpus else None,
            "timed_steps": len(times), **phase}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="config override a.b=value, applied after the bench's own "
                        "(checkpoint.interval=0, fault_tolerance.memory_snapshot_interval=1); "
                        "train.steps is always warmup + steps")
    p.add_argument("--steps", type=int, default=8, help="timed steps per phase (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them, per phase (default 2)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the phases, alternating (default 1); medians pool the timed steps")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per GPU for MFU (default: 989, dense bf16 H100/H200, on cuda; "
                        "on cpu none, MFU null; given there, the whole machine's peak)")
    p.add_argument("--max-host-mem", type=float, default=0.8,
                   help="stop a phase early at this fraction of host memory in use (default 0.8)")
    p.add_argument("--lag-timeout", type=float, default=120.0,
                   help="seconds to wait for the holders to catch up after an ON phase (default 120)")
    p.add_argument("--no-components", action="store_true", help="skip the per-component timings")
    p.add_argument("--reference", choices=("both", "eager", "none"), default="both",
                   help="after the engine, the plain-PyTorch HF Llama of the same shape "
                        "(bench/reference_llama.py): eager and torch.compile (both, default), eager only, or none")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/train_speed_<device>.json)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1, --warmup >= 0")

    import os

    import ray

    from checkpoint import CheckpointManager
    from ftrain.config import load_config, resolve
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from main import start_ray
    from megatron_actor import MegatronActor

    run_dir = f"/tmp/bench_train_speed_{os.getpid()}_{int(time.time())}"
    cfg = resolve(load_config(args.config, [
        f"run_dir={run_dir}", f"checkpoint.uri={run_dir}/ckpt", "checkpoint.interval=0",
        "fault_tolerance.memory_snapshot_interval=1", *args.overrides,
        f"train.steps={args.warmup + args.steps}"]))
    if cfg.rl.enabled or cfg.chaos.events:
        sys.exit("train_speed: needs rl.enabled=false and chaos.events=[] (no rollouts, no faults)")
    cuda = cfg.cluster.device == "cuda"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (PEAK_BF16_FLOPS if cuda else None)
    fl = model_flops(cfg)
    load_before = os.getloadavg()[0]
    started = not ray.is_initialized()
    if started:
        start_ray(cfg)
    group = ActorGroup(MegatronActor, cfg)
    runs: dict[str, list[dict]] = {}
    try:
        data = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))  # the OFF phase takes its batches from here (Trainer.batch)
        # MFU's device count: distinct GPUs of the workers; on CPU the machine is one device.
        gpus = len({s.device for s in group.workers}) if cuda else 1
        device = f"{gpus} x {gpu_name(group)}" if cuda else "cpu"
        params_live = live_params(group)
        if params_live is not None and params_live != fl["params"]:
            print(f"WARNING: the model has {params_live} parameters, the formula {fl['params']}: "
                  f"the FLOPs formula does not describe this model", flush=True)
        names = ["off", *(["on_no_memory"] if group.holders else []), "on"]
        for rep in range(args.repeats):
            for i, name in enumerate(names):
                if rep or i:  # every phase after the first starts from step 0 again
                    if not all(group.call("rollback", 0)):
                        raise RuntimeError("an engine could not reset to step 0 between phases")
                if name == "off":
                    res = run_phase(name, lean_step, data, args.warmup, args.steps, args.max_host_mem)
                else:
                    if group.holders:
                        set_holders(group, enabled=name == "on")
                    trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
                    res = run_phase(name, ft_step, trainer, args.warmup, args.steps, args.max_host_mem)
                    # Waiting for the holders also drains the sends before the next phase runs.
                    res.update(snapshot_lag_s=snapshot_lag(group, max(res["losses"]), args.lag_timeout)
                               if name == "on" else None,
                               recoveries=len(trainer.recoveries), save_stalls_s=trainer.save_stalls,
                               memory_snapshots=sender_counts(group) if name == "on" and group.holders else None)
                runs.setdefault(name, []).append(res)
        # Alone means alone: not while a backlog of holder sends is still being serialised.
        backlog = any(r["stopped_early"] or (name == "on" and group.holders and r["snapshot_lag_s"] is None)
                      for name in names for r in runs[name])
        comp = None if args.no_components or backlog else components(group, 3)
        state_gb = state_bytes(group) / 1e9
    finally:
        group.shutdown()
        if started:
            ray.shutdown()

    # After the actors are gone (the GPU is free): the plain loop, one GPU's share of the batch.
    refs = {mode: run_reference(args.config, args.overrides, max(cfg.train.micro_batch_size,
                                                                 cfg.train.global_batch_size // gpus),
                                mode == "compiled", args.steps, args.warmup, args.peak_tflops)
            for mode in {"both": ("eager", "compiled"), "eager": ("eager",), "none": ()}[args.reference]}
    ref = runs["off"][0]["losses"]
    diffs = [abs(ref[s] - r["losses"][s]) for name in names for r in runs[name] for s in r["losses"] if s in ref]
    ph = {name: summarize(merge(runs[name]), fl, peak, gpus) for name in names}
    ft, d, m, t = cfg.fault_tolerance, ParallelDims.from_config(cfg), cfg.model, cfg.train
    kept = keeps_shards(m.distributed_optimizer, ft.shard_keeper, d.dp)
    snap = ("no-op: distributed optimizer" if m.engine == "megatron" and m.distributed_optimizer and not kept
            else "model + optimizer to host memory" + ("; optimizer shard to its keeper (keeper.py)" if kept else ""))
    stalls = ph["on"].get("save_stalls_s") or []
    compiled = refs.get("compiled", {})
    result = {
        "device": device, "engine": m.engine,
        # issue-37 headline keys: the engine's off phase per GPU against the compiled HF loop
        "tokens_per_s_vs_compiled": ratio(ph["off"]["tokens_per_s"], compiled["tokens_per_s"] * gpus)
        if "tokens_per_s" in compiled else None,
        "objective": t.objective, "data_kind": cfg.data.kind,
        "updates_per_step": t.global_batch_size // t.mini_batch_size,
        "old_logprob_pass": behaviour_pass_needed(t),
        # issue-24 headline keys; the save ones only with checkpoints on (--set checkpoint.interval=k):
        # bench/checkpoint_io.py measures saves against the raw disk.
        "memory_snapshot_every_step_ratio": ratio(ph["on"]["step_s"], ph["on_no_memory"]["step_s"])
        if "on_no_memory" in ph and ft.memory_snapshot_interval == 1 else None,
        "async_save_stall_s": max(stalls) if stalls and cfg.checkpoint.async_save else None,
        "save_vs_raw": None, "state_gb": state_gb,
        "memory_snapshots": ph["on"]["memory_snapshots"],
        "layout": {"tp": d.tp, "pp": d.pp, "cp": d.cp, "dp": d.dp, "workers": cfg.cluster.num_workers,
                   "spares": cfg.cluster.num_spares, "gpus": gpus if cuda else 0, "dtype": m.dtype,
                   "distributed_optimizer": m.distributed_optimizer if m.engine == "megatron" else None},
        "params": fl["params"], "params_live": params_live, "params_matmul": fl["params_matmul"],
        "tokens_per_step": fl["tokens_per_step"], "flops_per_step": fl["flops_per_step"],
        "flops_formula": FORMULA, "peak_flops_per_gpu": peak,
        "off": ph["off"], "on": ph["on"], "on_no_memory": ph.get("on_no_memory"),
        "overhead_ratio": ratio(ph["on"]["step_s"], ph["off"]["step_s"]),
        "overhead_s_per_step": None if ph["on"]["step_s"] is None or ph["off"]["step_s"] is None
        else ph["on"]["step_s"] - ph["off"]["step_s"],
        "overhead_ratio_mean": ratio(ph["on"]["step_s_mean"], ph["off"]["step_s_mean"]),
        "overhead_ratio_no_memory": ratio(ph["on_no_memory"]["step_s"], ph["off"]["step_s"])
        if "on_no_memory" in ph else None,
        "losses_equal": all(x == 0.0 for x in diffs), "loss_max_abs_diff": max(diffs),
        "components": comp,
        "mfu": ph["off"]["mfu"],
        "reference_eager_mfu": refs.get("eager", {}).get("mfu"),
        "reference_compiled_mfu": refs.get("compiled", {}).get("mfu"),
        "reference": refs,
        "tokens_per_s_per_gpu_vs_reference": {
            mode: ratio(ph["off"]["tokens_per_s"], r["tokens_per_s"] * gpus) if "tokens_per_s" in r else None
            for mode, r in refs.items()},
        "machinery": {
            "off": "engine.train_step through __ray_call__ + ray.get, nothing else",
            "on_no_memory": None if "on_no_memory" not in ph else
            f"Trainer.train: deadline + progress polling every {ft.health_interval_s:g} s, "
            f"engine.snapshot() every step ({snap}), metrics; no holder sends",
            "on": f"as on_no_memory + memory snapshots to holders every {ft.memory_snapshot_interval} step(s)"
            if ft.memory_snapshot_interval else
            f"Trainer.train: deadline + progress polling every {ft.health_interval_s:g} s, "
            f"engine.snapshot() every step ({snap}), metrics; memory snapshots off",
            "checkpoints": f"every {cfg.checkpoint.interval} step(s) in ON phases"
            if cfg.checkpoint.interval else "none"},
        "config": {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_heads": m.num_heads,
                   "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": m.vocab_size, "seq_len": t.seq_len,
                   "global_batch_size": t.global_batch_size, "mini_batch_size": t.mini_batch_size,
                   "micro_batch_size": t.micro_batch_size, "warmup": args.warmup, "steps": args.steps,
                   "repeats": args.repeats, "health_interval_s": ft.health_interval_s,
                   "memory_snapshot_interval": ft.memory_snapshot_interval,
                   "checkpoint_interval": cfg.checkpoint.interval, "overrides": args.overrides,
                   "load_avg_1m": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count(),
                   "date": time.strftime("%Y-%m-%d")},
    }
    print_table(result)
    out = Path(args.out or ROOT / "bench" / "results" / f"train_speed_{cfg.cluster.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


def print_table(r: dict) -> None:
    """The phases side by side, the overhead, holder lag, loss check and component timings."""
    def fmt(x, spec):
        return "n/a" if x is None else format(x, spec)

    names = [n for n in ("off", "on_no_memory", "on") if r[n] is not None]
    print(f"\n{r['device']}, {r['engine']} engine, {r['params'] / 1e6:.1f}M params, "
          f"{r['tokens_per_step']} tokens/step, {r['flops_per_step']:.3g} FLOP/step; objective "
          f"{r['objective']} on {r['data_kind']} data, {r['updates_per_step']} update(s) per step"
          f"{', with' if r['old_logprob_pass'] else ', no'} old-log-prob pass")
    print(f"{'':<22}" + "".join(f"{n:>14}" for n in names))
    for label, key, spec in (("step time median (s)", "step_s", ".4f"), ("step time mean (s)", "step_s_mean", ".4f"),
                             ("tokens/s", "tokens_per_s", ",.0f"), ("MFU", "mfu", ".1%"),
                             ("host memory peak", "host_mem_peak_frac", ".0%"),
                             ("timed steps", "timed_steps", "d")):
        print(f"{label:<22}" + "".join(f"{fmt(r[n][key], spec):>14}" for n in names))
    if r["off"]["mfu"] is None:
        print("MFU n/a: peak FLOP/s of this device unknown (give --peak-tflops)")
    print(f"overhead ratio on/off: {fmt(r['overhead_ratio'], '.3f')}x (median), "
          f"{fmt(r['overhead_ratio_mean'], '.3f')}x (mean), {fmt(r['overhead_s_per_step'], '+.4f')} s per step"
          + (f"; without memory snapshots {fmt(r['overhead_ratio_no_memory'], '.3f')}x"
             if r["on_no_memory"] is not None else ""))
    lag = r["on"]["snapshot_lag_s"]
    lag = ("memory snapshots off" if not r["config"]["memory_snapshot_interval"] else
           f"holders caught up {lag:.3f} s after the last ON step" if lag is not None else
           "holders did NOT catch up within --lag-timeout")
    print(f"{lag}; losses of every phase {'equal' if r['losses_equal'] else 'differ (max %.3g)' % r['loss_max_abs_diff']}"
          f"; recoveries: {sum(r[n].get('recoveries', 0) for n in names)}")
    for n in names:
        if r[n]["stopped_early"]:
            print(f"{n} stopped early: {r[n]['stopped_early']}")
    for mode, ref in r["reference"].items():
        if "error" in ref:
            print(f"reference {mode}: failed: {ref['error'][-300:]}")
            continue
        print(f"reference {mode} (HF Llama, plain loop, {ref['rows']} rows/step on one device): "
              f"{ref['step_s']:.4f} s/step, {ref['tokens_per_s']:,.0f} tokens/s, MFU {fmt(ref['mfu'], '.1%')}; "
              f"engine (off) per GPU / reference: tokens/s {fmt(r['tokens_per_s_per_gpu_vs_reference'][mode], '.3f')}, "
              f"MFU {fmt(ratio(r['mfu'], ref['mfu']), '.3f')}")
    if r["components"]:
        c = r["components"]
        print(f"alone: engine.snapshot() {c['snapshot_s']:.4f} s, engine.start_host_copy() "
              f"{c['start_host_copy_s']:.4f} s (the copy itself {c['host_copy_s']:.4f} s), "
              f"one health poll {c['health_poll_s']:.4f} s")
    if r["memory_snapshots"] is not None:
        m = r["memory_snapshots"]
        print(f"memory snapshots in ON phases (all ranks): {m['sent']} sent, {m['skipped']} skipped "
              f"(one in flight), {m['failed']} failed; per-step snapshot ratio "
              f"{fmt(r['memory_snapshot_every_step_ratio'], '.3f')}x, state {fmt(r['state_gb'], '.2f')} GB per rank")


if __name__ == "__main__":
    main()
