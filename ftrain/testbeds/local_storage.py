"""S3 and GCS servers on loopback for local runs, tests and benchmarks: real object-storage
servers (S3: moto, GCS: gcp-storage-emulator) in this process, so checkpoints to s3:// and gs://
run without a cloud.

Each server picks a free port, can be stopped (the port then refuses connections, as a dead
endpoint would) and restarted on the same port with its objects kept (tests/conftest.py has
them as the session fixtures `s3_server` / `gcs_server`):

    server = S3Server().start()
    fs = s3fs.S3FileSystem(**server.storage_options)
    ...
    server.stop(); server.start()     # outage and recovery, same port, same objects

`storage_options` holds what fsspec needs (endpoint, dummy credentials, fast-failing retries);
`uri(prefix)` gives `s3://bucket/prefix` / `gs://bucket/prefix`.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs import

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
logging.getLogger("gcp_storage_emulator.storage").setLevel(logging.CRITICAL)  # logs every 404 as error

S3_BUCKET = "test-bucket"
GCS_BUCKET = "test-bucket"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range.

    Why not `bind(0)`: that hands out an ephemeral port, which any outgoing connection (Ray's,
    gloo's) may later take as its local port; a server stopped and restarted on the same port
    (the storage-outage test) then cannot bind it again. The range used, up to 12,000 ports
    below the ephemeral ones, also stays clear of Ray's worker ports (10002-19999 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 below {low}")


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"server on 127.0.0.1:{port} did not start within {timeout_s} s")


class _LoopbackServer:
    """A storage server on 127.0.0.1:port (a free one by default) with one bucket."""

    scheme = ""

    def __init__(self, port: int | None, bucket: str):
        self.port = port or free_port()
        self.bucket = bucket
        self._server = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def uri(self, prefix: str) -> str:
        return f"{self.scheme}://{self.bucket}/{prefix}"


class S3Server(_LoopbackServer):
    """moto S3 on 127.0.0.1:port. moto's backend state is process-global, so objects survive
    stop()/start(). stop() closes the listening socket, so clients get 'connection refused'."""

    scheme = "s3"

    def __init__(self, port: int | None = None, bucket: str = S3_BUCKET):
        super().__init__(port, bucket)

    @property
    def storage_options(self) -> dict:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            # fail fast while the server is down: no botocore / s3fs internal retry loops
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
            "skip_instance_cache": True,
        }

    def start(self) -> "S3Server":
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        _wait_listening(self.port)
        import boto3

        s3 = boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )
        if self.bucket not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
            s3.create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server._server.server_close()  # release the port: refuse, don't hang
            self._server = None


class GCSServer(_LoopbackServer):
    """gcp-storage-emulator (in memory) on 127.0.0.1:port with one bucket."""

    scheme = "gs"

    def __init__(self, port: int | None = None, bucket: str = GCS_BUCKET):
        super().__init__(port, bucket)

    @property
    def storage_options(self) -> dict:
        return {"project": "test", "token": "anon", "endpoint_url": self.endpoint_url, "skip_instance_cache": True}

    def start(self) -> "GCSServer":
        from gcp_storage_emulator.server import create_server

        self._server = create_server("127.0.0.1", self.port, in_memory=True, default_bucket=self.bucket)
        self._server.start()
        _wait_listening(self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

