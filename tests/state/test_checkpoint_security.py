"""Checkpoint loading never runs code and never leaves its prefix; fsspec file systems without
fileno/fsync (memory://) work."""
import json
import os
import pickle

import pytest
import torch

from checkpoint import CheckpointManager
from ftrain.state.manifest import CheckpointError


def _state():
    return {"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.bfloat16), "step": 3,
            "rng": torch.get_rng_state()}


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/pwned_by_checkpoint",))


def test_malicious_metadata_pickle_is_refused(tmp_path):
    m = CheckpointManager(str(tmp_path))
    m.save_shard(1, "s", _state())
    (tmp_path / "step_00000001" / "s" / ".metadata").write_bytes(pickle.dumps(_Evil()))
    if os.path.exists("/tmp/pwned_by_checkpoint"):
        os.remove("/tmp/pwned_by_checkpoint")
    with pytest.raises(CheckpointError, match="refused"):
        m.load_shard(1, "s", _state())  # no manifest given: nothing verifies the bytes first
    assert not os.path.exists("/tmp/pwned_by_checkpoint")


def test_manifest_paths_cannot_escape_the_prefix(tmp_path, caplog):
    m = CheckpointManager(str(tmp_path))
    m.commit(1, {}, m.save_shard(1, "s", _state()))
    path = tmp_path / "step_00000001" / "manifest.json"
    raw = json.loads(path.read_text())
    raw["files"][0]["path"] = "../../etc/passwd"
    path.write_text(json.dumps(raw))
    assert m.latest_verified() is None
    assert "escapes the checkpoint directory" in caplog.text


def test_memory_filesystem_without_fileno(tmp_path):
    m = CheckpointManager(f"memory://ckpt-{os.getpid()}")
    m.commit(2, {}, m.save_shard(2, "s", _state()))
    manifest = m.latest_verified()
    out = m.load_shard(2, "s", {"w": torch.zeros(6), "b": torch.zeros(2, dtype=torch.bfloat16),
                                "step": 0, "rng": torch.get_rng_state()}, manifest)
    assert manifest.step == 2 and torch.equal(out["w"], torch.arange(6.0))


def test_megatron_reader_refuses_a_malicious_metadata_pickle(tmp_path):
    """Megatron's torch_dist loads go through `megatron_compat.torch_dist_reader`'s reader (CPU,
    no process group needed to read metadata): its `.metadata` is read by the same allow-list
    unpickler as our own shards, so a pickle that would run code is refused."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    from ftrain.engines.megatron_compat import torch_dist_reader

    m = CheckpointManager(str(tmp_path))
    m.save_shard(1, "s", _state())
    path = tmp_path / "step_00000001" / "s"
    with torch_dist_reader():
        assert mcore_torch._get_filesystem_reader(str(path)).read_metadata().state_dict_metadata  # a good one reads
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    if os.path.exists("/tmp/pwned_by_checkpoint"):
        os.remove("/tmp/pwned_by_checkpoint")
    with torch_dist_reader(), pytest.raises(pickle.UnpicklingError, match="posix.system: refused|os.system: refused"):
        mcore_torch._get_filesystem_reader(str(path)).read_metadata()
    assert not os.path.exists("/tmp/pwned_by_checkpoint")
