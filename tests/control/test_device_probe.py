"""The device a replacement trains on: the processes of failed ranks on its GPU are awaited
(`device_probe.wait_for_exit`, `actor_slot.exited_on_its_gpus`) and the device is probed
(`probe_device`)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ftrain.control.actor_slot import ActorSlot, exited_on_its_gpus
from ftrain.control.device_probe import probe_device, wait_for_exit


def _sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_a_replacement_waits_for_the_failed_process_to_exit_and_no_longer():
    p = _sleeper(1.0)
    try:
        assert 0.5 < wait_for_exit([p.pid], timeout_s=30) < 20  # exited after ~1 s (a zombie until reaped)
    finally:
        p.kill()
        p.wait()
    assert wait_for_exit([p.pid], timeout_s=30) < 0.5  # gone (reaped): no wait


def test_a_killed_process_not_yet_reaped_has_freed_its_memory():
    p = _sleeper(60)
    try:
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # a zombie, unreaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert wait_for_exit([p.pid], timeout_s=30) < 0.5
    finally:
        p.wait()


def test_a_process_that_does_not_exit_is_waited_for_at_most_the_timeout():
    p = _sleeper(60)
    try:
        assert 0.3 <= wait_for_exit([p.pid, os.getpid() + 10**7], timeout_s=0.3) < 5
    finally:
        p.kill()
        p.wait()


def test_only_failed_ranks_on_the_members_gpus_are_awaited():
    member = ActorSlot(None, "10.0.0.1", "nodeA", [1], 1, pid=11)
    exited = [ActorSlot(None, "10.0.0.1", "nodeA", [1], 0, pid=21),   # its GPU: awaited
              ActorSlot(None, "10.0.0.1", "nodeA", [2], 2, pid=22),   # another GPU of its node
              ActorSlot(None, "10.0.0.2", "nodeB", [1], 3, pid=23),   # GPU 1 of another node
              ActorSlot(None, "10.0.0.1", "nodeA", [1], 4)]           # pid unknown (a reattached slot)
    assert exited_on_its_gpus(member, exited) == [21]
    cpu = ActorSlot(None, "10.0.0.1", "nodeA", [], 5, pid=31)
    assert exited_on_its_gpus(cpu, [ActorSlot(None, "10.0.0.1", "nodeA", [], 6, pid=32)]) == []  # CPU: none


def test_a_healthy_cpu_passes_the_probe():
    assert probe_device(torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvml_reads_the_physical_gpu_torch_runs_on():
    """NVML ignores CUDA_VISIBLE_DEVICES: the probe finds torch's device 0 by its PCI bus id, and
    that handle is the same GPU (its UUID) as torch's."""
    import pynvml

    from ftrain.control.device_probe import pci_bus_id

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id(0))
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    assert str(torch.cuda.get_device_properties(0).uuid) in (uuid.decode() if isinstance(uuid, bytes) else uuid)
    assert probe_device(torch.device("cuda", 0)) is None
