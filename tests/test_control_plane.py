"""`python -m bench.control_plane` at tiny N: it runs end to end (heartbeats through node agents,
steps, a killed and a SIGSTOPped rank detected, abort, the barrier through the store, the
restore plan) and writes its JSON with the documented top-level keys."""
import json

import pytest

from conftest import run_bench


@pytest.mark.slow
def test_control_plane_bench_runs_at_tiny_n(tmp_path):
    out = tmp_path / "cp.json"
    proc = run_bench("control_plane", "--sizes", "4", "8", "--ranks-per-node", "4", "--steps", "2",
                     "--idle-s", "1", "--health-timeout-s", "2", "--out", str(out))
    assert "control plane only" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["sizes"] == [4, 8]
    for key in ("driver_cpu_per_step_s", "recovery_control_s", "detect_kill_s", "detect_silent_s"):
        assert len(saved[key]) == 2 and all(v > 0 for v in saved[key]), key
    assert isinstance(saved["growth_exponent_driver_cpu"], float) and saved["device"].startswith("cpu")
