"""Run one test function as `world` real processes (ranks), one per GPU where there are GPUs."""
import contextlib
import os
import traceback

import torch
import torch.multiprocessing as mp

from ftrain.testbeds.local_storage import free_port

# Without GPUs the ranks are forked from one server process that imported these once: a
# spawned rank spends seconds of CPU importing them again (most of a CPU test's time). With
# GPUs each rank is spawned: a rank's visible GPU is set in its environment at its start.
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
            "megatron.core.optimizer", "megatron.core.dist_checkpointing"]


def _rank_main(target, rank: int, world: int, port: int, args: tuple, queue) -> None:
    try:
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # its one visible GPU (`_only_gpu`)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        queue.put((rank, target(rank, world, store, *args)))
    except BaseException:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
        queue.put((rank, traceback.format_exc()))


@contextlib.contextmanager
def _only_gpu(gpu: str):
    """CUDA_VISIBLE_DEVICES=`gpu` for the processes started inside the block (a spawned child
    copies the environment at its start). Why: a rank sees one GPU, as a Ray actor does, and
    the Megatron engine uses CUDA device 0 of its process."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def spawn_ranks(target, world: int, *args, timeout_s: float = 600.0) -> list:
    """Call `target(rank, world, store, *args)` in `world` spawned processes, rank r on GPU r
    (the only GPU its process sees, device 0 there) when CUDA is available and r is below the
    GPU count, else with no GPU visible; `store` is a `torch.distributed.TCPStore` shared by
    the ranks (for `init_process_group(store=...)`). `target` must be a module-level function
    (pickled by name).

    Returns the ranks' return values in rank order. Raises AssertionError naming the rank and its
    traceback when a rank raised, and queue.Empty when a rank gave no answer within `timeout_s`
    seconds (a hang does not block the suite forever)."""
    if torch.cuda.is_available():
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, args, queue)) for r in range(world)]
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = gpus.split(",") if gpus is not None else [str(i) for i in range(torch.cuda.device_count())]
    for r, p in enumerate(procs):
        with _only_gpu(gpus[r] if r < len(gpus) else ""):
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
