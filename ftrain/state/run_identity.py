"""Run identity: which run a checkpoint belongs to, and what a new `main.py train` does with a
`checkpoint.uri` that already holds checkpoints.

A run is (name, id, fingerprint). `run_name` names it; the id is made when a run starts fresh
(`<name>-<UTC date-time>-<6 hex>`) and kept by every resume, so two runs of one name never share
an id; the fingerprint hashes the config fields that define the run's math (`math_fields`:
model, train, ppo, rl, data), not where or how it runs (cluster, parallel sizes, micro-batch split,
fault tolerance, checkpoint, paths) nor how far it goes (train.steps: the data order does not
depend on it and the LR schedule has its own horizon, train.lr_decay_steps, fixed at the run's
start): a run resumed at another DP size, or continued past its last step, is the same run; a
run with another seed, learning rate or LR horizon is not.
Every manifest records the identity with those fields (`extra["run"]`), so a mismatch names them.

`plan_start` decides, before Ray starts:
- no committed checkpoint: a new run from step 0 (a warning when uncommitted step directories
  are there: saves that never committed);
- only checkpoints of a run of this name and fingerprint: resume it (keep its id), from its
  newest checkpoint that verifies and loads (the ranks check; older ones are the fallback);
  with train.lr_decay_steps unset, the horizon its checkpoints record is this run's, so a
  raised train.steps continues a finished run (steps after its last one only);
- a checkpoint of another run (another name or fingerprint, or none recorded): ConfigError
  naming both runs and the fields that differ; also a checkpoint of this run trained on other
  data files (the data fingerprint its manifest records, `data.data_fingerprint`). `main.py train --fresh` deletes the checkpoints
  under checkpoint.uri first and starts a new run.
Recovery, during a run, loads only checkpoints of the run's own id (`fault_tolerance.recover`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass

from ftrain.config import Config, ConfigError
from ftrain.state.manifest import Manifest, check_compatible

log = logging.getLogger(__name__)

MATH_SECTIONS = ("model", "train", "ppo", "rl", "data")
# the layout of the same math, and how far it goes (its LR horizon is train.lr_decay_steps)
NOT_MATH = {"model.distributed_optimizer", "train.micro_batch_size", "train.steps"}


def math_fields(cfg: Config) -> dict:
    """{"section.key": value} of the config fields that define the run's math (JSON values):
    `MATH_SECTIONS` without `NOT_MATH`; of `rl` only `rl.enabled` when RL is off;
    `train.lr_decay_steps` as the schedule uses it (train.steps while unset)."""
    out = {}
    for section in MATH_SECTIONS:
        values = dataclasses.asdict(getattr(cfg, section))
        if section == "rl" and not values["enabled"]:
            values = {"enabled": False}
        out.update({f"{section}.{k}": v for k, v in values.items() if f"{section}.{k}" not in NOT_MATH})
    out["train.lr_decay_steps"] = cfg.train.lr_decay_steps or cfg.train.steps
    return out


def fingerprint(fields: dict) -> str:
    """16 hex digits of the SHA-256 of `fields` (`math_fields`) as sorted JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    """Who wrote a checkpoint: `name` (run_name), `id` (one per run, kept by its resumes),
    `fingerprint` of `fields` (`math_fields`)."""
    name: str
    id: str
    fingerprint: str
    fields: dict

    @classmethod
    def new(cls, cfg: Config) -> RunIdentity:
        """A new run of the resolved `cfg` (run_name set), with a new id."""
        fields = math_fields(cfg)
        run_id = f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
        return cls(cfg.run_name, run_id, fingerprint(fields), fields)

    @classmethod
    def of(cls, manifest: Manifest) -> RunIdentity | None:
        """The identity a manifest records, None when it records none."""
        run = manifest.extra.get("run")
        if not isinstance(run, dict) or not {"name", "id", "fingerprint", "fields"} <= set(run):
            return None
        return cls(run["name"], run["id"], run["fingerprint"], dict(run["fields"]))

    def to_dict(self) -> dict:
        """What a manifest records (`extra["run"]`)."""
        return dataclasses.asdict(self)


@dataclass
class StartPlan:
    """What `main.py train` does: train `run` (a new one, or the one found) from step 0
    (`resume_step` None) or resume it from its checkpoints, the newest committed being
    `resume_step`, with `cfg`: the config given, train.lr_decay_steps set (the run's horizon)."""
    run: RunIdentity
    resume_step: int | None = None
    cfg: Config | None = None


def with_lr_horizon(cfg: Config, manifests: list[Manifest]) -> Config:
    """`cfg` with train.lr_decay_steps set: as given; else the horizon the newest checkpoint's
    run records (a continued run keeps its schedule); else train.steps (a new run)."""
    if cfg.train.lr_decay_steps is not None:
        return cfg
    theirs = RunIdentity.of(manifests[-1]) if manifests else None
    horizon = (theirs.fields.get("train.lr_decay_steps") if theirs else None) or cfg.train.steps
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr_decay_steps=int(horizon)))


def differences(theirs: RunIdentity, ours: RunIdentity) -> list[str]:
    """What makes `theirs` another run than `ours`: "key: X there, Y here" per field."""
    out = [] if theirs.name == ours.name else [f"run_name: {theirs.name} there, {ours.name} here"]
    keys = sorted(set(theirs.fields) | set(ours.fields))
    out += [f"{k}: {theirs.fields.get(k)!r} there, {ours.fields.get(k)!r} here"
            for k in keys if theirs.fields.get(k) != ours.fields.get(k)]
    if not out and theirs.fingerprint != ours.fingerprint:
        out.append(f"config fingerprint {theirs.fingerprint} there, {ours.fingerprint} here")
    return out


def _check_same_data(cfg: Config, manifest: Manifest) -> None:
    """Raise ConfigError when the checkpoint was trained on other data than this run reads
    (`data.data_fingerprint`: same data.* config but other files, e.g. a dataset rewritten under
    the same prefix): its steps would not continue the run it belongs to."""
    if cfg.data.kind == "synthetic":
        return
    from ftrain.data.dataset import data_fingerprint

    saved, ours = manifest.extra.get("data"), data_fingerprint(cfg)
    if saved != ours:
        raise ConfigError(f"data: checkpoint step {manifest.step} was trained on data {saved}, this run's data "
                          f"is {ours} (the files of data.path / data.blend changed: .idx content or .bin "
                          "size); restore that data, point checkpoint.uri elsewhere, or pass --fresh")


def plan_start(cfg: Config, manifests: list[Manifest], uncommitted: list[int]) -> StartPlan:
    """The start of a `train` run of the resolved `cfg` whose checkpoint.uri holds the committed
    `manifests` (ascending) and the `uncommitted` step directories (see the module docstring).
    Raises ConfigError, one line naming both runs and what differs, when a checkpoint is of
    another run, or (`check_compatible`) of a layout this run cannot load."""
    given = cfg.train.lr_decay_steps
    cfg = with_lr_horizon(cfg, manifests)
    horizon, steps = cfg.train.lr_decay_steps, cfg.train.steps
    if given is None and manifests and horizon < steps:
        raise ConfigError(
            f"train.steps: {steps} goes past this run's LR horizon of {horizon} steps (train.lr_decay_steps, "
            f"unset, was train.steps at the run's start and its checkpoints record it): steps {horizon + 1}-{steps} "
            f"would train at learning rate 0; set train.lr_decay_steps={horizon} to train them anyway, keep "
            f"train.steps <= {horizon}, or start a new run with train.lr_decay_steps >= {steps} (another "
            f"checkpoint.uri, or --fresh)")
    ours, uri = RunIdentity.new(cfg), cfg.checkpoint.uri
    if not manifests:
        if uncommitted:
            log.warning("checkpoint.uri %s holds only uncommitted steps %s (saves that never committed): "
                        "run %s starts at step 0", uri, uncommitted, ours.id)
        return StartPlan(ours, cfg=cfg)
    hint = ("resume that run with its config, point checkpoint.uri elsewhere, or pass --fresh to "
            "delete its checkpoints and start over")
    for m in manifests:
        theirs = RunIdentity.of(m)
        if theirs is None:
            raise ConfigError(f"checkpoint.uri: {uri} holds checkpoint step {m.step}, which names no run "
                              f"(written by an older version); this run is {ours.name}: point "
                              f"checkpoint.uri elsewhere, or pass --fresh to delete it and start over")
        if (theirs.name, theirs.fingerprint) != (ours.name, ours.fingerprint):
            raise ConfigError(f"checkpoint.uri: {uri} holds run {theirs.id} (checkpoint step {m.step}), "
                              f"another run than this one ({ours.name}): {'; '.join(differences(theirs, ours))}; "
                              f"{hint}")
    check_compatible(cfg, manifests[-1])
    _check_same_data(cfg, manifests[-1])
    return StartPlan(dataclasses.replace(ours, id=RunIdentity.of(manifests[-1]).id), manifests[-1].step, cfg)
