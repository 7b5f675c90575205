"""``flextensor.editing``'s sessions: streamed weights given device copies as they are used, within the
memory the model may use, and written back to their host packs.

[Note: editing within the budget]
Inside ``flextensor.editing(model)`` a streamed unit's parameters first view what they view between
forwards (their arena range, or an empty placeholder for a pipeline's component held on the host). When
something uses one of them, a torch function or method that takes it (seen by :class:`FirstUse`, a
TorchFunctionMode open only for the with-block) or a read or replacement of its ``.data`` (the guard in
weights/edits.py), the whole unit gets private device copies of its weights, read from its pack, and the
library edits them as on a model without offload. Reading the shape, dtype or device of a weight that
views its arena range is no use: the range has them.

The copies live in a working set shared by every model the with-block opened (a pipeline's components): at
most the device memory those models may use (their budget; without one, the device's share) less what their
layouts hold (the arena sits idle meanwhile, but its ranges are what the units not used view, so it stays).
Where that leaves less than their largest streamed unit (a budget the plan fills), the layouts give their
arenas back first, the largest first: the streamed units then hold placeholders until used, as a pipeline's
component held on the host does, resident units keep their storage (a caller may call one that carries no
hooks), the set has the budget less what resident units hold (at least the arena given back: more than a
unit), and the next forward allocates the arena again. Past the limit, the unit used longest ago is written
back to its pack and views its range (or a placeholder) again; its next use reads the edited pack. A unit is
kept instead while anything outside holds a view of one of its weights (its storage's use count is above what
the parameter and the session hold: a ``w = p.data`` kept across other layers), so that a write through that
view is never lost; and while one of its weights has a new shape or dtype, which its pack cannot take (the
with-block's end refuses it). A merge that goes through the layers in turn (peft ``merge_adapter``, diffusers
``fuse_lora``, ``load_state_dict``) so holds a few units at once; one that takes every weight first
(``state_dict()`` inside the block) holds them all, as on a model without offload. A device out of memory
while a unit is copied in writes back every unit it can, then tries once more.

One torch call that takes weights of more units than the set holds (``torch.stack`` of every layer's, a
foreach op, an optimizer's step) keeps them all until it has run: none is written back while the call
still has to see it. A write that no use announced (from another thread than the one that opened the
block, whose mode it is, or with torch function handling disabled) lands in the arena and is lost; the
weights' version counters show it, and the block's end raises.

At the block's end every unit still holding copies is written back, and every parameter views its device
bytes again (or a placeholder, for a pipeline's component held on the host). Units never used are left
as they were: their packs are not written (a pack shared between processes stays shared).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from flextensor.common.sizes import format_bytes
from flextensor.errors import UnsupportedOperationError
from flextensor.host.packs import UnitPack
from flextensor.store.units import Unit, parameter_aliases

if TYPE_CHECKING:
    from flextensor.engine.controller import OffloadEngine

logger = logging.getLogger("flextensor")

__all__ = ["EditSession", "FirstUse", "WorkingSet", "point_back", "refuse_to_begin", "working_set_for"]

_DATA = torch._C.TensorBase.data  # the real ``.data`` descriptor, under weights/edits.py's guard
_GUARD = "_flextensor_guard"  # see weights/edits.py

_METADATA_PROPERTIES = frozenset(
    {
        *("shape", "dtype", "ndim", "nbytes", "itemsize", "layout", "device", "is_cuda", "is_cpu", "is_meta"),
        *("requires_grad", "is_leaf", "grad", "grad_fn"),
    }
)
_METADATA_METHODS = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.__len__,
    }
)
"""What a weight viewing its arena range answers as it would with its values: no use of them."""


def _reads_metadata_only(func: Any) -> bool:
    descriptor = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and type(descriptor).__name__ == "getset_descriptor":
        return descriptor.__name__ in _METADATA_PROPERTIES  # type: ignore[union-attr]
    return func in _METADATA_METHODS


def _storage_uses(param: nn.Parameter) -> int:
    """How many tensors hold the storage ``param``'s value is in, as counted now (a constant more than
    the holders: what matters is the difference between two counts)."""
    value = _DATA.__get__(param)
    storage = value.untyped_storage()  # one Python object per storage: one held outside is a holder too
    return torch._C._storage_Use_Count(storage._cdata) + sys.getrefcount(storage)


Key = tuple["EditSession", Unit]  # a unit of one session: the working set's entries


class WorkingSet:
    """The units holding device copies in one with-block, used longest ago first (see [Note: editing
    within the budget]). ``limit_bytes``: None for no limit (a CPU without a budget)."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes
        self.live: OrderedDict[Key, int] = OrderedDict()
        self.held_bytes = 0
        self.peak_bytes = 0  # the most held at once (logged at the block's end)
        self.written_back = 0  # units written back before the block's end
        self._lock = threading.RLock()  # a .data read from another thread is a use too

    def use(self, session: EditSession, unit: Unit, keep: Collection[Key] = ()) -> None:
        """Give ``unit`` copies unless it has them, making room first; never write back a unit of
        ``keep`` (the others the same call uses: it must see all of them)."""
        key = (session, unit)
        with self._lock:
            if key in self.live:
                self.live.move_to_end(key)
                return
            self._make_room(unit.nbytes, keep)
            try:
                session.give_copies(unit)
            except torch.OutOfMemoryError:
                self._make_room(None, keep)  # everything that can go, then once more
                session.give_copies(unit)
            self.live[key] = unit.nbytes
            self.held_bytes += unit.nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _make_room(self, nbytes: int | None, keep: Collection[Key]) -> None:
        """Write back units, longest unused first, until ``nbytes`` more fit the limit (None: all)."""
        if nbytes is not None and (self.limit_bytes is None or self.held_bytes + nbytes <= self.limit_bytes):
            return
        for key in list(self.live):
            if nbytes is not None and self.held_bytes + nbytes <= self.limit_bytes:  # type: ignore[operator]
                return
            session, unit = key
            if key not in keep and session.take_copies_back(unit):
                self.held_bytes -= self.live.pop(key)
                self.written_back += 1

    def log_summary(self) -> None:
        limit = "no limit" if self.limit_bytes is None else f"limit {format_bytes(self.limit_bytes)}"
        logger.info(
            "editing held at most %s of weight copies on the device (%s); %d unit(s) written back before "
            "the end",
            format_bytes(self.peak_bytes),
            limit,
            self.written_back,
        )

    def forget(self, session: EditSession) -> None:
        for key in [k for k in self.live if k[0] is session]:
            self.held_bytes -= self.live.pop(key)


def point_back(units: Iterable[Unit], device: torch.device) -> None:
    """Make the parameters of ``units`` view their device bytes again (or hold placeholders while the
    units have none, until the next layout)."""
    for unit in units:
        if unit.storage is not None:
            unit.point_parameters()
        else:
            for _, param, entry in unit.parameters:
                param.data = torch.empty(0, dtype=entry.dtype, device=device)


def refuse_to_begin(engine: OffloadEngine) -> None:
    """Raise when ``engine``'s weights cannot be edited now; before anything changes."""
    if engine.bracket.running:
        raise UnsupportedOperationError(
            "flextensor.editing(model) cannot start inside a forward of the model; edit between forwards"
        )
    if engine.editing is not None:
        raise UnsupportedOperationError("flextensor.editing(model) is already open for this model")
    if engine.graphs.captured:
        raise UnsupportedOperationError(
            "a CUDA graph captured this model's arena addresses and contents; editing its weights would "
            "leave the graph replaying stale ones: call flextensor.release(model), edit, offload again"
        )


def working_set_for(engines: Sequence[OffloadEngine]) -> WorkingSet:
    """The working set of one with-block over ``engines``: what they may use on the device less what
    their layouts hold, at least their largest streamed unit; no limit when one of them has none
    (a CPU without a budget). Layouts that leave less than that unit are given back first (see [Note:
    editing within the budget])."""
    limits = [engine.policy.memory_limit() for engine in engines]
    if not engines or any(limit is None for limit in limits):
        return WorkingSet(None)
    limit: int = max(limits)  # type: ignore[type-var]
    room = limit - _held_bytes(engines)
    if room < _largest_streamed_bytes(engines):
        freed = 0
        for engine in sorted(engines, key=lambda e: e.store.arena_bytes(), reverse=True):
            freed += engine.vacate(keep_resident=True)
            room = limit - _held_bytes(engines)
            if room >= _largest_streamed_bytes(engines):
                break
        if freed:
            logger.info(
                "editing: the streamed units' arenas gave back %s so that edits stay within %s; the next "
                "forward allocates them again",
                format_bytes(freed),
                format_bytes(limit),
            )
    return WorkingSet(max(room, _largest_streamed_bytes(engines)))


def _held_bytes(engines: Iterable[OffloadEngine]) -> int:
    return sum(engine.store.device_bytes_held() for engine in engines)


def _largest_streamed_bytes(engines: Iterable[OffloadEngine]) -> int:
    """The largest unit that gets copies when used."""
    return max((u.nbytes for e in engines for u in e.units.values() if not u.resident), default=0)


class FirstUse(TorchFunctionMode):
    """Gives a unit its copies when a torch function or method is about to use one of its parameters
    (open for the with-block only: no cost outside it)."""

    def __init__(self, sessions: Iterable[EditSession]) -> None:
        super().__init__()
        self._sessions = {id(p): s for s in sessions for p in s.streamed_parameters()}

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        metadata_only = _reads_metadata_only(func)
        used = [
            (self._sessions[id(leaf)], leaf)
            for leaf in tree_leaves((args, kwargs))
            if isinstance(leaf, nn.Parameter) and id(leaf) in self._sessions
        ]
        if used:
            # One call may take weights of more units than the working set holds (torch.stack of every
            # layer's, a foreach op): none of them goes back before the call has run.
            keep = {key for session, param in used if (key := session.key_of(param)) is not None}
            for session, param in used:
                session.use(param, metadata_only, keep)
        return func(*args, **kwargs)


class EditSession:
    """One engine's weights made editable (:meth:`begin`), given copies as they are used (:meth:`use`)
    and written back (:meth:`end`)."""

    def __init__(self, engine: OffloadEngine, working_set: WorkingSet) -> None:
        self.engine = engine
        self.working_set = working_set
        self._unit_of: dict[int, Unit] = {}  # id of each streamed parameter -> its unit
        self._copies: dict[Unit, list[tuple[torch.Tensor, int]]] = {}  # unit -> (copy, its storage uses)
        self._resting: dict[Unit, int] = {}  # streamed unit -> its weights' version while it holds no copies
        self._unseen: list[str] = []  # units written unseen before they got copies

    def streamed_parameters(self) -> list[nn.Parameter]:
        return [p for u in self.engine.units.values() if not u.resident for _, p, _ in u.parameters]

    def begin(self) -> None:
        engine = self.engine
        refuse_to_begin(engine)
        engine.runtime.synchronize()  # copies in flight may still write the arena
        for unit in engine.units.values():
            if not unit.resident:  # a resident unit's parameters view storage of its own: edits stay there
                self._unit_of.update((id(param), unit) for _, param, _ in unit.parameters)
                self._resting[unit] = unit.weights_version()
        engine.editing = self

    def key_of(self, param: nn.Parameter) -> Key | None:
        unit = self._unit_of.get(id(param))
        return None if unit is None else (self, unit)

    def use(self, param: nn.Parameter, metadata_only: bool = False, keep: Collection[Key] = ()) -> None:
        """``param`` is about to be used: give its unit copies (if it is a streamed one's), writing back
        none of ``keep``. A read of its shape, dtype or device is no use while it views its arena range,
        which has them."""
        unit = self._unit_of.get(id(param))
        if unit is not None and not (metadata_only and unit.storage is not None):
            with torch._C.DisableTorchFunction():  # the session's own reads and writes are no uses
                self.working_set.use(self, unit, keep)

    def give_copies(self, unit: Unit) -> None:
        if unit.weights_version() != self._resting[unit]:
            self._unseen.append(unit.name)  # written in its arena range unseen: lost, refused at the end
        device = self.engine.runtime.device
        with torch.inference_mode(False), torch.no_grad():
            copies = [unit.kept(entry).to(device, copy=True) for _, _, entry in unit.parameters]
            given = []
            for (_, param, _), copy in zip(unit.parameters, copies, strict=True):
                _DATA.__set__(param, copy)
                given.append((copy, _storage_uses(param)))
        self._copies[unit] = given

    def take_copies_back(self, unit: Unit) -> bool:
        """Write ``unit``'s values back to its pack and view its device bytes again; False (nothing done)
        while a view of one of its weights is held outside, or one has a new shape or dtype."""
        given = self._copies[unit]
        for (_, param, entry), (copy, uses) in zip(unit.parameters, given, strict=True):
            now = _storage_uses(param)  # before any alias of our own is made here
            value = _DATA.__get__(param)
            kept = tuple(value.shape) == entry.shape and value.dtype == entry.dtype
            ours = value.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr()
            del value
            if not kept or now > (uses if ours else uses - 1):  # not ours: the session holds none of it
                return False
        self._write_back(unit)
        del self._copies[unit]
        self.point_back([unit])
        self._resting[unit] = unit.weights_version()
        return True

    def end(self) -> None:
        """Write every unit still holding copies back and view the device bytes again; raise for an edit
        that cannot be kept (a new shape or dtype), after leaving that weight as it was."""
        from flextensor.weights.edits import OutsideEdits
        from flextensor.weights.structure_guard import watch_structure

        engine = self.engine
        engine.editing = None
        engine.outside_edits = OutsideEdits()  # the user made the edit whole, or accepts the model as it is
        self.working_set.forget(self)
        engine.runtime.synchronize()
        names = parameter_aliases(engine.model)
        refused: list[str] = []
        # Written in place without a use seen (another thread, torch function handling disabled): the
        # write went to the arena, which the end forgets.
        resting = [(u, v) for u, v in self._resting.items() if u not in self._copies]
        unseen = self._unseen + [u.name for u, version in resting if u.weights_version() != version]
        with torch.inference_mode(False), torch.no_grad():
            for unit in list(engine.units.values()):
                self._rename(unit, names)
                if unit in self._copies:
                    refused += self._write_back(unit)
                elif unit.resident:
                    refused += self._write_resident(unit)
        self._copies.clear()
        self.point_back(engine.units.values())
        for unit in engine.units.values():
            if unit.resident:
                unit.storage_version = unit.weights_version()
        engine.after_edit(self._added_parameters(names))
        watch_structure(engine)  # parameter holders may have changed
        if unseen:
            raise UnsupportedOperationError(
                f"the weights of offload unit(s) {', '.join(unseen[:5])} were written in place inside "
                "flextensor.editing(model) where it could not see the write (from another thread than the "
                "one that opened the block, or with torch function handling disabled): the write landed in "
                "the shared device arena and was discarded. Make the edit in the thread that opened the "
                "with-block"
            )
        if refused:
            raise UnsupportedOperationError(
                f"an edit changed the shape or dtype of offloaded weights, which their host packs cannot "
                f"hold: {', '.join(refused)}; those weights were put back as they were, but nothing else "
                "the edit changed was undone (modules it replaced, the model's config: e.g. "
                "resize_token_embeddings resizes the output layer and the config too), so the model may "
                "no longer be consistent. Load it again (or call flextensor.release(model) and undo the "
                "rest by hand), make the change before offload(), then offload"
            )

    @staticmethod
    def _values(unit: Unit) -> tuple[list[tuple[Any, torch.Tensor]], list[str]]:
        """(entry, value) of ``unit``'s parameters whose values its pack can take, and the names of those
        it cannot (a new shape or dtype)."""
        kept, refused = [], []
        for fqn, param, entry in unit.parameters:
            value = _DATA.__get__(param)
            if tuple(value.shape) != entry.shape or value.dtype != entry.dtype:
                refused.append(f"{fqn} ({tuple(value.shape)} {value.dtype}, was {entry.shape} {entry.dtype})")
            else:
                kept.append((entry, value))
        return kept, refused

    def _write_back(self, unit: Unit) -> list[str]:
        """Copy ``unit``'s values into its pack; the names of those it cannot take (new shape or dtype)."""
        kept, refused = self._values(unit)
        for entry, value in kept:
            assert unit.pack is not None, f"unit {unit.name!r} lost its weights"
            if unit.pack.shared:
                if torch.equal(unit.pack.view(entry), value.cpu()):
                    continue  # unchanged: the pack stays shared
                unit.pack = self._private_pack(unit)
            unit.pack.view(entry).copy_(value)
        return refused

    def _write_resident(self, unit: Unit) -> list[str]:
        """Copy into ``unit``'s device storage the values its parameters were given meanwhile (a library
        replacing ``.data``), and refresh its pack from the storage; the names of those it cannot take."""
        kept, refused = self._values(unit)
        for entry, value in kept:
            target = entry.view(unit.storage)
            if target.data_ptr() != value.data_ptr():
                target.copy_(value)
        pack, storage = unit.pack, unit.storage
        assert storage is not None
        if pack is not None and not (pack.shared and torch.equal(pack.buffer, storage.cpu())):
            if pack.shared:
                unit.pack = pack = self._private_pack(unit)
            pack.buffer.copy_(storage)
        return refused

    def _rename(self, unit: Unit, names: dict[int, list[str]]) -> None:
        """Follow the parameters of ``unit`` to their names now (a LoRA layer wraps a linear layer: its
        weight becomes ``...base_layer.weight``; a tied weight keeps the name it had while that is still
        one of its names); forget those no longer in the model."""
        from flextensor.weights.edits import unguard_parameter

        kept = []
        for fqn, param, entry in unit.parameters:
            now = names.get(id(param))
            name = None if not now else fqn if fqn in now else now[0]
            if name is None:
                logger.info("offloaded parameter %s left the model while editing; no longer streamed", fqn)
                self.engine.owner_of.pop(id(param), None)
                unguard_parameter(param)
                continue
            kept.append((name, param, entry))
            param.__dict__[_GUARD] = (param.__dict__[_GUARD][0], name)  # a unit's: its 2-tuple form
        unit.parameters[:] = kept

    def _private_pack(self, unit: Unit) -> UnitPack:
        """A pack of this process's own with ``unit``'s weights: edits never reach a segment that other
        processes read (share_host_memory)."""
        shared = unit.pack
        assert shared is not None
        pack = UnitPack(unit.name, unit.entries, unit.nbytes, self.engine.store.pin)
        pack.buffer.copy_(shared.buffer)
        shared.free()
        logger.info("unit %s was edited: it keeps a private host copy instead of the shared one", unit.name)
        return pack

    def point_back(self, units: Iterable[Unit]) -> None:
        point_back(units, self.engine.runtime.device)

    def _added_parameters(self, names: dict[int, list[str]]) -> dict[str, str]:
        """Parameters inside offload units that belong to no unit (added while editing): FQN -> why they
        stay resident."""
        engine = self.engine
        streamed = {id(p) for u in engine.units.values() for _, p, _ in u.parameters}
        added = {}
        for unit in engine.units.values():
            prefix = unit.name + "." if unit.name else ""
            for name, param in unit.module.named_parameters():
                fqn = prefix + name
                if id(param) not in streamed and fqn not in engine.resident_reasons:
                    added[fqn] = f"added inside unit {unit.name!r} after offload(); kept on the device"
        return added
