"""Every hook flextensor puts on a model, the guards on its methods, and the bracketing of each forward.

:class:`ModelHooks` owns every handle: the model-level pre/post pair that brackets a forward, one pre/post
pair per hooked unit, the state-dict and load-state-dict hooks, and the guard on ``Module._apply``; they
are added and removed together. What the unit hooks do is the controller's current step driver
(``controller.step``: discovery, profiling, steady or recorded), so changing phase never re-registers a
hook; only which units carry hooks changes (resident units carry none in steady state).

The hook functions themselves, and the marks they read on each hooked module, are hooks/functions.py's;
the bracketing itself (outermost forward, owner thread, interrupted forwards) is hooks/bracket.py's.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from flextensor.errors import ConcurrentForwardError, UnsupportedOperationError
from flextensor.hooks import compiled_ops as compiled
from flextensor.hooks.bracket import ForwardBracket
from flextensor.hooks.functions import (
    alias_post_hook,
    alias_pre_hook,
    entry_point,
    mark,
    mark_alias,
    model_post_hook,
    model_pre_hook,
    unit_post_hook,
    unit_pre_hook,
    unmark,
)
from flextensor.store.units import Unit
from flextensor.weights.access import StreamedWeights

logger = logging.getLogger("flextensor")

__all__ = ["Controller", "ModelHooks", "StepDriver", "entry_method_names"]


class StepDriver(Protocol):
    """What the unit hooks call; one implementation per phase (see engine/controller.py)."""

    def pre(self, unit: Unit) -> None: ...

    def post(self, unit: Unit, output: Any) -> Any: ...

    def nested_pre(self, unit: Unit, running: list[Unit], in_graph: bool) -> None:
        """``unit`` starts inside ``running[-2]`` (``running``: the units running, ``unit`` last);
        ``in_graph``: called from a compiled graph's op (see [Note: nested calls])."""

    def nested_post(self, unit: Unit, output: Any, caller: Unit) -> Any:
        """``unit``, called inside ``caller``, returns."""


class Controller(Protocol):
    """What the hooks need from the engine."""

    model: nn.Module
    step: StepDriver
    bracket: ForwardBracket
    runtime: Any  # DeviceRuntime
    phase: Any  # learning.Phase
    weights: StreamedWeights
    editing: Any  # weights.edits.EditSession while flextensor.editing(model) is open, else None
    entry_methods: tuple[str, ...]  # methods besides forward that bracket a step (see entry_method_names)

    def begin_forward(self, signature: tuple[str, ...]) -> None: ...

    def end_forward(self, error: type[BaseException] | None) -> None: ...

    def close_interrupted_forward(self) -> None: ...

    def capture_began(self) -> None: ...

    def runs_eager(self) -> bool: ...

    def accept_weight_versions(self) -> None: ...


_GUARDED = ("_apply", "__reduce_ex__", "__deepcopy__")
"""Methods an offloaded model carries on its instance, removed with the hooks."""

EDIT_METHODS = ("fuse_lora", "unfuse_lora")
"""Methods (diffusers' models) that write into weights and change other state first: ``fuse_lora`` scales
each LoRA layer before it merges it, so a merge refused at a streamed weight's ``.data`` would leave the
scale changed. Outside flextensor.editing() they are refused on entry, before anything changes."""


def entry_method_names(model: nn.Module, names: Iterable[str], explicit: bool) -> tuple[str, ...]:
    """The methods of ``model`` among ``names`` (OffloadConfig.entry_methods) to bracket as steps. Names
    the model lacks are skipped when they are the defaults, refused when given explicitly."""
    from flextensor.errors import ConfigError

    found = []
    for name in names:
        if callable(getattr(type(model), name, None)):
            found.append(name)
        elif explicit:
            raise ConfigError(
                f"entry_methods names {name!r}, but {type(model).__name__} has no method of that name; "
                "name the methods callers run the model through (e.g. ['encode', 'decode'])"
            )
    return tuple(found)


def _refuse_copy(*args: Any) -> Any:
    raise UnsupportedOperationError(
        "an offloaded model cannot be pickled, saved whole or deep-copied: its weights live in flextensor's "
        "host packs and device arena, not in its parameters; save model.state_dict() (torch.save or "
        "safetensors) instead, or call flextensor.release(model) first"
    )


class ModelHooks:
    """The hooks on one offloaded model; built by the engine, removed by :meth:`detach`."""

    def __init__(self, controller: Controller) -> None:
        # Weak: an engine must not be kept alive by its own hooks object once released (it holds the
        # model, and so device memory, that a plain `del model` should give back without a gc pass).
        self._controller_ref = weakref.ref(controller)
        self._model_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._unit_handles: dict[Unit, list[torch.utils.hooks.RemovableHandle]] = {}
        self.units: dict[int, Unit] = {}  # Unit.index -> unit, for the hook functions and the ops
        self.eval_frame: object = None  # Dynamo's frame callback, switched off while discovery runs
        self.stance: Any = None  # torch.compiler.set_stance("force_eager") while discovery runs
        self._guarding = False  # whether compiled graphs are guarded on module hooks yet
        self.model_id = 0  # the constant compiled graphs carry (see hooks/compiled_ops.py)
        self.ops_seen = False  # a unit ran in this forward (the first checks for a capture)
        # The hooked units running now, outermost first: a call made while one runs is a nested call
        # (see [Note: nested calls] in store/nesting.py).
        self.running: list[Unit] = []
        # Units to unhook once their running call ends: their own pre hook laid the plan out, which
        # unhooks resident units, and the call's post hook must still run (it pops ``running``).
        self._unhook_after_call: set[Unit] = set()
        self.forward_in_graph = False  # the forward running was begun by a compiled graph's op
        # Whether the compiled pre op orders a unit's kernels through its floating-point inputs rather
        # than its weights (see compiled.written_inputs): set by integrations that need it (vLLM).
        self.order_by_inputs = False
        device = controller.runtime.device
        # What the compiled ops mutate to keep their order: one element each, made once.
        self.token = torch.zeros(1, device=device)
        self.spare = torch.zeros(1, device=device)  # stands in for a unit input that is no tensor

    @property
    def _controller(self) -> Controller:
        controller = self._controller_ref()
        assert controller is not None, "the engine these hooks belong to is gone"
        return controller

    @property
    def hooked_units(self) -> set[Unit]:
        return set(self._unit_handles)

    def attach(self) -> None:
        """The model-level hooks and guards (units are hooked by :meth:`hook_units`)."""
        model = self._controller.model
        compiled.skip_hook_frames(
            everything_eager=(
                unit_pre_hook,
                alias_pre_hook,
                unit_post_hook,
                alias_post_hook,
                ModelHooks.model_begin,
                ModelHooks.model_end,
            ),
            frame_only=(model_pre_hook, model_post_hook),
        )
        self._guarding = compiled.guard_hooks_if_compiling(model)
        if self._guarding:
            compiled.mark_static(self.token, self.spare)
        self.model_id = compiled.register(self)
        self._mark(model, None)
        self._model_handles += [
            model.register_forward_pre_hook(model_pre_hook, prepend=True, with_kwargs=True),
            model.register_forward_hook(model_post_hook, always_call=True),
            # torch tags these hooks with attributes, which bound methods cannot carry: wrap in functions.
            model.register_state_dict_post_hook(lambda *a: self._state_dict_from_host(*a)),
            model.register_load_state_dict_pre_hook(lambda *a: self._refuse_load_state_dict(*a)),
        ]
        # model.to()/.half()/.cuda() that would give a streamed parameter new storage would detach it
        # from the arena: guard them on the instance until release(). A no-op move (a diffusers
        # pipeline's pipe.to("cuda") reaching an offloaded transformer) still goes through.
        model._apply = self._guarded_apply  # type: ignore[method-assign]
        # pickle, torch.save(model) and copy.deepcopy find these on the instance before the class's: they
        # would otherwise fail deep inside on the engine's mmaps and hooks, or copy views of the arena.
        model.__reduce_ex__ = _refuse_copy  # type: ignore[method-assign,assignment]
        model.__deepcopy__ = _refuse_copy  # type: ignore[attr-defined]
        for name in self._controller.entry_methods:
            model.__dict__[name] = entry_point(model, name, getattr(model, name))
        for name in EDIT_METHODS:
            if callable(getattr(type(model), name, None)):
                model.__dict__[name] = self._edit_method(name, getattr(model, name))

    def hook_units(self, wanted: Iterable[Unit]) -> None:
        """Hook exactly the ``wanted`` units (plan time only): add missing pairs, remove the others."""
        wanted = set(wanted)
        self._unhook_after_call -= wanted
        for unit in [u for u in self._unit_handles if u not in wanted]:
            if unit in self.running:
                self._unhook_after_call.add(unit)
                continue
            for handle in self._unit_handles.pop(unit):
                handle.remove()
            # Its marks stay until detach: a graph compiled without guards on hooks while the unit was
            # hooked (vLLM's) still runs the unit's ops, which read them; they are harmless for a
            # resident unit (its pre finds its weights in place, its post has nothing to prefetch).
        for unit in wanted:
            self._mark(unit.module, unit)  # again for hooked units too: their weights may have changed
            live = unit.live_aliases()
            if live != unit.aliases:  # a tied weight left the unit: its holder stands for it no more
                for _, alias in unit.aliases:
                    unmark(alias)
                for handle in self._unit_handles.pop(unit, ()):
                    handle.remove()
                unit.aliases = live
            for path, alias in unit.aliases:
                self._mark(alias, unit)
                mark_alias(alias, path)
            if unit not in self._unit_handles:
                self.units[unit.index] = unit
                self._unit_handles[unit] = [
                    handle
                    for module, pre_hook in (
                        (unit.module, unit_pre_hook),
                        *((alias, alias_pre_hook) for _, alias in unit.aliases),
                    )
                    for handle in (
                        module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True),
                        module.register_forward_hook(
                            unit_post_hook if pre_hook is unit_pre_hook else alias_post_hook,
                            always_call=True,
                            with_kwargs=True,
                        ),
                    )
                ]

    def _mark(self, module: nn.Module, unit: Unit | None) -> None:
        """What the hook functions read from a hooked module (plain attributes, removed with the hooks)."""
        if unit is None:
            mark(module, self)
            return
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        mark(module, self, unit.index, tuple(names[id(p)] for _, p, _ in unit.parameters if id(p) in names))

    def detach(self) -> None:
        """Remove every hook and guard; safe to call twice."""
        controller = self._controller
        model = controller.model
        for name in (*_GUARDED, *controller.entry_methods, *EDIT_METHODS):
            model.__dict__.pop(name, None)
        for handle in self._model_handles:
            handle.remove()
        self._model_handles.clear()
        unmark(model)
        for handles in self._unit_handles.values():
            for handle in handles:
                handle.remove()
        self._unit_handles.clear()
        self._unhook_after_call.clear()
        for unit in self.units.values():  # every unit ever hooked keeps its marks until here
            unmark(unit.module)
            for _, alias in unit.aliases:
                unmark(alias)
        compiled.unregister(self.model_id)

    # -- the forward (the module-level hook functions below call these) ------------------------------------

    def model_begin(self, signature: tuple[str, ...]) -> bool:
        """The model's forward begins; returns whether it must run uncompiled (discovery)."""
        controller = self._controller
        if not self._guarding:  # torch.compile may have loaded Dynamo since offload()
            self._guarding = compiled.guard_hooks_if_compiling(controller.model)
            if self._guarding:
                compiled.mark_static(self.token, self.spare)
        self.begin(signature)
        return controller.bracket.depth == 1 and controller.runs_eager()

    def begin(self, signature: tuple[str, ...]) -> None:
        controller = self._controller
        bracket = controller.bracket
        bracket.claim()
        if bracket.interrupted():
            self.eval_frame = None  # that forward's compiled call has restored Dynamo itself
            if self.stance is not None:  # its force_eager stance is process-wide: every torch.compile
                stance, self.stance = self.stance, None  # would run eagerly until it is left
                stance.__exit__(None, None, None)
            controller.close_interrupted_forward()
            bracket.claim()
        bracket.depth += 1
        if bracket.depth == 1:
            self.ops_seen = False
            self.running.clear()  # a forward interrupted by KeyboardInterrupt never ran its units' posts
            # A forward called inside an `except` block sees that exception in sys.exc_info() all along:
            # remember it, so that it is not taken for one the forward raised.
            bracket.handled_at_start = sys.exc_info()[1]
            controller.begin_forward(signature)

    def model_end(self, output: Any) -> object:
        """The model's forward ends; returns Dynamo's frame callback to restore, if it was switched off."""
        bracket = self._controller.bracket
        if bracket.is_foreign_thread():
            return None  # the rejected call of a second thread
        bracket.depth -= 1
        if bracket.depth > 0:
            return None
        self.running.clear()  # a compiled graph that raised ran no post op of the units it had begun
        self.forward_in_graph = False
        previous, self.eval_frame = self.eval_frame, None
        # PyTorch calls always_call hooks from inside its exception handler when forward raised; a forward
        # that returns None does too, and may run inside the caller's own exception handler.
        error = sys.exc_info()[1] if output is None else None
        failed = error is not None and error is not bracket.handled_at_start
        bracket.handled_at_start = None
        self._controller.end_forward(type(error) if failed else None)
        return previous

    # The two methods below run per streamed unit per forward: attribute reads, no helper calls.

    def run_unit_pre(
        self, index: int, in_graph: bool = False, weights: list[torch.Tensor] | None = None
    ) -> None:
        controller = self._controller_ref()
        assert controller is not None, "the engine these hooks belong to is gone"
        owner = controller.bracket.owner
        if owner is not None and owner != threading.get_ident():  # ForwardBracket.is_foreign_thread
            unit = self.units[index]
            raise ConcurrentForwardError(
                f"unit {unit.name!r} entered from a second thread while a forward runs; run forwards "
                "one at a time"
            )
        if not self.ops_seen:  # once per forward: a capture may begin inside it (reduce-overhead mode)
            self.ops_seen = True
            controller.capture_began()
        unit = self.units[index]
        running = self.running
        running.append(unit)
        try:
            if len(running) == 1:
                controller.step.pre(unit)
            else:
                controller.step.nested_pre(unit, running, in_graph)
            if weights:  # a compiled graph's op: never copies of them (see [Note: compiled hot path])
                self._refuse_copies(unit, weights)
        except BaseException:
            running.pop()  # its post may not come (an alias's does not when its pre raised)
            if in_graph and self.forward_in_graph and controller.bracket.depth == 1:
                self.model_end(None)  # the graph's model_end op will not run: end the forward (failed)
            raise

    def _refuse_copies(self, unit: Unit, weights: list[torch.Tensor]) -> None:
        """A compiled graph's pre op got ``weights`` for ``unit``: they must be the weights themselves, in
        the unit's device bytes, not copies a backend made (see [Note: compiled hot path]). The first
        non-empty one is compared (an empty view has no address)."""
        storage = unit.storage
        if self.order_by_inputs or storage is None:
            return  # ordered by the unit's inputs (vLLM); no device bytes to compare with
        weight = next((w for w in weights if w.numel()), None)
        if weight is None:
            return
        try:
            pointer = weight.data_ptr()
        except RuntimeError:
            return  # a tensor subclass with no storage of its own: nothing to compare
        start = storage.data_ptr()
        if not start <= pointer < start + unit.nbytes:
            raise UnsupportedOperationError(
                f"a compiled graph gave flextensor's hook of unit {unit.name!r} a copy of its weights, not "
                "the weights themselves: this torch.compile backend (aot_eager, or another without "
                "inductor's re-inplacing) would compute with weights copied before they arrive and write "
                "them back over other units; compile with the default backend (inductor), or "
                "backend='eager', or compile the blocks (block.compile()) instead of the whole model"
            )

    def run_alias_pre(self, index: int, alias: str) -> bool:
        """A module holding some of unit ``index``'s weights is called: the unit's pre-hook, after the
        learning forwards hear of it (see [Note: tied aliases] in phases/discovery.py). Whether the call
        stands for the unit: not once its tied weight left the unit (it reads a weight of its own then)."""
        unit = self.units[index]
        module = next((m for path, m in unit.aliases if path == alias), None)
        if module is None or not unit.held_by(module):
            return False
        noticed = getattr(self._controller.step, "alias_called", None)
        if noticed is not None and not self._controller.bracket.is_foreign_thread():
            noticed(unit, alias)
        try:
            self.run_unit_pre(index)
        except ConcurrentForwardError:
            raise
        except BaseException:
            if self.running:  # no post comes for this call: the unit it ran in gets its bytes back now
                self._controller.step.nested_post(unit, None, self.running[-1])
            raise
        return True

    def run_unit_post(self, index: int, output: Any = None) -> Any:
        controller = self._controller_ref()
        assert controller is not None, "the engine these hooks belong to is gone"
        owner = controller.bracket.owner
        if owner is not None and owner != threading.get_ident():
            return None  # the rejected call of a second thread: the running forward's state is not ours
        unit = self.units[index]
        try:
            running = self.running
            if running and running[-1] is unit:  # not when its pre raised (and popped it)
                running.pop()
                if running:
                    return controller.step.nested_post(unit, output, running[-1])
            elif running:  # its pre raised inside running[-1]: no prefetch, the caller gets its bytes back
                return controller.step.nested_post(unit, output, running[-1])
            return controller.step.post(unit, output)
        finally:
            if self._unhook_after_call and unit in self._unhook_after_call and unit not in self.running:
                self._unhook_after_call.discard(unit)
                for handle in self._unit_handles.pop(unit, ()):
                    handle.remove()  # PyTorch iterates over a copy of the hooks: safe from inside one

    def run_model_begin(self, signature: str) -> None:
        """The model's forward begins inside a larger compiled region (see hooks/compiled_ops.py)."""
        # Tracing that region ran flextensor's unit ops, which declare the weights written: their version
        # counters grew with no edit (see [Note: editing streamed weights]).
        self._controller.accept_weight_versions()
        self.begin(tuple(signature.split("|")) if signature else ())
        if self._controller.bracket.depth == 1:
            self.forward_in_graph = True
        if getattr(self._controller.step, "eager_only", False):
            self.model_end(None)
            raise UnsupportedOperationError(
                f"the offloaded {type(self._controller.model).__name__} runs inside a compiled region "
                f"before its plan is made (it is in its {self._controller.phase.value} phase), and that "
                "phase needs eager Python; run it uncompiled until flextensor.phase(model) == "
                "'inference' (or compile the offloaded model itself: its first forwards then run eagerly)"
            )

    def run_model_end(self) -> None:
        self.model_end(True)

    # -- guards ------------------------------------------------------------------------------------------

    def _state_dict_from_host(self, module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        """A streamed parameter's arena range may hold another unit's bytes: report the kept copy. Inside
        flextensor.editing every parameter holds a copy of its own, edits included: report it as it is."""
        if self._controller.editing is not None:
            return
        for key, tensor in self._controller.weights.state_dict_entries(prefix):
            if key in state_dict:
                state_dict[key] = tensor

    def _edit_method(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (one of EDIT_METHODS), run only inside flextensor.editing(model)."""

        @functools.wraps(method)
        def edit(*args: Any, **kwargs: Any) -> Any:
            if self._controller.editing is None:
                raise UnsupportedOperationError(
                    f"{type(self._controller.model).__name__}.{name}() writes into offloaded weights: run it "
                    f"inside `with flextensor.editing(model): ...` (a pipeline: editing(pipe)); nothing "
                    "was changed"
                )
            return method(*args, **kwargs)

        return edit

    def _guarded_apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any
    ) -> nn.Module:
        """``nn.Module._apply``, but only when it leaves every streamed parameter where it is."""
        self._controller.weights.refuse_conversion(fn)
        model = self._controller.model
        return type(model)._apply(model, fn, *args, **kwargs)

    def _refuse_load_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        if self._controller.editing is None:  # inside flextensor.editing(), loads are edits
            self._controller.weights.refuse_load_state_dict(state_dict, prefix)

    def __repr__(self) -> str:
        return f"ModelHooks({len(self._model_handles)} model hooks, {len(self._unit_handles)} units hooked)"
