"""Typed configuration: one dataclass tree, loaded from YAML, overridden with `--set a.b=value`,
and validated before Ray starts.

Every invalid value raises `ConfigError` whose message names the field (`train.micro_batch_size`)
and says how to fix it. `resolve()` turns `auto` values into concrete ones (device, engine,
dtype) from what this machine has.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from parallel_dims import ParallelDims


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclass
class ClusterConfig:
    num_nodes: int = 1
    gpus_per_node: int = 0
    num_workers: int = 4
    num_spares: int = 4
    cpus_per_actor: float = 0.25
    gpus_per_actor: float | str = "auto"
    device: str = "auto"
    ray_address: typing.Optional[str] = None
    ray_num_cpus: typing.Optional[int] = None


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1


@dataclass
class ModelConfig:
    engine: str = "auto"
    hf_path: typing.Optional[str] = None
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int = 128
    max_seq_len: int = 64
    dtype: str = "auto"
    distributed_optimizer: bool = True


@dataclass
class TrainConfig:
    steps: int = 4
    global_batch_size: int = 16
    mini_batch_size: int = 8
    micro_batch_size: int = 2
    seq_len: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1234


@dataclass
class PPOConfig:
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"


@dataclass
class RLConfig:
    enabled: bool = False
    task: str = "reverse"
    task_args: dict = field(default_factory=dict)
    task_module: typing.Optional[str] = None
    group_size: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    advantage: str = "grpo"
    norm_std: bool = True
    gamma: float = 1.0
    lam: float = 0.95
    value_coef: float = 0.5
    value_clip: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


@dataclass
class CheckpointConfig:
    uri: str = "runs/demo/checkpoints"
    interval: int = 2
    keep_last: int = 2
    async_save: bool = False
    retry_budget_s: float = 60.0


@dataclass
class FaultToleranceConfig:
    health_interval_s: float = 0.5
    health_timeout_s: float = 5.0
    step_timeout_s: float = 120.0
    min_step_timeout_s: float = 10.0
    rendezvous_timeout_s: float = 60.0
    hang_factor: float = 5.0
    restore: str = "auto"
    min_dp: typing.Optional[int] = None
    refill_spares: bool = True
    memory_snapshot_interval: int = 0
    nccl_eager_init: bool = True
    nccl_split_share: bool = False


@dataclass
class ChaosConfig:
    events: list = field(default_factory=list)


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    run_dir: str = "runs/demo"

    def checkpoint_manager(self):
        """The CheckpointManager of `checkpoint.*` (driver and actors build the same one)."""
        from checkpoint import CheckpointManager
        k = self.checkpoint
        return CheckpointManager(k.uri, k.keep_last, retry_budget_s=k.retry_budget_s)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.from_world(self.cluster.num_workers, self.parallel.tp,
                                       self.parallel.pp, self.parallel.cp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "cluster.device": ("auto", "cpu", "cuda"),
    "model.engine": ("auto", "torch", "megatron"),
    "model.dtype": ("auto", "float32", "bfloat16"),
    "ppo.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "fault_tolerance.restore": ("auto", "peer", "memory", "checkpoint"),
    "rl.advantage": ("grpo", "gae"),
    "rl.kl_estimator": ("k1", "k3"),
}


def _check_type(value, hint, name: str):
    """Return `value` converted to `hint` (int -> float allowed) or raise ConfigError."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return None
        *first, last = [a for a in typing.get_args(hint) if a is not type(None)]
        for a in first:  # the first type the value converts to (float | str: 0.5 -> 0.5, "auto")
            with contextlib.suppress(ConfigError):
                return _check_type(value, a, name)
        return _check_type(value, last, name)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    ok = (isinstance(value, hint) and not (hint is int and isinstance(value, bool))
          or hint is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{name}: expected {hint.__name__}, got {value!r} "
                          f"({type(value).__name__}); set it to a {hint.__name__}")
    return float(value) if hint is float else value


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key; known keys here: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_type(value, hint, prefix + key)
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """Apply one `a.b=value` override to a raw config dict; the value is parsed as YAML."""
    if "=" not in override:
        raise ConfigError(f"--set {override!r}: expected the form section.key=value, e.g. train.steps=10")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{part}' is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a YAML file (or the defaults when `path` is None), apply overrides, validate.

    Raises ConfigError naming the first bad field.
    """
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {path}: file not found")
        data = yaml.safe_load(p.read_text()) or {}
    for override in overrides:
        apply_override(data, override)
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {message}")


def validate(cfg: Config) -> None:
    """Semantic checks across fields; raises ConfigError naming the field and the fix."""
    for name, choices in CHOICES.items():
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key)
        _require(value in choices, name, f"{value!r} is not one of {list(choices)}")
    c, t, m = cfg.cluster, cfg.train, cfg.model
    _require(c.num_workers >= 1, "cluster.num_workers", "must be >= 1")
    _require(c.num_spares >= 0, "cluster.num_spares", "must be >= 0")
    _require(c.num_nodes >= 1, "cluster.num_nodes", "must be >= 1")
    _require(c.gpus_per_node >= 0, "cluster.gpus_per_node", "must be >= 0")
    _require(c.cpus_per_actor > 0, "cluster.cpus_per_actor", "must be > 0 (fractions allowed)")
    _require(c.gpus_per_actor == "auto" or isinstance(c.gpus_per_actor, float) and 0 < c.gpus_per_actor <= 1,
             "cluster.gpus_per_actor", "must be auto or in (0, 1]; use a fraction such as 0.5 to let a spare share a GPU")
    for name in ("tp", "pp", "cp"):
        _require(getattr(cfg.parallel, name) >= 1, f"parallel.{name}", "must be >= 1")
    try:
        dims = cfg.dims
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "max_seq_len"):
        _require(getattr(m, name) >= 1, f"model.{name}", "must be >= 1")
    _require(m.hidden_size % m.num_heads == 0, "model.hidden_size",
             f"{m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    _require(m.hf_path is None or Path(m.hf_path).is_dir(), "model.hf_path",
             f"{m.hf_path!r} is not a local directory (no hub downloads at run time)")
    if m.hf_path is not None:
        _validate_hf_path(m)
    _require(t.steps >= 1, "train.steps", "must be >= 1")
    _require(2 <= t.seq_len <= m.max_seq_len, "train.seq_len",
             f"must be in [2, model.max_seq_len={m.max_seq_len}]")
    for name in ("global_batch_size", "mini_batch_size", "micro_batch_size"):
        _require(getattr(t, name) >= 1, f"train.{name}", "must be >= 1")
    _require(t.global_batch_size % t.mini_batch_size == 0, "train.global_batch_size",
             f"{t.global_batch_size} is not a multiple of train.mini_batch_size={t.mini_batch_size}")
    _require(t.mini_batch_size % dims.dp == 0, "train.mini_batch_size",
             f"{t.mini_batch_size} is not a multiple of the data-parallel size dp={dims.dp}")
    _require((t.mini_batch_size // dims.dp) % t.micro_batch_size == 0, "train.micro_batch_size",
             f"the per-replica mini-batch {t.mini_batch_size // dims.dp} "
             f"(train.mini_batch_size / dp) is not a multiple of {t.micro_batch_size}")
    _require(t.lr > 0, "train.lr", "must be > 0")
    _require(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    p = cfg.ppo
    _require(0 < p.eps_clip_low < 1, "ppo.eps_clip_low", "must be in (0, 1)")
    _require(0 < p.eps_clip_high < 1, "ppo.eps_clip_high", "must be in (0, 1)")
    _require(p.clip_ratio_c > 1, "ppo.clip_ratio_c", "must be > 1 (dual-clip bound, e.g. 3.0)")
    if cfg.rl.enabled:
        _validate_rl(cfg)
    k = cfg.checkpoint
    _require(bool(k.uri), "checkpoint.uri", "must be a path, file://, s3:// or gs:// URI")
    _require(k.interval >= 0, "checkpoint.interval", "must be >= 0 (0 disables checkpoints)")
    _require(k.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _require(k.retry_budget_s > 0, "checkpoint.retry_budget_s", "must be > 0 seconds")
    f = cfg.fault_tolerance
    for name in ("health_interval_s", "health_timeout_s", "step_timeout_s", "min_step_timeout_s",
                 "rendezvous_timeout_s"):
        _require(getattr(f, name) > 0, f"fault_tolerance.{name}", "must be > 0 seconds")
    _require(f.min_step_timeout_s <= f.step_timeout_s, "fault_tolerance.min_step_timeout_s",
             f"must be <= fault_tolerance.step_timeout_s={f.step_timeout_s}")
    _require(f.hang_factor >= 1, "fault_tolerance.hang_factor", "must be >= 1 (deadline = factor x median step time)")
    _require(f.min_dp is None or 1 <= f.min_dp <= dims.dp, "fault_tolerance.min_dp",
             f"must be null (never shrink) or in [1, dp={dims.dp}]")
    _require(isinstance(f.memory_snapshot_interval, int) and f.memory_snapshot_interval >= 0,
             "fault_tolerance.memory_snapshot_interval", "must be an integer >= 0 (0: off)")
    _require(f.restore != "memory" or f.memory_snapshot_interval > 0, "fault_tolerance.restore",
             "'memory' needs fault_tolerance.memory_snapshot_interval >= 1")
    for i, ev in enumerate(cfg.chaos.events):
        _validate_chaos_event(ev, f"chaos.events[{i}]", c.num_workers)
    if m.engine == "torch":
        _require(dims.tp == dims.pp == dims.cp == 1, "model.engine",
                 "the torch engine is data-parallel only; set parallel.tp/pp/cp=1 or model.engine=megatron")
    if m.engine == "megatron":
        _validate_megatron(cfg, dims)


def _validate_rl(cfg: Config) -> None:
    """RL mode (`rl.enabled`): sampling knobs, the task (built here, so a bad name or argument
    stops the run before Ray starts), room for prompt + completion in train.seq_len, and no
    context parallelism (generation runs whole prefixes on every rank)."""
    r, t, m = cfg.rl, cfg.train, cfg.model
    _require(cfg.parallel.cp == 1, "parallel.cp",
             f"{cfg.parallel.cp}: RL rollouts (generation) do not support context parallelism; "
             "set parallel.cp=1 (use parallel.tp / parallel.pp to split the model) or rl.enabled=false")
    _require(r.group_size >= 1, "rl.group_size", "must be >= 1")
    _require(r.advantage != "grpo" or r.group_size >= 2, "rl.group_size",
             "GRPO normalises rewards within a prompt's group of samples: needs >= 2 samples "
             "per prompt (or set rl.advantage=gae)")
    _require(t.global_batch_size % r.group_size == 0, "rl.group_size",
             f"train.global_batch_size={t.global_batch_size} is not a multiple of {r.group_size}")
    _require(r.max_new_tokens >= 1, "rl.max_new_tokens", "must be >= 1")
    _require(r.temperature > 0, "rl.temperature", "must be > 0")
    _require(0 < r.top_p <= 1, "rl.top_p", "must be in (0, 1]")
    _require(0 <= r.gamma <= 1, "rl.gamma", "must be in [0, 1]")
    _require(0 <= r.lam <= 1, "rl.lam", "must be in [0, 1]")
    _require(r.value_coef > 0, "rl.value_coef", "must be > 0 (weight of the value loss for rl.advantage=gae)")
    _require(r.value_clip >= 0, "rl.value_clip", "must be >= 0 (0: no value clipping)")
    _require(r.kl_coef >= 0, "rl.kl_coef", "must be >= 0 (0: no KL penalty, no reference model)")
    _require(r.entropy_coef >= 0, "rl.entropy_coef", "must be >= 0 (0: no entropy bonus)")
    from rl import make_task
    try:
        task = make_task(r.task, r.task_args, r.task_module)
    except KeyError as e:
        raise ConfigError(f"rl.task: {e.args[0]}; register it with rl.register_task or set "
                          f"rl.task_module to the module that does") from None
    except ImportError as e:
        raise ConfigError(f"rl.task_module: cannot import {r.task_module!r}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"rl.task_args: {e}") from None
    _require(len(task.tokenizer) <= m.vocab_size, "model.vocab_size",
             f"{m.vocab_size} is smaller than the {len(task.tokenizer)} tokens of task {r.task!r}")
    _require(task.max_prompt_len + r.max_new_tokens <= t.seq_len, "train.seq_len",
             f"{t.seq_len} cannot hold a prompt of up to {task.max_prompt_len} tokens plus "
             f"rl.max_new_tokens={r.max_new_tokens}; raise train.seq_len or lower rl.max_new_tokens")


def _validate_hf_path(m: ModelConfig) -> None:
    """model.hf_path is a Hugging Face model directory (config.json) whose vocabulary holds
    every token id the run feeds it (ids are drawn below model.vocab_size). Its architecture
    is checked by the engine that loads it (megatron_engine.hf_bridge)."""
    import json

    path = Path(m.hf_path) / "config.json"
    _require(path.is_file(), "model.hf_path",
             f"{m.hf_path!r} has no config.json (not a Hugging Face model directory)")
    try:
        hf_vocab = json.loads(path.read_text()).get("vocab_size")
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_path: cannot read {str(path)!r}: {e}") from None
    _require(not isinstance(hf_vocab, int) or m.vocab_size <= hf_vocab, "model.vocab_size",
             f"{m.vocab_size} is larger than the {hf_vocab} tokens of model.hf_path "
             f"(token ids must exist in its embedding; set model.vocab_size <= {hf_vocab})")


def _validate_megatron(cfg: Config, dims: ParallelDims) -> None:
    """Sizes Megatron-Core can shard: layers over pp, heads / ffn / padded vocab over tp,
    the sequence over 2 * cp load-balanced chunks."""
    m, t = cfg.model, cfg.train
    _require(m.num_layers % dims.pp == 0, "model.num_layers",
             f"{m.num_layers} is not divisible by parallel.pp={dims.pp}")
    _require(m.num_heads % dims.tp == 0, "model.num_heads",
             f"{m.num_heads} is not divisible by parallel.tp={dims.tp}")
    _require(m.ffn_hidden_size % dims.tp == 0, "model.ffn_hidden_size",
             f"{m.ffn_hidden_size} is not divisible by parallel.tp={dims.tp}")
    padded = -(-m.vocab_size // 128) * 128  # megatron_engine.padded_vocab_size
    _require(padded % dims.tp == 0, "parallel.tp",
             f"the vocabulary padded to a multiple of 128 ({padded}) is not divisible by tp={dims.tp}")
    _require(dims.cp == 1 or t.seq_len % (2 * dims.cp) == 0, "train.seq_len",
             f"{t.seq_len} is not a multiple of 2 * parallel.cp = {2 * dims.cp} (load-balanced context parallelism)")


CHAOS_KINDS = ("kill", "exception", "hang", "slow", "node")
CHAOS_POINTS = ("step_start", "before_allreduce", "inside_allreduce", "after_optimizer_step",
                "during_save", "mid_save", "during_recovery")


def _validate_chaos_event(ev, name: str, world_size: int) -> None:
    """A chaos event is {step: int >= 1, rank: int, kind: CHAOS_KINDS, point: CHAOS_POINTS}.
    'slow' makes every later micro-batch of that call take 1 s more (alive, progressing: must
    not be declared dead); 'node' kills every actor on the rank's node (no point)."""
    _require(isinstance(ev, dict) and set(ev) <= {"step", "rank", "kind", "point"}
             and {"step", "rank", "kind"} <= set(ev), name,
             "expected a mapping with step, rank, kind and (except kind: node) point")
    _require(isinstance(ev["step"], int) and ev["step"] >= 1, f"{name}.step", "must be an int >= 1")
    _require(isinstance(ev["rank"], int) and 0 <= ev["rank"] < world_size, f"{name}.rank",
             f"must be in [0, cluster.num_workers={world_size})")
    _require(ev["kind"] in CHAOS_KINDS, f"{name}.kind", f"must be one of {list(CHAOS_KINDS)}")
    _require(ev["kind"] == "node" or ev.get("point") in CHAOS_POINTS, f"{name}.point",
             f"must be one of {list(CHAOS_POINTS)}")


def model_signature(cfg: Config) -> dict:
    """What a checkpoint must match to be loaded into this run's model (recorded in manifests)."""
    m = cfg.model
    return {"engine": m.engine, "hf_path": m.hf_path, "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
            "ffn_hidden_size": m.ffn_hidden_size,
            **({"rl": {"value_head": cfg.rl.advantage == "gae", "reference": cfg.rl.kl_coef > 0}}
               if cfg.rl.enabled else {})}


def check_compatible(cfg: Config, manifest) -> None:
    """Raise ConfigError naming both sides when `manifest` (a committed checkpoint) was written by
    another model or a layout this engine cannot load."""
    saved = manifest.extra.get("model")
    ours = model_signature(cfg)
    if saved is not None and saved != ours:
        diff = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
        raise ConfigError(f"model: checkpoint step {manifest.step} was written by another model "
                          f"(field: checkpoint value vs this run: {diff}); point checkpoint.uri elsewhere "
                          f"or use the model it was written with")
    layout = manifest.layout
    if ours["engine"] == "torch" and any(layout.get(k, 1) != 1 for k in ("tp", "pp", "cp")):
        raise ConfigError(f"parallel: checkpoint step {manifest.step} has layout {layout}; the torch "
                          f"engine loads data-parallel checkpoints only (tp=pp=cp=1)")


def preflight(cfg: Config, resources: dict) -> None:
    """Checks that need the cluster, run before any actor starts. `resources`: Ray's
    `cluster_resources()` (logical CPU / GPU totals). Raises ConfigError naming the field when the
    cluster cannot hold every worker and spare, or the checkpoint URI cannot be written."""
    from checkpoint import CheckpointError

    c = cfg.cluster
    n = c.num_workers + c.num_spares
    need = {"CPU": n * c.cpus_per_actor}
    if c.device == "cuda":
        need["GPU"] = n * c.gpus_per_actor
        _require(c.num_workers <= resources.get("GPU", 0.0) + 1e-9, "cluster.num_workers",
                 f"{c.num_workers} ranks on {resources.get('GPU', 0.0):g} GPUs would put two ranks of the "
                 f"process group on one GPU; lower cluster.num_workers (and the parallel sizes) or add GPUs")
    for res, amount in need.items():
        have = resources.get(res, 0.0)
        _require(amount <= have + 1e-9, "cluster.num_workers",
                 f"{c.num_workers} workers + {c.num_spares} spares need {amount:g} {res} "
                 f"({'cpus' if res == 'CPU' else 'gpus'}_per_actor each) but the cluster has {have:g} "
                 f"{res}; lower cluster.num_spares / cluster.{res.lower()}s_per_actor or add nodes")
    try:
        cfg.checkpoint_manager().check_writable()
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.uri: {e}; check the URI, endpoint and credentials") from None


def gpus_visible() -> int:
    """Number of CUDA devices this process sees (0 when torch has no CUDA)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(cfg: Config, num_gpus: int | None = None) -> Config:
    """Return a copy with `auto` values made concrete for a machine with `num_gpus` GPUs.

    device auto -> cuda when GPUs are visible, else cpu; engine auto -> megatron on cuda,
    torch on cpu; dtype auto -> bfloat16 on cuda, float32 on cpu. Raises ConfigError for
    combinations this machine cannot run (megatron on CPU, cuda without GPUs).
    """
    num_gpus = gpus_visible() if num_gpus is None else num_gpus
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster),
                              model=dataclasses.replace(cfg.model))
    if cfg.cluster.device == "auto":
        cfg.cluster.device = "cuda" if num_gpus > 0 else "cpu"
    _require(cfg.cluster.device == "cpu" or num_gpus > 0, "cluster.device",
             "cuda was asked for but no GPU is visible; set cluster.device=cpu or auto")
    cuda = cfg.cluster.device == "cuda"
    if cfg.model.engine == "auto":
        cfg.model.engine = "megatron" if cuda else "torch"
    _require(cuda or cfg.model.engine == "torch", "model.engine",
             "Megatron-Core models need GPUs; set model.engine=torch (or auto) on a CPU machine")
    if cfg.model.dtype == "auto":
        cfg.model.dtype = "bfloat16" if cuda else "float32"
    c = cfg.cluster
    if c.gpus_per_actor == "auto":  # a whole GPU each, or 1/k of one when there are too few
        gpus = c.gpus_per_node * c.num_nodes if c.gpus_per_node else num_gpus if c.ray_address is None else 0
        c.gpus_per_actor = 1.0 / (math.ceil((c.num_workers + c.num_spares) / gpus) if cuda and gpus else 1)
    validate(cfg)
    return cfg
