"""One step's rows read three ways, on the same windows (`data.Windows`, `Data.rows`): through
`data.IndexedFile` (what ranks use: checked `os.pread` of the .idx pointer and the .bin tokens,
no memory map), through megatron-core's `IndexedDataset` with its .bin memory-mapped (a file
cut under it kills the reader with SIGBUS) and with its file reader (`mmap=False`: a short read
returns an uninitialised buffer). The variants take turns step by step (a busy machine slows
them alike). `warm`: the files in the page cache (steady state when the data fit in memory);
`cold`: evicted before each step (`posix_fadvise(DONTNEED)`: every read goes to the disk).

Prints a table (milliseconds per step, median over --steps, and tokens/s) and writes --out:
{"rows", "seq_len", "tokens", "documents", "results": {cache: {reader: {"ms_median", "ms_min",
"tokens_per_s"}}}}.
Usage (repository root): python -m bench.rows_read [--tokens N] [--gbs 64] [--seq-len 4096]
[--steps 20] [--dir DIR] [--out PATH]
"""
import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from bench import write_json


def make_dataset(prefix: str, tokens: int, seed: int = 0) -> int:
    """Random uint16 tokens in documents of 1 to ~4,000 tokens (geometric, mean 800) at
    `prefix`.bin/.idx, written by megatron-core's builder. Returns the document count."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 32000, tokens, dtype=np.uint16)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    at, documents = 0, 0
    while at < tokens:
        n = min(int(rng.geometric(1 / 800)), tokens - at)
        builder.add_document(ids[at:at + n], [n])
        at, documents = at + n, documents + 1
    builder.finalize(prefix + ".idx")
    return documents


def evict(prefix: str) -> None:
    """Drop `prefix`'s files from the page cache (clean pages: no root needed)."""
    for ext in (".bin", ".idx"):
        fd = os.open(prefix + ext, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from ftrain.data.dataset import Data, IndexedFile, Windows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 25)
    ap.add_argument("--gbs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where the dataset is written (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        prefix = os.path.join(tmp, "random_text_document")
        documents = make_dataset(prefix, args.tokens)
        readers = {"pread (IndexedFile)": IndexedFile(prefix), "mmap (IndexedDataset)": IndexedDataset(prefix),
                   "file (IndexedDataset mmap=False)": IndexedDataset(prefix, mmap=False)}
        data = {name: Data([(1.0, Windows(low, args.seq_len, seed=1))], seed=1, global_batch_size=args.gbs)
                for name, low in readers.items()}
        first = next(iter(data.values())).rows(1)
        assert all(np.array_equal(d.rows(1), first) for d in data.values()), "the readers disagree"
        results = {}
        for cache in ("warm", "cold"):
            times = {name: [] for name in data}
            for step in range(2, args.steps + 2):
                for name, d in data.items():
                    if cache == "cold":
                        evict(prefix)
                    t0 = time.perf_counter()
                    d.rows(step)
                    times[name].append(time.perf_counter() - t0)
            results[cache] = {name: {"ms_median": 1e3 * statistics.median(t), "ms_min": 1e3 * min(t),
                                     "tokens_per_s": args.gbs * args.seq_len / statistics.median(t)}
                              for name, t in times.items()}
    print(f"one step's rows: {args.gbs} x {args.seq_len} tokens, {args.tokens:,} tokens in {documents:,} documents, "
          f"median of {args.steps} steps")
    print(f"{'cache':6} {'reader':34} {'ms/step':>9} {'min ms':>9} {'Mtokens/s':>10}")
    for cache, by_reader in results.items():
        for name, r in by_reader.items():
            print(f"{cache:6} {name:34} {r['ms_median']:9.2f} {r['ms_min']:9.2f} {r['tokens_per_s'] / 1e6:10.2f}")
    if args.out:
        write_json(args.out, {"rows": args.gbs, "seq_len": args.seq_len, "tokens": args.tokens,
                              "documents": documents, "results": results})


if __name__ == "__main__":
    main()
