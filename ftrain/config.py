"""Typed configuration: one dataclass tree, loaded from YAML, overridden with `--set a.b=value`,
and validated before Ray starts.

Every field is documented by the string right under it; `python -m ftrain.config` writes those
docstrings as the reference docs/configuration.md (tests/test_config.py checks it is current).
Every invalid value raises `ConfigError` whose message names the field (`train.micro_batch_size`)
and says how to fix it. `resolve()` turns `auto` values into concrete ones (device, engine,
dtype) from what this machine has. This module imports no other module of the project.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclass
class ClusterConfig:
    """Where the actors run: Ray nodes and GPUs, training ranks and spares."""

    num_nodes: int = 1
    """Ray nodes the placement group spreads over (> 1: SPREAD strategy, else PACK); >= 1."""
    gpus_per_node: int = 0
    """GPUs per node (0 on CPU machines, or to use the GPUs of a local Ray); when set,
    `gpus_per_actor: auto` and `--dry-run` plan for gpus_per_node x num_nodes GPUs; >= 0."""
    num_workers: int = 4
    """Ranks in training = tp * pp * cp * dp: a multiple of parallel.tp * parallel.pp *
    parallel.cp; >= 1."""
    num_spares: int = 4
    """Pre-warmed backup actors (model built, in no process group) that replace failed ranks;
    >= 0."""
    cpus_per_actor: float = 0.25
    """Logical CPUs per actor (fractions allowed; Ray schedules by these); > 0."""
    gpus_per_actor: float | str = "auto"
    """GPUs per actor, in (0, 1], or auto; < 1 lets a spare share a GPU with a worker (ranks
    never share one); auto: 1, or 1/k when the GPUs (gpus_per_node x num_nodes, else those of a
    local Ray) are fewer than the actors."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device and collective backend: cuda + NCCL or cpu + gloo (auto: cuda when GPUs are
    visible, else cpu)."""
    ray_address: str | None = None
    """null: start a local Ray; "auto" or ray://...: join a running cluster."""
    ray_num_cpus: int | None = None
    """Logical CPUs of a local Ray (null: enough for every actor)."""


@dataclass
class ParallelConfig:
    """Model-parallel sizes; the data-parallel size is dp = cluster.num_workers / (tp * pp * cp)."""

    tp: int = 1
    """Tensor-parallel size; >= 1."""
    pp: int = 1
    """Pipeline-parallel size; >= 1."""
    cp: int = 1
    """Context-parallel size; >= 1 (1 with rl.enabled: generation does not split sequences)."""


@dataclass
class ModelConfig:
    """The model: a GPT of the sizes below, or a local Hugging Face model (hf_path)."""

    engine: Literal["auto", "torch", "megatron"] = "auto"
    """Training engine: torch (data-parallel only: parallel.tp = pp = cp = 1) or megatron
    (Megatron-Core, GPUs only); auto: megatron on cuda, torch on cpu."""
    hf_path: str | None = None
    """Local Hugging Face model directory (with config.json) to load; null: build the model
    from the sizes below. Nothing is downloaded at run time."""
    vocab_size: int = 128
    """Tokens in the vocabulary (megatron pads it to a multiple of 128); at most those of
    hf_path's model, at least those of the RL task; >= 1."""
    hidden_size: int = 64
    """Model width; divisible by num_heads; >= 1."""
    num_layers: int = 2
    """Transformer layers (megatron: divisible by parallel.pp); >= 1."""
    num_heads: int = 4
    """Attention heads (megatron: divisible by parallel.tp); >= 1."""
    ffn_hidden_size: int = 128
    """MLP width (megatron: divisible by parallel.tp); >= 1."""
    max_seq_len: int = 64
    """Longest sequence the model accepts, in tokens; >= train.seq_len."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter and compute dtype (auto: bfloat16 on cuda, float32 on cpu)."""
    distributed_optimizer: bool | Literal["auto"] = "auto"
    """Shard the optimizer state over DP: megatron's distributed optimizer (fp32 main params and
    Adam state), the torch engine's ZeRO-1 (`ZeroRedundancyOptimizer`). A lost shard is on no DP
    peer: `fault_tolerance.shard_keeper` keeps a copy of each off its node. auto: true on
    megatron, false on torch."""


@dataclass
class TrainConfig:
    """Steps, batch sizes (in sequences) and the AdamW optimizer."""

    steps: int = 4
    """Train steps (one rollout batch each); >= 1."""
    global_batch_size: int = 16
    """Sequences per step, over all DP replicas; a multiple of mini_batch_size."""
    mini_batch_size: int = 8
    """Sequences per optimizer step, over all DP replicas (global_batch_size / mini_batch_size
    updates per step); a multiple of dp."""
    micro_batch_size: int = 2
    """Sequences per forward/backward on one rank (gradient accumulation); divides
    mini_batch_size / dp."""
    seq_len: int = 32
    """Tokens per sequence, in [2, model.max_seq_len] (megatron with cp > 1: a multiple of
    2 * parallel.cp)."""
    lr: float = 1e-3
    """AdamW learning rate, cosine decay to 0 over train.lr_decay_steps; > 0."""
    lr_decay_steps: int | None = None
    """Steps of the cosine learning-rate decay (Megatron-LM's --lr-decay-iters, in steps); the
    learning rate is 0 after them. null: train.steps at the run's start, recorded in its
    checkpoints, so raising train.steps of a finished run continues it on the same schedule;
    >= 1."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max gradient norm (0: no clipping); >= 0."""
    seed: int = 1234
    """Seed of the model init and the data order; data = f(seed, step, dp rank)."""
    objective: Literal["ppo", "ce"] = "ppo"
    """ppo: the clipped PPO loss (synthetic batches or rl.enabled); ce: next-token cross
    entropy over the loss mask (data.kind mock, indexed or sft), token-mean over each global
    mini-batch, no extra forward pass."""

    def lr_decay_updates(self) -> int:
        """Optimizer updates of the cosine decay: (lr_decay_steps, or steps while unset) x the
        updates per step (global_batch_size / mini_batch_size)."""
        return (self.lr_decay_steps or self.steps) * (self.global_batch_size // self.mini_batch_size)


@dataclass
class PPOConfig:
    """The clipped PPO policy loss."""

    eps_clip_low: float = 0.2
    """The ratio is clipped below at 1 - eps_clip_low; in (0, 1)."""
    eps_clip_high: float = 0.28
    """The ratio is clipped above at 1 + eps_clip_high (DAPO clip-higher); in (0, 1)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages; > 1."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How token losses reduce to one number: the mean over all tokens, or per sequence the sum
    (or mean) over its tokens, then the mean over sequences; taken over each whole mini-batch of
    the global batch, so the update does not depend on the DP size or the micro-batch split."""


@dataclass
class RLConfig:
    """On-policy RL on the policy's own samples (rollout -> reward -> advantages -> PPO)."""

    enabled: bool = False
    """true: every train step is an RL step; false: the PPO loss on synthetic batches (random
    tokens and advantages, a pure function of train.seed and the step)."""
    task: str = "reverse"
    """Registered task: copy, reverse, add (digit strings), or a name given to
    rl.register_task."""
    task_args: dict = field(default_factory=dict)
    """Keyword arguments of the task, e.g. {digits: 3, partial: true}."""
    task_module: str | None = None
    """Python module imported before the task is looked up (where your register_task calls
    are)."""
    group_size: int = 4
    """Samples per prompt (train.global_batch_size / group_size prompts per step); divides
    train.global_batch_size; >= 2 for grpo."""
    max_new_tokens: int = 8
    """Longest completion in tokens, <eos> included; the task's longest prompt + this <=
    train.seq_len."""
    temperature: float = 1.0
    """Sampling temperature (also divides the logits of the PPO log-probs); > 0."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1] (1: plain sampling)."""
    advantage: Literal["grpo", "gae"] = "grpo"
    """grpo: group-normalised outcome reward; gae: a value head and GAE."""
    norm_std: bool = True
    """grpo: divide by the group's reward std (false: Dr. GRPO, mean-centred only)."""
    gamma: float = 1.0
    """gae: discount, in [0, 1]."""
    lam: float = 0.95
    """gae: lambda, in [0, 1]."""
    value_coef: float = 0.5
    """gae: weight of the clipped value loss; > 0."""
    value_clip: float = 0.2
    """gae: value clip range around the rollout values (0: no clipping); >= 0."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen initial policy in the loss (0: none, no
    reference model); >= 0."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Per-token KL estimator (Schulman 2020): k1 = -log ratio, k3 = ratio - log ratio - 1."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0: none); >= 0."""
    reward: str = "gsm8k"
    """data.kind=prompts: the reward of a completion (`ftrain/rl/rewards.py`): gsm8k (veRL's rule: the
    number after the last "#### " equals the ground truth), exact (the stripped text equals it),
    or "module:function" / "path/file.py:function", your own with veRL's compute_score signature
    (data_source, solution_str, ground_truth, extra_info) -> float. It must be deterministic
    (a replayed step scores its completions again), else set rl.record_rewards."""
    reward_args: dict = field(default_factory=dict)
    """Keyword arguments of rl.reward, e.g. {method: flexible, format_score: 0.1} for gsm8k
    (veRL's custom_reward_function.reward_kwargs)."""
    record_rewards: bool = False
    """Store each committed step's rewards in run_dir/recorded_rewards.jsonl; a replayed step
    whose completions are the recorded ones uses the recorded rewards instead of calling
    rl.reward again (for rewards that are not deterministic: an LLM judge, a sandbox)."""


@dataclass
class DataConfig:
    """What the run trains on (docs/data.md): synthetic PPO batches, Megatron's mock data,
    Megatron indexed datasets (.bin/.idx) as packed windows of train.seq_len tokens, or SFT
    conversations (one per row, padded). The rows of step s are a pure function of
    (data, seed, s): the same at any dp and any train.steps."""

    kind: Literal["synthetic", "mock", "indexed", "sft", "prompts"] = "synthetic"
    """synthetic: random tokens and advantages (PPO); mock: megatron-core's mock dataset
    (Megatron-LM --mock-data); indexed: the dataset(s) of data.path or data.blend; sft: the
    conversations of data.path or data.blend (made by `data prepare --messages-key`), loss on
    assistant tokens only; prompts: an RL prompt set in veRL's layout at data.path (needs
    rl.enabled; `ftrain/data/prompt_set.py`)."""
    path: str | None = None
    """indexed / sft: a Megatron dataset prefix, without .bin/.idx (e.g. /data/c4_text_document);
    prompts: a .parquet / .jsonl / .jsonl.gz file, a local path or an s3:// gs:// file:// URL
    (veRL's data.train_files)."""
    prompt_key: str = "prompt"
    """prompts: the column of the prompt, a chat list [{role, content}] (rendered with the
    tokenizer's chat template once, at load) or a plain string (veRL's data.prompt_key)."""
    answer_key: str = "reward_model.ground_truth"
    """prompts: the column of the answer the reward compares with; a dotted path reads nested
    columns (veRL's layout: reward_model.ground_truth)."""
    blend: str | None = None
    """indexed / sft: weights and prefixes in Megatron's --data-path form, "0.7 /data/a_text_document
    0.3 /data/b_text_document" (instead of data.path); weights > 0, normalised."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer directory (null: model.hf_path, if any): its size is checked
    against model.vocab_size, its EOS is the end-of-document id; `data inspect` decodes with it."""
    eod_id: int | None = None
    """End-of-document token id (null: the tokenizer's EOS; mock: model.vocab_size - 1)."""
    eod_mask_loss: bool = False
    """No loss on the token right after an end-of-document token (Megatron --eod-mask-loss)."""
    seed: int | None = None
    """Seed of the document and window order (null: train.seed)."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints on a local disk, S3 or GCS."""

    uri: str = "runs/demo/checkpoints"
    """Local path, file://, s3://bucket/prefix or gs://bucket/prefix."""
    interval: int = 2
    """Save every N committed steps (0: never); >= 0. An async save due while the previous one is
    still being written is made at the first step after that write commits (no stall)."""
    keep_last: int = 2
    """Committed checkpoints kept; older ones are deleted after a newer commit; >= 1."""
    async_save: bool | str = "auto"
    """Snapshot to host memory and write in the background (true), or write in the step (false);
    auto: true on GPU (the copy runs on a side stream beside the next step), false on CPU."""
    retry_budget_s: float = 60.0
    """Seconds transient storage errors are retried with backoff; then the save is skipped with
    a warning (training goes on, the previous checkpoint stays); > 0."""


@dataclass
class FaultToleranceConfig:
    """Failure detection, recovery and where a replacement's state comes from."""

    health_interval_s: float = 0.5
    """How often a waiting driver polls the progress counters, in seconds; > 0."""
    health_timeout_s: float = 5.0
    """Seconds within which an actor must answer a control ping, else it is dead; > 0."""
    step_timeout_s: float = 120.0
    """Step deadline before the first step, and its upper bound, in seconds; > 0."""
    min_step_timeout_s: float = 10.0
    """Lower bound of the step deadline, in seconds; in (0, step_timeout_s]."""
    rendezvous_timeout_s: float = 60.0
    """Seconds within which a new process-group generation must form (each rank's join, and
    the driver's wait for it); > 0."""
    collective_timeout_s: float = 1800.0
    """GPU: the NCCL process groups' own timeout (their watchdog), a backstop only: hangs are
    found by the step deadline, which progress extends (a collective may wait that long for a
    peer's slow checkpoint I/O); >= step_timeout_s and rendezvous_timeout_s."""
    hang_factor: float = 5.0
    """Step deadline = hang_factor x median step time, within the bounds, extended while the
    progress counters move (slow is not dead); >= 1."""
    restore: Literal["auto", "peer", "memory", "checkpoint"] = "auto"
    """Where a replacement's state comes from: a DP peer, in-memory snapshots (needs
    memory_snapshot_interval >= 1) or the newest committed checkpoint; auto: the cheapest that
    has it, in that order."""
    min_dp: int | None = None
    """With no spare left, shrink DP down to this, in [1, dp] (null: stop with a report). DP grows
    back to its configured size once the pool holds spares for every missing replica."""
    allow_restart_from_scratch: bool = False
    """When a recovery finds no source of the committed step (no DP peer, in-memory snapshot or
    checkpoint that verifies and loads), restart every rank from the initial state (step 0)
    instead of stopping the run (false: stop with a RecoveryError saying why)."""
    refill_spares: bool = True
    """Start new spares on freed bundles in the background."""
    driver_failover: bool = False
    """The run's actors, spares, snapshot holders and placement group are named, detached Ray
    actors (namespace `ftrain-<run_name>`) that outlive the driver: a new `main.py train` with
    the same config on the same cluster reattaches to them and continues from the committed
    step with no step lost and no checkpoint read (driver_failover.py). Needs a cluster
    (`cluster.ray_address`): a driver's own local Ray dies with it."""
    driver_failover_timeout_s: float = 300.0
    """With driver_failover: detached actors whose driver has not come back within this many
    seconds remove themselves and the placement group; > 0."""
    driver_lease_s: float = 10.0
    """On a cluster (`cluster.ray_address`), one driver per run: a driver holds the run's lease
    and renews it every second; another driver of the run waits once for an unrenewed lease to
    lapse after this many seconds, then takes the run over, or stops with one line
    (run_lease.py); >= 3 (three renewals, so a busy driver does not lose it)."""
    memory_snapshot_interval: int = 0
    """Every k committed steps each rank sends a host-memory copy of its model + optimizer
    shard to a holder actor on another node (async), which restores a whole lost DP replica or
    distributed-optimizer shards with no step lost (0: off); >= 0. Costs host RAM: 2 copies of
    the state."""
    shard_keeper: bool = True
    """With a sharded optimizer (`model.distributed_optimizer`) and dp >= 2: after every step each
    rank copies its optimizer shard to host memory and sends it in the background to its keeper
    (the snapshot holder of another node, keeper.py), so a recovery takes the parameters from a
    DP peer and the shard from the keeper: no committed step lost, no checkpoint read. Costs host
    RAM: up to 3 copies of each shard at the keeper plus the rank's send buffers. At dp = 1 (the
    local keeper): each rank copies its whole state into host memory its node's holder keeps,
    and a replacement on that node loads it. Costs 2 copies of each rank's state (pinned on GPU)."""
    nccl_eager_init: bool = True
    """GPU: every NCCL communicator of a new generation is built when its group is made (true),
    or at its first collective, inside the first step (false: unused groups cost nothing)."""
    nccl_split_share: bool = False
    """GPU: Megatron's groups share the NCCL resources of the default group
    (NCCL_COMM_SPLIT_SHARE_RESOURCES=1): aborting a survivor's communicators is faster;
    collectives of different groups may then serialize."""


@dataclass
class ChaosConfig:
    """Fault injection."""

    events: list = field(default_factory=list)
    """Events, each fired once: {step: int >= 1, rank: in [0, cluster.num_workers), kind,
    point}. kind: kill (SIGKILL), exception, hang (compute thread), slow (+1 s per micro-batch:
    alive, must not be replaced), node (every actor on the rank's node is killed; no point).
    point: step_start, before_allreduce, inside_allreduce, after_optimizer_step, during_save,
    mid_save, during_recovery, mid_snapshot (a memory snapshot in flight, in its background
    thread: the torch engine half-way through its host copy, else before its last part reaches
    the holder), during_restore (a peer restore's broadcast, its group made, before the first
    transfer)."""


@dataclass
class Config:
    """Every knob of a run, one section each. config.yaml lists them all with their defaults;
    override any with `--set section.key=value` (the value is parsed as YAML). Invalid values
    stop the run before Ray starts with one line naming the field, e.g. `config error:
    train.micro_batch_size: the per-replica mini-batch 2 (train.mini_batch_size / dp) is not a
    multiple of 4`. `--dry-run` prints the resolved config and the planned placement without
    starting anything (for a GPU layout on a laptop, set cluster.gpus_per_node)."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    run_dir: str = "runs/demo"
    """Directory of the run's outputs: the recovery timeline (recoveries.jsonl), loss.png,
    recoveries.png, train.json (train) or demo.json (demo)."""
    run_name: str | None = None
    """Name of the run (letters, digits, '_', '.', '-'; null: the last part of run_dir). Every
    checkpoint records it with the run's id and config fingerprint; `train` resumes only a
    checkpoint.uri whose checkpoints are of this name and fingerprint (docs/checkpoints.md)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_type(value, hint, name: str):
    """Return `value` converted to `hint` (int -> float allowed; a `Literal` admits its values
    only) or raise ConfigError."""
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {list(choices)}")
        return value
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


def require(cond: bool, field_name: str, message: str) -> None:
    """Raise ConfigError "`field_name`: `message`" unless `cond`."""
    if not cond:
        raise ConfigError(f"{field_name}: {message}")


def validate(cfg: Config) -> None:
    """Semantic checks across fields; raises ConfigError naming the field and the fix."""
    c, t, m = cfg.cluster, cfg.train, cfg.model
    require(c.num_workers >= 1, "cluster.num_workers", "must be >= 1")
    require(c.num_spares >= 0, "cluster.num_spares", "must be >= 0")
    require(c.num_nodes >= 1, "cluster.num_nodes", "must be >= 1")
    require(c.gpus_per_node >= 0, "cluster.gpus_per_node", "must be >= 0")
    require(c.cpus_per_actor > 0, "cluster.cpus_per_actor", "must be > 0 (fractions allowed)")
    require(c.gpus_per_actor == "auto" or isinstance(c.gpus_per_actor, float) and 0 < c.gpus_per_actor <= 1,
            "cluster.gpus_per_actor", "must be auto or in (0, 1]; use a fraction such as 0.5 to let a spare share a GPU")
    for name in ("tp", "pp", "cp"):
        require(getattr(cfg.parallel, name) >= 1, f"parallel.{name}", "must be >= 1")
    p = cfg.parallel
    model_parallel = p.tp * p.pp * p.cp
    if c.num_workers % model_parallel:  # the text of ParallelDims.from_world's ValueError
        raise ConfigError(f"cluster.num_workers={c.num_workers} is not a multiple of "
                          f"parallel.tp * parallel.pp * parallel.cp = {p.tp} * {p.pp} * {p.cp} = "
                          f"{model_parallel}; change cluster.num_workers or the parallel sizes")
    dp = c.num_workers // model_parallel
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "max_seq_len"):
        require(getattr(m, name) >= 1, f"model.{name}", "must be >= 1")
    require(m.hidden_size % m.num_heads == 0, "model.hidden_size",
            f"{m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    require(m.hf_path is None or Path(m.hf_path).is_dir(), "model.hf_path",
            f"{m.hf_path!r} is not a local directory (no hub downloads at run time)")
    if m.hf_path is not None:
        _validate_hf_path(m)
    require(t.steps >= 1, "train.steps", "must be >= 1")
    require(t.lr_decay_steps is None or t.lr_decay_steps >= 1, "train.lr_decay_steps", "must be >= 1 or null")
    require(2 <= t.seq_len <= m.max_seq_len, "train.seq_len",
            f"must be in [2, model.max_seq_len={m.max_seq_len}]")
    for name in ("global_batch_size", "mini_batch_size", "micro_batch_size"):
        require(getattr(t, name) >= 1, f"train.{name}", "must be >= 1")
    require(t.global_batch_size % t.mini_batch_size == 0, "train.global_batch_size",
            f"{t.global_batch_size} is not a multiple of train.mini_batch_size={t.mini_batch_size}")
    require(t.mini_batch_size % dp == 0, "train.mini_batch_size",
            f"{t.mini_batch_size} is not a multiple of the data-parallel size dp={dp}")
    require((t.mini_batch_size // dp) % t.micro_batch_size == 0, "train.micro_batch_size",
            f"the per-replica mini-batch {t.mini_batch_size // dp} "
            f"(train.mini_batch_size / dp) is not a multiple of {t.micro_batch_size}")
    require(t.lr > 0, "train.lr", "must be > 0")
    require(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    o = cfg.ppo
    require(0 < o.eps_clip_low < 1, "ppo.eps_clip_low", "must be in (0, 1)")
    require(0 < o.eps_clip_high < 1, "ppo.eps_clip_high", "must be in (0, 1)")
    require(o.clip_ratio_c > 1, "ppo.clip_ratio_c", "must be > 1 (dual-clip bound, e.g. 3.0)")
    if cfg.rl.enabled:
        _validate_rl(cfg)
    _validate_data(cfg)
    k = cfg.checkpoint
    require(cfg.run_name is None or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", cfg.run_name) is not None,
            "run_name", f"{cfg.run_name!r}: use letters, digits, '_', '.', '-' (starting with a letter or digit)")
    require(bool(k.uri), "checkpoint.uri", "must be a path, file://, s3:// or gs:// URI")
    require(k.interval >= 0, "checkpoint.interval", "must be >= 0 (0 disables checkpoints)")
    require(k.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    require(k.retry_budget_s > 0, "checkpoint.retry_budget_s", "must be > 0 seconds")
    require(k.async_save in (True, False, "auto"), "checkpoint.async_save", "must be true, false or auto")
    f = cfg.fault_tolerance
    for name in ("health_interval_s", "health_timeout_s", "step_timeout_s", "min_step_timeout_s",
                 "rendezvous_timeout_s"):
        require(getattr(f, name) > 0, f"fault_tolerance.{name}", "must be > 0 seconds")
    require(f.collective_timeout_s >= max(f.step_timeout_s, f.rendezvous_timeout_s), "fault_tolerance.collective_timeout_s",
            f"must be >= fault_tolerance.step_timeout_s={f.step_timeout_s} and "
            f"rendezvous_timeout_s={f.rendezvous_timeout_s} (it is the backstop of both)")
    require(f.min_step_timeout_s <= f.step_timeout_s, "fault_tolerance.min_step_timeout_s",
            f"must be <= fault_tolerance.step_timeout_s={f.step_timeout_s}")
    require(f.hang_factor >= 1, "fault_tolerance.hang_factor", "must be >= 1 (deadline = factor x median step time)")
    require(f.min_dp is None or 1 <= f.min_dp <= dp, "fault_tolerance.min_dp",
            f"must be null (never shrink) or in [1, dp={dp}]")
    require(f.driver_failover_timeout_s > 0, "fault_tolerance.driver_failover_timeout_s", "must be > 0")
    require(f.driver_lease_s >= 3, "fault_tolerance.driver_lease_s",
            "must be >= 3 seconds (the lease is renewed every second)")
    require(isinstance(f.memory_snapshot_interval, int) and f.memory_snapshot_interval >= 0,
            "fault_tolerance.memory_snapshot_interval", "must be an integer >= 0 (0: off)")
    require(f.restore != "memory" or f.memory_snapshot_interval > 0, "fault_tolerance.restore",
            "'memory' needs fault_tolerance.memory_snapshot_interval >= 1")
    for i, ev in enumerate(cfg.chaos.events):
        _validate_chaos_event(ev, f"chaos.events[{i}]", c.num_workers)
    if m.engine == "torch":
        require(p.tp == p.pp == p.cp == 1, "model.engine",
                "the torch engine is data-parallel only; set parallel.tp/pp/cp=1 or model.engine=megatron")
    if m.engine == "megatron":
        _validate_megatron(cfg)


def _validate_rl(cfg: Config) -> None:
    """RL mode (`rl.enabled`): sampling knobs and no context parallelism (generation runs whole
    prefixes on every rank). The task itself is checked by `rl.check_task`."""
    r, t = cfg.rl, cfg.train
    require(cfg.parallel.cp == 1, "parallel.cp",
            f"{cfg.parallel.cp}: RL rollouts (generation) do not support context parallelism; "
            "set parallel.cp=1 (use parallel.tp / parallel.pp to split the model) or rl.enabled=false")
    require(r.group_size >= 1, "rl.group_size", "must be >= 1")
    require(r.advantage != "grpo" or r.group_size >= 2, "rl.group_size",
            "GRPO normalises rewards within a prompt's group of samples: needs >= 2 samples "
            "per prompt (or set rl.advantage=gae)")
    require(t.global_batch_size % r.group_size == 0, "rl.group_size",
            f"train.global_batch_size={t.global_batch_size} is not a multiple of {r.group_size}")
    require(r.max_new_tokens >= 1, "rl.max_new_tokens", "must be >= 1")
    require(r.temperature > 0, "rl.temperature", "must be > 0")
    require(0 < r.top_p <= 1, "rl.top_p", "must be in (0, 1]")
    require(0 <= r.gamma <= 1, "rl.gamma", "must be in [0, 1]")
    require(0 <= r.lam <= 1, "rl.lam", "must be in [0, 1]")
    require(r.value_coef > 0, "rl.value_coef", "must be > 0 (weight of the value loss for rl.advantage=gae)")
    require(r.value_clip >= 0, "rl.value_clip", "must be >= 0 (0: no value clipping)")
    require(r.kl_coef >= 0, "rl.kl_coef", "must be >= 0 (0: no KL penalty, no reference model)")
    require(r.entropy_coef >= 0, "rl.entropy_coef", "must be >= 0 (0: no entropy bonus)")


def parse_blend(text: str) -> list[tuple[float, str]]:
    """Megatron's --data-path form "w1 prefix1 w2 prefix2 ..." (or one bare prefix, weight 1)
    -> [(weight, prefix)], weights as given. Raises ConfigError naming data.blend."""
    parts = text.split()
    if len(parts) == 1:
        return [(1.0, parts[0])]
    try:
        pairs = [(float(w), p) for w, p in zip(parts[::2], parts[1::2])]
    except ValueError:
        pairs = []
    require(bool(pairs) and len(parts) % 2 == 0 and all(w > 0 for w, _ in pairs), "data.blend",
            f"{text!r}: expected 'weight prefix weight prefix ...' with weights > 0, "
            "e.g. '0.7 /data/a_text_document 0.3 /data/b_text_document'")
    return pairs


def _validate_data(cfg: Config) -> None:
    """data.* against the objective: ce needs real rows (mock / indexed / sft), PPO needs
    advantages (synthetic or RL). The files themselves are checked by `data.open_data`."""
    d, t = cfg.data, cfg.train
    if d.kind == "prompts":
        require(cfg.rl.enabled and t.objective == "ppo", "data.kind",
                "prompts are RL prompts: set rl.enabled=true and train.objective=ppo")
        require(d.path is not None, "data.path", "data.kind=prompts needs the prompt file (.parquet / .jsonl)")
    elif t.objective == "ce":
        require(d.kind != "synthetic", "train.objective",
                "ce trains on text: set data.kind=mock, or data.kind=indexed or sft with data.path")
        require(not cfg.rl.enabled, "train.objective", "ce with rl.enabled: RL trains with ppo; set one of them")
    else:
        require(d.kind == "synthetic", "data.kind",
                f"{d.kind} data has no advantages for the ppo objective; set train.objective=ce")
    if d.kind in ("indexed", "sft"):
        require((d.path is None) != (d.blend is None), "data.path",
                f"data.kind={d.kind} needs exactly one of data.path (a prefix) or data.blend "
                "('0.7 /data/a_text_document 0.3 /data/b_text_document')")
        if d.blend is not None:
            parse_blend(d.blend)
    require(not (d.kind == "sft" and d.eod_mask_loss), "data.eod_mask_loss",
            "is for packed text; SFT conversations are not packed (their loss mask is stored): set it false")
    require(d.eod_id is None or 0 <= d.eod_id < cfg.model.vocab_size, "data.eod_id",
            f"must be in [0, model.vocab_size={cfg.model.vocab_size})")


def _validate_hf_path(m: ModelConfig) -> None:
    """model.hf_path is a Hugging Face model directory (config.json) whose vocabulary holds
    every token id the run feeds it (ids are drawn below model.vocab_size). Its architecture
    is checked by the engine that loads it (megatron_engine.hf_bridge)."""
    import json

    path = Path(m.hf_path) / "config.json"
    require(path.is_file(), "model.hf_path",
            f"{m.hf_path!r} has no config.json (not a Hugging Face model directory)")
    try:
        hf_vocab = json.loads(path.read_text()).get("vocab_size")
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_path: cannot read {str(path)!r}: {e}") from None
    require(not isinstance(hf_vocab, int) or m.vocab_size <= hf_vocab, "model.vocab_size",
            f"{m.vocab_size} is larger than the {hf_vocab} tokens of model.hf_path "
            f"(token ids must exist in its embedding; set model.vocab_size <= {hf_vocab})")


def _validate_megatron(cfg: Config) -> None:
    """Sizes Megatron-Core can shard: layers over pp, heads / ffn / padded vocab over tp,
    the sequence over 2 * cp load-balanced chunks."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    require(m.num_layers % p.pp == 0, "model.num_layers",
            f"{m.num_layers} is not divisible by parallel.pp={p.pp}")
    require(m.num_heads % p.tp == 0, "model.num_heads",
            f"{m.num_heads} is not divisible by parallel.tp={p.tp}")
    require(m.ffn_hidden_size % p.tp == 0, "model.ffn_hidden_size",
            f"{m.ffn_hidden_size} is not divisible by parallel.tp={p.tp}")
    padded = -(-m.vocab_size // 128) * 128  # megatron_engine.padded_vocab_size
    require(padded % p.tp == 0, "parallel.tp",
            f"the vocabulary padded to a multiple of 128 ({padded}) is not divisible by tp={p.tp}")
    require(p.cp == 1 or t.seq_len % (2 * p.cp) == 0, "train.seq_len",
            f"{t.seq_len} is not a multiple of 2 * parallel.cp = {2 * p.cp} (load-balanced context parallelism)")


CHAOS_KINDS = ("kill", "exception", "hang", "slow", "node")
CHAOS_POINTS = ("step_start", "before_allreduce", "inside_allreduce", "after_optimizer_step",
                "during_save", "mid_save", "during_recovery", "mid_snapshot",
                "during_restore")


def _validate_chaos_event(ev, name: str, world_size: int) -> None:
    """A chaos event is {step: int >= 1, rank: int, kind: CHAOS_KINDS, point: CHAOS_POINTS}.
    'slow' makes every later micro-batch of that call take 1 s more (alive, progressing: must
    not be declared dead); 'node' kills every actor on the rank's node (no point)."""
    require(isinstance(ev, dict) and set(ev) <= {"step", "rank", "kind", "point"}
            and {"step", "rank", "kind"} <= set(ev), name,
            "expected a mapping with step, rank, kind and (except kind: node) point")
    require(isinstance(ev["step"], int) and ev["step"] >= 1, f"{name}.step", "must be an int >= 1")
    require(isinstance(ev["rank"], int) and 0 <= ev["rank"] < world_size, f"{name}.rank",
            f"must be in [0, cluster.num_workers={world_size})")
    require(ev["kind"] in CHAOS_KINDS, f"{name}.kind", f"must be one of {list(CHAOS_KINDS)}")
    require(ev["kind"] == "node" or ev.get("point") in CHAOS_POINTS, f"{name}.point",
            f"must be one of {list(CHAOS_POINTS)}")


def gpus_visible() -> int:
    """Number of CUDA devices this process sees (0 when torch has no CUDA)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_megatron_on_cpu(cfg: Config) -> Config:
    """`cfg` (loaded, unresolved) resolved as for one GPU, so that `auto` picks the Megatron
    engine's GPU defaults (the distributed optimizer, the keeper), then put on CPU: gloo, no GPU
    per actor, float32 unless model.dtype was set. How tests and benchmarks run the GPU path on
    a machine without GPUs (`resolve` alone picks the torch engine there). Raises ConfigError as
    `resolve` does."""
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "float32"
    cfg = resolve(cfg, num_gpus=1)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device="cpu", gpus_per_actor=0),
                               model=dataclasses.replace(cfg.model, dtype=dtype))


def resolve(cfg: Config, num_gpus: int | None = None) -> Config:
    """Return a copy with `auto` values made concrete for a machine with `num_gpus` GPUs.

    device auto -> cuda when GPUs are visible, else cpu; engine auto -> megatron on cuda,
    torch on cpu; distributed_optimizer auto -> true on megatron, false on torch; dtype auto ->
    bfloat16 on cuda, float32 on cpu; checkpoint.async_save auto -> true on cuda, false on cpu;
    run_name null -> the last part of run_dir. Raises ConfigError for combinations this machine cannot run (megatron on
    CPU, cuda without GPUs).
    """
    num_gpus = gpus_visible() if num_gpus is None else num_gpus
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster),
                              model=dataclasses.replace(cfg.model), checkpoint=dataclasses.replace(cfg.checkpoint))
    if cfg.cluster.device == "auto":
        cfg.cluster.device = "cuda" if num_gpus > 0 else "cpu"
    require(cfg.cluster.device == "cpu" or num_gpus > 0, "cluster.device",
            "cuda was asked for but no GPU is visible; set cluster.device=cpu or auto")
    cuda = cfg.cluster.device == "cuda"
    if cfg.model.engine == "auto":
        cfg.model.engine = "megatron" if cuda else "torch"
    require(cuda or cfg.model.engine == "torch", "model.engine",
            "Megatron-Core models need GPUs; set model.engine=torch (or auto) on a CPU machine")
    if cfg.model.distributed_optimizer == "auto":
        cfg.model.distributed_optimizer = cfg.model.engine == "megatron"
    if cfg.model.dtype == "auto":
        cfg.model.dtype = "bfloat16" if cuda else "float32"
    if cfg.checkpoint.async_save == "auto":
        cfg.checkpoint.async_save = cuda
    if cfg.run_name is None:
        cfg.run_name = Path(cfg.run_dir).name or "run"
    c = cfg.cluster
    if c.gpus_per_actor == "auto":  # a whole GPU each, or 1/k of one when there are too few
        gpus = c.gpus_per_node * c.num_nodes if c.gpus_per_node else num_gpus if c.ray_address is None else 0
        c.gpus_per_actor = 1.0 / (math.ceil((c.num_workers + c.num_spares) / gpus) if cuda and gpus else 1)
    tp = cfg.parallel.tp
    require(not cuda or not c.gpus_per_node or tp <= c.gpus_per_node, "parallel.tp",
            f"{tp} ranks of a tensor-parallel group cannot stay inside one node of cluster.gpus_per_node="
            f"{c.gpus_per_node} GPUs (their all-reduce would cross the network every layer); lower parallel.tp")
    validate(cfg)
    return cfg


# -- the configuration reference ----------------------------------------------------------------

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring on one line} of dataclass `cls`: the string literal right
    under each field's declaration (fields without one are absent)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def _type_text(hint) -> str:
    """A field's type as the reference writes it: `one of auto, cpu, cuda`, `int or null`."""
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_text(a) for a in typing.get_args(hint))
    return hint.__name__


def _yaml_text(value) -> str:
    """`value` as YAML's flow style writes it: null, true, {}, 0.001, runs/demo."""
    return yaml.safe_dump([value], default_flow_style=True).strip()[1:-1]


def _field_table(cls: type, prefix: str) -> list[str]:
    """The reference's table of the non-section fields of dataclass `cls`: key, type, default,
    meaning (the field's docstring). KeyError names a field without a docstring."""
    hints, docs, defaults = typing.get_type_hints(cls), field_docs(cls), cls()
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not dataclasses.is_dataclass(hints[f.name]):
            rows.append(f"| `{prefix}{f.name}` | {_type_text(hints[f.name])} | "
                        f"`{_yaml_text(getattr(defaults, f.name))}` | {docs[f.name].replace('|', '/')} |")
    return rows


def reference() -> str:
    """The text of docs/configuration.md: Config's docstring, then per section its docstring and
    its fields' table, then the top-level fields' table."""
    out = ["# Configuration", "",
           "<!-- Generated by `python -m ftrain.config` from the field docstrings of ftrain/config.py; do not edit. -->",
           "", inspect.cleandoc(Config.__doc__), ""]
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            out += [f"## `{f.name}`", "", inspect.cleandoc(hints[f.name].__doc__), "",
                    *_field_table(hints[f.name], f.name + "."), ""]
    return "\n".join(out + ["## Top level", "", *_field_table(Config, ""), ""])


if __name__ == "__main__":  # python -m ftrain.config: regenerate the reference
    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(reference())
    print(f"wrote {REFERENCE}")
