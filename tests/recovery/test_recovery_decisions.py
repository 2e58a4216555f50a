"""The recovery protocol's decisions as pure functions, over tables of cases (no Ray, no
processes): which restore source serves a failure (`fault_tolerance.plan_restore`) and which
spare takes each failed rank (`actor_group.BackupPool.take_for`). The end-to-end tests with real
actors (test_recovery.py, test_fault_tolerance.py, test_node_loss.py) check that the protocol
carries these plans out."""
import pytest

from ftrain.control.actor_group import BackupPool
from ftrain.control.actor_slot import ActorSlot
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.failures import RecoveryError
from ftrain.recovery.fault_tolerance import (grow_back_size, plan_memory_restore, plan_peer_restore, plan_restore,
                                             same_shard, scratch_restart_refusal)

DP4 = ParallelDims(tp=1, pp=1, cp=1, dp=4).group_ranks("dp")       # [[0, 1, 2, 3]]
TP2_DP2 = ParallelDims(tp=2, pp=1, cp=1, dp=2).group_ranks("dp")   # [[0, 2], [1, 3]]


@pytest.mark.parametrize("dp_groups, survivors, clean, expected", [
    # one rank of a DP group replaced: the source and the new member only
    (DP4, {0, 2, 3}, {0, 2, 3}, [(0, [0, 1], [0, 1])]),
    # two new members, two survivors: a subgroup of three
    (DP4, {2, 3}, {2, 3}, [(2, [2, 0, 1], [2, 0, 1])]),
    # only the source survived: the whole group takes part (members None)
    (DP4, {3}, {3}, [(3, [0, 1, 2, 3], None)]),
    # a whole replica of tp=2 lost: each DP group has one survivor, the whole group takes part
    (TP2_DP2, {0, 1}, {0, 1}, [(0, [0, 2], None), (1, [1, 3], None)]),
    # a survivor could not roll back (no snapshot of the committed step): impossible
    (DP4, {0, 2, 3}, {0, 2}, None),
    # a DP group with no survivor: impossible
    (TP2_DP2, {0, 2}, {0, 2}, None),
    # nothing replaced: nothing to broadcast
    (DP4, {0, 1, 2, 3}, {0, 1, 2, 3}, []),
])
def test_peer_restore_plan(dp_groups, survivors, clean, expected):
    assert plan_peer_restore(dp_groups, survivors, clean) == expected


@pytest.mark.parametrize("dp_groups, survivors, expected", [
    # dp=3, one rank lost: the third member calls too (the Megatron engine broadcasts over its DP group)
    (ParallelDims(tp=1, pp=1, cp=1, dp=3).group_ranks("dp"), {0, 2}, [(0, [0, 1, 2], None)]),
    # dp=4 tp=2, two ranks of one DP group lost: that group calls whole, the other makes no call
    (ParallelDims(tp=2, pp=1, cp=1, dp=4).group_ranks("dp"), {0, 1, 3, 5, 6, 7}, [(0, [0, 2, 4, 6], None)]),
])
def test_peer_restore_without_subgroups_calls_whole_dp_groups(dp_groups, survivors, expected):
    assert plan_peer_restore(dp_groups, survivors, survivors, subgroups=False) == expected


TP2_DP3 = ParallelDims(tp=2, pp=1, cp=1, dp=3)   # ranks: tp fastest, dp slowest
TP2_DP2 = ParallelDims(tp=2, pp=1, cp=1, dp=2)


@pytest.mark.parametrize("before, before_dims, after, after_dims, expected", [
    # nothing moved
    (list("abcd"), TP2_DP2, list("abcd"), TP2_DP2, {0, 1, 2, 3}),
    # a spare at rank 1: new, not a survivor
    (list("abcd"), TP2_DP2, list("aXcd"), TP2_DP2, {0, 2, 3}),
    # shrink dp 3 -> 2 dropping replica 0 (a, b): replicas 1 and 2 move down a DP index, same shards
    (list("abcdef"), TP2_DP3, list("cdef"), TP2_DP2, {0, 1, 2, 3}),
    # ... and in the same recovery d fails and b (tp 1 of the dropped replica) takes its place:
    # same tp coordinate, so b holds the right shard
    (list("abcdef"), TP2_DP3, list("cbef"), TP2_DP2, {0, 1, 2, 3}),
    # c fails instead and b (tp 1) takes rank 0 (tp 0): another shard, not a survivor
    (list("abcdef"), TP2_DP3, list("bdef"), TP2_DP2, {1, 2, 3}),
    # two survivors swap tp positions: neither holds its shard
    (list("abcd"), TP2_DP2, list("bacd"), TP2_DP2, {2, 3}),
])
def test_survivors_are_the_ranks_that_kept_their_shard(before, before_dims, after, after_dims, expected):
    assert same_shard(before, before_dims, after, after_dims) == expected


@pytest.mark.parametrize("committed, clean, held, floor, expected", [
    # the replaced rank's snapshot of the committed step is held: only it loads
    (4, {0, 2, 3}, [{3, 4}, {3, 4}, {3, 4}, {3, 4}], 2, (4, [1])),
    # the committed step is missing for a rank that needs it: the newest common older step, for all
    (4, {0, 2, 3}, [{3, 4}, {3}, {3, 4}, {3, 4}], 2, (3, [0, 1, 2, 3])),
    # the common step is older than the newest checkpoint: no memory restore
    (4, {0, 2, 3}, [{1, 4}, {1}, {1, 4}, {1, 4}], 2, None),
    # a rank holds nothing at all
    (4, set(), [{4}, set(), {4}, {4}], 0, None),
    # every rank rolled back locally: nothing to load
    (4, {0, 1}, [set(), set()], 0, (4, [])),
])
def test_memory_restore_plan(committed, clean, held, floor, expected):
    assert plan_memory_restore(committed, clean, held, lambda: floor) == expected


def test_a_memory_restore_of_the_committed_step_reads_no_checkpoint_list():
    """The newest checkpoint's step is asked for (a storage read) only when the snapshots lack
    the committed step."""
    assert plan_memory_restore(4, {0}, [{4}, {4}], _never) == (4, [1])


def _never():
    raise AssertionError("asked although a cheaper source serves")


@pytest.mark.parametrize("mode, survivors, clean, held, source, step", [
    ("auto", {0, 2, 3}, {0, 2, 3}, _never, "peer", 4),                   # peer first
    ("auto", {0, 2, 3}, {0}, lambda: [{4}] * 4, "memory", 4),            # peer impossible -> memory
    ("auto", {0, 2, 3}, {0}, lambda: [set()] * 4, "checkpoint", None),   # neither -> checkpoint
    ("auto", {0, 2, 3}, {0}, None, "checkpoint", None),                  # no holders
    ("memory", {0, 2, 3}, {0, 2, 3}, lambda: [{4}] * 4, "memory", 4),    # mode memory skips peers
    ("checkpoint", {0, 2, 3}, set(), _never, "checkpoint", None),
    ("peer", {0, 2, 3}, {0, 2, 3}, _never, "peer", 4),
])
def test_restore_source_is_the_cheapest_the_mode_allows(mode, survivors, clean, held, source, step):
    plan = plan_restore(mode, 4, DP4, survivors, clean, held, lambda: 0)
    assert (plan.source, plan.step) == (source, step)


DP1 = ParallelDims(tp=1, pp=1, cp=1, dp=1).group_ranks("dp")       # [[0]]
TP2_DP1 = ParallelDims(tp=2, pp=1, cp=1, dp=1).group_ranks("dp")   # [[0], [1]]


@pytest.mark.parametrize("groups, survivors, clean, local, floor, held, source, step, ranks", [
    # dp=1, the rank lost once its node's holder kept the committed step: that step, no step lost
    (DP1, set(), set(), [{4, 5}], 2, _never, "local", 5, [0]),
    # killed inside the copy window of step 5: step 4 (one step re-run), not the checkpoint
    (DP1, set(), set(), [{3, 4}], 2, _never, "local", 4, [0]),
    # ... unless the newest checkpoint is newer than every kept step
    (DP1, set(), set(), [{3, 4}], 5, lambda: [set()], "checkpoint", None, []),
    # the replacement runs on another node than the holder that keeps the state: none there
    (DP1, set(), set(), [set()], 2, lambda: [{5}], "memory", 5, [0]),
    # tp=2 dp=1, rank 0 lost, rank 1 rolled back locally: rank 0 alone loads the committed step
    (TP2_DP1, {1}, {1}, [{4, 5}, set()], 2, _never, "local", 5, [0]),
    # ... the survivor could not roll back (Megatron's distributed optimizer) and rank 0's copy
    # of step 5 was in flight: both positions load step 4, the newest both have (never mixed)
    (TP2_DP1, {1}, set(), [{3, 4}, {4, 5}], 2, _never, "local", 4, [0, 1]),
])
def test_at_dp1_the_local_keeper_serves_before_snapshots_and_checkpoints(groups, survivors, clean, local, floor,
                                                                        held, source, step, ranks):
    plan = plan_restore("auto", 5, groups, survivors, clean, held, lambda: floor, local=lambda: local)
    assert (plan.source, plan.step, plan.ranks) == (source, step, ranks)
    assert "peer restore impossible" in plan.notes  # no DP peer at dp=1


DP2 = ParallelDims(tp=1, pp=1, cp=1, dp=2).group_ranks("dp")       # [[0, 1]]


@pytest.mark.parametrize("survivors, kept, floor, from_shards, source, step, ranks", [
    # dp=2, rank 1 replaced, its keeper holds the committed step: a peer gives the params
    ({0}, [{4, 5}, {4, 5}], 2, True, "peer+keeper", 5, [1]),
    # rank 1's copy of step 5 was in flight: every rank loads step 4 from its keeper (one step re-run)
    ({0}, [{4, 5}, {3, 4}], 2, True, "keeper", 4, [0, 1]),
    # ... not older than the newest checkpoint, which is then as good
    ({0}, [{4, 5}, {3, 4}], 5, True, "checkpoint", None, []),
    # ... nor for an engine that cannot make its params from the shards (the torch engine's ZeRO-1)
    ({0}, [{4, 5}, {3, 4}], 2, False, "checkpoint", None, []),
    # the whole DP group lost (one node held it): no peer, the keepers (on other nodes) serve step 5
    (set(), [{4, 5}, {4, 5}], 2, True, "keeper", 5, [0, 1]),
])
def test_with_a_sharded_optimizer_the_keepers_serve_where_no_peer_can(survivors, kept, floor, from_shards,
                                                                     source, step, ranks):
    plan = plan_restore("auto", 5, DP2, survivors, survivors, None, lambda: floor, kept=lambda: kept,
                        params_from_shards=from_shards)
    assert (plan.source, plan.step, plan.ranks) == (source, step, ranks)


@pytest.mark.parametrize("mode, held, match", [
    ("peer", None, "restore=peer"),
    ("memory", lambda: [set()] * 4, "restore=memory"),
])
def test_a_mode_that_cannot_serve_the_failure_is_an_error(mode, held, match):
    with pytest.raises(RecoveryError, match=match):
        plan_restore(mode, 4, DP4, {0, 2, 3}, {0}, held, lambda: 0)


@pytest.mark.parametrize("committed, allowed, stops", [
    (0, False, False),   # nothing committed: step 0 loses nothing
    (3, False, True),    # committed steps and no source: stop, say why
    (3, True, False),    # the user opted in to a restart from the initial state
])
def test_a_restart_from_scratch_stops_the_run_unless_opted_in(committed, allowed, stops):
    refusal = scratch_restart_refusal(committed, allowed, ["peer restore impossible"])
    assert (refusal is not None) == stops
    if stops:
        assert "committed step 3" in refusal and "peer restore impossible" in refusal
        assert "fault_tolerance.allow_restart_from_scratch=true" in refusal and "\n" not in refusal


@pytest.mark.parametrize("dp, spares, per_replica, expected", [
    (2, 2, 1, 4),      # both missing replicas filled: back to the configured dp
    (2, 1, 1, None),   # one spare for two missing replicas: wait (no partial grow)
    (2, 3, 2, None),   # tp=2: two replicas need 4 ranks
    (2, 4, 2, 4),
    (4, 5, 1, None),   # not shrunk: nothing to grow
])
def test_dp_grows_back_only_to_the_configured_size_when_spares_fill_it(dp, spares, per_replica, expected):
    assert grow_back_size(dp, 4, spares, per_replica) == expected


def _slot(node: str, gpu: int, bundle: int) -> ActorSlot:
    return ActorSlot(None, node, node, [gpu], bundle)


def test_spares_go_away_from_the_failed_node_and_onto_free_devices():
    """Rank 1 on node A fails: the spare on node B's free GPU wins over the one on A and over the
    one on a GPU a survivor uses. Both ranks of node B fail: the spare on A goes first, then one
    on B (no other node is left), each on its own device."""
    workers = [_slot("A", 0, 0), _slot("A", 1, 1), _slot("B", 0, 2), _slot("B", 1, 3)]
    on_a, busy_b, free_b = _slot("A", 2, 4), _slot("B", 0, 5), _slot("B", 2, 6)
    pool = BackupPool([on_a, busy_b, free_b])
    assert pool.take_for({1}, workers) == {1: free_b}
    pool = BackupPool([on_a, busy_b, free_b])
    assert pool.take_for({2, 3}, workers) == {2: on_a, 3: busy_b}
    assert pool.spares == [free_b]


def test_too_few_spares_take_nothing():
    workers = [_slot("A", 0, 0), _slot("A", 1, 1)]
    pool = BackupPool([_slot("B", 0, 2)])
    with pytest.raises(ValueError, match="2 rank"):
        pool.take_for({0, 1}, workers)
    assert len(pool) == 1
