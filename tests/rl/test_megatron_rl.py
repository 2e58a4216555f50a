"""RL with the Megatron engine: rollouts (`megatron_ops.sample_rollouts`), the value head,
the vocabulary-parallel entropy, and the config rules.

CPU (runs in CI): two real gloo processes go through three layouts in turn, tp=1 pp=1 (each
rank alone, dp=2: the reference), tp=2 and pp=2, on a GPTModel stage built from the same
tiny HF Llama checkpoint (`build_gpt_model` with mbridge, so every layout holds the same
weights). Megatron's CUDA-only calls on that path are stubbed (`_cpu_megatron`). The sampled
completions must be token-for-token those of the reference and equal on both ranks; log-probs
and values agree within fp32 rounding (TP sums partial matmuls in another order): log-probs to
1e-5 absolute, values to 1e-4 relative (we measured 4e-5 for tp=2).

GPU (marker `gpu`): the real `MegatronEngine` with rl.enabled on 1 and 2 GPUs (generate, RL
train steps with GRPO and with GAE + KL + entropy, reset / rollback / checkpoint replays).
"""
import contextlib
import os

import pytest
import torch

from ftrain.distributed.parallel_dims import ParallelDims

from ranks import spawn_ranks

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
VOCAB, SEQ = 100, 16  # vocab 100 is padded to 128: the padded columns must never be sampled
ATOL = 1e-5         # log-probs (and values near 0), absolute
VALUES_RTOL = 1e-4  # values: O(1) sums over the hidden dim of states that differ by ~1e-6 relative


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny HF Llama (4 layers, GQA, vocab 100), random weights, fp32 safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     initializer_range=0.2, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    AutoModelForCausalLM.from_config(hf, dtype=torch.float32).save_pretrained(path)
    return path


def _cpu_megatron() -> None:
    """Stub the CUDA-only calls on Megatron's CPU forward path: the device of new buffers, the
    CUDA RNG tracker around attention dropout, the p2p synchronize, the default causal mask."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel

    class NoRngTracker:
        def fork(self, name=None):
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoRngTracker()
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _rl_cfg(path: str):
    from ftrain.config import load_config

    return load_config(None, [f"model.hf_path={path}", "model.dtype=float32", f"model.vocab_size={VOCAB}",
                              "cluster.num_workers=1", "rl.enabled=true", "rl.temperature=0.7",
                              "rl.top_p=0.9", "rl.max_new_tokens=6", f"train.seq_len={SEQ}"])


def _prompts():
    """4 right-padded prompts of lengths 3, 5, 2, 4 (int64 [4, SEQ])."""
    from ftrain.data.training_batch import TrainingBatch

    g = torch.Generator().manual_seed(7)
    ids = torch.zeros(4, SEQ, dtype=torch.long)
    for b, n in enumerate((3, 5, 2, 4)):
        ids[b, 0] = 1
        ids[b, 1:n] = torch.randint(3, VOCAB, (n - 1,), generator=g)
    mask = (torch.arange(SEQ) < torch.tensor([3, 5, 2, 4])[:, None]).long()
    return TrainingBatch(ids, mask, torch.zeros(4, SEQ), torch.zeros(4, SEQ))


def _vocab_parallel_checks(tp_rank: int, tp: int) -> dict:
    """vocab_parallel_entropy / mask_padded_vocab on this rank's shard of hand-made logits
    against the full-vocabulary reference (values and gradients); errors by name."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from ftrain.engines.megatron_model import padded_vocab_size
    from ftrain.engines.megatron_ops import mask_padded_vocab, vocab_parallel_entropy
    from ftrain.objectives.ppo import token_entropy, token_log_probs

    full = torch.randn(3, 7, padded_vocab_size(VOCAB), generator=torch.Generator().manual_seed(3)) * 3
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
    shard = full.chunk(tp, dim=-1)[tp_rank].clone().requires_grad_(True)
    ref_full = full.clone().requires_grad_(True)
    ent = vocab_parallel_entropy(shard)
    ref = token_entropy(ref_full)
    ent.sum().backward()
    ref.sum().backward()
    out = {"entropy": (ent - ref).abs().max().item(),
           "entropy_grad": (shard.grad - ref_full.grad.chunk(tp, dim=-1)[tp_rank]).abs().max().item()}
    # padded columns masked: entropy and log-probs of the distribution over the real vocabulary
    masked = mask_padded_vocab(full.chunk(tp, dim=-1)[tp_rank], VOCAB)
    real = full[..., :VOCAB]
    out["masked_entropy"] = (vocab_parallel_entropy(masked) - token_entropy(real)).abs().max().item()
    lp = torch.nn.functional.pad(-vocab_parallel_cross_entropy(masked.clone(), torch.nn.functional.pad(ids[:, 1:], (0, 1)))[:, :-1], (1, 0))
    out["masked_log_probs"] = (lp - token_log_probs(real, ids)).abs().max().item()
    return out


def _engine_loss_checks(cfg, tp_rank: int, tp: int) -> dict:
    """`MegatronEngine._loss` (GAE value loss, k3 KL, entropy, temperature, padded vocabulary
    masked) on this rank's shard of hand-made logits against the same terms computed by `ppo`
    on the full real-vocabulary logits, as `TorchEngine._loss` does: loss, metrics and the
    gradient of the logits shard. The engine object gets only what `_loss` reads (no CUDA)."""
    import dataclasses
    import types

    from ftrain.data.training_batch import TrainingBatch
    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.engines.megatron_model import padded_vocab_size
    from ftrain.objectives.ppo import aggregate, kl_penalty, policy_loss, token_entropy, token_log_probs, value_loss

    r = dataclasses.replace(cfg.rl, advantage="gae", kl_coef=0.1, entropy_coef=0.01)
    p = cfg.ppo
    g = torch.Generator().manual_seed(11)
    B, S = 3, 7
    full = torch.randn(B, S, padded_vocab_size(VOCAB), generator=g) * 2
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    mask[:, 0] = 0
    rnd = [torch.randn(B, S, generator=g) for _ in range(5)]
    mb = TrainingBatch(ids, torch.ones_like(ids), mask, rnd[0], old_log_probs=-rnd[1].abs() - 3,
                       returns=rnd[2], old_values=rnd[3], ref_log_probs=-rnd[4].abs() - 3)
    values = torch.randn(B, S, generator=g)
    e = MegatronEngine.__new__(MegatronEngine)
    e.cfg, e.rl, e.dims, e.device = dataclasses.replace(cfg, rl=r), r, types.SimpleNamespace(cp=1), torch.device("cpu")

    shard = full.chunk(tp, dim=-1)[tp_rank].clone().requires_grad_(True)
    v = values.clone().requires_grad_(True)
    loss, metrics = e._loss(mb, v, False, shard)
    loss.backward()
    behaviour = e._loss(mb, None, True, full.chunk(tp, dim=-1)[tp_rank].clone())[1]["log_probs"]

    ref_full, ref_v = full.clone().requires_grad_(True), values.clone().requires_grad_(True)
    logits = ref_full[..., :VOCAB] / r.temperature
    lp = token_log_probs(logits, ids)
    ref, _ = policy_loss(lp, mb.old_log_probs, mb.advantages, mask, p.eps_clip_low, p.eps_clip_high,
                         p.clip_ratio_c, p.loss_agg_mode)
    terms = {"pg_loss": ref.item(),
             "vf_loss": value_loss(ref_v, mb.old_values, mb.returns, mask, r.value_clip, p.loss_agg_mode),
             "kl": aggregate(kl_penalty(lp, mb.ref_log_probs, r.kl_estimator), mask, p.loss_agg_mode),
             "entropy": aggregate(token_entropy(logits), mask, p.loss_agg_mode)}
    ref = ref + r.value_coef * terms["vf_loss"] + r.kl_coef * terms["kl"] - r.entropy_coef * terms["entropy"]
    ref.backward()
    out = {"loss": abs(loss.item() - ref.item()),
           "grad": (shard.grad - ref_full.grad.chunk(tp, dim=-1)[tp_rank]).abs().max().item(),
           "value_grad": (v.grad - ref_v.grad).abs().max().item(),
           "behaviour_log_probs": (behaviour - lp).abs().max().item()}
    out.update({k: abs(metrics[k] - float(t)) for k, t in terms.items()})
    return out


def _layout_run(cfg, tp: int, pp: int, head_seed: int) -> dict:
    """Build the model stage of this rank for (tp, pp), sample the prompts, return the rollout
    (and, tp=pp=1, reference checks of log-probs and value alignment)."""
    from megatron.core import parallel_state as ps

    from ftrain.engines.megatron_model import build_gpt_model, hf_bridge
    from ftrain.engines.megatron_ops import add_value_head, sample_rollouts, token_values
    from ftrain.objectives.ppo import token_log_probs
    from ftrain.rl.rollouts import EOS_ID, PAD_ID, row_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    model, _ = build_gpt_model(cfg, tp, pp, 1, hf_bridge(cfg.model.hf_path), use_cpu_initialization=True)
    if ps.is_pipeline_last_stage():
        add_value_head(model)
        with torch.no_grad():  # non-zero, the same in every layout (replicated over TP)
            g = torch.Generator().manual_seed(head_seed)
            model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=g))
            model.value_head.bias.fill_(0.5)
    rounds = []
    prompts = _prompts()
    out = sample_rollouts(model, prompts, [row_seed(1234, 1, row) for row in range(4)], cfg.rl, VOCAB,
                          with_values=True, stop_ids=(EOS_ID,), pad_id=PAD_ID, on_round=lambda: rounds.append(1))
    out["rounds"] = len(rounds)
    out["vocab_parallel"] = _vocab_parallel_checks(ps.get_tensor_model_parallel_rank(), tp)
    out["engine_loss"] = _engine_loss_checks(cfg, ps.get_tensor_model_parallel_rank(), tp)
    if tp == pp == 1:
        ids = out["input_ids"]
        with torch.no_grad():
            logits = model(ids, torch.arange(SEQ).expand_as(ids), None)
            values = token_values(model)
        lp = token_log_probs(logits[..., :VOCAB] / cfg.rl.temperature, ids) * out["loss_mask"]
        out["log_probs_vs_model"] = (lp - out["log_probs"]).abs().max().item()
        out["values_vs_forward"] = (values - out["values"]).abs().max().item()
        # the hooked hidden states are the output layer's input, and values[:, t] = V(prefix < t)
        with torch.no_grad():
            model(ids, torch.arange(SEQ).expand_as(ids), None)
            hidden = model.__dict__["_final_hidden"]
            relogits = model.output_layer(hidden)[0].transpose(0, 1)
            head = model.value_head(hidden.transpose(0, 1)).squeeze(-1)  # [B, S]
        out["hidden_is_output_input"] = torch.equal(relogits, logits)
        out["value_alignment"] = (token_values(model) - torch.nn.functional.pad(head[:, :-1], (1, 0))).abs().max().item()
        out["value_head_in_checkpoint"] = {"value_head.weight", "value_head.bias"} <= set(model.sharded_state_dict())
    return out


def _rl_worker(rank: int, world: int, store, path: str) -> dict:
    import torch.distributed as dist

    _cpu_megatron()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cfg = _rl_cfg(path)
    res = {f"tp{tp}_pp{pp}": _layout_run(cfg, tp, pp, head_seed=5) for tp, pp in ((1, 1), (2, 1), (1, 2))}
    dist.destroy_process_group()
    # numpy arrays travel by value (torch tensors by a file descriptor this process must outlive)
    return torch.utils._pytree.tree_map(lambda x: x.numpy() if isinstance(x, torch.Tensor) else x, res)


def test_rollouts_tp2_pp2_match_tp1_cpu(hf_dir):
    """tp=2 and pp=2 sample exactly the tokens of tp=1 pp=1 (same weights, same row seeds),
    with the same log-probs and values (fp32 rounding, see the module docstring), on every rank; the reference's log-probs
    are those of the model over the real vocabulary at rl.temperature; the padded vocabulary
    is never sampled; the vocabulary-parallel entropy and the engine's RL loss (all terms, and
    its gradient) equal the full-vocabulary ones."""
    results = torch.utils._pytree.tree_map(lambda x: torch.from_numpy(x) if hasattr(x, "dtype") else x,
                                           spawn_ranks(_rl_worker, 2, hf_dir, timeout_s=300))
    ref = results[0]["tp1_pp1"]
    prompts = _prompts()
    assert ref["loss_mask"].sum() > 4 and (ref["input_ids"] < VOCAB).all()
    assert torch.equal(ref["input_ids"][prompts.attention_mask.bool()], prompts.input_ids[prompts.attention_mask.bool()])
    assert ref["rounds"] >= 1 and ref["values"].abs().sum() > 0
    assert ref["log_probs_vs_model"] < ATOL and ref["values_vs_forward"] < ATOL
    assert ref["hidden_is_output_input"] and ref["value_alignment"] < ATOL and ref["value_head_in_checkpoint"]
    for rank, res in enumerate(results):
        for layout, out in res.items():
            where = f"rank {rank} {layout}"
            for k in ("input_ids", "attention_mask", "loss_mask"):
                assert torch.equal(out[k], ref[k]), (where, k, out[k], ref[k])
            assert out["rounds"] == ref["rounds"], where
            torch.testing.assert_close(out["log_probs"], ref["log_probs"], rtol=0, atol=ATOL, msg=where)
            torch.testing.assert_close(out["values"], ref["values"], rtol=VALUES_RTOL, atol=ATOL, msg=lambda m: where + m)
            assert max(out["vocab_parallel"].values()) < ATOL, (where, out["vocab_parallel"])
            assert max(out["engine_loss"].values()) < ATOL, (where, out["engine_loss"])


def test_config_accepts_rl_with_megatron_and_tp():
    from ftrain.config import load_config

    cfg = load_config(None, ["rl.enabled=true", "model.engine=megatron", "cluster.num_workers=2", "parallel.tp=2"])
    assert cfg.rl.enabled and cfg.model.engine == "megatron" and cfg.parallel.tp == 2


# -- GPU: the real MegatronEngine with rl.enabled (not run in CI) ---------------------------------
def _gpu_rl_scenarios(rank: int, world: int, store, tmp: str, layouts: list) -> dict:
    """Per layout (tp, pp) and RL setting (GRPO; GAE with KL and entropy): generate on every
    rank (equal within a replica), RL train steps 1 and 2 (as Trainer.experience + train_step),
    checkpoint at step 1; rollback to step 1 and checkpoint load both replay step 2 bitwise
    (same rollout, loss, grad norm); reset returns to the initial state. Returns flags / numbers."""
    import torch.distributed as dist
    from test_megatron_engine import _cfg, _digest, _join, _save

    from checkpoint import CheckpointManager
    from dispatch import MeshDispatch
    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.rl.rollouts import Rollouts

    out, gen = {}, 0
    settings = {"grpo": ["rl.advantage=grpo"],
                "gae_kl_entropy": ["rl.advantage=gae", "rl.kl_coef=0.05", "rl.entropy_coef=0.01"]}
    for tp, pp in layouts:
        for name, extra in settings.items():
            key = f"tp{tp}_pp{pp}_{name}"
            cfg = _cfg(tp, pp, world, dist_opt=False, extra=["rl.enabled=true", "rl.group_size=4", *extra])
            dims = ParallelDims.from_config(cfg)
            e = MegatronEngine(cfg)
            gen += 1
            _join(e, store, gen, rank, dims)
            initial = _digest(e)
            rollouts = Rollouts(cfg)
            ckpt = CheckpointManager(os.path.join(tmp, key))

            def experience(step):
                prompts = rollouts.prompts(step)
                mine = MeshDispatch.split(dims, (rollouts.prompt_batch(prompts),), {})[rank][0][0]
                d = dims.coords(rank).dp
                part = e.generate(mine, step, list(range(d, d + len(mine) * dims.dp, dims.dp)),
                                  rollouts.task.stop_ids, rollouts.task.pad_id)
                everyone = [None] * world
                dist.all_gather_object(everyone, part)
                same = all(torch.equal(everyone[r]["input_ids"], part["input_ids"]) for r in range(world)
                           if dims.coords(r).dp == d)
                batch, stats = rollouts.experience(step, prompts, MeshDispatch.collect(dims, everyone))
                return MeshDispatch.split(dims, (batch,), {})[rank][0][0], part, same

            e.snapshot()
            b1, part1, out[key + "_replica_equal"] = experience(1)
            out[key + "_values"] = (part1["values"] is not None) == (name != "grpo")
            r1 = e.train_step(b1, 1)
            _save(e, ckpt, 1, dims, rank)
            step1 = _digest(e)
            e.snapshot()
            b2, part2, _ = experience(2)
            r2 = e.train_step(b2, 2)
            last = rank == world - 1 if pp > 1 else True
            keys = {"pg_loss"} | ({"vf_loss", "kl", "entropy"} if name != "grpo" else set())
            out[key + "_metrics"] = (not last) or (keys <= set(r1) and all(r1[k] == r1[k] for k in keys))
            out[key + "_samples"] = e.rollout["samples"] == 2 * cfg.train.global_batch_size
            out[key + "_rollback"] = e.rollback(1) and _digest(e) == step1 and e.rollout["samples"] == 8
            e.snapshot()
            r2b = e.train_step(b2, 2)
            out[key + "_replay"] = (r2b["loss"] == r2["loss"] or not last) and r2b["grad_norm"] == r2["grad_norm"]
            e.load_checkpoint(ckpt, ckpt.latest_verified(), rank)
            out[key + "_load"] = _digest(e) == step1 and e.rollout["samples"] == 8
            e.snapshot()
            b2c, part2c, _ = experience(2)
            out[key + "_regenerate"] = torch.equal(part2c["input_ids"], part2["input_ids"])
            r2c = e.train_step(b2c, 2)
            out[key + "_replay_load"] = (r2c["loss"] == r2["loss"] or not last) and r2c["grad_norm"] == r2["grad_norm"]
            out[key + "_reset"] = e.reset() and _digest(e) == initial and e.rollout["samples"] == 0
            del e
            dist.barrier()
    return out


def _check_gpu(results: list[dict]) -> None:
    failures = [f"rank {r} {k}" for r, res in enumerate(results) for k, ok in res.items() if not ok]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_rl_engine_one_gpu(tmp_path):
    (res,) = spawn_ranks(_gpu_rl_scenarios, 1, str(tmp_path), [(1, 1)], timeout_s=900)
    assert len(res) == 2 * 10, res
    _check_gpu([res])


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 2, reason="needs 2 CUDA GPUs")
def test_rl_engine_two_gpus(tmp_path):
    """dp=2, tp=2 and pp=2 on two GPUs."""
    results = spawn_ranks(_gpu_rl_scenarios, 2, str(tmp_path), [(1, 1), (2, 1), (1, 2)], timeout_s=900)
    assert all(len(res) == 3 * 2 * 10 for res in results)
    _check_gpu(results)
