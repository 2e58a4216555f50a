"""GPU probe: how long does aborting a survivor's NCCL communicators take, when its compute thread
is stuck on a killed peer, depending on how it waits (device sync as Megatron's p2p code does,
or a stream sync) and on how the abort is issued. Needs 2 GPUs, Ray and torch with NCCL.

Each case: two Ray actors (one per GPU) form a process group from a driver-hosted TCPStore,
make `extra_groups` more groups over both ranks (Megatron makes ~15) and exchange once on each
(communicators connected); rank 0 then blocks on rank 1 (a 64 MiB p2p send in the last extra
group, or an all-reduce), rank 1 is killed, and rank 0's `abort` is called through its control
concurrency group. Prints a table and writes --out (committed: bench/results/gpu/abort_probe_nvidia-h200-x2_2026-11-29.json):
[{"case", "wait", "abort", "extra_groups", "first_s" (busy group aborted), "abort_s" (all
aborted; null: not within the timeout), "freed" (stuck call returned, s after the abort call),
"init_s" (init_process_group), "groups_s" (the extra groups made: ncclCommSplit of the default's)}].
--split-share sets NCCL_COMM_SPLIT_SHARE_RESOURCES=1 (the groups share the default group's
NCCL resources); --cases picks rows of CASES by index.
Usage (repository root): python3 -m bench.abort_probe [--timeout S] [--split-share] [--cases 4,5] [--out PATH]
"""
import argparse
import datetime
import json
import os
import socket
import threading
import time

import ray
import torch
import torch.distributed as dist

CASES = [  # (op rank 0 blocks in, how its compute thread waits, how abort is issued, extra groups)
    ("allreduce", "stream_sync", "all", 0),
    ("allreduce", "stream_sync", "all", 4),
    ("allreduce", "stream_sync", "all", 16),
    ("none", "-", "all", 16),
    ("allreduce", "stream_sync", "parallel", 16),
    ("allreduce", "stream_sync", "busy_first", 16),
    ("p2p", "device_sync", "parallel", 16),
]


@ray.remote(num_gpus=1, num_cpus=1, concurrency_groups={"control": 2})
class Rank:
    def join(self, host, port, rank, extra_groups):
        torch.cuda.set_device(0)
        store = dist.PrefixStore("probe", dist.TCPStore(host, port, is_master=False,
                                                        timeout=datetime.timedelta(seconds=60)))
        t0 = time.perf_counter()
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                                device_id=torch.device("cuda:0"))
        t1 = time.perf_counter()
        self.rank = rank
        self.groups = [dist.new_group([0, 1]) for _ in range(extra_groups)]
        t2 = time.perf_counter()
        for g in [None] + self.groups:  # connect every communicator, p2p ones too
            x = torch.ones(4, device="cuda")
            dist.all_reduce(x, group=g)
            peer = 1 - rank
            ops = [dist.P2POp(dist.isend, x, peer, group=g), dist.P2POp(dist.irecv, torch.empty_like(x), peer, group=g)]
            for r in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
                r.wait()
        torch.cuda.synchronize()
        return t1 - t0, t2 - t1

    def stuck(self, op, wait):
        t = time.perf_counter()
        x = torch.ones(16 << 20, device="cuda")
        g = self.groups[-1] if self.groups else None
        if op == "none":
            return 0.0
        if op == "p2p":
            for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1, group=g)]):
                r.wait()
        else:
            dist.all_reduce(x, group=g)
        if wait == "device_sync":
            torch.cuda.synchronize()
        else:
            x[0].item()
        return time.perf_counter() - t

    @ray.method(concurrency_group="control")
    def abort(self, how):
        """-> (seconds until the busy group was aborted, seconds until all were)."""
        from torch.distributed.distributed_c10d import _abort_process_group, _world
        t = time.perf_counter()
        if how == "busy_first":  # the group with in-flight work first, alone
            self.groups[-1].abort()
        elif how == "parallel":  # every group's abort in its own thread
            threads = [threading.Thread(target=pg.abort) for pg in list(_world.pg_names)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        first = time.perf_counter() - t
        _abort_process_group()
        return first, time.perf_counter() - t


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_case(op, wait, how, extra_groups, timeout):
    host, port = ray.util.get_node_ip_address(), free_port()
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    a, b = Rank.remote(), Rank.remote()
    joins = ray.get([a.join.remote(host, port, 0, extra_groups), b.join.remote(host, port, 1, extra_groups)])
    f = a.stuck.remote(op, wait)
    time.sleep(2)
    ray.kill(b)
    time.sleep(0.5)
    t = time.perf_counter()
    try:
        first_s, abort_s = ray.get(a.abort.remote(how), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        first_s = abort_s = None
    try:
        ray.get(f, timeout=max(1.0, timeout - (time.perf_counter() - t)))
        freed = round(time.perf_counter() - t, 3)
    except ray.exceptions.GetTimeoutError:
        freed = None
    except ray.exceptions.RayError as e:
        freed = f"raised {type(e).__name__}"
    ray.kill(a)
    del store
    return {"case": op, "wait": wait, "abort": how, "extra_groups": extra_groups,
            "first_s": None if first_s is None else round(first_s, 3),
            "abort_s": None if abort_s is None else round(abort_s, 3), "freed": freed,
            "init_s": round(max(j[0] for j in joins), 3), "groups_s": round(max(j[1] for j in joins), 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for abort (default 15)")
    ap.add_argument("--split-share", action="store_true", help="NCCL_COMM_SPLIT_SHARE_RESOURCES=1")
    ap.add_argument("--cases", default=None, help="comma-separated indices into CASES (default all)")
    ap.add_argument("--out", default="bench/results/gpu/abort_probe.json")
    args = ap.parse_args()
    if args.split_share:  # before ray.init: the actors' processes inherit it
        os.environ["NCCL_COMM_SPLIT_SHARE_RESOURCES"] = "1"
    ray.init(include_dashboard=False)
    cases = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    rows = [run_case(*c, args.timeout) for c in cases]
    print(f"{'op':10} {'wait':12} {'abort':11} {'groups':>6} {'first_s':>8} {'abort_s':>8} {'freed':>10} "
          f"{'init_s':>7} {'groups_s':>8}")
    for r in rows:
        print(f"{r['case']:10} {r['wait']:12} {r['abort']:11} {r['extra_groups']:>6} {str(r['first_s']):>8} "
              f"{str(r['abort_s']):>8} {str(r['freed']):>10} {r['init_s']:>7} {r['groups_s']:>8}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                   "split_share": args.split_share, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
