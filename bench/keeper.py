"""The steady per-step cost of the shard keeper (keeper.py) on one device, beside the same
training without it.

With a sharded optimizer at dp ranks, a rank keeps, per step: a rollback snapshot of its params
and optimizer shard (Megatron, `engine.snapshot()`; the torch engine takes one anyway), and a
copy of its shard kept by its keeper (`keeper.ShardSender.after_step`: a side-stream copy into
one of two shared pinned arenas, which the `SnapshotHolder` actor of this host adopts, as a
one-node job's keeper does; with `--courier` sent by a courier process of this host to it while
the next steps run, as to a keeper on another node, courier.py). One device has no dp=8: the shard size is emulated
by `--fractions` (each optimizer tensor cut to its first fraction of elements, so the copies and
the send move a dp=1/fraction rank's bytes; the params are copied whole, as a real rank's are).

Cases, one engine (world of one rank, its own process group): `off` (training without keeper:
no rollback snapshot, nothing kept), `kept` (the rollback snapshot + the shard kept every step);
with `--breakdown` also `rollback` (the rollback snapshot only) and `copy` (rollback + the
shard's copy into the arenas, nothing sent). Why interleaved: step times drift by 10-30% over a
run (clocks, the host), more than the 3% to resolve, so the cases run in `--blocks` blocks of
`--settle` untimed + `--block-steps` timed steps each, in the order A B ... then ... B A (each
block reversed), all in one process, after `--warmup` untimed steps. A step's time is the wall
time from the end of the previous step to the end of this one (no device sync in a block: what
a training loop sees, the copies' spill-over into the next step included). The keeper's sends
are drained (untimed) at the end of each `kept` block, so none overlaps another case's steps.
Per case: the median and the 10/25/75/90th percentiles of its timed steps and each block's
median; ratio = median / off's median, with a 90% bootstrap interval (steps resampled within
each case) and the median, min and max of the per-block ratios (each block against the off
block of the same round). The holder runs on this host, so it adopts the arenas (no send);
`--courier` has the courier send them to it through Ray instead (a keeper on another node, less
the network). A fraction whose host memory (rollback + the 2 arenas, which an adopting holder
maps; with `--courier` also 3 copies at the holder + 1 in flight) would pass 3/4 of the
free memory is skipped and noted.

Usage (repository root): python -m bench.keeper [--fractions 0.125,1] [--blocks 8] [--block-steps 6]
    [--settle 1] [--warmup 3] [--breakdown] [--courier] [--trace DIR] [--set a.b=v ...] [--out PATH]
JSON: {"redundancy_overhead_ratio" (kept / off median step time at the first fraction),
"shard_fraction", "kept_every_step" (every step of every kept block, settle steps included, sent,
none skipped or failed, at the first fraction), "device", "engine", "params", "cases":
{fraction: {"off", "kept" (, "rollback", "copy"): {"step_s", "p10_s", "p25_s", "p75_s", "p90_s",
"steps_s", "block_s", "ratio", "ratio_p5", "ratio_p95", "block_ratio" {median, min, max},
"cpu_s" (median CPU seconds of the training thread per timed step: near step_s means the step
is bound by the host's kernel launches), "gc_s" (the garbage collector's pauses over the timed
steps)};
"kept" also "kept" {sent, skipped, failed}, "send_waits", "send_wait_s", "adopted" (the holder
adopted the arenas), "couriers" (couriers started: 0 when adopted); "shard_gb",
"rollback_gb", "kept_every_step", "rounds"} or {"skipped": why}}, "complete" (false: a run cut
short, the rounds so far; the file is rewritten after each round), "config"}.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
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
from ftrain.config import FaultToleranceConfig, load_config, resolve  # noqa: E402
from ftrain.data.training_batch import synthetic_batch  # noqa: E402
from ftrain.distributed.parallel_dims import ParallelDims  # noqa: E402
from ftrain.state.host_memory import state_nbytes  # noqa: E402
from ftrain.state.keeper import ShardSender, shard_key  # noqa: E402
from ftrain.state.snapshots import SnapshotHolder  # noqa: E402


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
    `_shard_state` cut (its rollback copy is whole in every phase). Megatron's cut views are
    cached, keyed by the number of optimizer entries and their tensors' addresses (not their
    ids: `p.data` is a new tensor object per call): cutting or even walking ~1000 tensors per
    call would add milliseconds per step to the kept cases on the training thread, the bench's
    cost, not the keeper's. The bench never reallocates the optimizer state in place of the
    old, so the first and last entries' addresses stand for all."""
    if hasattr(engine, "_keeps_rollback"):
        whole = type(engine)._train_state.__get__(engine)

        views = {}  # the cut views, made again only when the optimizer's tensors are others

        def train_state():
            state = whole()
            opt = state["optimizer"]
            ids = (len(opt), opt[0][0].data_ptr(), opt[-1][0].data_ptr()) if opt else ()
            if ids not in views:
                views.clear()
                views[ids] = cut(state["optimizer"], fraction)
            return {**state, "optimizer": views[ids]}
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
    """The `ShardSender` of case `copy`: the shard copied into its arenas each step, not sent
    (each arena's previous copy waited for first)."""

    def __init__(self):
        self.sender = ShardSender(FaultToleranceConfig.health_timeout_s)
        self.copies = [None] * ShardSender.BUFFERS

    def after_step(self, engine, holder, key, step):
        i = step % len(self.copies)
        if self.copies[i] is not None:
            self.copies[i].wait()
        self.copies[i] = engine.start_shard_copy(self.sender.arena(engine, i).tensor)
        self.sender.sent += 1

    def wait(self):
        for c in filter(None, self.copies):
            c.wait()


class Case:
    """One case's per-step work around `train_step` (see the module doc) and its timings."""

    def __init__(self, name: str, engine, holder, courier: bool = False):
        self.name, self.engine, self.holder = name, engine, holder
        self.steps_s, self.block_s, self.sender = [], [], None
        self.cpu_s, self.gc_s = [], []  # per timed step: the training thread's CPU time, GC pauses
        if name == "kept":
            self.sender = ShardSender(FaultToleranceConfig.health_timeout_s)
            self.sender.connect(holder, adopt=False if courier else None)
        elif name == "copy":
            self.sender = CopyOnly()
        if self.sender is not None:  # arenas pinned, courier started before timing (done at join in a run)
            (self.sender if name == "kept" else self.sender.sender).prepare(engine)
            self.sender.wait()
        self.sent = 0  # steps whose shard this case started to keep

    def begin(self) -> None:
        if hasattr(self.engine, "_keeps_rollback"):
            rollback = self.name != "off"
            self.engine._keeps_rollback = lambda: rollback

    def step(self, cfg, step: int) -> None:
        t, m = cfg.train, cfg.model
        batch = synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, m.vocab_size)
        self.engine.snapshot()
        self.engine.train_step(batch, step)
        if self.sender is not None:
            self.sender.after_step(self.engine, self.holder, shard_key("bench", 0), step)
            self.sent += 1

    def end(self) -> None:
        """Drain the sends and copies in flight (untimed) and wait for the device."""
        if self.sender is not None:
            self.sender.wait()
        sync(self.engine)


class GC:
    """Seconds the garbage collector paused this process so far (`gc.callbacks`)."""

    paused_s, _start = 0.0, 0.0

    @classmethod
    def callback(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._start = time.perf_counter()
        else:
            cls.paused_s += time.perf_counter() - cls._start


gc.callbacks.append(GC.callback)


def stats(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=20, method="inclusive")  # q[k-1]: the 5k-th percentile
    return {"step_s": statistics.median(times), "p10_s": q[1], "p25_s": q[4], "p75_s": q[14], "p90_s": q[17]}


def ratio_interval(off: list[float], on: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentiles of median(on) / median(off) over bootstrap resamples of each."""
    rng = random.Random(seed)
    r = sorted(statistics.median(rng.choices(on, k=len(on))) / statistics.median(rng.choices(off, k=len(off)))
               for _ in range(reps))
    return r[int(0.05 * reps)], r[int(0.95 * reps) - 1]


def run_blocks(cases: list[Case], cfg, args, step: int, after_round=lambda: None) -> int:
    """The interleaved blocks (module doc), `after_round()` after each round; returns the next
    step number."""
    for block in range(args.blocks):
        for case in (cases if block % 2 == 0 else cases[::-1]):
            case.begin()
            sync(case.engine)
            times, last, cpu, paused = [], time.perf_counter(), time.thread_time(), GC.paused_s
            for i in range(args.settle + args.block_steps):
                case.step(cfg, step)
                step += 1
                now, now_cpu = time.perf_counter(), time.thread_time()
                if i >= args.settle:
                    times.append(now - last)
                    case.cpu_s.append(now_cpu - cpu)
                    case.gc_s.append(GC.paused_s - paused)
                last, cpu, paused = now, now_cpu, GC.paused_s
            case.end()
            case.steps_s += times
            case.block_s.append(statistics.median(times))
        after_round()
    return step


def trace(cases: list[Case], cfg, step: int, out_dir: str, settle: int = 2, steps: int = 2) -> int:
    """Per case: `settle` untimed steps, then `steps` steps under torch.profiler (CPU and CUDA
    activities), written to out_dir/keeper_trace_<case>.json; returns the next step number."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    for case in cases:
        case.begin()
        for _ in range(settle):
            case.step(cfg, step)
            step += 1
        sync(case.engine)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                case.step(cfg, step)
                step += 1
            sync(case.engine)
        case.end()
        prof.export_chrome_trace(os.path.join(out_dir, f"keeper_trace_{case.name}.json"))
        print(f"  trace of {case.name}: {out_dir}/keeper_trace_{case.name}.json", flush=True)
    return step


def summary(cases: list[Case]) -> dict:
    off = cases[0]
    out = {}
    for case in cases:
        lo, hi = ratio_interval(off.steps_s, case.steps_s)
        blocks = [b / o for b, o in zip(case.block_s, off.block_s)]
        out[case.name] = {**stats(case.steps_s), "ratio": statistics.median(case.steps_s) / statistics.median(off.steps_s),
                          "ratio_p5": lo, "ratio_p95": hi, "steps_s": case.steps_s, "block_s": case.block_s,
                          "cpu_s": statistics.median(case.cpu_s), "gc_s": sum(case.gc_s),
                          "block_ratio": {"median": statistics.median(blocks), "min": min(blocks), "max": max(blocks)}}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fractions", default="0.125,1", help="shard sizes, as fractions of the optimizer state")
    ap.add_argument("--blocks", type=int, default=8, help="rounds of one block per case")
    ap.add_argument("--block-steps", type=int, default=6, help="timed steps per block")
    ap.add_argument("--settle", type=int, default=1, help="untimed steps at the start of each block")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before the first block")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time, at the first fraction: the rollback snapshot alone, and with the shard copy")
    ap.add_argument("--courier", action="store_true",
                    help="send the shard through a courier to the holder (as to a keeper on another node) "
                         "instead of the holder adopting its arenas")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="after the blocks of the first fraction, profile 2 steps of each case (torch.profiler, "
                         "CPU and CUDA) and write DIR/keeper_trace_<case>.json (chrome traces)")
    ap.add_argument("--config", default="config.yaml")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    n_cases = 2 * len(fractions) + (2 if args.breakdown else 0)
    steps = args.warmup + n_cases * args.blocks * (args.settle + args.block_steps)
    cfg = resolve(load_config(args.config, ["cluster.num_workers=1", "cluster.num_spares=0",
                                            "model.distributed_optimizer=true", f"train.steps={steps}", *args.sets]))
    if cfg.model.engine == "megatron":
        from ftrain.engines.megatron_engine import MegatronEngine as Engine
    else:
        from ftrain.engines.torch_engine import TorchEngine as Engine
    engine = Engine(cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    engine.connect(dist.PrefixStore("gen1", store), ParallelDims.from_config(cfg), 0)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # its own Ray
    device = torch.cuda.get_device_name(0) if cfg.model.engine == "megatron" else f"cpu ({os.cpu_count()} cores)"
    params = sum(p.numel() for p in engine.model.parameters())

    def write(results: dict, complete: bool) -> dict:
        first = results.get(str(fractions[0]), {})
        result = {"redundancy_overhead_ratio": first["kept"]["ratio"] if "kept" in first else None,
                  "shard_fraction": fractions[0], "kept_every_step": first.get("kept_every_step", False),
                  "device": device, "engine": cfg.model.engine, "params": params, "complete": complete,
                  "cases": results, "config": args.sets}
        write_json(args.out or f"bench/results/keeper_{'gpu' if cfg.model.engine == 'megatron' else 'cpu'}.json",
                   result)
        return result

    warm = Case("off", engine, None)
    for step in range(1, args.warmup + 1):
        warm.step(cfg, step)
    step = args.warmup + 1
    results = {}
    for fraction in fractions:
        emulate_shard(engine, fraction)
        shard_b = state_nbytes(engine._shard_state())
        rollback_b = state_nbytes(engine._train_state()) if hasattr(engine, "_keeps_rollback") else 0
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        need = rollback_b + (6 if args.courier else 2) * shard_b
        if need > avail * 3 / 4:  # the rest for the process, Ray and the page cache
            results[str(fraction)] = {"skipped": f"needs {need / 1e9:.1f} GB of host memory, "
                                                 f"{avail / 1e9:.1f} GB available"}
            print(f"fraction {fraction}: {results[str(fraction)]['skipped']}", flush=True)
            continue
        holder = SnapshotHolder.remote()
        names = ["off", "kept"] + (["rollback", "copy"] if args.breakdown and fraction == fractions[0] else [])
        cases = [Case(name, engine, holder, args.courier) for name in names]
        kept = cases[1].sender

        def fraction_result():
            result = summary(cases)
            result["kept"].update(kept=kept.counts(), send_waits=kept.waits, send_wait_s=kept.wait_s,
                                  adopted=kept.adopt, couriers=kept.couriers)
            result.update(shard_gb=shard_b / 1e9, rollback_gb=rollback_b / 1e9, rounds=len(cases[0].block_s),
                          kept_every_step=kept.counts() == {"sent": cases[1].sent, "skipped": 0, "failed": 0})
            return result

        def after_round():  # what a run cut short by its time limit leaves
            results[str(fraction)] = fraction_result()
            write(results, complete=False)
            print(f"  round {len(cases[0].block_s)}: " + ", ".join(
                f"{c.name} {statistics.median(c.block_s[-1:]):.4f} s" for c in cases), flush=True)

        step = run_blocks(cases, cfg, args, step, after_round)
        result = fraction_result()
        if args.trace and fraction == fractions[0]:
            step = trace(cases, cfg, step, args.trace)
        for case in cases:
            if case.sender is not None:
                case.sender.sender.close() if isinstance(case.sender, CopyOnly) else case.sender.close()
        ray.kill(holder)
        results[str(fraction)] = result
        print(f"fraction {fraction} (shard {shard_b / 1e9:.2f} GB, rollback {rollback_b / 1e9:.2f} GB), "
              f"{args.blocks} blocks x {args.block_steps} timed steps per case:", flush=True)
        print(f"  {'case':<9}{'median s':>9}{'p10':>8}{'p90':>8}{'ratio':>8}{'90% interval':>16}{'block ratios':>22}"
              f"{'cpu s':>8}{'gc s':>7}")
        for name in names:
            r = result[name]
            b = r["block_ratio"]
            print(f"  {name:<9}{r['step_s']:9.4f}{r['p10_s']:8.3f}{r['p90_s']:8.3f}{r['ratio']:8.3f}"
                  f"{r['ratio_p5']:8.3f}-{r['ratio_p95']:.3f}{b['median']:8.3f} ({b['min']:.3f}-{b['max']:.3f})"
                  f"{r['cpu_s']:8.3f}{r['gc_s']:7.3f}")
        print(f"  kept {kept.counts()}, {kept.waits} send waits ({kept.wait_s:.3f} s), "
              f"{'adopted by the holder' if kept.adopt else 'sent'}, {kept.couriers} courier(s)", flush=True)
    result = write(results, complete=True)
    print(f"redundancy_overhead_ratio {result['redundancy_overhead_ratio']} at shard fraction {fractions[0]}, "
          f"kept_every_step {result['kept_every_step']}, {device}")
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()
