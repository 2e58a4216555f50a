"""Peer restore of the Megatron engine at dp >= 3 (issue: the broadcast ignored who calls it), on
CPU: real gloo processes, one per rank, drive `megatron_engine.MegatronEngine` the way
`MegatronActor` does (process-group generations through one TCPStore with a fresh prefix each,
`connect`, `snapshot` + `train_step`, `rollback`, `broadcast_from`) and the recovery protocol's
own decision (`fault_tolerance.plan_peer_restore`) says which ranks call the broadcast.

Each case: every rank trains steps 1 and 2 (committed) and records the uninterrupted steps 3
and 4 from a host copy of step 2; then all train step 3 (not committed) and the `lost` ranks are
replaced by fresh engines (built from `train.seed`, step 0) in a new generation of the same
layout. Survivors roll back to step 2, the planned callers broadcast, and every rank must hold
its position's step-2 state bitwise and then train steps 3 and 4 with the uninterrupted run's
losses and gradient norms exactly (fp32 on CPU, same reduction order). A broadcast that waits
for ranks that never call fails the case at the process-group timeout
(`fault_tolerance.step_timeout_s`, 20 s here) instead of hanging the suite."""
import hashlib

import pytest

from parallel_dims import ParallelDims
from ranks import spawn_ranks


def _cfg(dp: int, tp: int):
    """A tiny fp32 GPT (2 layers, hidden 64, vocab 128), no distributed optimizer (peer restore
    needs every DP rank to hold its shard's whole optimizer state)."""
    from config import load_config, resolve

    sets = [f"parallel.tp={tp}", f"cluster.num_workers={dp * tp}", "model.distributed_optimizer=false",
            "model.dtype=float32", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
            "model.ffn_hidden_size=128", "model.vocab_size=128", "model.max_seq_len=16", "train.seq_len=16",
            "train.global_batch_size=12", "train.mini_batch_size=12", "train.micro_batch_size=1",
            "train.steps=4", "fault_tolerance.step_timeout_s=20", "fault_tolerance.min_step_timeout_s=10"]
    return resolve(load_config(None, sets), num_gpus=1)  # a GPU config; the engine runs where it is


def _batch(cfg, step, dims, rank):
    from dispatch import MeshDispatch
    from training_batch import synthetic_batch

    t, m = cfg.train, cfg.model
    b = synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, m.vocab_size)
    return MeshDispatch.split(dims, (b,), {})[rank][0][0]


def _digest(state) -> str:
    from host_memory import state_tensors

    h = hashlib.sha256(f"{state['step']} {state['sched_steps']}".encode())
    for x in state_tensors(state):
        h.update(x.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _train(engine, cfg, dims, rank, steps) -> list:
    out = []
    for step in steps:
        engine.snapshot()
        res = engine.train_step(_batch(cfg, step, dims, rank), step)
        out.append((res["loss"], res["grad_norm"]))
    return out


def _peer_restore_rank(rank: int, world: int, store, dp: int, tp: int, lost: list[int]) -> dict:
    import torch
    import torch.distributed as dist

    from fault_tolerance import plan_peer_restore
    from megatron_engine import MegatronEngine

    torch.set_num_threads(1)
    cfg = _cfg(dp, tp)
    dims = ParallelDims.from_config(cfg)

    def join(engine, gen):
        engine.disconnect()
        engine.connect(dist.PrefixStore(f"gen{gen}", store), dims, rank)

    e = MegatronEngine(cfg)
    join(e, 1)
    _train(e, cfg, dims, rank, (1, 2))
    committed = e._host_copy(e._train_state(), pin=False)
    out = {"before": _digest(committed), "reference": _train(e, cfg, dims, rank, (3, 4))}
    e.load_state(committed)
    _train(e, cfg, dims, rank, (3,))  # the step a failure interrupts: never committed
    if rank in lost:  # a fresh spare takes this rank
        e = None
        dist.destroy_process_group()
        e = MegatronEngine(cfg)
    join(e, 2)
    survivors = set(range(world)) - set(lost)
    clean = {r for r, ok in enumerate(_all(rank in survivors and e.rollback(2))) if ok}
    plan = plan_peer_restore(dims.group_ranks("dp"), survivors, clean)
    out["plan"] = plan
    assert plan, f"no peer restore planned: survivors {survivors}, rolled back {clean}"
    for src, callers, members in plan:
        if rank in callers:
            e.broadcast_from(src, members)
    out["after"] = _digest(e._train_state())
    out["resumed"] = _train(e, cfg, dims, rank, (3, 4))
    dist.destroy_process_group()
    return out


def _all(value) -> list:
    """`value` of every rank of the default group, in rank order."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _check(results: list[dict], lost: list[int]) -> None:
    for rank, r in enumerate(results):
        assert r["after"] == r["before"], f"rank {rank} (lost={rank in lost}) does not hold its step-2 state"
        assert r["resumed"] == r["reference"], (rank, r["resumed"], r["reference"])


@pytest.mark.parametrize("dp, tp, lost", [
    (3, 1, [1]),      # one of three replicas: the source and the new rank call, the third does not
    (4, 1, [0, 2]),   # two of four, rank 0 among them
])
def test_megatron_peer_restore_at_dp_3_and_4(dp, tp, lost):
    _check(spawn_ranks(_peer_restore_rank, dp * tp, dp, tp, lost, timeout_s=240), lost)


@pytest.mark.slow
@pytest.mark.parametrize("dp, tp, lost", [
    (3, 2, [2, 3]),      # a whole replica of tp=2: each DP group gets one new rank
    (4, 2, [2, 5]),      # two ranks of different replicas and TP positions
    (4, 2, [0, 1, 4]),   # three ranks: one DP group loses two
])
def test_megatron_peer_restore_with_tensor_parallelism(dp, tp, lost):
    _check(spawn_ranks(_peer_restore_rank, dp * tp, dp, tp, lost, timeout_s=600), lost)
