"""GPU bench: does `fault_tolerance.nccl_split_share` (NCCL_COMM_SPLIT_SHARE_RESOURCES=1: the
communicators split from the default one share its NCCL resources) slow collectives that
overlap? Needs 2 GPUs and torch with NCCL; no Ray.

For each setting (off, on) two fresh processes (one per GPU) make the default NCCL group
(eagerly, on their device) and two groups split from it over both ranks, as Megatron's DP and
TP groups of a dp x tp layout are. Timed (CUDA events, median of --repeats after 3 warm-ups):
a large all-reduce on the DP group alone (gradient reduction), a train of small all-reduces on
the TP group alone (activations), and both at once from two CUDA streams. `overlap` =
(dp_alone + tp_alone) / both: 2.0 when the two hide each other entirely, 1.0 when they
serialise. Prints a table and writes --out: {"device", "rows": [{"split_share", "dp_alone_ms",
"tp_alone_ms", "both_ms", "overlap"}]}.
Usage (repository root): python3 -m bench.split_share_overlap [--dp-mib 256] [--tp-mib 4]
    [--tp-count 32] [--repeats 10] [--out bench/results/gpu/split_share_overlap_KIND_DATE.json]
"""
import argparse
import datetime
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ftrain.testbeds.local_storage import free_port


def _timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` runs (after 3 warm-ups), by CUDA events."""
    times = []
    for i in range(3 + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rank(rank: int, port: int, split_share: bool, args, queue) -> None:
    os.environ["NCCL_COMM_SPLIT_SHARE_RESOURCES"] = "1" if split_share else "0"
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    dp, tp = dist.new_group([0, 1]), dist.new_group([0, 1])  # split from the default communicator
    grads = torch.ones(args.dp_mib << 18, device="cuda")     # float32: MiB * 2**18 elements
    acts = [torch.ones(args.tp_mib << 18, device="cuda") for _ in range(args.tp_count)]
    side = torch.cuda.Stream()

    def dp_reduce():
        dist.all_reduce(grads, group=dp)

    def tp_reduces():
        for a in acts:
            dist.all_reduce(a, group=tp)

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dp_reduce()
        tp_reduces()
        torch.cuda.current_stream().wait_stream(side)

    row = {"split_share": split_share, "dp_alone_ms": _timed(dp_reduce, args.repeats),
           "tp_alone_ms": _timed(tp_reduces, args.repeats), "both_ms": _timed(both, args.repeats)}
    row["overlap"] = (row["dp_alone_ms"] + row["tp_alone_ms"]) / row["both_ms"]
    dist.destroy_process_group()
    if rank == 0:
        queue.put(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp-mib", type=int, default=256, help="size of the DP all-reduce (MiB)")
    parser.add_argument("--tp-mib", type=int, default=4, help="size of each TP all-reduce (MiB)")
    parser.add_argument("--tp-count", type=int, default=32, help="TP all-reduces per measurement")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench.split_share_overlap needs 2 CUDA GPUs")
    ctx = mp.get_context("spawn")
    rows = []
    for split_share in (False, True):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, split_share, args, queue)) for r in (0, 1)]
        for p in procs:
            p.start()
        rows.append(queue.get(timeout=300))
        for p in procs:
            p.join(timeout=60)
    print(f"{'split_share':>11} {'dp_alone_ms':>11} {'tp_alone_ms':>11} {'both_ms':>8} {'overlap':>7}")
    for r in rows:
        print(f"{str(r['split_share']):>11} {r['dp_alone_ms']:>11.2f} {r['tp_alone_ms']:>11.2f} "
              f"{r['both_ms']:>8.2f} {r['overlap']:>7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": f"2 x {torch.cuda.get_device_name(0)}", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
