"""Context parallelism without Transformer Engine (`megatron_attention`): Megatron-Core's
`SDPAttention` with context_parallel_size > 1 on real gloo process groups, against the same
attention over the whole sequence on one rank, fp32: cp = 2 (2 processes) and tp = 2 x cp = 2
(4 processes, heads split over TP, ranks laid out tp fastest as Megatron lays them), grouped
query attention (4 heads, 2 key/value groups); outputs and the gradients of query, key and value
of each rank's load-balanced chunks (r and 2cp-1-r); and the whole GPTModel (SDPAttention,
Megatron's rotary embedding of each rank's chunks) at cp = 2 against cp = 1 on CPU, logits and
parameter gradients. The whole engine at cp = 2 on two GPUs: the `gpu` test at the end."""
import contextlib

import pytest
import torch

from ranks import spawn_ranks

S, B, HEADS, GROUPS, D = 16, 2, 4, 2, 8  # sequence, batch, heads, key/value groups, head dim


def _cp_chunks(x: torch.Tensor, cp: int, r: int) -> torch.Tensor:
    """Chunks r and 2cp-1-r of 2cp along dim 0 (the sequence, Megatron's layout)."""
    c = x.chunk(2 * cp, dim=0)
    return torch.cat([c[r], c[2 * cp - 1 - r]])


def _worker(rank: int, world: int, store, tp: int) -> dict:
    """One rank: its TP shard of the heads, its CP chunks of the sequence; max abs errors of the
    CP output and gradients against full-sequence causal SDPA of the same heads."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from ftrain.engines.megatron_attention import SDPAttention

    torch.cuda.current_device = lambda: "cpu"  # Megatron's gather allocates on the current device
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cp = world // tp
    tp_rank, cp_rank = rank % tp, rank // tp
    groups = {}  # every rank creates every group, in the same order
    for t in range(tp):
        groups["cp", t] = dist.new_group([t + tp * c for c in range(cp)])
    for c in range(cp):
        groups["tp", c] = dist.new_group([t + tp * c for t in range(tp)])
    pgs = ProcessGroupCollection(tp=groups["tp", cp_rank], cp=groups["cp", tp_rank])
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, tensor_model_parallel_size=tp, context_parallel_size=cp,
                               attention_dropout=0.0, use_cpu_initialization=True)
    attn = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        pg_collection=pgs)
    assert attn.cp_group is not None and attn.uses_sdpa

    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q, w = (torch.randn(S, B, HEADS, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(S, B, GROUPS, D, generator=gen) for _ in range(2))
    h, g = HEADS // tp, GROUPS // tp  # this TP rank's heads and groups
    q, w = q[:, :, tp_rank * h:(tp_rank + 1) * h], w[:, :, tp_rank * h:(tp_rank + 1) * h]
    k, v = k[:, :, tp_rank * g:(tp_rank + 1) * g], v[:, :, tp_rank * g:(tp_rank + 1) * g]

    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.permute(1, 2, 0, 3) for x in full), is_causal=True, enable_gqa=True).permute(2, 0, 1, 3)
    (ref * w).sum().backward()

    local = [_cp_chunks(x, cp, cp_rank).requires_grad_() for x in (q, k, v)]
    out = attn(*local, None)                                   # [s, b, h * d]
    (out * _cp_chunks(w, cp, cp_rank).reshape(out.shape)).sum().backward()  # sums to the full loss over CP

    errors = {"out": (out - _cp_chunks(ref, cp, cp_rank).reshape(out.shape)).abs().max().item()}
    for name, a, b in zip("qkv", local, full, strict=True):
        errors[f"grad_{name}"] = (a.grad - _cp_chunks(b.grad, cp, cp_rank)).abs().max().item()
    errors["scale"] = max(x.grad.abs().max().item() for x in full)
    dist.destroy_process_group()
    return errors


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)], ids=["cp2", "tp2_cp2"])
def test_context_parallel_attention_equals_full_sequence(world, tp):
    for rank, errors in enumerate(spawn_ranks(_worker, world, tp, timeout_s=240)):
        assert errors["scale"] > 0.1, errors  # the gradients are not trivially zero
        assert max(v for k, v in errors.items() if k != "scale") < 1e-5, (rank, errors)


def _model_worker(rank: int, world: int, store) -> dict:
    """GPTModel of config.yaml's shape (fp32, CPU) at cp = 1 and cp = `world`: max abs errors of
    this rank's logits, and the largest error of a parameter's gradient (summed over the CP
    group, as Megatron's DDP reduces them over dp x cp) relative to its largest entry, of the
    loss sum(logits * w)."""
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.tensor_parallel as tensor_parallel
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ftrain.config import load_config
    from ftrain.engines.megatron_model import build_gpt_model
    from ftrain.engines.megatron_ops import cp_split

    class NoRngTracker:
        def fork(self, name=None):
            return contextlib.nullcontext()

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        # Megatron's own, less its pinned-memory CUDA copy of the two chunk indices.
        cp, r = cp_group.size(), cp_group.rank()
        x = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
        x = x.index_select(seq_dim, torch.tensor([r, 2 * cp - 1 - r]))
        return x.view(*x.shape[:seq_dim], -1, *x.shape[seq_dim + 2:])

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoRngTracker()
    rotary.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(2))
    out = {}
    for cp in (1, world):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, context_parallel_size=cp, create_gloo_process_groups=False)
        r = ps.get_context_parallel_rank()
        torch.manual_seed(0)  # the same weights at both sizes
        model, _ = build_gpt_model(load_config(None, ["model.dtype=float32", f"parallel.cp={cp}"]), 1, 1, cp,
                                   use_cpu_initialization=True)
        logits = model(cp_split(ids, cp, r), cp_split(torch.arange(32).expand_as(ids), cp, r), None)
        (logits * cp_split(w, cp, r)).sum().backward()
        grads = [p.grad for p in model.parameters()]
        for g in grads:
            dist.all_reduce(g, group=ps.get_context_parallel_group())
        out[cp] = (logits.detach(), grads)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    ref_logits, ref_grads = out[1]
    logits, grads = out[world]
    return {"logits": (logits - cp_split(ref_logits, world, rank)).abs().max().item(),
            "grads": max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref_grads, strict=True)),
            "scale": min(g.abs().max().item() for g in ref_grads)}


@pytest.mark.slow
def test_context_parallel_gpt_model_equals_cp1_on_cpu():
    for rank, errors in enumerate(spawn_ranks(_model_worker, 2, timeout_s=300)):
        assert errors["scale"] > 0, errors  # every parameter has a gradient
        assert errors["logits"] < 1e-5 and errors["grads"] < 1e-5, (rank, errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_context_parallel_does_not_change_the_training():
    """The whole Megatron engine (GPTModel with SDPAttention or TE's attention, RoPE of each
    rank's chunks, the loss over the CP-split sequence) at cp = 2 on two GPUs against cp = 1 on
    one: the losses and gradient norms of two steps within bf16 tolerance, on both CP ranks."""
    from test_megatron_engine import LOSS_RTOL, _weighted_steps

    (one,) = spawn_ranks(_weighted_steps, 1, timeout_s=600)
    for rank, two in enumerate(spawn_ranks(_weighted_steps, 2, ("parallel.cp=2",), timeout_s=600)):
        assert two == pytest.approx(one, rel=LOSS_RTOL), (rank, one, two)

