"""`megatron_groups`: a Megatron-Core GPTModel built in one generation holds only the next
generation's groups after `rebind` and computes the same logits on them, on real gloo process
groups (two CPU ranks, tp = 2); a group made outside `parallel_state` is reported, not silently
left behind; a spare's model prebuilt in a world of one rank joins dp = 2 without a build."""
import contextlib

import pytest
import torch

from ftrain.distributed.parallel_dims import ParallelDims

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

    from ftrain.engines.megatron_groups import make_groups

    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}", store), rank=rank, world_size=world)
    return make_groups(dims)


def _logits(model) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ids = torch.randint(0, 200, (2, SEQ), generator=torch.Generator().manual_seed(1))
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        local = model(ids, torch.arange(SEQ).expand_as(ids), causal).float().contiguous()
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _rank(rank: int, world: int, store, foreign: bool) -> dict:
    import torch.distributed as dist

    from ftrain.config import load_config
    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines.megatron_groups import StaleGroups, rebind
    from ftrain.engines.megatron_model import build_gpt_model

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
    (shared groups, `make_groups(shared=True)`), moved to a generation where the two roles are
    different groups, then to one where they are the same group."""
    import torch.distributed as dist

    from ftrain.engines.megatron_groups import StaleGroups, rebind

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
    """A model built on shared groups in a world of one rank holds one group for every role;
    moved to dp >= 2 the TP and DP groups differ, and a reference does not say which it is:
    `rebind` raises StaleGroups naming the roles (the engine then builds the model again)
    instead of swapping in whichever role came last (the DP group as the TP group: wrong shapes
    in the checkpoint's sharded state dict, collectives over the wrong ranks). Where the roles'
    new groups are one group, the reference moves. A spare prebuilds on groups made one per
    role instead (`test_a_prebuilt_spare_joins_dp2_without_building`)."""
    (r,) = spawn_ranks(_one_group_for_two_roles, 1, timeout_s=120)
    assert "tp, dp" in r.get("ambiguous", "") and r["kept"], r
    assert r["swapped"] == 1 and r["moved"], r


def _prebuilt_spare_joins(rank: int, world: int, store) -> dict:
    """Generation 1: both ranks of a dp = 2 `MegatronEngine` on gloo build their model at join
    and train step 1. Generation 2: rank 0 is a spare that warmed up (`warm_up`: its model
    prebuilt in a world of one rank), rank 1 a fresh engine that builds at join; both train
    step 1 again."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from test_megatron_engine import _digest
    from test_megatron_peer_restore import _batch, _cfg

    from checkpoint import CheckpointManager
    from ftrain.engines.megatron_engine import MegatronEngine

    torch.set_num_threads(1)
    cfg = _cfg(world, 1)  # gloo's connect waits up to step_timeout_s: a loaded machine starts ranks late
    cfg = dataclasses.replace(cfg, fault_tolerance=dataclasses.replace(cfg.fault_tolerance, step_timeout_s=300))
    dims = ParallelDims.from_config(cfg)
    cold = MegatronEngine(cfg)
    cold.connect(dist.PrefixStore("gen1", store), dims, rank)
    expect = _digest(cold), cold.train_step(_batch(cfg, 1, dims, rank), 1), _digest(cold)
    del cold
    dist.destroy_process_group()
    engine = MegatronEngine(cfg)
    if rank == 0:
        engine.warm_up(CheckpointManager)
    out = {"phases": engine.connect(dist.PrefixStore("gen2", store), dims, rank)}
    qkv = engine.model.decoder.layers[0].self_attention.linear_qkv
    out["tp_group_right"] = qkv.tp_group is ps.get_tensor_model_parallel_group() is not ps.get_data_parallel_group()
    got = _digest(engine), engine.train_step(_batch(cfg, 1, dims, rank), 1), _digest(engine)
    out["same_start"], out["same_step"], out["same_end"] = (
        got[0] == expect[0], (got[1]["loss"], got[1]["grad_norm"]) == (expect[1]["loss"], expect[1]["grad_norm"]),
        got[2] == expect[2])
    dist.destroy_process_group()
    return out


def test_a_prebuilt_spare_joins_dp2_without_building():
    """A spare's model prebuilt in its private world of one rank (`MegatronEngine.warm_up`,
    tp = pp = cp = 1) joins a dp = 2 generation without being built again: that world's groups
    are one per role (`make_groups(shared=False)`), so `rebind` moves each reference to its own
    role's group (the TP group, not the DP group); the spare starts from the same state as a
    model built at join and trains step 1 to the same loss, gradient norm and state, bitwise."""
    spare, fresh = spawn_ranks(_prebuilt_spare_joins, 2, timeout_s=300)
    assert "rebind_s" in spare["phases"] and "build_s" not in spare["phases"], spare["phases"]
    assert "build_s" in fresh["phases"], fresh["phases"]
    for r in (spare, fresh):
        assert r["tp_group_right"] and r["same_start"] and r["same_step"] and r["same_end"], r
