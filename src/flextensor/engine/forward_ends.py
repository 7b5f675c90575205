"""What the end of each forward teaches an offloaded model.

Part of the engine (a mixin of :class:`~flextensor.engine.controller.OffloadEngine`, split out so that each
reads in one sitting). At the end of the outermost forward the driver that ran it (phases/discovery.py,
phases/profiling.py, phases/steady.py) is closed and what it learned goes to the next phase: the execution
order after discovery, a profiled sample to the planner (engine/plan_states.py), the check of a saved
profile's first forward, a step recorded for ``report()`` and ``trace()``. A forward that raised teaches
nothing but what its error says (a profiling forward out of memory profiles again streaming every unit).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from flextensor.engine.plan_states import PlanStates
from flextensor.phases.discovery import CheckedStep, DiscoveryResult, DiscoveryStep
from flextensor.phases.learning import Phase
from flextensor.phases.profiling import ProfilingStep, sample_from_timeline
from flextensor.phases.steady import CapturedStep, RecordedStep

if TYPE_CHECKING:
    from flextensor.device.runtime import DeviceRuntime
    from flextensor.phases.autocast_cache import AutocastCachePause
    from flextensor.phases.timeline import StepRecorder
    from flextensor.weights.autograd_guard import StreamedWeightGuard

logger = logging.getLogger("flextensor")

__all__ = ["ForwardEnds"]


class ForwardEnds(PlanStates):
    """Closes each outermost forward's driver and hands on what it learned (see the module docstring)."""

    step: Any
    _outside: Any
    forwards: int
    runtime: DeviceRuntime
    _record_next: bool
    _grad_guard: StreamedWeightGuard
    _autocast_cache: AutocastCachePause

    if TYPE_CHECKING:  # the engine's own

        def end_forward(self, error: type[BaseException] | None) -> None: ...
        def drop_empty_units(self) -> None: ...

    def _end_forward(self, error: type[BaseException] | None) -> None:
        driver, self.step = self.step, self._outside
        self._grad_guard.exit()
        self._autocast_cache.exit()
        self.bracket.reset()
        self.forwards += 1
        if isinstance(driver, CapturedStep):
            if self.graphs.capturing():
                driver.join()
            self.graphs.after_capture(self.store, driver.assumed)
            self._learn_nested_calls(self.store.nested.forget())  # the layout is kept: a warning
            return
        if self.graphs.captured:
            self.graphs.restore(self.store)
            self.graphs.fence_end(self.store)
        nested = self.store.nested.forget()  # discovery and the check keep such units resident themselves
        checked = isinstance(driver, (DiscoveryStep, CheckedStep))
        if nested and not checked and self._learn_nested_calls(nested):
            return
        if isinstance(driver, DiscoveryStep):
            result = driver.end(error)
            if result is not None:  # a partial order would make a wrong plan: learn again next forward
                assert self.signature is not None
                sample = sample_from_timeline(driver.recorder.timeline())
                discovered = self.learning.discovered(result, sample, self.signature)
                if discovered is not None:
                    self._finish_discovery(discovered)
        elif isinstance(driver, CheckedStep):
            result = driver.end(error)
            if result is None:
                self._record_next = True
                return
            self._check_next = False
            driver.recorder.finish()
            self._keep_recording(driver.recorder)
            self._after_check(result)
            if self.phase is Phase.INFERENCE:
                self._enter(Phase.INFERENCE)  # resident units lose the check's hooks
        elif isinstance(driver, ProfilingStep):
            if error is None:
                # Only a whole forward is read: one interrupted between creating a unit's end event and
                # recording it (Ctrl-C) has an event that never happened (tests/test_safety.py).
                sample = driver.end()
                assert self.signature is not None
                if driver.compiled_during() and self.learning.compiler_ran():
                    pass  # its times and memory are the compiler's: profile one more forward
                elif self.learning.profiled(sample, self.signature):
                    self._plan_from_samples()
            elif issubclass(error, torch.OutOfMemoryError) and any(u.resident for u in self.units.values()):
                # Units kept resident to profile a new shape left too little room for its activations.
                self._profile_again_streaming_everything("a profiling forward ran out of device memory")
        elif isinstance(driver, RecordedStep):
            if error is None:
                driver.recorder.finish()
                self._keep_recording(driver.recorder)
            else:
                self._record_next = True  # a partial step says nothing: record the next one

    def close_interrupted_forward(self) -> None:
        """A forward left without its end: stopped by an exception PyTorch does not hand to always_call
        hooks (KeyboardInterrupt, SystemExit). Close it as failed, so this forward starts clean."""
        logger.warning("the previous forward was interrupted; closing it before this one runs")
        self.runtime.synchronize()  # its kernels and copies may still be queued behind stale events
        self._autocast_cache.forget()
        self.end_forward(KeyboardInterrupt)

    def record_next_step(self) -> None:
        self._record_next = True

    def _keep_recording(self, recorder: StepRecorder) -> None:
        self.latest_recording = recorder
        if self.signature is not None:
            self.recordings[self.signature] = recorder

    @property
    def last_recording(self) -> StepRecorder | None:
        """The recorded step of the plan in place; before that plan's first step (the forward that made
        it was a profiling one), the latest step recorded under any plan, which ``report()`` uses only if
        its units sit where they sit now."""
        if self.signature is not None and self.signature in self.recordings:
            return self.recordings[self.signature]
        return self.latest_recording

    def _finish_discovery(self, discovered: DiscoveryResult) -> None:
        """Forget emptied units and lay out every unit for profiling."""
        # Units that must stay resident were made so when found (see discovery.BehaviourChecks).
        self.runtime.synchronize()  # the packs of dropped units may still be read by copies in flight
        self.drop_empty_units()
        ran = set(discovered.order)
        idle = [u for u in self.units.values() if u not in ran]
        if idle:
            logger.info(
                "%d unit(s) never ran in discovery; they load on demand: %s",
                len(idle),
                ", ".join(u.name for u in idle[:5]),
            )
        self.order = [u for u in discovered.order if u.name in self.units]
        self._lay_out_to_profile()
