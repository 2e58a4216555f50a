"""The GPU engine: a Megatron-Core `GPTModel` trained with PPO under Megatron DDP, the Megatron
(optionally distributed) optimizer and the pipeline schedule, over NCCL.

It implements the engine interface of `torch_engine.TorchEngine` (the reference), which
`MegatronActor` drives: `connect` / `disconnect` a process-group generation, `train_step`,
`save_checkpoint` / `load_checkpoint` (Megatron `dist_checkpointing`, torch_dist format),
`snapshot` / `rollback` (host-memory copy of the last committed step), `broadcast_from`
(peer restore inside the DP group) and `reset`.

Lifecycle. Megatron layers take their process groups when they are built, so the model, DDP
wrapper, optimizer and LR schedule are (re)built in every `connect`, after
`parallel_state.initialize_model_parallel` has made the groups of the new generation. A rank
that already held a model (a survivor) carries its training state into the new objects by
copying tensors in place (model params, fp32 main params, Adam moments and step, schedule),
so a membership change loses nothing. A pre-warmed spare has imported Megatron and made its
CUDA context in `__init__`; its model is built from `train.seed` when it first joins, so it
starts equal to a reference run's step 0.

Peer restore and the distributed optimizer. With `model.distributed_optimizer: true` each DP
rank holds a different shard of the fp32 main params and Adam moments, so no DP peer can supply
a replaced rank's shard: `rollback(step > 0)` returns False on every rank, and the recovery
protocol falls back to the newest checkpoint. With `distributed_optimizer: false` every DP rank
holds the whole state of its (tp, cp, pp) shard and `broadcast_from` restores params and
optimizer state from a peer.

Log-probs across shards: the vocabulary-parallel cross entropy gives log p(token) on every TP
rank from its vocabulary shard (-CE = log p). With cp > 1 the sequence is cut into 2*cp chunks
and rank r keeps chunks r and 2*cp-1-r (Megatron's load-balanced layout); labels are shifted
before the split, and per-token log-probs are all-gathered (differentiably) over the CP group
before the PPO loss. Context parallelism needs Transformer Engine attention (the local spec
has none), so cp > 1 raises at build time without TE.

Vocabulary: Megatron needs vocab % tp == 0; the embedding is padded to a multiple of 128
(independent of tp, so checkpoints reshard across TP sizes). Padded entries take part in the
softmax, as in Megatron's own training.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib.util
import logging
import math
import mmap
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from checkpoint import CheckpointError, as_checkpoint_error
from config import Config
from parallel_dims import ParallelDims
from ppo import aggregate, kl_penalty, policy_loss, value_loss
from engine import StepInterrupt
from training_batch import TrainingBatch, synthetic_batch

log = logging.getLogger(__name__)
VOCAB_MULTIPLE = 128
_ALLOCATOR = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot-alloc")
_SAVE_ARENA: list = []  # pinned host memory of the last finished async save, for the next one
MEGATRON_SHARD = "megatron"  # shard name of the dist_checkpointing files in a checkpoint step
HOST_ALLOC_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def configure_host_allocator() -> None:
    """Make torch pin host memory with malloc + page mapping by 8 threads + cudaHostRegister
    instead of one cudaHostAlloc call (torch's PYTORCH_CUDA_ALLOC_CONF options from
    pytorch/pytorch#108488). cudaHostAlloc holds a CUDA driver lock for the whole allocation,
    and a step's kernel launches wait on it: pinning a freshly joined rank's ~22 GB snapshot
    buffers (1.36B params) in the background made its first step take 20.4 s instead of 1.3 s
    (bench/results/gpu/first_step_probe_nvidia-h200-x2_2026-11-30.json). The engine's own
    buffers now come from `pinned_empty` (the same registration path, exact size); this
    covers what still pins through torch, e.g. Megatron's device-to-host copy in a synchronous
    save. Call before CUDA is initialised in the process; settings already in
    PYTORCH_CUDA_ALLOC_CONF are kept."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "pinned_use_cuda_host_register" not in conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, HOST_ALLOC_CONF]))


_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def padded_vocab_size(vocab_size: int) -> int:
    """Vocabulary rows of the Megatron embedding/output layer: vocab_size rounded up to 128."""
    return math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def cp_split(x: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's part of the sequence dim (1) of x [B, S, ...]: chunks cp_rank and
    2*cp-1-cp_rank of 2*cp equal chunks, concatenated -> [B, S/cp, ...]. Identity for cp=1."""
    if cp == 1:
        return x
    c = x.chunk(2 * cp, dim=1)
    return torch.cat([c[cp_rank], c[2 * cp - 1 - cp_rank]], dim=1)


def cp_gather(local: torch.Tensor, cp: int, group) -> torch.Tensor:
    """Inverse of `cp_split` over the CP group, differentiable: local [B, S/cp] -> [B, S].
    The backward sums the gradients of all CP ranks (so each rank's local part receives cp
    times the gradient of a loss that every rank computes identically)."""
    if cp == 1:
        return local
    from torch.distributed.nn.functional import all_gather

    parts = all_gather(local.contiguous(), group=group)
    chunks: list = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)


def _set_main_param_and_state(opt, model_param, tensors: dict) -> None:
    """`DistributedOptimizer._set_main_param_and_optimizer_states` without its KeyError: in
    Megatron-Core 0.16 a fully_reshardable load copies every key of torch AdamW's state,
    'step' included, from `tensors`, which has none ('step' is restored per param group)."""
    gi, go = opt.model_param_group_index_map[model_param]
    main = opt.optimizer.param_groups[gi]["params"][go]
    main.data.copy_(tensors["param"])
    for k, v in tensors.items():
        if k != "param":
            opt.optimizer.state[main][k].copy_(v)


def _same_layout(a: dict, b: dict) -> bool:
    """Whether two training states have tensors of the same shapes and dtypes, in order."""
    return [(x.shape, x.dtype) for x in _tensors(a)] == [(x.shape, x.dtype) for x in _tensors(b)]


def _tensors(state) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(state) if isinstance(x, torch.Tensor)]


def _copy_state(dst: dict, src: dict) -> None:
    """Queue a non-blocking copy of every tensor of `src` into the same-structured `dst` on the
    current stream (host <-> device; the caller synchronizes). Raises ValueError when the two
    hold different numbers of tensors."""
    for d, s in zip(_tensors(dst), _tensors(src), strict=True):
        d.copy_(s, non_blocking=True)


def _with_counters(into: dict, state: dict) -> dict:
    """`into` (a host copy of `state`'s tensors) with `state`'s python values: the schedule's
    update count, the step and, with RL, the rollout position."""
    into.update(sched_steps=state["sched_steps"], step=state["step"])
    if "rollout" in state:
        into["rollout"] = dict(state["rollout"])
    return into


_ALIGN = 64  # bytes: any dtype's view may start at such an offset


def state_nbytes(state) -> int:
    """Bytes `carve` needs for the tensors of `state` (each rounded up to 64 bytes)."""
    return sum(-(-x.numel() * x.element_size() // _ALIGN) * _ALIGN for x in _tensors(state))


def carve(state, arena: torch.Tensor):
    """Buffers shaped like every tensor of `state` (same shapes and dtypes; other leaves kept),
    in disjoint parts of `arena` (uint8 [N] host memory, e.g. pinned and reserved earlier) at
    64-byte-aligned offsets. Each buffer has a storage of its own bytes only (`torch.frombuffer`
    over the arena's memory, which it keeps alive), not a view of the arena's storage:
    `torch.save` and pickle write a tensor's whole storage, so Megatron's async save of views
    wrote the whole 19 GB arena for every tensor and failed ("unexpected pos" in torch's zip
    writer, bench/results/gpu/checkpoint_megatron_1b_exactpin_*_2026-11-30c.log; a full disk
    is the likely cause, not seen).
    Returns None when `arena` has fewer than `state_nbytes(state)` bytes."""
    if arena.numel() < state_nbytes(state):
        return None
    memory, offset = arena.numpy(), 0

    def view(x):
        nonlocal offset
        if not isinstance(x, torch.Tensor):
            return x
        if x.numel() == 0:  # frombuffer refuses count 0
            return torch.empty(x.shape, dtype=x.dtype)
        out = torch.frombuffer(memory, dtype=x.dtype, count=x.numel(), offset=offset).view(x.shape)
        offset += -(-x.numel() * x.element_size() // _ALIGN) * _ALIGN
        return out

    return torch.utils._pytree.tree_map(view, state)


class _PinnedMap(mmap.mmap):
    """Anonymous host memory (pages faulted in on first touch, no memset) page-locked with
    cudaHostRegister for as long as any tensor views it: `torch.frombuffer` keeps this object
    alive until the last view's storage is freed, and its finalizer unregisters the pages
    before the memory is unmapped."""

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
    PowerOf2Ceil; unbounded by default), so a 1.36B-param rank's 19.1 GB snapshot took
    34.4 GB and 2 workers + 2 spares filled a 256 GB host until the OS killed ranks
    (bench/results/gpu/demo_tp1_dp2_1b_hostmem_nvidia-h200-x2_2026-11-30.txt,
    recovery_1b_reserved_nvidia-h200-x2_2026-11-30.log). The pages are faulted in by torch's
    multi-threaded fill, then registered (as torch's `pinned_use_cuda_host_register` does,
    without cudaHostAlloc's long driver lock). Any view keeps the memory alive and pinned.
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


def _pin_in_background(nbytes: int) -> concurrent.futures.Future:
    """`pinned_empty(nbytes)` in the allocator thread, registered by this thread's device."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return _ALLOCATOR.submit(pinned_empty, nbytes, device)


# -- the model, and Hugging Face checkpoints (through mbridge) ----------------------------------
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # config.json model_type values model.hf_path may hold
# Megatron's local layer spec keeps the pre-attention / pre-MLP RMSNorm as modules of their own;
# mbridge's name tables use Transformer Engine's names (the norm fused into the next linear).
_LOCAL_TO_TE_NAME = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
                     ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


def _hf_error(hf_path: str, what: str) -> ValueError:
    return ValueError(f"model.hf_path={hf_path!r}: {what}")


def _hf_rope_args(hf, hf_path: str) -> dict:
    """GPTModel rotary arguments reproducing the HF config's RoPE (transformers 5
    `rope_parameters`, or 4's `rope_theta` / `rope_scaling`): default; linear (positions divided
    by factor); llama3 with Megatron's fixed low/high frequency factors 1 / 4 and 8192 original
    positions (Llama 3.1 / 3.2). Raises ValueError for any other scaling or partial rotary."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if theta is None:
        raise _hf_error(hf_path, "config.json has no rope_theta")
    if partial not in (None, 1, 1.0):
        raise _hf_error(hf_path, f"partial_rotary_factor={partial} is not supported (full rotary only)")
    args = {"rotary_base": float(theta)}
    if kind == "linear":
        args["seq_len_interpolation_factor"] = float(rope["factor"])
    elif kind == "llama3" and (rope.get("low_freq_factor"), rope.get("high_freq_factor"),
                               rope.get("original_max_position_embeddings")) == (1, 4, 8192):
        args.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    elif kind != "default":
        raise _hf_error(hf_path, f"rope scaling {rope} is not supported (Megatron's rotary embedding "
                                 f"reproduces: default, linear, llama3 with factors 1/4 and 8192 positions)")
    return args


def hf_bridge(hf_path: str, dtype: torch.dtype = torch.float32):
    """The mbridge `Bridge` of the local Hugging Face checkpoint `hf_path` (a directory with
    config.json and *.safetensors; nothing is downloaded: `local_files_only`). It pads the
    vocabulary like this engine (`padded_vocab_size`, zero rows) and converts weights to
    `dtype`. Only its name tables and per-tensor conversions are used (`load_hf_weights`), none
    of its collectives, so it is made with trivial parallel states.

    Raises ValueError naming model.hf_path when the directory has no config.json, or the
    model is not one the Megatron GPTModel here reproduces: model_type not in
    HF_MODEL_TYPES, an activation other than silu, biases other than Qwen2's q/k/v ones,
    sliding-window attention, or an unsupported RoPE (`_hf_rope_args`)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(hf_path, "config.json")):
        raise _hf_error(hf_path, "not a local Hugging Face model directory (no config.json)")
    hf = AutoConfig.from_pretrained(hf_path, local_files_only=True)
    kind = getattr(hf, "model_type", None)
    if kind not in HF_MODEL_TYPES:
        raise _hf_error(hf_path, f"model_type {kind!r} is not supported by the Megatron engine; "
                                 f"supported model_types: {', '.join(HF_MODEL_TYPES)}")
    unsupported = {"hidden_act": (getattr(hf, "hidden_act", "silu"), "silu"),
                   "mlp_bias": (getattr(hf, "mlp_bias", False), False),
                   "attention_bias": (getattr(hf, "attention_bias", False), False),
                   "use_sliding_window": (getattr(hf, "use_sliding_window", False), False)}
    for key, (value, ok) in unsupported.items():
        if value != ok:
            raise _hf_error(hf_path, f"{key}={value!r} is not supported for {kind} (only {ok!r})")
    _hf_rope_args(hf, hf_path)
    import mbridge
    from mbridge.core.parallel_states import ParallelStates

    bridge = mbridge.AutoBridge.from_config(hf, dtype=dtype, parallel_states=ParallelStates(),
                                            make_vocab_size_divisible_by=VOCAB_MULTIPLE)
    bridge.vocab_size, bridge.padded_vocab_size = hf.vocab_size, padded_vocab_size(hf.vocab_size)
    return bridge


def hf_model_args(bridge, hf_path: str, tp: int, pp: int) -> tuple[dict, dict]:
    """(TransformerConfig fields, GPTModel arguments) of the HF model of `bridge` (`hf_bridge`):
    layers, hidden size, heads, query groups (GQA), head dim, FFN width, RMSNorm eps, q/k/v
    bias (Qwen2), q/k RMSNorm (Qwen3), vocabulary (padded), positions, RoPE, tied embeddings.
    Megatron's random init stays on (it also tags the TP-sharded weights with the attributes
    the grad norm and optimizer read); `load_hf_weights` then overwrites every parameter.
    Raises ValueError naming model.hf_path when a size cannot be split over parallel.tp / .pp."""
    c, hf = bridge.config, bridge.hf_config
    for n, what, k, name in ((c.num_layers, "layers", pp, "pp"), (c.num_attention_heads, "attention heads", tp, "tp"),
                             (c.num_query_groups, "key/value heads", tp, "tp"),
                             (c.ffn_hidden_size, "intermediate_size", tp, "tp"),
                             (bridge.padded_vocab_size, "padded vocabulary rows", tp, "tp")):
        if n % k:
            raise _hf_error(hf_path, f"its {n} {what} are not divisible by parallel.{name}={k}")
    arch = {k: getattr(c, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                       "ffn_hidden_size", "kv_channels", "layernorm_epsilon",
                                       "add_qkv_bias", "qk_layernorm")}
    gpt = {"vocab_size": bridge.padded_vocab_size, "max_sequence_length": hf.max_position_embeddings,
           "share_embeddings_and_output_weights": bool(getattr(hf, "tie_word_embeddings", False)),
           **_hf_rope_args(hf, hf_path)}
    return arch, gpt


def load_hf_weights(model, bridge, hf_path: str, tp_rank: int, tp_size: int) -> None:
    """Copy this rank's shard of the HF weights at `hf_path` into every parameter of `model`
    (a GPTModel stage built from `hf_model_args`, any TP/PP layout), in place, without any
    collective (each rank reads the tensors its stage needs; peak extra memory: one full tensor).

    mbridge does the conversion: local layer index -> global (PP), Megatron name -> HF names,
    q/k/v fused and interleaved by query group, gate/up fused, vocabulary padded with zero
    rows, cast to the bridge's dtype, split over TP. Local-spec norm names are first
    translated to the Transformer Engine names mbridge knows (`_LOCAL_TO_TE_NAME`); the output
    layer is mapped here (lm_head, or the embedding when tied: mbridge 0.15.1's Qwen2 bridge
    records a tied model in a class-level table, which would leak into later untied models).
    Raises ValueError naming model.hf_path when a tensor is missing, unmapped or mis-shaped."""
    from mbridge.core.safetensor_io import SafeTensorIO

    io = SafeTensorIO(hf_path)
    tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
    global_names = bridge._weight_name_mapping_mcore_local_to_global(model)
    with torch.no_grad():
        for local, param in model.named_parameters():
            name = global_names[local]
            for old, new in _LOCAL_TO_TE_NAME.items():
                if name.endswith(old):
                    name = name[: -len(old)] + new
            try:
                if name == "output_layer.weight":
                    hf_names = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
                else:
                    hf_names = bridge._weight_name_mapping_mcore_to_hf(name)
                weights = io.load_some_hf_weight(hf_names)
            except (KeyError, ValueError, NotImplementedError) as e:
                raise _hf_error(hf_path, f"no weights for Megatron parameter {local} ({e})") from None
            full = bridge._weight_to_mcore_format(name, [weights[n] for n in hf_names])
            shard = bridge._weight_split_across_tp(name, full, param, tp_size)[tp_rank]
            if shard.shape != param.shape:
                raise _hf_error(hf_path, f"{hf_names} give {local} the shape {tuple(shard.shape)}, "
                                         f"the model has {tuple(param.shape)}")
            param.copy_(shard)


def build_gpt_model(cfg: Config, tp: int, pp: int, cp: int, bridge=None,
                    use_cpu_initialization: bool = False, initialize: bool = True):
    """This rank's pipeline stage of the Megatron-Core GPTModel, and its TransformerConfig.
    Megatron's groups must exist (`parallel_state.initialize_model_parallel(tp, pp, cp)`).

    Without `bridge`: RMSNorm, SwiGLU, RoPE, no biases, untied embeddings, the sizes of
    cfg.model, Megatron's random init (seeded CUDA RNG tracker). With `bridge` (`hf_bridge` of
    model.hf_path): the architecture of the HF config (`hf_model_args`) and this rank's TP/PP
    shard of its weights (`load_hf_weights`). Params in cfg.model.dtype on the current CUDA
    device (on CPU with `use_cpu_initialization`). Layer spec: Transformer Engine's when
    installed, else Megatron's local one. `initialize=False`: params left uninitialised and
    no HF weights read (the caller copies weights in). Raises ValueError as `hf_model_args`,
    `load_hf_weights`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    bf16 = m.dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    if bridge is None:
        arch = {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_heads,
                "ffn_hidden_size": m.ffn_hidden_size}
        gpt = {"vocab_size": padded_vocab_size(m.vocab_size), "max_sequence_length": m.max_seq_len,
               "share_embeddings_and_output_weights": False}
    else:
        arch, gpt = hf_model_args(bridge, m.hf_path, tp, pp)
    tc = TransformerConfig(
        **arch, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, context_parallel_size=cp, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, use_cpu_initialization=use_cpu_initialization,
        perform_initialization=initialize)
    spec = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=tc.qk_layernorm) if have_transformer_engine()
            else get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=tc.qk_layernorm))
    model = GPTModel(config=tc, transformer_layer_spec=spec, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope", **gpt)
    if bridge is not None and initialize:
        load_hf_weights(model, bridge, m.hf_path, ps.get_tensor_model_parallel_rank(), tp)
    return model, tc


# -- RL: rollouts (generation), value head, loss terms ---------------------------------------------
# Used by `MegatronEngine.generate` / `_loss` on the live model, and by tests on a GPTModel stage
# built on CPU. Every function that takes a `model` takes what Megatron's schedule takes: the DDP
# wrapper, or a (possibly Float16Module-wrapped) GPTModel stage.
_MASKED_LOGIT = -1e9  # logit of a padded vocabulary column under RL: exp() is exactly 0, and
                      # unlike -inf it keeps p * log p finite (0) in the entropy


def pipeline_forward(model, ids: torch.Tensor, on_output) -> list:
    """Forward-only pass of ids int64 [B, L] (on the model's device) through every pipeline
    stage: stage i > 0 receives the previous stage's hidden states [L, B, H] (in the config's
    pipeline_dtype) and sends its own to stage i + 1, by plain p2p over the PP group (an
    explicit pass instead of Megatron's schedule, which allocates on "cuda" and so cannot be
    tested on CPU; one micro-batch needs no schedule). Collective over the PP group (and inside
    the model, the TP group). On the last stage `on_output(logits float [B, L, V_pad/tp])`
    returns a dict, and the result is [that dict]; other stages return []. Positions are
    0..L-1 and the mask is Megatron's causal one (right padding after a row's last token does
    not change its earlier positions)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    group = ps.get_pipeline_model_parallel_group()
    if not ps.is_pipeline_first_stage():
        c = get_model_config(model)
        hidden = torch.empty(ids.shape[1], ids.shape[0], c.hidden_size, dtype=c.pipeline_dtype, device=ids.device)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
        get_attr_wrapped_model(model, "set_input_tensor")(hidden)
    out = model(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(), group=group)
        return []
    return [on_output(out)]


def _broadcast_from_last_stage(x: torch.Tensor) -> torch.Tensor:
    """x (meaningful on the last pipeline stage, same shape and dtype everywhere) broadcast in
    place over the PP group: one collective per call on every stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(x, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return x


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def sampling_logits_fn(model, vocab_size: int, temperature: float, on_round=None):
    """The `logits_fn` of `rl.sample` for this rank's Megatron model stage.

    Each call (one sampling round) runs the prefix through all pipeline stages
    (`pipeline_forward`); the last stage takes each row's logits at its last token
    (index mask.sum(-1) - 1: the only position `rl.sample` reads), all-gathers the vocabulary
    shards over the TP group, drops the padded columns (>= `vocab_size`) and divides by
    `temperature`; the result [B, V] float32 is broadcast over the PP group. So every TP and PP
    rank of a model replica sees bitwise the same logits, and `rl.sample` (same per-row
    generators) draws the same tokens there, which the first stage feeds to the next round. Every
    stage makes the same collectives per round: its p2p receive / send, one broadcast.

    Returns fn(ids int64 [B, L], mask int64 [B, L]) -> float32 [B, L, V] on the CPU: the last
    positions' logits expanded along L (a view, no copy). Only the positions `rl.sample` reads
    (each row's last token) hold that row's logits; pass it to `rl.sample` only.
    `on_round()` is called once per round (progress counting)."""
    from megatron.core import parallel_state as ps

    device = _model_device(model)

    def last_token_logits(logits, last):
        local = logits[torch.arange(len(last), device=device), last].float().contiguous()  # [B, V_pad/tp]
        return {"logits": gather_vocab(local)[:, :vocab_size] / temperature}

    def logits_fn(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        last = (mask.sum(-1) - 1).to(device)
        out = pipeline_forward(model, ids.to(device), functools.partial(last_token_logits, last=last))
        x = out[0]["logits"] if ps.is_pipeline_last_stage() else \
            torch.empty(ids.shape[0], vocab_size, device=device)
        x = _broadcast_from_last_stage(x).cpu()
        if on_round is not None:
            on_round()
        return x[:, None].expand(ids.shape[0], ids.shape[1], vocab_size)

    return logits_fn


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """All-gather vocabulary shards [..., V_pad/tp] over the TP group -> [..., V_pad] (rank
    order = vocabulary order, as Megatron's VocabParallelEmbedding / output layer split it).
    No gradient."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=-1)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits float [..., V_pad/tp] (this TP rank's shard) with the padded vocabulary columns
    (global index >= `vocab_size`) set to `_MASKED_LOGIT`: RL trains the distribution over the
    real vocabulary, the one `sampling_logits_fn` samples from. Returns a new tensor."""
    from megatron.core import parallel_state as ps

    n = logits.shape[-1]
    col = ps.get_tensor_model_parallel_rank() * n + torch.arange(n, device=logits.device)
    return logits.masked_fill(col >= vocab_size, _MASKED_LOGIT)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """`ppo.token_entropy` of vocabulary-parallel logits float32 [B, S, V/tp] (this TP rank's
    shard), without gathering the vocabulary: with m the max over the whole vocabulary
    (all-reduced, no gradient: H does not depend on the shift), z = logits - m,
        H = log sum_v exp(z_v) - sum_v exp(z_v) z_v / sum_v exp(z_v),
    the two sums all-reduced over the TP group with Megatron's reduce_from_tensor_model_parallel_region
    (backward: identity, so each rank's shard gets the gradient of the full-vocabulary entropy),
    as Megatron's vocab_parallel_cross_entropy does for the log-sum-exp. Returns float32 [B, S],
    column t = H(p(. | prefix before t)), column 0 = 0, equal on every TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    m = logits.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits[:, :-1].float() - m[:, :-1]
    e = z.exp()
    total = reduce_from_tensor_model_parallel_region(e.sum(-1))
    ez = reduce_from_tensor_model_parallel_region((e * z).sum(-1))
    return F.pad(total.log() - ez / total, (1, 0))


def add_value_head(model) -> None:
    """Give a last-stage GPTModel `model` a value head for GAE: `model.value_head`, a
    zero-initialised Linear(hidden, 1) in the model's dtype, registered as a submodule so that
    Megatron DDP, the optimizer, `sharded_state_dict` and the engine's state copies include it,
    and a forward hook on `model.decoder.final_layernorm` that keeps the last forward's final
    hidden states [L, B, H] (after the final norm, the output layer's input) for `token_values`.
    A hook rather than a second forward: GPTModel.forward returns logits only, and the hook
    works unchanged under DDP / Float16Module and the pipeline schedule."""
    c = model.config
    head = torch.nn.Linear(c.hidden_size, 1, dtype=c.params_dtype, device=_model_device(model))
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    model.value_head = head

    def keep_hidden(module, args, output):
        model.__dict__["_final_hidden"] = output

    model.decoder.final_layernorm.register_forward_hook(keep_hidden)


def token_values(model) -> torch.Tensor:
    """Values float32 [B, L] of the last forward of `model` (a GPTModel stage with
    `add_value_head`; the last stage): `align_values(value_head(final hidden))`. Consumes the
    kept hidden states. Raises KeyError if no forward ran since the last call."""
    hidden = model.__dict__.pop("_final_hidden")
    return align_values(model.value_head(hidden))


def align_values(v: torch.Tensor) -> torch.Tensor:
    """Value head output [L, B, 1] (sequence-first, Megatron's layout) -> float32 [B, L] aligned
    like `rl.PolicyValue`: column t = V(prefix before token t) = head output at t - 1, column 0 = 0."""
    return F.pad(v.squeeze(-1).t()[:, :-1].float(), (1, 0))


@torch.no_grad()
def sample_rollouts(model, prompts: TrainingBatch, seeds: list[int], rl_cfg, vocab_size: int,
                    with_values: bool, on_round=None) -> dict:
    """`rl.sample` of `prompts` (right-padded int64 [B, S] input_ids / attention_mask, CPU) on
    this rank's Megatron model stage (`sampling_logits_fn`; temperature and top-p of `rl_cfg`),
    row b drawing from a generator seeded with seeds[b]. Collective over the model-parallel
    (TP x PP) group of the replica: every rank returns the same result. With `with_values`,
    one more forward of the sampled sequences gives the value head's estimates (`token_values`,
    last stage, broadcast over the PP group).

    Returns `rl.sample`'s dict of CPU [B, S] tensors plus `values` (float32 [B, S] or None)."""
    from rl import EOS_ID, PAD_ID, sample

    out = sample(sampling_logits_fn(model, vocab_size, rl_cfg.temperature, on_round),
                 prompts.input_ids, prompts.attention_mask, seeds, rl_cfg.max_new_tokens, EOS_ID, PAD_ID,
                 temperature=1.0, top_p=rl_cfg.top_p)
    out["values"] = None
    if with_values:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model

        device = _model_device(model)
        ids = out["input_ids"].to(device)
        res = pipeline_forward(model, ids, lambda logits: {"values": token_values(unwrap_model(model))})
        v = res[0]["values"] if ps.is_pipeline_last_stage() else torch.empty(ids.shape, device=device)
        out["values"] = _broadcast_from_last_stage(v.contiguous()).cpu()
    return out


class MegatronEngine:
    """Megatron-Core GPT model, optimizer and cosine LR schedule of one rank (CUDA device 0 of
    the process, bf16 params with fp32 main params and fp32 gradient reduction).

    Raises ValueError from `__init__` when the config asks for something this install cannot
    run (cp > 1 without Transformer Engine) or `model.hf_path` holds a model it cannot load
    (`hf_bridge`, `hf_model_args`).

    RL (`rl.enabled`, as `TorchEngine`): `generate` samples rollouts (`sample_rollouts`); with
    `rl.advantage=gae` the last stage's GPTModel carries a value head (`add_value_head`), and
    with `rl.kl_coef > 0` a frozen reference GPTModel of the same layout (the initial policy)
    gives `ref_log_probs`. `_loss` adds the value, KL and entropy terms. Value head, reference
    weights and the rollout position are part of the training state (snapshots, rollback, peer
    broadcast, reset) and of the checkpoint.
    """

    in_collective = False  # never stuck in one after an abort: NCCL's abort ends its collectives

    def __init__(self, cfg: Config):
        self.cfg = cfg
        m = cfg.model
        if cfg.parallel.cp > 1 and not have_transformer_engine():
            raise ValueError("parallel.cp > 1 needs Transformer Engine attention (the local layer "
                             "spec has no context parallelism); install transformer_engine or set parallel.cp=1")
        # Pre-warm: imports and the CUDA context; the model needs this generation's groups.
        from megatron.core import dist_checkpointing, parallel_state  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        self.device = torch.device("cuda", torch.cuda.current_device())
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
        self.step = 0                  # train steps whose update this state contains
        self._dirty = False            # True while a step may have partly updated the state
        self._initial: dict | None = None   # host copy of the step-0 state (taken before step 1)
        self._snapshot: dict | None = None  # host copy of the last committed step's state
        self._trained_since_connect = False
        self._arena: concurrent.futures.Future | None = None    # pinned bytes of the snapshot buffers
        self._copy_stream: torch.cuda.Stream | None = None       # side stream of the snapshot copy
        self._copy_done: torch.cuda.Event | None = None          # the snapshot copy in flight
        self._send_buffers: dict | None = None  # pinned buffers of `host_state`
        self.connect_phases: dict[str, float] = {}  # seconds of the last `connect`, by part
        self._connected = False
        self._interrupt = StepInterrupt()  # hooks on each model `_build` makes

    # -- process groups ----------------------------------------------------------------------
    def connect(self, dims: ParallelDims, rank: int) -> None:
        """Make Megatron's groups for this generation (the default group must exist) and build
        model, DDP, optimizer and schedule on them. A rank that already held a model keeps its
        training state and RNG state; a new one starts from the seeded step-0 state."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        if (dims.tp, dims.pp, dims.cp) != (self.cfg.parallel.tp, self.cfg.parallel.pp, self.cfg.parallel.cp):
            raise ValueError(f"dims {dims} do not match the config's parallel sizes {self.cfg.parallel}")
        # Carry the live state over, unless its optimizer shards no longer fit (DP resized under
        # the distributed optimizer: the state is then restored from a checkpoint).
        self._wait_snapshot_copy()  # the rebuild frees tensors it may still be reading
        keep = self.model is not None and not (self.cfg.model.distributed_optimizer and self.dims.dp != dims.dp)
        old = self._train_state() if keep else None
        rng = self._rng_state() if old is not None else None
        t0 = time.perf_counter()
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(dims.tp, dims.pp, context_parallel_size=dims.cp,
                                     create_gloo_process_groups=False)
        self.dims, self.rank = dims, rank
        model_parallel_cuda_manual_seed(self.cfg.train.seed + 100 * ps.get_pipeline_model_parallel_rank())
        t1 = time.perf_counter()
        self._build()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if old is None:
            self.step = 0
        else:
            self._set_train_state(old)
            torch.cuda.set_rng_state(rng["cuda"])
            torch.set_rng_state(rng["cpu"])
            get_cuda_rng_tracker().set_states(rng["tracker"])
            torch.cuda.synchronize()
        del old
        self.connect_phases = {"groups_s": t1 - t0, "build_s": t2 - t1, "state_copy_s": time.perf_counter() - t2}
        self._trained_since_connect = False
        self._interrupt.clear()
        self._connected = True

    def interrupt(self) -> None:
        """Make the running step (or rollout) raise `torch_engine.Interrupted` at its next
        module forward or parameter gradient (`StepInterrupt`); called from another thread when
        the generation is aborted (an aborted NCCL collective returns without raising, so the
        step would run on). Kernels already queued still run; `rollback` or a restore follows.
        Cleared by `connect`."""
        self._interrupt.set()

    def disconnect(self) -> None:
        """Mark the generation's groups unusable (no collective); the state stays for `connect`."""
        self._connected = False

    def _build(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        m, t, d = self.cfg.model, self.cfg.train, self.dims
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.model = self.ddp = self.optimizer = self.scheduler = self.ref_model = None
        torch.cuda.empty_cache()
        # HF weights are in the model before DDP (its buffers) and the optimizer (fp32 main
        # params) copy them.
        model, tc = build_gpt_model(self.cfg, d.tp, d.pp, d.cp, self.hf_bridge)
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
        module = Float16Module(tc, self.model) if self.bf16 else self.model
        self.ddp = DistributedDataParallel(
            config=tc, module=module,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=m.distributed_optimizer))
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=0.0, weight_decay=t.weight_decay,
                            adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, bf16=self.bf16,
                            params_dtype=dtype, clip_grad=t.grad_clip,
                            use_distributed_optimizer=m.distributed_optimizer),
            [self.ddp], use_gloo_process_groups=False)
        updates = t.steps * (t.global_batch_size // t.mini_batch_size)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=t.lr, min_lr=0.0, lr_warmup_steps=0,
            lr_decay_steps=updates, lr_decay_style="cosine", start_wd=t.weight_decay,
            end_wd=t.weight_decay, wd_incr_steps=updates, wd_incr_style="constant")
        for o in self.optimizer.chained_optimizers:
            if isinstance(o, DistributedOptimizer):
                o._set_main_param_and_optimizer_states = functools.partial(_set_main_param_and_state, o)
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
        out = model(cp_split(mb.input_ids, cp, cp_rank), cp_split(pos, cp, cp_rank), None)
        self.progress += 1
        values = token_values(self.model) if not behaviour and hasattr(self.model, "value_head") else None
        return out, functools.partial(self._loss, mb, values, behaviour)

    def _loss(self, mb: TrainingBatch, values: torch.Tensor | None, behaviour: bool, logits: torch.Tensor):
        """Last stage: logits float32 [B, S/cp, V_pad/tp] -> (loss to backprop, reported dict).
        A behaviour pass (forward only: old or reference policy) reports `log_probs` [B, S].

        Training: the dual-clip PPO policy loss; with RL (as `TorchEngine._loss`, cp = 1) plus
        `value_coef` x clipped value loss (GAE, `values` float32 [B, S] of the value head),
        `kl_coef` x KL(policy || reference) (`rl.kl_estimator`), - `entropy_coef` x entropy,
        each aggregated with `ppo.loss_agg_mode`. RL logits are divided by `rl.temperature` and
        their padded vocabulary columns masked (`mask_padded_vocab`): the distribution the
        rollouts were sampled from. The entropy is vocabulary-parallel (`vocab_parallel_entropy`,
        no gather of the logits) and computed before the cross entropy, which overwrites fp32
        logits in place."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        cp, r = self.dims.cp, self.rl
        if r is not None:
            logits = mask_padded_vocab(logits.float(), self.cfg.model.vocab_size) / r.temperature
        entropy = None
        if r is not None and r.entropy_coef > 0 and not behaviour:
            entropy = vocab_parallel_entropy(logits)                           # [B, S]
        labels = cp_split(F.pad(mb.input_ids[:, 1:], (0, 1)), cp, ps.get_context_parallel_rank())
        lp_next = -vocab_parallel_cross_entropy(logits.float(), labels)        # [B, S/cp]
        lp_next = cp_gather(lp_next, cp, ps.get_context_parallel_group())       # [B, S]
        log_probs = F.pad(lp_next[:, :-1], (1, 0))                              # [B, S]
        if behaviour:
            return torch.zeros((), device=self.device), {"log_probs": log_probs.detach()}
        p = self.cfg.ppo
        loss, metrics = policy_loss(log_probs, mb.old_log_probs, mb.advantages, mb.loss_mask,
                                    p.eps_clip_low, p.eps_clip_high, p.clip_ratio_c, p.loss_agg_mode)
        if r is not None:
            metrics["pg_loss"] = loss.item()
            if values is not None:
                vf = value_loss(values, mb.old_values, mb.returns, mb.loss_mask, r.value_clip, p.loss_agg_mode)
                loss = loss + r.value_coef * vf
                metrics["vf_loss"] = vf.item()
            if mb.ref_log_probs is not None:
                kl = aggregate(kl_penalty(log_probs, mb.ref_log_probs, r.kl_estimator), mb.loss_mask, p.loss_agg_mode)
                loss = loss + r.kl_coef * kl
                metrics["kl"] = kl.item()
            if entropy is not None:
                ent = aggregate(entropy, mb.loss_mask, p.loss_agg_mode)
                loss = loss - r.entropy_coef * ent
                metrics["entropy"] = ent.item()
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
    def generate(self, prompts: TrainingBatch, step: int, rows: list[int]) -> dict:
        """Sample completions of this replica's prompt rows with the current policy, as
        `TorchEngine.generate`: row j's randomness comes from `rl.row_seed(train.seed, step,
        rows[j])` (global row indices), so a row samples the same at any DP size; every rank
        of the replica (all TP and PP ranks) returns the same result (`sample_rollouts`).
        `progress` grows by one per sampling round. Returns `rl.sample`'s dict of CPU [B, S]
        tensors plus `values` (float32 [B, S], the value head's estimates, GAE) or None.
        Raises RuntimeError without rl.enabled or before `connect`."""
        from rl import row_seed

        if self.rl is None:
            raise RuntimeError("generate needs rl.enabled=true")
        if not self._connected:
            raise RuntimeError("generate called before connect(): no process group generation")

        def on_round():
            self.progress += 1

        return sample_rollouts(self.ddp, prompts, [row_seed(self.cfg.train.seed, step, row) for row in rows],
                               self.rl, self.cfg.model.vocab_size, self.rl.advantage == "gae", on_round)

    def train_step(self, batch: TrainingBatch, step: int) -> dict:
        """One PPO step on this replica's shard of the global batch (as `TorchEngine.train_step`).

        batch: this DP replica's sequences (CPU or GPU), B = global_batch_size / dp, S =
        train.seq_len (S % (2*cp) == 0 when cp > 1). Old log-probs, when absent, come from a
        forward-only pass of the current policy, and with RL's KL penalty `ref_log_probs` from
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
        t = self.cfg.train
        micro, last = t.micro_batch_size, ps.is_pipeline_last_stage()
        # Phases (with device syncs) are timed on the first step after a connect only: that is
        # the step a recovery timeline explains (`first_step_detail`); others stay sync-free.
        timed = not self._trained_since_connect
        t0 = time.perf_counter()
        if self.step == 0 and self._initial is None:  # before the first update: for `reset`
            self._initial = self._host_copy(self._train_state(), pin=False)
        batch = batch.to(self.device)
        if batch.old_log_probs is None:
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
            self._wait_snapshot_copy(torch.cuda.current_stream())  # the update overwrites its source
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
        """Copy `state` (same structure as `_train_state`) into the live tensors in place."""
        self._wait_snapshot_copy()  # it may still be reading them
        _copy_state(self._train_state(), state)
        torch.cuda.synchronize()
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
        _copy_state(into, state)
        torch.cuda.synchronize()
        return _with_counters(into, state)

    def _host_copy_async(self, state: dict, into: dict) -> dict:
        """Start copying `state` into the pinned buffers `into` on a side stream and return at
        once: the copy overlaps the step's forward and backward passes, which only read the
        state. `_wait_snapshot_copy` orders the optimizer step (and any reader) after it."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        self._copy_stream.wait_stream(torch.cuda.current_stream())  # the state as of now
        with torch.cuda.stream(self._copy_stream):
            _copy_state(into, state)
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return _with_counters(into, state)

    def _wait_snapshot_copy(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order `stream`'s later work after the snapshot copy in flight (no host wait), or with
        no stream, block until the copy is done (before the host reads the snapshot)."""
        if self._copy_done is not None:
            if stream is None:
                self._copy_done.synchronize()
            else:
                stream.wait_event(self._copy_done)

    def reserve_host_memory(self, nbytes: int, headroom: float = 0.1) -> bool:
        """Pin `nbytes` of host memory in a background thread, for the rollback snapshot buffers
        this rank will need after it joins (`MegatronActorGroup` asks pre-warmed spares to do so
        with the largest rank's `snapshot_nbytes`). Pinning ~20 GB takes seconds and slows
        this process's kernel launches meanwhile (bench/first_step_probe.py), so it is done
        before any failure instead of in the first steps after a recovery. Skipped (returns
        False, with a warning) when the host would keep less than `headroom` of its memory
        available: the spare then pins after it joins rather than take memory the ranks need."""
        import psutil

        if nbytes <= 0 or self._arena is not None:
            return self._arena is not None
        mem = psutil.virtual_memory()
        if mem.available - nbytes < headroom * mem.total:
            log.warning("not reserving %.1f GB of pinned host memory for a rollback snapshot: %.1f GB of "
                        "%.1f GB available; this rank pins it after it joins (slower first steps)",
                        nbytes / 1e9, mem.available / 1e9, mem.total / 1e9)
            return False
        self._arena = _pin_in_background(nbytes)
        return True

    def warm_up(self) -> float:
        """Pre-warmed spare, before any failure: pay the one-time costs of a process's first
        training step now rather than in the first step after a recovery. Runs one step of a
        one-layer model with this config's sizes (tp = pp = cp = 1, one micro-batch, no RL
        terms, no HF weights: with `model.hf_path` the sizes are cfg.model's) in a private NCCL
        world of one rank, then frees everything it built (Megatron's groups, the process
        group, its GPU memory) and puts the CPU and CUDA RNG states back, so the spare later
        builds its model exactly as without it. The costs (inferred causes: CUDA's lazily
        loaded kernels, cuBLAS handles and workspaces, NCCL's first initialisation): the
        first step of a fresh rank took 1.32-1.48 s against 0.62-0.77 s for the next ones
        and for a survivor's first step after a reconnect, on one H200 at 1.36B params
        (bench/results/gpu/first_step_probe_*_2026-11-30.json, variant no_snapshot).
        Returns seconds; 0.0 without doing anything when this process is in a process group
        or holds a model (it has trained: nothing left to warm)."""
        import gc

        from megatron.core import parallel_state as ps

        if self.model is not None or dist.is_initialized():
            return 0.0
        t0 = time.perf_counter()
        c, micro = self.cfg, self.cfg.train.micro_batch_size
        cfg = dataclasses.replace(
            c, parallel=dataclasses.replace(c.parallel, tp=1, pp=1, cp=1),
            model=dataclasses.replace(c.model, num_layers=1, hf_path=None, distributed_optimizer=False),
            train=dataclasses.replace(c.train, global_batch_size=micro, mini_batch_size=micro),
            rl=dataclasses.replace(c.rl, enabled=False))
        rng = torch.get_rng_state(), torch.cuda.get_rng_state()
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=self.device)
        engine = None
        try:
            engine = MegatronEngine(cfg)
            engine.connect(ParallelDims(tp=1, pp=1, cp=1, dp=1), 0)
            engine.step = 1  # not step 0: no host copy for `reset`
            t = cfg.train
            engine.train_step(synthetic_batch(t.seed, 1, micro, t.seq_len, cfg.model.vocab_size), 2)
            torch.cuda.synchronize()
        finally:
            del engine
            ps.destroy_model_parallel()
            dist.destroy_process_group()
            gc.collect()
            torch.cuda.empty_cache()
            torch.set_rng_state(rng[0])
            torch.cuda.set_rng_state(rng[1])
        return time.perf_counter() - t0

    def snapshot_nbytes(self) -> int:
        """Bytes of this rank's rollback snapshot (0 with the distributed optimizer: none kept)."""
        return 0 if self.cfg.model.distributed_optimizer else state_nbytes(self._train_state())

    def host_state(self) -> dict:
        """A host-memory copy of this rank's live training state (model params and its
        optimizer shard), to send to a SnapshotHolder. The copy is made into pinned buffers
        allocated at the first call and reused by the next one (no per-call allocation of
        ~14 bytes per parameter): the caller must be done with the previous copy first
        (MegatronActor waits for the previous send before taking the next copy)."""
        state = self._train_state()
        if self._send_buffers is not None and _same_layout(self._send_buffers, state):
            return self._host_copy(state, self._send_buffers)
        self._send_buffers = None
        self._send_buffers = self._host_copy(state)
        return self._send_buffers

    def load_state(self, state: dict) -> None:
        """Make `state` (from `host_state` of the same rank position) the live state."""
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
        (`reset`); with the distributed optimizer no copy is kept (see `rollback`)."""
        if self.step > 0 and not self.cfg.model.distributed_optimizer:
            self._snapshot_to_host()
        self._dirty = True
        self.step_start_progress = self.progress

    def _snapshot_to_host(self) -> None:
        """Copy the live state into the pinned snapshot buffers (~14 bytes per parameter) on a
        side stream (`_host_copy_async`). The buffers are views (`carve`) into one pinned arena:
        the memory reserved before this rank joined (`reserve_host_memory`), else pinned at the
        first copy. A rank that has not trained since it joined (a spare with a restored state)
        and has no arena pins it in the background and keeps no snapshot until it is ready:
        pinning takes seconds, which the first step after a recovery must not wait for. Until
        then `rollback` answers False for this rank and recovery restores it from a peer, an
        in-memory snapshot or a checkpoint."""
        state = self._train_state()
        if self._snapshot is not None and _same_layout(self._snapshot, state):
            self._snapshot = self._host_copy_async(state, self._snapshot)
            return
        self._snapshot = None
        self._wait_snapshot_copy()  # the old buffers may be reused below
        need = state_nbytes(state)
        if self._arena is not None and self._arena.done() and (
                self._arena.exception() or self._arena.result().numel() < need):
            self._arena = None  # pinning failed, or too small for this layout
        if self._arena is None:
            self._arena = _pin_in_background(need)
            if self._trained_since_connect:
                self._arena.result()  # a rank in steady training pins now (raises if it cannot)
        if self._arena.done():
            self._snapshot = self._host_copy_async(state, carve(state, self._arena.result()))

    def rollback(self, step: int) -> bool:
        """Return to the state after committed step `step` without any transfer: the live state
        if it is that step and clean, the snapshot, or `reset()` for step 0. Returns False when
        this rank holds no copy of that step, and always for step > 0 with the distributed
        optimizer (a replaced rank's optimizer shard exists on no peer: restore from checkpoint)."""
        if step == 0:
            return self.reset()
        if self.cfg.model.distributed_optimizer:
            return False
        if self.step == step and not self._dirty:
            return True
        if self._snapshot is not None and self._snapshot["step"] == step:
            self._wait_snapshot_copy()
            self._set_train_state(self._snapshot)
            return True
        return False

    def broadcast_from(self, src_rank: int) -> None:
        """Make this rank's training state equal to `src_rank`'s (same DP group, i.e. same
        (tp, cp, pp) shard): every tensor is broadcast in place over the DP group (CPU scalars
        through a CUDA copy), the schedule count and step with `broadcast_object_list`.
        Raises RuntimeError with the distributed optimizer (peers hold other shards)."""
        from megatron.core import parallel_state as ps

        if self.cfg.model.distributed_optimizer and self.dims.dp > 1:
            raise RuntimeError("broadcast_from: with model.distributed_optimizer each DP rank holds "
                               "a different optimizer shard; restore from a checkpoint instead")
        self._wait_snapshot_copy()  # the broadcast overwrites what it may still be reading
        group = ps.get_data_parallel_group()
        state = self._train_state()
        for x in _tensors(state):
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

    # -- checkpoints -------------------------------------------------------------------------
    def _rng_state(self) -> dict:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(),
                "tracker": get_cuda_rng_tracker().get_states()}

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
        storage failure past the retry limits."""
        return save_sharded(ckpt, step, rank, self._sharded_state(False, True), async_save,
                            after_write=lambda: self.fault_point("mid_save"))

    def load_checkpoint(self, ckpt, manifest, rank: int) -> None:
        """Collective over all ranks: load the committed checkpoint `manifest` (already verified
        by the ranks, `MegatronActor.verify_checkpoint`) into this rank's shards; the saved layout may differ
        in DP and TP size (dist_checkpointing reshards). RNG states are restored only when the
        layout is the same (rank r gets rank r's); otherwise each rank keeps its own."""
        d = self.dims
        same = {k: manifest.layout.get(k) for k in ("tp", "pp", "cp", "dp")} == \
            {"tp": d.tp, "pp": d.pp, "cp": d.cp, "dp": d.dp}
        self._wait_snapshot_copy()  # the load overwrites what it may still be reading
        loaded = load_sharded(ckpt, manifest, self._sharded_state(True, same))
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
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            rng = loaded["rng"]
            torch.set_rng_state(rng["cpu"])
            torch.cuda.set_rng_state(rng["cuda"])
            get_cuda_rng_tracker().set_states(rng["tracker"])
        self.step, self._dirty = int(loaded["step"]), False


# -- dist_checkpointing through a CheckpointManager ---------------------------------------------
def _is_rank_file(name: str, rank: int) -> bool:
    """Whether `name` (a file torch_dist wrote) belongs to `rank`: its `__{rank}_*.distcp`
    files; rank 0 also owns the global ones (.metadata, common.pt, metadata.json)."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) == rank if m else rank == 0


def _put_rank_files(ckpt, step: int, stage: str, rank: int) -> list:
    """`ckpt.put_files` of the files of `rank` in `stage` (hash; upload for object storage)."""
    return ckpt.put_files(step, stage, MEGATRON_SHARD, [n for n in sorted(os.listdir(stage)) if _is_rank_file(n, rank)])


def save_sharded(ckpt, step: int, rank: int, sharded_state_dict: dict, async_save: bool = False,
                 after_write=lambda: None) -> list:
    """Collective over the default process group: `dist_checkpointing.save(sharded_state_dict)`
    (torch_dist format) as shard `megatron` of checkpoint `step` of `ckpt` (a CheckpointManager).

    Local URI: all ranks write in place (a shared file system for multi-node runs). Object
    storage (s3://, gs://): each rank writes into its own private staging directory (tempfile,
    honours TMPDIR; rank 0's also gets the global metadata), then uploads only its own files,
    so no rank waits on another's transfers. Returns this rank's FileEntry list (size, sha256)
    for `CheckpointManager.commit`. Raises CheckpointError on storage failure past the retry
    limits (the caller's error path; the rank stays usable).

    `async_save`: only the synchronous part runs here (planning collectives, the common state,
    a host copy of every tensor: later changes to the state are not in the checkpoint); the
    files are written in a background thread, and `[PendingSave]` is returned. Synchronous:
    `after_write()` runs between the write and the hash / upload (fault injection 'mid_save')."""
    import shutil
    import tempfile

    from megatron.core import dist_checkpointing

    path = ckpt.local_dir(step, MEGATRON_SHARD)
    stage = path or tempfile.mkdtemp(prefix=f"mcore-save-rank{rank}-")
    what = f"saving {ckpt.step_uri(step)}/{MEGATRON_SHARD}"
    done = False
    try:
        if path is not None and rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        dist.barrier()  # the in-place directory exists (and is empty) before anyone writes
        if async_save:
            request = as_checkpoint_error(what, dist_checkpointing.save, sharded_state_dict, stage,
                                          async_sharded_save=True)
            done = True  # the stage now belongs to the PendingSave
            return [PendingSave(ckpt, step, rank, request, stage, path is None)]
        as_checkpoint_error(what, dist_checkpointing.save, sharded_state_dict, stage)
        after_write()
        return _put_rank_files(ckpt, step, stage, rank)
    finally:
        if path is None and not done:
            shutil.rmtree(stage, ignore_errors=True)


class PendingSave:
    """The background part of an async `save_sharded`: Megatron's AsyncRequest
    (`dist_checkpointing.save(..., async_sharded_save=True)`) whose tensors were copied to host
    memory at construction; its write (`async_fn`: no collective) runs in a thread. `result()`
    must be called on every rank, from the thread that runs the collectives (the actor's
    `finish_checkpoint`): it waits for the write, runs the request's finalize functions
    (collective: the global metadata), then hashes / uploads this rank's files and returns
    their FileEntry list. Raises CheckpointError when the write or an upload failed."""

    def __init__(self, ckpt, step: int, rank: int, request, stage: str, owns_stage: bool):
        import threading

        self.ckpt, self.step, self.rank, self.request = ckpt, step, rank, request
        self.stage, self.owns_stage, self.error = stage, owns_stage, None
        args = list(request.async_fn_args)
        # args[1]: Megatron's write buckets [(file, key, (bytes items, [(item, tensor)]))]; the
        # tensors are copied here (Megatron's preload_fn aliases tensors that are on the CPU).
        # GPU tensors: non-blocking copies into one exact-size pinned arena (`pinned_empty`,
        # reused by the next save) and one sync, not a pageable copy per tensor.
        gpu = [t for _, _, (_, tensors) in args[1] for _, t in tensors if t.is_cuda]
        need, arena = state_nbytes(gpu), _SAVE_ARENA.pop() if _SAVE_ARENA else None
        self._arena = arena if arena is not None and arena.numel() >= need else pinned_empty(need)
        host = iter(carve(gpu, self._arena))
        args[1] = [(f, k, (b, [(item, next(host).copy_(t.detach(), non_blocking=True) if t.is_cuda
                                else t.detach().clone()) for item, t in tensors]))
                   for f, k, (b, tensors) in args[1]]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._thread = threading.Thread(target=self._write, args=(args,), daemon=True, name="mcore-async-save")
        self._thread.start()

    def _write(self, args) -> None:
        try:
            if self.request.async_fn is not None:
                _write_buckets(self.request.async_fn, *args)
        except BaseException as exc:  # noqa: BLE001 (reported by result())
            self.error = exc

    def result(self) -> list:
        import shutil

        what = f"saving {self.ckpt.step_uri(self.step)}/{MEGATRON_SHARD} (async)"
        try:
            self._thread.join()
            ok = [None] * dist.get_world_size()  # every rank finalizes, or none (no rank left in a collective)
            dist.all_gather_object(ok, self.error is None)
            if not all(ok):
                failed = [r for r, good in enumerate(ok) if not good]
                raise CheckpointError(f"{what} failed on rank(s) {failed}" +
                                      (f": {self.error!r}" if self.error is not None else ""))
            for finalize in self.request.finalize_fns:
                as_checkpoint_error(what, finalize)
            return _put_rank_files(self.ckpt, self.step, self.stage, self.rank)
        finally:
            if not self._thread.is_alive():
                _SAVE_ARENA[:] = [self._arena]
            if self.owns_stage:
                shutil.rmtree(self.stage, ignore_errors=True)


def _write_buckets(async_fn, _rank: int, buckets: list, results_queue) -> None:
    """What Megatron's async write (`async_fn`: `FileSystemWriterAsync.write_preloaded_data_multiproc`
    bound to its transforms and `use_msc`) does, without its fork: each write bucket goes to
    `FileSystemWriterAsync.write_preloaded_data` in a thread of this process, and the results
    (bucket index -> write results, or the first exception) go to `results_queue` for the
    request's finalize (`_rank`, Megatron's first argument, is not needed). Megatron forks one
    writer process per bucket; here that fork happened in a background thread while the
    training thread ran, and in one CI run (tests/test_megatron_checkpoint.py) a rank waited
    until its 240 s timeout while its two forked writers stayed in futex_wait. A lock held by
    another thread at the fork is the likely cause (inferred, the textbook hazard of fork in a
    threaded process)."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if not (isinstance(async_fn, functools.partial) and len(async_fn.args) == 2):
        raise CheckpointError(f"megatron-core's async write is {async_fn!r}, not the partial of "
                              "(transform_list, use_msc) of megatron-core 0.16.1: install the version "
                              "pinned in requirements.txt")
    transform_list, use_msc = async_fn.args

    def write(i: int, bucket):
        out, count = queue.Queue(), queue.Queue()
        count.put(i)  # the writer marks its bucket done on this queue
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, out, count, True, use_msc=use_msc)
        return out.get()[1]

    with concurrent.futures.ThreadPoolExecutor(max(1, len(buckets)), thread_name_prefix="mcore-write") as pool:
        results = list(pool.map(write, range(len(buckets)), buckets))
    error = next((r for r in results if isinstance(r, Exception)), None)
    results_queue.put(error if error is not None else dict(enumerate(results)))


def load_sharded(ckpt, manifest, sharded_state_dict: dict) -> dict:
    """Collective over the default process group: `dist_checkpointing.load` of shard
    `megatron` of the committed checkpoint `manifest` into `sharded_state_dict` (the saved
    layout may differ in DP and TP size: dist_checkpointing reshards). Returns the loaded
    state dict.

    Object storage: the global files are downloaded into a private staging directory first,
    then each `.distcp` file only when this rank's load plan reads from it (so a rank fetches
    the files holding its shards, not the whole checkpoint); every download is checked against
    the manifest's size and sha256. Raises CheckpointError on a mismatch, a storage failure or
    any load error (on every rank: DCP gathers one rank's read error to all)."""
    from megatron.core import dist_checkpointing

    what = f"loading {ckpt.step_uri(manifest.step)}/{MEGATRON_SHARD}"
    path = ckpt.local_dir(manifest.step, MEGATRON_SHARD)
    if path is not None:
        return as_checkpoint_error(what, dist_checkpointing.load, sharded_state_dict, path)
    import tempfile

    prefix = MEGATRON_SHARD + "/"
    files = {f.path[len(prefix):]: f for f in manifest.files if f.path.startswith(prefix)}
    with tempfile.TemporaryDirectory(prefix="mcore-load-") as stage:
        ckpt.get_files(manifest.step, [f for n, f in files.items() if not _RANK_FILE.match(n)], stage)
        fetched: set[str] = set()

        def fetch(names: set[str]) -> None:
            missing = sorted(names - fetched)
            unknown = [n for n in missing if n not in files]
            if unknown:
                raise CheckpointError(f"{ckpt.step_uri(manifest.step)}: {unknown} are read but not in its manifest")
            ckpt.get_files(manifest.step, [files[n] for n in missing], stage)
            fetched.update(missing)

        with _fetch_before_read(fetch):
            return as_checkpoint_error(what, dist_checkpointing.load, sharded_state_dict,
                                       os.path.join(stage, MEGATRON_SHARD))


@contextlib.contextmanager
def _fetch_before_read(fetch):
    """Make Megatron's torch_dist loader call `fetch(relative file names)` with the files a
    read plan needs before reading them. Megatron-Core 0.16 builds its reader in
    `strategies.torch._get_filesystem_reader` (its only remote path is NVIDIA's
    multi-storage client), so that factory is swapped for the duration of one load."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_data(self, plan, planner):
            fetch({self.storage_data[item.storage_index].relative_path for item in plan.items})
            return super().read_data(plan, planner)

    original = mcore_torch._get_filesystem_reader
    mcore_torch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: Reader(checkpoint_dir)
    try:
        yield
    finally:
        mcore_torch._get_filesystem_reader = original
