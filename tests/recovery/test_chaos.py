"""Short versions of the chaos soak (`python -m bench.chaos`) on a Ray cluster of logical nodes with
checkpoints on a loopback S3 server; nothing may diverge or be lost. The torch engine: one fault
of every kind (slow). The Megatron engine (MegatronActors on gloo at tp=2 x dp=2, the
distributed optimizer, the shard keeper, a checkpoint every 2 steps): a kill and an exception,
nothing diverged or lost (slow: about 85 s on an idle 2-core machine, 250 s beside the rest of
the suite; every kind runs in `python -m bench.chaos --engine megatron --faults 50`; in CI the
same layout meets failures at random times in `test_goodput.py`)."""
import json

import pytest

from conftest import run_bench

KINDS = 9  # the soak's fault kinds (bench/chaos.py KINDS; its JSON counts every kind, 0 included)


@pytest.mark.slow
def test_one_fault_of_every_kind(tmp_path):
    out = tmp_path / "chaos.json"
    run_bench("chaos", "--faults", str(KINDS), "--seed", "1", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["engine"] == "torch" and r["run_stopped"] is None
    assert r["kinds"] == {k: 1 for k in r["kinds"]} and len(r["kinds"]) == KINDS
    assert r["recovered"] == r["faults"] == KINDS
    assert r["max_abs_loss_diff"] == 0.0 and r["replays_equal"]
    assert r["checkpoints_lost"] == 0
    assert r["saves_skipped_by_storage_outage"]          # the outage did hit a save
    assert r["recovery_kinds"]["hang"] >= 1 and r["recovery_kinds"]["crash"] >= 1
    assert any(s.startswith("checkpoint") for s in r["restore_sources"])  # fell back past the corrupt one


@pytest.mark.slow
def test_the_megatron_engine_at_tp2_dp2_survives_a_kill_and_an_exception(tmp_path):
    out = tmp_path / "chaos.json"
    run_bench("chaos", "--engine", "megatron", "--faults", "2", "--seed", "1", "--nodes", "1", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["engine"] == "megatron" and r["run_stopped"] is None, r["run_stopped"]
    assert r["recovered"] == r["faults"] == 2, r
    assert r["recovery_kinds"]["crash"] >= 1 and r["recovery_kinds"]["exception"] >= 1, r["recovery_kinds"]
    # a rank lost inside its keeper's copy window comes back from the checkpoint: a step replayed
    assert r["steps_lost"] <= r["faults"] and "peer+keeper" in r["restore_sources"], r["restore_sources"]
    assert r["max_abs_loss_diff"] == 0.0 and r["replays_equal"] and r["checkpoints_lost"] == 0
