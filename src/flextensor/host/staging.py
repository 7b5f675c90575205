"""The staging ring: a few pinned host slots through which bytes that are not page-locked reach the device.

[Note: staging ring]
A copy from pageable host memory cannot be asynchronous: CUDA first copies it into a driver buffer of
its own, holding the host thread for the whole copy. Under a host budget (see store/host_budget.py) the packs
that do not fit are pageable, so their copies go through this ring instead: the unit's bytes are cut into
slot-sized chunks; for each, the host waits until the slot's previous device copy is done (an event of
that slot only, never the device), writes the chunk into the slot, and issues the slot -> device copy on
the copy stream, behind the same event waits as any copy. The device copies stay asynchronous and ordered
like every other copy; the host pays the memcpy into the slot and waits only when it runs more than a
ring ahead of the copies, which the ring's size (two of the largest units, up to STAGING_RING_MAX) makes
rare.

What fills a slot is a callable (``fill(slot, offset)``): a pageable pack's bytes today, a disk read
into the same slot for a disk tier. On a CPU device the ring runs the same way (copies are synchronous
memcpy there and nothing is page-locked), which is how CI tests the staged path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flextensor.common.sizes import align_up, format_bytes
from flextensor.device.runtime import DeviceRuntime
from flextensor.host.packs import PAGE, UnitPack

__all__ = ["STAGING_RING_MAX", "STAGING_SLOTS", "StagingRing", "staging_layout"]

STAGING_SLOTS = 4
"""Slots in the ring: with four, the host fills one slot while the device copies out of the others, so
the memcpy into the ring and the device copy overlap; more buys little, fewer serialises them."""

STAGING_RING_MAX = 64 * 2**20
"""The ring's largest size: copies of 16 MiB slots already run at the link's full speed, and the ring
counts against the host budget, which under WSL2 is a few hundred MiB."""


def staging_layout(largest_unit: int) -> tuple[int, int]:
    """(slot bytes, slots) of the ring for units of at most ``largest_unit`` bytes: two such units (so the
    host can run a unit ahead of the copies), at most STAGING_RING_MAX, in page-aligned slots."""
    ring = min(STAGING_RING_MAX, 2 * max(largest_unit, 1))
    slot = align_up(-(-ring // STAGING_SLOTS), PAGE)
    return slot, STAGING_SLOTS


class StagingRing:
    """Pinned slots and, per slot, the event of the last device copy out of it (see [Note: staging ring])."""

    def __init__(self, slot_bytes: int, slots: int, runtime: DeviceRuntime, pin: bool) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.runtime = runtime
        # One exact-size page-locked mapping, the same kind a unit's pack is (see host/packs.py).
        self._memory = UnitPack("staging ring", (), slot_bytes * slots, pin)
        buffer = self._memory.buffer
        self._slot = [buffer[k * slot_bytes : (k + 1) * slot_bytes] for k in range(slots)]
        self._drained = [runtime.event() for _ in range(slots)]  # recorded after each copy out of the slot
        self._in_use = [False] * slots  # whether the slot's event guards a copy (unrecorded: none)
        self._next = 0
        self.copies = 0  # copies staged since offload(): a unit's, or a piece of a compressed unit's
        self.staged_bytes = 0

    @property
    def nbytes(self) -> int:
        """Host bytes the ring holds (page-locked on CUDA)."""
        return self.slot_bytes * self.slots

    @property
    def pinned(self) -> bool:
        return self._memory.pinned

    @property
    def buffer(self) -> torch.Tensor:
        """The ring's memory as one uint8 tensor (the link probe copies out of it)."""
        return self._memory.buffer

    def copy(self, destination: torch.Tensor, fill: Callable[[torch.Tensor, int], None], stream: Any) -> None:
        """Copy ``destination.numel()`` bytes to ``destination`` (a uint8 device range) through the ring,
        on ``stream``, which must be current. ``fill(slot, offset)`` writes the bytes at ``offset`` of the
        source into ``slot`` (a uint8 host tensor of the chunk's length)."""
        total = destination.numel()
        offset = 0
        while offset < total:
            count = min(self.slot_bytes, total - offset)
            k = self._next
            self._next = (k + 1) % self.slots
            if self._in_use[k]:
                self._drained[k].synchronize()  # this slot's last copy only: the host runs a ring ahead
            slot = self._slot[k][:count]
            fill(slot, offset)
            destination[offset : offset + count].copy_(slot, non_blocking=True)
            # An interrupt before the record leaves the event guarding the slot's earlier copy: the slot may
            # then be refilled under this copy, whose unit's range is unowned already and loads again.
            self._in_use[k] = True
            self._drained[k].record(stream)
            offset += count
        self.copies += 1
        self.staged_bytes += total

    def copy_from_host(self, destination: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
        """Copy the pageable uint8 host tensor ``source`` into ``destination`` through the ring."""

        def fill(slot: torch.Tensor, offset: int) -> None:
            slot.copy_(source[offset : offset + slot.numel()])

        self.copy(destination, fill, stream)

    def drain(self) -> None:
        """Wait for every copy out of the ring (plan time: before its memory or a destination is freed)."""
        for k in range(self.slots):
            if self._in_use[k]:
                self._drained[k].synchronize()

    def free(self) -> None:
        self.drain()
        self._slot = []
        self._memory.free()

    def __repr__(self) -> str:
        return (
            f"StagingRing({self.slots} slots of {format_bytes(self.slot_bytes)}, "
            f"pinned={self.pinned}, {self.copies} copies staged)"
        )
