"""The join barrier (`MegatronActor.join`): a blocking wait on the generation's "formed" key,
freed by the last member to arrive or by an abort; neither an abort nor a timed-out wait
leaves a stale reply that would stall the actor's next join. Real actors, the driver's TCPStore."""
import datetime

import pytest
import ray
import torch.distributed as dist

from ftrain.config import load_config, resolve
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.failures import StaleGenerationError
from megatron_actor import MegatronActor


@pytest.mark.slow
def test_an_aborted_or_timed_out_barrier_leaves_the_next_join_working(ray_session, tmp_path):
    cfg = resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "fault_tolerance.rendezvous_timeout_s=3", f"run_dir={tmp_path}",
        f"checkpoint.uri={tmp_path}/ckpt"]), num_gpus=0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    actors = [MegatronActor.options(num_cpus=0).remote(cfg, i) for i in range(2)]
    try:
        ray.get([a.build.remote() for a in actors])
        dims, host, port = ParallelDims(tp=1, pp=1, cp=1, dp=2), "127.0.0.1", store.port
        # Alone in generation 1: blocked in the barrier until an abort frees it.
        alone = actors[0].join.remote(1, 0, dims, host, port)
        assert not ray.wait([alone], timeout=1.0)[0]
        ray.get(actors[0].abort.remote(1))
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(alone, timeout=10)
        assert isinstance(e.value.cause, StaleGenerationError)
        # Alone in generation 2: the wait times out (rendezvous_timeout_s) ...
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(actors[0].join.remote(2, 0, dims, host, port), timeout=30)
        assert isinstance(e.value.cause, TimeoutError)
        # ... and generation 3 forms with both, on fresh or clean clients.
        phases = ray.get([a.join.remote(3, r, dims, host, port) for r, a in enumerate(actors)], timeout=60)
        assert all("rendezvous_s" in p for p in phases), phases
    finally:
        for a in actors:
            ray.kill(a)
