"""Streamed parameters as the rest of the world sees them, and how one leaves the stream.

A streamed parameter views a range of the device arena that other units' weights overwrite, so what it
holds between forwards is not its value. Its true bytes are its unit's pack. So:

- ``state_dict()`` reads the packs (:meth:`StreamedWeights.state_dict_entries`);
- ``load_state_dict()`` into a streamed weight, and a dtype or device conversion that would give one new
  storage, are refused before anything changes (outside ``flextensor.editing``, see weights/edits.py);
- a parameter leaves the stream for good with storage of its own on the device: one at a time when
  discovery finds it must stay resident (:meth:`StreamedWeights.keep_resident`), all of them at
  ``release()`` (:meth:`StreamedWeights.build_released`, then :meth:`StreamedWeights.swap_in`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flextensor.errors import UnsupportedOperationError
from flextensor.store.device_store import DeviceStore
from flextensor.store.units import Unit, parameter_aliases
from flextensor.weights.edits import own_class, unguard_parameter
from flextensor.weights.subclasses import check_swappable, set_parameter_value

logger = logging.getLogger("flextensor")

__all__ = ["StreamedWeights"]


class StreamedWeights:
    """The units' parameters of one offloaded model. Shares the engine's ``units`` and ``owner_of`` maps
    (the engine removes emptied units from the first; :meth:`keep_resident` removes from the second) and
    its ``resident_reasons`` (FQN -> why it never streams)."""

    def __init__(
        self,
        model: nn.Module,
        units: dict[str, Unit],
        owner_of: dict[int, Unit],
        resident_reasons: dict[str, str],
        store: DeviceStore,
        on_leave: Callable[[], None],
    ) -> None:
        self.model = model
        self.units = units
        self.owner_of = owner_of
        self.resident_reasons = resident_reasons
        self.store = store
        self._on_leave = on_leave  # a weight left the stream (the engine re-arms its edit watch)
        self.outside_reads = 0  # weights found read outside their unit since reset_counts()
        self.handed_back = False  # release() gave every parameter storage of its own (swap_in)

    def _names_now(self) -> dict[int, list[str]]:
        """Every name of each parameter now: a weight tied within a unit has several (``state_dict()``
        holds a key for each), and a module added since offload() (a LoRA layer) may have renamed one."""
        return parameter_aliases(self.model)

    def state_dict_entries(self, prefix: str) -> list[tuple[str, torch.Tensor]]:
        """(key, tensor) for every name of every streamed parameter: its kept copy, since its arena range
        may hold another unit's bytes; a tied weight's names share one tensor, as in the model's own
        ``state_dict()``. Each tensor has a storage of its own (torch.save and safetensors refuse one
        storage viewed as several dtypes) and shares its unit's ``pack_writes`` version counter, so an
        in-place write into it is seen at the next forward's start (see [Note: writes into state_dict
        tensors] in weights/edits.py)."""
        names = self._names_now()
        entries = []
        for unit in self.units.values():
            if unit.resident or unit.pack is None:
                continue
            for fqn, param, entry in unit.parameters:
                kept = _written_through(unit.pack.standalone_view(entry), unit.pack_writes)
                kept = _as_parameter_class(kept, param)
                entries += [(prefix + name, kept) for name in names.get(id(param), [fqn])]
        return entries

    def refuse_load_state_dict(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Raise before ``load_state_dict`` writes into a streamed weight; a load that touches only other
        weights (a peft adapter's) goes through."""
        names = self._names_now()
        for unit in self.units.values():
            if unit.resident:
                continue
            for fqn, param, _ in unit.parameters:
                if any(prefix + name in state_dict for name in names.get(id(param), [fqn])):
                    raise UnsupportedOperationError(
                        f"load_state_dict() would write the offloaded weight {fqn!r} into the shared device "
                        "arena; load inside `with flextensor.editing(model): ...`, or call "
                        "flextensor.release(model) first, load, then offload again"
                    )

    def refuse_conversion(self, fn: Any) -> None:
        """Raise before ``Module._apply(fn)`` changes anything if it would give a streamed parameter new
        storage (a dtype or device conversion); a no-op move passes. Probes one empty tensor per dtype."""
        probed: set[torch.dtype] = set()
        for unit in self.units.values():
            for fqn, param, _ in unit.parameters:
                if param.dtype in probed:
                    continue
                probed.add(param.dtype)
                probe = torch.empty(0, dtype=param.dtype, device=param.device)
                applied = fn(probe)
                if applied is not probe:  # a conversion makes a new tensor; a no-op returns its input
                    raise UnsupportedOperationError(
                        f"this conversion would give the offloaded parameter {fqn!r} new storage "
                        f"({param.dtype} on {param.device} -> {applied.dtype} on {applied.device}), "
                        "detached from flextensor's buffers; call flextensor.release(model) first, "
                        "convert, then offload again"
                    )

    def keep_resident(self, param_id: int, reason: str, current_values: bool = False) -> None:
        """Stop streaming one parameter: give it device storage of its own, for good (plan time, or a
        learning forward). ``current_values``: copy what the parameter views now (its unit's arena range,
        which the unit occupies) rather than its pack, to keep an update the forward just made."""
        unit = self.owner_of.pop(param_id)
        for i, (fqn, param, entry) in enumerate(unit.parameters):
            if id(param) == param_id:
                source = param.data if current_values else unit.kept(entry)
                with torch.inference_mode(False), torch.no_grad():
                    param.data = source.to(self.store.runtime.device, copy=True)
                del unit.parameters[i]
                unguard_parameter(param)
                self.resident_reasons[fqn] = reason
                logger.info("keeping %s resident: %s", fqn, reason)
                self._on_leave()
                return

    def keep_read_outside_resident(self, param_id: int, func: Any) -> None:
        """Discovery's outside-read tracker saw a streamed weight read while its unit was idle."""
        unit = self.owner_of.get(param_id)
        if unit is None:
            # Already made resident in this forward (a unit found running inside another): the read
            # tracker's map is the forward's snapshot, and it sees keep_resident's own ``param.data =
            # ...`` as a read. Nothing streams any more, so nothing to do.
            return
        self.outside_reads += 1
        self.keep_resident(
            param_id, f"read outside its unit {unit.name!r} (by {getattr(func, '__name__', func)})"
        )

    def keep_unit_resident(self, unit: Unit, reason: str, current_values: bool) -> None:
        """Discovery found a unit that must not stream (it runs inside another, updates its weights...)."""
        for _, param, _ in list(unit.parameters):
            self.keep_resident(
                id(param), f"its unit {unit.name!r} must stay resident: {reason}", current_values
            )

    def build_released(self, device: torch.device | None) -> list[tuple[Any, str, torch.Tensor]]:
        """Every copy ``release()`` needs, built before anything changes: (owner, "data" or a buffer name,
        new tensor). Streamed parameters get storage of their own on ``device`` (default: the offload
        device); with ``device``, every other parameter and buffer moves there too."""
        target = device if device is not None else self.store.runtime.device
        built = self.store.build_released(target)
        swaps: list[tuple[Any, str, torch.Tensor]] = []
        for unit in self.units.values():
            for _, param, _ in unit.parameters:
                swaps.append((param, "data", built[id(param)]))
        if device is not None:
            for module in self.model.modules():
                for param in module._parameters.values():
                    if param is not None and id(param) not in built and param.device != device:
                        check_swappable(param)  # before anything changes: never a half-released model
                        swaps.append((param, "data", param.data.to(device)))
                for key, buf in module._buffers.items():
                    if buf is not None and buf.device != device:
                        swaps.append((module, key, buf.to(device)))
        return swaps

    def swap_in(self, swaps: list[tuple[Any, str, torch.Tensor]]) -> None:
        """Install what :meth:`build_released` built. Allocates nothing: an interrupt part-way leaves
        parameters that hold the right values either way (and the packs intact, to build from again)."""
        for owner, key, value in swaps:
            if key == "data":
                set_parameter_value(owner, value)
            else:
                owner._buffers[key] = value
        self.handed_back = True

    def unguard(self) -> None:
        """Give every unit parameter its own class back (release, or a failed offload)."""
        for unit in self.units.values():
            for _, param, _ in unit.parameters:
                unguard_parameter(param)


def _written_through(view: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """``view`` (a host copy with a storage of its own) as a tensor over the same bytes whose version
    counter is ``counter``'s: an in-place write into it, or into a view of it, bumps that one counter."""
    storage = view.untyped_storage()
    if storage.nbytes() % view.element_size():
        return view
    version = counter._version
    raw = torch.Tensor._make_subclass(torch.Tensor, counter)  # an alias: it shares the version counter
    with torch.no_grad():
        raw.set_(storage, 0, (storage.nbytes(),), (1,))
    torch._C._autograd._unsafe_set_version_counter((counter,), (version,))  # set_ wrote no weight
    return raw.view(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())


def _as_parameter_class(tensor: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """``tensor`` (a streamed parameter's host copy) as the model's own ``state_dict()`` would give it:
    of the class and with the attributes of ``param.detach()`` (a ``GGUFParameter`` with its
    ``quant_type``; a plain tensor for ``nn.Parameter`` and subclasses that keep its disabled torch
    function), so a state dict saved from an offloaded model reloads as one saved without offloading."""
    if type(param) is nn.Parameter:
        return tensor
    template = param.detach()  # only its class and attributes are read: no bytes are copied
    cls = own_class(type(template))  # the class the user's parameter had, not the guarded one
    if cls is torch.Tensor:
        return tensor
    presented = tensor.as_subclass(cls)
    presented.__dict__.update(
        (key, value) for key, value in template.__dict__.items() if not key.startswith("_flextensor")
    )
    return presented
