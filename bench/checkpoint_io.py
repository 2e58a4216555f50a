"""Checkpoint benchmark of the CPU engine (issue 5): save / load throughput through
CheckpointManager against raw writes of the same bytes to the same storage, and the training
stall of an async save vs a sync save.

    python -m bench.checkpoint_io [--backends local s3 gcs] [--repeat 3] [--dir /tmp]        (repository root)
    python -m bench.checkpoint_io --engine megatron --set model.num_layers=24 ... --out PATH   (GPU)

What runs, per backend (each repeat in this order; the best time of each
measure over the repeats is reported, every run is kept in the JSON):
  raw     the engine's tensors (model + AdamW state + RNG: the bytes of the checkpoint) written
          with plain calls: local `open/write/fsync` (the save path fsyncs too), remote fsspec
          `fs.open(path, "wb").write` from memory; then read back the same way.
  sync    `TorchEngine.save_checkpoint(ckpt, step, dims, rank=0, async_save=False)` followed by
          `ckpt.commit(...)`: what `Trainer.save` blocks training for without async_save.
          save_gbps = checkpoint bytes / that time.
  async   `TorchEngine.save_checkpoint(..., async_save=True)`: the time it blocks is the stall
          (snapshot to host memory); then the futures and commit (async_total_s).
  load    `TorchEngine.load_checkpoint(ckpt, manifest, 0)` (downloads, checks sha256, loads in
          place); `verify_s` is `ckpt.latest_verified()` that a restore runs first.
Local reads are cold: the files' pages are dropped from the page cache (posix_fadvise) first.

Engine: a Llama of ~220M params on the local disk (model + AdamW fp32 = ~2.6 GB); a smaller one
(~120 MB) on S3 and GCS, which are the loopback test servers (moto, gcp-storage-emulator) run in
a child process each: their numbers measure this code plus a Python server on the same 2-CPU
machine, not a cloud. Writes bench/results/checkpoint_cpu.json: the headline keys are the local
disk row; `rows` has every backend.

Megatron engine (GPU, `--engine megatron [--set section.key=value ...]`): one rank on CUDA device
0 (world size 1: a single-rank NCCL group made in this process), `MegatronEngine(cfg)` of the
config's sizes (config defaults + `--set`; see bench/results/gpu/run_checkpoint_1b.sh for the
~1.4B GPT), one train step so the Adam moments exist; local disk only, under --dir. Per repeat:
  raw     `engine.host_state()` (the live training state copied to host memory: model params,
          fp32 main params, exp_avg, exp_avg_sq; `d2h_s`) plus the RNG states, written with the
          plain local writes above (fsync'd), read back cold; then deleted.
  async   a steady train step (`steady_step_s`), then `save_checkpoint(..., async_save=True)`
          (`async_call_s`: the sharded state dicts, planning, queuing the device-to-host copy)
          and at once the next train step (`step_after_save_s`: its update waits for that
          copy); async_stall_s = async_call_s + (step_after_save_s - steady_step_s, if > 0);
          then `PendingSave.result()` + commit (async_total_s, from the call). Run twice: the
          layout's first save (`first_*`: plans made and validated), and after the sync save
          the third (the headline: `SavePlanCache` reuses the plans). The pinned host memory of
          the copy is reserved when the engine joins (`checkpoint.async_save` is set here).
  sync    between the two, `MegatronEngine.save_checkpoint` (torch_dist, written in the call,
          each file hashed as written) + `ckpt.commit`: the stall. The raw write is one stream
          from host memory; `raw_write_incl_d2h_gbps` counts the device-to-host copy too.
          `sharded_state_s`: building the model's and optimizer's sharded state dicts alone.
  load    of the third save's checkpoint: the live state is zeroed, the page cache of the
          checkpoint dropped, `verify_s` is `ckpt.latest_verified()`, then
          `engine.load_checkpoint(ckpt, manifest, 0)` and `torch.cuda.synchronize()`;
          `load_matches`: every state tensor's sum (float64, on the GPU) and the engine step
          equal those at the save call (the step trained after it is not in the checkpoint).
Headline keys of the JSON (both engines, from the local disk row): `async_save_stall_s`,
`save_vs_raw` (checkpoint bytes / (async_total_s - async_stall_s), the background write + hash
+ commit, over the raw write speed), `state_gb` (the raw payload), `device`;
`memory_snapshot_every_step_ratio` is null here (bench/train_speed.py measures it).
Only one copy of the state is on disk at a time: the raw files are deleted before the save, the
previous checkpoint before the next save, outside the timed save (`delete_previous_s`; so the
commit's retention has nothing to delete and the save is timed on free space, as the raw write). The JSON (--out) is rewritten after every repeat
(`complete` false until the last), so a run cut short still leaves its finished repeats.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from bench import write_json
from checkpoint import CheckpointManager
from ftrain.config import Config
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.engines.torch_engine import TorchEngine
from ftrain.testbeds.local_storage import (GCSServer,  # sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT before gcsfs loads
                                           S3Server, free_port)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (vocab, hidden, ffn, layers, heads): params ~ 2*V*H + L*(4*H^2 + 3*H*F); bytes ~ 12 * params
SIZES = {
    "large": (32000, 1024, 2816, 12, 16),   # ~220M params, ~2.6 GB checkpoint
    "small": (16000, 512, 1408, 4, 8),      # ~29M params, ~0.35 GB checkpoint
    "tiny": (8000, 384, 1024, 2, 6),        # ~10M params, ~0.12 GB checkpoint
}
BACKEND_SIZE = {"local": "large", "s3": "tiny", "gcs": "tiny"}
CHUNK = 64 << 20


def build_engine(size: str) -> TorchEngine:
    """A TorchEngine whose AdamW state exists (one step with zero gradients), so the checkpoint
    holds model + exp_avg + exp_avg_sq, as after real training."""
    vocab, hidden, ffn, layers, heads = SIZES[size]
    cfg = Config()
    cfg.model.engine = "torch"
    cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.ffn_hidden_size = vocab, hidden, ffn
    cfg.model.num_layers, cfg.model.num_heads = layers, heads
    engine = TorchEngine(cfg)
    engine._initial_model = None  # only reset() needs it; frees one model copy of memory
    for p in engine.model.parameters():
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    engine.scheduler.step()
    engine.optimizer.zero_grad(set_to_none=True)
    engine.step = 1
    return engine


def state_tensors(engine: TorchEngine) -> dict[str, list[torch.Tensor]]:
    """The tensors each shard of `save_checkpoint` holds (rank 0 of dp: `model` and `rng_rank0`)."""
    out = {"model": [t for t in torch.utils._pytree.tree_leaves(engine._train_state()) if isinstance(t, torch.Tensor)]}
    out["rng_rank0"] = [torch.get_rng_state()]
    return out


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def drop_cache(path: str) -> None:
    """Drop the clean page-cache pages of every file under `path` (so the next read is cold)."""
    for dirpath, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(fs, local: bool, root: str, shards: dict[str, list[torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    for name, tensors in shards.items():
        path = f"{root}/{name}.bin"
        if local:
            with open(path, "wb") as f:
                for t in tensors:
                    f.write(as_bytes(t))
                f.flush()
                os.fsync(f.fileno())
        else:
            with fs.open(path, "wb") as f:
                for t in tensors:
                    f.write(as_bytes(t))
    return time.perf_counter() - t0


def raw_read(fs, local: bool, root: str, shards: dict) -> float:
    if local:
        drop_cache(root)
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    for name in shards:
        path = f"{root}/{name}.bin"
        with (open(path, "rb", buffering=0) if local else fs.open(path, "rb", block_size=CHUNK)) as f:
            if local:
                while f.readinto(buf):
                    pass
            else:
                while f.read(CHUNK):
                    pass
    return time.perf_counter() - t0


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class ServerProcess:
    """One loopback storage server of local_storage.py in a child process (so it does not
    share this process's GIL); `server` is the parent-side handle (uri, storage_options)."""

    def __init__(self, kind: str):
        cls = {"s3": S3Server, "gcs": GCSServer}[kind]
        self.server = cls(port=free_port())
        code = (f"import time; from ftrain.testbeds.local_storage import {cls.__name__} as C; C(port={self.server.port}).start(); "
                "print('ready', flush=True); time.sleep(1e9)")
        # the emulators print a traceback per client that closes a connection early: keep it in a log
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{kind}-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.stop(keep_log=True)
            raise RuntimeError(f"{kind} server did not start; see {self.log.name}")

    def stop(self, keep_log: bool = False) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()
        if not keep_log:
            os.unlink(self.log.name)


def bench_backend(backend: str, uri: str, storage_options: dict | None, repeat: int) -> dict:
    engine = build_engine(BACKEND_SIZE[backend])
    params = sum(p.numel() for p in engine.model.parameters())
    shards = state_tensors(engine)
    ckpt = CheckpointManager(uri, keep_last=1, storage_options=storage_options)
    dims = ParallelDims.from_world(1)
    layout = {"world_size": 1, "tp": 1, "pp": 1, "cp": 1, "dp": 1, "engine": "torch"}
    raw_root = f"{ckpt.root}/raw"
    if ckpt._local:
        os.makedirs(raw_root, exist_ok=True)
    runs = []
    step = 0
    for _ in range(repeat):
        r = {}
        r["raw_write_s"] = raw_write(ckpt.fs, ckpt._local, raw_root, shards)
        r["raw_read_s"] = raw_read(ckpt.fs, ckpt._local, raw_root, shards)
        if not ckpt._local:
            ckpt.fs.rm(raw_root, recursive=True)  # do not keep two copies in the server's memory

        step += 1
        r["delete_previous_s"] = timed(ckpt.clear)[0]  # outside the save, like the raw files'
        gc.collect()
        t0 = time.perf_counter()
        files = engine.save_checkpoint(ckpt, step, dims, 0, async_save=False)
        t1 = time.perf_counter()
        ckpt.commit(step, layout, files)
        r["sync_write_s"], r["commit_s"] = t1 - t0, time.perf_counter() - t1
        r["sync_stall_s"] = r["save_s"] = time.perf_counter() - t0
        r["bytes"] = sum(f.size for f in files)
        r["payload_bytes"] = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts)

        step += 1
        r["delete_previous_s"] += timed(ckpt.clear)[0]
        gc.collect()
        t0 = time.perf_counter()
        futures = engine.save_checkpoint(ckpt, step, dims, 0, async_save=True)
        r["async_stall_s"] = time.perf_counter() - t0
        files = [f for fut in futures for f in fut.result()]
        manifest = ckpt.commit(step, layout, files)
        r["async_total_s"] = time.perf_counter() - t0

        if ckpt._local:
            drop_cache(ckpt._step_path(step))
        r["verify_s"], found = timed(ckpt.latest_verified)
        assert found is not None and found.step == step, found
        if ckpt._local:
            drop_cache(ckpt._step_path(step))
        r["load_s"], _ = timed(lambda: engine.load_checkpoint(ckpt, manifest, 0))
        assert engine.step == 1
        runs.append(r)
        print(f"  {backend} run: " + " ".join(f"{k}={v:.3f}" for k, v in r.items() if k.endswith("_s")), flush=True)
    if ckpt._local:
        shutil.rmtree(raw_root, ignore_errors=True)
    del engine, shards
    gc.collect()
    return {"params": params, **summarize(backend, BACKEND_SIZE[backend], runs)}


def summarize(backend: str, size: str, runs: list[dict]) -> dict:
    """One backend's row: the best (least) time of each measure over the repeats (on a shared,
    loaded machine the least disturbed run is the best estimate of what the code costs) and the
    throughputs and ratios from them; every run stays in `runs`."""
    med = {k: min(r[k] for r in runs) for k, v in runs[0].items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    gb = med["bytes"] / 1e9
    row = {
        "backend": backend, "size": size, "bytes": int(med["bytes"]),
        "payload_bytes": int(med["payload_bytes"]), "repeats": len(runs), "stat": "best of repeats",
        "save_gbps": gb / med["save_s"], "raw_write_gbps": med["payload_bytes"] / 1e9 / med["raw_write_s"],
        "load_gbps": gb / med["load_s"], "raw_read_gbps": med["payload_bytes"] / 1e9 / med["raw_read_s"],
        **{k: v for k, v in med.items() if k.endswith("_s")},
        "run_save_ratios": [(r["bytes"] / r["save_s"]) / (r["payload_bytes"] / r["raw_write_s"]) for r in runs],
        "runs": runs,
    }
    row["save_ratio"] = row["save_gbps"] / row["raw_write_gbps"]
    row["load_ratio"] = row["load_gbps"] / row["raw_read_gbps"]
    return row


def _mount_of(path: str) -> dict:
    """File system type and device of the mount holding `path` (from /proc/self/mounts)."""
    path, best = os.path.realpath(path), {"dir_mount": None, "dir_fs_type": None, "dir_device": None}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and \
                        len(mnt) >= len(best["dir_mount"] or ""):
                    best = {"dir_mount": mnt, "dir_fs_type": fstype, "dir_device": dev}
    except OSError:
        pass
    return best


def bench_megatron(args, tmp: str, report) -> dict:
    """The Megatron engine on CUDA device 0, world size 1, checkpoints on the local disk under
    `tmp` (see the module docstring). Calls `report(row, info)` after every repeat; returns info
    (device, params, config, build times)."""
    import socket

    import torch.distributed as dist

    from ftrain.config import load_config, resolve
    from ftrain.data.training_batch import synthetic_batch
    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.state.host_memory import state_tensors

    cfg = resolve(load_config(args.config, ["model.engine=megatron", "cluster.num_workers=1", "cluster.num_spares=0",
                                            "checkpoint.async_save=true", *args.overrides]))
    dims, t, m = ParallelDims.from_config(cfg), cfg.train, cfg.model
    if dims.world_size != 1:
        raise SystemExit(f"--engine megatron runs one rank; got world size {dims.world_size}")
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    t0 = time.perf_counter()
    engine = MegatronEngine(cfg)
    connect_phases = engine.connect(dist.PrefixStore("gen1", store), dims, 0)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics = engine.train_step(synthetic_batch(t.seed, 1, t.global_batch_size, t.seq_len, m.vocab_size), 1)
    torch.cuda.synchronize()
    info = {"device": torch.cuda.get_device_name(0), "engine": "megatron",
            "params": sum(p.numel() for p in engine.model.parameters()),
            "build_s": build_s, "connect_phases": connect_phases,
            "train_step_s": time.perf_counter() - t0, "train_step_loss": metrics["loss"],
            "model": dataclasses.asdict(m), "distributed_optimizer": m.distributed_optimizer,
            "train": {k: getattr(t, k) for k in ("seq_len", "global_batch_size", "mini_batch_size",
                                                 "micro_batch_size", "lr", "seed")}}
    print(f"  megatron: {info['params'] / 1e9:.3f}B params on {info['device']}, build {build_s:.1f} s, "
          f"train step {info['train_step_s']:.1f} s (loss {metrics['loss']:.4f})", flush=True)

    def async_save(step: int) -> tuple:
        """An async save of checkpoint `step` with the next train step trained at once, committed:
        (fingerprint and engine step at the call, {steady_step_s, async_call_s, step_after_save_s,
        async_stall_s, async_total_s}, files, manifest). The training stall is the call plus what
        the next step takes over a steady one (its update waits for the save's device-to-host copy)."""
        deleted_s = timed(ckpt.clear)[0]  # the previous checkpoint, outside the timing (as the raw files)
        steady = train_step()
        gc.collect()
        torch.cuda.synchronize()
        saved, saved_step = fingerprint(), engine.step
        t0 = time.perf_counter()
        pending = engine.save_checkpoint(ckpt, step, dims, 0, async_save=True)
        call = time.perf_counter() - t0
        after = train_step()
        files = [f for p in pending for f in p.result()]
        manifest = ckpt.commit(step, layout, files)
        times = {"steady_step_s": steady, "async_call_s": call, "step_after_save_s": after,
                 "async_stall_s": call + max(0.0, after - steady), "async_total_s": time.perf_counter() - t0,
                 "delete_previous_s": deleted_s}
        return saved, saved_step, times, files, manifest

    def train_step() -> float:  # seconds of one synchronized train step on the bench's batch
        t0 = time.perf_counter()
        engine.train_step(synthetic_batch(t.seed, engine.step + 1, t.global_batch_size, t.seq_len, m.vocab_size),
                          engine.step + 1)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def fingerprint() -> torch.Tensor:  # per state tensor: its sum in float64, on the GPU
        return torch.stack([x.detach().to(engine.device).double().sum() for x in state_tensors(engine._train_state())])

    mnt = _mount_of(tmp)
    print(f"  checkpoints under {tmp}: {mnt['dir_fs_type']} {mnt['dir_device']} on {mnt['dir_mount']}, "
          f"{shutil.disk_usage(tmp).free / 1e9:.1f} GB free", flush=True)
    if mnt["dir_fs_type"] in ("tmpfs", "ramfs"):
        print(f"  WARNING: {tmp} is in memory ({mnt['dir_fs_type']}), not a disk: pass --dir on a disk", flush=True)
    ckpt = CheckpointManager(os.path.join(tmp, f"bench-{uuid.uuid4().hex[:8]}"), keep_last=1)
    layout = {"world_size": 1, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "dp": dims.dp, "engine": "megatron"}
    raw_root = f"{ckpt.root}/raw"
    runs, step = [], 0
    for _ in range(args.repeat):
        r = {}
        os.makedirs(raw_root, exist_ok=True)
        gc.collect()
        r["d2h_s"], host = timed(engine.host_state)
        shards = {"model": state_tensors(host), "rng_rank0": [torch.get_rng_state(), torch.cuda.get_rng_state()]}
        r["payload_bytes"] = sum(x.numel() * x.element_size() for ts in shards.values() for x in ts)
        free = shutil.disk_usage(raw_root).free
        if free < 1.1 * r["payload_bytes"]:
            raise SystemExit(f"{raw_root}: {free / 1e9:.1f} GB free, the state is {r['payload_bytes'] / 1e9:.1f} GB")
        r["raw_write_s"] = raw_write(None, True, raw_root, shards)
        r["raw_read_s"] = raw_read(None, True, raw_root, shards)
        del host, shards
        shutil.rmtree(raw_root)
        ckpt.clear()  # one copy of the state on disk at a time
        step += 1
        r["sharded_state_s"], _ = timed(lambda: engine._sharded_state(False, True))
        _, _, first, _, _ = async_save(step)  # the layout's first save: plans made and validated
        r.update({f"first_{k}": v for k, v in first.items()})

        step += 1
        r["sync_delete_previous_s"] = timed(ckpt.clear)[0]
        gc.collect()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        files = engine.save_checkpoint(ckpt, step, dims, 0)
        t1 = time.perf_counter()
        ckpt.commit(step, layout, files)
        r["sync_write_s"], r["commit_s"] = t1 - t0, time.perf_counter() - t1
        r["sync_stall_s"] = r["save_s"] = time.perf_counter() - t0

        step += 1  # the steady-state async save: the layout's third save reuses the cached plans
        async_saved, async_step, steady, async_files, manifest = async_save(step)
        r.update(steady)
        r["bytes"], r["files"] = sum(f.size for f in async_files), len(async_files)

        # load: that async checkpoint, cold, into a zeroed state; it holds the state of the call
        for x in state_tensors(engine._train_state()):  # so that the load has to restore every tensor
            x.zero_()
        engine.step = 0
        drop_cache(ckpt._step_path(step))
        r["verify_s"], found = timed(ckpt.latest_verified)
        if found is None or found.step != step:
            raise RuntimeError(f"checkpoint step {step} does not verify: latest_verified() = {found}")
        drop_cache(ckpt._step_path(step))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.load_checkpoint(ckpt, manifest, 0)
        torch.cuda.synchronize()
        r["load_s"] = time.perf_counter() - t0
        r["load_matches"] = bool(torch.equal(async_saved, fingerprint())) and engine.step == async_step
        r["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        runs.append(r)
        print("  megatron local run: " + " ".join(f"{k}={v:.3f}" for k, v in r.items() if k.endswith("_s"))
              + f" GB={r['bytes'] / 1e9:.2f} load_matches={r['load_matches']}", flush=True)
        if not r["load_matches"]:
            print("  WARNING: the loaded state differs from the saved one", flush=True)
        row = summarize("local", f"megatron {info['params'] / 1e9:.2f}B params", runs)
        row.update(load_matches=all(x["load_matches"] for x in runs),
                   raw_write_incl_d2h_gbps=max(x["payload_bytes"] / (x["d2h_s"] + x["raw_write_s"]) for x in runs) / 1e9)
        report(row, info)
    shutil.rmtree(ckpt.root, ignore_errors=True)
    dist.destroy_process_group()
    return info


def write_out(args, rows: list[dict], info: dict, complete: bool) -> dict:
    """The JSON of --out: the headline keys from the local disk row, then everything."""
    head = next((r for r in rows if r["backend"] == "local"), rows[0])
    out = {k: head[k] for k in ("save_gbps", "raw_write_gbps", "save_ratio", "load_gbps", "raw_read_gbps",
                                "load_ratio", "async_stall_s", "sync_stall_s", "async_total_s", "bytes")}
    # The issue-24 headline keys: the async save's stall, its background part (write, hash,
    # commit) against the raw write of the same bytes, the state size; memory snapshots are
    # measured by bench/train_speed.py (null here).
    background_s = head["async_total_s"] - head["async_stall_s"]
    out.update(async_save_stall_s=head["async_stall_s"],
               save_vs_raw=head["bytes"] / 1e9 / background_s / head["raw_write_gbps"] if background_s > 0 else None,
               state_gb=head["payload_bytes"] / 1e9, memory_snapshot_every_step_ratio=None)
    out["headline_backend"] = head["backend"]
    out["device"], out["engine"], out["params"] = info["device"], info["engine"], info["params"]
    out["complete"] = complete
    out["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0]}
    if info["engine"] == "megatron":
        import megatron.core

        machine.update(cuda=torch.version.cuda, megatron_core=getattr(megatron.core, "__version__", None),
                       gpu_peak_allocated_gb=torch.cuda.max_memory_allocated() / 1e9,
                       dir=args.dir or tempfile.gettempdir(), **_mount_of(args.dir or tempfile.gettempdir()),
                       note="one GPU, world size 1; local disk under dir")
    else:
        machine["note"] = "shared machine; S3/GCS are loopback Python servers (moto, gcp-storage-emulator)"
    out["machine"] = machine
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    out.update({k: v for k, v in info.items() if k not in out})
    out["rows"] = rows
    write_json(args.out, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="torch", choices=["torch", "megatron"],
                    help="torch: the CPU engine (default); megatron: the GPU engine on CUDA device 0, local disk only")
    ap.add_argument("--backends", nargs="+", default=None, choices=["local", "s3", "gcs"],
                    help="default: local s3 gcs (torch), local (megatron)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per backend; the best time of each measure is reported")
    ap.add_argument("--dir", default=None, help="parent of the local checkpoint directory (default: TMPDIR)")
    ap.add_argument("--local-size", default="large", choices=sorted(SIZES), help="torch engine only")
    ap.add_argument("--remote-size", default="tiny", choices=sorted(SIZES), help="torch engine only")
    ap.add_argument("--config", default=None, help="megatron: YAML config (default: the built-in defaults)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="megatron: config override (repeatable), e.g. --set model.num_layers=24")
    ap.add_argument("--out", default=None, help="JSON output (default: bench/results/checkpoint_cpu.json "
                                                "for the torch engine; required for megatron)")
    args = ap.parse_args()
    if args.engine == "torch":
        if args.overrides or args.config:
            ap.error("--set / --config apply to --engine megatron (the torch engine uses --local-size / --remote-size)")
        args.backends = args.backends or ["local", "s3", "gcs"]
        args.out = args.out or os.path.join(ROOT, "bench", "results", "checkpoint_cpu.json")
    else:
        if (args.backends or ["local"]) != ["local"]:
            ap.error("--engine megatron measures the local disk only (--backends local)")
        if not args.out:
            ap.error("--engine megatron needs --out (e.g. bench/results/gpu/checkpoint_megatron_<...>.json)")
        args.backends = ["local"]
    BACKEND_SIZE.update(local=args.local_size, s3=args.remote_size, gcs=args.remote_size)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=args.dir) as tmp:
        if args.engine == "megatron":
            def report(row, info):
                rows[:] = [row]
                write_out(args, rows, info, complete=len(row["runs"]) == args.repeat)

            info = bench_megatron(args, tmp, report)
        else:
            info = {"device": "cpu", "engine": "torch", "params": None}
            for backend in args.backends:
                prefix = f"bench-{uuid.uuid4().hex[:8]}"
                if backend == "local":
                    rows.append(bench_backend(backend, os.path.join(tmp, prefix), None, args.repeat))
                    continue
                srv = ServerProcess(backend)
                opts = dict(srv.server.storage_options)
                if backend == "s3":  # the tests' 10 s read timeout is for fast outage detection; a 50 MB
                    # part to a busy moto can take longer, and s3fs's re-sent part then breaks moto's upload
                    opts["config_kwargs"] = {**opts["config_kwargs"], "read_timeout": 300}
                try:
                    rows.append(bench_backend(backend, srv.server.uri(prefix), opts, args.repeat))
                finally:
                    srv.stop()
            info["params"] = next((r for r in rows if r["backend"] == "local"), rows[0])["params"]

    cols = [("backend", "backend", "s"), ("GB", "bytes", "gb"), ("raw_write", "raw_write_gbps", ".2f"),
            ("save", "save_gbps", ".2f"), ("ratio", "save_ratio", ".2f"), ("raw_read", "raw_read_gbps", ".2f"),
            ("load", "load_gbps", ".2f"), ("sync_stall", "sync_stall_s", ".2f"),
            ("async_stall", "async_stall_s", ".2f"), ("async_total", "async_total_s", ".2f"),
            ("verify", "verify_s", ".2f")]
    print("throughput in GB/s, times in s (best of %d runs)" % args.repeat)
    print(" ".join(f"{c[0]:>11}" for c in cols))
    for r in rows:
        cells = ["-" if r[k] is None else f"{r[k] / 1e9:.2f}" if f == "gb" else format(r[k], f) for _, k, f in cols]
        print(" ".join(f"{c:>11}" for c in cells))

    out = write_out(args, rows, info, complete=True)
    print(f"async save: stall {out['async_save_stall_s']:.2f} s, background write "
          f"{out['save_vs_raw'] or float('nan'):.2f}x the raw write speed, state {out['state_gb']:.2f} GB")
    print(f"wrote {args.out} (peak RSS {out['peak_rss_gb']:.1f} GB)")


if __name__ == "__main__":
    main()
