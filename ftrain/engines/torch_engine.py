"""The CPU engine: an HF `transformers` causal LM trained with PPO under torch DDP over gloo.

It implements `engine.Engine` (the contract `MegatronActor` drives): `connect` / `abort` /
`disconnect` a process-group generation, `train_step`, `generate`, `save_checkpoint` /
`load_checkpoint`, `snapshot` / `rollback` (host-memory copy of the last committed step),
`broadcast_from` (peer restore inside the DP group).

ZeRO-1 (`model.distributed_optimizer: true`, off by default here): the AdamW state is sharded
over DP by `torch.distributed.optim.ZeroRedundancyOptimizer`, made over each generation's DP
group in `connect` (it partitions by group rank). The rank's shard is then on no DP peer:
`start_shard_copy` / `load_shard` move it to and from its keeper (keeper.py), and
`broadcast_from` gives everything else. Its checkpoints hold one optimizer shard per DP rank
(`zero_dp{d}`) and load at the same dp only.

Determinism: the model is built from `train.seed` with the global RNG reseeded first, every
rank uses one intra-op thread, and data are a pure function of (seed, step, dp rank), so a
replayed step computes bitwise the same numbers on CPU.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import math
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ftrain.config import Config
from ftrain.data.training_batch import TrainingBatch
from ftrain.distributed.comms import (abort_process_groups, left_collective, recording_new_sockets, shutdown_sockets,
                                      wait_work)
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.engines.engine import StepInterrupt, state_digest
from ftrain.objectives.ppo import behaviour_pass_needed, ce_objective, ppo_objective, token_entropy, token_log_probs
from ftrain.state.host_memory import HostCopy, carve_shard, state_nbytes, state_tensors
from ftrain.state.manifest import check_compatible

# Every gloo group's set-up reads each rank's address record from the driver's store. gloo's
# defaults (transport/tcp/context.cc): one blocking get per peer and records that hold one
# sequence number per rank, so each rank reads O(N^2) bytes in N round trips. These make it one
# batched `multi_get` of records of constant size. Read by gloo when a group is made.
GLOO_ENV = {"GLOO_ENABLE_STORE_V2_API": "1", "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "1"}


def build_hf_model(cfg: Config) -> torch.nn.Module:
    """Build the causal LM: from `model.hf_path` (local HF directory) or a Llama config of the
    configured sizes, randomly initialised from `train.seed`. Dropout is 0 so replays match."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    if m.hf_path:
        return AutoModelForCausalLM.from_pretrained(m.hf_path, attn_implementation="eager",
                                                    torch_dtype=torch.float32)
    hf_cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                         intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
                         num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads,
                         max_position_embeddings=m.max_seq_len, attention_dropout=0.0,
                         tie_word_embeddings=False)
    return type(AutoModelForCausalLM.from_config(hf_cfg))._from_config(
        hf_cfg, attn_implementation="eager")


def flat_collective(tensors: list[torch.Tensor], collective) -> None:
    """Run `collective(flat)` (in place) on one flat copy of `tensors` per dtype, in their order,
    and copy the result back into them: one collective per dtype instead of one per tensor
    (each gloo collective costs a ring of 2 (N - 1) dependent transfers)."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        collective(flat)
        for t, out in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(out.view_as(t))


class TorchEngine:
    """Model, AdamW optimizer and cosine LR schedule of one rank (CPU, float32).

    The model is built in `__init__` (a spare is pre-warmed by constructing this) and is wrapped
    in DDP only when a process-group generation is joined (`connect`).
    """

    checks_while_loading = True  # `load_checkpoint` hashes local files beside the load

    def __init__(self, cfg: Config):
        self.cfg = cfg
        for k, v in GLOO_ENV.items():
            os.environ.setdefault(k, v)
        torch.set_num_threads(1)
        self.model = build_hf_model(cfg)
        self.rl = cfg.rl if cfg.rl.enabled else None
        self.module, self.ref_model = self._build_rl_modules()
        self._initial_model = copy.deepcopy(self.module.state_dict())
        self.ddp: DDP | None = None
        self.dp_group = None
        self.progress = 0              # micro-batches + buckets all-reduced, ever (monotonic)
        self.step_start_progress = 0   # `progress` when the current step started
        self.fault_point = lambda point: None  # set by the actor (fault injection)
        self.delay_s = 0.0             # fault injection 'slow': extra seconds per micro-batch
        self.save_phases: dict[str, float] = {}  # seconds by part of the last save_checkpoint
        self._snapshot: dict | None = None
        self._host_buffers: dict[str, list[torch.Tensor]] = {}  # per copied part, reused by `_start_copy`
        self._host_copies: list[threading.Event] = []  # set when each copy in flight ends
        self.zero = cfg.model.distributed_optimizer  # ZeRO-1: made over the DP group in `connect`
        self._zero_position: tuple[int, int] | None = None  # (DP rank, dp) the local shard belongs to
        self.in_collective = False     # the compute thread is inside a gloo collective
        self._sockets: dict[int, str] = {}  # what this generation's gloo groups opened (`abort`)
        self._work = None              # the last collective's Work (see `disconnect`)
        self._retired: list = []       # (group, Work) of aborted generations, see `disconnect`
        self._param_index = {id(p): i for i, p in enumerate(self.module.parameters())}  # gradient layout
        self._pending: list = []       # (bucket, future) of this backward, reduced with the last bucket
        self._interrupt = StepInterrupt()
        self._interrupt.watch(self.module)
        if self.ref_model is not None:
            self._interrupt.watch(self.ref_model)
        self.reset()

    def _build_rl_modules(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """The module trained under DDP and the frozen reference policy.

        Without RL: the HF model itself, no reference. With RL: `rl.PolicyValue` (the model plus,
        for `rl.advantage=gae`, a zero-initialised linear value head on its last hidden state),
        and with `rl.kl_coef > 0` a frozen copy of the initial policy (the KL anchor)."""
        if self.rl is None:
            return self.model, None
        from ftrain.rl.rollouts import PolicyValue

        head = None
        if self.rl.advantage == "gae":
            head = torch.nn.Linear(self.model.config.hidden_size, 1)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
        ref = None
        if self.rl.kl_coef > 0:
            ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        return PolicyValue(self.model, head), ref

    def reset(self) -> None:
        """Return to the state of step 0: the seeded initial weights, a fresh optimizer and LR
        schedule. A pre-warmed spare is in this state, so step 0 never needs a copy."""
        t = self.cfg.train
        self._wait_host_copy()  # it may still be reading the state replaced here
        self.module.load_state_dict(self._initial_model)
        self._make_optimizer()
        self.step = 0                  # number of train steps whose update this state contains
        # Rollout stream position: samples trained on so far. Sampling itself is a pure function
        # of (seed, step, row) and the weights, so this is all the rollout state there is.
        self.rollout = {"seed": t.seed, "samples": 0}
        self._dirty = False            # True while a step may have partly updated the state

    def _make_optimizer(self, keep: bool = False) -> None:
        """A fresh AdamW (with ZeRO-1 and a DP group: a `ZeroRedundancyOptimizer` over it) and
        cosine schedule. `keep`: carry the schedule and this rank's optimizer state over into
        them (a survivor moved to a new generation at the same DP position)."""
        t = self.cfg.train
        old = (self._local_optimizer().state_dict(), self.scheduler.state_dict()) if keep else None
        if self.zero and self.dp_group is not None:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(self.module.parameters(), torch.optim.AdamW,
                                                     process_group=self.dp_group, lr=t.lr,
                                                     weight_decay=t.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        # Cosine to 0 over the decay's updates, then 0 (Megatron's schedule past
        # --lr-decay-iters; CosineAnnealingLR would rise again past its T_max).
        horizon = t.lr_decay_updates()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: 0.5 * (1.0 + math.cos(math.pi * min(n, horizon) / horizon)))
        if old is not None:
            self._local_optimizer().load_state_dict(old[0])
            self._load_scheduler(old[1])

    def _local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer holding this rank's state: ZeRO's local AdamW (its shard), else the AdamW."""
        return getattr(self.optimizer, "optim", self.optimizer)

    def _load_scheduler(self, state: dict) -> None:
        """Load the schedule's state and set the lr it gives (the optimizer's param groups hold
        the lr of the next update; ZeRO copies them to its local AdamW at each step)."""
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    # -- process groups ----------------------------------------------------------------------
    def connect(self, store, dims: ParallelDims, rank: int) -> dict[str, float]:
        """Create this generation's gloo group from `store` (its sockets recorded for `abort`)
        and wrap the model in DDP over it. `init_sync=False`: DDP must not broadcast rank 0's
        weights when a generation forms (rank 0 may be a fresh spare); recovery restores state
        explicitly (rollback / broadcast_from). Returns seconds: `process_group_s`, `connect_s`."""
        t0 = time.perf_counter()
        with recording_new_sockets(self._sockets):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=dims.world_size,
                                    timeout=datetime.timedelta(seconds=self.cfg.fault_tolerance.step_timeout_s))
        t1 = time.perf_counter()
        # The torch engine is data-parallel only (config validation), so the DP group is WORLD.
        self.dp_group = dist.group.WORLD
        self._interrupt.clear()
        if self.zero:
            # ZeRO partitions by the group's rank: a new generation needs a new optimizer. The
            # local shard carries over at the same DP position; at another one it belongs to
            # another partition, so the state is dirty until recovery restores it.
            position = (rank, dims.dp)
            same = self._zero_position in (None, position)
            self._wait_host_copy()
            self._make_optimizer(keep=same and self._zero_position is not None)
            if not same:
                self._snapshot, self._dirty = None, True
            self._zero_position = position
        self.ddp = DDP(self.module, process_group=self.dp_group, broadcast_buffers=False,
                       init_sync=False)
        self.ddp.register_comm_hook(self.dp_group, self._allreduce_hook)
        return {"process_group_s": t1 - t0, "connect_s": time.perf_counter() - t1}

    def abort(self, grace_s: float) -> None:
        """Control thread: `interrupt`, shut down the sockets of this generation's gloo groups
        (gloo has no communicator abort: a collective is freed only when its sockets fail),
        abort the groups, and wait up to `grace_s` seconds for the compute thread to leave its
        collective (`comms.left_collective`). Raises RuntimeError when it has not."""
        self.interrupt()
        shutdown_sockets(self._sockets)
        if dist.is_initialized():
            abort_process_groups()
        if not left_collective(self, grace_s):
            raise RuntimeError(f"compute thread still inside a collective {grace_s:g} s after the abort "
                               "(a gloo send queued behind a partial write is not failed by the shutdown "
                               "of its connection)")

    def interrupt(self) -> None:
        """Make the running step (or rollout) raise `Interrupted` at its next module forward or
        parameter gradient (`StepInterrupt`); called from another thread when the generation
        is aborted. Cleared by `connect`. A step's own collectives are freed by the abort itself."""
        self._interrupt.set()

    def _allreduce_hook(self, group, bucket):
        """Average the gradients over the DP group: one collective per step, over every bucket's
        gradients laid out in the module's parameter order (the futures of earlier buckets
        complete with the last one: `bucket.is_last()`).

        DDP re-packs its buckets after the first iteration of every new wrapper (bucket order =
        gradient-ready order), and a multi-rank all-reduce sums each element in an order that
        depends on its offset in the buffer. A fixed layout makes every sum independent of the
        packing, so a run whose DDP was re-wrapped by a recovery stays bitwise equal to one that
        never was. One collective, not one per parameter: each gloo collective costs
        a ring of 2 (N - 1) dependent transfers. Also counts progress (a rank stuck before the
        collective shows a lower count than peers waiting inside it) and is a fault-injection
        point."""
        self.progress += 1
        future = torch.futures.Future()
        self._pending.append((bucket, future))
        if not bucket.is_last():
            return future
        pending, self._pending = self._pending, []
        grads = sorted((self._param_index[id(p)], g) for b, _ in pending
                       for p, g in zip(b.parameters(), b.gradients()))  # views into the buffers

        def average(flat):
            flat.div_(dist.get_world_size(group))
            self.fault_point("inside_allreduce")
            with self._collective():
                self._wait(dist.all_reduce(flat, group=group, async_op=True))

        flat_collective([g for _, g in grads], average)
        for b, f in pending:
            f.set_result(b.buffer())
        return future

    @contextlib.contextmanager
    def _collective(self):
        """Mark the compute thread as inside a collective (`in_collective`, read by
        `MegatronActor.abort` from the control thread)."""
        self.in_collective = True
        try:
            yield
        finally:
            self.in_collective = False

    def dp_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum `values` over the DP group (see `Engine.dp_sum`); counts progress."""
        out = values.clone()
        self.progress += 1
        with self._collective():
            self._wait(dist.all_reduce(out, group=self.dp_group, async_op=True))
        return out

    def _wait(self, work) -> None:
        """Wait for the collective `work` (async_op=True), and re-raise its error; raises
        `Interrupted` within 10 ms of `interrupt` instead (`comms.wait_work` says why)."""
        self._work = work
        wait_work(work, self._interrupt.check)

    def disconnect(self) -> None:
        """Forget the DDP wrapper and groups of an aborted generation (no collective). A gloo
        group whose collective is still stuck (`_wait`) is kept until that collective ends at
        its timeout: destroying a group joins its worker threads, which would hold up the
        next generation by up to that timeout (see docs/recovery.md, "Abort")."""
        if self._work is not None and not self._work.is_completed():
            self._retired.append((self.dp_group, self._work))
        self._retired = [r for r in self._retired if not r[1].is_completed()]
        self.ddp, self.dp_group, self._work = None, None, None
        if dist.is_initialized():  # a generation whose forming was cancelled by an abort
            abort_process_groups()
        self._sockets = {}

    # -- compute -----------------------------------------------------------------------------
    def _forward(self, module: torch.nn.Module, batch: TrainingBatch):
        """(logits float [B, S, V], values float32 [B, S] or None) of `module` (the model, the
        DDP wrapper, `rl.PolicyValue` or the reference model). RL divides the logits by
        `rl.temperature`, the distribution the completions were sampled from."""
        out = module(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logits, values = out if isinstance(out, tuple) else (out.logits, None)
        if self.rl is not None and self.rl.temperature != 1.0:
            logits = logits / self.rl.temperature
        return logits, values

    def _log_probs(self, module: torch.nn.Module, batch: TrainingBatch) -> torch.Tensor:
        return token_log_probs(self._forward(module, batch)[0], batch.input_ids)

    def _with_behaviour(self, batch: TrainingBatch) -> TrainingBatch:
        """Fill old_log_probs (current, pre-update policy; only when the step makes more than
        one update: `ppo.behaviour_pass_needed`) and, with a KL penalty, ref_log_probs (frozen
        reference policy) where absent, micro-batch by micro-batch, without gradients."""
        micro = self.cfg.train.micro_batch_size
        with torch.no_grad():
            if batch.old_log_probs is None and behaviour_pass_needed(self.cfg.train):
                batch = batch.with_old_log_probs(torch.cat(
                    [self._log_probs(self.module, mb) for mb in batch.chunk(len(batch) // micro)]))
            if self.ref_model is not None and batch.ref_log_probs is None:
                batch = dataclasses.replace(batch, ref_log_probs=torch.cat(
                    [self._log_probs(self.ref_model, mb) for mb in batch.chunk(len(batch) // micro)]))
        return batch

    def _loss(self, mb: TrainingBatch) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch through DDP (`ppo.ppo_objective`: the PPO policy loss, and
        with RL the value, KL and entropy terms; `ppo.ce_objective` for train.objective=ce)."""
        logits, values = self._forward(self.ddp, mb)
        if self.cfg.train.objective == "ce":
            return ce_objective(token_log_probs(logits, mb.input_ids), mb)
        r = self.rl
        entropy = token_entropy(logits) if r is not None and r.entropy_coef > 0 else None
        return ppo_objective(token_log_probs(logits, mb.input_ids), mb, self.cfg.ppo, r, values, entropy)

    @torch.no_grad()
    def generate(self, prompts: TrainingBatch, step: int, rows: list[int], stop_ids: tuple[int, ...],
                 pad_id: int) -> dict:
        """Sample completions of this replica's prompt rows with the current policy (see
        `rl.sample`); row j's randomness comes from `rl.row_seed(train.seed, step, rows[j])`,
        `rows` being the global row indices, so a row samples the same on any replica and at any
        DP size; a row stops at any of `stop_ids` and is padded with `pad_id`. Returns
        `rl.sample`'s dict of [B, S] tensors, plus `values` (float32 [B, S], the value head's
        estimates, GAE) or None."""
        from ftrain.rl.rollouts import row_seed, sample

        r, t = self.rl, self.cfg.train
        if r is None:
            raise RuntimeError("generate needs rl.enabled=true")

        def logits_fn(ids, mask):
            return self._forward(self.module, TrainingBatch(ids, mask, None, None))[0]

        def on_token():
            self.progress += 1

        out = sample(logits_fn, prompts.input_ids, prompts.attention_mask,
                     [row_seed(t.seed, step, row) for row in rows], r.max_new_tokens,
                     stop_ids, pad_id, temperature=1.0, top_p=r.top_p, on_token=on_token)
        out["values"] = None
        if self.module.value_head is not None:
            out["values"] = self._forward(self.module, TrainingBatch(
                out["input_ids"], out["attention_mask"], None, None))[1]
        return out

    def train_step(self, batch: TrainingBatch, step: int) -> dict:
        """One PPO (or, with train.objective=ce, cross-entropy) step on this replica's shard of
        the global batch.

        batch: this DP replica's sequences, B = global_batch_size / dp. PPO: old log-probs, when
        absent, are computed with the current (pre-update) policy, by an extra forward only when
        the step makes more than one update (`ppo.behaviour_pass_needed`); ce needs none. The
        batch is cut into
        global_batch_size / mini_batch_size mini-batches, one optimizer step each; every
        mini-batch is cut into micro-batches of `train.micro_batch_size` whose gradients
        accumulate (DDP syncs on the last one). Returns python floats: `loss` (mean over
        mini-batches of the token-mean PPO loss), `grad_norm`, `lr`, PPO metrics.
        Raises RuntimeError if no generation is connected.
        """
        if self.ddp is None:
            raise RuntimeError("train_step called before connect(): no process group generation")
        t = self.cfg.train
        micro = t.micro_batch_size
        if t.objective == "ppo":
            batch = self._with_behaviour(batch)
        minis = batch.chunk(t.global_batch_size // t.mini_batch_size)
        losses, norms, metrics = [], [], {}
        for mini in minis:
            micros = mini.chunk(len(mini) // micro)
            self.optimizer.zero_grad(set_to_none=True)
            self._pending.clear()  # buckets of a backward that an interrupt cut short
            mini_loss = 0.0
            for i, mb in enumerate(micros):
                sync = i == len(micros) - 1
                if sync:
                    self.fault_point("before_allreduce")
                with contextlib.nullcontext() if sync else self.ddp.no_sync():
                    loss, metrics = self._loss(mb)
                    (loss / len(micros)).backward()
                mini_loss += loss.item() / len(micros)
                self.progress += 1
                time.sleep(self.delay_s)
            if t.grad_clip > 0:
                norms.append(torch.nn.utils.clip_grad_norm_(self.module.parameters(), t.grad_clip).item())
            self._wait_host_copy()  # the update overwrites what the copy reads
            with self._collective() if self.zero else contextlib.nullcontext():
                self.optimizer.step()  # ZeRO: then broadcasts each rank's updated parameters
            self.scheduler.step()
            self.fault_point("after_optimizer_step")
            losses.append(mini_loss)
        self.step, self._dirty, self.delay_s = step, False, 0.0
        self.rollout["samples"] += t.global_batch_size
        return {"loss": sum(losses) / len(losses), "mini_losses": losses,
                "grad_norm": max(norms) if norms else 0.0,
                "lr": self.scheduler.get_last_lr()[0], **metrics}

    # -- state -------------------------------------------------------------------------------
    def _train_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.zero:  # the parameters (replicated) and this rank's optimizer shard
            model_sd, optim_sd = self.module.state_dict(), self._local_optimizer().state_dict()
        else:
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd,
                 "scheduler": self.scheduler.state_dict(), "step": self.step}
        if self.rl is not None:  # value head: inside `model`; reference policy + rollout here
            state["rollout"] = dict(self.rollout)
            if self.ref_model is not None:
                state["reference"] = self.ref_model.state_dict()
        return state

    def _set_train_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self._wait_host_copy()
        if self.zero:  # `state` may lack the optimizer shard (`broadcast_from`)
            self.module.load_state_dict(state["model"])
            if "optimizer" in state:
                self._local_optimizer().load_state_dict(state["optimizer"])
            self._load_scheduler(state["scheduler"])
        else:
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        if "rollout" in state:
            self.rollout = dict(state["rollout"])
        if "reference" in state:
            self.ref_model.load_state_dict(state["reference"])
        self.step, self._dirty = int(state["step"]), False

    def save_checkpoint(self, ckpt, step: int, dims: ParallelDims, rank: int,
                        async_save: bool = False) -> list:
        """Write this rank's shards of checkpoint `step` through `ckpt` (a CheckpointManager; no
        collective): the replicated model/optimizer/scheduler state from DP rank 0 only
        (`model`; with ZeRO-1 without the optimizer, which every DP rank writes as its shard
        `zero_dp{d}`), and every rank's RNG state (`rng_rank{r}`). Returns the FileEntry list; with
        `async_save`, a list of one Future of that list: the state is copied to host memory
        before this returns and written in the background while training goes on."""
        t0 = time.perf_counter()
        shards = {f"rng_rank{rank}": {"torch_cpu": torch.get_rng_state()}}
        if dims.coords(rank).dp == 0:
            shards["model"] = self._train_state()
            if self.zero:  # the optimizer is saved per DP rank (below)
                del shards["model"]["optimizer"]
        if self.zero:
            shards[f"zero_dp{dims.coords(rank).dp}"] = self._shard_state()
        self.save_phases = {"state_s": time.perf_counter() - t0}
        if async_save:
            return [ckpt.async_save_shards(step, shards)]  # one background write: the call never waits on storage
        files = []
        for name, state in shards.items():
            files += ckpt.save_shard(step, name, state)
            self.fault_point("mid_save")  # fault injection: some shards written, not all
        return files

    def load_checkpoint(self, ckpt, manifest, rank: int) -> None:
        """Load this rank's state in place from the committed checkpoint `manifest`, whose sizes
        the ranks checked (`MegatronActor.verify_checkpoint`); local files are hashed beside the
        load, downloads before it (CheckpointMismatch on a sha256 mismatch: the state is then to
        be discarded). The RNG of a rank that did not exist at save time is kept.
        Raises ConfigError when the checkpoint belongs to another model or layout."""
        check_compatible(self.cfg, manifest)
        self._wait_host_copy()  # the load writes into the live tensors
        if self.zero:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self._local_optimizer())  # the template needs the Adam state's shapes
        template = self._train_state()
        if self.zero:  # the shard is its own file (`save_checkpoint`)
            del template["optimizer"]
        self._set_train_state(ckpt.load_shard(manifest.step, "model", template, manifest))
        if self.zero:
            self.load_shard(ckpt.load_shard(manifest.step, f"zero_dp{rank}", self._shard_state(), manifest))
        name = f"rng_rank{rank}"
        if any(f.path.startswith(name + "/") for f in manifest.files):
            template = {"torch_cpu": torch.get_rng_state()}
            torch.set_rng_state(ckpt.load_shard(manifest.step, name, template, manifest)["torch_cpu"])

    def snapshot(self) -> None:
        """Copy the training state to host memory at the start of a step (so the copy is the
        state of the last committed step) and mark the live state dirty until the step ends.
        Step 0 needs no copy: `reset()` rebuilds it."""
        self._snapshot = None if self.step == 0 else copy.deepcopy(self._train_state())
        self._dirty = True
        self.step_start_progress = self.progress

    def rollback(self, step: int) -> bool:
        """Return to the state after committed step `step` without any transfer: the live state
        if it is that step and clean, the snapshot, or `reset()` for step 0. Returns False when
        this rank holds no copy of that step (a spare, or a snapshot of another step)."""
        if self.step == step and not self._dirty:
            return True
        if step == 0:
            self.reset()
        elif self._snapshot is not None and self._snapshot["step"] == step:
            self._set_train_state(copy.deepcopy(self._snapshot))
        else:
            return False
        self._dirty = False
        return True

    def start_host_copy(self) -> HostCopy:
        """Start copying the live training state (that of committed step `self.step`) into host
        buffers reused from the previous copy, in a background thread, tensor by tensor, and
        return at once; the python leaves are copied now. The next optimizer step, and every
        other change of the live state, waits for the copy first (`_wait_host_copy`), so the
        copy is exactly that step's state while the next step's forward and backward run
        beside it. The fault point `mid_snapshot` fires in the copy thread half-way through
        (its exception fails the copy: `wait()` raises). The caller is done with the previous
        copy's buffers (SnapshotSender sends one at a time)."""
        return self._start_copy("all", self._train_state())

    def shard_nbytes(self, whole: bool = False) -> int:
        """Bytes of an arena that `start_shard_copy` copies the shard (`whole`: the whole
        training state) into (`carve`'s size)."""
        return state_nbytes(self._train_state() if whole else self._shard_state())

    def start_shard_copy(self, arena: torch.Tensor, whole: bool = False) -> HostCopy | None:
        """As `start_host_copy`, of this rank's optimizer shard only (`_shard_state`: what no DP
        peer holds) or, `whole`, of the whole training state, into buffers carved from `arena`
        (uint8 host memory of at least `shard_nbytes(whole)` bytes); None without ZeRO (no
        shard) and not `whole`. Raises ValueError when `arena` is too small."""
        if not (self.zero or whole):
            return None
        state = self._train_state() if whole else self._shard_state()
        return self._start_copy("shard", state, state_tensors(carve_shard(state, arena)))

    def _shard_state(self) -> dict:
        """This rank's ZeRO optimizer shard (its local AdamW's state, references) and the step."""
        return {"optimizer": self._local_optimizer().state_dict(), "step": self.step}

    def load_shard(self, state: dict) -> None:
        """Make `state` (a `start_shard_copy` state of this DP position) the live optimizer
        shard. Raises ValueError when it is of another step than the live state's."""
        if int(state["step"]) != self.step:
            raise ValueError(f"optimizer shard of step {state['step']} given to a rank at step {self.step}")
        self._wait_host_copy()
        self._local_optimizer().load_state_dict(copy.deepcopy(state["optimizer"]))

    def _start_copy(self, part: str, live: dict, buffers: list[torch.Tensor] | None = None) -> HostCopy:
        """`start_host_copy` of the state `live` into `buffers` (one per tensor of `live`, in
        order) or, with None, the buffers kept for `part`."""
        self._wait_host_copy()
        leaves, spec = torch.utils._pytree.tree_flatten(live)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if buffers is None:
            self._allocate_host_buffers(tensors, part)
            buffers = self._host_buffers[part]
        it = iter(buffers)
        state = torch.utils._pytree.tree_unflatten(
            [next(it) if isinstance(x, torch.Tensor) else copy.deepcopy(x) for x in leaves], spec)
        done, errors = threading.Event(), []

        def run(pairs):
            try:
                for i, (dst, src) in enumerate(pairs):
                    if i == len(pairs) // 2:
                        self.fault_point("mid_snapshot")
                    dst.copy_(src)
            except BaseException as exc:  # noqa: BLE001 (reported by wait())
                errors.append(exc)
            finally:
                done.set()

        def wait():
            done.wait()
            if errors:
                raise RuntimeError(f"host copy of step {state['step']} failed: {errors[0]!r}") from errors[0]

        self._host_copies = [e for e in self._host_copies if not e.is_set()] + [done]
        threading.Thread(target=run, args=(list(zip(buffers, tensors, strict=True)),), daemon=True,
                         name="snapshot-copy").start()
        return HostCopy(state, wait)

    def prepare_host_copy(self) -> None:
        """Allocate the host buffers of `start_host_copy` now (when a rank joins with memory
        snapshots on), not in its first snapshot step. Not before the optimizer's first step:
        AdamW makes its state then, and reading the state earlier (`get_state_dict`) would make
        it with an extra zero-gradient step; plain host memory is cheap to allocate in the
        first copy instead."""
        if not self._local_optimizer().state:
            return
        self._wait_host_copy()
        self._allocate_host_buffers([x for x in torch.utils._pytree.tree_leaves(self._train_state())
                                     if isinstance(x, torch.Tensor)])

    def _allocate_host_buffers(self, tensors: list[torch.Tensor], part: str = "all") -> None:
        have = self._host_buffers.get(part)
        if have is None or [(b.shape, b.dtype) for b in have] != [(x.shape, x.dtype) for x in tensors]:
            self._host_buffers[part] = [torch.empty_like(x) for x in tensors]

    def _wait_host_copy(self) -> None:
        """Block until the copies of `_start_copy` in flight (if any) have read the state."""
        for done in self._host_copies:
            done.wait()

    def load_state(self, state: dict) -> None:
        """Make `state` (a `start_host_copy` state, possibly of another process) the live state."""
        self._set_train_state(copy.deepcopy(state))

    def sync_params(self) -> None:
        """Nothing to do: this engine restores the params whole (`Engine.sync_params`)."""

    def broadcast_from(self, src_rank: int, ranks: list[int] | None = None) -> None:
        """Make this rank's training state equal to `src_rank`'s (a member of the same DP group):
        the tensors of the state are broadcast (one flat broadcast per dtype: `flat_collective`),
        the python leaves (step, LR schedule, optimizer hyper-parameters such as the decayed lr)
        with `broadcast_object_list`. Both sides have the same state structure (same model).
        `ranks`: only these members take part, over a group made among them alone (the other
        members make no call); None: the whole DP group."""
        if ranks is None:
            self._broadcast_state(src_rank)
            return
        with recording_new_sockets(self._sockets):
            group = dist.new_group(sorted(ranks), use_local_synchronization=True)
        full, self.dp_group = self.dp_group, group
        try:
            self._broadcast_state(src_rank)
        finally:
            self.dp_group = full

    def _broadcast_state(self, src_rank: int) -> None:
        self.fault_point("during_restore")  # fault injection: the group made, nothing sent
        self._wait_host_copy()  # the broadcast writes into the live tensors
        state = self._train_state()
        if self.zero:  # each rank's own shard (`load_shard` gives a replaced rank its own)
            del state["optimizer"]
        leaves, spec = torch.utils._pytree.tree_flatten(state)
        others = [[x for x in leaves if not isinstance(x, torch.Tensor)]]
        with self._collective():
            flat_collective([x for x in leaves if isinstance(x, torch.Tensor)],
                            lambda flat: self._wait(dist.broadcast(flat, src=src_rank, group=self.dp_group,
                                                                   async_op=True)))
            dist.broadcast_object_list(others, src=src_rank, group=self.dp_group)
        it = iter(others[0])
        leaves = [x if isinstance(x, torch.Tensor) else next(it) for x in leaves]
        self._set_train_state(torch.utils._pytree.tree_unflatten(leaves, spec))

    def state_digest(self) -> str:
        return state_digest(self._train_state())

    # -- spare preparation: nothing to do (a fresh engine's first step is as fast as the next) --
    def snapshot_nbytes(self) -> int:
        return 0

    def save_nbytes(self) -> int:
        return 0

    def reserve_host_memory(self, nbytes: int, save_nbytes: int = 0) -> bool:
        return False

    def warm_up(self, checkpoints) -> float:
        return 0.0
