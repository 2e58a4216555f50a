"""GPU probe: why is the first train step of a freshly joined Megatron rank slow (9.8 s against
~2 s in steady state at 1.36B, bench/results/gpu/recovery_1b_nvidia-h200-x2_2026-11-30.json)?

Each variant runs in its own process on GPU 0 (world size 1, the recovery bench's 1.36B model,
no distributed optimizer: rollback snapshots on) and times, with a device sync after each, the
first steps of a rank in the state of a restored spare (built, connected, step 3), then the first
step after a reconnect (a survivor's view of a recovery):
- `spare`: a spare that reserved nothing: its rollback snapshot buffers are pinned
  (`megatron_engine.pinned_empty`) in a background thread while the first step runs;
- `spare_reserved`: the snapshot memory pinned before the rank joins (what `ActorGroup`
  has pre-warmed spares do: `MegatronEngine.reserve_host_memory`), then as `spare`;
- `no_snapshot`: no rollback snapshot at all (isolates the pinned allocation);
- `warm_up`: what a pre-warmed spare does before any failure: `MegatronEngine.warm_up` (a
  throwaway step of a one-layer model in a private world) and the reserved memory, then as
  `spare_reserved`. (Until 2026-11-30 a variant `warm` ran a forward pass after the build.)
Prints a table and writes --out: {"variants": {name: {"build_s" (includes warm_up_s), "warm_up_s", "steps_s": [...], "phases":
first step's phases, "reconnect_step_s"}}, "device", "date"}.
Usage (repository root, GPU machine): python3 -m bench.first_step_probe [--variants ...] [--out PATH]
"""
import argparse
import datetime
import json
import subprocess
import sys
import time

from bench import write_json

MODEL = ["model.distributed_optimizer=false", "model.num_layers=24", "model.hidden_size=2048",
         "model.num_heads=16", "model.ffn_hidden_size=5632", "model.vocab_size=32000",
         "model.max_seq_len=2048", "train.seq_len=2048", "train.global_batch_size=4",
         "train.mini_batch_size=2", "train.micro_batch_size=1", "train.steps=8",
         "cluster.num_workers=1", "cluster.num_spares=0"]


def _variant(name: str) -> dict:
    import torch
    import torch.distributed as dist

    from checkpoint import CheckpointManager
    from ftrain.config import load_config, resolve
    from ftrain.data.training_batch import synthetic_batch
    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines import megatron_engine

    cfg = resolve(load_config(None, MODEL), num_gpus=1)
    megatron_engine.configure_host_allocator()
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True)

    def join(e, gen):
        e.disconnect()
        e.connect(dist.PrefixStore(f"g{gen}", store), ParallelDims.from_config(cfg), 0)

    def batch(step):
        t = cfg.train
        return synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, cfg.model.vocab_size)

    def step(e, s):
        t0 = time.perf_counter()
        e.snapshot()
        out = e.train_step(batch(s), s)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out.get("phases")

    if name == "no_snapshot":
        megatron_engine.MegatronEngine._snapshot_to_host = lambda self: None
    t0 = time.perf_counter()
    e = megatron_engine.MegatronEngine(cfg)
    warm_up_s = e.warm_up(CheckpointManager) if name == "warm_up" else 0.0
    join(e, 1)
    build_s = time.perf_counter() - t0
    if name in ("spare_reserved", "warm_up"):  # before any failure: not part of the steps timed below
        e.reserve_host_memory(e.snapshot_nbytes(), e.save_nbytes())
        e._arena.result()
    e.step = 3  # a restored spare: no step-0 host copy (`reset`)
    steps, phases = [], None
    for s in (4, 5, 6):
        dt, ph = step(e, s)
        steps.append(round(dt, 3))
        phases = phases or ph
    join(e, 2)
    reconnect_s, _ = step(e, 7)
    return {"build_s": round(build_s, 2), "warm_up_s": round(warm_up_s, 2), "steps_s": steps, "phases": phases,
            "reconnect_step_s": round(reconnect_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["warm_up", "spare_reserved", "no_snapshot"])
    ap.add_argument("--out", default="bench/results/gpu/first_step_probe.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process: run one variant
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(_variant(args.one)), flush=True)
        return
    import torch

    results = {}
    for name in args.variants:  # a fresh process each: first-use costs are per process
        proc = subprocess.run([sys.executable, "-m", "bench.first_step_probe", "--one", name],
                              capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        results[name] = json.loads(line[-1][7:]) if line else {"error": proc.stderr[-3000:]}
        print(name, results[name], flush=True)
    print(f"\n{'variant':<12} {'build_s':>8} {'step1_s':>8} {'step2_s':>8} {'step3_s':>8} {'reconnect':>10}")
    for name, r in results.items():
        if "error" not in r:
            print(f"{name:<12} {r['build_s']:>8} " + " ".join(f"{x:>8}" for x in r["steps_s"])
                  + f" {r['reconnect_step_s']:>10}")
    out = {"variants": results, "device": torch.cuda.get_device_name(0),
           "date": datetime.date.today().isoformat()}
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
