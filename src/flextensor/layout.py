"""Where each streamed unit lives in the device arena, and when its copy may start.

Pure: no torch, no CUDA. The engine applies this layout; the simulator predicts with it. Keeping the index
arithmetic in one table-tested function is the point (see [Note: static arena aliasing] in engine.py).

[Note: ring layout]
Streamed units get fixed byte ranges in one device arena, placed in execution order like a ring buffer:
a unit goes right after the previous one, or back to offset 0 when it would run past the arena's end.
Because the ranges are fixed, a unit's parameters can alias its range for good, and loading a unit is a
single copy of its packed host buffer. Two units whose ranges overlap *conflict*: one may be copied in only
after the compute that read the other has been issued (and the copy stream waits for that compute on the
device). ``ready_after[k]`` is the position whose compute must be issued before the unit at position ``k``
may be copied; the copy is issued in that position's post-hook. Positions are cyclic: the first units of
the next forward are prefetched during the tail of this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

UNIT_ALIGNMENT = 4096
"""Byte alignment of each unit's range in the arena (page size: keeps every parameter view aligned for any
kernel, and costs under 4 KiB per unit)."""


def align_up(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class RingLayout:
    """Static placement of streamed units in a device arena of ``arena_bytes``.

    ``order`` holds the streamed units in execution order (each once). ``offsets[u]`` is the unit's first
    byte in the arena. ``conflicts[u]`` lists the units whose ranges overlap ``u``'s. ``ready_after[k]`` is
    the position (index into ``order``) after whose compute the copy for position ``k`` may be issued, or
    ``None`` when the unit conflicts with nothing (it is loaded once and stays). ``prefetch_after[j]`` is
    the inverse: the positions to copy in after position ``j``'s compute, nearest first.
    """

    order: tuple[str, ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    arena_bytes: int
    conflicts: tuple[tuple[int, ...], ...]
    ready_after: tuple[int | None, ...]
    prefetch_after: tuple[tuple[int, ...], ...]

    def position(self, unit: str) -> int:
        return self.order.index(unit)


def minimal_arena_bytes(sizes: Sequence[int]) -> int:
    """The smallest arena that can hold the largest unit."""
    return max((align_up(s, UNIT_ALIGNMENT) for s in sizes), default=0)


def ring_layout(order: Sequence[str], sizes: Sequence[int], arena_bytes: int) -> RingLayout:
    """Place ``order`` (streamed units, execution order) with ``sizes`` bytes into ``arena_bytes``.

    Raises ValueError when a unit does not fit the arena at all.
    """
    if len(order) != len(sizes):
        raise ValueError(f"order has {len(order)} units but sizes has {len(sizes)}")
    if len(set(order)) != len(order):
        raise ValueError("each unit may appear once in a ring layout's order")
    n = len(order)
    padded = [align_up(s, UNIT_ALIGNMENT) for s in sizes]
    if n and max(padded) > arena_bytes:
        big = max(range(n), key=lambda i: padded[i])
        raise ValueError(
            f"unit {order[big]!r} needs {padded[big]} bytes but the arena has {arena_bytes}; "
            "the arena must hold the largest streamed unit"
        )
    offsets: list[int] = []
    cursor = 0
    for size in padded:
        if cursor + size > arena_bytes:
            cursor = 0
        offsets.append(cursor)
        cursor += size

    conflicts = tuple(
        tuple(
            j
            for j in range(n)
            if j != k and offsets[j] < offsets[k] + padded[k] and offsets[k] < offsets[j] + padded[j]
        )
        for k in range(n)
    )
    ready_after: list[int | None] = []
    for k in range(n):
        # The conflicting position closest before k, cyclically: the last reader of this range.
        best: int | None = None
        for distance in range(1, n):
            j = (k - distance) % n
            if j in conflicts[k]:
                best = j
                break
        ready_after.append(best)
    prefetch: list[list[int]] = [[] for _ in range(n)]
    for k in range(n):
        j = ready_after[k]
        if j is not None:
            prefetch[j].append(k)
    for j in range(n):
        prefetch[j].sort(key=lambda k, j=j: (k - j) % n)
    return RingLayout(
        order=tuple(order),
        sizes=tuple(sizes),
        offsets=tuple(offsets),
        arena_bytes=arena_bytes,
        conflicts=conflicts,
        ready_after=tuple(ready_after),
        prefetch_after=tuple(tuple(p) for p in prefetch),
    )
