"""How one logical call on an actor group is fanned out to its ranks and gathered back.

A `Dispatch` turns the driver's (args, kwargs) into one (args, kwargs) per global rank
(`split`) and the per-rank results into what the caller sees (`collect`). Ray is not
imported here: `dispatch_remote` only calls `.remote` on the handles it is given (`dispatch_args`
gives the per-rank arguments alone, for calls sent through node agents: `node_agent.NodeCalls`).
"""

from __future__ import annotations

from typing import Callable

from parallel_dims import ParallelDims, RankCoords
from training_batch import TrainingBatch


class Dispatch:
    """Base class: fan-out and gather rules for one call on a group of `dims.world_size` ranks."""

    @classmethod
    def split(cls, dims: ParallelDims, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        """(args, kwargs) for each global rank; index = rank."""
        raise NotImplementedError

    @classmethod
    def collect(cls, dims: ParallelDims, results: list) -> list:
        """Per-rank results (index = rank) -> the output returned to the caller."""
        raise NotImplementedError


class PassThroughDispatch(Dispatch):
    """Every rank gets the same arguments; every rank's result is returned, in rank order."""

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
    d, d+dp, d+2dp, ... Interleaved, not contiguous, so that mini-batch k cut from each rank's
    local rows in order is global rows [k*m, (k+1)*m) (m = mini-batch size) at any dp: the
    optimizer updates do not depend on the DP size (shrinking DP, resharding a checkpoint).
    Other arguments go to every rank unchanged.
    collect: one result per DP replica, in dp order, taken from the rank with tp=0, cp=0 on
    the last pipeline stage (where the loss is computed).
    """

    @classmethod
    def split(cls, dims: ParallelDims, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        def chunks(value):
            if not isinstance(value, TrainingBatch):
                return [value] * dims.dp
            if len(value) % dims.dp != 0:
                raise ValueError(
                    f"batch of {len(value)} sequences cannot be split evenly over dp={dims.dp} "
                    f"data-parallel replicas; use a batch size that is a multiple of {dims.dp}"
                )
            return [value.strided(d, dims.dp) for d in range(dims.dp)]

        per_arg = [chunks(a) for a in args]
        per_kwarg = {k: chunks(v) for k, v in kwargs.items()}
        per_replica = [
            (tuple(c[d] for c in per_arg), {k: c[d] for k, c in per_kwarg.items()})
            for d in range(dims.dp)
        ]
        return [per_replica[dims.coords(r).dp] for r in range(dims.world_size)]

    @classmethod
    def collect(cls, dims: ParallelDims, results: list) -> list:
        _check_len(dims, results)
        return [
            results[dims.rank_of(RankCoords(tp=0, cp=0, dp=d, pp=dims.pp - 1))]
            for d in range(dims.dp)
        ]


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


def dispatch_args(dims: ParallelDims, dispatch: str | type[Dispatch], *args, put: Callable | None = None,
                  **kwargs) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of each global rank's call (index = rank), as the dispatch splits them.

    Args:
        dispatch: a registered name or a Dispatch subclass deciding each rank's arguments.
        put: e.g. `ray.put`: each distinct argument value other than a scalar (int, float,
            bool, str, None) is passed through it once and its result given to every rank
            that gets the value, so a replica's batch is serialized once, not once per rank
            of the replica. None: values are given as they are.
    """
    cls = get_dispatch_type(dispatch) if isinstance(dispatch, str) else dispatch
    per_rank = cls.split(dims, args, kwargs)
    if put is None:
        return per_rank
    stored: dict[int, object] = {}  # id(value) -> put(value); the values live in per_rank
    converted: dict[int, tuple] = {}  # id((args, kwargs)) -> its put form: ranks that share one share it

    def once(v):
        if v is None or isinstance(v, (int, float, bool, str)):
            return v
        if id(v) not in stored:
            stored[id(v)] = put(v)
        return stored[id(v)]

    def put_form(pair: tuple) -> tuple:
        if id(pair) not in converted:
            a, kw = pair
            converted[id(pair)] = (tuple(once(v) for v in a), {k: once(v) for k, v in kw.items()})
        return converted[id(pair)]

    return [put_form(pair) for pair in per_rank]


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
