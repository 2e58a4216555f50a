"""Scenarios reported by people running such systems, restated as tests (real Ray actors, real
gloo groups, real processes killed and stopped)."""
import datetime
import gc
import multiprocessing
import os
import signal
import threading
import time

import ray
import torch
import torch.distributed as dist

from config import load_config, resolve
from megatron_actor import MegatronActorGroup, recording_new_sockets, shutdown_sockets
from storage_servers import free_port
from trainer import Trainer


def make_cfg(tmp_path, *overrides):
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "train.steps=4", "checkpoint.interval=1",
        "fault_tolerance.health_timeout_s=3", "fault_tolerance.min_step_timeout_s=10",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", *overrides]), num_gpus=0)


def _resources(handle) -> dict:
    """OS threads (native ones too: gloo/NCCL workers, Ray's pools) and open fds of an actor."""
    return ray.get(handle.__ray_call__.remote(lambda self: {
        "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}))


def test_twenty_generations_leak_no_threads_or_sockets(ray_session, tmp_path):
    group = MegatronActorGroup(make_cfg(tmp_path, "cluster.num_spares=0"))
    try:
        trainer = Trainer(group.cfg, group)
        trainer.train(1)
        group.form_generation()
        before = [_resources(s.handle) for s in group.workers]
        for i in range(20):  # half clean re-forms, half after an abort (the failure path)
            if i % 2:
                ray.get([s.handle.abort.remote() for s in group.workers])
            group.form_generation()
        trainer.train(2)     # the 22nd generation still trains
        after = [_resources(s.handle) for s in group.workers]
    finally:
        group.shutdown()
    for b, a in zip(before, after):
        assert a["threads"] <= b["threads"] + 1, (b, a)
        assert a["fds"] <= b["fds"] + 4, (b, a)


def test_briefly_unreachable_actor_is_not_replaced(ray_session, tmp_path):
    """SIGSTOP freezes rank 1 (control thread too) for 2 s, less than health_timeout_s."""
    group = MegatronActorGroup(make_cfg(tmp_path, "cluster.num_spares=1"))
    try:
        trainer = Trainer(group.cfg, group)
        trainer.train(1)
        pid = ray.get(group.workers[1].handle.info.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(2.0, os.kill, (pid, signal.SIGCONT)).start()
        trainer.train(3)
        assert not trainer.recoveries and len(group.pool) == 1
    finally:
        group.shutdown()


def test_killed_mid_checkpoint_write_uses_previous_checkpoint(ray_session, tmp_path):
    """Rank 0 (which writes the model shard) dies after its first shard of step 2 is written:
    step 2 is never committed; recovery from checkpoint uses step 1 and replays step 2."""
    cfg = make_cfg(tmp_path, "cluster.num_spares=2", "fault_tolerance.restore=checkpoint",
                   "chaos.events=[{step: 2, rank: 0, kind: kill, point: mid_save}]")
    group = MegatronActorGroup(cfg)
    try:
        trainer = Trainer(cfg, group)
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

    cfg = make_cfg(tmp_path, "cluster.num_spares=0", "checkpoint.interval=0")
    first = MegatronActorGroup(cfg)
    try:
        Trainer(cfg, first).train(1)
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
        second = MegatronActorGroup(cfg)
        try:
            trainer = Trainer(cfg, second)
            trainer.train(2)
            assert second.store_port != old_port and second.generation == 1
            assert not trainer.recoveries and len(trainer.losses) == 2
        finally:
            second.shutdown()
    finally:
        squatter.close()


def _gloo_rank(rank: int, port: int, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    sockets: dict[int, str] = {}
    with recording_new_sockets(sockets):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=300))
    if rank == 0:
        errors: list[str] = []

        def all_reduce():
            try:
                dist.all_reduce(torch.ones(4))
            except RuntimeError as e:
                errors.append(str(e))

        t = threading.Thread(target=all_reduce, daemon=True)
        t.start()
        t.join(1.0)
        blocked = t.is_alive()
        shut = shutdown_sockets(sockets)
        t.join(20.0)
        out.put({"blocked_before": blocked, "shut": shut, "freed": not t.is_alive(), "errors": errors})
        store.set("done", "1")
    else:  # hung but alive: never enters the collective, keeps its sockets open
        store.wait(["done"])
    out.close()
    out.join_thread()
    os._exit(0)  # no process-group teardown at exit: the point is what happened above


def test_abort_frees_a_gloo_collective_whose_peer_is_alive_but_hung():
    """gloo has no abort of its own: without `shutdown_sockets` a rank waiting in an all-reduce on
    a hung (not dead) peer stays blocked until the group's timeout (300 s here)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert result["blocked_before"] and result["shut"] >= 1, result
    assert result["freed"], result
    assert result["errors"] and "closed" in result["errors"][0].lower(), result
