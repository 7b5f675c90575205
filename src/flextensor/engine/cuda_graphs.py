"""CUDA graphs of an offloaded model: when a forward may be captured, and what a capture changes after it.

[Note: captured forwards]
A captured graph holds the addresses of the arena, of each resident unit's storage and of the host
packs, and the order of the copies between them. So:

* Only a steady-state forward is captured (steady.CapturedStep): discovery and profiling run Python
  around every unit and synchronise the device, which a capture forbids. Capturing one of them raises.
* Once a forward of the model has been captured, its layout is kept for good: inputs of other shapes run
  with the plan in place (with a warning, once per input signature) rather than lay out another plan,
  which would free memory the graph still copies into. The plan for other shapes can be made by running
  them before the first capture.
* A graph's copies follow the ring like an eager forward's, except at its start: a replay cannot ask
  what the arena holds. The first capture fixes the *guaranteed* units: those in the arena at that
  moment that a steady forward also leaves there (its tail prefetches them for the next forward). Every
  graph skips the copies of those it finds in place at its capture, loads any it evicted before it
  ends, and so does every eager forward after a capture: whatever ran before a replay, eager or
  another graph, left them in the arena.
* Eager forwards after a capture are fenced against replays: their copies wait for the compute queued
  before them (a replay still reading a range), and the next work on the compute stream waits for their
  copies (a replay reading what they load). Two event operations per forward, none before any capture.
* A serving engine (vLLM) keeps one layout for every input from its first plan on (``pin_layout``; its
  plans are made for every input, see PlanPolicy.plan_for_every_input), and captures by itself: before
  its first capture the engine ends its learning with a plan (Engine.prepare_for_captures).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from flextensor.device.runtime import DeviceRuntime
from flextensor.errors import UnsupportedOperationError
from flextensor.store.copies import holds_weights
from flextensor.store.device_store import DeviceStore
from flextensor.store.units import Unit

logger = logging.getLogger("flextensor")

__all__ = ["GraphCaptures", "steady_end_state"]


def steady_end_state(streamed: list[Unit], owner: list[Unit | None]) -> list[Unit | None]:
    """The arena's occupancy after steady forwards from ``owner``: each unit in ``streamed`` (execution
    order) loaded when it runs without its weights, then the units its post-hook prefetches. Two
    passes: the first leaves the state every later one starts from."""
    state = list(owner)
    for _ in range(2):
        for unit in streamed:
            for needed in (unit, *unit.prefetch_next):
                if not holds_weights(needed, state):
                    for cell in needed.cells:
                        state[cell] = needed
    return state


class GraphCaptures:
    """One offloaded model's record of captures (see [Note: captured forwards])."""

    def __init__(self, runtime: DeviceRuntime, model_name: str) -> None:
        self.runtime = runtime
        self.model_name = model_name
        self.captured = False  # some forward was captured: the layout is kept, eager forwards are fenced
        self.pinned = False  # captures were announced (pin_layout): the layout is kept, as once captured
        self.guaranteed: set[Unit] | None = None  # fixed by the first capture (see the note)
        self._retired: list[Any] = []  # events recorded inside captures, kept alive with the graphs
        self._warned: set[tuple[str, ...]] = set()

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        return self.runtime.is_cuda and torch.cuda.is_current_stream_capturing()

    def check_capturable(self, phase: str, steady: bool, planned: bool) -> None:
        """Raise unless the forward about to be captured runs the steady hot path of a laid-out plan."""
        if not steady:
            raise UnsupportedOperationError(
                f"a CUDA graph is capturing the offloaded {self.model_name} in its {phase} phase; its "
                "first forwards learn the model and need Python and device synchronisation around every "
                "unit, which a capture forbids. Run it without CUDA graphs until "
                "flextensor.phase(model) == 'inference' (torch.compile's reduce-overhead mode captures "
                "from its second compiled call: run the model eagerly a few times first)"
            )
        if not planned:
            raise UnsupportedOperationError(
                f"a CUDA graph is capturing the offloaded {self.model_name} with inputs it has no plan "
                "for; run these inputs once without CUDA graphs first, so that their plan is laid out "
                "before the capture"
            )

    def capture_plan(self, streamed: list[Unit], owner: list[Unit | None]) -> tuple[set[Unit], set[Unit]]:
        """(units a graph captured now may skip copying at its start, units it must leave loaded)."""
        staged = [u.name for u in streamed if u.staging is not None]
        if staged:
            # A graph replays the ring's device copies but not the host's writes into the ring.
            raise UnsupportedOperationError(
                f"a CUDA graph cannot capture the staged copies of {', '.join(staged[:3])}"
                f"{', ...' if len(staged) > 3 else ''} (their packs are pageable under the host memory "
                "budget): raise host_memory_budget until every streamed unit is pinned, or compile "
                "without mode='reduce-overhead'"
            )
        held = {u for u in streamed if holds_weights(u, owner)}
        if self.guaranteed is None:
            end = steady_end_state(streamed, owner)
            self.guaranteed = {u for u in held if holds_weights(u, end)}
        return held & self.guaranteed, self.guaranteed

    def after_capture(self, store: DeviceStore, assumed: set[Unit]) -> None:
        """The capture ran nothing: the arena holds what it held before it, or, once replayed, what the
        graph leaves. Only ``assumed`` is in both."""
        self.captured = True
        owner = store.owner
        for cell, occupant in enumerate(owner):
            if occupant is not None and occupant not in assumed:
                owner[cell] = None
        # Events recorded in a capture were never recorded on the device: eager forwards get fresh ones
        # (never recorded, so waiting on one waits for nothing; the fences order them against replays).
        for unit in store.units:
            self._retired += (unit.copy_done, unit.compute_done)
            unit.copy_done, unit.compute_done = self.runtime.event(), self.runtime.event()
        if store.coded_loads is not None:
            store.coded_loads.end_capture()

    def restore(self, store: DeviceStore) -> None:
        """End of an eager forward after a capture: load any guaranteed unit it left out, on the copy
        stream after the forward's compute, so that a replay can follow."""
        if not self.guaranteed:
            return
        compute = self.runtime.current_stream()
        for unit in self.guaranteed:
            if not holds_weights(unit, store.owner):
                store.load_on_demand(unit, compute)

    def warn_on_release(self) -> None:
        """A graph replayed after release() would copy into freed memory, and nothing can stop it."""
        if self.captured:
            logger.warning(
                "releasing %s, of which a CUDA graph was captured: that graph copies into memory freed now "
                "and must not be replayed (drop it; torch._dynamo.reset() drops reduce-overhead graphs)",
                self.model_name,
            )

    @property
    def layout_kept(self) -> bool:
        """Whether the layout in place is kept for every input from now on."""
        return self.captured or self.pinned

    def pin_layout(self) -> None:
        """Keep the layout in place, once there is one, for every input (see [Note: captured forwards]).
        Inputs without a plan of their own then run with it by design: logged, not warned."""
        self.pinned = True

    def keep_layout(self, signature: tuple[str, ...], current: tuple[str, ...] | None) -> bool:
        """Whether a forward with ``signature`` must keep the layout made for ``current``: after a
        capture, another layout would free memory the graph copies into."""
        if not self.layout_kept or current is None or signature == current:
            return False
        if signature not in self._warned:
            self._warned.add(signature)
            if self.pinned:
                logger.info(
                    "inputs %s run with the plan made for %s: %s keeps one layout for every input",
                    ", ".join(signature),
                    ", ".join(current),
                    self.model_name,
                )
            else:
                logger.warning(
                    "inputs %s run with the plan made for %s: a CUDA graph of %s was captured with that "
                    "layout, which is kept so that its replays stay valid (plan other shapes before the "
                    "first capture by running them once without CUDA graphs)",
                    ", ".join(signature),
                    ", ".join(current),
                    self.model_name,
                )
        return True

    def fence_begin(self) -> None:
        """Eager forward after a capture: its copies come after the compute already queued (a replay)."""
        if self.captured:
            self.runtime.copy_stream.wait_stream(self.runtime.current_stream())

    def fence_end(self, store: DeviceStore) -> None:
        """Eager forward after a capture: later work on the compute stream comes after its copies (and
        the decodes of its coded loads)."""
        if self.captured:
            compute = self.runtime.current_stream()
            compute.wait_stream(self.runtime.copy_stream)
            if store.coded_loads is not None:
                store.coded_loads.fence(compute)

    def __repr__(self) -> str:
        state: Any = "captured" if self.captured else "never captured"
        return f"GraphCaptures({self.model_name}, {state})"
