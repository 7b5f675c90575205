"""Which plan serves which inputs, and the limits a plan must fit on this device.

Plans are cached per *input signature*: the bucketed shapes of the tensors a forward receives (see
``input_signature`` in hooks/functions.py). :class:`PlanPolicy` makes plans under the budget (or, without
one, within the device's share), below the peak of a plan whose layout ran out of memory, and chooses
which resident units stay resident while a new input shape is profiled.

[Note: a budget for the weights alone] A serving engine (vLLM) sizes its own device memory: it measures
the model's weights after loading and its activations in a warm-up step, and gives the rest to its KV
cache. Under it the budget covers only what flextensor places: the model's weights on the device (those
that never stream, resident units, the arena). The plans then count the model's weights on the device
outside the units' storage (read at each plan: a weight kept resident since counts) instead of everything
allocated at a step's start (which would count the KV cache), and no activations (the engine accounts
for them); a profile saves its measurements counted so. See :meth:`PlanPolicy.count_weights_only`.

[Note: compression yields to the budget]
Coded loads need two staging slots on the device (see [Note: coded loads] in plan/measurements.py). Under a
budget that fits the smallest plan without them but not with them (a compute-bound model whose budget
was sized to its raw plan: wan20 at 5.7 GB), refusing would make ``compression="lossless"`` break a
model that runs without it. The plan is then made without coded loads, with a warning that says how
much more budget compression needs, and the engine holds the packs uncompressed again
(``store.coded_loads.hold_uncompressed``) before laying it out. That is for every input from then on: a pack
is held one way, and plans already made for other inputs are made again without coded loads (a long
prefill whose activations leave no room gives compression up for the decode steps too; the warning says
by how much the budget falls short). A profile saved from such a plan says so (its plan streams no unit
compressed), and a run started from it holds its packs uncompressed from the start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from flextensor.common.sizes import format_bytes
from flextensor.device.runtime import DeviceRuntime
from flextensor.errors import BudgetError
from flextensor.plan.host_plan import HostPlan
from flextensor.plan.layout import minimal_arena_bytes
from flextensor.plan.measurements import Measurements
from flextensor.plan.plan import Plan
from flextensor.plan.planner import minimal_need_bytes, plan_offload, residents_within
from flextensor.store.units import Unit

logger = logging.getLogger("flextensor")

__all__ = [
    "FAILED_LAYOUT_SHRINK",
    "NO_BUDGET_DEVICE_FRACTION",
    "PlanEntry",
    "PlanPolicy",
    "without_coding",
]

NO_BUDGET_DEVICE_FRACTION = 0.92
"""Without a budget the plan still has to fit the device: this share of its memory, leaving room for the
caching allocator's fragmentation and other processes' contexts."""

ROOM_BACK_SHARE = 0.05
"""A plan made for more memory outside the model is made again when at least this share of the limit
came back: the layout it costs is not made for a few bytes."""

FAILED_LAYOUT_SHRINK = 0.9
"""After a plan's layout ran out of memory, the next plan's predicted peak stays under this share of it."""


@dataclass(frozen=True)
class PlanEntry:
    """A plan and the measurements it was made from, cached per input signature. ``crowded_bytes``: how
    far their baseline was raised above the one measured because the memory outside the model grew (see
    PlanStates.plan_again_if_crowded), which it gives back when that memory is freed again."""

    measurements: Measurements
    plan: Plan
    crowded_bytes: int = 0


class PlanPolicy:
    """Plans for one offloaded model on its device (see the module docstring)."""

    def __init__(self, runtime: DeviceRuntime, budget_bytes: int | None) -> None:
        self.runtime = runtime
        self.budget_bytes = budget_bytes
        self.failed_peak_bytes: int | None = None  # predicted peak of a plan whose layout ran out of memory
        # set when a host budget cannot pin every pack (store/host_budget.py)
        self.host: HostPlan | None = None
        self.fixed_weight_bytes: Callable[[], int] | None = None  # set by count_weights_only
        self.link_bound = False  # set by plan_for_every_input
        self.decode_bps: float | None = None  # set by stream_coded
        self.coded_sizes: Callable[[], dict[str, tuple[int, int]]] | None = None
        self.mapped: frozenset[str] = frozenset()  # units read in place from host memory (store/mapping.py)

    def count_weights_only(self, fixed_weight_bytes: Callable[[], int]) -> None:
        """Plan for the weights alone: ``fixed_weight_bytes()`` (asked at each plan: a weight may leave
        the stream for device storage of its own) never stream; see [Note: a budget for the weights
        alone]. Without a budget, plans are then made without a device limit: the serving engine
        accounted for the whole model when it loaded."""
        self.fixed_weight_bytes = fixed_weight_bytes

    def plan_for_every_input(self) -> None:
        """Plans will serve every input, not only those measured: plan each as if the step computed
        nothing, so that it keeps as many units resident as the memory limit allows. That is the best plan
        for the shortest steps (decode), where the link is the bottleneck, and costs the longest ones
        (prefill) little: their compute hides the copies of the fewer units left to stream."""
        self.link_bound = True

    def stream_coded(self, decode_bps: float, coded_sizes: Callable[[], dict[str, tuple[int, int]]]) -> None:
        """Some packs are held compressed (host/coded_packs.py): plans time their loads as coded ones, from
        the decode speed and ``coded_sizes()`` (unit name -> (bytes a coded load copies, its largest piece);
        asked at each plan)."""
        self.decode_bps, self.coded_sizes = decode_bps, coded_sizes

    def planned(self, measurements: Measurements) -> Measurements:
        """``measurements`` as the plans count them: as measured, or for the weights alone; with the
        coded units' sizes and the decode speed when packs are held compressed."""
        if self.coded_sizes is not None:
            sizes = self.coded_sizes()
            units = tuple(
                replace(u, coded_nbytes=None, coded_piece_nbytes=None)
                if u.name not in sizes
                else replace(u, coded_nbytes=sizes[u.name][0], coded_piece_nbytes=sizes[u.name][1])
                for u in measurements.units
            )
            measurements = replace(measurements, units=units, decode_bps=self.decode_bps)
        elif measurements.decode_bps is not None:  # a profile made with compression, which is off now
            measurements = without_coding(measurements)
        if self.fixed_weight_bytes is None:
            return measurements
        return replace(measurements, baseline_bytes=self.fixed_weight_bytes(), activation_peak_bytes=0)

    def stop_coding(self) -> None:
        """The packs are held uncompressed again (see [Note: compression yields to the budget])."""
        self.decode_bps, self.coded_sizes = None, None

    def memory_limit(self) -> int | None:
        """What a plan must fit: the budget, or without one the device's share (None when the device's
        size is unknown, as on a CPU)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        if self.fixed_weight_bytes is not None:
            return None
        capacity = self.runtime.total_memory()
        return None if capacity is None else int(NO_BUDGET_DEVICE_FRACTION * capacity)

    def make_plan(self, measurements: Measurements) -> Plan:
        """The plan for ``measurements``: under the budget; without one, within the device's share; and
        below the peak of a plan whose layout ran out of memory. A plan with coded loads that does not fit
        gives way to one without (see [Note: compression yields to the budget]): its ``coded`` is empty.
        Mapped units are planned as if they were not units, then held resident (``Plan.mapped``)."""
        plan = self._plan_unmapped(without_units(measurements, set(self.mapped)))
        return with_mapped(plan, measurements, self.mapped)

    def _plan_unmapped(self, measurements: Measurements) -> Plan:
        measurements = self.planned(measurements)
        try:
            return self._make_plan(measurements)
        except BudgetError:
            if self.decode_bps is None or not measurements.decode_bps:
                raise
            raw = without_coding(measurements)
            plan = self._make_plan(raw)  # raises that plan's own BudgetError when it does not fit either
            need = minimal_need_bytes(measurements)[0]
            staging = need - minimal_need_bytes(raw)[0]
            if self.budget_bytes is None:
                more = f"{format_bytes(staging)} more free device memory"
            else:
                more = f"{format_bytes(max(need - self.budget_bytes, 1))} more gpu_memory_budget"
            logger.warning(
                "compression='lossless' is not used: the memory limit has no room for the %s its two "
                "staging slots take at these inputs, so the packs are held uncompressed and copied as they "
                "are, for every input from now on (%s streams them compressed)",
                format_bytes(staging),
                more,
            )
            return plan

    def _make_plan(self, measurements: Measurements) -> Plan:
        if self.link_bound:
            units = tuple(replace(u, compute_s=0.0, gap_before_s=0.0) for u in measurements.units)
            measurements = replace(measurements, units=units, tail_s=0.0)
        plan = plan_offload(measurements, self.budget_bytes, self.host)
        limit = self.memory_limit()
        if self.failed_peak_bytes is not None:
            # Never below the smallest plan: that one is retried as it is rather than refused.
            shrunk = int(FAILED_LAYOUT_SHRINK * self.failed_peak_bytes)
            shrunk = max(shrunk, minimal_need_bytes(measurements)[0])
            limit = shrunk if limit is None else min(limit, shrunk)
        if limit is not None and plan.predicted_peak_bytes > limit:
            logger.info("the plan would not fit the memory left; planning for %d bytes", limit)
            plan = plan_offload(measurements, limit, self.host)
        return plan

    def layout_failed(self, plan: Plan, error: BaseException) -> None:
        if isinstance(error, torch.OutOfMemoryError):
            # The device had less room than measured (memory taken since, fragmentation): the next
            # plan asks for less, or raises BudgetError, rather than failing the same way again.
            self.failed_peak_bytes = plan.predicted_peak_bytes

    def layout_landed(self) -> None:
        self.failed_peak_bytes = None  # what failed was that layout, not this device for good

    def profiling_residents(
        self,
        units: Iterable[Unit],
        order: Sequence[Unit],
        plans: Mapping[tuple[str, ...], PlanEntry],
        device_bytes_held: int,
    ) -> set[str]:
        """The units kept resident while a new input shape is profiled: those resident now, as far as
        memory allows.

        Where a unit's weights live changes none of what profiling measures (compute time, activation
        memory; copy times come from the link model), and keeping them spares rebuilding their packs. The
        new shape's activations are unknown until it runs, though: under a memory limit (the budget, or
        the device's share without one) units stream instead until the layout leaves room for the largest
        activation peak measured so far.
        """
        units = list(units)
        resident = {u.name: u.device_nbytes for u in units if u.resident}
        limit = self.memory_limit()
        if limit is None or not resident:
            return set(resident)
        if self.fixed_weight_bytes is not None:
            reserve, fixed = 0, self.fixed_weight_bytes()
        else:
            reserve = max((e.measurements.activation_peak_bytes for e in plans.values()), default=0)
            fixed = max(0, self.runtime.memory_allocated() - device_bytes_held)  # weights, user tensors
        in_order = set(order)
        streamed = [u.nbytes for u in order if u.name not in resident]
        # Units that never ran are loaded on demand at the arena's start: the arena holds the largest.
        idle = minimal_arena_bytes([u.nbytes for u in units if u not in in_order])
        kept = residents_within(resident, streamed, limit - fixed - reserve, arena_floor=idle)
        kept |= {u.name for u in units if u.resident and u.mapped is not None}  # no room to give back
        if len(kept) < len(resident):
            logger.info(
                "profiling streams %d of the %d resident unit(s), to leave room for activations",
                len(resident) - len(kept),
                len(resident),
            )
        return kept


def without_units(measurements: Measurements, names: set[str]) -> Measurements:
    """``measurements`` as if the units ``names`` were not units: their device time becomes time between
    units (that of the next one, or the step's tail)."""
    if not names:
        return measurements
    units, carried = [], 0.0
    for unit in measurements.units:
        if unit.name in names:
            carried += unit.gap_before_s + unit.compute_s
        else:
            units.append(replace(unit, gap_before_s=unit.gap_before_s + carried))
            carried = 0.0
    return replace(measurements, units=tuple(units), tail_s=measurements.tail_s + carried)


def with_mapped(plan: Plan, measurements: Measurements, mapped: Collection[str]) -> Plan:
    """``plan``, made without the units ``mapped`` (:func:`without_units`), with those of them among
    ``measurements`` held resident, read in place (``Plan.mapped``)."""
    names = tuple(u.name for u in measurements.units if u.name in mapped)
    if not names:
        return plan
    resident = set(plan.resident) | set(names)
    in_order = tuple(u.name for u in measurements.units if u.name in resident)
    return replace(plan, resident=in_order, mapped=names)


def without_coding(measurements: Measurements) -> Measurements:
    """``measurements`` as if no pack were held compressed."""
    units = tuple(replace(u, coded_nbytes=None, coded_piece_nbytes=None) for u in measurements.units)
    return replace(measurements, units=units, decode_bps=None)
