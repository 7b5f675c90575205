"""The device memory budget: refused at offload() when no plan can hold its units in flight, changed on an
offloaded model or pipeline with set_budget (a model whose plan did not fit recovers), and BudgetError's
numbers as attributes."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import LEARN
from flextensor import api
from flextensor.errors import BudgetError, ConfigError, NotOffloadedError
from flextensor.pipelines.pipeline import pipeline_of
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.plan.planner import plan_offload
from real_models import llama_inputs, tiny_llama
from streaming import streaming_config

LAYERS = ["model.layers.*"]


def _slow_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A link no compute hides (10 kB/s): plans keep layers resident wherever the budget has room."""
    real_probe = api.probe_links
    monkeypatch.setattr(
        api, "probe_links", lambda store, arena: (LinkModel.constant(1e4), real_probe(store, arena)[1])
    )


@torch.no_grad()
def test_a_budget_below_the_two_largest_units_in_flight_is_refused_at_offload() -> None:
    model = tiny_llama(layers=4)
    inputs = llama_inputs()
    ref = model(inputs).logits
    before = dict(model.named_parameters())
    tight = streaming_config(model, LAYERS)
    too_small = tight.gpu_memory_budget - 1
    with pytest.raises(
        BudgetError, match=r"'model\.layers\.\d' and 'model\.layers\.\d'\) take in flight"
    ) as info:
        flextensor.offload(model, tight.model_copy(update={"gpu_memory_budget": too_small}))
    assert (info.value.needed_bytes, info.value.budget_bytes) == (tight.gpu_memory_budget, too_small)
    assert dict(model.named_parameters()) == before and torch.equal(model(inputs).logits, ref)
    with pytest.raises(NotOffloadedError):
        flextensor.phase(model)
    flextensor.offload(model, tight)  # the tightest budget that holds them is taken
    outputs = [model(inputs).logits for _ in range(LEARN + 1)]
    assert all(torch.equal(out, ref) for out in outputs) and flextensor.phase(model) == "inference"
    flextensor.release(model)


@torch.no_grad()
def test_a_model_whose_plan_does_not_fit_runs_again_after_set_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama(layers=4)
    inputs = llama_inputs()
    ref = model(inputs).logits
    config = streaming_config(model, LAYERS)
    flextensor.offload(model, config)
    activations = 3 * config.gpu_memory_budget
    # A CPU counts no memory: the forwards measure a peak of activations the budget has no room for.
    monkeypatch.setattr(api.engine_of(model).runtime, "max_memory_allocated", lambda: activations)
    errors = []
    for _ in range(LEARN + 2):
        try:
            assert torch.equal(model(inputs).logits, ref)
        except BudgetError as error:
            errors.append(error)
    assert len(errors) >= 2 and flextensor.phase(model) == "profiling"  # at every forward after the first
    needed = errors[-1].needed_bytes
    assert errors[-1].budget_bytes == config.gpu_memory_budget and needed >= activations
    flextensor.set_budget(model, needed)
    outputs = [model(inputs).logits for _ in range(LEARN + 1)]
    assert all(torch.equal(out, ref) for out in outputs) and flextensor.phase(model) == "inference"
    assert flextensor.status(model).plan.budget_bytes == needed
    flextensor.release(model)


@torch.no_grad()
def test_set_budget_plans_again_from_the_saved_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_link(monkeypatch)
    model = tiny_llama(layers=4)
    inputs = llama_inputs()
    ref = model(inputs).logits
    config = streaming_config(model, LAYERS)
    flextensor.offload(model, config)
    for _ in range(LEARN + 1):
        assert torch.equal(model(inputs).logits, ref)
    status = flextensor.status(model)
    assert status.phase == "inference" and len(status.plan.streamed) == 4  # the tightest budget: all stream
    forwards = status.forwards

    flextensor.set_budget(model, "1MiB")
    raised = flextensor.status(model).plan
    assert raised.budget_bytes == 2**20 and not raised.streamed  # room for every layer: none streams
    assert torch.equal(model(inputs).logits, ref)
    status = flextensor.status(model)
    assert status.phase == "inference" and status.forwards == forwards + 1  # no forward learned again
    assert status.device_bytes_held >= sum(u.nbytes for u in status.units)  # laid out as planned

    with pytest.raises(BudgetError) as info:
        flextensor.set_budget(model, config.gpu_memory_budget - 1)
    assert info.value.needed_bytes == config.gpu_memory_budget
    with pytest.raises(ConfigError, match="byte size"):
        flextensor.set_budget(model, "ten gigs")
    assert flextensor.status(model).plan == raised  # refused: nothing changed
    assert torch.equal(model(inputs).logits, ref)

    flextensor.set_budget(model, config.gpu_memory_budget)  # lowered again: every layer streams
    assert len(flextensor.status(model).plan.streamed) == 4
    assert torch.equal(model(inputs).logits, ref) and torch.equal(model(inputs).logits, ref)
    assert flextensor.phase(model) == "inference"
    flextensor.release(model)


@torch.no_grad()
def test_set_budget_on_a_pipeline_changes_every_components_and_the_shared_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _slow_link(monkeypatch)
    torch.manual_seed(0)
    parts = {name: nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))) for name in ("first", "second")}
    x = torch.randn(2, 64)
    expected = parts["second"](parts["first"](x))
    config = flextensor.OffloadConfig(
        device="cpu", include_patterns=["first.*", "second.*"], gpu_memory_budget="40KiB"
    )
    flextensor.offload(parts, config)
    for _ in range(LEARN + 2):
        assert torch.equal(parts["second"](parts["first"](x)), expected)
    assert flextensor.phase(parts) == "inference"
    with pytest.raises(BudgetError):
        flextensor.set_budget(parts, "8KiB")  # below two layers in flight: nothing changes
    assert pipeline_of(parts).budget_bytes == 40 * 2**10
    flextensor.set_budget(parts, "1MiB")
    assert pipeline_of(parts).budget_bytes == 2**20
    for module in parts.values():
        plan = flextensor.status(module).plan
        assert plan.budget_bytes == 2**20 and not plan.streamed
    for _ in range(2):
        assert torch.equal(parts["second"](parts["first"](x)), expected)
    flextensor.release(parts)


def test_budget_errors_carry_their_numbers() -> None:
    units = tuple(UnitMeasurement(f"u{i}", 8192, 1e-3, 0.0, 0) for i in range(3))
    measurements = Measurements(
        units=units,
        link=LinkModel.constant(1e9),
        tail_s=0.0,
        baseline_bytes=1000,
        activation_peak_bytes=500,
        input_shapes=(),
    )
    with pytest.raises(BudgetError) as info:
        plan_offload(measurements, 4096)
    assert (info.value.needed_bytes, info.value.budget_bytes) == (1000 + 500 + 2 * 8192, 4096)
    copy = pickle.loads(pickle.dumps(info.value))  # e.g. from a worker process
    assert (copy.needed_bytes, copy.budget_bytes, str(copy)) == (1000 + 500 + 2 * 8192, 4096, str(info.value))
