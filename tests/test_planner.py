"""The planner against closed-form optima, its budget errors, and its invariants.

Most cases use uniform chains: ``n`` one-slot units (``SLOT`` bytes, aligned) that each compute ``t``
seconds and copy in ``c`` seconds. With ``m < n`` slots of memory for weights (residents plus an arena of
at least two slots), a step copies at least ``S = min(n - m + 2, 2 (n - m))`` units (``r`` residents
leave ``s = n - r`` to stream; an arena of ``a`` slots keeps ``2a - s`` of them for good once it is over
half of them, so ``min(s, 2 (s - a))`` are copied). Steps are synchronised (see [Note: what the simulator
models]), so nothing is copied before the first streamed unit's compute has ended: no step beats
``max(n t, t + S c)``. A transfer-bound chain reaches it with the residents after the first streamed
unit, where they delay no copy.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flextensor.errors import BudgetError
from flextensor.plan.layout import UNIT_ALIGNMENT, align_up
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.plan.planner import (
    NO_BUDGET_SLOWDOWN,
    Plan,
    _multipliers,
    _Search,
    minimal_need_bytes,
    plan_offload,
)
from flextensor.plan.simulator import simulate

SLOT = 256 * UNIT_ALIGNMENT
BASELINE = SLOT // 2
ACTIVATIONS = SLOT
FIXED = BASELINE + ACTIVATIONS
GiB = 2**30


def uniform(n: int, compute_s: float, copy_s: float) -> Measurements:
    return Measurements(
        units=tuple(UnitMeasurement(f"layers.{i}", SLOT, compute_s) for i in range(n)),
        link=LinkModel.constant(SLOT / copy_s),
        baseline_bytes=BASELINE,
        activation_peak_bytes=ACTIVATIONS,
    )


def weights_slots(plan: Plan) -> float:
    """Slots of device memory the plan spends on weights (residents and arena)."""
    return (plan.predicted_peak_bytes - FIXED) / SLOT


def check_consistent(plan: Plan, m: Measurements) -> None:
    """The plan places every unit once, in execution order, and its predictions are the simulator's."""
    names = [u.name for u in m.units]
    assert sorted(plan.resident + plan.streamed) == sorted(names)
    assert list(plan.resident) == [n for n in names if n in plan.resident]
    assert list(plan.streamed) == [n for n in names if n in plan.streamed]
    sim = simulate(plan, m)
    assert plan.predicted_step_s == sim.step_s
    assert plan.predicted_peak_bytes == sim.peak_bytes


# --- closed forms -------------------------------------------------------------------------------------


def test_transfer_bound_chain_with_budget() -> None:
    n, t, c = 12, 1.0, 3.0
    m = uniform(n, t, c)
    bandwidth = SLOT / c
    copied: list[int] = []
    for slots in range(2, n + 1):
        budget = FIXED + slots * SLOT
        plan = plan_offload(m, budget)
        check_consistent(plan, m)
        assert plan.budget_bytes == budget
        assert plan.predicted_peak_bytes <= budget
        sim = simulate(plan, m)
        copied.append(sim.streamed_bytes)
        # The closed-form optimum (see the module docstring), whatever the parity of the slot count.
        least_copied = min(n - slots + 2, 2 * (n - slots))
        assert plan.predicted_step_s == pytest.approx(max(n * t, t + least_copied * c)), slots
        if least_copied * c > (n - 1) * t:
            # Transfer bound: the copy stream is busy from the end of the first compute to the end.
            assert sim.streamed_bytes == least_copied * SLOT
            assert plan.predicted_step_s == pytest.approx(t + sim.streamed_bytes / bandwidth)
            assert "layers.0" not in plan.resident  # it would delay the first copy by a compute
    # More budget, fewer bytes over the link, until the copies hide under compute.
    assert all(b <= a for a, b in itertools.pairwise(copied))
    assert copied[0] == n * SLOT and copied[-1] <= 2 * SLOT


def test_compute_bound_chain_without_budget_keeps_the_last_unit_resident() -> None:
    # Each copy hides under the compute before its unit, but the one for the next step's layers.1
    # shares the last unit's slot: with no tail it has nothing to hide under (a 1 s copy on a 32 s step,
    # beyond NO_BUDGET_SLOWDOWN). Making layers.1 resident only shifts the ring (layers.0 then shares the
    # last unit's slot); keeping the last unit resident gives that copy 2 s of compute to hide under.
    m = uniform(16, 2.0, 1.0)
    assert simulate(Plan((), tuple(u.name for u in m.units), 2 * SLOT), m).step_s == pytest.approx(33.0)
    plan = plan_offload(m)
    check_consistent(plan, m)
    assert plan.resident == ("layers.15",)
    assert plan.arena_bytes == 2 * SLOT
    assert plan.predicted_step_s == pytest.approx(m.compute_s)
    assert plan.budget_bytes is None


def test_compute_bound_chain_with_a_long_tail_streams_everything_through_two_slots() -> None:
    # A 1 s tail hides the copy issued after the last unit: nothing needs to stay resident.
    m = dataclasses.replace(uniform(16, 2.0, 1.0), tail_s=1.0)
    plan = plan_offload(m)
    check_consistent(plan, m)
    assert plan.resident == ()
    assert plan.arena_bytes == 2 * SLOT
    assert plan.predicted_step_s == pytest.approx(m.compute_s)
    # Half of it does not: the last unit stays resident again.
    half = dataclasses.replace(m, tail_s=0.5)
    assert plan_offload(half).resident == ("layers.15",)


def test_copies_that_cannot_hide_keep_units_resident_without_budget() -> None:
    # Copies take 3x the compute: a step within tolerance of 12 s copies at most 3 units after the first
    # compute (1 + 3 x 3 <= 12 * 1.005), which takes 11 slots of weights (see the module docstring:
    # 10 slots copy at least 4).
    m = uniform(12, 1.0, 3.0)
    plan = plan_offload(m)
    check_consistent(plan, m)
    assert plan.resident
    assert plan.predicted_step_s <= m.compute_s * NO_BUDGET_SLOWDOWN
    assert weights_slots(plan) == pytest.approx(11.0, abs=0.01)
    # And 11 is the least: a slot less is measurably slower, whatever the budget mode finds.
    tighter = plan_offload(m, plan.predicted_peak_bytes - SLOT)
    assert tighter.predicted_step_s == pytest.approx(1.0 + 4 * 3.0)
    assert tighter.predicted_step_s > m.compute_s * NO_BUDGET_SLOWDOWN


GB = 10**9
LINK = 25e9


def llama_like(layer_s: float, head_s: float = 0.01, tail_s: float = 0.0) -> Measurements:
    layers = [UnitMeasurement(f"layers.{i}", int(0.44 * GB), layer_s) for i in range(32)]
    units = (UnitMeasurement("embed", GB, 1e-6), *layers, UnitMeasurement("lm_head", GB, head_s))
    return Measurements(
        units=units, link=LinkModel.constant(LINK), tail_s=tail_s, activation_peak_bytes=GB // 2
    )


LAYER = align_up(int(0.44 * GB), UNIT_ALIGNMENT)


def test_first_unit_whose_copy_cannot_hide_stays_resident() -> None:
    # Layers hide their own copies (40 ms compute vs 17.6 ms copy). Streamed, the embedding (the first
    # unit, 40 ms to copy) shares its range with the last units, so its copy is issued at the end of
    # the step with only the head's 20 ms (and no tail) left to hide under: it stays resident, and so
    # does the head, whose size would otherwise set a 2 GB arena. Two layer slots then do: layers.1's
    # copy, issued after layers.31, hides under the head.
    m = llama_like(0.04, head_s=0.02)
    plan = plan_offload(m)
    check_consistent(plan, m)
    assert plan.resident == ("embed", "lm_head")
    assert plan.arena_bytes == 2 * LAYER
    assert plan.predicted_step_s == pytest.approx(m.compute_s)


def test_a_long_tail_lets_the_first_unit_stream() -> None:
    # A 100 ms tail hides the 75.2 ms of copies (embedding and two layers) that the head's range holds
    # up until the end of the step: everything streams through two embedding-sized slots, 2 GB instead
    # of 2.88 GB.
    m = llama_like(0.04, head_s=0.02, tail_s=0.1)
    plan = plan_offload(m)
    check_consistent(plan, m)
    assert plan.resident == ()
    assert plan.arena_bytes == 2 * align_up(GB, UNIT_ALIGNMENT)
    assert plan.predicted_step_s == pytest.approx(m.compute_s)
    assert simulate(plan, m).tail_copy_s == pytest.approx(0.0)


def test_tight_budget_keeps_the_first_unit_whose_copy_ends_the_step_resident() -> None:
    # A 2-slot first unit, three 1-slot units, 1 s computes and 1 s copies per slot, 4 slots of budget.
    # All streamed through 4 slots, u3 wraps over u0: u0's 2 s copy is issued after the last unit and
    # the step waits for it (4 + 2 s). Keeping u0 resident shrinks the arena to 2 slots, the same
    # memory, and leaves only u1's 1 s copy after u3 (4 + 1 s). No copy waits in either: only the copy
    # ending the step tells the planner that u0 is worth keeping.
    m = Measurements(
        units=tuple(UnitMeasurement(f"u{i}", n * SLOT, 1.0) for i, n in enumerate([2, 1, 1, 1])),
        link=LinkModel.constant(SLOT / 1.0),
    )
    streamed_all = simulate(Plan((), ("u0", "u1", "u2", "u3"), 4 * SLOT), m)
    assert streamed_all.step_s == pytest.approx(6.0)
    assert streamed_all.exposed_wait_s == pytest.approx(0.0)
    plan = plan_offload(m, 4 * SLOT)
    check_consistent(plan, m)
    assert plan.resident == ("u0",)
    assert plan.arena_bytes == 2 * SLOT
    assert plan.predicted_step_s == pytest.approx(5.0)


def test_big_end_units_whose_copies_cannot_hide_stay_resident() -> None:
    # With a 10 ms head, layers.1's 17.6 ms copy issued after layers.31 is 7.6 ms short of hiding: over
    # NO_BUDGET_SLOWDOWN of a 1.29 s step. Keeping layers.31 resident too gives it 40 ms more.
    m = llama_like(0.04)
    slim = Plan(("embed", "lm_head"), tuple(u.name for u in m.units[1:-1]), 2 * LAYER)
    assert simulate(slim, m).step_s == pytest.approx(m.compute_s + int(0.44 * GB) / LINK - 0.01)
    plan = plan_offload(m)
    check_consistent(plan, m)
    assert plan.resident == ("embed", "layers.31", "lm_head")
    assert plan.arena_bytes == 2 * LAYER
    assert plan.predicted_step_s == pytest.approx(m.compute_s)


def test_very_different_sizes_with_a_budget() -> None:
    m = llama_like(0.005)  # layers are transfer bound: 5 ms compute, 17.6 ms copy
    previous = float("inf")
    for gb in (3, 5, 8, 12.5, 16):
        budget = int(gb * GB)
        plan = plan_offload(m, budget)
        check_consistent(plan, m)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_step_s <= previous
        previous = plan.predicted_step_s
        # The copy stream starts when the first streamed unit's compute ends, and then never idles.
        sim = simulate(plan, m)
        first = next(u for u in sim.units if not u.resident)
        bound = max(m.compute_s, first.compute_end_s + sim.streamed_bytes / LINK)
        assert bound - 1e-9 <= plan.predicted_step_s <= bound * 1.02
    # 12.5 GB: embedding, head and 20 layers resident; 12 layers, spread out so every copy has compute
    # under it, stream through two layer slots at link speed from the end of layers.0's compute.
    plan = plan_offload(m, int(12.5 * GB))
    assert plan.arena_bytes == 2 * LAYER
    assert {"embed", "lm_head"} <= set(plan.resident)
    assert plan.streamed[0] == "layers.0"
    assert len(plan.streamed) == 12
    assert plan.predicted_step_s == pytest.approx(1e-6 + 0.005 + 12 * int(0.44 * GB) / LINK)
    # 16 GB: enough residents that the copies hide under compute.
    assert plan_offload(m, 16 * GB).predicted_step_s == pytest.approx(m.compute_s)


def test_budget_search_reaches_compute_speed_when_a_plan_does() -> None:
    # Light and heavy 1-slot units (1 and 3 s), 2 s copies, 5 slots of budget. Everything streamed
    # through two slots takes 15 s. Five slots run at compute speed (10 s), for instance with u3..u5
    # resident and u0..u2 through two slots: u2's copy (issued after u0, 1-3) hides under u1, u1 stays
    # for good, and u0's copy for the next step (issued after u2, 5-7) hides under u3..u5. The copies'
    # waits, not only the copy ending the step, must steer the search there.
    m = Measurements(
        units=tuple(UnitMeasurement(f"u{i}", SLOT, t) for i, t in enumerate([1.0, 3.0, 1.0, 3.0, 1.0, 1.0])),
        link=LinkModel.constant(SLOT / 2.0),
    )
    assert simulate(Plan((), tuple(u.name for u in m.units), 2 * SLOT), m).step_s == pytest.approx(15.0)
    assert simulate(Plan(("u3", "u4", "u5"), ("u0", "u1", "u2"), 2 * SLOT), m).step_s == pytest.approx(10.0)
    plan = plan_offload(m, 5 * SLOT)
    check_consistent(plan, m)
    assert plan.predicted_peak_bytes <= 5 * SLOT
    assert plan.predicted_step_s == pytest.approx(m.compute_s) == pytest.approx(10.0)


def test_generous_budget_takes_the_least_memory_among_equally_fast_plans() -> None:
    m = uniform(10, 2.0, 1.0)
    plan = plan_offload(m, 100 * SLOT)
    assert plan.predicted_step_s == pytest.approx(m.compute_s)
    # Two slots and the last unit resident, for the copy issued after it (see the compute-bound test).
    assert plan.predicted_peak_bytes == FIXED + 3 * SLOT
    assert plan.resident == ("layers.9",)


# --- budget errors ------------------------------------------------------------------------------------


def test_infeasible_budget_names_the_numbers() -> None:
    m = Measurements(
        units=tuple(UnitMeasurement(f"layers.{i}", int(0.73 * GiB), 0.01) for i in range(8)),
        link=LinkModel.constant(LINK),
        baseline_bytes=int(0.04 * GiB),
        activation_peak_bytes=int(3.8 * GiB),
    )
    with pytest.raises(BudgetError) as info:
        plan_offload(m, 4 * GiB)
    assert str(info.value) == (
        "budget 4.00 GiB is below the 5.30 GiB this model needs at this input: activations 3.80 GiB, "
        "the two largest units in flight 1.46 GiB, weights that never stream and other tensors on the "
        "device 41.0 MiB; raise the budget (of an offloaded model: flextensor.set_budget(model, size)), "
        "offload more modules or free what else the process holds on the device"
    )
    assert info.value.budget_bytes == 4 * GiB and info.value.needed_bytes == minimal_need_bytes(m)[0]


def test_budget_exactly_at_the_minimal_need_is_feasible() -> None:
    m = Measurements(
        units=tuple(UnitMeasurement(f"u{i}", (i % 3 + 1) * 10_000, 0.01) for i in range(7)),
        link=LinkModel.constant(1e6),
        baseline_bytes=1234,
        activation_peak_bytes=56_789,
    )
    need, in_flight = minimal_need_bytes(m)
    assert in_flight == 2 * align_up(30_000, UNIT_ALIGNMENT)
    assert need == 1234 + 56_789 + in_flight
    plan = plan_offload(m, need)
    check_consistent(plan, m)
    assert plan.resident == () and plan.arena_bytes == in_flight
    assert plan.predicted_peak_bytes == need
    with pytest.raises(BudgetError, match=r"bytes\)"):  # one byte short still prints distinct numbers
        plan_offload(m, need - 1)


def test_no_units() -> None:
    m = Measurements(units=(), link=LinkModel.constant(1.0), tail_s=0.5, baseline_bytes=10)
    for budget in (None, 10, 10**9):
        plan = plan_offload(m, budget)
        assert (plan.resident, plan.streamed, plan.arena_bytes) == ((), (), 0)
        assert plan.predicted_step_s == pytest.approx(0.5)
        assert plan.predicted_peak_bytes == 10
    with pytest.raises(BudgetError):
        plan_offload(m, 9)


def test_a_single_unit_stays_resident() -> None:
    m = Measurements(units=(UnitMeasurement("only", 5 * SLOT, 1.0),), link=LinkModel.constant(SLOT))
    plan = plan_offload(m, 5 * SLOT)
    assert plan.resident == ("only",) and plan.streamed == ()
    assert plan.predicted_step_s == pytest.approx(1.0)


def test_a_hundred_units_plan() -> None:
    # Sizes and compute times cycling through a few values, as in a model with several module kinds.
    units = tuple(UnitMeasurement(f"u{i}", (1 + i % 4) * SLOT, 0.5 + (i * 7 % 5) * 0.25) for i in range(100))
    m = Measurements(units=units, link=LinkModel.constant(SLOT))
    total = sum(u.nbytes for u in units)
    plan = plan_offload(m, total // 2)
    check_consistent(plan, m)
    assert plan.predicted_peak_bytes <= total // 2
    sim = simulate(plan, m)
    assert plan.predicted_step_s <= 1.05 * max(m.compute_s, sim.streamed_bytes / SLOT)
    free = plan_offload(m)
    assert free.predicted_step_s <= m.compute_s * NO_BUDGET_SLOWDOWN
    assert free.predicted_peak_bytes < total


# --- invariants ---------------------------------------------------------------------------------------


@st.composite
def measurements(draw: st.DrawFn) -> Measurements:
    n = draw(st.integers(1, 7))
    sizes = draw(st.lists(st.integers(1, 6).map(lambda k: k * UNIT_ALIGNMENT), min_size=n, max_size=n))
    computes = draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0, 0.4]), min_size=n, max_size=n))
    return Measurements(
        units=tuple(UnitMeasurement(f"u{i}", sizes[i], computes[i], gaps[i]) for i in range(n)),
        link=LinkModel.constant(float(UNIT_ALIGNMENT)),
        tail_s=draw(st.sampled_from([0.0, 0.3])),
        baseline_bytes=draw(st.integers(0, 3 * UNIT_ALIGNMENT)),
        activation_peak_bytes=draw(st.integers(0, 3 * UNIT_ALIGNMENT)),
    )


@settings(max_examples=150, deadline=None)
@given(
    measurements(), st.lists(st.integers(-2 * UNIT_ALIGNMENT, 40 * UNIT_ALIGNMENT), min_size=1, max_size=6)
)
def test_more_budget_is_never_slower(m: Measurements, offsets: list[int]) -> None:
    need, _ = minimal_need_bytes(m)
    previous: Plan | None = None
    for budget in sorted(need + o for o in offsets):
        if budget < need:
            with pytest.raises(BudgetError):
                plan_offload(m, budget)
            continue
        plan = plan_offload(m, budget)
        check_consistent(plan, m)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_step_s >= m.compute_s - 1e-9
        if previous is not None:
            assert plan.predicted_step_s <= previous.predicted_step_s * (1 + 1e-9) + 1e-12
        previous = plan


@settings(max_examples=150, deadline=None)
@given(measurements())
def test_no_budget_plan_is_within_tolerance_of_all_resident(m: Measurements) -> None:
    plan = plan_offload(m)
    check_consistent(plan, m)
    assert plan.predicted_step_s <= m.compute_s * NO_BUDGET_SLOWDOWN + 1e-12
    # It never costs more than keeping everything resident.
    every = sum(align_up(u.nbytes, UNIT_ALIGNMENT) for u in m.units)
    assert plan.predicted_peak_bytes <= m.baseline_bytes + m.activation_peak_bytes + every


@settings(max_examples=100, deadline=None)
@given(measurements(), st.data())
def test_search_sees_what_the_simulator_predicts(m: Measurements, data: st.DataObject) -> None:
    # The search scores configurations through a faster path than simulate(); if the two disagreed the
    # plan chosen would not be the best by its own prediction, and more budget could look slower.
    search = _Search(m)
    n = len(m.units)
    resident = frozenset(data.draw(st.sets(st.integers(0, n - 1))))
    rung = data.draw(st.sampled_from([*_multipliers(search), 1]))
    config = search.evaluate(resident, rung)
    names = search.names
    plan = Plan(
        resident=tuple(names[i] for i in range(n) if i in config.resident),
        streamed=tuple(names[i] for i in range(n) if i not in config.resident),
        arena_bytes=config.arena,
    )
    sim = simulate(plan, m)
    assert config.step_s == sim.step_s
    assert config.memory == sim.peak_bytes
