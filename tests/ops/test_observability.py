"""Operability: `main.py train` end to end on CPU with one injected kill, checked through what an
operator sees: the Ray metrics scraped from the node's Prometheus endpoint, the key=value event
lines, the plots in run_dir; and `--dry-run` (config + placement plan, no Ray)."""
import argparse
import logging
import math
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import own_ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ray_metrics():
    """A local Ray whose metrics reach its node's Prometheus endpoint within ~0.5 s; yields the
    endpoint's URL."""
    import ray

    own_ray()
    saved = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "500"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "RAY_IGNORE_UNHANDLED_ERRORS": "1"}})
    yield f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
    ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_metrics_report_interval_ms")
    else:
        os.environ["RAY_metrics_report_interval_ms"] = saved


def scrape(url: str, expect: dict, timeout_s: float = 30.0) -> dict:
    """(sample name, frozenset of our tags) -> value, once every sample in `expect` has its
    expected value (the metrics agent exports what the driver recorded ~0.5-2 s later, one
    metric at a time); after `timeout_s` the samples as they are, for the asserts to report."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        samples = {(s.name, frozenset((k, v) for k, v in s.labels.items() if k in ("kind", "phase", "le"))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name.startswith("ray_ft_")}
        if all(k in samples and math.isclose(samples[k], v, abs_tol=1e-6) for k, v in expect.items()) \
                or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def test_train_exports_metrics_logs_events_and_plots(ray_metrics, tmp_path, capsys, caplog):
    import main
    from ftrain.config import load_config, resolve

    cfg = resolve(load_config(os.path.join(ROOT, "config.yaml"), [
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", "train.steps=4",
        "cluster.num_workers=2", "cluster.num_spares=1", "fault_tolerance.refill_spares=false",
        "chaos.events=[{step: 3, rank: 1, kind: kill, point: inside_allreduce}]"]))
    with caplog.at_level(logging.INFO, logger="events"):
        assert main.cmd_train(cfg, argparse.Namespace(quiet=True)) == 0
    out = capsys.readouterr().out
    last_loss = float(out.split("step     4  loss")[1].split()[0])

    # one key=value event line per committed step, recovery and save
    events = [r.getMessage() for r in caplog.records if r.name == "events"]
    assert sum(e.startswith("event=step ") for e in events) == 4
    assert any(e.startswith("event=recovery kind=crash ranks=1 ") and " step=3 " in e for e in events)
    assert sum(e.startswith("event=checkpoint_save step=") for e in events) == 2

    # plots: non-empty PNGs
    for name in ("loss.png", "recoveries.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # metrics, read back from the Prometheus endpoint of the node's metrics agent
    expect = {("ray_ft_recoveries_total", frozenset({("kind", "crash")})): 1,
              ("ray_ft_spares_available", frozenset()): 0,  # the one spare replaced rank 1
              ("ray_ft_step_seconds_count", frozenset()): 4,
              ("ray_ft_checkpoint_save_stall_seconds_count", frozenset()): 2,
              ("ray_ft_loss", frozenset()): last_loss,
              **{("ray_ft_recovery_phase_seconds_count", frozenset({("phase", phase)})): 1
                 for phase in ("detect", "abort", "replace", "rebuild", "restore", "first_step", "total")}}
    m = scrape(ray_metrics, expect)
    for key, value in expect.items():
        assert m.get(key) == pytest.approx(value, abs=1e-6), key
    assert m[("ray_ft_throughput_tokens_per_s", frozenset())] > 0
    assert m[("ray_ft_recovery_phase_seconds_sum", frozenset({("phase", "total")}))] > 0


def dry_run(*overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "main.py", "train", "--dry-run", *(a for o in overrides for a in ("--set", o))]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_dry_run_prints_config_and_placement_without_ray():
    out = dry_run("cluster.num_workers=2", "cluster.num_spares=2", "train.steps=7")
    assert out.returncode == 0, out.stderr
    assert "Ray instance" not in out.stderr  # nothing started
    config_text, plan = out.stdout.split("# planned placement")
    cfg = yaml.safe_load(config_text)
    assert cfg["train"]["steps"] == 7 and cfg["cluster"]["device"] == "cpu" and cfg["model"]["engine"] == "torch"
    rows = [line.split() for line in plan.splitlines()[2:]]
    assert [r[0] for r in rows] == ["rank", "rank", "spare", "spare"]
    assert sorted(int(r[-3]) for r in rows) == [0, 1, 2, 3]  # bundle column


def test_dry_run_plans_a_gpu_layout_on_a_cpu_machine(capsys):
    import main

    overrides = ("cluster.gpus_per_node=8", "cluster.num_nodes=2", "cluster.num_workers=8",
                 "cluster.num_spares=4", "parallel.tp=2")
    assert main.main(["train", "--dry-run", "--config", os.path.join(ROOT, "config.yaml"),
                      *(a for o in overrides for a in ("--set", o))]) == 0
    plan = capsys.readouterr().out.split("# planned placement")[1]
    assert "tp=2 cp=1 dp=4 pp=1" in plan and "1.0 GPU" in plan
    devices = [tuple(line.split()[-3:]) for line in plan.splitlines()[2:]]  # (node, "GPU", id)
    assert len(devices) == 12 and len(set(devices)) == 12  # one actor per GPU
    assert {d[0] for d in devices} == {"node0", "node1"}


def test_the_step_line_shows_the_newest_step_the_keepers_hold(caplog):
    """With the keeper on, each `event=step` line carries `kept_step` (the step a rank lost now
    comes back to; `none` while a keeper holds nothing) and, when a rank waited for its
    previous send, `keeper_wait_s`; without the keeper, neither."""
    from ftrain.ops.metrics import RunMetrics

    m = RunMetrics(100)
    with caplog.at_level(logging.INFO, logger="events"):
        for step, kept, wait in ((5, 4, 0.25), (6, -1, 0.0), (7, None, 0.0)):
            m.on_step(step, 1.0, 0.5, 1, kept_step=kept, keeper_wait_s=wait)
    lines = [r.getMessage() for r in caplog.records if "event=step" in r.getMessage()]
    assert "kept_step=4 keeper_wait_s=0.250" in lines[0] and "kept_step=none" in lines[1]
    assert "kept_step" not in lines[2] and "keeper_wait_s" not in lines[1] + lines[2]
