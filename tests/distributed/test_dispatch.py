import pytest
import torch

import dispatch
from dispatch import MeshDispatch, PassThroughDispatch, get_dispatch_type, register, register_dispatch_type
from ftrain.data.training_batch import TrainingBatch
from ftrain.distributed import fanout
from ftrain.distributed.fanout import Dispatch, dispatch_remote
from ftrain.distributed.parallel_dims import ParallelDims


def numbered_batch(b: int, s: int = 3) -> TrainingBatch:
    """Sequence i has every input id equal to i, so a chunk tells which sequences it holds."""
    ids = torch.arange(b).unsqueeze(1).expand(b, s).contiguous()
    return TrainingBatch(
        input_ids=ids,
        attention_mask=torch.ones(b, s, dtype=torch.int64),
        loss_mask=torch.zeros(b, s),
        advantages=torch.zeros(b, s),
    )


LAYOUTS = [
    ParallelDims(tp=tp, pp=pp, cp=cp, dp=dp)
    for dp in (1, 2, 4)
    for tp, cp, pp in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 1, 3)]
]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_mini_batches_do_not_depend_on_dp(dp):
    """Mini-batch k cut from every replica's local rows (as the engines do) is the same set of
    global rows at every DP size, so shrinking DP does not change the optimizer updates."""
    b, minis = 16, 2
    parts = MeshDispatch.split(ParallelDims(tp=1, pp=1, cp=1, dp=dp), (numbered_batch(b),), {})
    for k in range(minis):
        rows = sorted(r for args, _ in parts for r in args[0].chunk(minis)[k].input_ids[:, 0].tolist())
        assert rows == list(range(k * b // minis, (k + 1) * b // minis))


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
def test_mesh_split_gives_each_replica_its_rows(dims):
    b = 8
    batch, extra, flag = numbered_batch(b), numbered_batch(b), object()
    parts = MeshDispatch.split(dims, (batch, flag), {"other": extra, "lr": 0.5})
    assert len(parts) == dims.world_size
    for rank, (args, kwargs) in enumerate(parts):
        d = (rank // (dims.tp * dims.cp)) % dims.dp  # Megatron: tp fastest, then cp, dp, pp
        expected = list(range(d, b, dims.dp))
        assert args[0].input_ids[:, 0].tolist() == expected
        assert kwargs["other"].input_ids[:, 0].tolist() == expected
        assert args[1] is flag and kwargs["lr"] == 0.5


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
def test_mesh_collect_takes_last_stage_tp0_cp0_per_replica(dims):
    results = [f"r{r}" for r in range(dims.world_size)]
    stride = dims.tp * dims.cp
    expected = [f"r{(dims.pp - 1) * stride * dims.dp + d * stride}" for d in range(dims.dp)]
    assert MeshDispatch.collect(dims, results) == expected


def test_mesh_explicit_layout():
    dims = ParallelDims(tp=2, pp=2, cp=1, dp=2)
    parts = MeshDispatch.split(dims, (numbered_batch(4),), {})
    assert [p[0][0].input_ids[0, 0].item() for p in parts] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert MeshDispatch.collect(dims, list(range(8))) == [4, 6]


def test_mesh_split_not_divisible():
    dims = ParallelDims(tp=1, pp=1, cp=1, dp=4)
    with pytest.raises(ValueError, match="6 sequences.*dp=4"):
        MeshDispatch.split(dims, (), {"batch": numbered_batch(6)})


def test_collect_wrong_length():
    dims = ParallelDims(tp=2, pp=1, cp=1, dp=2)
    for cls in (MeshDispatch, PassThroughDispatch):
        with pytest.raises(ValueError, match="3 results"):
            cls.collect(dims, [0, 1, 2])


def test_pass_through():
    dims = ParallelDims(tp=2, pp=1, cp=1, dp=3)
    batch = numbered_batch(5)
    parts = PassThroughDispatch.split(dims, (batch, 1), {"k": "v"})
    assert len(parts) == 6
    assert all(a[0] is batch and a[1] == 1 and kw == {"k": "v"} for a, kw in parts)
    assert PassThroughDispatch.collect(dims, list("abcdef")) == list("abcdef")


def test_registry(monkeypatch):
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    assert get_dispatch_type("mesh") is MeshDispatch
    assert get_dispatch_type("pass_through") is PassThroughDispatch
    with pytest.raises(KeyError, match="mesh.*pass_through"):
        get_dispatch_type("nope")

    class Custom(PassThroughDispatch):
        pass

    register_dispatch_type("custom", Custom)
    register_dispatch_type("custom", Custom)  # same class again: fine
    assert get_dispatch_type("custom") is Custom
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_type("mesh", Custom)
    with pytest.raises(TypeError):
        register_dispatch_type("bad", object)
    with pytest.raises(TypeError):
        register_dispatch_type("bad", MeshDispatch())



def test_a_method_declares_its_dispatch_and_the_group_reads_it():
    """`dispatch.register(NAME)` marks a method; `fanout.dispatch_of` reads it from the class a
    Ray actor class wraps (as `ActorGroup.call` does) or from a plain class; a method with no
    declared dispatch is a TypeError naming it, an unknown name a KeyError at definition."""
    import ray

    class Rank:
        @register("mesh")
        def train_step(self, generation, step, batch=None):
            return step

        def ping(self):
            return True

    assert fanout.dispatch_of(Rank, "train_step") is MeshDispatch
    assert fanout.dispatch_of(ray.remote(Rank), "train_step") is MeshDispatch
    with pytest.raises(TypeError, match=r"Rank\.ping declares no dispatch"):
        fanout.dispatch_of(ray.remote(Rank), "ping")
    with pytest.raises(KeyError, match="unknown dispatch type 'nope'"):
        register("nope")


def test_the_rank_actor_declares_the_dispatch_of_every_method_the_driver_calls():
    from megatron_actor import MegatronActor

    for method in ("train_step", "generate"):
        assert fanout.dispatch_of(MegatronActor, method) is MeshDispatch
    for method in ("save_checkpoint", "checkpoint_written", "finish_checkpoint", "load_checkpoint", "rollback"):
        assert fanout.dispatch_of(MegatronActor, method) is PassThroughDispatch


class FakeHandle:
    """Stands in for a Ray actor handle: handle.method.remote(...) records the call."""

    def __init__(self, rank):
        self.rank = rank

    def __getattr__(self, method):
        handle = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                return (handle.rank, method, args, kwargs)

        return Method


def test_dispatch_remote():
    dims = ParallelDims(tp=2, pp=1, cp=1, dp=2)
    handles = [FakeHandle(r) for r in range(4)]
    refs = dispatch_remote(handles, "train_step", dims, MeshDispatch, numbered_batch(4), step=7)
    assert [(r, m, a[0].input_ids[:, 0].tolist(), kw) for r, m, a, kw in refs] == [
        (0, "train_step", [0, 2], {"step": 7}),
        (1, "train_step", [0, 2], {"step": 7}),
        (2, "train_step", [1, 3], {"step": 7}),
        (3, "train_step", [1, 3], {"step": 7}),
    ]
    refs = dispatch_remote(handles, "ping", dims, PassThroughDispatch, "x")
    assert refs == [(r, "ping", ("x",), {}) for r in range(4)]
    with pytest.raises(ValueError, match="3 actor handles"):
        dispatch_remote(handles[:3], "ping", dims, PassThroughDispatch)


def test_base_dispatch_is_abstract():
    dims = ParallelDims(tp=1, pp=1, cp=1, dp=1)
    with pytest.raises(NotImplementedError):
        Dispatch.split(dims, (), {})
    with pytest.raises(NotImplementedError):
        Dispatch.collect(dims, [None])


def test_dispatch_remote_puts_each_replicas_batch_once_not_once_per_rank():
    """tp=2, pp=2, dp=2 (8 ranks): a step's `put` calls are one per DP replica's batch plus
    one for the shared non-scalar argument; scalars are sent as they are; every rank of a
    replica gets that replica's stored batch."""
    dims = ParallelDims(tp=2, pp=2, cp=1, dp=2)
    handles = [FakeHandle(r) for r in range(8)]
    stored = []

    def put(value):
        stored.append(value)
        return f"ref{len(stored) - 1}"

    refs = dispatch_remote(handles, "train_step", dims, MeshDispatch, 3, numbered_batch(4), {"lr": 1.0},
                           step=7, put=put)
    assert len(stored) == dims.dp + 1
    extra = next(i for i, v in enumerate(stored) if isinstance(v, dict))
    for r, _, (generation, batch_ref, extra_ref), kw in refs:
        assert generation == 3 and kw == {"step": 7} and extra_ref == f"ref{extra}"
        rows = stored[int(batch_ref[3:])].input_ids[:, 0].tolist()
        assert rows == ([0, 2] if dims.coords(r).dp == 0 else [1, 3])


# -- each rank's arguments derived where its node agent runs (`Dispatch.for_rank`) ------------

def _rows(pair):
    """A rank's (args, kwargs) with each TrainingBatch as its rows' first input ids."""
    def show(v):
        return ("rows", v.input_ids[:, 0].tolist()) if isinstance(v, TrainingBatch) else v
    args, kwargs = pair
    return tuple(map(show, args)), {k: show(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
@pytest.mark.parametrize("kind", ["mesh", "pass_through"])
def test_for_rank_over_call_args_gives_each_rank_what_split_gives_it(dims, kind):
    """The agent-side derivation (`for_rank` over the call's arguments cut once, `call_args`)
    gives every rank of dp 1/2/4 with tp/cp/pp the same arguments as the driver-side split,
    with values as they are and with each put once (`put`: a store that numbers what it holds)."""
    cls = get_dispatch_type(kind)
    args, kwargs = (5, numbered_batch(8), "s"), {"other": numbered_batch(8), "lr": 0.5, "cfg": {"a": 1}}
    split = cls.split(dims, args, kwargs)
    shared = fanout.call_args(dims, cls, *args, **kwargs)
    assert [_rows(cls.for_rank(dims, r, *shared)) for r in range(dims.world_size)] == list(map(_rows, split))
    for_driver, for_agents = Store(), Store()
    by_driver = fanout.dispatch_args(dims, cls, *args, put=for_driver.put, **kwargs)
    shared = fanout.call_args(dims, cls, *args, put=for_agents.put, **kwargs)
    by_agents = [cls.for_rank(dims, r, *shared) for r in range(dims.world_size)]
    assert [_rows(for_agents.resolve(p)) for p in by_agents] == [_rows(for_driver.resolve(p)) for p in by_driver]
    # each put once: one part per replica of each cut batch (mesh), else each value whole
    assert len(for_agents.values) == len(for_driver.values) == (2 * dims.dp + 1 if kind == "mesh" else 3)


class Store:
    """A store as `put` sees one: each value put gets the next "refN"; `resolve` reads back."""

    def __init__(self):
        self.values = []

    def put(self, value) -> str:
        self.values.append(value)
        return f"ref{len(self.values) - 1}"

    def resolve(self, pair):
        def get(v):
            return self.values[int(v[3:])] if isinstance(v, str) and v.startswith("ref") else v
        args, kwargs = pair
        return tuple(map(get, args)), {k: get(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
def test_a_node_given_only_its_ranks_parts_derives_the_same_arguments(dims):
    """A node agent gets only the parts of a cut batch that its own ranks need (`Cut.only`,
    nodes of 2 ranks here) and still derives every one of its ranks' arguments."""
    cls, batch = MeshDispatch, numbered_batch(8)
    split = cls.split(dims, (batch,), {})
    (cut,), _ = fanout.call_args(dims, cls, batch)
    for first in range(0, dims.world_size, 2):
        ranks = range(first, min(first + 2, dims.world_size))
        mine = cut.only({cls.part_key(dims, r) for r in ranks})
        assert len(mine.parts) == len({dims.coords(r).dp for r in ranks})
        for r in ranks:
            assert _rows(cls.for_rank(dims, r, (mine,), {})) == _rows(split[r])


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
def test_collects_names_exactly_the_ranks_collect_reads(dims):
    """`collects` (what a node agent sends back) is the set of ranks `collect` reads."""
    for cls in (MeshDispatch, PassThroughDispatch):
        read = cls.collect(dims, list(range(dims.world_size)))
        assert sorted(read) == [r for r in range(dims.world_size) if cls.collects(dims, r)]
