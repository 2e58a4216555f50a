"""`python -m bench.control_plane`: at tiny N it runs end to end (heartbeats through node agents,
steps, a killed and a SIGSTOPped rank detected, abort, the barrier through the store, the
restore plan) and writes its JSON with the documented top-level keys; a phase that runs past its
limit is that size's recorded failure, not a hang."""
import json
import time

import pytest

from bench.control_plane import PhaseTimeout, phase
from conftest import run_bench


def test_a_phase_past_its_limit_is_a_failure_not_a_hang(capsys):
    t0 = time.monotonic()
    with pytest.raises(PhaseTimeout, match="not done after"):
        phase(4, "held", 0.2, time.sleep, 30)
    assert time.monotonic() - t0 < 5
    assert phase(4, "quick", 5, lambda x: x + 1, 1) == 2
    with pytest.raises(ValueError, match="bad"):
        phase(4, "raises", 5, lambda: (_ for _ in ()).throw(ValueError("bad")))
    out = capsys.readouterr().out
    assert "N=4 held ..." in out and "N=4 held: not done after 0.2 s" in out and "N=4 quick: " in out


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
