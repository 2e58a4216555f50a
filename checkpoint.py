"""Checkpoints of sharded training state on a local disk, S3 or GCS, with no collectives.

Layout under the manager's URI (local path, ``file://``, ``s3://bucket/prefix``, ``gs://bucket/prefix``):

    {uri}/step_{N:08d}/{shard}/        files torch.distributed.checkpoint wrote for one shard owner
    {uri}/step_{N:08d}/manifest.json   written last, by the driver: the commit point
    {uri}/latest                       step number of the newest commit (a hint for people/tools)

Protocol
  1. Each shard owner (e.g. ``model_tp0_pp0_cp0``, ``rng_rank3``) calls ``save_shard`` for its
     own shard (or ``async_save_shards`` for all of them at once). DCP runs with ``no_dist=True``:
     no collective, so a dead peer can never block a save. The call returns the files it wrote
     (size, sha256).
  2. The driver gathers those ``FileEntry`` lists (over Ray) and calls ``commit``: every file must
     exist with its size, then ``manifest.json`` is written, then ``latest``, then retention.
  3. Restore: the newest committed step whose files all verify is picked (``latest_verified()``
     on one process, or ``verify_files`` on a share of the manifest per rank, in parallel, as
     the recovery protocol does); each owner calls ``load_shard(step, name, state_dict,
     manifest)``, which re-checks its files' sha256 first.

Failure cases
  - An owner dies mid-save, or the driver never commits: the step directory has no manifest, so
    it is never loaded; retention deletes it once a newer step commits.
  - The driver dies between manifest and ``latest``: the step is committed (the manifest decides).
  - Bytes rot or a file disappears after the commit: ``verify`` finds it (size, sha256) and
    ``latest_verified`` falls back to an older checkpoint, logging a warning for each one skipped.
  - Storage outage: transient errors are retried with exponential backoff, at most ``max_retries``
    times within ``retry_budget_s``; then ``CheckpointError``. A single request is bounded only by
    the client's own timeouts (S3: ``config_kwargs`` connect/read timeouts in storage_options;
    gcsfs retries a refused connection internally for about 30 s).

A run's manifests record its ``model_signature`` and its identity (``extra["run"]``: name, id,
config fingerprint; ``run_identity.py``); ``check_compatible`` refuses a checkpoint of another
model (or a layout the torch engine cannot load) with a ConfigError naming both sides, and
``committed_manifests(run_id)`` / ``latest_verified(run_id)`` skip the checkpoints of other runs.

Remote shards are written by DCP into a private local staging directory (``tempfile``, honours
``TMPDIR``), hashed there, then uploaded with fsspec (concurrent files; a large file in parallel
parts: s3fs multipart, GCS parallel composite upload; ``part_bytes``).
Loads download into staging, check the hashes, then read. Local URIs are written and read in place.
For the GCS emulator set ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before gcsfs is imported.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
import warnings
from typing import Any, Callable

import fsspec
import fsspec.callbacks
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ftrain.config import CheckpointConfig, ConfigError
from ftrain.state.checkpoint_io import (IO, as_checkpoint_error, check_local_file, describe, hashed_beside,
                                        is_transient, no_zip_crc32, sha256_local, sha256_of)
from ftrain.state.manifest import (LATEST, MANIFEST, CheckpointError, CheckpointMismatch, FileEntry, Manifest,
                                   parse_manifest, step_dir)
from ftrain.state.safe_load import SafeReader

logger = logging.getLogger(__name__)
# DCP warns on every no_dist call that it "assumes a single process": that is the intent here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_WRITE_THREADS = 1  # >1 loses errors: DCP (torch 2.13) only prints exceptions of its extra writer threads
_COMPOSE_MAX = 32  # source objects of one GCS compose request, at most
_PART_STREAMS = 16  # GCS part objects uploaded at once
_PART_BLOCK = 16 << 20  # bytes: a part's read size and its gcsfs write block (a multiple of 256 KiB)
PROBE_BUDGET_S = 10.0  # retries of the start-up storage probe: a wrong endpoint is reported in seconds


class _NotCommitted(CheckpointError):
    """manifest.json is missing or does not parse (as opposed to storage being unreachable)."""


class _InvalidManifest(_NotCommitted):
    """manifest.json is there but does not parse or names another step: a damaged checkpoint."""


class _ProgressCallback(fsspec.callbacks.Callback):
    """fsspec transfer callback: bytes as the client reports them, to `IO`."""

    def relative_update(self, inc: int = 1) -> None:
        IO.moved(inc)

    def branched(self, path_1, path_2, **kwargs):  # per-file callbacks of a multi-file transfer
        return _ProgressCallback()


class CheckpointManager:
    """Saves, commits, verifies and loads checkpoints under one URI. Safe to use from one actor's
    threads; several processes may share a URI as long as each shard name has one writer and one
    driver commits.

    Args:
        uri: root of the checkpoints (see module docstring).
        keep_last: committed checkpoints kept by retention (>= 1).
        storage_options: passed to fsspec (e.g. S3 ``key``/``secret``/``client_kwargs``, GCS
            ``token``/``endpoint_url``). Without them the usual env vars apply (AWS_ENDPOINT_URL,
            AWS_ACCESS_KEY_ID, ..., STORAGE_EMULATOR_HOST). Never logged.
        max_retries: retries of one storage operation after its first failure.
        retry_backoff_s: first retry delay in seconds, doubled each retry.
        retry_budget_s: a storage operation gives up (CheckpointError) when the next retry would
            start later than this many seconds after its first attempt.
        part_bytes: object storage uploads a file of at least two such parts in parallel parts
            (``put_files``): S3 parts of this size (at least 5 MiB; larger when a file would
            need more than 10,000), GCS at most 32 parts of at least this size.
    """

    def __init__(
        self,
        uri: str,
        keep_last: int = 2,
        storage_options: dict | None = None,
        max_retries: int = 5,
        retry_backoff_s: float = 0.5,
        retry_budget_s: float = 60.0,
        part_bytes: int = 64 << 20,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.part_bytes = part_bytes
        self.uri = str(uri).rstrip("/")
        self.keep_last = keep_last
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.retry_budget_s = retry_budget_s
        self.fs, root = fsspec.core.url_to_fs(self.uri, **(storage_options or {}))
        self.root = root.rstrip("/")
        self._local = "file" in _protocols(self.fs)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._pending_what = ""
        self.load_warnings: list[str] = []  # what loads noticed without failing (`load_shard`), for the driver

    @classmethod
    def from_config(cls, k: CheckpointConfig) -> CheckpointManager:
        """The manager of a run's `checkpoint.*` settings (driver and actors build the same one)."""
        return cls(k.uri, k.keep_last, retry_budget_s=k.retry_budget_s)

    def __repr__(self) -> str:  # no storage_options: they may hold credentials
        return f"CheckpointManager({self.uri!r}, keep_last={self.keep_last})"

    # ---------------------------------------------------------------- paths
    def step_uri(self, step: int) -> str:
        """URI of the directory of checkpoint ``step``."""
        return f"{self.uri}/{step_dir(step)}"

    def _step_path(self, step: int) -> str:
        return f"{self.root}/{step_dir(step)}"

    # ---------------------------------------------------------------- save
    def save_shard(self, step: int, name: str, state_dict: dict) -> list[FileEntry]:
        """Write ``state_dict`` (nested dicts/lists of tensors and picklable objects) as shard
        ``name`` of ``step``; synchronous. Returns the files written, paths relative to the step
        directory. A shard saved again replaces the earlier one. Transient storage errors are
        retried; raises CheckpointError past the retry limits or on any other error."""
        _check_name(name)
        where = f"{self.step_uri(step)}/{name}"
        what = f"saving shard {name!r} to {where}"
        if self._local:
            target = f"{self._step_path(step)}/{name}"
            self._retry(what, _dcp_save_fresh, state_dict, target, True)
            return self.put_files(step, target, name, sorted(os.listdir(target)))
        with tempfile.TemporaryDirectory(prefix="ckpt-stage-") as stage:
            with IO.operation(self.retry_budget_s):
                as_checkpoint_error(what, _dcp_save_fresh, state_dict, stage, False)
            return self.put_files(step, stage, name, sorted(os.listdir(stage)))

    def local_dir(self, step: int, name: str) -> str | None:
        """The directory of shard ``name`` of ``step`` on this machine's file system for a local
        URI (a writer writes there in place), or None for object storage (stage, then ``put_files``)."""
        return f"{self._step_path(step)}/{name}" if self._local else None

    def put_files(self, step: int, local_dir: str, name: str, names: list[str],
                  hashed: dict[str, tuple[int, str]] | None = None) -> list[FileEntry]:
        """Hash the files ``names`` of ``local_dir`` and, for object storage, upload them to shard
        ``name`` of ``step`` (``_upload``: files concurrently, large ones in parallel parts). ``hashed``:
        {file name: (size in bytes, sha256 hex)} of files the caller hashed as it wrote them;
        those are not read again (their size on disk must match). For a local URI ``local_dir``
        must be ``local_dir(step, name)`` (files written in place). Returns their FileEntry
        list (paths relative to the step directory) for ``commit``. Raises CheckpointError when
        a hashed file's size differs, or on storage failure past the retry limits."""
        _check_name(name)
        hashed = hashed or {}
        paths = {n: p for n in names if os.path.isfile(p := os.path.join(local_dir, n))}
        changed = [f"{n}: {os.path.getsize(p)} bytes, {hashed[n][0]} written" for n, p in paths.items()
                   if n in hashed and os.path.getsize(p) != hashed[n][0]]
        if changed:
            raise CheckpointError(f"files of shard {name!r} changed after they were written: {'; '.join(changed)}")
        unhashed = [n for n in paths if n not in hashed]
        # hashlib releases the GIL on large buffers: files hash in parallel.
        with concurrent.futures.ThreadPoolExecutor(max(1, min(8, len(unhashed))), thread_name_prefix="ckpt-hash") as pool:
            digests = dict(zip(unhashed, pool.map(sha256_local, [paths[n] for n in unhashed])))
        entries = [FileEntry(f"{name}/{n}", os.path.getsize(p), hashed[n][1] if n in hashed else digests[n])
                   for n, p in paths.items()]
        if self._local:
            if os.path.realpath(local_dir) != os.path.realpath(self.local_dir(step, name)):
                raise ValueError(f"{local_dir} is not {self.local_dir(step, name)}: write local shards in place")
            return entries
        local = [os.path.join(local_dir, e.path.split("/", 1)[1]) for e in entries]
        remote = [f"{self._step_path(step)}/{e.path}" for e in entries]
        self._retry(f"uploading shard {name!r} to {self.step_uri(step)}/{name}", self._upload, local, remote)
        return entries

    def _upload(self, local: list[str], remote: list[str]) -> None:
        """Upload the files `local` to the object paths `remote`, concurrently; a file of at
        least two `part_bytes` parts in parallel parts, with each library's own mechanism:
        S3, s3fs's multipart upload (`max_concurrency` parts in flight, 10 by default); GCS,
        whose resumable upload sends its chunks one after another, `_put_composite`."""
        sizes = [os.path.getsize(p) for p in local]
        if "gs" in _protocols(self.fs) or "gcs" in _protocols(self.fs):
            large = [i for i, n in enumerate(sizes) if n >= 2 * self.part_bytes]
            rest = [i for i in range(len(local)) if i not in large]
            if rest:
                self.fs.put([local[i] for i in rest], [remote[i] for i in rest], callback=_ProgressCallback())
            for i in large:
                self._put_composite(local[i], remote[i], sizes[i])
        elif "s3" in _protocols(self.fs):  # s3fs: multipart from 2 parts on, at most 10,000 parts
            self.fs.put(local, remote, chunksize=max(self.part_bytes, -(-max(sizes, default=0) // 10_000)),
                        callback=_ProgressCallback())
        else:
            self.fs.put(local, remote, callback=_ProgressCallback())

    def _put_composite(self, local: str, remote: str, size: int) -> None:
        """GCS parallel composite upload of the file `local` to `remote` (as gsutil's): its
        byte ranges go to at most `_COMPOSE_MAX` part objects beside `remote`, `_PART_STREAMS`
        of them at a time (gcsfs's file writer each, on gcsfs's event loop), then GCS composes
        them into `remote` (gcsfs `merge`) and the parts are deleted, also when a step failed."""
        n = min(_COMPOSE_MAX, -(-size // self.part_bytes))
        span = -(-size // n)
        parts = [f"{remote}.part-{uuid.uuid4().hex[:8]}-{i:02d}" for i in range(n)]

        def put_part(i: int) -> None:
            with open(local, "rb") as src, self.fs.open(parts[i], "wb", block_size=_PART_BLOCK) as dst:
                src.seek(i * span)
                left = min(span, size - i * span)
                while left:
                    if not (chunk := src.read(min(left, _PART_BLOCK))):
                        raise EOFError(f"{local} ended before byte {size}")
                    left -= dst.write(chunk)
                    IO.moved(len(chunk))

        try:
            with concurrent.futures.ThreadPoolExecutor(min(n, _PART_STREAMS), thread_name_prefix="ckpt-part") as pool:
                list(pool.map(put_part, range(n)))
            self.fs.merge(remote, parts)
        finally:
            try:
                self.fs.rm(parts)  # the ones that exist
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 (not in the manifest; deleted with their step)
                logger.warning("could not delete the upload parts of %s: %s", remote, describe(exc))

    def get_files(self, step: int, files: list[FileEntry], stage_dir: str) -> None:
        """Download ``files`` (manifest entries of ``step``) from object storage into
        ``stage_dir``/{entry path} (concurrent transfers) and check each one's size and sha256.
        Raises CheckpointMismatch naming every mismatched file (a bad checkpoint), CheckpointError
        on storage failure past the retry limits."""
        if not files:
            return
        remote = [f"{self._step_path(step)}/{f.path}" for f in files]
        local = [os.path.join(stage_dir, f.path) for f in files]
        for d in {os.path.dirname(p) for p in local}:
            os.makedirs(d, exist_ok=True)
        self._retry(f"downloading {len(files)} files of {self.step_uri(step)}", self.fs.get, remote, local,
                    callback=_ProgressCallback())
        problems = [p for f in files if (p := check_local_file(stage_dir, f))]
        if problems:  # a bad checkpoint, not storage down
            raise CheckpointMismatch(f"{self.step_uri(step)} failed verification: " + "; ".join(problems))

    def async_save_shards(self, step: int, shards: dict[str, dict]) -> concurrent.futures.Future:
        """Like ``save_shard`` for each {name: state_dict} of ``shards``, written one after the
        other in a background thread. First waits for this manager's previous pending save (its
        error, if any, stays in its future and is logged here), then copies every tensor to
        host memory before returning: later in-place changes to the tensors are not in the
        checkpoint. The future's result is the ``list[FileEntry]`` of all the shards."""
        self._wait_previous()
        snapshots = {name: _snapshot(state) for name, state in shards.items()}
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-save")
        self._pending = self._executor.submit(
            lambda: [f for name, state in snapshots.items() for f in self.save_shard(step, name, state)])
        self._pending_what = f"async save of shards {sorted(shards)} of step {step}"
        return self._pending

    def wait(self) -> None:
        """Wait for the pending async save; re-raises its error (CheckpointError)."""
        if self._pending is not None:
            self._pending.result()

    def _wait_previous(self) -> None:
        if self._pending is None:
            return
        concurrent.futures.wait([self._pending])
        if self._pending.exception() is not None:
            logger.warning("%s failed: %s", self._pending_what, self._pending.exception())

    # ---------------------------------------------------------------- load
    def load_shard(self, step: int, name: str, state_dict: dict, manifest: Manifest | None = None,
                   verified: bool = False) -> dict:
        """Load shard ``name`` of ``step`` into ``state_dict`` in place (tensors copied into,
        other values replaced) and return it. With ``manifest``, checks the size of this shard's
        files first and their sha256 beside the load (local files; a mismatch raises
        CheckpointMismatch after the load: discard the state); ``verified``: the caller has just
        hashed them (``verify_files``), so local files get the size check only (downloaded
        copies are always hashed before the load: they are what gets loaded). Raises
        CheckpointMismatch when ``state_dict`` does not fit the checkpoint (a key missing or of
        another shape; a key only the checkpoint has is logged and added to ``load_warnings``)
        or a file's sha256 does not match, CheckpointError on a missing shard, a size mismatch,
        or storage failure past the retry limits."""
        _check_name(name)
        where = f"{self.step_uri(step)}/{name}"
        expected = None
        if manifest is not None:
            if manifest.step != step:
                raise CheckpointError(f"manifest is for step {manifest.step}, not {step} ({where})")
            expected = [f for f in manifest.files if f.path.startswith(name + "/")]
            if not expected:
                raise CheckpointError(f"manifest of {self.step_uri(step)} lists no files of shard {name!r}")
        if self._local:
            return self._check_and_load(where, f"{self._step_path(step)}", name, expected, state_dict,
                                        hash_files=not verified)
        with tempfile.TemporaryDirectory(prefix="ckpt-stage-") as stage:
            if expected is not None:
                self.get_files(step, expected, stage)  # downloads and checks size + sha256
                return self._check_and_load(where, stage, name, None, state_dict)
            remote = self._retry(f"listing {where}", self._find, f"{self._step_path(step)}/{name}")
            if not remote:
                raise CheckpointError(f"no files of shard {name!r} at {where}")
            os.makedirs(os.path.join(stage, name))
            local = [os.path.join(stage, name, p.rsplit("/", 1)[1]) for p in remote]
            self._retry(f"downloading {where}", self.fs.get, remote, local, callback=_ProgressCallback())
            return self._check_and_load(where, stage, name, None, state_dict)

    def _check_and_load(self, where, step_dir, name, expected, state_dict, hash_files: bool = True) -> dict:
        """Load shard `name` from the local `step_dir` into `state_dict`. `expected` (its manifest
        entries): sizes checked first; with `hash_files`, their sha256 is computed beside the load
        (the load waits for no hashing pass; both read the same bytes, the second from the page
        cache), and a mismatch raises CheckpointMismatch once the load is done: the state it
        loaded into is then to be discarded (the caller loads another checkpoint)."""
        if expected is not None:
            problems = [p for f in expected if (p := check_local_file(step_dir, f, hash_file=False))]
            if problems:
                raise CheckpointError(f"shard {name!r} at {where} failed verification: " + "; ".join(problems))
        reader = SafeReader(os.path.join(step_dir, name))
        what = f"loading shard {name!r} from {where}"
        check = expected if expected is not None and hash_files else []
        with IO.operation(self.retry_budget_s), hashed_beside(step_dir, check, f"shard {name!r} at {where}"):
            as_checkpoint_error(what, dcp.load, state_dict, storage_reader=reader, no_dist=True, error=CheckpointMismatch)
        # dcp.load fails on a key the checkpoint lacks or of another shape, but loads a subset
        # silently: a key only the checkpoint has is named here.
        unexpected = sorted(set(reader.metadata.state_dict_metadata) - set(flatten_state_dict(state_dict)[0]))
        if unexpected:
            self.load_warnings.append(f"{where}: the checkpoint holds keys this run does not load: "
                                      f"{', '.join(unexpected[:20])}")
            logger.warning("%s", self.load_warnings[-1])
        return state_dict

    def check_writable(self, budget_s: float | None = None) -> None:
        """Write, read back and delete a small probe object under the URI, so a wrong endpoint,
        a missing bucket or no permission shows before training starts. `budget_s`: seconds of
        retries at most (default: `retry_budget_s`). Raises CheckpointError naming the URI and
        the endpoint tried."""
        probe, path = copy.copy(self), f"{self.root}/.probe-{uuid.uuid4().hex}"
        probe.retry_budget_s = min(self.retry_budget_s, budget_s or self.retry_budget_s)
        try:
            probe._retry(f"writing a probe to {self.uri}", self._write_atomic, path, b"ok")
            probe._retry(f"reading a probe from {self.uri}", self.fs.cat_file, path)
            probe._retry(f"deleting a probe from {self.uri}", self._rm, path, False)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (endpoint: {self.endpoint()})") from e

    def warm_client(self) -> None:
        """Make the object-storage client now, with one small request (a spare does it while
        warming): its first request loads the client's service descriptions, seconds of CPU on a
        busy host in calls that hold the GIL, which would otherwise fall in a recovery's load,
        where the rank could answer no heartbeat. Nothing for a local URI; errors are only
        logged (the request that needs storage reports them)."""
        if self._local:
            return
        try:
            self.fs.exists(f"{self.root}/{LATEST}")
        except Exception as exc:  # noqa: BLE001 (a warm-up; storage may be down now)
            logger.debug("warming the storage client of %s: %s", self.uri, describe(exc))

    def endpoint(self) -> str:
        """The storage endpoint this manager talks to, for messages (no credentials)."""
        if self._local:
            return "the local file system"
        endpoint = ((getattr(self.fs, "client_kwargs", None) or {}).get("endpoint_url")
                    or getattr(self.fs, "_location", None))  # s3fs's setting; gcsfs's resolved one
        if endpoint is None and self.fs.protocol[0] in ("s3", "s3a"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS's default"
        return endpoint or f"the default of {self.fs.protocol[0]}://"

    # ---------------------------------------------------------------- commit
    def commit(self, step: int, layout: dict, files: list[FileEntry], extra: dict | None = None) -> Manifest:
        """Commit checkpoint ``step``: check that every file in ``files`` (FileEntry or dicts of
        its fields, as gathered from the shard owners) exists with its size, write
        ``manifest.json`` last in the step directory, then ``latest``, then apply retention
        (failures of retention are logged, not raised). Raises CheckpointError naming each
        missing or wrong-sized file (nothing is written then), on layout/extra that JSON cannot
        encode, or on storage failure past the retry limits (if manifest.json was written before
        the failure, the step counts as committed: the manifest decides, ``latest`` is a hint)."""
        files = [FileEntry(**f) if isinstance(f, dict) else f for f in files]
        where = self.step_uri(step)
        dupes = [p for p, n in collections.Counter(f.path for f in files).items() if n > 1]
        if dupes:
            raise CheckpointError(f"cannot commit {where}: files listed twice: {sorted(dupes)}")
        sizes = self._retry(f"listing {where}", self._sizes, self._step_path(step))
        problems = []
        for f in files:
            if f.path not in sizes:
                problems.append(f"{f.path}: missing")
            elif sizes[f.path] != f.size:
                problems.append(f"{f.path}: size {sizes[f.path]} bytes, expected {f.size}")
        if problems:
            raise CheckpointError(f"cannot commit {where}: " + "; ".join(problems))
        manifest = Manifest(step, dict(layout), list(files), dict(extra or {}), time.time())
        try:
            data = json.dumps(dataclasses.asdict(manifest), indent=1, sort_keys=True).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"cannot commit {where}: layout/extra not JSON-serializable: {exc}") from exc
        manifest = parse_manifest(data)  # as readers will see it (tuples become lists, ...)
        self._retry(f"writing {where}/{MANIFEST}", self._write_atomic, f"{self._step_path(step)}/{MANIFEST}", data)
        self._retry(f"writing {self.uri}/{LATEST}", self._write_atomic, f"{self.root}/{LATEST}", str(step).encode())
        try:
            self._apply_retention(step)
        except CheckpointError as exc:
            logger.warning("retention after committing %s failed (will retry next commit): %s", where, exc)
        return manifest

    def _apply_retention(self, committed: int) -> None:
        """Keep the newest ``keep_last`` committed steps (and ``committed``); delete older
        committed steps (manifest first, so a half-deleted step is never taken as committed) and
        uncommitted step directories older than ``committed`` (newer ones may be saves in flight)."""
        steps = self._step_dirs()
        valid = [s for s in steps if self._manifest_or_none(s) is not None]
        keep = set(valid[-self.keep_last :]) | {committed}
        doomed = [s for s in valid if s not in keep] + [s for s in steps if s not in valid and s < committed]
        for s in doomed:
            path = self._step_path(s)
            logger.info("retention: deleting %s", self.step_uri(s))
            self._retry(f"deleting {self.step_uri(s)}", self._rm, f"{path}/{MANIFEST}", False)
            self._retry(f"deleting {self.step_uri(s)}", self._rm, path, True)

    # ---------------------------------------------------------------- inspect
    def committed_steps(self) -> list[int]:
        """Ascending steps whose manifest.json exists and parses (contents are not verified)."""
        return [m.step for m in self.committed_manifests()]

    def committed_manifests(self, run_id: str | None = None) -> list[Manifest]:
        """Manifests of the committed steps, ascending (one read each; files not verified).
        With ``run_id``, only that run's (``Manifest.run_id``); each other one is skipped with
        a warning naming its run."""
        found = [m for s in self._step_dirs() if (m := self._manifest_or_none(s)) is not None]
        if run_id is None:
            return found
        for m in found:
            if m.run_id != run_id:
                logger.warning("skipping checkpoint %s: written by run %s, not by this run %s",
                               self.step_uri(m.step), m.run_id, run_id)
        return [m for m in found if m.run_id == run_id]

    def uncommitted_steps(self) -> list[int]:
        """Ascending steps that have a directory but no valid manifest (saves in flight,
        abandoned or damaged)."""
        return [s for s in self._step_dirs() if self._manifest_or_none(s) is None]

    def clear(self) -> list[int]:
        """Delete every step directory (committed or not; manifests first, so a half-deleted
        step is never taken as committed) and ``latest``; returns the steps deleted. Raises
        CheckpointError on storage failure past the retry limits."""
        steps = self._step_dirs()
        for s in steps:
            self._retry(f"deleting {self.step_uri(s)}", self._rm, f"{self._step_path(s)}/{MANIFEST}", False)
            self._retry(f"deleting {self.step_uri(s)}", self._rm, self._step_path(s), True)
        self._retry(f"deleting {self.uri}/{LATEST}", self._rm, f"{self.root}/{LATEST}", False)
        return steps

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``. Raises CheckpointError if it is missing (step not
        committed), does not parse, or storage fails past the retry limits."""
        where = f"{self.step_uri(step)}/{MANIFEST}"
        try:
            data = self._retry(f"reading {where}", self.fs.cat_file, f"{self._step_path(step)}/{MANIFEST}")
        except CheckpointError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise _NotCommitted(f"no {MANIFEST} at {self.step_uri(step)}: step {step} is not committed") from None
            raise
        try:
            manifest = parse_manifest(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise _InvalidManifest(f"invalid {where}: {exc!r}") from exc
        if manifest.step != step:
            raise _InvalidManifest(f"invalid {where}: it names step {manifest.step}")
        return manifest

    def verify(self, step: int) -> list[str]:
        """Problems of checkpoint ``step``: no/invalid manifest, missing files, size or sha256
        mismatches (each string names the file). Empty list = good. Reads every byte. Raises
        CheckpointError only when storage fails past the retry limits."""
        return self._verify(step)[1]

    def _verify(self, step: int, run_id: str | None = None) -> tuple[Manifest | None, list[str]]:
        try:
            manifest = self.read_manifest(step)
        except _NotCommitted as exc:
            return None, [str(exc)]
        if run_id is not None and manifest.run_id != run_id:  # not read further: not ours
            return manifest, [f"written by run {manifest.run_id}, not by this run {run_id}"]
        return manifest, self.verify_files(step, manifest.files)

    def verify_files(self, step: int, files: list[FileEntry], hash_files: bool = True) -> list[str]:
        """Problems of ``files`` (entries of step ``step``'s manifest): missing, size or sha256
        mismatch; empty list = good. Reads every byte of them, 8 files at a time (without
        ``hash_files``: sizes only, for a loader that hashes as it loads). Several processes can
        each verify a part of a manifest in parallel. Raises CheckpointError only when storage
        fails past the retry limits."""
        step_path = self._step_path(step)
        sizes = self._retry(f"listing {self.step_uri(step)}", self._sizes, step_path)

        def check(f: FileEntry) -> str | None:
            if f.path not in sizes:
                return f"{f.path}: missing"
            if sizes[f.path] != f.size:
                return f"{f.path}: size {sizes[f.path]} bytes, expected {f.size}"
            if not hash_files:
                return None
            where = f"{self.step_uri(step)}/{f.path}"
            digest = self._retry(f"reading {where}", self._sha256, f"{step_path}/{f.path}")
            return None if digest == f.sha256 else f"{f.path}: sha256 mismatch"

        with concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="ckpt-verify") as pool:
            return [p for p in pool.map(check, files) if p]

    def latest_verified(self, run_id: str | None = None) -> Manifest | None:
        """Newest committed checkpoint whose files all verify (with ``run_id``: of that run,
        others are skipped as ``committed_manifests`` does); logs a warning naming each newer
        step skipped and why (uncommitted, corrupt, missing files, another run). None if there
        is none. Raises CheckpointError when storage fails past the retry limits (an outage is
        not "no checkpoint")."""
        for step in reversed(self._step_dirs()):
            manifest, problems = self._verify(step, run_id)
            if not problems:
                return manifest
            logger.warning("skipping checkpoint %s: %s", self.step_uri(step), "; ".join(problems))
        return None

    # ---------------------------------------------------------------- storage helpers
    def _retry(self, what: str, fn: Callable, *args, **kwargs) -> Any:
        """Run ``fn``; retry transient storage errors with exponential backoff within
        ``max_retries`` and ``retry_budget_s``. Every failure ends as CheckpointError."""
        with IO.operation(self.retry_budget_s):
            return self._retry_loop(what, fn, *args, **kwargs)

    def _retry_loop(self, what: str, fn: Callable, *args, **kwargs) -> Any:
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn(*args, **kwargs)
            except CheckpointError:
                raise
            except (Exception, dcp.CheckpointException) as exc:
                elapsed = time.monotonic() - start
                delay = self.retry_backoff_s * 2**attempt
                if not is_transient(exc):
                    raise CheckpointError(f"{what} failed: {describe(exc)}") from exc
                if attempt >= self.max_retries or elapsed + delay > self.retry_budget_s:
                    raise CheckpointError(
                        f"{what} failed after {attempt + 1} attempts in {elapsed:.1f} s "
                        f"(max_retries={self.max_retries}, retry_budget_s={self.retry_budget_s}): {describe(exc)}"
                    ) from exc
                attempt += 1
                logger.warning("%s: transient error %s; retry %d/%d in %.2f s", what, describe(exc), attempt, self.max_retries, delay)
                time.sleep(delay)
                self.fs.invalidate_cache()

    def _step_dirs(self) -> list[int]:
        """Ascending steps that have a directory (committed or not)."""

        def ls() -> list[str]:
            self.fs.invalidate_cache(self.root)
            try:
                return self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []

        names = self._retry(f"listing {self.uri}", ls)
        return sorted(int(m.group(1)) for p in names if (m := _STEP_DIR.match(p.rstrip("/").rsplit("/", 1)[-1])))

    def _manifest_or_none(self, step: int) -> Manifest | None:
        """The manifest of `step`, or None when the step is not committed (no manifest: a save
        in progress or abandoned) or its manifest is damaged (skipped with a warning)."""
        try:
            return self.read_manifest(step)
        except _InvalidManifest as exc:
            logger.warning("skipping checkpoint step %d: %s", step, exc)
        except _NotCommitted:
            pass
        return None

    def _find(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        return sorted(self.fs.find(path))

    def _sizes(self, step_path: str) -> dict[str, int]:
        """{path relative to step_path: size in bytes} of every file under step_path."""
        self.fs.invalidate_cache(step_path)
        found = self.fs.find(step_path, detail=True)
        return {name[len(step_path) + 1 :]: int(info["size"]) for name, info in found.items()}

    def _sha256(self, path: str) -> str:
        with self.fs.open(path, "rb") as f:
            return sha256_of(f)

    def _write_atomic(self, path: str, data: bytes) -> None:
        """Readers see the old content or all of ``data``: rename locally; one PUT remotely."""
        if not self._local:
            self.fs.pipe_file(path, data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _rm(self, path: str, recursive: bool) -> None:
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass


# -------------------------------------------------------------------- module helpers
def check_uri(k: CheckpointConfig, budget_s: float = PROBE_BUDGET_S) -> None:
    """`checkpoint.uri` can be written (`CheckpointManager.check_writable`, at most `budget_s`
    seconds of retries). Needs no cluster: run it before Ray starts. Raises ConfigError naming
    the field, the URI and the endpoint."""
    try:
        CheckpointManager.from_config(k).check_writable(budget_s)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.uri: {e}; check the URI, endpoint and credentials") from None


def _protocols(fs) -> tuple:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _check_name(name: str) -> None:
    if not _SHARD_NAME.match(name) or name == MANIFEST:
        raise ValueError(f"invalid shard name {name!r}: use letters, digits, '_', '.', '-'")


def _dcp_save_fresh(state_dict: dict, directory: str, sync_files: bool) -> None:
    """DCP save into an emptied local directory (no stale files of an earlier attempt)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    writer = dcp.FileSystemWriter(directory, thread_count=_WRITE_THREADS, sync_files=sync_files)
    with no_zip_crc32():
        dcp.save(state_dict, storage_writer=writer, no_dist=True)


def _snapshot(obj: Any) -> Any:
    """Copy of a nested state dict: tensors cloned to host memory, other leaves deep-copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _snapshot(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_snapshot(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


