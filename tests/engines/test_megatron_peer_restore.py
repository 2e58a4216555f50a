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
import pytest
import torch
from test_megatron_engine import _batch, _state_digest

from ftrain.distributed.parallel_dims import ParallelDims

from ranks import spawn_ranks


def _cfg(dp: int, tp: int, dist_opt: bool = False):
    """A tiny fp32 GPT (2 layers, hidden 64, vocab 128), by default without the distributed
    optimizer (peer restore alone needs every DP rank to hold its shard's whole optimizer state)."""
    from ftrain.config import load_config, resolve

    sets = [f"parallel.tp={tp}", f"cluster.num_workers={dp * tp}", f"model.distributed_optimizer={dist_opt}",
            "model.dtype=float32", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
            "model.ffn_hidden_size=128", "model.vocab_size=128", "model.max_seq_len=16", "train.seq_len=16",
            "train.global_batch_size=12", "train.mini_batch_size=12", "train.micro_batch_size=1",
            "train.steps=4", "fault_tolerance.step_timeout_s=20", "fault_tolerance.min_step_timeout_s=10"]
    return resolve(load_config(None, sets), num_gpus=1)  # a GPU config; the engine runs where it is


def _train(engine, cfg, dims, rank, steps) -> list:
    out = []
    for step in steps:
        engine.snapshot()
        res = engine.train_step(_batch(cfg, step, dims, rank), step)
        out.append((res["loss"], res["grad_norm"]))
    return out


def _peer_restore_rank(proc: int, world: int, store, dp: int, tp: int, lost: list[int], swap: list) -> dict:
    """Process `proc` is rank `proc` of generation 1; in generation 2 the processes of each
    pair in `swap` exchange ranks (a survivor reused at another shard), and those in `lost`
    are fresh engines. Survivors are the ranks whose process kept its shard
    (`fault_tolerance.same_shard`, as the recovery protocol decides)."""
    import torch
    import torch.distributed as dist

    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.recovery.fault_tolerance import plan_peer_restore, same_shard

    torch.set_num_threads(1)
    cfg = _cfg(dp, tp)
    dims = ParallelDims.from_config(cfg)
    at = list(range(world))  # at[p]: process p's rank in generation 2
    for a, b in swap:
        at[a], at[b] = b, a

    def join(engine, gen, rank):
        engine.disconnect()
        engine.connect(dist.PrefixStore(f"gen{gen}", store), dims, rank)

    e = MegatronEngine(cfg)
    join(e, 1, proc)
    _train(e, cfg, dims, proc, (1, 2))
    committed = e._host_copy(e._train_state(), pin=False)
    out = {"before": _state_digest(committed, committed["step"]), "reference": _train(e, cfg, dims, proc, (3, 4)), "rank": at[proc]}
    e.load_state(committed)
    _train(e, cfg, dims, proc, (3,))  # the step a failure interrupts: never committed
    if proc in lost:  # a fresh spare takes this rank
        e = None
        dist.destroy_process_group()
        e = MegatronEngine(cfg)
    rank = at[proc]
    join(e, 2, rank)
    holders = [f"spare {p}" if p in lost else p for p in sorted(range(world), key=at.__getitem__)]
    survivors = same_shard(list(range(world)), dims, holders, dims)
    clean = {r for r, ok in enumerate(_all(rank in survivors and e.rollback(2))) if ok}
    # as the recovery protocol plans it for this engine (`fault_tolerance._restore`)
    plan = plan_peer_restore(dims.group_ranks("dp"), survivors, clean, subgroups=False)
    assert plan is not None, f"no peer restore possible: survivors {survivors}, rolled back {clean}"
    for src, callers, members in plan:
        if rank in callers:
            out["subset_refused"] = False
            try:  # a subset of the DP group is refused before any collective
                e.broadcast_from(src, [src])
            except ValueError:
                out["subset_refused"] = True
            e.broadcast_from(src, members)
    out["after"] = _state_digest(e._train_state(), e.step)
    out["resumed"] = _train(e, cfg, dims, rank, (3, 4))
    dist.destroy_process_group()
    return out


def _all(value) -> list:
    """`value` of every rank of the default group, in rank order."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _check(results: list[dict], exact: bool = True) -> None:
    """Every rank holds its position's step-2 state bitwise, and trains steps 3 and 4 as the
    process that held that position in the uninterrupted run."""
    by_rank = {r["rank"]: r for r in results}
    for rank, r in enumerate(results):  # in generation 1 process p was rank p
        now = by_rank[rank]
        assert now["after"] == r["before"], f"rank {rank} does not hold its step-2 state"
        assert now["resumed"] == (r["reference"] if exact else pytest.approx(r["reference"], rel=1e-4)), rank
        assert now.get("subset_refused", True), rank  # every caller was refused a subset first


@pytest.mark.parametrize("dp, tp, lost, swap", [
    (3, 1, [1], []),        # one of three replicas: the third member joins the broadcast
    pytest.param(4, 1, [0, 2], [], marks=pytest.mark.slow),  # two of four, rank 0 among them
], ids=["dp3_lost1", "dp4_lost2"])
def test_megatron_peer_restore_at_dp_3_and_4(dp, tp, lost, swap):
    _check(spawn_ranks(_peer_restore_rank, dp * tp, dp, tp, lost, swap, timeout_s=300))


@pytest.mark.slow
@pytest.mark.parametrize("dp, tp, lost, swap", [
    (3, 2, [2, 3], []),         # a whole replica of tp=2: each DP group gets one new rank
    (4, 2, [2, 5], []),         # two ranks of different replicas and TP positions
    (4, 2, [0, 1, 4], []),      # three ranks: one DP group loses two
    (2, 2, [], [(0, 1)]),       # two survivors swap TP positions: each is new at its shard
], ids=["dp3_tp2_replica_lost", "dp4_tp2_lost2", "dp4_tp2_lost3", "dp2_tp2_swapped"])
def test_megatron_peer_restore_with_tensor_parallelism(dp, tp, lost, swap):
    _check(spawn_ranks(_peer_restore_rank, dp * tp, dp, tp, lost, swap, timeout_s=600))


NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("dp, tp, lost", [(3, 1, [1]), (4, 1, [0, 2]), (4, 2, [2, 5]), (4, 2, [0, 1, 4])],
                         ids=["dp3_lost1", "dp4_lost2", "dp4_tp2_lost2", "dp4_tp2_lost3"])
def test_megatron_peer_restore_on_gpus(dp, tp, lost):
    """The same on NCCL, one GPU per rank (NCCL refuses two ranks of one communicator on one
    device, so dp >= 3 needs as many GPUs as ranks). Losses within fp32 round-off (CUDA's
    embedding backward adds in no fixed order); the restored state bitwise."""
    if NGPU < dp * tp:
        pytest.skip(f"needs {dp * tp} CUDA GPUs")
    _check(spawn_ranks(_peer_restore_rank, dp * tp, dp, tp, lost, [], timeout_s=600), exact=False)


def engine_on_gloo(proc: int, store, dp: int, tp: int):
    """(engine, cfg, dims): a `MegatronEngine` of `_cfg(dp, tp)` connected as rank `proc` of
    generation 1 over gloo through `store` (one CPU thread: the ranks share the cores)."""
    import torch.distributed as dist

    from ftrain.engines.megatron_engine import MegatronEngine

    torch.set_num_threads(1)
    cfg = _cfg(dp, tp)
    dims = ParallelDims.from_config(cfg)
    e = MegatronEngine(cfg)
    e.connect(dist.PrefixStore("gen1", store), dims, proc)
    return e, cfg, dims


def _dp_sum_rank(proc: int, world: int, store, dp: int, tp: int) -> dict:
    """Rank `proc` of a tp x dp Megatron engine on gloo: `dp_sum` of [proc + 1, 10 * (proc + 1)]."""
    import torch
    import torch.distributed as dist

    e, _, _ = engine_on_gloo(proc, store, dp, tp)
    progress = e.progress
    total = e.dp_sum(torch.tensor([proc + 1.0, 10.0 * (proc + 1)], dtype=torch.float64))
    out = {"sum": total.tolist(), "dtype": str(total.dtype), "device": str(total.device),
           "progress": e.progress - progress}
    dist.destroy_process_group()
    return out


def test_megatron_dp_sum_adds_over_the_dp_group_only():
    """`MegatronEngine.dp_sum` (the masked-token counts of rows each replica read itself, with SFT
    masks or eod_mask_loss): at tp=2 dp=2 each rank gets the sum over its own DP group (the ranks
    of its TP position, `ParallelDims.group_ranks('dp')`), as float64 on the CPU, and counts one
    unit of progress."""
    dp, tp = 2, 2
    results = spawn_ranks(_dp_sum_rank, dp * tp, dp, tp, timeout_s=300)
    dims = ParallelDims.from_world(dp * tp, tp=tp)
    for group in dims.group_ranks("dp"):
        want = [float(sum(r + 1 for r in group)), float(sum(10 * (r + 1) for r in group))]
        for r in group:
            assert results[r] == {"sum": want, "dtype": "torch.float64", "device": "cpu", "progress": 1}, (r, results)


def _abort_rank(proc: int, world: int, store, how: str) -> dict:
    """tp=2 on gloo (group timeout 20 s): rank 0 enters a TP all-reduce that rank 1, alive,
    never joins (as when a TP peer left its step for an abort); rank 0's control thread then
    aborts its engine (`how` 'abort') or only interrupts it ('interrupt': no socket shut down,
    no group aborted). Returns whether the all-reduce was freed within 3 s and its error."""
    import datetime
    import threading
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    e, _, _ = engine_on_gloo(proc, store, 1, 2)
    if proc == 1:
        store.wait(["done"], datetime.timedelta(seconds=60))
        return {}
    errors = []

    def compute():
        try:
            dist.all_reduce(torch.ones(4), group=ps.get_tensor_model_parallel_group())
        except RuntimeError as err:
            errors.append(f"{type(err).__name__}: {err}")

    t = threading.Thread(target=compute, daemon=True)
    t.start()
    t.join(1.0)
    blocked = t.is_alive()
    t0 = time.perf_counter()
    e.abort(5.0) if how == "abort" else e.interrupt()
    t.join(3.0)
    out = {"blocked_before": blocked, "freed": not t.is_alive(), "freed_s": time.perf_counter() - t0,
           "errors": errors}
    store.set("done", "1")
    return out


def test_megatron_abort_frees_a_tp_collective_whose_peer_left_on_gloo():
    """gloo has no abort: without the shutdown of the Megatron groups' sockets a rank in a TP
    all-reduce whose peer (alive) had left the step stayed there until the group's timeout,
    to be replaced as hung."""
    result = spawn_ranks(_abort_rank, 2, "abort", timeout_s=120)[0]
    assert result["blocked_before"], result
    assert result["freed"] and result["errors"], result


def test_the_interrupt_alone_ends_a_gloo_wait_of_the_megatron_engine():
    """A wait the socket shutdown does not end (a send behind a partial write; a TP all-reduce
    seen waiting with its group's connections all closed) ends at the abort's interrupt
    (`comms.interruptible_waits`): shown here with no socket shut down and no group aborted.
    Before, the wait lasted to the group's timeout and the rank was replaced as hung."""
    result = spawn_ranks(_abort_rank, 2, "interrupt", timeout_s=120)[0]
    assert result["blocked_before"], result
    assert result["freed"] and result["freed_s"] < 1.0, result
    assert result["errors"] and result["errors"][0].startswith("Interrupted"), result
