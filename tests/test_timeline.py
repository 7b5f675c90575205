"""The recorded step's bookkeeping, on the CPU runtime (host-clock events)."""

from __future__ import annotations

import torch

from flextensor.device.runtime import DeviceRuntime
from flextensor.phases.timeline import StepRecorder


def _copy(recorder: StepRecorder, unit: str) -> None:
    start, end = recorder.copy_events(unit, 100)
    start.record()
    end.record()


def test_a_units_copy_is_the_one_before_its_compute_not_the_next_steps_prefetch() -> None:
    recorder = StepRecorder(DeviceRuntime(torch.device("cpu")))
    recorder.begin()
    _copy(recorder, "u")  # this step's copy
    recorder.wait_start("u", False, 100)
    recorder.compute_start("u")
    recorder.compute_end("u")
    _copy(recorder, "u")  # prefetched for the next step, after u's compute
    recorder.finish()
    timeline = recorder.timeline()
    (unit,) = timeline.units
    first, second = timeline.copies
    assert unit.copy_start_s == first[1] and unit.copy_start_s <= unit.compute_start_s
    assert second[1] > unit.compute_start_s
    assert timeline.streamed_bytes == 200  # both copies moved bytes in this step
    assert timeline.step_s >= second[2]  # the step ends when the copy stream is idle too
