"""Device-to-host copy speed into the host memory kinds the engines copy snapshots and shards
into, alone and beside compute, and what the copy costs the compute.

Kinds: `cuda_host_alloc` (torch's pinned allocator), `registered` (`host_memory.pinned_empty`:
anonymous pages registered with cudaHostRegister, the rollback snapshot's), `shared`
(`host_memory.SharedArena`: a memfd mapping registered the same way, the keeper's arenas) and
`pageable` (plain host memory, no registration). For each: GB/s of one `--gb` GB copy of a
device buffer issued as `--tensors` equal copies from a side stream (as a state of many
tensors is copied), alone; then the same copy beside a loop of bf16 matmuls on the default
stream: the copy's GB/s and the matmuls' time against the same loop without a copy (ratio).
Device time from CUDA events; median of `--repeats`.

Usage (repository root, a CUDA machine): python -m bench.host_copy [--gb 2] [--tensors 600]
    [--repeats 5] [--out PATH]
JSON: {"device", "gb", "tensors", "kinds": {kind: {"alone_gbps", "beside_gbps",
"matmul_ratio"}}}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench import write_json  # noqa: E402
from ftrain.state.host_memory import SharedArena, pinned_empty  # noqa: E402


def host_buffer(kind: str, nbytes: int) -> torch.Tensor:
    if kind == "cuda_host_alloc":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if kind == "registered":
        return pinned_empty(nbytes)
    if kind == "shared":
        arena = SharedArena(nbytes, "bench-host-copy")
        return arena.tensor  # its views keep the mapping (and the registration) alive
    return torch.empty(nbytes, dtype=torch.uint8).zero_()  # pageable, pages faulted in


def copy_once(dst: list[torch.Tensor], src: list[torch.Tensor], stream: torch.cuda.Stream) -> float:
    """Seconds of device time of the copies, queued on `stream`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        torch._foreach_copy_(dst, src, non_blocking=True)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def matmuls(a: torch.Tensor, n: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        a @ a
    end.record()
    return start, end


def measure(kind: str, gb: float, tensors: int, repeats: int) -> dict:
    nbytes = int(gb * 1e9) // tensors * tensors
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = host_buffer(kind, nbytes)
    src, dst = list(device.chunk(tensors)), list(host.chunk(tensors))
    stream = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    copy_once(dst, src, stream)  # warm-up
    alone = [nbytes / copy_once(dst, src, stream) / 1e9 for _ in range(repeats)]
    n = 40  # ~1.1 TFLOP per matmul: the loop outlasts a few GB of copy
    base, beside, ratio = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        s, e = matmuls(a, n)
        e.synchronize()
        base.append(s.elapsed_time(e))
        torch.cuda.synchronize()
        s, e = matmuls(a, n)
        beside.append(nbytes / copy_once(dst, src, stream) / 1e9)
        e.synchronize()
        ratio.append(s.elapsed_time(e) / base[-1])
    return {"alone_gbps": statistics.median(alone), "beside_gbps": statistics.median(beside),
            "matmul_ratio": statistics.median(ratio), "matmul_s": statistics.median(base) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", default="cuda_host_alloc,registered,shared,pageable")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.host_copy needs a CUDA device")
    out = {"device": torch.cuda.get_device_name(), "gb": args.gb, "tensors": args.tensors, "kinds": {}}
    print(f"{'kind':<16}{'alone GB/s':>12}{'beside GB/s':>13}{'matmul ratio':>14}")
    for kind in args.kinds.split(","):
        r = measure(kind, args.gb, args.tensors, args.repeats)
        out["kinds"][kind] = r
        print(f"{kind:<16}{r['alone_gbps']:>12.1f}{r['beside_gbps']:>13.1f}{r['matmul_ratio']:>14.3f}")
        torch.cuda.empty_cache()
    write_json(args.out or "bench/results/gpu/host_copy.json", out)


if __name__ == "__main__":
    main()
