"""A health probe of the device an actor runs on: may a rank be placed there again?

A rank that crashed or hung may have done so because of its GPU (an Xid error, a row of HBM
gone bad). Its device is quarantined (`ActorGroup.quarantine`) until an actor on it passes
this probe: memory is allocated, a small matmul runs and is compared with the same matmul on
the host, and on NVIDIA GPUs the driver's error state is read through NVML (`nvidia-ml-py`)
for the physical GPU the actor was given, found by its PCI bus id (pending retired pages or
row remaps, volatile uncorrected ECC errors). On CPU only the matmul runs. And
`wait_for_exit`: a replacement placed on the GPU of a rank killed a moment ago waits until
that process has exited and freed its memory.
"""
from __future__ import annotations

import time

import torch

from ftrain.state.host_memory import process_gone

N = 256  # matmul size: milliseconds on any device, big enough to touch a few MB


def probe_device(device: torch.device) -> str | None:
    """Probe `device` (cpu or cuda); returns None when it is healthy, else the reason in one
    line. Never raises for a device fault: the error is the reason."""
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(N, N, generator=gen, dtype=torch.float32)
        expected = a @ a
        on_device = a.to(device)
        got = (on_device @ on_device).cpu()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if not torch.allclose(got, expected, rtol=1e-3, atol=1e-3):
            return f"matmul on {device} differs from the host's by {(got - expected).abs().max().item():.3g}"
    except RuntimeError as e:  # CUDA errors (torch.AcceleratorError) are RuntimeErrors
        return f"{device}: {str(e).splitlines()[0][:200]}"
    return _nvml_errors(device) if device.type == "cuda" else None


def _nvml_errors(device: torch.device) -> str | None:
    """The NVIDIA driver's error state of `device` (None: none, or NVML unavailable)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id(index))
        problems = []
        try:
            if pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                problems.append("retired pages pending")
        except pynvml.NVMLError:
            pass
        try:
            remap = pynvml.nvmlDeviceGetRemappedRows(handle)  # (corr, unc, pending, failure)
            if remap[2] or remap[3]:
                problems.append("row remap pending or failed")
        except pynvml.NVMLError:
            pass
        try:
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     pynvml.NVML_VOLATILE_ECC)
            if ecc:
                problems.append(f"{ecc} uncorrected ECC error(s) since the driver loaded")
        except pynvml.NVMLError:
            pass
        return f"GPU {index}: " + ", ".join(problems) if problems else None
    except pynvml.NVMLError:  # no NVML here (a driver without it): nothing more to read
        return None


def pci_bus_id(index: int) -> str:
    """The PCI bus id of torch's CUDA device `index`, as NVML writes it ("00000000:DC:00.0"):
    the physical GPU. NVML numbers GPUs physically and ignores CUDA_VISIBLE_DEVICES, which Ray
    sets per actor (its CUDA device 0 may be physical GPU 3), so NVML is asked by this id, not
    by the index."""
    p = torch.cuda.get_device_properties(index)
    return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"


def wait_for_exit(pids: list[int], timeout_s: float, poll_s: float = 0.05) -> float:
    """Wait until each process of `pids` (on this node) has exited: gone, or a zombie (its
    memory, GPU memory included, is freed; only its exit status is left), at most `timeout_s`
    seconds. Returns the seconds waited. Why: a rank SIGKILLed on a GPU frees its memory (tens
    of GB) only as its exit completes, which takes seconds; a replacement on that GPU that
    trains before would fail with CUDA out of memory (`host_memory.process_gone`: where /proc
    is missing, not Linux, nothing is waited for)."""
    t0 = time.monotonic()
    while not all(map(process_gone, pids)) and time.monotonic() - t0 < timeout_s:
        time.sleep(poll_s)
    return time.monotonic() - t0

