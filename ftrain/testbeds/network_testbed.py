"""A multi-host test bed on one Linux machine: each host is a network namespace on a bridge,
runs a Ray node, and can suffer the faults a real network has: a cut link (its packets
vanish, both directions), a brown-out (delay and loss through a user-space relay), a frozen
host (SIGSTOP of its processes) and a killed one.

Layout (root only; needs iproute2's `ip`): the bridge lives in a namespace of its own
(`<prefix>-br`), host i in `<prefix>-h<i>` with interface `eth0` at `<subnet>.<10+i>/24`, its
peer `<prefix>-p<i>` a bridge port. The bridge holds `<subnet>.1`, each host's default route
(Ray picks its node IP by a UDP connect to a public address, which needs a route). Nothing in
the root namespace is touched. Every process the test bed starts runs inside one of its
namespaces, so `close` stops exactly those (by pid, from `ip netns pids`), then deletes the
namespaces; `ray stop` would stop every Ray on the machine.

A driver joins a host with `enter(i)`: the calling thread (and the threads it starts, e.g.
Ray's) then uses that host's network. Hostnames are those of the machine (namespaces share
it): where the hostname resolves to 127.0.0.1, as in many containers, the test bed has that
trap too.
"""
from __future__ import annotations

import contextlib
import ctypes
import heapq
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000
SIOCETHTOOL = 0x8946
# ethtool's legacy set commands: tx checksum, scatter-gather, TCP segmentation, generic segmentation
ETHTOOL_OFFLOADS = (0x17, 0x19, 0x1F, 0x24)
RAY_PORT = 6379
# Ray's clients join a token-auth cluster only when told to (the token: ~/.ray/auth_token).
RAY_ENV = {"RAY_AUTH_MODE": "token"}


def available() -> str | None:
    """None when this machine can hold a test bed, else why not (one line, for a skip)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (the test bed runs as root in CI)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"ftnet-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return "`ip netns add` is not permitted here"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(("-n", ns) if ns else ()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc


@dataclass
class Host:
    """One host: its namespace, IP, bridge port, and the Ray node started in it (None: none)."""
    ns: str
    ip: str
    port: str           # its link's end in the bridge namespace
    ray: subprocess.Popen | None = None
    relay: subprocess.Popen | None = None   # brown-out relay of its link (None: direct)


class TestBed:
    """`num_hosts` hosts on one bridge (see the module docstring). Use as a context manager:
    the namespaces are made on entry and every process and namespace is removed on exit, on
    failure too. `prefix` names everything (namespaces, interfaces; keep it unique per machine),
    `subnet` is the first three octets of the hosts' /24. Raises RuntimeError when an `ip`
    command fails (its stderr in the message)."""

    __test__ = False  # not a pytest class

    def __init__(self, num_hosts: int = 3, prefix: str = "ftnet", subnet: str = "10.77.0"):
        self.prefix, self.subnet = prefix, subnet
        self.bridge_ns = f"{prefix}-br"
        self.hosts = [Host(f"{prefix}-h{i}", f"{subnet}.{10 + i}", f"{prefix}-p{i}") for i in range(num_hosts)]
        self.temp_dir = Path(f"/tmp/{prefix}-ray")  # Ray's session files, apart from other clusters'

    # -- set-up and tear-down ---------------------------------------------------------------
    def __enter__(self) -> TestBed:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> None:
        """The bridge namespace and every host on it; removes leftovers of the same prefix first."""
        self.close()
        _ip("netns", "add", self.bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", "br0", ns=self.bridge_ns)
        _ip("link", "set", "br0", "up", ns=self.bridge_ns)
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            _ip("link", "add", "eth0", "netns", h.ns, "type", "veth", "peer", "name", h.port, "netns", self.bridge_ns)
            _ip("link", "set", h.port, "master", "br0", "up", ns=self.bridge_ns)
            _ip("addr", "add", f"{h.ip}/24", "dev", "eth0", ns=h.ns)
            _ip("link", "set", "eth0", "up", ns=h.ns)
            _ip("link", "set", "lo", "up", ns=h.ns)
            _ip("route", "add", "default", "via", f"{self.subnet}.1", ns=h.ns)
            with self.enter(self.hosts.index(h)):
                _no_offloads("eth0")

    def close(self) -> None:
        """Stop every process in the test bed's namespaces (SIGKILL by pid; never this process),
        then delete the namespaces. Safe to call twice, and on a half-made test bed."""
        for h in self.hosts:
            for p in (h.relay, h.ray):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
            h.ray = h.relay = None
        for ns in [self.bridge_ns, *(h.ns for h in self.hosts)]:
            self._signal(ns, signal.SIGCONT)  # a stopped process cannot die until continued
            self._signal(ns, signal.SIGKILL)
            _ip("netns", "del", ns, check=False)

    @staticmethod
    def pids(ns: str) -> list[int]:
        """Processes whose network namespace is `ns`, this one excluded."""
        proc = _ip("netns", "pids", ns, check=False)
        return [int(p) for p in proc.stdout.split() if int(p) != os.getpid()]

    def _signal(self, ns: str, sig: int) -> None:
        for pid in self.pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    # -- Ray ------------------------------------------------------------------------------------
    def start_ray(self, cpus: list[float], env: dict[str, str] | None = None, timeout_s: float = 120.0) -> str:
        """A Ray head on host 0 and a worker node on each other host, `cpus[i]` logical CPUs on
        host i; `env`: extra environment of every node (and so of its actors). Returns the
        head's address. Raises RuntimeError when a node does not come up within `timeout_s`.
        One node after another: nodes of one machine share a session directory, and two
        starting at once can pick the same socket name there."""
        for i in range(len(self.hosts)):
            self.start_node(i, cpus[i], env)
            self.wait_for_nodes(i + 1, timeout_s)
        return self.address

    @property
    def address(self) -> str:
        return f"{self.hosts[0].ip}:{RAY_PORT}"

    def start_node(self, i: int, cpus: float, env: dict[str, str] | None = None) -> None:
        """Start host i's Ray node (the head when i == 0), in the background (`--block`)."""
        h = self.hosts[i]
        ray_bin = str(Path(sys.executable).with_name("ray"))
        role = ["--head", f"--port={RAY_PORT}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false"] \
            if i == 0 else [f"--address={self.address}"]
        cmd = ["ip", "netns", "exec", h.ns, ray_bin, "start", *role, f"--node-ip-address={h.ip}",
               f"--num-cpus={cpus:g}", "--num-gpus=0", "--disable-usage-stats", "--block"]
        log = open(self.temp_dir.with_name(f"{h.ns}.log"), "ab")
        h.ray = subprocess.Popen(cmd, env={**os.environ, **RAY_ENV, **(env or {})}, stdout=log, stderr=log,
                                 start_new_session=True)

    def restart_node(self, i: int, cpus: float, env: dict[str, str] | None = None, timeout_s: float = 120.0) -> None:
        """Heal host i (link, relay, frozen processes), stop everything in it and start a fresh
        Ray node there: after a long cut Ray declares the old node dead and it cannot return."""
        self.heal(i)
        h = self.hosts[i]
        self._signal(h.ns, signal.SIGCONT)
        self._signal(h.ns, signal.SIGKILL)
        if h.ray is not None:
            h.ray.wait()
        self.start_node(i, cpus, env)
        self.wait_for_nodes(len(self.hosts), timeout_s)

    def wait_for_nodes(self, n: int, timeout_s: float) -> None:
        """Wait until the head lists `n` live nodes (asked from host 0, in a subprocess)."""
        ray_bin = str(Path(sys.executable).with_name("ray"))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                proc = subprocess.run(["ip", "netns", "exec", self.hosts[0].ns, sys.executable, "-c",
                                       "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False);"
                                       "print('alive_nodes', sum(n['Alive'] for n in ray.nodes()))", self.address],
                                      capture_output=True, text=True, timeout=30, env={**os.environ, **RAY_ENV})
            except subprocess.TimeoutExpired as e:  # a head still starting may not answer yet
                proc = subprocess.CompletedProcess(e.cmd, 1, "", f"no answer within 30 s: {e}")
            counts = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("alive_nodes ")]
            alive = int(counts[0]) if proc.returncode == 0 and counts else 0
            if alive >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{alive} of {n} Ray nodes up after {timeout_s:.0f} s "
                                   f"({ray_bin}; logs in {self.temp_dir.parent}/{self.prefix}-h*.log): "
                                   f"{proc.stderr[-500:]}")
            time.sleep(1.0)

    @contextlib.contextmanager
    def enter(self, i: int):
        """Run the calling thread (and threads it starts inside the block) in host i's network
        namespace; back in the original one after the block."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{self.hosts[i].ns}") as there:
            if libc.setns(there.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.hosts[i].ns}")
            try:
                yield self.hosts[i]
            finally:
                libc.setns(home.fileno(), CLONE_NEWNET)

    # -- faults ---------------------------------------------------------------------------------
    def cut(self, i: int) -> None:
        """Cut host i's link, both directions: its bridge port leaves the bridge, so its packets
        vanish and nothing is refused (its interface stays up, as when a switch drops them)."""
        _ip("link", "set", self.hosts[i].port, "nomaster", ns=self.bridge_ns)

    def brownout(self, i: int, delay_s: float, loss: float, seed: int = 0) -> None:
        """Route host i's link through a relay process in the bridge namespace that delays every
        frame by `delay_s` seconds and drops a fraction `loss` of them, both directions (the
        kernel here has no netem)."""
        h = self.hosts[i]
        relay_if, bridge_if = f"{self.prefix}-r{i}", f"{self.prefix}-b{i}"
        _ip("link", "add", relay_if, "type", "veth", "peer", "name", bridge_if, ns=self.bridge_ns)
        _ip("link", "set", bridge_if, "master", "br0", "up", ns=self.bridge_ns)
        _ip("link", "set", relay_if, "up", ns=self.bridge_ns)
        _ip("link", "set", h.port, "nomaster", ns=self.bridge_ns)
        h.relay = subprocess.Popen(["ip", "netns", "exec", self.bridge_ns, sys.executable, __file__, "relay",
                                    h.port, relay_if, str(delay_s), str(loss), str(seed)], start_new_session=True)

    def freeze(self, i: int) -> None:
        """SIGSTOP every process of host i (its kernel still answers TCP; nothing reads)."""
        self._signal(self.hosts[i].ns, signal.SIGSTOP)

    def kill(self, i: int) -> None:
        """SIGKILL every process of host i; its interface stays, so connections are refused."""
        self._signal(self.hosts[i].ns, signal.SIGCONT)
        self._signal(self.hosts[i].ns, signal.SIGKILL)

    def heal(self, i: int) -> None:
        """Undo `cut`, `brownout` and `freeze` of host i."""
        h = self.hosts[i]
        if h.relay is not None:
            h.relay.kill()
            h.relay.wait()
            h.relay = None
            _ip("link", "del", f"{self.prefix}-r{i}", ns=self.bridge_ns, check=False)
        _ip("link", "set", h.port, "master", "br0", ns=self.bridge_ns)
        self._signal(h.ns, signal.SIGCONT)


def _no_offloads(interface: str) -> None:
    """Turn off checksum and segmentation offloads of `interface` (in the calling thread's
    namespace; the ioctl `ethtool -K` makes). Why: a veth hands frames on with their checksum
    left to "hardware" and up to 64 KB long; the brown-out relay reads frames raw, so every
    frame must be complete and at most one MTU."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for cmd in ETHTOOL_OFFLOADS:
            value = ctypes.create_string_buffer(struct.pack("II", cmd, 0))
            ifreq = struct.pack("16sP", interface.encode(), ctypes.addressof(value))
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)


def relay(a: str, b: str, delay_s: float, loss: float, seed: int) -> None:
    """Copy Ethernet frames between interfaces `a` and `b` (raw AF_PACKET sockets), each one
    `delay_s` seconds late and a fraction `loss` dropped, until killed. One thread per
    direction; frames keep their order."""
    rng = random.Random(seed)
    lock = threading.Lock()

    def forward(src: str, dst: str) -> None:
        rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        rx.bind((src, 0))
        tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        tx.bind((dst, 0))
        queue: list[tuple[float, int, bytes]] = []
        cond, n = threading.Condition(), 0

        def sender() -> None:
            while True:
                with cond:
                    while not queue or queue[0][0] > time.monotonic():
                        cond.wait(max(0.0, queue[0][0] - time.monotonic()) if queue else None)
                    _, _, frame = heapq.heappop(queue)
                with contextlib.suppress(OSError):
                    tx.send(frame)

        threading.Thread(target=sender, daemon=True).start()
        while True:
            frame, addr = rx.recvfrom(65535)
            if addr[2] == socket.PACKET_OUTGOING:  # a frame this relay sent itself
                continue
            with lock:
                drop = rng.random() < loss
            if drop:
                continue
            with cond:
                n += 1
                heapq.heappush(queue, (time.monotonic() + delay_s, n, frame))
                cond.notify()

    threads = [threading.Thread(target=forward, args=(a, b), daemon=True),
               threading.Thread(target=forward, args=(b, a), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__" and sys.argv[1:2] == ["relay"]:
    relay(sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
