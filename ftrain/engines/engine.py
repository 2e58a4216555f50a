"""The engine contract: what a rank's actor (`megatron_actor.MegatronActor`) asks of the model
code it drives. Two engines implement it: `torch_engine.TorchEngine` (CPU, gloo, torch DDP) and
`megatron_engine.MegatronEngine` (GPU, NCCL, Megatron-Core); the actor calls nothing else.

Threads. Every method runs on the actor's compute thread, except `interrupt` and `abort`, which
the control thread calls while a step may be running (or stuck in a collective) there.

Process groups. An engine owns the process groups of its rank: `connect` creates the default
group of one membership generation from the driver's store (and whatever groups the engine
builds on it), `abort` frees a compute thread blocked in one of them, `disconnect` forgets them
without any collective. State (`step`, weights, optimizer, RNG) outlives a generation.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    from ftrain.data.training_batch import TrainingBatch
    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.state.host_memory import HostCopy
    from ftrain.state.manifest import Manifest


class Interrupted(RuntimeError):
    """A step cut short by an engine's `interrupt` (its generation was aborted); the rollback
    that follows discards what it changed."""


class StepInterrupt:
    """Stops the running step (or rollout) of an aborted generation: once `set` (from another
    thread), hooks on the watched modules raise `Interrupted` at the next module forward or
    parameter gradient, instead of letting the step run to its end. Why: a survivor joins the
    next generation only after its step returns, and on GPU an aborted NCCL collective returns
    without raising, so the step would otherwise run on for up to a step time. One Python call
    per module forward and per parameter gradient."""

    def __init__(self):
        self._event = threading.Event()

    def watch(self, module: torch.nn.Module) -> None:
        """Hook every submodule's forward and every trainable parameter's gradient."""
        for m in module.modules():
            m.register_forward_pre_hook(self.check)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.check)

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def check(self, *_) -> None:
        """Raises `Interrupted` when set."""
        if self._event.is_set():
            raise Interrupted("step interrupted: its process-group generation was aborted")


class Engine(Protocol):
    """Model, optimizer, LR schedule and process groups of one rank (or of a pre-warmed spare,
    which builds its model in `__init__` and joins no group until `connect`).

    Attributes read by the actor: `step` (train steps whose update the live state holds),
    `progress` (monotonic count of work done: micro-batches, collectives, sampling rounds; a
    rank stuck before a collective shows a lower count than its peers waiting inside it),
    `step_start_progress` (`progress` when the current step began), `checks_while_loading`
    (whether `load_checkpoint` hashes the bytes it reads against the manifest, raising
    CheckpointMismatch after the load on a mismatch: the ranks then check only sizes before
    it), `save_phases` (seconds by part of the last `save_checkpoint` call). Set by the actor:
    `fault_point(point)` (fault injection, called at the named points) and `delay_s` (fault
    'slow': extra seconds per micro-batch).
    """

    step: int
    progress: int
    step_start_progress: int
    checks_while_loading: bool
    save_phases: dict[str, float]
    fault_point: Callable[[str], None]
    delay_s: float

    # -- process groups (compute thread, except interrupt / abort) ----------------------------
    def connect(self, store, dims: ParallelDims, rank: int) -> dict[str, float]:
        """Join a membership generation as `rank` of `dims`: create the default process group
        from `store` (a `torch.distributed.Store` every member of this generation uses, with
        the collective timeout `fault_tolerance.step_timeout_s` for gloo, `collective_timeout_s`
        for NCCL) and the engine's groups on
        it; the training state carries over. Returns seconds by part (`process_group_s` first,
        then the engine's own parts), the rebuild detail of a recovery timeline."""

    def disconnect(self) -> None:
        """Forget the groups of an aborted generation without any collective (safe to call in
        any state, also when no generation was joined)."""

    def interrupt(self) -> None:
        """Control thread: make the running step or rollout raise `Interrupted` at its next
        module forward or parameter gradient. Cleared by `connect`."""

    def abort(self, grace_s: float) -> None:
        """Control thread: `interrupt`, then abort (not destroy) every communicator of this
        process, which frees a compute thread blocked in a collective whose peer died.
        Raises RuntimeError when the compute thread is still inside a collective `grace_s`
        seconds later: the rank must then be replaced."""

    # -- compute -----------------------------------------------------------------------------
    def train_step(self, batch: TrainingBatch, step: int) -> dict:
        """One PPO step on this DP replica's part of the global batch (B = global_batch_size /
        dp). Returns python floats `loss`, `mini_losses`, `grad_norm`, `lr`, PPO metrics, and
        on the first step after a `connect` optionally `phases` (seconds by part)."""

    def dp_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum float64 `values` (CPU, [K]) over this rank's DP group (one replica's rank at each
        (tp, cp, pp)): a collective every DP member calls, e.g. the masked tokens of each
        mini-batch of rows each replica read itself (`rank_rows.RankRows`). Returns a CPU tensor."""

    def generate(self, prompts: TrainingBatch, step: int, rows: list[int], stop_ids: tuple[int, ...],
                 pad_id: int) -> dict:
        """RL rollout: sample completions of this replica's prompt rows (`rows`: their global
        row indices, which seed the sampling) with the current policy, stopping at the task's
        `stop_ids` and padding with its `pad_id` (the tokenizer's); changes no state.
        Returns `rl.sample`'s dict of CPU [B, S] tensors plus `values` (float32 or None)."""

    # -- in-memory state ---------------------------------------------------------------------
    def snapshot(self) -> None:
        """At the start of a step: keep a host copy of the committed state (for `rollback`)
        where the engine keeps one, and mark the live state dirty until the step ends."""

    def rollback(self, step: int) -> bool:
        """Return to committed step `step` from local state, no transfer. False when this rank
        holds no copy of that step."""

    def start_host_copy(self) -> HostCopy | None:
        """Start copying the live training state (committed step `step`) into host buffers
        kept for it, overlapped with the next step, and return at once (None: the buffers are
        not ready yet, e.g. still being pinned; the caller skips this snapshot). Every later
        change of the live state is ordered after the copy, so its bytes are that step's. The
        buffers are reused by the next call: the caller is done with them first."""

    def prepare_host_copy(self) -> None:
        """Allocate (on GPU: pin, in the background) the buffers of `start_host_copy` now, so
        that no training step pays for it; called when a rank joins with memory snapshots on."""

    def load_state(self, state: dict) -> None:
        """Make `state` (a `start_host_copy` state of the same rank position) the live state."""

    def shard_nbytes(self, whole: bool = False) -> int:
        """Bytes of host memory `start_shard_copy` needs for this rank's optimizer shard now
        (`whole`: for its whole training state)."""

    def start_shard_copy(self, arena: torch.Tensor, whole: bool = False) -> HostCopy | None:
        """As `start_host_copy`, of this rank's optimizer shard only (with a sharded optimizer,
        `model.distributed_optimizer`: the part of the state no DP peer holds) and the step, for
        its keeper (keeper.py), into buffers carved from `arena` (uint8 host memory of at least
        `shard_nbytes(whole)` bytes, e.g. a `host_memory.SharedArena`'s; the caller is done with
        the copy it held before). `whole`: the whole training state (`start_host_copy`'s, for
        the local keeper at dp = 1; `load_state` loads it). None without a sharded optimizer and
        not `whole`. Raises ValueError when `arena` is too small."""

    def load_shard(self, state: dict) -> None:
        """Make `state` (a `start_shard_copy` state of the same rank position) the live optimizer
        shard; the rest of the state is already at its step (`broadcast_from`). Raises
        ValueError when it is of another step."""

    def sync_params(self) -> None:
        """Collective over this rank's DP group, after a restore (`fault_tolerance`): make the
        params consistent with the restored optimizer shards where the engine derives them from
        the shards (Megatron's distributed optimizer: `rollback` and `broadcast_from` then set
        the shards only); a no-op for an engine that restores the params whole."""

    def broadcast_from(self, src_rank: int, ranks: list[int] | None = None) -> None:
        """Collective over this rank's DP group: receive the training state of `src_rank`.
        `ranks`: only these members take part (the source and the replaced ranks), where the
        engine can form such a group; None: the whole DP group. A sharded optimizer's shards
        are not broadcast (each rank keeps its own; a replaced rank's comes from `load_shard`)."""

    def state_digest(self) -> str:
        """SHA-256 over the live training state (`engine.state_digest`: weights, optimizer state,
        schedule and step): replicas and runs that agree bitwise have equal digests."""

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, ckpt, step: int, dims: ParallelDims, rank: int,
                        async_save: bool = False) -> list:
        """Write this rank's shards of checkpoint `step` through `ckpt` (the run's checkpoint
        manager, the example's `checkpoint.CheckpointManager`); returns their FileEntry list, or with
        `async_save` a list of futures of such lists (the state copied to host memory first).
        Raises CheckpointError on storage failure past the retry budget."""

    def load_checkpoint(self, ckpt, manifest: Manifest, rank: int) -> None:
        """Load this rank's state from the committed, verified checkpoint `manifest`."""

    # -- spare preparation -------------------------------------------------------------------
    def snapshot_nbytes(self) -> int:
        """Bytes of host memory this rank's rollback snapshot takes (0 when it keeps none)."""

    def save_nbytes(self) -> int:
        """Bytes of host memory this rank's async checkpoint saves copy its state into (0 when
        saves are synchronous or nothing is reserved for them)."""

    def reserve_host_memory(self, nbytes: int, save_nbytes: int = 0) -> bool:
        """Spare: reserve `nbytes` of host memory for the snapshot it will keep once it joins,
        and `save_nbytes` for its async saves' copies; returns whether it reserved the
        snapshot's."""

    def warm_up(self, checkpoints: Callable) -> float:
        """Spare: pay the process's one-time first-step costs before any failure. `checkpoints`
        makes a checkpoint manager of a local directory (the example's `CheckpointManager`),
        for a save that warms the save path. Returns seconds (0.0 when there is nothing to
        warm)."""


def state_digest(state) -> str:
    """SHA-256 over a training state (nested dicts / lists of tensors and python values, as an
    engine's `_train_state`): every tensor's dtype, shape and bytes and every other leaf's repr,
    in the state's order. Equal digests: bitwise equal weights, optimizer state and counters."""
    import hashlib

    h = hashlib.sha256()
    for x in torch.utils._pytree.tree_leaves(state):
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().contiguous()
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()
