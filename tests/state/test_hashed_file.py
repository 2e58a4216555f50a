"""`hashed_file.HashedFile`: the bytes and sha256 of a file written through it, with O_DIRECT,
through the page cache where the file system refuses O_DIRECT, and with a failing write."""
import errno
import hashlib
import os

import pytest

from ftrain.state import hashed_file
from ftrain.state.hashed_file import PIECE, HashedFile

# pieces of several sizes: small records, one spanning buffers, a tail that is not a whole block
CHUNKS = [b"header", os.urandom(PIECE - 3), os.urandom(2 * PIECE + 4097), b"x" * 100, os.urandom(5000)]


def _write(path) -> HashedFile:
    f = HashedFile(str(path))
    for i, chunk in enumerate(CHUNKS):
        assert f.write(memoryview(chunk)) == len(chunk)
        assert f.tell() == sum(len(c) for c in CHUNKS[:i + 1])
    f.close()
    return f


def test_the_file_holds_what_was_written_and_its_sha256(tmp_path):
    data = b"".join(CHUNKS)
    f = _write(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == data
    assert f.size == len(data) and f.sha256.hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_file_system_without_o_direct_is_written_through_the_page_cache(tmp_path, monkeypatch):
    opened = []
    real_open = os.open

    def no_direct(path, flags, *args):
        opened.append(bool(flags & hashed_file._O_DIRECT))
        if flags & hashed_file._O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(hashed_file.os, "open", no_direct)
    f = _write(tmp_path / "f")
    assert opened == [True, False] and not f._direct
    assert (tmp_path / "f").read_bytes() == b"".join(CHUNKS)


def test_a_failed_write_is_raised(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hashed_file, "_write_all", full)
    f = HashedFile(str(tmp_path / "f"))
    with pytest.raises(OSError, match="No space left"):
        try:
            for chunk in CHUNKS * 3:  # the writer's error reaches a later write, or close
                f.write(chunk)
        finally:
            f.close()
    assert not f._writer.is_alive()
