"""Failure-domain placement (`assign_roles`) on synthetic ActorSlots (no Ray), the spare pool's
choice of spare, and the scale benchmark's log-log fit."""
import itertools

import pytest

from fault_tolerance import BackupPool
from megatron_actor import ActorSlot, assign_roles, placement_report


def slots(nodes: int, gpus: int, per_gpu: int = 1, cpu: bool = False, extra: dict | None = None):
    """`nodes` nodes of `gpus` devices with `per_gpu` slots each (cpu: devices are bundles);
    `extra`: node index -> different device count. Bundle indices interleave nodes as Ray does."""
    out, b = [], 0
    counts = {n: (extra or {}).get(n, gpus) for n in range(nodes)}
    for k, g in itertools.product(range(per_gpu), range(max(counts.values()))):
        for n in range(nodes):
            if g < counts[n]:
                out.append(ActorSlot(None, f"10.0.0.{n}", f"node{n:02d}", [] if cpu else [g], b))
                b += 1
    return out


def check(all_slots, num_workers):
    workers, spares = assign_roles(all_slots, num_workers)
    assert len(workers) == num_workers and len(spares) == len(all_slots) - num_workers
    assert {id(s) for s in workers} | {id(s) for s in spares} == {id(s) for s in all_slots}
    return workers, spares


def per_node(group):
    out = {}
    for s in group:
        out[s.node_id] = out.get(s.node_id, 0) + 1
    return out


@pytest.mark.parametrize("nodes,gpus,workers,cpu", [
    (2, 8, 8, False), (4, 8, 24, False), (8, 8, 48, False), (16, 8, 112, False),
    (3, 2, 2, True), (4, 2, 6, True), (4, 16, 48, True), (5, 4, 15, False)])
def test_spares_cover_any_single_node_loss(nodes, gpus, workers, cpu):
    all_slots = slots(nodes, gpus, cpu=cpu)
    w, s = check(all_slots, workers)
    wn, sn = per_node(w), per_node(s)
    # The pool is at least one node's slots here, so every node's loss is covered ...
    assert len(s) >= max(wn.get(n, 0) + sn.get(n, 0) for n in wn)
    for n in wn:
        assert len(s) - sn.get(n, 0) >= wn[n], (n, wn, sn)
    # ... and spares are spread evenly (at most one apart), not packed on the last node.
    counts = [sn.get(f"node{n:02d}", 0) for n in range(nodes)]
    assert max(counts) - min(counts) <= 1, counts
    assert all("covered by" in line for line in placement_report(w, s))


def test_ranks_follow_node_then_device_order():
    w, _ = check(slots(4, 8), 24)
    keys = [(s.node_ip, s.gpu_ids[0]) for s in w]
    assert keys == sorted(keys)
    assert len({s.device for s in w}) == 24  # one rank per GPU


def test_shared_gpus_keep_one_worker_per_gpu():
    # gpus_per_actor=0.5: two slots per GPU; workers take one slot of every GPU first.
    w, s = check(slots(2, 4, per_gpu=2), 8)
    assert len({s.device for s in w}) == 8
    assert per_node(s) == {"node00": 4, "node01": 4}


def test_uneven_nodes_and_small_pool_reported():
    w, s = check(slots(3, 8, extra={2: 4}), 19)  # 20 slots, 1 spare: a node loss is not covered
    assert len(s) == 1
    lines = placement_report(w, s)
    assert len(lines) == 3 and sum("NOT covered" in x for x in lines) == 3


def test_single_node_keeps_old_split():
    all_slots = slots(1, 8, cpu=True)
    w, s = check(all_slots, 4)
    assert [x.bundle_index for x in w] == [0, 1, 2, 3] and [x.bundle_index for x in s] == [4, 5, 6, 7]


def test_more_workers_than_devices_fills_devices_first():
    # 2 nodes x 2 GPUs x 2 slots, 6 workers: every GPU has a worker before any GPU gets two.
    w, s = check(slots(2, 2, per_gpu=2), 6)
    assert len({x.device for x in w}) == 4


def test_pool_take_prefers_other_node_and_fullest_node():
    sp = [ActorSlot(None, "a", "A", [], 1), ActorSlot(None, "b", "B", [], 2), ActorSlot(None, "b", "B", [], 3)]
    pool = BackupPool(sp)
    assert pool.take({"A"}, set()).node_id == "B"
    assert pool.take(set(), set()).node_id in {"A", "B"}
    pool = BackupPool(sp)
    assert pool.take({"B"}, set()).node_id == "A"
    assert pool.take({"B"}, set()).node_id == "B"  # none elsewhere: any
    assert pool.take(set(), set()).node_id == "B" and pool.take(set(), set()) is None


def test_loglog_slope():
    from scale import loglog_slope

    assert loglog_slope([8, 16, 32, 64], [1, 1, 1, 1]) == pytest.approx(0)
    assert loglog_slope([8, 16, 32, 64], [8, 16, 32, 64]) == pytest.approx(1)
