"""The host budget: which packs are page-locked (copied straight to the device) and which are staged.

[Note: host budget]
``host_memory_budget`` (or the limit detected on this machine, see device/host_limits.py) bounds the host
bytes page-locked for the weights. When every pack fits, every pack is pinned as before and nothing else
changes. Otherwise a staging ring (host/staging.py) is page-locked first, and packs are pinned while the rest
of the budget holds them; the others stay pageable and their copies go through the ring
(``Unit.staging``), slower but still asynchronous. Which units those are is the planner's choice (see
plan/host_plan.py): at offload(), before anything is known, units in module order are pinned while they
fit; each plan then names the streamed units it stages (``Plan.staged``), and laying it out pins the
others, unpinning only to make room, so switching between plans re-pins as little as possible. Resident
units never need pinning: their copy to the device is a one-off.

On a device without pinning (a CPU) the same split applies with nothing page-locked: "direct" packs are
copied as they are, the others through the ring. That is the path CI tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from flextensor.common.sizes import format_bytes
from flextensor.device.link import probe_link
from flextensor.device.runtime import DeviceRuntime, Target
from flextensor.errors import ConfigError, HostBudgetError, PinningError
from flextensor.host.disk import CheckpointFiles, DiskReadAhead, plan_disk_tier
from flextensor.host.staging import StagingRing, staging_layout
from flextensor.plan.host_plan import HostPlan
from flextensor.plan.measurements import LinkModel
from flextensor.store.units import Unit

if TYPE_CHECKING:
    from flextensor.config.schema import OffloadConfig
    from flextensor.store.device_store import DeviceStore

logger = logging.getLogger("flextensor")

__all__ = ["PIN_THREADS", "HostBudget", "host_budget_target", "probe_links", "probe_staged_link"]

PIN_THREADS = 8
"""Packs page-locked at once after packing (private packs are built unpinned, then pinned here, within the
host budget if there is one): ``cudaHostRegister`` spends its time populating and locking pages, which the
driver may do for several mappings in parallel (``flextensor probe``'s "threads at once" row says whether
it does on a machine; not measured for this choice). The same count ``offload(weights=...)`` pins with, one
pack per reading thread."""


def host_budget_target(config: OffloadConfig, target: Target) -> Target:
    """``target`` with its host budget checked against the rest of ``config``, before anything changes."""
    explicit = config.host_memory_budget is not None
    if explicit and target.device.type == "cuda" and not target.pin:
        raise ConfigError(
            "host_memory_budget bounds page-locked memory, but pinned_memory=False pins none: every copy is "
            "already from pageable memory; drop one of the two settings"
        )
    if target.host_limits is not None:
        logger.info("host limits: %s", target.host_limits.describe())
    if config.share_host_memory and target.host_budget_bytes is not None:
        if explicit:
            raise ConfigError(
                "host_memory_budget with share_host_memory=True is not supported yet: the shared segment is "
                "page-locked whole; leave host_memory_budget unset"
            )
        logger.warning(
            "share_host_memory: the shared segment is page-locked whole, beyond the %s this machine "
            "allows (%s); pinning may fail",
            format_bytes(target.host_budget_bytes),
            target.host_limits.describe() if target.host_limits is not None else "",
        )
        return replace(target, host_budget_bytes=None)
    return target


class HostBudget:
    """One offloaded model's pinned bytes under its budget (see [Note: host budget])."""

    def __init__(self, budget_bytes: int | None, runtime: DeviceRuntime, pin: bool) -> None:
        self.budget_bytes = budget_bytes
        self.runtime = runtime
        self.pin = pin
        self.ring: StagingRing | None = None
        self.read_ahead: DiskReadAhead | None = None  # reads disk units ahead of their copies (host/disk.py)
        self.disk_files: CheckpointFiles | None = None  # the disk units' checkpoint, checked at every forward

    @property
    def capacity(self) -> int | None:
        """Bytes of packs that may be direct (pinned): the budget less the ring and the disk read-ahead
        buffers; None: no bound."""
        if self.budget_bytes is None or self.ring is None:
            return None
        return self.budget_bytes - self.ring.nbytes - self.read_ahead_bytes

    @property
    def read_ahead_bytes(self) -> int:
        """Host bytes of the disk units' read-ahead buffers (pageable; see host/disk.py)."""
        return 0 if self.read_ahead is None else self.read_ahead.nbytes

    def start(self, units: Sequence[Unit]) -> None:
        """At offload(), packs built unpinned: set up the ring if the packs do not all fit the budget, then
        pin units in order while they fit; stage the rest. Raises HostBudgetError, before any pinning,
        when the budget cannot hold even the ring."""
        total = sum(_held(u) for u in units)
        on_disk = [u for u in units if u.pack is not None and u.pack.disk]
        if self.budget_bytes is None or (total <= self.budget_bytes and not on_disk):
            # Packs still being read from a checkpoint are pinned by their readers, in the background
            # (see read_checkpoint for when its readers pin).
            self._pin_in_parallel([u for u in units if u.pack is None or u.pack.read])
            return
        slot, slots = staging_layout(max(u.nbytes for u in units))
        ring_bytes = slot * slots
        if self.budget_bytes < ring_bytes:
            raise HostBudgetError(
                f"host memory budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} bytes) cannot "
                f"hold the staging ring of {format_bytes(ring_bytes)} ({ring_bytes} bytes: {slots} slots of "
                f"{format_bytes(slot)}) that the {format_bytes(total - self.budget_bytes)} of weights beyond "
                "it are copied through; raise host_memory_budget to at least that, or leave it unset",
                needed_bytes=ring_bytes,
                budget_bytes=self.budget_bytes,
            )
        self.ring = StagingRing(slot, slots, self.runtime, self.pin)
        if on_disk:
            _, buffer_bytes = plan_disk_tier([u.nbytes for u in units], self.budget_bytes)  # as at reading
            self.read_ahead = DiskReadAhead(buffer_bytes)
            self.disk_files = on_disk[0].pack.files  # type: ignore[union-attr]  # one checkpoint for all
            for unit in on_disk:
                unit.pack.read_ahead = self.read_ahead  # type: ignore[union-attr]
        room = self.budget_bytes - ring_bytes - self.read_ahead_bytes
        direct = []
        for unit in units:  # in module order while they fit: no plan says which matter yet
            if unit in on_disk:  # streams from the checkpoint through the ring (see host/disk.py)
                unit.staging = self.ring
            elif _held(unit) <= room:
                room -= _held(unit)
                direct.append(unit)
            else:
                self._stage(unit)
        # Packs still being read are pinned by their readers (every pack not on disk is direct).
        self._pin_in_parallel([u for u in direct if u.pack is None or u.pack.read])
        staged = [u for u in units if u.staging is not None and u not in on_disk]
        logger.info(
            "host budget %s: %d unit(s) pinned (%s), %d staged through a %s ring (%s), %d read from the "
            "checkpoint through it (%s) and %s of read-ahead buffers",
            format_bytes(self.budget_bytes),
            len(units) - len(staged) - len(on_disk),
            format_bytes(self.direct_bytes(units)),
            len(staged),
            format_bytes(ring_bytes),
            format_bytes(sum(_held(u) for u in staged)),
            len(on_disk),
            format_bytes(sum(u.nbytes for u in on_disk)),
            format_bytes(self.read_ahead_bytes),
        )

    def direct_bytes(self, units: Sequence[Unit]) -> int:
        """Host bytes of the packs copied straight to the device (pinned on CUDA)."""
        return sum(_held(u) for u in units if u.pack is not None and u.staging is None)

    def admit(self, unit: Unit, units: Sequence[Unit] = ()) -> None:
        """Place a new (unpinned) pack: direct and pinned if the budget has room next to the direct packs
        of ``units``, else staged. A pin the system refuses stages the unit too, with a warning."""
        capacity = self.capacity
        if capacity is not None:
            others = self.direct_bytes([u for u in units if u is not unit])
            if others + _held(unit) > capacity:
                self._stage(unit)
                return
        self._make_direct(unit)

    def apply(self, units: Sequence[Unit], streamed: Sequence[Unit], staged: Collection[str]) -> None:
        """Plan time, on a synchronised device: make every streamed unit the plan does not stage direct,
        unpinning first units that do not stream, then units it stages, only as far as room is needed."""
        capacity = self.capacity
        if capacity is None:
            return
        wanted = [u for u in streamed if u.name not in staged and u.pack is not None and not u.pack.disk]
        wanted_set = set(wanted)
        streaming = set(streamed)
        # Who gives way first: units not streamed (resident, never run), then those this plan stages.
        givers = [u for u in units if u not in streaming] + [u for u in streamed if u not in wanted_set]
        direct = self.direct_bytes(units)
        for unit in wanted:
            if unit.staging is None:
                continue
            while direct + _held(unit) > capacity and givers:
                giver = givers.pop(0)
                if giver.pack is not None and giver.staging is None:
                    direct -= _held(giver)
                    self._stage(giver)
            if direct + _held(unit) > capacity:
                logger.warning("unit %s does not fit the host budget: it stays staged", unit.name)
                continue
            self._make_direct(unit)
            if unit.staging is None:
                direct += _held(unit)

    def _make_direct(self, unit: Unit) -> None:
        self._settle(unit, self._pin(unit))

    def _pin(self, unit: Unit) -> PinningError | None:
        """Page-lock ``unit``'s pack if this device pins; the refusal, if the system refuses."""
        assert unit.pack is not None
        if not self.pin or unit.pack.shared:
            return None
        try:
            unit.pack.pin()
        except PinningError as exc:
            return exc
        return None

    def _settle(self, unit: Unit, refused: PinningError | None) -> None:
        """``unit`` is direct, unless pinning it was refused (the system allows less than the budget, as
        WSL may): then it is staged, or copied from pageable memory when there is no ring."""
        if refused is None:
            unit.staging = None
        elif self.ring is None:
            logger.warning("%s; unit %s is copied from pageable memory", refused, unit.name)
        else:
            logger.warning("%s; unit %s is staged instead", refused, unit.name)
            self._stage(unit)

    def _pin_in_parallel(self, units: Sequence[Unit]) -> None:
        """Make ``units`` direct, pinning up to PIN_THREADS packs at once (see PIN_THREADS)."""
        pending = [u for u in units if self.pin and u.pack is not None and not u.pack.pinned]
        if len(pending) < 2:
            for unit in units:
                self._make_direct(unit)
            return
        device = self.runtime.device

        def pin(unit: Unit) -> PinningError | None:
            torch.cuda.set_device(device)  # registration goes to the thread's current device
            return self._pin(unit)

        with ThreadPoolExecutor(min(PIN_THREADS, len(pending))) as pool:
            refusals = dict(zip(pending, pool.map(pin, pending), strict=True))
        for unit in units:
            self._settle(unit, refusals.get(unit))

    def _stage(self, unit: Unit) -> None:
        assert unit.pack is not None and self.ring is not None
        unit.pack.unpin()
        unit.staging = self.ring

    def plan_reads(self, streamed: Sequence[Unit]) -> None:
        """Give the disk reader the streamed order of a new layout (see [Note: disk reads ahead])."""
        if self.read_ahead is not None:
            order = [u.pack for u in streamed if u.pack is not None and u.pack.disk and u.staging is not None]
            self.read_ahead.plan(order)  # type: ignore[arg-type]

    def check_disk_files(self) -> None:
        """Once per forward: CheckpointError if the checkpoint the disk units stream from changed (see
        [Note: checkpoint changed under the model] in host/disk.py); nothing without disk units."""
        if self.disk_files is not None:
            self.disk_files.check_unchanged()

    def free(self) -> None:
        self.disk_files = None
        if self.read_ahead is not None:
            self.read_ahead.close()
            self.read_ahead = None
        if self.ring is not None:
            self.ring.free()
            self.ring = None

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return f"HostBudget({budget}, ring={self.ring!r})"


def _held(unit: Unit) -> int:
    return 0 if unit.pack is None else unit.pack.held_bytes


def probe_staged_link(ring: StagingRing, source: torch.Tensor, destination: torch.Tensor) -> LinkModel:
    """The speed of copies through ``ring`` from the pageable ``source`` into ``destination`` (the arena),
    host clock around the whole staged copy: the host's memcpy into the ring is part of its cost."""
    runtime = ring.runtime
    size = min(source.numel(), destination.numel())
    stream = runtime.copy_stream
    previous = runtime.current_stream()
    runtime.set_stream(stream)
    times = []
    try:
        for _ in range(3):
            runtime.synchronize()
            start = time.perf_counter()
            ring.copy_from_host(destination[:size], source[:size], stream)
            runtime.synchronize()
            times.append(max(time.perf_counter() - start, 1e-9))
    finally:
        runtime.set_stream(previous)
    ring.copies -= 3  # probes are not the model's copies
    ring.staged_bytes -= 3 * size
    return LinkModel(points=((max(size, 1), size / sorted(times)[1]),))


def probe_links(store: DeviceStore, arena: torch.Tensor) -> tuple[LinkModel, HostPlan | None]:
    """At offload(): the direct link's speed (a pinned pack's copies, or the ring's own pinned memory's when
    no pack is direct) and, under a host budget that stages units, what the planner needs to know of it."""
    runtime, host, units = store.runtime, store.host, store.units
    direct = [u for u in units if u.pack is not None and u.staging is None]
    ring = host.ring
    if direct or ring is None:
        largest = max(direct or units, key=lambda u: u.nbytes)
        assert largest.pack is not None
        link = probe_link(runtime, largest.pack.buffer, arena)
    else:
        link = probe_link(runtime, ring.buffer, arena)
    if ring is None:
        return link, None
    staged = max((u for u in units if u.staging is not None), key=lambda u: u.nbytes)
    assert staged.pack is not None and host.capacity is not None
    staged_link = probe_staged_link(ring, staged.pack.buffer, arena)  # a disk unit's: read once for it
    logger.info(
        "staged copies: %.2f GB/s against %.2f GB/s pinned",
        staged_link.bytes_per_s(staged.nbytes) / 1e9,
        link.bytes_per_s(staged.nbytes) / 1e9,
    )
    on_disk = [u for u in units if u.pack is not None and u.pack.disk]
    if not on_disk:
        return link, HostPlan(capacity_bytes=host.capacity, staged_link=staged_link)
    from flextensor.host.disk import DiskPack, probe_disk_link

    largest = max(on_disk, key=lambda u: u.nbytes)
    assert isinstance(largest.pack, DiskPack)
    disk_link = probe_disk_link(ring, largest.pack, arena)
    logger.info(
        "copies from the checkpoint file: %.2f GB/s (%d unit(s), %s)",
        disk_link.bytes_per_s(largest.nbytes) / 1e9,
        len(on_disk),
        format_bytes(sum(u.nbytes for u in on_disk)),
    )
    disk = frozenset(u.name for u in on_disk)
    return link, HostPlan(host.capacity, staged_link, disk_units=disk, disk_link=disk_link)
