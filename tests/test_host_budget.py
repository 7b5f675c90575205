"""The host memory budget end to end on CPU (the same path as on CUDA, nothing page-locked): packs that do
not fit are copied through the staging ring, outputs stay bitwise, the budget holds in every phase; the
ring itself; the planner's choice of staged units; and the errors."""

from __future__ import annotations

import mmap

import pytest
import torch

import flextensor
from engine_helpers import LEARN, assert_all_equal, first_tensor, run_forwards
from flextensor.host.packs import pack_layout
from flextensor.host.staging import STAGING_RING_MAX, StagingRing, staging_layout
from flextensor.plan.host_plan import HostPlan, choose_staged, pack_bytes
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.plan.planner import plan_offload
from flextensor.plan.simulator import simulate
from flextensor.weights.selection import select
from real_models import llama_inputs, tiny_llama
from streaming import streaming_config

LAYERS = ["model.layers.*"]


def unit_pack_bytes(model: torch.nn.Module) -> list[int]:
    selection = select(model, LAYERS, ())
    params = dict(model.named_parameters())
    return [
        pack_bytes(pack_layout([(n, params[n]) for n in selection.unit_parameters[u]])[1])
        for u in selection.units
    ]


def budget_for(model: torch.nn.Module, pinned_units: int) -> int:
    """A host budget that holds the staging ring and ``pinned_units`` packs, not one more."""
    sizes = unit_pack_bytes(model)
    slot, slots = staging_layout(max(sizes))
    return slot * slots + pinned_units * max(sizes) + mmap.PAGESIZE


def assert_within_budget(model: torch.nn.Module, budget: int) -> flextensor.OffloadStatus:
    status = flextensor.status(model)
    assert status.host_budget_bytes == budget
    assert status.staging_bytes > 0
    assert status.direct_bytes + status.staging_bytes <= budget
    assert any(u.staged for u in status.units)
    assert status.host_pinned_bytes == 0  # a CPU pins nothing
    return status


@pytest.fixture
def staged_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte counts of every copy that goes through a staging ring (the real ring, observed)."""
    seen: list[int] = []
    original = StagingRing.copy

    def observed(self: StagingRing, destination: torch.Tensor, fill, stream) -> None:  # type: ignore[no-untyped-def]
        seen.append(destination.numel())
        original(self, destination, fill, stream)

    monkeypatch.setattr(StagingRing, "copy", observed)
    return seen


def test_tiny_host_budget_streams_through_the_ring_bitwise(staged_copies: list[int]) -> None:
    model = tiny_llama(layers=4)
    inputs = llama_inputs()
    with torch.no_grad():
        ref = first_tensor(model(inputs))
    budget = budget_for(model, pinned_units=1)
    config = streaming_config(model, LAYERS, host_memory_budget=budget)
    flextensor.offload(model, config)
    assert_within_budget(model, budget)  # from offload() on, before any plan
    outs = run_forwards(model, inputs, LEARN)
    assert flextensor.phase(model) == "inference"
    staged_copies.clear()
    outs += run_forwards(model, inputs, 3)
    assert_all_equal(outs, ref)
    status = assert_within_budget(model, budget)
    plan = status.plan
    assert plan is not None and plan.staged and set(plan.staged) <= set(plan.streamed)
    assert {u.name for u in status.units if u.staged} == set(plan.staged)
    assert len(staged_copies) >= 3 * len(plan.staged)  # every staged unit, every steady forward
    report = flextensor.report(model)
    assert report.staging_bytes == status.staging_bytes and report.host_budget_bytes == budget
    assert report.host_pageable_bytes == report.host_bytes_held  # nothing pinned on a CPU
    assert "staging ring" in str(report)
    flextensor.release(model)
    assert_all_equal(run_forwards(model, inputs, 1), ref)


def test_budget_holding_every_pack_needs_no_ring() -> None:
    model = tiny_llama(layers=2)
    budget = sum(unit_pack_bytes(model))
    flextensor.offload(model, streaming_config(model, LAYERS, host_memory_budget=budget))
    status = flextensor.status(model)
    assert status.staging_bytes == 0 and not any(u.staged for u in status.units)
    flextensor.release(model)


def test_budget_below_the_ring_is_a_clear_error_and_leaves_the_model() -> None:
    model = tiny_llama(layers=3)
    inputs = llama_inputs()
    with torch.no_grad():
        ref = first_tensor(model(inputs))
    slot, slots = staging_layout(max(unit_pack_bytes(model)))
    config = streaming_config(model, LAYERS, host_memory_budget=slot * slots - 1)
    with pytest.raises(flextensor.HostBudgetError, match="cannot hold the staging ring") as info:
        flextensor.offload(model, config)
    assert str(slot * slots) in str(info.value)  # says how much to set
    assert (info.value.needed_bytes, info.value.budget_bytes) == (slot * slots, slot * slots - 1)
    with pytest.raises(flextensor.NotOffloadedError):
        flextensor.status(model)
    assert_all_equal(run_forwards(model, inputs, 1), ref)


def test_saved_plan_keeps_its_staged_units(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = tiny_llama(layers=4)
    inputs = llama_inputs()
    with torch.no_grad():
        ref = first_tensor(model(inputs))
    budget = budget_for(model, pinned_units=1)
    flextensor.offload(model, streaming_config(model, LAYERS, host_memory_budget=budget))
    run_forwards(model, inputs, LEARN)
    path = tmp_path / "llama.profile"
    flextensor.save_profile(model, path)
    staged = flextensor.status(model).plan.staged  # type: ignore[union-attr]
    flextensor.release(model)
    again = tiny_llama(layers=4)
    flextensor.offload(again, streaming_config(again, LAYERS, host_memory_budget=budget, profile=path))
    assert_all_equal(run_forwards(again, inputs, 2), ref)
    status = assert_within_budget(again, budget)
    assert status.plan is not None and status.plan.staged == staged
    flextensor.release(again)


def test_host_budget_with_a_shared_segment_is_refused() -> None:
    model = tiny_llama(layers=2)
    config = streaming_config(model, LAYERS, host_memory_budget="1MiB", share_host_memory=True)
    with pytest.raises(flextensor.ConfigError, match="share_host_memory"):
        flextensor.offload(model, config)


def test_host_memory_budget_field() -> None:
    assert flextensor.OffloadConfig(host_memory_budget="512MiB").host_memory_budget == 512 * 2**20
    assert flextensor.OffloadConfig.env_var("host_memory_budget") == "FT_HOST_MEMORY_BUDGET"
    for bad in (0, -1, True, "lots"):
        with pytest.raises(flextensor.ConfigError, match="host_memory_budget"):
            flextensor.OffloadConfig(host_memory_budget=bad)


def test_host_memory_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_HOST_MEMORY_BUDGET", "768MiB")
    assert flextensor.load_config().host_memory_budget == 768 * 2**20


# -- the ring ---------------------------------------------------------------------------------------------


def test_ring_copies_bytes_in_slot_sized_chunks_and_wraps() -> None:
    from flextensor.device.runtime import DeviceRuntime

    runtime = DeviceRuntime(torch.device("cpu"))
    ring = StagingRing(mmap.PAGESIZE, 3, runtime, pin=False)
    source = torch.randint(0, 256, (7 * mmap.PAGESIZE + 123,), dtype=torch.uint8)  # 8 chunks, 3 slots
    destination = torch.zeros_like(source)
    ring.copy_from_host(destination, source, runtime.copy_stream)
    assert torch.equal(destination, source)
    offsets: list[int] = []
    ring.copy(
        destination[:100], lambda slot, offset: (offsets.append(offset), slot.fill_(7)), runtime.copy_stream
    )
    assert offsets == [0] and bool((destination[:100] == 7).all())
    ring.free()


def test_ring_layout_holds_two_units_up_to_its_cap() -> None:
    slot, slots = staging_layout(10_000)
    assert slot % mmap.PAGESIZE == 0 and slot * slots >= 20_000
    slot, slots = staging_layout(2**30)
    assert slot * slots == STAGING_RING_MAX


# -- the planner ------------------------------------------------------------------------------------------

PAGE = mmap.PAGESIZE
UNIT = 16 * PAGE


def test_choose_staged_prefers_units_copied_once_then_the_most_slack() -> None:
    # Four units in a two-unit ring: each copy is issued after the unit two before it (cyclic), so it
    # hides under the compute of the unit just before it. Unit 1 computes long: unit 2's copy has slack.
    order = [0, 1, 2, 3]
    nbytes = [UNIT] * 4
    compute = [1.0, 5.0, 1.0, 1.0]
    starts = [0.0, 1.0, 6.0, 7.0]
    ready_after: list[int | None] = [2, 3, 0, 1]
    staged_copy = [2.0] * 4
    args = (order, nbytes, starts, compute, 8.0, ready_after, staged_copy)
    assert choose_staged(*args, capacity_bytes=4 * UNIT) == frozenset()
    assert choose_staged(*args, capacity_bytes=3 * UNIT) == {2}
    assert (
        choose_staged(*args, capacity_bytes=3 * UNIT - 1) >= {2}
        and len(choose_staged(*args, 3 * UNIT - 1)) == 2
    )
    once: list[int | None] = [2, 3, 0, None]  # unit 3's range is never overwritten: copied once, ever
    assert choose_staged(order, nbytes, starts, compute, 8.0, once, staged_copy, 3 * UNIT) == {3}


def measurements(n: int = 8, compute_s: float = 1e-3, gbps: float = 20.0) -> Measurements:
    return Measurements(
        units=tuple(UnitMeasurement(f"layers.{i}", UNIT, compute_s) for i in range(n)),
        link=LinkModel.constant(gbps * 1e9),
    )


def test_planner_stages_only_what_the_capacity_cannot_pin_and_times_it_slower() -> None:
    m = measurements()
    budget = 3 * UNIT  # streams most units
    slow = LinkModel.constant(UNIT / 5e-3)  # a staged copy takes 5 compute times
    plan = plan_offload(m, budget, HostPlan(capacity_bytes=2 * UNIT, staged_link=slow))
    assert plan.staged and set(plan.staged) <= set(plan.streamed)
    pinned = [name for name in plan.streamed if name not in plan.staged]
    assert sum(pack_bytes(UNIT) for _ in pinned) <= 2 * UNIT
    unbounded = plan_offload(m, budget)
    assert unbounded.staged == ()
    assert plan.predicted_step_s > unbounded.predicted_step_s  # the planner knows the slower copies
    assert plan.predicted_step_s == pytest.approx(simulate(plan, m, staged_link=slow).step_s)
    roomy = plan_offload(m, budget, HostPlan(capacity_bytes=8 * UNIT, staged_link=slow))
    assert roomy.staged == ()


def test_simulator_refuses_staged_units_that_do_not_stream() -> None:
    m = measurements(n=3)
    plan = plan_offload(m, 2 * UNIT)
    bad = type(plan)(
        resident=plan.resident, streamed=plan.streamed, arena_bytes=plan.arena_bytes, staged=("x",)
    )
    with pytest.raises(flextensor.PlanError, match="staged"):
        simulate(bad, m)


@torch.no_grad()
def test_a_pipeline_shares_the_host_budget_by_weight_bytes() -> None:
    torch.manual_seed(0)
    parts = {
        "big": torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(6))),
        "small": torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(2))),
    }
    x = torch.randn(2, 128)
    expected = parts["small"](parts["big"](x))
    budget = 2**20
    flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", host_memory_budget=budget))
    outputs = [parts["small"](parts["big"](x)) for _ in range(LEARN + 1)]
    assert all(torch.equal(out, expected) for out in outputs)
    shares = {name: flextensor.status(module).host_budget_bytes for name, module in parts.items()}
    assert shares["big"] is not None and shares["small"] is not None
    assert shares["big"] + shares["small"] <= budget and shares["big"] == 3 * shares["small"]
    flextensor.release(parts)


@torch.no_grad()
def test_a_pipeline_host_budget_too_small_names_the_component_and_what_the_pipeline_needs() -> None:
    """Each component gets a share of the host budget: the error names the component whose share holds
    neither its packs nor its ring, and the budget the pipeline needs, which then works (it used to ask
    for the component's ring as the pipeline's budget, which failed again)."""
    torch.manual_seed(0)
    parts = {
        "big": torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(6))),
        "small": torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(2))),
    }
    x = torch.randn(2, 128)
    expected = parts["small"](parts["big"](x))
    slot, slots = staging_layout(pack_layout(list(parts["big"][0].named_parameters()))[1])
    budget = slot * slots  # one ring (the same for both): the small one's share, 1/4 of it, is the short one
    with pytest.raises(flextensor.HostBudgetError, match=r"component 'small' gets 36\.0 KiB") as info:
        flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", host_memory_budget=budget))
    needed = info.value.needed_bytes
    assert info.value.budget_bytes == budget and needed > budget and str(needed) in str(info.value)
    with pytest.raises(flextensor.NotOffloadedError):
        flextensor.phase(parts)
    flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", host_memory_budget=needed))
    outputs = [parts["small"](parts["big"](x)) for _ in range(LEARN + 1)]
    assert all(torch.equal(out, expected) for out in outputs)
    flextensor.release(parts)


def test_switching_plans_between_inputs_stays_bitwise_and_within_the_budget() -> None:
    # Two input shapes, two plans (like prefill and decode): each layout re-pins only to make room.
    model = tiny_llama(layers=6)
    short, long = llama_inputs(seq=4), llama_inputs(seq=32)
    with torch.no_grad():
        refs = [first_tensor(model(short)), first_tensor(model(long))]
    budget = budget_for(model, pinned_units=2)
    flextensor.offload(model, streaming_config(model, LAYERS, host_memory_budget=budget))
    with torch.no_grad():
        for _ in range(LEARN + 2):
            for inputs, ref in zip((short, long), refs, strict=True):
                assert torch.equal(first_tensor(model(inputs)), ref)
                assert_within_budget(model, budget)
    status = flextensor.status(model)
    assert len(status.plans) == 2 and all(set(p.staged) <= set(p.streamed) for p in status.plans.values())
    flextensor.release(model)
