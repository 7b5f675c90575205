"""Host-to-device copy speed, probed at the sizes the model's units will actually be copied at.

Run once at ``offload()`` time and cached per device for the process: a few copies of a unit's own
pinned pack into the device arena, timed with device events (about 0.1 s on a PCIe Gen5 link).
"""

from __future__ import annotations

import statistics

import torch

from flextensor.device.runtime import DeviceRuntime
from flextensor.plan.measurements import LinkModel

PROBE_REPEATS = 3
"""Copies per size; the median discards the first copy's one-off costs."""

PROBE_MIN_BYTES = 1 << 20
"""Smallest probed size: below a MiB per-copy latency dominates and units are rarely that small."""

_cache: dict[tuple[str, tuple[int, ...]], LinkModel] = {}


def probe_sizes(largest: int) -> tuple[int, ...]:
    """The largest unit and quarters down to PROBE_MIN_BYTES: enough points to interpolate."""
    sizes = []
    size = largest
    while size >= PROBE_MIN_BYTES and len(sizes) < 4:
        sizes.append(size)
        size //= 4
    return tuple(sorted(sizes)) or (largest,)


def probe_link(runtime: DeviceRuntime, source: torch.Tensor, destination: torch.Tensor) -> LinkModel:
    """Time copies of prefixes of ``source`` (host) into ``destination`` (device, at least as large)."""
    largest = min(source.numel(), destination.numel())
    sizes = probe_sizes(largest)
    key = (f"{runtime.device}:{runtime.name()}:{source.is_pinned() if runtime.is_cuda else False}", sizes)
    if key in _cache:
        return _cache[key]
    points = []
    stream = runtime.copy_stream
    previous = runtime.current_stream()
    runtime.set_stream(stream)
    try:
        for size in sizes:
            times = []
            for _ in range(PROBE_REPEATS):
                start, end = runtime.event(timing=True), runtime.event(timing=True)
                start.record(stream)
                destination[:size].copy_(source[:size], non_blocking=True)
                end.record(stream)
                end.synchronize()
                times.append(max(start.elapsed_time(end) / 1000.0, 1e-9))
            points.append((size, size / statistics.median(times)))
    finally:
        runtime.set_stream(previous)
    link = LinkModel(points=tuple(points))
    _cache[key] = link
    return link
