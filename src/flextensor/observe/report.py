"""``flextensor.report(model)``: where each unit's weights live and what streaming them cost, per unit.

A report reads the step the engine already recorded (the first steady forward after each plan, or the
one after ``flextensor.record_next_step(model)``): asking for one adds no work to any forward, and
forwards pay nothing when no report is asked for. The numbers are device time, from events recorded on
the compute and copy streams (host clock on CPU).

Per unit, in execution order: bytes, resident or streamed, its arena range, compute time, time on the
copy stream, and the exposed wait (how long its compute stalled on its copy). Totals: the measured step
against the planner's prediction, bytes streamed per step and the speed achieved against the probed
link, and the peak allocated against the prediction and the budget.
"""

from __future__ import annotations

import io
import statistics
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from flextensor.common.sizes import format_bytes
from flextensor.errors import NotOffloadedError

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from torch import nn

    from flextensor.engine.controller import OffloadEngine
    from flextensor.phases.timeline import Timeline

__all__ = ["Report", "UnitReport", "format_speed", "recorded_timeline", "report"]

RENDER_WIDTH = 120
"""Columns ``str(report)`` renders to: wide enough for unit paths of real models without wrapping."""

_EN_DASH = "\u2013"
"""Between the ends of an arena range ("arena 0.00\u20130.44 GiB"): a hyphen would read as a minus."""

_EXPOSED_WAIT_SHARE = 0.01
"""A unit whose wait exceeds this share of the step is highlighted: it is where the step loses time."""


@dataclass(frozen=True)
class UnitReport:
    """One offload unit in the recorded step. Times in milliseconds; ``copy_ms`` None when not copied.

    ``copy_ms`` sums this unit's copies issued during the step (a prefetch for the next step included).
    ``wait_ms`` is the exposed wait: how long its compute waited for its copy. ``slot_start`` /
    ``slot_end`` are its byte range in the arena, None for a resident unit and while the layout is given
    back (a pipeline's component between its steps: ``device_bytes_held`` is 0 then). ``coded_nbytes``:
    the size of its host copy held compressed (``compression="lossless"``), what a load of it copies;
    None if raw. ``mapped``: resident, read in place from its pinned host copy (``map_embeddings``).
    """

    name: str
    nbytes: int
    resident: bool
    compute_ms: float
    copy_ms: float | None
    wait_ms: float
    slot_start: int | None
    slot_end: int | None
    coded_nbytes: int | None = None
    mapped: bool = False

    @property
    def placement(self) -> str:
        """``"resident"``, ``"mapped"`` (resident, in host memory) or ``"streamed"``."""
        if self.resident:
            return "mapped" if self.mapped else "resident"
        return "streamed"


@dataclass(frozen=True)
class Report:
    """One recorded steady step of an offloaded model. Build it with :func:`report`.

    ``forward``: which forward of the model was recorded (0 is the first). ``units``: per-unit rows, in
    execution order. Times are milliseconds, sizes bytes, speeds GB/s
    (10^9 bytes per second). ``link_gbps`` is the probed host-to-device speed at ``typical_unit_bytes``
    (the median streamed unit); ``achieved_gbps`` is what this step's copies moved per second of copy
    time. On a CPU device both are memcpy rates within host RAM (there is no link), and the rendered
    report gives no share of one. ``peak_allocated_bytes`` is None on CPU, where device allocations are
    not counted.
    ``host_bytes_held`` is the host memory held for the units' weights when the report is made: the packs
    of the units some plan streams (units resident in every plan keep none, unless the packs are shared
    between processes). A freed pack that tensors still view (a ``state_dict()`` taken earlier) stays
    mapped until they go, and is not counted. Of it, ``host_pinned_bytes`` are page-locked (0 on a CPU)
    and ``host_pageable_bytes`` not; ``staging_bytes`` is the pinned staging ring the pageable packs are
    copied through (included in ``host_pinned_bytes``, not in ``host_bytes_held``), and
    ``host_budget_bytes`` the host budget in force (see docs/host-memory.md); ``disk_bytes`` the weights
    streamed from the checkpoint file, with no host pack (the disk tier, not in ``host_bytes_held``), and
    ``read_ahead_bytes`` the pageable buffers they are read into ahead of their copies.
    ``decode_gbps``: with ``compression="lossless"``, the decode speed probed at offload() (GB/s of
    weights written); None when no unit is held compressed. Streamed bytes count the weights delivered,
    compressed or not.
    """

    model: str
    forward: int
    device: str
    units: tuple[UnitReport, ...]
    step_ms: float
    predicted_step_ms: float
    compute_ms: float
    exposed_wait_ms: float
    copy_ms: float
    copies: int
    streamed_bytes: int
    typical_unit_bytes: int
    achieved_gbps: float | None
    link_gbps: float | None
    arena_bytes: int
    device_bytes_held: int
    host_bytes_held: int
    peak_allocated_bytes: int | None
    predicted_peak_bytes: int
    budget_bytes: int | None
    host_pinned_bytes: int = 0
    host_pageable_bytes: int = 0
    staging_bytes: int = 0
    host_budget_bytes: int | None = None
    disk_bytes: int = 0
    read_ahead_bytes: int = 0
    decode_gbps: float | None = None
    decode_staging_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON-ready data; each unit also gets ``placement`` and ``slot`` strings."""
        data = asdict(self)
        scale = _slot_scale(self.arena_bytes)
        for row, unit in zip(data["units"], self.units, strict=True):
            row["placement"] = unit.placement
            row["slot"] = _slot(unit, scale)
        return data

    def __rich__(self) -> RenderableType:
        from rich.console import Group

        return Group(self._unit_table(), self._totals_table())

    def __str__(self) -> str:
        return self.render()

    def render(self, width: int = RENDER_WIDTH) -> str:
        """The report as plain text (tables drawn with box characters, no colour)."""
        from rich.console import Console

        out = io.StringIO()
        Console(file=out, width=width, color_system=None, force_terminal=False, no_color=True).print(self)
        # rich pads every line to the table's width; the padding is noise in logs and diffs.
        return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"

    def print(self, console: Console | None = None) -> None:
        """Print the report to ``console`` (default: a rich Console on stdout, in colour on a terminal)."""
        from rich.console import Console

        (console or Console()).print(self)

    # -- rendering ------------------------------------------------------------------------------------------

    def _unit_table(self) -> Any:
        from rich.table import Table

        table = Table(
            title=f"flextensor: {self.model} on {self.device}, steady step of forward {self.forward}",
            title_justify="left",
        )
        table.add_column("#", justify="right", style="dim")
        table.add_column("unit", overflow="fold")
        table.add_column("bytes", justify="right")
        table.add_column("placement")
        table.add_column("slot")
        table.add_column("compute ms", justify="right")
        table.add_column("copy ms", justify="right")
        table.add_column("wait ms", justify="right")
        scale = _slot_scale(self.arena_bytes)
        highlight = self.step_ms * _EXPOSED_WAIT_SHARE
        for i, unit in enumerate(self.units):
            wait = f"{unit.wait_ms:.3f}"
            if unit.wait_ms > highlight and unit.wait_ms > 0:
                wait = f"[bold red]{wait}[/]"
            table.add_row(
                str(i),
                unit.name,
                format_bytes(unit.nbytes),
                unit.placement if unit.resident else f"[cyan]{unit.placement}[/]",
                _slot(unit, scale),
                f"{unit.compute_ms:.3f}",
                "-" if unit.copy_ms is None else f"{unit.copy_ms:.3f}",
                wait,
            )
        return table

    def _totals_table(self) -> Any:
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        off = _percent_off(self.step_ms, self.predicted_step_ms)
        grid.add_row(
            "step", f"{self.step_ms:.2f} ms measured, {self.predicted_step_ms:.2f} ms predicted{off}"
        )
        share = f" ({self.exposed_wait_ms / self.step_ms:.0%} of the step)" if self.step_ms > 0 else ""
        waits = f"exposed waits {self.exposed_wait_ms:.2f} ms{share}"
        grid.add_row("compute", f"{self.compute_ms:.2f} ms in units; {waits}")
        grid.add_row("streamed", self._streamed_text())
        resident = self.device_bytes_held - self.arena_bytes - self.decode_staging_bytes
        staging = (
            f" + staging slots {format_bytes(self.decode_staging_bytes)}" if self.decode_staging_bytes else ""
        )
        grid.add_row(
            "held",
            f"{format_bytes(self.device_bytes_held)} for units: arena {format_bytes(self.arena_bytes)} + "
            f"resident units {format_bytes(resident)}{staging}",
        )
        host = f"{format_bytes(self.host_bytes_held)} in host RAM for units' weights"
        host += f", {format_bytes(self.host_pageable_bytes)} of them pageable"
        if self.staging_bytes:
            host += f"; staging ring {format_bytes(self.staging_bytes)}"
        host += f"; {format_bytes(self.host_pinned_bytes)} pinned in all"
        if self.host_budget_bytes is not None:
            host += f"; host budget {format_bytes(self.host_budget_bytes)}"
        if self.disk_bytes:
            host += f"; {format_bytes(self.disk_bytes)} read from the checkpoint file"
            if self.read_ahead_bytes:
                host += f" through {format_bytes(self.read_ahead_bytes)} of read-ahead buffers"
        grid.add_row("host", host)
        coded = [u for u in self.units if u.coded_nbytes is not None]
        if coded and self.decode_gbps is not None:
            ratio = sum(u.coded_nbytes or 0 for u in coded) / max(1, sum(u.nbytes for u in coded))
            grid.add_row(
                "compressed",
                f"{len(coded)} unit(s) held at {ratio:.3f} of their size, decoded at "
                f"{format_speed(self.decode_gbps * 1e9)}",
            )
        budget = "no budget" if self.budget_bytes is None else f"budget {format_bytes(self.budget_bytes)}"
        if self.peak_allocated_bytes is None:
            peak = f"not measured on {self.device}; predicted {format_bytes(self.predicted_peak_bytes)}"
        else:
            peak = (
                f"{format_bytes(self.peak_allocated_bytes)} allocated, predicted "
                f"{format_bytes(self.predicted_peak_bytes)}"
            )
        grid.add_row("peak", f"{peak}; {budget}")
        return grid

    def _streamed_text(self) -> str:
        streamed = f"{format_bytes(self.streamed_bytes)} per step in {self.copies} copies"
        achieved = None if self.achieved_gbps is None else format_speed(self.achieved_gbps * 1e9)
        probed = None if self.link_gbps is None else format_speed(self.link_gbps * 1e9)
        at = format_bytes(self.typical_unit_bytes)
        if self.device.startswith("cpu"):
            # No link on a CPU: a copy is a memcpy within host RAM, whose rate swings with the caches and
            # the other processes; a share of the probed one says nothing (it read 1527 %).
            rates = [f"{achieved} achieved"] if achieved else []
            rates += [f"{probed} probed at {at}"] if probed else []
            return f"{streamed}, a memcpy in host RAM on cpu" + (f": {', '.join(rates)}" if rates else "")
        if achieved is not None:
            streamed += f", {achieved} achieved"
        if probed is not None and self.link_gbps is not None:
            streamed += f"; link {probed} at {at}"
            if self.achieved_gbps is not None and self.link_gbps > 0:
                streamed += f" ({self.achieved_gbps / self.link_gbps:.0%})"
        return streamed


def format_speed(bytes_per_s: float) -> str:
    """``"24.1 GB/s"``; below 0.1 GB/s in MB/s (a CPU stand-in "link" under load), so it never reads 0.0."""
    if bytes_per_s >= 1e8:
        return f"{bytes_per_s / 1e9:.1f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def _percent_off(measured: float, predicted: float) -> str:
    if predicted <= 0:
        return ""
    return f" ({(measured - predicted) / predicted:+.0%})"


def _slot_scale(arena_bytes: int) -> tuple[str, int]:
    """One unit for every slot of a report, picked by the arena's size, so ranges line up."""
    for name, factor in (("GiB", 2**30), ("MiB", 2**20)):
        if arena_bytes >= factor:
            return name, factor
    return "KiB", 2**10


def _slot(unit: UnitReport, scale: tuple[str, int]) -> str:
    if unit.resident:
        return "host memory" if unit.mapped else "resident"
    if unit.slot_start is None or unit.slot_end is None:
        return "-"  # the layout is given back (a pipeline's component between its steps)
    name, factor = scale
    return f"arena {unit.slot_start / factor:.2f}{_EN_DASH}{unit.slot_end / factor:.2f} {name}"


def recorded_timeline(engine: OffloadEngine) -> Timeline:
    """The engine's latest recorded steady step; NotOffloadedError if there is none for the current plan.

    Shared by :func:`report` and :func:`flextensor.trace`.
    """
    from flextensor.phases.learning import Phase

    recording = engine.last_recording
    if engine.phase is not Phase.INFERENCE or recording is None or engine.current is None:
        raise NotOffloadedError(
            f"no steady-state step recorded yet (the model is in its {engine.phase.value} phase): run one "
            "forward in steady state first (flextensor.phase(model) == 'inference')"
        )
    timeline = recording.timeline()
    planned = set(engine.current.plan.resident)  # where units sit now is "host" while given back
    for unit in timeline.units:
        state = engine.units.get(unit.unit)
        if state is not None and (state.name in planned) != unit.resident:
            # The inputs changed and another plan is in force; its first step has not been recorded.
            raise NotOffloadedError(
                "the recorded step ran under an earlier plan: call flextensor.record_next_step(model) and "
                "run one forward, then ask again"
            )
    return timeline


@dataclass(frozen=True)
class PipelineReport:
    """:class:`Report` of each component of an offloaded pipeline that has run a steady step."""

    components: dict[str, Report]

    def to_dict(self) -> dict[str, Any]:
        return {name: r.to_dict() for name, r in self.components.items()}

    def __str__(self) -> str:
        return "\n".join(f"== {name}\n{r.render()}" for name, r in self.components.items())


def report(model: nn.Module) -> Report | PipelineReport:
    """Per-unit placement and timing of ``model``'s latest recorded steady step, with totals; of a
    pipeline, one per component that has run a steady step.

    The report describes the plan in place: the one the last forward's input shapes use (each plan keeps
    its own recording; before a new plan's first step, the latest recorded step if every unit still sits
    where it did then). The first steady forward after each plan is recorded automatically; call
    ``flextensor.record_next_step(model)`` and run a forward to report on a later one. Raises
    NotOffloadedError when the model is not offloaded, or has not run a steady forward yet.
    """
    from flextensor.api import engine_of
    from flextensor.pipelines.pipeline import components_of, pipeline_of

    if components_of(model) is not None:
        reports = {}
        for name, component in pipeline_of(model).components.items():
            try:
                reports[name] = report(component)
            except NotOffloadedError:
                continue  # still learning
        if not reports:
            raise NotOffloadedError("no component of the pipeline has run a steady step yet")
        return PipelineReport(reports)

    engine = engine_of(model)
    timeline = recorded_timeline(engine)
    entry = engine.current
    assert entry is not None

    copy_ms: dict[str, float] = {}
    busy_s = 0.0
    for name, start, end in timeline.copies:
        copy_ms[name] = copy_ms.get(name, 0.0) + (end - start) * 1e3
        busy_s += end - start

    arena = engine.store.arena
    timed = {unit.unit: unit for unit in timeline.units}
    profiled = entry.measurements.by_name()
    in_order = set(engine.order)
    # By the plan, not where units sit now: a pipeline's component given back holds every unit on the
    # host until its next step.
    planned = set(entry.plan.resident)
    rows = []
    for state in [*engine.order, *(u for u in engine.units.values() if u not in in_order)]:
        name = state.name
        unit = timed.get(name)
        resident = name in planned
        if unit is None and not resident:
            continue  # streamed but did not run in the recorded step
        start = end = None
        if not resident and state.storage is not None and arena is not None:
            # Streamed storage is a view into the arena: its offset there is its slot.
            start = state.storage.data_ptr() - arena.data_ptr()
            end = start + state.nbytes
        # Resident units carry no hooks in steady state (they cost nothing); their compute time is the
        # one measured while profiling.
        compute_s = (
            unit.compute_s if unit is not None else (profiled[name].compute_s if name in profiled else 0.0)
        )
        rows.append(
            UnitReport(
                name=name,
                nbytes=state.nbytes,
                resident=resident,
                compute_ms=compute_s * 1e3,
                copy_ms=copy_ms.get(name),
                wait_ms=unit.wait_s * 1e3 if unit is not None else 0.0,
                slot_start=start,
                slot_end=end,
                coded_nbytes=state.pack.coded_nbytes if state.pack is not None and state.pack.coded else None,  # type: ignore[attr-defined]
                mapped=state.mapped is not None,
            )
        )

    streamed_sizes = [u.nbytes for u in engine.units.values() if u.name not in planned]
    sizes = streamed_sizes or [u.nbytes for u in engine.units.values()]
    typical = int(statistics.median(sizes)) if sizes else 0
    link = entry.measurements.link
    plan = entry.plan
    return Report(
        model=type(model).__name__,
        forward=engine.last_recording.forward if engine.last_recording is not None else 0,
        device=str(engine.runtime.device),
        units=tuple(rows),
        step_ms=timeline.step_s * 1e3,
        predicted_step_ms=plan.predicted_step_s * 1e3,
        compute_ms=sum(row.compute_ms for row in rows),
        exposed_wait_ms=timeline.exposed_wait_s * 1e3,
        copy_ms=busy_s * 1e3,
        copies=len(timeline.copies),
        streamed_bytes=timeline.streamed_bytes,
        typical_unit_bytes=typical,
        achieved_gbps=timeline.streamed_bytes / busy_s / 1e9 if busy_s > 0 else None,
        link_gbps=link.bytes_per_s(typical) / 1e9 if link is not None and typical > 0 else None,
        arena_bytes=0 if arena is None else arena.numel(),
        device_bytes_held=engine.store.device_bytes_held(),
        host_bytes_held=engine.store.host_bytes_held(),
        peak_allocated_bytes=timeline.peak_allocated_bytes if engine.runtime.is_cuda else None,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        budget_bytes=engine.policy.budget_bytes,
        host_pinned_bytes=engine.store.host_pinned_bytes(),
        host_pageable_bytes=sum(
            u.pack.held_bytes for u in engine.units.values() if u.pack is not None and not u.pack.pinned
        ),
        staging_bytes=engine.store.staging_bytes(),
        host_budget_bytes=engine.store.host.budget_bytes,
        disk_bytes=engine.store.disk_bytes(),
        read_ahead_bytes=engine.store.host.read_ahead_bytes,
        decode_gbps=None if engine.policy.decode_bps is None else engine.policy.decode_bps / 1e9,
        decode_staging_bytes=0 if engine.store.coded_loads is None else engine.store.coded_loads.nbytes,
    )
