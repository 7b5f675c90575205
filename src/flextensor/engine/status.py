"""``flextensor.status(model)``: a read-only snapshot of an offloaded model's state.

What a person (or a test) may ask of the engine without reaching into it: the phase, each unit's
placement and bytes, the plan in force and every plan cached per input signature, and how often the
store moved weights. Building one costs a pass over the units; the forwards pay nothing for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flextensor.errors import SelectionError
from flextensor.plan.plan import Plan

if TYPE_CHECKING:
    from flextensor.engine.controller import OffloadEngine

__all__ = ["OffloadStatus", "UnitStatus", "status_of"]


@dataclass(frozen=True)
class UnitStatus:
    """One offload unit: ``placement`` is ``"host"``, ``"streamed"``, ``"resident"`` or ``"device_only"``
    (resident with no host copy); ``host_bytes`` the host memory its pack holds (0 without one);
    ``pinned`` / ``shared`` describe that pack; ``uploads`` / ``pack_rebuilds`` count how often it was
    given resident storage and had its pack built again from it. ``staged``: its copies go through the
    staging ring (its pack did not fit the host budget; see docs/host-memory.md). ``on_disk``: it has no
    host pack, its copies read the checkpoint file (the disk tier; see docs/host-memory.md).
    ``compressed``: its pack is held compressed (``compression="lossless"``; see docs/compression.md).
    ``mapped``: when resident, the device reads its pinned pack in place and it holds no device memory
    (``map_embeddings``; see docs/pipelines.md)."""

    name: str
    nbytes: int
    placement: str
    host_bytes: int
    pinned: bool
    shared: bool
    uploads: int
    pack_rebuilds: int
    staged: bool = False
    on_disk: bool = False
    compressed: bool = False
    mapped: bool = False


@dataclass(frozen=True)
class OffloadStatus:
    """A snapshot of one offloaded model (see the module docstring).

    ``units``: in execution order once discovered. ``plans``: every plan made so far, keyed by the
    bucketed input signature it serves (see ``flextensor.hooks.functions.input_signature``); ``plan`` the
    one in force (None while learning). ``forward_running``: a forward is in progress on some thread.
    ``uploads``: resident units copied to the device; ``pack_rebuilds``: host packs built again from
    device storage; ``layouts``: device layouts made (plans applied, profiling layouts).
    ``host_pinned_bytes``: host bytes page-locked for the weights (pinned packs and the staging ring; 0 on
    a CPU); ``staging_bytes``: the staging ring's bytes (0 without one); ``host_budget_bytes``: the host
    budget in force (None: none); ``direct_bytes``: bytes of the packs copied straight to the device (on
    CUDA, the packs pinned); ``disk_bytes``: bytes of the units streamed from the checkpoint file, with no
    host pack (the disk tier); of their copies, ``disk_reads_ahead`` were read by the disk reader ahead of
    time and ``disk_reads_inline`` on the copying thread; ``read_ahead_bytes``: the reader's pageable
    buffers. The host budget bounds ``direct_bytes``, the ring and the read-ahead buffers together (see
    docs/host-memory.md).
    """

    model: str
    device: str
    phase: str
    forwards: int
    forward_running: bool
    units: tuple[UnitStatus, ...]
    plan: Plan | None
    plans: Mapping[tuple[str, ...], Plan]
    input_signature: tuple[str, ...] | None
    arena_bytes: int
    device_bytes_held: int
    host_bytes_held: int
    uploads: int
    pack_rebuilds: int
    layouts: int
    host_pinned_bytes: int = 0
    staging_bytes: int = 0
    host_budget_bytes: int | None = None
    direct_bytes: int = 0
    disk_bytes: int = 0
    disk_reads_ahead: int = 0
    disk_reads_inline: int = 0
    read_ahead_bytes: int = 0

    def unit(self, name: str) -> UnitStatus:
        """The status of the unit ``name`` (SelectionError if it is not an offload unit)."""
        for unit in self.units:
            if unit.name == name:
                return unit
        raise SelectionError(
            f"{name!r} is not an offload unit of this {self.model}; its units are "
            + ", ".join(repr(u.name) for u in self.units[:5])
            + (", ..." if len(self.units) > 5 else "")
        )

    @property
    def streamed(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units if u.placement == "streamed")

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units if u.placement in ("resident", "device_only"))


def status_of(engine: OffloadEngine) -> OffloadStatus:
    """The snapshot of ``engine``."""
    in_order = set(engine.order)
    ordered = [*engine.order, *(u for u in engine.units.values() if u not in in_order)]
    units = tuple(
        UnitStatus(
            name=u.name,
            nbytes=u.nbytes,
            placement=u.placement.value,
            host_bytes=0 if u.pack is None else u.pack.held_bytes,
            pinned=u.pack is not None and u.pack.pinned,
            shared=u.pack is not None and u.pack.shared,
            uploads=u.uploads,
            pack_rebuilds=u.pack_rebuilds,
            staged=u.pack is not None and u.staging is not None,
            on_disk=u.pack is not None and u.pack.disk,
            compressed=u.pack is not None and u.pack.coded,
            mapped=u.mapped is not None,
        )
        for u in ordered
    )
    counters = engine.store.counters
    reader = engine.store.host.read_ahead
    return OffloadStatus(
        model=type(engine.model).__name__,
        device=str(engine.runtime.device),
        phase=engine.phase.value,
        forwards=engine.forwards,
        forward_running=engine.bracket.running,
        units=units,
        plan=None if engine.current is None else engine.current.plan,
        plans={key: entry.plan for key, entry in engine.plans.items()},
        input_signature=engine.signature,
        arena_bytes=engine.store.arena_bytes(),
        device_bytes_held=engine.store.device_bytes_held(),
        host_bytes_held=engine.store.host_bytes_held(),
        uploads=counters.uploads,
        pack_rebuilds=counters.pack_rebuilds,
        layouts=counters.layouts,
        host_pinned_bytes=engine.store.host_pinned_bytes(),
        staging_bytes=engine.store.staging_bytes(),
        host_budget_bytes=engine.store.host.budget_bytes,
        direct_bytes=engine.store.host.direct_bytes(engine.store.units),
        disk_bytes=engine.store.disk_bytes(),
        disk_reads_ahead=0 if reader is None else reader.hits,
        disk_reads_inline=0 if reader is None else reader.misses,
        read_ahead_bytes=engine.store.host.read_ahead_bytes,
    )
