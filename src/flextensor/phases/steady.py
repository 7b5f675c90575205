"""The steady-state hot path: the only code that runs per streamed unit per forward once a plan is in place.

A streamed unit's pre-hook makes the compute stream wait for its copy (loading it first when it runs out
of the learned order); its post-hook records that its compute is done and issues the copies the ring
layout schedules after it (``Unit.prefetch_next``), on the copy stream, each after that compute. Per unit:
one event wait, one event record, and for the units with copies to issue one wait and the copies. No
phase, recorder or grad branch: the forward's driver is chosen once at its start (:class:`DirectStep` on
a CUDA device, which calls the CUDA runtime itself; :class:`RecordedStep` for a recorded step).

The compute stream is the one current when the unit's pre-hook runs, read there and kept for its
post-hook, not the one current when the forward began: CUDA-graph trees warm a compiled model up on a
stream of their own after the model's own hook ran on the default stream, and a compiled part of a model
may do so while the rest runs on the default stream (DirectStep reads a raw handle, about 0.1 us).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from flextensor.device.cudart import CudartCalls
from flextensor.device.runtime import HostCalls
from flextensor.phases.timeline import StepRecorder
from flextensor.store.copies import copy_into_range, holds_weights, wait_for_decodes
from flextensor.store.device_store import DeviceStore
from flextensor.store.stream_order import note_forward_stream
from flextensor.store.units import Placement, Unit

logger = logging.getLogger("flextensor")

__all__ = [
    "CapturedStep",
    "DirectStep",
    "OutsideForwardStep",
    "ProfiledStep",
    "RecordedStep",
    "SteadyStep",
    "steady_step",
]


class SteadyStep:
    """Pre/post of the streamed units for one steady forward (see the module docstring)."""

    __slots__ = ("compute", "copy", "owner", "set_stream", "store")

    def __init__(self, store: DeviceStore) -> None:
        self.store = store
        self.copy = store.runtime.copy_stream
        self.set_stream = store.runtime.set_stream
        self.compute: Any = None
        self.owner: list[Unit | None] = []

    def begin(self) -> None:
        """Once per forward: the compute stream of this forward, the occupancy of the current layout."""
        self.compute = self.store.runtime.current_stream()
        self.owner = self.store.owner

    def chosen(self) -> SteadyStep:
        """The step that drives this forward (see :meth:`DirectStep.chosen`)."""
        return self

    def pre(self, unit: Unit) -> None:
        # The stream this unit runs on, which its post-hook uses too: not always the forward's first one
        # (CUDA-graph trees warm a compiled part up on a stream of their own).
        self.compute = compute = self.store.runtime.current_stream()
        if not holds_weights(unit, self.owner):
            self.store.load_on_demand(unit, compute)  # out of the learned order
        compute.wait_event(unit.copy_done)

    def post(self, unit: Unit, output: Any) -> None:
        compute = self.compute
        unit.compute_done.record(compute)
        owner = self.owner
        pending = [u for u in unit.prefetch_next if not holds_weights(u, owner)]
        if pending:
            copy = self.copy
            self.set_stream(copy)
            try:
                copy.wait_event(unit.compute_done)
                for upcoming in pending:
                    copy_into_range(upcoming, owner, copy)
            finally:
                self.set_stream(compute)

    def nested_pre(self, unit: Unit, running: list[Unit], in_graph: bool) -> None:
        """``unit`` runs inside another: it borrows its range (see [Note: nested calls])."""
        self.store.nested.pre(unit, running, in_graph=in_graph)
        if not unit.resident:
            self.store.runtime.current_stream().wait_event(unit.copy_done)

    def nested_post(self, unit: Unit, output: Any, caller: Unit) -> None:
        self.store.nested.post(unit, caller)


class DirectStep(SteadyStep):
    """:class:`SteadyStep` with its waits, records and direct copies made straight into the CUDA runtime
    (see [Note: direct runtime calls] in device/cudart.py; on CPU through their stand-ins): no call
    switches the current stream, so a post-hook that prefetches only pinned packs makes none. Each hook
    reads the stream it runs on (a raw handle, cheap), so units that run on different streams within one
    forward (a compiled part warming up on its own stream) are each ordered on theirs. A staged or disk
    unit's copy goes through torch on the copy stream, as in SteadyStep."""

    __slots__ = ("calls", "copy_handle", "plain", "stream_handle")

    def __init__(self, store: DeviceStore, calls: CudartCalls | HostCalls) -> None:
        super().__init__(store)
        self.calls = calls
        self.copy_handle: int = self.copy.cuda_stream
        self.stream_handle = store.runtime.current_stream_handle
        self.plain = SteadyStep(store)

    def chosen(self) -> SteadyStep:
        """This step while the model's device is the current one; else the plain step (the direct calls
        do not make the event's device current, as torch's do). Once per forward."""
        return self if self.store.runtime.is_current() else self.plain

    def pre(self, unit: Unit) -> None:
        if not holds_weights(unit, self.owner):  # out of the learned order
            self.store.load_on_demand(unit, self.store.runtime.current_stream())
        self.calls.wait(self.stream_handle(), unit.copy_done)

    def post(self, unit: Unit, output: Any) -> None:
        calls = self.calls
        calls.record(unit.compute_done, self.stream_handle(), None)  # None: torch's record, if any, on it too
        owner = self.owner
        pending = [u for u in unit.prefetch_next if not holds_weights(u, owner)]
        if not pending:
            return
        copy_handle = self.copy_handle
        calls.wait(copy_handle, unit.compute_done)
        for upcoming in pending:
            if upcoming.staging is not None or upcoming.pack.coded:  # type: ignore[union-attr]
                # Through the staging ring, or compressed: torch's copies (and decode), on the copy stream.
                current = self.store.runtime.current_stream()
                self.set_stream(self.copy)
                try:
                    copy_into_range(upcoming, owner, self.copy)
                finally:
                    self.set_stream(current)
                continue
            cells = upcoming.cells
            if self.store.coded_loads is not None:  # a compressed unit there may still be decoding
                wait_for_decodes(upcoming, owner, self.copy)
            for cell in cells:  # emptied first, claimed last: as copy_into_range, for an interrupt
                owner[cell] = None
            storage = upcoming.storage
            source = upcoming.pack.buffer  # type: ignore[union-attr]
            calls.copy_to_device(storage.data_ptr(), source.data_ptr(), storage.nbytes, copy_handle)  # type: ignore[union-attr]
            calls.record(upcoming.copy_done, copy_handle, self.copy)
            for cell in cells:
                owner[cell] = upcoming


def steady_step(store: DeviceStore) -> SteadyStep:
    """The steady step for ``store``'s device: the direct one (on CUDA when PyTorch's CUDA runtime can be
    called; a warning when not, and the plain one)."""
    calls = store.runtime.direct_calls()
    return SteadyStep(store) if calls is None else DirectStep(store, calls)


class RecordedStep(SteadyStep):
    """A steady forward that also records device timings for ``report`` and ``trace``."""

    __slots__ = ("recorder",)

    def __init__(self, store: DeviceStore, recorder: StepRecorder) -> None:
        super().__init__(store)
        self.recorder = recorder

    def begin(self) -> None:
        super().begin()
        self.recorder.begin()

    def pre(self, unit: Unit) -> None:
        recorder = self.recorder
        recorder.wait_start(unit.name, unit.resident, unit.nbytes)
        self.compute = self.store.runtime.current_stream()  # as in SteadyStep.pre
        if not unit.resident:
            if not holds_weights(unit, self.owner):
                self._timed_copies(unit, (), on_demand=True)
            self.compute.wait_event(unit.copy_done)
        recorder.compute_start(unit.name)

    def post(self, unit: Unit, output: Any) -> None:
        self.recorder.compute_end(unit.name)
        if unit.resident:
            return
        unit.compute_done.record(self.compute)
        pending = [u for u in unit.prefetch_next if not holds_weights(u, self.owner)]
        if pending:
            self._timed_copies(unit, pending, on_demand=False)

    def _timed_copies(self, unit: Unit, pending: list[Unit], on_demand: bool) -> None:
        copy, owner = self.copy, self.owner
        self.set_stream(copy)
        try:
            if on_demand:
                pending = [unit]
                for cell in unit.cells:
                    occupant = owner[cell]
                    if occupant is not None and occupant is not unit:
                        copy.wait_event(occupant.compute_done)
            else:
                copy.wait_event(unit.compute_done)
            for upcoming in pending:
                start, end = self.recorder.copy_events(upcoming.name, upcoming.nbytes)
                start.record(copy)
                copy_into_range(upcoming, owner, copy)
                end.record(copy)
        finally:
            self.set_stream(self.compute)


class ProfiledStep(SteadyStep):
    """A steady forward while a profiler runs (``torch.profiler.profile``, or ``emit_nvtx`` for Nsight):
    the same work, inside named ranges, so that the trace shows where the offloader waits and copies."""

    __slots__ = ()

    def pre(self, unit: Unit) -> None:
        with torch.profiler.record_function(f"flextensor.wait_for {unit.name}"):
            super().pre(unit)

    def post(self, unit: Unit, output: Any) -> None:
        if unit.prefetch_next:
            with torch.profiler.record_function(f"flextensor.prefetch_after {unit.name}"):
                super().post(unit, output)
        else:
            super().post(unit, output)


class OutsideForwardStep:
    """A unit called outside any forward of its model (a user calling one block, a tied alias such as
    ``get_input_embeddings()``): load it on demand on whatever stream is current, and mark its compute so
    later copies wait for it. ``ensure_layout`` gives units device bytes again when a failed layout left
    them without. Once a CUDA graph was captured (``graphs``), its load comes after the replays queued
    before it and the units a replay counts on are loaded again after it, as after an eager forward."""

    __slots__ = ("called", "ensure_layout", "graphs", "model_name", "store", "streamed", "warned")

    def __init__(
        self, store: DeviceStore, ensure_layout: Callable[[], None], graphs: Any, model_name: str
    ) -> None:
        self.store = store
        self.ensure_layout = ensure_layout
        self.graphs = graphs
        self.model_name = model_name
        self.called: set[int] = set()  # units called outside a forward since the last forward began
        self.streamed = 0  # how many units stream, read when ``called`` starts filling
        self.warned = False

    def pre(self, unit: Unit) -> None:
        if unit.placement is Placement.HOST:
            self.ensure_layout()
        if self.store.keep_packs:  # a pipeline component: its next switch must see this call's stream
            note_forward_stream(self.store)
        if not self.warned:
            self._notice(unit)  # after the layout: a unit given back with its component counts as laid out
        if unit.resident:
            return
        compute = self.store.runtime.current_stream()
        if not holds_weights(unit, self.store.owner):
            self.graphs.fence_begin()
            self.store.load_on_demand(unit, compute)
        compute.wait_event(unit.copy_done)

    def post(self, unit: Unit, output: Any) -> None:
        if unit.resident:
            return
        unit.compute_done.record(self.store.runtime.current_stream())
        if self.graphs.captured:
            self.graphs.restore(self.store)
            self.graphs.fence_end(self.store)

    def _notice(self, unit: Unit) -> None:
        """Warn once when every streamed unit ran outside a forward between two forwards: the model's call
        was bypassed (``model.forward(x)``), so nothing is learned or prefetched. One unit called by hand
        (a block, a tied alias) is not that."""
        if unit.resident:
            return  # a plan's resident units lose their hooks: count what every call still reaches
        if not self.called:  # the first since a forward: the plan may have changed
            self.streamed = sum(not u.resident for u in self.store.units)
        self.called.add(unit.index)
        if self.streamed > 1 and len(self.called) == self.streamed:
            self.warned = True
            logger.warning(
                "every unit of %s ran outside a call of the model itself (model.forward(...) called "
                "directly?): such calls load each unit when it runs, with no prefetch, and flextensor "
                "learns nothing from them; call the model (model(...)), or offload the module you call",
                self.model_name,
            )

    def nested_pre(self, unit: Unit, running: list[Unit], in_graph: bool) -> None:
        """A unit called inside another one called outside a forward: it borrows (see [Note: nested
        calls]), after the replays queued before it."""
        if unit.placement is Placement.HOST:
            self.ensure_layout()
        if not unit.resident and not holds_weights(unit, self.store.owner):
            self.graphs.fence_begin()
        self.store.nested.pre(unit, running, in_graph=in_graph)
        if not unit.resident:
            self.store.runtime.current_stream().wait_event(unit.copy_done)

    def nested_post(self, unit: Unit, output: Any, caller: Unit) -> None:
        self.store.nested.post(unit, caller)


class CapturedStep(SteadyStep):
    """A steady forward captured in a CUDA graph (``torch.cuda.graph``, ``mode="reduce-overhead"``).

    The copy stream joins the capture at the forward's start (it waits on the capturing stream), and the
    capturing stream waits on it after the last unit's copies, so the graph holds every copy and the
    events ordering them. The graph skips the copy of a unit only if it is one of ``assumed``: units
    whose weights are in the arena whenever a replay starts (see [Note: captured forwards]); every other
    unit it loads itself. Events recorded before the capture are not waited on (a captured stream may
    not): the device is idle when a capture begins (torch.cuda.graph synchronises first), and a replay's
    assumed units were loaded before it on its stream.
    """

    __slots__ = ("assumed", "computed", "copied", "guaranteed", "joined", "last")

    def __init__(
        self, store: DeviceStore, last: Unit | None, assumed: set[Unit], guaranteed: set[Unit]
    ) -> None:
        super().__init__(store)
        self.last = last
        self.assumed = assumed  # in the arena when any replay of this graph starts: not copied first
        self.guaranteed = guaranteed  # what every graph and eager forward leaves in the arena
        self.copied: set[Unit] = set()  # units whose copy_done was recorded in this capture
        self.computed: set[Unit] = set()  # units whose compute_done was recorded in this capture
        self.joined = False

    def begin(self) -> None:
        super().begin()
        owner, assumed = self.owner, self.assumed
        for cell, occupant in enumerate(owner):
            if occupant is not None and occupant not in assumed:
                owner[cell] = None  # in the arena now, but not at every replay's start: load it
        self.copy.wait_stream(self.compute)  # fork: the copy stream's work from here is captured
        if self.store.coded_loads is not None:
            self.store.coded_loads.begin_capture()

    def pre(self, unit: Unit) -> None:
        if not holds_weights(unit, self.owner):
            self._load(unit)
        if unit in self.copied:
            self.compute.wait_event(unit.copy_done)

    def post(self, unit: Unit, output: Any) -> None:
        pending = [u for u in unit.prefetch_next if not holds_weights(u, self.owner)]
        super().post(unit, output)  # records compute_done, then copies ``pending`` after it
        self.computed.add(unit)
        self.copied.update(pending)
        if unit is self.last:
            self.join()

    def nested_pre(self, unit: Unit, running: list[Unit], in_graph: bool) -> None:
        """As SteadyStep's, with the capture's loads, and waits only on events recorded in it."""
        self.store.nested.pre(unit, running, self._load_on_stream, in_graph, capture_step=True)
        if unit in self.copied:
            self.compute.wait_event(unit.copy_done)

    def nested_post(self, unit: Unit, output: Any, caller: Unit) -> None:
        self.computed.add(unit)  # first: a caller it displaced loads after its compute_done
        self.store.nested.post(unit, caller, self._load_on_stream)

    def _load_on_stream(self, unit: Unit, compute: Any) -> None:
        self._load(unit)

    def join(self) -> None:
        """Load any assumed unit the forward left out, then make the capturing stream wait for the copy
        stream (a capture cannot end with work left on it). Once, inside the capture."""
        if self.joined:
            return
        self.joined = True
        for unit in self.guaranteed:
            if not holds_weights(unit, self.owner):
                self._load(unit)  # the next replay starts from what this one leaves
        self.compute.wait_stream(self.copy)
        if self.store.coded_loads is not None:  # the decode stream joins too (host/coded_packs.py)
            self.store.coded_loads.fence(self.compute)

    def _load(self, unit: Unit) -> None:
        copy, owner = self.copy, self.owner
        self.set_stream(copy)
        try:
            for cell in unit.cells:
                occupant = owner[cell]
                if occupant is not None and occupant is not unit and occupant in self.computed:
                    copy.wait_event(occupant.compute_done)
            copy_into_range(unit, owner, copy)
            self.copied.add(unit)
        finally:
            self.set_stream(self.compute)
