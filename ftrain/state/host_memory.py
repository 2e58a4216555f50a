"""Page-locked host memory and the host buffers of a training state.

A training state here is any pytree (dicts, lists) whose tensor leaves are the state and whose
other leaves (python counters) are carried along. `state_tensors` lists its tensors in a fixed
order; `carve` lays buffers shaped like them into one arena of host memory, which
`pinned_empty` allocates page-locked at its exact size (`pin_in_background` does so off the
calling thread). Why pinned: device-to-host copies into pinned memory are asynchronous and run
at full bus speed.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import mmap
import os
import threading
from typing import Callable

import torch

HOST_ALLOC_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
_ALLOCATOR = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot-alloc")
_ALIGN = 64  # bytes: any dtype's view may start at such an offset


def configure_host_allocator() -> None:
    """Make torch pin host memory with malloc + page mapping by 8 threads + cudaHostRegister
    instead of one cudaHostAlloc call (torch's PYTORCH_CUDA_ALLOC_CONF options from
    pytorch/pytorch#108488). Why: cudaHostAlloc holds a CUDA driver lock for the whole
    allocation, and the step's kernel launches wait on it (see bench/results/HISTORY.md). The
    engine's own buffers come from `pinned_empty` (the same registration path, exact size);
    this covers what still pins through torch, e.g. Megatron's device-to-host copy in a
    synchronous save.
    Call before CUDA is initialised in the process; settings already in
    PYTORCH_CUDA_ALLOC_CONF are kept."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "pinned_use_cuda_host_register" not in conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, HOST_ALLOC_CONF]))


@dataclasses.dataclass
class HostCopy:
    """A copy of a training state into host buffers that may still be in flight (an engine's
    `start_host_copy`). `state`: the host buffers, with the python leaves (step, schedule) as
    of the copy's start; `wait()` blocks until every byte is in them (it releases the GIL:
    call it from any thread) and raises when the copy failed. The engine orders every later
    change of the live state after the copy, so the bytes are those of one committed step."""

    state: dict
    wait: Callable[[], None]


def state_tensors(state) -> list[torch.Tensor]:
    """The tensor leaves of `state` (nested dicts, lists and tuples), in pytree order (a dict's
    values in insertion order, as `torch.utils._pytree.tree_leaves`); other leaves skipped.
    A walk of its own: called several times per step on ~1,000-leaf states, where the
    general pytree walk costs the training thread milliseconds."""
    out: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(state)
    return out


def tree_map(fn, state):
    """`torch.utils._pytree.tree_map(fn, state)` (same leaves, same order, same containers)
    with plain dicts, lists and tuples walked here: a state's ~1,000 leaves are mapped on the
    training thread every step (`regions`), where the general pytree walk costs milliseconds."""
    t = type(state)
    if t is dict:
        return {k: tree_map(fn, v) for k, v in state.items()}
    if t is list:
        return [tree_map(fn, v) for v in state]
    if t is tuple:
        return tuple(tree_map(fn, v) for v in state)
    if isinstance(state, (dict, list, tuple)):  # other containers (named tuples, ...): the general walk
        return torch.utils._pytree.tree_map(fn, state)
    return fn(state)


def same_layout(a: dict, b: dict) -> bool:
    """Whether two training states have tensors of the same shapes and dtypes, in order."""
    a, b = state_tensors(a), state_tensors(b)
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))


def copy_state(dst: dict, src: dict) -> None:
    """Queue a non-blocking copy of every tensor of `src` into the same-structured `dst` on the
    current stream (host <-> device; the caller synchronizes). Raises ValueError when the two
    hold different numbers of tensors. One `torch._foreach_copy_` call: the per-tensor launches
    run in C++ with the GIL released (a state has ~1,000 tensors; a python loop over them costs
    the training thread milliseconds per step), device-local pairs as multi-tensor kernels."""
    dst, src = state_tensors(dst), state_tensors(src)
    if len(dst) != len(src):
        raise ValueError(f"copy_state: {len(dst)} destination tensors for {len(src)} source tensors")
    if dst:
        torch._foreach_copy_(dst, src, non_blocking=True)


STAGING_BYTES = 256 << 20
"""Device memory of an engine's staging buffer for `copy_to_host` (gathered chunks): 256 MiB."""


def plan_chunks(spans: list[tuple[int, int]], chunk: int) -> list[list[int]]:
    """Group host buffers for `copy_to_host`: `spans` are (address, nbytes) of the destination
    buffers, disjoint; returns lists of their indices, each list in address order, covering
    every index once: consecutive buffers (in address order) whose whole range, gaps
    included, fits in `chunk` bytes share a list; a buffer of more than `chunk` bytes is a list
    of its own. Raises ValueError when two spans overlap."""
    groups: list[list[int]] = []
    start = end = None
    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        address, n = spans[i]
        if end is not None and address < end:
            raise ValueError(f"plan_chunks: buffers overlap at address {address:#x}")
        if start is None or address + n - start > chunk:
            groups.append([i])
            start = address
        else:
            groups[-1].append(i)
        end = address + n
    return groups


class _Plan:
    """`copy_to_host`'s copies for one set of destination buffers: `direct` (the indices of the
    pairs copied as they are) and `chunks`: per chunk, per dtype (the staging buffer's views,
    the indices of their sources), and the chunk's host range."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor], staging: torch.Tensor):
        gather = [i for i, (d, x) in enumerate(zip(dst, src)) if x.is_cuda and not d.is_cuda and d.numel()]
        self.direct = sorted(set(range(len(dst))) - set(gather))
        self.chunks: list[tuple[list[tuple[list, list[int]]], torch.Tensor]] = []
        spans = [(dst[i].data_ptr(), dst[i].numel() * dst[i].element_size()) for i in gather]
        for group in plan_chunks(spans, staging.numel()):
            if len(group) == 1:  # alone, or larger than the staging buffer (`plan_chunks`)
                self.direct.append(gather[group[0]])
                continue
            start = spans[group[0]][0]
            span = spans[group[-1]][0] + spans[group[-1]][1] - start
            by_dtype: dict[torch.dtype, tuple[list, list[int]]] = {}
            for g in group:
                i, (address, n) = gather[g], spans[g]
                view = staging[address - start:][:n]
                views, sources = by_dtype.setdefault(dst[i].dtype, ([], []))
                views.append(view.view(dst[i].dtype).view(dst[i].shape))
                sources.append(i)
            host = torch.frombuffer((ctypes.c_ubyte * span).from_address(start), dtype=torch.uint8)
            self.chunks.append((list(by_dtype.values()), host))

    @staticmethod
    def key(dst: list[torch.Tensor], src: list[torch.Tensor], staging: torch.Tensor) -> tuple:
        return (staging.data_ptr(), staging.numel(), *((d.data_ptr(), d.numel(), d.dtype, d.is_cuda, x.is_cuda)
                                                        for d, x in zip(dst, src)))


_PLANS: dict[tuple, _Plan] = {}  # the last plans: the same few sets of buffers are copied into every step
_MAX_PLANS = 4  # a rollback snapshot, a keeper's two arenas, a memory snapshot's buffers
_PLANS_LOCK = threading.Lock()


def copy_to_host(dst: dict, src: dict, staging: torch.Tensor) -> None:
    """`copy_state(dst, src)` in few device-to-host copies: queue on the current stream, for
    each run of consecutive host buffers of `dst` (page-locked: `carve`d from a pinned arena)
    whose CUDA sources fit in `staging` (a CUDA uint8 buffer, e.g. `STAGING_BYTES`), one
    multi-tensor device copy per dtype into `staging` at the buffers' relative offsets and one
    copy of that range to the host; other pairs (larger tensors, CPU sources) copied directly.
    Why: every copy is a driver call that contends with the training thread's kernel launches
    for the driver's locks, and a state has ~1,000 tensors: on a launch-bound step, 1,000
    concurrent copies cost 10-18% of its time and 1-100 copies of the same bytes 3%
    (bench/copy_contention.py). The stream's order serialises the reuse of `staging`.
    Raises ValueError when the two hold different numbers of tensors."""
    dst, src = state_tensors(dst), state_tensors(src)
    if len(dst) != len(src):
        raise ValueError(f"copy_to_host: {len(dst)} destination tensors for {len(src)} source tensors")
    key = _Plan.key(dst, src, staging)
    with _PLANS_LOCK:  # engines of one process copy from threads of their own
        plan = _PLANS.get(key)
        if plan is None:
            while len(_PLANS) >= _MAX_PLANS:
                _PLANS.pop(next(iter(_PLANS)))
            plan = _PLANS[key] = _Plan(dst, src, staging)
    if plan.direct:
        torch._foreach_copy_([dst[i] for i in plan.direct], [src[i] for i in plan.direct], non_blocking=True)
    for by_dtype, host in plan.chunks:
        for views, sources in by_dtype:
            torch._foreach_copy_(views, [src[i] for i in sources], non_blocking=True)
        host.copy_(staging[:host.numel()], non_blocking=True)


def state_nbytes(state) -> int:
    """Bytes `carve` needs for the tensors of `state` (each rounded up to 64 bytes)."""
    return sum(-(-x.numel() * x.element_size() // _ALIGN) * _ALIGN for x in state_tensors(state))


def carve(state, arena: torch.Tensor):
    """Buffers shaped like every tensor of `state` (same shapes and dtypes; other leaves kept),
    in disjoint parts of `arena` (uint8 [N] host memory, e.g. pinned and reserved earlier) at
    64-byte-aligned offsets, those of CUDA tensors first (in state order; one run of buffers
    for `copy_to_host`), then the others. Each buffer has a storage of its own bytes only (`torch.frombuffer`
    over the arena's memory, which it keeps alive), not a view of the arena's storage: why,
    `torch.save` and pickle write a tensor's whole storage, so saving a view (Megatron's async
    save pickles each tensor) would write the whole arena for every tensor.
    Returns None when `arena` has fewer than `state_nbytes(state)` bytes."""
    if arena.numel() < state_nbytes(state):
        return None
    memory, leaves = arena.numpy(), state_tensors(state)
    offsets, offset = [0] * len(leaves), 0
    for i in sorted(range(len(leaves)), key=lambda i: not leaves[i].is_cuda):  # CUDA tensors first
        offsets[i] = offset
        offset += -(-leaves[i].numel() * leaves[i].element_size() // _ALIGN) * _ALIGN
    position = iter(offsets)

    def view(x):
        if not isinstance(x, torch.Tensor):
            return x
        at = next(position)
        if x.numel() == 0:  # frombuffer refuses count 0
            return torch.empty(x.shape, dtype=x.dtype)
        return torch.frombuffer(memory, dtype=x.dtype, count=x.numel(), offset=at).view(x.shape)

    return tree_map(view, state)


def carve_shard(state, arena: torch.Tensor):
    """`carve` for an engine's `start_shard_copy`: the buffers, or ValueError naming both sizes
    when `arena` is too small."""
    into = carve(state, arena)
    if into is None:
        raise ValueError(f"start_shard_copy: arena of {arena.numel()} bytes, the shard needs "
                         f"{state_nbytes(state)} (shard_nbytes)")
    return into


class _PinnedMap(mmap.mmap):
    """Mapped host memory (anonymous: pages faulted in on first touch, no memset; or a memory
    file's), page-locked with cudaHostRegister once `register`ed, for as long as any tensor
    views it: `torch.frombuffer` keeps this object alive until the last view's storage is
    freed, and its finalizer unregisters the pages before the memory is unmapped."""

    ptr = None

    def register(self, ptr: int) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(ptr, len(self), 1)  # cudaHostRegisterPortable: pinned for every context
        if err != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {len(self)} bytes of host memory failed ({err}): "
                               f"lower the host memory in use or raise the locked-memory limit (ulimit -l)")
        self.ptr = ptr

    def __del__(self):
        if self.ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)


def pinned_empty(nbytes: int, device: int | None = None) -> torch.Tensor:
    """uint8 [nbytes] of page-locked host memory of exactly `nbytes` bytes (plain host memory
    without CUDA), for `carve`. Not `torch.empty(..., pin_memory=True)`: torch's host caching
    allocator rounds every pinned block up to a power of two (at::CachingHostAllocator,
    PowerOf2Ceil; unbounded by default), which nearly doubles a large snapshot's memory and
    can exhaust the host. The pages are faulted in by torch's multi-threaded fill, then
    registered (as torch's `pinned_use_cuda_host_register` does, without cudaHostAlloc's long
    driver lock). Any view keeps the memory alive and pinned.
    `device`: the CUDA device whose context registers it (for a call from another thread than
    the rank's; None: the current one). Raises RuntimeError when CUDA cannot register the memory."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    owner = _PinnedMap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc's large blocks
    buf = torch.frombuffer(owner, dtype=torch.uint8).zero_()
    if torch.cuda.is_available():
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            owner.register(buf.data_ptr())
    return buf


def pin_in_background(nbytes: int) -> concurrent.futures.Future:
    """`pinned_empty(nbytes)` in the allocator thread, registered by this thread's device."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return _ALLOCATOR.submit(pinned_empty, nbytes, device)


class _Region:
    """Where a tensor of a state lies in an arena: byte offset, shape and dtype."""

    __slots__ = ("offset", "shape", "dtype")

    def __init__(self, offset: int, shape: tuple, dtype: torch.dtype):
        self.offset, self.shape, self.dtype = offset, shape, dtype


def regions(state, arena: torch.Tensor):
    """`state` (host tensors inside `arena`, e.g. `carve`d from it) with every tensor replaced by
    its `_Region` in `arena`; other leaves kept: the layout another process that maps the arena
    (a courier, a holder, a replacement) rebuilds the state from (`from_regions`), no bytes.
    Raises ValueError for a tensor outside `arena`."""
    base, end = arena.data_ptr(), arena.data_ptr() + arena.numel()

    def region(x):
        if not isinstance(x, torch.Tensor):
            return x
        n = x.numel() * x.element_size()
        if n and not base <= x.data_ptr() <= x.data_ptr() + n <= end:
            raise ValueError("regions: a tensor of the state is not in the arena (copy the shard into it)")
        return _Region(x.data_ptr() - base if n else 0, tuple(x.shape), x.dtype)

    return tree_map(region, state)


def from_regions(layout, arena: torch.Tensor):
    """Inverse of `regions`: the state with tensors over the bytes of `arena` (no copy), each
    with a storage of its own bytes only (as `carve`'s: a deepcopy of one copies
    its bytes, not the arena's)."""
    memory = arena.numpy()

    def tensor(x):
        if not isinstance(x, _Region):
            return x
        n = torch.Size(x.shape).numel()
        if n == 0:  # frombuffer refuses count 0
            return torch.empty(x.shape, dtype=x.dtype)
        return torch.frombuffer(memory, dtype=x.dtype, count=n, offset=x.offset).view(x.shape)

    return tree_map(tensor, layout)


SEAL_BYTES = 64  # the head of a keeper's arena: the step its contents are complete for (`seal`)


class _MemoryFile:
    """A descriptor `fd` of a memory file (memfd) held by this process: the memory lives while
    any process holds a descriptor or mapping of it; another process of this node opens it
    through `path` while this object lives. `sealed()` reads the step written by `seal`."""

    fd = -1

    @property
    def path(self) -> str:
        """Where another process of this node opens the memory (while this object lives)."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def sealed(self) -> int:
        """The step the arena's contents are complete for (`SharedArena.seal`), -1: none."""
        return int.from_bytes(os.pread(self.fd, 8, 0), "little", signed=True)

    def close(self) -> None:
        """Give this process's descriptor back (a mapping made from it stays valid)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


class SharedArena(_MemoryFile):
    """uint8 [nbytes] host memory (`tensor`) that another process of this node can map
    (`attach_shared`): an anonymous memory file (memfd, named `name` in /proc/PID/maps, no path
    under /dev/shm), page-locked with cudaHostRegister where CUDA exists, so device-to-host
    copies into it are asynchronous. Nothing to clean up after any exit: the kernel frees the
    memory when the last descriptor and mapping of it are gone (a SIGKILLed owner included).
    The descriptor stays open while this object lives, so a process that maps it later (a new
    courier, a holder that adopts it: `AdoptedArena`) can still do so through `path`. A keeper
    uses the first `SEAL_BYTES` bytes as the arena's seal (`retire`, `seal`) and puts the state
    after them."""

    def __init__(self, nbytes: int, name: str = "shard-keeper", device: int | None = None):
        self.nbytes, self.fd = nbytes, os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(nbytes, 1))
        owner = _PinnedMap(self.fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
        self.tensor = torch.frombuffer(owner, dtype=torch.uint8)[:nbytes].zero_()
        if torch.cuda.is_available() and nbytes:
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                owner.register(self.tensor.data_ptr())

    @classmethod
    def reopen(cls, path: str, view: torch.Tensor) -> SharedArena:
        """Another arena's memory file at `path` (a `SharedArena` of a process that is gone,
        kept by the holder that adopted it) as this process's own arena, `view` its mapping
        here (uint8 [nbytes], e.g. `attach_shared(path, nbytes, pin=True)`): this process's
        descriptor keeps the memory alive, and its `path` lets others open it anew. Raises
        OSError when no process holds the file any more."""
        arena = cls.__new__(cls)
        arena.fd, arena.nbytes, arena.tensor = os.open(path, os.O_RDWR | os.O_CLOEXEC), view.numel(), view
        return arena

    def retire(self) -> None:
        """Mark the contents incomplete (`sealed()` -1) before they are overwritten: a reader
        that sees the seal of step k before and after reading read step k's bytes."""
        self.tensor[:8].view(torch.int64).fill_(-1)

    def seal(self, step: int) -> None:
        """Mark the contents complete for `step` (after every byte of it is in)."""
        self.tensor[:8].view(torch.int64).fill_(step)


class AdoptedArena(_MemoryFile):
    """Another process's `SharedArena` (opened through its `path`), `nbytes` bytes, kept alive
    by this process's own descriptor: its memory outlives its owner's process until `close`
    (or this object goes). Raises OSError when the owner is gone."""

    def __init__(self, path: str, nbytes: int):
        self.fd, self.nbytes = os.open(path, os.O_RDWR | os.O_CLOEXEC), nbytes
        self.ino = os.fstat(self.fd).st_ino

    def is_file(self, path: str) -> bool:
        """Whether `path` opens this same memory file."""
        try:
            return os.stat(path).st_ino == self.ino
        except OSError:
            return False


def process_gone(pid: int) -> bool:
    """Whether process `pid` of this node has ended: no such process, or a zombie (exited, its
    memory released, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def attach_shared(path: str, nbytes: int, pin: bool = False) -> torch.Tensor:
    """uint8 [nbytes] view of another process's `SharedArena` at `path` (`SharedArena.path`),
    mapped shared: the owner's writes are seen here. `pin`: every page mapped now
    (MAP_POPULATE) and, where CUDA exists, page-locked by this thread's device (cudaHostRegister,
    undone when the last view goes), so host-to-device copies from it run at full bus speed
    rather than faulting in and staging tens of GB at the time of the copy. Raises OSError when
    the owner is gone, RuntimeError when CUDA cannot register the memory."""
    with open(path, "r+b") as f:
        memory = _PinnedMap(f.fileno(), max(nbytes, 1), flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if pin else 0))
    view = torch.frombuffer(memory, dtype=torch.uint8)[:nbytes]
    if pin and nbytes and torch.cuda.is_available():
        memory.register(view.data_ptr())
    return view


def share_in_background(nbytes: int, name: str) -> concurrent.futures.Future:
    """`SharedArena(nbytes, name)` in the allocator thread, registered by this thread's device."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return _ALLOCATOR.submit(SharedArena, nbytes, name, device)
