"""Failure-domain placement (`assign_roles`) on synthetic ActorSlots (no Ray), the spare pool's
choice of spare, and the scale benchmark's log-log fit (`python -m bench.scale --merge`, which
runs nothing)."""
import itertools
import json

import pytest

from ftrain.control.actor_group import BackupPool, assign_roles, placement_report
from ftrain.control.actor_slot import ActorSlot

from conftest import run_bench


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
    assert BackupPool(sp).take(set(), set()).node_id == "B"  # from the node holding the most spares
    pool = BackupPool(sp)
    assert pool.take({"B"}, set()).node_id == "A"
    assert pool.take({"B"}, set()).node_id == "B"  # none elsewhere: any
    assert pool.take(set(), set()).node_id == "B" and pool.take(set(), set()) is None


def scale_run(path, cores, rows):
    """An earlier `bench.scale` run at `path` (JSON, and its _fit.json with the host's `cores`)
    of `rows`: (n, failure, total_s), the total in the restore phase; returns the path."""
    phases = {"detect_s": 0.0, "abort_s": 0.0, "replace_s": 0.0, "rebuild_s": 0.0, "first_step_s": 0.0,
              "first_step_excess_s": 0.0}
    path.write_text(json.dumps([{"n": n, "failure": failure, "failed_ranks": 1, **phases, "restore_s": total,
                                 "control_s": total, "total_s": total} for n, failure, total in rows]))
    path.with_name(path.stem + "_fit.json").write_text(json.dumps({"cores": cores}))
    return str(path)


def test_loglog_slope(tmp_path):
    """The fit's slope of total_s against N: 0 for a flat phase (actor rows), 1 for a linear one
    (node rows)."""
    ns = [8, 16, 32, 64]
    run = scale_run(tmp_path / "run.json", 2, [(n, "actor", 1) for n in ns] + [(n, "node", n) for n in ns])
    run_bench("scale", "--merge", run, "--out", str(tmp_path / "merged.json"))
    slope = {f: v["slope"]["total_s"] for f, v in json.loads((tmp_path / "merged_fit.json").read_text())["fit"].items()}
    assert slope["actor"] == pytest.approx(0)
    assert slope["node"] == pytest.approx(1)


def test_merge_fits_runs_of_one_host_together_and_refuses_two_hosts(tmp_path):
    """`python -m bench.scale --merge` runs nothing: the rows of earlier runs are fitted together
    (N=8 from one run, N=64 from the other), and runs of hosts with different core counts
    are refused."""
    a = scale_run(tmp_path / "a.json", 32, [(8, "actor", 0.2)])
    b = scale_run(tmp_path / "b.json", 32, [(64, "actor", 0.3)])
    out = tmp_path / "merged.json"
    run_bench("scale", "--merge", a, b, "--out", str(out))
    assert [r["n"] for r in json.loads(out.read_text())] == [8, 64]
    fit = json.loads((tmp_path / "merged_fit.json").read_text())
    assert fit["cores"] == 32 and fit["merged_from"] == [a, b]
    assert fit["fit"]["actor"]["ratio_max_min"]["total_s"] == pytest.approx(1.5)
    refused = run_bench("scale", "--merge", a, scale_run(tmp_path / "c.json", 2, [(64, "actor", 0.3)]),
                        "--out", str(out), check=False)
    assert refused.returncode != 0 and "different hosts" in refused.stderr


def tp_groups_inside_nodes(workers, tp: int) -> bool:
    """Every TP group (ranks tp*k .. tp*k + tp - 1, tp fastest in Megatron's order) on one node."""
    return all(len({s.node_id for s in workers[k:k + tp]}) == 1 for k in range(0, len(workers), tp))


@pytest.mark.parametrize("nodes,gpus,per_gpu,workers,tp", [
    (2, 8, 1, 8, 2), (2, 8, 1, 8, 4), (2, 8, 1, 8, 8), (2, 8, 1, 12, 4), (2, 8, 1, 4, 2),
    (2, 8, 2, 16, 8), (3, 3, 1, 6, 2), (4, 8, 1, 24, 4), (2, 8, 1, 8, 2)])
def test_tp_groups_stay_inside_a_node(nodes, gpus, per_gpu, workers, tp):
    """2 x 8 GPUs and others, tp 2/4/8 (pp = 2 when workers = 2 x tp x dp: the same rule, since
    TP groups are consecutive ranks): every node holds whole TP groups, no two ranks share a
    GPU while one is free, and the spares stay spread over nodes as far as whole groups allow."""
    w, s = assign_roles(slots(nodes, gpus, per_gpu), workers, tp)
    assert len(w) == workers and tp_groups_inside_nodes(w, tp)
    assert all(n % tp == 0 for n in per_node(w).values())
    assert len({x.device for x in w}) == workers  # a GPU each
    counts = [per_node(s).get(f"node{n:02d}", 0) for n in range(nodes)]
    assert max(counts) - min(counts) <= tp, counts  # spread as evenly as whole TP groups allow


def test_tp_group_too_big_for_a_node_is_refused():
    with pytest.raises(ValueError, match="tensor-parallel groups of 4 ranks cannot all stay inside one node"):
        assign_roles(slots(2, 3), 4, tp=4)


def test_a_tp_rank_is_replaced_on_its_groups_node_or_with_a_warning(caplog):
    """tp=2 over 2 nodes x 4 GPUs: rank 1 (TP peer: rank 0 on node A) takes the spare on A,
    not the one on B, though today's DP rule prefers another node; with no spare on A it takes
    B's and says that the group's all-reduce now crosses nodes."""
    from ftrain.distributed.parallel_dims import ParallelDims

    dims = ParallelDims(tp=2, pp=1, cp=1, dp=2)
    workers = [ActorSlot(None, "a", "A", [g], g) for g in range(2)] + [ActorSlot(None, "b", "B", [g], 4 + g) for g in range(2)]
    on_a, on_b = ActorSlot(None, "a", "A", [2], 2), ActorSlot(None, "b", "B", [2], 6)
    assert BackupPool([on_a, on_b]).take_for({1}, workers, dims) == {1: on_a}
    assert BackupPool([on_b, on_a]).take_for({1}, workers, dims) == {1: on_a}
    caplog.clear()
    assert BackupPool([on_b]).take_for({1}, workers, dims) == {1: on_b}
    assert "its TP group [0, 1] runs on node A" in caplog.text and "crosses nodes" in caplog.text
    # The whole group lost (node A): both replacements on one node.
    pool = BackupPool([ActorSlot(None, "c", "C", [0], 8), ActorSlot(None, "b", "B", [3], 7),
                       ActorSlot(None, "c", "C", [1], 9)])
    chosen = pool.take_for({0, 1}, workers, dims)
    assert chosen[0].node_id == chosen[1].node_id == "C"
