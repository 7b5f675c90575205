"""flextensor.report and flextensor.trace on the CPU engine: they read the step the engine recorded."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

import flextensor
from engine_helpers import offload_with_placements
from flextensor.errors import NotOffloadedError
from flextensor.observe.report import Report
from real_models import llama_inputs, tiny_llama

LAYERS = 4
ALL_STREAMED = 100 * 1024
"""Room for two of tiny_llama's 40 KiB (aligned) layers and not three: every layer streams."""


def _offloaded(budget: int | None) -> torch.nn.Module:
    config = flextensor.OffloadConfig(
        include_patterns=["model.layers.*"], device="cpu", gpu_memory_budget=budget
    )
    return flextensor.offload(tiny_llama(layers=LAYERS), config)


def _to_steady(model: torch.nn.Module) -> None:
    inputs = llama_inputs()
    with torch.no_grad():
        while flextensor.phase(model) != "inference":
            model(inputs)
        model(inputs)  # the first steady forward: recorded


@pytest.fixture(scope="module")
def streamed_model() -> torch.nn.Module:
    model = _offloaded(ALL_STREAMED)
    _to_steady(model)
    return model


def test_report_rows_follow_execution_order_with_slots(streamed_model: torch.nn.Module) -> None:
    status = flextensor.status(streamed_model)
    rep = flextensor.report(streamed_model)
    assert isinstance(rep, Report)
    assert [u.name for u in rep.units] == flextensor.offload_units(streamed_model)
    assert [u.name for u in rep.units] == [f"model.layers.{i}" for i in range(LAYERS)]
    arena = status.arena_bytes
    for row in rep.units:
        assert row.nbytes == status.unit(row.name).nbytes
        assert not row.resident and row.placement == "streamed"
        assert row.slot_start is not None and row.slot_end is not None
        assert 0 <= row.slot_start < row.slot_end <= arena
        assert row.compute_ms > 0 and row.wait_ms >= 0
        assert row.copy_ms is not None and row.copy_ms > 0
    # Consecutive units never share bytes: one computes while the next is copied in.
    for a, b in zip(rep.units, rep.units[1:], strict=False):
        assert a.slot_end <= b.slot_start or b.slot_end <= a.slot_start


def test_report_totals(streamed_model: torch.nn.Module) -> None:
    status = flextensor.status(streamed_model)
    rep = flextensor.report(streamed_model)
    assert rep.step_ms > 0 and rep.compute_ms > 0
    assert status.plan is not None
    assert rep.predicted_step_ms == pytest.approx(status.plan.predicted_step_s * 1e3)
    assert rep.predicted_peak_bytes == status.plan.predicted_peak_bytes
    assert rep.streamed_bytes == sum(u.nbytes for u in rep.units)  # each layer once per step
    assert rep.copies == LAYERS
    assert rep.achieved_gbps is not None and rep.achieved_gbps > 0
    assert rep.link_gbps is not None and rep.link_gbps > 0
    assert rep.budget_bytes == ALL_STREAMED
    assert rep.arena_bytes == status.arena_bytes
    assert rep.device_bytes_held == status.device_bytes_held
    assert rep.host_bytes_held == sum(u.host_bytes for u in status.units) > 0  # all streamed
    assert rep.peak_allocated_bytes is None  # not counted on CPU
    assert rep.exposed_wait_ms == pytest.approx(sum(u.wait_ms for u in rep.units))


def test_report_to_dict_and_rendering(streamed_model: torch.nn.Module) -> None:
    rep = flextensor.report(streamed_model)
    data = rep.to_dict()
    json.dumps(data)  # plain data
    assert {"model", "device", "units", "step_ms", "predicted_step_ms", "streamed_bytes"} <= set(data)
    assert {"achieved_gbps", "link_gbps", "peak_allocated_bytes", "budget_bytes"} <= set(data)
    assert {"device_bytes_held", "host_bytes_held"} <= set(data)
    row = data["units"][0]
    assert {"name", "nbytes", "placement", "slot", "compute_ms", "copy_ms", "wait_ms"} <= set(row)
    assert row["slot"].startswith("arena 0.00\u2013") and row["slot"].endswith(" KiB")

    text = str(rep)
    for name in (u.name for u in rep.units):
        assert name in text
    assert "measured" in text and "predicted" in text and "streamed" in text and "host RAM" in text
    assert all(line == line.rstrip() for line in text.splitlines())
    out = io.StringIO()
    rep.print(Console(file=out, width=140))
    assert "model.layers.3" in out.getvalue()


def test_report_on_cpu_gives_the_memcpy_rate_not_a_share_of_a_link(streamed_model: torch.nn.Module) -> None:
    """On a CPU device a unit's "copy" is a memcpy within host RAM: the report gives its rate in GB/s and
    says so, never a percentage of a host-to-device link (such a share read 1527 %)."""
    rep = flextensor.report(streamed_model)
    assert rep.device == "cpu" and rep.achieved_gbps is not None and rep.link_gbps is not None
    (streamed,) = [line for line in str(rep).splitlines() if line.startswith("streamed")]
    assert "memcpy" in streamed and "%" not in streamed and "link" not in streamed, streamed
    assert len(re.findall(r"\d (?:GB|MB)/s", streamed)) == 2, streamed  # achieved and probed


def test_report_resident_units_say_so() -> None:
    model = _offloaded(None)  # no budget: the planner may keep any unit resident
    _to_steady(model)
    status = flextensor.status(model)
    rep = flextensor.report(model)
    for row in rep.units:
        assert row.resident == (row.name in status.resident)
        assert (row.slot_start is None) == row.resident
        assert ("resident" in row.placement) == row.resident
    # Resident units hold their weights on the device only: host bytes are the streamed units' packs.
    assert rep.host_bytes_held == sum(u.host_bytes for u in status.units if u.name in status.streamed)
    assert all(
        u.placement == "device_only" and u.host_bytes == 0 for u in status.units if u.name in status.resident
    )


def test_report_before_steady_state_raises() -> None:
    model = _offloaded(ALL_STREAMED)
    with pytest.raises(NotOffloadedError, match=r"run one forward in steady state first"):
        flextensor.report(model)
    with torch.no_grad():
        model(llama_inputs())  # discovery ends: the next forward profiles
    with pytest.raises(NotOffloadedError, match="profiling phase"):
        flextensor.report(model)
    with pytest.raises(NotOffloadedError, match="not offloaded"):
        flextensor.report(torch.nn.Linear(2, 2))


def test_record_next_step_refreshes_the_recording(streamed_model: torch.nn.Module) -> None:
    first = flextensor.report(streamed_model).forward
    with torch.no_grad():
        streamed_model(llama_inputs())
    assert flextensor.report(streamed_model).forward == first  # steady forwards are not recorded unless asked
    flextensor.record_next_step(streamed_model)
    with torch.no_grad():
        streamed_model(llama_inputs())
    assert flextensor.report(streamed_model).forward == flextensor.status(streamed_model).forwards - 1 > first
    assert [u.name for u in flextensor.report(streamed_model).units] == flextensor.offload_units(
        streamed_model
    )


def test_trace_writes_chrome_trace_json(streamed_model: torch.nn.Module, tmp_path: Path) -> None:
    path = tmp_path / "step.json"
    assert flextensor.trace(streamed_model, path) == path
    document = json.loads(path.read_text())
    events = document["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {1: "compute stream", 2: "copy stream"}
    slices = [e for e in events if e["ph"] == "X"]
    for e in slices:
        assert e["pid"] == 1 and e["ts"] >= 0 and e["dur"] >= 0
    units = flextensor.offload_units(streamed_model)
    compute = [e for e in slices if e["tid"] == 1 and e["cat"] == "unit"]
    assert [e["name"] for e in compute] == units
    assert all(e["args"]["bytes"] > 0 and e["args"]["placement"] == "streamed" for e in compute)
    copies = [e for e in slices if e["tid"] == 2]
    assert sorted(e["name"] for e in copies) == sorted(units)
    assert all(e["args"]["bytes"] > 0 for e in copies)
    for wait in (e for e in slices if e["cat"] == "wait"):
        assert wait["tid"] == 1 and wait["name"].removeprefix("wait ") in units
    (step,) = [e for e in slices if e["cat"] == "step"]
    for e in compute:  # nested inside the step slice, as Perfetto draws them
        assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3


def test_trace_replaces_atomically_and_refuses_before_steady_state(
    streamed_model: torch.nn.Module, tmp_path: Path
) -> None:
    path = tmp_path / "step.json"
    path.write_text("old")
    flextensor.trace(streamed_model, str(path))
    assert json.loads(path.read_text())["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.json"]  # no temporary file left

    fresh = _offloaded(ALL_STREAMED)
    with pytest.raises(NotOffloadedError, match="steady state"):
        flextensor.trace(fresh, tmp_path / "none.json")
    assert not (tmp_path / "none.json").exists()


def test_each_plan_reports_its_own_recorded_step() -> None:
    """A served model switches plans between input shapes (prefill, decode): the report describes the
    plan in place, recorded at its first step, not a refusal because another plan ran last."""
    trading = {
        8: ("embed", "layers.0", "layers.1", "lm_head"),
        32: ("embed", "layers.1", "layers.3", "lm_head"),
    }
    model, tokens, refs = offload_with_placements(trading)
    with torch.no_grad():
        for seq in (8, 32):
            model(tokens[seq])  # each plan's first step, recorded
        for seq in (8, 32, 8):
            assert torch.equal(model(tokens[seq]), refs[seq])
            resident = {u.name for u in flextensor.report(model).units if u.resident}
            assert resident == set(trading[seq]) & set(flextensor.offload_units(model))


def test_a_plan_not_yet_run_reports_the_latest_step_when_its_units_sit_where_they_did() -> None:
    """The forward that made a plan was a profiling one (a server's last step can be): until the plan's
    own first step, the report shows the latest recorded step, as every unit still streams."""
    model = _offloaded(ALL_STREAMED)
    _to_steady(model)
    recorded = flextensor.report(model).forward
    with torch.no_grad():
        while True:  # new shapes: profiled until their plan is made, by the last of these forwards
            model(llama_inputs(seq=32))
            if flextensor.phase(model) == "inference":
                break
    assert flextensor.report(model).forward == recorded
    with torch.no_grad():
        model(llama_inputs(seq=32))  # the new plan's first step: its own
    assert flextensor.report(model).forward == flextensor.status(model).forwards - 1
