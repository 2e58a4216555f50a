"""Benchmarks (`python -m bench.NAME`): each prints a table and writes its JSON with `write_json`."""
import json
import os


def write_json(path: str, result) -> None:
    """Write `result` as indented JSON to `path` (its directory made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def actor_env(root, **extra: str) -> dict:
    """The `runtime_env` env_vars of a benchmark's actors: `root` put before this process's
    PYTHONPATH, not in its place (where Ray itself comes from PYTHONPATH, as with the GPU
    bundle's `install.sh`, a worker without it cannot import ray: Ray restarts it forever and
    every call to its actor waits with no error), plus `extra`."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])), **extra}
