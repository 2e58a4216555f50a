"""Where a training step's time goes: the torch profiler around a few `train_step`s of the engine
in this process (one rank: tp = pp = cp = dp = 1, a process group of one), after untimed
warm-up steps.

The engine is the run's (`model.engine`): on a GPU the Megatron engine, by default at the 1.36B
shape of bench/attention.py (24 layers, hidden 2048, 16 heads, ffn 5632, vocab 32000, seq
2048) with 16 x 2048 = 32,768 tokens per step; on CPU the torch engine at config.yaml's shape.
The step is the production one (`engine.train_step` with the synthetic PPO batch and the
trainer's loss weights: old-log-prob forward, forward + backward per micro-batch, optimizer).

Reported, per profiled step:
  top ops     the `--top` ops / kernels by self device time (CUDA) or self CPU time (CPU);
  shares      that time split by what the name says: attention, matmul, norm, optimizer,
              loss (cross entropy / softmax), communication, copy, framework (CPU: the
              self time of module / autograd ranges, i.e. Python overhead), elementwise / other
              (`CATEGORIES`, first match wins; kernels whose names say nothing, e.g. the
              elementwise kernels of an unfused RMSNorm, count as elementwise / other);
  host syncs  calls that make the host wait for the device (cudaStreamSynchronize,
              cudaDeviceSynchronize, cudaEventSynchronize, cudaMemcpy, `.item()`),
              count and host seconds; on CPU the `.item()` calls that would be syncs on a GPU.

Usage (repository root): python -m bench.profile_step [--steps 1] [--warmup 2] [--micro-batch N]
    [--global-batch N] [--top 25] [--small] [--set a.b=v ...] [--out-dir DIR]
Prints the tables and writes DIR/profile_step_<device>.json (the tables) and
DIR/profile_step_<device>.trace.json.gz (the Chrome / Perfetto trace); DIR defaults to
bench/results/gpu on a GPU, bench/results elsewhere.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from bench.attention import MODEL_1B

ROOT = Path(__file__).resolve().parent.parent
# (category, pattern on the lower-cased op / kernel name); the first match wins.
CATEGORIES = (
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|gloo|c10d"),
    ("optimizer", r"adam|multi_tensor|foreach|optimizer|l2norm|clip_grad"),
    ("framework", r"distributeddataparallel|autograd::engine|\.forward$|\.backward$"),  # CPU: python-side ranges
    ("attention", r"flash|fmha|attention|sdpa|attn|cudnn.*mha"),
    ("loss", r"cross_entropy|log_softmax|nll_loss|softmax"),
    ("norm", r"rms_?norm|layer_?norm|rowwisemoments"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|aten::(mm|addmm|bmm|baddbmm|matmul|linear)\b|sm\d+_.*tn"),
    ("copy", r"memcpy|memset|aten::(copy_|to|_to_copy|contiguous|clone|cat)\b|cat_|copy_kernel"),
)
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
ITEM_NAMES = ("aten::item", "aten::_local_scalar_dense")


def category(name: str) -> str:
    """The first `CATEGORIES` entry whose pattern matches `name`, else 'elementwise / other'."""
    low = name.lower()
    return next((c for c, pat in CATEGORIES if re.search(pat, low)), "elementwise / other")


def summarize(prof, cuda: bool, steps: int, top: int) -> dict:
    """Tables of a finished `torch.profiler.profile` of `steps` steps: {"time_basis" ("device"
    on CUDA: kernel time; "cpu": self CPU time of ops), "total_s_per_step", "top" (list of
    {"name", "category", "calls_per_step", "s_per_step", "share"}), "shares" (category ->
    share of the total), "host_syncs" ({"count_per_step", "host_s_per_step", "by_name"})}."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    if cuda:  # the kernels (device events); their time is what the GPU spent
        rows = [(e.key, e.count, e.self_device_time_total) for e in events if e.device_type == DeviceType.CUDA]
    else:  # CPU ops by self time (children not counted twice); profiler ranges excluded
        rows = [(e.key, e.count, e.self_cpu_time_total) for e in events
                if e.device_type == DeviceType.CPU and not e.key.startswith(("ProfilerStep", "## "))]
    total_us = sum(us for _, _, us in rows) or 1.0
    rows.sort(key=lambda r: -r[2])
    shares: dict[str, float] = {}
    for name, _, us in rows:
        shares[category(name)] = shares.get(category(name), 0.0) + us / total_us
    # on CUDA every .item() (aten::_local_scalar_dense) is a device-to-host copy the host waits for
    sync_names = (*SYNC_NAMES, "cudaMemcpy", "aten::_local_scalar_dense") if cuda else ITEM_NAMES
    syncs = {e.key: (e.count, e.cpu_time_total) for e in events if e.key in sync_names}
    return {"time_basis": "device" if cuda else "cpu", "total_s_per_step": total_us / 1e6 / steps,
            "top": [{"name": n, "category": category(n), "calls_per_step": c / steps,
                     "s_per_step": us / 1e6 / steps, "share": us / total_us} for n, c, us in rows[:top]],
            "shares": dict(sorted(shares.items(), key=lambda kv: -kv[1])),
            "host_syncs": {"count_per_step": sum(c for c, _ in syncs.values()) / steps,
                           "host_s_per_step": sum(us for _, us in syncs.values()) / 1e6 / steps,
                           "by_name": {k: c / steps for k, (c, _) in syncs.items()}}}


def make_engine(cfg):
    """The run's engine (`model.engine`), connected as the only rank of a process group of one."""
    import torch.distributed as dist

    from ftrain.distributed.parallel_dims import ParallelDims

    if cfg.model.engine == "megatron":
        from ftrain.engines.megatron_engine import MegatronEngine as Engine
    else:
        from ftrain.engines.torch_engine import TorchEngine as Engine
    engine = Engine(cfg)
    engine.connect(dist.HashStore(), ParallelDims(tp=1, pp=1, cp=1, dp=1), 0)
    return engine


def step_batch(cfg, step: int):
    """The trainer's batch of `step` (`synthetic_batch`) with its loss weights at dp = 1."""
    import dataclasses

    from ftrain.data.training_batch import synthetic_batch
    from ftrain.objectives.ppo import global_loss_weights

    t, m = cfg.train, cfg.model
    batch = synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, m.vocab_size)
    weights = global_loss_weights(batch.loss_mask, cfg.ppo.loss_agg_mode, t.mini_batch_size,
                                  t.mini_batch_size // t.micro_batch_size)
    return dataclasses.replace(batch, loss_weights=weights)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1, help="profiled steps (default 1: the trace grows with each)")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (default 2)")
    p.add_argument("--micro-batch", type=int, default=None, help="train.micro_batch_size (default: the config's, 2)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="train.global_batch_size = mini_batch_size (default 16 at the 1.36B shape, else the config's)")
    p.add_argument("--small", action="store_true", help="config.yaml's model shape on a GPU too (not the 1.36B one)")
    p.add_argument("--top", type=int, default=25, help="rows of the top-ops table (default 25)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    p.add_argument("--out-dir", default=None, help="default bench/results/gpu on cuda, bench/results on cpu")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1, --warmup >= 0")
    import torch

    from ftrain.config import load_config, resolve

    big = resolve(load_config(None, args.overrides)).cluster.device == "cuda" and not args.small
    batch = args.global_batch or (16 if big else None)
    sets = [*(MODEL_1B if big else []), "cluster.num_workers=1", "cluster.num_spares=0",
            *([f"train.global_batch_size={batch}", f"train.mini_batch_size={batch}"] if batch else []),
            *([f"train.micro_batch_size={args.micro_batch}"] if args.micro_batch else []), *args.overrides]
    cfg = resolve(load_config(None, [*sets, f"train.steps={args.warmup + args.steps + 1}"]))
    cuda = cfg.cluster.device == "cuda"
    engine = make_engine(cfg)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for step in range(1, args.warmup + 1):
        engine.train_step(step_batch(cfg, step), step)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for step in range(args.warmup + 1, args.warmup + args.steps + 1):
            engine.train_step(step_batch(cfg, step), step)
        sync()
        wall = (time.perf_counter() - t0) / args.steps
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    tables = summarize(prof, cuda, args.steps, args.top)
    t, m = cfg.train, cfg.model
    result = {"device": device, "engine": m.engine, "wall_s_per_step_profiled": wall, **tables,
              "config": {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_heads": m.num_heads,
                         "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": m.vocab_size, "dtype": m.dtype,
                         "seq_len": t.seq_len, "global_batch_size": t.global_batch_size,
                         "micro_batch_size": t.micro_batch_size, "warmup": args.warmup, "steps": args.steps,
                         "overrides": args.overrides, "date": time.strftime("%Y-%m-%d")}}
    print_tables(result)
    out = Path(args.out_dir or ROOT / "bench" / "results" / ("gpu" if cuda else ""))
    out.mkdir(parents=True, exist_ok=True)
    stem = f"profile_step_{device.replace(' ', '_').lower()}"
    prof.export_chrome_trace(str(out / f"{stem}.trace.json.gz"))
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / stem}.json and {stem}.trace.json.gz")
    return result


def print_tables(r: dict) -> None:
    basis = "kernel time" if r["time_basis"] == "device" else "self CPU time"
    print(f"\n{r['device']}, {r['engine']} engine: {r['wall_s_per_step_profiled']:.4f} s per profiled step, "
          f"{r['total_s_per_step']:.4f} s of {basis} per step")
    print(f"{'share':>7} {'s/step':>9} {'calls':>7}  {'category':<20} name")
    for row in r["top"]:
        print(f"{row['share']:>7.1%} {row['s_per_step']:>9.4f} {row['calls_per_step']:>7.0f}  "
              f"{row['category']:<20} {row['name'][:100]}")
    print("shares: " + ", ".join(f"{k} {v:.1%}" for k, v in r["shares"].items()))
    h = r["host_syncs"]
    print(f"host syncs per step: {h['count_per_step']:.0f} ({h['host_s_per_step']:.4f} s host time): "
          + ", ".join(f"{k} {v:.0f}" for k, v in h["by_name"].items()))


if __name__ == "__main__":
    main()
