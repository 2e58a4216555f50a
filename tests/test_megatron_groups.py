"""`megatron_groups`: a Megatron-Core GPTModel built in one generation holds only the next
generation's groups after `rebind` and computes the same logits on them, on real gloo process
groups (two CPU ranks, tp = 2); a group made outside `parallel_state` is reported, not silently
left behind."""
import contextlib

import pytest
import torch

from ranks import spawn_ranks

SEQ = 8


def _cpu_megatron():
    """Run Megatron's forward path on CPU: no CUDA device, no CUDA RNG tracker."""
    import megatron.core.tensor_parallel as tensor_parallel

    class NoRngTracker:
        def fork(self, name=None):
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoRngTracker()


def _generation(store, gen: int, rank: int, world: int, dims):
    import torch.distributed as dist

    from megatron_groups import make_groups

    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}", store), rank=rank, world_size=world)
    return make_groups(dims)


def _logits(model) -> torch.Tensor:
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    ids = torch.randint(0, 200, (2, SEQ), generator=torch.Generator().manual_seed(1))
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        local = model(ids, torch.arange(SEQ).expand_as(ids), causal).float().contiguous()
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _rank(rank: int, world: int, store, foreign: bool) -> dict:
    import torch.distributed as dist

    from config import load_config
    from megatron_groups import StaleGroups, rebind
    from megatron_model import build_gpt_model
    from parallel_dims import ParallelDims

    _cpu_megatron()
    dims = ParallelDims(tp=world, pp=1, cp=1, dp=1)
    cfg = load_config(None, ["model.dtype=float32", "model.num_layers=2", "model.hidden_size=64",
                             "model.num_heads=4", "model.ffn_hidden_size=128", "model.vocab_size=200",
                             "cluster.num_workers=2"])
    old = _generation(store, 0, rank, world, dims)
    torch.manual_seed(0)
    model, _ = build_gpt_model(cfg, world, 1, 1, None, use_cpu_initialization=True)
    if foreign:
        model.side_group = dist.new_group([0, 1])  # not one of parallel_state's
    before = _logits(model)
    dist.destroy_process_group()  # the generation ends: its groups are gone
    new = _generation(store, 1, rank, world, dims)
    out = {}
    try:
        out["swapped"] = rebind([model], old, new)
    except StaleGroups as e:
        out["stale"] = str(e)
        return out
    out["left"] = rebind([model], old, new)  # a second pass finds no old group
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    out["tp_group_is_new"] = qkv.tp_group is new["_TENSOR_MODEL_PARALLEL_GROUP"]
    out["equal"] = torch.equal(before, _logits(model))
    dist.destroy_process_group()
    return out


def test_a_model_moves_to_the_next_generation_groups():
    for r in spawn_ranks(_rank, 2, False, timeout_s=300):
        assert r["swapped"] > 0 and r["left"] == 0 and r["tp_group_is_new"] and r["equal"], r


@pytest.mark.slow
def test_a_group_made_outside_parallel_state_is_reported():
    for r in spawn_ranks(_rank, 2, True, timeout_s=300):
        assert "side_group" in r.get("stale", ""), r
