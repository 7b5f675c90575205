"""An offloaded model's phases, what the learning forwards have taught so far, and when it is enough.

Discovery forwards each give an execution order and the units that must stay resident; their union over
``discovery_forwards`` forwards is what profiling lays out. Profiling forwards each give a timed sample;
after ``profiling_forwards`` of them the engine plans, unless the samples disagree (a noisy forward: up to
``EXTRA_FORWARDS`` more) or the compiler ran during one (its times and memory are the compiler's: left
out, up to ``EXTRA_FORWARDS`` times). The discovery forward's times count towards the plan too, keyed by
the inputs it ran with. The engine (engine/controller.py) decides what each outcome changes; this module only
keeps the counts and the samples.
"""

from __future__ import annotations

import enum
import logging

from flextensor.phases.discovery import DiscoveryResult
from flextensor.phases.profiling import EXTRA_FORWARDS, StepSample, combine_samples, samples_disagree
from flextensor.plan.measurements import LinkModel, Measurements

logger = logging.getLogger("flextensor")

__all__ = ["Learning", "Phase"]


class Phase(enum.Enum):
    """Where an offloaded model is in its life, and what each phase costs.

    DISCOVERY: units load on demand, one at a time, while the engine learns their execution order and
        which weights must never stream. Device memory: resident weights plus an arena of the two
        largest units.
    PROFILING: the same memory; each unit's copy and compute are timed with device events and the
        activation peak is measured. Ends with the plan. New input shapes in steady state are profiled
        again, with the units resident until then kept resident as far as memory allows.
    INFERENCE: the plan is applied: some units resident, the rest streamed through an arena of
        ``plan.arena_bytes`` with prefetch. Memory: as planned (at most the budget).
    """

    DISCOVERY = "discovery"
    PROFILING = "profiling"
    INFERENCE = "inference"


class Learning:
    """The discovery results and profiling samples of one model's learning phases."""

    def __init__(self, discovery_forwards: int, profiling_forwards: int) -> None:
        self._discovery_forwards = discovery_forwards
        self._profiling_forwards = profiling_forwards
        self._discovered = DiscoveryResult()
        self._timing: dict[tuple[str, ...], StepSample] = {}  # discovery forwards' times, by inputs
        self._samples: list[StepSample] = []
        self._forwards = 0  # in the phase now learning
        self._extra_forwards = 0
        self._compile_discards = 0

    def discovered(
        self, result: DiscoveryResult, sample: StepSample, signature: tuple[str, ...]
    ) -> DiscoveryResult | None:
        """Add one discovery forward; the union of all of them once there were enough, else None."""
        known = set(self._discovered.order)
        self._discovered.order += [u for u in result.order if u not in known]
        for unit, reason in result.must_stay_resident.items():
            self._discovered.must_stay_resident.setdefault(unit, reason)
        self._timing[signature] = sample
        self._forwards += 1
        if self._forwards < self._discovery_forwards:
            return None
        self._forwards = 0
        discovered, self._discovered = self._discovered, DiscoveryResult()
        return discovered

    def discovered_so_far(self) -> DiscoveryResult | None:
        """End discovery early: the union of the discovery forwards run so far (None if none ran)."""
        if self._forwards == 0:
            return None
        self._forwards = 0
        discovered, self._discovered = self._discovered, DiscoveryResult()
        return discovered

    def sample_discovery_times(self, signature: tuple[str, ...] | None) -> bool:
        """With no profiled forward to plan from, take a discovery forward's times (those of ``signature``,
        else the latest) as the one sample; whether there was any."""
        if self._samples:
            return True
        timing = self._timing.get(signature) if signature is not None else None
        if timing is None and self._timing:
            timing = list(self._timing.values())[-1]
        if timing is not None:
            self._samples.append(timing)
        return bool(self._samples)

    def compiler_ran(self) -> bool:
        """A profiling forward during which the compiler ran: whether to leave it out (and profile one
        more) rather than count it."""
        if self._compile_discards >= EXTRA_FORWARDS:
            return False
        self._compile_discards += 1
        logger.info("torch.compile compiled during a profiling forward; profiling one more")
        return True

    def profiled(self, sample: StepSample, signature: tuple[str, ...]) -> bool:
        """Add one profiling forward; whether the samples are now enough to plan from."""
        self._samples.append(sample)
        self._forwards += 1
        if self._forwards < self._profiling_forwards:
            return False
        noisy = samples_disagree(self._samples, self._timing.get(signature))
        if noisy and self._extra_forwards < EXTRA_FORWARDS:
            self._extra_forwards += 1
            logger.info("profiled step times disagree by more than 2x; profiling one more forward")
            return False
        return True

    def has_samples(self) -> bool:
        return bool(self._samples)

    def measurements(
        self, link: LinkModel, device_bytes_held: int, signature: tuple[str, ...]
    ) -> Measurements:
        """The planner's measurements from the forwards profiled so far; profiling starts over after."""
        timing = self._timing.get(signature)
        timing_only = (timing,) if timing is not None else ()
        measurements = combine_samples(self._samples, link, device_bytes_held, signature, timing_only)
        self.restart_profiling()
        return measurements

    def restart_profiling(self) -> None:
        """Forget the samples of a profiling cut short (a failed layout, a forward out of memory)."""
        self._samples, self._forwards, self._extra_forwards, self._compile_discards = [], 0, 0, 0
