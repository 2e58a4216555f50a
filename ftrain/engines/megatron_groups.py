"""Megatron-Core's process groups of one membership generation, and moving live Megatron
objects (model, DDP wrapper, optimizer) from the previous generation's groups onto them.

Megatron layers, DDP buckets and the distributed optimizer keep references to the process
groups they were built with (`tp_group`, `pg_collection`, `data_parallel_group`, ...). After a
membership change with the same layout and the same rank, every group of the new generation
has the same members as the old one of the same role, so the objects need only their group
references swapped (`rebind`); nothing is rebuilt and no tensor is copied. A spare's model
built in a world of one rank moves the same way into any dp, its groups made one per role
(`make_groups(shared=False)`) so that each reference names its role. A reference that
cannot be swapped (a group made outside `parallel_state`, or one held where it cannot be
replaced) raises `StaleGroups`, and the caller builds the objects again.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.engines.megatron_compat import one_group_per_membership


class StaleGroups(RuntimeError):
    """Objects still reference process groups of an earlier generation after `rebind`."""


def make_groups(dims: ParallelDims, shared: bool = True) -> dict[str, dist.ProcessGroup]:
    """Replace Megatron's groups (`parallel_state`) by ones of the current default process
    group for the layout `dims`; returns them by role (`groups_by_role`). `shared`: one
    communicator per distinct member list (`megatron_compat.one_group_per_membership`), for a
    generation that trains. `shared=False`: one group per role, as Megatron makes them (only
    roles Megatron itself makes one object share one, in every generation alike), for objects
    built to move to a generation of another layout (a spare's prebuilt model): shared, in a
    world of one rank every role is one object and `rebind` could not tell which role a
    reference serves."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    with one_group_per_membership() if shared else contextlib.nullcontext():
        ps.initialize_model_parallel(dims.tp, dims.pp, context_parallel_size=dims.cp,
                                     create_gloo_process_groups=False)
    return groups_by_role()


def groups_by_role() -> dict[str, dist.ProcessGroup]:
    """Every process group `parallel_state` holds, keyed by its global's name (with the index or
    key for lists and dicts of groups), plus the default group as 'WORLD'. Two generations of
    the same layout have the same keys, each naming a group of the same members."""
    from megatron.core import parallel_state as ps

    out = {"WORLD": dist.group.WORLD}
    for name, value in vars(ps).items():
        if not name.startswith("_") or name == "_global_process_group_list":
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else [(None, value)]
        for key, g in items:
            if isinstance(g, dist.ProcessGroup):
                out[name if key is None else f"{name}[{key}]"] = g
    return out


def rebind(roots: list, old: dict[str, dist.ProcessGroup], new: dict[str, dist.ProcessGroup]) -> int:
    """Swap, in every object reachable from `roots`, each reference to a group of `old` for the
    group of the same role in `new`. Returns the number of references swapped. Raises
    ValueError when the two generations have different roles (another layout), StaleGroups when
    a process group that is in neither generation is still referenced, or one sits where it
    cannot be swapped (a `functools.partial`), or a referenced old group stands for several
    roles whose new groups differ (a reference to it does not say which role it serves: groups
    made with `make_groups(shared=True)` in a world of one rank are one group for every role, so
    a spare prebuilds with `shared=False`)."""
    if old.keys() != new.keys():
        raise ValueError(f"the generations' groups differ in roles: {sorted(old.keys() ^ new.keys())}")
    swap: dict[int, dist.ProcessGroup | None] = {}
    roles: dict[int, list[str]] = {}
    for k, g in old.items():
        roles.setdefault(id(g), []).append(k)
        swap[id(g)] = new[k] if swap.get(id(g), new[k]) is new[k] else None  # None: ambiguous
    live = {id(g) for g in new.values()}
    walk = _Walk(swap, live, roles)
    for root in roots:
        walk.fix(root, "root")
    if walk.stale:
        raise StaleGroups(f"{len(walk.stale)} reference(s) to process groups of no live generation, "
                          f"e.g. {walk.stale[0]}")
    return walk.swapped


class _Walk:
    """One pass over an object graph: containers and the attributes of Megatron objects and
    torch modules (not tensors, not plain torch internals)."""

    def __init__(self, swap: dict[int, dist.ProcessGroup | None], live: set[int], roles: dict[int, list[str]]):
        self.swap, self.live, self.roles = swap, live, roles
        self.seen: set[int] = set()
        self.swapped = 0
        self.stale: list[str] = []

    def fix(self, obj, path: str):
        """`obj` with its groups swapped: the same object (changed in place) except for tuples
        and groups themselves, which are returned new."""
        if isinstance(obj, dist.ProcessGroup):
            if self.swap.get(id(obj)) is not None:
                self.swapped += 1
                return self.swap[id(obj)]
            if id(obj) in self.swap:
                roles = self.roles[id(obj)]
                self.stale.append(f"{path} (one group for roles {', '.join(roles[:4])}{', ...' if len(roles) > 4 else ''}, "
                                  "different groups now)")
                return obj
            if id(obj) not in self.live:
                self.stale.append(path)
            return obj
        if obj is None or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type)) or id(obj) in self.seen:
            return obj
        self.seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                obj[k] = self.fix(v, f"{path}[{k!r}]")
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                obj[i] = self.fix(v, f"{path}[{i}]")
        elif isinstance(obj, tuple):
            fixed = tuple(self.fix(v, f"{path}[{i}]") for i, v in enumerate(obj))
            if any(a is not b for a, b in zip(fixed, obj)):
                return type(obj)(*fixed) if hasattr(obj, "_fields") else fixed
        elif isinstance(obj, functools.partial):
            before = self.swapped
            for i, v in enumerate((*obj.args, *obj.keywords.values())):
                self.fix(v, f"{path}.partial[{i}]")
            if self.swapped != before:  # a partial's arguments cannot be replaced
                self.stale.append(f"{path} (functools.partial)")
        elif _walkable(obj):
            for k, v in list(vars(obj).items()):
                if k in ("_parameters", "_buffers"):
                    continue  # tensors only
                fixed = self.fix(v, f"{path}.{k}")
                if fixed is not v:
                    obj.__dict__[k] = fixed
        return obj


def _walkable(obj) -> bool:
    """Megatron objects and torch modules hold groups in their attributes; other torch objects
    (optimizers' inner state, streams, events) do not and are large or opaque."""
    if isinstance(obj, torch.nn.Module):
        return True
    module = type(obj).__module__ or ""
    return hasattr(obj, "__dict__") and module.startswith("megatron.")
