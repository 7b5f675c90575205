"""The two-stream simulator against timelines worked out by hand, and its invariants.

Sizes are whole multiples of the arena alignment and the link moves one "slot" (``SLOT`` bytes) in
``COPY`` seconds, so closed forms come out in round numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flextensor.common.sizes import align_up
from flextensor.plan.layout import UNIT_ALIGNMENT, ring_layout
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.plan.plan import Plan
from flextensor.plan.simulator import Simulation, simulate

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


def test_transfer_bound_chain_runs_at_link_speed_after_the_first_compute() -> None:
    # Copies (3 s) dwarf computes (1 s). Two slots: u2's copy waits for u0's compute (the first
    # post-hook), then the copy stream never idles: u2..u7, then u0 and u1 for the next step, which the
    # step waits for. Step = one compute + the bytes over the bandwidth = 1 + 8 x 3.
    m = chain([1.0] * 8, copy_s=3.0)
    sim = simulate(streamed(m, 2), m)
    assert sim.streamed_bytes == 8 * SLOT
    assert sim.step_s == pytest.approx(25.0)
    assert sim.step_s == pytest.approx(1.0 + sim.streamed_bytes / (SLOT / 3.0))
    # u2..u7 each wait 2 s (copy 3 s, compute 1 s); the last compute ends at 20, the copies at 25.
    assert sim.exposed_wait_s == pytest.approx(6 * 2.0)
    assert sim.tail_copy_s == pytest.approx(5.0)
    # u0's and u1's copies ran at the end of the previous step, the second one up to its very end.
    assert (sim.units[0].copy_start_s, sim.units[0].copy_end_s) == (pytest.approx(-6.0), pytest.approx(-3.0))
    assert (sim.units[1].copy_start_s, sim.units[1].copy_end_s) == (pytest.approx(-3.0), pytest.approx(0.0))
    # The copy stream idles while u0 computes, then copies back to back.
    assert sim.units[2].copy_start_s == pytest.approx(1.0)
    copies = [(u.copy_start_s, u.copy_end_s) for u in sim.units[2:]]
    for (_, end), (start, _) in itertools.pairwise(copies):
        assert start == pytest.approx(end)


def test_transfer_bound_chain_cold_costs_the_same() -> None:
    # Without cross-step prefetch the copies run back to back from the step's start and the last unit's
    # compute comes after all of them: bytes / bandwidth + one compute, as with cross-step prefetch,
    # whose copies of u0 and u1 now cost the step that issues them.
    m = chain([1.0] * 8, copy_s=3.0)
    sim = simulate(streamed(m, 2), m, cyclic=False)
    assert sim.step_s == pytest.approx(24.0 + 1.0)
    assert sim.units[0].copy_start_s == pytest.approx(0.0)
    assert sim.tail_copy_s == 0.0


def test_compute_bound_chain_waits_for_the_copy_issued_after_its_last_unit() -> None:
    # Computes 3 s, copies 1 s, two slots: every copy hides under a compute except u1's, for the next
    # step: it shares u7's slot, so it can only start once u7, the last unit, has run.
    m = chain([3.0] * 8, copy_s=1.0)
    sim = simulate(streamed(m, 2), m)
    assert sim.step_s == pytest.approx(m.compute_s + 1.0) == pytest.approx(25.0)
    assert sim.exposed_wait_s == pytest.approx(0.0)
    assert sim.tail_copy_s == pytest.approx(1.0)
    for u in sim.units:
        assert u.copy_end_s is not None and u.copy_end_s <= u.compute_start_s + 1e-12
    # u0's copy was issued in the previous step after u6 (at 21 of 25) and hid under u7; u1's ended it.
    assert sim.units[0].copy_start_s == pytest.approx(-4.0)
    assert (sim.units[1].copy_start_s, sim.units[1].copy_end_s) == (pytest.approx(-1.0), pytest.approx(0.0))
    # A tail as long as that copy hides it: the step is the compute time.
    tailed = chain([3.0] * 8, copy_s=1.0, tail_s=1.0)
    sim = simulate(streamed(tailed, 2), tailed)
    assert sim.step_s == pytest.approx(tailed.compute_s) == pytest.approx(25.0)
    assert sim.tail_copy_s == pytest.approx(0.0)
    # Cold, the first copy has nothing to hide under.
    assert simulate(streamed(tailed, 2), tailed, cyclic=False).step_s == pytest.approx(1.0 + 25.0)
    # So does a resident last unit: u0..u6 stream, u0 shares u6's slot and its copy hides under u7.
    sim = simulate(streamed(m, 2, resident=("u7",)), m)
    assert sim.step_s == pytest.approx(m.compute_s)
    assert sim.units[0].copy_start_s == pytest.approx(21.0 - 24.0)


def test_mixed_chain_timeline_by_hand() -> None:
    # Light/heavy alternating units (1 s, 4 s), 2 s copies, two slots: u0/u2 share slot 0, u1/u3 slot 1.
    # Worked by hand (times from the steady step's start; u0 and u1 are there from the previous step):
    # u0 0-1 issues u2's copy 1-3; u1 1-5 issues u3's 5-7; u2 5-6 (its copy hid under u1) issues u0's
    # for the next step, queued behind u3's: 7-9; u3 waits 1 s for its copy, runs 7-11 and issues u1's
    # 11-13, which nothing hides: step = 10 s compute + 1 s wait + 2 s tail copy.
    m = chain([1.0, 4.0, 1.0, 4.0], copy_s=2.0)
    sim = simulate(streamed(m, 2), m)
    assert sim.step_s == pytest.approx(13.0)
    assert sim.compute_s == pytest.approx(10.0)
    assert sim.exposed_wait_s == pytest.approx(1.0)
    assert sim.tail_copy_s == pytest.approx(2.0)
    expected = {  # name: (copy start, copy end, compute start, wait)
        "u0": (7.0 - 13.0, 9.0 - 13.0, 0.0, 0.0),
        "u1": (11.0 - 13.0, 0.0, 1.0, 0.0),
        "u2": (1.0, 3.0, 5.0, 0.0),
        "u3": (5.0, 7.0, 7.0, 1.0),
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
    assert sim.step_s >= sim.streamed_bytes / LINK
    assert sim.step_s == pytest.approx(sim.streamed_bytes / LINK, rel=1e-4)

    # Heavy layers hide their own copies, but the LM head's range wraps over the embedding and the first
    # two layers: their copies can only start once the head, the last unit, has run, and the step waits
    # for all three.
    m = llama_like(0.04, 0.01)
    layout = ring_layout(names, [u.nbytes for u in m.units], big)
    assert layout.ready_after[:3] == (len(names) - 1,) * 3
    sim = simulate(Plan((), names, big), m)
    embed_copy, layer_copy = GB / LINK, int(0.44 * GB) / LINK
    assert sim.units[0].copy_start_s == pytest.approx(-(embed_copy + 2 * layer_copy))
    assert sim.exposed_wait_s == pytest.approx(0.0, abs=1e-9)
    assert sim.tail_copy_s == pytest.approx(embed_copy + 2 * layer_copy)
    assert sim.step_s == pytest.approx(m.compute_s + embed_copy + 2 * layer_copy)
    # Keeping those two resident lets two layer slots do: every copy hides but layers.1's, issued after
    # layers.31 with only the head's 10 ms left to hide its 17.6 ms.
    layers = names[1:-1]
    slim = Plan(("embed", "lm_head"), layers, 2 * align_up(int(0.44 * GB), UNIT_ALIGNMENT))
    sim = simulate(slim, m)
    assert sim.exposed_wait_s == pytest.approx(0.0, abs=1e-9)
    assert sim.tail_copy_s == pytest.approx(layer_copy - 0.01)
    assert sim.step_s == pytest.approx(m.compute_s + layer_copy - 0.01)
    # A tail covering the rest hides it.
    tailed = dataclasses.replace(m, tail_s=layer_copy - 0.01)
    assert simulate(slim, tailed).step_s == pytest.approx(tailed.compute_s)


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
    assert set(data) == {
        "step_s", "peak_bytes", "streamed_bytes", "compute_s", "exposed_wait_s", "tail_copy_s", "units",
    }  # fmt: skip
    assert data["tail_copy_s"] == sim.tail_copy_s > 0  # u0's copy, issued after u1, ends the step
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
    # Units of 2, 1, 2, 1 slots, 2 s compute each, 1 s copy per slot. Four slots: u0/u2 and u1/u3 share
    # ranges like two slots; u0 2 s issues u2's copy 2-4, u1 2-4 issues u3's 4-5, u2 4-6 issues u0's
    # 6-8, u3 6-8 issues u1's 8-9: 9 s. Five slots: u1 and u2 stay for good, but u3 wraps over u0, so
    # u0's 2 s copy can only start after u3, the last unit, has run: 10 s. The planner simulates rather
    # than assume monotonicity for this reason.
    m = chain([2.0] * 4, slots=[2, 1, 2, 1])
    assert simulate(streamed(m, 4), m).step_s == pytest.approx(9.0)
    assert simulate(streamed(m, 5), m).step_s == pytest.approx(10.0)
    assert simulate(streamed(m, 5), m).streamed_bytes < simulate(streamed(m, 4), m).streamed_bytes


def test_making_a_unit_resident_can_be_slower() -> None:
    # Units of 1, 1, 1, 2 slots, 2 s compute each, 1 s copy per slot, three slots. u3 wraps over u0 and
    # u1, u2 stays: u1 2-4 issues u3's copy 4-6, hidden under u2; u3 6-8 issues u0's and u1's copies
    # 8-10 for the next step: 10 s. With u0 resident the ring shifts: u3 wraps over u1 and u2, so its
    # copy is issued after u2 (6-8), which runs right before it: u3 waits 2 s, then u1's and u2's copies
    # 10-12: 12 s.
    m = chain([2.0] * 4, slots=[1, 1, 1, 2])
    assert simulate(streamed(m, 3), m).step_s == pytest.approx(10.0)
    sim = simulate(streamed(m, 3, resident=("u0",)), m)
    assert sim.step_s == pytest.approx(12.0)
    assert sim.units[3].wait_s == pytest.approx(2.0)


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
def test_step_is_compute_plus_waits_plus_tail_copy_and_bounded_by_the_link(
    case: tuple[Measurements, Plan], cyclic: bool
) -> None:
    m, plan = case
    sim = simulate(plan, m, cyclic=cyclic)
    assert sim.compute_s == pytest.approx(m.compute_s)
    assert sim.step_s >= sim.compute_s - 1e-9
    assert sim.tail_copy_s >= 0.0
    assert sim.step_s == pytest.approx(sim.compute_s + sim.exposed_wait_s + sim.tail_copy_s, abs=1e-9)
    # Every byte copied in a step goes through the one link, which moves a page per second.
    assert sim.step_s >= sim.streamed_bytes / UNIT_ALIGNMENT - 1e-9
    for u in sim.units:
        assert u.wait_s >= 0.0
        assert u.compute_end_s >= u.compute_start_s
        if u.copy_start_s is not None and u.copy_end_s is not None:
            assert u.copy_end_s <= u.compute_start_s + 1e-9
            # Copies run within a step: this one's, or the previous one's (a cross-step prefetch).
            assert u.copy_start_s >= -1e-9 or u.copy_end_s <= 1e-9
            assert u.copy_start_s >= -sim.step_s - 1e-9
    if not cyclic:
        # Every copy is consumed in the step that issues it, before the compute ends.
        assert sim.tail_copy_s == 0.0
    elif sim.streamed_bytes:
        # Steady state: nothing issues a copy before the first streamed unit's compute has ended.
        first = next(u for u in sim.units if not u.resident)
        assert sim.step_s >= first.compute_end_s + sim.streamed_bytes / UNIT_ALIGNMENT - 1e-9
    if sim.tail_copy_s > 1e-9:
        # Only a cross-step prefetch can outlast the compute (any other copy ends before its consumer
        # starts), so the step ends on one: in steady state, the last of them ends at 0.
        ahead = [u.copy_end_s for u in sim.units if u.copy_end_s is not None and u.copy_end_s <= 1e-9]
        assert ahead and max(ahead) == pytest.approx(0.0, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(plans(), st.booleans())
def test_default_steps_reach_the_steady_state(case: tuple[Measurements, Plan], cyclic: bool) -> None:
    m, plan = case
    sim, longer = simulate(plan, m, cyclic=cyclic), simulate(plan, m, steps=7, cyclic=cyclic)
    assert sim.step_s == pytest.approx(longer.step_s, rel=1e-9, abs=1e-9)
    assert sim.tail_copy_s == pytest.approx(longer.tail_copy_s, rel=1e-9, abs=1e-9)
    assert sim.streamed_bytes == longer.streamed_bytes


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
