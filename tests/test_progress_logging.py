"""Progress bars (FT_PROGRESS, the delayed start) and the flextensor logger (FT_LOG_LEVEL)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import flextensor
from flextensor.common.log import configure_logging
from flextensor.common.progress import progress_bar, progress_mode
from spec_model import make_spec_model, spec_tokens

ROOT = Path(__file__).resolve().parents[1]


# -- progress -----------------------------------------------------------------------------------------------


def test_progress_mode_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert progress_mode({}) == "auto"
    assert progress_mode({"FT_PROGRESS": "0"}) == "off"
    assert progress_mode({"FT_PROGRESS": "off"}) == "off"
    assert progress_mode({"FT_PROGRESS": "1"}) == "forced"
    assert progress_mode({"FT_PROGRESS": " Yes "}) == "forced"
    assert progress_mode({"FT_PROGRESS": "maybe"}) == "auto"
    monkeypatch.setenv("FT_PROGRESS", "0")
    assert progress_mode() == "off"


def test_progress_off_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FT_PROGRESS", "0")
    with progress_bar("Packing weights", 4, delay_s=0) as bar:
        for _ in range(4):
            bar.advance()
    assert not bar.shown
    assert capsys.readouterr() == ("", "")


def test_progress_auto_is_off_when_stderr_is_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("FT_PROGRESS", raising=False)
    with progress_bar("Packing weights", 4, delay_s=0) as bar:
        bar.advance(4)
    assert not bar.shown
    assert capsys.readouterr().err == ""


def test_progress_forced_into_a_log_writes_plain_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FT_PROGRESS", "1")  # stderr is captured here: not a terminal
    with progress_bar("Packing weights", 3 * 2**20, unit="bytes", delay_s=0) as bar:
        for _ in range(3):
            bar.advance(2**20)
    assert bar.shown and bar.completed == 3 * 2**20
    captured = capsys.readouterr()
    assert "Packing weights ..." in captured.err
    assert "Packing weights done 3.0 MiB of 3.0 MiB (100%)" in captured.err
    assert "\x1b" not in captured.err and "\r" not in captured.err  # no colour codes, no redraws
    assert captured.out == ""


def test_progress_on_a_terminal_draws_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    from flextensor.common.progress import ProgressBar

    bar = ProgressBar("Packing weights", 2**20, unit="bytes", delay_s=0, force_terminal=True)
    bar.advance(2**20)
    bar.close()
    assert bar.shown


def test_progress_appears_only_after_the_delay(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FT_PROGRESS", "1")
    with progress_bar("Quick work", 2, delay_s=30) as bar:
        bar.advance(2)
    assert not bar.shown
    assert capsys.readouterr().err == ""

    with progress_bar("Slow work", 2, delay_s=0.05) as bar:
        bar.advance(1)
        deadline = time.monotonic() + 10
        while not bar.shown and time.monotonic() < deadline:  # the timer thread starts it
            time.sleep(0.01)
        bar.advance(1)
    assert bar.shown
    assert "Slow work" in capsys.readouterr().err


def test_progress_closes_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_PROGRESS", "1")
    timers = {t for t in threading.enumerate() if isinstance(t, threading.Timer)}
    with pytest.raises(RuntimeError, match="boom"), progress_bar("Failing work", 2, delay_s=30) as bar:
        raise RuntimeError("boom")
    assert not bar.shown
    assert {t for t in threading.enumerate() if isinstance(t, threading.Timer)} <= timers  # none left


# -- logging ------------------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root_handlers = list(logging.getLogger().handlers)
    yield
    configure_logging({})
    assert logging.getLogger().handlers == root_handlers  # the root logger is never touched


def _steady_spec_model() -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(device="cpu"))
    with torch.no_grad():
        while flextensor.phase(model) != "inference":
            model(spec_tokens())


def test_log_level_info_shows_phase_lines(restore_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    logger = configure_logging({"FT_LOG_LEVEL": "info"})
    assert logger.level == logging.INFO
    _steady_spec_model()
    err = capsys.readouterr().err
    assert "flextensor INFO: discovery -> profiling" in err
    assert "flextensor INFO: profiling -> inference" in err
    assert "flextensor INFO: flextensor:" not in err  # the prefix is not doubled


def test_default_is_quiet(restore_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    logger = configure_logging({})
    assert logger.level == logging.NOTSET and logger.getEffectiveLevel() >= logging.WARNING
    _steady_spec_model()
    assert "flextensor" not in capsys.readouterr().err


WARN_AND_INFO = (
    "import logging, sys, flextensor\n"
    "log = logging.getLogger('flextensor')\n"
    "log.info('an info line')\n"
    "log.warning('a warning, %s', 'formatted')\n"
    "if len(sys.argv) > 1:\n"
    "    logging.basicConfig(format='app: %(name)s %(message)s')\n"
    "    log.warning('the application decides')\n"
)


def test_warnings_reach_stderr_when_the_application_configures_no_logging() -> None:
    """A warning says flextensor gave something up: without FT_LOG_LEVEL and without any logging set up
    by the application it still reaches stderr (once, saying whose it is), info lines do not; once the
    application configures logging, its handlers alone show flextensor's records."""
    env = {k: v for k, v in os.environ.items() if k != "FT_LOG_LEVEL"}
    env["PYTHONPATH"] = str(ROOT / "src")
    plain = subprocess.run([sys.executable, "-c", WARN_AND_INFO], capture_output=True, text=True, env=env)
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr == "flextensor WARNING: a warning, formatted\n"
    configured = subprocess.run(
        [sys.executable, "-c", WARN_AND_INFO, "configure"], capture_output=True, text=True, env=env
    )
    assert configured.returncode == 0, configured.stderr
    assert configured.stderr.splitlines() == [
        "flextensor WARNING: a warning, formatted",
        "app: flextensor the application decides",
    ]


def test_reconfiguring_replaces_handlers(restore_logging: None) -> None:
    logger = configure_logging({"FT_LOG_LEVEL": "DEBUG"})
    configure_logging({"FT_LOG_LEVEL": "20"})
    assert logger.level == logging.INFO
    assert sum(isinstance(h, logging.StreamHandler) for h in logger.handlers) == 1
    configure_logging({})
    assert logger.level == logging.NOTSET
    (fallback,) = logger.handlers  # warnings only, while the application configures no logging
    assert fallback.level == logging.WARNING


def test_invalid_log_level_warns_and_falls_back(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = configure_logging({"FT_LOG_LEVEL": "LOUD"})
    assert logger.level == logging.WARNING
    err = capsys.readouterr().err
    assert "flextensor WARNING: FT_LOG_LEVEL='LOUD' is not a log level" in err


def test_log_level_is_read_at_import() -> None:
    env = {**os.environ, "FT_LOG_LEVEL": "DEBUG", "PYTHONPATH": str(ROOT / "src")}
    code = "import logging, flextensor; print(logging.getLogger('flextensor').level)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(logging.DEBUG)
