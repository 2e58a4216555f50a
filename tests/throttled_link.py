"""A TCP relay on 127.0.0.1 that forwards to a local server at a bounded rate: a slow link to
storage for tests (a threaded relay; each direction shares one token bucket across every
connection, as one link would).

    with ThrottledRelay(listen_port, target_port, bytes_per_s=200_000):
        ...   # clients of 127.0.0.1:listen_port reach target_port at about 200 kB/s each way
"""
from __future__ import annotations

import socket
import threading
import time

_CHUNK = 16 << 10  # bytes forwarded per send: the rate's granularity


class _Bucket:
    """Tokens of bytes at `rate` per second; `take(n)` blocks until n are available."""

    def __init__(self, rate: float):
        self.rate, self.tokens, self.at, self.lock = rate, 0.0, time.monotonic(), threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:  # one sender at a time: the link's order
            now = time.monotonic()
            self.tokens = min(self.tokens + (now - self.at) * self.rate, _CHUNK)
            self.at = now
            self.tokens -= n
            if self.tokens < 0:
                time.sleep(-self.tokens / self.rate)


class ThrottledRelay:
    """Listens on `listen_port` (127.0.0.1); each connection is forwarded to `target_port`, both
    directions limited to `bytes_per_s` in all. A context manager: stops listening and closes
    every connection at exit."""

    def __init__(self, listen_port: int, target_port: int, bytes_per_s: float):
        self.target_port = target_port
        self._up, self._down = _Bucket(bytes_per_s), _Bucket(bytes_per_s)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", listen_port))
        self._listener.listen(64)
        self._sockets: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, server]
            for src, dst, bucket in ((client, server, self._up), (server, client, self._down)):
                threading.Thread(target=self._pump, args=(src, dst, bucket), daemon=True, name="relay-pump").start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, bucket: _Bucket) -> None:
        try:
            while data := src.recv(_CHUNK):
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept: the port is free at return
        except OSError:
            pass
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "ThrottledRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
