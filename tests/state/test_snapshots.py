"""In-memory snapshots: a host copy is exactly one committed step's state even while the next
step runs beside it, a snapshot reaches a holder whole or not at all, and a slow send makes the
next snapshot skipped (counted), not waited for."""
import os
import signal
import threading
import time

import pytest
import ray
import torch
import torch.distributed as dist

from ftrain.config import load_config, resolve
from ftrain.data.training_batch import synthetic_batch
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.engines.engine import state_digest
from ftrain.engines.torch_engine import TorchEngine
from ftrain.failures import StaleGenerationError, first_generation
from ftrain.state.host_memory import HostCopy
from ftrain.state.keeper import LocalMaps, ShardSender, load_local, local_key
from ftrain.state.snapshots import SnapshotHolder, SnapshotSender, from_wire, wire_parts


@pytest.fixture
def engine(tmp_path):
    """A TorchEngine of config.yaml's model in a gloo world of one rank (this process)."""
    cfg = resolve(load_config("config.yaml", ["cluster.num_workers=1", "cluster.num_spares=0",
                                              f"run_dir={tmp_path}"]), num_gpus=0)
    e = TorchEngine(cfg)
    e.connect(dist.HashStore(), ParallelDims.from_world(1), 0)
    yield e
    dist.destroy_process_group()


def batch(e, step):
    t = e.cfg.train
    return synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, e.cfg.model.vocab_size)


def test_a_host_copy_is_the_committed_step_while_the_next_step_races_it(engine):
    """The copy of step 1 is held up half-way (fault point `mid_snapshot`) for 2 s while step 2
    runs: step 2's forward and backward run beside it, its update waits for the copy (an
    update that did not would come during the hold and tear the copy), so the copy holds step
    1's state bitwise, and step 2 trains as it would without the copy."""
    engine.train_step(batch(engine, 1), 1)
    step1 = state_digest(engine._train_state())
    updated, during_hold = threading.Event(), []

    def hold_up_the_copy(point):
        if point == "after_optimizer_step":
            updated.set()
        elif point == "mid_snapshot":
            start = engine.progress
            during_hold.append((updated.wait(timeout=2.0), engine.progress > start))

    engine.fault_point = hold_up_the_copy
    copy = engine.start_host_copy()
    engine.train_step(batch(engine, 2), 2)
    copy.wait()
    assert during_hold == [(False, True)] and copy.state["step"] == 1  # (no update, micro-batches ran)
    assert state_digest(copy.state) == step1
    step2 = state_digest(engine._train_state())
    engine.load_state(copy.state)  # back to step 1, then step 2 again: the same state
    assert state_digest(engine._train_state()) == step1
    engine.fault_point = lambda point: None
    engine.train_step(batch(engine, 2), 2)
    assert state_digest(engine._train_state()) == step2


def test_a_copy_interrupted_midway_fails_and_training_goes_on(engine):
    engine.train_step(batch(engine, 1), 1)

    def fail(point):
        raise RuntimeError(f"injected at {point}")

    engine.fault_point = fail
    copy = engine.start_host_copy()
    with pytest.raises(RuntimeError, match="host copy of step 1 failed"):
        copy.wait()
    engine.fault_point = lambda point: None
    engine.train_step(batch(engine, 2), 2)  # the failed copy blocks nothing
    assert engine.step == 2


def test_a_holder_keeps_only_snapshots_whose_parts_all_arrived(ray_session):
    """A send cut short after some parts (its rank died) is never returned by `get` nor listed
    by `steps`; the next complete snapshot of the rank drops it."""
    g = torch.Generator().manual_seed(0)
    state = {"model": [torch.randn(64, generator=g) for _ in range(4)], "step": 5}
    meta, parts = wire_parts(state, part_bytes=2 * 64 * 4)
    assert len(parts) == 2
    holder = SnapshotHolder.remote(keep=2)
    key = ("dims", 0)
    ray.get(holder.put_part.remote(key, 5, 0, 2, meta, parts[0]))
    assert ray.get(holder.get.remote(key, 5)) is None and ray.get(holder.steps.remote()) == {}
    state6 = {"model": [x + 1 for x in state["model"]], "step": 6}
    meta6, parts6 = wire_parts(state6, part_bytes=2 * 64 * 4)
    for i, part in enumerate(parts6):
        ray.get(holder.put_part.remote(key, 6, i, 2, meta6 if i == 0 else None, part))
    assert ray.get(holder.steps.remote()) == {key: [6]}
    back = from_wire(ray.get(holder.get.remote(key, 6)))
    assert back["step"] == 6 and all(torch.equal(a, b) for a, b in zip(back["model"], state6["model"]))
    assert ray.get(holder.__ray_call__.remote(lambda h: h._partial)) == {}  # step 5's part dropped
    ray.kill(holder)


def test_a_rewind_drops_the_abandoned_timeline_and_its_late_parts(ray_session):
    """Steps 3 and 4 are held, step 5's first part has arrived (sent in generation 1) when the
    run rewinds to step 2 in generation 2: the holder drops steps 3-5 and the rest of step 5's
    send, keeps the history both timelines share, and takes the new timeline's step 3 (which,
    as the lowest of three steps, would otherwise have been dropped on arrival)."""
    state = {"model": [torch.zeros(64), torch.zeros(64)], "step": 0}
    meta, parts = wire_parts(state, part_bytes=64 * 4)
    holder = SnapshotHolder.remote(keep=3)
    key = ("dims", 0)
    for step in (2, 3, 4):
        for i, part in enumerate(parts):
            ray.get(holder.put_part.remote(key, step, i, 2, meta if i == 0 else None, part, 1))
    ray.get(holder.put_part.remote(key, 5, 0, 2, meta, parts[0], 1))
    ray.get(holder.drop_after.remote(2, 2))
    ray.get(holder.put_part.remote(key, 5, 1, 2, None, parts[1], 1))  # the old send's last part, late
    assert ray.get(holder.steps.remote()) == {key: [2]}
    assert ray.get(holder.__ray_call__.remote(lambda h: h._partial)) == {}
    for i, part in enumerate(parts):
        ray.get(holder.put_part.remote(key, 3, i, 2, meta if i == 0 else None, part, 2))
    assert ray.get(holder.steps.remote()) == {key: [2, 3]}
    ray.kill(holder)


def test_a_superseded_drivers_sends_and_rewind_are_refused(ray_session):
    """Generations carry their driver's lease epoch (`failures.first_generation`). Once a send
    of epoch 2 has reached the holder, a late send of epoch 1 is dropped and a rewind of epoch
    1 (a driver superseded inside its recovery) is refused (StaleGenerationError), dropping
    nothing; within one epoch, a rewind of a generation older than the last rewind's is
    refused too, and the driver holding the lease rewinds as before."""
    state = {"model": [torch.zeros(64)], "step": 0}
    meta, parts = wire_parts(state)
    holder, key = SnapshotHolder.remote(keep=3), ("dims", 0)
    old, new = first_generation(1) + 5, first_generation(2) + 1
    ray.get(holder.put_part.remote(key, 4, 0, 1, meta, parts[0], old))
    ray.get(holder.put_part.remote(key, 5, 0, 1, meta, parts[0], new))
    ray.get(holder.put_part.remote(key, 6, 0, 1, meta, parts[0], old))  # the old driver's rank, late
    assert ray.get(holder.steps.remote()) == {key: [4, 5]}
    with pytest.raises(StaleGenerationError, match="refused"):
        ray.get(holder.drop_after.remote(3, old))
    assert ray.get(holder.steps.remote()) == {key: [4, 5]}
    ray.get(holder.drop_after.remote(4, new + 1))
    with pytest.raises(StaleGenerationError):
        ray.get(holder.drop_after.remote(3, new))
    assert ray.get(holder.steps.remote()) == {key: [4]}
    ray.kill(holder)


@pytest.fixture
def frozen_holder(ray_session):
    """A SnapshotHolder whose process is stopped (SIGSTOP: a cut-off or frozen keeper; no call
    is answered and none fails), continued and killed after the test."""
    holder = SnapshotHolder.remote()
    pid = ray.get(holder.__ray_call__.remote(lambda h: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    yield holder
    os.kill(pid, signal.SIGCONT)
    ray.kill(holder)


def returns_within(fn, timeout_s: float):
    """`fn()`'s result; fails when it has not returned within `timeout_s` seconds (a hang)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert out, f"{fn} did not return within {timeout_s} s"
    return out[0]


def test_a_frozen_keeper_never_stalls_a_rank(engine, frozen_holder):
    """Each of a rank's calls to a holder that answers nothing ends after the holder timeout:
    the keeper's steps go on, the connection and the copies fail (counted), the copies of the
    next `QUIET_TIMEOUTS` timeouts are skipped without a call; a restore from it finds nothing
    (the next source is tried); a spare's mapping ahead stops; a memory snapshot fails. Before
    the timeouts, each of these waited forever."""
    timeout_s = 0.5
    sender = ShardSender(timeout_s)
    sender.connect(frozen_holder, whole=True, adopt=True)
    key = local_key("L", 0, "node")
    for step in range(1, 7):  # both buffers' sends time out, then the quiet skips the rest
        engine.train_step(batch(engine, step), step)
        returns_within(lambda: sender.after_step(engine, frozen_holder, key, step), 10)
    returns_within(sender.wait, 10)
    counts = sender.counts()
    assert counts["sent"] == 0 and counts["failed"] >= 1 and counts["skipped"] >= 1, counts
    assert counts["failed"] + counts["skipped"] == 6, counts
    assert returns_within(lambda: load_local(engine, frozen_holder, key, 6, timeout_s), 10) is None
    maps = LocalMaps(timeout_s)
    maps.start(frozen_holder)
    time.sleep(0.1)
    returns_within(maps.close, 10)
    snapshots = SnapshotSender(timeout_s)
    snapshots.send(frozen_holder, ("dims", 0), 6, engine.start_host_copy())
    returns_within(snapshots.wait, 10)
    assert snapshots.counts() == {"sent": 0, "skipped": 0, "failed": 1}


def test_a_snapshot_due_while_one_is_in_flight_is_skipped_not_waited_for(ray_session):
    """The sender's copy does not finish until released: `busy()` stays true, so the caller
    skips (and counts) the next snapshots; once released, the send completes."""
    holder = SnapshotHolder.remote(keep=2)
    ray.get(holder.steps.remote())  # started: its actor's start is not the sender's timeout to wait for
    release = threading.Event()
    sender = SnapshotSender(5.0)
    sender.send(holder, ("dims", 0), 1, HostCopy({"model": [torch.ones(8)], "step": 1}, release.wait))
    for step in (2, 3):
        assert sender.busy()
        sender.skip(step)
    release.set()
    deadline = time.monotonic() + 30
    while sender.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.counts() == {"sent": 1, "skipped": 2, "failed": 0}
    assert ray.get(holder.steps.remote()) == {("dims", 0): [1]}
    ray.kill(holder)


def _send(holder, key, step, state, part_bytes):
    """Every part of `state` to `holder` as (`key`, `step`), one call at a time."""
    meta, parts = wire_parts(state, part_bytes=part_bytes)
    for i, part in enumerate(parts):
        ray.get(holder.put_part.remote(key, step, i, len(parts), meta if i == 0 else None, part))
    return len(parts)


def _equal(wire_state, state) -> bool:
    back = from_wire(wire_state)
    return back["step"] == state["step"] and all(torch.equal(a, b) for a, b in zip(back["model"], state["model"]))


def test_a_holder_pins_nothing_in_the_object_store_once_a_part_is_put(ray_session):
    """Parts of 2 MB go through Ray's object store; the holder copies each into memory of its
    own, so once its snapshots are complete no object of its process is pinned (a holder that
    kept zero-copy views pinned every part it kept: the store filled, docs/recovery.md)."""
    from ray._private.internal_api import memory_summary

    holder = SnapshotHolder.remote(keep=2)
    key, sender = ("dims", 0), SnapshotSender(5.0, part_bytes=2 << 20)
    states = {s: {"model": [torch.full((1 << 18,), float(s + i)) for i in range(4)], "step": s} for s in (1, 2, 3)}
    for step, state in states.items():
        sender.send(holder, key, step, HostCopy(state, lambda: None))
        deadline = time.monotonic() + 30
        while sender.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sender.counts() == {"sent": 3, "skipped": 0, "failed": 0}
    assert ray.get(holder.steps.remote()) == {key: [2, 3]}
    pid = ray.get(holder.__ray_call__.remote(lambda h: __import__("os").getpid()))
    rows = memory_summary(ray.get_runtime_context().gcs_address, units="MB").splitlines()
    assert [r for r in rows if f"| {pid} " in r and "PINNED_IN_MEMORY" in r] == []
    assert all(_equal(ray.get(holder.get.remote(key, s)), states[s]) for s in (2, 3))
    ray.kill(holder)


def test_a_holder_reuses_the_dropped_snapshots_buffers_and_never_those_it_holds(ray_session):
    """Steps 1-4, then part 1 of 2 of step 5 (its sender died): step 4 is copied into the very
    arrays step 1 had (dropped when step 3 completed), step 5's part into step 2's; the steps
    held (3, 4) stay bitwise theirs, step 5 stays invisible, and a result `get` returned before
    its buffers were reused (step 1) is unchanged."""
    key, part_bytes = ("dims", 0), 2 * 64 * 4
    g = torch.Generator().manual_seed(0)
    states = {s: {"model": [torch.randn(64, generator=g) for _ in range(4)], "step": s} for s in range(1, 6)}
    holder = SnapshotHolder.remote(keep=2)
    for step in (1, 2, 3):
        assert _send(holder, key, step, states[step], part_bytes) == 2
        if step == 1:
            got1 = ray.get(holder.get.remote(key, 1))

    def probe(h):  # keep the spare arrays alive: an identity check, not an address that can recur
        h.probe = list(h._spare[key].values())
        return len(h.probe)

    assert ray.get(holder.__ray_call__.remote(probe)) == 4  # step 1's arrays
    _send(holder, key, 4, states[4], part_bytes)
    reused = ray.get(holder.__ray_call__.remote(
        lambda h: sorted(i for i, p in enumerate(h.probe) for w in h.snaps[key][4]["model"] if w.array is p)))
    assert reused == [0, 1, 2, 3]
    ray.get(holder.__ray_call__.remote(probe))  # step 2's arrays
    meta, parts = wire_parts(states[5], part_bytes=part_bytes)
    ray.get(holder.put_part.remote(key, 5, 0, 2, meta, parts[0]))
    assert ray.get(holder.__ray_call__.remote(
        lambda h: sum(w.array is p for p in h.probe for _, w in h._partial[(key, 5)][0][1]))) == 2
    assert ray.get(holder.steps.remote()) == {key: [3, 4]} and ray.get(holder.get.remote(key, 5)) is None
    assert all(_equal(ray.get(holder.get.remote(key, s)), states[s]) for s in (3, 4))
    assert _equal(got1, states[1])
    ray.kill(holder)
