"""What the planner is given: the link model's interpolation and the measurements' totals."""

from __future__ import annotations

import math

import pytest

from flextensor.errors import PlanError
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement

MiB = 2**20


def test_link_speed_is_clamped_outside_its_points_and_log_linear_between() -> None:
    link = LinkModel(points=((16 * MiB, 40e9), (MiB, 10e9)))  # given out of order: sorted
    assert link.points == ((MiB, 10e9), (16 * MiB, 40e9))
    assert link.bytes_per_s(1) == 10e9 and link.bytes_per_s(MiB) == 10e9
    assert link.bytes_per_s(1 << 40) == 40e9
    # 4 MiB is halfway between 1 and 16 MiB in log-size.
    assert link.bytes_per_s(4 * MiB) == pytest.approx(25e9)
    assert link.bytes_per_s(2 * MiB) == pytest.approx(10e9 + 30e9 * math.log(2) / math.log(16))


def test_copy_time_adds_the_fixed_latency_and_is_zero_for_nothing() -> None:
    link = LinkModel.constant(1e9, latency_s=1e-5)
    assert link.copy_s(0) == 0.0
    assert link.copy_s(10**9) == pytest.approx(1.0 + 1e-5)


@pytest.mark.parametrize("points", [(), ((0, 1e9),), ((MiB, 0.0),), ((MiB, -1.0),)])
def test_a_link_needs_positive_points(points: tuple) -> None:
    with pytest.raises(PlanError):
        LinkModel(points=points)


def test_step_compute_is_units_gaps_and_tail() -> None:
    m = Measurements(
        units=(UnitMeasurement("a", 1, 0.5, gap_before_s=0.1), UnitMeasurement("b", 1, 0.25)),
        link=LinkModel.constant(1e9),
        tail_s=0.05,
    )
    assert m.compute_s == pytest.approx(0.9)
    assert list(m.unit_names()) == ["a", "b"] and m.by_name()["b"].compute_s == 0.25
