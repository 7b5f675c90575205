"""The offload engine: hooks on the model, the phases, and the steady-state load/prefetch driver.

[Note: static arena aliasing]
Every streamed parameter's ``.data`` is, for good, a view into its unit's fixed range of the device arena
(see [Note: ring layout] in layout.py). Loading a unit is therefore one ``copy_`` of its packed host buffer
into that range, and the hot path touches no parameter at all: per unit it is one stream wait in the
pre-hook, one event record and at most a few copies in the post-hook. A unit's ``valid`` flag says whether
its range currently holds its weights; copying any unit in clears the flags of the units it overlaps, so
a unit run out of the learned order is simply loaded on demand and the output stays right.

Ordering uses events only: a copy waits (on the device) for the compute that last read its range; compute
waits for the copy. No ``record_stream`` is needed because the arena is never handed back to the caching
allocator while streaming: it is replaced only when a layout changes (a new plan, new input shapes), and
``apply_layout`` synchronises the device before it lets go of the old one.

[Note: one copy of a resident unit]
A unit resident in every saved plan never streams, so once a plan is in place its private host pack is
freed (unpinned and unmapped): its device storage holds the only copy of its weights, and host RAM holds
little more than what streams. A unit some saved plan streams keeps its pack, so that switching between
plans (prefill and decode) re-pins nothing. Packs in a segment shared with other processes
(``share_host_memory``) stay: those read it. Before a dropped unit's storage is ever freed (a new plan that
streams it, profiling, ``release``) its pack is built again from that storage with one device-to-host copy,
so every weight is always in a pack or in resident storage (``UnitState.kept``). Profiling a new input
shape keeps the resident units resident, as far as memory allows (see ``_profiling_residents``; a
profiling forward that runs out of memory anyway profiles again with every unit streamed).
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import OffloadConfig
from .discovery import OutsideReadTracker
from .errors import BackwardNotSupportedError, ConcurrentForwardError, FlexTensorError
from .host_store import PackedParameter, UnitPack
from .layout import UNIT_ALIGNMENT, align_up, minimal_arena_bytes, ring_layout
from .measurements import LinkModel, Measurements
from .planner import Plan, minimal_need_bytes, plan_offload
from .profiling import StepProfiler, StepSample, combine_samples
from .runtime import DeviceRuntime
from .timeline import StepRecorder

logger = logging.getLogger("flextensor")

NO_BUDGET_DEVICE_FRACTION = 0.92
"""Without a budget the plan still has to fit the device: this share of its memory, leaving room for the
caching allocator's fragmentation and other processes' contexts."""
FAILED_LAYOUT_SHRINK = 0.9
"""After a plan's layout ran out of memory, the next plan's predicted peak stays under this share of it."""


class Phase(enum.Enum):
    """Where an offloaded model is in its life, and what each phase costs.

    DISCOVERY: units load on demand, one at a time, while the engine learns their execution order and
        which weights are read outside their unit. Device memory: resident weights plus an arena of the
        two largest units.
    PROFILING: the same memory; each unit's copy and compute are timed with device events and the
        activation peak is measured. Ends with the plan. New input shapes in steady state are profiled
        again, with the units resident until then kept resident as far as memory allows.
    INFERENCE: the plan is applied: some units resident, the rest streamed through an arena of
        ``plan.arena_bytes`` with prefetch. Memory: as planned (at most the budget).
    """

    DISCOVERY = "discovery"
    PROFILING = "profiling"
    INFERENCE = "inference"


@dataclass(eq=False)
class UnitState:
    """One offload unit: its host pack, its device bytes, and the events that guard them.

    ``pack`` is None while the unit is resident in steady state and its private pack was dropped (see
    [Note: one copy of a resident unit]): its ``storage`` then holds the only copy of its weights.
    ``entries`` and ``nbytes`` are the pack's layout, kept to build the pack again.
    """

    name: str
    module: nn.Module
    pack: UnitPack | None
    parameters: list[tuple[str, nn.Parameter, PackedParameter]]
    copy_done: Any
    compute_done: Any
    resident: bool = False
    storage: torch.Tensor | None = None
    valid: bool = False
    conflicts: tuple[UnitState, ...] = ()
    prefetch_next: tuple[UnitState, ...] = ()
    entries: tuple[PackedParameter, ...] = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.pack is not None, "a unit starts with its weights packed on the host"
        self.entries, self.nbytes = self.pack.entries, self.pack.nbytes

    def kept(self, entry: PackedParameter) -> torch.Tensor:
        """One parameter's weights where they are kept for sure: the host pack, or the storage of a
        resident unit whose pack was dropped (a device tensor then). Not a streamed unit's arena range,
        which may hold another unit's bytes."""
        if self.pack is not None:
            return self.pack.view(entry)
        assert self.resident and self.storage is not None, f"unit {self.name!r} lost its weights"
        return entry.view(self.storage)

    def point_parameters(self) -> None:
        """Alias every parameter to its place in ``storage`` (plan time only)."""
        assert self.storage is not None
        for _, param, entry in self.parameters:
            param.data = entry.view(self.storage)

    def __repr__(self) -> str:
        where = "resident" if self.resident else "streamed"
        return f"UnitState({self.name!r}, {self.nbytes} bytes, {where}, valid={self.valid})"


class _StreamedWeightRef:
    """What autograd saves in place of a streamed weight: backward through it must fail loudly."""

    __slots__ = ("unit",)

    def __init__(self, unit: str) -> None:
        self.unit = unit


@dataclass
class _PlanState:
    measurements: Measurements
    plan: Plan
    samples: list[StepSample] = field(default_factory=list)


class OffloadEngine:
    """Owns one offloaded model's units, arena, phase and hooks. Built by ``flextensor.offload``."""

    def __init__(
        self,
        model: nn.Module,
        config: OffloadConfig,
        runtime: DeviceRuntime,
        units: list[UnitState],
        resident_parameters: dict[str, str],
        budget_bytes: int | None,
    ) -> None:
        self.model = model
        self.config = config
        self.runtime = runtime
        self.units = {u.name: u for u in units}
        self.resident_parameters = resident_parameters  # FQN -> reason, incl. weights found read outside
        self.budget_bytes = budget_bytes
        self._pin = config.resolved_pinned_memory(runtime.device)  # for packs built again
        self.phase = Phase.DISCOVERY
        self.order: list[str] = []  # execution order, once discovered
        self.plan: Plan | None = None
        self.measurements: Measurements | None = None
        self.link: LinkModel | None = None
        self.input_shapes: tuple[str, ...] = ()
        self.forwards = 0
        self._phase_forwards = 0
        self._plans: dict[tuple[str, ...], _PlanState] = {}
        self._samples: list[StepSample] = []
        self._arena: torch.Tensor | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._unit_handles: dict[str, list[torch.utils.hooks.RemovableHandle]] = {}
        self._owner_of: dict[int, str] = {id(p): u.name for u in units for _, p, _ in u.parameters}
        self._active: set[str] = set()
        self._must_stay_resident: dict[str, str] = {}  # unit -> why streaming it would be unsafe
        self._tracker: OutsideReadTracker | None = None
        self._profiler: StepProfiler | None = None
        self._owner_thread: int | None = None
        self._owner_lock = threading.Lock()  # makes the owner check-and-set atomic between threads
        self._depth = 0
        self._grad_guards: dict[str, Any] = {}
        self._recorder: StepRecorder | None = None  # armed for one steady step; None costs nothing
        self._record_next = False
        self.last_recording: StepRecorder | None = None
        self._layout_lost = False  # units may lack device bytes: the next forward lays them out first
        self._failed_peak_bytes: int | None = None  # predicted peak of a plan whose layout ran out of memory

    # -- layout -------------------------------------------------------------------------------------------

    def apply_layout(self, streamed: list[str], resident: Iterable[str], arena_bytes: int) -> None:
        """Give every unit its device bytes: own storage if resident, a range of the arena if streamed.

        Plan time only: synchronises the device and re-points parameters (a loop over parameters). A unit
        resident before and after keeps its storage and bytes, so switching between cached plans (prefill
        and decode) uploads only the units that enter residency.
        """
        resident = set(resident)
        both = resident.intersection(streamed)
        if both:  # a hand-edited profile could say so; the planner never does
            raise ValueError(f"units both resident and streamed in one layout: {sorted(both)}")
        rt = self.runtime
        rt.synchronize()
        for unit in self.units.values():
            if unit.pack is None and unit.name not in resident:
                self._rebuild_pack(unit)  # before _free_device_bytes frees its only copy
        kept = self._free_device_bytes(resident)

        idle = [u for u in self.units if u not in resident and u not in streamed]
        sizes = {u.name: u.nbytes for u in self.units.values()}
        idle_need = minimal_arena_bytes([sizes[u] for u in idle])
        if idle_need > arena_bytes and streamed:
            logger.warning(
                "units that never ran (%s) need a %d-byte arena, more than the %d bytes planned: the "
                "arena grows to hold them, beyond what the plan (and any budget) accounted for; exclude "
                "modules the model does not run",
                ", ".join(idle[:3]),
                idle_need,
                arena_bytes,
            )
        arena_bytes = max(arena_bytes, idle_need)
        arena_bytes = max(arena_bytes, minimal_arena_bytes([sizes[u] for u in streamed]))
        layout = ring_layout(streamed, [sizes[u] for u in streamed], arena_bytes)
        self._arena = torch.empty(arena_bytes, dtype=torch.uint8, device=rt.device) if arena_bytes else None

        ranges: dict[str, tuple[int, int]] = {}
        for name, offset in zip(layout.order, layout.offsets, strict=True):
            ranges[name] = (offset, align_up(sizes[name], UNIT_ALIGNMENT))
        for name in idle:
            # Units never seen running: loaded on demand at the arena's start if they ever run.
            ranges[name] = (0, align_up(sizes[name], UNIT_ALIGNMENT))

        for name in resident - kept:
            self._upload_resident(self.units[name])
        for name, (offset, length) in ranges.items():
            unit = self.units[name]
            assert self._arena is not None
            unit.storage = self._arena[offset : offset + unit.nbytes]
            unit.conflicts = tuple(
                self.units[other]
                for other, (o, n) in ranges.items()
                if other != name and o < offset + length and offset < o + n
            )
            unit.point_parameters()
        for position, name in enumerate(layout.order):
            self.units[name].prefetch_next = tuple(
                self.units[layout.order[k]] for k in layout.prefetch_after[position]
            )
        self._warm_start(layout.order)

    def _free_device_bytes(self, staying: set[str]) -> set[str]:
        """Drop the arena and every unit's storage except that of units resident now and in ``staying``;
        return the names of those kept, whose storage, bytes and parameters are left as they are.

        Runs before the new layout allocates anything, so that its storage and arena can reuse what is
        freed here: the peak of a switch is the larger of the two layouts, not their sum.
        """
        kept = {n for n, u in self.units.items() if n in staying and u.resident and u.storage is not None}
        for unit in self.units.values():
            unit.conflicts = unit.prefetch_next = ()  # a streamed unit's are recomputed for the new layout
            if unit.name in kept:
                continue
            for _, param, entry in unit.parameters:
                # Drop the views first: a parameter still viewing the arena would keep it allocated.
                param.data = torch.empty(0, dtype=entry.dtype, device=self.runtime.device)
            unit.storage = None
            unit.valid = False
            unit.resident = False
        self._arena = None
        return kept

    def _upload_resident(self, unit: UnitState) -> None:
        """Give a unit entering residency storage of its own, holding its weights for good."""
        assert unit.pack is not None  # only a resident unit may lack its pack
        unit.storage = torch.empty(unit.nbytes, dtype=torch.uint8, device=self.runtime.device)
        unit.storage.copy_(unit.pack.buffer)
        unit.valid = True
        unit.point_parameters()
        unit.resident = True  # last: a failed upload leaves the unit to be freed and retried next time

    def _drop_resident_packs(self) -> None:
        """Free the private host pack of every unit resident in every saved plan: its storage is the only
        copy it needs (see [Note: one copy of a resident unit]). A unit that some other plan streams keeps
        its pack, so that switching between plans (prefill and decode) re-pins nothing. Plan time only,
        after apply_layout, whose uploads have completed: no copy in flight reads these packs."""
        plans = [set(state.plan.resident) for state in self._plans.values()]
        everywhere = set.intersection(*plans) if plans else set(self.units)
        for unit in self.units.values():
            if unit.name in everywhere and unit.resident and unit.pack is not None and not unit.pack.shared:
                unit.pack.free()
                unit.pack = None

    def _rebuild_pack(self, unit: UnitState) -> None:
        """Give a resident unit whose pack was dropped a new one, copied from its device storage, with
        the layout and pinning of the original. Plan time only, on a synchronised device."""
        assert unit.resident and unit.storage is not None
        try:
            pack = UnitPack(unit.name, unit.entries, unit.nbytes, self._pin)
        except FlexTensorError as exc:  # page-locking refused (memlock limit): slower copies, same bytes
            logger.warning("%s; unit %s streams from pageable memory instead", exc, unit.name)
            pack = UnitPack(unit.name, unit.entries, unit.nbytes, False)
        try:
            pack.buffer.copy_(unit.storage)  # synchronous: the pack is whole when this returns
        except BaseException:
            pack.free()
            raise
        unit.pack = pack

    def _warm_start(self, order: tuple[str, ...]) -> None:
        """Copy in the first units of the order that do not overlap each other, ahead of the next forward."""
        for name in order:
            unit = self.units[name]
            if any(other.valid for other in unit.conflicts):
                break
            self._copy_in(unit, ())

    @property
    def arena(self) -> torch.Tensor | None:
        """The device bytes streamed units share (None when nothing streams)."""
        return self._arena

    def device_bytes_held(self) -> int:
        """Device bytes flextensor holds for units: the arena and resident units' storage."""
        arena = 0 if self._arena is None else self._arena.numel()
        return arena + sum(u.nbytes for u in self.units.values() if u.resident)

    def host_bytes_held(self) -> int:
        """Host bytes flextensor holds for units: their packs (a shared pack counts its range of the
        segment). In steady state units resident in every saved plan hold none unless shared."""
        return sum(u.pack.held_bytes for u in self.units.values() if u.pack is not None)

    # -- copies -------------------------------------------------------------------------------------------

    def _copy_in(self, unit: UnitState, after: Iterable[UnitState]) -> None:
        """Issue the copy of ``unit``'s pack into its range, after the compute of ``after`` on the device."""
        rt = self.runtime
        stream = rt.copy_stream
        for other in after:
            stream.wait_event(other.compute_done)
        timing = None
        if self._profiler is not None:
            timing = self._profiler.copy_events(unit.name)
        elif self._recorder is not None:
            timing = self._recorder.copy_events(unit.name, unit.nbytes)
        assert unit.storage is not None and unit.pack is not None
        with rt.on_copy_stream():
            if timing is not None:
                timing[0].record(stream)
            unit.storage.copy_(unit.pack.buffer, non_blocking=True)
            if timing is not None:
                timing[1].record(stream)
            unit.copy_done.record(stream)
        for other in unit.conflicts:
            other.valid = False
        unit.valid = True

    # -- hooks --------------------------------------------------------------------------------------------

    def attach(self) -> None:
        self._handles.append(
            self.model.register_forward_pre_hook(self._on_model_pre, prepend=True, with_kwargs=True)
        )
        self._handles.append(self.model.register_forward_hook(self._on_model_post, always_call=True))
        self._sync_unit_hooks()

        # model.to()/.half()/.cuda() that would give a streamed parameter new storage would detach it
        # from the arena: guard them on the instance until release(). A no-op move (a diffusers
        # pipeline's pipe.to("cuda") reaching an offloaded transformer) still goes through.
        self.model._apply = self._guarded_apply  # type: ignore[method-assign]
        # torch tags these hooks with attributes, which bound methods cannot carry: wrap in functions.
        self._handles.append(
            self.model.register_state_dict_post_hook(lambda *a: self._state_dict_from_host(*a))
        )
        self._handles.append(
            self.model.register_load_state_dict_pre_hook(lambda *a: self._refuse_load_state_dict(*a))
        )

    def _state_dict_from_host(self, module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        """A streamed parameter's arena range may hold another unit's bytes: report the host copy."""
        for unit in self.units.values():
            if unit.resident:
                continue
            for fqn, _, entry in unit.parameters:
                key = prefix + fqn
                if key in state_dict:
                    state_dict[key] = unit.kept(entry)

    def _guarded_apply(self, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        """``nn.Module._apply``, but only when it leaves every streamed parameter where it is."""
        for unit in self.units.values():
            for fqn, param, _ in unit.parameters:
                applied = fn(param)
                same = (applied.data_ptr(), applied.dtype, applied.device) == (
                    param.data_ptr(),
                    param.dtype,
                    param.device,
                )
                if not same:
                    raise RuntimeError(
                        f"this conversion would give the offloaded parameter {fqn!r} new storage "
                        f"({param.dtype} on {param.device} -> {applied.dtype} on {applied.device}), "
                        "detached from flextensor's buffers; call flextensor.release(model) first, "
                        "convert, then offload again"
                    )
        return type(self.model)._apply(self.model, fn, *args, **kwargs)

    def _refuse_load_state_dict(self, module: nn.Module, *args: Any) -> None:
        raise RuntimeError(
            "load_state_dict() on an offloaded model would write into the shared device arena; call "
            "flextensor.release(model) first, load, then offload again"
        )

    def _sync_unit_hooks(self) -> None:
        """Hook every unit while learning; in steady state only the streamed ones (plan time only).

        A resident unit's weights never move, so in steady state its hooks would only cost time: a
        module with hooks takes PyTorch's slow call path, which shows in launch-bound decode steps.
        """
        for unit in self.units.values():
            wanted = self.phase is not Phase.INFERENCE or not unit.resident
            hooked = unit.name in self._unit_handles
            if wanted and not hooked:
                self._unit_handles[unit.name] = [
                    unit.module.register_forward_pre_hook(self._unit_pre_hook(unit), prepend=True),
                    unit.module.register_forward_hook(self._unit_post_hook(unit), always_call=True),
                ]
            elif hooked and not wanted:
                for handle in self._unit_handles.pop(unit.name):
                    handle.remove()

    def detach(self) -> None:
        self.model.__dict__.pop("_apply", None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for handles in self._unit_handles.values():
            for handle in handles:
                handle.remove()
        self._unit_handles.clear()

    def _on_model_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        me = threading.get_ident()
        with self._owner_lock:
            if self._owner_thread is not None and self._owner_thread != me:
                raise ConcurrentForwardError(
                    f"a forward of this offloaded {type(self.model).__name__} is already running in "
                    "another thread; its weights share one device arena, so run forwards one at a time "
                    "(use a lock) or offload one model per thread"
                )
            self._owner_thread = me
        if self._depth and self._model_calls_on_stack() == 1:
            self._finish_interrupted_forward()
            self._owner_thread = me
        self._depth += 1
        if self._depth > 1:
            return
        shapes = _input_shapes(args, kwargs)
        if self.phase is Phase.INFERENCE:
            if shapes != self.input_shapes:
                self._on_new_input(shapes)
            if self._record_next and self.phase is Phase.INFERENCE:
                self._record_next = False
                self._recorder = StepRecorder(self.runtime)
                self._recorder.begin()
            return
        self.input_shapes = shapes
        if self.phase is Phase.DISCOVERY:
            self._tracker = OutsideReadTracker(self._owner_of, self._active, self._keep_outside_read_resident)
            self._tracker.__enter__()
        elif self.phase is Phase.PROFILING:
            if self._layout_lost:
                self._lay_out_to_profile()
            self._profiler = StepProfiler(self.runtime)
            self._profiler.begin_step()

    def _on_model_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._owner_thread != threading.get_ident():
            return  # the rejected call of a second thread
        self._depth -= 1
        if self._depth > 0:
            return
        # PyTorch calls always_call hooks from inside its exception handler when forward raised.
        self._end_forward(sys.exc_info()[0] if output is None else None)

    def _end_forward(self, error: type[BaseException] | None) -> None:
        """Close the step of the outermost forward: ``error`` is the type of what it raised, if it did."""
        self._owner_thread = None
        self.forwards += 1
        if self._recorder is not None:
            if error is None:
                self._recorder.finish()
                self.last_recording = self._recorder
            else:
                self._record_next = True  # a partial step says nothing: record the next one
            self._recorder = None
        self._active.clear()
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
            if error is None:  # a partial order would make a wrong plan: learn again next forward
                self._end_discovery_forward()
        elif self._profiler is not None:
            sample = self._profiler.end_step()
            self._profiler = None
            if error is None:
                self._end_profiling_forward(sample)
            elif issubclass(error, torch.OutOfMemoryError) and self._holds_resident_units():
                # Units kept resident to profile a new shape left too little room for its activations.
                self._profile_again_streaming_everything("a profiling forward ran out of device memory")

    def _model_calls_on_stack(self) -> int:
        """How many calls of the model run in this thread, this one included (a rare path: only when a
        forward starts while another seems to run)."""
        calls, frame = 0, sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is self.model:
                calls += 1
            frame = frame.f_back
        return calls

    def _finish_interrupted_forward(self) -> None:
        """A forward left without its end: stopped by an exception PyTorch does not hand to always_call
        hooks (KeyboardInterrupt, SystemExit). Close it as failed, so this forward starts clean."""
        logger.warning("the previous forward was interrupted; closing it before this one runs")
        self.runtime.synchronize()  # its kernels and copies may still be queued behind stale events
        for guard in self._grad_guards.values():
            guard.__exit__(None, None, None)
        self._grad_guards.clear()
        self._depth = 0
        self._end_forward(KeyboardInterrupt)

    def _holds_resident_units(self) -> bool:
        return any(unit.resident for unit in self.units.values())

    def _unit_pre_hook(self, unit: UnitState) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            owner = self._owner_thread
            if owner is not None and owner != threading.get_ident():
                raise ConcurrentForwardError(
                    f"unit {unit.name!r} entered from a second thread while a forward runs; run forwards "
                    "one at a time"
                )
            recorder = self._recorder
            if self.phase is not Phase.INFERENCE:
                self._unit_pre_learning(unit)
            elif not unit.resident:
                if recorder is not None:
                    recorder.wait_start(unit.name, False, unit.nbytes)
                if not unit.valid:
                    self._copy_in(unit, unit.conflicts)  # out of the learned order: load on demand
                self.runtime.current_stream().wait_event(unit.copy_done)
                if recorder is not None:
                    recorder.compute_start(unit.name)
            elif recorder is not None:
                recorder.wait_start(unit.name, True, unit.nbytes)
                recorder.compute_start(unit.name)
            if torch.is_grad_enabled() and not unit.resident:
                self._enter_grad_guard(unit)

        return hook

    def _unit_post_hook(self, unit: UnitState) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            owner = self._owner_thread
            if owner is not None and owner != threading.get_ident():
                return None  # the rejected call of a second thread: the running forward's state is not ours
            guard = self._grad_guards.pop(unit.name, None)
            if guard is not None:
                guard.__exit__(None, None, None)
            if self._recorder is not None:
                self._recorder.compute_end(unit.name)
            if unit.resident and self.phase is Phase.INFERENCE:
                return None
            replaced = None
            if self.phase is Phase.DISCOVERY and not unit.resident and self._aliases_arena(output):
                self._must_stay_resident.setdefault(unit.name, "its output is a view of its weights")
                # Later copies would overwrite what this output views: hand the caller a copy, taken
                # before compute_done is recorded so that those copies wait for it.
                replaced = _clone_tensors(output)
            unit.compute_done.record(self.runtime.current_stream())
            if self.phase is not Phase.INFERENCE:
                self._active.discard(unit.name)
                if self._profiler is not None:
                    self._profiler.unit_end(unit.name)
                return replaced
            for upcoming in unit.prefetch_next:
                if not upcoming.valid:
                    self._copy_in(upcoming, (unit,))
            return None

        return hook

    def _unit_pre_learning(self, unit: UnitState) -> None:
        """Discovery and profiling: record the order, load on demand, time when profiling."""
        if self.phase is Phase.DISCOVERY:
            if unit.name not in self.order:
                self.order.append(unit.name)
            if self._active - {unit.name}:
                # A unit running inside another's forward: a prefetch issued after it would overwrite
                # ranges the outer unit still reads. Keep it resident instead.
                outer = next(iter(self._active - {unit.name}))
                self._must_stay_resident.setdefault(unit.name, f"it runs inside unit {outer!r}")
        self._active.add(unit.name)
        if self._profiler is not None:
            self._profiler.before_load(unit.name, unit.nbytes)
        if not unit.resident:
            if not unit.valid:
                self._copy_in(unit, unit.conflicts)
            self.runtime.current_stream().wait_event(unit.copy_done)
        if self._profiler is not None:
            self._profiler.compute_start(unit.name)

    def _enter_grad_guard(self, unit: UnitState) -> None:
        arena_storage = self._arena.untyped_storage().data_ptr() if self._arena is not None else None
        name = unit.name

        def pack(tensor: torch.Tensor) -> Any:
            try:
                pointer = tensor.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                return tensor  # wrapper subclasses and sparse tensors have no plain storage to alias
            if arena_storage is not None and pointer == arena_storage:
                return _StreamedWeightRef(name)
            return tensor

        def unpack(saved: Any) -> Any:
            if isinstance(saved, _StreamedWeightRef):
                raise BackwardNotSupportedError(
                    f"backward reached the weights of unit {saved.unit!r}, which flextensor streams for "
                    "inference and overwrites after use, so their gradients would be wrong; run forwards "
                    "under torch.no_grad()/inference_mode(), or call flextensor.release(model) to train"
                )
            return saved

        guard = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        guard.__enter__()
        self._grad_guards[unit.name] = guard

    # -- discovery ----------------------------------------------------------------------------------------

    def _keep_outside_read_resident(self, param_id: int, func: Any) -> None:
        unit_name = self._owner_of[param_id]
        self.keep_resident(
            param_id, f"read outside its unit {unit_name!r} (by {getattr(func, '__name__', func)})"
        )

    def keep_resident(self, param_id: int, reason: str) -> None:
        """Stop streaming one parameter: give it device storage of its own, for good (plan time only)."""
        unit = self.units[self._owner_of.pop(param_id)]
        for i, (fqn, param, entry) in enumerate(unit.parameters):
            if id(param) == param_id:
                param.data = unit.kept(entry).to(self.runtime.device, copy=True)
                del unit.parameters[i]
                self.resident_parameters[fqn] = reason
                logger.info("keeping %s resident: %s", fqn, reason)
                return

    def _aliases_arena(self, output: Any) -> bool:
        """Whether a unit's output (a tensor, or a tuple/list/dict of them) views the arena."""
        if self._arena is None:
            return False
        arena = self._arena.untyped_storage().data_ptr()
        if isinstance(output, torch.Tensor):
            values: Any = (output,)
        elif isinstance(output, dict):  # transformers' ModelOutput is a dict too
            values = tuple(output.values())
        elif isinstance(output, (tuple, list)):
            values = output
        else:
            return False
        for value in values:
            if isinstance(value, torch.Tensor) and value.device == self.runtime.device:
                try:
                    if value.untyped_storage().data_ptr() == arena:
                        return True
                except (RuntimeError, NotImplementedError):
                    continue  # tensors without a plain storage cannot view the arena
        return False

    def _drop_empty_units(self) -> None:
        """Forget units left with nothing to stream: no hooks, no pack, no place in the order."""
        for name in [n for n, u in self.units.items() if not u.parameters]:
            for handle in self._unit_handles.pop(name, []):
                handle.remove()
            pack = self.units.pop(name).pack
            if pack is not None:
                pack.free()
            logger.info("unit %s streams nothing now; it is no longer an offload unit", name)
        self.order = [u for u in self.order if u in self.units]

    def _end_discovery_forward(self) -> None:
        self._phase_forwards += 1
        if self._phase_forwards < self.config.discovery_forwards:
            return
        self._phase_forwards = 0
        for name, reason in self._must_stay_resident.items():
            if name in self.units:
                for _, param, _ in list(self.units[name].parameters):
                    self.keep_resident(id(param), f"its unit {name!r} must stay resident: {reason}")
        self._must_stay_resident.clear()
        self.runtime.synchronize()  # the packs of dropped units may still be read by copies in flight
        self._drop_empty_units()
        ran = [u for u in self.order if self.units[u].parameters]
        idle = [u for u in self.units if u not in self.order]
        if idle:
            logger.info(
                "%d unit(s) never ran in discovery; they load on demand: %s",
                len(idle),
                ", ".join(idle[:5]),
            )
        self.order = ran
        self.apply_layout(ran, (), provisional_arena_bytes([self.units[u].nbytes for u in ran]))
        self._set_phase(Phase.PROFILING)

    # -- profiling and planning ---------------------------------------------------------------------------

    def _end_profiling_forward(self, sample: StepSample) -> None:
        self._samples.append(sample)
        self._phase_forwards += 1
        if self._phase_forwards < self.config.profiling_forwards:
            return
        self._phase_forwards = 0
        link = self.link or LinkModel.constant(1e12)
        measurements = combine_samples(self._samples, link, self.device_bytes_held(), self.input_shapes)
        self._samples = []
        self.install_plan(measurements)

    def install_plan(self, measurements: Measurements, plan: Plan | None = None) -> None:
        """Plan from ``measurements`` (unless given), apply it, and enter steady state."""
        if plan is None:
            plan = self._make_plan(measurements)
        self.order = [u.name for u in measurements.units]
        try:
            self.apply_layout(list(plan.streamed), plan.resident, plan.arena_bytes)
        except BaseException as exc:
            if isinstance(exc, torch.OutOfMemoryError):
                # The device had less room than measured (memory taken since, fragmentation): the next
                # plan asks for less, or raises BudgetError, rather than failing the same way again.
                self._failed_peak_bytes = plan.predicted_peak_bytes
            self._profile_again_streaming_everything("the plan's layout failed")
            raise
        self._failed_peak_bytes = None  # what failed was that layout, not this device for good
        self.measurements = measurements
        self.plan = plan
        self._plans[measurements.input_shapes] = _PlanState(measurements, plan)
        self._drop_resident_packs()
        self._set_phase(Phase.INFERENCE)
        self._sync_unit_hooks()
        self._record_next = True  # the first steady step is recorded for report() and trace()
        logger.info(
            "plan: %d unit(s) streamed, %d resident, arena %.2f GiB, predicted step %.1f ms, "
            "predicted peak %.2f GiB%s",
            len(plan.streamed),
            len(plan.resident),
            plan.arena_bytes / 2**30,
            plan.predicted_step_s * 1e3,
            plan.predicted_peak_bytes / 2**30,
            "" if plan.budget_bytes is None else f" (budget {plan.budget_bytes / 2**30:.2f} GiB)",
        )

    def _make_plan(self, measurements: Measurements) -> Plan:
        """The plan for ``measurements``: under the budget; without one, within the device's share; and
        below the peak of a plan whose layout ran out of memory."""
        plan = plan_offload(measurements, self.budget_bytes)
        limit = self._memory_limit()
        if self._failed_peak_bytes is not None:
            # Never below the smallest plan: that one is retried as it is rather than refused.
            shrunk = int(FAILED_LAYOUT_SHRINK * self._failed_peak_bytes)
            shrunk = max(shrunk, minimal_need_bytes(measurements)[0])
            limit = shrunk if limit is None else min(limit, shrunk)
        if limit is not None and plan.predicted_peak_bytes > limit:
            logger.info("the plan would not fit the memory left; planning for %d bytes", limit)
            plan = plan_offload(measurements, limit)
        return plan

    def _profile_again_streaming_everything(self, why: str) -> None:
        """Profile the next forward afresh with every unit streamed through a provisional arena: the way
        back from a plan whose layout failed half-way, or from a profiling forward that ran out of memory
        with units held resident. The layout itself is made by the next forward (``_lay_out_to_profile``),
        not here: here the failed forward's tensors may still hold the memory it needs."""
        logger.warning("%s: the next forward streams every unit and is profiled again", why)
        self._samples, self._phase_forwards = [], 0
        self.input_shapes, self.plan = (), None
        self._set_phase(Phase.PROFILING)
        self._layout_lost = True

    def _lay_out_to_profile(self) -> None:
        """Stream every unit through a provisional arena; until this succeeds, every forward tries again."""
        arena = provisional_arena_bytes([self.units[u].nbytes for u in self.order])
        self.apply_layout(self.order, (), arena)
        self._sync_unit_hooks()
        self._layout_lost = False

    def _on_new_input(self, shapes: tuple[str, ...]) -> None:
        """Inputs changed in steady state: reuse the plan made for them, or profile them and re-plan."""
        try:
            self._switch_layout(shapes)
        except BaseException:
            # A layout that failed half-way (out of memory) has freed units of the old one: forget which
            # layout is in place, so that the next forward lays one out again whatever its shapes.
            self.input_shapes, self.plan = (), None
            raise

    def _switch_layout(self, shapes: tuple[str, ...]) -> None:
        known = self._plans.get(shapes)
        if known is not None:
            if known.plan is not self.plan:
                self.apply_layout(list(known.plan.streamed), known.plan.resident, known.plan.arena_bytes)
                self._drop_resident_packs()
                self.measurements, self.plan = known.measurements, known.plan
                self._sync_unit_hooks()
            self.input_shapes = shapes
            return
        logger.info("new input shapes %s: profiling them and re-planning", ", ".join(shapes))
        resident = self._profiling_residents()
        streamed = [u for u in self.order if u not in resident]
        arena = provisional_arena_bytes([self.units[u].nbytes for u in streamed])
        self.apply_layout(streamed, resident, arena)
        self.input_shapes = shapes
        self._set_phase(Phase.PROFILING)
        self._sync_unit_hooks()
        self._profiler = StepProfiler(self.runtime)
        self._profiler.begin_step()

    def _profiling_residents(self) -> set[str]:
        """The units kept resident while a new input shape is profiled: those resident now, as far as
        memory allows.

        Where a unit's weights live changes none of what profiling measures (compute time, activation
        memory; copy times come from the link model), and keeping them spares rebuilding their packs (see
        [Note: one copy of a resident unit]). The new shape's activations are unknown until it runs,
        though: under a memory limit (the budget, or the device's share without one) units stream instead
        until the layout leaves room for the largest activation peak measured so far. Streaming everything
        fits whenever any plan does; keeping units can overrun the limit only if the new activations
        outgrow every shape seen before.
        """
        resident = {u.name: u.nbytes for u in self.units.values() if u.resident}
        limit = self._memory_limit()
        if limit is None or not resident:
            return set(resident)
        reserve = max((s.measurements.activation_peak_bytes for s in self._plans.values()), default=0)
        fixed = max(0, self.runtime.memory_allocated() - self.device_bytes_held())  # weights, user tensors
        streamed = [self.units[u].nbytes for u in self.order if u not in resident]
        # Units that never ran are loaded on demand at the arena's start: the arena holds the largest.
        idle = minimal_arena_bytes([u.nbytes for n, u in self.units.items() if n not in self.order])
        kept = residents_within(resident, streamed, limit - fixed - reserve, arena_floor=idle)
        if len(kept) < len(resident):
            logger.info(
                "profiling streams %d of the %d resident unit(s), to leave room for activations",
                len(resident) - len(kept),
                len(resident),
            )
        return kept

    def _memory_limit(self) -> int | None:
        """What a plan must fit: the budget, or without one the device's share (None when the device's
        size is unknown, as on a CPU)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        capacity = self.runtime.total_memory()
        return None if capacity is None else int(NO_BUDGET_DEVICE_FRACTION * capacity)

    def _set_phase(self, phase: Phase) -> None:
        logger.info("%s -> %s after %d forward(s)", self.phase.value, phase.value, self.forwards)
        self.phase = phase

    # -- release ------------------------------------------------------------------------------------------

    def release(self, device: torch.device | None) -> None:
        """Remove every hook and give each parameter storage of its own on ``device``."""
        self.runtime.synchronize()
        self.detach()
        target = device if device is not None else self.runtime.device
        for unit in self.units.values():
            for _, param, entry in unit.parameters:
                # A copy each, also from a resident unit's storage on the target: a view would keep the
                # unit's padded storage alive and shared (which safetensors refuses to save).
                param.data = unit.kept(entry).to(target, copy=True)
            unit.storage = None
            if unit.pack is not None:
                unit.pack.free()
                unit.pack = None
        self._arena = None
        if device is not None:
            for param in self.model.parameters():
                if param.device != device:
                    param.data = param.data.to(device)
            for module in self.model.modules():
                for key, buf in module._buffers.items():
                    if buf is not None and buf.device != device:
                        module._buffers[key] = buf.to(device)

    def __repr__(self) -> str:
        streamed = sum(1 for u in self.units.values() if not u.resident)
        return (
            f"OffloadEngine({type(self.model).__name__}, phase={self.phase.value}, units={len(self.units)}, "
            f"streamed={streamed}, device={self.runtime.device})"
        )


def provisional_arena_bytes(sizes: list[int]) -> int:
    """Arena while learning: room for the two largest units (or all of them, if that is less)."""
    return min(2 * minimal_arena_bytes(sizes), sum(align_up(s, UNIT_ALIGNMENT) for s in sizes))


def residents_within(
    resident: dict[str, int], streamed: list[int], room: int, arena_floor: int = 0
) -> set[str]:
    """Which of the ``resident`` units (name -> bytes) to keep so that they and the provisional arena of
    the rest (``streamed`` sizes plus the units not kept; at least ``arena_floor`` bytes) fit ``room``.

    Greedy: each step streams the unit whose move saves the most bytes (moving a unit larger than every
    streamed one grows the arena too), until the layout fits or no move saves anything; a layout that
    still does not fit gives way to streaming everything if that holds less.
    """
    kept = {name: align_up(nbytes, UNIT_ALIGNMENT) for name, nbytes in resident.items()}
    padded = [align_up(s, UNIT_ALIGNMENT) for s in streamed]
    total, largest = sum(padded), max(padded, default=0)

    def held(kept_bytes: int, total: int, largest: int) -> int:
        return kept_bytes + max(min(2 * largest, total), arena_floor)  # as provisional_arena_bytes

    kept_bytes = sum(kept.values())
    now = held(kept_bytes, total, largest)
    while kept and now > room:
        moves = {n: held(kept_bytes - b, total + b, max(largest, b)) for n, b in kept.items()}
        name = min(moves, key=lambda n: (moves[n], n))
        if moves[name] >= now:
            break
        size = kept.pop(name)
        kept_bytes, total, largest, now = kept_bytes - size, total + size, max(largest, size), moves[name]
    if now > room and held(0, total + kept_bytes, max(largest, *kept.values(), 0)) < now:
        return set()
    return set(kept)


def _clone_tensors(output: Any) -> Any:
    """``output`` with its tensors cloned (a tensor, or a tuple/list/dict of them)."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, dict):
        copy = output.copy()
        for key, value in output.items():
            copy[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return copy
    if isinstance(output, (tuple, list)):
        return type(output)(v.clone() if isinstance(v, torch.Tensor) else v for v in output)
    return output


def _bucket(n: int) -> int:
    """Round a dimension up to a power of two: a decode loop whose mask grows by one each step re-plans
    log2(length) times, not every step."""
    return 1 << max(0, int(n) - 1).bit_length()


def _input_shapes(args: tuple, kwargs: dict) -> tuple[str, ...]:
    """Bucketed shapes of the tensors passed to the model's forward: what the plan's activations depend
    on. Each dimension is rounded up to a power of two (see _bucket)."""
    shapes = [
        f"{i}:{tuple(map(_bucket, a.shape))}" for i, a in enumerate(args) if isinstance(a, torch.Tensor)
    ]
    shapes += [
        f"{k}:{tuple(map(_bucket, v.shape))}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)
    ]
    return tuple(shapes)
