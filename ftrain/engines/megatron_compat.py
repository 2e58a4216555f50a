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
import threading

import megatron.core
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from ftrain.state.checkpoint_io import IO, no_zip_crc32
from ftrain.state.hashed_file import HashedFile
from ftrain.state.manifest import CheckpointError
from ftrain.state.safe_load import SafeReader

log = logging.getLogger(__name__)
WRITTEN_FOR = "0.16.1"  # megatron-core version the patches below were written against
# (patch, Megatron-Core module, attributes it replaces or relies on, what to re-check)
PATCHES = (
    ("patch_distributed_optimizer", "megatron.core.optimizer.distrib_optimizer",
     ("DistributedOptimizer._set_main_param_and_optimizer_states",
      "DistributedOptimizer.sharded_param_state_fully_reshardable",
      "DistributedOptimizer._get_main_param_and_optimizer_states"),
     "per-instance method swaps: the original load raises KeyError 'step' in a fully_reshardable "
     "load; the model-space state of a save or load with one DP rank is built from views (same keys, shapes, "
     "replica ids as the original's, which iterates gbuf_ranges / buffers[i].param_index_map)"),
    ("torch_dist_reader", "megatron.core.dist_checkpointing.strategies.torch",
     ("_get_filesystem_reader",),
     "the torch_dist loader's reader factory (checkpoint_dir, cache_metadata=True: metadata read once), "
     "swapped for one load for a reader that reads in parallel, straight into the destinations, and "
     "fetches files before reading"),
    ("write_buckets", "megatron.core.dist_checkpointing.strategies.filesystem_async",
     ("FileSystemWriterAsync.write_preloaded_data_multiproc", "FileSystemWriterAsync.write_preloaded_data",
      "_write_item"),
     "re-implements the async write (partial(write_preloaded_data_multiproc, transform_list, use_msc)) "
     "with threads instead of forked writers, and write_preloaded_data (each bucket's items through "
     "_write_item(*transform_list, stream, data, item, storage_key, serialization_format=TORCH_SAVE), "
     "then fsync) with the file hashed as written"),
    ("foreach_grad_norm", "megatron.core.optimizer.clip_grads",
     ("l2_norm_impl", "multi_tensor_scale_impl", "multi_tensor_applier"),
     "without TE / Apex, clip_grads' local fallbacks: l2_norm_impl(chunk, noop, [tensors], per_tensor) "
     "-> ([1] norm, None), multi_tensor_scale_impl(chunk, noop, [src, dst], scale)"),
    ("one_group_per_membership", "megatron.core.parallel_state",
     ("create_group", "initialize_model_parallel"),
     "initialize_model_parallel makes every group through the module's create_group(ranks=..., "
     "timeout=..., pg_options=..., group_desc=...)"),
    ("cpu_stand_ins", "megatron.core.tensor_parallel.random",
     ("_get_cuda_rng_state", "_set_cuda_rng_state", "CudaRNGStatesTracker.add", "CudaRNGStatesTracker.fork"),
     "a process without CUDA: the RNG tracker reads and sets its states through _get_cuda_rng_state / "
     "_set_cuda_rng_state and torch.cuda.get_rng_state / manual_seed; new buffers go on "
     "torch.cuda.current_device(); the p2p and checkpoint paths call torch.cuda.synchronize()"),
    ("local_param_groups", "megatron.core.optimizer", ("_get_param_groups", "get_megatron_optimizer"),
     "get_megatron_optimizer -> _get_param_groups all_gather_object's every rank's param-group keys "
     "over the world (torch.distributed.all_gather_object, looked up at call time)"),
    ("params_from_main_params", "megatron.core.optimizer.distrib_optimizer",
     ("DistributedOptimizer._copy_main_params_to_model_params",),
     "called outside an update: copies each main-param shard (cast) into its range of the DDP's "
     "param buffer, which DistributedDataParallel.start_param_sync(force_sync=True) then all-gathers"),
    ("cpu_stand_ins", "megatron.core.optimizer.distrib_optimizer",
     ("DistributedOptimizer._build_model_and_main_param_groups",),
     "DistributedOptimizer._build_model_and_main_param_groups sorts parameters by Tensor.type() "
     "('torch.cuda.FloatTensor' / HalfTensor / BFloat16Tensor) and raises TypeError for others"),
    ("cpu_stand_ins", "megatron.core.optimizer.optimizer", ("clip_grad_by_total_norm_fp32",),
     "the optimizer's clip_grad_by_total_norm_fp32(params, max_norm, total_norm, use_decoupled_grad), "
     "imported by name, asserts CUDA gradients: replaced on CPU by the same scaling"),
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
    for k, v in tensors.items():
        dst = main.data if k == "param" else opt.optimizer.state[main][k]
        if v.data_ptr() != dst.data_ptr():  # equal: loaded in place (`_model_space_views`)
            dst.copy_(v)


_MODEL_SPACE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # Megatron's world-tensor keys, in its order


def _model_space_views(opt, original, model_sharded_state_dict, is_loading: bool = False,
                       metadata: dict | None = None):
    """`DistributedOptimizer.sharded_param_state_fully_reshardable` of a save or load whose DP
    group has one rank: the same dict of ShardedTensors (index -> {"param", "exp_avg",
    "exp_avg_sq"}; keys `optimizer.state.<key>.<model key>`, the model parameter's shape and
    replica id, fp32), whose data are views of the live main params and Adam moments on the
    device. Why: with one DP rank each parameter's optimizer state is already whole, yet the
    original gathers every shard into new pageable host tensors with a synchronous copy per
    parameter to save (seconds per GB of state: most of an async save's stall), and to load
    allocates host tensors for the whole state, reads into them and copies each to the device.
    A save copies the views itself (`megatron_checkpoint.PendingSave`: to pinned memory, on a
    side stream); a load reads into them, so `load_parameter_state_from_fully_reshardable`
    finds the state in place (`_set_main_param_and_state` skips those copies). DP > 1, the
    memory-efficient variant, or a state that is not whole per parameter: the original."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    metadata = metadata or {}
    if opt.data_parallel_group.size() > 1 or metadata.get("distrib_optim_fully_reshardable_mem_efficient"):
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
def local_param_groups():
    """Inside the block, `torch.distributed.all_gather_object` gives every rank's slot this
    rank's object, with no collective: Megatron's `get_megatron_optimizer` gathers the
    parameter-group keys of every rank of the world so that all build the same groups. Why:
    here every rank builds the same groups (one model code, no per-parameter overrides), and a
    rank that builds its optimizer while the others keep theirs (a spare joining survivors,
    `MegatronEngine.connect`) would wait in a gather they never make: the spare's join hung, or
    the gather took the survivors' next collective."""
    import copy

    import torch.distributed as dist

    original = dist.all_gather_object

    def own(object_list, obj, group=None):
        object_list[:] = [copy.deepcopy(obj) for _ in object_list]

    dist.all_gather_object = own
    try:
        yield
    finally:
        dist.all_gather_object = original


def _on_cpu(factory):
    """`factory` (torch.zeros, ...) with a CUDA `device` argument taken as the CPU."""
    @functools.wraps(factory)
    def on_cpu(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)
    return on_cpu


def _clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """Megatron's `clip_grad_by_total_norm_fp32` (gradients scaled in place by max_norm /
    (total_norm + 1e-6) when that is below 1) without its assertion that they are CUDA tensors."""
    grads = [getattr(p, "decoupled_grad" if use_decoupled_grad else "grad", None) for p in parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        _foreach_scale(None, None, [[g.detach() for g in grads if g is not None]] * 2, coeff)


def params_from_main_params(optimizer, ddp) -> None:
    """Make the params of `ddp` (Megatron's DistributedDataParallel) the cast of `optimizer`'s
    main params (a ChainedOptimizer of DistributedOptimizers), all-gathered over DP: what the
    distributed optimizer does after each update. A collective of the DP group."""
    for o in optimizer.chained_optimizers:
        o._copy_main_params_to_model_params()
    ddp.start_param_sync(force_sync=True)


_CUDA_TYPES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
               torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def cpu_stand_ins() -> None:
    """In a process without CUDA, make the CUDA calls Megatron-Core's training path makes act
    on the CPU: `torch.cuda.current_device()` is "cpu" (where Megatron puts new buffers),
    tensor factories given device "cuda" (Megatron's optimizer, clip-grad and schedule
    literals) and `Tensor.cuda()` make or keep CPU tensors, `Tensor.type()` names a float
    tensor's CUDA type (the distributed optimizer sorts parameters by it and refuses others),
    `torch.cuda.synchronize()` does nothing, and the CUDA RNG (Megatron's RNG tracker, its
    seeding, `torch.cuda.get_rng_state` / `set_rng_state` / `manual_seed`) is the CPU generator,
    so the tracker forks the CPU RNG as it forks CUDA's on a GPU: each TP rank initialises its
    shard from its own seeded state, DP replicas identically. Why: the Megatron engine's logic
    (groups, peer restore, checkpoints) is tested on CPU processes over gloo. Raises
    RuntimeError when CUDA is available (the stand-ins would hide the GPU). Idempotent."""
    from megatron.core.optimizer import optimizer
    from megatron.core.tensor_parallel import random

    if torch.cuda.is_available():
        raise RuntimeError("cpu_stand_ins: CUDA is available; the Megatron engine uses the GPU")
    if getattr(torch.zeros, "__wrapped__", None) is not None:
        return  # already in place
    for name in ("tensor", "zeros", "ones", "empty", "full"):  # Megatron's device='cuda' literals
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    as_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *args, **kwargs: (
        as_type(self, *args, **kwargs) if args or kwargs else _CUDA_TYPES.get(self.dtype) or as_type(self))
    optimizer.clip_grad_by_total_norm_fp32 = _clip_by_total_norm
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = torch.cuda.random.manual_seed = lambda seed: torch.manual_seed(seed) and None
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # The tracker's fork warns when the CPU RNG moved inside it: here that is the forked RNG itself.
    logging.getLogger(random.__name__).addFilter(lambda r: "CPU RNG state changed" not in r.getMessage())


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
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

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
def torch_dist_reader(fetch=None):
    """Inside the block, Megatron's torch_dist loader reads with `_Reader` (files in parallel,
    tensors straight into their destinations) and, when `fetch` is given, calls `fetch(relative
    file names)` with the files a read plan needs before reading them. Megatron-Core 0.16 builds
    its reader in `strategies.torch._get_filesystem_reader` (its only remote path is NVIDIA's
    multi-storage client), so that factory is swapped for the duration of one load."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    original = mcore_torch._get_filesystem_reader
    mcore_torch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: _Reader(checkpoint_dir, fetch)
    try:
        yield
    finally:
        mcore_torch._get_filesystem_reader = original


_READ_THREADS = 8  # files of one read plan read at once
_STAGE = 16 << 20  # bytes: each of the two pinned buffers of a thread that reads into GPU memory


class _Reader(SafeReader):
    """Megatron's torch_dist reader (torch DCP's FileSystemReader, metadata read once and by
    the allow-list unpickler of `checkpoint.SafeReader`: loading never runs code), faster:
    the files of a read plan are read in parallel (a thread each, at most `_READ_THREADS`), and
    a tensor whose stored bytes are those of its destination (after the plan's narrowing: same
    dtype and shape, both contiguous) is read straight into it (CPU memory), or through two
    pinned buffers per thread (GPU memory), instead of torch.load into a new tensor and a copy.
    Anything else (objects, stream transforms, slices of another layout that are not
    contiguous) goes through FileSystemReader.read_data, one item at a time. The planner is
    called under one lock (DCP's planners assume one caller). Stored bytes are taken in the
    host's byte order, as torch.save writes them (every supported host is little-endian)."""

    def __init__(self, path, fetch=None):
        super().__init__(path)
        self._fetch, self._metadata = fetch, None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:  # Megatron reads it again after the load
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if self._fetch is not None:
            self._fetch(set(per_file))
        lock = threading.Lock()
        with concurrent.futures.ThreadPoolExecutor(max(1, min(_READ_THREADS, len(per_file))),
                                                   thread_name_prefix="mcore-read") as pool:
            for _ in pool.map(lambda name: self._read_file(name, per_file[name], planner, lock), per_file):
                pass
        done = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: list, planner, lock) -> None:
        stage = None
        try:
            with open(self.fs.concat_path(self.path, name), "rb") as f:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    stored = self._stored_bytes(f, item)
                    with lock:
                        target = None if stored is None else planner.resolve_tensor(item).detach()
                        if target is None or not _fits(target, stored[0]):
                            super().read_data(LoadPlan([item]), planner)
                            continue
                    if target.is_cuda:
                        stage = stage or _Stage(target.device)
                        stage.copy(f, stored[1], target)
                    else:
                        _read_exact(f, stored[1], memoryview(target.view(-1).view(torch.uint8).numpy()))
                    with lock:
                        planner.commit_tensor(item, target)
        finally:
            if stage is not None:
                stage.finish()  # also on an error: no copy may still read a buffer once it is freed

    def _stored_bytes(self, f, item):
        """(meta tensor of the stored slice `item` reads, offset in `f` of its first byte) when
        those bytes are contiguous in the file, else None. Reads only the small records of the
        item's torch.save archive (torch.load to the meta device records each storage's offset)."""
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            return None
        meta = torch.load(_create_file_view(f, info.offset, info.length), map_location="meta", weights_only=True)
        start = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
        src = narrow_tensor_by_index(meta, item.storage_offsets, item.lengths)
        if start is None or not src.is_contiguous():
            return None
        return src, info.offset + start + src.storage_offset() * src.element_size()


def _fits(target: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the bytes of `src` (contiguous) can be read into `target` as they are."""
    return (type(target) is torch.Tensor and target.device.type in ("cpu", "cuda") and target.dtype == src.dtype
            and target.shape == src.shape and target.is_contiguous())


def _read_exact(f, offset: int, out: memoryview) -> None:
    """Read len(`out`) bytes of `f` from `offset` into `out` (the GIL is released while reading).
    Raises EOFError when the file ends first."""
    f.seek(offset)
    if f.readinto(out) != len(out):
        raise EOFError(f"{f.name}: fewer than {len(out)} bytes at offset {offset}")


class _Stage:
    """Two pinned host buffers of `_STAGE` bytes through which one thread reads file bytes into
    GPU memory: a piece is read into one buffer while the other's copy to the GPU runs."""

    def __init__(self, device: torch.device):
        from ftrain.state.host_memory import pinned_empty

        self.device = device
        self.buffers = [pinned_empty(_STAGE, device.index) for _ in range(2)]
        self.copied: list = [None, None]  # the event of each buffer's copy in flight
        self.turn = 0

    def copy(self, f, offset: int, target: torch.Tensor) -> None:
        out = target.view(-1).view(torch.uint8)
        with torch.cuda.device(self.device):
            for start in range(0, out.numel(), _STAGE):
                n = min(_STAGE, out.numel() - start)
                buf, done = self.buffers[self.turn], self.copied[self.turn]
                if done is not None:
                    done.synchronize()  # its previous copy has left the buffer
                _read_exact(f, offset + start, memoryview(buf[:n].numpy()))
                out[start:start + n].copy_(buf[:n], non_blocking=True)
                self.copied[self.turn] = torch.cuda.Event()
                self.copied[self.turn].record()
                self.turn ^= 1

    def finish(self) -> None:
        """Wait until every copy has reached the GPU (the destinations may be used after)."""
        for done in self.copied:
            if done is not None:
                done.synchronize()


def _write_bucket(transform_list: list, bucket) -> tuple[list, tuple[int, str]]:
    """`FileSystemWriterAsync.write_preloaded_data` of one write bucket (file path, storage key,
    (byte items, tensor items)) into a `HashedFile` (sha256 computed as written, O_DIRECT):
    every item through torch's `_write_item` (torch.save of each tensor) in Megatron's order,
    then fsync. Returns (the items' WriteResults, (file size in bytes, sha256 hex))."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import _write_item

    path, storage_key, (bytes_data, tensor_data) = bucket
    out = HashedFile(path, on_write=IO.moved)  # a slow disk is not a hang (`checkpoint.IOProgress`)
    try:
        results = [_write_item(*transform_list, out, data, item, storage_key,
                               serialization_format=SerializationFormat.TORCH_SAVE)
                   for item, data in [*bytes_data, *tensor_data]]
    finally:
        out.close()
    return results, (out.size, out.sha256.hexdigest())


def write_buckets(async_fn, _rank: int, buckets: list, results_queue) -> dict[str, tuple[int, str]]:
    """What Megatron's async write (`async_fn`: `FileSystemWriterAsync.write_preloaded_data_multiproc`
    bound to its transforms and `use_msc`) does, without its fork and without a second read of
    the files: the write buckets are written in parallel, one thread each (`_write_bucket`:
    hashed as written, O_DIRECT, fsync'd), with torch.save's zip CRC32 off (`no_zip_crc32`);
    the results (bucket index -> write results, or the first exception) go to `results_queue`
    for the request's finalize (`_rank`, Megatron's first argument, is not needed). Returns {file name
    in the checkpoint directory: (size in bytes, sha256 hex)} of the files written, for
    `CheckpointManager.put_files(..., hashed=...)`; {} when a bucket failed.
    Why not Megatron's fork of one writer process per bucket: it forks from a background thread
    while the training thread runs, and a lock another thread holds at the fork stays held
    forever in the child (a forked writer then hangs in futex_wait). Raises CheckpointError when
    `async_fn` is not the partial of megatron-core `WRITTEN_FOR`, or when Megatron's
    multi-storage client is enabled (this writer writes local files)."""
    if not (isinstance(async_fn, functools.partial) and len(async_fn.args) == 2):
        raise CheckpointError(f"megatron-core's async write is {async_fn!r}, not the partial of "
                              f"(transform_list, use_msc) of megatron-core {WRITTEN_FOR}: install the version "
                              "pinned in requirements.txt")
    transform_list, use_msc = async_fn.args
    if use_msc:
        raise CheckpointError("megatron-core's multi-storage client is enabled; checkpoints are staged in local "
                              "files (disable it, or uninstall multistorageclient)")

    def write(bucket):
        try:
            return _write_bucket(transform_list, bucket)
        except Exception as exc:  # noqa: BLE001 (handed to finalize, as Megatron's writer does)
            return exc, None

    with no_zip_crc32(), concurrent.futures.ThreadPoolExecutor(
            max(1, len(buckets)), thread_name_prefix="mcore-write") as pool:
        written = list(pool.map(write, buckets))
    error = next((r for r, _ in written if isinstance(r, Exception)), None)
    results_queue.put(error if error is not None else {i: r for i, (r, _) in enumerate(written)})
    return {} if error is not None else {key: digest for (_, key, _), (_, digest) in zip(buckets, written)}
