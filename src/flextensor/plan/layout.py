"""Where each streamed unit lives in the device arena, when its copy may start, and which bytes it shares.

Pure: no torch, no CUDA. The engine lays units out with this; the simulator and the planner predict with
it. Keeping the index arithmetic in these table-tested functions is the point.

[Note: ring layout]
Streamed units get fixed byte ranges in one device arena, placed in execution order like a ring buffer:
a unit goes right after the previous one, or back to offset 0 when it would run past the arena's end
(a *lap* is a run of units between two wraps). Because the ranges are fixed, a unit's parameters can
alias its range for good, and loading a unit is a single copy of its packed host buffer. Two units whose
ranges overlap *conflict*: one may be copied in only after the compute that read the other has been
issued (and the copy stream waits for that compute on the device). ``ready_after[k]`` is the position
whose compute must be issued before the unit at position ``k`` may be copied: the nearest conflicting
position before ``k``, cyclically; the copy is issued in that position's post-hook. When it comes later
in the order than ``k``, the copy is for the next forward (a cross-step prefetch). ``None``: ``k``
conflicts with nothing, is loaded once and stays.

[Note: occupancy cells]
Which unit's bytes an arena range holds is tracked per *cell*: the arena cut at every unit's first and
last byte, so each unit covers whole cells and units that overlap share at least one. A unit holds its
weights while it is the occupant of all its cells; a copy makes it the occupant of its own, which at once
evicts every unit it overlaps without visiting them. Units of one lap share no cell, so a unit covers one
cell plus one per boundary of another lap inside its range: with equal sizes, one cell each.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from flextensor.common.sizes import align_up
from flextensor.errors import PlanError

__all__ = [
    "UNIT_ALIGNMENT",
    "RingLayout",
    "minimal_arena_bytes",
    "occupancy_cells",
    "provisional_arena_bytes",
    "ring_layout",
]

UNIT_ALIGNMENT = 4096
"""Byte alignment of each unit's range in the arena (page size: keeps every parameter view aligned for any
kernel, and costs under 4 KiB per unit)."""


@dataclass(frozen=True)
class RingLayout:
    """Static placement of streamed units in a device arena of ``arena_bytes`` (see [Note: ring layout]).

    ``order``: the streamed units in execution order (each once); ``sizes`` their bytes. ``offsets[k]``:
    position ``k``'s first byte in the arena. ``ready_after[k]``: the position after whose compute the
    copy for ``k`` may be issued, None when ``k`` conflicts with nothing. ``prefetch_after[j]``: the
    inverse, the positions whose copies position ``j``'s post-hook issues, nearest first.
    """

    order: tuple[str, ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    arena_bytes: int
    ready_after: tuple[int | None, ...]
    prefetch_after: tuple[tuple[int, ...], ...]


def minimal_arena_bytes(sizes: Sequence[int]) -> int:
    """The smallest arena that can hold the largest unit."""
    return max((align_up(s, UNIT_ALIGNMENT) for s in sizes), default=0)


def provisional_arena_bytes(sizes: Sequence[int]) -> int:
    """Arena while learning: room for the two largest units (or all of them, if that is less)."""
    return min(2 * minimal_arena_bytes(sizes), sum(align_up(s, UNIT_ALIGNMENT) for s in sizes))


def ring_layout(order: Sequence[str], sizes: Sequence[int], arena_bytes: int) -> RingLayout:
    """Place ``order`` (streamed units, execution order) with ``sizes`` bytes into ``arena_bytes``.

    O(units x log units) for typical layouts. Raises PlanError when a unit does not fit the arena at all.
    """
    if len(order) != len(sizes):
        raise PlanError(f"order has {len(order)} units but sizes has {len(sizes)}")
    if len(set(order)) != len(order):
        raise PlanError("each unit may appear once in a ring layout's order")
    padded = [align_up(s, UNIT_ALIGNMENT) for s in sizes]
    if padded and max(padded) > arena_bytes:
        big = max(range(len(padded)), key=lambda i: padded[i])
        raise PlanError(
            f"unit {order[big]!r} needs {padded[big]} bytes but the arena has {arena_bytes}; "
            "the arena must hold the largest streamed unit"
        )
    offsets, laps = _place(padded, arena_bytes)
    ready_after = _ready_after(padded, offsets, laps)
    return RingLayout(
        order=tuple(order),
        sizes=tuple(sizes),
        offsets=tuple(offsets),
        arena_bytes=arena_bytes,
        ready_after=ready_after,
        prefetch_after=prefetch_lists(ready_after),
    )


def ready_after_for(sizes: Sequence[int], arena_bytes: int) -> tuple[int | None, ...]:
    """``ring_layout(...).ready_after`` for these sizes, without names or checks: the planner's inner loop."""
    padded = [align_up(s, UNIT_ALIGNMENT) for s in sizes]
    offsets, laps = _place(padded, arena_bytes)
    return _ready_after(padded, offsets, laps)


def _place(padded: Sequence[int], arena_bytes: int) -> tuple[list[int], list[list[int]]]:
    """Offsets in execution order, and the positions of each lap."""
    offsets = [0] * len(padded)
    laps: list[list[int]] = []
    cursor = 0
    for k, size in enumerate(padded):
        if not laps or cursor + size > arena_bytes:
            cursor = 0
            laps.append([])
        offsets[k] = cursor
        laps[-1].append(k)
        cursor += size
    return offsets, laps


def _ready_after(
    padded: Sequence[int], offsets: Sequence[int], laps: Sequence[Sequence[int]]
) -> tuple[int | None, ...]:
    """Per position, the nearest conflicting position before it, cyclically (see [Note: ring layout]).

    Units of one lap never overlap, and within a lap both offsets and ends increase: the last unit of a
    lap starting before a range's end is found by bisection, and it overlaps the range iff it ends after
    the range's start. Scanning laps backward from the unit's own finds the nearest conflict, which is
    almost always in the lap just before.
    """
    lap_offsets = [[offsets[k] for k in lap] for lap in laps]
    lap_of = [0] * len(padded)
    for index, lap in enumerate(laps):
        for k in lap:
            lap_of[k] = index
    count = len(laps)
    ready: list[int | None] = [None] * len(padded)
    for k, size in enumerate(padded):
        lo, hi = offsets[k], offsets[k] + size
        own = lap_of[k]
        for back in range(1, count):
            other = (own - back) % count
            idx = bisect.bisect_left(lap_offsets[other], hi) - 1
            if idx >= 0:
                j = laps[other][idx]
                if offsets[j] + padded[j] > lo:
                    ready[k] = j
                    break
    return tuple(ready)


def prefetch_lists(ready_after: Sequence[int | None]) -> tuple[tuple[int, ...], ...]:
    """For each position, the positions whose copies its post-hook issues, nearest first."""
    n = len(ready_after)
    lists: list[list[int]] = [[] for _ in range(n)]
    for k, j in enumerate(ready_after):
        if j is not None:
            lists[j].append(k)
    for j in range(n):
        if len(lists[j]) > 1:
            lists[j].sort(key=lambda k, j=j: (k - j) % n)
    return tuple(tuple(p) for p in lists)


def occupancy_cells(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """The cells (see [Note: occupancy cells]) each ``(offset, length)`` range covers, as cell indices.

    Two ranges share a cell exactly when they overlap. O(ranges x log ranges + cells covered).
    """
    bounds = sorted({b for offset, length in ranges for b in (offset, offset + length)})
    cells = []
    for offset, length in ranges:
        if length <= 0:
            cells.append(())
            continue
        first = bisect.bisect_left(bounds, offset)
        last = bisect.bisect_left(bounds, offset + length)
        cells.append(tuple(range(first, last)))
    return tuple(cells)
