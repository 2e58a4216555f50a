"""Does a side-stream device-to-host copy slow a host-bound training loop, and does it depend on
the number of copies or on the bytes? One GPU: a loop of small kernels (launch-bound, as the
1.36B step at micro-batch 2 partly is) and a loop of large matmuls (device-bound), each timed
alone and with a concurrent copy of the same bytes (--gb) into registered host memory
(host_memory.pinned_empty, as the keeper's arenas) split into 1,000 (slices, or -1000: buffers of their own as `carve` makes) / 100 / 1 copies, queued by
another thread on a side stream (as `_host_copy_async`). Prints a table; JSON to --out.
Usage: python -m bench.copy_contention [--gb 4.8] [--reps 5] [--out PATH]"""
import argparse
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench import write_json  # noqa: E402
from ftrain.state.host_memory import pinned_empty  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/copy_contention.json")
    args = ap.parse_args(argv)
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = pinned_empty(nbytes)
    side = torch.cuda.Stream()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    small = torch.zeros(1 << 16, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def launch_bound():
        for _ in range(20000):
            small.add_(1.0)

    def device_bound():
        for _ in range(40):
            torch.mm(a, a)
            for _ in range(50):
                small.add_(1.0)

    def copies(n):
        if n == 0:
            return None
        own, n = n < 0, abs(n)  # negative: buffers with storages of their own (`carve`'s frombuffer)
        per = nbytes // n // 64 * 64
        mem = host.numpy()
        dsts = [torch.frombuffer(mem, dtype=torch.uint8, count=per, offset=i * per) if own else
                host[i * per:(i + 1) * per] for i in range(n)]
        srcs = [src[i * per:(i + 1) * per] for i in range(n)]
        ready = torch.cuda.Event()
        ready.record()

        def launch():
            with torch.cuda.stream(side):
                side.wait_event(ready)
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
        return pool.submit(launch)

    results = {}
    for work_name, work in (("launch_bound", launch_bound), ("device_bound", device_bound)):
        for n in (0, 1000, -1000, 100, 1):
            times = []
            for _ in range(args.reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                f = copies(n)
                work()
                torch.cuda.current_stream().synchronize()
                t1 = time.perf_counter()
                if f is not None:
                    f.result()
                torch.cuda.synchronize()
                times.append(t1 - t0)
            results[f"{work_name}:{n}"] = statistics.median(times[1:])
            print(f"{work_name:>13} copies {n:5d}: {results[f'{work_name}:{n}']:.4f} s "
                  f"({results[f'{work_name}:{n}'] / results[f'{work_name}:0']:.3f}x)", flush=True)
    t0 = time.perf_counter()
    copies(1).result()
    side.synchronize()
    print(f"copy alone ({args.gb} GB, 1 copy): {time.perf_counter() - t0:.4f} s")
    write_json(args.out, {"device": torch.cuda.get_device_name(0), "gb": args.gb, "median_s": results})


if __name__ == "__main__":
    main()
