"""The planner's and simulator's model of compressed loads (see [Note: coded loads] in plan/measurements.py):
hand-computed times and peaks, and plans that code a unit only where it pays. Pure: no torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flextensor.common.json_codec import from_json_data, to_json_data
from flextensor.common.sizes import align_up
from flextensor.errors import PlanError
from flextensor.plan.layout import UNIT_ALIGNMENT
from flextensor.plan.measurements import (
    CODED_PIECE_BYTES,
    LinkModel,
    Measurements,
    UnitMeasurement,
    coded_pieces,
)
from flextensor.plan.plan import Plan
from flextensor.plan.planner import minimal_need_bytes, plan_offload
from flextensor.plan.simulator import simulate

UNIT = 16 * UNIT_ALIGNMENT  # 64 KiB
CODED = 11 * UNIT_ALIGNMENT  # 0.6875 of it
LINK = 1e9  # bytes/s: a raw copy takes 65.536 us, a coded one 45.056 us
FAST_DECODE = 1e11  # a decode of UNIT bytes takes 0.655 us


def link_bound(
    units: int = 4, decode_bps: float | None = FAST_DECODE, coded: int | None = CODED
) -> Measurements:
    """``units`` layers of UNIT bytes that compute nothing: every step is its copies."""
    return Measurements(
        units=tuple(UnitMeasurement(f"layers.{i}", UNIT, 0.0, coded_nbytes=coded) for i in range(units)),
        link=LinkModel.constant(LINK),
        decode_bps=decode_bps,
    )


def test_a_coded_load_is_its_compressed_copy_then_its_decode() -> None:
    measurements = link_bound()
    unit = measurements.units[0]
    assert measurements.coded_load_s(unit) == pytest.approx(CODED / LINK + UNIT / FAST_DECODE)
    assert measurements.load_s(unit) == measurements.coded_load_s(unit)
    assert replace(measurements, decode_bps=None).coded_load_s(unit) is None
    raw = link_bound(coded=None)
    assert raw.coded_load_s(raw.units[0]) is None and raw.load_s(raw.units[0]) == pytest.approx(UNIT / LINK)


def test_the_simulator_times_coded_loads_and_counts_their_staging_buffer() -> None:
    measurements = link_bound()
    names = tuple(u.name for u in measurements.units)
    raw = Plan(resident=(), streamed=names, arena_bytes=2 * UNIT)
    coded = replace(raw, coded=names)
    load = CODED / LINK + UNIT / FAST_DECODE
    # Four loads one after another on the copy stream, nothing to hide them under.
    assert simulate(raw, measurements).step_s == pytest.approx(4 * UNIT / LINK)
    assert simulate(coded, measurements).step_s == pytest.approx(4 * load)
    assert simulate(raw, measurements).peak_bytes == 2 * UNIT
    assert simulate(coded, measurements).peak_bytes == 2 * UNIT + 2 * CODED  # two staging slots, aligned
    with pytest.raises(PlanError, match="compressed unit"):
        simulate(coded, link_bound(coded=None))


def test_plans_load_the_compressed_units_coded_and_budget_their_staging() -> None:
    measurements = link_bound()
    need, _ = minimal_need_bytes(measurements)
    assert need == 2 * UNIT + 2 * CODED
    plan = plan_offload(measurements, budget_bytes=need)
    assert plan.resident == () and plan.coded == plan.streamed
    assert plan.predicted_peak_bytes <= need
    assert plan.predicted_step_s == pytest.approx(4 * (CODED / LINK + UNIT / FAST_DECODE))
    # With room for the staging slots to matter little, coded loads make the step faster.
    budget = 4 * UNIT
    uncoded = plan_offload(link_bound(units=8, coded=None), budget_bytes=budget)
    coded = plan_offload(link_bound(units=8), budget_bytes=budget)
    assert coded.coded and coded.predicted_step_s < uncoded.predicted_step_s
    # Resident units are never coded.
    assert plan_offload(measurements, budget_bytes=4 * UNIT) == plan_offload(link_bound(coded=None), 4 * UNIT)


def test_coded_sizes_and_the_decode_speed_survive_a_profile() -> None:
    measurements = link_bound()
    assert from_json_data(to_json_data(measurements, Measurements), Measurements) == measurements
    plan = plan_offload(measurements, budget_bytes=2 * UNIT + 2 * CODED)
    assert from_json_data(to_json_data(plan, Plan), Plan) == plan


def test_a_unit_in_pieces_is_timed_as_its_pieces_copies_and_one_decode() -> None:
    """A unit larger than a piece is copied piece by piece (each copy pays the link's latency) while the
    pieces before decode: a two-stage pipeline, its slower stage paid per piece, the other once. Its
    staging slots hold a piece."""
    piece = CODED_PIECE_BYTES
    nbytes, coded = 3 * piece + piece // 2, int(0.7 * (3 * piece + piece // 2))
    link = LinkModel.constant(LINK, latency_s=1e-5)
    unit = UnitMeasurement("layers.0", nbytes, 0.0, coded_nbytes=coded, coded_piece_nbytes=piece * 3 // 4)
    measurements = Measurements(units=(unit,), link=link, decode_bps=FAST_DECODE)
    assert coded_pieces(nbytes) == 4 and coded_pieces(piece) == 1 and coded_pieces(1) == 1
    copy, decode = 1e-5 + -(-coded // 4) / LINK, nbytes / 4 / FAST_DECODE
    assert copy > decode
    assert measurements.coded_load_s(unit) == pytest.approx(4 * copy + decode)
    # Behind a decoder slower than the link the copies wait for staging slots: the decodes set the pace.
    slow = replace(measurements, decode_bps=LINK / 4)
    assert slow.coded_load_s(unit) == pytest.approx(4 * nbytes / 4 / (LINK / 4) + copy)
    assert unit.staging_nbytes == piece * 3 // 4
    assert replace(unit, coded_piece_nbytes=None).staging_nbytes == coded  # a profile from before pieces
    need, _ = minimal_need_bytes(measurements)
    assert need == align_up(nbytes, UNIT_ALIGNMENT) + 2 * align_up(piece * 3 // 4, UNIT_ALIGNMENT)
    assert from_json_data(to_json_data(measurements, Measurements), Measurements) == measurements


def test_staged_units_held_compressed_are_timed_as_coded_loads_over_the_staged_link() -> None:
    """Under a host budget, a compressed unit that is staged still loads compressed: its pieces cross
    the slower staged link, then decode. The planner ranks and pins by what packs hold (compressed)."""
    from flextensor.plan.host_plan import HostPlan

    measurements = link_bound(units=4)
    names = tuple(u.name for u in measurements.units)
    staged_link = LinkModel.constant(LINK / 2)
    plan = Plan(resident=(), streamed=names, arena_bytes=2 * UNIT, staged=names[:2], coded=names)
    # Four loads back to back: two over the staged link, two over the pinned one.
    step = 2 * (CODED / (LINK / 2) + UNIT / FAST_DECODE) + 2 * (CODED / LINK + UNIT / FAST_DECODE)
    assert simulate(plan, measurements, staged_link=staged_link).step_s == pytest.approx(step)
    # Room to pin two compressed packs, not two raw ones: two units staged, all four compressed.
    host = HostPlan(capacity_bytes=2 * 12 * UNIT_ALIGNMENT, staged_link=staged_link)
    planned = plan_offload(measurements, budget_bytes=2 * UNIT + 2 * CODED, host=host)
    assert len(planned.staged) == 2 and planned.coded == planned.streamed == names
