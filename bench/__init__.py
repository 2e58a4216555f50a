"""Benchmarks (`python -m bench.NAME`): each prints a table and writes its JSON with `write_json`."""
import contextlib
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


@contextlib.contextmanager
def logical_cluster(nodes: int, root, cpus_per_node: int = 4):
    """A Ray cluster of `nodes` logical nodes on this machine (`ray.cluster_utils.Cluster`; the
    head has no CPUs, so every actor lands on a node that can be lost), joined by this process
    with `actor_env(root)` for its actors; shut down on exit. Actors inherit the rest of this
    process's environment (credentials stay out of runtime_env: Ray's agent logs env_vars)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=cpus_per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": actor_env(root)})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()

