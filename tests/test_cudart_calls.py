"""The direct runtime calls of the steady hot path (device/cudart.py): finding PyTorch's CUDA runtime among
the mapped files, the CPU stand-in, and on a CUDA device copies, records and waits on PyTorch's handles."""

from __future__ import annotations

import pytest
import torch

from flextensor.device.cudart import CudartCalls, loaded_cudart_path
from flextensor.device.runtime import HostCalls, HostEvent
from flextensor.errors import DeviceError

MAPS = """\
7f00a000-7f00b000 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6
7f00c000-7f00d000 rw-p 00000000 00:00 0
7f00e000-7f00f000 r-xp 00000000 08:01 456 /venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f010000-7f011000 r--p 00000000 08:01 789 /opt/path with spaces/libcudart.so.12
"""

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU machine)")


def test_the_runtime_torch_loaded_is_found_in_the_mapped_files() -> None:
    cu13 = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
    assert loaded_cudart_path(MAPS, "13.0") == cu13
    assert loaded_cudart_path(MAPS, "12.8") == "/opt/path with spaces/libcudart.so.12"
    assert loaded_cudart_path(MAPS, "11.8") is None  # neither is torch's runtime
    assert loaded_cudart_path(MAPS.splitlines()[3], "13.0") is None
    assert loaded_cudart_path(MAPS.splitlines()[3], "") == "/opt/path with spaces/libcudart.so.12"  # unknown
    assert loaded_cudart_path(MAPS.splitlines()[0] + "\n" + MAPS.splitlines()[1], "13.0") is None
    assert loaded_cudart_path("", "13.0") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU build maps no CUDA runtime")
def test_without_a_cuda_runtime_there_are_no_direct_calls() -> None:
    assert CudartCalls.load() is None


def test_the_cpu_stand_in_copies_and_records() -> None:
    source = torch.arange(64, dtype=torch.uint8)
    destination = torch.zeros(64, dtype=torch.uint8)
    calls, event = HostCalls(), HostEvent()
    calls.copy_to_device(destination.data_ptr(), source.data_ptr(), 64, 0)
    calls.record(event, 0, None)
    calls.wait(0, event)
    assert torch.equal(destination, source)
    assert event.elapsed_time(event) == 0.0


@pytest.mark.gpu
@cuda_only
def test_copies_records_and_waits_on_torch_handles() -> None:
    calls = CudartCalls.load()
    assert calls is not None
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    source = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8).pin_memory()
    destination = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    copied, never_recorded = torch.cuda.Event(), torch.cuda.Event()
    calls.wait(side.cuda_stream, never_recorded)  # no handle yet: no wait, as torch
    calls.copy_to_device(destination.data_ptr(), source.data_ptr(), source.numel(), side.cuda_stream)
    calls.record(copied, side.cuda_stream, side)  # first record: through torch, which creates the event
    calls.record(copied, side.cuda_stream, side)  # then straight into the runtime
    calls.wait(main.cuda_stream, copied)
    assert torch.equal(destination.clone().cpu(), source)  # clone: on the main stream, after the wait
    with pytest.raises(DeviceError, match="cudaMemcpyAsync failed with CUDA error"):
        calls.copy_to_device(0, source.data_ptr(), source.numel(), side.cuda_stream)
    torch.ones(4, device="cuda").add_(1)  # the failure was reported once: torch's next launch succeeds
    torch.cuda.synchronize()
