"""Run one test function as `world` real processes (ranks), one per GPU where there are GPUs."""
import traceback

import torch
import torch.multiprocessing as mp

from local_storage import free_port


def _rank_main(target, rank: int, world: int, port: int, args: tuple, queue) -> None:
    try:
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        queue.put((rank, target(rank, world, store, *args)))
    except BaseException:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
        queue.put((rank, traceback.format_exc()))


def spawn_ranks(target, world: int, *args, timeout_s: float = 600.0) -> list:
    """Call `target(rank, world, store, *args)` in `world` spawned processes, rank r on GPU r
    when CUDA is available; `store` is a `torch.distributed.TCPStore` shared by the ranks (for
    `init_process_group(store=...)`). `target` must be a module-level function (pickled by name).

    Returns the ranks' return values in rank order. Raises AssertionError naming the rank and its
    traceback when a rank raised, and queue.Empty when a rank gave no answer within `timeout_s`
    seconds (a hang does not block the suite forever)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for r, res in sorted(results.items()):
        assert not (isinstance(res, str) and res.startswith("Traceback")), f"rank {r} failed:\n{res}"
    return [results[r] for r in range(world)]
