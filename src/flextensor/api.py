"""The public verbs: offload, release, save_profile and the introspection calls."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from .bandwidth import probe_link
from .config import OffloadConfig
from .engine import OffloadEngine, Phase, UnitState, provisional_arena_bytes
from .errors import AlreadyOffloadedError, FlexTensorError, NotOffloadedError
from .host_store import PackedParameter, UnitPack, pack_unit
from .progress import progress_bar
from .runtime import DeviceRuntime
from .selection import Selection, select

logger = logging.getLogger("flextensor")

_ENGINE_ATTR = "_flextensor_engine"


def offload(model: nn.Module, config: OffloadConfig | None = None) -> nn.Module:
    """Offload ``model``'s selected weights to host RAM and stream them to the device as it runs.

    Returns the same object, patched in place. After this call the selected parameters live in (pinned)
    host RAM and everything else is on ``config.device`` for good. The first forwards discover the
    execution order and profile it (see ``phase``; with ``config.profile`` the saved plan is in place at
    once); then weights are prefetched on a side stream, and units resident in every plan made so far free
    their host copy (unless it is shared between processes).
    If anything fails here, the model is left exactly as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload() takes a torch.nn.Module, got {type(model).__name__}")
    config = config if config is not None else OffloadConfig()
    if getattr(model, _ENGINE_ATTR, None) is not None:
        raise AlreadyOffloadedError(
            f"this {type(model).__name__} is already offloaded; call flextensor.release(model) first"
        )
    device = config.resolved_device()
    selection = select(model, config.include_patterns, config.exclude_patterns)
    runtime = DeviceRuntime(device)
    budget = config.resolved_budget_bytes(runtime.total_memory())
    with _Rollback(model, selection, runtime) as rollback:
        pin = config.resolved_pinned_memory(device)
        units = rollback.pack_units(pin, config)
        rollback.move_resident_to(device)
        resident = {name: "not selected for offloading" for name in selection.resident_parameters}
        resident.update(selection.resident_reasons)
        engine = rollback.engine = OffloadEngine(model, config, runtime, units, resident, budget)
        order = list(selection.units)
        sizes = [u.nbytes for u in units]
        engine.apply_layout(order, (), provisional_arena_bytes(sizes))
        if engine.arena is not None and units:
            largest = max(units, key=lambda u: u.nbytes)
            assert largest.pack is not None  # packs are dropped only once a plan is in place
            engine.link = probe_link(runtime, largest.pack.buffer, engine.arena)
            for unit in units:
                unit.valid = False  # the probe wrote over the arena
        if config.profile is not None:
            from .profile_io import start_from_profile

            start_from_profile(engine, config.profile)
        engine.attach()
        setattr(model, _ENGINE_ATTR, engine)
        rollback.commit()
    logger.info(
        "offloaded %d unit(s), %.2f GiB streamed from %s host memory to %s",
        len(units),
        sum(u.nbytes for u in units) / 2**30,
        "pinned" if pin and runtime.is_cuda else "pageable",
        device,
    )
    return model


class _Rollback:
    """Undo everything ``offload()`` did to the model if it fails part way."""

    def __init__(self, model: nn.Module, selection: Selection, runtime: DeviceRuntime) -> None:
        self.model = model
        self.selection = selection
        self.runtime = runtime
        self.packs: list[UnitPack] = []
        self.packed: list[list[tuple[nn.Parameter, PackedParameter]]] = []  # per unit, as packed
        self.units: list[UnitState] = []
        self.original_devices = {id(p): p.device for p in model.parameters()}
        self.moved: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.moved_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        # Meta parameters attached to a shared segment are new objects: (module, key, original, new).
        self.swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        self.engine: OffloadEngine | None = None
        self.done = False

    def __enter__(self) -> _Rollback:
        return self

    def pack_units(self, pin: bool, config: OffloadConfig) -> list[UnitState]:
        """Put every unit's parameters in host packs: private ones, or with ``config.share_host_memory``
        ranges of the node's shared segment (which meta parameters may attach to, see shared_store)."""
        self._check_resident_have_data()
        params = dict(self.model.named_parameters())
        modules = dict(self.model.named_modules())
        named_units = [
            (name, [(fqn, params[fqn]) for fqn in self.selection.unit_parameters[name]])
            for name in self.selection.units
        ]
        total = sum(p.numel() * p.element_size() for _, named in named_units for _, p in named)
        what = "Packing and pinning weights" if pin else "Packing weights"
        with progress_bar(what, total=total, unit="bytes") as bar:
            if config.share_host_memory:
                from .shared_store import pack_shared

                patterns = [list(config.include_patterns), list(config.exclude_patterns)]
                shared = pack_shared(self.model, named_units, patterns, pin, bar.advance)
                self.packs.extend(shared.packs)
                self.swapped = shared.swapped
                for (name, _), named, pack in zip(named_units, shared.parameters, shared.packs, strict=True):
                    self._add_unit(name, modules[name], named, pack)
            else:
                for name, named in named_units:
                    pack = pack_unit(name, named, pin)
                    self.packs.append(pack)
                    self._add_unit(name, modules[name], named, pack)
                    bar.advance(sum(e.nbytes for e in pack.entries))
        return self.units

    def _add_unit(
        self, name: str, module: nn.Module, named: list[tuple[str, nn.Parameter]], pack: UnitPack
    ) -> None:
        self.packed.append([(p, e) for (_, p), e in zip(named, pack.entries, strict=True)])
        self.units.append(
            UnitState(
                name=name,
                module=module,
                pack=pack,
                parameters=[(fqn, p, e) for (fqn, p), e in zip(named, pack.entries, strict=True)],
                copy_done=self.runtime.event(),
                compute_done=self.runtime.event(),
            )
        )

    def _check_resident_have_data(self) -> None:
        """Weights that stay on the device are never shared or packed: they must hold data."""
        streamed = set(self.selection.streamed_parameters())
        resident = [(n, "parameter", t) for n, t in self.model.named_parameters() if n not in streamed]
        resident += [(n, "buffer", t) for n, t in self.model.named_buffers()]
        for name, kind, tensor in resident:
            if tensor.device.type == "meta":
                raise FlexTensorError(
                    f"{kind} {name!r} is on the meta device and holds no data; it is not offloaded, so "
                    "it cannot come from a shared host copy either: load it (e.g. "
                    "load_state_dict(..., assign=True)) before offload()"
                )

    def move_resident_to(self, device: torch.device) -> None:
        streamed = {id(p) for u in self.units for _, p, _ in u.parameters}
        for param in self.model.parameters():
            if id(param) not in streamed and param.device != device:
                self.moved.append((param, param.data))
                param.data = param.data.to(device)
        for module in self.model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != device:
                    self.moved_buffers.append((module, key, buf))
                    module._buffers[key] = buf.to(device)

    def commit(self) -> None:
        self.done = True
        self.moved.clear()
        self.moved_buffers.clear()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.done:
            return
        if self.engine is not None:
            self.engine.detach()
        for param, original in self.moved:
            param.data = original
        for module, key, buf in self.moved_buffers:
            module._buffers[key] = buf
        for module, key, original_param, _ in self.swapped:
            module._parameters[key] = original_param
        swapped = {id(new) for _, _, _, new in self.swapped}
        self.runtime.synchronize()  # copies issued so far may still read the packs
        # Every parameter as packed, from the record made at pack time: the engine may have moved some
        # out of their units since (weights kept resident). A plan from a saved profile may already have
        # dropped resident units' packs: their weights are read from their device storage then.
        for unit, packed in zip(self.units, self.packed, strict=True):
            for param, entry in packed:
                if id(param) in swapped:
                    continue
                original = self.original_devices[id(param)]
                param.data = unit.kept(entry).to(original, copy=True)
        # Freeing is idempotent; a pack the engine built again is only on its unit.
        for pack in [*self.packs, *(u.pack for u in self.units if u.pack is not None)]:
            pack.free()


def _engine(model: nn.Module) -> OffloadEngine:
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is None:
        raise NotOffloadedError(
            f"this {type(model).__name__} is not offloaded by flextensor; "
            "call flextensor.offload(model) first"
        )
    return engine


def release(model: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """Stop offloading ``model``: remove every hook and make each parameter a normal tensor again.

    Parameters end up on ``device`` if given (e.g. ``"cpu"``), else on the offload device. Host memory
    held for the weights is freed. Returns the model.
    """
    engine = _engine(model)
    engine.release(torch.device(device) if device is not None else None)
    delattr(model, _ENGINE_ATTR)
    return model


def offload_units(model: nn.Module) -> list[str]:
    """Module paths of the offload units; in execution order once discovered."""
    engine = _engine(model)
    ordered = [u for u in engine.order if u in engine.units]
    return ordered + [u for u in engine.units if u not in ordered]


def offloaded_parameters(model: nn.Module) -> list[str]:
    """Fully qualified names of the parameters of the offload units: streamed, or streamable.

    The plan may keep some of their units resident; those resident in every plan made so far hold their
    weights on the device only, with no host copy (unless the host memory is shared between processes).
    """
    engine = _engine(model)
    return [fqn for name in offload_units(model) for fqn, _, _ in engine.units[name].parameters]


def resident_parameters(model: nn.Module) -> list[str]:
    """Fully qualified names of the parameters that stay on the device and never stream."""
    streamed = set(offloaded_parameters(model))
    return [name for name, _ in model.named_parameters() if name not in streamed]


def phase(model: nn.Module) -> str:
    """``"discovery"``, ``"profiling"`` or ``"inference"`` (steady state)."""
    return _engine(model).phase.value


def save_profile(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Save the measurements and plan of ``model`` (in steady state) so the next run starts there."""
    from .profile_io import save_engine_profile

    engine = _engine(model)
    if engine.phase is not Phase.INFERENCE or engine.measurements is None or engine.plan is None:
        raise NotOffloadedError(
            f"nothing to save yet: the model is in its {engine.phase.value} phase; run forwards until "
            "flextensor.phase(model) == 'inference', then save"
        )
    save_engine_profile(engine, path)


def record_next_step(model: nn.Module) -> None:
    """Record device timings of the model's next steady-state forward, for ``report`` and ``trace``.

    The first steady forward after each plan is recorded anyway; recording adds event records to that
    one forward and nothing to the others.
    """
    _engine(model)._record_next = True
