"""Profiling: per-unit compute time and activation memory, measured with device events, made robust.

The driver (:class:`ProfilingStep`) loads each unit on demand (weights already in place before its compute
starts) and times its copy and its compute; :class:`StepProfiler` folds the allocator's peak per unit.
:func:`combine_samples` turns the timed forwards into the planner's :class:`Measurements`.

[Note: robust measurements]
A device time can only be inflated by noise (another process, clock ramp-up, a first call's one-off
work), never deflated. So every timed forward counts, the discovery forward included (its units also run
with their weights already loaded), and each unit's compute, gap and the tail are the minimum over them:
one noisy profiling forward (152 ms recorded against 3 ms real) no longer becomes the plan. When the
samples disagree by more than :data:`DISAGREEMENT` in total compute (a profiled forward slower than the
discovery forward, which does more host work, is suspect), the engine profiles one more forward (at most
:data:`EXTRA_FORWARDS` times). Activation peaks take the maximum: memory must fit the worst.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from flextensor.device.runtime import DeviceRuntime
from flextensor.phases.timeline import Timeline
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.store.copies import copy_into_range, holds_weights
from flextensor.store.device_store import DeviceStore
from flextensor.store.units import Unit

__all__ = [
    "DISAGREEMENT",
    "EXTRA_FORWARDS",
    "ProfilingStep",
    "StepProfiler",
    "StepSample",
    "UnitSample",
    "combine_samples",
    "sample_from_timeline",
    "samples_disagree",
]

DISAGREEMENT = 2.0
"""Two timed forwards whose compute differs by more than this factor: one of them was noisy."""

EXTRA_FORWARDS = 2
"""At most this many forwards are profiled beyond ``profiling_forwards`` when samples disagree."""


@dataclass(frozen=True)
class UnitSample:
    """One unit in one timed step (seconds, bytes)."""

    unit: str
    nbytes: int
    compute_s: float
    gap_before_s: float
    copy_s: float
    activation_bytes: int


@dataclass(frozen=True)
class StepSample:
    """One timed step: its units in execution order, the tail after the last, memory at its start."""

    units: tuple[UnitSample, ...]
    tail_s: float
    step_s: float
    baseline_bytes: int
    activation_peak_bytes: int

    @property
    def compute_s(self) -> float:
        return sum(u.compute_s for u in self.units)


@dataclass
class _UnitCall:
    unit: str
    nbytes: int
    before_load: Any
    start: Any = None
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
        call = _UnitCall(unit, nbytes, before_load=before, memory_at_start=rt.memory_allocated())
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


def graphs_compiled() -> int:
    """How many graphs Dynamo has compiled in this process (0 while it is not loaded)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class ProfilingStep:
    """The unit hooks' driver during a profiling forward: load on demand, time the copy and the compute."""

    def __init__(self, store: DeviceStore) -> None:
        self.store = store
        self.profiler = StepProfiler(store.runtime)
        self._compute: Any = None
        self._graphs_before = 0

    def begin(self) -> None:
        self._compute = self.store.runtime.current_stream()
        self._graphs_before = graphs_compiled()
        self.profiler.begin_step()

    def end(self) -> StepSample:
        return self.profiler.end_step()

    def compiled_during(self) -> bool:
        """Whether torch.compile compiled a graph during this forward: its times and memory peak are the
        compiler's (autotuning buffers included), not the compiled model's."""
        return graphs_compiled() != self._graphs_before

    def pre(self, unit: Unit) -> None:
        profiler = self.profiler
        profiler.before_load(unit.name, unit.nbytes)
        self._compute = self.store.runtime.current_stream()  # as in SteadyStep.pre
        if not unit.resident:
            if not holds_weights(unit, self.store.owner):
                self._timed_load(unit)
            self._compute.wait_event(unit.copy_done)
        profiler.compute_start(unit.name)

    def post(self, unit: Unit, output: Any) -> None:
        if not unit.resident:
            unit.compute_done.record(self._compute)
        self.profiler.unit_end(unit.name)

    def nested_pre(self, unit: Unit, running: list[Unit], in_graph: bool) -> None:
        """A nesting discovery did not see: borrow (see [Note: nested calls]); the engine then drops
        this forward's sample and learns again."""
        self.store.nested.pre(unit, running, in_graph=in_graph)
        if not unit.resident:
            self._compute.wait_event(unit.copy_done)

    def nested_post(self, unit: Unit, output: Any, caller: Unit) -> None:
        self.store.nested.post(unit, caller)

    def _timed_load(self, unit: Unit) -> None:
        store, runtime = self.store, self.store.runtime
        stream = runtime.copy_stream
        timing = self.profiler.copy_events(unit.name)
        runtime.set_stream(stream)
        try:
            for cell in unit.cells:
                occupant = store.owner[cell]
                if occupant is not None and occupant is not unit:
                    stream.wait_event(occupant.compute_done)
            if timing is not None:
                timing[0].record(stream)
            copy_into_range(unit, store.owner, stream)
            if timing is not None:
                timing[1].record(stream)
        finally:
            runtime.set_stream(self._compute)


def sample_from_timeline(timeline: Timeline) -> StepSample:
    """A StepSample from a recorded step (the discovery forward): compute, gaps and tail only."""
    units = []
    previous_end = 0.0
    for unit in timeline.units:
        gap_start = unit.compute_start_s - unit.wait_s
        units.append(
            UnitSample(
                unit=unit.unit,
                nbytes=unit.nbytes,
                compute_s=unit.compute_s,
                gap_before_s=max(0.0, gap_start - previous_end),
                copy_s=unit.copy_s or 0.0,
                activation_bytes=0,
            )
        )
        previous_end = unit.compute_end_s
    return StepSample(
        units=tuple(units),
        tail_s=max(0.0, timeline.step_s - previous_end),
        step_s=timeline.step_s,
        baseline_bytes=0,
        activation_peak_bytes=0,
    )


def samples_disagree(profiled: list[StepSample], discovery: StepSample | None) -> bool:
    """Whether the latest profiled forward looks noisy: its compute exceeds by more than DISAGREEMENT
    that of an earlier profiled forward or of the discovery forward (which runs the same units with more
    host work, so it is normally the slower one). A quiet forward after a noisy one settles it."""
    if not profiled or not profiled[-1].units:
        return False
    others = [s.compute_s for s in profiled[:-1] if s.units]
    if discovery is not None and discovery.units:
        others.append(discovery.compute_s)
    return bool(others) and profiled[-1].compute_s > DISAGREEMENT * max(min(others), 1e-9)


def combine_samples(
    samples: list[StepSample],
    link: LinkModel,
    planned_bytes: int,
    input_shapes: tuple[str, ...] = (),
    timing_only: tuple[StepSample, ...] = (),
) -> Measurements:
    """The planner's measurements from profiled ``samples`` (see [Note: robust measurements]).

    ``timing_only``: further timed forwards (discovery) whose times count but whose memory does not.
    ``planned_bytes``: device bytes flextensor held at the step's start (arena and resident units), which
    the planner re-decides, so they leave the baseline. Units are those of the last profiled sample.
    """
    last = samples[-1]
    timed = [*samples, *timing_only]
    by_name = [{u.unit: u for u in s.units} for s in timed]
    profiled = by_name[: len(samples)]
    units = []
    for unit in last.units:
        same = [index[unit.unit] for index in by_name if unit.unit in index]
        units.append(
            UnitMeasurement(
                name=unit.unit,
                nbytes=unit.nbytes,
                compute_s=min(u.compute_s for u in same),
                gap_before_s=min(u.gap_before_s for u in same),
                activation_bytes=max(
                    index[unit.unit].activation_bytes for index in profiled if unit.unit in index
                ),
            )
        )
    return Measurements(
        units=tuple(units),
        link=link,
        tail_s=min(s.tail_s for s in timed),
        baseline_bytes=max(0, last.baseline_bytes - planned_bytes),
        activation_peak_bytes=max(s.activation_peak_bytes for s in samples),
        input_shapes=input_shapes,
    )
