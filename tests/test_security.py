"""Security: credentials never reach logs; Ray token authentication is left on."""
import logging
from pathlib import Path

import ray

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.trainer import Trainer
from megatron_actor import MegatronActor

from conftest import SECRET


def test_credentials_never_logged(ray_session, tmp_path, s3_server, caplog):
    caplog.set_level(logging.DEBUG)
    cfg = resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "cluster.num_spares=1", "checkpoint.interval=1", f"run_dir={tmp_path}",
        f"checkpoint.uri={s3_server.uri(tmp_path.name)}",
        "chaos.events=[{step: 2, rank: 1, kind: kill, point: step_start}]",
        "fault_tolerance.restore=checkpoint"]), num_gpus=0)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(3)               # saves and loads through S3 with the secret in the env
        repr_text = repr(trainer.ckpt) + repr(cfg)
    finally:
        group.shutdown()
    assert trainer.recoveries and trainer.checkpoints
    logs_dir = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    texts = [p.read_text(errors="replace") for p in logs_dir.rglob("*") if p.is_file()]
    assert texts, "no Ray logs to scan"
    for text in (*texts, caplog.text, repr_text, (tmp_path / "recoveries.jsonl").read_text()):
        assert SECRET not in text


def test_token_authentication_not_disabled():
    """No script, job or config of ours turns Ray's token authentication off."""
    for f in ("run.sh", "main.py", "job.yaml", "Dockerfile", "deploy/rayjob.yaml", *Path("configs").glob("*.yaml")):
        assert "RAY_AUTH_MODE" not in Path(f).read_text(), f
