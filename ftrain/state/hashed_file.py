"""A file written once, front to back, whose sha256 is computed as its bytes are written.

`HashedFile` is the stream Megatron's torch_dist write buckets are pickled into
(`megatron_compat._write_bucket`). Its bytes go through a few page-aligned buffers of `PIECE`
bytes: each piece is hashed, copied into a buffer while still in the CPU cache, and a writer
thread of the file writes full buffers with O_DIRECT, so the disk reads them by DMA while the
next piece is hashed. Why not the page cache: the kernel's copy into it, and its writeback and
reclaim later, take CPU that the hash needs on a small host, and a checkpoint of many GB would
push the training process's pages out of the cache. Where the
file system refuses O_DIRECT (tmpfs, some network file systems), the same buffers are written
through the page cache.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import queue
import threading

import numpy as np

PIECE = 4 << 20  # bytes: a buffer; stays in the L2/L3 cache between hashing and copying
_BUFFERS = 3  # per file: one being filled, up to two being written
_ALIGN = 4096  # bytes: O_DIRECT offsets and lengths (any logical block size up to 4 KiB)
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux


class HashedFile:
    """`path` created (truncated) for writing. `write(data)` (any contiguous buffer) appends;
    `tell()` is the bytes written so far, `flush()` does nothing (the bytes go out in pieces);
    `close()` writes the rest, fsyncs and closes, and must be called once at the end (also
    after an error, to stop the writer thread). Then `size` (bytes) and `sha256` (hashlib
    object) describe the file as written. Raises OSError of the write that failed, from the
    next `write` or from `close`. `on_write(n)`, when given, is told the bytes of each write."""

    def __init__(self, path: str, on_write=None):
        self.path, self.size, self.sha256, self._on_write = path, 0, hashlib.sha256(), on_write
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self._fd, self._direct = os.open(path, flags | _O_DIRECT), bool(_O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT
                raise
            self._fd, self._direct = os.open(path, flags), False
        self._free: queue.Queue = queue.Queue()
        for _ in range(_BUFFERS):
            self._free.put(mmap.mmap(-1, PIECE))  # anonymous: page-aligned
        self._full: queue.Queue = queue.Queue()
        self._error: OSError | None = None
        self._buffer, self._filled = self._free.get(), 0
        self._writer = threading.Thread(target=self._write_out, daemon=True, name="hashed-file-writer")
        self._writer.start()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._error is not None:
                raise self._error
            n = min(len(view) - done, PIECE - self._filled)
            piece = view[done:done + n]
            self.sha256.update(piece)  # releases the GIL, as the copy does: buckets run in parallel
            np.copyto(np.frombuffer(self._buffer, np.uint8, n, self._filled), np.frombuffer(piece, np.uint8))
            self._filled += n
            done += n
            if self._filled == PIECE:
                self._full.put((self._buffer, PIECE))
                self._buffer, self._filled = self._free.get(), 0
        self.size += len(view)
        if self._on_write is not None:
            self._on_write(len(view))
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """Write the last piece (its whole 4 KiB blocks with the others, the rest through the
        page cache), wait for the writer, fsync, close. Raises the first write error."""
        whole = self._filled - self._filled % _ALIGN
        if whole:
            self._full.put((self._buffer, whole))
        self._full.put(None)
        self._writer.join()
        try:
            if self._error is not None:
                raise self._error
            if whole < self._filled:
                self._buffered()
                _write_all(self._fd, memoryview(self._buffer)[whole:self._filled])
            os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def _write_out(self) -> None:
        """The writer thread: the full buffers in order, each back to the free ones once written."""
        while (item := self._full.get()) is not None:
            buffer, n = item
            if self._error is None:
                try:
                    try:
                        _write_all(self._fd, memoryview(buffer)[:n])
                    except OSError as exc:  # a device whose blocks are larger than _ALIGN
                        if not (self._direct and exc.errno == errno.EINVAL):
                            raise
                        self._buffered()
                        _write_all(self._fd, memoryview(buffer)[:n])
                except OSError as exc:
                    self._error = exc
            self._free.put(buffer)

    def _buffered(self) -> None:
        """Go on through the page cache (O_DIRECT off for this file's descriptor)."""
        if self._direct:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
            self._direct = False


def _write_all(fd: int, data: memoryview) -> None:
    """os.write until all of `data` is written (a write may take fewer bytes)."""
    while data:
        data = data[os.write(fd, data):]
