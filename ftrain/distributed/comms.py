"""Process-group lifecycle of one process: the network interface its groups bind, abort every
communicator (each in its own thread), free gloo collectives by shutting down their sockets,
close NCCL group calls left open by an aborted step, make gloo waits end at an abort, and tell a
lost node (its raylet refuses connections) from an unreachable one.

Why these exist: torch aborts communicators one after another and gloo has no abort at all,
so a rank blocked in a collective whose peer died would otherwise wait for the process-group
timeout. See docs/recovery.md for the measurements behind each.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
import zlib

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_of(ip: str) -> str | None:
    """The name of this machine's network interface that holds address `ip` (None: none)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def use_node_interface(ip: str) -> str | None:
    """Make this process's gloo and NCCL groups bind and advertise `ip` (the node IP Ray
    reports): GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME are set to the interface holding it,
    each unless already set. Returns that interface (None: no interface holds `ip`; nothing
    set). Why: without them gloo advertises the address its hostname resolves to, and where
    that is 127.0.0.1 (common in containers) no peer on another host can connect
    ("Gloo connectFullMesh failed ... remote=[127.0.0.1]")."""
    name = interface_of(ip)
    if name is not None:
        for var in SOCKET_IFNAME_VARS:
            os.environ.setdefault(var, name)
    return name


def abort_process_groups() -> None:
    """Abort every process group of this process, each in its own thread, then drop them from
    torch's registry (`_abort_process_group`, whose own aborts are then no-ops).

    Why threads: torch aborts the groups one after another (inside one ncclGroupStart/End), so
    the time grows with the number of communicators (Megatron makes many per rank) and, with a
    collective blocked on a dead peer, may not return at all; aborted in parallel, every group is
    freed at once (see docs/recovery.md, "Abort")."""
    from torch.distributed.distributed_c10d import _abort_process_group, _world

    threads = [threading.Thread(target=pg.abort, daemon=True) for pg in list(_world.pg_names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _abort_process_group()


@contextlib.contextmanager
def recording_new_sockets(into: dict[int, str]):
    """Record in `into` (fd -> 'socket:[inode]') every socket this process opens inside the block.

    Why: gloo has no abort (torch 2.13's ProcessGroupGloo keeps Backend's no-op `abort`), so a
    rank blocked in a gloo collective is freed only when a socket of that collective fails.
    Without help that happens when a neighbour's process group is destroyed, one ring hop at a
    time, so the delay grows with the number of ranks (see docs/recovery.md, "Abort").
    `shutdown_sockets` on what gloo opened frees every rank at once. Linux only
    (/proc/self/fd); elsewhere nothing is recorded and aborts fall back to that cascade."""
    before = set(_socket_links().values())
    try:
        yield
    finally:
        into.update({fd: link for fd, link in _socket_links().items() if link not in before})


def _socket_links() -> dict[int, str]:
    links = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return links
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            links[int(fd)] = link
    return links


def shutdown_sockets(sockets: dict[int, str]) -> int:
    """`shutdown(SHUT_RDWR)` each connected TCP socket of `sockets` (from `recording_new_sockets`)
    that is still the same socket (its fd may have been closed and reused since), then empty
    `sockets`; the fds stay open for their owner to close. Both ends of each connection then
    fail their pending reads and writes. Returns how many were shut down."""
    import socket

    live, n = _socket_links(), 0
    for fd, link in sockets.items():
        if live.get(fd) != link:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                # Not a listening socket: gloo's listener treats a failed accept as fatal
                # (GLOO_ENFORCE in tcp/listener.cc: the process aborts).
                if s.type == socket.SOCK_STREAM and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
        except OSError:  # closed meanwhile, or not connected
            pass
    sockets.clear()
    return n


WAIT_SLICE = datetime.timedelta(milliseconds=10)
"""How long `wait_work` blocks between two checks."""

_torch_wait: list = []  # [torch's own Work.wait], once `interruptible_waits` replaced it
_wait_check: list = []  # [check] of the engine that installed `interruptible_waits`


def wait_work(work, check) -> bool:
    """Wait for the collective `work` and return or raise as its own untimed `wait()` would;
    meanwhile call `check()` every `WAIT_SLICE`, which raises to end the wait
    (`engine.StepInterrupt.check`: `Interrupted` once the generation was aborted).

    Why: a gloo wait ends only when its work does, and the socket shutdown of an abort
    (`shutdown_sockets`) does not end every work (a send queued behind a partial write is not
    failed: `left_collective`; see docs/recovery.md, "Abort"). The compute thread must leave
    the aborted step for the rank to join the next generation; else it is replaced as hung."""
    wait = _torch_wait[0] if _torch_wait else type(work).wait
    while True:
        try:
            return wait(work, WAIT_SLICE)
        except RuntimeError:
            if work.is_completed():  # done meanwhile, or failed: its own result or error
                return wait(work)
            check()


def interruptible_waits(check) -> None:
    """Make every untimed `Work.wait()` of this process (the wait of each synchronous
    collective, and of each handle an async one returns) a `wait_work` with `check`; timed
    waits are unchanged. Installed once per process (a patch of torch's `Work.wait`); a later
    call replaces `check`. For gloo only: an NCCL wait does not block the host. Why: the
    collectives of Megatron-Core's layers and optimizer wait inside its own code."""
    from torch._C._distributed_c10d import Work

    if not _torch_wait:
        _torch_wait.append(Work.wait)
        untimed = datetime.timedelta(0)

        def sliced_wait(work, timeout: datetime.timedelta = untimed) -> bool:
            if timeout != untimed:
                return _torch_wait[0](work, timeout)
            return wait_work(work, _wait_check[0])

        Work.wait = sliced_wait
    _wait_check[:] = [check]


def left_collective(engine, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Wait up to `timeout_s` seconds for `engine.in_collective` to turn False; returns whether
    it did. Why: gloo (tcp/pair.cc, torch 2.13) fails a pair's pending sends when its
    connection fails, but not a send queued behind a partial write (a peer that stopped reading
    mid-message): that send returns only at the process-group timeout (`step_timeout_s`), so
    a caller must not wait on it unbounded (see docs/recovery.md, "Abort")."""
    deadline = time.monotonic() + timeout_s
    while engine.in_collective:
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


GROUP_NAME_RANKS = 16
"""Members a process group's name in `collective_counts` lists at most; a larger group is
named by its size, first and last member and a digest of the whole list (`group_name`)."""


def group_name(members: list[int]) -> str:
    """The name of the process group of `members` (global ranks in group-rank order):
    'r0,r1,...' up to `GROUP_NAME_RANKS` members, else 'n=N:r0..rlast:CRC32' (the same on
    every member). Why: every ping carries a name per group (`collective_counts`), and a
    group of every DP replica named rank by rank would make each ping O(ranks) and a
    heartbeat round O(ranks^2) bytes to the driver."""
    text = ",".join(map(str, members))
    if len(members) <= GROUP_NAME_RANKS:
        return text
    return f"n={len(members)}:{members[0]}..{members[-1]}:{zlib.crc32(text.encode()):08x}"


def collective_counts() -> dict[str, int]:
    """Collectives entered so far in each process group of this process's generation, by group:
    'NAME#i' (NAME: `group_name` of the group's global ranks in group-rank order, 'r0,r1,...'
    for a small group; i: how many groups of those
    members this process made before it, the same order on every member) -> torch's sequence
    number of the group, bumped when a rank issues a collective on it (gloo: p2p sends and
    receives too; NCCL: collectives only). Why: a rank that stopped before a collective its
    peers entered shows a lower count in that group than they do (`health.hang_culprits`).
    Read from the control thread while the compute thread may be inside a collective; {} when
    this process is in no process group (an aborted generation's are dropped from torch's
    registry, `abort_process_groups`)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    from torch.distributed.distributed_c10d import _world

    counts: dict[str, int] = {}
    made: dict[str, int] = {}
    for pg, ranks in list(_world.pg_group_ranks.items()):
        members = group_name(sorted(ranks, key=ranks.get))
        made[members] = made.get(members, -1) + 1
        try:
            counts[f"{members}#{made[members]}"] = int(pg._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001 - e.g. a communicator not made yet; a ping must answer
            continue
    return counts


def refuses_connections(address: tuple[str, int], timeout_s: float = 0.5) -> bool:
    """True when a TCP connect to `address` (host, port) is refused: the host is up and nothing
    listens there. False when it connects, or gives no answer within `timeout_s` seconds (a
    host that is down or cut off refuses nothing: that is no proof)."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def close_open_nccl_groups() -> None:
    """Close NCCL group calls left open on the calling thread. torch's `_coalescing_manager`
    (behind `batch_isend_irecv`, which Megatron's pipeline p2p uses) opens an ncclGroupStart and
    has no `finally`: when a send or receive raises inside it, as one does on a communicator that
    `abort` aborted under a running step, the group stays open on the compute thread, and the
    next communicator made there (the next generation's) would be deferred to a group end that
    never comes. ncclGroupEnd on a thread with no open group fails: that ends the loop."""
    import torch.distributed as dist

    nccl = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1)  # makes no communicator
    for _ in range(8):
        try:
            nccl._group_end()
        except Exception:  # noqa: BLE001 - 'invalid usage': no group was open
            return
