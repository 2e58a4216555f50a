"""The steady per-step cost of the shard keeper (keeper.py) on one device, beside the same
training without it.

With a sharded optimizer at dp ranks, a rank keeps, per step: a rollback snapshot of its params
and optimizer shard (Megatron, `engine.snapshot()`; the torch engine takes one anyway), and a
copy of its shard sent to its keeper (`keeper.ShardSender.after_step`: a side-stream copy into
pinned buffers overlapped with the next step, a background send to a `SnapshotHolder` actor,
and a wait for the previous send before the next copy, so no step's shard is skipped). One
device has no dp=8: the shard size is emulated by `--fractions` (each optimizer tensor cut to
its first fraction of elements, so the copies and the send move a dp=1/fraction rank's bytes;
the params are copied whole, as a real rank's are).

Phases, one engine (world of one rank, its own process group), consecutive steps: `off` (the
default training without keeper: `engine.snapshot()` + `train_step`), then for each fraction
`kept` (the rollback snapshot + `train_step` + the shard sent to a real `SnapshotHolder` actor
in a local Ray). `--warmup` steps of each phase untimed; step_s = median of `--steps` timed
steps, each from the snapshot to the send's start (what the actor's `train_step` does).
The holder runs on this host (a real keeper is on another node: the send crosses the network).
A fraction whose host memory (rollback + send buffers + 3 copies at the holder) would pass
half of the available memory is skipped and noted.

Usage (repository root): python -m bench.keeper [--fractions 0.125,1] [--steps 8] [--warmup 2]
                                                [--breakdown] [--set a.b=v ...] [--out PATH]
JSON: {"redundancy_overhead_ratio" (kept.step_s / off.step_s at the first fraction),
"shard_fraction", "kept_every_step" (every timed and warm-up step's shard sent, none skipped or
failed, at the first fraction), "device", "engine", "params", "off": {"step_s", "steps_s"},
"cases": {fraction: {"step_s", "steps_s", "ratio", "shard_gb", "rollback_gb", "kept":
{sent, skipped, failed}, "kept_every_step", "send_wait_s"} or {"skipped": why}; with --breakdown
also "FRACTION:rollback", ":copy", ":send_only" (see `kept_case`)}, "config"}.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import write_json  # noqa: E402
from config import load_config, resolve  # noqa: E402
from host_memory import state_nbytes  # noqa: E402
from keeper import ShardSender, shard_key  # noqa: E402
from parallel_dims import ParallelDims  # noqa: E402
from snapshots import SnapshotHolder  # noqa: E402
from training_batch import synthetic_batch  # noqa: E402


def cut(state, fraction: float):
    """`state` with every tensor of more than one element cut to a view of its first
    `fraction` of elements (at least one): a dp = 1/fraction rank's share of the bytes."""
    def part(x):
        if not isinstance(x, torch.Tensor) or x.numel() <= 1:
            return x
        return x.reshape(-1)[:max(1, int(x.numel() * fraction))]
    return torch.utils._pytree.tree_map(part, state)


def emulate_shard(engine, fraction: float) -> None:
    """Make `engine` keep and send a 1/fraction-rank's share of its optimizer state: Megatron's
    `_train_state` (its rollback snapshot and `_shard_state` read it) with the optimizer cut,
    and the rollback snapshot kept (a real rank keeps it at dp >= 2); the torch engine's
    `_shard_state` cut (its rollback copy is whole in every phase)."""
    if hasattr(engine, "_keeps_rollback"):
        whole = type(engine)._train_state.__get__(engine)

        def train_state():
            state = whole()
            return {**state, "optimizer": cut(state["optimizer"], fraction)}
        engine._train_state = train_state
        engine._keeps_rollback = lambda: True
        engine._snapshot = None  # laid out for the previous fraction
    else:
        shard = type(engine)._shard_state.__get__(engine)
        engine._shard_state = lambda: cut(shard(), fraction)


def sync(engine) -> None:
    if torch.cuda.is_available() and engine.cfg.cluster.device == "cuda":
        torch.cuda.synchronize()


class CopyOnly:
    """The `ShardSender.after_step` of case `copy`: the shard's host copy without the send (the
    previous copy waited for first, as the sender waits for its send)."""

    def __init__(self):
        self.copy = None
        self.sender = ShardSender().sender  # counts only: nothing is sent

    def after_step(self, engine, holder, key, step):
        if self.copy is not None:
            self.copy.wait()
        self.copy = engine.start_shard_copy()
        self.sender.sent += 1


def phase(engine, cfg, first: int, warmup: int, steps: int, keep=None) -> tuple[list[float], int, float]:
    """Run steps first.. first+warmup+steps-1; returns (timed step seconds, next step, seconds
    of the timed steps spent waiting for the previous step's send). `keep`: (ShardSender or
    `CopyOnly`, holder) sending each step's shard."""
    t, m = cfg.train, cfg.model
    times, waited = [], 0.0
    for step in range(first, first + warmup + steps):
        batch = synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, m.vocab_size)
        sync(engine)
        t0 = time.perf_counter()
        engine.snapshot()
        engine.train_step(batch, step)
        if keep is not None:
            tw = time.perf_counter()
            keep[0].sender.wait()
            if step >= first + warmup:
                waited += time.perf_counter() - tw
            keep[0].after_step(engine, keep[1], shard_key("bench", 0), step)
        t1 = time.perf_counter()
        if step >= first + warmup:
            times.append(t1 - t0)
    return times, first + warmup + steps, waited


def kept_case(engine, cfg, args, step: int, mode: str) -> tuple[dict, int]:
    """One timed phase from `step` in `mode`: 'kept' (rollback snapshot + shard copy + send),
    'rollback' (the rollback snapshot only), 'copy' (rollback + shard copy, nothing sent),
    'send_only' (shard copy + send, no rollback snapshot). Returns ({"step_s", "steps_s",
    "kept", "send_wait_s"}, next step)."""
    megatron = hasattr(engine, "_keeps_rollback")
    if megatron:
        engine._keeps_rollback = (lambda: False) if mode == "send_only" else (lambda: True)
    holder = sender = None
    if mode in ("kept", "send_only"):
        holder, sender = SnapshotHolder.remote(), ShardSender()
        sender.connect(holder)
        sender.sender.wait()
    elif mode == "copy":
        sender = CopyOnly()
    if megatron and sender is not None:  # pin the send buffers before timing (done at join in a run)
        engine.start_shard_copy()
        engine._shard_arena.result()
    times, step, waited = phase(engine, cfg, step, args.warmup, args.steps,
                                (sender, holder) if sender is not None else None)
    counts = {}
    if sender is not None:
        sender.sender.wait()
        counts = sender.sender.counts()
    if holder is not None:
        ray.kill(holder)
    if megatron:
        engine._keeps_rollback = lambda: True
    return {"step_s": statistics.median(times), "steps_s": times, "kept": counts, "send_wait_s": waited}, step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fractions", default="0.125,1", help="shard sizes, as fractions of the optimizer state")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--breakdown", action="store_true",
                    help="also time, at the first fraction: the rollback snapshot alone, plus the shard copy, "
                         "and the copy + send without the rollback snapshot")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", default="config.yaml")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    phases = 1 + len(fractions) + (3 if args.breakdown else 0)
    cfg = resolve(load_config(args.config, ["cluster.num_workers=1", "cluster.num_spares=0",
                                            "model.distributed_optimizer=true",
                                            f"train.steps={phases * (args.warmup + args.steps)}", *args.sets]))
    if cfg.model.engine == "megatron":
        from megatron_engine import MegatronEngine as Engine
    else:
        from torch_engine import TorchEngine as Engine
    engine = Engine(cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    engine.connect(dist.PrefixStore("gen1", store), ParallelDims.from_config(cfg), 0)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # its own Ray
    device = torch.cuda.get_device_name(0) if cfg.model.engine == "megatron" else f"cpu ({os.cpu_count()} cores)"
    off, step, _ = phase(engine, cfg, 1, args.warmup, args.steps)
    off_s = statistics.median(off)
    cases = {}
    for fraction in fractions:
        emulate_shard(engine, fraction)
        shard_b = state_nbytes(engine._shard_state())
        rollback_b = state_nbytes(engine._train_state()) if hasattr(engine, "_keeps_rollback") else 0
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if rollback_b + 4 * shard_b > avail / 2:
            cases[str(fraction)] = {"skipped": f"needs {(rollback_b + 4 * shard_b) / 1e9:.1f} GB of host memory, "
                                               f"{avail / 1e9:.1f} GB available"}
            continue
        if args.breakdown and fraction == fractions[0]:
            for mode in ("rollback", "copy", "send_only"):
                part, step = kept_case(engine, cfg, args, step, mode)
                cases[f"{fraction}:{mode}"] = {**part, "ratio": part["step_s"] / off_s}
                print(f"fraction {fraction} {mode}: step {part['step_s']:.4f} s (x{part['step_s'] / off_s:.3f}), "
                      f"send wait {part['send_wait_s']:.3f} s", flush=True)
        case, step = kept_case(engine, cfg, args, step, "kept")
        counts = case["kept"]
        cases[str(fraction)] = {
            **case, "ratio": case["step_s"] / off_s, "shard_gb": shard_b / 1e9, "rollback_gb": rollback_b / 1e9,
            "kept_every_step": counts == {"sent": args.warmup + args.steps, "skipped": 0, "failed": 0}}
        print(f"fraction {fraction}: step {case['step_s']:.4f} s vs {off_s:.4f} s off "
              f"(x{cases[str(fraction)]['ratio']:.3f}), shard {shard_b / 1e9:.2f} GB, kept {counts}, "
              f"send wait {case['send_wait_s']:.3f} s", flush=True)
    first = cases[str(fractions[0])]
    result = {"redundancy_overhead_ratio": first.get("ratio"), "shard_fraction": fractions[0],
              "kept_every_step": first.get("kept_every_step", False), "device": device,
              "engine": cfg.model.engine, "params": sum(p.numel() for p in engine.model.parameters()),
              "off": {"step_s": off_s, "steps_s": off}, "cases": cases, "config": args.sets}
    write_json(args.out or f"bench/results/keeper_{'gpu' if cfg.model.engine == 'megatron' else 'cpu'}.json", result)
    print(f"redundancy_overhead_ratio {result['redundancy_overhead_ratio']} at shard fraction {fractions[0]}, "
          f"kept_every_step {result['kept_every_step']}, {device}")
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()
