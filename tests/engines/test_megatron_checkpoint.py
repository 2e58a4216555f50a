"""Megatron `dist_checkpointing` through the CheckpointManager (`megatron_checkpoint.save_sharded` /
`load_sharded`) on local disk, S3 and GCS: two real gloo ranks save a torch_dist checkpoint,
commit it, load it back in the same and in a different sharding, save asynchronously (a change
after the call is not saved), and refuse a corrupt file.

The engine's model needs CUDA, so the ranks save plain Megatron ShardedTensors / ShardedObjects
(the same objects a GPTModel's `sharded_state_dict` is made of). Megatron's torch_dist writer
calls `torch.cuda.synchronize()` and puts a flag on `torch.cuda.current_device()`; those two
are the only things replaced (no CUDA here). The engine itself is covered on GPU
(tests/test_megatron_engine.py), and its checkpoint load on CPU at dp=3 tp=2 (the engine's
own CPU stand-ins, `megatron_compat.cpu_stand_ins`): every file hashed once across the ranks
beside the load, a flipped byte found."""
import os
import traceback
import uuid

import pytest
import torch
from test_checkpoint import flip_byte

from checkpoint import CheckpointManager
from ftrain.state.manifest import CheckpointError

from ranks import spawn_ranks

WORLD = 2
ROWS, COLS = 8, 6


def full_weight() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _state(rank: int, split_dim: int, fill: float | None) -> dict:
    """Rank `rank`'s sharded state: weight `w` split over the ranks along `split_dim`, a
    per-rank object (like the RNG state) and a common value. `fill` None: the true values
    (to save); else a template of that value (to load into)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    local = full_weight().chunk(WORLD, dim=split_dim)[rank].clone()
    if fill is not None:
        local.fill_(fill)
    obj = {"rank": rank, "seed": 1000 + rank} if fill is None else None
    return {"w": ShardedTensor.from_rank_offsets("w", local, (split_dim, rank, WORLD)),
            "rng": ShardedObject("rng", obj, (WORLD,), (rank,), replica_id=0),
            "step": 7}


def _commit(ckpt, step: int, files: list, layout: dict):
    """Collective: every rank's `files` of `step` gathered and committed by rank 0 (as the
    driver does) with `layout`; returns the manifest, once every rank can read it."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, files)
    if dist.get_rank() == 0:
        ckpt.commit(step, layout, [f for fs in gathered for f in fs])
    dist.barrier()
    return ckpt.read_manifest(step)


def _round_trip(rank: int, uri: str, opts: dict | None, corrupt: bool) -> dict:
    import torch.distributed as dist

    from ftrain.engines.megatron_checkpoint import load_sharded, save_sharded

    out = {}
    ckpt = CheckpointManager(uri, storage_options=opts)
    mid_save = []  # this rank's files at storage when `after_write` ('mid_save') runs
    files = save_sharded(ckpt, 3, rank, _state(rank, 0, None), after_write=lambda: mid_save.append(
        len(ckpt.fs.glob(f"{ckpt.root}/step_00000003/megatron/__{rank}_*"))))
    out["files"] = sorted(f.path for f in files)
    out["mid_save"] = mid_save
    manifest = _commit(ckpt, 3, files, {"dp": WORLD})

    fetched: list[str] = []
    get_files = ckpt.get_files
    ckpt.get_files = lambda step, entries, stage: (fetched.extend(e.path for e in entries),
                                                   get_files(step, entries, stage))[1]
    same = load_sharded(ckpt, manifest, _state(rank, 0, -1.0))
    out["same"] = (same["w"], same["rng"], same["step"])
    out["fetched"] = sorted(fetched)
    resharded = load_sharded(ckpt, manifest, _state(rank, 1, -1.0))
    out["resharded"] = resharded["w"]

    # async save: the state is copied when save_sharded returns; a later change is not saved.
    # The write runs in threads: no os.fork (a fork from a threaded process can deadlock).
    forks = []
    os.register_at_fork(before=lambda: forks.append(1))
    state = _state(rank, 0, None)
    (pending,) = save_sharded(ckpt, 5, rank, state, async_save=True)
    state["w"].data.add_(1000.0)
    _commit(ckpt, 5, pending.result(), {"dp": WORLD})
    out["async_forks"] = len(forks)
    out["async"] = load_sharded(ckpt, ckpt.read_manifest(5), _state(rank, 0, -1.0))["w"]

    if not corrupt:  # local disk: saves that reuse one SavePlanCache (the 3rd skips planning)
        from ftrain.engines.megatron_checkpoint import SavePlanCache

        plans, state, out["cached"] = SavePlanCache(owner=None), _state(rank, 0, None), []
        cached = CheckpointManager(uri + "-cached")
        for step in (6, 7, 8):
            state["w"].data.add_(1.0)
            (pending,) = save_sharded(cached, step, rank, state, async_save=True, plans=plans)
            out["cached"].append(load_sharded(cached, _commit(cached, step, pending.result(), {"dp": WORLD}),
                                              _state(rank, 0, -1.0))["w"])
        out["cache_reused"] = plans.strategy.validated_cache_reuse

    if not corrupt:  # local disk: each rank hashes its share beside the load (MegatronEngine.load_checkpoint)
        m5 = ckpt.read_manifest(5)
        victim = next(f for f in m5.files if f.path.startswith("megatron/__1_"))
        if rank == 0:  # a byte changed at the same size: only a hash finds it
            flip_byte(ckpt, 5, victim.path)
        dist.barrier()
        share = m5.share(rank, WORLD)
        try:
            load_sharded(ckpt, m5, _state(rank, 0, -1.0), hash_share=share)
            out["corrupt_local"] = (victim in share, None)
        except CheckpointError as exc:
            out["corrupt_local"] = (victim in share, f"{type(exc).__name__}: {exc}")

    if corrupt:
        if rank == 0:
            victim = next(f for f in manifest.files if f.path.startswith("megatron/__1_"))
            ckpt.fs.pipe_file(f"{ckpt.root}/step_00000003/{victim.path}", b"x" * victim.size)
        dist.barrier()
        try:
            load_sharded(ckpt, manifest, _state(rank, 0, -1.0))
            out["corrupt"] = None
        except CheckpointError as exc:
            out["corrupt"] = f"{type(exc).__name__}: {exc}"
    return out


def _round_trip_backend(rank: int, world: int, name: str, uri: str, opts: dict | None) -> dict:
    """Save, commit (rank 0), load in the same and in another sharding, and (object storage)
    load again after rank 0 corrupted one of rank 1's files."""
    return _round_trip(rank, uri, opts, corrupt=name != "local")


def _worker(rank: int, world: int, store, targets: dict, each=_round_trip_backend) -> dict:
    """Rank `rank` of `world` on gloo: `each(rank, world, name, uri, storage_options)` for each
    backend of `targets` ({name: (uri, storage_options)}). Returns {name: its results, or
    {"error": traceback}}."""
    torch.cuda.synchronize = lambda *a, **k: None  # no CUDA here (see module docstring)
    torch.cuda.current_device = lambda: "cpu"
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = {}
    for name, (uri, opts) in targets.items():
        try:
            results[name] = each(rank, world, name, uri, opts)
        except BaseException:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
            results[name] = {"error": traceback.format_exc()}
    dist.destroy_process_group()
    return results


def test_save_commit_load_reshard(request, tmp_path):
    """One pair of ranks (Megatron's import dominates the time) goes through all three backends."""
    prefix = f"mcore-{uuid.uuid4().hex[:8]}"
    targets = {"local": (str(tmp_path / prefix), None)}
    for backend in ("s3", "gcs"):
        server = request.getfixturevalue(f"{backend}_server")
        targets[backend] = (server.uri(prefix), server.storage_options)
    by_rank = spawn_ranks(_worker, WORLD, targets, timeout_s=240)

    full = full_weight()
    for backend, (uri, opts) in targets.items():
        results = {r: by_rank[r][backend] for r in range(WORLD)}
        for r, out in results.items():
            assert "error" not in out, f"{backend} rank {r}:\n{out['error']}"
            assert out["async_forks"] == 0, (backend, r, out["async_forks"])
        # 'mid_save' fires once, after the write: in place on local disk, before any upload
        own = {r: len([p for p in out["files"] if p.startswith(f"megatron/__{r}_")]) for r, out in results.items()}
        assert all(own[r] > 0 and out["mid_save"] == [own[r] if backend == "local" else 0]
                   for r, out in results.items()), {r: out["mid_save"] for r, out in results.items()}
        # each rank lists only its own files; rank 0 also the global metadata
        assert all(p.startswith("megatron/__1_") for p in results[1]["files"])
        assert {"megatron/.metadata", "megatron/common.pt", "megatron/metadata.json"} <= set(results[0]["files"])
        assert not set(results[0]["files"]) & set(results[1]["files"])
        if backend == "local":  # the remote ones were corrupted on purpose at the end
            assert CheckpointManager(uri, storage_options=opts).verify(3) == []
            # step 5's changed file is named after the load by the rank whose share holds it; the
            # other rank loads, or fails its own load of the changed bytes: a bad checkpoint either way
            shares = [results[r]["corrupt_local"] for r in range(WORLD)]
            assert sum(mine for mine, _ in shares) == 1, shares
            for mine, error in shares:
                if mine:
                    assert error.startswith("CheckpointMismatch") and "sha256 mismatch" in error, shares
                else:
                    assert error is None or error.startswith("CheckpointMismatch"), shares
        for r, out in results.items():
            w, rng, step = out["same"]
            torch.testing.assert_close(w, full.chunk(WORLD, 0)[r], rtol=0, atol=0)
            assert rng == {"rank": r, "seed": 1000 + r} and step == 7
            torch.testing.assert_close(out["resharded"], full.chunk(WORLD, 1)[r], rtol=0, atol=0)
            torch.testing.assert_close(out["async"], full.chunk(WORLD, 0)[r], rtol=0, atol=0)
            if backend == "local":  # each save with cached plans holds that save's values
                for i, w in enumerate(out["cached"]):
                    torch.testing.assert_close(w, full.chunk(WORLD, 0)[r] + i + 1, rtol=0, atol=0)
                assert out["cache_reused"]
        if backend != "local":
            # same layout: a rank downloads the global files and its own .distcp files only
            assert [p for p in results[1]["fetched"] if p.endswith(".distcp")] == \
                [p for p in results[1]["files"] if p.endswith(".distcp")], backend
            # a corrupt .distcp file is refused by sha256 on the rank that reads it, as a bad
            # checkpoint (not storage down), and the other rank's load fails too (DCP gathers
            # the error) instead of hanging
            for r in range(WORLD):
                assert results[r]["corrupt"].startswith("CheckpointMismatch"), (backend, results[r]["corrupt"])
                assert "sha256 mismatch" in results[r]["corrupt"], (backend, results[r]["corrupt"])


def test_local_put_files_must_be_in_place(tmp_path):
    ckpt = CheckpointManager(str(tmp_path / "c"))
    os.makedirs(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "f").write_bytes(b"abc")
    with pytest.raises(ValueError, match="in place"):
        ckpt.put_files(1, str(tmp_path / "elsewhere"), "megatron", ["f"])


def test_an_unknown_megatron_async_write_is_named():
    """The async save reuses megatron-core 0.16.1's write function through its bound arguments;
    another layout is refused with the pinned version in the message, not unpacked blindly."""
    import queue

    from ftrain.engines.megatron_compat import write_buckets

    with pytest.raises(CheckpointError, match="0.16.1"):
        write_buckets(lambda *a: None, 0, [], queue.Queue())


def _io_worker(rank: int, world: int, store, root: str) -> dict:
    """One rank: an async save of tensors that span several write pieces, a transposed
    (non-contiguous) one and an object; a load into zeroed tensors; a synchronous save. Records
    which files were hashed by reading them back and how many bytes were read straight into
    tensors."""
    torch.cuda.synchronize = lambda *a, **k: None  # no CUDA here (see module docstring)
    torch.cuda.current_device = lambda: "cpu"
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    import checkpoint
    from ftrain.engines import megatron_compat
    from ftrain.engines.megatron_checkpoint import load_sharded, save_sharded
    from ftrain.state import checkpoint_io, hashed_file

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    reread, direct = [], []
    sha256_local, read_exact = checkpoint_io.sha256_local, megatron_compat._read_exact
    checkpoint.sha256_local = checkpoint_io.sha256_local = \
        lambda path: (reread.append(os.path.basename(path)), sha256_local(path))[1]
    megatron_compat._read_exact = lambda f, offset, out: (direct.append(len(out)), read_exact(f, offset, out))[1]
    g = torch.Generator().manual_seed(0)
    values = {"big": torch.randn(3, hashed_file.PIECE // 4 + 5, generator=g),  # > 3 write pieces
              "bf16": torch.randn(7, 5, generator=g).bfloat16(),
              "transposed": torch.randn(6, 4, generator=g).t()}

    def state(fill: bool) -> dict:
        return {**{k: ShardedTensor.from_rank_offsets(k, torch.zeros(v.shape, dtype=v.dtype) if fill else v,
                                                      replica_id=0) for k, v in values.items()},
                "rng": ShardedObject("rng", None if fill else {"seed": 5}, (1,), (0,), replica_id=0), "step": 3}

    ckpt = CheckpointManager(root)
    (pending,) = save_sharded(ckpt, 1, 0, state(False), async_save=True)
    manifest = ckpt.commit(1, {"dp": 1}, pending.result())
    out = {"reread": sorted(reread), "files": sorted(f.path for f in manifest.files), "verify": ckpt.verify(1),
           "crc32_after_save": torch.utils.serialization.config.save.compute_crc32}
    loaded = load_sharded(ckpt, manifest, state(True))
    out["equal"] = {k: torch.equal(loaded[k], v) for k, v in values.items()}
    out["rng"], out["direct"] = loaded["rng"], sorted(direct)
    reread.clear()  # a synchronous save writes the same way, in this thread, without forking
    forks = []
    os.register_at_fork(before=lambda: forks.append(1))
    ckpt.commit(2, {"dp": 1}, save_sharded(ckpt, 2, 0, state(False)))
    out["sync"] = {"reread": sorted(reread), "forks": len(forks), "verify": ckpt.verify(2)}
    dist.destroy_process_group()
    return out


def test_saves_hash_while_writing_and_load_reads_into_the_tensors(tmp_path):
    """The background write hashes each .distcp file as it writes it (only the small global
    files are read back to hash them), with sha256 values that `verify` recomputes; the zip
    CRC32 switch is restored after the write; a synchronous save does the same, without fork. The load reads each contiguous stored tensor
    straight into its destination; a transposed one goes through torch's read, equal too."""
    from ftrain.state import hashed_file

    (out,) = spawn_ranks(_io_worker, 1, str(tmp_path / "c"), timeout_s=240)
    distcp = [p.split("/", 1)[1] for p in out["files"] if p.endswith(".distcp")]
    assert len(distcp) == 2, out["files"]  # Megatron's two write buckets, written in parallel
    assert not set(out["reread"]) & set(distcp) and out["reread"], out["reread"]
    assert out["verify"] == [] and out["crc32_after_save"] is True
    assert out["equal"] == {"big": True, "bf16": True, "transposed": True} and out["rng"] == {"seed": 5}
    assert out["direct"] == sorted([3 * (hashed_file.PIECE // 4 + 5) * 4, 7 * 5 * 2]), out["direct"]
    assert out["sync"] == {"reread": out["reread"], "forks": 0, "verify": []}, out["sync"]


def _abandon_then_save(rank: int, world: int, name: str, uri: str, opts: dict | None) -> dict:
    """An async save of step 5 that a recovery abandons while its upload (local: its hashing)
    is held back, then, as the actor does before its next save
    (`MegatronActor._end_abandoned_save`), `PendingSave.abandon` and a save of step 5 with
    other values (the replayed timeline), committed. Returns the loaded values, the problems
    `verify` finds and whether the abandoned save's arena came back."""
    import threading

    import torch.distributed as dist

    from ftrain.engines import megatron_checkpoint
    from ftrain.engines.megatron_checkpoint import load_sharded, save_sharded

    ckpt, abandoned_ckpt = (CheckpointManager(uri, storage_options=opts) for _ in range(2))
    gate = threading.Event()
    put_files = abandoned_ckpt.put_files
    abandoned_ckpt.put_files = lambda *a, **k: (gate.wait(), put_files(*a, **k))[1]
    old = _state(rank, 0, None)
    old["w"].data.add_(100.0)
    (pending,) = save_sharded(abandoned_ckpt, 5, rank, old, async_save=True)
    threading.Timer(0.2, gate.set).start()  # the old upload ends while the next save waits
    pending.abandon()
    manifest = _commit(ckpt, 5, save_sharded(ckpt, 5, rank, _state(rank, 0, None)), {"dp": world})
    return {"w": load_sharded(ckpt, manifest, _state(rank, 0, -1.0))["w"],
            "problems": ckpt.verify(5), "arena_back": megatron_checkpoint._SAVE_ARENA == [pending._arena]}


def test_an_abandoned_async_save_ends_before_a_new_save_of_its_step(s3_server, tmp_path):
    """A recovery abandons an async save of step 5 whose upload is still running; the replay
    saves step 5 again with other values. The new save starts only once the abandoned write
    has ended (`PendingSave.abandon`), so no late old file overwrites a new one: the committed
    step verifies and loads the new values on both ranks, and the abandoned save's pinned
    arena is back for the next save. (On GPU the same path runs with the device-to-host copy
    on the side stream: `MegatronActor._end_abandoned_save`.)"""
    prefix = f"mcore-abandon-{uuid.uuid4().hex[:8]}"
    targets = {"local": (str(tmp_path / prefix), None), "s3": (s3_server.uri(prefix), s3_server.storage_options)}
    by_rank = spawn_ranks(_worker, WORLD, targets, _abandon_then_save, timeout_s=240)
    for backend in targets:
        for r in range(WORLD):
            out = by_rank[r][backend]
            assert "error" not in out, f"{backend} rank {r}:\n{out['error']}"
            torch.testing.assert_close(out["w"], full_weight().chunk(WORLD, 0)[r], rtol=0, atol=0)
            assert out["problems"] == [] and out["arena_back"], (backend, r, out)


def _load_hash_rank(proc: int, world: int, store, dp: int, tp: int, root: str) -> dict:
    """Rank `proc` of a tp x dp `MegatronEngine` on gloo: trains steps 1-2, saves and commits
    step 2 (rank 0 commits, as the driver does), trains step 3, then loads step 2 with the
    real hashing spied on (`checkpoint_io.sha256_local` still runs). Then rank 0 flips a byte of
    the newest-listed `.distcp` file (a size check passes it) and every rank loads step 2
    again. Returns the digests saved and loaded, the files this rank hashed during the good
    load, its share, and the outcome of the corrupt load."""
    import torch.distributed as dist
    from test_megatron_engine import _state_digest
    from test_megatron_peer_restore import _train, engine_on_gloo

    from ftrain.state import checkpoint_io

    e, cfg, dims = engine_on_gloo(proc, store, dp, tp)
    ckpt = CheckpointManager(root)
    _train(e, cfg, dims, proc, (1, 2))
    out = {"saved": _state_digest(e._train_state(), e.step)}
    manifest = _commit(ckpt, 2, e.save_checkpoint(ckpt, 2, dims, proc),
                       {"world_size": world, "tp": tp, "pp": 1, "cp": 1, "dp": dp})
    _train(e, cfg, dims, proc, (3,))  # the state moves on: the load must bring step 2 back
    assert ckpt.verify_files(2, manifest.share(proc, world), hash_files=not e.checks_while_loading) == []

    hashed, sha256 = [], checkpoint_io.sha256_local
    checkpoint_io.sha256_local = lambda path: (hashed.append(os.path.relpath(path, os.path.join(root, "step_00000002"))),
                                             sha256(path))[1]
    e.load_checkpoint(ckpt, manifest, proc)
    checkpoint_io.sha256_local = sha256
    out.update(loaded=_state_digest(e._train_state(), e.step), hashed=hashed,
               share=[f.path for f in manifest.share(proc, world)], files=[f.path for f in manifest.files])

    victim = [f for f in manifest.files if f.path.endswith(".distcp")][-1]
    if proc == 0:  # a byte changed at the same size: only a hash finds it
        flip_byte(ckpt, 2, victim.path)
    dist.barrier()
    try:
        e.load_checkpoint(ckpt, manifest, proc)
        out["corrupt"] = None
    except CheckpointError as exc:
        out["corrupt"] = f"{type(exc).__name__}: {exc}"
    out["victim"] = victim.path
    dist.destroy_process_group()
    return out


@pytest.mark.slow  # six Megatron processes: ~1 min on 2 cores, more under load
def test_megatron_load_hashes_each_file_once_at_dp3_tp2(tmp_path):
    """`MegatronEngine.load_checkpoint` at dp=3 tp=2 (six gloo ranks): rank r hashes exactly its
    share `Manifest.share(r, 6)` beside the load (the share its verify round checked), so every
    file of the checkpoint is hashed once across the ranks and none twice; the loaded state is
    the saved one bitwise on every rank. A byte flipped after the save in one file is found by
    the rank whose share holds it (CheckpointMismatch naming the file), with no hashing pass
    before the load."""
    dp, tp = 3, 2
    world = dp * tp
    results = spawn_ranks(_load_hash_rank, world, dp, tp, str(tmp_path / "ckpt"), timeout_s=600)
    files = results[0]["files"]
    for r, out in enumerate(results):
        assert out["loaded"] == out["saved"], f"rank {r}: the load is not the saved state"
        assert sorted(out["hashed"]) == sorted(out["share"]), (r, out["hashed"], out["share"])
    hashed = [p for out in results for p in out["hashed"]]
    assert sorted(hashed) == sorted(files) and len(set(hashed)) == len(files), hashed
    victim = results[0]["victim"]
    finder = next(r for r, out in enumerate(results) if victim in out["share"])
    found = results[finder]["corrupt"]
    assert found is not None and found.startswith("CheckpointMismatch") and f"{victim}: sha256 mismatch" in found, found
    for r, out in enumerate(results):  # the others loaded (the bytes were tensor data) or failed with it
        assert out["corrupt"] is None or out["corrupt"].startswith("Checkpoint"), (r, out["corrupt"])


@pytest.mark.slow  # three Megatron actors (two ranks and a spare) on CPU: about a minute or more
def test_megatron_recovery_falls_back_past_a_checkpoint_whose_bytes_changed(ray_session, tmp_path):
    """The recovery protocol with `MegatronActor`s running `MegatronEngine` on CPU (gloo; the
    driver's config check refuses Megatron on CPU to users, so the config is resolved as for a
    GPU and set to the CPU after), dp=2, `fault_tolerance.restore=checkpoint`: checkpoints at
    steps 1 and 2, then one byte of a `.distcp` file of step 2 flipped at the same size, and
    rank 0 killed during step 3. The ranks' check before the load (sizes: the engine hashes
    while loading) passes step 2, the hash beside the load finds it; recovery discards that
    state, loads step 1 with no spare spent on the bad checkpoint, and replays step 2 with its
    first loss bitwise; no rank builds a model at the join (the spare's, prebuilt in a world of
    one rank, moves onto the dp = 2 groups). The same fallback load again
    (`fault_tolerance.restore_checkpoint`) leaves every rank with the state it had after step 1,
    bitwise."""
    import ray

    from ftrain.control.actor_group import ActorGroup
    from ftrain.recovery.fault_tolerance import restore_checkpoint
    from ftrain.state.manifest import check_compatible
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    from conftest import megatron_cpu_cfg

    cfg = megatron_cpu_cfg(tmp_path, "cluster.num_workers=2", "cluster.num_spares=1", "train.steps=3",
                           "fault_tolerance.restore=checkpoint")
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        trainer.save(1)
        after_1 = group.state_digests()
        trainer.train(2)
        trainer.save(2)
        victim = [f for f in trainer.ckpt.read_manifest(2).files if f.path.endswith(".distcp")][-1]
        flip_byte(trainer.ckpt, 2, victim.path)
        assert trainer.ckpt.verify_files(2, trainer.ckpt.read_manifest(2).files, hash_files=False) == []
        losses = dict(trainer.losses)
        ray.kill(group.workers[0].handle, no_restart=True)
        trainer.train(3)
        (tl,) = trainer.recoveries
        assert (tl.failed_ranks, tl.restore_source, tl.attempts, len(group.pool)) == ([0], "checkpoint step 1", 1, 0)
        assert "checkpoint step 2 does not load" in tl.notes, tl.notes
        assert "build_s" not in tl.rebuild_detail, tl.rebuild_detail  # the spare's prebuilt model moved
        assert trainer.replayed == {2: [losses[2]]}
        notes = []
        assert restore_checkpoint(group, trainer.ckpt, trainer.ckpt.committed_manifests(), cfg.fault_tolerance.step_timeout_s,
                                  lambda m: check_compatible(cfg, m), notes) == 1
        assert notes == ["checkpoint step 2 does not load"] and group.state_digests() == after_1
    finally:
        group.shutdown()


@pytest.mark.parametrize("tp, dp, killed, async_save", [
    (1, 2, 1, False),
    pytest.param(1, 2, 1, True, marks=pytest.mark.slow),
    pytest.param(1, 3, 2, False, marks=pytest.mark.slow),
    pytest.param(2, 2, 3, False, marks=pytest.mark.slow),
], ids=["dp2", "dp2_async", "dp3", "tp2_dp2"])
def test_every_save_after_a_recovery_commits(ray_session, tmp_path, tp, dp, killed, async_save):
    """MegatronActors on CPU (gloo), tp x dp ranks with the distributed optimizer and the shard
    keeper, a checkpoint every step; rank `killed` killed after step 3. The replacement joins a
    rebuilt generation beside survivors that kept their model and optimizer: every save after
    the recovery still commits (the save is planned afresh by every rank of the new generation:
    a survivor reusing its old plans, without the collectives the replacement's planning runs,
    would leave them waiting in different collectives), none fails, one recovery, and the
    losses are bitwise the run without failure. CI: dp=2, sync saves; slow:
    async saves, dp=3, tp=2 x dp=2."""
    import dataclasses

    import ray

    from conftest import megatron_cpu_cfg, reference_run, wait_for_shards
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    cfg = megatron_cpu_cfg(tmp_path, "model.distributed_optimizer=true", f"parallel.tp={tp}",
                           f"cluster.num_workers={tp * dp}", "cluster.num_spares=1", "train.steps=5",
                           f"train.global_batch_size={2 * dp}", f"train.mini_batch_size={2 * dp}",
                           "checkpoint.interval=1", f"checkpoint.async_save={str(async_save).lower()}",
                           "fault_tolerance.refill_spares=false", "fault_tolerance.health_timeout_s=30")
    elsewhere = dataclasses.replace(cfg.checkpoint, uri=str(tmp_path / "reference"))
    ref_losses, _ = reference_run(dataclasses.replace(cfg, checkpoint=elsewhere), 5)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(3)
        wait_for_shards(group, 3)
        ray.kill(group.workers[killed].handle, no_restart=True)
        trainer.train(5)
        (tl,) = trainer.recoveries
        assert (tl.failed_ranks, tl.steps_lost) == ([killed], 0), tl
        assert trainer.failed_saves == [] and trainer.checkpoints[-2:] == [4, 5], trainer.checkpoints
        assert trainer.ckpt.committed_steps()[-1] == 5
        assert trainer.losses == ref_losses  # the final states' bitwise check after a recovery: test_keeper.py
    finally:
        group.shutdown()


@pytest.mark.slow
def test_every_save_after_a_shrink_and_a_grow_back_commits(ray_session, tmp_path):
    """As `test_every_save_after_a_recovery_commits` (dp2), through two membership changes:
    MegatronActors on gloo at dp=2 with no spare (`fault_tolerance.min_dp=1`), a checkpoint every
    step; rank 0 killed after step 2, DP shrinks to 1, and once its bundle's refill is warm DP
    grows back to 2 at a step boundary. Every save after each change commits, none fails."""
    from conftest import kill_then_await_refill, megatron_cpu_cfg
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    cfg = megatron_cpu_cfg(tmp_path, "cluster.num_workers=2", "cluster.num_spares=0", "fault_tolerance.min_dp=1",
                           "train.steps=6", "checkpoint.interval=1", "fault_tolerance.health_timeout_s=30")

    after_step = kill_then_await_refill(timeout_s=180)

    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(6, after_step)
        assert group.dims.dp == 2 and len(trainer.recoveries) == 1 and len(trainer.grows) == 1
        assert trainer.failed_saves == [] and trainer.checkpoints[-4:] == [3, 4, 5, 6], trainer.checkpoints
    finally:
        group.shutdown()
