"""``flextensor.trace(model, path)``: the latest recorded steady step as a Chrome trace, for Perfetto.

The file is Chrome's JSON trace format (``{"traceEvents": [...]}``) that https://ui.perfetto.dev and
``chrome://tracing`` open: one process with two tracks, ``compute stream`` (a ``step`` slice holding one
slice per unit, and ``wait <unit>`` slices where compute stalled on a copy) and ``copy stream`` (one
slice per host-to-device copy). Times are microseconds from the step's start; each slice's ``args`` carry
the unit's bytes and placement. Like :func:`flextensor.report`, it reads the already-recorded step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flextensor.common.json_codec import atomic_write_text
from flextensor.observe.report import recorded_timeline

if TYPE_CHECKING:
    from torch import nn

    from flextensor.engine.controller import OffloadEngine
    from flextensor.phases.timeline import Timeline

__all__ = ["COMPUTE_TID", "COPY_TID", "trace", "trace_events"]

PID = 1
COMPUTE_TID = 1
"""Track (thread id) of the compute stream's slices."""
COPY_TID = 2
"""Track (thread id) of the copy stream's slices."""


def _us(seconds: float) -> float:
    # Nanosecond resolution is what device events give; more digits only bloat the file.
    return round(seconds * 1e6, 3)


def _slice(name: str, cat: str, tid: int, start_s: float, end_s: float, args: dict[str, Any]) -> dict:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": PID,
        "tid": tid,
        "ts": _us(start_s),
        "dur": _us(max(0.0, end_s - start_s)),
        "args": args,
    }


def trace_events(engine: OffloadEngine, timeline: Timeline) -> dict[str, Any]:
    """The Chrome trace document (a JSON-ready dict) of ``timeline``, a step recorded by ``engine``."""
    model = type(engine.model).__name__
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": PID, "args": {"name": f"flextensor: {model}"}}
    ]
    for tid, track in ((COMPUTE_TID, "compute stream"), (COPY_TID, "copy stream")):
        events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": track}})
        # Compute above copy, whatever order the viewer would pick by name.
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid, "args": {"sort_index": tid}}
        )
    # The step encloses the unit slices on the compute track, so Perfetto nests them under it.
    events.append(
        _slice(
            "step",
            "step",
            COMPUTE_TID,
            0.0,
            timeline.step_s,
            {"streamed_bytes": timeline.streamed_bytes, "exposed_wait_ms": timeline.exposed_wait_s * 1e3},
        )
    )
    for unit in timeline.units:
        args = {
            "bytes": unit.nbytes,
            "placement": "resident" if unit.resident else "streamed",
            "wait_ms": unit.wait_s * 1e3,
        }
        if unit.wait_s > 0:
            start = unit.compute_start_s - unit.wait_s
            events.append(
                _slice(f"wait {unit.unit}", "wait", COMPUTE_TID, start, unit.compute_start_s, dict(args))
            )
        events.append(_slice(unit.unit, "unit", COMPUTE_TID, unit.compute_start_s, unit.compute_end_s, args))
    for name, start, end in timeline.copies:
        state = engine.units.get(name)
        nbytes = state.nbytes if state is not None else 0
        gbps = nbytes / (end - start) / 1e9 if end > start else None
        events.append(_slice(name, "copy", COPY_TID, start, end, {"bytes": nbytes, "GB/s": gbps}))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "model": model,
            "device": str(engine.runtime.device),
            "step_ms": timeline.step_s * 1e3,
            "peak_allocated_bytes": timeline.peak_allocated_bytes,
        },
    }


def trace(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write ``model``'s latest recorded steady step to ``path`` as Chrome trace JSON; returns the path.

    Open the file in https://ui.perfetto.dev. The write is atomic: a reader sees the old file or the new
    one, never half of it. Raises NotOffloadedError when no steady step has been recorded yet, OSError
    when the file cannot be written.
    """
    from flextensor.api import engine_of

    engine = engine_of(model)
    document = trace_events(engine, recorded_timeline(engine))
    atomic_write_text(path, json.dumps(document, separators=(",", ":")))
    return Path(path)
