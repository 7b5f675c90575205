"""Predict a plan's step time and peak memory: an event-level model of the compute and copy streams.

Pure: no torch, no CUDA. The planner searches against this model; the engine is what it models.

[Note: what the simulator models]
Units run in execution order on the compute stream. Before unit ``i`` there are ``gap_before_s`` seconds
of other compute, after the last unit ``tail_s``. Resident units never wait. Streamed units live in the
arena at their ring-layout ranges (see [Note: ring layout] in plan/layout.py); their copies run FIFO on one
copy stream:

* the copy for streamed position ``k`` is issued right after position ``ready_after[k]``'s compute is
  issued (its post-hook), nearest positions first, and starts on the device at
  ``max(copy stream free, end of that compute)``: the copy stream waits on that compute's event;
* when ``ready_after[k]`` comes later in the order than ``k``, the copy is for the *next* forward: it is
  issued in this step and hides under this step's tail (cross-step prefetch) as far as the tail allows;
* a step ends when both streams are idle: what the caller sees when it reads the output (``.item()``,
  sampling, a benchmark's synchronize), so a cross-step copy that outlasts the tail costs this step its
  remainder instead of hiding under the caller's own work;
* when ``ready_after[k]`` is None the unit's range is never overwritten: it is copied once, ever;
* a unit's compute starts at ``max(previous compute end + gap, end of its copy)``;
* a coded unit's load (``plan.coded``) holds the copy stream for its compressed pieces' copies and
  decodes (see [Note: coded loads] in plan/measurements.py).

A cold step (the first one, or every step when ``cyclic=False``) starts with an empty arena: the copies
that no earlier compute of the step issues (``ready_after`` None or later in the order) are issued at the
step's start, in execution order, once the previous step has ended.

The host is assumed to run ahead of the device within a step (no host-side syncs but the step
boundary), so only device-side dependencies order events. Every event time is a max of sums of earlier
ones, so one pass per step suffices: O(steps x units) after the layout.

Since both streams are idle when a step starts, the copy stream idles until the first post-hook that
issues a copy, and whatever a step's last streamed unit's post-hook issues can only hide under the
compute after it (resident units, the tail): those are the copies that cannot hide. A step's time is
``compute_s + exposed_wait_s + tail_copy_s`` (see Simulation). The second step is already steady: it
starts, like every later one, with idle streams and the same units in the arena.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from flextensor.common.sizes import align_up
from flextensor.errors import PlanError
from flextensor.plan.layout import UNIT_ALIGNMENT, ring_layout
from flextensor.plan.measurements import LinkModel, Measurements
from flextensor.plan.plan import Plan

CODED_STAGING_SLOTS = 2
"""Staging slots of coded loads: a copy fills one while the decode stream reads the other."""

DEFAULT_STEPS = 2
"""Forwards simulated: a cold one and a steady one. Each step starts with both streams idle (see [Note:
what the simulator models]), so the second starts in the state every later one does."""


@dataclass(frozen=True)
class UnitTimeline:
    """One unit in the steady step. Times are seconds from that step's start.

    ``copy_start_s`` / ``copy_end_s``: the copy this step's compute consumes, or None for a resident unit
    or one that is never reloaded. A cross-step prefetch ran at the end of the previous step: negative
    times, ending at or before 0.
    ``wait_s``: how long the unit's compute stalled on its copy. ``slot_offset``: the unit's first byte in
    the arena, None for a resident unit.
    """

    name: str
    resident: bool
    nbytes: int
    copy_start_s: float | None
    copy_end_s: float | None
    compute_start_s: float
    compute_end_s: float
    wait_s: float
    slot_offset: int | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Simulation:
    """The simulator's prediction for one plan, measured on the last (steady) of the simulated steps.

    ``step_s``: device time of one step. ``peak_bytes``: the step's peak allocated device memory.
    ``streamed_bytes``: bytes copied host-to-device per step. ``compute_s``: the step's compute and gaps
    and tail (its time with every weight already there). ``exposed_wait_s``: total time compute stalled on
    copies. ``tail_copy_s``: how long copies issued in the step (prefetches for the next one included)
    ran on after its compute and tail had ended: the step ends only when both streams are idle. So
    ``step_s == compute_s + exposed_wait_s + tail_copy_s`` up to rounding.
    """

    step_s: float
    peak_bytes: int
    streamed_bytes: int
    compute_s: float
    exposed_wait_s: float
    tail_copy_s: float
    units: tuple[UnitTimeline, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "step_s": self.step_s,
            "peak_bytes": self.peak_bytes,
            "streamed_bytes": self.streamed_bytes,
            "compute_s": self.compute_s,
            "exposed_wait_s": self.exposed_wait_s,
            "tail_copy_s": self.tail_copy_s,
            "units": [u.to_dict() for u in self.units],
        }


def peak_bytes(
    measurements: Measurements,
    resident_nbytes: Sequence[int],
    arena_bytes: int,
    staging_nbytes: Sequence[int] = (),
) -> int:
    """Steady-state peak: what flextensor does not plan, resident units, the arena, the staging slots of
    the coded units (``staging_nbytes``: their largest compressed pieces) and activations.

    Resident units are rounded up to the arena's alignment: the engine packs each unit in its own
    aligned buffer, so this is what they really take.
    """
    resident = sum(align_up(n, UNIT_ALIGNMENT) for n in resident_nbytes)
    fixed = measurements.baseline_bytes + measurements.activation_peak_bytes
    return fixed + resident + arena_bytes + coded_staging_bytes(staging_nbytes)


def coded_staging_bytes(staging_nbytes: Sequence[int]) -> int:
    """The device slots coded loads go through, given each coded unit's largest compressed piece: two of
    the largest (one being decoded while the next is copied, see [Note: coded loads] in
    plan/measurements.py)."""
    return CODED_STAGING_SLOTS * align_up(max(staging_nbytes, default=0), UNIT_ALIGNMENT)


@dataclass
class StreamTrace:
    """What :func:`run_streams` returns: the reported (steady) step, in absolute times."""

    step_start: float
    step_s: float
    tail_copy: float  # how long the copy stream ran on after the compute stream (tail included) ended
    compute_start: list[float]
    compute_end: list[float]
    wait: list[float]
    copy_start: list[float | None]  # per streamed position: the copy the steady step consumes
    copy_end: list[float | None]
    copied: list[bool]  # per streamed position: copied in steady state (not loaded once for good)
    gain: list[float] | None  # per streamed position: see run_streams' want_gain


def run_streams(
    compute: Sequence[float],
    gaps: Sequence[float],
    tail: float,
    position: Sequence[int],
    copy_s: Sequence[float],
    ready_after: Sequence[int | None],
    prefetch: Sequence[Sequence[int]],
    steps: int,
    cyclic: bool,
    want_gain: bool = False,
) -> StreamTrace:
    """Simulate ``steps`` forwards of the two streams (see [Note: what the simulator models]).

    ``position[i]`` is unit ``i``'s streamed position or -1 when it is resident; ``copy_s``,
    ``ready_after`` and ``prefetch`` are indexed by streamed position. The trace is of the last step.

    With ``want_gain``, also estimate per streamed position how much the step would shorten if that unit
    were resident: a copy delays the compute waiting on it and, through the FIFO, every copy queued
    back-to-back behind it, and the step's end when that run outlasts the compute (``tail_copy``); so the
    estimate is ``min(copy time, waits and tail copy downstream in its back-to-back run)``. Copies are
    counted in the step that issues them: a cross-step prefetch costs this step, never the next (it ends
    before the next step starts, so its consumer never waits on it). It is a ranking hint for the
    planner, which simulates the real effect.
    """
    n_units = len(compute)
    n = len(copy_s)
    report = steps - 1
    unit_of = [0] * n
    for i, k in enumerate(position):
        if k >= 0:
            unit_of[k] = i
    copy_free = 0.0
    t = 0.0
    cur_start: list[float | None] = [None] * n
    cur_end: list[float | None] = [None] * n
    nxt_start: list[float | None] = [None] * n
    nxt_end: list[float | None] = [None] * n
    result: StreamTrace | None = None
    # For the gain estimate: the reported step's copies in FIFO order, as (position, consumed in this
    # step, queued back-to-back behind the previous copy).
    events: list[tuple[int, bool, bool]] = []
    for s in range(steps):
        cstart = [0.0] * n_units
        cend = [0.0] * n_units
        wait = [0.0] * n_units
        record = want_gain and s == report
        if s == 0 or not cyclic:
            cur_start = [None] * n
            cur_end = [None] * n
            for k in range(n):
                j = ready_after[k]
                if j is None or j > k:
                    # Arena empty at a cold start: nothing to wait for but the previous step's end.
                    start = copy_free if copy_free > t else t
                    if record:
                        events.append((k, True, copy_free > t))
                    copy_free = start + copy_s[k]
                    cur_start[k] = start
                    cur_end[k] = copy_free
        else:
            cur_start, cur_end = nxt_start, nxt_end
        nxt_start = [None] * n
        nxt_end = [None] * n
        prev = t
        for i in range(n_units):
            ready = prev + gaps[i]
            start = ready
            k = position[i]
            if k >= 0:
                done = cur_end[k]
                if done is not None and done > start:
                    start = done
            cstart[i] = start
            wait[i] = start - ready
            prev = start + compute[i]
            cend[i] = prev
            if k >= 0:
                for q in prefetch[k]:
                    if q < k and not cyclic:
                        continue  # no cross-step prefetch: the next step starts cold
                    begin = copy_free if copy_free > prev else prev
                    if record:
                        events.append((q, q > k, copy_free > prev))
                    copy_free = begin + copy_s[q]
                    if q > k:
                        cur_start[q] = begin
                        cur_end[q] = copy_free
                    else:
                        nxt_start[q] = begin
                        nxt_end[q] = copy_free
        # Synchronised step boundary: copies issued in this step (next-step prefetches too) finish in it.
        compute_end = prev + tail
        step_end = compute_end if compute_end >= copy_free else copy_free
        if s == report:
            result = StreamTrace(
                step_start=t,
                step_s=step_end - t,
                tail_copy=step_end - compute_end,
                compute_start=cstart,
                compute_end=cend,
                wait=wait,
                copy_start=cur_start,
                copy_end=cur_end,
                copied=[j is not None for j in ready_after] if cyclic else [True] * n,
                gain=None,
            )
        t = step_end
    assert result is not None
    if want_gain:
        gain = [0.0] * n
        # The step's end waits on the last copy when it outlasts the compute: a downstream cost too.
        downstream = result.tail_copy
        chained_to_next = downstream > 0.0
        for k, consumed_here, chained in reversed(events):
            here = downstream if chained_to_next else 0.0
            if consumed_here:
                here += result.wait[unit_of[k]]
            g = min(copy_s[k], here)
            if g > gain[k]:
                gain[k] = g
            downstream = here
            chained_to_next = chained
        last = max((i for i in range(n_units) if position[i] >= 0), default=None)
        if last is not None:
            # Made resident, the last streamed unit's compute follows the post-hook that then issues the
            # step's last copies: it can hide that much of the tail copy (ring shifts aside).
            k = position[last]
            credit = min(result.tail_copy, gaps[last] + compute[last])
            if credit > gain[k]:
                gain[k] = credit
        result.gain = gain
    return result


def _check_plan(plan: Plan, measurements: Measurements) -> None:
    names = [u.name for u in measurements.units]
    known = set(names)
    resident, streamed = set(plan.resident), set(plan.streamed)
    if len(streamed) != len(plan.streamed) or len(resident) != len(plan.resident):
        raise PlanError("a plan lists a unit twice")
    if resident & streamed:
        raise PlanError(f"units both resident and streamed: {sorted(resident & streamed)}")
    unknown = (resident | streamed) - known
    if unknown:
        raise PlanError(f"the plan names units the measurements do not have: {sorted(unknown)}")
    missing = known - resident - streamed
    if missing:
        raise PlanError(f"the plan places no entry for units {sorted(missing)}")
    if list(plan.streamed) != [n for n in names if n in streamed]:
        raise PlanError("plan.streamed must list the streamed units in execution order")
    if not set(plan.staged) <= streamed:
        extra = sorted(set(plan.staged) - streamed)
        raise PlanError(f"plan.staged names units that are not streamed: {extra}")
    by_name = measurements.by_name()
    for name in plan.coded:
        if name not in streamed or measurements.coded_load_s(by_name[name]) is None:
            raise PlanError(f"plan.coded names {name}, which is not a streamed, compressed unit")


def simulate(
    plan: Plan,
    measurements: Measurements,
    *,
    steps: int = DEFAULT_STEPS,
    cyclic: bool = True,
    staged_link: LinkModel | None = None,
    disk_link: LinkModel | None = None,
    disk_units: frozenset[str] = frozenset(),
) -> Simulation:
    """Simulate ``steps`` consecutive forwards under ``plan`` and report the last (steady) one.

    ``cyclic=False`` models forwards that each start with an empty arena and no cross-step prefetch.
    ``staged_link``: the speed of the plan's staged units' copies (through the staging ring); without
    it they are timed like the others. ``disk_units`` (staged, read from the checkpoint file) are timed
    at the slower of ``staged_link`` and ``disk_link``.
    Raises PlanError when the plan does not place every measured unit exactly once, or when the arena
    cannot hold its largest streamed unit.
    """
    if steps < 1:
        raise PlanError(f"steps must be at least 1, got {steps}")
    _check_plan(plan, measurements)
    units = measurements.units
    sizes = {u.name: u.nbytes for u in units}
    layout = ring_layout(plan.streamed, [sizes[u] for u in plan.streamed], plan.arena_bytes)
    pos_of = {name: k for k, name in enumerate(layout.order)}
    position = [pos_of.get(u.name, -1) for u in units]
    link = measurements.link
    staged = set(plan.staged) if staged_link is not None else set()
    coded = {
        u.name: measurements.coded_load_s(u, staged_link if u.name in staged else None)
        for u in units
        if u.name in plan.coded
    }
    copy_s = [
        coded[name] if name in coded else (staged_link if name in staged else link).copy_s(n)  # type: ignore[union-attr]
        for name, n in zip(layout.order, layout.sizes, strict=True)
    ]
    if disk_link is not None:
        copy_s = [
            max(s, disk_link.copy_s(n)) if name in disk_units else s
            for s, name, n in zip(copy_s, layout.order, layout.sizes, strict=True)
        ]
    trace = run_streams(
        [u.compute_s for u in units],
        [u.gap_before_s for u in units],
        measurements.tail_s,
        position,
        copy_s,
        layout.ready_after,
        layout.prefetch_after,
        steps,
        cyclic,
    )
    t0 = trace.step_start
    timelines = []
    for i, u in enumerate(units):
        k = position[i]
        cs = ce = None
        if k >= 0 and trace.copied[k]:
            start, end = trace.copy_start[k], trace.copy_end[k]
            cs = None if start is None else start - t0
            ce = None if end is None else end - t0
        timelines.append(
            UnitTimeline(
                name=u.name,
                resident=k < 0,
                nbytes=u.nbytes,
                copy_start_s=cs,
                copy_end_s=ce,
                compute_start_s=trace.compute_start[i] - t0,
                compute_end_s=trace.compute_end[i] - t0,
                wait_s=trace.wait[i],
                slot_offset=None if k < 0 else layout.offsets[k],
            )
        )
    return Simulation(
        step_s=trace.step_s,
        peak_bytes=peak_bytes(
            measurements,
            [sizes[name] for name in plan.resident],
            plan.arena_bytes,
            [u.staging_nbytes for u in units if u.name in plan.coded],
        ),
        streamed_bytes=sum(n for n, c in zip(layout.sizes, trace.copied, strict=True) if c),
        compute_s=measurements.compute_s,
        exposed_wait_s=sum(trace.wait),
        tail_copy_s=trace.tail_copy,
        units=tuple(timelines),
    )
