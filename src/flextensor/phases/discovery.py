"""Discovery: the first forward(s) learn the execution order and what must never stream.

The driver (:class:`DiscoveryStep`) loads each unit on demand before it runs and records:

* the order in which units first run;
* units that must stay resident, and why: one running inside another unit's forward (a prefetch issued
  after it would overwrite ranges the outer unit still reads), one whose output views its own weights
  (later copies would overwrite that output), one that writes its own weights (a counter or running
  statistic held as a parameter: the next reload would lose the update);
* weights read outside their unit's forward, through :class:`OutsideReadTracker`: a TorchFunctionMode that
  sees every torch call, so the engine makes such a parameter resident before the call reads it.

It returns a :class:`DiscoveryResult`; the engine decides what to do with it. Costs nothing after
discovery.

[Note: tied aliases]
A weight tied between a unit and a module outside every unit (UMT5's token embedding: the unit
``encoder.embed_tokens`` runs, the top-level ``shared`` holds the same parameter and never runs) streams
with the unit when that other holder has no unit inside it (weights/selection.py). The holder is the unit's
*alias*: it carries the unit's hooks, so a call of it at any time (``get_input_embeddings()(ids)``, a
code path first taken later) loads the unit's weights as a call of the unit does, and its reads are
inside the unit for the outside-read tracker. An alias that runs during discovery, or in the first
forward from a profile, makes its unit resident for good (:meth:`BehaviourChecks.alias_called`): the
unit would run twice a forward, once where the learned order does not expect it, and reload there every
time. A weight read through the alias without calling it (``F.embedding(ids, model.shared.weight)``) is
a read outside its unit like any other (see docs/patterns.md, *Weights read outside their unit*).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from flextensor.phases.steady import RecordedStep
from flextensor.phases.timeline import StepRecorder
from flextensor.store.copies import holds_weights
from flextensor.store.device_store import DeviceStore
from flextensor.store.units import Unit

__all__ = [
    "BehaviourChecks",
    "CheckedStep",
    "DiscoveryResult",
    "DiscoveryStep",
    "OutsideReadTracker",
    "clone_tensors",
    "views_storage",
]

MAX_NESTING = 8
"""Depth to which a unit's output (tuples, lists, dicts of tensors) is searched for views of its weights:
deeper structures are not outputs of real modules, and a bound keeps a cyclic structure from hanging us."""


def _tensors_in(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


class OutsideReadTracker(TorchFunctionMode):
    """Calls ``on_outside_read(param_id, func)`` for a streamed parameter read while its unit is idle."""

    def __init__(
        self,
        owner_of: dict[int, Unit],
        active_units: set[Unit],
        on_outside_read: Callable[[int, Any], None],
    ) -> None:
        super().__init__()
        self._owner_of = owner_of
        self._active = active_units
        self._on_outside_read = on_outside_read

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for tensor in _tensors_in((*args, *kwargs.values())):
            owner = self._owner_of.get(id(tensor))
            if owner is not None and owner not in self._active:
                self._on_outside_read(id(tensor), func)
        return func(*args, **kwargs)


def views_storage(output: Any, storage: torch.Tensor, depth: int = 0) -> bool:
    """Whether ``output`` (a tensor, or tuples/lists/dicts of them, nested) views the bytes of
    ``storage`` (by address: each parameter has a storage object of its own over the arena's bytes)."""
    if depth > MAX_NESTING:
        return False
    if isinstance(output, torch.Tensor):
        if output.device != storage.device:
            return False
        try:
            pointer = output.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return False  # tensors without a plain storage cannot view the arena
        start = storage.data_ptr()
        return start <= pointer < start + storage.nbytes
    if isinstance(output, dict):  # transformers' ModelOutput is a dict too
        values: Iterable[Any] = output.values()
    elif isinstance(output, (tuple, list)):
        values = output
    else:
        return False
    return any(views_storage(value, storage, depth + 1) for value in values)


def clone_tensors(output: Any, depth: int = 0) -> Any:
    """``output`` with every tensor in it cloned, nested tuples, lists and dicts rebuilt around them."""
    if depth > MAX_NESTING:
        return output
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, dict):
        copy = output.copy()  # keeps the class of a ModelOutput
        for key, value in output.items():
            copy[key] = clone_tensors(value, depth + 1)
        return copy
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
        return type(output)(*(clone_tensors(v, depth + 1) for v in output))
    if isinstance(output, (tuple, list)):
        return type(output)(clone_tensors(v, depth + 1) for v in output)
    return output


@dataclass
class DiscoveryResult:
    """What one discovery forward learned: ``order`` of first runs, and units that must stay resident."""

    order: list[Unit] = field(default_factory=list)
    must_stay_resident: dict[Unit, str] = field(default_factory=dict)


KeepResident = Callable[[Unit, str, bool], None]
"""``keep(unit, reason, current_values)``: make every weight of ``unit`` resident now, copied from the
weights it computes with (``current_values``: its arena range, which it occupies) or from its pack."""


class BehaviourChecks:
    """What discovery watches for in each unit's forward (see the module docstring).

    A unit found running inside another is made resident before it loads (loading it could overwrite
    the outer unit's range mid-forward); one that writes its weights or returns views of them is made
    resident from the weights it just used, so the forward's result and any update survive.
    """

    def __init__(
        self,
        store: DeviceStore,
        owner_of: dict[int, Unit],
        on_outside_read: Callable[[int, Any], None],
        keep_resident: KeepResident,
    ) -> None:
        self.store = store
        self.result = DiscoveryResult()
        self.active: set[Unit] = set()
        self._seen: set[Unit] = set()
        self._versions: dict[Unit, tuple[int, ...]] = {}
        self._keep = keep_resident
        self._tracker = OutsideReadTracker(owner_of, self.active, on_outside_read)

    def begin(self) -> None:
        self._tracker.__enter__()

    def end(self) -> None:
        self._tracker.__exit__(None, None, None)
        self.active.clear()

    def _stay(self, unit: Unit, reason: str, current_values: bool) -> None:
        if unit not in self.result.must_stay_resident:
            self.result.must_stay_resident[unit] = reason
            self._keep(unit, reason, current_values)

    def enter(self, unit: Unit) -> None:
        """A unit's pre-hook, before it loads."""
        if unit not in self._seen:
            self._seen.add(unit)
            self.result.order.append(unit)
        outer = next((u for u in self.active if u is not unit), None)
        if outer is not None:
            self._stay(unit, f"it runs inside unit {outer.name!r}", current_values=False)
        self.active.add(unit)

    def loaded(self, unit: Unit) -> None:
        """A unit's pre-hook, once its weights are in place: note their versions."""
        self._versions[unit] = tuple(param._version for _, param, _ in unit.parameters)

    def leave(self, unit: Unit, output: Any) -> Any:
        """A unit's post-hook, before its compute is marked done: the output to hand on, if replaced."""
        replaced = None
        before = self._versions.pop(unit, None)
        # Each parameter has a version counter of its own; copies into the arena do not touch it.
        if before is not None and before != tuple(param._version for _, param, _ in unit.parameters):
            self._stay(unit, "its forward writes its own weights", current_values=True)
        arena = self.store.arena
        if arena is not None and views_storage(output, arena):
            self._stay(unit, "its output is a view of its weights", current_values=True)
            # Later copies would overwrite what this output views: hand the caller a copy, taken
            # before compute_done is recorded so that those copies wait for it.
            replaced = clone_tensors(output)
        elif unit.resident and unit.storage is not None and views_storage(output, unit.storage):
            # Resident in a profile's plan (its first forward checks every unit): fine now, its storage
            # is its own, but a later plan streaming it would not be.
            self._stay(unit, "its output is a view of its weights", current_values=True)
        self.active.discard(unit)
        return replaced

    def alias_called(self, unit: Unit, alias: str) -> None:
        """A module holding some of ``unit``'s weights (tied) runs: the unit stays resident (see [Note:
        tied aliases])."""
        self._stay(unit, f"its weights are tied to {alias!r}, which runs too", current_values=False)

    def inside_another(self) -> bool:
        """Whether a unit is running inside another one right now."""
        return len(self.active) > 1


class DiscoveryStep:
    """The unit hooks' driver during a discovery forward: every unit loads on demand, nothing prefetches."""

    eager_only = True  # the outside-read tracker sees torch calls only outside compiled graphs

    def __init__(self, store: DeviceStore, checks: BehaviourChecks, recorder: StepRecorder) -> None:
        self.store = store
        self.checks = checks
        self.recorder = recorder  # times the forward too: one more sample for the planner's measurements
        self._compute: Any = None

    def begin(self) -> None:
        self._compute = self.store.runtime.current_stream()
        self.recorder.begin()
        self.checks.begin()

    def end(self, error: type[BaseException] | None) -> DiscoveryResult | None:
        """Close the forward; its result, or None when it raised (a partial order would mis-plan)."""
        self.checks.end()
        if error is not None:
            return None
        self.recorder.finish()
        return self.checks.result

    def alias_called(self, unit: Unit, alias: str) -> None:
        self.checks.alias_called(unit, alias)

    def pre(self, unit: Unit) -> None:
        self.checks.enter(unit)
        self.recorder.wait_start(unit.name, unit.resident, unit.nbytes)
        self._compute = self.store.runtime.current_stream()  # as in SteadyStep.pre
        if not unit.resident and unit.parameters:
            if not holds_weights(unit, self.store.owner):
                self.store.load_on_demand(unit, self._compute)
            self._compute.wait_event(unit.copy_done)
        self.checks.loaded(unit)
        self.recorder.compute_start(unit.name)

    def post(self, unit: Unit, output: Any) -> Any:
        self.recorder.compute_end(unit.name)
        replaced = self.checks.leave(unit, output)
        if not unit.resident:
            unit.compute_done.record(self._compute)
        return replaced

    def nested_pre(self, unit: Unit, running: list[Unit], in_graph: bool) -> None:
        self.pre(unit)  # the checks find the nesting and keep the unit resident before it loads

    def nested_post(self, unit: Unit, output: Any, caller: Unit) -> Any:
        return self.post(unit, output)


class CheckedStep(RecordedStep):
    """The first forward from a saved profile: a recorded steady step that also runs discovery's checks,
    so a model whose code changed since the profile was made still computes right outputs (and is then
    profiled again). A unit running inside another issues no prefetch: it could overwrite the outer's
    range."""

    __slots__ = ("checks",)
    eager_only = True  # as DiscoveryStep

    def __init__(self, store: DeviceStore, recorder: StepRecorder, checks: BehaviourChecks) -> None:
        super().__init__(store, recorder)
        self.checks = checks

    def begin(self) -> None:
        super().begin()
        self.checks.begin()

    def end(self, error: type[BaseException] | None) -> DiscoveryResult | None:
        self.checks.end()
        return None if error is not None else self.checks.result

    def alias_called(self, unit: Unit, alias: str) -> None:
        self.checks.alias_called(unit, alias)

    def pre(self, unit: Unit) -> None:
        self.checks.enter(unit)
        if unit.parameters:
            super().pre(unit)
        self.checks.loaded(unit)

    def post(self, unit: Unit, output: Any) -> Any:
        nested = self.checks.inside_another()
        replaced = self.checks.leave(unit, output)
        if nested or not unit.parameters:
            self.recorder.compute_end(unit.name)
            if not unit.resident:
                unit.compute_done.record(self.compute)
        else:
            super().post(unit, output)
        return replaced

    def nested_pre(self, unit: Unit, running: list[Unit], in_graph: bool) -> None:
        self.pre(unit)  # as DiscoveryStep's: the checks see the nesting

    def nested_post(self, unit: Unit, output: Any, caller: Unit) -> Any:
        return self.post(unit, output)
