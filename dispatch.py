"""The dispatch registry: how each of the rank actor's methods is fanned out to the ranks and
gathered back, by name (`register_dispatch_type`, `get_dispatch_type`) and on the method
itself (`register`: the driver's `ActorGroup.call` reads it). The mechanism (`Dispatch`, `Cut`,
`call_args`, `for_rank`) is `ftrain.distributed.fanout`.
"""

from __future__ import annotations

from typing import Callable, Hashable

from ftrain.distributed.fanout import DISPATCH_ATTR, Cut, Dispatch, check_len
from ftrain.distributed.parallel_dims import ParallelDims


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
        check_len(dims, results)
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
        from ftrain.data.training_batch import TrainingBatch  # here: `for_rank` (a node agent) needs no torch

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


def register(name: str) -> Callable:
    """Method decorator: calls of the method through `ActorGroup.call` use the dispatch type
    registered under `name` (`ftrain.distributed.fanout.dispatch_of` reads it). Raises KeyError
    for an unregistered name, at class definition."""
    kind = get_dispatch_type(name)

    def mark(method: Callable) -> Callable:
        setattr(method, DISPATCH_ATTR, kind)
        return method
    return mark
