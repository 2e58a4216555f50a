"""How one logical call on an actor group is fanned out to its ranks and gathered back.

A `Dispatch` says which part of each argument a global rank gets (`part_key`, `cut`: a pure
function of the layout, the rank and the call's arguments, `for_rank`), which ranks' results
the caller reads (`collects`) and what the caller sees (`collect`). The driver can split a call
into every rank's arguments (`split`, `dispatch_args`, `dispatch_remote`), or cut each argument
once (`call_args`) and let each node's agent derive its own ranks' arguments with `for_rank`
(`node_agent.NodeCalls`: the driver's work per call then grows with the nodes, not the ranks).
Ray is not imported here: `put` and `.remote` are given by the caller.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Hashable

from parallel_dims import ParallelDims


@dataclass(frozen=True)
class Cut:
    """An argument already cut by a dispatch: part key (`Dispatch.part_key`) -> that part.
    May hold only the parts some ranks need (`only`)."""
    parts: dict

    def only(self, keys) -> Cut:
        """The parts of `keys` alone (a node's agent gets the parts of its own ranks)."""
        return Cut({k: self.parts[k] for k in keys if k in self.parts})


class Dispatch:
    """Base class: fan-out and gather rules for one call on a group of `dims.world_size` ranks.

    A subclass defines `part_key`, `cut` and `collects`; `for_rank`, `split` and `collect`
    follow from them (a subclass may define them directly, keeping them consistent)."""

    @classmethod
    def part_key(cls, dims: ParallelDims, rank: int) -> Hashable:
        """Which part of a cut argument global rank `rank` gets; ranks with the same key get
        the same arguments."""
        raise NotImplementedError

    @classmethod
    def cut(cls, dims: ParallelDims, value) -> Cut | None:
        """`value` cut into its parts (every key `part_key` gives), or None when every rank
        gets it whole. Raises ValueError when `value` cannot be cut for `dims`."""
        raise NotImplementedError

    @classmethod
    def collects(cls, dims: ParallelDims, rank: int) -> bool:
        """Whether `collect` reads the result of global rank `rank`."""
        raise NotImplementedError

    @classmethod
    def for_rank(cls, dims: ParallelDims, rank: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(args, kwargs) of global rank `rank`'s call, from the call's arguments as `call_args`
        gives them: each `Cut` value replaced by the rank's part (`part_key`), every other value
        as it is. A pure function: `for_rank(dims, r, *call_args(dims, cls, *a, **kw))` is
        `split(dims, a, kw)[r]`. Cuts nothing itself, so a node agent deriving its ranks'
        arguments imports no batch type (no torch)."""
        key = cls.part_key(dims, rank)

        def mine(value):
            return value.parts[key] if isinstance(value, Cut) else value
        return tuple(mine(v) for v in args), {k: mine(v) for k, v in kwargs.items()}

    @classmethod
    def split(cls, dims: ParallelDims, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        """(args, kwargs) for each global rank; index = rank. Ranks with the same part key
        share one (args, kwargs) object, and each value is cut once."""
        return _per_rank(cls, dims, *call_args(dims, cls, *args, **kwargs))

    @classmethod
    def collect(cls, dims: ParallelDims, results: list) -> list:
        """Per-rank results (index = rank) -> the output returned to the caller: the results
        of the ranks `collects` reads, in rank order (`collected_ranks`). Results of other
        ranks are not read (they may be None: `node_agent.NodeAgent.call` does not return them)."""
        _check_len(dims, results)
        return [results[r] for r in collected_ranks(cls, dims)]


class PassThroughDispatch(Dispatch):
    """Every rank gets the same arguments; every rank's result is returned, in rank order."""

    @classmethod
    def part_key(cls, dims: ParallelDims, rank: int) -> Hashable:
        return None

    @classmethod
    def cut(cls, dims: ParallelDims, value) -> Cut | None:
        return None

    @classmethod
    def collects(cls, dims: ParallelDims, rank: int) -> bool:
        return True

    @classmethod
    def split(cls, dims: ParallelDims, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        return [(args, kwargs)] * dims.world_size

    @classmethod
    def collect(cls, dims: ParallelDims, results: list) -> list:
        _check_len(dims, results)
        return list(results)


class MeshDispatch(Dispatch):
    """Data-parallel fan-out over the (tp, cp, dp, pp) mesh.

    split: every `TrainingBatch` argument (positional or keyword) is cut into dims.dp
    interleaved parts along B: every rank of DP replica d (all its tp, cp, pp ranks) gets rows
    d, d+dp, d+2dp, ... (part key: the rank's dp coordinate). Interleaved, not contiguous, so
    that mini-batch k cut from each rank's local rows in order is global rows [k*m, (k+1)*m)
    (m = mini-batch size) at any dp: the optimizer updates do not depend on the DP size
    (shrinking DP, resharding a checkpoint). Other arguments go to every rank unchanged.
    collect: one result per DP replica, in dp order, taken from the rank with tp=0, cp=0 on
    the last pipeline stage (where the loss is computed).
    """

    @classmethod
    def part_key(cls, dims: ParallelDims, rank: int) -> Hashable:
        return dims.coords(rank).dp

    @classmethod
    def cut(cls, dims: ParallelDims, value) -> Cut | None:
        from training_batch import TrainingBatch  # here: `for_rank` (a node agent) needs no torch

        if not isinstance(value, TrainingBatch):
            return None
        if len(value) % dims.dp != 0:
            raise ValueError(
                f"batch of {len(value)} sequences cannot be split evenly over dp={dims.dp} "
                f"data-parallel replicas; use a batch size that is a multiple of {dims.dp}"
            )
        return Cut({d: value.strided(d, dims.dp) for d in range(dims.dp)})

    @classmethod
    def collects(cls, dims: ParallelDims, rank: int) -> bool:
        c = dims.coords(rank)
        return c.tp == 0 and c.cp == 0 and c.pp == dims.pp - 1


@functools.lru_cache(maxsize=64)
def collected_ranks(cls: type[Dispatch], dims: ParallelDims) -> tuple[int, ...]:
    """The ranks whose results `cls.collect` reads, in rank order (for `MeshDispatch` that is dp
    order: dp is the slower coordinate); computed once per layout, so that a step's collect
    costs one lookup per result read."""
    return tuple(r for r in range(dims.world_size) if cls.collects(dims, r))


def _check_len(dims: ParallelDims, results: list) -> None:
    if len(results) != dims.world_size:
        raise ValueError(f"got {len(results)} results for a group of {dims.world_size} ranks")


_REGISTRY: dict[str, type[Dispatch]] = {}


def register_dispatch_type(name: str, cls: type[Dispatch]) -> None:
    """Register `cls` under `name`. Registering the same class twice is a no-op.

    Raises:
        TypeError: cls is not a subclass of Dispatch.
        ValueError: name is already registered to another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, Dispatch)):
        raise TypeError(f"dispatch type {name!r} must be a subclass of Dispatch, got {cls!r}")
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"dispatch type {name!r} is already registered to {_REGISTRY[name]!r}")
    _REGISTRY[name] = cls


def get_dispatch_type(name: str) -> type[Dispatch]:
    """The class registered under `name`. Raises KeyError listing the registered names."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown dispatch type {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


register_dispatch_type("mesh", MeshDispatch)
register_dispatch_type("pass_through", PassThroughDispatch)


def call_args(dims: ParallelDims, dispatch: str | type[Dispatch], *args, put: Callable | None = None,
              **kwargs) -> tuple[tuple, dict]:
    """The call's (args, kwargs) cut once for every rank: each value the dispatch cuts replaced
    by its `Cut`, each of its parts and each other value but a scalar (int, float, bool, str,
    None) passed through `put` once (e.g. `ray.put`; None: values as they are). Each rank's
    arguments are then `for_rank(dims, rank, *call_args(...))`: what `node_agent.NodeAgent`
    derives for its ranks, and what `dispatch_args` gives. Raises ValueError when a value
    cannot be cut (`Dispatch.cut`)."""
    cls = get_dispatch_type(dispatch) if isinstance(dispatch, str) else dispatch

    stored: dict[int, object] = {}  # id(value) -> put(value): a value given twice is put once

    def once(v):
        if put is None or v is None or isinstance(v, (int, float, bool, str)):
            return v
        if id(v) not in stored:
            stored[id(v)] = put(v)
        return stored[id(v)]

    def form(v):
        whole = cls.cut(dims, v)
        return once(v) if whole is None else Cut({k: once(part) for k, part in whole.parts.items()})
    return tuple(form(v) for v in args), {k: form(v) for k, v in kwargs.items()}


def dispatch_args(dims: ParallelDims, dispatch: str | type[Dispatch], *args, put: Callable | None = None,
                  **kwargs) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of each global rank's call (index = rank), as the dispatch splits them.

    Args:
        dispatch: a registered name or a Dispatch subclass deciding each rank's arguments.
        put: e.g. `ray.put`: each distinct argument value other than a scalar (int, float,
            bool, str, None) is passed through it once and its result given to every rank
            that gets the value, so a replica's batch is serialized once, not once per rank
            of the replica (`call_args`). None: values are given as they are.
    """
    cls = get_dispatch_type(dispatch) if isinstance(dispatch, str) else dispatch
    if put is None:
        return cls.split(dims, args, kwargs)
    return _per_rank(cls, dims, *call_args(dims, cls, *args, put=put, **kwargs))


def _per_rank(cls: type[Dispatch], dims: ParallelDims, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """`for_rank` of every global rank over arguments cut once (`Cut` values); ranks with the
    same part key share one (args, kwargs) object."""
    shared: dict = {}
    out = []
    for rank in range(dims.world_size):
        key = cls.part_key(dims, rank)
        if key not in shared:
            shared[key] = cls.for_rank(dims, rank, args, kwargs)
        out.append(shared[key])
    return out


def dispatch_remote(
    handles: list,
    method: str,
    dims: ParallelDims,
    dispatch: str | type[Dispatch],
    *args,
    put: Callable | None = None,
    **kwargs,
) -> list:
    """Call `handles[r].<method>.remote(*args_r, **kwargs_r)` on every rank r, with the
    arguments of `dispatch_args` (`put`: see there).

    Returns:
        The ObjectRefs, one per rank (pass them to `dispatch.collect` after `ray.get`).

    Raises:
        ValueError: len(handles) != dims.world_size.
    """
    if len(handles) != dims.world_size:
        raise ValueError(f"got {len(handles)} actor handles for a group of {dims.world_size} ranks")
    per_rank = dispatch_args(dims, dispatch, *args, put=put, **kwargs)
    return [getattr(handle, method).remote(*a, **kw) for handle, (a, kw) in zip(handles, per_rank)]
