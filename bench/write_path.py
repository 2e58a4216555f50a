"""Megatron torch_dist checkpoint I/O on CPU: the async save's background write and the load,
each against raw disk I/O of the same bytes in the same run (issue 24).

    python -m bench.write_path [--gb 2.5] [--repeat 3] [--dir /tmp] [--device cpu|cuda] [--out PATH]

The state: the tensors of a GPT-like model (hidden 1024, FFN 2816, vocab 32000) as a training
rank holds them, per weight a bf16 parameter and the fp32 main parameter, exp_avg and exp_avg_sq,
with as many layers as fit in --gb; plus a per-rank object and a common value, so the global
files (.metadata, common.pt, metadata.json) are written as in the engine's saves. One rank: a
world-size-1 gloo group in this process, Megatron ShardedTensors of CPU tensors (the engine
needs CUDA; its save hands Megatron the same objects), through `megatron_checkpoint` exactly as
`MegatronEngine.save_checkpoint` / `load_checkpoint` do, on a local directory under --dir.
`--device cuda`: the state's tensors on CUDA device 0, as the engine's are (the save copies them
to pinned host memory; the load reads into GPU memory); the raw I/O uses host copies of them.

Per repeat, in this order, with raw first in even repeats and last in odd ones (what runs before
a write changes its speed on a shared disk: alternating evens that out), each write starting
with the page cache of the earlier checkpoints dropped:
  raw      the state's bytes written into one file with open/write/fsync (bench.checkpoint_io's
           `raw_write`), then read back cold (`raw_read`); then deleted.
  save     `save_sharded(..., async_save=True)` (`stall_s`: planning + host copy), then
           `PendingSave.result()` and `ckpt.commit`: `background_s` = total - stall, the write
           of Megatron's write buckets in threads, the files' sha256, finalize, commit.
  verify   `ckpt.verify_files` of the manifest (reads and hashes every byte, as a restore does
           before it loads).
  load     the page cache of the checkpoint dropped, `load_sharded` into zeroed tensors of the
           state's shapes; `load_matches`: every tensor equals the saved one.
  sync     `save_sharded(...)` synchronously + `ckpt.commit` (`sync_save_s`: what a save without
           checkpoint.async_save stalls training for; `sync_vs_raw` against the raw write).
`save_vs_raw` = checkpoint bytes / background_s over the raw write's GB/s; `load_vs_raw`
likewise for the load against the raw read. Both from the best (least) time of each measure
over the repeats; `runs` keeps every repeat and its own ratios (raw and checkpoint I/O side by
side), `median_run_*` are their medians.

`raw_write_cpu_s` / `background_cpu_s`: CPU seconds of this process (all threads, kernel time
included) during the raw write and during the background part.
`phases`: what the write path's CPU work costs, measured in memory on the same tensors (no
disk): torch.save of every tensor into a discarding stream with and without the zip CRC32
(DCP's `_write_item` pickles each tensor with torch.save), and sha256 of every byte.
Writes bench/results/checkpoint_write_path_cpu.json (--out); the table goes to stdout.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch

from bench import write_json
from bench.checkpoint_io import ROOT, _mount_of, drop_cache, raw_read, raw_write
from checkpoint import CheckpointManager
from ftrain.state.checkpoint_io import no_zip_crc32

HIDDEN, FFN, VOCAB = 1024, 2816, 32000
WEIGHTS = {"qkv": (3 * HIDDEN, HIDDEN), "proj": (HIDDEN, HIDDEN), "fc1": (2 * FFN, HIDDEN),
           "fc2": (HIDDEN, FFN), "ln1": (HIDDEN,), "ln2": (HIDDEN,)}
BYTES_PER_PARAM = 2 + 3 * 4  # bf16 param + fp32 main param, exp_avg, exp_avg_sq


def make_state(gb: float) -> dict[str, torch.Tensor]:
    """{key: CPU tensor} of about `gb` GB (at least one layer): the embedding's and each layer's
    weights as bf16 parameter + three fp32 optimizer tensors, random values."""
    g = torch.Generator().manual_seed(0)
    per_layer = sum(torch.Size(s).numel() for s in WEIGHTS.values()) * BYTES_PER_PARAM
    layers = max(1, round((gb * 1e9 - VOCAB * HIDDEN * BYTES_PER_PARAM) / per_layer))
    weights = {"embedding": (VOCAB, HIDDEN)}
    weights.update({f"layers.{i}.{n}": s for i in range(layers) for n, s in WEIGHTS.items()})
    state = {}
    for name, shape in weights.items():
        state[f"{name}.param"] = torch.randn(shape, generator=g).bfloat16()
        for part in ("main", "exp_avg", "exp_avg_sq"):
            state[f"{name}.{part}"] = torch.randn(shape, generator=g)
    return state


def sharded(state: dict[str, torch.Tensor]) -> dict:
    """The Megatron sharded state dict of one rank holding every tensor whole, plus an RNG-like
    per-rank object and a common value."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in state.items()}
    out["rng"] = ShardedObject("rng", {"seed": 1234}, (1,), (0,), replica_id=0)
    out["step"] = 1
    return out


class _Discard(io.RawIOBase):
    """A write-only stream that keeps only the byte count (torch.save needs `tell`), feeding the
    bytes to `digest` when given."""

    def __init__(self, digest=None):
        self.n, self.digest = 0, digest

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self.digest is not None:
            self.digest.update(b)
        self.n += memoryview(b).nbytes
        return memoryview(b).nbytes

    def tell(self) -> int:
        return self.n


def phases(tensors: list[torch.Tensor]) -> dict:
    """Seconds of each CPU part of the write path over `tensors`, in memory (see the docstring)."""
    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def save_all():
        sink = _Discard()
        for t in tensors:
            torch.save(t, sink)

    out = {"torch_save_crc32_s": timed(save_all)}
    with no_zip_crc32():
        out["torch_save_no_crc32_s"] = timed(save_all)
    out["sha256_s"] = timed(lambda: [hashlib.sha256(memoryview(t.view(-1).view(torch.uint8).numpy())).digest()
                                     for t in tensors])
    return out


def raw_io(ckpt: CheckpointManager, host: list, raw_root: str) -> dict:
    """The raw write (fsync'd) and cold read of the bytes of `host`, then the file deleted."""
    os.makedirs(raw_root, exist_ok=True)
    drop_cache(ckpt.root)
    cpu = time.process_time()
    r = {"raw_write_s": raw_write(None, True, raw_root, {"state": host}), "raw_write_cpu_s": time.process_time() - cpu}
    r["raw_read_s"] = raw_read(None, True, raw_root, {"state": host})
    shutil.rmtree(raw_root)
    return r


def one_repeat(ckpt: CheckpointManager, step: int, state: dict, host: list, template: dict, raw_root: str,
               raw_first: bool) -> dict:
    """One repeat (see the module docstring): checkpoints `step` (async) and `step` + 1 (sync);
    `host`: the state's tensors in host memory; `raw_first`: the raw I/O before the checkpoint
    I/O, else after it."""
    from ftrain.engines.megatron_checkpoint import load_sharded, save_sharded

    r = {"payload_bytes": sum(t.numel() * t.element_size() for t in host), "raw_first": raw_first}
    if raw_first:
        r.update(raw_io(ckpt, host, raw_root))
    drop_cache(ckpt.root)  # every write starts with none of the earlier checkpoints' pages cached
    t0 = time.perf_counter()
    (pending,) = save_sharded(ckpt, step, 0, sharded(state), async_save=True)
    r["stall_s"], cpu = time.perf_counter() - t0, time.process_time()
    files = pending.result()
    manifest = ckpt.commit(step, {"world_size": 1, "engine": "megatron"}, files)
    r["total_s"], r["background_cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu
    r["background_s"] = r["total_s"] - r["stall_s"]
    r["bytes"], r["files"] = sum(f.size for f in files), len(files)

    drop_cache(ckpt._step_path(step))
    t0 = time.perf_counter()
    problems = ckpt.verify_files(step, manifest.files)
    r["verify_s"] = time.perf_counter() - t0
    if problems:
        raise RuntimeError(f"checkpoint step {step} does not verify: {problems}")

    for t in template.values():
        if isinstance(t, torch.Tensor):
            t.zero_()
    drop_cache(ckpt._step_path(step))
    t0 = time.perf_counter()
    loaded = load_sharded(ckpt, manifest, sharded(template))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    r["load_s"] = time.perf_counter() - t0
    r["load_matches"] = all(torch.equal(loaded[k], v) for k, v in state.items()) and loaded["step"] == 1

    drop_cache(ckpt.root)
    t0 = time.perf_counter()
    ckpt.commit(step + 1, {"world_size": 1, "engine": "megatron"}, save_sharded(ckpt, step + 1, 0, sharded(state)))
    r["sync_save_s"] = time.perf_counter() - t0
    if not raw_first:
        r.update(raw_io(ckpt, host, raw_root))
    r["save_vs_raw"] = (r["bytes"] / r["background_s"]) / (r["payload_bytes"] / r["raw_write_s"])
    r["sync_vs_raw"] = (r["bytes"] / r["sync_save_s"]) / (r["payload_bytes"] / r["raw_write_s"])
    r["load_vs_raw"] = (r["payload_bytes"] / r["load_s"]) / (r["payload_bytes"] / r["raw_read_s"])
    return r


def summarize(runs: list[dict]) -> dict:
    """The best (least) time of each measure over the repeats and the speeds and ratios from them
    (a shared machine: the least disturbed run is the best estimate of the code's cost)."""
    best = {k: min(r[k] for r in runs) for k in runs[0] if k.endswith("_s")}
    gb, payload_gb = runs[0]["bytes"] / 1e9, runs[0]["payload_bytes"] / 1e9
    out = {"bytes": runs[0]["bytes"], "payload_bytes": runs[0]["payload_bytes"], "files": runs[0]["files"],
           "raw_write_gbps": payload_gb / best["raw_write_s"], "background_gbps": gb / best["background_s"],
           "raw_read_gbps": payload_gb / best["raw_read_s"], "load_gbps": payload_gb / best["load_s"],
           **best, "load_matches": all(r["load_matches"] for r in runs)}
    out["sync_save_gbps"] = gb / best["sync_save_s"]
    out["save_vs_raw"] = out["background_gbps"] / out["raw_write_gbps"]
    out["sync_vs_raw"] = out["sync_save_gbps"] / out["raw_write_gbps"]
    out["load_vs_raw"] = out["load_gbps"] / out["raw_read_gbps"]
    for k in ("save_vs_raw", "sync_vs_raw", "load_vs_raw"):
        out[f"median_run_{k}"] = statistics.median(r[k] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.5, help="state size in GB (default 2.5)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the checkpoint directory (default: TMPDIR)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the state's tensors are")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "checkpoint_write_path_cpu.json"))
    args = ap.parse_args()

    import megatron.core
    import torch.distributed as dist

    if args.device == "cpu":
        torch.cuda.synchronize = lambda *a, **k: None  # Megatron's torch_dist writer calls these;
        torch.cuda.current_device = lambda: "cpu"       # no CUDA here (as tests/test_megatron_checkpoint.py)
    host = make_state(args.gb)
    state = {k: t.to(args.device) for k, t in host.items()}
    template = {k: torch.zeros_like(t) for k, t in state.items()}
    print(f"state: {len(state)} tensors, {sum(t.nbytes for t in state.values()) / 1e9:.2f} GB", flush=True)
    found = phases(list(host.values()))
    print("  in memory: " + " ".join(f"{k}={v:.2f}" for k, v in found.items()), flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-write-path-", dir=args.dir) as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        ckpt = CheckpointManager(os.path.join(tmp, "ckpt"), keep_last=1)
        for i in range(args.repeat):
            runs.append(one_repeat(ckpt, 2 * i + 1, state, list(host.values()), template, os.path.join(tmp, "raw"),
                                   raw_first=i % 2 == 0))
            print("  run: " + " ".join(f"{k}={v:.3f}" for k, v in runs[-1].items() if k.endswith(("_s", "_raw")))
                  + f" load_matches={runs[-1]['load_matches']}", flush=True)
        dist.destroy_process_group()
    head = summarize(runs)
    cols = [("raw_write", "raw_write_gbps"), ("background", "background_gbps"), ("ratio", "save_vs_raw"),
            ("sync_save", "sync_save_gbps"), ("ratio", "sync_vs_raw"), ("raw_read", "raw_read_gbps"),
            ("load", "load_gbps"), ("ratio", "load_vs_raw"), ("stall_s", "stall_s"), ("verify_s", "verify_s")]
    print(f"GB/s, best of {args.repeat} runs; {head['bytes'] / 1e9:.2f} GB in {head['files']} files")
    print(" ".join(f"{c:>10}" for c, _ in cols))
    print(" ".join(f"{head[k]:>10.2f}" for _, k in cols))
    print(f"median of the runs' own ratios: background {head['median_run_save_vs_raw']:.2f}, "
          f"sync {head['median_run_sync_vs_raw']:.2f}, load {head['median_run_load_vs_raw']:.2f}")
    out = {**head, "state_gb": head["payload_bytes"] / 1e9, "tensors": len(state), "phases": found,
           "repeats": args.repeat, "stat": "best of repeats",
           "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "megatron_core": megatron.core.__version__, "load_avg_1m": os.getloadavg()[0],
                       "dir": args.dir or tempfile.gettempdir(), **_mount_of(args.dir or tempfile.gettempdir())},
           "runs": runs}
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
