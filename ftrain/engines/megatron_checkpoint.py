"""Megatron `dist_checkpointing` (torch_dist format) through our `CheckpointManager`: every
rank saves its shards as shard `megatron` of a checkpoint step and loads them back, on a local
file system or object storage (s3://, gs://), synchronously or with the write in the background
(`PendingSave`). The saved layout may differ from the loading one in DP and TP size
(dist_checkpointing reshards).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re

import torch
import torch.distributed as dist

from ftrain.engines.megatron_compat import torch_dist_reader, write_buckets
from ftrain.state.checkpoint_io import IO, as_checkpoint_error, hashed_beside
from ftrain.state.host_memory import carve, pin_in_background, pinned_empty, state_nbytes
from ftrain.state.manifest import CheckpointError, CheckpointMismatch

MEGATRON_SHARD = "megatron"  # shard name of the dist_checkpointing files in a checkpoint step
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_SAVE_ARENA: list = []  # pinned host memory for the next async save (a tensor, or a Future of one)


def _is_rank_file(name: str, rank: int) -> bool:
    """Whether `name` (a file torch_dist wrote) belongs to `rank`: its `__{rank}_*.distcp`
    files; rank 0 also owns the global ones (.metadata, common.pt, metadata.json)."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) == rank if m else rank == 0


def _put_rank_files(ckpt, step: int, stage: str, rank: int, hashed: dict | None = None, skip=()) -> list:
    """`ckpt.put_files` of the files of `rank` in `stage` but those in `skip` (hash those not in
    `hashed`, {name: (size, sha256)} of the files hashed as they were written; upload for
    object storage)."""
    names = [n for n in sorted(os.listdir(stage)) if _is_rank_file(n, rank) and n not in skip]
    return ckpt.put_files(step, stage, MEGATRON_SHARD, names, hashed)


def reserve_save_arena(nbytes: int) -> None:
    """Pin `nbytes` of host memory in the background for the next async save's device-to-host
    copies (`pin_in_background`), unless the arena kept for it is at least that large: pinning
    tens of GB takes seconds, which the first save would otherwise stall on."""
    kept = _SAVE_ARENA[0] if _SAVE_ARENA else None
    if isinstance(kept, concurrent.futures.Future):
        if not kept.done() or (kept.exception() is None and kept.result().numel() >= nbytes):
            return
    elif kept is not None and kept.numel() >= nbytes:
        return
    _SAVE_ARENA[:] = [pin_in_background(nbytes)]


def take_save_arena(nbytes: int) -> torch.Tensor:
    """Pinned host memory of at least `nbytes` bytes for one async save: the kept arena (waiting
    for it while it is still being pinned) when it is large enough and pinning did not fail,
    else a new exact-size one (`pinned_empty`). The save returns it when its write is done."""
    kept = _SAVE_ARENA.pop() if _SAVE_ARENA else None
    if isinstance(kept, concurrent.futures.Future):
        kept = None if kept.exception() is not None else kept.result()
    return kept if kept is not None and kept.numel() >= nbytes else pinned_empty(nbytes)


class SavePlanCache:
    """The torch_dist save strategy of one model layout, kept from save to save (Megatron-LM's
    `--ckpt-assume-constant-structure`): with `cached_metadata` the strategy reuses its local
    and central save plans and the global metadata once two saves planned the same, so later
    saves skip DCP's planning collectives; and the check that every shard has exactly one
    writer (`validate_access_integrity`, an all-gather of every rank's shard metadata) runs in
    the first save only. Valid while the model, optimizer and process groups are those it was
    made for (`matches`), and only if every rank of the group uses its own cache of the same
    saves (planning and validation are collectives): the engine makes a new one at every join
    of a generation, on every member, and after a checkpoint load."""

    def __init__(self, owner):
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        self.owner = owner  # identity of what the plans describe (e.g. the optimizer object)
        self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
        self.validated = False

    def matches(self, owner) -> bool:
        return owner is self.owner


def save_sharded(ckpt, step: int, rank: int, sharded_state_dict: dict, async_save: bool = False,
                 after_write=lambda: None, plans: SavePlanCache | None = None,
                 copy_stream: torch.cuda.Stream | None = None) -> list:
    """Collective over the default process group: `dist_checkpointing.save(sharded_state_dict)`
    (torch_dist format) as shard `megatron` of checkpoint `step` of `ckpt` (a CheckpointManager).

    Local URI: all ranks write in place (a shared file system for multi-node runs). Object
    storage (s3://, gs://): each rank writes into its own private staging directory (tempfile,
    honours TMPDIR; rank 0's also gets the global metadata), then uploads only its own files,
    so no rank waits on another's transfers. Returns this rank's FileEntry list (size, sha256)
    for `CheckpointManager.commit`. Raises CheckpointError on storage failure past the retry
    limits (the caller's error path; the rank stays usable).

    `async_save`: only the synchronous part runs here (planning collectives, the common state,
    a host copy of every tensor: later changes to the state are not in the checkpoint); the
    files are written in a background thread, and `[PendingSave]` is returned. Synchronous: the
    same write in this call (`_write_now`); `after_write()` runs between the write and the
    upload (fault injection 'mid_save'). Either way each .distcp file is hashed as it is written.
    `plans`: the layout's `SavePlanCache` (None: plan from scratch and validate, every save).
    `copy_stream` (async, CUDA): the device-to-host copies run on that stream, ordered after
    the current stream's work, and the call returns without waiting for them; the caller must
    order every later change of the saved tensors after `PendingSave.copied` (None: the call
    waits for the copies)."""
    import shutil
    import tempfile

    from megatron.core import dist_checkpointing

    path = ckpt.local_dir(step, MEGATRON_SHARD)
    stage = path or tempfile.mkdtemp(prefix=f"mcore-save-rank{rank}-")
    what = f"saving {ckpt.step_uri(step)}/{MEGATRON_SHARD}"
    done = False
    try:
        if path is not None:
            # Every rank has ended the write of a save a recovery abandoned (the actor calls
            # `PendingSave.abandon` before a save) before rank 0 empties the directory.
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.makedirs(path)
        dist.barrier()  # the in-place directory exists (and is empty) before anyone writes
        kwargs = {} if plans is None else {"sharded_strategy": plans.strategy,
                                           "validate_access_integrity": not plans.validated}
        request = as_checkpoint_error(what, dist_checkpointing.save, sharded_state_dict, stage,
                                      async_sharded_save=True, **kwargs)
        if plans is not None:
            plans.validated = True
        if async_save:
            done = True  # the stage now belongs to the PendingSave
            return [PendingSave(ckpt, step, rank, request, stage, path is None, copy_stream)]
        with IO.operation(ckpt.retry_budget_s):
            hashed = as_checkpoint_error(what, _write_now, request)
        after_write()
        return _put_rank_files(ckpt, step, stage, rank, hashed)
    finally:
        if path is None and not done:
            shutil.rmtree(stage, ignore_errors=True)


def _write_now(request) -> dict:
    """Megatron's `AsyncRequest.execute_sync` with `write_buckets` as the write (threads, each
    file hashed as written; not Megatron's forked writers): the host copy of the tensors
    (`preload_fn`), the write, a barrier, the finalize functions (collective). Returns
    {file name: (size, sha256)} of the files written."""
    hashed, args = {}, list(request.async_fn_args)
    if request.async_fn is not None:
        if request.preload_fn is not None:
            args[1] = request.preload_fn()
        hashed = write_buckets(request.async_fn, *args)
    dist.barrier()
    for finalize in request.finalize_fns:
        finalize()
    return hashed


class PendingSave:
    """The background part of an async `save_sharded`: Megatron's AsyncRequest
    (`dist_checkpointing.save(..., async_sharded_save=True)`) whose tensors are copied to host
    memory at construction; its write (`async_fn`: no collective) runs in a thread once the
    copies are done (`write_buckets`: the .distcp files in parallel, each hashed as it is
    written), then, for object storage, uploads them (`CheckpointManager.put_files`).
    `copied`: the CUDA event that marks the copies done (None when the construction waited for
    them, or without CUDA). `done()`: whether that thread has ended (written and uploaded, or
    failed), so `result()` will not wait for it. `result()` must be called on every rank, from
    the thread that runs the collectives (the actor's `finish_checkpoint`): it waits for the
    thread, runs the request's finalize functions (collective: the global metadata), then
    hashes and puts the global files (rank 0) and returns this rank's FileEntry list. Raises
    CheckpointError when the write or an upload failed."""

    def __init__(self, ckpt, step: int, rank: int, request, stage: str, owns_stage: bool,
                 copy_stream: torch.cuda.Stream | None = None):
        import threading

        self.ckpt, self.step, self.rank, self.request = ckpt, step, rank, request
        self.stage, self.owns_stage, self.error, self.copied = stage, owns_stage, None, None
        args = list(request.async_fn_args)
        # args[1]: Megatron's write buckets [(file, key, (bytes items, [(item, tensor)]))]; the
        # tensors are copied here (Megatron's preload_fn aliases tensors that are on the CPU).
        # GPU tensors: non-blocking copies into one exact-size pinned arena (`take_save_arena`,
        # returned for the next save), not a pageable copy per tensor.
        gpu = [t for _, _, (_, tensors) in args[1] for _, t in tensors if t.is_cuda]
        self._arena = take_save_arena(state_nbytes(gpu))
        host = iter(carve(gpu, self._arena))
        if copy_stream is not None:
            copy_stream.wait_stream(torch.cuda.current_stream())  # the state as of this call
        with torch.cuda.stream(copy_stream) if copy_stream is not None else contextlib.nullcontext():
            args[1] = [(f, k, (b, [(item, next(host).copy_(t.detach(), non_blocking=True) if t.is_cuda
                                    else t.detach().clone()) for item, t in tensors]))
                       for f, k, (b, tensors) in args[1]]
            if copy_stream is not None:
                self.copied = torch.cuda.Event()
                self.copied.record()
        if copy_stream is None and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._thread = threading.Thread(target=self._write, args=(args,), daemon=True, name="mcore-async-save")
        self._thread.start()

    def _write(self, args) -> None:
        self.hashed = {}  # {file name: (size, sha256)} of the .distcp files, hashed as written
        self.entries = []  # their FileEntry list, put (uploaded for object storage)
        try:
            if self.copied is not None:
                self.copied.synchronize()
            if self.request.async_fn is not None:
                with IO.operation(self.ckpt.retry_budget_s):
                    self.hashed = write_buckets(self.request.async_fn, *args)
            self.entries = self.ckpt.put_files(self.step, self.stage, MEGATRON_SHARD, sorted(self.hashed), self.hashed)
        except BaseException as exc:  # noqa: BLE001 (reported by result())
            self.error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def abandon(self) -> None:
        """Give this save up (a recovery abandoned it: `result()` will not be called): wait for
        its write and upload to end, so that none of its files lands after a new save of the
        same step began, then return its pinned arena for the next save and remove its private
        staging directory. No collective; what it wrote is never committed (a write error is
        dropped with it)."""
        import shutil

        self._thread.join()
        _SAVE_ARENA[:] = [self._arena]
        if self.owns_stage:
            shutil.rmtree(self.stage, ignore_errors=True)

    def result(self) -> list:
        import shutil

        what = f"saving {self.ckpt.step_uri(self.step)}/{MEGATRON_SHARD} (async)"
        try:
            self._thread.join()
            ok = [None] * dist.get_world_size()  # every rank finalizes, or none (no rank left in a collective)
            dist.all_gather_object(ok, self.error is None)
            if not all(ok):
                failed = [r for r, good in enumerate(ok) if not good]
                raise CheckpointError(f"{what} failed on rank(s) {failed}" +
                                      (f": {self.error!r}" if self.error is not None else ""))
            for finalize in self.request.finalize_fns:
                as_checkpoint_error(what, finalize)
            return self.entries + _put_rank_files(self.ckpt, self.step, self.stage, self.rank, skip=self.hashed)
        finally:
            if not self._thread.is_alive():
                _SAVE_ARENA[:] = [self._arena]
            if self.owns_stage:
                shutil.rmtree(self.stage, ignore_errors=True)


def load_sharded(ckpt, manifest, sharded_state_dict: dict, hash_share: list | None = None) -> dict:
    """Collective over the default process group: `dist_checkpointing.load` of shard
    `megatron` of the committed checkpoint `manifest` into `sharded_state_dict` (the saved
    layout may differ in DP and TP size: dist_checkpointing reshards). Returns the loaded
    state dict. Files are read in parallel, tensors straight into their destinations where the
    stored bytes allow (`megatron_compat.torch_dist_reader`). Local files: this rank hashes
    `hash_share` (manifest entries; the ranks share the files) beside the load
    (`checkpoint.hashed_beside`) and raises CheckpointMismatch after it on a sha256 mismatch
    (the loaded state is then to be discarded on every rank: the caller tries another checkpoint).

    Object storage: the global files are downloaded into a private staging directory first,
    then each `.distcp` file only when this rank's load plan reads from it (so a rank fetches
    the files holding its shards, not the whole checkpoint); every download is checked against
    the manifest's size and sha256. Raises CheckpointMismatch when the checkpoint does not fit
    `sharded_state_dict`, CheckpointError on a download mismatch or a storage failure (on every
    rank: DCP gathers one rank's read error to all)."""
    from megatron.core import dist_checkpointing

    what = f"loading {ckpt.step_uri(manifest.step)}/{MEGATRON_SHARD}"
    path = ckpt.local_dir(manifest.step, MEGATRON_SHARD)
    if path is not None:
        with torch_dist_reader(), IO.operation(ckpt.retry_budget_s), \
                hashed_beside(os.path.dirname(path), hash_share or [], f"{ckpt.step_uri(manifest.step)}"):
            return as_checkpoint_error(what, dist_checkpointing.load, sharded_state_dict, path, error=CheckpointMismatch)
    import tempfile

    prefix = MEGATRON_SHARD + "/"
    files = {f.path[len(prefix):]: f for f in manifest.files if f.path.startswith(prefix)}
    with tempfile.TemporaryDirectory(prefix="mcore-load-") as stage:
        ckpt.get_files(manifest.step, [f for n, f in files.items() if not _RANK_FILE.match(n)], stage)
        fetched: set[str] = set()

        def fetch(names: set[str]) -> None:
            missing = sorted(names - fetched)
            unknown = [n for n in missing if n not in files]
            if unknown:
                raise CheckpointError(f"{ckpt.step_uri(manifest.step)}: {unknown} are read but not in its manifest")
            ckpt.get_files(manifest.step, [files[n] for n in missing], stage)
            fetched.update(missing)

        with torch_dist_reader(fetch):
            return as_checkpoint_error(what, dist_checkpointing.load, sharded_state_dict,
                                       os.path.join(stage, MEGATRON_SHARD), error=CheckpointMismatch)

