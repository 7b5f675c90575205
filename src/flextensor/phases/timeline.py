"""Recording one steady-state step: when each copy and each unit's compute ran on the device.

The engine records only when a recorder is armed (the first steady step after each plan, or on request
through ``flextensor.record_next_step``); otherwise its hooks skip this module entirely. Events are read
lazily, when a report or trace asks, so recording adds no synchronisation to the step itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from flextensor.device.runtime import DeviceRuntime
from flextensor.errors import PlanError


@dataclass
class _UnitEvents:
    unit: str
    resident: bool
    nbytes: int
    copy_start: Any = None
    copy_end: Any = None
    wait_start: Any = None
    compute_start: Any = None
    compute_end: Any = None


@dataclass(frozen=True)
class UnitTiming:
    """One unit in a recorded step. Seconds from the step's start; copy times None when not copied."""

    unit: str
    resident: bool
    nbytes: int
    compute_start_s: float
    compute_end_s: float
    wait_s: float
    copy_start_s: float | None = None
    copy_end_s: float | None = None

    @property
    def compute_s(self) -> float:
        return self.compute_end_s - self.compute_start_s

    @property
    def copy_s(self) -> float | None:
        if self.copy_start_s is None or self.copy_end_s is None:
            return None
        return self.copy_end_s - self.copy_start_s


@dataclass(frozen=True)
class Timeline:
    """A recorded step: per-unit timings (execution order), the step's length and its memory peak."""

    units: tuple[UnitTiming, ...]
    step_s: float
    peak_allocated_bytes: int
    streamed_bytes: int
    copies: tuple[tuple[str, float, float], ...] = field(default_factory=tuple)

    @property
    def exposed_wait_s(self) -> float:
        return sum(u.wait_s for u in self.units)

    def to_dict(self) -> dict[str, Any]:
        return {
            "units": [asdict(u) for u in self.units],
            "step_s": self.step_s,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "streamed_bytes": self.streamed_bytes,
            "exposed_wait_s": self.exposed_wait_s,
            "copies": [list(c) for c in self.copies],
        }


class StepRecorder:
    """Collects events for one step; ``timeline()`` turns them into seconds (waiting on the device)."""

    def __init__(self, runtime: DeviceRuntime, forward: int = 0) -> None:
        self.runtime = runtime
        self.forward = forward  # which forward of the model this records (0 = the first)
        self.start = runtime.event(timing=True)
        self.end: Any = None
        self.units: dict[str, _UnitEvents] = {}
        self.order: list[str] = []
        self.copies: list[tuple[str, Any, Any, int]] = []  # every copy issued during the step
        self.peak = 0
        self.finished = False
        self._timeline: Timeline | None = None

    def begin(self) -> None:
        self.runtime.reset_peak_memory()
        self.start.record(self.runtime.current_stream())

    def _entry(self, unit: str, resident: bool, nbytes: int) -> _UnitEvents:
        entry = self.units.get(unit)
        if entry is None:
            entry = self.units[unit] = _UnitEvents(unit, resident, nbytes)
            self.order.append(unit)
        return entry

    def copy_events(self, unit: str, nbytes: int) -> tuple[Any, Any]:
        start, end = self.runtime.event(timing=True), self.runtime.event(timing=True)
        self.copies.append((unit, start, end, nbytes))
        return start, end

    def wait_start(self, unit: str, resident: bool, nbytes: int) -> None:
        entry = self._entry(unit, resident, nbytes)
        if entry.wait_start is None:
            entry.wait_start = self.runtime.event(timing=True)
            entry.wait_start.record(self.runtime.current_stream())

    def compute_start(self, unit: str) -> None:
        entry = self.units[unit]
        if entry.compute_start is None:
            entry.compute_start = self.runtime.event(timing=True)
            entry.compute_start.record(self.runtime.current_stream())

    def compute_end(self, unit: str) -> None:
        entry = self.units.get(unit)
        if entry is not None and entry.compute_start is not None:
            entry.compute_end = self.runtime.event(timing=True)
            entry.compute_end.record(self.runtime.current_stream())

    def finish(self) -> None:
        self.end = self.runtime.event(timing=True)
        self.end.record(self.runtime.current_stream())
        self.peak = self.runtime.max_memory_allocated()
        self.finished = True

    def timeline(self) -> Timeline:
        """Seconds from the step's start for everything recorded (waits for the recorded work once)."""
        if self._timeline is not None:
            return self._timeline
        if not self.finished:
            raise PlanError("the recorded step has not finished yet")
        self.end.synchronize()
        for _, _, copy_end, _ in self.copies:
            copy_end.synchronize()

        def at(event: Any) -> float:
            return self.start.elapsed_time(event) / 1000.0

        # A unit's copy is the last one that started before its compute did; a later one is a prefetch
        # for the next step and belongs to the copy track only.
        copies = []
        for unit, c_start, c_end, _ in self.copies:
            copies.append((unit, at(c_start), at(c_end)))
        starts = {name: at(e.compute_start) for name, e in self.units.items() if e.compute_start is not None}
        copy_of: dict[str, tuple[float, float]] = {}
        for unit, start, end in copies:
            if unit in starts and start <= starts[unit]:
                copy_of[unit] = (start, end)
        units = []
        for name in self.order:
            e = self.units[name]
            if e.compute_start is None or e.compute_end is None:
                continue
            span = copy_of.get(name)
            units.append(
                UnitTiming(
                    unit=name,
                    resident=e.resident,
                    nbytes=e.nbytes,
                    compute_start_s=at(e.compute_start),
                    compute_end_s=at(e.compute_end),
                    wait_s=max(0.0, at(e.compute_start) - at(e.wait_start)) if e.wait_start else 0.0,
                    copy_start_s=None if span is None else span[0],
                    copy_end_s=None if span is None else span[1],
                )
            )
        streamed = sum(nbytes for _, _, _, nbytes in self.copies)
        # The step ends when both streams are idle: copies issued in it (next-step prefetches included)
        # are what a caller that reads the output waits for too.
        copy_tail = max((end for _, _, end in copies), default=0.0)
        self._timeline = Timeline(
            units=tuple(units),
            step_s=max(at(self.end), copy_tail),
            peak_allocated_bytes=self.peak,
            streamed_bytes=streamed,
            copies=tuple(copies),
        )
        return self._timeline
