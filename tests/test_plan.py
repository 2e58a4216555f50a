"""Capacity planner (bench/plan.py): the simulator against closed-form expectations."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from plan import (STRATEGIES, Costs, Failure, daly_interval, failure_trace, simulate,  # noqa: E402
                  young_interval)

DAY = 86400.0


def costs(**kw):
    base = dict(detect_s=5, inplace_s=10, peer_restore_s=5, ckpt_load_s=300, restart_s=1200,
                ckpt_stall_s=0, step_s=10, refill_s=7200)
    return Costs(**{**base, **kw})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_failures_goodput_is_one(strategy):
    r = simulate([], strategy, costs(), 10 * DAY, 3600, 8)
    assert r.goodput == pytest.approx(1.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_failures_checkpoint_overhead_closed_form(strategy):
    tau, delta = 3600.0, 60.0
    r = simulate([], strategy, costs(ckpt_stall_s=delta), 100 * (tau + delta), tau, 8)
    assert r.goodput == pytest.approx(tau / (tau + delta))


def test_zero_rates_give_empty_trace():
    assert failure_trace(16384, 8, 0.0, 0.0, 30 * DAY, 0) == []


def test_trace_rate_matches_poisson_mean():
    gpus, rate, days = 16384, 1.55e-5, 200
    n = len(failure_trace(gpus, 8, rate, 0.0, days * DAY, 1))
    expected = gpus * rate * 24 * days
    assert abs(n - expected) < 4 * math.sqrt(expected)


def test_restart_loses_work_since_checkpoint_and_downtime():
    # One failure 30 min after a checkpoint (interval 1 h, free checkpoints): restart loses the
    # 30 min of work plus detect + restart; ours loses the in-flight part of a step plus recovery.
    c = costs()
    f = [Failure(t=3600 + 1800, gpus=1, u=0.5)]
    h = 10 * 3600.0
    r = simulate(f, "restart", c, h, 3600, 0)
    assert h - r.useful_s == pytest.approx(1800 + c.detect_s + c.restart_s)
    p = simulate(f, "spare_peer", c, h, 3600, 8)
    assert h - p.useful_s == pytest.approx(0.5 * c.step_s + c.detect_s + c.inplace_s + c.peer_restore_s)
    s = simulate(f, "spare_ckpt", c, h, 3600, 8)
    assert h - s.useful_s == pytest.approx(1800 + c.detect_s + c.inplace_s + c.ckpt_load_s)


def test_empty_pool_falls_back_to_restart():
    c = costs()
    f = [Failure(t=5400, gpus=8, u=0.5)]
    r = simulate(f, "spare_peer", c, 10 * 3600.0, 3600, 0)
    assert r.fallbacks_to_restart == 1
    assert r.useful_s == pytest.approx(simulate(f, "restart", c, 10 * 3600.0, 3600, 0).useful_s)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_more_spares_never_lower_goodput(seed):
    c = costs(ckpt_stall_s=30)
    trace = failure_trace(65536, 8, 1.55e-5, 3.39e-5, 20 * DAY, seed)
    for strategy in ("spare_peer", "spare_ckpt"):
        g = [simulate(trace, strategy, c, 20 * DAY, 1800, s).goodput for s in (0, 8, 16, 32, 64, 128)]
        assert all(b >= a - 1e-9 for a, b in zip(g, g[1:])), (strategy, g)


def test_ours_beats_restart_on_the_same_trace():
    c = costs(ckpt_stall_s=30)
    trace = failure_trace(16384, 8, 1.55e-5, 3.39e-5, 30 * DAY, 3)
    g = {s: simulate(trace, s, c, 30 * DAY, 1800, 64).goodput for s in STRATEGIES}
    assert g["spare_peer"] > g["spare_ckpt"] > g["restart"]


def test_young_daly_formulas():
    delta, m = 60.0, 3 * 3600.0
    assert young_interval(delta, m) == pytest.approx(math.sqrt(2 * delta * m))
    x = delta / (2 * m)
    assert daly_interval(delta, m) == pytest.approx(math.sqrt(2 * delta * m) * (1 + math.sqrt(x) / 3 + x / 9) - delta)
    assert daly_interval(3 * m, m) == m


def test_young_interval_is_the_simulated_optimum_for_restart():
    # Checkpoint cost 60 s, MTBF 1 h, restart cost small: the simulated goodput of the restart
    # strategy peaks near sqrt(2 delta M) (a flat optimum: within 10% of the best on a grid).
    delta, mtbf = 60.0, 3600.0
    c = costs(ckpt_stall_s=delta, restart_s=60, detect_s=0)
    trace = failure_trace(1000, 8, 1 / (1000 * mtbf / 3600), 0.0, 200 * DAY, 5)
    grid = [young_interval(delta, mtbf) * k for k in (0.25, 0.5, 0.75, 1, 1.33, 2, 4)]
    g = [simulate(trace, "restart", c, 200 * DAY, tau, 0).goodput for tau in grid]
    best = grid[g.index(max(g))]
    assert 0.5 * young_interval(delta, mtbf) <= best <= 2 * young_interval(delta, mtbf)
    assert g[3] >= max(g) - 0.005


def test_main_plan_mode_runs_the_planner(tmp_path):
    """`python main.py plan ARGS` forwards ARGS to bench/plan.py and writes its JSON and PNG."""
    import json

    from main import main

    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--gpus", "1000", "--days", "2", "--traces", "1",
                 "--out", str(out), "--png", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert png.stat().st_size > 0 and "1000" in json.dumps(rows)
