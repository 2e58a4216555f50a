"""Checkpoint throughput: save / async-save stall / commit / verify / load of one shard, per backend.

    .venv/bin/python bench/checkpoint.py [--mb 64 256] [--backends local s3 gcs] [--repeat 2]

S3 and GCS are the loopback test servers (moto, gcp-storage-emulator), so their numbers measure
this code plus an in-process Python server, not a cloud. Prints a table (seconds, MB/s) and
writes bench/results/checkpoint.json.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from checkpoint import CheckpointManager  # noqa: E402
from storage_servers import GCSServer, S3Server  # noqa: E402


def state_of(mb: int) -> dict:
    """~mb MB of fp32/bf16 tensors in a few layers, plus python objects."""
    n = mb * (1 << 20) // 4 // 8
    return {
        "layers": {f"l{i}": {"w": torch.randn(n), "b": torch.randn(n // 2).bfloat16()} for i in range(6)},
        "opt": {"step": 10, "lr": 1e-4},
        "rng": torch.get_rng_state(),
    }


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_one(m: CheckpointManager, mb: int, step: int) -> dict:
    state = state_of(mb)
    nbytes = sum(t.numel() * t.element_size() for d in state["layers"].values() for t in d.values())
    t_save, files = timed(lambda: m.save_shard(step, "model", state))
    t_stall, fut = timed(lambda: m.async_save_shard(step + 1, "model", state))
    t_async_total = t_stall + timed(fut.result)[0]
    t_commit, manifest = timed(lambda: m.commit(step, {"tp": 1}, files))
    t_verify, problems = timed(lambda: m.verify(step))
    assert not problems, problems
    target = state_of(mb)
    t_load, _ = timed(lambda: m.load_shard(step, "model", target, manifest))
    mbytes = nbytes / 1e6
    return {
        "mb": round(mbytes, 1), "save_s": t_save, "async_stall_s": t_stall, "async_total_s": t_async_total,
        "commit_s": t_commit, "verify_s": t_verify, "load_s": t_load,
        "save_MBps": mbytes / t_save, "load_MBps": mbytes / t_load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--backends", nargs="+", default=["local", "s3", "gcs"])
    ap.add_argument("--repeat", type=int, default=2, help="runs per cell; the best is reported")
    args = ap.parse_args()
    servers = {"s3": S3Server, "gcs": GCSServer}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            server = servers[backend]().start() if backend in servers else None
            prefix = f"bench-{uuid.uuid4().hex[:8]}"
            uri = server.uri(prefix) if server else os.path.join(tmp, prefix)
            m = CheckpointManager(uri, keep_last=1, storage_options=server.storage_options if server else None)
            step = 0
            for mb in args.mb:
                runs = []
                for _ in range(args.repeat):
                    step += 2
                    runs.append(bench_one(m, mb, step))
                best = min(runs, key=lambda r: r["save_s"] + r["load_s"])
                rows.append({"backend": backend, **best})
            if server:
                server.stop()
    cols = ["backend", "mb", "save_s", "async_stall_s", "async_total_s", "commit_s", "verify_s", "load_s", "save_MBps", "load_MBps"]
    print(" ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>13.3f}" if isinstance(r[c], float) else f"{r[c]:>13}" for c in cols))
    out = os.path.join(ROOT, "bench", "results", "checkpoint.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
