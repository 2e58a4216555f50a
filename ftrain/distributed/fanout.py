"""How one logical call on a group of ranks is fanned out to them and gathered back: the
mechanism; the example's dispatch types and their registry are `dispatch.py` at the top.

A `Dispatch` says which part of each argument a global rank gets (`part_key`, `cut`: a pure
function of the layout, the rank and the call's arguments, `for_rank`), which ranks' results
the caller reads (`collects`) and what the caller sees (`collect`). The driver can split a call
into every rank's arguments (`split`, `dispatch_args`, `dispatch_remote`), or cut each argument
once (`call_args`) and let each node's agent derive its own ranks' arguments with `for_rank`
(`ftrain.control.node_agent.NodeCalls`: the driver's work per call then grows with the nodes,
not the ranks). A rank actor's method declares its dispatch (`DISPATCH_ATTR`, set by the
example's `dispatch.register`); `dispatch_of` reads it. Ray is not imported here: `put` and
`.remote` are given by the caller.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Hashable

from ftrain.distributed.parallel_dims import ParallelDims

DISPATCH_ATTR = "__dispatch__"  # on a rank actor's method: the Dispatch subclass its calls use


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
        check_len(dims, results)
        return [results[r] for r in collected_ranks(cls, dims)]


@functools.lru_cache(maxsize=64)
def collected_ranks(cls: type[Dispatch], dims: ParallelDims) -> tuple[int, ...]:
    """The ranks whose results `cls.collect` reads, in rank order (for `MeshDispatch` that is dp
    order: dp is the slower coordinate); computed once per layout, so that a step's collect
    costs one lookup per result read."""
    return tuple(r for r in range(dims.world_size) if cls.collects(dims, r))


def check_len(dims: ParallelDims, results: list) -> None:
    """Raises ValueError unless `results` holds one result per rank of `dims`."""
    if len(results) != dims.world_size:
        raise ValueError(f"got {len(results)} results for a group of {dims.world_size} ranks")


def call_args(dims: ParallelDims, dispatch: type[Dispatch], *args, put: Callable | None = None,
              **kwargs) -> tuple[tuple, dict]:
    """The call's (args, kwargs) cut once for every rank: each value the dispatch cuts replaced
    by its `Cut`, each of its parts and each other value but a scalar (int, float, bool, str,
    None) passed through `put` once (e.g. `ray.put`; None: values as they are). Each rank's
    arguments are then `for_rank(dims, rank, *call_args(...))`: what `node_agent.NodeAgent`
    derives for its ranks, and what `dispatch_args` gives. Raises ValueError when a value
    cannot be cut (`Dispatch.cut`)."""
    stored: dict[int, object] = {}  # id(value) -> put(value): a value given twice is put once

    def once(v):
        if put is None or v is None or isinstance(v, (int, float, bool, str)):
            return v
        if id(v) not in stored:
            stored[id(v)] = put(v)
        return stored[id(v)]

    def form(v):
        whole = dispatch.cut(dims, v)
        return once(v) if whole is None else Cut({k: once(part) for k, part in whole.parts.items()})
    return tuple(form(v) for v in args), {k: form(v) for k, v in kwargs.items()}


def dispatch_args(dims: ParallelDims, dispatch: type[Dispatch], *args, put: Callable | None = None,
                  **kwargs) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of each global rank's call (index = rank), as the dispatch splits them.

    Args:
        dispatch: the Dispatch subclass deciding each rank's arguments.
        put: e.g. `ray.put`: each distinct argument value other than a scalar (int, float,
            bool, str, None) is passed through it once and its result given to every rank
            that gets the value, so a replica's batch is serialized once, not once per rank
            of the replica (`call_args`). None: values are given as they are.
    """
    if put is None:
        return dispatch.split(dims, args, kwargs)
    return _per_rank(dispatch, dims, *call_args(dims, dispatch, *args, put=put, **kwargs))


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
    dispatch: type[Dispatch],
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


def dispatch_of(actor_cls, method: str) -> type[Dispatch]:
    """The Dispatch subclass `method` of `actor_cls` (a Ray actor class or a plain class)
    declares (`DISPATCH_ATTR`). Raises TypeError naming the method when it declares none."""
    cls = getattr(actor_cls, "__ray_actor_class__", actor_cls)  # the class a Ray actor class wraps
    kind = getattr(getattr(cls, method, None), DISPATCH_ATTR, None)
    if kind is None:
        raise TypeError(f"{cls.__name__}.{method} declares no dispatch: decorate it with dispatch.register(NAME)")
    return kind
