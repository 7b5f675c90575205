"""The ring layout and occupancy cells against tables worked out by hand, and a brute-force oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flextensor.common.sizes import align_up
from flextensor.errors import PlanError
from flextensor.plan.layout import (
    UNIT_ALIGNMENT,
    minimal_arena_bytes,
    occupancy_cells,
    prefetch_lists,
    provisional_arena_bytes,
    ready_after_for,
    ring_layout,
)

S = UNIT_ALIGNMENT  # one slot: sizes in whole slots keep the arithmetic exact


@pytest.mark.parametrize(
    ("sizes", "arena", "offsets", "ready_after", "prefetch_after"),
    [
        # Equal sizes, two slots: units alternate, each waits for the one two before it.
        ([S, S, S, S], 2 * S, (0, S, 0, S), (2, 3, 0, 1), ((2,), (3,), (0,), (1,))),
        # Equal sizes, three slots: only the fourth wraps, onto the first; the middle two stay loaded.
        ([S, S, S, S], 3 * S, (0, S, 2 * S, 0), (3, None, None, 0), ((3,), (), (), (0,))),
        # Mixed sizes: the last, two slots wide, lies over the first's tail and the second.
        ([2 * S, S, S, 2 * S], 3 * S, (0, 2 * S, 0, S), (3, 3, 0, 1), ((2,), (3,), (), (0, 1))),
        # A unit that does not fit the room left wraps even though the lap is short.
        ([S, 2 * S, S], 2 * S, (0, 0, 0), (2, 0, 1), ((1,), (2,), (0,))),
        # Everything fits: nothing conflicts, everything is loaded once.
        ([S, S, S], 3 * S, (0, S, 2 * S), (None, None, None), ((), (), ())),
        # Sizes are padded to the alignment before placing.
        ([1, S + 1, 1], 3 * S, (0, S, 0), (2, None, 0), ((2,), (), (0,))),
    ],
)
def test_ring_layout_table(
    sizes: list[int],
    arena: int,
    offsets: tuple[int, ...],
    ready_after: tuple[int | None, ...],
    prefetch_after: tuple[tuple[int, ...], ...],
) -> None:
    names = [f"u{i}" for i in range(len(sizes))]
    layout = ring_layout(names, sizes, arena)
    assert layout.offsets == offsets
    assert layout.ready_after == ready_after
    assert layout.prefetch_after == prefetch_after
    assert ready_after_for(sizes, arena) == ready_after


def test_prefetch_lists_are_nearest_first_cyclically() -> None:
    # Position 3 is the last reader of positions 0, 1 and 2 (a big unit at the end): 0 comes first.
    assert prefetch_lists((3, 3, 3, None)) == ((), (), (), (0, 1, 2))
    assert prefetch_lists((2, 2, None)) == ((), (), (0, 1))


def test_occupancy_cells_table() -> None:
    # The mixed layout above: cells [0, S), [S, 2S), [2S, 3S).
    ranges = [(0, 2 * S), (2 * S, S), (0, S), (S, 2 * S)]
    assert occupancy_cells(ranges) == ((0, 1), (2,), (0,), (1, 2))
    assert occupancy_cells([(0, S), (S, S)]) == ((0,), (1,))  # one lap: no shared cell
    assert occupancy_cells([(0, S), (0, 0)]) == ((0,), ())


def test_minimal_and_provisional_arenas() -> None:
    assert minimal_arena_bytes([]) == 0
    assert minimal_arena_bytes([1, 3 * S]) == 3 * S
    assert provisional_arena_bytes([S, 2 * S, S]) == 4 * S  # two of the largest
    assert provisional_arena_bytes([2 * S]) == 2 * S  # or all of them, if that is less


@pytest.mark.parametrize(
    ("names", "sizes", "arena", "message"),
    [
        (["a"], [S, S], 2 * S, "order has 1 units but sizes has 2"),
        (["a", "a"], [S, S], 2 * S, "once"),
        (["a", "b"], [S, 3 * S], 2 * S, "unit 'b' needs 12288 bytes but the arena has 8192"),
    ],
)
def test_ring_layout_refuses_what_cannot_be_placed(
    names: list[str], sizes: list[int], arena: int, message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        ring_layout(names, sizes, arena)


def _brute_force_ready_after(sizes: list[int], arena: int) -> tuple[int | None, ...]:
    """The definition, pair by pair: the nearest position before ``k`` (cyclically) that overlaps it."""
    padded = [align_up(s, UNIT_ALIGNMENT) for s in sizes]
    offsets, cursor = [], 0
    for size in padded:
        if cursor + size > arena:
            cursor = 0
        offsets.append(cursor)
        cursor += size
    n = len(padded)

    def overlap(a: int, b: int) -> bool:
        return offsets[a] < offsets[b] + padded[b] and offsets[b] < offsets[a] + padded[a]

    return tuple(next((j for d in range(1, n) if overlap(j := (k - d) % n, k)), None) for k in range(n))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.integers(1, 5 * S), st.integers(1, 4).map(lambda k: k * S)), max_size=14),
    st.integers(0, 20 * S),
)
def test_ring_layout_matches_the_pairwise_definition(sizes: list[int], extra: int) -> None:
    arena = minimal_arena_bytes(sizes) + extra
    layout = ring_layout([f"u{i}" for i in range(len(sizes))], sizes, arena)
    assert layout.ready_after == _brute_force_ready_after(sizes, arena)
    # Cells: two units share one exactly when their ranges overlap.
    ranges = [(o, align_up(s, UNIT_ALIGNMENT)) for o, s in zip(layout.offsets, sizes, strict=True)]
    cells = occupancy_cells(ranges)
    for a in range(len(sizes)):
        for b in range(len(sizes)):
            (oa, la), (ob, lb) = ranges[a], ranges[b]
            overlapping = oa < ob + lb and ob < oa + la
            assert bool(set(cells[a]) & set(cells[b])) == overlapping


def test_ten_thousand_units_lay_out_in_linearithmic_time() -> None:
    # Two slots for 10,000 equal units: every unit conflicts with 4,999 others, yet the layout is quick
    # and each unit has one cell (the old pairwise scan took seconds and ~400 MB here).
    sizes = [S] * 10_000
    layout = ring_layout([f"u{i}" for i in range(len(sizes))], sizes, 2 * S)
    assert layout.ready_after[:4] == (9_998, 9_999, 0, 1)
    cells = occupancy_cells([(o, S) for o in layout.offsets])
    assert {len(c) for c in cells} == {1}
