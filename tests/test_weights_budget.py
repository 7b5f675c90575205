"""A budget for the weights alone (a serving engine sizes the rest; see [Note: a budget for the weights
alone] in engine/policy.py): plans count the weights outside units instead of everything allocated at a
step's start, and the device store holds the budget's bytes in reserve until its next layout frees them."""

from __future__ import annotations

import pytest
import torch

import flextensor
from engine_helpers import CPU, LEARN, run_forwards
from flextensor.api import engine_of
from flextensor.device.runtime import DeviceRuntime
from flextensor.engine.policy import PlanPolicy
from flextensor.errors import BudgetError
from flextensor.plan.layout import UNIT_ALIGNMENT
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from spec_model import make_spec_model, spec_tokens

SLOT = 64 * UNIT_ALIGNMENT
WEIGHTS_OUTSIDE_UNITS = 3 * SLOT
KV_CACHE = 1000 * SLOT
"""What a serving engine allocated after loading: far more than the budget."""


def served_step() -> Measurements:
    """Eight one-slot layers, measured while the KV cache was allocated."""
    return Measurements(
        units=tuple(UnitMeasurement(f"layers.{i}", SLOT, 1e-3) for i in range(8)),
        link=LinkModel.constant(SLOT / 2e-3),
        baseline_bytes=WEIGHTS_OUTSIDE_UNITS + KV_CACHE,
        activation_peak_bytes=4 * SLOT,
    )


def test_a_weights_budget_plans_without_the_memory_the_serving_engine_holds() -> None:
    budget = WEIGHTS_OUTSIDE_UNITS + 5 * SLOT
    policy = PlanPolicy(DeviceRuntime(torch.device("cpu")), budget)
    with pytest.raises(BudgetError, match="other tensors on the device"):
        policy.make_plan(served_step())  # as measured, the KV cache counts
    policy.count_weights_only(lambda: WEIGHTS_OUTSIDE_UNITS)
    plan = policy.make_plan(served_step())
    assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_peak_bytes > budget - SLOT  # the whole budget goes to weights
    assert len(plan.streamed) >= 3 and plan.resident  # two in flight at least, the rest resident


def test_a_weights_budget_below_the_smallest_plan_is_refused() -> None:
    policy = PlanPolicy(DeviceRuntime(torch.device("cpu")), WEIGHTS_OUTSIDE_UNITS + SLOT)
    policy.count_weights_only(lambda: WEIGHTS_OUTSIDE_UNITS)
    with pytest.raises(BudgetError, match="two largest units in flight") as info:
        policy.make_plan(served_step())
    assert info.value.budget_bytes == WEIGHTS_OUTSIDE_UNITS + SLOT
    assert info.value.needed_bytes > info.value.budget_bytes


def test_without_a_budget_a_weights_budget_has_no_device_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = DeviceRuntime(torch.device("cpu"))
    monkeypatch.setattr(runtime, "total_memory", lambda: 2**40)  # a device of known size, as a GPU
    policy = PlanPolicy(runtime, None)
    assert policy.memory_limit() is not None  # the device's share, counting whatever is allocated
    policy.count_weights_only(lambda: WEIGHTS_OUTSIDE_UNITS)
    assert policy.memory_limit() is None  # the serving engine accounted for the whole model


def test_the_reserve_is_held_until_the_next_layout_frees_it_first() -> None:
    tokens = spec_tokens()
    with torch.no_grad():
        want = make_spec_model(n_layers=6)(tokens)
    model = flextensor.offload(
        make_spec_model(n_layers=6), flextensor.OffloadConfig(include_patterns=["layers.*"], **CPU)
    )
    store = engine_of(model).store
    learning = store.device_bytes_held()
    store.hold_in_reserve(10 * 2**20)
    assert store.device_bytes_held() == learning + 10 * 2**20
    outs = run_forwards(model, tokens, 1)  # discovery ends with the layout to profile, which frees it
    assert store.reserved is None
    outs += run_forwards(model, tokens, LEARN)
    assert flextensor.phase(model) == "inference"
    assert store.device_bytes_held() == flextensor.report(model).device_bytes_held
    for out in outs:
        assert torch.equal(out, want)
    flextensor.release(model)


class TiedHead(torch.nn.Module):
    """Layers to stream, a head tied to the embedding, a buffer and an empty buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(16))
        self.register_buffer("unused", torch.empty(0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x * self.scale[0])


def test_weights_outside_units_count_tied_weights_once_and_skip_the_units() -> None:
    pytest.importorskip("vllm")
    from flextensor.vllm.budget import weights_outside_units

    model = flextensor.offload(TiedHead(), flextensor.OffloadConfig(include_patterns=["layers.*"], **CPU))
    assert weights_outside_units(model) == 64 * 32 * 4 + 16 * 4  # embedding (= head) and the buffer
    flextensor.release(model)


def test_vllm_offloader_replans_a_profile_for_the_weights_alone(tmp_path) -> None:
    """A server restarted with another budget re-plans from the saved measurements, which were taken
    while vLLM's KV cache was allocated (here: a baseline far over the budget): the re-plan counts the
    weights alone, as the first run's plans did, instead of refusing the budget."""
    import json

    pytest.importorskip("vllm")  # CI installs it; the plugin's tests fail there when it is missing
    from flextensor.vllm.offloader import FlexTensorOffloader

    tokens = spec_tokens()
    layers = [f"layers.{i}" for i in range(4)]  # what the offloader names vLLM's decoder layers
    model = flextensor.offload(
        make_spec_model(),
        flextensor.OffloadConfig(include_patterns=layers, gpu_memory_budget=2**20, **CPU),
    )
    run_forwards(model, tokens, LEARN)
    path = tmp_path / "served.ftprofile.json"
    flextensor.save_profile(model, path)
    flextensor.release(model)
    saved = json.loads(path.read_text())
    saved["measurements"]["baseline_bytes"] = 2**40  # what a KV cache on the device made it
    path.write_text(json.dumps(saved))

    served = make_spec_model()
    config = flextensor.OffloadConfig(gpu_memory_budget=2**21, profile=path, **CPU)  # another budget
    offloader = FlexTensorOffloader(config, torch.device("cpu"))
    offloader.wrap_modules(iter(served.layers))
    offloader.model = served
    offloader.post_init()
    assert flextensor.phase(served) == "inference"  # from the profile, planned again
    with torch.no_grad():
        want = make_spec_model()(tokens)
        assert torch.equal(served(tokens), want)
    flextensor.release(served)


def test_a_plan_for_every_input_keeps_as_many_units_resident_as_the_budget_allows() -> None:
    """Measured on a compute-heavy step every copy hides, so the plan that serves those inputs alone may
    stream everything through a deep arena; a plan for every input assumes the shortest step, where
    each unit streamed costs its copy: two in flight, the rest of the budget resident."""
    budget = WEIGHTS_OUTSIDE_UNITS + 4 * SLOT
    heavy = replace_compute(served_step(), 1.0)  # far longer than a copy (2 ms)
    policy = PlanPolicy(DeviceRuntime(torch.device("cpu")), budget)
    policy.count_weights_only(lambda: WEIGHTS_OUTSIDE_UNITS)
    policy.plan_for_every_input()
    plan = policy.make_plan(heavy)
    assert len(plan.resident) == 2 and plan.arena_bytes == 2 * SLOT
    assert plan.predicted_peak_bytes <= budget


def replace_compute(measurements: Measurements, compute_s: float) -> Measurements:
    from dataclasses import replace

    return replace(measurements, units=tuple(replace(u, compute_s=compute_s) for u in measurements.units))


def test_one_layout_serves_every_input_after_the_first_plan() -> None:
    """The vLLM offloader's choice (Engine.keep_one_layout): once planned, inputs of other shapes neither
    profile nor lay out again, and their outputs are those of the model on the device."""
    reference = make_spec_model(n_layers=6)
    model = flextensor.offload(
        make_spec_model(n_layers=6), flextensor.OffloadConfig(include_patterns=["layers.*"], **CPU)
    )
    engine = engine_of(model)
    engine.keep_one_layout()
    tokens = spec_tokens()
    run_forwards(model, tokens, LEARN)
    assert flextensor.phase(model) == "inference"
    layouts = flextensor.status(model).layouts
    for shape in ((1, 3), (3, 17), (2, 5)):
        other = torch.randint(0, 64, shape)
        with torch.no_grad():
            assert torch.equal(model(other), reference(other))
        assert flextensor.phase(model) == "inference"
    assert flextensor.status(model).layouts == layouts and len(engine.plans) == 1
    flextensor.release(model)


def test_under_vllm_a_budget_without_room_for_the_staging_of_compressed_loads_warns_at_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The smallest plan of compressed units needs their two staging slots too: a budget without room for
    them is told while loading that the plans will copy the packs uncompressed (see [Note: compression
    yields to the budget]); one without room for the smallest plan at all is refused then."""
    pytest.importorskip("vllm")
    from flextensor.vllm.budget import count_weights_only, weights_outside_units

    monkeypatch.setattr("flextensor.store.coded_loads.probe_decode", lambda runtime, pack, destination: 1e15)
    model = make_spec_model(n_layers=6).to(torch.bfloat16)
    config = flextensor.OffloadConfig(include_patterns=["layers.*"], compression="lossless", **CPU)
    model = flextensor.offload(model, config)
    engine = engine_of(model)
    units = engine.store.units
    assert all(u.pack is not None and u.pack.coded for u in units)
    two = 2 * max(align_up_unit(u.nbytes) for u in units)
    # Room for the weights outside the layers and two layers in flight, none for the staging slots.
    engine.policy.budget_bytes = weights_outside_units(model) + two + 1024
    with caplog.at_level("WARNING", logger="flextensor"):
        count_weights_only(model)
    assert "will copy the packs uncompressed" in caplog.text
    engine.policy.budget_bytes = weights_outside_units(model) + two - 1024
    with pytest.raises(BudgetError, match="two largest units in flight"):
        count_weights_only(model)
    flextensor.release(model)


def align_up_unit(nbytes: int) -> int:
    return -(-nbytes // UNIT_ALIGNMENT) * UNIT_ALIGNMENT
