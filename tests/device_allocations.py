"""What flextensor holds on its device, as a GPU's allocator would count it, on the CPU stand-in.

Every arena and resident storage comes from ``slots.allocate_device_bytes``; :class:`DeviceAllocations`
makes each one a buffer whose life it follows by weak reference, so a local variable, a view or a
reference cycle that keeps an old arena alive keeps it counted (the CPU's own counters read 0). The peak
is sampled at every allocation: what was live when a new one was made.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from flextensor.store import device_store as slots


class _Buffer(bytearray):
    """A bytearray that takes weak references: the storage of the tensor made over it keeps it alive."""


class DeviceAllocations:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._live: list[tuple[weakref.ref[_Buffer], int]] = []
        self.peak = 0
        monkeypatch.setattr(slots, "allocate_device_bytes", self._allocate)

    def live_bytes(self) -> int:
        self._live = [(ref, n) for ref, n in self._live if ref() is not None]
        return sum(n for _, n in self._live)

    def reset_peak(self) -> None:
        self.peak = self.live_bytes()

    def _allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        buffer = _Buffer(nbytes)
        self._live.append((weakref.ref(buffer), nbytes))
        self.peak = max(self.peak, self.live_bytes())
        return torch.frombuffer(buffer, dtype=torch.uint8)
