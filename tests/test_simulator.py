"""The two-stream simulator against timelines worked out by hand, and its invariants.

Sizes are whole multiples of the arena alignment and the link moves one "slot" (``SLOT`` bytes) in
``COPY`` seconds, so closed forms come out in round numbers.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flextensor.layout import UNIT_ALIGNMENT, align_up, ring_layout
from flextensor.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.planner import Plan
from flextensor.simulator import Simulation, _prefetch_lists, _ring_ready_after, simulate

SLOT = 256 * UNIT_ALIGNMENT  # 1 MiB: aligned, so padding never changes the arithmetic


def chain(
    computes: list[float],
    *,
    copy_s: float = 1.0,
    slots: list[int] | None = None,
    gaps: list[float] | None = None,
    tail_s: float = 0.0,
    baseline: int = 0,
    activations: int = 0,
) -> Measurements:
    """Units ``u0..`` with these compute times; unit ``i`` is ``slots[i]`` slots big (default 1)."""
    n = len(computes)
    slots = slots or [1] * n
    gaps = gaps or [0.0] * n
    return Measurements(
        units=tuple(UnitMeasurement(f"u{i}", slots[i] * SLOT, computes[i], gaps[i]) for i in range(n)),
        link=LinkModel.constant(SLOT / copy_s),
        tail_s=tail_s,
        baseline_bytes=baseline,
        activation_peak_bytes=activations,
    )


def streamed(m: Measurements, arena_slots: float, resident: tuple[str, ...] = ()) -> Plan:
    names = tuple(u.name for u in m.units if u.name not in resident)
    return Plan(resident=resident, streamed=names, arena_bytes=int(arena_slots * SLOT))


# --- closed forms -------------------------------------------------------------------------------------


def test_transfer_bound_chain_runs_at_link_speed() -> None:
    # Copies (3 s) dwarf computes (1 s): with two slots the copy stream never idles, cyclic prefetch
    # included, so the step is exactly the bytes over the bandwidth.
    m = chain([1.0] * 8, copy_s=3.0)
    sim = simulate(streamed(m, 2), m)
    assert sim.streamed_bytes == 8 * SLOT
    assert sim.step_s == pytest.approx(24.0)
    assert sim.step_s == pytest.approx(sim.streamed_bytes / (SLOT / 3.0))
    assert sim.exposed_wait_s == pytest.approx(24.0 - 8.0)
    # Back-to-back copies: each starts when the one before it ends.
    copies = [(u.copy_start_s, u.copy_end_s) for u in sim.units]
    for (_, end), (start, _) in itertools.pairwise(copies):
        assert start == pytest.approx(end)


def test_transfer_bound_chain_cold_costs_one_more_compute() -> None:
    # Without cross-step prefetch the copies still run back to back from the step's start, but the last
    # unit's compute now comes after all of them: bytes / bandwidth + one compute (< one copy).
    m = chain([1.0] * 8, copy_s=3.0)
    sim = simulate(streamed(m, 2), m, cyclic=False)
    assert sim.step_s == pytest.approx(24.0 + 1.0)
    assert sim.units[0].copy_start_s == pytest.approx(0.0)


def test_compute_bound_chain_runs_at_compute_speed() -> None:
    m = chain([3.0] * 8, copy_s=1.0)
    sim = simulate(streamed(m, 2), m)
    assert sim.step_s == pytest.approx(m.compute_s) == pytest.approx(24.0)
    assert sim.exposed_wait_s == pytest.approx(0.0)
    for u in sim.units:
        assert u.copy_end_s is not None and u.copy_end_s <= u.compute_start_s + 1e-12
    # The first unit's copy was issued in the previous step, after the second-to-last unit's compute.
    assert sim.units[0].copy_start_s == pytest.approx(-3.0)
    # Cold, the first copy has nothing to hide under.
    assert simulate(streamed(m, 2), m, cyclic=False).step_s == pytest.approx(1.0 + 24.0)


def test_mixed_chain_timeline_by_hand() -> None:
    # Light/heavy alternating units (1 s, 4 s), 2 s copies, two slots: u0/u2 share slot 0, u1/u3 slot 1.
    # Worked by hand (times from the steady step's start): u3's copy may start only when u1's compute
    # ends (6), takes 2 s while u2 computes 1 s, so u3 waits 1 s; likewise u1 waits 1 s for its copy,
    # issued after the previous step's u3 (which ends at 0). u0's and u2's copies hide under the heavy
    # units. Step = 10 s compute + 2 x 1 s.
    m = chain([1.0, 4.0, 1.0, 4.0], copy_s=2.0)
    sim = simulate(streamed(m, 2), m)
    assert sim.step_s == pytest.approx(12.0)
    assert sim.compute_s == pytest.approx(10.0)
    assert sim.exposed_wait_s == pytest.approx(2.0)
    expected = {  # name: (copy start, copy end, compute start, wait)
        "u0": (-4.0, -2.0, 0.0, 0.0),
        "u1": (0.0, 2.0, 2.0, 1.0),
        "u2": (2.0, 4.0, 6.0, 0.0),
        "u3": (6.0, 8.0, 8.0, 1.0),
    }
    for u in sim.units:
        cs, ce, start, wait = expected[u.name]
        assert (u.copy_start_s, u.copy_end_s) == (pytest.approx(cs), pytest.approx(ce)), u.name
        assert u.compute_start_s == pytest.approx(start), u.name
        assert u.wait_s == pytest.approx(wait), u.name
    assert [u.slot_offset for u in sim.units] == [0, SLOT, 0, SLOT]
    # Cold: A 0-2 and B 2-4 copied at the start; C's copy after A, D's after B: 14 s.
    assert simulate(streamed(m, 2), m, cyclic=False).step_s == pytest.approx(14.0)


def test_cold_first_unit_copy_cannot_hide() -> None:
    # Everything fits the arena, so steady state copies nothing; cold, each step starts by copying the
    # 5-slot first unit with nothing before it to hide under: step = first copy + all compute.
    m = chain([1.0, 2.0, 2.0], slots=[5, 1, 1])
    arena = 7
    assert simulate(streamed(m, arena), m).step_s == pytest.approx(5.0)
    cold = simulate(streamed(m, arena), m, cyclic=False)
    assert cold.step_s == pytest.approx(5.0 + 5.0)
    assert cold.units[0].wait_s == pytest.approx(5.0)
    assert cold.streamed_bytes == 7 * SLOT
    # A 2 s gap before the first unit hides 2 s of that copy.
    gapped = chain([1.0, 2.0, 2.0], slots=[5, 1, 1], gaps=[2.0, 0.0, 0.0])
    cold = simulate(streamed(gapped, arena), gapped, cyclic=False)
    assert cold.step_s == pytest.approx(5.0 + 5.0)
    assert cold.units[0].wait_s == pytest.approx(3.0)


GB = 10**9
LINK = 25e9  # bytes/s, a PCIe 4 x16 link


def llama_like(layer_s: float, head_s: float) -> Measurements:
    layers = [UnitMeasurement(f"layers.{i}", int(0.44 * GB), layer_s) for i in range(32)]
    units = (UnitMeasurement("embed", GB, 1e-6), *layers, UnitMeasurement("lm_head", GB, head_s))
    return Measurements(units=units, link=LinkModel.constant(LINK))


def test_units_of_very_different_sizes() -> None:
    # A 1 GB embedding first, 32 x 0.44 GB layers, a 1 GB LM head, through two of the largest units.
    big = 2 * align_up(GB, UNIT_ALIGNMENT)
    transfer_bound = llama_like(1e-6, 1e-6)
    names = tuple(u.name for u in transfer_bound.units)
    sim = simulate(Plan((), names, big), transfer_bound)
    assert sim.streamed_bytes == sum(u.nbytes for u in transfer_bound.units)
    assert sim.step_s == pytest.approx(sim.streamed_bytes / LINK, rel=1e-4)

    # Heavy layers hide their own copies, but the LM head's range wraps over the embedding and first
    # layers: their copies can only start once the head has run, at the very end of the step.
    m = llama_like(0.04, 0.01)
    layout = ring_layout(names, [u.nbytes for u in m.units], big)
    assert layout.ready_after[0] == len(names) - 1
    sim = simulate(Plan((), names, big), m)
    embed_copy, layer_copy = GB / LINK, int(0.44 * GB) / LINK
    assert sim.units[0].copy_start_s == pytest.approx(0.0, abs=1e-9)
    assert sim.exposed_wait_s == pytest.approx(embed_copy + layer_copy - 1e-6)
    assert sim.step_s == pytest.approx(m.compute_s + embed_copy + layer_copy - 1e-6)
    # Keeping those two resident lets two layer slots do: every copy hides.
    layers = names[1:-1]
    slim = Plan(("embed", "lm_head"), layers, 2 * align_up(int(0.44 * GB), UNIT_ALIGNMENT))
    sim = simulate(slim, m)
    assert sim.step_s == pytest.approx(m.compute_s)
    assert sim.exposed_wait_s == pytest.approx(0.0, abs=1e-9)


def test_arena_holding_everything_copies_nothing_in_steady_state() -> None:
    m = chain([0.5, 0.1, 2.0, 0.3], copy_s=5.0, slots=[1, 2, 1, 3], tail_s=0.25)
    sim = simulate(streamed(m, 7), m)
    assert sim.streamed_bytes == 0
    assert sim.step_s == pytest.approx(m.compute_s)
    assert all(u.copy_start_s is None and u.copy_end_s is None for u in sim.units)
    assert [u.slot_offset for u in sim.units] == [0, SLOT, 3 * SLOT, 4 * SLOT]


def test_resident_units_cost_no_copy() -> None:
    m = chain([1.0] * 4, copy_s=3.0)
    sim = simulate(streamed(m, 2, resident=("u1", "u3")), m)
    by_name = {u.name: u for u in sim.units}
    for name in ("u1", "u3"):
        u = by_name[name]
        assert u.resident and u.copy_start_s is None and u.slot_offset is None and u.wait_s == 0.0
    # u0 and u2 fill the two slots exactly: nothing streams any more.
    assert sim.streamed_bytes == 0
    assert sim.step_s == pytest.approx(4.0)
    every = Plan(tuple(u.name for u in m.units), (), 0)
    assert simulate(every, m).step_s == pytest.approx(m.compute_s)
    assert simulate(every, m).streamed_bytes == 0


def test_peak_bytes_formula() -> None:
    units = (
        UnitMeasurement("a", 10_000, 1.0),  # pads to 12288
        UnitMeasurement("b", 5_000, 1.0),
        UnitMeasurement("c", 4_096, 1.0),
    )
    m = Measurements(
        units=units, link=LinkModel.constant(1e6), baseline_bytes=777, activation_peak_bytes=1_000
    )
    plan = Plan(("a",), ("b", "c"), 16_384)
    assert simulate(plan, m).peak_bytes == 777 + 12_288 + 16_384 + 1_000
    # The arena counts whole, however little of it the streamed units use.
    roomy = Plan(("a",), ("b", "c"), 1 << 20)
    assert simulate(roomy, m).peak_bytes == 777 + 12_288 + (1 << 20) + 1_000


def test_cold_steps_copy_every_streamed_unit() -> None:
    m = chain([1.0, 1.0, 1.0], slots=[1, 1, 1])
    assert simulate(streamed(m, 3), m).streamed_bytes == 0
    assert simulate(streamed(m, 3), m, cyclic=False).streamed_bytes == 3 * SLOT


def test_to_dict_is_json_ready() -> None:
    m = chain([1.0, 2.0], copy_s=0.5)
    sim = simulate(streamed(m, 1), m)
    data = json.loads(json.dumps(sim.to_dict()))
    assert data["step_s"] == sim.step_s
    assert [u["name"] for u in data["units"]] == ["u0", "u1"]
    assert set(data["units"][0]) == {
        "name", "resident", "nbytes", "copy_start_s", "copy_end_s",
        "compute_start_s", "compute_end_s", "wait_s", "slot_offset",
    }  # fmt: skip
    assert isinstance(sim, Simulation)


def test_rejects_plans_that_do_not_match_the_measurements() -> None:
    m = chain([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="no entry"):
        simulate(Plan(("u0",), ("u1",), SLOT), m)
    with pytest.raises(ValueError, match="execution order"):
        simulate(Plan((), ("u1", "u0", "u2"), SLOT), m)
    with pytest.raises(ValueError, match="both"):
        simulate(Plan(("u0",), ("u0", "u1", "u2"), SLOT), m)
    with pytest.raises(ValueError, match="largest"):
        simulate(Plan((), ("u0", "u1", "u2"), SLOT - 1), m)
    with pytest.raises(ValueError, match="steps"):
        simulate(streamed(m, 2), m, steps=0)


def test_no_units_is_just_the_tail() -> None:
    m = Measurements(units=(), link=LinkModel.constant(1.0), tail_s=0.5)
    sim = simulate(Plan((), (), 0), m)
    assert sim.step_s == pytest.approx(0.5) and sim.units == ()


# --- the ring layout is not monotone: documented, since the planner must search around it --------------


def test_larger_arena_can_be_slower() -> None:
    # Four 1-slot units, copy = compute = 1 s. Two slots: every copy hides under one compute (4 s).
    # Three slots: u1, u2 stay for good, but u0 and u3 share slot 0, so u0's copy can only start after
    # u3, the last unit, has run: 1 s exposed per step. The planner simulates rather than assume
    # monotonicity for this reason.
    m = chain([1.0] * 4)
    assert simulate(streamed(m, 2), m).step_s == pytest.approx(4.0)
    assert simulate(streamed(m, 3), m).step_s == pytest.approx(5.0)


def test_making_a_unit_resident_can_be_slower() -> None:
    # Five 1-slot units in three slots: u0/u3 and u1/u4 share slots, u2 stays; each copy hides (5 s).
    # With u2 resident the ring shifts: u0 and u4 share slot 0 and u0's copy waits for the last unit.
    m = chain([1.0] * 5)
    assert simulate(streamed(m, 3), m).step_s == pytest.approx(5.0)
    assert simulate(streamed(m, 3, resident=("u2",)), m).step_s == pytest.approx(6.0)


# --- invariants ---------------------------------------------------------------------------------------


@st.composite
def measurements(draw: st.DrawFn, max_units: int = 8) -> Measurements:
    n = draw(st.integers(1, max_units))
    sizes = draw(
        st.lists(
            st.one_of(st.integers(1, 6).map(lambda k: k * UNIT_ALIGNMENT), st.integers(0, 7 * 4096)),
            min_size=n,
            max_size=n,
        )
    )
    computes = draw(st.lists(st.floats(0.0, 4.0), min_size=n, max_size=n))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0, 0.5]), min_size=n, max_size=n))
    return Measurements(
        units=tuple(UnitMeasurement(f"u{i}", sizes[i], computes[i], gaps[i]) for i in range(n)),
        link=LinkModel.constant(float(UNIT_ALIGNMENT)),  # one aligned page per second
        tail_s=draw(st.sampled_from([0.0, 0.7])),
        baseline_bytes=draw(st.integers(0, 10**6)),
        activation_peak_bytes=draw(st.integers(0, 10**6)),
    )


@st.composite
def plans(draw: st.DrawFn) -> tuple[Measurements, Plan]:
    m = draw(measurements())
    names = [u.name for u in m.units]
    resident = draw(st.lists(st.booleans(), min_size=len(names), max_size=len(names)))
    streamed_units = [u for u, r in zip(m.units, resident, strict=True) if not r]
    padded = [align_up(u.nbytes, UNIT_ALIGNMENT) for u in streamed_units]
    arena = draw(st.integers(max(padded, default=0), sum(padded) + UNIT_ALIGNMENT))
    plan = Plan(
        resident=tuple(n for n, r in zip(names, resident, strict=True) if r),
        streamed=tuple(u.name for u in streamed_units),
        arena_bytes=arena,
    )
    return m, plan


@settings(max_examples=300, deadline=None)
@given(plans(), st.booleans())
def test_step_is_compute_plus_waits_and_bounded_by_the_link(
    case: tuple[Measurements, Plan], cyclic: bool
) -> None:
    m, plan = case
    sim = simulate(plan, m, cyclic=cyclic)
    assert sim.compute_s == pytest.approx(m.compute_s)
    assert sim.step_s >= sim.compute_s - 1e-9
    assert sim.step_s == pytest.approx(sim.compute_s + sim.exposed_wait_s, abs=1e-9)
    # Every byte copied in a step goes through the one link, which moves a page per second.
    assert sim.step_s >= sim.streamed_bytes / UNIT_ALIGNMENT - 1e-9
    for u in sim.units:
        assert u.wait_s >= 0.0
        assert u.compute_end_s >= u.compute_start_s
        if u.copy_end_s is not None:
            assert u.copy_end_s <= u.compute_start_s + 1e-9


@settings(max_examples=200, deadline=None)
@given(plans(), st.booleans())
def test_three_steps_reach_the_steady_state(case: tuple[Measurements, Plan], cyclic: bool) -> None:
    m, plan = case
    assert simulate(plan, m, cyclic=cyclic).step_s == pytest.approx(
        simulate(plan, m, steps=7, cyclic=cyclic).step_s, rel=1e-9, abs=1e-9
    )


@settings(max_examples=200, deadline=None)
@given(plans())
def test_nothing_beats_an_arena_that_holds_everything(case: tuple[Measurements, Plan]) -> None:
    m, plan = case
    sizes = [align_up(m.by_name()[n].nbytes, UNIT_ALIGNMENT) for n in plan.streamed]
    roomy = Plan(plan.resident, plan.streamed, max(plan.arena_bytes, sum(sizes)))
    every = Plan(tuple(u.name for u in m.units), (), 0)
    step = simulate(plan, m).step_s
    assert simulate(roomy, m).step_s == pytest.approx(m.compute_s)
    assert simulate(roomy, m).step_s <= step + 1e-9
    assert simulate(every, m).step_s <= step + 1e-9


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.integers(0, 5 * 4096), st.integers(0, 4).map(lambda k: k * 4096)), max_size=12),
    st.integers(0, 20 * 4096),
)
def test_fast_layout_matches_ring_layout(sizes: list[int], extra: int) -> None:
    arena = max((align_up(s, UNIT_ALIGNMENT) for s in sizes), default=0) + extra
    names = [f"u{i}" for i in range(len(sizes))]
    layout = ring_layout(names, sizes, arena)
    ready_after = _ring_ready_after(sizes, arena)
    assert ready_after == layout.ready_after
    assert tuple(tuple(p) for p in _prefetch_lists(ready_after)) == layout.prefetch_after
