"""The ``flextensor`` command: in-process through ``main`` for speed, and once through the entry point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import flextensor
from flextensor.cli.main import main, parse_budget
from flextensor.errors import ConfigError
from flextensor.phases.profiling import EXTRA_FORWARDS
from real_models import llama_inputs, tiny_llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "llama.json"
    model = flextensor.offload(
        tiny_llama(layers=4),
        flextensor.OffloadConfig(include_patterns=["model.layers.*"], device="cpu"),
    )
    with torch.no_grad():
        while flextensor.phase(model) != "inference":
            model(llama_inputs())
    flextensor.save_profile(model, path)
    return path


@pytest.fixture(scope="module")
def pipeline_profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The profile of a pipeline (a mapping of two stacks of linear layers), saved in steady state."""
    path = tmp_path_factory.mktemp("profiles") / "pipeline.json"
    torch.manual_seed(0)
    parts = {
        name: torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3))) for name in ("enc", "dec")
    }
    flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", include_patterns=["enc.*", "dec.*"]))
    x = torch.randn(2, 64)
    with torch.no_grad():
        while flextensor.phase(parts) != "inference":
            parts["dec"](parts["enc"](x))
    flextensor.save_profile(parts, path)
    flextensor.release(parts)
    return path


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("flextensor: error: ")
    return lines[0]


def test_profile_show(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "show", str(profile_path)]) == 0
    out = capsys.readouterr().out
    for text in ("model.layers.*", "cpu", torch.__version__, "0:(2, 8)", "38 tensors", "arena"):
        assert text in out
    for i in range(4):
        assert f"model.layers.{i}" in out
    assert "predicted step" in out and "compute ms" in out and "link" in out


def test_plan_single_budget_and_none(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(profile_path), "--budget", "100KiB"]) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "predicted peak" in out and "100.0 KiB" in out
    assert out.count("streamed") >= 4  # every layer streams within 100 KiB
    assert main(["plan", str(profile_path), "--budget", "none"]) == 0
    assert "budget          none" in capsys.readouterr().out


def test_plan_range_table_shows_infeasible_rows(
    profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(profile_path), "--budget", "40KiB..200KiB", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    for label in ("40.0 KiB", "80.0 KiB", "120.0 KiB", "160.0 KiB", "200.0 KiB"):
        assert label in out
    assert "below" in out  # 40 KiB cannot hold two layers: the BudgetError's reason is in its row


def test_plan_times_staged_copies_as_the_host_budget_did(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile saved under a host budget plans offline as the run did: with no room to pin, every
    streamed unit is staged at the slower staged speed, and the predicted step is longer."""
    import dataclasses

    from flextensor.plan.host_plan import HostPlan
    from flextensor.plan.measurements import LinkModel
    from flextensor.plan.planner import plan_offload
    from flextensor.profiles.file import load_profile_file, save_profile_file

    profile = load_profile_file(profile_path)
    slow = LinkModel(points=((1 << 20, 1e6),))  # 1 MB/s: staged copies dominate the step
    staged = dataclasses.replace(profile, host=HostPlan(capacity_bytes=0, staged_link=slow))
    path = tmp_path / "staged.json"
    save_profile_file(staged, path)
    budget = 100 * 1024
    assert main(["plan", str(path), "--budget", "100KiB"]) == 0
    out = capsys.readouterr().out
    expected = plan_offload(staged.measurements, budget, staged.host)
    assert expected.staged and f"{expected.predicted_step_s * 1e3:.2f} ms" in out
    pinned = plan_offload(profile.measurements, budget)
    assert expected.predicted_step_s > pinned.predicted_step_s
    assert main(["profile", "show", str(path)]) == 0
    assert "host budget" in capsys.readouterr().out


def test_profile_show_and_plan_read_a_pipelines_profile(
    pipeline_profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(pipeline_profile_path)
    assert main(["profile", "show", path]) == 0
    out = capsys.readouterr().out
    assert re.search(r"components +enc, dec", out), out
    for name in ("enc", "dec"):
        assert f"component {name}" in out
    assert out.count("units, in execution order") == 2 and "predicted step" in out
    assert main(["plan", path, "--budget", "100KiB"]) == 0
    out = capsys.readouterr().out
    assert "component enc" in out and "component dec" in out and out.count("plan for") == 2
    assert out.count("predicted steady step, per unit") == 2
    assert main(["plan", path, "--budget", "8KiB..1MiB", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("plans over budgets") == 2 and "below" in out  # 8 KiB holds no two layers
    assert main(["plan", path, "--budget", "8KiB"]) == 2
    assert "component 'enc'" in _one_error_line(capsys.readouterr().err)


def test_parse_budget() -> None:
    assert parse_budget("none") == [None]
    assert parse_budget("8GiB") == [8 * 2**30]
    assert parse_budget("4GiB..16GiB") == [round((4 + 12 * i / 7) * 2**30) for i in range(8)]
    assert parse_budget("1KiB..2KiB", steps=3) == [1024, 1536, 2048]
    for bad in ("lots", "2GiB..1GiB", "1GiB..x"):
        with pytest.raises(ConfigError):
            parse_budget(bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "show", "/no/such/profile.json"], "does not exist"),
        (["plan", "/no/such/profile.json"], "does not exist"),
        (["plan", "PROFILE", "--budget", "lots"], "not a byte size"),
        (["plan", "PROFILE", "--budget", "1KiB"], "below"),
        (["plan", "PROFILE", "--budget", "1GiB..2GiB", "--steps", "1"], "--steps"),
        (["demo", "--device", "cpu", "--budget", "lots"], "not a byte size"),
    ],
)
def test_errors_are_one_line_and_status_2(
    argv: list[str], message: str, profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(profile_path) if a == "PROFILE" else a for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in _one_error_line(captured.err)
    assert captured.out == ""


def test_profile_of_another_version_is_refused(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(profile_path.read_text())
    data["version"] = 99
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    assert main(["profile", "show", str(newer)]) == 2
    assert "version 99" in _one_error_line(capsys.readouterr().err)
    directory = tmp_path / "a_directory"
    directory.mkdir()
    assert main(["plan", str(directory)]) == 2
    _one_error_line(capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_probe_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == "flextensor: error: no CUDA device: probe measures the host-device link"


def test_probe_result_renders_and_serialises() -> None:
    import io

    from rich.console import Console

    from flextensor.observe.probe import CopyMeasurement, PinMeasurement, ProbeResult

    mib = 2**20
    result = ProbeResult(
        "cuda:0",
        "Test GPU",
        tuple(
            CopyMeasurement(direction, pinned, size, size / 20e9)
            for size in (mib, 256 * mib)
            for direction in ("host_to_device", "device_to_host")
            for pinned in (True, False)
        ),
        (PinMeasurement("torch pin_memory()", 256 * mib, 0.1),),
    )
    data = result.to_dict()
    json.dumps(data)
    assert data["copies"][0]["gbps"] == pytest.approx(20.0)
    out = io.StringIO()
    Console(file=out, width=120).print(result)
    text = out.getvalue()
    assert "H2D pinned" in text and "D2H pageable" in text and "256.0 MiB" in text and "20.0" in text
    assert "pin_memory()" in text and "2.68" in text  # 256 MiB in 0.1 s


@pytest.mark.parametrize(
    "argv",
    [[], ["probe"], ["profile"], ["profile", "show"], ["plan"], ["demo"]],
)
def test_help_on_every_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--help"]) == 0
    assert "usage: flextensor" in capsys.readouterr().out


def test_version_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flextensor {flextensor.__version__}"
    assert main([]) == 2  # no command: the help, on stderr
    assert main(["profile"]) == 2  # no action
    assert main(["frobnicate"]) == 2
    assert main(["demo", "--layers", "many"]) == 2


def test_demo_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--device", "cpu", "--layers", "2", "--hidden", "64", "--seq", "8", "--steps", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out
    for text in ("weights held on the device", "step time", "forwards until steady state"):
        assert text in out
    assert "outputs bitwise equal" in out and "yes" in out
    assert "model.layers.1" in out  # the report table
    assert "timings say nothing about a GPU" in " ".join(out.split())


def test_run_demo_falls_back_to_an_mlp_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    from flextensor.cli.demo import run_demo

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    result = run_demo("cpu", layers=3, hidden=32, steps=1, seq=4)
    assert result["model"].startswith("MLP stack")
    assert result["bitwise_equal"] is True and result["max_abs_diff"] == 0.0
    # One discovery and one profiling forward; up to EXTRA_FORWARDS more when a loaded machine's timings
    # disagree (see [Note: robust measurements] in phases/profiling.py).
    assert 2 <= result["forwards_to_steady"] <= 2 + EXTRA_FORWARDS
    # An all-resident plan holds the weights plus alignment padding (512 B per parameter): tiny here.
    assert 0 < result["offloaded_weights_bytes"] <= 1.25 * result["weights_bytes"]
    assert result["native_peak_bytes"] is None and result["offloaded_step_s"] > 0
    assert [u.name for u in result["report"].units] == ["layers.0", "layers.1", "layers.2"]


def _run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("FT_LOG_LEVEL", None)
    return subprocess.run(
        [sys.executable, "-m", "flextensor", *argv],  # python -m flextensor: __main__.py
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_entry_point(profile_path: Path) -> None:
    ok = _run_cli("plan", str(profile_path), "--budget", "100KiB..200KiB", "--steps", "2")
    assert ok.returncode == 0, ok.stderr
    assert "100.0 KiB" in ok.stdout and "200.0 KiB" in ok.stdout
    bad = _run_cli("profile", "show", "/no/such/profile.json")
    assert bad.returncode == 2 and bad.stdout == ""
    assert "does not exist" in _one_error_line(bad.stderr)


def test_console_script_is_declared() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["flextensor"] == "flextensor.cli.main:main"
