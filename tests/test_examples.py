"""The pipeline examples (examples/*.py) run with ``--random-weights --tiny`` on the CPU, each in a
process of its own as a user runs it: every component offloaded under the tightest budget, the mp4
written, and the frames bitwise equal to the pipeline's own without flextensor
(``--compare-native``). The three run at the same time to stay well under a minute on 2 cores."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flextensor
from flextensor.host.packs import pack_layout
from flextensor.pipelines.configs import default_unit_patterns
from flextensor.pipelines.pipeline import components_of
from flextensor.plan.layout import minimal_arena_bytes
from flextensor.weights.selection import select

pytest.importorskip("diffusers")
pytest.importorskip("imageio_ffmpeg", reason="writing an mp4 needs imageio-ffmpeg (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))  # the examples import their shared module as scripts do

NAMES = ("wan2_2_t2v", "ltx2", "cosmos")


def torchvision_missing() -> str | None:
    """diffusers' Cosmos models resize their padding mask with torchvision; None when it imports."""
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # a wheel built for another torch fails with more than ImportError
        return f"diffusers' Cosmos models need torchvision matching this torch ({error})"
    return None


def tightest_budget(name: str) -> int:
    """Two of the largest units in flight of the component that needs most: every unit of that
    component streams, and no two components fit together (tests/test_pipelines.py's bound, for any
    pipeline)."""
    example = importlib.import_module(name).EXAMPLE
    from example_common import parse_args

    pipe = example.build_tiny(parse_args(example, ["--random-weights", "--tiny"]))
    needs = []
    for module in components_of(pipe).values():
        params = dict(module.named_parameters())
        if not params:
            continue
        selection = select(module, default_unit_patterns(module), ())
        sizes = [
            pack_layout([(n, params[n]) for n in selection.unit_parameters[u]])[1] for u in selection.units
        ]
        needs.append(2 * minimal_arena_bytes(sizes))
    return max(needs)


def example_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"  # three at once on two cores
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    out = tmp_path_factory.mktemp("examples")
    env = example_env()
    procs = {}
    for name in NAMES:
        if name == "cosmos" and torchvision_missing():
            continue
        video = out / f"{name}.mp4"
        cmd = [sys.executable, str(EXAMPLES / f"{name}.py"), "--random-weights", "--tiny", "--device", "cpu"]
        cmd += ["--compare-native", "--budget", str(tightest_budget(name)), "--output", str(video)]
        cmd += ["--profile", str(out / f"{name}.ftprofile.json")]  # written after the run
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True), video)  # fmt: skip
    results = {}
    for name, (proc, video) in procs.items():
        stdout, _ = proc.communicate(timeout=240)
        results[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout), video)
    return results


@pytest.mark.parametrize("name", NAMES)
def test_example_writes_its_video_and_matches_native_bitwise(name: str, runs) -> None:
    if name == "cosmos" and (reason := torchvision_missing()):
        pytest.skip(reason)
    done, video = runs[name]
    assert done.returncode == 0, done.stdout[-4000:]
    assert "outputs match native: bitwise" in done.stdout, done.stdout[-4000:]
    assert "(inference)" in done.stdout  # the compared generation ran every component's plan
    import imageio_ffmpeg

    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(video))
    assert f"wrote {video} ({frames} frames)" in done.stdout


def test_a_saved_profile_starts_the_example_in_steady_state(runs) -> None:
    done, video = runs["wan2_2_t2v"]
    profile = video.parent / "wan2_2_t2v.ftprofile.json"
    assert done.returncode == 0 and f"profile saved to {profile}" in done.stdout, done.stdout[-4000:]
    cmd = [*done.args[:-4], "--output", str(video.with_suffix(".again.mp4")), "--profile", str(profile)]
    again = subprocess.run(cmd, env=example_env(), capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "phase inference" in again.stdout and "warm-up" not in again.stdout, again.stdout
    assert "outputs match native: bitwise" in again.stdout


@pytest.mark.parametrize("name", NAMES)
def test_example_help_names_its_options(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    example = importlib.import_module(name).EXAMPLE
    from example_common import main

    with pytest.raises(SystemExit) as exit_info:
        main(example, ["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    for option in ("--model-id", "--random-weights", "--tiny", "--budget", "--steps", "--frames",
                   "--compare-native", "--output"):  # fmt: skip
        assert option in usage, option


def test_example_refuses_random_weights_without_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    from example_common import main

    with pytest.raises(SystemExit) as exit_info:
        main(importlib.import_module("wan2_2_t2v").EXAMPLE, ["--random-weights"])
    assert exit_info.value.code == 2 and "add --tiny" in capsys.readouterr().err


def test_the_examples_extra_leaves_an_installed_torch_alone() -> None:
    """An unpinned torchvision in ``.[examples]`` pulled the torch it was built for (a CUDA build of 5 GB)
    over the installed one: Cosmos's torchvision is an extra of its own, installed as a pair with torch."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {
        re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower() for requirement in extras["examples"]
    }
    assert not names & {"torch", "torchvision", "torchaudio"}, extras["examples"]
    assert "torchvision" in extras["cosmos"] and "flextensor[examples]" in extras["cosmos"]


def test_cosmos_without_torchvision_says_what_it_needs() -> None:
    """diffusers' Cosmos models die of a NameError deep inside diffusers without torchvision: the example
    checks first, before anything is built, and says what to install."""
    code = (
        "import sys; sys.modules['torchvision'] = None; sys.path.insert(0, sys.argv[1]); import cosmos; "
        "argv = ['--random-weights', '--tiny', '--device', 'cpu', '--output', '-']; "
        "sys.exit(cosmos.main(cosmos.EXAMPLE, argv))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(EXAMPLES)],
        env=example_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-4000:]
    assert "cosmos needs torchvision" in done.stderr and "NameError" not in done.stderr, done.stderr[-4000:]
    assert "pip install" in done.stderr and ".[cosmos]" in done.stderr, done.stderr[-4000:]
    assert "cosmos:" not in done.stdout  # nothing was built or loaded


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class _CountingPipe:
    """A stand-in pipeline of one component: it counts the generations it runs without flextensor."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = _Blocks()
        self.native_calls = 0

    @property
    def components(self) -> dict[str, torch.nn.Module]:
        return {"net": self.net}

    def set_progress_bar_config(self, **kwargs: object) -> None:
        pass

    def to(self, device: str) -> _CountingPipe:
        self.net.to(device)
        return self

    def __call__(self, x: torch.Tensor) -> SimpleNamespace:
        try:
            flextensor.status(self.net)
        except flextensor.NotOffloadedError:
            self.native_calls += 1
        return SimpleNamespace(frames=[self.net(x).numpy()])


def test_compare_native_warms_native_up_as_flextensor_was(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``--compare-native`` timed one cold native generation against warmed-up offloaded ones (ratios like
    0.10x): native now runs the same number of warm-ups first, then as many timed generations."""
    import example_common

    pipe = _CountingPipe()
    example = example_common.Example(
        name="counting",
        description="a stand-in pipeline",
        load=lambda args: pipe,
        build_tiny=lambda args: pipe,
        call_kwargs=lambda pipe, args: {"x": torch.ones(2, 8)},
        defaults={},
        tiny_defaults={"steps": 1, "frames": 1, "height": 8, "width": 8, "fps": 1},
    )
    timed: list[tuple[str, int]] = []  # each timed generation's label, and native generations before it
    real = example_common.timed_generation

    def counting(example, pipe, args, label):
        timed.append((label, pipe.native_calls))
        return real(example, pipe, args, label)

    monkeypatch.setattr(example_common, "timed_generation", counting)
    argv = [
        "--random-weights",
        "--tiny",
        "--device",
        "cpu",
        "--compare-native",
        "--runs",
        "2",
        "--output",
        "-",
    ]
    assert example_common.main(example, argv) == 0
    assert "outputs match native: bitwise" in capsys.readouterr().out
    warmups = sum(label.startswith("flextensor warm-up") for label, _ in timed)
    assert warmups >= 1  # the component learned its plan in its first generations
    native = [(label, before) for label, before in timed if label.startswith("native")]
    assert [label for label, _ in native if "warm-up" in label] == [
        f"native warm-up {i + 1}" for i in range(warmups)
    ]
    assert [before for label, before in native if "warm-up" not in label] == [warmups, warmups + 1]
    assert pipe.native_calls == warmups + 2
