"""The public verbs: offload, release, save_profile, and the introspection calls."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from flextensor.config.devices import resolve_device
from flextensor.config.schema import OffloadConfig
from flextensor.device.runtime import resolve_target
from flextensor.engine.budgets import check_units_fit
from flextensor.engine.controller import OffloadEngine
from flextensor.engine.status import OffloadStatus
from flextensor.errors import AlreadyOffloadedError, ConfigError, NotOffloadedError, UnsupportedOperationError
from flextensor.hooks.model_hooks import entry_method_names
from flextensor.store.host_budget import HostBudget, host_budget_target, probe_links
from flextensor.weights.packing import Packing, check_offloadable, mark_offloaded, unmark_offloaded
from flextensor.weights.selection import select
from flextensor.weights.subclasses import refuse_subclass_checkpoint

if TYPE_CHECKING:
    from flextensor.profiles.file import Profile

logger = logging.getLogger("flextensor")

__all__ = [
    "engine_of",
    "offload",
    "offload_units",
    "offloaded_parameters",
    "phase",
    "record_next_step",
    "release",
    "resident_parameters",
    "save_profile",
    "set_budget",
    "status",
]

_ENGINE_ATTR = "_flextensor_engine"


def compiled_original(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper compiles, else ``model`` itself.

    offload() and release() work on that module and return the wrapper: its parameter names are the
    module's own (no ``_orig_mod.`` prefix for the include patterns), and the wrapper's compiled calls
    run the hooks put on it."""
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.eval_frame import OptimizedModule

        if isinstance(model, OptimizedModule) and isinstance(model._orig_mod, nn.Module):
            return model._orig_mod
    return model


def offload(
    model: nn.Module,
    config: OffloadConfig | None = None,
    *,
    weights: str | os.PathLike[str] | None = None,
) -> nn.Module:
    """Offload ``model``'s selected weights to host RAM and stream them to the device as it runs.

    Returns the same object, patched in place. After this call the selected parameters live in (pinned)
    host RAM and everything else is on ``config.device`` for good. The first forwards discover the
    execution order and profile it (see ``phase``; with ``config.profile`` the saved plan is in place at
    once); then weights are prefetched on a side stream, and units resident in every plan made so far free
    their host copy (unless it is shared between processes).
    If anything fails here, the model is left exactly as it was. ``model`` may be compiled already
    (``torch.compile(model)``, ``model.compile()``): see docs/compile.md. ``model`` may also be a
    diffusers pipeline or a mapping of names to modules: every component is offloaded under one budget
    (see docs/pipelines.md); ``release``, ``phase`` and ``report`` take it too.

    ``weights``: a safetensors checkpoint (a file, a sharded folder with its ``*.index.json``, or a
    transformers or diffusers model folder) to read the weights from, straight into host packs and onto the
    device, with no other copy of the model in RAM; ``model`` may then be built on the meta device (see
    docs/loading.md). It must match the model exactly: CheckpointError, before anything changes, otherwise.
    """
    from flextensor.pipelines.pipeline import components_of, offload_pipeline

    if components_of(model) is not None:  # a diffusers pipeline, or a mapping of names to modules
        if weights is not None:
            raise UnsupportedOperationError(
                "weights= takes the checkpoint of one model, not of a pipeline: load the pipeline's weights "
                "the usual way, or offload each component with its own weights= folder"
            )
        return offload_pipeline(model, config if config is not None else OffloadConfig())
    wrapper, model = model, compiled_original(model)
    # Before check_offloadable: that one also refuses a model already offloaded (as a module of an
    # offloaded model), and the documented error for offloading the same model twice is this one.
    if getattr(model, _ENGINE_ATTR, None) is not None:
        raise AlreadyOffloadedError(
            f"this {type(model).__name__} is already offloaded; call flextensor.release(model) first"
        )
    check_offloadable(model)
    config = config if config is not None else OffloadConfig()
    explicit = "entry_methods" in config.model_fields_set
    entry_methods = entry_method_names(model, config.entry_methods, explicit)
    target = host_budget_target(config, resolve_target(config))
    selection = select(model, config.include_patterns, config.exclude_patterns)
    checkpoint = None
    if weights is not None:
        from flextensor.host.checkpoint import plan_checkpoint_load

        if config.share_host_memory:
            raise ConfigError(
                "share_host_memory=True with weights= is not supported yet: load the weights first "
                "(or leave share_host_memory off)"
            )
        refuse_subclass_checkpoint(model)
        checkpoint = plan_checkpoint_load(model, weights)
    with Packing(model, selection, target, checkpoint) as packing:
        units = packing.pack_units(config)
        selection = packing.selection  # made again if the checkpoint untied tied weights
        packing.move_resident_to(target.device)
        resident = {name: "not selected for offloading" for name in selection.resident_parameters}
        resident.update(selection.resident_reasons)
        engine = OffloadEngine(model, config, target, units, resident, entry_methods)
        engine.store.set_host_budget(HostBudget(target.host_budget_bytes, target.runtime, target.pin))
        if config.map_embeddings:
            from flextensor.store.mapping import mark_mapped_units

            mapped = mark_mapped_units(
                units,
                model,
                target.device,
                shared=config.share_host_memory,
                host_budget=engine.store.host.capacity is not None,
                compressed=config.compression != "off",
            )
            engine.policy.mapped = frozenset(mapped)
        packing.on_undo(engine.store.host.free)
        packing.on_undo(engine.hooks.detach)
        packing.on_undo(engine.unguard_parameters)
        packing.on_undo(lambda: unmark_offloaded(model))
        packing.on_undo(lambda: model.__dict__.pop(_ENGINE_ATTR, None))
        check_units_fit(units, engine.policy.mapped, target.budget_bytes)  # see engine/budgets.py
        engine.start()
        profile = None
        if config.profile is not None:
            from flextensor.profiles.reuse import read_profile

            profile = read_profile(config.profile)
        arena = engine.store.arena
        if arena is not None and units:
            engine.link, engine.policy.host = probe_links(engine.store, arena)
            engine.store.forget_contents()  # the probe wrote over the arena
            if config.compression == "lossless":
                compress(engine, arena, profile, str(config.profile))
        del arena  # the profile's layout below frees the learning arena first: no reference may keep it
        if profile is not None:
            from flextensor.profiles.reuse import start_from_loaded_profile

            start_from_loaded_profile(engine, profile, str(config.profile))
        setattr(model, _ENGINE_ATTR, engine)
        mark_offloaded(model)
        packing.commit()
    logger.info(
        "offloaded %d unit(s), %.2f GiB streamed from %s host memory to %s",
        len(units),
        sum(u.nbytes for u in units) / 2**30,
        "pinned" if target.pin else "pageable",
        target.device,
    )
    return wrapper


def compress(engine: OffloadEngine, arena: torch.Tensor, profile: Profile | None, source: str) -> None:
    """Hold compressed the packs whose loads that speeds up, and tell the planner (see [Note: coded
    packs] in host/coded_packs.py); when the run adopts a ``profile``'s plan, only the units it loads
    compressed."""
    from flextensor.profiles.reuse import adopted_coded_units
    from flextensor.store.coded_loads import coded_sizes, compress_packs

    only = None if profile is None else adopted_coded_units(engine, profile, source)
    if only is not None and not only:
        if profile is not None and profile.plan.streamed:
            logger.warning(
                "compression='lossless' is not used: the plan of profile %s copies every streamed unit as "
                "it is (made without compression, or under a budget with no room for its staging slots), so "
                "the packs stay uncompressed; offload without profile= to plan with compression",
                source,
            )
        return
    assert engine.link is not None
    store = engine.store
    decode_bps = compress_packs(store, engine.link, arena, only)
    if decode_bps is not None:
        engine.policy.stream_coded(decode_bps, lambda: coded_sizes(store.units))


def engine_of(model: nn.Module) -> OffloadEngine:
    """The engine that offloads ``model``; NotOffloadedError when flextensor does not manage it."""
    engine = compiled_original(model).__dict__.get(_ENGINE_ATTR)
    if engine is None:
        raise NotOffloadedError(
            f"this {type(model).__name__} is not offloaded by flextensor; "
            "call flextensor.offload(model) first"
        )
    return engine


def release(model: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """Stop offloading ``model``: remove every hook and make each parameter a normal tensor again.

    Parameters end up on ``device`` if given (e.g. ``"cpu"``), else on the offload device. Host memory
    held for the weights is freed. The device is checked and every new copy is built before anything
    changes: when that fails (no such device, out of memory) the model stays offloaded and working, and
    ``release`` can be called again; so can a call stopped part-way (Ctrl-C), which the next one
    finishes, with the weights where the first one put them. A component of an offloaded pipeline is
    released with its pipeline only (``release(pipe)``); ``release(pipe.transformer)`` raises
    UnsupportedOperationError, changing nothing.
    """
    from flextensor.pipelines.pipeline import components_of, release_pipeline

    if components_of(model) is not None:
        return release_pipeline(model, device)
    component = engine_of(model).component_of
    if component is not None:  # its hooks and budget are the pipeline's: alone, it would leave it broken
        name, pipeline = component
        raise UnsupportedOperationError(
            f"this {type(compiled_original(model)).__name__} is the component {name!r} of an offloaded "
            f"{pipeline}, which shares one budget and its hooks between its components; release the "
            "pipeline: flextensor.release(pipe), which releases every component"
        )
    return release_model(model, device)


def release_model(model: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """:func:`release` of one offloaded model, a pipeline's component included (pipelines/pipeline.py)."""
    engine = engine_of(model)
    target = resolve_device(str(torch.device(device))) if device is not None else None
    engine.release(target)
    original = compiled_original(model)
    unmark_offloaded(original)
    delattr(original, _ENGINE_ATTR)
    return model


def set_budget(model: nn.Module, budget: int | str | None) -> None:
    """Raise or lower the device memory budget (``gpu_memory_budget``) of an offloaded model, or of a
    pipeline, without offloading it again.

    ``budget``: a size such as ``"10GiB"`` or a number of bytes, or None for no budget. Every plan made so
    far is made again from its saved measurements under it, and the next forward lays its plan out; a model
    still learning makes its first plan under it. A model whose plan did not fit (BudgetError at each
    forward) runs again at its next forward. A budget that cannot hold the two largest units in flight, or
    a plan made so far, raises BudgetError (with ``needed_bytes``), changing nothing.
    """
    from flextensor.engine.budgets import parse_budget_value, set_engine_budgets
    from flextensor.pipelines.pipeline import components_of, pipeline_of

    budget_bytes = parse_budget_value(budget)
    if components_of(model) is None:
        set_engine_budgets([engine_of(model)], budget_bytes)
        return
    pipeline = pipeline_of(model)
    set_engine_budgets([pipeline.engine(name) for name in pipeline.components], budget_bytes)
    pipeline.budget_bytes = budget_bytes


def offload_units(model: nn.Module) -> list[str]:
    """Module paths of the offload units; in execution order once discovered."""
    return [unit.name for unit in engine_of(model).status().units]


def offloaded_parameters(model: nn.Module) -> list[str]:
    """Fully qualified names of the parameters of the offload units: streamed, or streamable.

    The plan may keep some of their units resident; those resident in every plan made so far hold their
    weights on the device only, with no host copy (unless the host memory is shared between processes).
    """
    engine = engine_of(model)
    return [fqn for name in offload_units(model) for fqn, _, _ in engine.units[name].parameters]


def resident_parameters(model: nn.Module) -> list[str]:
    """Fully qualified names of the parameters that stay on the device and never stream."""
    streamed = set(offloaded_parameters(model))
    return [name for name, _ in model.named_parameters() if name not in streamed]


def phase(model: nn.Module) -> str:
    """``"discovery"``, ``"profiling"`` or ``"inference"`` (steady state); of a pipeline, its least
    advanced component's."""
    from flextensor.pipelines.pipeline import components_of, pipeline_of

    if components_of(model) is not None:
        return pipeline_of(model).phase()
    return engine_of(model).phase.value


def status(model: nn.Module) -> OffloadStatus:
    """A snapshot of ``model``'s offloading: phase, each unit's placement, the plans, the bytes held."""
    return engine_of(model).status()


def save_profile(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Save the measurements and plan of ``model`` (in steady state) so the next run starts there.

    The write is atomic; a symbolic link at ``path`` is followed and its target replaced. Of a pipeline,
    one file holds every component's; ``OffloadConfig(profile=path)`` given to the pipeline's offload
    reloads them all.
    """
    from flextensor.pipelines.pipeline import components_of, save_pipeline

    if components_of(model) is not None:  # one file for every component (pipelines/profile.py)
        save_pipeline(model, path)
        logger.info("saved the pipeline's profile to %s", path)
        return
    from flextensor.profiles.file import save_profile_file
    from flextensor.profiles.reuse import snapshot_profile

    save_profile_file(snapshot_profile(engine_of(model)), path)
    logger.info("saved profile to %s", path)


def record_next_step(model: nn.Module) -> None:
    """Record device timings of the model's next steady-state forward, for ``report`` and ``trace``.

    The first steady forward after each plan is recorded anyway; recording adds event records to that
    one forward and nothing to the others.
    """
    engine_of(model).record_next_step()
