"""CI version of the chaos soak (`python -m bench.chaos`): one fault of every kind over a CPU run
on a 3-node Ray cluster with checkpoints on a loopback S3 server; nothing may diverge or be lost."""
import json

import pytest

from conftest import run_bench

KINDS = 9  # the soak's fault kinds (bench/chaos.py KINDS; its JSON counts every kind, 0 included)


@pytest.mark.slow
def test_one_fault_of_every_kind(tmp_path):
    out = tmp_path / "chaos.json"
    run_bench("chaos", "--faults", str(KINDS), "--seed", "1", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["kinds"] == {k: 1 for k in r["kinds"]} and len(r["kinds"]) == KINDS
    assert r["recovered"] == r["faults"] == KINDS
    assert r["max_abs_loss_diff"] == 0.0 and r["replays_equal"]
    assert r["checkpoints_lost"] == 0
    assert r["saves_skipped_by_storage_outage"]          # the outage did hit a save
    assert r["recovery_kinds"]["hang"] >= 1 and r["recovery_kinds"]["crash"] >= 1
    assert any(s.startswith("checkpoint") for s in r["restore_sources"])  # fell back past the corrupt one
