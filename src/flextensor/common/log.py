"""The ``flextensor`` logger: warnings reach stderr, more only when asked; the root logger is never touched.

:func:`configure_logging` runs once when flextensor is imported. When the environment variable
``FT_LOG_LEVEL`` is set (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``, ``CRITICAL``, any case, or a number),
the logger takes that level and writes to stderr as ``flextensor INFO: <message>``. Without it
flextensor leaves the logger's level alone: an application that configures logging (a handler on the
root logger, or on ``flextensor``) decides what it sees; in one that does not, warnings and errors still
reach stderr, as ``flextensor WARNING: <message>`` (a warning is how flextensor says that it gave
something up, e.g. compression for a budget, so it must not vanish; Python's own last-resort handler
would print it too, without saying whose it is). Info lines stay quiet then.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

__all__ = ["LOGGER_NAME", "LOG_FORMAT", "LOG_LEVEL_ENV_VAR", "configure_logging"]

LOGGER_NAME = "flextensor"
"""Name of the logger every flextensor module logs to."""

LOG_LEVEL_ENV_VAR = "FT_LOG_LEVEL"
"""Environment variable that turns on flextensor's own stderr log output, at the level it names."""

LOG_FORMAT = "flextensor %(levelname)s: %(message)s"
"""Format of the lines written to stderr when ``FT_LOG_LEVEL`` is set."""

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_OURS = "_flextensor_handler"
"""Attribute marking the handlers this module added, so a second call replaces them instead of stacking."""


def _parse_level(raw: str) -> int | None:
    text = raw.strip().upper()
    if text.isdigit():
        return int(text)
    if text == "WARN":
        return logging.WARNING
    return getattr(logging, text) if text in _LEVELS else None


def configure_logging(environ: Mapping[str, str] | None = None) -> logging.Logger:
    """Set up the ``flextensor`` logger from ``FT_LOG_LEVEL`` (read from ``environ``, default os.environ).

    Idempotent: calling it again (e.g. after changing the variable) replaces what an earlier call added.
    An invalid value still turns output on, at WARNING, and says so in a warning on stderr: whoever set
    the variable wants to see flextensor's messages. Returns the logger.
    """
    env = os.environ if environ is None else environ
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if getattr(h, _OURS, False)]:
        logger.removeHandler(handler)
    if getattr(logger, _OURS, False):
        # An earlier call set the level from the variable; undo that before reading it again.
        logger.setLevel(logging.NOTSET)
        setattr(logger, _OURS, False)

    raw = env.get(LOG_LEVEL_ENV_VAR)
    if raw is None or not raw.strip():
        fallback = _WarningsWhenUnconfigured()
        fallback.setFormatter(logging.Formatter(LOG_FORMAT))
        setattr(fallback, _OURS, True)
        logger.addHandler(fallback)
        return logger
    level = _parse_level(raw)
    # sys.stderr is looked up per record, not bound now, so pytest's capsys and redirections see it.
    stream = _StderrHandler()
    stream.setFormatter(logging.Formatter(LOG_FORMAT))
    setattr(stream, _OURS, True)
    logger.addHandler(stream)
    logger.setLevel(logging.WARNING if level is None else level)
    setattr(logger, _OURS, True)
    if level is None:
        logger.warning(
            "%s=%r is not a log level; use one of %s; showing warnings only",
            LOG_LEVEL_ENV_VAR,
            raw,
            ", ".join(_LEVELS),
        )
    return logger


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler that writes to whatever ``sys.stderr`` is when a record is emitted."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # StreamHandler.__init__ and setStream assign it; the live sys.stderr wins


class _WarningsWhenUnconfigured(_StderrHandler):
    """Warnings and errors to stderr, only while no other handler would get them: none on the
    ``flextensor`` logger or its ancestors (an application that configures logging decides)."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        logger: logging.Logger | None = logging.getLogger(LOGGER_NAME)
        while logger is not None:
            if any(not getattr(h, _OURS, False) for h in logger.handlers):
                return
            if not logger.propagate:
                break
            logger = logger.parent
        super().emit(record)
