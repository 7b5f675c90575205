"""Progress bars for slow setup work (packing and pinning weights, the link probe), built on rich.

A bar appears on stderr only when the work has lasted :data:`SHOW_AFTER_S` seconds, so fast calls stay
silent, and only when stderr is a terminal; ``FT_PROGRESS=0`` turns bars off everywhere and
``FT_PROGRESS=1`` turns them on even when stderr is not a terminal (a log file, CI), where they are
plain lines every :data:`PLAIN_EVERY_S` seconds rather than a redrawn bar::

    with progress_bar("Packing weights", total=total_bytes, unit="bytes") as bar:
        for unit in units:
            pack(unit)
            bar.advance(unit.nbytes)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

__all__ = ["PROGRESS_ENV_VAR", "SHOW_AFTER_S", "ProgressBar", "progress_bar", "progress_mode"]

PROGRESS_ENV_VAR = "FT_PROGRESS"
"""``0`` (or false/no/off): never show bars; ``1`` (or true/yes/on): show them even when not a terminal."""

SHOW_AFTER_S = 1.0
"""Work that finishes sooner shows no bar: a bar that flashes for a moment is noise."""

PLAIN_EVERY_S = 5.0
"""With ``FT_PROGRESS=1`` and stderr not a terminal (a log file, CI), one plain line this often instead of
a redrawn bar: no colour codes or carriage returns in the log."""

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def progress_mode(environ: Mapping[str, str] | None = None) -> Literal["off", "auto", "forced"]:
    """``"off"``, ``"forced"`` (``FT_PROGRESS`` says so) or ``"auto"`` (shown if stderr is a terminal).

    An unrecognised value counts as unset.
    """
    raw = (os.environ if environ is None else environ).get(PROGRESS_ENV_VAR, "").strip().lower()
    if raw in _OFF:
        return "off"
    if raw in _ON:
        return "forced"
    return "auto"


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


class ProgressBar:
    """Handle of one piece of work: call :meth:`advance` as it goes. Does nothing when bars are off.

    The rich display starts lazily, from a timer, once the work has run ``delay_s`` seconds; until then
    :meth:`advance` only adds to a counter.
    """

    def __init__(
        self,
        description: str,
        total: float | None,
        *,
        unit: Literal["items", "bytes"] = "items",
        delay_s: float = SHOW_AFTER_S,
        enabled: bool = True,
        force_terminal: bool = False,
        plain: bool = False,
    ) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.enabled = enabled
        self.completed = 0.0
        self._force_terminal = force_terminal
        self._plain = plain
        self._lines = 0
        self._lock = threading.Lock()
        self._progress: Any = None
        self._task: Any = None
        self._closed = False
        self._timer: threading.Timer | None = None
        self._started_at = time.monotonic()  # the clock rich tasks use
        if enabled:
            if delay_s <= 0:
                self._show()
            else:
                self._timer = threading.Timer(delay_s, self._show)
                self._timer.daemon = True
                self._timer.start()

    @property
    def shown(self) -> bool:
        """Whether the bar is (or was) on screen (or, in plain mode, a line was written)."""
        return self._progress is not None or self._lines > 0

    def _plain_line(self, final: bool = False) -> None:
        elapsed = max(time.monotonic() - self._started_at, 1e-9)
        done = self.completed
        if self.unit == "bytes":
            from flextensor.common.sizes import format_bytes

            amount = format_bytes(int(done)) + (f" of {format_bytes(int(self.total))}" if self.total else "")
            rate = f", {done / elapsed / 1e9:.2f} GB/s"
        else:
            amount = f"{int(done)}" + (f" of {int(self.total)}" if self.total else "")
            rate = ""
        share = f" ({done / self.total:.0%})" if self.total else ""
        state = "done" if final else "..."
        sys.stderr.write(f"{self.description} {state} {amount}{share} in {elapsed:.1f} s{rate}\n")
        sys.stderr.flush()
        self._lines += 1

    def _plain_tick(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._plain_line()
            self._timer = threading.Timer(PLAIN_EVERY_S, self._plain_tick)
            self._timer.daemon = True
            self._timer.start()

    def advance(self, n: float = 1) -> None:
        """Record ``n`` more items (or bytes) done."""
        if not self.enabled:
            return
        with self._lock:
            self.completed += n
            if self._progress is not None:
                self._progress.update(self._task, completed=self.completed)

    def _show(self) -> None:
        if self._plain:
            self._plain_tick()
            return
        from rich.console import Console
        from rich.errors import LiveError
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with self._lock:
            if self._closed or self._progress is not None:
                return
            if self.unit == "bytes":
                amount: list[Any] = [DownloadColumn(binary_units=True), TransferSpeedColumn()]
            else:
                amount = [MofNCompleteColumn()]
            progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                *amount,
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True, force_terminal=self._force_terminal or None),
            )
            task = progress.add_task(self.description, total=self.total, completed=self.completed)
            # Count the time before the bar appeared, so speed and ETA are right from the first frame.
            progress.tasks[0].start_time = self._started_at
            try:
                progress.start()
            except LiveError:  # another rich live display (the caller's own bar) owns the terminal
                self.enabled = False
                return
            self._progress, self._task = progress, task

    def close(self) -> None:
        """Stop the timer and, if the bar is shown, draw its final state and remove the live display."""
        timer = self._timer
        if timer is not None:
            timer.cancel()
            timer.join(timeout=1.0)  # no thread left behind (a bar appearing after the work ended)
        with self._lock:
            self._closed = True
            timer = self._timer
            progress, self._progress = self._progress, None
            if self._plain and self._lines:
                self._plain_line(final=True)
        if timer is not None:
            timer.cancel()
        if progress is not None:
            progress.update(self._task, completed=self.completed)
            progress.stop()
            self._progress = progress  # keep ``shown`` true for callers that ask afterwards


@contextlib.contextmanager
def progress_bar(
    description: str,
    total: float | None,
    *,
    unit: Literal["items", "bytes"] = "items",
    delay_s: float = SHOW_AFTER_S,
) -> Iterator[ProgressBar]:
    """A progress bar for work of ``total`` items or bytes (None: unknown) that appears after ``delay_s``.

    Off when ``FT_PROGRESS=0``, or when stderr is not a terminal unless ``FT_PROGRESS=1``. With
    ``unit="bytes"`` the bar shows sizes and a transfer speed. The yielded object's ``advance(n)`` is
    cheap (a lock and an add); the bar is closed when the block exits, also on an error.
    """
    mode = progress_mode()
    terminal = _stderr_is_terminal()
    enabled = mode == "forced" or (mode == "auto" and terminal)
    bar = ProgressBar(
        description,
        total,
        unit=unit,
        delay_s=delay_s,
        enabled=enabled,
        plain=mode == "forced" and not terminal,
    )
    try:
        yield bar
    finally:
        bar.close()
