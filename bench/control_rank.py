"""`ControlRank`: the rank actor of `bench.control_plane`, whose engine does no math. It keeps
the control surface of `megatron_actor.MegatronActor` that the driver's control plane uses:
`ping` (same answer: generation, rank, progress, step_progress, step, collectives) and `abort`
in a separate concurrency group, `join` through the driver's TCPStore with the same barrier
(`rendezvous`), a `train_step` that counts progress (and may hold, as a rank blocked in a
collective, until an abort frees it), `rollback` and `pid`. Light on purpose: torch (for the
store client) is imported on the first `join` only, so an actor that never joins costs what
a bare Ray actor costs."""
from __future__ import annotations

import datetime
import os
import threading
import time

import ray

from ftrain.control.rendezvous import arrive, release, wait_formed
from ftrain.failures import StaleGenerationError

CONTROL = "control"


@ray.remote(num_cpus=0, concurrency_groups={CONTROL: 2})
class ControlRank:
    def __init__(self, rendezvous_timeout_s: float):
        self.timeout_s = rendezvous_timeout_s
        self.generation: int | None = None
        self.rank: int | None = None
        self.progress = self.step = 0
        self._epoch = 0
        self._joining = None
        self._clients: dict[str, object] = {}  # "main" / "control" -> TCPStore client
        self._freed = threading.Event()          # set by abort: a held step returns

    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> dict:
        return {"generation": self.generation, "rank": self.rank, "progress": self.progress,
                "step_progress": 0, "step": self.step, "collectives": {}}

    @ray.method(concurrency_group=CONTROL)
    def abort(self, generation: int) -> float:
        t0 = time.perf_counter()
        self.generation = None
        self._epoch += 1
        if (joining := self._joining) is not None:
            release(self._client("control", *joining[1:]), f"gen{joining[0]}")
        self._freed.set()
        return time.perf_counter() - t0

    def connect(self, host: str, port: int) -> None:
        """Make the store clients now (torch imported), as `MegatronActor.prepare_spare` does."""
        self._client("main", host, port)
        self._client("control", host, port)

    def _client(self, which: str, host: str, port: int):
        import torch.distributed as dist

        if which not in self._clients:
            self._clients[which] = dist.TCPStore(host, port, is_master=False,
                                                 timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._clients[which]

    def join(self, generation: int, rank: int, world_size: int, host: str | None, port: int) -> float:
        """The barrier of `MegatronActor.join` (no process group is made); `host` None: no
        barrier (no store, no torch in this actor). Returns seconds."""
        t0 = time.perf_counter()
        epoch = self._epoch
        if host is None:
            self.generation, self.rank = generation, rank
            self._freed.clear()
            return 0.0
        import torch.distributed as dist

        self._client("control", host, port)
        store = dist.PrefixStore(f"gen{generation}", self._client("main", host, port))
        arrive(store, world_size)
        self._joining = (generation, host, port)
        try:
            formed = epoch == self._epoch and wait_formed(store, self.timeout_s)
        except TimeoutError:
            self._clients.pop("main")
            raise
        finally:
            self._joining = None
        if not formed or epoch != self._epoch:
            raise StaleGenerationError(f"rank {rank}: generation {generation} aborted while forming")
        self.generation, self.rank = generation, rank
        self._freed.clear()
        return time.perf_counter() - t0

    def train_step(self, generation: int, step: int, batch, hold_s: float = 0.0) -> dict:
        """Count the step's progress; with `hold_s`, then block up to that long (a rank in a
        collective) unless an abort frees it."""
        if generation != self.generation:
            raise StaleGenerationError(f"rank {self.rank}: call for generation {generation}")
        self.progress += 1
        self.step = step
        if hold_s:
            self._freed.wait(hold_s)
        return {"step": step, "rows": len(batch)}

    def rollback(self, generation: int, step: int) -> bool:
        return True
