"""Shared fixtures: the repository root and the test folders on sys.path, a local Ray session,
storage servers; and `run_bench`, how tests run a benchmark (as a program: tests do not import
bench/)."""
import dataclasses
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
# Test modules sit in a folder per part of the library (basenames unique): helpers here and
# in other test modules are imported by plain name from any folder.
sys.path[:0] = [TESTS, *sorted(e.path for e in os.scandir(TESTS) if e.is_dir() and e.name not in ("fixtures", "__pycache__"))]

import pytest  # noqa: E402

from ftrain.testbeds.local_storage import GCSServer, S3Server  # noqa: E402

SECRET = f"secret-{os.urandom(8).hex()}"  # a credential that must never appear in any log


# Wall seconds per module on the 2-core machine under `bash run.sh test` (two xdist workers):
# modules are collected longest first, so the workers, handed whole modules in collection order
# (run.sh: --dist loadfile --no-loadscope-reorder), finish together instead of one waiting on a
# long module started last. Only the order depends on these; unlisted modules go last.
MODULE_SECONDS = {"test_recovery": 254, "test_resume": 117, "test_scenarios": 114, "test_keeper": 110,
                  "test_data": 110, "test_driver_failover": 99, "test_fault_tolerance": 89, "test_rl": 78,
                  "test_node_loss": 55, "test_dp_invariance": 55, "test_slow_storage": 51,
                  "test_train_speed": 49, "test_driver_crash": 46, "test_rank_rows": 44, "test_health": 33, "test_agent_tree": 40,
                  "test_observability": 29, "test_bad_input": 26, "test_sft": 25, "test_megatron_groups": 24,
                  "test_security": 22, "test_checkpoint": 20, "test_megatron_checkpoint": 19,
                  "test_snapshots": 25, "test_fencing": 30, "test_goodput": 150, "test_megatron_rl": 11, "test_megatron_peer_restore": 9}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.stem, 0))  # stable: tests keep their order


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    server = GCSServer().start()
    yield server
    server.stop()


def run_bench(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m bench.NAME ARGS` from the repository root, its output captured (text); with
    `check`, an AssertionError that shows the output's end unless it exits 0."""
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=ROOT, capture_output=True, text=True)
    assert not check or proc.returncode == 0, \
        f"python -m bench.{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="session")
def _shared_ray_at_exit():
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def ray_session(s3_server, gcs_server, _shared_ray_at_exit):
    """A local Ray instance (8 logical CPUs on any machine), shared by the modules that use it:
    started by the first, kept for the next (a start and shutdown cost ~6 s), shut down at the
    end of the session or by a module that needs a Ray of its own (`own_ray`). Tests leave
    nothing running in it (each shuts its actors down). Driver and actors reach the loopback
    S3 / GCS servers through the usual environment variables; botocore tries a request once
    (`AWS_MAX_ATTEMPTS`, as `S3Server.storage_options`): a refused connection fails at once
    instead of after botocore's backoff, and the retries left are the ones under test
    (`checkpoint.retry_budget_s`)."""
    import ray

    env = {"PYTHONPATH": ROOT, "AWS_ENDPOINT_URL": s3_server.endpoint_url,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1", "STORAGE_EMULATOR_HOST": gcs_server.endpoint_url,
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "RAY_IGNORE_UNHANDLED_ERRORS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if not ray.is_initialized():
        # Actors inherit the environment of the local Ray started here (the same for every
        # module). Credentials must not go in runtime_env: Ray's runtime-env agent logs its
        # env_vars (tests/test_security.py found it).
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def own_ray() -> None:
    """For a module that starts a Ray of its own (one per process): shut down the one
    `ray_session` shares, which its next user starts again."""
    import ray

    ray.shutdown()


def wait_for_snapshots(group, step: int, timeout_s: float = 30.0) -> None:
    """Block until the SnapshotHolders hold every rank's in-memory snapshot of `step` (they are
    sent in the background after the step, so a kill right after it could race them)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not all(step in group.held_snapshots().get((str(group.dims), r), ())
                  for r in range(group.dims.world_size)):
        assert time.monotonic() < deadline, f"snapshots of step {step} not held: {group.held_snapshots()}"
        time.sleep(0.05)


def wait_for_senders(group, timeout_s: float = 30.0) -> None:
    """Block until no rank has a memory snapshot send in flight (after a join: its first call to
    the holder, see `SnapshotSender.connect`), so the next step's snapshot is not skipped."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while any(ray.get([s.handle.__ray_call__.remote(lambda actor: actor._sender.busy()) for s in group.workers])):
        assert time.monotonic() < deadline, "a rank's snapshot sender stayed busy"
        time.sleep(0.05)


def wait_for_shards(group, step: int, timeout_s: float = 30.0) -> None:
    """Block until the keepers hold every rank's optimizer shard of `step` (keeper.py: sent in
    the background after the step, so a kill right after it could race the send)."""
    import time

    from ftrain.state.keeper import shard_key

    deadline = time.monotonic() + timeout_s
    while not all(step in group.held_snapshots().get(shard_key(str(group.dims), r), ())
                  for r in range(group.dims.world_size)):
        assert time.monotonic() < deadline, f"shards of step {step} not kept: {group.held_snapshots()}"
        time.sleep(0.05)



def kill_then_await_refill(timeout_s: float):
    """An `after_step` for `Trainer.train` at dp=2 with no spare (`fault_tolerance.min_dp=1`):
    kill rank 0 after step 2; after step 3 (DP shrunk to 1, no grow yet) wait until the killed
    rank's bundle is refilled into the pool, so that the grow back comes at the next boundary."""
    import time

    def after_step(trainer, step):
        if step == 2:
            trainer.group.kill([0])
        if step == 3:
            assert trainer.group.dims.dp == 1 and not trainer.grows
            deadline = time.monotonic() + timeout_s
            while len(trainer.group.pool) < 1:
                assert time.monotonic() < deadline, "the killed rank's bundle was not refilled"
                trainer.group.poll_refills()
                time.sleep(0.1)
    return after_step


_references: dict[str, tuple[dict, list]] = {}


def reference_run(cfg, steps: int) -> tuple[dict, list]:
    """(losses, each rank's final state digest) of `steps` steps of the resolved `cfg` trained
    in-process with no failure and no spare: the reference a run with failures is compared to.
    Run once per session for the same ranks and math (`cluster.num_workers`, `cluster.device`
    and the parallel, model, train, ppo, rl and data sections; spares, nodes, checkpoints and timeouts
    change no result), so modules with the same reference share one run."""
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    assert not cfg.chaos.events, "a reference has no failure"
    fields = dataclasses.asdict(cfg)
    math = [fields[section] for section in ("parallel", "model", "train", "ppo", "rl", "data")]
    key = json.dumps([steps, cfg.cluster.num_workers, cfg.cluster.device, *math], sort_keys=True, default=str)
    if key not in _references:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, num_spares=0))
        group = ActorGroup(MegatronActor, cfg)
        try:
            trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
            trainer.train(steps)
            _references[key] = trainer.losses, group.state_digests()
        finally:
            group.shutdown()
    return _references[key]


def uninterrupted_losses(path, sets: list[str], steps: int) -> dict:
    """Losses of `reference_run` of config.yaml with `sets`, run_dir and checkpoint.uri under
    `path`: the reference a killed-driver run is compared to."""
    from ftrain.config import load_config, resolve

    cfg = resolve(load_config("config.yaml", [*sets, f"run_dir={path}", f"checkpoint.uri={path}/ckpt"]), num_gpus=0)
    return reference_run(cfg, steps)[0]


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory):
    """(tokenizer dir, dataset prefix) of the offline corpus (`data_prepare.stdlib_corpus`): a
    2048-token byte-level BPE trained on pydoc_data/topics.py and the first 40 standard-library
    .py files prepared with it (about 11,000 windows of 32 tokens); made once per session."""
    from ftrain.data.prepare import stdlib_corpus as make

    tok, prefix = make(tmp_path_factory.mktemp("stdlib"), max_files=40)
    return str(tok), prefix


TINY_MEGATRON = ["model.distributed_optimizer=false", "model.dtype=float32", "model.num_layers=2",
                 "model.hidden_size=64", "model.num_heads=4", "model.ffn_hidden_size=128", "model.vocab_size=128",
                 "model.max_seq_len=16", "train.seq_len=16", "train.global_batch_size=4", "train.mini_batch_size=4",
                 "train.micro_batch_size=1", "checkpoint.interval=0", "checkpoint.async_save=false"]


def megatron_cpu_cfg(tmp_path, *sets: str):
    """A config of MegatronActors on CPU (gloo) with a tiny float32 model (`TINY_MEGATRON`, then
    `sets`): resolved as for one GPU so the engine is Megatron, then the cluster set to CPU."""
    from ftrain.config import load_config, resolve_megatron_on_cpu

    cfg = resolve_megatron_on_cpu(load_config("config.yaml", [*TINY_MEGATRON, *sets, f"run_dir={tmp_path}",
                                                      f"checkpoint.uri={tmp_path}/ckpt"]))
    assert cfg.model.engine == "megatron"
    return cfg
