"""A pipeline lays its next component out at the end of the previous one's run (see [Note: the next
component ahead] in pipelines/pipeline.py), on the tiny two-expert Wan2.2 pipeline and the CPU engine."""

from __future__ import annotations

import itertools
import logging
from unittest.mock import Mock

import pytest
import torch

import flextensor
from flextensor.api import engine_of
from flextensor.store.device_store import DeviceStore

pytest.importorskip("diffusers")
from real_models import run_wan_pipeline, tiny_wan_pipeline
from test_pipelines import modules_of, offloaded_pipeline, run_until_steady, tightest_budget


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
    def after_step(engine) -> None:  # a layout ahead, or a switch at the run's end
        before = pipeline.laid_out_ahead + pipeline.switched_at_run_end
        callback(engine)
        if pipeline.laid_out_ahead + pipeline.switched_at_run_end > before:
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


@torch.no_grad()
def test_what_a_run_leaves_outside_at_its_end_does_not_hold_the_next_layout_back(
    references: dict[int, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the end of a run the caller holds that run's output (and whatever else it keeps), which the next
    component's plan did not count: its layout ahead still goes by the plan's peak, and its step's own
    make-room counts what is outside then. Here the outside looks far larger than the budget while a run
    ends (the allocator's counters are faked on the CPU engine): transformer_2 is laid out ahead as
    before (it was never laid out ahead on the H200 while that growth counted)."""
    from flextensor.engine.plan_states import PlanStates

    pipe = offloaded_pipeline()
    pipeline = pipe._flextensor_pipeline
    run_until_steady(pipe)
    ending = [False]
    real_make_room, real_grown = pipeline._make_room, PlanStates.grown_outside

    def make_room(name: str, keep: str | None) -> bool:
        ending[0] = keep is not None  # a layout ahead, at the end of ``keep``'s run
        try:
            return real_make_room(name, keep)
        finally:
            ending[0] = False

    def grown_outside(self, entry, beside: int) -> int:
        return 10 * pipeline.budget_bytes if ending[0] else real_grown(self, entry, beside)

    monkeypatch.setattr(pipeline, "_make_room", make_room)
    monkeypatch.setattr(PlanStates, "grown_outside", grown_outside)
    before = pipeline.laid_out_ahead
    assert torch.equal(run_wan_pipeline(pipe), references[4])
    assert pipeline.laid_out_ahead > before


def room_for_the_text_encoder_beside_the_vae() -> object:
    """The tiny Wan pipeline offloaded 8 % above the tightest budget: the text encoder gives its memory
    back for the experts and fits beside the VAE at its end (where it was laid out ahead across the end
    of a call before)."""
    pipe = tiny_wan_pipeline()
    budget = int(1.08 * tightest_budget(pipe))
    flextensor.offload(pipe, flextensor.OffloadConfig(device="cpu", gpu_memory_budget=budget))
    return pipe


def watch_layouts_ahead(pipe) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    for name in modules_of(pipe):
        engine = engine_of(getattr(pipe, name))
        engine.after_step = record_ahead(engine.after_step, pipe._flextensor_pipeline, name, events)
    return events


@torch.no_grad()
def test_nothing_is_laid_out_ahead_across_the_end_of_a_call(references: dict[int, torch.Tensor]) -> None:
    """The VAE's run ends each call; the text encoder that follows begins the next one, after the
    pipeline's post-processing and whatever the caller does in between (memory no plan counts: on the
    H200 its layout ahead took the peak past the budget). Layouts ahead within a call go on."""
    pipe = room_for_the_text_encoder_beside_the_vae()
    run_until_steady(pipe)
    events = watch_layouts_ahead(pipe)
    for _ in range(3):
        assert torch.equal(run_wan_pipeline(pipe), references[4])
    laid = [component for _, component in events]
    assert "transformer_2" in laid, events
    assert "text_encoder" not in laid, events


@torch.no_grad()
def test_nor_after_a_call_that_raised_before_its_end(
    references: dict[int, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that raises after the VAE never reaches maybe_free_model_hooks(): the switch to the next
    call's text encoder is still known to cross a call's end."""
    pipe = room_for_the_text_encoder_beside_the_vae()
    run_until_steady(pipe)
    events = watch_layouts_ahead(pipe)
    monkeypatch.setattr(
        pipe.video_processor, "postprocess_video", Mock(side_effect=RuntimeError("disk full"))
    )
    with pytest.raises(RuntimeError, match="disk full"):
        run_wan_pipeline(pipe)
    monkeypatch.undo()
    for _ in range(2):
        assert torch.equal(run_wan_pipeline(pipe), references[4])
    assert "text_encoder" not in [component for _, component in events], events
    assert not engine_of(pipe.text_encoder).laid_out


@torch.no_grad()
def test_a_call_ending_where_the_vae_came_next_leaves_no_more_held(
    references: dict[int, torch.Tensor],
) -> None:
    """A call with ``output_type="latent"`` ends after ``transformer_2``, where the VAE came next before:
    the guess at its run's end is wrong once. Under the tightest budget the VAE does not fit beside it,
    and its layout would hold more than ``transformer_2`` gives back, so no switch is made there: what
    stays held while the caller goes on is no more than the step would have left."""
    pipe = offloaded_pipeline()
    run_until_steady(pipe)
    held_before = held_bytes(pipe)
    vae = engine_of(pipe.vae)
    pipe(
        prompt="a cat runs in the snow", negative_prompt="blurry", height=16, width=16, num_frames=1,
        num_inference_steps=4, guidance_scale=3.0, generator=torch.Generator().manual_seed(7),
        output_type="latent", max_sequence_length=8,
    )  # fmt: skip
    assert not vae.laid_out
    assert held_bytes(pipe) <= max(held_before, flextensor.status(pipe.transformer_2).device_bytes_held)
    assert torch.equal(run_wan_pipeline(pipe), references[4])
