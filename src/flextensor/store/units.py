"""Offload units: one module's streamable parameters, where their weights are, and the events guarding them.

A unit's placement is one of :class:`Placement`; the device store (store/device_store.py) moves units between
them at plan time. Whether a streamed unit's arena range holds its weights right now is not a flag on the
unit: it is the range's occupancy (see [Note: occupancy cells] in plan/layout.py), so loading a unit evicts
the units it overlaps without visiting them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.dlpack import from_dlpack, to_dlpack

from flextensor.host.packs import PackedParameter, UnitPack

__all__ = ["Placement", "Unit", "parameter_aliases"]


def parameter_aliases(model: nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> every name it has in ``model`` (a tied weight has several), in
    ``named_parameters`` order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


class Placement(enum.Enum):
    """Where a unit's weights are, and what that costs on each side of the link.

    HOST: only in its host pack; its parameters view the pack or hold empty placeholders while a layout
        is being replaced. Device: nothing. Host: its pack.
    STREAMED: its parameters view a fixed range of the arena, shared with other units; the range holds
        its weights while it is the occupant of all the range's cells (a copy of its pack puts them
        there). Device: its share of the arena. Host: its pack (pinned on CUDA).
    RESIDENT: device storage of its own, loaded once; the host pack is kept because some saved plan
        streams the unit. Device: its bytes. Host: its pack.
    DEVICE_ONLY: device storage of its own, and no host pack: the unit is resident in every saved plan,
        so the storage is the only copy of its weights (see [Note: one copy of a resident unit] in
        store/device_store.py). Device: its bytes. Host: nothing.
    """

    HOST = "host"
    STREAMED = "streamed"
    RESIDENT = "resident"
    DEVICE_ONLY = "device_only"

    @property
    def on_device(self) -> bool:
        """Whether the unit has device storage of its own (not an arena range)."""
        return self in (Placement.RESIDENT, Placement.DEVICE_ONLY)


@dataclass(eq=False)
class Unit:
    """One offload unit. ``index`` is its position in the engine's list (stable for the model's life).

    ``parameters``: (FQN, parameter, where it sits in the pack); ``entries`` and ``nbytes`` are the
    pack's layout, kept to build the pack again after it was dropped. ``storage``: the unit's device bytes
    (its own, or its arena range), None in HOST. ``cells``: the occupancy cells its arena range covers.
    ``prefetch_next``: the units whose copies its post-hook issues in steady state, nearest first.
    ``staging``: None when its pack is copied straight to the device; else the staging ring its copies go
    through (see [Note: host budget] in store/host_budget.py).
    ``storage_version``: :meth:`weights_version` when the device storage's contents last matched the pack
    (an in-place edit of a resident unit's weights bumps it).
    ``mapped``: its pinned pack seen from the device: when resident, that is its storage, and it holds no
    device memory (see [Note: mapped units] in store/mapping.py). None: not mapped.
    ``aliases``: (path, module) of the modules outside every unit that hold some of its weights (tied):
    a call of one is hooked as a call of the unit (see [Note: tied aliases] in phases/discovery.py).
    ``pack_writes``: an empty tensor whose version counter the unit's ``state_dict()`` tensors share, so an
    in-place write into one of them shows as one counter (see [Note: writes into state_dict tensors] in
    weights/edits.py).
    """

    name: str
    index: int
    module: nn.Module
    pack: UnitPack | None
    parameters: list[tuple[str, nn.Parameter, PackedParameter]]
    copy_done: Any
    compute_done: Any
    placement: Placement = Placement.HOST
    storage: torch.Tensor | None = None
    cells: tuple[int, ...] = ()
    prefetch_next: tuple[Unit, ...] = ()
    storage_version: int = 0
    uploads: int = 0  # times given resident storage (a plan switch that keeps it resident uploads nothing)
    pack_rebuilds: int = 0  # times its host pack was built again from device storage
    staging: Any = None  # the StagingRing its copies go through when its pack is not pinned (host budget)
    aliases: tuple[tuple[str, nn.Module], ...] = ()
    mapped: torch.Tensor | None = None  # its pinned pack seen from the device (store/mapping.py)
    pack_writes: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    entries: tuple[PackedParameter, ...] = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.pack is not None, "a unit starts with its weights packed on the host"
        self.entries, self.nbytes = self.pack.entries, self.pack.nbytes

    @property
    def resident(self) -> bool:
        return self.placement.on_device

    @property
    def device_nbytes(self) -> int:
        """The device memory the unit takes when resident: none when mapped."""
        return 0 if self.mapped is not None else self.nbytes

    def held_by(self, module: nn.Module) -> bool:
        """Whether ``module`` holds one of this unit's parameters itself (an alias still tied to it)."""
        mine = {id(param) for _, param, _ in self.parameters}
        return any(id(param) in mine for param in module._parameters.values() if param is not None)

    def live_aliases(self) -> tuple[tuple[str, nn.Module], ...]:
        """The aliases still holding one of its parameters: a tied weight that left the unit (read
        outside it, untied by an edit) takes its holder's alias role with it."""
        return tuple((path, alias) for path, alias in self.aliases if self.held_by(alias))

    def kept(self, entry: PackedParameter) -> torch.Tensor:
        """One parameter's weights where they are kept for sure: the device storage of a resident unit
        (what it computes with, edits included), else the host pack. Never a streamed unit's arena range,
        which may hold another unit's bytes."""
        if self.placement.on_device:
            assert self.storage is not None
            return entry.view(self.storage)
        assert self.pack is not None, f"unit {self.name!r} lost its weights"
        return self.pack.view(entry)

    def point_parameters(self) -> None:
        """Alias every parameter to its place in ``storage`` (plan time only).

        Each parameter gets a storage object of its own over those bytes (a DLPack alias, which keeps the
        arena alive as a view would): to the compiler, weights that view one arena are inputs aliasing
        each other, and the compiled hot path declares a unit's weights written by its pre-op (see
        [Note: compiled hot path] in hooks/compiled_ops.py), which aliased inputs would turn into a copy of
        the whole arena per call."""
        assert self.storage is not None
        for _, param, entry in self.parameters:
            own = from_dlpack(to_dlpack(self.storage[entry.offset : entry.offset + entry.nbytes]))
            param.data = entry.shaped(own.view(entry.dtype))

    def weights_version(self) -> int:
        """Grows with every in-place write through the unit's parameters (``p.mul_()``, ``p.copy_()``);
        copies into the storage do not change it, and neither does a write through ``p.data``, which is a
        new tensor with a version counter of its own each time. Plan time only: a loop over the
        parameters."""
        return sum(param._version for _, param, _ in self.parameters)

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {self.nbytes} bytes, {self.placement.value})"
