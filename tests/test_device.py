"""Tests for flextensor.device.runtime: resolving pinning and budget once, and the CPU stand-ins (what the
device itself means: tests/test_config.py)."""

from __future__ import annotations

import pytest
import torch

from flextensor.config.schema import OffloadConfig
from flextensor.device.runtime import HostEvent, HostStream, resolve_budget, resolve_pinning
from flextensor.errors import ConfigError, PlanError

GiB = 2**30


# ----------------------------------------------------------------------------------------------------------
# Resolution
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pinned", "device", "expected"),
    [
        (None, "cuda:0", True),
        (None, "cpu", False),
        (True, "cuda:0", True),
        (False, "cuda:0", False),
        (True, "cpu", False),
        (False, "cpu", False),
    ],
)
def test_resolve_pinned_memory(pinned: bool | None, device: str, expected: bool) -> None:
    assert resolve_pinning(pinned, torch.device(device)) is expected


def test_resolve_budget_bytes() -> None:
    assert resolve_budget(OffloadConfig(), 80 * GiB) is None
    assert resolve_budget(OffloadConfig(), None) is None
    assert resolve_budget(OffloadConfig(gpu_memory_budget="8GiB"), 80 * GiB) == 8 * GiB
    assert resolve_budget(OffloadConfig(gpu_memory_budget="8GiB"), None) == 8 * GiB
    assert resolve_budget(OffloadConfig(max_gpu_mem_fraction=0.25), 80 * GiB) == 20 * GiB
    assert resolve_budget(OffloadConfig(max_gpu_mem_fraction=0.3), 1003) == 300  # 300.9, rounded down


@pytest.mark.parametrize("total", [None, 0, -1])
def test_resolve_budget_bytes_fraction_needs_total(total: int | None) -> None:
    with pytest.raises(ConfigError, match=r"max_gpu_mem_fraction.*total memory"):
        resolve_budget(OffloadConfig(max_gpu_mem_fraction=0.5), total)


def test_host_event_measures_the_host_clock_in_milliseconds() -> None:
    start, end = HostEvent(), HostEvent()
    start.record()
    end.record()
    assert end.query() and 0.0 <= start.elapsed_time(end) < 1000.0
    start.synchronize()  # no-ops that stand in for CUDA's
    start.wait()


def test_host_event_needs_both_ends_recorded() -> None:
    with pytest.raises(PlanError, match="recorded"):
        HostEvent().elapsed_time(HostEvent())


def test_host_stream_orders_nothing_because_cpu_work_is_synchronous() -> None:
    stream = HostStream()
    assert stream.wait_event(HostEvent()) is None
    assert stream.wait_stream(stream) is None
    assert repr(stream) == "HostStream()"
