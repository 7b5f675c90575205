"""Copying a unit's weights into its range of the arena, and whether they are there (see [Note: static
arena aliasing] and [Note: occupancy cells] in store/device_store.py and plan/layout.py): the steps every
streamed load takes, on the hot path and off it."""

from __future__ import annotations

from flextensor.store.units import Unit

__all__ = ["copy_into_range", "holds_weights", "wait_for_decodes"]


def holds_weights(unit: Unit, owner: list[Unit | None]) -> bool:
    """Whether ``unit``'s arena range holds its weights (or their copy is in flight): it occupies every
    cell of its range."""
    for cell in unit.cells:  # noqa: SIM110 (a loop, not all(): this runs per unit per forward)
        if owner[cell] is not unit:
            return False
    return True


def copy_into_range(unit: Unit, owner: list[Unit | None], copy_stream: object) -> None:
    """Issue the copy of ``unit``'s pack into its arena range; the copy stream must be current.

    The cells are emptied before the bytes change and claimed only once the copy and its event are
    issued: an interrupt (Ctrl-C) anywhere in between leaves them unowned, so every unit there loads again
    rather than compute with bytes that are not its own.
    """
    cells = unit.cells
    wait_for_decodes(unit, owner, copy_stream)
    for cell in cells:
        owner[cell] = None
    if unit.pack.coded:  # type: ignore[union-attr]  # compressed: copied, then decoded (host/coded_packs.py)
        unit.pack.loads.load(unit, copy_stream)  # type: ignore[union-attr]  # records copy_done itself
        for cell in cells:
            owner[cell] = unit
        return
    if unit.staging is None:
        unit.storage.copy_(unit.pack.buffer, non_blocking=True)  # type: ignore[union-attr]
    elif unit.pack.disk:  # type: ignore[union-attr]  # read from the checkpoint (see host/disk.py)
        unit.pack.copy_through(unit.staging, unit.storage, copy_stream)  # type: ignore[union-attr]
    else:  # a pageable pack under the host budget (see [Note: staging ring] in host/staging.py)
        unit.staging.copy_from_host(unit.storage, unit.pack.buffer, copy_stream)  # type: ignore[union-attr]
    unit.copy_done.record(copy_stream)
    for cell in cells:
        owner[cell] = unit


def wait_for_decodes(unit: Unit, owner: list[Unit | None], copy_stream: object) -> None:
    """Before ``unit``'s load writes its range: a compressed unit whose bytes are there was decoded on the
    decode stream (see [Note: coded packs] in host/coded_packs.py), unordered with the copy stream; wait for
    that unit's decode (its own event: in the planned order it ran before this load was issued, so the
    wait costs nothing, whereas waiting for every decode would idle the link during each). One look per
    cell, no wait when nothing there is compressed."""
    previous = None
    for cell in unit.cells:
        occupant = owner[cell]
        if occupant is None or occupant is unit or occupant is previous:
            continue
        previous = occupant
        pack = occupant.pack
        if pack is not None and pack.coded:
            loads = pack.loads  # type: ignore[attr-defined]
            if loads is not None:
                loads.wait_decoded(copy_stream, occupant)
