"""What the engine measures about a model on a machine: the planner's and the simulator's inputs.

Pure data: no torch. Times are seconds of device time, sizes are bytes. Saved in profiles as JSON
(``@record``: see common/json_codec.py).

[Note: coded loads]
With ``compression="lossless"`` a unit's pack may be held compressed (codec/, host/coded_packs.py), cut in
pieces of ``CODED_PIECE_BYTES`` of weights each. A load copies each piece's compressed bytes into one of
two device staging slots on the copy stream, and decodes it from there into its part of the unit's arena
range on a decode stream, so the next piece's copy runs while this one decodes. The model charges each
coded load on the copy stream as that two-stage pipeline: the slower stage (a piece's copy behind a fast
decoder; its decode behind a slow one, the copies then waiting for staging slots) once per piece, the
other once. That is when the unit is ready; slightly pessimistic for how soon the next unit's copy starts
(it overlaps the last decode). A unit is held compressed only where its coded load is faster than its raw
copy on this link (decided at offload(), store.coded_loads.compress_packs); compute is unchanged. The planner
counts the two staging slots, each the largest compressed piece (``staging_nbytes``), in the peak: about
90 MB on bf16 weights (two pieces at about 0.7), whatever the unit's size. When they do not fit a budget
that the plan without them fits, the plan streams raw and the packs are held uncompressed again
(engine/policy.py, [Note: compression yields to the budget]).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from flextensor.common.json_codec import Bytes, BytesPerSecond, Seconds, record
from flextensor.errors import PlanError


@record
@dataclass(frozen=True)
class UnitMeasurement:
    """One offload unit, as measured in a profiling forward.

    ``nbytes``: bytes of its streamable parameters as packed (what one copy moves).
    ``compute_s``: device time of its forward, from its pre-hook to its post-hook, weights already there.
    ``gap_before_s``: device time between the end of the previous unit (or the step's start) and this
    unit's start: the compute of modules that are not units (embeddings, a final norm, glue).
    ``activation_bytes``: peak allocated during its forward above what was allocated when it started.
    ``coded_nbytes``: bytes its pack takes losslessly compressed (``compression="lossless"``): what its
    loads copy before decoding; None when it is not held compressed. ``coded_piece_nbytes``: its largest
    compressed piece, what a staging slot must hold (None: as ``coded_nbytes``, as profiles written
    before pieces say).
    """

    name: str
    nbytes: Bytes
    compute_s: Seconds
    gap_before_s: Seconds = 0.0
    activation_bytes: Bytes = 0
    coded_nbytes: Bytes | None = None
    coded_piece_nbytes: Bytes | None = None

    @property
    def staging_nbytes(self) -> int:
        """What a staging slot needs to load this unit coded (0 when it is not held compressed)."""
        if self.coded_nbytes is None:
            return 0
        return self.coded_nbytes if self.coded_piece_nbytes is None else self.coded_piece_nbytes


@record
@dataclass(frozen=True)
class LinkModel:
    """Host-to-device copy speed as a function of copy size, from a probe.

    ``points`` are (bytes, bytes_per_second) pairs sorted by size; between points the speed is
    interpolated linearly in log-size, outside them it is clamped. ``latency_s`` is a fixed cost per copy.
    """

    points: tuple[tuple[Bytes, BytesPerSecond], ...]
    latency_s: Seconds = 0.0

    def __post_init__(self) -> None:
        if not self.points:
            raise PlanError("a LinkModel needs at least one (bytes, bytes_per_second) point")
        if any(bps <= 0 or size <= 0 for size, bps in self.points):
            raise PlanError(f"link points must be positive, got {self.points}")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    @classmethod
    def constant(cls, bytes_per_s: float, latency_s: float = 0.0) -> LinkModel:
        return cls(points=((1, bytes_per_s),), latency_s=latency_s)

    def bytes_per_s(self, nbytes: int) -> float:
        sizes = [s for s, _ in self.points]
        i = bisect.bisect_left(sizes, nbytes)
        if i == 0:
            return self.points[0][1]
        if i >= len(self.points):
            return self.points[-1][1]
        (s0, b0), (s1, b1) = self.points[i - 1], self.points[i]
        w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return b0 + w * (b1 - b0)

    def copy_s(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bytes_per_s(nbytes)


CODED_PIECE_BYTES = 64 * 2**20
"""Bytes of weights per piece of a compressed pack (see [Note: coded loads]): small enough that the two
staging slots take little of a budget (about 90 MB on bf16), large enough that a piece's copy runs at the
link's full rate. On the H200 (llama32_decode_b1 at 8 GiB) 16 MiB pieces (about 11 MB copies, each behind
an event wait) ran the step in 0.139 s, 64 MiB in 0.122 s, whole units (~440 MB) in 0.129 s."""


def coded_pieces(nbytes: int) -> int:
    """How many pieces a compressed pack of a unit of ``nbytes`` is cut in."""
    return max(1, -(-nbytes // CODED_PIECE_BYTES))


def coded_load_seconds(nbytes: int, coded_nbytes: int, link: LinkModel, decode_bps: float) -> float:
    """How long a coded load of a unit of ``nbytes`` (``coded_nbytes`` compressed) holds the copy stream
    (see [Note: coded loads]): its pieces copy and decode as a two-stage pipeline, so the slower stage
    runs once per piece and the faster one once."""
    pieces = coded_pieces(nbytes)
    copy = link.copy_s(-(-coded_nbytes // pieces))
    decode = nbytes / pieces / decode_bps
    return pieces * max(copy, decode) + min(copy, decode)


@record
@dataclass(frozen=True)
class Measurements:
    """Everything the planner needs, measured on this machine for this model and input.

    ``units``: every offload unit, in execution order.
    ``tail_s``: device time after the last unit until the step ends.
    ``baseline_bytes``: allocated device memory at the step's start that flextensor does not plan:
    weights that never stream (modules outside units, excluded parameters) and the user's own tensors.
    ``activation_peak_bytes``: the step's peak allocated memory above what was allocated at its start.
    ``link``: the host-to-device copy speed.
    ``decode_bps``: how fast the device decodes compressed packs, in bytes of weights written per second
    (None: no unit is compressed). See [Note: coded loads].
    """

    units: tuple[UnitMeasurement, ...]
    link: LinkModel
    tail_s: Seconds = 0.0
    baseline_bytes: Bytes = 0
    activation_peak_bytes: Bytes = 0
    input_shapes: tuple[str, ...] = field(default_factory=tuple)
    decode_bps: BytesPerSecond | None = None

    def coded_load_s(self, unit: UnitMeasurement, link: LinkModel | None = None) -> float | None:
        """How long ``unit``'s coded load holds the copy stream: its compressed pieces over the link (or
        ``link``: the staged copies' speed) and their decodes, pipelined (see [Note: coded loads]); None
        when it is not held compressed."""
        if unit.coded_nbytes is None or not self.decode_bps:
            return None
        return coded_load_seconds(unit.nbytes, unit.coded_nbytes, link or self.link, self.decode_bps)

    def load_s(self, unit: UnitMeasurement) -> float:
        """How long ``unit``'s load holds the copy stream: coded when it is held compressed, else a copy."""
        coded = self.coded_load_s(unit)
        return self.link.copy_s(unit.nbytes) if coded is None else coded

    @property
    def compute_s(self) -> float:
        """The step's device time with every weight already on the device."""
        return sum(u.compute_s + u.gap_before_s for u in self.units) + self.tail_s

    def by_name(self) -> dict[str, UnitMeasurement]:
        return {u.name: u for u in self.units}

    def unit_names(self) -> Sequence[str]:
        return [u.name for u in self.units]
