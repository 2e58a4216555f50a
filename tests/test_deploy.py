"""Deployment files parse, name files that exist, and their entrypoints' CLIs answer --help."""
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def check_resumable(entrypoint: str, persistent: str):
    """A retried job resumes its run: the entrypoint trains a named run whose checkpoints and
    run_dir are on storage that outlives an attempt (`persistent`), and never starts fresh
    (--fresh deletes the checkpoints). Returns its resolved config."""
    from ftrain.config import load_config, resolve
    assert shlex.split(entrypoint)[2] == "train" and "--fresh" not in shlex.split(entrypoint)
    sets = entrypoint_overrides(entrypoint)
    assert any(s.startswith("run_name=") for s in sets)
    cfg = resolve(load_config(ROOT / "config.yaml", sets), num_gpus=8)
    assert cfg.checkpoint.uri.startswith(persistent) and cfg.run_dir.startswith(persistent)
    assert 0 < cfg.checkpoint.interval < cfg.train.steps
    return cfg


def test_job_yaml_is_consistent():
    job = yaml.safe_load((ROOT / "job.yaml").read_text())
    assert job["max_retries"] > 0  # a retried job resumes (driver or head node lost)
    assert (ROOT / job["containerfile"]).is_file()
    check_resumable(job["entrypoint"], "/mnt/user_storage/")  # Anyscale's storage that outlives a cluster


def entrypoint_overrides(entrypoint: str) -> list[str]:
    """The `--set` values of a `python main.py ...` command line."""
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["python", "main.py"] and (ROOT / argv[1]).is_file()
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_rayjob_yaml_is_consistent():
    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy" / "rayjob.yaml").read_text())}
    job = docs["RayJob"]
    spec, cluster = job["spec"], job["spec"]["rayClusterSpec"]
    # a retry (a new RayCluster) resumes from the checkpoints on the shared volume
    assert spec["backoffLimit"] > 0 and spec["shutdownAfterJobFinishes"] is True
    assert (ROOT / job["metadata"]["annotations"]["ft-megatron/dockerfile"]).is_file()
    assert yaml.safe_load(spec["runtimeEnvYAML"])["working_dir"] == "/home/ray/app"
    assert "WORKDIR /home/ray/app" in (ROOT / "Dockerfile").read_text()
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    containers = [c for g in pods for c in g["template"]["spec"]["containers"]]
    assert len({c["image"] for c in containers}) == 1  # one image, built from the Dockerfile
    claim = docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert all(v.get("persistentVolumeClaim", {}).get("claimName") == claim
               for g in pods for v in g["template"]["spec"]["volumes"] if v["name"] == "checkpoints")

    cfg = check_resumable(spec["entrypoint"], containers[0]["volumeMounts"][0]["mountPath"])
    # GPU workers hold every rank and spare now, and room for more (spare capacity)
    gpus = [g for g in cluster["workerGroupSpecs"] if "nvidia.com/gpu" in
            g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    per_node = int(gpus[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    c = cfg.cluster
    assert per_node == c.gpus_per_node and gpus[0]["replicas"] == c.num_nodes
    assert (c.num_workers + c.num_spares) * c.gpus_per_actor <= per_node * gpus[0]["replicas"]
    assert gpus[0]["maxReplicas"] > gpus[0]["replicas"]


def test_entrypoints_dry_run(capsys):
    """Both deployment entrypoints run through the CLI with --dry-run (config resolved for the
    GPU cluster, placement planned, nothing started)."""
    import main
    for entrypoint in (yaml.safe_load((ROOT / "job.yaml").read_text())["entrypoint"],
                       next(d for d in yaml.safe_load_all((ROOT / "deploy" / "rayjob.yaml").read_text())
                            if d["kind"] == "RayJob")["spec"]["entrypoint"]):
        argv = shlex.split(entrypoint)[2:] + ["--dry-run", "--config", str(ROOT / "config.yaml"),
                                              "--set", "cluster.gpus_per_node=8"]
        assert main.main(argv) == 0
        out = capsys.readouterr().out
        assert "# planned placement" in out and out.count("\nspare ") == 4


def test_cli_help():
    for args in (["--help"], ["demo", "--help"], ["train", "--help"]):
        out = subprocess.run([sys.executable, "main.py", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and "--set" in out.stdout and "--dry-run" in out.stdout


def test_bad_config_fails_before_ray_with_one_line():
    out = subprocess.run([sys.executable, "main.py", "demo", "--set", "train.micro_batch_size=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("config error: train.micro_batch_size")


def test_dockerfile_cmd_is_valid_and_venv_stays_out():
    import json
    cmd = json.loads(next(line for line in (ROOT / "Dockerfile").read_text().splitlines()
                          if line.startswith("CMD "))[4:])
    assert cmd[:2] == ["python", "main.py"] and (ROOT / cmd[1]).is_file()
    from ftrain.config import load_config, resolve
    resolve(load_config(ROOT / "config.yaml", [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]), num_gpus=4)
    assert ".venv" in (ROOT / ".dockerignore").read_text().split()


def test_the_demo_verdict_needs_the_final_state_too(capsys):
    """Equal losses are not enough on CPU: the first update of a step runs at ratio 1, where the
    PPO loss does not depend on the weights. The demo also compares each rank's final training
    state (`Engine.state_digest`)."""
    from ftrain.config import load_config, resolve
    from main import print_report

    cfg = resolve(load_config(None, []), num_gpus=0)
    ref = {"losses": {1: 0.5, 2: 0.25}, "replayed": {}, "recoveries": [], "state_digests": ["a", "b"]}
    tl = {"kind": "crash", "failed_ranks": [1], "failed_nodes": ["n"], "restored_step": 1, "restore_source": "peer",
          "steps_lost": 0, "attempts": 1, **{p: 0.0 for p in ("detect_s", "abort_s", "replace_s", "rebuild_s",
                                                             "restore_s", "first_step_s", "first_step_excess_s", "total_s")}}
    run = {**ref, "recoveries": [tl]}
    assert print_report(ref, run, cfg)
    assert not print_report(ref, {**run, "state_digests": ["a", "c"]}, cfg)
    assert "final training state (weights + optimizer, per rank): differs" in capsys.readouterr().out


def test_the_job_ships_the_library_and_the_example_to_its_actors(tmp_path):
    """job.yaml's `working_dir` and `excludes` as Ray's runtime_env, from a driver outside the
    repository (its own local Ray): an actor imports `ftrain` and the example's modules from the
    copy Ray shipped, not from the repository; the image (Dockerfile) installs the package too."""
    job = yaml.safe_load((ROOT / "job.yaml").read_text())
    env = {"working_dir": str(ROOT / job["working_dir"]), "excludes": job["excludes"]}
    code = f"""
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False, runtime_env={env!r})

@ray.remote
def where():
    import ftrain.trainer, megatron_actor
    return ftrain.trainer.__file__, megatron_actor.__file__

print(*ray.get(where.remote()))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    trainer, actor = out.stdout.split()
    assert "working_dir_files" in trainer and "working_dir_files" in actor and not trainer.startswith(str(ROOT))
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.index("COPY . .") < dockerfile.index("pip install --no-cache-dir --no-deps -e .")
