"""Profiling forwards: per-unit compute time and activation memory, measured with device events.

Used only while the engine is in its profiling phase; steady state records nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from .measurements import LinkModel, Measurements, UnitMeasurement
from .runtime import DeviceRuntime


@dataclass
class _UnitCall:
    unit: str
    nbytes: int
    before_load: Any
    start: Any
    end: Any = None
    copy_start: Any = None
    copy_end: Any = None
    memory_at_start: int = 0
    peak: int = 0


@dataclass
class _StepRecord:
    start: Any
    end: Any = None
    baseline: int = 0
    peak: int = 0
    calls: list[_UnitCall] = field(default_factory=list)


@dataclass(frozen=True)
class UnitSample:
    """One unit in one profiled step (seconds, bytes)."""

    unit: str
    nbytes: int
    compute_s: float
    gap_before_s: float
    copy_s: float
    activation_bytes: int


@dataclass(frozen=True)
class StepSample:
    units: tuple[UnitSample, ...]
    tail_s: float
    step_s: float
    baseline_bytes: int
    activation_peak_bytes: int


class StepProfiler:
    """Records events around each unit of a profiling forward and turns them into a StepSample."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self._step: _StepRecord | None = None
        self._open: dict[str, _UnitCall] = {}

    def begin_step(self) -> None:
        rt = self.runtime
        rt.reset_peak_memory()
        start = rt.event(timing=True)
        start.record(rt.current_stream())
        self._step = _StepRecord(start=start, baseline=rt.memory_allocated())
        self._open.clear()

    def _fold_peak(self) -> int:
        """Fold the allocator's peak since the last reset into the step's peak, then reset it."""
        assert self._step is not None
        peak = self.runtime.max_memory_allocated()
        self._step.peak = max(self._step.peak, peak)
        self.runtime.reset_peak_memory()
        return peak

    def before_load(self, unit: str, nbytes: int) -> _UnitCall:
        assert self._step is not None
        rt = self.runtime
        self._fold_peak()
        before = rt.event(timing=True)
        before.record(rt.current_stream())
        call = _UnitCall(unit, nbytes, before_load=before, start=None, memory_at_start=rt.memory_allocated())
        self._step.calls.append(call)
        self._open[unit] = call
        return call

    def copy_events(self, unit: str) -> tuple[Any, Any] | None:
        """Events to record around a copy issued for ``unit`` right now (None outside a unit's load)."""
        call = self._open.get(unit)
        if call is None or call.copy_start is not None:
            return None
        call.copy_start = self.runtime.event(timing=True)
        call.copy_end = self.runtime.event(timing=True)
        return call.copy_start, call.copy_end

    def compute_start(self, unit: str) -> None:
        call = self._open[unit]
        call.start = self.runtime.event(timing=True)
        call.start.record(self.runtime.current_stream())

    def unit_end(self, unit: str) -> None:
        call = self._open.pop(unit, None)
        if call is None:
            return
        call.end = self.runtime.event(timing=True)
        call.end.record(self.runtime.current_stream())
        call.peak = max(0, self._fold_peak() - call.memory_at_start)

    def end_step(self) -> StepSample:
        assert self._step is not None
        rt = self.runtime
        step = self._step
        step.end = rt.event(timing=True)
        step.end.record(rt.current_stream())
        self._fold_peak()
        rt.synchronize()  # profiling only: read the events
        seconds = lambda a, b: max(0.0, a.elapsed_time(b) / 1000.0)  # noqa: E731
        merged: dict[str, dict[str, float]] = {}
        order: list[str] = []
        previous_end = step.start
        for call in step.calls:
            if call.end is None or call.start is None:
                continue
            entry = merged.get(call.unit)
            if entry is None:
                order.append(call.unit)
                entry = merged[call.unit] = {
                    "nbytes": call.nbytes,
                    "compute": 0.0,
                    "gap": seconds(previous_end, call.before_load),
                    "copy": 0.0,
                    "act": 0,
                }
            entry["compute"] += seconds(call.start, call.end)
            if call.copy_start is not None and call.copy_end is not None:
                entry["copy"] += seconds(call.copy_start, call.copy_end)
            entry["act"] = max(entry["act"], call.peak)
            previous_end = call.end
        units = tuple(
            UnitSample(
                unit=u,
                nbytes=int(merged[u]["nbytes"]),
                compute_s=merged[u]["compute"],
                gap_before_s=merged[u]["gap"],
                copy_s=merged[u]["copy"],
                activation_bytes=int(merged[u]["act"]),
            )
            for u in order
        )
        sample = StepSample(
            units=units,
            tail_s=seconds(previous_end, step.end),
            step_s=seconds(step.start, step.end),
            baseline_bytes=step.baseline,
            activation_peak_bytes=max(0, step.peak - step.baseline),
        )
        self._step = None
        return sample


def combine_samples(
    samples: list[StepSample],
    link: LinkModel,
    planned_bytes: int,
    input_shapes: tuple[str, ...] = (),
) -> Measurements:
    """Median over profiled steps, per unit. ``planned_bytes``: device bytes flextensor held at the step's
    start (arena and resident units), which the planner re-decides, so they leave the baseline."""
    last = samples[-1]

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    units = []
    for i, unit in enumerate(last.units):
        same = [s.units[i] for s in samples if i < len(s.units) and s.units[i].unit == unit.unit]
        units.append(
            UnitMeasurement(
                name=unit.unit,
                nbytes=unit.nbytes,
                compute_s=med([u.compute_s for u in same]),
                gap_before_s=med([u.gap_before_s for u in same]),
                activation_bytes=max(u.activation_bytes for u in same),
            )
        )
    return Measurements(
        units=tuple(units),
        link=link,
        tail_s=med([s.tail_s for s in samples]),
        baseline_bytes=max(0, last.baseline_bytes - planned_bytes),
        activation_peak_bytes=max(s.activation_peak_bytes for s in samples),
        input_shapes=input_shapes,
    )
