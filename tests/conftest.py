"""Shared fixtures: the repository root on sys.path, a local Ray session, storage servers."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

from storage_servers import gcs_server, s3_server  # noqa: E402,F401  (fixtures)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance per test module (8 logical CPUs on any machine)."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    ray.shutdown()
