"""In-memory snapshot sends on CPU: a rank's `SnapshotSender` to a `SnapshotHolder` on the same
node (local Ray), against the previous holder that kept zero-copy views of Ray's buffers, in the
same run.

    python -m bench.snapshot_send [--gb 0.25 1.0] [--sends 6] [--object-store-gb 1.5] [--out PATH]

The state: fp32 tensors of 64 MB each (a sharded model + optimizer state is many such), --gb GB
in all, one state per size in --gb, sent --sends times in a row (step 1, 2, ...) under one
(layout, rank) key, as a completed host copy (no device copy). Per send: the seconds from
`send` until the sender is no longer `busy()` (every part put and acknowledged by the holder)
and the state's GB/s over them. Modes, each with a fresh holder (keep=2), in this order:
  zero_copy  the reference: the previous holder, which keeps zero-copy numpy views of the parts
             (so Ray's object store pins every snapshot it keeps).
  copy       `SnapshotHolder` (copies each part into memory it owns, reuses the buffers of the
             snapshot it drops).
After the sends: `pinned_mib`, the object-store memory that references pin (Ray's memory
summary, "Pinned": the holder's zero-copy views), and whether the holder holds the last two
steps; `fallback_allocations`, how many times the raylet logged that the full store fell back
to disk-backed allocations.
With the reference, keep + 1 snapshots pinned in the store fill it once 3 x --gb is over
--object-store-gb (Ray's default: 30 % of RAM); a first touch of fresh memory costs too, so the
steady state is the sends after the first three. Writes bench/results/snapshot_send_cpu.json
(--out); the table goes to stdout.
"""
from __future__ import annotations

import argparse
import glob
import os
import platform
import re
import statistics
import time

import ray
import torch

from bench import write_json
from ftrain.config import FaultToleranceConfig
from ftrain.state.host_memory import HostCopy
from ftrain.state.snapshots import SnapshotHolder, SnapshotSender, join_parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSOR_BYTES = 64 << 20


@ray.remote(num_cpus=0)
class ZeroCopyHolder:
    """The reference: `SnapshotHolder`'s previous logic, keeping the parts as Ray delivered them
    (zero-copy views of its object store) for the newest `keep` complete steps."""

    def __init__(self, keep: int = 2):
        self.keep, self.snaps, self._partial = keep, {}, {}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def put_part(self, key, step, index, count, meta, part) -> None:
        got = self._partial.setdefault((key, step), {})
        got[index] = (meta, part)
        if len(got) < count:
            return
        del self._partial[(key, step)]
        steps = self.snaps.setdefault(key, {})
        steps[step] = join_parts(got[0][0], [got[i][1] for i in range(count)])
        for old in sorted(steps)[:-self.keep]:
            del steps[old]

    def steps(self) -> dict:
        return {k: sorted(v) for k, v in self.snaps.items()}


def pinned_mib() -> float:
    """MiB of objects pinned in the object store by a worker's references (Ray's memory
    summary, the "Pinned" column: e.g. a holder's zero-copy views), summed over the nodes."""
    from ray._private.internal_api import memory_summary

    summary = memory_summary(ray.get_runtime_context().gcs_address, units="MB")
    found = re.findall(r"\n\S+ MB\s+\d+, \([\d.]+ MB\)\s+\d+, \(([\d.]+) MB\)", summary)
    return sum(float(x) for x in found) * 1e6 / 2**20


def settled_pinned_mib(timeout_s: float = 10.0) -> float:
    """`pinned_mib` once two readings 0.5 s apart agree (references are released asynchronously)."""
    last, deadline = pinned_mib(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = pinned_mib()
        if now == last:
            break
        last = now
    return last


def fallback_allocations() -> int:
    """Times this Ray session's raylet fell back to disk-backed allocations (store full)."""
    session = ray._private.worker.global_worker.node.get_session_dir_path()
    return sum(open(p, errors="replace").read().count("falling back to allocating from filesystem")
               for p in glob.glob(os.path.join(session, "logs", "raylet*.out")))


def run_mode(mode: str, state: dict, sends: int) -> dict:
    """`sends` consecutive sends of `state` through a SnapshotSender to a fresh holder of `mode`."""
    holder = (ZeroCopyHolder if mode == "zero_copy" else SnapshotHolder).remote(keep=2)
    ray.get(holder.node_id.remote())  # the connection, outside the timing (as `connect` does)
    sender = SnapshotSender(FaultToleranceConfig.health_timeout_s)
    gb = sum(t.numel() * t.element_size() for t in state["model"]) / 1e9
    fallback0, times = fallback_allocations(), []
    for step in range(1, sends + 1):
        t0 = time.perf_counter()
        sender.send(holder, ("layout", 0), step, HostCopy({**state, "step": step}, lambda: None))
        while sender.busy():
            time.sleep(0.001)
        times.append(time.perf_counter() - t0)
    held = ray.get(holder.steps.remote()).get(("layout", 0))
    out = {"send_s": times, "gbps": [gb / t for t in times], "counts": sender.counts(),
           "pinned_mib": settled_pinned_mib(), "fallback_allocations": fallback_allocations() - fallback0,
           "holds_last_two": held == [sends - 1, sends]}
    ray.kill(holder)
    settled_pinned_mib()  # the killed holder's pins released before the next mode
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, nargs="+", default=[0.25, 1.0], help="state sizes, GB")
    ap.add_argument("--sends", type=int, default=6)
    ap.add_argument("--object-store-gb", type=float, default=1.5, help="0: Ray's default (30%% of RAM)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "snapshot_send_cpu.json"))
    args = ap.parse_args()
    store = int(args.object_store_gb * 1e9) or None
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=store, log_to_driver=False)
    store_gb = ray.cluster_resources()["object_store_memory"] / 1e9
    print(f"object store {store_gb:.2f} GB", flush=True)
    results = []
    for gb in args.gb:
        n = max(1, round(gb * 1e9 / TENSOR_BYTES))
        state = {"model": [torch.rand(TENSOR_BYTES // 4) for _ in range(n)]}
        for mode in ("zero_copy", "copy"):
            r = {"state_gb": n * TENSOR_BYTES / 1e9, "mode": mode, **run_mode(mode, state, args.sends)}
            r["steady_gbps"] = statistics.median(r["gbps"][3:]) if len(r["gbps"]) > 3 else None
            results.append(r)
            print(f"{r['state_gb']:6.2f} GB {mode:>9}: GB/s " + " ".join(f"{x:5.2f}" for x in r["gbps"])
                  + f" | pinned {r['pinned_mib']:.0f} MiB, fallbacks {r['fallback_allocations']}, "
                  f"holds last two {r['holds_last_two']}", flush=True)
        del state
    print(f"\n{'state GB':>8} {'mode':>9} {'first 3 GB/s':>18} {'steady GB/s':>11} {'pinned MiB':>10}")
    for r in results:
        steady = f"{r['steady_gbps']:.2f}" if r["steady_gbps"] is not None else "-"
        print(f"{r['state_gb']:8.2f} {r['mode']:>9} {' '.join(f'{x:.2f}' for x in r['gbps'][:3]):>18} "
              f"{steady:>11} {r['pinned_mib']:10.0f}")
    out = {"object_store_gb": store_gb, "sends": args.sends, "tensor_bytes": TENSOR_BYTES,
           "stat": "steady_gbps: median GB/s of the sends after the first three", "results": results,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "ray": ray.__version__,
                       "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0]}}
    ray.shutdown()
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
