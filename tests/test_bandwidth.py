"""The link probe run by offload(): the sizes it copies and the model it returns, on the CPU runtime."""

from __future__ import annotations

import torch

from flextensor.device import link as bandwidth
from flextensor.device.link import PROBE_MIN_BYTES, probe_link, probe_sizes
from flextensor.device.runtime import DeviceRuntime

MiB = 2**20


def test_probe_sizes_are_the_largest_unit_and_quarters_down_to_a_mib() -> None:
    assert probe_sizes(64 * MiB) == (MiB, 4 * MiB, 16 * MiB, 64 * MiB)
    assert probe_sizes(1024 * MiB) == (16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB)  # four points at most
    assert probe_sizes(PROBE_MIN_BYTES // 2) == (PROBE_MIN_BYTES // 2,)  # a small unit: just itself


def test_probe_link_measures_positive_speeds_at_those_sizes_and_caches_them() -> None:
    bandwidth._cache.clear()
    runtime = DeviceRuntime(torch.device("cpu"))
    source, destination = torch.zeros(4 * MiB, dtype=torch.uint8), torch.empty(4 * MiB, dtype=torch.uint8)
    link = probe_link(runtime, source, destination)
    assert [size for size, _ in link.points] == list(probe_sizes(4 * MiB))
    assert all(speed > 0 for _, speed in link.points)
    assert probe_link(runtime, source, destination) is link  # once per device and sizes
    bandwidth._cache.clear()
