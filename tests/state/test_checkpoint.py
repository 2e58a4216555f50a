"""CheckpointManager against a local directory and real S3 (moto) / GCS (emulator) servers on
loopback: round trip, commit rule, corrupt / missing / uncommitted checkpoints, retention,
async-save consistency, and an S3 outage with recovery."""

import logging
import multiprocessing
import os
import random
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from checkpoint import CheckpointManager
from ftrain.state.manifest import CheckpointError, FileEntry, Manifest
from ftrain.testbeds.local_storage import S3Server, free_port  # (fixtures s3_server, gcs_server: conftest)


@pytest.fixture(params=["local", "s3", "gcs"])
def make_manager(request, tmp_path):
    """Factory of managers on one fresh URI of the requested backend."""
    prefix = f"ckpt-{uuid.uuid4().hex[:8]}"
    if request.param == "local":
        uri, opts = str(tmp_path / prefix), None
    else:
        server = request.getfixturevalue(f"{request.param}_server")
        uri, opts = server.uri(prefix), server.storage_options

    def make(**kwargs) -> CheckpointManager:
        return CheckpointManager(uri, storage_options=opts, **kwargs)

    return make


def full_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w32": torch.randn(16, 8, generator=g),
            "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
            "f16": torch.randn(3, 5, generator=g).half(),
            "i64": torch.randint(-1000, 1000, (11,), generator=g),
            "mask": torch.rand(6, generator=g) > 0.5,
            "u8": torch.randint(0, 255, (4,), generator=g, dtype=torch.uint8),
            "nested": {"deep": {"c64": torch.randn(2, 2, dtype=torch.complex64, generator=g)}},
        },
        "optim": {"step": seed, "lr": 0.1 * seed, "betas": [0.9, 0.95], "name": f"adam{seed}"},
        "rng": {
            "torch": torch.Generator().manual_seed(seed).get_state(),
            "python": random.Random(seed).getstate(),
            "numpy": np.random.RandomState(seed).get_state(),
            "raw": bytes([seed % 256, 1, 2, 3]),
        },
    }


def assert_state_equal(a, b):
    assert type(a) is type(b) or isinstance(a, torch.Tensor), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def save_and_commit(m: CheckpointManager, step: int, shards=("model_tp0", "rng_rank0")) -> Manifest:
    files = []
    for i, name in enumerate(shards):
        files += m.save_shard(step, name, full_state(step * 10 + i))
    return m.commit(step, {"tp": 1, "shards": list(shards)}, files, extra={"loss": 1.0 / step})


def load(m: CheckpointManager, step: int, name: str, manifest=None) -> dict:
    return m.load_shard(step, name, full_state(999), manifest)


def flip_byte(m: CheckpointManager, step: int, rel: str) -> None:
    path = f"{m.root}/step_{step:08d}/{rel}"
    data = bytearray(m.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    m.fs.pipe_file(path, bytes(data))


def test_round_trip(make_manager):
    m = make_manager()
    manifest = save_and_commit(m, 3)
    assert m.step_uri(3) == f"{m.uri}/step_00000003"
    assert manifest.step == 3 and manifest.extra == {"loss": 1.0 / 3}
    assert {f.path.split("/")[0] for f in manifest.files} == {"model_tp0", "rng_rank0"}
    assert all(f.size > 0 and len(f.sha256) == 64 for f in manifest.files)
    assert m.read_manifest(3) == manifest
    for i, name in enumerate(["model_tp0", "rng_rank0"]):
        target = full_state(999)
        out = m.load_shard(3, name, target, manifest)
        assert out is target
        assert_state_equal(target, full_state(30 + i))
    assert_state_equal(load(m, 3, "model_tp0"), full_state(30))  # without a manifest too
    # A fresh manager (another process, e.g. a spare) sees the same.
    m2 = make_manager()
    assert m2.committed_steps() == [3] and m2.latest_verified() == manifest
    with pytest.raises(CheckpointError, match="no files of shard 'nope'|lists no files"):
        m2.load_shard(3, "nope", {}, manifest)


def test_verified_load_reads_local_files_once(make_manager, monkeypatch):
    """After the ranks verified a checkpoint, loading it does not hash local files again (sizes
    are still checked); a downloaded copy is always hashed, being what gets loaded."""
    from ftrain.state import checkpoint_io

    m = make_manager()
    manifest = save_and_commit(m, 3)
    hashed = []
    real = checkpoint_io.sha256_local
    monkeypatch.setattr(checkpoint_io, "sha256_local", lambda p: (hashed.append(p), real(p))[1])
    assert_state_equal(m.load_shard(3, "model_tp0", full_state(999), manifest, verified=True), full_state(30))
    assert bool(hashed) == (m.local_dir(3, "model_tp0") is None)
    if m.local_dir(3, "model_tp0") is not None:
        victim = next(f for f in manifest.files if f.path.startswith("model_tp0/"))
        m.fs.pipe_file(f"{m.root}/step_00000003/{victim.path}", b"x")  # truncated after verification
        with pytest.raises(CheckpointError, match="size 1 bytes"):
            m.load_shard(3, "model_tp0", full_state(999), manifest, verified=True)


def test_commit_rule(make_manager, monkeypatch):
    m = make_manager()
    files = m.save_shard(1, "model_tp0", full_state(1))
    # Saved but not committed: invisible.
    assert m.committed_steps() == [] and m.latest_verified() is None
    assert not m.fs.exists(f"{m.root}/latest")
    with pytest.raises(CheckpointError, match="not committed"):
        m.read_manifest(1)
    # A commit naming a file that is missing or has the wrong size writes nothing.
    bogus = [*files, FileEntry("model_tp1/__0_0.distcp", 10, "0" * 64)]
    with pytest.raises(CheckpointError, match=r"model_tp1/__0_0.distcp: missing"):
        m.commit(1, {}, bogus)
    wrong = [FileEntry(files[0].path, files[0].size + 1, files[0].sha256), *files[1:]]
    with pytest.raises(CheckpointError, match="size"):
        m.commit(1, {}, wrong)
    assert m.committed_steps() == [] and not m.fs.exists(f"{m.root}/latest")
    # manifest.json is written before latest; dicts (as gathered over Ray) are accepted.
    writes = []
    original = m._write_atomic
    monkeypatch.setattr(m, "_write_atomic", lambda p, d: (writes.append(p.rsplit("/", 1)[1]), original(p, d)))
    m.commit(1, {"tp": 1}, [f.__dict__ for f in files])
    assert writes == ["manifest.json", "latest"]
    assert m.fs.cat_file(f"{m.root}/latest") == b"1"
    assert m.committed_steps() == [1] and m.latest_verified().step == 1


def test_half_written_checkpoint_is_skipped(make_manager, caplog):
    m = make_manager()
    save_and_commit(m, 1)
    m.save_shard(2, "model_tp0", full_state(20))  # rank died before the rest / before commit
    assert m.committed_steps() == [1]
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        best = m.latest_verified()
    assert best.step == 1
    assert "step_00000002" in caplog.text and "not committed" in caplog.text
    assert_state_equal(load(m, 1, "model_tp0", best), full_state(10))


def test_corrupt_and_missing_files_fall_back(make_manager, caplog):
    m = make_manager(keep_last=3)
    for step in (1, 2, 3):
        save_and_commit(m, step)
    m3 = m.read_manifest(3)
    victim = next(f.path for f in m3.files if f.path.endswith("distcp") and f.size > 0)
    flip_byte(m, 3, victim)  # same size, different bytes
    gone = m.read_manifest(2).files[0].path
    m.fs.rm(f"{m.root}/step_00000002/{gone}")
    assert m.verify(3) == [f"{victim}: sha256 mismatch"]
    assert m.verify(2) == [f"{gone}: missing"]
    assert m.verify(1) == []
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        best = m.latest_verified()
    assert best.step == 1
    assert "step_00000003" in caplog.text and "sha256 mismatch" in caplog.text
    assert "step_00000002" in caplog.text and f"{gone}: missing" in caplog.text
    with pytest.raises(CheckpointError, match="failed verification.*sha256 mismatch"):
        m.load_shard(3, victim.split("/")[0], full_state(0), m3)


def test_missing_or_garbled_manifest(make_manager, caplog):
    m = make_manager(keep_last=5)
    for step in (1, 2, 3):
        save_and_commit(m, step)
    m.fs.rm(f"{m.root}/step_00000003/manifest.json")
    m.fs.pipe_file(f"{m.root}/step_00000002/manifest.json", b'{"step": 2, "files": [')
    assert m.committed_steps() == [1]
    with pytest.raises(CheckpointError, match="not committed"):
        m.read_manifest(3)
    with pytest.raises(CheckpointError, match="invalid"):
        m.read_manifest(2)
    assert m.verify(3) and m.verify(2)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert m.latest_verified().step == 1
    assert "step_00000003" in caplog.text and "step_00000002" in caplog.text


def test_a_manifest_with_a_missing_field_is_skipped_with_a_warning_naming_the_step(make_manager, caplog):
    m = make_manager(keep_last=5)
    for step in (1, 2):
        save_and_commit(m, step)
    m.fs.pipe_file(f"{m.root}/step_00000002/manifest.json", b'{"step": 2, "layout": {}, "extra": {}}')
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert [x.step for x in m.committed_manifests()] == [1]
    assert "skipping checkpoint step 2: invalid" in caplog.text


def test_a_state_that_does_not_fit_the_checkpoint_names_step_shard_and_key(make_manager, caplog):
    """A key missing from the checkpoint or of another shape: CheckpointMismatch (a bad checkpoint
    for this run) naming the step, the shard and the key; a key only the checkpoint has: a warning."""
    from ftrain.state.manifest import CheckpointMismatch

    m = make_manager()
    m.commit(1, {}, m.save_shard(1, "model", {"a": torch.ones(3), "b": torch.ones(2)}))
    manifest = m.latest_verified()
    with pytest.raises(CheckpointMismatch, match=r"step_00000001/model.*Missing key.*: c"):
        m.load_shard(1, "model", {"a": torch.zeros(3), "b": torch.zeros(2), "c": torch.zeros(1)}, manifest)
    with pytest.raises(CheckpointMismatch, match=r"step_00000001/model.*Size mismatch.* for a"):
        m.load_shard(1, "model", {"a": torch.zeros(4), "b": torch.zeros(2)}, manifest)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert torch.equal(m.load_shard(1, "model", {"a": torch.zeros(3)}, manifest)["a"], torch.ones(3))
    assert "step_00000001/model: the checkpoint holds keys this run does not load: b" in caplog.text


def test_retention_keep_last(make_manager):
    m = make_manager(keep_last=2)
    save_and_commit(m, 1)
    save_and_commit(m, 2)
    m.save_shard(3, "model_tp0", full_state(3))  # stale: never committed
    m.save_shard(9, "model_tp0", full_state(9))  # newer than any commit: a save in flight
    save_and_commit(m, 4)
    assert m.committed_steps() == [2, 4]
    save_and_commit(m, 5)
    assert m.committed_steps() == [4, 5]
    steps_left = sorted(p.rsplit("/", 1)[1] for p in m.fs.ls(m.root, detail=False))
    assert steps_left == ["latest", "step_00000004", "step_00000005", "step_00000009"]
    assert m.latest_verified().step == 5


@pytest.mark.parametrize("make_manager", ["local", "s3"], indirect=True)
def test_async_save_snapshots_at_call(make_manager):
    m = make_manager()
    state = {"w": torch.zeros(1 << 20), "meta": {"step": 1, "seen": [1]}}
    fut = m.async_save_shards(1, {"model_tp0": state, "rng": {"seed": 3}})
    state["w"].add_(1.0)  # training goes on while the write runs
    state["meta"]["seen"].append(2)
    fut2 = m.async_save_shards(2, {"model_tp0": state})  # waits for the first save
    assert fut.done()
    m.wait()
    m.commit(1, {}, fut.result())
    m.commit(2, {}, fut2.result())
    out = {"w": torch.full((1 << 20,), 7.0), "meta": {"step": 0, "seen": []}}
    m.load_shard(1, "model_tp0", out, m.read_manifest(1))
    assert torch.count_nonzero(out["w"]) == 0 and out["meta"] == {"step": 1, "seen": [1]}
    assert m.load_shard(1, "rng", {"seed": 0}, m.read_manifest(1)) == {"seed": 3}
    m.load_shard(2, "model_tp0", out, m.read_manifest(2))
    assert torch.all(out["w"] == 1.0) and out["meta"]["seen"] == [1, 2]
    # An error in the background save comes back from wait() / the future.
    m.async_save_shards(3, {"model_tp0": {"bad": lambda: None}})  # not picklable
    with pytest.raises(CheckpointError, match="shard 'model_tp0'"):
        m.wait()


def test_bad_arguments(tmp_path):
    m = CheckpointManager(f"file://{tmp_path}/c")
    with pytest.raises(ValueError):
        m.save_shard(1, "../escape", {})
    files = m.save_shard(1, "a", {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match="twice"):
        m.commit(1, {}, files + files)
    with pytest.raises(CheckpointError, match="JSON"):
        m.commit(1, {"bad": object()}, files)
    with pytest.raises(CheckpointError, match="loading shard 'a'"):
        m.load_shard(1, "a", {"x": torch.ones(3)})  # wrong shape
    assert m.committed_steps() == []
    with pytest.raises(ValueError):
        CheckpointManager(str(tmp_path), keep_last=0)


def test_put_files_takes_the_hashes_made_while_writing(tmp_path):
    """A file the writer hashed as it wrote it is not read again: its entry carries the given
    sha256 (a wrong one here, so a re-read would show); the others are hashed from disk. A
    hashed file whose size on disk differs is refused."""
    import hashlib

    m = CheckpointManager(str(tmp_path / "c"))
    d = m.local_dir(1, "megatron")
    os.makedirs(d)
    for name, data in (("a", b"abc"), ("b", b"defg")):
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    entries = m.put_files(1, d, "megatron", ["a", "b"], hashed={"a": (3, "f" * 64)})
    assert entries == [FileEntry("megatron/a", 3, "f" * 64),
                       FileEntry("megatron/b", 4, hashlib.sha256(b"defg").hexdigest())]
    with pytest.raises(CheckpointError, match="a: 3 bytes, 2 written"):
        m.put_files(1, d, "megatron", ["a", "b"], hashed={"a": (2, "f" * 64)})


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_a_large_file_uploads_in_parallel_parts(backend, request, tmp_path, monkeypatch):
    """With 5 MiB parts, a 21 MB file goes up in 5 parts at once (S3: s3fs's multipart
    upload, seen as UploadPart requests in flight together; GCS: part objects written from
    several threads, composed in order, then deleted) and arrives byte for byte; a small file
    beside it goes up whole. A failed compose leaves no part behind."""
    import hashlib

    server = request.getfixturevalue(f"{backend}_server")
    m = CheckpointManager(server.uri(f"parts-{uuid.uuid4().hex[:8]}"), storage_options=server.storage_options,
                          part_bytes=5 << 20)
    big = os.urandom(4 * (5 << 20) + 12345)
    os.makedirs(tmp_path / "stage")
    (tmp_path / "stage" / "big").write_bytes(big)
    (tmp_path / "stage" / "small").write_bytes(b"small")
    shard_dir = f"{m.root}/step_00000001/shard"
    seen = {"parts": 0, "in_flight": 0, "most_in_flight": 0, "threads": set(), "merged": []}
    if backend == "s3":
        def before(**_):
            seen["parts"] += 1
            seen["in_flight"] += 1
            seen["most_in_flight"] = max(seen["most_in_flight"], seen["in_flight"])

        def after(**_):
            seen["in_flight"] -= 1

        m.fs.connect()
        m.fs.s3.meta.events.register("before-call.s3.UploadPart", before)
        m.fs.s3.meta.events.register("after-call.s3.UploadPart", after)
    else:
        fs_open, fs_merge = m.fs.open, m.fs.merge

        def open_part(path, mode="rb", **kwargs):
            if ".part-" in path:
                seen["parts"] += 1
                seen["threads"].add(threading.current_thread().name)
            return fs_open(path, mode, **kwargs)

        monkeypatch.setattr(m.fs, "open", open_part)
        monkeypatch.setattr(m.fs, "merge", lambda path, parts: (seen["merged"].append(parts), fs_merge(path, parts)))

    entries = m.put_files(1, str(tmp_path / "stage"), "shard", ["big", "small"])
    assert entries == [FileEntry("shard/big", len(big), hashlib.sha256(big).hexdigest()),
                       FileEntry("shard/small", 5, hashlib.sha256(b"small").hexdigest())]
    assert hashlib.sha256(m.fs.cat_file(f"{shard_dir}/big")).digest() == hashlib.sha256(big).digest()
    assert m.fs.cat_file(f"{shard_dir}/small") == b"small"
    assert seen["parts"] == 5, seen
    if backend == "s3":
        assert seen["most_in_flight"] > 1, seen
    else:
        assert len(seen["threads"]) > 1, seen
        (parts,) = seen["merged"]
        assert [p.rsplit("-", 1)[1] for p in parts] == ["00", "01", "02", "03", "04"]
        m.fs.invalidate_cache()
        assert sorted(p.rsplit("/", 1)[1] for p in m.fs.find(shard_dir)) == ["big", "small"]

        def refuse(path, parts):
            raise RuntimeError("compose refused")

        monkeypatch.setattr(m.fs, "merge", refuse)
        with pytest.raises(CheckpointError, match="compose refused"):
            m.put_files(2, str(tmp_path / "stage"), "shard", ["big"])
        m.fs.invalidate_cache()
        assert m.fs.find(f"{m.root}/step_00000002") == []


def test_s3_outage_and_recovery(tmp_path):
    server = S3Server().start()  # own server: stopping it must not disturb other tests
    try:
        m = CheckpointManager(
            server.uri("outage"), storage_options=server.storage_options,
            max_retries=10, retry_backoff_s=0.05, retry_budget_s=1.0,
        )
        first = save_and_commit(m, 1)
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=r"s3://test-bucket/outage/step_00000002/model_tp0.*attempts"):
            m.save_shard(2, "model_tp0", full_state(20))
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(CheckpointError):  # an outage is not "no checkpoint"
            m.latest_verified()
        server.start()  # same port, same objects
        assert m.latest_verified() == first
        assert_state_equal(load(m, 1, "model_tp0", first), full_state(10))
        assert save_and_commit(m, 2).step == 2
        assert m.latest_verified().step == 2
        # A short blip inside the retry budget is ridden out.
        m.retry_budget_s = 10.0
        server.stop()
        threading.Timer(0.5, server.start).start()
        assert m.save_shard(3, "model_tp0", full_state(30))
        assert save_and_commit(m, 3).step == 3
    finally:
        time.sleep(0.6)
        server.stop()



@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_endpoint_and_credentials_from_env(backend, request, monkeypatch):
    server = request.getfixturevalue(f"{backend}_server")
    if backend == "s3":
        for k, v in dict(AWS_ENDPOINT_URL=server.endpoint_url, AWS_ACCESS_KEY_ID="testing",
                         AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1").items():
            monkeypatch.setenv(k, v)
    else:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint_url)
    m = CheckpointManager(server.uri(f"env-{uuid.uuid4().hex[:8]}"), storage_options={"skip_instance_cache": True})
    assert "testing" not in repr(m)
    assert save_and_commit(m, 1) == m.latest_verified()

def _rank_main(rank: int, port: int, uri: str, peer_dead, results) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    if rank == 1:
        os._exit(0)  # dies inside the group, no destroy
    peer_dead.wait(60)
    m = CheckpointManager(uri)
    files = m.save_shard(1, "model_tp0_pp0", {"w": torch.arange(4.0), "it": 7})
    m.commit(1, {"world_size": 2}, files)
    state = {"w": torch.zeros(4), "it": 0}
    m.load_shard(1, "model_tp0_pp0", state, m.latest_verified())
    results.put((state["w"].tolist(), state["it"]))


def test_no_collective_with_dead_peer(tmp_path):
    """Inside an initialized process group whose other rank is dead, save/commit/load finish."""
    ctx = multiprocessing.get_context("spawn")
    port, peer_dead, results = free_port(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(tmp_path), peer_dead, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[1].join(60)
    peer_dead.set()
    try:
        assert results.get(timeout=60) == ([0.0, 1.0, 2.0, 3.0], 7)
    finally:
        procs[0].join(10)
        for p in procs:
            if p.is_alive():
                p.kill()


def test_a_local_load_hashes_beside_the_load_and_a_mismatch_found_at_its_end_is_a_bad_checkpoint(make_manager, monkeypatch):
    """With its manifest, a local shard's files are size-checked, then hashed while the load
    runs (each file once, not a full pass before it); bytes changed at the same size load, and
    the mismatch found at the end raises CheckpointMismatch (a bad checkpoint: the caller
    discards the state and loads another). A sizes-only verify (`hash_files=False`) passes it.
    A downloaded copy that does not match is a bad checkpoint too, not storage down."""
    from ftrain.state import checkpoint_io
    from ftrain.state.manifest import CheckpointMismatch

    m = make_manager()
    manifest = save_and_commit(m, 1)
    if m.local_dir(1, "model_tp0") is None:  # object storage: a download is hashed before its load
        flip_byte(m, 1, next(f.path for f in manifest.files if f.path.startswith("model_tp0/") and f.size))
        with pytest.raises(CheckpointMismatch, match="sha256 mismatch"):
            m.load_shard(1, "model_tp0", full_state(999), manifest)
        return
    hashed = []
    real = checkpoint_io.sha256_local
    monkeypatch.setattr(checkpoint_io, "sha256_local", lambda p: (hashed.append(p), real(p))[1])
    assert_state_equal(m.load_shard(1, "model_tp0", full_state(999), manifest), full_state(10))
    shard_files = [f for f in manifest.files if f.path.startswith("model_tp0/")]
    assert sorted(hashed) == sorted(f"{m.local_dir(1, 'model_tp0')}/{f.path.split('/', 1)[1]}" for f in shard_files)
    victim = next(f.path for f in shard_files if f.path.endswith("distcp"))
    flip_byte(m, 1, victim)
    assert m.verify_files(1, manifest.files, hash_files=False) == []
    with pytest.raises(CheckpointMismatch, match=f"{victim}: sha256 mismatch.*discarded"):
        m.load_shard(1, "model_tp0", full_state(999), manifest)


@pytest.mark.parametrize("files, parts", [(7, 3), (2, 5), (6, 6), (0, 2)])
def test_the_shares_of_a_manifest_hold_each_file_once(files, parts):
    """`Manifest.share(r, n)`, what rank r of n checks before a load and hashes beside it: the n
    shares together hold every file exactly once (a share may be empty); a part outside
    [0, n) is refused."""
    m = Manifest(1, {}, [FileEntry(f"f{i}", i, "0" * 64) for i in range(files)], {}, 0.0)
    shares = [m.share(r, parts) for r in range(parts)]
    assert sorted((f.path for s in shares for f in s), key=lambda p: int(p[1:])) == [f.path for f in m.files]
    with pytest.raises(ValueError, match=f"share {parts} of {parts}"):
        m.share(parts, parts)
