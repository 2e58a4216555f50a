"""Every place this project replaces or re-implements an internal of Megatron-Core, in one module.

Each patch depends on private Megatron-Core code of the version it was written for
(`WRITTEN_FOR`, the version requirements.txt pins). `PATCHES` lists them with the attributes
they touch; importing this module logs a warning naming each one when another version is
installed, and tests/test_megatron_compat.py fails when the installed version differs or an
attribute is gone, so an upgrade is checked patch by patch.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import logging

import megatron.core
import torch

from checkpoint import CheckpointError

log = logging.getLogger(__name__)
WRITTEN_FOR = "0.16.1"  # megatron-core version the patches below were written against
# (patch, Megatron-Core module, attributes it replaces or relies on, what to re-check)
PATCHES = (
    ("patch_distributed_optimizer", "megatron.core.optimizer.distrib_optimizer",
     ("DistributedOptimizer._set_main_param_and_optimizer_states",
      "DistributedOptimizer.sharded_param_state_fully_reshardable",
      "DistributedOptimizer._get_main_param_and_optimizer_states"),
     "per-instance method swaps: the original load raises KeyError 'step' in a fully_reshardable "
     "load; the save's model-space state with one DP rank is built from views (same keys, shapes, "
     "replica ids as the original's, which iterates gbuf_ranges / buffers[i].param_index_map)"),
    ("fetch_before_read", "megatron.core.dist_checkpointing.strategies.torch",
     ("_get_filesystem_reader",),
     "the torch_dist loader's reader factory, swapped for one load to fetch files before reading"),
    ("write_buckets", "megatron.core.dist_checkpointing.strategies.filesystem_async",
     ("FileSystemWriterAsync.write_preloaded_data_multiproc", "FileSystemWriterAsync.write_preloaded_data"),
     "re-implements the async write (partial(write_preloaded_data_multiproc, transform_list, "
     "use_msc)) with threads instead of forked writers"),
    ("foreach_grad_norm", "megatron.core.optimizer.clip_grads",
     ("l2_norm_impl", "multi_tensor_scale_impl", "multi_tensor_applier"),
     "without TE / Apex, clip_grads' local fallbacks: l2_norm_impl(chunk, noop, [tensors], per_tensor) "
     "-> ([1] norm, None), multi_tensor_scale_impl(chunk, noop, [src, dst], scale)"),
    ("one_group_per_membership", "megatron.core.parallel_state",
     ("create_group", "initialize_model_parallel"),
     "initialize_model_parallel makes every group through the module's create_group(ranks=..., "
     "timeout=..., pg_options=..., group_desc=...)"),
)


def patch_target(module: str, attribute: str):
    """The object at dotted `attribute` of the Megatron-Core module `module` (for the checks
    of `PATCHES`). Raises ImportError or AttributeError when it no longer exists."""
    obj = importlib.import_module(module)
    for name in attribute.split("."):
        obj = getattr(obj, name)
    return obj


def _check_version() -> None:
    """Log one warning when the installed Megatron-Core is not `WRITTEN_FOR`, with the patches
    to re-check, one line each."""
    installed = megatron.core.__version__
    if installed != WRITTEN_FOR:
        patches = "\n".join(f"  {name}: {module}.{', '.join(attrs)} ({why})" for name, module, attrs, why in PATCHES)
        log.warning("megatron-core %s is installed; megatron_compat was written for %s. Re-check:\n%s",
                    installed, WRITTEN_FOR, patches)


_check_version()


def _set_main_param_and_state(opt, model_param, tensors: dict) -> None:
    """`DistributedOptimizer._set_main_param_and_optimizer_states` without its KeyError: in
    Megatron-Core 0.16 a fully_reshardable load copies every key of torch AdamW's state,
    'step' included, from `tensors`, which has none ('step' is restored per param group)."""
    gi, go = opt.model_param_group_index_map[model_param]
    main = opt.optimizer.param_groups[gi]["params"][go]
    main.data.copy_(tensors["param"])
    for k, v in tensors.items():
        if k != "param":
            opt.optimizer.state[main][k].copy_(v)


_MODEL_SPACE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # Megatron's world-tensor keys, in its order


def _model_space_views(opt, original, model_sharded_state_dict, is_loading: bool = False,
                       metadata: dict | None = None):
    """`DistributedOptimizer.sharded_param_state_fully_reshardable` of a save whose DP group
    has one rank: the same dict of ShardedTensors (index -> {"param", "exp_avg", "exp_avg_sq"};
    keys `optimizer.state.<key>.<model key>`, the model parameter's shape and replica id, fp32),
    whose data are views of the live main params and Adam moments on the device. Why: the
    original gathers every shard into new pageable host tensors first, with a synchronous copy
    per parameter (seconds per GB of state: most of an async save's stall), although with one DP
    rank each parameter's optimizer state is already whole. The save copies the views itself
    (`megatron_checkpoint.PendingSave`: to pinned memory, on a side stream). Loading, DP > 1,
    the memory-efficient variant, or a state that is not whole per parameter: the original."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    metadata = metadata or {}
    if is_loading or opt.data_parallel_group.size() > 1 or metadata.get("distrib_optim_fully_reshardable_mem_efficient"):
        return original(model_sharded_state_dict, is_loading, metadata)
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {sh.data: sh for sh in nested_values(sharded)}
    state = {}
    for gbuf_idx in range(len(opt.gbuf_ranges)):
        for model_param in opt.buffers[gbuf_idx].param_index_map:
            meta, tensors = by_param[model_param], opt._get_main_param_and_optimizer_states(model_param)
            if any(tensors[k].numel() != model_param.numel() for k in _MODEL_SPACE_KEYS):
                return original(model_sharded_state_dict, is_loading, metadata)
            views = {}
            for k in _MODEL_SPACE_KEYS:
                t = tensors[k].detach()
                kw = {"key": f"optimizer.state.{k}.{meta.key}", "data": t.view(meta.data.shape),
                      "dtype": t.dtype, "replica_id": meta.replica_id}
                if isinstance(meta, ShardedTensorFactory):
                    kw.pop("dtype")
                views[k] = dataclasses.replace(meta, **kw)
                views[k].validate_metadata_integrity()
            state[len(state)] = views
    return state


def patch_distributed_optimizer(optimizer) -> None:
    """Give every `DistributedOptimizer` of `optimizer` (what `get_megatron_optimizer` returns:
    a chained optimizer) `_set_main_param_and_state` as its
    `_set_main_param_and_optimizer_states`, so a fully_reshardable checkpoint loads into it, and
    `_model_space_views` as its `sharded_param_state_fully_reshardable` (saves without the
    host gather when one DP rank holds the whole state)."""
    from megatron.core.optimizer import DistributedOptimizer

    for o in optimizer.chained_optimizers:
        if isinstance(o, DistributedOptimizer):
            o._set_main_param_and_optimizer_states = functools.partial(_set_main_param_and_state, o)
            o.sharded_param_state_fully_reshardable = functools.partial(
                _model_space_views, o, o.sharded_param_state_fully_reshardable)


def _foreach_l2_norm(_chunk_size, _noop_flag, tensor_lists, _per_tensor, *_args):
    """`local_multi_tensor_l2_norm` without a host sync: Megatron-Core's builds a host tensor
    from one device scalar per parameter (a device sync each, ~170 per step on a 24-layer
    model); here the per-tensor norms stay on the device (`torch._foreach_norm`)."""
    (tensors,) = tensor_lists
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)).float())
    return norm.reshape(1), None


def _foreach_scale(_chunk_size, _noop_flag, tensor_lists, scale):
    """`local_multi_tensor_scale` (dst = src * scale) as one foreach launch, in place when src
    is dst (gradient clipping), instead of two kernels per tensor."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def foreach_grad_norm() -> None:
    """Without Transformer Engine or Apex, make Megatron-Core's gradient clipping use
    `_foreach_l2_norm` and `_foreach_scale` (same results, no per-parameter device sync).
    A no-op when a fused implementation is installed."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = _foreach_scale


@contextlib.contextmanager
def one_group_per_membership():
    """Inside the block, Megatron's `parallel_state.create_group` makes one process group per
    distinct member list and hands it to every role with those members (the default group for
    all ranks), instead of one communicator per role. Why: `initialize_model_parallel` makes
    17 groups whatever the layout, and with eagerly initialised NCCL each is a communicator
    split, paid again in every generation; most of them repeat a member list (with tp = pp =
    cp = 1 every model-parallel group is the rank alone and every data-parallel one is the
    world). Ranks make groups in the same order, so every rank shares the same ones. Groups
    with their own NCCL options or local synchronisation are made as Megatron asks."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    original, made = ps.create_group, {}
    world = tuple(range(dist.get_world_size()))

    def create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                     use_local_synchronization=False, group_desc=None):
        key = tuple(sorted(ranks))
        if pg_options is not None or use_local_synchronization or backend not in (None, dist.get_backend()):
            return original(ranks, timeout, backend, pg_options, use_local_synchronization, group_desc)
        if key == world:
            return dist.group.WORLD
        if key not in made:
            made[key] = original(ranks, timeout, backend, pg_options, use_local_synchronization, group_desc)
        return made[key]

    ps.create_group = create_group
    try:
        yield
    finally:
        ps.create_group = original


@contextlib.contextmanager
def fetch_before_read(fetch):
    """Make Megatron's torch_dist loader call `fetch(relative file names)` with the files a
    read plan needs before reading them. Megatron-Core 0.16 builds its reader in
    `strategies.torch._get_filesystem_reader` (its only remote path is NVIDIA's
    multi-storage client), so that factory is swapped for the duration of one load."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_data(self, plan, planner):
            fetch({self.storage_data[item.storage_index].relative_path for item in plan.items})
            return super().read_data(plan, planner)

    original = mcore_torch._get_filesystem_reader
    mcore_torch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: Reader(checkpoint_dir)
    try:
        yield
    finally:
        mcore_torch._get_filesystem_reader = original


def write_buckets(async_fn, _rank: int, buckets: list, results_queue) -> None:
    """What Megatron's async write (`async_fn`: `FileSystemWriterAsync.write_preloaded_data_multiproc`
    bound to its transforms and `use_msc`) does, without its fork: each write bucket goes to
    `FileSystemWriterAsync.write_preloaded_data` in a thread of this process, and the results
    (bucket index -> write results, or the first exception) go to `results_queue` for the
    request's finalize (`_rank`, Megatron's first argument, is not needed). Why not Megatron's
    fork of one writer process per bucket: it forks from a background thread while the
    training thread runs, and a lock another thread holds at the fork stays held forever in
    the child (a forked writer then hangs in futex_wait). Raises CheckpointError when
    `async_fn` is not the partial of megatron-core `WRITTEN_FOR`."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if not (isinstance(async_fn, functools.partial) and len(async_fn.args) == 2):
        raise CheckpointError(f"megatron-core's async write is {async_fn!r}, not the partial of "
                              f"(transform_list, use_msc) of megatron-core {WRITTEN_FOR}: install the version "
                              "pinned in requirements.txt")
    transform_list, use_msc = async_fn.args

    def write(i: int, bucket):
        out, count = queue.Queue(), queue.Queue()
        count.put(i)  # the writer marks its bucket done on this queue
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, out, count, True, use_msc=use_msc)
        return out.get()[1]

    with concurrent.futures.ThreadPoolExecutor(max(1, len(buckets)), thread_name_prefix="mcore-write") as pool:
        results = list(pool.map(write, range(len(buckets)), buckets))
    error = next((r for r in results if isinstance(r, Exception)), None)
    results_queue.put(error if error is not None else dict(enumerate(results)))
