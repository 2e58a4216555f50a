"""Loading a checkpoint never runs code: DCP's reader with its `.metadata` pickle read through
an allow-list unpickler (DCP reads tensors and objects with `torch.load(weights_only=True)`)."""

from __future__ import annotations

import dataclasses
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

# What a DCP `.metadata` pickle may reference (read off torch 2.13's own files). Anything else,
# e.g. `os.system`, is refused: a checkpoint must never run code when loaded.
_METADATA_GLOBALS = {("pathlib", "PosixPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if ((module, name) in _METADATA_GLOBALS or module == "torch.distributed.checkpoint.metadata"
                or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
                or _is_plain_data(module, name)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata references {module}.{name}: refused")


_PLAIN_DATA_MODULES = ("torch.distributed.checkpoint.planner", "torch.distributed.checkpoint.filesystem")


def _is_plain_data(module: str, name: str) -> bool:
    """Whether `module.name` is a dataclass or an enum of DCP's planner or file-system modules
    (`SavePlan`, `WriteItem`, `_StoragePrefix`, ...: Megatron's torch_dist metadata keeps its
    save plans), which unpickle as data only, never running code."""
    import enum
    import importlib

    if module not in _PLAIN_DATA_MODULES:
        return False
    cls = getattr(importlib.import_module(module), name, None)
    return isinstance(cls, type) and (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum))


class SafeReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, with `.metadata` read by a restricted unpickler (DCP itself reads
    tensors and objects with `torch.load(weights_only=True)`, but the metadata with `pickle`).
    Every reader of checkpoint files derives from it (Megatron's too: `megatron_compat._Reader`).
    `read_metadata` raises pickle.UnpicklingError naming a global outside the allow-list."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self.metadata = metadata  # kept: the caller compares its keys with what it loaded
        return metadata
