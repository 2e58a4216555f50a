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


def _one_group_for_two_roles(rank: int, world: int, store) -> dict:
    """A module holding the one group that stands for roles 'tp' and 'dp' in a world of one rank
    (a spare's prebuilt model), moved to a generation where the two roles are different groups,
    then to one where they are the same group."""
    import torch.distributed as dist

    from megatron_groups import StaleGroups, rebind

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    one, tp, dp = (dist.new_group([0]) for _ in range(3))
    module = torch.nn.Linear(1, 1)
    module.tp_group = one
    out = {}
    try:
        rebind([module], {"tp": one, "dp": one}, {"tp": tp, "dp": dp})
    except StaleGroups as e:
        out["ambiguous"] = str(e)
    out["kept"] = module.tp_group is one
    out["swapped"] = rebind([module], {"tp": one, "dp": one}, {"tp": tp, "dp": tp})
    out["moved"] = module.tp_group is tp
    dist.destroy_process_group()
    return out


def test_a_group_of_several_roles_is_not_guessed_when_their_new_groups_differ():
    """A spare's model prebuilt in a world of one rank holds one group for every role; joining
    at dp >= 2 the TP and DP groups differ, and a reference does not say which it is: `rebind`
    raises StaleGroups naming the roles (the engine then builds the model again) instead of
    swapping in whichever role came last (the DP group as the TP group: wrong shapes in the
    checkpoint's sharded state dict, collectives over the wrong ranks). Where the roles' new
    groups are one group, the reference moves."""
    (r,) = spawn_ranks(_one_group_for_two_roles, 1, timeout_s=120)
    assert "tp, dp" in r.get("ambiguous", "") and r["kept"], r
    assert r["swapped"] == 1 and r["moved"], r
