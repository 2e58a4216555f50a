"""Scenarios reported by people running such systems, restated as tests (real Ray actors, real
gloo groups, real processes killed and stopped)."""
import datetime
import gc
import math
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ftrain.config import load_config, resolve
from ftrain.distributed.comms import recording_new_sockets, shutdown_sockets

from ranks import spawn_ranks

# ray, actor_group and trainer are imported by the tests that use them: each spawned rank
# below imports this module, ~1 s of CPU less each without them.


def make_cfg(tmp_path, *overrides):
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "train.steps=4", "checkpoint.interval=1",
        "fault_tolerance.health_timeout_s=3", "fault_tolerance.min_step_timeout_s=10",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", *overrides]), num_gpus=0)


def _resources(handle) -> dict:
    """OS threads (native ones too: gloo/NCCL workers, Ray's pools) and open fds of an actor."""
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: {
        "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}))


def test_twenty_generations_leak_no_threads_or_sockets(ray_session, tmp_path):
    import ray

    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    group = ActorGroup(MegatronActor, make_cfg(tmp_path, "cluster.num_spares=0"))
    try:
        trainer = Trainer(group.cfg, group, CheckpointManager.from_config(group.cfg.checkpoint))
        trainer.train(1)
        group.form_generation()
        before = [_resources(s.handle) for s in group.workers]
        for i in range(20):  # half clean re-forms, half after an abort (the failure path)
            if i % 2:
                ray.get([s.handle.abort.remote(group.generation) for s in group.workers])
            group.form_generation()
        trainer.train(2)     # the 22nd generation still trains
        after = [_resources(s.handle) for s in group.workers]
    finally:
        group.shutdown()
    for b, a in zip(before, after):
        assert a["threads"] <= b["threads"] + 1, (b, a)
        assert a["fds"] <= b["fds"] + 4, (b, a)


def test_briefly_unreachable_actor_is_not_replaced(ray_session, tmp_path):
    """SIGSTOP freezes rank 1 (control thread too) for 2 s, less than health_timeout_s. No spare:
    had rank 1 been judged dead, its replacement would stop the run (RecoveryError)."""
    import ray

    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    group = ActorGroup(MegatronActor, make_cfg(tmp_path, "cluster.num_spares=0"))
    try:
        trainer = Trainer(group.cfg, group, CheckpointManager.from_config(group.cfg.checkpoint))
        trainer.train(1)
        pid = ray.get(group.workers[1].handle.info.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(2.0, os.kill, (pid, signal.SIGCONT)).start()
        trainer.train(3)
        assert not trainer.recoveries
    finally:
        group.shutdown()


# sync (slow): test_recovery.py restores past a half-written checkpoint in CI
@pytest.mark.parametrize("async_save", [pytest.param(False, marks=pytest.mark.slow), True])
def test_killed_mid_checkpoint_write_uses_previous_checkpoint(ray_session, tmp_path, async_save):
    """Rank 0 (which writes the model shard) dies between writing files of step 2 and the commit
    (sync: after its first shard; async: after the background write, before the commit): step 2
    is never committed; recovery from checkpoint uses step 1 and replays step 2."""
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    # an async save of step 2 is finished (and would be committed) after step 3 has run
    cfg = make_cfg(tmp_path, "cluster.num_spares=1", "fault_tolerance.restore=checkpoint",
                   "fault_tolerance.refill_spares=false", f"checkpoint.async_save={str(async_save).lower()}",
                   f"chaos.events=[{{step: {3 if async_save else 2}, rank: 0, kind: kill, point: mid_save}}]")
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(3)
    finally:
        group.shutdown()
    (tl,) = trainer.recoveries
    assert tl.restore_source == "checkpoint step 1" and 2 in trainer.replayed
    assert trainer.replayed[2] == [trainer.losses[2]]
    assert trainer.checkpoints == [1, 2, 3]  # step 2 committed only after its replay


def test_new_group_forms_while_old_store_port_is_in_time_wait_or_taken(ray_session, tmp_path):
    """The driver's rendezvous store binds port 0 (the OS picks a free one) and every generation
    uses a prefix of that one store, so no fixed port is ever re-bound. Here a run ends (its
    store's connections go to TIME_WAIT), another program takes that exact port, and a new run
    forms its generation and trains at once."""
    import socket

    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    # One rank a run: its connection to the store is what goes to TIME_WAIT.
    cfg = make_cfg(tmp_path, "cluster.num_workers=1", "cluster.num_spares=0", "checkpoint.interval=0")
    first = ActorGroup(MegatronActor, cfg)
    try:
        Trainer(cfg, first, CheckpointManager.from_config(cfg.checkpoint)).train(1)
        old_port = first.store_port
    finally:
        first.shutdown()
    del first  # the store closes; its accepted connections are in TIME_WAIT
    gc.collect()
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # binds despite TIME_WAIT
    try:
        squatter.bind(("", old_port))  # another program now listens on the old port
        squatter.listen()
        second = ActorGroup(MegatronActor, cfg)
        try:
            trainer = Trainer(cfg, second, CheckpointManager.from_config(cfg.checkpoint))
            trainer.train(2)
            assert second.store_port != old_port and second.generation == 1
            assert not trainer.recoveries and len(trainer.losses) == 2
        finally:
            second.shutdown()
    finally:
        squatter.close()



def _blocked_after(fn, catch: type, seconds: float = 1.0) -> tuple[threading.Thread, list[str], bool]:
    """Run `fn` in a daemon thread (as an engine's compute thread), collecting the messages of
    the `catch` exceptions it raises; returns the thread, those messages and whether it was
    still running `seconds` later."""
    errors: list[str] = []

    def run():
        try:
            fn()
        except catch as e:
            errors.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return t, errors, t.is_alive()


def _gloo_rank(rank: int, world: int, store) -> dict:
    sockets: dict[int, str] = {}
    with recording_new_sockets(sockets):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    if rank == 1:  # hung but alive: never enters the collective, keeps its sockets open
        try:
            store.wait(["done"])
        except dist.DistNetworkError:  # the store's host ended right after rank 0 set "done"
            pass
        return {}
    t, errors, blocked = _blocked_after(lambda: dist.all_reduce(torch.ones(4)), RuntimeError)
    shut = shutdown_sockets(sockets)
    t.join(20.0)
    store.set("done", "1")
    return {"blocked_before": blocked, "shut": shut, "freed": not t.is_alive(), "errors": errors}


def test_abort_frees_a_gloo_collective_whose_peer_is_alive_but_hung():
    """gloo has no abort of its own: without `shutdown_sockets` a rank waiting in an all-reduce on
    a hung (not dead) peer stays blocked until the group's timeout (300 s here)."""
    result = spawn_ranks(_gloo_rank, 2, timeout_s=120)[0]
    assert result["blocked_before"] and result["shut"] >= 1, result
    assert result["freed"], result
    assert result["errors"] and "closed" in result["errors"][0].lower(), result


def _send_rank(rank: int, world: int, store) -> dict:
    """Rank 0 sends 256 MB to rank 1, which posts no receive, and rank 0's sockets are shut down
    while the send waits (what the torch engine's `abort` does)."""
    from types import SimpleNamespace

    from ftrain.distributed.comms import left_collective

    sockets: dict[int, str] = {}
    with recording_new_sockets(sockets):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=10))
    big = torch.ones(64 * 2**20)
    if rank == 1:
        store.wait(["done"], datetime.timedelta(seconds=60))
        return {}
    work = dist.isend(big, 1)
    engine, errors = SimpleNamespace(in_collective=True), []  # as the engine's compute thread

    def wait():
        try:
            work.wait()
        except RuntimeError as e:
            errors.append(str(e))
        finally:
            engine.in_collective = False

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(2.0)  # the send is pending by now
    shutdown_sockets(sockets)
    left = left_collective(engine, 3.0)
    store.set("done", "1")
    t.join(30.0)
    return {"left": left, "errors": errors}


def test_the_socket_shutdown_frees_a_pending_gloo_send():
    """A gloo send waiting for a receive is freed at once when `shutdown_sockets` shuts its
    connection down, and `left_collective` sees the compute thread leave within its grace."""
    freed = spawn_ranks(_send_rank, 2, timeout_s=120)[0]
    assert freed["left"] and freed["errors"] and "closed" in freed["errors"][0].lower(), freed


def test_left_collective_waits_for_the_compute_thread_within_its_grace():
    """`comms.left_collective`: True as soon as the compute thread leaves its collective, False
    (after the grace, not later) when it does not; a rank then gets replaced."""
    from types import SimpleNamespace

    from ftrain.distributed.comms import left_collective

    engine = SimpleNamespace(in_collective=True)
    threading.Timer(0.2, setattr, (engine, "in_collective", False)).start()
    t0 = time.monotonic()
    assert left_collective(engine, 5.0) and time.monotonic() - t0 < 4.0
    engine.in_collective = True
    t0 = time.monotonic()
    assert not left_collective(engine, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0


def _engine_stuck_rank(rank: int, world: int, store, cfg) -> dict:
    """Rank 0 all-reduces, waiting as the torch engine waits for its collectives
    (`TorchEngine._wait`); rank 1 never joins and its sockets stay open, so nothing frees the
    collective before gloo's timeout (10 s): it stands for the send above that outlives the
    socket shutdown. Then the rest of an abort (engine interrupted, groups dropped from
    torch's registry, engine disconnected) and a next generation in which both ranks train
    a step while the stuck group is still kept."""
    from torch.distributed.distributed_c10d import _abort_process_group

    from ftrain.data.training_batch import synthetic_batch
    from ftrain.distributed.comms import left_collective
    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines.engine import Interrupted
    from ftrain.engines.torch_engine import TorchEngine

    dist.init_process_group("gloo", store=dist.PrefixStore("gen1", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=10))
    engine, out = TorchEngine(cfg), {}
    if rank == 0:
        engine.dp_group = dist.group.WORLD

        def step():
            with engine._collective():
                engine._wait(dist.all_reduce(torch.ones(4), async_op=True))

        _, raised, blocked = _blocked_after(step, Interrupted)
        engine.interrupt()
        left = left_collective(engine, 3.0)
        work = engine._work
        out = {"blocked": blocked, "left": left, "raised": raised}
    hung_group = dist.group.WORLD if rank == 1 else None  # alive and hung: its sockets stay open
    _abort_process_group()
    engine.disconnect()  # destroying the group would join gloo's worker thread (stuck until 10 s)
    engine.connect(dist.PrefixStore("gen2", store), ParallelDims(1, 1, 2, 1), rank)
    t = cfg.train
    batch = synthetic_batch(t.seed, 1, t.global_batch_size, t.seq_len, cfg.model.vocab_size)
    loss = engine.train_step(batch.strided(rank, world), 1)["loss"]
    if rank == 0:
        out.update(still_stuck_after_next_step=not work.is_completed(), retired=len(engine._retired), loss=loss)
        store.set("checked", "1")
        store.wait(["seen"], datetime.timedelta(seconds=60))  # rank 0 hosts the store: stay until rank 1 read it
    else:
        store.wait(["checked"], datetime.timedelta(seconds=60))
        store.set("seen", "1")
    del hung_group
    return out


def test_the_torch_engine_leaves_a_collective_that_gloo_does_not_free(tmp_path):
    """An interrupted torch engine's compute thread leaves its collective even when gloo keeps
    it (no replacement needed). `disconnect` keeps the stuck group alive instead of
    destroying it, which would wait for gloo's timeout (its work is still pending after the
    next generation's step), and that kept group does not disturb the next generation."""
    cfg = make_cfg(tmp_path, "cluster.num_workers=2")
    out = spawn_ranks(_engine_stuck_rank, 2, cfg, timeout_s=120)[0]
    assert out["blocked"] and out["left"] and out["raised"], out
    assert out["still_stuck_after_next_step"] and out["retired"] == 1, out
    assert math.isfinite(out["loss"]), out


def test_a_survivor_still_in_a_collective_after_the_abort_is_replaced(ray_session, tmp_path):
    """The abort round (`HealthMonitor.abort_survivors`) names a survivor whose abort reports its
    compute thread still inside a collective (the gloo case above), so recovery replaces it
    instead of waiting for its step."""
    import ray

    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    group = ActorGroup(MegatronActor, make_cfg(tmp_path, "cluster.num_spares=0", "fault_tolerance.health_timeout_s=1"))
    try:
        Trainer(group.cfg, group, CheckpointManager.from_config(group.cfg.checkpoint)).train(1)
        stuck = group.workers[1].handle
        ray.get(stuck.__ray_call__.remote(lambda self: setattr(self.engine, "in_collective", True)))
        assert group.health.abort_survivors(set()) == {1}
        group.kill({1}, injected=False)
        # ray.kill is asynchronous: a ping sent just after it may still be served
        deadline, killed = time.monotonic() + 30, False
        while not killed and time.monotonic() < deadline:
            try:
                ray.get(stuck.ping.remote(), timeout=30)
                time.sleep(0.2)
            except ray.exceptions.RayActorError:
                killed = True
        assert killed  # to be replaced by a spare
        assert ray.get(group.workers[0].handle.ping.remote(), timeout=30)["rank"] == 0
    finally:
        group.shutdown()


def _interrupted_steps(rank: int, world: int, store, cfg) -> dict:
    from ftrain.data.training_batch import synthetic_batch
    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines.engine import Interrupted
    from ftrain.engines.torch_engine import TorchEngine

    engine = TorchEngine(cfg)
    engine.connect(dist.PrefixStore("gen1", store), ParallelDims(1, 1, 1, 1), rank)
    t = cfg.train
    batch = synthetic_batch(t.seed, 1, t.global_batch_size, t.seq_len, cfg.model.vocab_size)
    weights = [p.detach().clone() for p in engine.module.parameters()]
    raised = {}
    # an abort arriving before the step's forward (at the fault point just before it) ...
    engine.fault_point = lambda point: engine.interrupt() if point == "before_allreduce" else None
    try:
        engine.train_step(batch, 1)
    except Interrupted as e:
        raised["forward"] = str(e)
    grads_after_forward_stop = sum(p.grad is not None for p in engine.module.parameters())
    engine.fault_point = lambda point: None
    engine.disconnect()
    engine.connect(dist.PrefixStore("gen2", store), ParallelDims(1, 1, 1, 1), rank)  # the next generation: cleared
    # ... and one arriving when the forward is done: the first gradient stops the backward
    # (the training forward: the one with autograd on; old log-probs are computed without)
    hook = engine.module.register_forward_hook(lambda *_: engine.interrupt() if torch.is_grad_enabled() else None)
    try:
        engine.train_step(batch, 1)
    except Interrupted as e:
        raised["backward"] = str(e)
    hook.remove()
    unchanged = all(torch.equal(a, b.detach()) for a, b in zip(weights, engine.module.parameters()))
    engine.disconnect()
    engine.connect(dist.PrefixStore("gen3", store), ParallelDims(1, 1, 1, 1), rank)
    loss = engine.train_step(batch, 1)["loss"]
    return {"raised": raised, "grads_after_forward_stop": grads_after_forward_stop, "unchanged": unchanged,
            "loss": loss}


def test_abort_interrupts_the_running_step_of_the_torch_engine(tmp_path):
    """An aborted generation's step stops at the next module (forward) or gradient (backward)
    without updating the weights; once the next generation is joined, steps run again."""
    # one micro-batch, one optimizer step: an uninterrupted backward would end the step
    cfg = make_cfg(tmp_path, "cluster.num_workers=1", "train.mini_batch_size=16", "train.micro_batch_size=16")
    out = spawn_ranks(_interrupted_steps, 1, cfg, timeout_s=120)[0]
    assert set(out["raised"]) == {"forward", "backward"}, out
    assert out["grads_after_forward_stop"] == 0, out  # stopped in the forward, before any backward
    assert out["unchanged"], out
    assert math.isfinite(out["loss"]), out


def _gradients_under_two_packings(rank: int, world: int, store, cfg) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ftrain.engines.torch_engine import TorchEngine

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    engine = TorchEngine(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len),
                        generator=torch.Generator().manual_seed(rank))
    grads = []
    # DDP's first iteration packs in reverse parameter order; from the second on, in the order
    # the gradients were ready (what a run has that was not re-wrapped by a recovery)
    for iterations in (2, 1):
        ddp = DDP(engine.module, init_sync=False)
        ddp.register_comm_hook(dist.group.WORLD, engine._allreduce_hook)
        for _ in range(iterations):
            engine.module.zero_grad(set_to_none=True)
            # gradients of very different size per rank, so the order of the sum shows in the bits
            (ddp(input_ids=ids).logits.float().square().mean() * 10.0 ** (3 * rank)).backward()
        grads.append([p.grad.clone() for p in engine.module.parameters()])
        del ddp
        gc.collect()  # the next wrapper's reducer must be the only one on these parameters
    return all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_gradient_average_does_not_depend_on_the_bucket_packing(tmp_path):
    """4 gloo ranks: the same backward under a DDP wrapper in its first iteration and one in its
    second (buckets re-packed in gradient-ready order) gives bitwise equal averaged gradients
    (`TorchEngine._allreduce_hook` lays them out in parameter order), as a recovery's re-wrap needs."""
    cfg = make_cfg(tmp_path, "cluster.num_workers=4")
    assert spawn_ranks(_gradients_under_two_packings, 4, cfg, timeout_s=180) == [True] * 4
