"""`python -m bench.control_plane`: at tiny N it runs end to end (heartbeats through node agents,
steps, a killed and a SIGSTOPped rank detected, abort, the barrier through the store, the
restore plan) and writes its JSON with the documented top-level keys; a phase that runs past its
limit is that size's recorded failure, not a hang."""
import json

import pytest

from conftest import run_bench


@pytest.mark.slow
def test_a_phase_past_its_limit_is_the_sizes_recorded_failure(tmp_path):
    out = tmp_path / "cp.json"
    proc = run_bench("control_plane", "--sizes", "4", "--ranks-per-node", "4", "--no-store",
                     "--phase-timeout-s", "0.5", "--out", str(out))
    assert "N=4 start ..." in proc.stdout and "N=4 start: not done after 0.5 s" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["sizes"] == [] and saved["growth_exponent_driver_cpu"] is None
    assert saved["failures"] == [{"n": 4, "failed": "start: PhaseTimeout: not done after 0.5 s"}]


@pytest.mark.slow
def test_control_plane_bench_runs_at_tiny_n(tmp_path):
    out = tmp_path / "cp.json"
    proc = run_bench("control_plane", "--sizes", "4", "8", "--ranks-per-node", "4", "--steps", "2",
                     "--idle-s", "1", "--health-timeout-s", "2", "--out", str(out))
    assert "control plane only" in proc.stdout
    assert "N=8 detect killed: " in proc.stdout and "N=8   10/10 rank actors up" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["sizes"] == [4, 8] and saved["failures"] == []
    for key in ("driver_cpu_per_step_s", "recovery_control_s", "detect_kill_s", "detect_silent_s", "rank_pss_mb"):
        assert len(saved[key]) == 2 and all(v > 0 for v in saved[key]), key
    assert isinstance(saved["growth_exponent_driver_cpu"], float) and saved["device"].startswith("cpu")


def test_driver_wait_bench_measures_both_gc_modes(tmp_path):
    """`bench.driver_wait`: the driver's own work per step at each N, with the default GC and
    with the frozen heap, every step's results read whole (the digest and loss checked there)."""
    out = tmp_path / "dw.json"
    proc = run_bench("driver_wait", "--sizes", "8", "32", "--steps", "5", "--out", str(out))
    assert "frozen heap" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["sizes"] == [8, 32] and saved["roots"] == [1, 4]
    for key in ("wait_cpu_per_step_s", "reduce_cpu_per_step_s", "driver_cpu_per_step_s",
                "driver_cpu_per_step_gc_default_s"):
        assert len(saved[key]) == 2 and all(v > 0 for v in saved[key]), key
    assert saved["heap_objects"] > 10_000 and saved["device"].startswith("cpu")
