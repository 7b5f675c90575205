"""A pipeline lays its next component out at the end of the previous one's run (see [Note: the next
component ahead] in pipelines.py), on the tiny two-expert Wan2.2 pipeline and the CPU engine."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import flextensor
from flextensor.api import engine_of
from flextensor.slots import DeviceStore

pytest.importorskip("diffusers")
from real_models import run_wan_pipeline, tiny_wan_pipeline
from test_pipelines import modules_of, offloaded_pipeline, run_until_steady


@pytest.fixture(scope="module")
def references() -> dict[int, torch.Tensor]:
    """Generations of the pipeline without offload, by number of steps."""
    with torch.no_grad():
        pipe = tiny_wan_pipeline()
        return {steps: run_wan_pipeline(pipe, steps) for steps in (2, 4, 6)}


def held_bytes(pipe) -> int:
    return sum(flextensor.status(m).device_bytes_held for m in modules_of(pipe).values())


@torch.no_grad()
def test_the_second_expert_is_in_place_when_the_switch_comes(references: dict[int, torch.Tensor]) -> None:
    """Under the tightest budget the VAE needs it all, but the two experts fit together: transformer_2 is
    laid out at the end of the transformer's run, before its first step, and the budget still holds."""
    pipe = offloaded_pipeline()
    pipeline = pipe._flextensor_pipeline
    run_until_steady(pipe)
    at_first_steps: list[bool] = []
    over_budget: list[int] = []

    def before_engine(module, args) -> None:  # runs before flextensor's own pre-hook (prepended later)
        if pipeline._run[0] != "transformer_2":  # its first step: the transformer's run just ended
            at_first_steps.append(engine_of(module).laid_out)
        if held_bytes(pipe) > pipeline.budget_bytes:
            over_budget.append(held_bytes(pipe))

    pipe.transformer_2.register_forward_pre_hook(before_engine, prepend=True)
    for _ in range(2):
        before = pipeline.laid_out_ahead
        at_first_steps.clear()
        assert torch.equal(run_wan_pipeline(pipe), references[4])
        assert pipeline.laid_out_ahead > before
        assert at_first_steps[0], "transformer_2 was not laid out before its first step"
    assert not over_budget
    assert held_bytes(pipe) <= pipeline.budget_bytes


@torch.no_grad()
def test_generations_with_other_step_counts_stay_bitwise(references: dict[int, torch.Tensor]) -> None:
    """A run longer than the last one makes the guess wrong: the component laid out ahead is not the one
    that runs next (it waits, or gives its memory back); outputs are the same either way."""
    pipe = offloaded_pipeline()
    pipeline = pipe._flextensor_pipeline
    run_until_steady(pipe)
    events: list[tuple[str, str]] = []  # ("ahead", component) and ("step", component), in order
    for name in modules_of(pipe):
        engine = engine_of(getattr(pipe, name))
        engine.before_step = record_step(engine.before_step, name, events)
        engine.after_step = record_ahead(engine.after_step, pipeline, name, events)
    for steps in (6, 2, 4, 4):
        assert torch.equal(run_wan_pipeline(pipe, steps), references[steps]), steps
    wrong = [
        laid for (kind, laid), (_, came) in itertools.pairwise(events) if kind == "ahead" and came != laid
    ]
    assert wrong, events  # the 6-step generation's longer transformer run: transformer_2 waited


def record_step(callback, name: str, events: list):
    def before_step(engine) -> None:
        events.append(("step", name))
        callback(engine)

    return before_step


def record_ahead(callback, pipeline, name: str, events: list):
    def after_step(engine) -> None:
        before = pipeline.laid_out_ahead
        callback(engine)
        if pipeline.laid_out_ahead > before:
            events.append(("ahead", pipeline._runs[name][1]))

    return after_step


@torch.no_grad()
def test_a_layout_ahead_that_fails_is_warned_and_left_to_the_step(
    references: dict[int, torch.Tensor], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pipe = offloaded_pipeline()
    run_until_steady(pipe)
    real_lay_out = DeviceStore.lay_out

    def lay_out(self, *args, **kwargs) -> None:
        real_lay_out(self, *args, **kwargs)
        if kwargs.get("ahead", args[4] if len(args) > 4 else False):
            raise torch.OutOfMemoryError("no room ahead")  # after taking its memory: given back

    monkeypatch.setattr(DeviceStore, "lay_out", lay_out)
    before = pipe._flextensor_pipeline.laid_out_ahead
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        assert torch.equal(run_wan_pipeline(pipe), references[4])
    assert "laying the plan out ahead of the next forward failed" in caplog.text
    assert pipe._flextensor_pipeline.laid_out_ahead == before
    monkeypatch.undo()
    assert torch.equal(run_wan_pipeline(pipe), references[4])
