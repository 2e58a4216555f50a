"""The Megatron-Core GPTModel of a rank's pipeline stage, and Hugging Face checkpoints read into
it through mbridge (llama, qwen2, qwen3: `HF_MODEL_TYPES`).

Vocabulary: Megatron needs vocab % tp == 0; the embedding is padded to a multiple of 128
(`padded_vocab_size`, independent of tp, so checkpoints reshard across TP sizes).
"""
from __future__ import annotations

import functools
import logging
import math
import os

import torch
import torch.nn.functional as F

from ftrain.config import Config

log = logging.getLogger(__name__)
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int) -> int:
    """Vocabulary rows of the Megatron embedding/output layer: vocab_size rounded up to 128."""
    return math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def have_transformer_engine() -> bool:
    """Whether Megatron-Core can build Transformer Engine's layer spec here: `transformer_engine`
    and Megatron's TE extension import (Megatron's own `HAVE_TE`). The one check of the TE path:
    everything else follows from the spec `build_gpt_model` picks by it."""
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.HAVE_TE


_FUSIONS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
            "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "persist_layer_norm")


def backend_summary(tc, spec: str, core_attention: type) -> str:
    """One line (key=value) naming the kernels a model of TransformerConfig `tc` runs on: the
    layer spec ('transformer_engine' / 'local'), the core-attention class, for SDPA the
    backends torch has enabled and those that can run this model's attention (head dim, dtype,
    causal; `torch.backends.cuda.can_use_*`, on the current CUDA device), the fusions the config
    turns on, and the Adam class Megatron's optimizer uses (TE's or Apex's fused one, else
    torch's AdamW)."""
    import torch.backends.cuda as tbc
    from megatron.core import optimizer

    parts = [f"spec={spec}", f"core_attention={core_attention.__name__}"]
    if core_attention.__name__ == "SDPAttention":
        enabled = [n for n, on in (("flash", tbc.flash_sdp_enabled()), ("mem_efficient", tbc.mem_efficient_sdp_enabled()),
                                   ("cudnn", tbc.cudnn_sdp_enabled()), ("math", tbc.math_sdp_enabled())) if on]
        parts.append(f"sdpa_enabled={','.join(enabled)}")
        if torch.cuda.is_available():
            d = tc.kv_channels
            q = torch.empty(1, tc.num_attention_heads, 128, d, dtype=tc.params_dtype, device="cuda")
            params = tbc.SDPAParams(q, q, q, None, 0.0, True, False)
            usable = [n for n, f in (("flash", tbc.can_use_flash_attention), ("mem_efficient", tbc.can_use_efficient_attention),
                                     ("cudnn", tbc.can_use_cudnn_attention)) if f(params)]
            parts.append(f"sdpa_usable={','.join(usable) or 'math only'}")
    fused = [f for f in _FUSIONS if getattr(tc, f, False)]
    parts += [f"fusions={','.join(fused) or 'none'}", f"adam={optimizer.Adam.__module__}.{optimizer.Adam.__name__}"]
    return "event=backend " + " ".join(parts)


@functools.cache
def _log_once(line: str) -> None:
    log.info("%s", line)


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
                    use_cpu_initialization: bool = False, initialize: bool = True, sdpa: bool = True):
    """This rank's pipeline stage of the Megatron-Core GPTModel, and its TransformerConfig.
    Megatron's groups must exist (`parallel_state.initialize_model_parallel(tp, pp, cp)`).

    Without `bridge`: RMSNorm, SwiGLU, RoPE, no biases, untied embeddings, the sizes of
    cfg.model, Megatron's random init (seeded CUDA RNG tracker). With `bridge` (`hf_bridge` of
    model.hf_path): the architecture of the HF config (`hf_model_args`) and this rank's TP/PP
    shard of its weights (`load_hf_weights`). Params in cfg.model.dtype on the current CUDA
    device (on CPU with `use_cpu_initialization`). Layer spec: Transformer Engine's when
    Megatron can build it (`have_transformer_engine`), else Megatron's local one with its core attention on torch's fused SDPA kernels
    (`megatron_attention.SDPAttention`; `sdpa=False`: Megatron's own, which materialises the
    scores); with cfg.parallel.cp > 1 SDPAttention gathers K/V over the CP group. Global rank 0
    logs `backend_summary` (INFO) once per process. `initialize=False`: params left uninitialised and
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
        # SwiGLU through Megatron's fused `bias_swiglu_impl` (its jit fuser; no TE / Apex needed):
        # one kernel each way instead of silu, mul and their backward.
        bias_activation_fusion=True, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, use_cpu_initialization=use_cpu_initialization,
        perform_initialization=initialize)
    te = have_transformer_engine()
    if te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=tc.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=tc.qk_layernorm)
        if sdpa:
            from ftrain.engines.megatron_attention import SDPAttention

            spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if torch.distributed.get_rank() == 0:  # each distinct line once per process
        _log_once(backend_summary(tc, "transformer_engine" if te else "local",
                                  spec.submodules.self_attention.submodules.core_attention))
    model = GPTModel(config=tc, transformer_layer_spec=spec, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope", **gpt)
    if bridge is not None and initialize:
        load_hf_weights(model, bridge, m.hf_path, ps.get_tensor_model_parallel_rank(), tp)
    return model, tc

