"""How an offloaded model gets from learning to a laid-out plan, and from one plan to another.

Part of the engine (a mixin of :class:`~flextensor.engine.controller.OffloadEngine`, split out so that each
reads in one sitting): planning from the profiled forwards, adopting a saved profile and checking it, laying a
plan out, switching plans when the inputs change, and the ways back to profiling when a layout fails.
For serving engines: one layout for every input (``keep_one_layout``) and ending the learning before
captures (``prepare_for_captures``). It uses the engine's state: the units, their order, the plan cache,
the plan in place and the inputs it serves, the store, the policy and the learning record.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from flextensor.common.sizes import format_bytes
from flextensor.engine.policy import ROOM_BACK_SHARE, PlanEntry, PlanPolicy, without_coding
from flextensor.phases.discovery import DiscoveryResult
from flextensor.phases.learning import Learning, Phase
from flextensor.plan.layout import provisional_arena_bytes
from flextensor.plan.measurements import LinkModel, Measurements
from flextensor.plan.plan import Plan
from flextensor.plan.planner import minimal_need_bytes

if TYPE_CHECKING:
    from flextensor.engine.cuda_graphs import GraphCaptures
    from flextensor.phases.timeline import StepRecorder
    from flextensor.store.device_store import DeviceStore
    from flextensor.store.units import Unit
    from flextensor.weights.access import StreamedWeights

logger = logging.getLogger("flextensor")

__all__ = ["PlanStates"]


class PlanStates:
    """The plan state machine of one offloaded model (see the module docstring)."""

    units: dict[str, Unit]
    order: list[Unit]
    phase: Phase
    plans: dict[tuple[str, ...], PlanEntry]
    current: PlanEntry | None
    signature: tuple[str, ...] | None
    laid_out: bool
    link: LinkModel | None
    store: DeviceStore
    policy: PlanPolicy
    learning: Learning
    graphs: GraphCaptures
    weights: StreamedWeights
    bracket: Any
    recordings: dict[tuple[str, ...], StepRecorder]
    latest_recording: StepRecorder | None
    _check_next: bool
    before_outside_layout: Any

    if TYPE_CHECKING:  # the engine's own

        def _enter(self, phase: Phase) -> None: ...
        def _lay_out(
            self,
            streamed: list[Unit],
            resident: Any,
            arena_bytes: int,
            staged: Any = None,
            ahead: bool = False,
        ) -> None: ...
        def _lay_out_to_discover(self) -> None: ...
        def _lay_out_to_learn(self, order: list[Unit]) -> None: ...
        def _finish_discovery(self, discovered: DiscoveryResult) -> None: ...
        def vacate(self, keep_resident: bool = False) -> int: ...

    def _lay_out_to_profile(self) -> None:
        """Stream every unit through a provisional arena (OffloadEngine._lay_out_to_learn); until this
        succeeds, every forward tries again."""
        self._lay_out_to_learn(self.order or list(self.units.values()))
        self._enter(Phase.PROFILING)

    def _plan_from_samples(self) -> None:
        """Plan the inputs being profiled from the forwards profiled so far, and enter steady state."""
        assert self.signature is not None
        link = self.link or LinkModel.constant(1e12)
        self.install_plan(self.learning.measurements(link, self.store.device_bytes_held(), self.signature))

    def adopt_profile(self, order: list[str], measurements: Measurements, plan: Plan | None) -> None:
        """Enter steady state from a saved profile: its order, its measurements, its plan (None: plan from
        the measurements). The next forward is a checking one (see :meth:`_after_check`)."""
        self.order = [self.units[name] for name in order if name in self.units]
        self.install_plan(measurements, plan)
        self._check_next = True

    def _after_check(self, result: DiscoveryResult) -> None:
        """The first forward from a profile ran like a discovery forward in the plan's layout: when the
        model no longer behaves as profiled (its code changed: a weight read outside its unit, a unit that
        now must stay resident, another order), profile it again instead of keeping a plan that no longer
        fits it. That forward's outputs were right either way (weights loaded on demand)."""
        seen = set(result.order)
        ran = [u for u in self.order if u in seen]
        changed = self.weights.outside_reads or result.must_stay_resident or result.order != ran
        if not changed:
            return
        logger.warning(
            "this model does not run as it did when its profile was made (its code changed?): "
            "profiling it again; save a new profile once it reaches steady state"
        )
        known = set(result.order)
        order = [*result.order, *(u for u in self.order if u not in known)]
        self._learn_again(DiscoveryResult(order, dict(result.must_stay_resident)))

    def _learn_again(self, discovered: DiscoveryResult) -> None:
        """Forget every plan and recording, and profile again from ``discovered``."""
        self.plans.clear()
        self.recordings.clear()
        self.latest_recording = None
        self.current = None
        self.learning.restart_profiling()
        self._finish_discovery(discovered)

    def _learn_nested_calls(self, seen: dict[Unit, Unit]) -> bool:
        """Streamed units that ran inside another after learning (see [Note: nested calls] in
        store/nesting.py): their calls borrowed their range, right but slow. Keep them resident and
        profile again, as discovery would have; whether it did (this forward's samples then say nothing).
        Not while CUDA graphs or a serving engine hold the layout, nor where the budget has no room for
        them (unless a compiled forward refused to borrow): such calls go on borrowing."""
        nested = {u: outer for u, outer in seen.items() if u.name in self.units and not u.resident}
        if not nested:
            return False
        borrowing = self.store.nested
        calls = ", ".join(f"{u.name!r} inside {outer.name!r}" for u, outer in nested.items())
        if self.graphs.layout_kept:
            if not nested.keys() <= borrowing.reported:
                borrowing.reported.update(nested)
                logger.warning(
                    "units ran inside another, which the learning forwards never saw (%s); the layout is "
                    "kept (CUDA graphs or a serving engine), so each such call waits for its copy",
                    calls,
                )
            return False
        # A compiled forward cannot borrow (it refused the load): those are kept resident whatever the
        # budget says, even after eager forwards borrowed them; the next plan says how much more it needs.
        refused = bool(nested.keys() & borrowing.refused)
        if not refused and nested.keys() <= borrowing.without_room:
            return False  # decided once, not again each forward: they go on borrowing
        short = 0 if refused else self._short_to_keep(nested)
        if short > 0:
            borrowing.without_room.update(nested)
            logger.warning(
                "units ran inside another, which the learning forwards never saw (%s); the budget has no "
                "room to keep them resident (%s more gpu_memory_budget would make room), so each such call "
                "waits for its copy",
                calls,
                format_bytes(short),
            )
            return False
        logger.warning(
            "units ran inside another, which the learning forwards never saw (%s): keeping the inner "
            "units resident and profiling again (save a new profile once in steady state)",
            calls,
        )
        for unit, outer in nested.items():
            self.weights.keep_unit_resident(unit, f"it runs inside {outer.name!r}", current_values=False)
        self._learn_again(DiscoveryResult(list(self.order)))
        return True

    def _short_to_keep(self, nested: dict[Unit, Unit]) -> int:
        """How far keeping the ``nested`` units resident would take the smallest plan of any input seen
        past the budget (0: every one fits, or no budget). Learning again forgets every plan, and one that
        cannot be made would stop a forward with BudgetError, where the borrowing calls are right, only
        slower. Plan time: once per nesting first seen."""
        budget = self.policy.budget_bytes
        if budget is None:
            return 0
        kept = {u.name for u in nested}
        # Resident outside the units, their weights join what the next profile measures as the baseline
        # (a unit that never ran while learning is in no measurements: its own size counts).
        moved = sum(u.nbytes for u in nested) if self.store.runtime.counts_memory else 0
        short = 0
        for entry in self.plans.values():
            measurements = entry.measurements
            after = replace(
                measurements,  # mapped units, read in place, are planned as if they were not units
                units=tuple(u for u in measurements.units if u.name not in kept | self.policy.mapped),
                baseline_bytes=measurements.baseline_bytes + moved,
            )
            short = max(short, minimal_need_bytes(after)[0] - budget)
        return short

    def install_plan(
        self, measurements: Measurements, plan: Plan | None = None, crowded_bytes: int = 0
    ) -> None:
        """Plan from ``measurements`` (unless given), lay it out, and enter steady state. ``crowded_bytes``:
        see PlanEntry."""
        measurements = self.policy.planned(measurements)  # as plans count them (what a profile saves)
        if plan is None:
            plan = self.policy.make_plan(measurements)
        self.order = [self.units[u.name] for u in measurements.units]
        try:
            if self.policy.decode_bps is not None and not plan.coded and self._streams_coded_packs(plan):
                # A plan without coded loads (see [Note: compression yields to the budget]).
                measurements = self._hold_uncompressed(measurements)
            self._apply(PlanEntry(measurements, plan, crowded_bytes))
        except BaseException as exc:
            self.policy.layout_failed(plan, exc)
            self._profile_again_streaming_everything("the plan's layout failed")
            raise
        self.policy.layout_landed()
        self.signature = measurements.input_shapes
        # A recording made under an earlier plan for these inputs is dropped: the next step records.
        self.recordings.pop(self.signature, None)
        logger.info("plan: %s", plan.summary())

    def plan_again_if_crowded(self, signature: tuple[str, ...], beside: int = 0) -> bool:
        """Plan the inputs ``signature`` again, from the same measurements, when the device memory outside
        this model grew since their plan was made so much that the plan's peak no longer fits its limit: a
        pipeline's component plans in the first generation, before its caller holds the generation's
        output. ``beside``: device bytes the pipeline's other components hold for their units, which the
        pipeline counts on its own (they leave the outside: counted in the plan too, the components would
        make each other give memory back at every step). Reads the allocator's counters (no device sync)
        and plans only then; a pipeline's component asks before each step. Once the outside shrinks
        again by at least ROOM_BACK_SHARE of the limit, such a plan is made again with the room back (never
        with less outside than was measured). Whether it planned. (A model that no longer fits at all
        raises BudgetError here, its plans left as they were.)"""
        entry, limit = self.plans.get(signature), self.policy.memory_limit()
        if entry is None or limit is None or self.phase is not Phase.INFERENCE or self.graphs.layout_kept:
            return False
        if self.graphs.capturing():
            return False  # a layout would synchronise and allocate inside the capture
        grown = self.grown_outside(entry, beside)
        if grown > 0 and entry.plan.predicted_peak_bytes + grown > limit:
            logger.info("plan again: %d more bytes outside this model than when it was planned", grown)
        elif (
            grown < 0 and entry.crowded_bytes and min(-grown, entry.crowded_bytes) >= ROOM_BACK_SHARE * limit
        ):
            grown = -min(-grown, entry.crowded_bytes)  # back down to what was measured, not below
            logger.info("plan again: %d bytes outside this model freed since it was planned", -grown)
        else:
            return False
        outside = entry.measurements.baseline_bytes + grown
        self.install_plan(
            replace(entry.measurements, baseline_bytes=outside), crowded_bytes=entry.crowded_bytes + grown
        )
        return True

    def plans_under(self, budget_bytes: int | None) -> dict[tuple[str, ...], PlanEntry]:
        """Every plan made so far, made again from its measurements under ``budget_bytes``; the policy and
        the plans in place are left as they were (BudgetError when one does not fit)."""
        kept = self.policy.budget_bytes
        self.policy.budget_bytes = budget_bytes
        try:
            return {
                signature: replace(entry, plan=self.policy.make_plan(entry.measurements))
                for signature, entry in self.plans.items()
            }
        finally:
            self.policy.budget_bytes = kept

    def adopt_budget(self, budget_bytes: int | None, plans: dict[tuple[str, ...], PlanEntry]) -> None:
        """Plan under ``budget_bytes`` from now on, with ``plans`` (:meth:`plans_under`) for the inputs seen:
        the layout in place is given back and the next forward lays its plan out. A model still learning
        (or whose plan failed: BudgetError at every forward) makes its next plan under it."""
        self.policy.budget_bytes = budget_bytes
        self.policy.failed_peak_bytes = None  # a layout that failed under the old budget says nothing now
        signature = None if self.current is None else self.current.measurements.input_shapes
        if signature is not None:
            self.vacate()  # a plan's layout (a learning one serves any budget)
        self.plans.update(plans)
        for known in plans:
            self.recordings.pop(known, None)  # the next step under each new plan records
        if signature is not None:
            self.current, self.laid_out = self.plans[signature], False
        coded = self.policy.decode_bps is not None
        if coded and any(not e.plan.coded and self._streams_coded_packs(e.plan) for e in plans.values()):
            self._hold_uncompressed(next(iter(plans.values())).measurements)  # every plan made again
        budget = "none" if budget_bytes is None else format_bytes(budget_bytes)
        logger.info("gpu_memory_budget now %s: %d plan(s) made again", budget, len(plans))

    def grown_outside(self, entry: PlanEntry, beside: int) -> int:
        """How much more device memory is allocated outside this model (and outside the ``beside`` bytes a
        pipeline's other components hold) than when ``entry`` was planned; 0 where the device does not
        count its memory (a CPU)."""
        allocated = self.store.runtime.memory_allocated()
        if not allocated:
            return 0
        return allocated - self.store.device_bytes_held() - beside - entry.measurements.baseline_bytes

    def _streams_coded_packs(self, plan: Plan) -> bool:
        return any((pack := self.units[name].pack) is not None and pack.coded for name in plan.streamed)

    def _hold_uncompressed(self, measurements: Measurements) -> Measurements:
        """Give every compressed pack its raw bytes back, plan without coded loads from now on (the plans
        made for other inputs too), and return ``measurements`` as such plans count them."""
        from flextensor.store.coded_loads import hold_uncompressed

        self.store.recode = None  # before vacate() rebuilds resident packs: raw, not encoded to be undone
        self.current, self.laid_out = None, False
        self.store.vacate()  # the device bytes each piece's decode needs: the plan lays out afresh
        hold_uncompressed(self.store)
        self.policy.stop_coding()
        for signature, entry in list(self.plans.items()):  # made for coded loads: made again without
            raw = without_coding(entry.measurements)
            self.plans[signature] = PlanEntry(raw, self.policy.make_plan(raw), entry.crowded_bytes)
            self.recordings.pop(signature, None)
        return without_coding(measurements)

    def _apply(self, entry: PlanEntry, ahead: bool = False) -> None:
        """Lay out ``entry``'s plan, remember it, and enter steady state; a failure leaves no layout.
        ``ahead``: see ``DeviceStore.lay_out``."""
        plan = entry.plan
        self.current = None
        self._lay_out(
            [self.units[n] for n in plan.streamed],
            [self.units[n] for n in plan.resident],
            plan.arena_bytes,
            plan.staged,
            ahead,
        )
        self.current = entry
        self.plans[entry.measurements.input_shapes] = entry
        resident_everywhere = set.intersection(*(set(e.plan.resident) for e in self.plans.values()))
        self.store.drop_packs(resident_everywhere)
        self._enter(Phase.INFERENCE)

    def _profile_again_streaming_everything(self, why: str) -> None:
        """Profile the next forward afresh with every unit streamed through a provisional arena: the way
        back from a plan whose layout failed half-way, or from a profiling forward that ran out of memory
        with units held resident. The layout itself is made by the next forward, not here: here the
        failed forward's tensors may still hold the memory it needs."""
        logger.warning("%s: the next forward streams every unit and is profiled again", why)
        self.learning.restart_profiling()
        self.current, self.signature, self.laid_out = None, None, False
        self._enter(Phase.PROFILING)

    def _ensure_layout(self) -> None:
        """Give units device bytes again after a layout was lost, for a unit called outside a forward."""
        if self.before_outside_layout is not None:
            self.before_outside_layout(self)  # a pipeline's other components make room, as for a step
        if self.current is not None:
            self._apply(self.current)
        elif self.phase is Phase.DISCOVERY:
            self._lay_out_to_discover()
        else:
            self._lay_out_to_profile()

    def _switch_to(self, signature: tuple[str, ...]) -> None:
        """Inputs changed in steady state (or the layout was lost): lay out the plan made for them, or
        profile them with the units resident until now kept resident as far as memory allows."""
        try:
            known = self.plans.get(signature)
            if known is not None:
                if known is not self.current or not self.laid_out:
                    self._apply(known)
                self.signature = signature
                return
            logger.info("new input shapes %s: profiling them and re-planning", ", ".join(signature))
            kept = self.policy.profiling_residents(
                self.units.values(), self.order, self.plans, self.store.device_bytes_held()
            )
            resident = {self.units[name] for name in kept}
            streamed = [u for u in self.order if u not in resident]
            self._lay_out(streamed, resident, provisional_arena_bytes([u.nbytes for u in streamed]))
            self.current, self.signature = None, signature
            self._enter(Phase.PROFILING)
        except BaseException:
            # A layout that failed half-way (out of memory) has freed units of the old one: forget which
            # layout is in place, so that the next forward lays one out again whatever its shapes.
            self.current, self.signature, self.laid_out = None, None, False
            raise

    def keep_one_layout(self) -> None:
        """Serve every input with one plan from the first on, made as if the link were the bottleneck:
        for a serving engine whose budget counts the weights alone (any plan fits every input), and
        which alternates prefill and decode steps (a layout per shape would move the resident units at
        each switch) or captures its steps in CUDA graphs (which keep the layout anyway)."""
        self.policy.plan_for_every_input()
        self.graphs.pin_layout()

    def prepare_for_captures(self) -> None:
        """A runtime that captures whole forwards by itself (vLLM) is about to: end the learning with a
        plan now, from what the forwards so far measured (a discovery forward's times if no forward was
        profiled; the latest plan if the forwards profiling these inputs were the compiler's), and keep
        the layout for every input from then on (see [Note: captured forwards]). Cheap once a capture
        ran: runtimes call it before every replay too. Before any forward it does nothing: the capture
        refuses, saying what to do."""
        if self.graphs.captured or self.bracket.running:
            return
        if self.phase is Phase.DISCOVERY:
            discovered = self.learning.discovered_so_far()
            if discovered is None:
                return
            self._finish_discovery(discovered)
        if self.phase is Phase.PROFILING:
            if not self.learning.has_samples() and self.plans:
                self.learning.restart_profiling()
                self._apply(list(self.plans.values())[-1])
                self.signature = self.current.measurements.input_shapes  # type: ignore[union-attr]
            elif self.learning.sample_discovery_times(self.signature):
                self._plan_from_samples()
        if self.phase is Phase.INFERENCE and self.laid_out:
            if self._check_next:
                logger.warning(
                    "a CUDA graph capture comes before the forward that checks the model still runs as its "
                    "profile says; the check is skipped"
                )
                self._check_next = False
            self.graphs.pin_layout()
