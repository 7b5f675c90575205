"""Changing an offloaded model's weights: the ``editing`` context, and catching edits made without it.

[Note: editing streamed weights]
A streamed parameter views its unit's range of the device arena, which other units overwrite; the unit's
host pack is the source of truth. An in-place write into such a parameter between forwards (peft's
``merge_adapter``, diffusers' ``fuse_lora``, ``weight.mul_()``) would land in whatever unit occupies those
bytes now and be lost at the next reload. So edits are made inside ``flextensor.editing(model)``: there a
streamed unit's parameters get private device copies of its weights when first used, so a library may
read and write any of them, in any order, as on a model without offload, within the memory the model may
use (see [Note: editing within the budget] in engine/edit_session.py); at the end each parameter's value is
written back to its unit's pack (and to the device storage of a resident unit), the parameters view the
arena again, and the arena's contents are forgotten so every unit reloads from its pack. Modules added
inside units meanwhile (peft and diffusers LoRA layers) keep their new parameters resident on the device:
the units' packs, and so the plan, stay as they are.

An edit made without the context through ``.data`` (``p.data.mul_()``, ``p.data += delta``: how peft and
diffusers merge) is refused at once, before it writes anything: every unit parameter's class is swapped
for a subclass whose ``data`` property raises outside a forward and outside the context (a ``.data`` read
there could return another unit's bytes as well). Neither PyTorch's kernels nor the hot path touch
``.data``, so this costs nothing per forward; flextensor's own plan-time code goes through. The model's
other parameters (outside every unit, their bytes their own) get the same class, but their ``.data`` is
only noted (:class:`OutsideEdits`; reading it is legitimate: deepcopy, torch.save, peft's
``modules_to_save``): a merge walks the layers in turn, and one that merged a layer kept on the device
before a streamed weight refused would leave the model half-merged, so after such a refusal the model
refuses to run until the edit is made whole inside the context. diffusers' ``fuse_lora`` scales each
layer before it merges it, so it is refused on entry (hooks.EDIT_METHODS).

An edit made without the context is caught before the next forward computes anything when it went
through the parameter itself (``p.mul_()``, ``p.copy_()``, ``nn.init``): it bumps the parameter's version
counter, and :class:`WeightWatch` compares the sum of the streamed parameters' counters with the sum
when the layout was made (one C-level sum per forward, no Python loop); a pipeline's component held on
the host between its phases (empty placeholders) is watched too, and an edit seen when a layout or a
vacate arms the watch again stays pending for the next forward. Such an edit cannot be kept (its
bytes may have landed in another unit's weights): the edited units' arena ranges are forgotten, so they
reload their packs, and their parameters view their ranges again (``weight.set_(t)`` re-points one), and
the forward raises :class:`~flextensor.errors.UnsupportedOperationError`.
flextensor's own compiled unit ops declare the weights written (see [Note: compiled hot path] in
hooks/compiled_ops.py), so they bump the counters too: inside a forward that is absorbed (the watch is armed
again at its end), but tracing a larger compiled region runs them before the model's forward begins, so a
forward entered from such a region takes the counters as they are (a blind spot for ``p.mul_()`` there;
writes through ``.data`` are still refused).

[Note: writes into state_dict tensors]
``state_dict()`` gives a streamed weight as a view of its unit's host pack (weights/access.py), so an
in-place write into it (``model.state_dict()[k].copy_(v)``, the usual in-place loading idiom) changes the
weight for good, but a copy of the unit already in the arena (or in resident storage) still holds the old
bytes. Every such view shares the version counter of its unit's ``pack_writes`` (an empty tensor), so the
write bumps that one counter; :class:`WeightWatch` sums those counters with the parameters' (the same C
pass per forward, one more counter per unit). At the next forward's start the written units compute with
their packs again (:func:`take_pack_writes`): a streamed unit's arena range is forgotten, so it reloads,
and a resident unit's storage takes the entries that differ from its pack. A pack the write cannot reach
(shared between processes: copy on write; compressed; the checkpoint file) refuses that forward instead.
"""

from __future__ import annotations

import logging
import operator
import sys
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from flextensor.engine.edit_session import EditSession, FirstUse, point_back, refuse_to_begin, working_set_for
from flextensor.errors import NotOffloadedError, UnsupportedOperationError
from flextensor.store.units import Placement, Unit
from flextensor.weights.subclasses import is_wrapper_subclass

if TYPE_CHECKING:
    from flextensor.engine.controller import OffloadEngine
    from flextensor.store.device_store import DeviceStore

logger = logging.getLogger("flextensor")

__all__ = [
    "OutsideEdits",
    "WeightWatch",
    "discard_edits",
    "editing",
    "edits_discarded",
    "guard_parameters",
    "own_class",
    "refuse_forward_over_edits",
    "settle_changes",
    "take_pack_writes",
    "unguard_parameter",
]

_VERSION = operator.attrgetter("_version")
_DATA = torch._C.TensorBase.data  # the real ``.data`` descriptor, under the guard
_DETACH = torch._C.TensorBase.detach
_NEW_PARAMETER = nn.Parameter.__new__.__code__
_GUARD = "_flextensor_guard"  # on a guarded parameter: (weak reference to its engine, its FQN)
_GUARDED_CLASSES: dict[type, type] = {}  # parameter class -> its guarded subclass


def _check_data_access(param: nn.Parameter, what: str) -> None:
    guard = param.__dict__.get(_GUARD)
    if guard is None:
        return
    engine = guard[0]()
    if engine is not None and engine.editing is not None:
        engine.editing.use(param)  # its unit gets copies (see [Note: editing within the budget])
        return
    if engine is None or engine.bracket.running:
        return
    if sys._getframe(2).f_globals.get("__name__", "").startswith("flextensor."):
        return  # flextensor's own plan-time code: it knows where the weights are
    edits = engine.outside_edits
    if len(guard) > 2:  # a weight outside every unit: its bytes are its own; noted (see the note)
        edits.touched.add(guard[1])
        return
    if edits.touched:  # an edit going through the layers in turn may have changed those already
        edits.unsettled = sorted(edits.touched)
    raise UnsupportedOperationError(
        f"{what.format(guard[1])} of an offloaded model between forwards: the weight views a device range "
        "that other units' weights overwrite, so it may hold another unit's bytes and a write there would "
        "be lost. Make edits (peft merge_adapter/unmerge_adapter, diffusers fuse_lora/unfuse_lora, "
        "weight.data changes, weight_norm and other parametrizations) inside "
        "`with flextensor.editing(model): ...`, and set up there what reads "
        "the base weights (a peft DoRA adapter, use_dora=True: `with flextensor.editing(model): "
        "peft_model = get_peft_model(model, config)`); read weights from model.state_dict()"
        + (f"; {edits.unsettled_text()}" if edits.unsettled else "")
    )


class OutsideEdits:
    """``.data`` accesses of weights outside every unit between forwards (see [Note: editing streamed
    weights]): allowed, and remembered until the next forward, so that an edit refused at a streamed
    weight after it went through some of them leaves the model refusing to run (:attr:`unsettled`) rather
    than running half-edited."""

    def __init__(self) -> None:
        self.touched: set[str] = set()
        self.unsettled: list[str] = []

    def unsettled_text(self) -> str:
        names = ", ".join(self.unsettled[:5]) + (", ..." if len(self.unsettled) > 5 else "")
        return (
            f"the refused edit had gone through .data of weights outside the offload units ({names}), "
            "which it may have changed: the model may be half-edited, and refuses to run until the edit is "
            "made whole inside `with flextensor.editing(model): ...` (peft and diffusers skip the layers "
            "already merged) or the model is loaded again"
        )


def _get_data(param: nn.Parameter) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # Traced inside a compiled forward (a model reading weight.data): what .data gives there, the
        # same storage without autograd, in a form Dynamo can trace (it cannot trace the check below).
        return param.detach()
    _check_data_access(param, "reading {}.data")
    return _DATA.__get__(param)


def _set_data(param: nn.Parameter, value: torch.Tensor) -> None:
    current = _DATA.__get__(param)
    unchanged = (
        value.data_ptr() == current.data_ptr()
        and value.shape == current.shape
        and value.stride() == current.stride()
        and value.dtype == current.dtype
        and value.device == current.device
    )
    if not unchanged:  # a no-op move (module.to() of the device it is on) sets .data to itself
        _check_data_access(param, "replacing {}.data")
    _DATA.__set__(param, value)


def _detach(param: nn.Parameter) -> torch.Tensor:
    if not torch.compiler.is_compiling() and sys._getframe(1).f_code is _NEW_PARAMETER:
        # nn.Parameter(param) (parametrizations.weight_norm's): torch wants a subclass's detach() to keep
        # the class. The new parameter sheds it when registered (weights/structure_guard.py).
        _check_data_access(param, "nn.Parameter({})")
        return _DETACH(param).as_subclass(type(param))
    return _DETACH(param)


def _state_without_guard(param: nn.Parameter) -> dict | None:
    """What pickling a guarded parameter (torch.save, deepcopy) keeps of its attributes: the user's, not
    flextensor's guard (a weak reference to the engine, which cannot be pickled)."""
    state = {k: v for k, v in param.__dict__.items() if not k.startswith("_flextensor")}
    return state or None


def _guarded_class(cls: type) -> type:
    made = _GUARDED_CLASSES.get(cls)
    if made is None:
        members = {
            "data": property(_get_data, _set_data),
            "detach": _detach,
            "__getstate__": _state_without_guard,
            "__module__": cls.__module__,
        }
        made = type(cls.__name__, (cls,), members)
        made._flextensor_original = cls  # type: ignore[attr-defined]
        _GUARDED_CLASSES[cls] = made
    return made


def guard_parameters(engine: OffloadEngine) -> list[nn.Parameter]:
    """Guard ``.data`` of every unit parameter and note accesses to that of the model's other parameters
    (see [Note: editing streamed weights]) and watch the modules that hold them (see [Note: replaced
    weights] in weights/structure_guard.py); plan time. Returns the parameters outside every unit (the
    caller unguards them at release); a wrapper subclass (see weights/subclasses.py) keeps its class, and
    a parameter another model guards is left to it."""
    ref = weakref.ref(engine)
    in_units = set()
    for unit in engine.units.values():
        for fqn, param, _ in unit.parameters:
            param.__dict__[_GUARD] = (ref, fqn)
            param.__class__ = _guarded_class(type(param))
            in_units.add(id(param))
    outside = []
    for fqn, param in engine.model.named_parameters():
        if id(param) in in_units or _GUARD in param.__dict__ or is_wrapper_subclass(param):
            continue
        param.__dict__[_GUARD] = (ref, fqn, "outside")
        param.__class__ = _guarded_class(type(param))
        outside.append(param)
    from flextensor.weights.structure_guard import watch_structure  # it builds on this module

    watch_structure(engine)
    return outside


def own_class(cls: type) -> type:
    """The class a parameter had before :func:`guard_parameters` gave it the guarded subclass ``cls``."""
    return getattr(cls, "_flextensor_original", cls)


def unguard_parameter(param: nn.Parameter) -> None:
    """Give a parameter that leaves its unit (or the model released) its own class back."""
    param.__dict__.pop(_GUARD, None)
    original = getattr(type(param), "_flextensor_original", None)
    if original is not None:
        param.__class__ = original


def _versions_of(params: tuple[nn.Parameter, ...]) -> tuple[int, ...]:
    # ``_version`` is a tensor property: a TorchFunctionMode (discovery's outside-read tracker, or the
    # user's own) would see each read as a use of the weight. Counting is bookkeeping, not a use.
    with torch._C.DisableTorchFunction():
        return tuple(map(_VERSION, params))


class WeightWatch:
    """Notices in-place writes through unit parameters, and into the units' ``state_dict()`` tensors,
    between forwards (see [Note: editing streamed weights] and [Note: writes into state_dict tensors]).
    :meth:`arm` at plan time; :meth:`changes` at a forward's start, :meth:`refresh` at its end (compiled
    unit ops bump the counters too): each one pass over the counters in C, no Python loop.

    Watched: the parameters of streamed units (they view arena ranges other units overwrite) and of units
    held only on the host (a pipeline's component between its phases: its parameters are empty
    placeholders, and the next layout fills them from the packs), and every unit's ``pack_writes``
    counter. Arming again at plan time (a new layout, a component vacated for another one) keeps what was
    changed since the last arming as pending (:attr:`pending`, :attr:`pending_writes`), so the next
    forward still sees it; only callers that know the new parameter counters are no edit (the end of a
    forward, edits written back by flextensor.editing) pass ``accept=True``, and only :meth:`settled`
    forgets the writes into the packs, once they are taken."""

    def __init__(self) -> None:
        self._tensors: tuple[torch.Tensor, ...] = ()  # the watched parameters, then the pack counters
        self._owners: tuple[Unit, ...] = ()  # the unit of each
        self._parameters = 0  # how many of _tensors are parameters
        self._versions: tuple[int, ...] = ()
        self._total = 0
        self.pending: list[Unit] = []  # units edited before the last arming, not yet refused
        self.pending_writes: list[Unit] = []  # units whose packs were written before it, not yet taken

    def arm(self, units: Iterable[Unit], accept: bool = False) -> None:
        """Watch the parameters of the units streamed or held on the host now, and every unit's pack
        counter, from their present versions (plan time); edits since the last arming stay pending unless
        ``accept``, writes into the packs always do."""
        units = list(units)
        edited, written = self._changed()
        self.pending = [] if accept else _merged(self.pending, edited)
        self.pending_writes = _merged(self.pending_writes, written)
        watched = [u for u in units if u.placement in (Placement.STREAMED, Placement.HOST)]
        params = [p for u in watched for _, p, _ in u.parameters]
        self._tensors = (*params, *(u.pack_writes for u in units))
        self._owners = (*(u for u in watched for _ in u.parameters), *units)
        self._parameters = len(params)
        self.refresh()

    def settled(self, units: Iterable[Unit]) -> None:
        """Every change seen so far was dealt with (edits refused, writes into packs taken): arm afresh."""
        self.arm(units, accept=True)
        self.pending_writes = []

    def refresh(self) -> None:
        """Take the watched counters' present versions as the unchanged ones."""
        self._versions = _versions_of(self._tensors)
        self._total = sum(self._versions)

    def changes(self) -> tuple[list[Unit], list[Unit]]:
        """(units whose parameters were written in place, units whose ``state_dict()`` tensors were) since
        :meth:`refresh`, with those pending from before the last arming; usually neither, found with one
        sum (counters only grow, so an equal sum means nothing changed)."""
        edited, written = self._changed()
        return _merged(self.pending, edited), _merged(self.pending_writes, written)

    def _changed(self) -> tuple[list[Unit], list[Unit]]:
        now = _versions_of(self._tensors)
        if sum(now) == self._total:
            return [], []
        changed = [i for i, (v, was) in enumerate(zip(now, self._versions, strict=True)) if v != was]
        edited = [self._owners[i] for i in changed if i < self._parameters]
        written = [self._owners[i] for i in changed if i >= self._parameters]
        return _merged([], edited), _merged([], written)


def _merged(first: list[Unit], second: list[Unit]) -> list[Unit]:
    return list(dict.fromkeys([*first, *second])) if first else list(dict.fromkeys(second))


def refuse_forward_over_edits(engine: OffloadEngine) -> None:
    """At a forward's start: refuse it inside flextensor.editing(), or when streamed weights were written
    in place outside it since the last forward (their edits are then discarded, see edits_discarded);
    take what was written into ``state_dict()`` tensors (see take_pack_writes)."""
    if engine.editing is not None:
        raise UnsupportedOperationError(
            "a forward of the model inside flextensor.editing(model): run it after the with-block, once "
            "the edits are written back"
        )
    outside = engine.outside_edits
    if outside.unsettled:
        raise UnsupportedOperationError(f"a forward after a refused edit: {outside.unsettled_text()}")
    if outside.touched:
        outside.touched.clear()  # the last edit, if any, went through whole
    settle_changes(engine)


def settle_changes(engine: OffloadEngine) -> None:
    """Deal with every change the watch saw (plan time): take the writes into ``state_dict()`` tensors,
    discard in-place edits of streamed weights, then raise for what could not be kept."""
    edited, written = engine.watch.changes()
    if not edited and not written:
        return
    lost = take_pack_writes(engine, written)
    if edited:
        discard_edits(engine, edited)
    engine.watch.settled(engine.units.values())
    if edited:
        raise edits_discarded(edited)
    if lost:
        raise UnsupportedOperationError(
            f"tensors of model.state_dict() were written in place (e.g. state_dict()[key].copy_(value)) "
            f"for offload unit(s) {_names(lost)}, whose host copy those tensors do not reach (shared "
            "between processes, compressed or read from the checkpoint file): the write was not kept and "
            "the model computes with the weights it had. Write them inside `with flextensor.editing(model): "
            "model.load_state_dict(...)` instead"
        )


def take_pack_writes(engine: OffloadEngine, written: list[Unit]) -> list[Unit]:
    """Tensors of ``state_dict()`` (views of the units' host packs) were written in place: make every unit
    compute with its pack again (see [Note: writes into state_dict tensors]). Returns the units whose
    packs such a write cannot reach."""
    lost = []
    for unit in written:
        pack = unit.pack
        if pack is None or pack.shared or pack.coded or pack.disk:
            lost.append(unit)
        elif unit.resident and unit.storage is not None and unit.mapped is None:
            engine.runtime.synchronize()
            with torch.no_grad():
                for _, _, entry in unit.parameters:
                    target, value = entry.view(unit.storage), pack.view(entry)
                    if not torch.equal(target, value.to(target.device)):
                        target.copy_(value)
        else:
            _forget_arena_contents(engine.store, unit)
    return lost


def _forget_arena_contents(store: DeviceStore, unit: Unit) -> None:
    for cell in unit.cells:  # none for a unit held on the host: its next layout loads it anyway
        store.owner[cell] = None


def discard_edits(engine: OffloadEngine, edited: list[Unit]) -> None:
    """Streamed weights were written in place outside flextensor.editing(): the bytes written may be
    another unit's. Forget what their arena ranges hold, so every unit there reloads its pack, and make
    their parameters view their ranges again (``weight.set_(t)`` re-points a parameter)."""
    for unit in edited:
        _forget_arena_contents(engine.store, unit)
    point_back(edited, engine.runtime.device)


def _names(units: list[Unit]) -> str:
    return ", ".join(repr(u.name) for u in units[:5]) + (", ..." if len(units) > 5 else "")


def edits_discarded(edited: list[Unit]) -> UnsupportedOperationError:
    """The error that refuses a forward after :func:`discard_edits`, before it computes."""
    return UnsupportedOperationError(
        f"the weights of offload unit(s) {_names(edited)} were changed in place outside "
        "flextensor.editing(model) (e.g. weight.mul_(), copy_(), set_(), an init function): a streamed "
        "weight views a device range that other units' weights overwrite (and a pipeline component's "
        "weights are not on the device at all between its phases), so the edit was discarded and those "
        "units reload their weights from host memory. Make the edit inside `with flextensor.editing(model): "
        "...`, then run the model"
    )


@contextmanager
def editing(model: nn.Module) -> Iterator[nn.Module]:
    """Make an offloaded model's weights editable in place for the duration of the block.

    Inside, every weight holds its unit's real values on the device, so libraries may change them as on
    a model without offload: peft ``merge_adapter`` / ``unmerge_adapter``, diffusers ``fuse_lora`` /
    ``unfuse_lora``, ``load_state_dict``, ``weight.mul_()``. On exit the edited values are written back to
    the host packs and every later forward computes with them. Modules added meanwhile (LoRA layers) keep
    their new parameters resident on the device. A streamed unit's weights come to the device when first
    used and go back to its host pack when the memory the model may use is full (see [Note: editing
    within the budget] in engine/edit_session.py); no forward may run inside the block. A diffusers pipeline
    or a mapping of modules edits every offloaded component.
    """
    from flextensor.api import engine_of
    from flextensor.pipelines.pipeline import components_of

    components = components_of(model)
    target = model
    if components is None and callable(getattr(model, "get_base_model", None)):
        target = model.get_base_model()  # a peft PeftModel wraps the offloaded model
    modules = list(components.values()) if components is not None else [target]
    engines = []
    for module in modules:
        try:
            engines.append(engine_of(module))
        except NotOffloadedError:
            if components is None:
                raise  # a pipeline's components that are not offloaded need no editing
    for engine in engines:  # before any session begins or a layout is given back: nothing to undo
        _refuse_unwritable_packs(engine)
        refuse_to_begin(engine)
        # Written in place before the block: the session would take those bytes as the weights.
        settle_changes(engine)
    sessions: list[EditSession] = []
    working_set = working_set_for(engines)  # may give layouts back
    try:
        for engine in engines:
            session = EditSession(engine, working_set)
            session.begin()  # a refused begin changed nothing: no end() for it
            sessions.append(session)
        with FirstUse(sessions):
            yield model
    finally:
        errors = []
        for session in reversed(sessions):
            try:
                session.end()
            except Exception as exc:  # finish every component, then raise the first failure
                errors.append(exc)
        if sessions:
            working_set.log_summary()
        if errors:
            raise errors[0]


_UNWRITABLE_PACKS = (
    (
        "disk",
        "stream from the checkpoint file (their packs did not fit host_memory_budget), which is the only "
        "copy of their weights: flextensor.editing cannot write them; raise host_memory_budget so every "
        "pack fits, or save the edited weights to a new checkpoint and offload from it",
    ),
    (
        "coded",
        "hold their weights compressed (compression='lossless'): flextensor.editing cannot write them "
        "yet; release the model, edit it and offload it again, or offload it with compression off",
    ),
)
"""Packs editing cannot write, by the pack attribute that marks them: the checkpoint file is the only copy
of a disk unit's weights, and not ours to write (see [Note: disk tier] in host/disk.py); a compressed pack
would have to be encoded again."""


def _refuse_unwritable_packs(engine: OffloadEngine) -> None:
    for kind, why in _UNWRITABLE_PACKS:
        names = [u.name for u in engine.units.values() if u.pack is not None and getattr(u.pack, kind)]
        if names:
            raise UnsupportedOperationError(
                f"{len(names)} unit(s) of this model ({', '.join(names[:4])}) {why}"
            )
