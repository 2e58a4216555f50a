"""GPU tests of `megatron_engine.MegatronEngine` (marker `gpu`; skipped without enough GPUs), and
CPU tests of its host-buffer helpers (`host_memory`) and context-parallel ops (`megatron_ops`).

Each test spawns one process per GPU (`ranks.spawn_ranks`: process r uses GPU r) and drives the
engine the way `MegatronActor` does: process-group generations through one TCPStore with a fresh
prefix each, `connect`, `train_step`, checkpoints committed by rank 0 through
`CheckpointManager`, rollback and peer broadcast; the test asserts on the ranks' results.
"""
import functools
import hashlib
import os

import pytest
import torch

from ftrain.distributed.parallel_dims import ParallelDims

from ranks import spawn_ranks

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
LOSS_RTOL = 2e-2  # bf16 tolerance across layouts (see main.losses_match)


def _cfg(tp=1, pp=1, world=1, dist_opt=True, extra=("ppo.loss_agg_mode=seq-mean-token-mean",)):
    """The small GPT (4 layers, hidden 128, vocab 200) of the GPU tests; `extra`: more --set items."""
    from ftrain.config import load_config, resolve

    sets = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"cluster.num_workers={world}",
            f"model.distributed_optimizer={str(dist_opt).lower()}", "model.num_layers=4",
            "model.hidden_size=128", "model.num_heads=4", "model.ffn_hidden_size=256",
            "model.vocab_size=200", "train.global_batch_size=8", "train.mini_batch_size=4",
            "train.micro_batch_size=1", "train.steps=4", *extra]
    return resolve(load_config(None, sets), num_gpus=1)


def _batch(cfg, step, dims, rank):
    from dispatch import MeshDispatch
    from ftrain.data.training_batch import synthetic_batch

    t, m = cfg.train, cfg.model
    b = synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, m.vocab_size)
    return MeshDispatch.split(dims, (b,), {})[rank][0][0]


def _join(engine, store, gen, rank, dims):
    """As the actor joins generation `gen`: `disconnect` (aborts the previous generation's
    groups), then `connect` through the store's prefix `gen{gen}` (makes the process group)."""
    import torch.distributed as dist

    engine.disconnect()
    return engine.connect(dist.PrefixStore(f"gen{gen}", store), dims, rank)


def _digest(engine) -> str:
    """SHA-256 over every tensor of the engine's training state, plus its step."""
    return _state_digest(engine._train_state(), engine.step)


def _state_digest(state, step) -> str:
    from ftrain.state.host_memory import state_tensors

    h = hashlib.sha256(str(step).encode())
    for x in state_tensors(state):
        h.update(x.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _moments(engine) -> list[torch.Tensor]:
    return [x.detach().cpu().clone() for _, s in
            [(p, o.optimizer.state[p]) for o in engine.optimizer.chained_optimizers
             for g in o.optimizer.param_groups for p in g["params"]]
            for x in (s["exp_avg"], s["exp_avg_sq"])]


def _save(engine, ckpt, step, dims, rank, train_while_writing=None):
    """Every rank writes; rank 0 commits the manifest (what Trainer.save does). With a callable
    `train_while_writing` the save is async: the write runs in the background while the callable
    trains on, then `PendingSave.result()` (collective) finishes it."""
    import torch.distributed as dist

    files = engine.save_checkpoint(ckpt, step, dims, rank, async_save=train_while_writing is not None)
    if train_while_writing is not None:
        train_while_writing()
        (pending,) = files
        files = pending.result()
    everyone = [None] * dims.world_size
    dist.all_gather_object(everyone, files)
    if rank == 0:
        ckpt.commit(step, {"world_size": dims.world_size, "tp": dims.tp, "pp": dims.pp,
                           "cp": dims.cp, "dp": dims.dp}, [f for fs in everyone for f in fs])
    dist.barrier()
    return files


def _views_match_megatron(engine) -> bool:
    """Whether the save's model-space optimizer state (the patched
    `sharded_param_state_fully_reshardable`, views of the live state when DP is 1) equals
    Megatron's own method's (gathered host copies): same entries, keys, shapes, offsets,
    replica ids, dtypes (a ShardedTensorFactory, e.g. SwiGLU's fc1, has key and replica id
    only) and values."""
    model_sd = engine.model.sharded_state_dict()
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    for o in engine.optimizer.chained_optimizers:
        ours = o.sharded_param_state_fully_reshardable(model_sd, False, meta)
        theirs = type(o).sharded_param_state_fully_reshardable(o, model_sd, False, meta)
        if ours.keys() != theirs.keys():
            return False
        for i, entry in ours.items():
            if entry.keys() != theirs[i].keys():
                return False
            for k, a in entry.items():
                b = theirs[i][k]
                same = [(type(x), x.key, x.replica_id, *(getattr(x, f, None) for f in ("global_shape", "global_offset", "dtype")))
                        for x in (a, b)]
                if same[0] != same[1] or not torch.equal(a.data.cpu(), b.data.cpu()):
                    return False
    return True


def _count_calls(engine, method: str):
    """Count calls of `method` on every DistributedOptimizer of `engine` from now on; returns
    a function that gives the count so far."""
    calls = []
    for o in engine.optimizer.chained_optimizers:
        original = getattr(o, method)
        setattr(o, method, lambda *a, _f=original, **k: (calls.append(1), _f(*a, **k))[1])
    return lambda: len(calls)


def _scenarios(rank, world, store, tmp, storage) -> dict:
    """Train / save / load (same layout: bitwise; resharded: within bf16 tolerance), reconnect,
    rollback, peer broadcast. Returns numbers for the test to check."""
    import torch.distributed as dist

    from checkpoint import CheckpointManager
    from ftrain.engines.megatron_engine import MegatronEngine

    out = {}
    uri, opts = storage or (os.path.join(tmp, "ckpt"), None)
    ckpt = CheckpointManager(uri, storage_options=opts)
    cfg = _cfg(world=world)
    dims = ParallelDims.from_config(cfg)
    e = MegatronEngine(cfg)
    _join(e, store, 1, rank, dims)
    initial = _digest(e)
    e.snapshot()
    out["step1"] = e.train_step(_batch(cfg, 1, dims, rank), 1)
    files = _save(e, ckpt, 1, dims, rank)
    out["files"] = [f.path for f in files]
    saved_moments, saved_digest = _moments(e), _digest(e)
    out["rollback_dist_opt"] = e.rollback(1)
    e.snapshot()
    out["step2"] = e.train_step(_batch(cfg, 2, dims, rank), 2)
    before, objects = _digest(e), (e.model, e.ddp, e.optimizer, e.scheduler)
    phases = _join(e, store, 2, rank, dims)                # new generation keeps the state
    out["reconnect_keeps_state"] = _digest(e) == before
    # ... and the objects: only their process groups changed (megatron_groups.rebind)
    out["reconnect_keeps_objects"] = (all(a is b for a, b in zip(objects, (e.model, e.ddp, e.optimizer, e.scheduler)))
                                      and "rebind_s" in phases and "build_s" not in phases)
    gathers = _count_calls(e, "get_parameter_state_dp_zero")
    e.load_checkpoint(ckpt, ckpt.latest_verified(), rank)
    # one DP rank: the load reads into views of the live state, no host world tensors
    out["load_gathers_as_expected"] = (gathers() == 0) == (dims.dp == 1)
    out["load_digest_equal"] = _digest(e) == saved_digest
    out["moments_equal"] = all(torch.equal(a, b) for a, b in zip(saved_moments, _moments(e)))
    out["moments_nonzero"] = any(a.abs().sum() > 0 for a in saved_moments)
    out["step2_again"] = e.train_step(_batch(cfg, 2, dims, rank), 2)
    out["reset_is_initial"] = (e.reset(), _digest(e) == initial)[1]
    out["views_match_megatron"] = _views_match_megatron(e)
    # Async save: the next step trains while the checkpoint is copied (side stream) and written.
    ck_async = CheckpointManager(os.path.join(tmp, "ckpt_async"))
    e.snapshot()
    e.train_step(_batch(cfg, 1, dims, rank), 1)
    at_call = _digest(e)
    _save(e, ck_async, 1, dims, rank, train_while_writing=functools.partial(e.train_step, _batch(cfg, 2, dims, rank), 2))
    after_step2 = _digest(e)
    e.load_checkpoint(ck_async, ck_async.latest_verified(), rank)
    out["async_holds_call_state"] = _digest(e) == at_call != after_step2
    del e
    if world >= 2:
        # Resharding: the tp=1 dp=2 checkpoint into tp=2 dp=1 (full batch on one replica).
        cfg2 = _cfg(tp=2, world=world)
        e2 = MegatronEngine(cfg2)
        _join(e2, store, 3, rank, ParallelDims.from_config(cfg2))
        e2.load_checkpoint(ckpt, ckpt.latest_verified(), rank)
        out["step2_tp2"] = e2.train_step(_batch(cfg2, 2, ParallelDims.from_config(cfg2), rank), 2)
        del e2
        # Peer restore without the distributed optimizer: rollback, then rank 1 as a fresh spare.
        cfg3 = _cfg(world=world, dist_opt=False)
        e3 = MegatronEngine(cfg3)
        _join(e3, store, 4, rank, ParallelDims.from_config(cfg3))
        e3.snapshot()
        e3.train_step(_batch(cfg3, 1, ParallelDims.from_config(cfg3), rank), 1)
        step1 = _digest(e3)
        e3.snapshot()
        e3.train_step(_batch(cfg3, 2, ParallelDims.from_config(cfg3), rank), 2)
        out["rollback_ok"] = e3.rollback(1) and _digest(e3) == step1
        if rank == 1:
            e3.reset()
        e3.broadcast_from(0)
        digests = [None] * world
        dist.all_gather_object(digests, _digest(e3))
        out["broadcast_equal"] = len(set(digests)) == 1 and digests[0] == step1
        # Pipeline parallel: pp=2, save/load round trip replays a step bitwise.
        cfg4 = _cfg(pp=2, world=world)
        e4 = MegatronEngine(cfg4)
        _join(e4, store, 5, rank, ParallelDims.from_config(cfg4))
        ck4 = CheckpointManager(os.path.join(tmp, "ckpt_pp"))
        e4.train_step(_batch(cfg4, 1, ParallelDims.from_config(cfg4), rank), 1)
        # async save: step 2 trains while the step-1 checkpoint is written from host copies
        _save(e4, ck4, 1, ParallelDims.from_config(cfg4), rank,
              train_while_writing=lambda: out.__setitem__("pp_step2", e4.train_step(_batch(cfg4, 2, ParallelDims.from_config(cfg4), rank), 2)))
        e4.load_checkpoint(ck4, ck4.latest_verified(), rank)
        out["pp_step2_again"] = e4.train_step(_batch(cfg4, 2, ParallelDims.from_config(cfg4), rank), 2)
    return out


def _spawn(world, tmp, storage=None) -> list[dict]:
    """Run `_scenarios` on `world` GPUs; checkpoints go to `storage` ((uri, storage_options))
    or a local directory under `tmp`."""
    return spawn_ranks(_scenarios, world, str(tmp), storage)


def _check_common(res: dict, rank: int, world: int) -> None:
    assert f"megatron/__{rank}_0.distcp" in res["files"]
    assert ("megatron/.metadata" in res["files"]) == (rank == 0)
    assert res["rollback_dist_opt"] is (world >= 2)  # kept for the shard keeper at dp >= 2 only
    assert res["reconnect_keeps_state"] and res["load_digest_equal"]
    assert res["reconnect_keeps_objects"]
    assert res["moments_equal"] and res["moments_nonzero"]
    assert res["step2_again"]["loss"] == res["step2"]["loss"]
    assert res["step2_again"]["grad_norm"] == res["step2"]["grad_norm"]
    assert res["reset_is_initial"]
    assert res["views_match_megatron"]
    assert res["load_gathers_as_expected"]
    assert res["async_holds_call_state"]


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_engine_one_gpu(tmp_path):
    (res,) = _spawn(1, tmp_path)
    _check_common(res, 0, 1)
    assert res["step1"]["lr"] > 0 and res["step2"]["loss"] == res["step2"]["loss"]  # not NaN


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_engine_two_gpus(tmp_path, backend, request):
    storage = None
    if backend == "gcs":  # object storage: per-rank staging, upload, fetch-on-read (loopback emulator)
        pytest.importorskip("gcsfs")
        pytest.importorskip("gcp_storage_emulator")
        server = request.getfixturevalue("gcs_server")
        storage = (server.uri(f"mcore-{os.getpid()}"), server.storage_options)
    results = _spawn(2, tmp_path, storage)
    for rank, res in enumerate(results):
        _check_common(res, rank, 2)
        assert res["rollback_ok"] and res["broadcast_equal"]
    # tp=2 dp=1 from the tp=1 dp=2 checkpoint: same step-2 loss / grad norm as the mean over
    # the two replicas (seq-mean-token-mean makes the replica mean the global mean).
    ref_loss = sum(r["step2"]["loss"] for r in results) / 2
    for res in results:
        assert res["step2_tp2"]["loss"] == pytest.approx(ref_loss, rel=LOSS_RTOL, abs=1e-3)
        assert res["step2_tp2"]["grad_norm"] == pytest.approx(results[0]["step2"]["grad_norm"], rel=LOSS_RTOL)
    # pp=2: the loss lives on the last stage (rank 1); the replayed step matches bitwise.
    assert results[1]["pp_step2_again"]["loss"] == results[1]["pp_step2"]["loss"]
    assert results[0]["pp_step2"]["loss"] != results[0]["pp_step2"]["loss"]  # NaN off the last stage


def _warm_up_ranks(rank, world, store) -> dict:
    """A spare that ran `warm_up` before joining against one that did not (same process, one
    after the other): the warm-up frees the GPU memory of its one-layer step (it keeps only the
    spare's prebuilt model), keeps the RNG states and leaves no process group; asked again (a
    spare's `prepare_spare` after its `build`) it does nothing; the warmed engine joins without
    building a model, with the same step-0 state, and trains the same first step."""
    import torch.distributed as dist

    from checkpoint import CheckpointManager
    from ftrain.engines.megatron_engine import MegatronEngine

    cfg = _cfg(dist_opt=False)
    cold = MegatronEngine(cfg)
    _join(cold, store, 1, rank, ParallelDims.from_config(cfg))
    cold_state, cold_step = _digest(cold), cold.train_step(_batch(cfg, 1, ParallelDims.from_config(cfg), rank), 1)
    del cold
    dist.destroy_process_group()
    warm = MegatronEngine(cfg)
    memory, rng = torch.cuda.memory_allocated(), (torch.get_rng_state(), torch.cuda.get_rng_state())
    out = {"seconds": warm.warm_up(CheckpointManager)}
    prebuilt = sum(p.numel() * p.element_size() for p in warm._prebuilt["objects"][0].parameters())
    out["freed"] = torch.cuda.memory_allocated() - memory <= prebuilt + (1 << 20)
    out["rng_kept"] = torch.equal(rng[0], torch.get_rng_state()) and torch.equal(rng[1], torch.cuda.get_rng_state())
    out["no_group_left"] = not dist.is_initialized()
    out["warmed_once"] = warm.warm_up(CheckpointManager) == 0.0  # a spare's `prepare_spare` after its `build`
    phases = _join(warm, store, 2, rank, ParallelDims.from_config(cfg))
    out["prebuilt_used"] = "build_s" not in phases and "rebind_s" in phases
    out["same_state"] = _digest(warm) == cold_state
    step = warm.train_step(_batch(cfg, 1, ParallelDims.from_config(cfg), rank), 1)
    out["same_step"] = (step["loss"], step["grad_norm"]) == (cold_step["loss"], cold_step["grad_norm"])
    out["rank_not_warmed_again"] = warm.warm_up(CheckpointManager) == 0.0
    return out


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_spare_warm_up_leaves_no_trace():
    (res,) = spawn_ranks(_warm_up_ranks, 1)
    assert res["seconds"] > 0
    assert res["freed"] and res["rng_kept"] and res["no_group_left"]
    assert res["warmed_once"], res
    assert res["prebuilt_used"] and res["same_state"] and res["same_step"] and res["rank_not_warmed_again"]


def _interrupted_ranks(rank, world, store) -> dict:
    """`MegatronEngine.interrupt` as `MegatronActor.abort` calls it: a step interrupted before
    its training forward and one interrupted after it (in the backward) both raise
    `Interrupted` and change no state; after the next `connect` the step runs as in an engine
    that was never interrupted."""
    import torch.distributed as dist

    from ftrain.engines.engine import Interrupted
    from ftrain.engines.megatron_engine import MegatronEngine

    cfg = _cfg(dist_opt=False)
    batch = _batch(cfg, 1, ParallelDims.from_config(cfg), rank)
    e = MegatronEngine(cfg)
    _join(e, store, 1, rank, ParallelDims.from_config(cfg))
    before, raised = _digest(e), []
    e.fault_point = lambda point: e.interrupt() if point == "before_allreduce" else None
    for stop_in in ("forward", "backward"):
        if stop_in == "backward":  # interrupt when the training forward is done
            e.fault_point = lambda point: None
            hook = e.model.register_forward_hook(lambda *_: e.interrupt() if torch.is_grad_enabled() else None)
        try:
            e.snapshot()
            e.train_step(batch, 1)
        except Interrupted:
            raised.append(stop_in)
        _join(e, store, 2 if stop_in == "forward" else 3, rank, ParallelDims.from_config(cfg))  # clears the interrupt
    hook.remove()
    out = {"raised": raised, "unchanged": _digest(e) == before}  # no optimizer step ran
    step = e.train_step(batch, 1)
    e = None  # frees its GPU memory
    dist.destroy_process_group()
    fresh = MegatronEngine(cfg)
    _join(fresh, store, 4, rank, ParallelDims.from_config(cfg))
    ref = fresh.train_step(batch, 1)
    out["same_step"] = (step["loss"], step["grad_norm"]) == (ref["loss"], ref["grad_norm"])
    return out


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_interrupt_stops_a_step_without_changing_state():
    (res,) = spawn_ranks(_interrupted_ranks, 1)
    assert res["raised"] == ["forward", "backward"], res
    assert res["unchanged"] and res["same_step"], res


def _host_copy_ranks(rank, world, store) -> dict:
    """`start_host_copy` as a memory snapshot uses it, with and without the distributed
    optimizer: the copy of step 1 is queued on the side stream and step 2 is queued right
    behind it (its forward and backward beside the copy, its update ordered after it). The
    copy must hold step 1's state bitwise, and step 2 must train as without the copy."""
    from ftrain.engines.megatron_engine import MegatronEngine

    out = {}
    for gen, dist_opt in ((1, True), (2, False)):
        cfg = _cfg(dist_opt=dist_opt)
        dims = ParallelDims.from_config(cfg)
        e = MegatronEngine(cfg)
        _join(e, store, gen, rank, dims)
        # the rollback snapshot's pinned memory (kept without dist-opt) is pinning since the join
        arena_at_join = (e._arena is not None) == (not dist_opt)
        e.prepare_host_copy()
        e.train_step(_batch(cfg, 1, dims, rank), 1)
        step1 = _digest(e)
        e._send_arena.result()  # pinned in the background since the join
        copy = e.start_host_copy()
        e.snapshot()
        second = e.train_step(_batch(cfg, 2, dims, rank), 2)
        copy.wait()
        res = {"copy_is_step_1": _state_digest(copy.state, copy.state["step"]) == step1,
               "pinned": copy.state["model"][0].is_pinned(), "arena_at_join": arena_at_join}
        e.load_state(copy.state)
        res["loaded"] = _digest(e) == step1
        again = e.train_step(_batch(cfg, 2, dims, rank), 2)
        res["same_step_2"] = (second["loss"], second["grad_norm"]) == (again["loss"], again["grad_norm"])
        out[f"dist_opt={dist_opt}"] = res
        del e
        torch.distributed.destroy_process_group()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_a_host_copy_overlapped_with_the_next_step_is_the_committed_step():
    (res,) = spawn_ranks(_host_copy_ranks, 1)
    for case, r in res.items():
        assert r == {"copy_is_step_1": True, "pinned": True, "arena_at_join": True, "loaded": True,
                     "same_step_2": True}, (case, r)


def test_carve_host_buffers_from_a_reserved_arena():
    """A spare's rollback snapshot buffers live in memory it reserved before joining: each has
    its tensor's shape and dtype, at an offset any dtype may start at, no two overlap, non-tensor
    leaves are kept, and a too-small arena gives None (the engine allocates then). Each buffer's
    storage is its own bytes, so `torch.save` of one (Megatron's async save writes each tensor
    so) writes that tensor, not the whole arena."""
    import io

    from ftrain.state.host_memory import carve, state_nbytes, state_tensors

    state = {"model": [torch.randn(3, 5).bfloat16(), torch.randn(7)],
             "optimizer": [[torch.randn(3, 5), torch.zeros(3, 5), torch.ones(3, 5), torch.tensor(2.0)]],
             "sched_steps": 4, "step": 9, "empty": torch.zeros(0, 4)}
    need = state_nbytes(state)
    assert need == 64 * 6  # every tensor fits in one 64-byte slot
    arena = torch.zeros(need + (1 << 20), dtype=torch.uint8)
    buffers = carve(state, arena)
    assert buffers["sched_steps"] == 4 and buffers["step"] == 9
    for dst, src in zip(state_tensors(buffers), state_tensors(state), strict=True):
        assert (dst.shape, dst.dtype) == (src.shape, src.dtype)
        nbytes = dst.numel() * dst.element_size()
        assert dst.untyped_storage().nbytes() == nbytes
        assert nbytes == 0 or (dst.data_ptr() % 64 == 0 and 0 <= dst.data_ptr() - arena.data_ptr() < need)
        dst.copy_(src)
    for dst, src in zip(state_tensors(buffers), state_tensors(state), strict=True):
        assert torch.equal(dst, src)  # no buffer overwrote another
        saved = io.BytesIO()
        torch.save(dst, saved)
        assert saved.tell() < 4096  # the arena is 1 MiB
        assert torch.equal(torch.load(io.BytesIO(saved.getvalue())), src)
    assert carve(state, torch.zeros(need - 1, dtype=torch.uint8)) is None


def test_plan_chunks_groups_consecutive_buffers_that_fit_a_chunk():
    """`copy_to_host`'s grouping: buffers consecutive in address order share a chunk while
    their whole range (gaps included) fits; a larger buffer is alone; every index once;
    overlapping buffers are refused."""
    from ftrain.state.host_memory import plan_chunks

    assert plan_chunks([(0, 10), (64, 10), (128, 100), (1000, 10)], 200) == [[0, 1], [2], [3]]
    assert plan_chunks([(1000, 10), (0, 300), (400, 10), (420, 4)], 200) == [[1], [2, 3], [0]]
    assert plan_chunks([], 200) == []
    with pytest.raises(ValueError, match="overlap"):
        plan_chunks([(0, 100), (50, 10)], 200)


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_copy_to_host_is_the_per_tensor_copy_in_few_copies():
    """A state of CUDA tensors (bf16 and fp32, some larger than the staging buffer, an empty
    one) and CPU scalars, carved from a pinned arena (CUDA tensors first) and copied by
    `copy_to_host` on a side stream through a small staging buffer: every buffer equals its
    source, twice (the second time through the cached plan, after the sources changed)."""
    from ftrain.state.host_memory import carve, copy_to_host, pinned_empty, state_nbytes, state_tensors

    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"model": [torch.randn(n, device="cuda", generator=g).bfloat16() for n in (3, 1000, 17, 5000)],
             "optimizer": [[torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g),
                            torch.tensor(float(n))] for n in (7, 3000, 1)] + [[torch.zeros(0, device="cuda")]],
             "step": 3}
    into = carve(state, pinned_empty(state_nbytes(state)))
    staging = torch.empty(4096, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    for _ in range(2):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            copy_to_host(into, state, staging)
        stream.synchronize()
        for dst, src in zip(state_tensors(into), state_tensors(state), strict=True):
            assert torch.equal(dst, src.cpu())
        for x in state_tensors(state):
            x.add_(1)


def _cp_ranks(rank: int, world: int, store) -> dict:
    """One CP group of `world` gloo ranks: each computes per-token log-probs of its cp_split part
    of the same [B, S] batch, cp_gathers them, takes a loss every rank computes identically and
    backpropagates. Returns its kept positions, the gathered [B, S] values, the reference computed
    on the whole sequence, and the parameter gradient summed over the group / cp (Megatron's
    DDP average over the dp x cp group, dp=1) next to the whole-sequence gradient."""
    import torch.distributed as dist

    from ftrain.engines.megatron_ops import cp_gather, cp_split

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)  # the same batch and weights on every rank
    tokens = torch.randint(0, 11, (2, 4 * world))
    emb = torch.randn(11, 5)
    w = torch.randn(5, requires_grad=True)
    coef = torch.randn(2, 4 * world)

    def log_probs(t):  # [B, S] -> [B, S]: a per-token function, as the model's log p(token) is
        return torch.nn.functional.logsigmoid(emb[t] @ w)

    positions = cp_split(torch.arange(4 * world)[None], world, rank)[0].tolist()
    full = cp_gather(log_probs(cp_split(tokens, world, rank)), world, dist.group.WORLD)
    (full * coef).sum().backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)
    w.grad = None
    reference = log_probs(tokens)
    (reference * coef).sum().backward()
    dist.destroy_process_group()
    return {"positions": positions, "full": full.tolist(), "reference": reference.tolist(),
            "grad": (grad / world).tolist(), "reference_grad": w.grad.tolist()}


def test_context_parallel_log_probs_over_gloo():
    """Megatron's load-balanced CP layout (2*cp chunks, rank r keeps r and 2cp-1-r): the gathered
    per-token log-probs equal the whole-sequence ones, and the gradient averaged over the CP group
    equals the whole-sequence gradient (each rank's part receives cp times its gradient)."""
    results = spawn_ranks(_cp_ranks, 2, timeout_s=120)
    assert [r["positions"] for r in results] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    for r in results:
        assert r["full"] == r["reference"]
        assert r["grad"] == pytest.approx(r["reference_grad"], rel=1e-6, abs=1e-6)


def _log_probs_rank(rank: int, world: int, store) -> dict:
    """Rank `rank` of tp = `world` (fp32, gloo): the engine's token log-probs without RL (the
    model's own cross entropy, GPTModel's `labels` path) and the reference from the logits: the
    vocabulary shards gathered over TP, log-softmax, the next token's entry."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from test_megatron_peer_restore import _cfg

    from ftrain.engines.megatron_engine import MegatronEngine

    torch.set_num_threads(1)
    cfg = _cfg(1, world)
    dims = ParallelDims.from_config(cfg)
    engine = MegatronEngine(cfg)
    _join(engine, store, 1, rank, dims)
    batch = _batch(cfg, 1, dims, rank)
    engine.ddp.eval()
    ours = engine._behaviour_log_probs(engine.ddp, batch)
    with torch.no_grad():
        ids = batch.input_ids
        shard = engine.ddp(ids, torch.arange(ids.shape[1]).expand_as(ids), None)   # [B, S, V/tp]
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard)
        logp = F.log_softmax(torch.cat(parts, -1)[:, :-1, :cfg.model.vocab_size], -1)
        reference = F.pad(logp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    dist.destroy_process_group()
    return {"ours": ours.tolist(), "reference": reference.tolist()}


@pytest.mark.parametrize("tp", [1, 2])
def test_log_probs_without_rl_are_the_next_tokens_log_softmax(tp):
    """Without RL the loss takes the model's own (vocabulary-parallel) cross entropy, not the
    logits: column t of the log-probs is log p(token t | tokens before t), column 0 is 0, at
    tp = 1 and with the vocabulary split over tp = 2."""
    for r in spawn_ranks(_log_probs_rank, tp, timeout_s=180):
        ours, reference = torch.tensor(r["ours"]), torch.tensor(r["reference"])
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
        assert (ours[:, 0] == 0).all() and (ours[:, 1:] < 0).all()


def test_pinned_arena_is_exact_size_and_pinned_while_any_view_lives(monkeypatch):
    """`pinned_empty` registers exactly the bytes asked for (torch's pinned allocator would
    round 19.1 GB up to 34.4 GB) and unregisters them only once the last carved view is gone.
    CUDA's register / unregister calls are recorded by a stand-in (no GPU here)."""
    import gc
    import types

    from ftrain.state import host_memory
    from ftrain.state.host_memory import carve, pinned_empty, state_nbytes

    calls = []
    cudart = types.SimpleNamespace(
        cudaError=types.SimpleNamespace(success=0),
        cudaHostRegister=lambda ptr, n, flags: calls.append(("register", ptr, n, flags)) or 0,
        cudaHostUnregister=lambda ptr: calls.append(("unregister", ptr)) or 0)
    monkeypatch.setattr(host_memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: cudart)

    state = {"w": torch.randn(1000, 3), "m": torch.randn(1000, 3)}
    nbytes = state_nbytes(state)
    arena = pinned_empty(nbytes)
    assert calls == [("register", arena.data_ptr(), nbytes, 1)] and arena.numel() == nbytes == 24064
    views = carve(state, arena)
    del arena
    gc.collect()
    assert [c[0] for c in calls] == ["register"]  # the views still use the pinned pages
    views["m"].copy_(state["m"])
    assert torch.equal(views["m"], state["m"])
    del views
    gc.collect()
    assert [c[0] for c in calls] == ["register", "unregister"] and calls[1][1] == calls[0][1]

    failing = types.SimpleNamespace(cudaError=cudart.cudaError, cudaHostRegister=lambda ptr, n, flags: 2)
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: failing)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 64 bytes"):
        pinned_empty(64)


def test_spare_reserves_pinned_memory_only_with_headroom():
    """A spare reserves its snapshot memory when the host keeps >= 10% of its memory available
    afterwards, and skips the reservation (False) when it would not: no OOM kill of the ranks."""
    import types

    import psutil

    from ftrain.engines import megatron_checkpoint
    from ftrain.engines.megatron_engine import MegatronEngine

    spare = types.SimpleNamespace(_arena=None, _room=MegatronEngine._room)
    total, kept = psutil.virtual_memory().total, list(megatron_checkpoint._SAVE_ARENA)
    assert not MegatronEngine.reserve_host_memory(spare, total, total) and spare._arena is None
    assert megatron_checkpoint._SAVE_ARENA == kept  # neither reserved
    assert MegatronEngine.reserve_host_memory(spare, 4096, 2048)
    assert spare._arena.result().numel() == 4096
    assert megatron_checkpoint.take_save_arena(2048).numel() == 2048  # the async save's, reserved ahead
    assert MegatronEngine.reserve_host_memory(spare, 8192) and spare._arena.result().numel() == 4096  # kept


def _weighted_steps(rank, world, store, sets=()) -> list:
    """This rank trains two steps (token-mean, `loss_weights` as `Trainer.with_loss_weights`
    sets them) of the small GPT at the layout of `world` ranks and `sets`; returns [loss,
    grad_norm] of each step (the loss: this replica's share, dp x its part of the global
    mini-batch's)."""
    import dataclasses

    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.objectives.ppo import global_loss_weights

    cfg = _cfg(world=world, extra=("ppo.loss_agg_mode=token-mean", *sets))
    dims, t = ParallelDims.from_config(cfg), cfg.train
    engine = MegatronEngine(cfg)
    _join(engine, store, 1, rank, dims)
    out = []
    for step in (1, 2):
        full = _batch(cfg, step, ParallelDims(tp=1, pp=1, cp=1, dp=1), 0)
        w = global_loss_weights(full.loss_mask, "token-mean", t.mini_batch_size,
                                dims.dp * (t.mini_batch_size // dims.dp // t.micro_batch_size))
        mine = dataclasses.replace(full, loss_weights=w).strided(dims.coords(rank).dp, dims.dp)
        res = engine.train_step(mine, step)
        out += [res["loss"], res["grad_norm"]]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_the_micro_batch_split_does_not_change_the_training():
    """With the trainer's `loss_weights`, Megatron's pipeline schedule (which averages the
    micro-batches' losses) computes each mini-batch's token-mean over the whole mini-batch:
    micro-batches of 1 and of 2 rows give the same losses and gradient norms (the norm shows
    the gradient's scale, which Adam's update hides) within bf16 tolerance."""
    (one,) = spawn_ranks(_weighted_steps, 1, ("train.micro_batch_size=1",), timeout_s=600)
    (two,) = spawn_ranks(_weighted_steps, 1, ("train.micro_batch_size=2",), timeout_s=600)
    assert two == pytest.approx(one, rel=LOSS_RTOL), (one, two)


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 2, reason="needs 2 CUDA GPUs")
def test_the_dp_size_does_not_change_the_training():
    """The same at dp=2 (Megatron DDP averages the replicas' gradients) against dp=1: the
    replicas' mean loss and the (all-reduced, so common) gradient norm."""
    (one,) = spawn_ranks(_weighted_steps, 1, timeout_s=600)
    two = spawn_ranks(_weighted_steps, 2, timeout_s=600)
    mean = [(a + b) / 2 if i % 2 == 0 else a for i, (a, b) in enumerate(zip(*two))]
    assert mean == pytest.approx(one, rel=LOSS_RTOL), (one, two)


def _trained_step_1(rank, world, store):
    """(cfg, dims, engine): a Megatron engine of `_cfg(world=world)` joined as `rank` that trained step 1."""
    from ftrain.engines.megatron_engine import MegatronEngine

    cfg = _cfg(world=world)
    dims = ParallelDims.from_config(cfg)
    e = MegatronEngine(cfg)
    _join(e, store, 1, rank, dims)
    e.snapshot()
    e.train_step(_batch(cfg, 1, dims, rank), 1)
    return cfg, dims, e


def _keeper_ranks(rank, world, store) -> dict:
    """The engine's side of the shard keeper (keeper.py) with the distributed optimizer: the
    `start_shard_copy` of step 1 into a shared arena (pinned: asynchronous), overlapped with step
    2, holds step 1's shard; a rank put back
    at step 1 without its shard (world 1: the params from a host copy, the shard zeroed; world
    2: rank 1 reset to step 0 as a fresh spare, the params broadcast from rank 0, which rolled
    back) gets it back with `load_shard`: bitwise step 1's state, and step 2 trains the same."""
    from ftrain.state.host_memory import SharedArena, state_tensors

    cfg, dims, e = _trained_step_1(rank, world, store)
    step1, full = _digest(e), e._host_copy(e._train_state(), pin=False)
    copy = e.start_shard_copy(SharedArena(e.shard_nbytes()).tensor)  # as keeper.ShardSender's, pinned
    e.snapshot()
    second = e.train_step(_batch(cfg, 2, dims, rank), 2)
    copy.wait()
    out = {"pinned": copy.state["optimizer"][0][0].is_pinned(), "rollback": e.rollback(1) if world > 1 else e.load_state(full) is None}
    lost = world == 1 or rank == 1
    if lost:
        for x in state_tensors(e._shard_state()):
            x.zero_()
    if world > 1:
        if rank == 1:
            e.reset()
        e.broadcast_from(0)
    if lost:
        e.load_shard(copy.state)
    e.sync_params()  # the params of the rolled-back and broadcast states (`fault_tolerance` calls it)
    out["restored"] = _digest(e) == step1
    again = e.train_step(_batch(cfg, 2, dims, rank), 2)
    out["same_step_2"] = (second["loss"], second["grad_norm"]) == (again["loss"], again["grad_norm"])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_a_kept_shard_restores_a_rank_of_the_distributed_optimizer(world):
    if NGPU < world:
        pytest.skip(f"needs {world} CUDA GPU(s)")
    for res in spawn_ranks(_keeper_ranks, world):
        assert res == {"pinned": True, "rollback": True, "restored": True, "same_step_2": True}, res


def _rollback_from_kept_shard(rank, world, store) -> dict:
    """With the distributed optimizer and the keeper a rank's rollback snapshot (taken at the
    start of step 2) copies no tensor: it takes the optimizer shard from the keeper's copy of
    step 1 (`start_shard_copy`, a pinned shared arena) and no params; a rollback to step 1
    then `sync_params` (the params rebuilt from the shard's main params) is bitwise step 1's
    state, and step 2 trains the same again. One GPU has no DP peer: the rank keeps its
    rollback snapshot as one at dp >= 2 with the keeper does (`_keeps_rollback`)."""
    from ftrain.state.host_memory import SharedArena, state_tensors

    cfg, dims, e = _trained_step_1(rank, world, store)
    e._keeps_rollback = lambda: True
    step1 = _digest(e)
    arena = SharedArena(e.shard_nbytes())
    e.start_shard_copy(arena.tensor)
    e.snapshot()
    lo, hi = arena.tensor.data_ptr(), arena.tensor.data_ptr() + arena.nbytes
    in_arena = {part: sorted({lo <= x.data_ptr() < hi for x in state_tensors(e._snapshot[part])})
                for part in ("model", "optimizer") if part in e._snapshot}
    second = e.train_step(_batch(cfg, 2, dims, rank), 2)
    rolled_back = e.rollback(1)
    e.sync_params()
    out = {"in_arena": in_arena, "restored": rolled_back and _digest(e) == step1}
    again = e.train_step(_batch(cfg, 2, dims, rank), 2)
    out["same_step_2"] = (second["loss"], second["grad_norm"]) == (again["loss"], again["grad_norm"])
    return out


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_a_rollback_takes_the_optimizer_shard_from_the_keepers_copy():
    (res,) = spawn_ranks(_rollback_from_kept_shard, 1)
    assert res == {"in_arena": {"optimizer": [True]}, "restored": True, "same_step_2": True}, res


def _local_keeper_ranks(rank, world, store) -> dict:
    """The engine's side of the local keeper (keeper.py, dp = 1) with the distributed
    optimizer: `start_shard_copy(whole=True)` of step 1 into a pinned shared arena (after its
    seal), overlapped with step 2, holds step 1's whole state; with every live tensor zeroed, the
    state loaded through another mapping of the arena (`load_state`, as a replacement maps the
    holder's) is bitwise step 1's, and step 2 trains the same again."""
    from ftrain.state.host_memory import SEAL_BYTES, SharedArena, attach_shared, from_regions, regions, state_tensors

    cfg, dims, e = _trained_step_1(rank, world, store)
    step1 = _digest(e)
    arena = SharedArena(e.shard_nbytes(True) + SEAL_BYTES)
    arena.retire()
    copy = e.start_shard_copy(arena.tensor[SEAL_BYTES:], True)
    layout = regions(copy.state, arena.tensor)
    e.snapshot()
    second = e.train_step(_batch(cfg, 2, dims, rank), 2)
    copy.wait()
    arena.seal(1)
    out = {"pinned": copy.state["model"][0].is_pinned()}
    for x in state_tensors(e._train_state()):
        x.zero_()
    e.load_state(from_regions(layout, attach_shared(arena.path, arena.nbytes)))
    out["restored"] = _digest(e) == step1 and e.step == 1
    again = e.train_step(_batch(cfg, 2, dims, rank), 2)
    out["same_step_2"] = (second["loss"], second["grad_norm"]) == (again["loss"], again["grad_norm"])
    return out


@pytest.mark.gpu
def test_the_local_keeper_restores_a_rank_of_the_distributed_optimizer_at_dp1():
    if NGPU < 1:
        pytest.skip("needs a CUDA GPU")
    (res,) = spawn_ranks(_local_keeper_ranks, 1)
    assert res == {"pinned": True, "restored": True, "same_step_2": True}, res


def _generations_ranks(rank, world, store) -> dict:
    """20 membership generations of one engine, as a rank lives through them: half re-formed
    cleanly, half after an abort of the NCCL communicators (the failure path), each with a
    training step; what the process holds is read after the first and after the last: OS
    threads (NCCL's watchdog and proxy threads), open fds (sockets), GPU memory allocated and
    reserved, pinned host memory (the CUDA caching host allocator's current bytes)."""
    from ftrain.engines.megatron_engine import MegatronEngine

    cfg = _cfg()
    dims = ParallelDims.from_config(cfg)
    e = MegatronEngine(cfg)

    def held() -> dict:
        torch.cuda.synchronize()
        return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
                "gpu_allocated": torch.cuda.memory_allocated(), "gpu_reserved": torch.cuda.memory_reserved(),
                "pinned": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)}

    samples = []
    for gen in range(1, 22):
        if gen % 2 == 0:
            e.abort(5.0)
        _join(e, store, gen, rank, dims)
        e.snapshot()
        e.train_step(_batch(cfg, gen, dims, rank), gen)
        if gen in (2, 21):
            samples.append(held())
    return {"before": samples[0], "after": samples[1]}

def _ce_steps(rank, world, store, sets=()) -> dict:
    """This rank trains four `ce` steps of the small GPT on megatron-core's mock data (the
    trainer's global batch, `loss_weights` token-mean as `Trainer.with_loss_weights`, this
    replica's rows); returns the losses and how many behaviour (old log-prob) passes ran. At the
    default lr (1e-3) the loss falls ~0.4 in four steps; at 1e-2 it rises first (Adam overshoots)."""
    import dataclasses

    from ftrain.data.dataset import open_data
    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.objectives.ppo import global_loss_weights

    cfg = _cfg(world=world, extra=("train.objective=ce", "data.kind=mock", "train.lr=0.001", *sets))
    dims, t = ParallelDims.from_config(cfg), cfg.train
    data, engine = open_data(cfg), MegatronEngine(cfg)
    passes = []
    behaviour = engine._behaviour_log_probs
    engine._behaviour_log_probs = lambda *a, **k: (passes.append(1), behaviour(*a, **k))[1]
    _join(engine, store, 1, rank, dims)
    losses = []
    for step in range(1, t.steps + 1):
        full = data.batch(step)
        w = global_loss_weights(full.loss_mask, "token-mean", t.mini_batch_size,
                                dims.dp * (t.mini_batch_size // dims.dp // t.micro_batch_size))
        losses.append(engine.train_step(dataclasses.replace(full, loss_weights=w).strided(dims.coords(rank).dp, dims.dp),
                                        step)["loss"])
    return {"losses": losses, "behaviour_passes": len(passes)}


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_twenty_generations_leak_no_nccl_communicator_memory_or_socket():
    """NCCL on one GPU: 20 generations (half after an abort) hold no more threads, fds, GPU
    memory or pinned host memory than after the first ones (the CPU twin with gloo:
    `test_scenarios.py::test_twenty_generations_leak_no_threads_or_sockets`)."""
    (res,) = spawn_ranks(_generations_ranks, 1, timeout_s=300)
    b, a = res["before"], res["after"]
    assert a["threads"] <= b["threads"] + 1, res
    assert a["fds"] <= b["fds"] + 4, res
    assert a["gpu_allocated"] <= b["gpu_allocated"] and a["gpu_reserved"] <= b["gpu_reserved"] + (64 << 20), res
    assert a["pinned"] <= b["pinned"], res


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_ce_trains_on_mock_data_without_a_behaviour_pass():
    """The `ce` objective in the Megatron engine: no old-log-prob pass, the loss falls on
    megatron's (learnable) mock text, and micro-batches of 1 and 2 rows train the same within
    bf16 tolerance (the global token-mean)."""
    (one,) = spawn_ranks(_ce_steps, 1, ("train.micro_batch_size=1",), timeout_s=600)
    (two,) = spawn_ranks(_ce_steps, 1, ("train.micro_batch_size=2",), timeout_s=600)
    assert one["behaviour_passes"] == two["behaviour_passes"] == 0
    assert one["losses"][-1] < one["losses"][0] - 0.25, one
    assert two["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL), (one, two)


def _one_update_ppo_ranks(rank, world, store) -> dict:
    """Two one-update PPO steps (global = mini batch 8) of the small GPT; returns the behaviour
    passes that ran and each step's ratio metrics (the old log-probs are the training forward's)."""
    from ftrain.engines.megatron_engine import MegatronEngine

    cfg = _cfg(world=world, extra=("train.mini_batch_size=8",))
    dims, engine = ParallelDims.from_config(cfg), MegatronEngine(cfg)
    passes, behaviour = [], engine._behaviour_log_probs
    engine._behaviour_log_probs = lambda *a, **k: (passes.append(1), behaviour(*a, **k))[1]
    _join(engine, store, 1, rank, dims)
    out = [engine.train_step(_batch(cfg, step, dims, rank), step) for step in (1, 2)]
    return {"passes": len(passes), "steps": [{k: o[k] for k in ("loss", "ppo_kl", "pg_clipfrac")} for o in out]}


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
def test_one_update_ppo_runs_no_behaviour_pass():
    """PPO with one optimizer update per step: no old-log-prob pass; the ratio is exactly 1
    (ppo_kl 0, nothing clipped) and the loss finite."""
    (res,) = spawn_ranks(_one_update_ppo_ranks, 1, timeout_s=600)
    assert res["passes"] == 0, res
    for s in res["steps"]:
        assert s["ppo_kl"] == 0.0 and s["pg_clipfrac"] == 0.0 and s["loss"] == s["loss"], res
