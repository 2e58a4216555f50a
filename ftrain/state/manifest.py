"""What a checkpoint is: its files (`FileEntry`), its manifest (`Manifest`, written last: the
commit point) and the errors of reading one; whether it fits this run's model and engine
(`model_signature`, `check_compatible`). The manager that writes and reads them is the
example's `checkpoint.CheckpointManager`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ftrain.config import Config, ConfigError

MANIFEST = "manifest.json"
LATEST = "latest"


@dataclass
class FileEntry:
    """One file of a checkpoint: ``path`` relative to the step directory, ``size`` in bytes."""

    path: str
    size: int
    sha256: str


@dataclass
class Manifest:
    """What ``commit`` wrote to ``manifest.json``; ``created_at`` is Unix time in seconds."""

    step: int
    layout: dict
    files: list[FileEntry]
    extra: dict
    created_at: float

    @property
    def run_id(self) -> str | None:
        """The id of the run that committed it (``extra["run"]["id"]``), None if it names none."""
        run = self.extra.get("run")
        return run.get("id") if isinstance(run, dict) else None

    def share(self, part: int, parts: int) -> list[FileEntry]:
        """Part ``part`` of ``parts`` of the files (every ``parts``-th file from ``part``): rank r
        of n checks and hashes this share of a checkpoint, before the load (sizes, or sha256
        where the engine does not hash while loading) and beside it. The shares of parts
        0..parts-1 hold every file exactly once. Raises ValueError unless 0 <= part < parts."""
        if not 0 <= part < parts:
            raise ValueError(f"share {part} of {parts}: part must be in [0, {parts})")
        return self.files[part::parts]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed, read or verified; the message names the URI."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint does not fit the state it is loaded into (a key missing or of another
    shape), or its bytes do not match its manifest's sha256 (found while loading): the
    checkpoint is bad for this run, the loading rank is not."""



def model_signature(cfg: Config) -> dict:
    """What a checkpoint must match to be loaded into this run's model (recorded in manifests)."""
    m = cfg.model
    return {"engine": m.engine, "hf_path": m.hf_path, "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
            "ffn_hidden_size": m.ffn_hidden_size,
            **({"rl": {"value_head": cfg.rl.advantage == "gae", "reference": cfg.rl.kl_coef > 0}}
               if cfg.rl.enabled else {})}


def check_compatible(cfg: Config, manifest: Manifest) -> None:
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


def step_dir(step: int) -> str:
    """The directory name of checkpoint `step` under the manager's URI: ``step_{N:08d}``."""
    return f"step_{int(step):08d}"


def parse_manifest(data: bytes) -> Manifest:
    """The Manifest in `data` (manifest.json's bytes). Raises ValueError (or KeyError, TypeError)
    when it does not parse, and ValueError when a file path leaves its step directory."""
    raw = json.loads(data)
    manifest = Manifest(
        step=int(raw["step"]),
        layout=dict(raw["layout"]),
        files=[FileEntry(str(f["path"]), int(f["size"]), str(f["sha256"])) for f in raw["files"]],
        extra=dict(raw["extra"]),
        created_at=float(raw["created_at"]),
    )
    for f in manifest.files:  # a manifest must not point outside its step directory
        if f.path.startswith("/") or ".." in f.path.split("/") or "\\" in f.path:
            raise ValueError(f"file path {f.path!r} escapes the checkpoint directory")
    return manifest
