"""The GPU engine (`engine.Engine`): a Megatron-Core `GPTModel` trained with PPO under Megatron
DDP, the Megatron (optionally distributed) optimizer and the pipeline schedule, over NCCL.

The model comes from `megatron_model`, the TP/PP/CP operations and RL sampling from
`megatron_ops`, checkpoint I/O from `megatron_checkpoint`, pinned host buffers from
`host_memory`, and every patch of Megatron-Core internals from `megatron_compat`.

Lifecycle. Megatron layers, DDP buckets and the optimizer keep the process groups they were
built with. In every `connect`, `parallel_state.initialize_model_parallel` makes the groups of
the new generation; a rank that keeps its layout and rank position (a survivor) keeps its model,
DDP wrapper, optimizer and schedule and only moves their group references onto the new groups
(`megatron_groups.rebind`): no tensor is copied and nothing is built. A rank whose position
changed (DP resized) builds the objects again and copies its training state into them in place.
A pre-warmed spare has imported Megatron and made its CUDA context in `__init__`; with
tp = pp = cp = 1 it also builds its model while warming (`warm_up`), else when it first joins,
from `train.seed`, so it starts equal to a reference run's step 0.

Peer restore and the distributed optimizer. With `model.distributed_optimizer: true` each DP
rank holds a different shard of the fp32 main params and Adam moments, so no DP peer can supply
a replaced rank's shard. With the shard keeper (`fault_tolerance.shard_keeper`, dp >= 2,
keeper.py) each rank keeps a rollback snapshot of its params and shard, `start_shard_copy`
gives the shard to its keeper after every step, and a replaced rank gets the params from a peer
(`broadcast_from`, the shards excluded) and its shard back with `load_shard`. Without the keeper
`rollback(step > 0)` returns False on every rank, and the recovery protocol falls back to the
newest checkpoint. With `distributed_optimizer: false` every DP rank holds the whole state of
its (tp, cp, pp) shard and `broadcast_from` restores params and optimizer state from a peer.

Log-probs across shards: the vocabulary-parallel cross entropy gives log p(token) on every TP
rank from its vocabulary shard (-CE = log p). With cp > 1 the sequence is cut into 2*cp chunks
and rank r keeps chunks r and 2*cp-1-r (Megatron's load-balanced layout); labels are shifted
before the split, and per-token log-probs are all-gathered (differentiably) over the CP group
before the PPO loss. Attention over the CP-split sequence is Transformer Engine's where it is
installed, else `megatron_attention.SDPAttention`'s (K/V all-gathered over the CP group).

Vocabulary: the embedding is padded to a multiple of 128 (`megatron_model.padded_vocab_size`).
Padded entries take part in the softmax, as in Megatron's own training (RL masks them:
`megatron_ops.mask_padded_vocab`).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftrain.config import Config
from ftrain.data.training_batch import TrainingBatch, synthetic_batch
from ftrain.distributed import comms
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.engines.engine import StepInterrupt, state_digest
from ftrain.engines.megatron_checkpoint import SavePlanCache, load_sharded, reserve_save_arena, save_sharded
from ftrain.engines.megatron_compat import (cpu_stand_ins, foreach_grad_norm, local_param_groups,
                                            params_from_main_params, patch_distributed_optimizer)
from ftrain.engines.megatron_groups import StaleGroups, make_groups, rebind
from ftrain.engines.megatron_model import build_gpt_model, hf_bridge, hf_model_args
from ftrain.engines.megatron_ops import (add_value_head, cp_gather, cp_split, mask_padded_vocab, sample_rollouts,
                                         token_values, vocab_parallel_entropy)
from ftrain.objectives.ppo import behaviour_pass_needed, ce_objective, ppo_objective
from ftrain.state.host_memory import (STAGING_BYTES, HostCopy, carve, carve_shard, configure_host_allocator, copy_state,
                                      copy_to_host, pin_in_background, pinned_empty, same_layout, state_nbytes,
                                      state_tensors)
from ftrain.state.keeper import keeps_shards

log = logging.getLogger(__name__)


TENSOR_PARTS = ("model", "optimizer", "reference")  # the parts of `_train_state` that hold tensors


def _with_counters(into: dict, state: dict) -> dict:
    """`into` (a host copy of `state`'s tensors) with `state`'s python values: the schedule's
    update count, the step and, with RL, the rollout position."""
    into.update(sched_steps=state["sched_steps"], step=state["step"])
    if "rollout" in state:
        into["rollout"] = dict(state["rollout"])
    return into


def _shard(dims: ParallelDims, rank: int) -> tuple[int, int, int]:
    """(tp, pp, cp) coordinates of `rank`: which model shard it holds (its DP replicas hold the same)."""
    c = dims.coords(rank)
    return c.tp, c.pp, c.cp


class MegatronEngine:
    """Megatron-Core GPT model, optimizer and cosine LR schedule of one rank (CUDA device 0 of
    the process, bf16 params with fp32 main params and fp32 gradient reduction). In a process
    without CUDA it runs on the CPU over gloo (`megatron_compat.cpu_stand_ins`; tests of its
    logic: the config accepts the Megatron engine only with GPUs).

    `__init__` also sets up the process for CUDA (`host_memory.configure_host_allocator`, NCCL's
    environment, device 0): make the engine before anything initialises CUDA in the process.

    Raises ValueError from `__init__` when `model.hf_path` holds a model it cannot load
    (`hf_bridge`, `hf_model_args`).

    RL (`rl.enabled`, as `TorchEngine`): `generate` samples rollouts (`sample_rollouts`); with
    `rl.advantage=gae` the last stage's GPTModel carries a value head (`add_value_head`), and
    with `rl.kl_coef > 0` a frozen reference GPTModel of the same layout (the initial policy)
    gives `ref_log_probs`. `_loss` adds the value, KL and entropy terms (`ppo.ppo_objective`).
    Value head, reference weights and the rollout position are part of the training state
    (snapshots, rollback, peer broadcast, reset) and of the checkpoint.
    """

    checks_while_loading = True  # `load_checkpoint` hashes this rank's share of local files beside the load

    def __init__(self, cfg: Config):
        # Process set-up, before CUDA is initialised in this process.
        configure_host_allocator()
        if cfg.fault_tolerance.nccl_split_share:
            # NCCL reads it at its first communicator; aborting communicators is faster with it.
            os.environ["NCCL_COMM_SPLIT_SHARE_RESOURCES"] = "1"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        else:  # a CPU process (tests of the engine's logic over gloo): see `megatron_compat.cpu_stand_ins`
            cpu_stand_ins()
        foreach_grad_norm()  # gradient clipping without a device sync per parameter
        self.cfg = cfg
        m = cfg.model
        # Pre-warm: imports and the CUDA context; the model needs this generation's groups.
        from megatron.core import dist_checkpointing, parallel_state  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        torch.zeros(1, device=self.device)
        self.bf16 = m.dtype == "bfloat16"
        # HF checkpoint: checked here (a bad model.hf_path fails before any group forms); its
        # weights are read in every `_build`, so a model built from it starts from them.
        self.hf_bridge = None
        if m.hf_path:
            self.hf_bridge = hf_bridge(m.hf_path, torch.bfloat16 if self.bf16 else torch.float32)
            hf_model_args(self.hf_bridge, m.hf_path, cfg.parallel.tp, cfg.parallel.pp)
        self.rl = cfg.rl if cfg.rl.enabled else None
        self.model = None              # the unwrapped GPTModel (this rank's pipeline stage)
        self.ref_model = None          # RL with kl_coef > 0: frozen reference policy (wrapped like the model)
        # Rollout stream position (as TorchEngine): samples trained on so far.
        self.rollout = {"seed": cfg.train.seed, "samples": 0}
        self.ddp = self.optimizer = self.scheduler = None
        self.dims: ParallelDims | None = None
        self.rank: int | None = None
        self.progress = 0              # micro-batches done, ever (monotonic); read by the health monitor
        self.step_start_progress = 0   # `progress` when the current step started
        self.fault_point = lambda point: None  # set by the actor (fault injection)
        self.delay_s = 0.0             # fault injection 'slow': extra seconds per micro-batch
        self.save_phases: dict[str, float] = {}  # seconds by part of the last save_checkpoint
        self._step = 0                 # `step`
        self._kept: dict | None = None  # host buffers of this step's `start_shard_copy` (see `step`)
        self._dirty = False            # True while a step may have partly updated the state
        self._params_pending = False   # the params wait for `sync_params` (only the shard was restored)
        self._initial: dict | None = None   # host copy of the step-0 state (taken before step 1)
        self._snapshot: dict | None = None  # host copy of the last committed step's state
        self._rollback_buffers: dict | None = None  # the snapshot's own buffers (`_snapshot_to_host`)
        self._trained_since_connect = False
        self._sockets: dict[int, str] = {}  # what this generation's gloo groups opened (`abort`)
        self._arena: concurrent.futures.Future | None = None    # pinned bytes of the snapshot buffers
        self._copy_stream: torch.cuda.Stream | None = None       # side stream of the snapshot copy
        self._copy_done: torch.cuda.Event | None = None          # the snapshot copy in flight
        self._staging: torch.Tensor | None = None  # device buffer of `copy_to_host` (STAGING_BYTES)
        self._copy_launcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot-copy")
        self._copy_launched: concurrent.futures.Future | None = None  # its launch (`_host_copy_async`)
        self._send_arena: concurrent.futures.Future | None = None  # pinned bytes of `start_host_copy`
        self._send_buffers: dict | None = None  # its buffers (views of the arena) for this layout
        self._shard_buffers: dict[int, dict] = {}  # `start_shard_copy`'s buffers, by arena address
        self._save_plans: SavePlanCache | None = None  # of this optimizer's layout, see `save_checkpoint`
        self._connected = False
        self._interrupt = StepInterrupt()  # hooks on each model `_build` makes
        self._groups: dict = {}        # this generation's groups by role (`megatron_groups`)
        self._position: tuple | None = None  # (dims, rank) the model, DDP and optimizer were built for
        self._prebuilt: dict | None = None   # spare: the model `warm_up` built, its groups and RNG states
        self._warmed = False           # `warm_up` ran: a process warms up once
        self._tc = None                # the model's TransformerConfig

    @property
    def step(self) -> int:
        """Train steps whose update the live state contains."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        # Whatever changes the live state sets the step (a train step, rollback, restore, load
        # or rebuild), so a kept copy of the state before no longer stands for it.
        self._step, self._kept = value, None

    # -- process groups ----------------------------------------------------------------------
    def connect(self, store, dims: ParallelDims, rank: int) -> dict[str, float]:
        """Join a generation as `rank` of `dims`: create the default NCCL process group from
        `store` (collective timeout `fault_tolerance.collective_timeout_s`; with
        `fault_tolerance.nccl_eager_init` its communicator is made at once, on device 0) and
        Megatron's groups on it (`megatron_groups.make_groups`).

        A rank that held this layout and rank position before (a survivor) keeps its model, DDP
        wrapper, optimizer and schedule: only their group references move to the new groups
        (`megatron_groups.rebind`), so its state and RNG states are untouched. Otherwise the
        objects are built for the new position: a spare from the model it built while warming
        (`warm_up`, layouts with tp = pp = cp = 1) or from `train.seed`, starting equal to a
        reference run's step 0; a rank whose DP index changed carries its training state and
        RNG states over by copying tensors in place; one that now holds another model shard
        (other tp / pp / cp coordinates) starts as a spare, with no snapshot. Returns seconds by part:
        `process_group_s`, `groups_s`, and `rebind_s` or `build_s` (model), `wrap_s` (DDP,
        optimizer, schedule), `state_copy_s`. Raises ValueError when `dims` has other tp / pp /
        cp sizes than the config."""
        if (dims.tp, dims.pp, dims.cp) != (self.cfg.parallel.tp, self.cfg.parallel.pp, self.cfg.parallel.cp):
            raise ValueError(f"dims {dims} do not match the config's parallel sizes {self.cfg.parallel}")
        ft = self.cfg.fault_tolerance
        # From here this generation's collectives may run: an abort after it interrupts them again.
        self._interrupt.clear()
        t_pg = time.perf_counter()
        # Hangs are the health monitor's to find (step deadline, extended by progress) and end
        # (abort); NCCL's watchdog is the backstop: past collective_timeout_s it tears the process
        # down (mode 3, stated rather than inherited), which recovery sees as a crash. gloo (CPU)
        # keeps step_timeout_s as its backstop: it has no abort (`abort` shuts its sockets down).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        timeout = ft.collective_timeout_s if self.backend == "nccl" else ft.step_timeout_s
        if self.backend == "gloo":
            comms.interruptible_waits(self._interrupt.check)  # a gloo wait blocks: `abort` must end it
        sockets = comms.recording_new_sockets(self._sockets) if self.backend == "gloo" else contextlib.nullcontext()
        with sockets:  # every gloo group connects its pairs when made: `abort` shuts them down
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=dims.world_size,
                                    timeout=datetime.timedelta(seconds=timeout),
                                    device_id=self.device if ft.nccl_eager_init and self.backend == "nccl" else None)
            parts = {"process_group_s": time.perf_counter() - t_pg}
            self._wait_snapshot_copy()  # a rebuild frees tensors it may still be reading
            t0 = time.perf_counter()
            old_groups, self._groups = self._groups, make_groups(dims)
            parts["groups_s"] = time.perf_counter() - t0
        # Every member of a generation plans its first save afresh (the plans hold the old
        # groups; a survivor reusing them while a new member plans would wait in other collectives).
        self._save_plans = None
        same_position = self.ddp is not None and self._position == (dims, rank)
        self.dims, self.rank = dims, rank
        if not (same_position and self._rebind([self.ddp, self.optimizer, self.ref_model], old_groups, parts)):
            # Carry the live state over, unless its optimizer shards no longer fit (DP resized
            # under the distributed optimizer: the state is then restored from a checkpoint) or
            # the rank now holds another model shard (other tp / pp / cp coordinates: a member
            # of a dropped replica reused as a spare). Such a rank starts as a spare does, from
            # `train.seed` at step 0; its snapshot and initial copy are of the old shard.
            moved = self._position is not None and _shard(*self._position) != _shard(dims, rank)
            if moved:
                self._snapshot = self._initial = None
            keep = self.ddp is not None and not moved and not (
                self.cfg.model.distributed_optimizer and self._position[0].dp != dims.dp)
            old = self._train_state() if keep else None
            rng = self._rng_state() if keep else None
            self._build(parts)
            t2 = time.perf_counter()
            if old is None:  # a fresh build: the seeded step-0 state, clean
                self.step, self._dirty, self._params_pending = 0, False, False
            else:
                dirty = self._dirty  # a step cut short stays so: `rollback` must not take it for committed
                self._set_train_state(old)
                self._dirty = dirty
                self._set_rng_state(rng)
                torch.cuda.synchronize()
            del old
            parts["state_copy_s"] = time.perf_counter() - t2
        if self.cfg.model.distributed_optimizer and not same_position:
            self._snapshot = None  # its optimizer shard is the old position's
        self._position = (dims, rank)
        self._trained_since_connect = False
        self._connected = True
        # Pinned host memory the first steps would otherwise wait for, pinned in the background.
        self.reserve_host_memory(self.snapshot_nbytes())  # the rollback snapshot (none with dist-opt and no keeper)
        if self.cfg.checkpoint.async_save:
            reserve_save_arena(state_nbytes(self._train_state()))
        return parts

    def _rebind(self, objects: list, old_groups: dict, parts: dict) -> bool:
        """Move `objects` onto this generation's groups (`megatron_groups.rebind`); adds
        `rebind_s` to `parts`. False (logged) when some reference could not be moved: the
        caller builds the objects again."""
        t0 = time.perf_counter()
        try:
            rebind(objects, old_groups, self._groups)
        except (StaleGroups, ValueError) as e:
            log.warning("rank %s builds its model again: %s", self.rank, e)
            return False
        parts["rebind_s"] = time.perf_counter() - t0
        return True

    def interrupt(self) -> None:
        """Make the running step (or rollout) raise `engine.Interrupted` at its next
        module forward or parameter gradient (`StepInterrupt`); called from another thread when
        the generation is aborted (an aborted NCCL collective returns without raising, so the
        step would run on); on gloo also at once from any wait for a collective
        (`comms.interruptible_waits`). Kernels already queued still run; `rollback` or a
        restore follows. Cleared by `connect`."""
        self._interrupt.set()

    def abort(self, grace_s: float) -> None:
        """Control thread: `interrupt`, then abort every communicator of this process
        (`comms.abort_process_groups`), which frees a compute thread blocked in a collective.
        `grace_s` is not waited for: NCCL's abort ends its collectives, so the compute thread
        is never left inside one. gloo has no abort: its groups' sockets are shut down first
        (`comms.shutdown_sockets`), which fails a collective blocked on a peer that is alive
        but gone elsewhere (a TP peer that left the step for the abort), at once rather than
        at the group's timeout; a wait the shutdown does not fail ends at the interrupt."""
        self.interrupt()
        comms.shutdown_sockets(self._sockets)
        if dist.is_initialized():
            comms.abort_process_groups()

    def disconnect(self) -> None:
        """Mark the generation's groups unusable and forget them, without any collective; the
        state stays for `connect`. Aborts the groups of a generation whose forming was cancelled
        (still initialised here), then closes NCCL group calls an aborted step left open on this
        thread (`comms.close_open_nccl_groups`): else the next generation's communicators would
        wait for a group end that never comes."""
        self._connected = False
        self._sockets = {}
        if dist.is_initialized():
            comms.abort_process_groups()
        if self.backend == "nccl":
            comms.close_open_nccl_groups()

    def _build(self, parts: dict) -> None:
        """Build model, DDP, optimizer and schedule for this generation's position, from the
        model `warm_up` built when it fits (tp = pp = cp = 1: every rank's model is the same
        shard) and nothing else was built since. Adds `build_s` or `rebind_s`, and `wrap_s`."""
        self.model = self.ddp = self.optimizer = self.scheduler = self.ref_model = None
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        prebuilt, self._prebuilt = self._prebuilt, None
        if prebuilt is not None and self._rebind(list(prebuilt["objects"]), prebuilt["groups"], parts):
            self.model, self.ref_model, self._tc = prebuilt["objects"]
            self._set_rng_state(prebuilt["rng"])
        else:
            self._build_model()
            parts["build_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        self._wrap()
        torch.cuda.synchronize()
        parts["wrap_s"] = time.perf_counter() - t1

    def _build_model(self) -> None:
        """This rank's GPTModel stage (value head, frozen reference policy as RL needs), seeded
        from `train.seed` and the pipeline rank, on the current groups."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module

        d = self.dims
        model_parallel_cuda_manual_seed(self.cfg.train.seed + 100 * ps.get_pipeline_model_parallel_rank())
        # HF weights are in the model before DDP (its buffers) and the optimizer (fp32 main
        # params) copy them.
        model, self._tc = build_gpt_model(self.cfg, d.tp, d.pp, d.cp, self.hf_bridge)
        self.model = model.to(self.device)
        if self.rl is not None and self.rl.kl_coef > 0:
            # Same layout and groups; weights = this policy's as built (a survivor's trained
            # reference comes back with its state in `connect`).
            ref, ref_tc = build_gpt_model(self.cfg, d.tp, d.pp, d.cp, self.hf_bridge, initialize=False)
            ref = ref.to(self.device).eval().requires_grad_(False)
            with torch.no_grad():
                for r, p in zip(ref.parameters(), self.model.parameters(), strict=True):
                    r.copy_(p)
            self.ref_model = Float16Module(ref_tc, ref) if self.bf16 else ref
        if self.rl is not None and self.rl.advantage == "gae" and ps.is_pipeline_last_stage():
            add_value_head(self.model)  # before DDP and the optimizer: trained with the model

    def _wrap(self) -> None:
        """DDP wrapper, optimizer and LR schedule around `self.model`, on the current groups."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        m, t, tc = self.cfg.model, self.cfg.train, self._tc
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        module = Float16Module(tc, self.model) if self.bf16 else self.model
        self.ddp = DistributedDataParallel(
            config=tc, module=module,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=m.distributed_optimizer))
        with local_param_groups():  # no collective: survivors that keep their optimizer make none
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=0.0, weight_decay=t.weight_decay,
                                adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, bf16=self.bf16,
                                params_dtype=dtype, clip_grad=t.grad_clip,
                                use_distributed_optimizer=m.distributed_optimizer),
                [self.ddp], use_gloo_process_groups=False)
        updates = t.lr_decay_updates()  # cosine to 0, then 0
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=t.lr, min_lr=0.0, lr_warmup_steps=0,
            lr_decay_steps=updates, lr_decay_style="cosine", start_wd=t.weight_decay,
            end_wd=t.weight_decay, wd_incr_steps=updates, wd_incr_style="constant")
        patch_distributed_optimizer(self.optimizer)

        def finalize_with_fault_point(*args, **kwargs):
            # Megatron runs the DP gradient all-reduce inside finalize_model_grads: the chaos
            # point 'inside_allreduce' fires as this rank enters it (peers there first block).
            self.fault_point("inside_allreduce")
            return finalize_model_grads(*args, **kwargs)

        tc.finalize_model_grads_func = finalize_with_fault_point
        for m in (self.ddp, self.ref_model):
            if m is not None:
                self._interrupt.watch(m)
        tc.grad_scale_func = self.optimizer.scale_loss
        self._init_optimizer_state()

    def _init_optimizer_state(self) -> None:
        """Create Adam's state (step 0, zero moments: what torch's lazy init makes) so that every
        rank's state has the same structure before the first step (for copies/broadcasts)."""
        for o in self.optimizer.chained_optimizers:
            for g in o.optimizer.param_groups:
                for p in g["params"]:
                    s = o.optimizer.state[p]
                    if not s:
                        s.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))

    # -- compute -----------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model, behaviour: bool = False):
        """Megatron `forward_step_func`: one micro-batch through this pipeline stage. With a
        value head (last stage, GAE) the values of a training pass go to the loss."""
        from megatron.core import parallel_state as ps

        mb: TrainingBatch = next(data_iterator)
        if self.delay_s:
            time.sleep(self.delay_s)
        cp, cp_rank = self.dims.cp, ps.get_context_parallel_rank()
        pos = torch.arange(mb.input_ids.shape[1], device=self.device).expand_as(mb.input_ids)
        ids, pos = cp_split(mb.input_ids, cp, cp_rank), cp_split(pos, cp, cp_rank)
        if self.rl is None:  # only the targets' log-probs are needed: the model's own cross entropy
            out = model(ids, pos, None, labels=self._labels(mb))
        else:
            out = model(ids, pos, None)
        self.progress += 1
        values = token_values(self.model) if not behaviour and hasattr(self.model, "value_head") else None
        return out, functools.partial(self._loss, mb, values, behaviour)

    def _labels(self, mb: TrainingBatch) -> torch.Tensor:
        """The next token at each position, int64 [B, S/cp] (0 after the last): this CP rank's
        part (`cp_split`)."""
        from megatron.core import parallel_state as ps

        return cp_split(F.pad(mb.input_ids[:, 1:], (0, 1)), self.dims.cp, ps.get_context_parallel_rank())

    def _loss(self, mb: TrainingBatch, values: torch.Tensor | None, behaviour: bool, out: torch.Tensor):
        """Last stage: the model's output -> (loss to backprop, reported dict). Without RL `out`
        is the model's per-token cross entropy float32 [B, S/cp] of the next token (GPTModel's
        `labels` path, as Megatron-LM computes its loss: the vocabulary-parallel cross entropy
        in float32 on the model's logits, without their transposed float32 copy); with RL it is
        the logits float32 [B, S/cp, V_pad/tp]. A behaviour pass (forward only: old or
        reference policy) reports `log_probs` [B, S].

        Training: `ppo.ce_objective` for train.objective=ce; else `ppo.ppo_objective`, as
        `TorchEngine._loss`: the dual-clip PPO policy loss;
        with RL plus `value_coef` x clipped value loss (GAE, `values` float32 [B, S] of the
        value head), `kl_coef` x KL(policy || reference) (`rl.kl_estimator`), - `entropy_coef` x
        entropy, each aggregated with `ppo.loss_agg_mode`. RL logits are divided by
        `rl.temperature` and their padded vocabulary columns masked (`mask_padded_vocab`): the
        distribution the rollouts were sampled from. The entropy is vocabulary-parallel
        (`vocab_parallel_entropy`, no gather of the logits) and computed before the cross
        entropy, which overwrites fp32 logits in place."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        cp, r, entropy = self.dims.cp, self.rl, None
        if r is None:
            lp_next = -out                                                      # [B, S/cp]
        else:
            logits = mask_padded_vocab(out.float(), self.cfg.model.vocab_size) / r.temperature
            if r.entropy_coef > 0 and not behaviour:
                entropy = vocab_parallel_entropy(logits)                       # [B, S]
            lp_next = -vocab_parallel_cross_entropy(logits, self._labels(mb))  # [B, S/cp]
        lp_next = cp_gather(lp_next, cp, ps.get_context_parallel_group())       # [B, S]
        log_probs = F.pad(lp_next[:, :-1], (1, 0))                              # [B, S]
        if behaviour:
            return torch.zeros((), device=self.device), {"log_probs": log_probs.detach()}
        if self.cfg.train.objective == "ce":  # no old log-probs: no behaviour pass ran
            loss, metrics = ce_objective(log_probs, mb)
        else:
            loss, metrics = ppo_objective(log_probs, mb, self.cfg.ppo, r, values, entropy)
        # Every CP rank computes the same loss; the gather's backward sums cp copies and the
        # schedule multiplies by cp (gradients are averaged over dp*cp): divide by cp once.
        return loss / cp, {"loss": loss.detach(), **metrics}

    def _run(self, micros: list[TrainingBatch], forward_only: bool, model=None) -> list[dict]:
        """The pipeline schedule over `micros` with `model` (default: the DDP-wrapped policy).
        Forward-only runs are behaviour passes (they report log-probs)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=functools.partial(self._forward_step, behaviour=forward_only),
            data_iterator=iter(micros), model=[model or self.ddp],
            num_microbatches=len(micros), seq_length=micros[0].input_ids.shape[1],
            micro_batch_size=len(micros[0]), forward_only=forward_only)

    def _behaviour_log_probs(self, model, batch: TrainingBatch) -> torch.Tensor:
        """Token log-probs float32 [B, S] of `batch` under `model` (the policy's DDP wrapper or
        the reference model), forward only, micro-batch by micro-batch; zeros on stages other
        than the last (only the last computes a loss)."""
        from megatron.core import parallel_state as ps

        with torch.no_grad():
            out = self._run(batch.chunk(len(batch) // self.cfg.train.micro_batch_size), True, model)
        return torch.cat([o["log_probs"] for o in out]) if ps.is_pipeline_last_stage() else torch.zeros_like(batch.loss_mask)

    @torch.no_grad()
    def generate(self, prompts: TrainingBatch, step: int, rows: list[int], stop_ids: tuple[int, ...],
                 pad_id: int) -> dict:
        """Sample completions of this replica's prompt rows with the current policy, as
        `TorchEngine.generate`: row j's randomness comes from `rl.row_seed(train.seed, step,
        rows[j])` (global row indices), so a row samples the same at any DP size; a row stops at
        any of `stop_ids` and is padded with `pad_id`; every rank
        of the replica (all TP and PP ranks) returns the same result (`sample_rollouts`).
        `progress` grows by one per sampling round. Returns `rl.sample`'s dict of CPU [B, S]
        tensors plus `values` (float32 [B, S], the value head's estimates, GAE) or None.
        Raises RuntimeError without rl.enabled or before `connect`."""
        from ftrain.rl.rollouts import row_seed

        if self.rl is None:
            raise RuntimeError("generate needs rl.enabled=true")
        if not self._connected:
            raise RuntimeError("generate called before connect(): no process group generation")

        def on_round():
            self.progress += 1

        return sample_rollouts(self.ddp, prompts, [row_seed(self.cfg.train.seed, step, row) for row in rows],
                               self.rl, self.cfg.model.vocab_size, self.rl.advantage == "gae", stop_ids, pad_id,
                               on_round)

    def train_step(self, batch: TrainingBatch, step: int) -> dict:
        """One PPO (or cross-entropy: train.objective=ce, no behaviour pass) step on this
        replica's shard of the global batch (as `TorchEngine.train_step`).

        batch: this DP replica's sequences (CPU or GPU), B = global_batch_size / dp, S =
        train.seq_len (S % (2*cp) == 0 when cp > 1). Old log-probs, when absent, come from a
        forward-only pass of the current policy when the step makes more than one update
        (`ppo.behaviour_pass_needed`; with one, the training forward's detached log-probs), and with RL's KL penalty `ref_log_probs` from
        the reference model. One optimizer step per mini-batch; the
        micro-batches of a mini-batch run through the pipeline schedule. Returns python floats:
        `loss` (mean over mini-batches of the PPO loss; NaN on ranks that are not the last
        pipeline stage), `mini_losses`, `grad_norm` (global), `lr`, PPO metrics (with RL also
        `pg_loss`, and `vf_loss` / `kl` / `entropy` when those terms are on).
        Raises RuntimeError if no generation is connected.
        """
        from megatron.core import parallel_state as ps

        if not self._connected:
            raise RuntimeError("train_step called before connect(): no process group generation")
        if self._params_pending:
            raise RuntimeError("train_step called before sync_params(): the params of a restored optimizer "
                               "shard were not rebuilt")
        t = self.cfg.train
        micro, last = t.micro_batch_size, ps.is_pipeline_last_stage()
        # Phases (with device syncs) are timed on the first step after a connect only: that is
        # the step a recovery timeline explains (`first_step_detail`); others stay sync-free.
        timed = not self._trained_since_connect
        t0 = time.perf_counter()
        if self.step == 0 and self._initial is None:  # before the first update: for `reset`
            self._initial = self._host_copy(self._train_state(), pin=False)
        batch = batch.to(self.device)
        if batch.old_log_probs is None and behaviour_pass_needed(t):  # else the training forward's
            batch = batch.with_old_log_probs(self._behaviour_log_probs(self.ddp, batch))
        if self.ref_model is not None and batch.ref_log_probs is None:
            batch = dataclasses.replace(batch, ref_log_probs=self._behaviour_log_probs(self.ref_model, batch))
        if timed:
            torch.cuda.synchronize()
        phases = {"old_log_probs_s": time.perf_counter() - t0, "forward_backward_s": 0.0, "optimizer_s": 0.0}
        losses, norms, metrics = [], [], {}
        for mini in batch.chunk(t.global_batch_size // t.mini_batch_size):
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.fault_point("before_allreduce")
            t1 = time.perf_counter()
            out = self._run(mini.chunk(len(mini) // micro), forward_only=False)
            if timed:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            self._wait_snapshot_copy(torch.cuda.current_stream() if self.backend == "nccl" else None)  # the update overwrites its source
            _, grad_norm, _ = self.optimizer.step()
            phases["forward_backward_s"] += t2 - t1
            phases["optimizer_s"] += time.perf_counter() - t2
            self.fault_point("after_optimizer_step")
            self.scheduler.step(increment=1)
            norms.append(float(grad_norm or 0.0))
            if last:
                losses.append(sum(o["loss"].item() for o in out) / len(out))
                metrics = {k: sum(o[k] for o in out) / len(out) for k in out[0] if k != "loss"}
        self.step, self._dirty, self._trained_since_connect = step, False, True
        self.rollout["samples"] += t.global_batch_size
        loss = sum(losses) / len(losses) if losses else float("nan")
        return {"loss": loss, "mini_losses": losses, "grad_norm": max(norms),
                "lr": self.optimizer.param_groups[0]["lr"], **({"phases": phases} if timed else {}), **metrics}

    # -- in-memory state ---------------------------------------------------------------------
    def _train_state(self) -> dict:
        """Live training state of this rank (references, not copies): model params (the value
        head's included), then per optimizer main param: [main param fp32, exp_avg, exp_avg_sq,
        step (CPU scalar)], the schedule's update count and the engine step; with RL also the
        reference policy's params (`reference`) and the rollout position (`rollout`, python
        values)."""
        inner = [(p, o.optimizer.state[p]) for o in self.optimizer.chained_optimizers
                 for g in o.optimizer.param_groups for p in g["params"]]
        state = {"model": [p.data for p in self.model.parameters()],
                 "optimizer": [[p.data, s["exp_avg"], s["exp_avg_sq"], s["step"]] for p, s in inner],
                 "sched_steps": self.scheduler.num_steps, "step": self.step}
        if self.ref_model is not None:
            state["reference"] = [p.data for p in self.ref_model.parameters()]
        if self.rl is not None:
            state["rollout"] = dict(self.rollout)
        return state

    def _set_train_state(self, state: dict) -> None:
        """Copy `state` (the structure of `_train_state`) into the live tensors in place; a part
        it lacks or holds empty is left as it is: the optimizer (`broadcast_from` with the
        distributed optimizer) or the model params, which then wait for `sync_params` (a
        rollback from a snapshot that takes them from the shard)."""
        self._wait_snapshot_copy()  # it may still be reading them
        live = self._train_state()
        parts = [k for k in TENSOR_PARTS if k in live and state.get(k)]
        copy_state({k: live[k] for k in parts}, {k: state[k] for k in parts})
        torch.cuda.synchronize()
        self._params_pending = "model" not in parts
        self.scheduler.num_steps = int(state["sched_steps"])
        self.scheduler.step(increment=0)  # sets lr / weight decay of that update count
        if "rollout" in state:
            self.rollout = dict(state["rollout"])
        self.step, self._dirty = int(state["step"]), False

    def _host_copy(self, state: dict, into: dict | None = None, pin: bool = True) -> dict:
        """Copy of `state` in host memory (pinned when `pin`: faster repeated copies); reuses the
        buffers of `into` when given."""
        if into is None:
            into = carve(state, pinned_empty(state_nbytes(state)) if pin else
                         torch.empty(state_nbytes(state), dtype=torch.uint8))
        copy_state(into, state)
        torch.cuda.synchronize()
        return _with_counters(into, state)

    def _host_copy_async(self, state: dict, into: dict) -> dict:
        """Start copying `state` into the pinned buffers `into` on a side stream and return at
        once: the copy overlaps the step's forward and backward passes, which only read the
        state. `_wait_snapshot_copy` orders the optimizer step (and any reader) after it. The
        copies are queued on the device by a thread of this engine (`_copy_launcher`): a state
        has ~1,000 tensors and each device-to-host copy launch costs the calling thread tens of
        microseconds of driver time, which the training thread, launching the step's kernels,
        would pay every step. They are few (`copy_to_host`: gathered on the device through
        a staging buffer of `STAGING_BYTES`, one copy per chunk), since each copy contends
        with the step's launches for the driver. On CPU the copy is done when this returns."""
        if self.backend != "nccl":
            copy_state(into, state)
            return _with_counters(into, state)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        ready, done, stream = torch.cuda.Event(), torch.cuda.Event(), self._copy_stream
        ready.record()  # the state as of now
        src, dst = state_tensors(state), state_tensors(into)

        if self._staging is None:
            self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=self.device)
        staging = self._staging

        def launch():  # the copies' launches (milliseconds of driver time) off the training thread
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                copy_to_host(dst, src, staging)
                done.record()

        # No wait for the previous launch (the shard copy's ~1,000 launches take the launcher
        # ~10 ms, which the next snapshot would add to the gap between steps): the launcher is
        # one thread, so the launches of its stream stay in call order, and `done` is recorded
        # after every earlier copy of that stream.
        self._copy_launched, self._copy_done = self._copy_launcher.submit(launch), done
        return _with_counters(into, state)

    def _copy_waiter(self):
        """A function that blocks until the copy just started by `_host_copy_async` is done
        (not the later ones); nothing to wait for on CPU."""
        launched, done = self._copy_launched, self._copy_done
        if done is None:
            return lambda: None

        def wait():
            if launched is not None:
                launched.result()
            done.synchronize()
        return wait

    def _copies_launched(self) -> None:
        """Block until the copies of `_host_copy_async` are queued on the device (so that
        `_copy_done` has been recorded; raises what the launch raised)."""
        if self._copy_launched is not None:
            self._copy_launched.result()

    def _wait_snapshot_copy(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order `stream`'s later work after the snapshot copy in flight (no host wait), or with
        no stream, block until the copy is done (before the host reads the snapshot)."""
        self._copies_launched()
        if self._copy_done is not None:
            if stream is None:
                self._copy_done.synchronize()
            else:
                stream.wait_event(self._copy_done)

    def reserve_host_memory(self, nbytes: int, save_nbytes: int = 0, headroom: float = 0.1) -> bool:
        """Pin `nbytes` of host memory in a background thread, for the rollback snapshot buffers
        this rank will need after it joins, and `save_nbytes` for its async saves' copies
        (`megatron_checkpoint.reserve_save_arena`); `actor_group.ActorGroup` asks pre-warmed
        spares to do so with the largest rank's sizes (`snapshot_nbytes`, `save_nbytes`); a rank
        that joins without them asks in `connect`. Why ahead: pinning tens of GB takes seconds
        and slows this process's kernel launches meanwhile, so it is done before training (and
        before any failure) instead of in the first steps and the first save after a recovery.
        Each is skipped (with a warning) when the host would keep less than `headroom` of its
        memory available: the spare then pins after it joins rather than take memory the ranks
        need. Returns whether the snapshot's memory is reserved."""
        if nbytes > 0 and self._arena is None and self._room(nbytes, headroom, "a rollback snapshot"):
            self._arena = pin_in_background(nbytes)
        if save_nbytes > 0 and self._room(save_nbytes + (nbytes if self._arena is not None else 0), headroom,
                                          "async checkpoint saves"):
            reserve_save_arena(save_nbytes)
        return self._arena is not None

    @staticmethod
    def _room(nbytes: int, headroom: float, what: str) -> bool:
        """Whether pinning `nbytes` more leaves `headroom` of the host's memory available;
        warns when not."""
        import psutil

        mem = psutil.virtual_memory()
        if mem.available - nbytes >= headroom * mem.total:
            return True
        log.warning("not reserving %.1f GB of pinned host memory for %s: %.1f GB of %.1f GB available; "
                    "this rank pins it after it joins (slower first steps)", nbytes / 1e9, what,
                    mem.available / 1e9, mem.total / 1e9)
        return False

    def warm_up(self, checkpoints: Callable) -> float:
        """Pre-warmed spare, before any failure: pay the one-time costs of a process's first
        training step now rather than in the first step after a recovery. Runs one step of a
        one-layer model with this config's sizes (tp = pp = cp = 1, one micro-batch, no RL
        terms, no HF weights: with `model.hf_path` the sizes are cfg.model's) in a private NCCL
        world of one rank, then frees everything it built (Megatron's groups, the process
        group, its GPU memory) and puts the CPU and CUDA RNG states back. Why: a fresh process's
        first step is about twice as slow as the next ones (inferred causes: CUDA's lazily
        loaded kernels, cuBLAS handles and workspaces, NCCL's first initialisation; see
        docs/recovery.md, "Replace"). With `checkpoint.async_save` it also saves that model
        asynchronously into a temporary directory (then removed; through `checkpoints(directory)`, a
        checkpoint manager): a process's first save pays
        for its imports and first uses of the checkpoint code, which would otherwise stall the
        first save after a recovery. With tp = pp = cp = 1 it then builds the spare's model
        (`_prebuild`), so that joining does not build it.
        Returns seconds; 0.0 without doing anything when this process warmed up before (a
        spare's `build` and `prepare_spare` both ask), is in a process group or holds a model
        (it has trained: nothing left to warm)."""
        import gc

        from megatron.core import parallel_state as ps

        if self._warmed or self.model is not None or dist.is_initialized():
            return 0.0
        self._warmed = True
        t0 = time.perf_counter()
        c, micro = self.cfg, self.cfg.train.micro_batch_size
        cfg = dataclasses.replace(
            c, parallel=dataclasses.replace(c.parallel, tp=1, pp=1, cp=1),
            model=dataclasses.replace(c.model, num_layers=1, hf_path=None),
            train=dataclasses.replace(c.train, global_batch_size=micro, mini_batch_size=micro),
            rl=dataclasses.replace(c.rl, enabled=False))
        rng = torch.get_rng_state(), torch.cuda.get_rng_state()
        engine = None
        try:
            engine = MegatronEngine(cfg)
            engine.connect(dist.HashStore(), ParallelDims(tp=1, pp=1, cp=1, dp=1), 0)  # a world of one rank
            engine.step = 1  # not step 0: no host copy for `reset`
            t = cfg.train
            engine.train_step(synthetic_batch(t.seed, 1, micro, t.seq_len, cfg.model.vocab_size), 2)
            if c.checkpoint.async_save:
                with tempfile.TemporaryDirectory(prefix="warm-up-save-") as tmp:
                    for pending in engine.save_checkpoint(checkpoints(tmp), 2, engine.dims, 0, True):
                        pending.result()
            torch.cuda.synchronize()
        finally:
            del engine
            ps.destroy_model_parallel()
            if dist.is_initialized():  # connect may have failed before making the group
                dist.destroy_process_group()
            gc.collect()
            torch.cuda.empty_cache()
            torch.set_rng_state(rng[0])
            torch.cuda.set_rng_state(rng[1])
        p = self.cfg.parallel
        if p.tp == p.pp == p.cp == 1:
            self._prebuild()
        return time.perf_counter() - t0

    def _prebuild(self) -> None:
        """Spare, tp = pp = cp = 1 (every rank holds the same model shard): build the model
        stage now, in a private NCCL world of one rank, exactly as `connect` would build it;
        `connect` then only moves it onto the generation's groups (`megatron_groups.rebind`),
        at any dp. The world's groups are one per role (`make_groups(shared=False)`): shared,
        every role would be the world's one group and a reference to it would not say whether
        it is the TP or the DP group of a dp >= 2 generation. Keeps the RNG states the
        build leaves (what a build at join would leave) for `connect`, and restores the
        process's own."""
        from megatron.core import parallel_state as ps

        rng = self._rng_state()
        dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            groups = make_groups(ParallelDims(tp=1, pp=1, cp=1, dp=1), shared=False)
            self.dims = ParallelDims(tp=1, pp=1, cp=1, dp=1)
            self._build_model()
            torch.cuda.synchronize()
            self._prebuilt = {"objects": (self.model, self.ref_model, self._tc), "groups": groups,
                              "rng": self._rng_state()}
        finally:
            self.model = self.ref_model = self.dims = None
            ps.destroy_model_parallel()
            dist.destroy_process_group()
            self._set_rng_state(rng)

    def snapshot_nbytes(self) -> int:
        """Bytes of this rank's rollback snapshot (0 with the distributed optimizer and no keeper:
        none kept)."""
        return state_nbytes(self._train_state()) if self._keeps_rollback() else 0

    def save_nbytes(self) -> int:
        """Bytes of the async saves' pinned copy of this rank's state (0 with synchronous saves)."""
        return state_nbytes(self._train_state()) if self.cfg.checkpoint.async_save else 0

    def _keeps_rollback(self) -> bool:
        """Whether this rank keeps a rollback snapshot: always without the distributed optimizer;
        with it only when the keeper holds the shards (keeper.py), else no peer restore can use it."""
        m, dims = self.cfg.model, self.dims
        return not m.distributed_optimizer or (
            dims is not None and keeps_shards(True, self.cfg.fault_tolerance.shard_keeper, dims.dp))

    def prepare_host_copy(self) -> None:
        """Start pinning the host buffers of `start_host_copy` (~14 bytes per parameter of this
        rank's shard) in a background thread, if not pinned yet for a state of this size. Called
        when the rank joins with memory snapshots on, so that no training step pays the pinning
        (seconds for tens of GB)."""
        need = state_nbytes(self._train_state())
        arena = self._send_arena
        if arena is not None and not (arena.done() and (arena.exception() or arena.result().numel() < need)):
            return
        self._send_buffers = None
        self._send_arena = pin_in_background(need)

    def _send_buffers_for(self, state: dict) -> dict | None:
        """Pinned buffers laid out as `state`, or None while they are still being pinned (a
        pinning started here when none fits, e.g. after a layout change)."""
        if self._send_buffers is not None and same_layout(self._send_buffers, state):
            return self._send_buffers
        self._send_buffers = None
        self.prepare_host_copy()
        if not self._send_arena.done():
            return None
        self._send_buffers = carve(state, self._send_arena.result())  # raises if pinning failed
        return self._send_buffers

    def start_host_copy(self) -> HostCopy | None:
        """Queue a copy of this rank's live training state (model params and its optimizer
        shard: with the distributed optimizer the fp32 main-param and Adam shards) into pinned
        buffers on the snapshot side stream (`_host_copy_async`), and return at once. The copy
        runs on a copy engine beside the next step's forward and backward; that step's
        optimizer update waits for it on the device (`_wait_snapshot_copy`), as does every other
        change of the live state, so its bytes are exactly those of step `self.step`. Returns
        None while the buffers are still being pinned (`prepare_host_copy`). The buffers are
        reused by the next call: the caller must be done with the previous copy."""
        state = self._train_state()
        into = self._send_buffers_for(state)
        if into is None:
            return None
        into = self._host_copy_async(state, into)
        return HostCopy(into, self._copy_waiter())

    def _shard_state(self) -> dict:
        """This rank's optimizer shard (with the distributed optimizer: its fp32 main params and
        Adam moments, references) with the schedule count and step: what its keeper holds."""
        state = self._train_state()
        return {"optimizer": state["optimizer"], "sched_steps": state["sched_steps"], "step": state["step"]}

    def shard_nbytes(self, whole: bool = False) -> int:
        """Bytes of an arena that `start_shard_copy` copies the shard (`whole`: the whole
        training state) into (`carve`'s size)."""
        return state_nbytes(self._train_state() if whole else self._shard_state())

    def start_shard_copy(self, arena: torch.Tensor, whole: bool = False) -> HostCopy | None:
        """As `start_host_copy`, of `_shard_state` only or, `whole`, of the whole training state
        (`_train_state`), into buffers carved from `arena` (uint8 host memory of at least
        `shard_nbytes(whole)` bytes, pinned for an asynchronous copy; the caller is done with
        its previous copy). None without the distributed optimizer (every DP peer holds the
        whole optimizer state) and not `whole`. Raises ValueError when `arena` is too small."""
        if not (self.cfg.model.distributed_optimizer or whole):
            return None
        state = self._train_state() if whole else self._shard_state()
        into = self._shard_buffers.get(arena.data_ptr())
        if into is None or not same_layout(into, state):
            into = carve_shard(state, arena)
            while len(self._shard_buffers) >= 2:  # the sender's two arenas; older ones are freed
                self._shard_buffers.pop(next(iter(self._shard_buffers)))
            self._shard_buffers[arena.data_ptr()] = into
        into = self._kept = self._host_copy_async(state, into)
        return HostCopy(into, self._copy_waiter())

    def load_shard(self, state: dict) -> None:
        """Copy `state` (a `start_shard_copy` state of this rank position) into the live
        optimizer shard. Raises ValueError when it is of another step than the live state's."""
        if int(state["step"]) != self.step:
            raise ValueError(f"optimizer shard of step {state['step']} given to a rank at step {self.step}")
        self._wait_snapshot_copy()
        copy_state(self._shard_state(), state)
        torch.cuda.synchronize()
        self._kept = None  # of the shard before

    def host_state(self) -> dict:
        """`start_host_copy`, waiting for its buffers to be pinned and for the copy: the live
        training state in the reused pinned buffers (changed by the next call)."""
        self.prepare_host_copy()
        self._send_arena.result()
        copy = self.start_host_copy()
        copy.wait()
        return copy.state

    def load_state(self, state: dict) -> None:
        """Make `state` (from `start_host_copy` of the same rank position) the live state."""
        self._set_train_state(state)

    def reset(self) -> bool:
        """Return to the state of step 0 (the seeded initial weights, zero Adam state, the
        schedule's start) from the host copy taken when this rank began step 1, with no
        collective. Returns False when this rank holds no such copy and is not at a clean
        step 0 (a spare that joined later and was restored to a later step: recovery then
        gets step 0 from a peer or a checkpoint)."""
        if self._initial is not None:
            self._set_train_state(self._initial)
        elif self.step != 0 or self._dirty:
            return False
        self.step, self._dirty = 0, False
        return True

    def snapshot(self) -> None:
        """Copy the training state to host memory at the start of a step (the state of the last
        committed step) and mark the live state dirty until the step ends. Step 0 needs no copy
        (`reset`); with the distributed optimizer and no keeper none is kept (see `rollback`)."""
        if self.step > 0 and self._keeps_rollback():
            self._snapshot_to_host()
        self._dirty = True
        self.step_start_progress = self.progress

    def _snapshot_to_host(self) -> None:
        """Copy the live state into the pinned snapshot buffers (~14 bytes per parameter) on a
        side stream (`_host_copy_async`). The buffers are views (`carve`) into one pinned arena:
        the memory reserved in the background before this rank joined or when it connected
        (`reserve_host_memory`), else pinned at the first copy. A rank that has trained since
        it joined waits for a pinning still in progress, so in steady training every step
        keeps its snapshot. A rank that has not (a spare with a restored state, in the first
        step after a recovery) does not wait: pinning takes seconds, which that step must not
        pay; it keeps no snapshot until the arena is ready, so `rollback` answers False for
        it meanwhile and recovery restores it from a peer, an in-memory snapshot or a
        checkpoint.
        The parts of the state that the keeper's copy of this step holds (`start_shard_copy`
        since the step was set: the optimizer shard, or with the local keeper every part) are
        not copied again: the snapshot takes them from that copy's buffers, which the sender
        overwrites two copies later (its two arenas), after the next snapshot replaced this
        one. With the distributed optimizer the model params are not copied either when the
        shard is kept: they are the cast of its main params, gathered over DP, so a rollback
        restores the shard and leaves the params to `sync_params`. Why: each copy in flight
        slows the step's kernel launches (at dp = 8 the params are 57% of the bytes left)."""
        state = self._train_state()
        kept = self._kept or {}
        derived = {"model"} if "optimizer" in kept and "model" not in kept and self.cfg.model.distributed_optimizer \
            else set()
        own = {k: v for k, v in state.items() if k not in TENSOR_PARTS or k not in kept and k not in derived}
        buffers = self._rollback_buffers
        if buffers is None or not same_layout(buffers, own):
            buffers = self._rollback_buffers = self._carve_rollback(own)
            if buffers is None:  # pinning in progress: no snapshot this step (dropped by the carve)
                return
        copied = self._host_copy_async(own, buffers)
        self._snapshot = {k: copied[k] if k in copied else kept[k] for k in state if k not in derived}

    def _carve_rollback(self, state: dict) -> dict | None:
        """Snapshot buffers laid out as `state`, carved from the pinned arena (pinned here when
        there is none of its size; a rank that has not trained since it joined gets None while
        it is pinned, see `_snapshot_to_host`)."""
        self._snapshot = None
        self._wait_snapshot_copy()  # the old buffers may be reused below
        need = state_nbytes(state)
        if self._arena is not None and self._arena.done() and (
                self._arena.exception() or self._arena.result().numel() < need):
            self._arena = None  # pinning failed, or too small for this layout
        if self._arena is None:
            self._arena = pin_in_background(need)
        if self._trained_since_connect:
            self._arena.result()  # a rank in steady training waits for its pinning (raises if it cannot)
        return carve(state, self._arena.result()) if self._arena.done() else None

    def rollback(self, step: int) -> bool:
        """Return to the state after committed step `step` without any transfer: the live state
        if it is that step and clean, the snapshot, or `reset()` for step 0. Returns False when
        this rank holds no copy of that step, and always for step > 0 with the distributed
        optimizer and no keeper (a replaced rank's optimizer shard exists on no peer: restore
        from checkpoint). A snapshot without params (`_snapshot_to_host`) restores the shard
        only: the DP group then calls `sync_params`."""
        if step == 0:
            return self.reset()
        if not self._keeps_rollback():
            return False
        if self.step == step and not self._dirty:
            return True
        if self._snapshot is not None and self._snapshot["step"] == step:
            self._wait_snapshot_copy()
            self._set_train_state(self._snapshot)
            return True
        return False

    def sync_params(self) -> None:
        """Collective over the DP group (every member calls): with the distributed optimizer,
        make the model params the cast of the optimizer's main params, all-gathered over DP,
        as its update does after each step (`megatron_compat.params_from_main_params`). It
        completes a restore that set the optimizer shards only (`rollback` from a snapshot
        without params, `broadcast_from`); `train_step` refuses to run before it. Without the
        distributed optimizer the params were restored whole: nothing to do."""
        if not self.cfg.model.distributed_optimizer:
            return
        self._wait_snapshot_copy()  # the param buffer it may still be reading
        params_from_main_params(self.optimizer, self.ddp)
        torch.cuda.synchronize()
        self._params_pending = False

    def dp_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum `values` over Megatron's DP group (see `Engine.dp_sum`); counts progress."""
        from megatron.core import parallel_state as ps

        out = values.to(self.device)
        self.progress += 1
        dist.all_reduce(out, group=ps.get_data_parallel_group())
        return out.cpu()

    def broadcast_from(self, src_rank: int, ranks: list[int] | None = None) -> None:
        """Make this rank's training state equal to `src_rank`'s (same DP group, i.e. same
        (tp, cp, pp) shard): every tensor is broadcast in place over the DP group (CPU scalars
        through a CUDA copy), the schedule count and step with `broadcast_object_list`.
        Collective over the whole DP group: every member calls (`ranks` None or all of them;
        `fault_tolerance.plan_peer_restore(subgroups=False)`). Why not a subgroup of the
        callers: with eagerly initialised NCCL a new group is split from the world's
        communicator, which every rank of the world must call; the DP group's communicator
        exists already, and a broadcast's time is set by the bytes, not by the receivers.
        With the distributed optimizer at dp > 1 neither the optimizer shards are broadcast
        (each rank's is its own: a replaced rank gets its from its keeper, `load_shard`) nor
        the model params (the cast of the shards' main params: `sync_params`, which every
        member calls once the shards are in place, rebuilds them), only the step, schedule and
        rollout position and, with RL, the reference policy.
        Raises ValueError when `ranks` is a strict subset of the DP group (those outside it
        would never call: the broadcast would hang)."""
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        if ranks is not None and sorted(ranks) != sorted(dist.get_process_group_ranks(group)):
            raise ValueError(f"broadcast_from: ranks {sorted(ranks)} are not the whole DP group "
                             f"{dist.get_process_group_ranks(group)}; every DP member must call (ranks=None)")
        self._wait_snapshot_copy()  # the broadcast overwrites what it may still be reading
        self.fault_point("during_restore")  # fault injection: before the first transfer
        state = self._train_state()
        if self.cfg.model.distributed_optimizer and self.dims.dp > 1:
            state["optimizer"] = state["model"] = []  # each rank's shard, and the params `sync_params` rebuilds
        for x in state_tensors(state):
            buf = x if x.is_cuda else x.to(self.device)
            dist.broadcast(buf, src=src_rank, group=group)
            if buf is not x:
                x.copy_(buf)
        meta = [(state["sched_steps"], state["step"], state.get("rollout"))]
        dist.broadcast_object_list(meta, src=src_rank, group=group, device=self.device)
        state["sched_steps"], state["step"], rollout = meta[0]
        if rollout is not None:
            state["rollout"] = rollout
        self._set_train_state(state)

    def state_digest(self) -> str:
        """SHA-256 over the live training state (`engine.state_digest`): replicas that agree
        bitwise have equal digests (with the distributed optimizer, DP replicas hold different
        optimizer shards: compare rank with rank)."""
        return state_digest(self._train_state())

    # -- checkpoints -------------------------------------------------------------------------
    def _rng_state(self) -> dict:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(),
                "tracker": get_cuda_rng_tracker().get_states()}

    @staticmethod
    def _set_rng_state(rng: dict) -> None:
        """Make `rng` (from `_rng_state`) the process's CPU, CUDA and Megatron tracker states."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.set_rng_state(rng["cpu"])
        torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])

    def _sharded_state(self, is_loading: bool, with_rng: bool) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        model_sd = self.model.sharded_state_dict()
        # fully_reshardable: optimizer state in model-parameter space (reshards over DP and TP).
        meta = {"distrib_optim_sharding_type": "fully_reshardable"}
        sd = {"model": model_sd,
              "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta),
              "step": self.step, "sched_steps": self.scheduler.num_steps}
        if self.ref_model is not None:
            from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

            ref_sd = self.ref_model.sharded_state_dict()
            replace_prefix_for_sharding(ref_sd, "", "reference.")  # keys apart from the policy's
            sd["reference"] = ref_sd
        if self.rl is not None:
            sd["rollout"] = dict(self.rollout)  # common (rank 0's), equal on every rank
        if with_rng:
            w = self.dims.world_size
            sd["rng"] = ShardedObject("rng_state", self._rng_state(), (w,), (self.rank,), replica_id=0)
        return sd

    def save_checkpoint(self, ckpt, step: int, dims: ParallelDims, rank: int, async_save: bool = False) -> list:
        """Collective over all ranks: write the model's and optimizer's sharded state dicts, the
        step, the schedule count (common, rank 0) and every rank's RNG state with Megatron
        `dist_checkpointing` (torch_dist) as shard `megatron` of `step` (`save_sharded`). Returns
        the FileEntry list of the files this rank wrote; with `async_save`, a one-element list
        of `PendingSave` whose `result()` (collective) returns it. Raises CheckpointError on
        storage failure past the retry limits. Save plans are reused from save to save within one
        generation while the optimizer (so the model and layout) is the one they were made for
        and no checkpoint was loaded since (`SavePlanCache`); `connect` drops them, on every
        member alike. Async: the device-to-host copy of the
        state runs on the snapshot side stream beside the next step's forward and backward
        passes, whose update waits for it; the host buffers are pinned when the rank joins."""
        if self._save_plans is None or not self._save_plans.matches(self.optimizer):
            self._save_plans = SavePlanCache(self.optimizer)
        if async_save and self._copy_stream is None and self.backend == "nccl":
            self._copy_stream = torch.cuda.Stream()
        self._copies_launched()  # its copies queue on the same stream after theirs
        t0 = time.perf_counter()
        state = self._sharded_state(False, True)
        t1 = time.perf_counter()
        files = save_sharded(ckpt, step, rank, state, async_save,
                             after_write=lambda: self.fault_point("mid_save"), plans=self._save_plans,
                             copy_stream=self._copy_stream if async_save else None)
        self.save_phases = {"state_s": t1 - t0, "save_s": time.perf_counter() - t1}
        if async_save:
            self._copy_done = files[0].copied  # the next update waits for the copy (`_wait_snapshot_copy`)
        return files

    def load_checkpoint(self, ckpt, manifest, rank: int) -> None:
        """Collective over all ranks: load the committed checkpoint `manifest` (sizes already
        checked by the ranks, `MegatronActor.verify_checkpoint`) into this rank's shards; the saved layout may differ
        in DP and TP size (dist_checkpointing reshards). Local files: rank r hashes its share
        `manifest.share(r, world_size)` beside the load (the verify round's share) and raises
        CheckpointMismatch on a mismatch (`load_sharded`). RNG states are restored only when the
        layout is the same (rank r gets rank r's); otherwise each rank keeps its own."""
        d = self.dims
        same = {k: manifest.layout.get(k) for k in ("tp", "pp", "cp", "dp")} == \
            {"tp": d.tp, "pp": d.pp, "cp": d.cp, "dp": d.dp}
        self._wait_snapshot_copy()  # the load overwrites what it may still be reading
        self._save_plans = None  # a recovery: plan the next save afresh
        loaded = load_sharded(ckpt, manifest, self._sharded_state(True, same),
                              hash_share=manifest.share(rank, d.world_size))
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        if self.ref_model is not None:
            self.ref_model.load_state_dict(loaded["reference"])
        if self.rl is not None:
            self.rollout = dict(loaded["rollout"])
        for o in self.optimizer.chained_optimizers:  # Megatron sets one shared 'step' tensor for
            for s in o.optimizer.state.values():      # all params; AdamW would add 1 per param
                if "step" in s:
                    s["step"] = s["step"].clone()
        self.scheduler.num_steps = int(loaded["sched_steps"])
        self.scheduler.step(increment=0)
        if same:
            self._set_rng_state(loaded["rng"])
        self.step, self._dirty, self._params_pending = int(loaded["step"]), False, False

