"""Deployment files parse, name files that exist, and their entrypoints' CLIs answer --help."""
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_job_yaml_is_consistent():
    job = yaml.safe_load((ROOT / "job.yaml").read_text())
    assert job["max_retries"] == 0  # recovery is ours, not a job restart
    assert (ROOT / job["containerfile"]).is_file()
    argv = shlex.split(job["entrypoint"])
    assert argv[:2] == ["python", "main.py"] and (ROOT / argv[1]).is_file()
    # the entrypoint's overrides are valid config (parsed and validated, no Ray started)
    from config import load_config, resolve
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    resolve(load_config(ROOT / "config.yaml", overrides), num_gpus=8)


def test_cli_help():
    for args in (["--help"], ["demo", "--help"]):
        out = subprocess.run([sys.executable, "main.py", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and "--set" in out.stdout


def test_bad_config_fails_before_ray_with_one_line():
    out = subprocess.run([sys.executable, "main.py", "demo", "--set", "train.micro_batch_size=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("config error: train.micro_batch_size")
