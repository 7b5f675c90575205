"""Packing: a model's selected parameters into host packs, everything else to the device, all undoable.

:class:`Packing` is a context manager around ``offload()``'s changes to the model. It packs each unit's
parameters (into private pinned packs, or into the node's shared segment with ``share_host_memory``),
moves the parameters and buffers that never stream to the device, and records everything it changed: if
anything fails before :meth:`Packing.commit`, leaving the context puts every parameter and buffer back
where and as it was (values, device, strides) and frees every pack. With ``weights`` (a checkpoint matched
to the model, see host/checkpoint.py) the packs and the resident tensors are read from the checkpoint instead
of copied from the model; meta parameters then become new parameter objects, put back on failure.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flextensor.common.progress import progress_bar
from flextensor.config.schema import OffloadConfig
from flextensor.device.runtime import DeviceRuntime, Target
from flextensor.errors import UnsupportedModelError
from flextensor.host.packs import PackedParameter, UnitPack, pack_unit
from flextensor.store.units import Unit
from flextensor.weights.selection import Selection, select
from flextensor.weights.subclasses import is_wrapper_subclass, set_parameter_value

if TYPE_CHECKING:
    from flextensor.host.checkpoint import CheckpointLoad

logger = logging.getLogger("flextensor")

__all__ = ["Packing", "check_offloadable", "is_offloaded_module", "mark_offloaded", "unmark_offloaded"]

_OFFLOADED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Every module of every model offloaded in this process: offloading one of them again would pack
weights that already view another model's arena."""


def check_offloadable(model: object) -> None:
    """Raise UnsupportedModelError, before anything changes, for what offload() cannot take as it is."""
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"offload() takes a torch.nn.Module, got {type(model).__name__}")
    for path, module in model.named_modules():
        if module in _OFFLOADED_MODULES:
            raise UnsupportedModelError(
                f"{type(model).__name__} contains {path or 'itself'}, a module of a model flextensor already "
                "offloads; release that model first (flextensor.release) or offload it as a whole"
            )
        if hasattr(module, "_hf_hook"):
            raise UnsupportedModelError(
                f"module {path or '<root>'} carries accelerate hooks (cpu_offload, device_map dispatch), "
                "which move weights on their own; remove them first with "
                "accelerate.hooks.remove_hook_from_module(model, recurse=True) and load the weights"
            )
        # Any run of a diffusers pipeline leaves an empty hook registry (its cache_context): no hook.
        if getattr(getattr(module, "_diffusers_hook", None), "hooks", None):
            raise UnsupportedModelError(
                f"module {path or '<root>'} carries diffusers hooks (group offloading, layerwise casting); "
                "remove them first (e.g. pipe.remove_all_hooks() or reload the model)"
            )
    for name, param in model.named_parameters():
        if param.layout is not torch.strided:
            raise UnsupportedModelError(
                f"parameter {name!r} is {param.layout} (not a dense tensor), which flextensor cannot pack; "
                "keep it out of offloading with exclude_patterns, or make it dense first"
            )


def is_offloaded_module(module: nn.Module) -> bool:
    """Whether ``module`` is part of a model flextensor offloads."""
    return module in _OFFLOADED_MODULES


def mark_offloaded(model: nn.Module) -> None:
    for module in model.modules():
        _OFFLOADED_MODULES.add(module)


def unmark_offloaded(model: nn.Module) -> None:
    for module in model.modules():
        _OFFLOADED_MODULES.discard(module)


class Packing:
    """Pack a selection's units and move the rest to the device; undo it all unless committed."""

    def __init__(
        self, model: nn.Module, selection: Selection, target: Target, weights: CheckpointLoad | None = None
    ) -> None:
        self.model = model
        self.weights = weights
        self.selection = selection
        self.target = target
        self.runtime: DeviceRuntime = target.runtime
        self.units: list[Unit] = []
        self._packs: list[UnitPack] = []
        self._packed: list[list[tuple[nn.Parameter, PackedParameter]]] = []  # per unit, as packed
        self._original_devices = {id(p): p.device for p in model.parameters()}
        self._moved: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._moved_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        # Meta parameters attached to a shared segment are new objects: (module, key, original, new).
        self._swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        self._undo_first: list[Callable[[], None]] = []
        self._done = False

    def __enter__(self) -> Packing:
        return self

    @property
    def pins_while_packing(self) -> bool:
        """Whether packs shared between processes are page-locked as they are built: under a host budget
        they are built pageable and the budget pins those that fit (see [Note: host budget] in
        store/host_budget.py). Private packs of a model with weights are always built pageable and pinned
        afterwards, several at once (host_budget.PIN_THREADS); packs read from a checkpoint are pinned by
        their readers unless the budget stages some (see read_checkpoint)."""
        return self.target.pin and self.target.host_budget_bytes is None

    def on_undo(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` first if the offload fails (e.g. remove the hooks an engine added)."""
        self._undo_first.append(callback)

    def pack_units(self, config: OffloadConfig) -> list[Unit]:
        """Put every unit's parameters in host packs: private ones, or with ``config.share_host_memory``
        ranges of the node's shared segment (which meta parameters may attach to, see
        host/shared/store.py)."""
        if self.weights is None:
            self._check_resident_have_data()
        elif self.weights.untied:
            self._untie(self.weights)
            self.selection = select(self.model, config.include_patterns, config.exclude_patterns)
        pin = self.pins_while_packing
        params = dict(self.model.named_parameters())
        modules = dict(self.model.named_modules())
        named_units = [
            (name, [(fqn, params[fqn]) for fqn in self.selection.unit_parameters[name]])
            for name in self.selection.units
        ]
        if self.weights is not None:
            self._load_checkpoint(self.weights, named_units, modules)
            self._check_resident_have_data()
            return self.units
        total = sum(p.numel() * p.element_size() for _, named in named_units for _, p in named)
        what = "Packing and pinning weights" if pin and config.share_host_memory else "Packing weights"
        with progress_bar(what, total=total, unit="bytes") as bar:
            if config.share_host_memory:
                from flextensor.host.shared.store import pack_shared

                patterns = [list(config.include_patterns), list(config.exclude_patterns)]
                device = self.target.device
                decode_on = device if device.type == "cuda" else None
                shared = pack_shared(self.model, named_units, patterns, pin, bar.advance, decode_on=decode_on)
                self._packs.extend(shared.packs)
                self._swapped = shared.swapped
                for (name, _), named, pack in zip(named_units, shared.parameters, shared.packs, strict=True):
                    self._add_unit(name, modules[name], named, pack)
            else:
                for name, named in named_units:
                    # Built pageable: the host budget then pins the packs, several at once (PIN_THREADS).
                    pack = pack_unit(name, named, False)
                    self._packs.append(pack)
                    self._add_unit(name, modules[name], named, pack)
                    bar.advance(sum(e.nbytes for e in pack.entries))
        return self.units

    def _untie(self, weights: CheckpointLoad) -> None:
        """Give each tied name the checkpoint holds with values of its own a parameter of its own (on the
        meta device until it is read), put back on failure (see [Note: a checkpoint that unties tied
        weights] in host/checkpoint_ties.py); transformers' record of the tie goes, as its tie_weights
        does."""
        declared = getattr(self.model, "all_tied_weights_keys", None)
        for name, source in weights.untied:
            owner, _, key = name.rpartition(".")
            module = self.model.get_submodule(owner)
            tied = module._parameters[key]
            assert tied is not None
            own = torch.empty(source.shape, dtype=source.dtype, device="meta")
            new = nn.Parameter(own, requires_grad=tied.requires_grad)
            module._parameters[key] = new
            self._swapped.append((module, key, tied, new))
            weights.sources[id(new)] = source
            if isinstance(declared, dict) and name in declared:
                self.on_undo(functools.partial(declared.__setitem__, name, declared.pop(name)))

    def _load_checkpoint(
        self,
        weights: CheckpointLoad,
        named_units: list[tuple[str, list[tuple[str, nn.Parameter]]]],
        modules: dict[str, nn.Module],
    ) -> None:
        """Read the resident tensors from the checkpoint and start reading the units' packs (see [Note:
        reading while the model runs] in host/checkpoint.py); point the model at them."""
        from flextensor.host.checkpoint import read_checkpoint

        streamed = {id(p) for _, named in named_units for _, p in named}
        resident: dict[int, torch.Tensor] = {}
        for _, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if id(tensor) in weights.sources and id(tensor) not in streamed:
                resident.setdefault(id(tensor), tensor)
        device = self.target.device
        total = sum(weights.source_of(t).nbytes for t in resident.values())
        with progress_bar("Reading the weights kept on the device", total=total, unit="bytes") as bar:
            packs, values = read_checkpoint(
                weights,
                named_units,
                list(resident.values()),
                self.target.pin,
                device,
                bar.advance,
                self.target.host_budget_bytes,
            )
        on_disk = sum(e.nbytes for p in packs if p.disk for e in p.entries)
        logger.info(
            "reading %.2f GiB of offloaded weights from %s in the background; %.2f GiB stay in the file",
            (weights.nbytes - total - on_disk) / 2**30,
            weights.path,
            on_disk / 2**30,
        )
        # From here on only pointers change, and each change is recorded for undo.
        self._packs.extend(packs)
        places = _places(self.model)
        for (name, named), pack in zip(named_units, packs, strict=True):
            placed = [
                (fqn, self._assign_parameter(param, pack.unread_view(entry), places[id(param)]))
                for (fqn, param), entry in zip(named, pack.entries, strict=True)
            ]
            self._add_unit(name, modules[name], placed, pack)
        for key, tensor in resident.items():
            if isinstance(tensor, nn.Parameter):
                self._assign_parameter(tensor, values[key], places[key])
            else:
                self._assign_buffer(values[key], places[key])
        for key, value in weights.computed.items():
            self._assign_buffer(value.to(device), places[key])

    def _assign_parameter(
        self, param: nn.Parameter, value: torch.Tensor, places: list[tuple[nn.Module, str]]
    ) -> nn.Parameter:
        """``param`` holding ``value``: the same object when it has data, a new one for a meta parameter
        (a meta tensor cannot take real data), put in every module that holds it (tied weights)."""
        if param.device.type != "meta":
            self._moved.append((param, param.data))
            param.data = value
            return param
        new = nn.Parameter(value, requires_grad=param.requires_grad)
        for module, key in places:
            self._swapped.append((module, key, param, new))
            module._parameters[key] = new
        return new

    def _assign_buffer(self, value: torch.Tensor, places: list[tuple[nn.Module, str]]) -> None:
        for module, key in places:
            self._moved_buffers.append((module, key, module._buffers[key]))  # type: ignore[arg-type]
            module._buffers[key] = value

    def _add_unit(
        self, name: str, module: nn.Module, named: list[tuple[str, nn.Parameter]], pack: UnitPack
    ) -> None:
        self._packed.append([(p, e) for (_, p), e in zip(named, pack.entries, strict=True)])
        aliases = self.selection.unit_aliases.get(name, ())
        self.units.append(
            Unit(
                name=name,
                index=len(self.units),
                module=module,
                pack=pack,
                parameters=[(fqn, p, e) for (fqn, p), e in zip(named, pack.entries, strict=True)],
                copy_done=self.runtime.event(),
                compute_done=self.runtime.event(),
                aliases=tuple((path, self.model.get_submodule(path)) for path in aliases),
            )
        )

    def _check_resident_have_data(self) -> None:
        """Weights that stay on the device are never shared or packed: they must hold data."""
        streamed = set(self.selection.streamed_parameters())
        resident = [(n, "parameter", t) for n, t in self.model.named_parameters() if n not in streamed]
        resident += [(n, "buffer", t) for n, t in self.model.named_buffers()]
        for name, kind, tensor in resident:
            if tensor.device.type == "meta":
                raise UnsupportedModelError(
                    f"{kind} {name!r} is on the meta device and holds no data; it is not offloaded, so "
                    "it cannot come from a shared host copy either: load it (e.g. "
                    "load_state_dict(..., assign=True)) before offload()"
                )

    def move_resident_to(self, device: torch.device) -> None:
        """Move every parameter and buffer that never streams to ``device``, for good."""
        streamed = {id(p) for u in self.units for _, p, _ in u.parameters}
        for name, param in self.model.named_parameters():
            if id(param) not in streamed and param.device != device:
                moved = param.data.to(device)
                original = param.detach() if is_wrapper_subclass(param) else param.data
                set_parameter_value(param, moved, repr(name))
                self._moved.append((param, original))  # after: a refused swap moved nothing
        for module in self.model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != device:
                    self._moved_buffers.append((module, key, buf))
                    module._buffers[key] = buf.to(device)

    def commit(self) -> None:
        self._done = True
        self._moved.clear()
        self._moved_buffers.clear()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._done:
            return
        for callback in self._undo_first:
            callback()
        for module, key, buf in reversed(self._moved_buffers):
            module._buffers[key] = buf
        for module, key, original_param, _ in reversed(self._swapped):  # an untied name is swapped twice
            module._parameters[key] = original_param
        swapped = {id(new) for _, _, _, new in self._swapped}
        self.runtime.synchronize()  # copies issued so far may still read the packs
        # Every parameter as packed, from the record made at pack time: the engine may have moved some
        # out of their units since (weights kept resident). A plan from a saved profile may already have
        # dropped resident units' packs: their weights are read from their device storage then.
        for unit, packed in zip(self.units, self._packed, strict=True):
            for param, entry in packed:
                if id(param) in swapped:
                    continue
                original = self._original_devices[id(param)]
                param.data = unit.kept(entry).to(original, copy=True)
        # Last: a parameter read from a checkpoint gets its own values back, not the packed ones.
        try:
            for param, original in self._moved:
                set_parameter_value(param, original)
        finally:
            # Freeing is idempotent; a pack the engine built again is only on its unit.
            for pack in [*self._packs, *(u.pack for u in self.units if u.pack is not None)]:
                pack.free()


def _places(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id of each parameter and buffer -> every (module, attribute) that holds it (tied ones: several)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in {id(m): m for _, m in model.named_modules(remove_duplicate=False)}.values():
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is not None:
                    places.setdefault(id(tensor), []).append((module, key))
    return places
