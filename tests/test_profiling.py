"""Profiled forwards -> the planner's measurements, robust to one noisy forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor
from flextensor.phases.profiling import (
    StepSample,
    UnitSample,
    combine_samples,
    sample_from_timeline,
    samples_disagree,
)
from flextensor.phases.timeline import Timeline, UnitTiming
from flextensor.plan.measurements import LinkModel
from streaming import streaming_config

LINK = LinkModel.constant(1e9)


def _sample(computes: list[float], activation: int = 0, tail: float = 0.01) -> StepSample:
    units = tuple(
        UnitSample(f"u{i}", 4096, c, gap_before_s=0.001 * (i + 1), copy_s=0.002, activation_bytes=activation)
        for i, c in enumerate(computes)
    )
    return StepSample(
        units, tail_s=tail, step_s=sum(computes) + tail, baseline_bytes=100, activation_peak_bytes=activation
    )


def test_each_unit_takes_its_fastest_compute_and_the_worst_memory() -> None:
    noisy = _sample([0.152, 0.003, 0.003], activation=10, tail=0.2)
    quiet = _sample([0.003, 0.004, 0.002], activation=30, tail=0.01)
    m = combine_samples([noisy, quiet], LINK, planned_bytes=40, input_shapes=("x:(1,)",))
    assert [u.compute_s for u in m.units] == [0.003, 0.003, 0.002]
    assert [u.activation_bytes for u in m.units] == [30, 30, 30]
    assert m.tail_s == 0.01 and m.activation_peak_bytes == 30
    assert m.baseline_bytes == 60 and m.input_shapes == ("x:(1,)",)


def test_the_discovery_forward_counts_for_time_not_for_memory() -> None:
    profiled = _sample([0.152, 0.003], activation=10)
    discovery = _sample([0.004, 0.005], activation=10**9)
    m = combine_samples([profiled], LINK, planned_bytes=0, timing_only=(discovery,))
    assert [u.compute_s for u in m.units] == [0.004, 0.003]
    assert m.activation_peak_bytes == 10 and [u.activation_bytes for u in m.units] == [10, 10]


def test_a_profiled_forward_much_slower_than_discovery_is_noisy() -> None:
    quiet, noisy, discovery = _sample([0.003] * 3), _sample([0.152, 0.003, 0.003]), _sample([0.004] * 3)
    assert not samples_disagree([quiet], discovery)  # discovery is normally the slower one
    assert samples_disagree([noisy], discovery)
    assert samples_disagree([quiet, noisy], None)
    assert not samples_disagree([noisy, quiet], discovery)  # a quiet forward after a noisy one settles it
    assert not samples_disagree([quiet], None) and not samples_disagree([], discovery)


def test_a_recorded_step_becomes_a_sample() -> None:
    timeline = Timeline(
        units=(
            UnitTiming("a", False, 8, compute_start_s=0.002, compute_end_s=0.005, wait_s=0.001),
            UnitTiming("b", False, 8, compute_start_s=0.007, compute_end_s=0.010, wait_s=0.0),
        ),
        step_s=0.012,
        peak_allocated_bytes=0,
        streamed_bytes=16,
    )
    sample = sample_from_timeline(timeline)
    assert [u.compute_s for u in sample.units] == pytest.approx([0.003, 0.003])
    assert [u.gap_before_s for u in sample.units] == pytest.approx([0.001, 0.002])
    assert sample.tail_s == pytest.approx(0.002)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_one_noisy_profiling_forward_does_not_become_the_plan() -> None:
    # A pause in the middle of the profiling forward (another process, a clock ramping up): it is
    # profiled again, and the plan's prediction stays near the real step, not 200 ms longer (the bound
    # is half the pause, so a busy machine's slower quiet forwards still pass).
    import time

    model = _Stack()
    flextensor.offload(model, streaming_config(model, ["layers.*"]))
    calls = {"n": 0}

    def pause_once(module: nn.Module, args: tuple) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the profiling forward's first unit (discovery is the first call)
            time.sleep(0.2)

    handle = model.layers[0].register_forward_pre_hook(pause_once)
    x = torch.randn(2, 32)
    with torch.no_grad():
        forwards = 0
        while flextensor.phase(model) != "inference":
            model(x)
            forwards += 1
    handle.remove()
    plan = flextensor.status(model).plan
    assert plan is not None and plan.predicted_step_s < 0.1
    # discovery, the noisy profiling forward, and the one profiled again (on a loaded machine that one
    # may be noisy too, and profiled once more: a full suite run here saw 4 once)
    assert forwards >= 3


def test_a_torch_profiler_sees_the_offloaders_waits_and_copies() -> None:
    model = _Stack()
    flextensor.offload(model, streaming_config(model, ["layers.*"]))
    x = torch.randn(2, 32)
    with torch.no_grad():
        for _ in range(4):
            model(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(x)
    names = {event.name for event in prof.events()}
    assert {f"flextensor.wait_for layers.{i}" for i in range(4)} <= names
    assert any(name.startswith("flextensor.prefetch_after") for name in names)
