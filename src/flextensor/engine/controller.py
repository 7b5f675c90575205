"""The controller: an offloaded model's phases, its plans, and what the start and end of each forward decide.

The engine owns the units, the device store (store/device_store.py), the hooks (hooks/model_hooks.py) and the
plan cache. At the start of each outermost forward it picks the forward's driver (phases/discovery.py,
phases/profiling.py, phases/steady.py), which the unit hooks call; at its end it hands what the driver learned
to the next phase (phases/learning.py counts the forwards and keeps the samples; engine/forward_ends.py closes
each driver; engine/plan_states.py makes, lays out and switches the plans). Every phase change goes through
:meth:`OffloadEngine._enter`, which also decides which units carry hooks. How streamed weights look to
``state_dict``, conversions and ``release`` is weights/access.py's; in-place edits are weights/edits.py's.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flextensor.config.schema import OffloadConfig
from flextensor.device.runtime import Target, profiler_running
from flextensor.engine.cuda_graphs import GraphCaptures
from flextensor.engine.edit_session import EditSession
from flextensor.engine.forward_ends import ForwardEnds
from flextensor.engine.policy import PlanEntry, PlanPolicy
from flextensor.engine.status import OffloadStatus, status_of
from flextensor.errors import UnsupportedOperationError
from flextensor.phases.autocast_cache import AutocastCachePause
from flextensor.phases.discovery import BehaviourChecks, CheckedStep, DiscoveryStep
from flextensor.phases.learning import Learning, Phase
from flextensor.phases.profiling import ProfilingStep
from flextensor.phases.steady import (
    CapturedStep,
    OutsideForwardStep,
    ProfiledStep,
    RecordedStep,
    steady_step,
)
from flextensor.phases.timeline import StepRecorder
from flextensor.plan.layout import provisional_arena_bytes
from flextensor.plan.measurements import LinkModel
from flextensor.store.device_store import DeviceStore
from flextensor.store.stream_order import in_stream_order, lays_out_in_stream_order, note_forward_stream
from flextensor.store.units import Placement, Unit
from flextensor.weights.access import StreamedWeights
from flextensor.weights.autograd_guard import StreamedWeightGuard
from flextensor.weights.edits import (
    OutsideEdits,
    WeightWatch,
    guard_parameters,
    refuse_forward_over_edits,
    unguard_parameter,
)

logger = logging.getLogger("flextensor")

__all__ = ["OffloadEngine", "Phase"]


class OffloadEngine(ForwardEnds):
    """Owns one offloaded model's units, store, phase, plans and hooks. Built by ``flextensor.offload``."""

    def __init__(
        self,
        model: nn.Module,
        config: OffloadConfig,
        target: Target,
        units: list[Unit],
        resident_reasons: dict[str, str],
        entry_methods: tuple[str, ...] = (),
    ) -> None:
        from flextensor.hooks.bracket import ForwardBracket

        # hooks/model_hooks.py types its controller by protocol only
        from flextensor.hooks.model_hooks import ModelHooks

        self.model = model
        self.config = config
        self.target = target
        self.runtime = target.runtime
        self.store = DeviceStore(units, self.runtime, target.pin)
        self.units = {u.name: u for u in units}
        self.resident_reasons = resident_reasons  # FQN -> why it never streams, incl. found in discovery
        self.owner_of = {id(p): u for u in units for _, p, _ in u.parameters}
        self.bracket = ForwardBracket(model)
        self.entry_methods = entry_methods  # bracketed like forward (hooks.functions.entry_point)
        # a pipeline's (pipelines/pipeline.py)
        self.before_step: Callable[[OffloadEngine], None] | None = None
        self.after_step: Callable[[OffloadEngine], None] | None = None  # a pipeline's, on success
        self.before_outside_layout: Callable[[OffloadEngine], None] | None = None  # a pipeline's
        self.held_beside: Callable[[], int] = lambda: 0  # a pipeline's: what its other components hold
        self.component_of: tuple[str, str] | None = None  # (its name, the pipeline's class): a component
        self._laid_out_on: object = None  # the stream a layout made before the forward was ordered on
        # Set by a pipeline before a forward after which this model gives its memory back: that forward
        # copies nothing in for the next one (DeviceStore.prefetch_past_end), and _past_end_off is True
        # while it runs.
        self.gives_back_after_forward = False
        self._past_end_off = False
        self._early_failed: set[bool] = set()  # a layout ahead (True) or at a run's end (False) failed
        self.hooks = ModelHooks(self)
        self.phase = Phase.DISCOVERY
        self.order: list[Unit] = []  # execution order, once discovered
        self.link: LinkModel | None = None
        self.plans: dict[tuple[str, ...], PlanEntry] = {}
        self.current: PlanEntry | None = None  # the plan laid out, None while learning
        self.signature: tuple[str, ...] | None = None  # the inputs the current layout serves
        self.laid_out = False  # units have the device bytes the phase needs; else the next forward lays out
        self.forwards = 0
        # The first steady step of each plan, recorded for report() and trace(), by input signature: a
        # served model switches plans between prefill and decode steps, each reported as recorded.
        self.recordings: dict[tuple[str, ...], StepRecorder] = {}
        self.latest_recording: StepRecorder | None = None
        ensure_layout = weakref.WeakMethod(self._ensure_layout)  # no cycle: see ModelHooks
        self._steady = steady_step(self.store)
        self.graphs = GraphCaptures(self.runtime, type(model).__name__)
        self._outside = OutsideForwardStep(
            self.store, lambda: ensure_layout()(), self.graphs, type(model).__name__
        )
        self.step: Any = self._outside  # what the unit hooks call (see hooks/model_hooks.py)
        self.learning = Learning(config.discovery_forwards, config.profiling_forwards)
        left_the_stream = weakref.WeakMethod(self._weight_left_the_stream)  # no cycle: see ModelHooks
        self.weights = StreamedWeights(
            model,
            self.units,
            self.owner_of,
            resident_reasons,
            self.store,
            lambda: _call_if_alive(left_the_stream),
        )
        self.policy = PlanPolicy(self.runtime, target.budget_bytes)
        self._record_next = False
        self._check_next = False  # the first forward from a saved profile checks the model still fits it
        self._grad_guard = StreamedWeightGuard()
        self._autocast_cache = AutocastCachePause(self.runtime.device.type)  # see phases/autocast_cache.py
        self.watch = WeightWatch()  # in-place writes into streamed weights between forwards
        self._rearm_watch = False  # weights left the stream during this forward
        self.editing: EditSession | None = None  # flextensor.editing(model) is open
        self._guarded_outside: list[nn.Parameter] = []  # parameters outside every unit, .data watched
        self.outside_edits = OutsideEdits()  # their .data accesses between forwards (weights/edits.py)

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Lay every unit out for discovery and hook the model (``offload()`` calls this once)."""
        self._lay_out_to_discover()
        self.hooks.attach()
        self._guarded_outside = guard_parameters(self)
        self._enter(Phase.DISCOVERY)

    def _lay_out_to_discover(self) -> None:
        self._lay_out_to_learn(list(self.units.values()))

    def _lay_out_to_learn(self, order: list[Unit]) -> None:
        """Every unit through a provisional arena, but the mapped ones (see store/mapping.py): read in
        place as in every plan, they take no room and are timed as they will run."""
        streamed = [u for u in order if u.mapped is None]
        mapped = [u for u in self.units.values() if u.mapped is not None]
        self._lay_out(streamed, mapped, provisional_arena_bytes([u.nbytes for u in streamed]))

    def _enter(self, phase: Phase) -> None:
        """Change phase and hook exactly the units that need hooks in it: all of them while learning, the
        streamed ones in steady state (a resident unit's hooks would only cost time: a module with hooks
        takes PyTorch's slow call path, which shows in launch-bound decode steps)."""
        if phase is not self.phase:
            logger.info("%s -> %s after %d forward(s)", self.phase.value, phase.value, self.forwards)
            self.phase = phase
        units = self.units.values()
        self.hooks.hook_units(u for u in units if phase is not Phase.INFERENCE or not u.resident)

    def _lay_out(
        self, streamed: list[Unit], resident: Any, arena_bytes: int, staged: Any = None, ahead: bool = False
    ) -> None:
        self.laid_out = False
        self.store.lay_out(streamed, resident, arena_bytes, staged, ahead)
        self.laid_out = True
        self.watch.arm(self.units.values())

    def lay_out_ahead(self) -> bool:
        """Lay the plan in place out now, before this model's next forward, while the device may still
        run other work: a pipeline's next component (see [Note: the next component ahead] in
        pipelines/pipeline.py). Only from steady state with nothing laid out; True when it was laid out. A
        failure (out of memory) is logged and leaves the layout to the next forward."""
        if not self._may_lay_out_early(ahead=True):
            return False
        if not self.runtime.fits_outside_cache(self.layout_bytes()):
            return False
        return self._lay_out_early(ahead=True)

    def layout_bytes(self) -> int:
        """The device bytes the plan in force holds once laid out: its arena and resident units."""
        plan = self.current.plan  # type: ignore[union-attr]
        return plan.arena_bytes + sum(self.units[n].device_nbytes for n in plan.resident if n in self.units)

    def lay_out_in_stream_order(self) -> bool:
        """Lay the plan in place out now, before this model's next forward, ordered on the current stream
        after the work queued there (see [Note: a switch in stream order] in store/stream_order.py): a
        pipeline's next component, once the one whose run just ended gave its memory back. True when it
        was laid out; False, with nothing done, where the layout would synchronise the device."""
        if not self.lays_out_in_stream_order():
            return False
        return self._lay_out_early(ahead=False)

    def lays_out_in_stream_order(self) -> bool:
        """Whether :meth:`lay_out_in_stream_order` would lay the plan out now."""
        return self._may_lay_out_early(ahead=False) and lays_out_in_stream_order(self.store)

    def _may_lay_out_early(self, ahead: bool) -> bool:
        return not (
            self.current is None
            or self.laid_out
            or ahead in self._early_failed
            or self.phase is not Phase.INFERENCE
            or self._check_next
            or self.bracket.running
            or self.editing is not None
            or self.graphs.capturing()
        )

    def _lay_out_early(self, ahead: bool) -> bool:
        entry = self.current
        assert entry is not None
        try:
            self._apply(entry, ahead=ahead)
        except Exception as exc:  # an optimisation: the forward lays out as usual
            logger.warning(
                "laying the plan out %s failed (%s): it lays out at each forward from now on",
                "ahead of the next forward" if ahead else "at the end of the previous component's run",
                exc,
            )
            self._early_failed.add(ahead)
            self.store.vacate()
            self.current, self.laid_out = entry, False
            return False
        # The uploads are ordered on this stream (see DeviceStore.lay_out); a forward on another one
        # waits for the copy stream.
        self._laid_out_on = self.runtime.current_stream()
        return True

    def vacates_in_stream_order(self) -> bool:
        """Whether :meth:`vacate` would give every device byte back now without synchronising the
        device (see [Note: a switch in stream order])."""
        return self.laid_out and self.can_vacate() and in_stream_order(self.store, True)

    def can_vacate(self) -> bool:
        """Whether :meth:`vacate` would give device memory back now."""
        return not (self.bracket.running or self.graphs.layout_kept)

    # -- forwards -----------------------------------------------------------------------------------------

    def begin_forward(self, signature: tuple[str, ...]) -> None:
        """The outermost forward starts: lay out if needed, switch plans for new inputs, pick its driver."""
        if torch.jit.is_tracing():
            raise UnsupportedOperationError(
                "torch.jit.trace cannot record an offloaded model: the trace would capture the weights the "
                "arena held while tracing, not the streaming; use torch.compile, or trace the model before "
                "offload() or after flextensor.release(model)"
            )
        refuse_forward_over_edits(self)
        self.store.host.check_disk_files()
        if self.store.keep_packs:  # a pipeline component: its switches are ordered by streams
            note_forward_stream(self.store)
        if self.before_step is not None:
            self.before_step(self)  # the other components of a pipeline make room (pipelines/pipeline.py)
            self.plan_again_if_crowded(signature, self.held_beside())  # its caller may hold more now
        early, self._laid_out_on = self._laid_out_on, None
        # Resident units uploaded on the copy stream before this forward, ordered on another stream than
        # this one, are read after their uploads. (A capture may not wait on work outside it; the uploads
        # are complete by then anyway.)
        if early is not None and early != self.runtime.current_stream() and not self.graphs.capturing():
            self.runtime.current_stream().wait_stream(self.runtime.copy_stream)
        if self.phase is Phase.PROFILING and self.learning.has_samples() and signature != self.signature:
            # Profiling the previous inputs was cut short by other ones (generate(): a prefill, then
            # decode steps) before it had all its forwards: plan those inputs from what was profiled,
            # rather than mix these inputs' samples into theirs (a plan keyed by these inputs, made
            # from both, and none for the previous ones).
            self._plan_from_samples()
        keep = self.phase is Phase.INFERENCE and self.laid_out
        if keep and self.graphs.keep_layout(signature, self.signature):
            signature = self.signature  # type: ignore[assignment]  (see [Note: captured forwards])
        if self.phase is Phase.INFERENCE:
            if signature != self.signature or not self.laid_out:
                self._switch_to(signature)
        elif not self.laid_out and self.phase is Phase.DISCOVERY:
            self._lay_out_to_discover()  # given back before it ran (a pipeline's component): still to learn
        elif not self.laid_out:
            self._lay_out_to_profile()
        if self.phase is not Phase.INFERENCE:
            self.signature = signature
        if self.graphs.capturing():
            driver: Any = self._captured_driver()
        else:
            self.graphs.fence_begin()
            driver = self._driver()
        self.store.nested.forget()  # calls made outside a forward borrow, and teach nothing
        if self._outside.called:
            self._outside.called.clear()
        driver.begin()
        self.step = driver
        gives_back, self.gives_back_after_forward = self.gives_back_after_forward, False
        if gives_back and self.phase is Phase.INFERENCE and self.laid_out and not self._graph_bound():
            self.store.prefetch_past_end(False)
            self._past_end_off = True
        if self.store.arena is not None:
            self._autocast_cache.enter()
            if torch.is_grad_enabled():
                self._grad_guard.enter(self.store.arena)

    def _graph_bound(self) -> bool:
        """Whether a CUDA graph records or holds this layout's copies (see [Note: captured forwards])."""
        return self.graphs.layout_kept or self.graphs.capturing()

    def _driver(self) -> Any:
        if self.phase is Phase.DISCOVERY or (self.phase is Phase.INFERENCE and self._check_next):
            self.weights.outside_reads = 0
            if self.phase is Phase.INFERENCE:
                # The check watches the units the plan keeps resident too (hooked for this forward only):
                # a weight of theirs read outside its unit would read the arena once a later plan streams
                # the unit (found: a profile's resident unit, read outside it, wrong after a new shape).
                self.hooks.hook_units(self.units.values())
            weights, watched = self.weights, dict(self.owner_of)
            checks = BehaviourChecks(
                self.store, watched, weights.keep_read_outside_resident, weights.keep_unit_resident
            )
            recorder = StepRecorder(self.runtime, self.forwards)
            if self.phase is Phase.DISCOVERY:
                return DiscoveryStep(self.store, checks, recorder)
            self._record_next = False  # the checking forward is recorded too
            return CheckedStep(self.store, recorder, checks)
        if self.phase is Phase.PROFILING:
            return ProfilingStep(self.store)
        if self._record_next or self.signature not in self.recordings:  # each plan's first step too
            self._record_next = False
            return RecordedStep(self.store, StepRecorder(self.runtime, self.forwards))
        if profiler_running():
            return ProfiledStep(self.store)
        return self._steady.chosen()

    def _captured_driver(self) -> CapturedStep:
        self.graphs.check_capturable(
            self.phase.value, self.phase is Phase.INFERENCE and not self._check_next, self.laid_out
        )
        streamed = [u for u in self.order if not u.resident]
        assumed, guaranteed = self.graphs.capture_plan(streamed, self.store.owner)
        return CapturedStep(self.store, streamed[-1] if streamed else None, assumed, guaranteed)

    def runs_eager(self) -> bool:
        """Whether the forward now running needs eager Python around every torch call (discovery, a
        checking forward), so must run uncompiled (see [Note: compiled hot path] in hooks/compiled_ops.py)."""
        return getattr(self.step, "eager_only", False)

    def capture_began(self) -> None:
        """The first unit op of a compiled forward found the stream capturing (reduce-overhead mode): the
        forward's driver becomes the captured one (see [Note: captured forwards])."""
        if isinstance(self.step, CapturedStep) or not self.graphs.capturing():
            return
        if self._past_end_off:  # a graph replays its copies at every forward: the layout's own
            self._past_end_off = False
            self.store.prefetch_past_end(True)
        driver = self._captured_driver()
        driver.begin()
        self.step = driver

    def end_forward(self, error: type[BaseException] | None) -> None:
        """Close the outermost forward: ``error`` is the type of what it raised, if it did."""
        # Compiled unit ops bumped the counters of the weights they order by: no edit, and a new plan
        # made while closing the forward must not take them for one (see WeightWatch).
        self.watch.refresh()
        if self._past_end_off:
            self._past_end_off = False
            self.store.prefetch_past_end(True)  # the post-hooks copied what they do: the layout's own again
        try:
            self._end_forward(error)
        finally:
            if self._rearm_watch:
                self._rearm_watch = False
                self.watch.arm(self.units.values(), accept=True)  # the forward's own counter bumps
        if error is None and self.after_step is not None and not self.graphs.capturing():
            self.after_step(self)  # a pipeline lays its next component out ahead (pipelines/pipeline.py)

    def keep_parameter_resident(self, param_id: int, reason: str) -> None:
        """Stop streaming one parameter, for good (see StreamedWeights.keep_resident)."""
        self.weights.keep_resident(param_id, reason)

    def _weight_left_the_stream(self) -> None:
        if self.bracket.running:
            self._rearm_watch = True  # once, at the forward's end: arming walks every weight
        else:
            self.watch.arm(self.units.values())

    def keep_alias_weights_resident(self, why: str) -> None:
        """Keep every weight a tied alias holds on the device (plan time), for a caller that reads such
        weights outside the model's forward without calling the alias (see [Note: tied aliases] in
        phases/discovery.py): vLLM's ``compute_logits`` reads a tied output head's weight that way."""
        for unit in list(self.units.values()):
            for path, alias in unit.aliases:
                for param in alias._parameters.values():
                    if param is not None and id(param) in self.owner_of:
                        self.weights.keep_resident(id(param), f"tied to {path!r}, {why}")
        self.drop_empty_units()
        self.hooks.hook_units(self.hooks.hooked_units)  # the aliases lose their hooks

    def drop_empty_units(self) -> None:
        """Forget units left with nothing to stream: no hooks, no pack, no place in the order."""
        empty = [u for u in self.units.values() if not u.parameters]
        if not empty:
            return
        owner = self.store.owner
        for unit in empty:
            del self.units[unit.name]
            if unit.pack is not None:
                unit.pack.free()
                unit.pack = None
            # Its arena range too: the hooks keep the unit (its marks) until release, and a view would
            # keep the whole arena alive after the next layout replaced it.
            for cell in unit.cells:
                if cell < len(owner) and owner[cell] is unit:
                    owner[cell] = None
            unit.storage, unit.cells, unit.prefetch_next = None, (), ()
            self.store.past_end = []  # its entries may name it; the next layout makes them again
            unit.placement = Placement.HOST
            logger.info("unit %s streams nothing now; it is no longer an offload unit", unit.name)
        self.store.units = list(self.units.values())
        self.hooks.hook_units(u for u in self.hooks.hooked_units if u.name in self.units)
        self.order = [u for u in self.order if u.name in self.units]

    # -- what the hooks ask -------------------------------------------------------------------------------

    def accept_weight_versions(self) -> None:
        """Take the streamed weights' version counters as they are now as unedited."""
        self.watch.arm(self.units.values(), accept=True)

    def after_edit(self, added: dict[str, str]) -> None:
        """flextensor.editing() wrote the edited weights back to the packs: every arena range must reload,
        parameters added inside units stay resident, the unit hooks see the modules as they are now."""
        for fqn, reason in added.items():
            self.resident_reasons[fqn] = reason
            logger.info("keeping %s resident: %s", fqn, reason)
        self.store.forget_contents()
        self.hooks.hook_units(self.hooks.hooked_units)  # re-mark: parameter names may have changed
        self.watch.arm(self.units.values(), accept=True)

    def vacate(self, keep_resident: bool = False) -> int:
        """Give back the device bytes held for units while another component of a pipeline runs (with
        ``keep_resident``, those of the streamed units only: flextensor.editing's room); the next forward
        lays its plan out again (re-uploading resident units given back). Returns the bytes freed: 0
        while a forward runs, when nothing is laid out, or once a CUDA graph holds the layout's addresses."""
        if not self.laid_out or not self.can_vacate():
            return 0
        held = self.store.device_bytes_held()
        self.store.vacate(keep_resident)
        self.laid_out = False
        self._laid_out_on = None
        self.watch.arm(self.units.values())
        if not keep_resident and self.phase is Phase.INFERENCE:
            # Resident units lost their storage and carry no hooks in steady state: hooked until the
            # next layout, one called directly (get_input_embeddings()(ids)) lays the plan out first.
            self.hooks.hook_units(self.units.values())
        return held - self.store.device_bytes_held()

    def planned_peak_bytes(self) -> int | None:
        """The peak the plan in force predicts for a step, None while the model is still learning."""
        if self.phase is Phase.INFERENCE and self.current is not None:
            return self.current.plan.predicted_peak_bytes
        return None

    # -- release ------------------------------------------------------------------------------------------

    def release(self, device: torch.device | None) -> None:
        """Remove every hook and give each parameter storage of its own on ``device`` (default: the offload
        device), built before anything changes: a failure (out of memory) leaves the model offloaded and
        working. A second call finishes a first that failed or was stopped (Ctrl-C) at any point."""
        self.graphs.warn_on_release()
        if not self.weights.handed_back:  # once swapped, the packs may be freed: never built from again
            self.weights.swap_in(self.weights.build_released(device))
        self.unguard_parameters()
        self.hooks.detach()
        self.store.free_everything()

    def unguard_parameters(self) -> None:
        """Give every guarded parameter its own class back (release, or a failed offload)."""
        self.weights.unguard()
        for param in self._guarded_outside:
            unguard_parameter(param)
        self._guarded_outside = []

    # -- introspection ------------------------------------------------------------------------------------

    def status(self) -> OffloadStatus:
        return status_of(self)

    def __repr__(self) -> str:
        streamed = sum(1 for u in self.units.values() if u.placement is Placement.STREAMED)
        return (
            f"OffloadEngine({type(self.model).__name__}, phase={self.phase.value}, units={len(self.units)}, "
            f"streamed={streamed}, device={self.runtime.device})"
        )


def _call_if_alive(method: weakref.WeakMethod) -> None:
    if (bound := method()) is not None:
        bound()
