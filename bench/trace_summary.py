"""Summarise a torch.profiler chrome trace: per CUDA stream busy time, the compute stream's idle
gaps, memcpys by stream and kind, and the longest CUDA runtime calls (host waits) per thread.
Usage: python -m bench.trace_summary TRACE.json [...]"""
import collections
import gzip
import json
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summary(path):
    ev = [e for e in load(path) if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print(path, "no GPU events")
        return
    t0, t1 = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    print(f"== {path}: GPU window {(t1 - t0) / 1e3:.1f} ms")
    by_stream = collections.defaultdict(list)
    for e in gpu:
        by_stream[e["args"].get("stream")].append(e)
    compute = max(by_stream, key=lambda s: sum(e["cat"] == "kernel" for e in by_stream[s]))
    for s, es in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        busy = union([(e["ts"], e["ts"] + e["dur"]) for e in es])
        kinds = collections.Counter()
        durs = collections.Counter()
        for e in es:
            k = e["name"] if e["cat"] != "kernel" else "kernel"
            kinds[k] += 1
            durs[k] += e["dur"]
        print(f"  stream {s}{' (compute)' if s == compute else ''}: {len(es)} events, busy {busy / 1e3:.1f} ms; "
              + ", ".join(f"{k[:40]} x{kinds[k]} {durs[k] / 1e3:.1f} ms" for k in kinds))
    es = sorted(by_stream[compute], key=lambda e: e["ts"])
    gaps, end = [], es[0]["ts"]
    for e in es:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e["name"]))
        end = max(end, e["ts"] + e["dur"])
    gaps.sort(reverse=True)
    print(f"  compute stream idle {sum(g[0] for g in gaps) / 1e3:.1f} ms in {len(gaps)} gaps; largest:")
    for g, at, name in gaps[:8]:
        print(f"    {g / 1e3:8.2f} ms at +{(at - t0) / 1e3:8.1f} ms before {name[:70]}")
    long_copies = sorted((e for e in by_stream[compute] if e["cat"] == "gpu_memcpy"), key=lambda e: -e["dur"])[:5]
    for e in long_copies:
        print(f"    compute-stream copy {e['name'][:30]} {e['dur'] / 1e3:.2f} ms at +{(e['ts'] - t0) / 1e3:.1f} ms, "
              f"{e['args'].get('bytes', '?')} bytes")
    rt = [e for e in ev if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    per_thread = collections.defaultdict(list)
    for e in rt:
        per_thread[e.get("tid")].append(e)
    for tid, es in per_thread.items():
        tot = collections.Counter()
        for e in es:
            tot[e["name"]] += e["dur"]
        top = tot.most_common(4)
        print(f"  thread {tid}: {len(es)} runtime calls; " + ", ".join(f"{n} {d / 1e3:.1f} ms" for n, d in top))
        for e in sorted(es, key=lambda e: -e["dur"])[:3]:
            print(f"      longest {e['name']} {e['dur'] / 1e3:.2f} ms at +{(e['ts'] - t0) / 1e3:.1f} ms")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summary(p)
