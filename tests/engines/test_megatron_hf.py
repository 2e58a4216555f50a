"""Hugging Face checkpoints in the Megatron engine (`model.hf_path`, converted by mbridge).

Tiny randomly initialised HF models (Llama with GQA and llama3 RoPE scaling, Qwen2 with q/k/v
bias and tied embeddings, Qwen3 with q/k RMSNorm and a head dim that is not hidden / heads)
are saved to a temp dir, loaded into our Megatron GPTModel and their logits compared with the
HF model's. Nothing is downloaded.

CPU (runs in CI): `megatron_model.build_gpt_model` on a one-rank gloo group, local layer
spec, CPU params; Megatron's two CUDA-only calls on that path (the RoPE buffer's move to
`torch.cuda.current_device()`, the CUDA RNG tracker around attention dropout) are stubbed, and
the causal mask is passed explicitly (Megatron's default one is made on "cuda"). fp32 logits
match to 1e-5 (they are bitwise equal on this machine).

GPU (marker `gpu`): the real `MegatronEngine` (bf16, DDP, distributed optimizer) in one
process per GPU, as tests/test_megatron_engine.py drives it: tp=1 on one GPU; tp=2 and pp=2 on
two. Logits and the engine's token log-probs are compared with the HF model's under the bf16
rule of `_bf16_close`.
"""
import contextlib
import os

import pytest
import torch

from ftrain.distributed.parallel_dims import ParallelDims

from ranks import spawn_ranks

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
SEQ = 32


def _hf_configs(vocab_qwen2: int = 200) -> dict:
    """Tiny HF configs, one per supported family (initializer_range 0.1: attention far from
    uniform, so RoPE and q/k mistakes show in the logits)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-6,
                  initializer_range=0.1)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return {
        # untied, GQA (2 query groups), Llama 3.1 RoPE scaling
        "llama": LlamaConfig(vocab_size=256, tie_word_embeddings=False, rope_parameters=llama3, **common),
        # tied embeddings, q/k/v bias; vocab 200 is padded to 256 (zero rows)
        "qwen2": Qwen2Config(vocab_size=vocab_qwen2, tie_word_embeddings=True, **common),
        # q/k RMSNorm, head_dim 48 != 128 / 4, untied (loaded after the tied qwen2: mbridge's
        # class-level tied-weights table must not leak into it)
        "qwen3": Qwen3Config(vocab_size=256, head_dim=48, tie_word_embeddings=False, **common),
    }


def _save_hf(root, name: str, hf_config, seed: int = 0) -> str:
    """Save a randomly initialised HF model of `hf_config` (fp32 safetensors) to root/name."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # HF inits norm weights to 1 and biases to 0: make their loading visible
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in pname else 0.0, 0.2)
    path = os.path.join(str(root), name)
    model.save_pretrained(path)
    return path


def _hf_logits(path: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF model logits [B, S, V] (float32) of `ids` [B, S] with params in `dtype`, on ids' device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype)
    with torch.no_grad():
        return model.to(ids.device)(ids).logits.float()


def _bf16_close(ours: torch.Tensor, hf_bf16: torch.Tensor, hf_fp32: torch.Tensor) -> tuple[bool, str]:
    """bf16 tolerance, calibrated by HF itself: our bf16 values may be at most 3x as far (max
    abs error) from the fp32 HF reference as the HF model run in bf16 is, plus 1% of the
    largest reference value.

    Why: bf16 keeps 8 significant bits, so every matmul, norm and softmax rounds at ~0.4%,
    and the rounding compounds over the layers into an error whose size depends on the model
    (here about 3% of the largest logit); two correct bf16 implementations that order their
    operations differently land at similar distances from the fp32 values (on CPU we measured
    0.8x-1.25x HF's own bf16 error). A conversion mistake (q/k/v interleave, gate/up order,
    bias, norm, RoPE, shard) moves the logits by about their own size, far outside this bar."""
    err = (ours - hf_fp32).abs().max().item()
    err_hf = (hf_bf16 - hf_fp32).abs().max().item()
    bar = 3 * err_hf + 0.01 * hf_fp32.abs().max().item()
    return err <= bar, f"max |ours - hf_fp32| = {err:.4g}, bar {bar:.4g} (hf bf16 error {err_hf:.4g})"


# -- CPU: build_gpt_model + load_hf_weights on one gloo rank --------------------------------------
@pytest.fixture(scope="module")
def megatron_cpu():
    """Megatron's model-parallel state for one CPU rank (gloo, tp = pp = 1), with the CUDA
    calls of the forward path stubbed for CPU. Yields `parallel_state`."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    import megatron.core.tensor_parallel as tensor_parallel
    from megatron.core import parallel_state as ps

    class NoRngTracker:
        def fork(self, name=None):
            return contextlib.nullcontext()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        mp.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: NoRngTracker())
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        try:
            yield ps
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def _cpu_cfg(path: str, dtype: str):
    from ftrain.config import load_config

    return load_config(None, [f"model.hf_path={path}", f"model.dtype={dtype}", "model.vocab_size=128",
                              "cluster.num_workers=1"])


def _megatron_cpu_logits(path: str, dtype: str, ids: torch.Tensor):
    """(logits float32 [B, S, V_pad] of our GPTModel built from `path`, the model)."""
    from ftrain.engines.megatron_model import build_gpt_model, hf_bridge

    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model, _ = build_gpt_model(_cpu_cfg(path, dtype), 1, 1, 1, hf_bridge(path, torch_dtype),
                               use_cpu_initialization=True)
    s = ids.shape[1]
    pos = torch.arange(s).expand_as(ids)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return model(ids, pos, causal).float(), model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: _save_hf(root, name, c) for name, c in _hf_configs().items()}


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_hf_logits_match_fp32_cpu(megatron_cpu, hf_dirs, name):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(hf_dirs[name]).vocab_size
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ours, model = _megatron_cpu_logits(hf_dirs[name], "float32", ids)
    ref = _hf_logits(hf_dirs[name], ids, torch.float32)
    assert ours.shape == (2, SEQ, 256)
    torch.testing.assert_close(ours[..., :vocab], ref, rtol=1e-5, atol=1e-5)
    assert torch.all(ours[..., vocab:] == 0)  # padded vocabulary rows are zero
    names = {n for n, _ in model.named_parameters()}
    assert ("output_layer.weight" in names) == (name != "qwen2")  # tied: no output weight of its own
    assert any("q_layernorm" in n for n in names) == (name == "qwen3")
    assert any(n.endswith("linear_qkv.bias") for n in names) == (name == "qwen2")
    # TP-sharded weights carry Megatron's attributes (grad norm, optimizer rely on them)
    assert all(getattr(p, "tensor_model_parallel", False) for n, p in model.named_parameters()
               if n.endswith(("linear_qkv.weight", "linear_fc2.weight", "word_embeddings.weight")))


def test_sdpa_attention_equals_megatrons_on_cpu(megatron_cpu, hf_dirs):
    """`SDPAttention` (the local spec's core attention here) against Megatron's own
    `DotProductAttention`, the same weights, fp32: logits and the gradient of every parameter
    within fp32 tolerance; SDPA both with the causal mask type alone (the kernel's causal mode)
    and with an explicit mask tensor (Megatron's own needs that one on CPU); GQA (2 query
    groups of 4 heads) and a head dim of 48 (qwen3)."""
    from ftrain.engines.megatron_attention import SDPAttention
    from ftrain.engines.megatron_model import build_gpt_model, hf_bridge

    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(SEQ).expand_as(ids)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    for name in ("llama", "qwen3"):
        path = hf_dirs[name]
        out = []
        for sdpa, m in ((False, mask), (True, mask), (True, None)):
            model, _ = build_gpt_model(_cpu_cfg(path, "float32"), 1, 1, 1, hf_bridge(path, torch.float32),
                                       use_cpu_initialization=True, sdpa=sdpa)
            assert any(isinstance(x, SDPAttention) for x in model.modules()) == sdpa
            logits = model(ids, pos, m).float()
            logits.square().mean().backward()
            out.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
        for logits, grads in out[1:]:
            torch.testing.assert_close(logits, out[0][0], rtol=1e-5, atol=1e-5)
            for a, b in zip(grads, out[0][1], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_hf_logits_bf16_rule_cpu(megatron_cpu, hf_dirs):
    """The bf16 rule the GPU test applies holds on CPU too (bf16 params, CPU kernels)."""
    ids = torch.randint(0, 256, (4, SEQ), generator=torch.Generator().manual_seed(2))
    ours, _ = _megatron_cpu_logits(hf_dirs["llama"], "bfloat16", ids)
    ok, msg = _bf16_close(ours[..., :256], _hf_logits(hf_dirs["llama"], ids, torch.bfloat16),
                          _hf_logits(hf_dirs["llama"], ids, torch.float32))
    assert ok, msg


def test_unsupported_hf_models_name_the_field(tmp_path):
    """Unsupported checkpoints fail with a ValueError naming model.hf_path (config only)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from ftrain.engines.megatron_model import hf_bridge, hf_model_args

    def saved(name, c):
        c.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128)
    with pytest.raises(ValueError, match=r"model.hf_path=.*no config.json"):
        hf_bridge(str(tmp_path))
    with pytest.raises(ValueError, match=r"model.hf_path=.*'mistral'.*supported model_types: llama, qwen2, qwen3"):
        hf_bridge(saved("mistral", MistralConfig(**small)))
    with pytest.raises(ValueError, match=r"model.hf_path=.*attention_bias=True"):
        hf_bridge(saved("llama_bias", LlamaConfig(attention_bias=True, **small)))
    with pytest.raises(ValueError, match=r"model.hf_path=.*use_sliding_window=True"):
        hf_bridge(saved("qwen2_swa", Qwen2Config(use_sliding_window=True, **small)))
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match=r"model.hf_path=.*rope scaling"):
        hf_bridge(saved("llama_yarn", LlamaConfig(rope_parameters=yarn, max_position_embeddings=128, **small)))
    path = saved("llama", LlamaConfig(**small))
    bridge = hf_bridge(path)
    arch, gpt = hf_model_args(bridge, path, tp=2, pp=2)
    assert (arch["num_layers"], arch["num_query_groups"], arch["kv_channels"], gpt["vocab_size"]) == (2, 2, 16, 128)
    with pytest.raises(ValueError, match=r"model.hf_path=.*4 attention heads are not divisible by parallel.tp=8"):
        hf_model_args(bridge, path, tp=8, pp=1)
    with pytest.raises(ValueError, match=r"model.hf_path=.*2 layers are not divisible by parallel.pp=4"):
        hf_model_args(bridge, path, tp=1, pp=4)


def test_config_checks_hf_path(tmp_path):
    from transformers import LlamaConfig

    from ftrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="^model.hf_path: .*no config.json"):
        load_config(None, [f"model.hf_path={tmp_path}"])
    LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="^model.vocab_size: 128 is larger than the 100 tokens"):
        load_config(None, [f"model.hf_path={tmp_path}"])
    assert load_config(None, [f"model.hf_path={tmp_path}", "model.vocab_size=100"]).model.hf_path == str(tmp_path)


def _cpu_tp_worker(rank: int, world: int, store, dirs: dict) -> dict:
    """One gloo rank of a tp=`world` CPU run: max |logits - HF fp32| per model (logits
    gathered over TP)."""
    import megatron.core.tensor_parallel as tensor_parallel
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    class NoRngTracker:
        def fork(self, name=None):
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoRngTracker()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ps.initialize_model_parallel(world, 1, create_gloo_process_groups=False)
    from transformers import AutoConfig

    from ftrain.engines.megatron_model import build_gpt_model, hf_bridge

    errors = {}
    for name, path in dirs.items():
        model, _ = build_gpt_model(_cpu_cfg(path, "float32"), world, 1, 1, hf_bridge(path),
                                   use_cpu_initialization=True)
        vocab = AutoConfig.from_pretrained(path).vocab_size
        ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        with torch.no_grad():
            local = model(ids, torch.arange(SEQ).expand_as(ids), causal).float().contiguous()
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
        ours = torch.cat(parts, dim=-1)[..., :vocab]
        errors[name] = (ours - _hf_logits(path, ids, torch.float32)).abs().max().item()
    return errors


@pytest.mark.slow
def test_hf_logits_match_fp32_cpu_tp2(hf_dirs):
    """tp=2 over two gloo processes: each rank loads its shard (q/k/v by query group, gate/up,
    vocabulary rows, row-parallel columns); gathered logits match HF in fp32."""
    for rank, errors in enumerate(spawn_ranks(_cpu_tp_worker, 2, hf_dirs, timeout_s=300)):
        assert max(errors.values()) < 1e-4, (rank, errors)


# -- GPU: the real MegatronEngine (bf16) ------------------------------------------------------------
def _engine_cfg(path: str, tp: int, pp: int, world: int):
    from ftrain.config import load_config, resolve

    sets = [f"model.hf_path={path}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"cluster.num_workers={world}",
            "model.vocab_size=200", f"train.seq_len={SEQ}", "train.global_batch_size=8",
            "train.mini_batch_size=4", "train.micro_batch_size=1", "train.steps=2"]
    return resolve(load_config(None, sets), num_gpus=1)


def _engine_logits(e, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits float32 [B, S, V_pad] through the engine's wrapped model (DDP,
    Float16Module), gathered over the TP group (pp = 1 only)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        local = e.ddp(ids, pos, None).float().contiguous()
    parts = [torch.empty_like(local) for _ in range(e.dims.tp)]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _engine_log_probs(e, batch):
    """The engine's token log-probs [B, S] (position 0 is 0) through the pipeline schedule, on
    the last stage; None elsewhere."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        out = e._run(batch.to(e.device).chunk(len(batch)), forward_only=True)
    return torch.cat([o["log_probs"] for o in out]).float() if ps.is_pipeline_last_stage() else None


def _hf_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Token log-probs [B, S] (position 0 is 0) from HF logits [B, S, V], with the softmax
    over the engine's padded vocabulary: the padded rows are zero, so their logits are 0 and
    take part in the engine's softmax (see megatron_engine's module docstring)."""
    from ftrain.engines.megatron_model import padded_vocab_size

    v = logits.shape[-1]
    logits = torch.nn.functional.pad(logits.float(), (0, padded_vocab_size(v) - v))
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def _gpu_scenarios(rank: int, world: int, store, dirs: dict, layouts: list) -> dict:
    """For each layout (tp, pp) and HF model: engine built from hf_path; logits (pp = 1) and
    log-probs against HF in bf16 / fp32; a train step; reset returns to the HF weights; a
    second engine (a spare joining later) builds the same state. Returns messages / flags."""
    import torch.distributed as dist
    from test_megatron_engine import _batch, _digest, _join

    from ftrain.engines.megatron_engine import MegatronEngine

    out, gen = {}, 0
    for tp, pp in layouts:
        for name, path in dirs.items():
            key = f"tp{tp}_pp{pp}_{name}"
            cfg = _engine_cfg(path, tp, pp, world)
            e = MegatronEngine(cfg)
            gen += 1
            _join(e, store, gen, rank, ParallelDims.from_config(cfg))
            initial = _digest(e)
            batch = _batch(cfg, 1, ParallelDims.from_config(cfg), rank)  # dp = 1: the whole batch
            ids = batch.input_ids.to(e.device)
            ref32 = _hf_logits(path, ids, torch.float32)
            ref16 = _hf_logits(path, ids, torch.bfloat16)
            vocab = ref32.shape[-1]
            if pp == 1:
                logits = _engine_logits(e, ids)
                out[key + "_logits"] = _bf16_close(logits[..., :vocab], ref16, ref32)
            lp = _engine_log_probs(e, batch)
            if lp is not None:
                out[key + "_log_probs"] = _bf16_close(lp, _hf_log_probs(ref16, ids), _hf_log_probs(ref32, ids))
            e.snapshot()
            res = e.train_step(batch, 1)
            out[key + "_train_finite"] = bool(torch.isfinite(torch.tensor([res["grad_norm"]])).all()) and \
                (res["loss"] == res["loss"] or pp > 1 and rank != world - 1)
            e.reset()
            out[key + "_reset_is_hf"] = _digest(e) == initial
            del e
            e = MegatronEngine(cfg)  # a spare that joins later
            gen += 1
            _join(e, store, gen, rank, ParallelDims.from_config(cfg))
            out[key + "_spare_same"] = _digest(e) == initial
            del e
            dist.barrier()
    return out


def _spawn_gpu(world: int, dirs: dict, layouts: list) -> list[dict]:
    return spawn_ranks(_gpu_scenarios, world, dirs, layouts, timeout_s=900)


def _check_gpu(results: list[dict]) -> None:
    failures = []
    for rank, res in enumerate(results):
        for key, value in res.items():
            ok, msg = value if isinstance(value, tuple) else (value, "")
            if not ok:
                failures.append(f"rank {rank} {key}: {msg or 'False'}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_hf_engine_one_gpu(tmp_path):
    dirs = {name: _save_hf(tmp_path, name, c) for name, c in _hf_configs().items()}
    (res,) = _spawn_gpu(1, dirs, [(1, 1)])
    assert len(res) == 3 * 5, res  # logits, log_probs, train, reset, spare per model
    _check_gpu([res])


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 2, reason="needs 2 CUDA GPUs")
def test_hf_engine_two_gpus_tp2_pp2(tmp_path):
    dirs = {name: _save_hf(tmp_path, name, c) for name, c in _hf_configs().items()}
    results = _spawn_gpu(2, dirs, [(2, 1), (1, 2)])
    assert all(f"tp2_pp1_{n}_logits" in r for r in results for n in dirs)
    assert all(f"tp1_pp2_{n}_log_probs" in results[1] for n in dirs)  # the last stage
    _check_gpu(results)


def test_backend_summary_names_the_kernels():
    """The start-up line `build_gpt_model` logs on rank 0: spec, core attention, the SDPA
    backends torch has enabled (this process's settings), the fusions on, the Adam in use."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from ftrain.engines.megatron_attention import SDPAttention
    from ftrain.engines.megatron_model import backend_summary, have_transformer_engine

    tc = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bias_activation_fusion=True)
    line = backend_summary(tc, "local", SDPAttention)
    assert line.startswith("event=backend spec=local core_attention=SDPAttention sdpa_enabled=")
    assert "fusions=bias_activation_fusion " in line
    assert ("adam=torch.optim.adamw.AdamW" in line) == (not have_transformer_engine())
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]):  # what torch reports, not a fixed list
        assert "flash" not in backend_summary(tc, "local", SDPAttention).split("sdpa_enabled=")[1].split()[0]
    assert "sdpa" not in backend_summary(tc, "local", DotProductAttention)
