"""Bad input fails before any actor starts or any state is lost, with one line naming the
field and the fix."""
import time

import pytest
import torch

from checkpoint import CheckpointManager
from ftrain.config import ConfigError, load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.state.manifest import check_compatible, model_signature
from ftrain.testbeds.local_storage import free_port
from megatron_actor import MegatronActor


def cfg_with(tmp_path, *overrides):
    return resolve(load_config("config.yaml", [f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt",
                                                *overrides]), num_gpus=0)


def test_cluster_too_small_reports_what_is_there(ray_session, tmp_path):
    cfg = cfg_with(tmp_path, "cluster.num_workers=32", "cluster.num_spares=8", "train.mini_batch_size=32",
                   "train.global_batch_size=32", "train.micro_batch_size=1")
    deadline = time.monotonic() + 30  # the actors an earlier module killed give their CPUs back
    while ray_session.available_resources().get("CPU") != 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(ConfigError, match=r"^cluster.num_workers: .*need 10 CPU.*cluster has 8 CPU"):
        ActorGroup(MegatronActor, cfg)
    assert ray_session.available_resources().get("CPU") == 8  # nothing was placed or started


def test_unreachable_checkpoint_uri(tmp_path, monkeypatch):
    import s3fs

    from checkpoint import check_uri

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    cfg = cfg_with(tmp_path, "checkpoint.uri=s3://no-such-bucket-for-tests/x", "checkpoint.retry_budget_s=1")
    try:
        with pytest.raises(ConfigError, match="^checkpoint.uri: .*no-such-bucket-for-tests.*endpoint: http://127.0.0.1"):
            check_uri(cfg.checkpoint)
    finally:  # fsspec caches the client made for this endpoint: later tests must not get it
        s3fs.S3FileSystem.clear_instance_cache()


def main_fails(*sets: str, env: dict | None = None, ray_starts: bool = True) -> str:
    """Run `main.py train --set ...` as a user would; assert it exits 2 with no traceback (and,
    unless `ray_starts`, before a local Ray started); return its last stderr line."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "main.py", "train", *(a for s in sets for a in ("--set", s))],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert ray_starts or "Started a local Ray instance" not in out.stderr, out.stderr[-2000:]
    return out.stderr.strip().splitlines()[-1]


def test_the_cli_reports_unreachable_storage_in_one_line_before_ray_starts(tmp_path):
    line = main_fails(f"run_dir={tmp_path}", "checkpoint.uri=s3://no-such-bucket-for-tests/x",
                      env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
                           "AWS_SECRET_ACCESS_KEY": "x"})
    assert line.startswith("config error: checkpoint.uri: ") and "endpoint: http://127.0.0.1" in line, line


def test_the_cli_reports_a_cluster_too_small_in_one_line(tmp_path):
    line = main_fails(f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", "cluster.num_spares=20",
                      "cluster.cpus_per_actor=1", "cluster.ray_num_cpus=2", ray_starts=False)
    assert line.startswith("config error: cluster.num_workers: 4 workers + 20 spares need 24 CPU"), line


def test_a_tp_group_wider_than_a_node_is_refused_in_one_line(tmp_path):
    from ftrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"^parallel.tp: 16 ranks of a tensor-parallel group cannot stay inside "
                                          r"one node of cluster.gpus_per_node=8 GPUs"):
        resolve(load_config("config.yaml", [f"run_dir={tmp_path}", "cluster.gpus_per_node=8", "cluster.num_nodes=4",
                                            "parallel.tp=16", "cluster.num_workers=32"]), num_gpus=8)


def test_a_placement_that_cannot_be_placed_is_a_cluster_error(ray_session, tmp_path):
    """Enough CPUs in total but not free (another placement group holds them): after the
    placement timeout, a ClusterError saying what was asked and what the cluster has."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from ftrain.failures import ClusterError

    hog = placement_group([{"CPU": 8}])
    ray_session.get(hog.ready(), timeout=60)
    try:
        with pytest.raises(ClusterError, match=r"^cluster too small: 8 bundles .*cluster.num_spares=4"):
            ActorGroup(MegatronActor, cfg_with(tmp_path), placement_timeout_s=2)
    finally:
        remove_placement_group(hog)


def test_checkpoint_from_another_model_names_both(tmp_path):
    a = cfg_with(tmp_path)
    b = cfg_with(tmp_path, "model.hidden_size=32")
    m = CheckpointManager(str(tmp_path / "ckpt"))
    manifest = m.commit(1, {"tp": 1, "pp": 1, "cp": 1}, m.save_shard(1, "s", {"x": torch.ones(1)}),
                        {"model": model_signature(a)})
    check_compatible(a, manifest)
    with pytest.raises(ConfigError, match=r"^model: .*'hidden_size': \(64, 32\)"):
        check_compatible(b, manifest)
    tp2 = m.commit(2, {"tp": 2, "pp": 1, "cp": 1}, m.save_shard(2, "s", {"x": torch.ones(1)}),
                   {"model": model_signature(a)})
    with pytest.raises(ConfigError, match="^parallel: .*tp=pp=cp=1"):
        check_compatible(a, tp2)


@pytest.mark.parametrize("field, bad", [
    ("input_ids", lambda b: b.input_ids.float()),
    ("input_ids", lambda b: b.input_ids + 1000),
    ("advantages", lambda b: b.advantages.masked_fill(torch.ones_like(b.advantages, dtype=torch.bool), float("nan"))),
    ("loss_mask", lambda b: b.loss_mask[:, :-1]),
])
def test_a_malformed_batch_fails_on_the_driver_naming_the_field(monkeypatch, field, bad):
    """The trainer validates each batch it makes (`Trainer.batch`) before any rank sees it."""
    from types import SimpleNamespace

    from ftrain import trainer
    from ftrain.data.training_batch import synthetic_batch

    def malformed(*args):
        b = synthetic_batch(*args)
        setattr(b, field, bad(b))
        return b

    monkeypatch.setattr(trainer, "synthetic_batch", malformed)
    cfg = load_config(None, ["model.vocab_size=100"])
    with pytest.raises(ValueError, match=field):
        trainer.Trainer.batch(SimpleNamespace(cfg=cfg, data=None), 1)


@pytest.mark.parametrize("case", ["refused", "no_bucket", "indexed_on_s3"])
def test_data_on_unreachable_storage_is_one_line_before_ray_starts(stdlib_corpus, s3_server, tmp_path, capsys,
                                                                   monkeypatch, case):
    """data.path on object storage: a prompt set behind an endpoint that refuses connections or
    in a bucket that does not exist (a loopback S3), or an indexed dataset there (ranks read
    local or mounted files): `main.py train` (`main.main` in this process, the CLI's code path)
    exits 2 with one line naming data.path, and Ray does not start."""
    import ray
    import s3fs

    import main

    tok, prefix = stdlib_corpus
    endpoint = f"http://127.0.0.1:{free_port()}" if case == "refused" else s3_server.endpoint_url
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    url = "s3://no-such-bucket-for-tests/train.parquet"
    sets = [f"data.tokenizer={tok}", f"run_dir={tmp_path}/run", f"checkpoint.uri={tmp_path}/ckpt",
            *([f"data.path={url}"] if case != "indexed_on_s3" else
              ["rl.enabled=false", "train.objective=ce", "data.kind=indexed", f"data.path=s3://{s3_server.bucket}/corpus"])]
    expected = {"refused": f"config error: data.path: cannot reach {url}: EndpointConnectionError: Could not connect "
                           f"to the endpoint URL: \"{endpoint}/",
                "no_bucket": f"config error: data.path: {url}: no such object (or no such bucket)",
                "indexed_on_s3": f"config error: data.path: s3://{s3_server.bucket}/corpus: an indexed dataset is read "
                                 "from a local or mounted path"}[case]
    started = ray.is_initialized()
    try:
        code = main.main(["train", "--config", "configs/grpo_cpu.yaml", *(a for s in sets for a in ("--set", s))])
    finally:  # fsspec caches the client made for this endpoint: later tests must not get it
        s3fs.S3FileSystem.clear_instance_cache()
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("config error:")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(expected), stderr[-2000:]
    assert "Traceback" not in stderr and ray.is_initialized() == started, stderr[-2000:]
