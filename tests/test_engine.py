"""The engine's phases and plans end to end on the CPU engine: phase changes, plans per input signature and
switching between them, resident units kept (or streamed) across switches and new shapes, host packs
dropped and rebuilt, and the way back from layouts and forwards that fail half-way.

Device memory is failed on purpose through ``flextensor.store.device_store.allocate_device_bytes``, the one
place every arena and resident storage is allocated; a forward is failed by a forward pre-hook that raises.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

import flextensor
import flextensor.store.device_store
from engine_helpers import (
    CPU,
    LEARN,
    assert_all_equal,
    assert_packs_dropped,
    assert_packs_hold_the_weights,
    assert_placement,
    grown,
    install_placement,
    offload_with_placements,
    pack_rebuilds,
    residency_seen_by,
    run_forwards,
    storage_pointers,
    uploads,
)
from flextensor.api import engine_of
from flextensor.errors import PlanError
from flextensor.hooks.functions import input_signature
from flextensor.phases.profiling import EXTRA_FORWARDS
from flextensor.plan.layout import UNIT_ALIGNMENT, provisional_arena_bytes
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.plan.planner import residents_within
from spec_model import make_spec_model, spec_tokens
from streaming import streaming_config

# Two plans sharing three resident units; layers.0 and layers.3 trade places between them.
TRADING = {
    8: ("embed", "layers.0", "layers.1", "lm_head"),
    32: ("embed", "layers.1", "layers.3", "lm_head"),
}
SHARED = ("embed", "layers.1", "lm_head")


def _fail_allocations(
    monkeypatch: pytest.MonkeyPatch,
    when: Callable[[int], bool],
    error: type[Exception] = torch.OutOfMemoryError,
) -> list[int]:
    """Make ``flextensor.store.device_store.allocate_device_bytes`` raise ``error("injected")`` for the calls
    where ``when(nbytes)`` is true; returns the sizes of the calls that failed."""
    allocate = flextensor.store.device_store.allocate_device_bytes
    failed: list[int] = []

    def allocate_or_fail(nbytes: int, device: torch.device) -> torch.Tensor:
        if when(nbytes):
            failed.append(nbytes)
            raise error("injected")
        return allocate(nbytes, device)

    monkeypatch.setattr(flextensor.store.device_store, "allocate_device_bytes", allocate_or_fail)
    return failed


# -- phases ------------------------------------------------------------------------------------------------


def test_phases_follow_configured_counts() -> None:
    model = flextensor.offload(
        make_spec_model(), flextensor.OffloadConfig(discovery_forwards=2, profiling_forwards=2, **CPU)
    )
    seen = [flextensor.phase(model)]
    for _ in range(4 + EXTRA_FORWARDS):
        run_forwards(model, spec_tokens(), 1)
        seen.append(flextensor.phase(model))
    assert seen[:4] == ["discovery", "discovery", "profiling", "profiling"]
    # Then steady state; timing noise may add up to EXTRA_FORWARDS profiling forwards first.
    extra = seen[4:].index("inference")
    assert extra <= EXTRA_FORWARDS and set(seen[4 + extra :]) == {"inference"}
    assert flextensor.status(model).forwards == 4 + EXTRA_FORWARDS


def test_include_star_streams_through_list_children_and_never_needs_whole_model() -> None:
    model = flextensor.offload(make_spec_model(n_layers=6), flextensor.OffloadConfig(**CPU))
    units = flextensor.offload_units(model)
    assert "layers" not in units and "layers.0" in units
    total = sum(u.nbytes for u in flextensor.status(model).units)
    run_forwards(model, spec_tokens(), 1)
    assert flextensor.status(model).device_bytes_held < total / 2  # learning holds the two largest units

    budget = total // 2
    model = flextensor.offload(
        make_spec_model(n_layers=6), flextensor.OffloadConfig(gpu_memory_budget=budget, **CPU)
    )
    run_forwards(model, spec_tokens(), LEARN)
    status = flextensor.status(model)
    assert status.device_bytes_held <= budget
    assert status.plan is not None and status.plan.streamed


# -- new input shapes, cached plans ------------------------------------------------------------------------


def test_new_input_shape_in_steady_state_replans_and_stays_right() -> None:
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    run_forwards(model, spec_tokens(), LEARN)
    longer = spec_tokens(seq=16)
    ref = run_forwards(make_spec_model(), longer, 1)[0]
    assert_all_equal(run_forwards(model, longer, LEARN), ref)
    status = flextensor.status(model)
    assert status.phase == "inference"
    assert len(status.plans) == 2
    assert status.plan is status.plans[input_signature((longer,), {})]


def test_switching_back_to_known_input_shapes_reuses_their_plan() -> None:
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    short, long = spec_tokens(seq=8), spec_tokens(seq=32)
    refs = {8: run_forwards(make_spec_model(), short, 1)[0], 32: run_forwards(make_spec_model(), long, 1)[0]}
    run_forwards(model, short, LEARN)
    run_forwards(model, long, LEARN)
    plans = dict(flextensor.status(model).plans)
    assert len(plans) == 2
    with torch.no_grad():
        for tokens in (short, long, short, long):
            assert torch.equal(model(tokens), refs[tokens.shape[1]])
            status = flextensor.status(model)
            assert status.phase == "inference"  # no forward was profiled again...
            assert status.plan is plans[input_signature((tokens,), {})]  # ...each ran on its known plan
    assert flextensor.status(model).plans == plans


def test_profiling_cut_short_by_other_inputs_plans_the_inputs_it_profiled() -> None:
    """generate() in miniature: a profiling forward asks for one more (its time disagrees with the
    discovery forward's: here a user hook sleeps in it), but the next forward has other inputs. The
    profiled inputs get their plan from their own forward; the new ones are profiled afresh, not mixed in."""
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    short, longer = spec_tokens(seq=8), spec_tokens(seq=16)
    refs = {seq: run_forwards(make_spec_model(), tokens, 1)[0] for seq, tokens in ((8, short), (16, longer))}
    signatures = {seq: input_signature((tokens,), {}) for seq, tokens in ((8, short), (16, longer))}
    sleep_s = [0.0]

    def noisy(module: nn.Module, args: tuple) -> None:
        time.sleep(sleep_s[0])

    model.layers[1].register_forward_pre_hook(noisy)
    with torch.no_grad():
        start = time.perf_counter()
        assert torch.equal(model(short), refs[8])  # discovery
        # Far more than DISAGREEMENT times the discovery forward's compute, whatever the machine's load.
        sleep_s[0] = 4 * (time.perf_counter() - start) + 0.05
        assert torch.equal(model(short), refs[8])  # profiling, far slower than discovery: one more, please
        sleep_s[0] = 0.0
        status = flextensor.status(model)
        assert status.phase == "profiling" and status.plans == {}
        # Other inputs: the short ones are planned from their forward first, then the longer ones are
        # profiled on their own (one forward, nothing to disagree with) and planned too.
        assert torch.equal(model(longer), refs[16])
        status = flextensor.status(model)
        assert set(status.plans) == set(signatures.values())
        assert status.phase == "inference" and status.plan is status.plans[signatures[16]]
    with torch.no_grad():
        for seq, tokens in ((8, short), (16, longer), (8, short)):
            assert torch.equal(model(tokens), refs[seq])
            assert flextensor.status(model).plan is flextensor.status(model).plans[signatures[seq]]


# -- switching between cached plans keeps shared resident units ---------------------------------------------


def test_alternating_plans_keep_shared_resident_units_in_place() -> None:
    model, tokens, refs = offload_with_placements(TRADING)
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    pointers = storage_pointers(model, SHARED)
    with torch.no_grad():
        for seq, before in ((32, 8), (8, 32), (32, 8), (8, 32), (32, 8)):
            counted = uploads(model)
            assert torch.equal(model(tokens[seq]), refs[seq]), f"seq {seq} differs from the resident model"
            assert torch.equal(model(tokens[seq]), refs[seq])  # steady state on the switched-to plan
            # Only the units entering residency were uploaded; the shared ones kept their storage.
            assert grown(counted, uploads(model)) == sorted(set(TRADING[seq]) - set(TRADING[before]))
            assert storage_pointers(model, SHARED) == pointers
            assert_placement(model, TRADING[seq])


@pytest.mark.parametrize("next_seq", [32, 8], ids=["same-shapes-again", "back-to-the-old-shapes"])
def test_a_switch_that_fails_half_way_is_laid_out_again_by_the_next_forward(
    monkeypatch: pytest.MonkeyPatch, next_seq: int
) -> None:
    model, tokens, refs = offload_with_placements(TRADING)
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    # The switch to 32 uploads layers.3 after layers.0 left residency: the old layout is gone by then.
    size = flextensor.status(model).unit("layers.3").nbytes
    assert flextensor.status(model).plans[input_signature((tokens[32],), {})].arena_bytes != size
    armed = [True]

    def layers_3_once(nbytes: int) -> bool:
        if armed[0] and nbytes == size:
            armed[0] = False
            return True
        return False

    failed = _fail_allocations(monkeypatch, layers_3_once)
    with torch.no_grad():
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            model(tokens[32])
        assert failed == [size]
        assert not flextensor.status(model).forward_running
        assert torch.equal(model(tokens[next_seq]), refs[next_seq])
        assert_placement(model, TRADING[next_seq])
        for seq in (8, 32):
            assert torch.equal(model(tokens[seq]), refs[seq])
            assert_placement(model, TRADING[seq])
    assert flextensor.phase(model) == "inference"


def test_a_layout_with_a_unit_both_resident_and_streamed_is_refused() -> None:
    model, tokens, refs = offload_with_placements({8: ("embed", "layers.0")})
    engine = engine_of(model)
    before = flextensor.status(model)
    units = engine.units
    with pytest.raises(PlanError, match=r"both resident and streamed.*layers\.0"):
        engine.store.lay_out([units["layers.0"], units["layers.1"]], [units["layers.0"]], 1 << 20)
    assert flextensor.status(model) == before  # refused before anything moved
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    assert_placement(model, ("embed", "layers.0"))


def test_a_plan_with_a_unit_both_resident_and_streamed_is_refused_and_profiled_again() -> None:
    model, tokens, refs = offload_with_placements({8: ("embed", "layers.0")})
    engine = engine_of(model)
    entry = engine.plans[input_signature((tokens[8],), {})]
    plan = entry.plan
    assert "layers.0" in plan.resident
    bad = dataclasses.replace(plan, streamed=("layers.0", *plan.streamed))
    with pytest.raises(PlanError, match=r"both resident and streamed"):
        engine.install_plan(entry.measurements, bad)
    assert flextensor.status(model).plan is None and flextensor.phase(model) == "profiling"
    assert_all_equal(run_forwards(model, tokens[8], 3), refs[8])
    assert flextensor.phase(model) == "inference"


def test_switching_between_all_resident_plans_uploads_nothing() -> None:
    everything = ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head", "lm_head")
    model, tokens, refs = offload_with_placements({8: everything, 32: everything})
    names = flextensor.offload_units(model)
    assert set(names) == set(everything)
    pointers = storage_pointers(model, names)
    counted = uploads(model)
    with torch.no_grad():
        for seq in (8, 32, 8, 32):
            assert torch.equal(model(tokens[seq]), refs[seq])
    assert uploads(model) == counted
    status = flextensor.status(model)
    assert status.arena_bytes == 0
    assert storage_pointers(model, names) == pointers
    assert status.device_bytes_held == sum(u.nbytes for u in status.units)


def test_new_shape_under_a_tight_budget_streams_resident_units_and_switching_back_uploads_them() -> None:
    placements = {8: ("embed", "layers.0", "layers.1", "lm_head")}
    model, tokens, refs = offload_with_placements(placements, profiling_forwards=2)
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    assert_placement(model, placements[8])
    assert_packs_dropped(model, placements[8])
    longer = spec_tokens(seq=16)
    ref = run_forwards(make_spec_model(), longer, 1)[0]
    with torch.no_grad():
        # Profiling: the resident units and the arena of the rest would overrun the budget, so every
        # unit streams and nothing else is held; the residents' packs come back exactly.
        assert torch.equal(model(longer), ref)
    assert flextensor.phase(model) == "profiling"
    assert_placement(model, ())
    status = flextensor.status(model)
    assert_packs_hold_the_weights(model, (u.name for u in status.units))
    assert status.device_bytes_held == provisional_arena_bytes([u.nbytes for u in status.units])
    assert_all_equal(run_forwards(model, longer, 3), ref)  # the second profiling forward, maybe more
    assert flextensor.phase(model) == "inference"
    with torch.no_grad():
        for tokens_now, ref_now in ((tokens[8], refs[8]), (longer, ref), (tokens[8], refs[8])):
            assert torch.equal(model(tokens_now), ref_now)
    assert_placement(model, placements[8])
    assert_packs_dropped(model, placements[8])


# -- one copy of a resident unit: its host pack is dropped in steady state -------------------------------


def test_only_units_resident_in_every_plan_drop_their_pack_and_a_plan_streaming_one_rebuilds_it() -> None:
    # layers.0 and layers.3 trade places between the two plans: they keep their packs, so alternating
    # re-pins nothing; embed, layers.1 and lm_head are resident in both and hold no host copy.
    model, tokens, refs = offload_with_placements(TRADING)
    assert_packs_dropped(model, TRADING[32])
    status = flextensor.status(model)
    assert {u.name for u in status.units if u.placement == "device_only"} == set(SHARED)
    assert {u.name for u in status.units if u.host_bytes == 0} == set(SHARED)
    rebuilds = pack_rebuilds(model)
    with torch.no_grad():
        for seq in (8, 32, 8, 32):
            assert torch.equal(model(tokens[seq]), refs[seq]), f"seq {seq} differs from the resident model"
            assert torch.equal(model(tokens[seq]), refs[seq])
            assert_placement(model, TRADING[seq])
            assert_packs_dropped(model, TRADING[seq])
            # The unit that trades out of residency streams from the pack it kept: its original weights.
            assert_packs_hold_the_weights(model, set(TRADING[8 if seq == 32 else 32]) - set(SHARED))
    assert pack_rebuilds(model) == rebuilds
    assert flextensor.status(model).pack_rebuilds == 0

    # A plan for 8 that streams layers.1: its pack is built again from its storage, exactly.
    install_placement(model, input_signature((tokens[8],), {}), ("embed", "layers.0", "lm_head"))
    assert grown(rebuilds, pack_rebuilds(model)) == ["layers.1"]
    assert flextensor.status(model).pack_rebuilds == 1
    assert_packs_hold_the_weights(model, {"layers.1"})
    with torch.no_grad():
        for seq in (8, 32, 8):
            assert torch.equal(model(tokens[seq]), refs[seq])


def test_new_shape_profiles_with_resident_units_in_place() -> None:
    placements = {8: ("embed", "layers.0", "layers.1", "lm_head")}
    model, tokens, refs = offload_with_placements(placements, tight=False, profiling_forwards=2)
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    pointers = storage_pointers(model, placements[8])
    counted, rebuilds = uploads(model), pack_rebuilds(model)
    longer = spec_tokens(seq=16)
    ref = run_forwards(make_spec_model(), longer, 1)[0]
    with torch.no_grad():
        assert torch.equal(model(longer), ref)  # profiling: only the units streamed before stream
    assert flextensor.phase(model) == "profiling"
    assert_placement(model, placements[8])
    assert_packs_dropped(model, placements[8])
    assert storage_pointers(model, placements[8]) == pointers
    assert uploads(model) == counted and pack_rebuilds(model) == rebuilds
    status = flextensor.status(model)
    streamed = [u.nbytes for u in status.units if u.name not in placements[8]]
    resident = sum(status.unit(u).nbytes for u in placements[8])
    assert status.device_bytes_held == resident + provisional_arena_bytes(streamed)

    assert_all_equal(run_forwards(model, longer, 3), ref)  # the second profiling forward, maybe more
    assert flextensor.phase(model) == "inference"
    signature = input_signature((longer,), {})
    status = flextensor.status(model)
    assert status.plan is status.plans[signature] and status.input_signature == signature
    measurements = engine_of(model).plans[signature].measurements
    # Resident units were profiled too: every unit is measured, in execution order.
    assert list(measurements.unit_names()) == flextensor.offload_units(model)
    assert all(u.compute_s > 0 for u in measurements.units)
    assert_placement(model, status.plan.resident)
    assert_packs_dropped(model, status.plan.resident)
    assert grown(rebuilds, pack_rebuilds(model)) == sorted(set(placements[8]) - set(status.plan.resident))
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])  # back to the hand-made plan
    assert_packs_hold_the_weights(model, set(flextensor.offload_units(model)) - set(placements[8]))
    assert_packs_dropped(model, placements[8])


# -- failures half-way ---------------------------------------------------------------------------------------


def test_a_profiling_forward_out_of_memory_with_residents_held_profiles_again_streaming_everything() -> None:
    placements = {8: ("embed", "layers.0", "layers.1", "lm_head")}
    model, tokens, refs = offload_with_placements(placements, tight=False)
    longer = spec_tokens(seq=16)
    ref = run_forwards(make_spec_model(), longer, 1)[0]
    armed = [True]

    def out_of_memory_once(module: nn.Module, args: tuple) -> None:
        if armed[0]:  # the new shape's activations did not fit beside the resident units
            armed[0] = False
            raise torch.OutOfMemoryError("injected")

    handle = model.layers[2].register_forward_pre_hook(out_of_memory_once)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        model(longer)
    handle.remove()
    assert flextensor.phase(model) == "profiling"
    seen = residency_seen_by(model.layers[3], model)
    assert_all_equal(run_forwards(model, longer, 3), ref)
    assert seen[0] == set()  # the profiling forward after the failure streamed every unit
    assert flextensor.phase(model) == "inference"
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])


def _transfer_bound(model: nn.Module) -> Measurements:
    """Measurements of ``model``'s units whose copies take ten times their compute: without a memory
    limit the planner keeps every unit resident."""
    names = flextensor.offload_units(model)
    size = max(u.nbytes for u in flextensor.status(model).units)
    return Measurements(
        units=tuple(UnitMeasurement(name, size, 1e-3) for name in names),
        link=LinkModel.constant(size / 10e-3),
        baseline_bytes=0,
        activation_peak_bytes=size,
    )


@pytest.mark.parametrize("error", [RuntimeError, torch.OutOfMemoryError])
def test_a_plan_whose_layout_fails_profiles_again_and_retries_until_a_layout_lands(
    monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    # Out of memory also caps the next plan below the failed one, but never below the smallest plan:
    # the smallest plan is retried, not refused with a BudgetError.
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    tokens = spec_tokens()
    ref = run_forwards(make_spec_model(), tokens, 1)[0]
    failures = [2]  # the plan's layout, then the first attempt at the layout to profile again

    def while_profiling(nbytes: int) -> bool:
        # A layout allocates after it let the old one go: what a failure half-way leaves.
        if failures[0] and flextensor.phase(model) == "profiling":
            failures[0] -= 1
            return True
        return False

    with torch.no_grad():
        assert torch.equal(model(tokens), ref)  # discovery
        assert flextensor.phase(model) == "profiling"
        _fail_allocations(monkeypatch, while_profiling, error)
        # Profiling: the forward runs, its plan's layout fails (timing noise may first ask for up to
        # EXTRA_FORWARDS more profiling forwards, which lay nothing out).
        for _ in range(1 + EXTRA_FORWARDS):
            try:
                model(tokens)
            except error as exc:
                assert "injected" in str(exc)
                break
        else:
            pytest.fail("no profiling forward laid out a plan")
        assert failures == [1]
        status = flextensor.status(model)
        assert status.phase == "profiling" and status.plan is None and not status.forward_running
        with pytest.raises(error, match="injected"):
            model(tokens)  # laying out to profile again fails too: the next forward tries again
        assert failures == [0]
    assert_all_equal(run_forwards(model, tokens, 3), ref)
    status = flextensor.status(model)
    assert status.phase == "inference"
    assert_placement(model, status.plan.resident)
    # The cap cleared once a layout landed: a transfer-bound model keeps every unit resident again.
    policy = engine_of(model).policy
    assert policy.failed_peak_bytes is None
    assert set(policy.make_plan(_transfer_bound(model)).resident) == set(flextensor.offload_units(model))


def test_after_a_layout_ran_out_of_memory_the_next_plan_asks_for_less(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    engine = engine_of(model)
    names = flextensor.offload_units(model)
    measurements = _transfer_bound(model)
    first = engine.policy.make_plan(measurements)
    assert set(first.resident) == set(names)

    _fail_allocations(monkeypatch, lambda nbytes: True)
    with pytest.raises(torch.OutOfMemoryError):
        engine.install_plan(measurements, first)
    assert flextensor.status(model).plan is None and flextensor.phase(model) == "profiling"
    second = engine.policy.make_plan(measurements)
    assert second.predicted_peak_bytes <= 0.9 * first.predicted_peak_bytes
    assert len(second.resident) < len(names)


def test_profiling_keeps_the_residents_that_leave_room_within_the_limit() -> None:
    page = UNIT_ALIGNMENT
    resident = {"a": 4 * page, "b": page, "c": 10 * page}
    streamed = [2 * page, 2 * page]  # a provisional arena of 4 pages
    assert residents_within(resident, streamed, 10**9) == {"a", "b", "c"}
    # Streaming a or c would grow the arena by as much as it frees; streaming b saves its page.
    assert residents_within(resident, streamed, 18 * page) == {"a", "c"}
    assert residents_within(resident, streamed, 0) == {"a", "c"}  # nothing holds less
    # Streaming the largest resident unit saves the most when it is no larger than the streamed ones.
    assert residents_within({"a": page, "b": 3 * page}, [4 * page, 4 * page], 10 * page) == {"a"}
    # No single move saves anything, but streaming both holds less than keeping them.
    assert residents_within({"x": 10 * page, "y": 10 * page}, [page], 0) == set()
    assert residents_within({}, streamed, 0) == set()
    # Units that never ran set a floor under the arena: keeping a unit must leave room beside it.
    assert residents_within({"a": page}, [page], 3 * page) == {"a"}
    assert residents_within({"a": page}, [page], 3 * page, arena_floor=3 * page) == set()


# -- units that never run ---------------------------------------------------------------------------------


class HasUnusedModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.unused = nn.Linear(256, 256)  # selected by "*", never run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_never_run_unit_larger_than_the_planned_arena_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = HasUnusedModule()
    # offload() takes no less than two of the largest units in flight (it cannot know which never run);
    # the plan, made for the small blocks that ran, has an arena the unused unit does not fit.
    budget = streaming_config(model).gpu_memory_budget
    model = flextensor.offload(model, flextensor.OffloadConfig(gpu_memory_budget=budget, **CPU))
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        run_forwards(model, torch.randn(2, 8), LEARN)
    assert any("never ran" in r.getMessage() and "unused" in r.getMessage() for r in caplog.records)
    # It still loads on demand if it ever runs: the arena grew to hold it.
    status = flextensor.status(model)
    assert status.unit("unused").placement == "streamed"
    assert status.arena_bytes >= status.unit("unused").nbytes
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(model.unused(x), HasUnusedModule().unused(x))
