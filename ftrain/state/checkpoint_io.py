"""Checkpoint file I/O shared by the example's `checkpoint.CheckpointManager` and the engines'
writers: the process's I/O progress (a slow save is not a hang), which storage errors a retry
may cure, CheckpointError wrapping, sha256 of local files (beside a load, or checked against
a manifest), and torch.save without its zip CRC32."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.utils.serialization

from ftrain.state.manifest import CheckpointError, CheckpointMismatch, FileEntry

HASH_CHUNK = 8 << 20  # bytes


class IOProgress:
    """Progress of this process's checkpoint I/O, for the health monitor (`io_progress()` in
    each heartbeat: a slow save, verify or load is not a hang). Storage operations run inside
    `operation(stall_s)`; the transfer loops report bytes (`moved(n)`: written, uploaded,
    downloaded, hashed) at the granularity their client gives (a chunk, a part, a file).
    `counter()` is monotonic: the bytes moved, plus one per call while some operation is within
    its own deadline (`stall_s` seconds since it started or last moved bytes; a single request
    of a slow upload reports its bytes only when it ends). An operation silent past its own
    deadline stops the count, so the step deadline can name the rank hung. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes = self._ticks = 0
        self._ops: dict[int, list[float]] = {}  # id -> [stall_s, last movement (monotonic)]

    def moved(self, n: int) -> None:
        with self._lock:
            self._bytes += n
            now = time.monotonic()
            for op in self._ops.values():
                op[1] = now

    @contextlib.contextmanager
    def operation(self, stall_s: float):
        key = object()
        with self._lock:
            self._ops[id(key)] = [stall_s, time.monotonic()]
        try:
            yield
        finally:
            with self._lock:
                del self._ops[id(key)]

    def counter(self) -> int:
        with self._lock:
            now = time.monotonic()
            if any(now - last <= stall for stall, last in self._ops.values()):
                self._ticks += 1
            return self._bytes + self._ticks


IO = IOProgress()  # the process's checkpoint I/O (every manager of the process reports here)


def io_progress() -> int:
    """`IO.counter()`: this process's checkpoint I/O progress, for its heartbeat."""
    return IO.counter()


def as_checkpoint_error(what: str, fn: Callable, *args, error: type = CheckpointError, **kwargs) -> Any:
    """``fn(*args, **kwargs)``; any error it raises, DCP's CheckpointException (a
    BaseException) included, becomes ``error``("{what} failed: ..."), except that one caused by a
    CheckpointError raised inside stays of its kind: CheckpointMismatch (a bad checkpoint) or a
    plain CheckpointError (storage past its retry budget)."""
    try:
        return fn(*args, **kwargs)
    except (Exception, dcp.CheckpointException) as exc:
        inner = [e for e, _ in exc.failures.values()] if isinstance(exc, dcp.CheckpointException) else [exc]
        cls = next((c for c in (CheckpointMismatch, CheckpointError) if any(isinstance(e, c) for e in inner)), error)
        raise cls(f"{what} failed: {describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    """repr of the error; for DCP's CheckpointException, of the errors it wraps (no tracebacks)."""
    if isinstance(exc, dcp.CheckpointException):
        return "; ".join(repr(e) for e, _ in exc.failures.values()) or repr(exc)
    return repr(exc)


_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved = True


@contextlib.contextmanager
def no_zip_crc32():
    """torch.save (which DCP runs per tensor) computes a zip CRC32 of every byte, a full CPU pass
    (~1/3 of DCP's save time on CPU) that torch.load never checks; our integrity check is the
    manifest's sha256. The switch is process-global, so it is refcounted across saver threads
    and restored when the last one ends."""
    global _crc_users, _crc_saved
    cfg = torch.utils.serialization.config.save
    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = cfg.compute_crc32
            cfg.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                cfg.compute_crc32 = _crc_saved


def sha256_of(f) -> str:
    """Hex sha256 of the binary file object `f` read to its end; the bytes count as I/O progress."""
    h = hashlib.sha256()
    while chunk := f.read(HASH_CHUNK):
        h.update(chunk)
        IO.moved(len(chunk))
    return h.hexdigest()


def sha256_local(path: str) -> str:
    with open(path, "rb") as f:
        return sha256_of(f)


@contextlib.contextmanager
def hashed_beside(step_dir: str, files: list[FileEntry], what: str):
    """Hash `files` (manifest entries under the local `step_dir`) in threads while the body
    runs: a load reading the same bytes waits for no hashing pass (the second reader finds them
    in the page cache). Raises CheckpointMismatch naming `what` and the files after the body
    when a sha256 differs, also when the body raised (changed bytes can make the load fail
    first; the mismatch is the cause to name): the state the body loaded is then to be discarded."""
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, len(files))), thread_name_prefix="ckpt-hash") as pool:
        digests = pool.map(lambda f: sha256_local(os.path.join(step_dir, f.path)), files)
        failure = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 (re-raised below unless a mismatch explains it)
            failure = e
        if bad := [f"{f.path}: sha256 mismatch" for f, d in zip(files, digests) if d != f.sha256]:
            raise CheckpointMismatch(f"{what} failed verification: {'; '.join(bad)}; "
                                     f"the state loaded from it is to be discarded") from failure
        if failure is not None:
            raise failure


def check_local_file(step_dir: str, f: FileEntry, hash_file: bool = True) -> str | None:
    path = os.path.join(step_dir, f.path)
    if not os.path.isfile(path):
        return f"{f.path}: missing"
    if (size := os.path.getsize(path)) != f.size:
        return f"{f.path}: size {size} bytes, expected {f.size}"
    if hash_file and sha256_local(path) != f.sha256:
        return f"{f.path}: sha256 mismatch"
    return None


_TRANSIENT_BY_NAME = {
    "botocore.exceptions.ConnectionError",  # refused, connect timeout, proxy
    "botocore.exceptions.HTTPClientError",  # read timeout, connection closed
    "botocore.exceptions.IncompleteReadError",
    "aiohttp.client_exceptions.ClientError",
}
_PERMANENT_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help: network/timeout/5xx-like errors, not missing files or bugs."""
    if isinstance(exc, dcp.CheckpointException):
        return any(is_transient(e) for e, _ in exc.failures.values())
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    if isinstance(exc, (OSError, TimeoutError)):  # incl. aiohttp connection errors, s3fs-mapped errors
        return True
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
    if names & _TRANSIENT_BY_NAME:
        return True
    if "gcsfs.retry.HttpError" in names:
        code = getattr(exc, "code", None)
        return code is None or code == 429 or (isinstance(code, int) and code >= 500)
    return False
