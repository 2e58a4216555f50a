"""The goodput bench (`python -m bench.goodput`): failures from a seeded Poisson process,
injected by wall time into the trainer as `main.py train` runs it. Its pure parts (the
schedule, the mix, the restart baseline) are unit-tested; one short run of the Megatron engine on
gloo (tp=2 x dp=2, the distributed optimizer and the shard keeper, checkpoints every 2 steps)
runs end to end: whatever the failures hit, the run goes on, its losses equal the run without
failures and no committed checkpoint is lost (the CI version of the Megatron chaos soak)."""
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrain.ops.goodput import MIX, POINTS, failure_schedule, parse_mix, restart_ettr

from conftest import run_bench


def test_the_schedule_is_a_seeded_poisson_process_of_the_mix():
    mix = parse_mix(MIX, 1)
    a = failure_schedule(30.0, 7, 300_000.0, mix, 4)
    assert a == failure_schedule(30.0, 7, 300_000.0, mix, 4) != failure_schedule(30.0, 8, 300_000.0, mix, 4)
    gaps = [y["t_s"] - x["t_s"] for x, y in zip(a, a[1:])]
    assert abs(sum(gaps) / len(gaps) - 30.0) < 1.0  # mean inter-arrival (10^4 draws: sd ~0.3)
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(30.0 * math.log(2), rel=0.05)  # exponential's median
    share = {k: sum(f["kind"] == k for f in a) / len(a) for k in mix}
    assert share == pytest.approx({"crash": 0.4, "exception": 0.4, "hang": 0.2}, abs=0.02)
    assert all(f["point"] in POINTS[f["kind"]] and 0 <= f["rank"] < 4 for f in a)
    assert {f["point"] for f in a if f["kind"] == "crash"} == set(POINTS["crash"])  # saves and `now` included


def test_a_bad_mix_is_refused_naming_the_flag():
    for text, words in [("crash=1,fire=1", "unknown kind 'fire'"), ("crash=0", "positive weight"),
                        ("crash=-1,hang=1", "must be >= 0"), ("node=1", "--nodes >= 2")]:
        with pytest.raises(ValueError, match="--mix") as e:
            parse_mix(text, 1)
        assert words in str(e.value)
    assert parse_mix("crash=1,node=1", 3) == {"crash": 1.0, "node": 1.0}


def test_the_restart_baseline_redoes_the_steps_since_the_checkpoint_and_pays_each_restart():
    assert restart_ettr([], 100, 1.0, 10, 60.0) == (1.0, [])
    # At t=25 s: 25 steps done, checkpoint 20: 5 lost; 60 s restart: wall 25 + 60 + 80 = 165 s.
    ettr, lost = restart_ettr([(25.0, 0.0)], 100, 1.0, 10, 60.0)
    assert lost == [5.0] and ettr == pytest.approx(100 / 165)
    # A second failure during the restart starts it again (nothing more lost); a hang's detection adds.
    ettr, lost = restart_ettr([(25.0, 0.0), (50.0, 10.0)], 100, 1.0, 10, 60.0)
    assert lost == [5.0] and ettr == pytest.approx(100 / (50 + 10 + 60 + 80))
    assert restart_ettr([(500.0, 0.0)], 100, 1.0, 10, 60.0) == (1.0, [])  # after the job's end
    assert restart_ettr([(25.5, 0.0)], 100, 1.0, 0, 60.0)[1] == [25.5]  # no checkpoints: from step 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 500), st.floats(0, 20)), max_size=8), st.integers(1, 200),
       st.floats(0.01, 5), st.integers(0, 20), st.floats(0, 100))
def test_the_restart_baseline_never_beats_a_run_without_failures(failures, steps, step_s, interval, restart_s):
    ettr, lost = restart_ettr(failures, steps, step_s, interval, restart_s)
    assert 0 < ettr <= 1 + 1e-12 and len(lost) <= len(failures)
    assert all(0 <= x <= (interval or steps) + 1e-9 for x in lost)


def test_the_megatron_engine_goes_on_through_failures_at_random_times(tmp_path):
    out = tmp_path / "goodput.json"
    tiny = ["model.max_seq_len=16", "train.seq_len=16", "train.global_batch_size=4", "train.mini_batch_size=4",
            "train.micro_batch_size=1", "parallel.tp=2", "cluster.num_spares=2"]
    run_bench("goodput", "--engine", "megatron", "--steps", "8", "--mtbf-s", "8", "--seed", "3", "--no-restart",
              "--mix", "crash=0.5,exception=0.5", *[a for o in tiny for a in ("--set", o)], "--out", str(out))
    r = json.loads(out.read_text())
    assert r["engine"] == "megatron" and r["layout"].startswith("ParallelDims(tp=2") and "dp=2" in r["layout"], r["layout"]
    assert r["run_stopped"] is None, r["run_stopped"]
    assert r["committed_steps"] == 8 and r["recoveries"] >= 1, r["schedule"]
    assert r["losses_equal"] and r["replays_equal"] and r["checkpoints_lost"] == 0
    assert {t["kind"] for t in r["timelines"]} <= {"crash", "exception"}
    assert any(t["restore_source"].startswith(("peer", "keeper")) for t in r["timelines"]), r["timelines"]
    assert r["ettr"] > 0 and r["goodput_vs_plain"] == pytest.approx(r["ettr"])  # CPU: plain = the reference
