"""CI version of the chaos soak (bench/chaos.py): one fault of every kind over a CPU run on a
3-node Ray cluster with checkpoints on a loopback S3 server; nothing may diverge or be lost."""

import chaos


def test_one_fault_of_every_kind():
    r = chaos.run_soak(n_faults=len(chaos.KINDS), seed=1)
    assert r["kinds"] == {k: 1 for k in chaos.KINDS}
    assert r["recovered"] == r["faults"] == len(chaos.KINDS)
    assert r["max_abs_loss_diff"] == 0.0 and r["replays_equal"]
    assert r["checkpoints_lost"] == 0
    assert r["saves_skipped_by_storage_outage"]          # the outage did hit a save
    assert r["recovery_kinds"]["hang"] >= 1 and r["recovery_kinds"]["crash"] >= 1
    assert any(s.startswith("checkpoint") for s in r["restore_sources"])  # fell back past the corrupt one
