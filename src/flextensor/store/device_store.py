"""The device store: the arena, which unit occupies which bytes, and moving weights between host and device.

[Note: static arena aliasing]
Every streamed parameter's ``.data`` is, for good, a view into its unit's fixed range of the device arena
(see [Note: ring layout] in plan/layout.py). Loading a unit is therefore one ``copy_`` of its packed host
buffer into that range, and the hot path touches no parameter at all: per unit it is one stream wait in the
pre-hook, one event record and at most a few copies in the post-hook. Whether a range holds a unit's
weights is its occupancy (see [Note: occupancy cells]), so a unit run out of the learned order is simply
loaded on demand and the output stays right.

Ordering uses events only: a copy waits (on the device) for the compute that last read its range; compute
waits for the copy. No ``record_stream`` is needed because the arena is never handed back to the caching
allocator while streaming: it is replaced only when a layout changes (a new plan, new input shapes), and
:meth:`DeviceStore.lay_out` synchronises the device before it lets go of the old one; a pipeline
component's switch orders the same on the device instead (see [Note: a switch in stream order] in
store/stream_order.py).

[Note: one copy of a resident unit]
A unit resident in every saved plan never streams, so once a plan is in place its private host pack is
freed (unpinned and unmapped): its device storage holds the only copy of its weights (DEVICE_ONLY), and
host RAM holds little more than what streams. A unit some saved plan streams keeps its pack (RESIDENT), so
that switching between plans (prefill and decode) re-pins nothing. Packs in a segment shared with other
processes (``share_host_memory``) stay: those read it. Before a resident unit's storage is ever freed (a
plan that streams it, profiling, ``release``) its pack is built again, or refreshed when its weights were
edited in place, from that storage with one device-to-host copy: every weight is always in a pack or in
resident storage (``Unit.kept``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flextensor.common.sizes import align_up, format_bytes
from flextensor.device.runtime import DeviceRuntime, profiler_range
from flextensor.errors import PlanError
from flextensor.host.packs import UnitPack
from flextensor.plan.layout import UNIT_ALIGNMENT, minimal_arena_bytes, occupancy_cells, ring_layout
from flextensor.store.copies import copy_into_range
from flextensor.store.host_budget import HostBudget
from flextensor.store.nesting import NestedCalls
from flextensor.store.stream_order import (
    copy_after_compute,
    in_stream_order,
    let_go_in_stream_order,
    wait_for_uploads,
)
from flextensor.store.units import Placement, Unit

if TYPE_CHECKING:
    from flextensor.host.coded_packs import CodedLoads

logger = logging.getLogger("flextensor")

__all__ = [
    "DeviceStore",
    "StoreCounters",
    "allocate_device_bytes",
    "release_copy",
]


def allocate_device_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of uninitialised device memory: every arena and resident storage comes from here (one
    place to see, and for tests to fail, what a layout allocates)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def release_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A private copy of ``tensor`` on ``device``, strides kept: what a released parameter holds (one place
    for tests to fail part-way, as running out of memory would)."""
    return tensor.to(device, copy=True)


@dataclass
class StoreCounters:
    """What the store did since offload(): resident uploads, packs built again, on-demand loads."""

    uploads: int = 0
    pack_rebuilds: int = 0
    layouts: int = 0


class DeviceStore:
    """One offloaded model's device bytes: the arena, resident storage, occupancy, host packs' lifecycle.

    Plan-time methods synchronise the device and may loop over parameters; the hot path only reads
    ``owner`` and the units' fields (see phases/steady.py).
    """

    def __init__(self, units: Sequence[Unit], runtime: DeviceRuntime, pin: bool) -> None:
        self.units = list(units)
        self.runtime = runtime
        self.pin = pin  # for packs built again
        self.arena: torch.Tensor | None = None
        self.owner: list[Unit | None] = []  # per occupancy cell: whose weights its bytes are
        self.counters = StoreCounters()
        self.keep_packs = False  # a pipeline component gives its device bytes back between its steps
        self.host = HostBudget(None, runtime, pin)  # which packs are pinned; set_host_budget bounds it
        self.reserved: torch.Tensor | None = None  # see hold_in_reserve
        self.coded_loads: CodedLoads | None = None  # staging slots and decode stream of coded loads
        self.recode: Callable[[Unit], None] | None = None  # encodes a pack built again (store/coded_loads.py)
        self.nested = NestedCalls(self)  # units called inside another after learning borrow their range
        # The stream every forward since the layout in place ran on; None once one ran on another (see
        # store/stream_order.py).
        self.compute_stream: object = None
        # The streamed units whose post-hooks copy in the next forward's first units (the ring's wrap): each
        # with its copies with and without them (see prefetch_past_end).
        self.past_end: list[tuple[Unit, tuple[Unit, ...], tuple[Unit, ...]]] = []

    def hold_in_reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` of device memory until the next layout, which frees it first and allocates into
        it (the caching allocator keeps the freed block for it). A serving engine that sizes its own
        memory from what the model holds after loading (vLLM's KV cache) then accounts for the planned
        layout before any plan exists (see [Note: a budget for the weights alone] in engine/policy.py)."""
        self.reserved = None
        if nbytes > 0:
            self.reserved = allocate_device_bytes(nbytes, self.runtime.device)

    def set_host_budget(self, host: HostBudget) -> None:
        """Bound the pinned host bytes (offload() calls this once, before the first layout): pins the packs
        (built unpinned) that fit and stages the rest; HostBudgetError if the budget cannot hold the ring."""
        host.start(self.units)
        self.host = host

    # -- layout -------------------------------------------------------------------------------------------

    def lay_out(
        self,
        streamed: Sequence[Unit],
        resident: Iterable[Unit],
        arena_bytes: int,
        staged: Collection[str] | None = None,
        ahead: bool = False,
    ) -> None:
        """Give every unit its device bytes: own storage if resident, a range of the arena otherwise.

        ``streamed`` in execution order; units in neither list (never seen running) get a range at the
        arena's start and load on demand if they ever run. Plan time only: synchronises the device and
        re-points parameters. A unit resident before and after keeps its storage, so switching between
        cached plans uploads only the units that enter residency. ``staged``: the streamed units a plan
        copies through the staging ring; the others are pinned as the host budget allows (None: the
        pinning stays as it is, for the learning phases' layouts).

        ``ahead``: from a store holding no device bytes, while other work may still run (see [Note: the
        next component ahead] in pipelines/pipeline.py): no synchronise; memory taken and residents uploaded
        with the copy stream current, so nothing waits for, or reuses memory of, compute queued before. The
        current stream then waits for the copy stream, so that what it runs next reads the uploads after
        them; a forward on another stream must wait for the copy stream itself.
        """
        assert not (ahead and self.device_bytes_held()), "a layout ahead starts from a vacated store"
        # Device buffers are normal tensors even when a forward under inference_mode lays them out:
        # inference tensors carry no version counter, which in-place edits of weights are detected by.
        what = "flextensor.lay_out_ahead" if ahead else "flextensor.lay_out"
        with torch.inference_mode(False), torch.no_grad(), profiler_range(what):
            self.compute_stream = self.runtime.current_stream()
            if not ahead:
                self._lay_out(streamed, resident, arena_bytes, staged)
                return
            previous = self.runtime.current_stream()
            self.runtime.set_stream(self.runtime.copy_stream)
            try:
                self._lay_out(streamed, resident, arena_bytes, staged, synchronize=False)
            finally:
                self.runtime.set_stream(previous)
            # Behind the compute queued so far, which never reads this layout: the component's forward,
            # or one of its resident units called directly before it (they carry no hooks), reads the
            # uploads after them.
            wait_for_uploads(self)

    def _lay_out(
        self,
        streamed: Sequence[Unit],
        resident: Iterable[Unit],
        arena_bytes: int,
        staged: Collection[str] | None,
        synchronize: bool = True,
    ) -> None:
        resident = set(resident)
        both = resident.intersection(streamed)
        if both:  # a hand-edited profile could say so; the planner never does
            raise PlanError(f"units both resident and streamed in one layout: {sorted(u.name for u in both)}")
        # From a store holding nothing (a pipeline component's step), ordered by streams instead.
        ordered = synchronize and not self.device_bytes_held() and in_stream_order(self, False)
        if synchronize and not ordered:
            self.runtime.synchronize()
        for unit in self.units:
            if unit.resident and unit not in resident:
                self._refresh_pack(unit)  # before its storage, maybe the only copy, is freed
        kept = self._free_device_bytes(resident)
        if staged is not None:
            self.host.apply(self.units, streamed, staged)  # nothing reads the packs: the device is idle

        in_order = set(streamed)
        idle = [u for u in self.units if u not in resident and u not in in_order]
        idle_need = minimal_arena_bytes([u.nbytes for u in idle])
        if idle_need > arena_bytes and streamed:
            logger.warning(
                "units that never ran (%s) need a %s arena, more than the %s planned: the arena grows to "
                "hold them, beyond what the plan (and any budget) accounted for; exclude modules the "
                "model does not run",
                ", ".join(u.name for u in idle[:3]),
                format_bytes(idle_need),
                format_bytes(arena_bytes),
            )
        arena_bytes = max(arena_bytes, idle_need, minimal_arena_bytes([u.nbytes for u in streamed]))
        layout = ring_layout([u.name for u in streamed], [u.nbytes for u in streamed], arena_bytes)
        self.arena = allocate_device_bytes(arena_bytes, self.runtime.device) if arena_bytes else None
        self.allocate_coded_loads([*streamed, *idle], streamed)
        entering = [u for u in self.units if u in resident and u not in kept]
        if ordered:
            # The memory taken here may be what compute queued before still reads (see the note).
            copy_after_compute(self)
            for unit in entering:
                self.upload_resident(unit, self.runtime.copy_stream)
            wait_for_uploads(self)
        else:
            for unit in entering:
                self.upload_resident(unit)

        # Units never seen running are loaded on demand at the arena's start if they ever run.
        placed = [*streamed, *idle]
        offsets = [*layout.offsets, *(0 for _ in idle)]
        ranges = [
            (offset, align_up(u.nbytes, UNIT_ALIGNMENT)) for u, offset in zip(placed, offsets, strict=True)
        ]
        cells = occupancy_cells(ranges)
        self.owner = [None] * (1 + max((c[-1] for c in cells if c), default=-1))
        for unit, (offset, _), unit_cells in zip(placed, ranges, cells, strict=True):
            assert self.arena is not None
            unit.storage = self.arena[offset : offset + unit.nbytes]
            unit.cells = unit_cells
            unit.placement = Placement.STREAMED
            unit.point_parameters()
        self.past_end = []
        for position, unit in enumerate(streamed):
            unit.prefetch_next = tuple(streamed[k] for k in layout.prefetch_after[position])
            within = tuple(streamed[k] for k in layout.prefetch_after[position] if k > position)
            if within != unit.prefetch_next:  # the ring wraps here: it copies the next forward's first units
                self.past_end.append((unit, unit.prefetch_next, within))
        self.host.plan_reads(streamed)
        self.counters.layouts += 1
        self._warm_start(streamed)

    def prefetch_past_end(self, allowed: bool) -> None:
        """Whether the last streamed units' post-hooks copy in the next forward's first units. Off for a
        forward after which the model gives its memory back (a pipeline's component at the end of its
        run): those copies would be thrown away, and they hold up the link and the give-back. A forward
        that follows all the same loads those units when they run."""
        for unit, ring, within in self.past_end:
            unit.prefetch_next = ring if allowed else within

    def allocate_coded_loads(self, placed: Sequence[Unit], streamed: Sequence[Unit] = ()) -> None:
        """The staging slots and decode stream for the coded loads of the units ``placed`` in the arena,
        each slot as large as the largest compressed piece (see [Note: coded packs] in host/coded_packs.py).
        The plan counted the slots for its ``streamed`` units; a larger piece of a unit that never ran
        makes them larger (warned)."""
        coded = [u for u in placed if u.pack is not None and u.pack.coded]
        if not coded:
            return
        from flextensor.host.coded_packs import CodedLoads

        def slot_bytes(units: Sequence[Unit]) -> int:
            sizes = [u.pack.staging_nbytes for u in units if u.pack is not None and u.pack.coded]  # type: ignore[attr-defined]
            return align_up(max(sizes, default=0), UNIT_ALIGNMENT)

        largest, planned = slot_bytes(coded), slot_bytes(streamed)
        if streamed and largest > planned:
            logger.warning(
                "compressed units that never ran need staging slots of %s, more than the %s planned: the "
                "slots grow beyond what the plan (and any budget) accounted for; exclude modules the model "
                "does not run",
                format_bytes(largest),
                format_bytes(planned),
            )
        device = self.runtime.device
        self.coded_loads = CodedLoads(self.runtime, largest, lambda n: allocate_device_bytes(n, device))
        for unit in coded:
            unit.pack.loads = self.coded_loads  # type: ignore[union-attr]

    def _free_device_bytes(self, staying: set[Unit]) -> set[Unit]:
        """Drop the arena and every unit's storage except that of units resident now and in ``staying``;
        return those kept, whose storage, bytes and parameters are left as they are.

        Runs before the new layout allocates anything, so that its storage and arena can reuse what is
        freed here: the peak of a switch is the larger of the two layouts, not their sum.
        """
        kept = {u for u in self.units if u in staying and u.resident and u.storage is not None}
        self.past_end = []
        for unit in self.units:
            unit.prefetch_next = ()  # a streamed unit's are recomputed for the new layout
            if unit in kept:
                continue
            for _, param, entry in unit.parameters:
                # Drop the views first: a parameter still viewing the arena would keep it allocated.
                param.data = torch.empty(0, dtype=entry.dtype, device=self.runtime.device)
            unit.storage = None
            unit.cells = ()
            unit.placement = Placement.HOST
        self.arena = None
        self.reserved = None  # the new layout takes its place
        self.owner = []
        self.drop_coded_loads()
        return kept

    def drop_coded_loads(self) -> None:
        """Free the staging slots of coded loads (a new layout, release, packs held uncompressed again)."""
        self.coded_loads = None
        for unit in self.units:
            if unit.pack is not None and unit.pack.coded:
                unit.pack.loads = None  # type: ignore[attr-defined]

    def upload_resident(self, unit: Unit, copy_stream: object = None) -> None:
        """Give a unit entering residency storage of its own, holding its weights for good, taken on the
        current stream. ``copy_stream``: the copy runs there and the host does not wait for it (the pack
        must stay as it is until that stream passes)."""
        assert unit.pack is not None  # only a unit with device storage may lack its pack
        with profiler_range(f"flextensor.upload {unit.name}"):
            self._upload(unit, copy_stream)

    def _upload(self, unit: Unit, copy_stream: object = None) -> None:
        assert unit.pack is not None
        if unit.mapped is not None:  # its pack, read in place: nothing to allocate, copy or count
            unit.storage = unit.mapped
            unit.point_parameters()
            unit.storage_version = unit.weights_version()
            unit.placement = Placement.RESIDENT
            return
        storage = allocate_device_bytes(unit.nbytes, self.runtime.device)
        if unit.pack.coded and self.runtime.is_cuda:
            # Decoded on the device: the host's decoder runs at about 0.2 GB/s, 2 s per 8B-model layer.
            unit.pack.decode_through(self.runtime.device, storage)  # type: ignore[attr-defined]
        elif copy_stream is None:
            storage.copy_(unit.pack.buffer)
        else:
            previous = self.runtime.current_stream()
            self.runtime.set_stream(copy_stream)
            try:
                storage.copy_(unit.pack.buffer, non_blocking=True)
            finally:
                self.runtime.set_stream(previous)
        unit.storage = storage
        unit.point_parameters()
        unit.storage_version = unit.weights_version()
        unit.placement = Placement.RESIDENT  # last: a failed upload leaves the unit to be freed and retried
        unit.uploads += 1
        self.counters.uploads += 1

    def _warm_start(self, order: Sequence[Unit]) -> None:
        """Copy in the first units of the order that do not overlap each other, ahead of the next forward."""
        if not order:
            return
        previous = self.runtime.current_stream()
        stream = self.runtime.copy_stream
        self.runtime.set_stream(stream)
        try:
            for unit in order:
                if any(self.owner[cell] is not None for cell in unit.cells):
                    break
                if unit.pack is not None and not unit.pack.read:
                    break  # still being read from a checkpoint: the forward loads it when it needs it
                copy_into_range(unit, self.owner, stream)
        finally:
            self.runtime.set_stream(previous)

    def drop_packs(self, resident_everywhere: set[str]) -> None:
        """Free the private host pack of every resident unit named in ``resident_everywhere`` (resident in
        every saved plan): its storage is the only copy it needs (see [Note: one copy of a resident
        unit]). Plan time only, after lay_out, whose uploads have completed."""
        if self.keep_packs:
            return
        for unit in self.units:
            pack = unit.pack
            if pack is None or pack.shared or pack.disk:  # a disk pack holds no host memory to give back
                continue
            if unit.name in resident_everywhere and unit.resident and unit.mapped is None:
                if unit.storage is not None and unit.weights_version() != unit.storage_version:
                    continue  # edited in place since the upload: the pack is refreshed when it streams
                pack.free()
                unit.pack = None
                unit.placement = Placement.DEVICE_ONLY

    def _refresh_pack(self, unit: Unit) -> None:
        """Make a resident unit's host pack hold what its device storage holds, before that storage goes:
        build it again if it was dropped, copy into it if the weights were edited in place. Plan time only,
        on a synchronised device."""
        assert unit.storage is not None
        edited = unit.weights_version() != unit.storage_version
        if unit.mapped is not None:  # its storage is the pack: edits are in it already
            unit.storage_version = unit.weights_version()
            return
        if unit.pack is not None and not edited:
            return
        if unit.pack is not None and (unit.pack.disk or unit.pack.coded):
            # Edited in place: the file no longer holds its weights, or the compressed bytes are stale.
            unit.pack.free()
            unit.pack = None
            unit.staging = None
        if unit.pack is None:
            pack = UnitPack(unit.name, unit.entries, unit.nbytes, False)  # the host budget pins it
            try:
                pack.buffer.copy_(unit.storage)  # synchronous: the pack is whole when this returns
            except BaseException:
                pack.free()
                raise
            unit.pack = pack
            if self.recode is not None:
                self.recode(unit)  # held compressed again, as it was
            self.host.admit(unit, self.units)
            unit.pack_rebuilds += 1
            self.counters.pack_rebuilds += 1
        else:
            unit.pack.buffer.copy_(unit.storage)
        unit.storage_version = unit.weights_version()

    def vacate(self, keep_resident: bool = False) -> None:
        """Give back every device byte held for units (the arena, resident storage): each unit keeps only
        its host pack until the next layout. With ``keep_resident``, resident units keep their storage
        (and their parameters) and only the streamed side goes. Plan time only: synchronises the device,
        or orders the freed memory after its queued uses (see [Note: a switch in stream order])."""
        with profiler_range("flextensor.vacate"):
            self._vacate(keep_resident)

    def _vacate(self, keep_resident: bool) -> None:
        if in_stream_order(self, not keep_resident):
            let_go_in_stream_order(self, keep_resident)  # every resident unit's pack holds its weights
        else:
            self.runtime.synchronize()
            if not keep_resident:
                for unit in self.units:
                    if unit.resident:
                        self._refresh_pack(unit)  # its storage may hold the only copy, or edits
        self._free_device_bytes({u for u in self.units if u.resident} if keep_resident else set())

    # -- loading ------------------------------------------------------------------------------------------

    def forget_contents(self) -> None:
        """Something other than a unit's copy wrote over the arena (the link probe): no unit holds its
        weights there any more."""
        self.owner = [None] * len(self.owner)

    def load_on_demand(self, unit: Unit, compute_stream: object) -> None:
        """Copy ``unit`` in now, after the compute that last read any of its cells; used when a unit runs
        out of the learned order and while learning. Leaves ``compute_stream`` current."""
        stream = self.runtime.copy_stream
        self.runtime.set_stream(stream)
        try:
            for cell in unit.cells:
                occupant = self.owner[cell]
                if occupant is not None and occupant is not unit:
                    stream.wait_event(occupant.compute_done)  # type: ignore[attr-defined]
            if self.coded_loads is not None:  # a decode may still write these cells (host/coded_packs.py)
                self.coded_loads.fence(stream)
            copy_into_range(unit, self.owner, stream)
        finally:
            self.runtime.set_stream(compute_stream)

    # -- accounting ---------------------------------------------------------------------------------------

    def arena_bytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def device_bytes_held(self) -> int:
        """Device bytes held for units: the arena, resident units' storage, the reserve and the staging
        buffer of coded loads."""
        reserved = 0 if self.reserved is None else self.reserved.numel()
        staging = 0 if self.coded_loads is None else self.coded_loads.nbytes
        return (
            self.arena_bytes() + reserved + staging + sum(u.device_nbytes for u in self.units if u.resident)
        )

    def host_bytes_held(self) -> int:
        """Host bytes held for units: their packs (a shared pack counts its range of the segment)."""
        return sum(u.pack.held_bytes for u in self.units if u.pack is not None)

    def host_pinned_bytes(self) -> int:
        """Host bytes page-locked for units: pinned packs and the staging ring (0 on a CPU)."""
        ring = self.host.ring
        packs = sum(u.pack.held_bytes for u in self.units if u.pack is not None and u.pack.pinned)
        return packs + (ring.nbytes if ring is not None and ring.pinned else 0)

    def disk_bytes(self) -> int:
        """Bytes of the units that stream from the checkpoint file, with no host pack (see host/disk.py)."""
        return sum(u.nbytes for u in self.units if u.pack is not None and u.pack.disk)

    def staging_bytes(self) -> int:
        """Host bytes of the staging ring (0 when every pack fits the host budget)."""
        return 0 if self.host.ring is None else self.host.ring.nbytes

    # -- release ------------------------------------------------------------------------------------------

    def build_released(self, target: torch.device) -> dict[int, torch.Tensor]:
        """A private copy of every unit parameter's weights on ``target``, keyed by id(parameter). Swaps
        nothing: a failure here (out of memory) leaves the store as it was."""
        self.runtime.synchronize()
        built: dict[int, torch.Tensor] = {}
        for unit in self.units:
            for _, param, entry in unit.parameters:
                # A copy each, also from a resident unit's storage on the target: a view would keep the
                # unit's padded storage alive and shared (which safetensors and torch.save refuse).
                built[id(param)] = release_copy(unit.kept(entry), target)
        return built

    def free_everything(self) -> None:
        """Let go of the arena, every storage and every pack (after the parameters got their own copies)."""
        self.runtime.synchronize()  # a layout ahead's blocks go back to the copy stream, which may write
        self.host.free()  # first: the disk readers still read into the packs' files
        # The coded loads' views hold the arena, the slots and every coded pack; packs point back at them.
        self.drop_coded_loads()
        self.past_end = []
        for unit in self.units:
            unit.storage = None
            unit.cells = ()
            unit.prefetch_next = ()
            unit.placement = Placement.HOST
            unit.staging = None
            if unit.pack is not None:
                unit.pack.free()
                unit.pack = None
        self.arena = None
        self.reserved = None
        self.owner = []

    def __repr__(self) -> str:
        streamed = sum(1 for u in self.units if u.placement is Placement.STREAMED)
        return (
            f"DeviceStore({len(self.units)} units, {streamed} streamed, arena "
            f"{format_bytes(self.arena_bytes())}, device {self.runtime.device})"
        )
