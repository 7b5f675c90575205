"""Between a live engine and a saved profile: build one from the engine, start an engine from one."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import warnings

import torch

from .engine import OffloadEngine
from .errors import ProfileError
from .profile import (
    Compatibility,
    Fingerprint,
    Profile,
    check_compatibility,
    fingerprint_parameters,
    load_profile_file,
    replan_reasons,
    save_profile_file,
)

logger = logging.getLogger("flextensor")


def _distributed_place() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def engine_fingerprint(engine: OffloadEngine, input_shapes: tuple[str, ...]) -> Fingerprint:
    rank, world_size = _distributed_place()
    return Fingerprint(
        parameters=fingerprint_parameters(engine.model),
        include_patterns=tuple(engine.config.include_patterns),
        exclude_patterns=tuple(engine.config.exclude_patterns),
        device_name=engine.runtime.name(),
        torch_version=torch.__version__,
        input_shapes=input_shapes,
        rank=rank,
        world_size=world_size,
    )


def save_engine_profile(engine: OffloadEngine, path: str | os.PathLike[str]) -> None:
    """Write the engine's measurements and plan (steady state) to ``path``, atomically."""
    from . import __version__

    assert engine.measurements is not None and engine.plan is not None
    streamed = {fqn for unit in engine.units.values() for fqn, _, _ in unit.parameters}
    profile = Profile(
        fingerprint=engine_fingerprint(engine, engine.measurements.input_shapes),
        order=tuple(engine.order),
        unit_parameters={
            name: tuple(fqn for fqn, _, _ in unit.parameters) for name, unit in engine.units.items()
        },
        resident_parameters=tuple(n for n, _ in engine.model.named_parameters() if n not in streamed),
        measurements=engine.measurements,
        plan=engine.plan,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        flextensor_version=__version__,
    )
    save_profile_file(profile, path)
    logger.info("saved profile to %s", path)


def start_from_profile(engine: OffloadEngine, path: str | os.PathLike[str]) -> None:
    """Put a freshly offloaded engine straight into steady state from the profile at ``path``.

    Another model or other patterns raise ProfileError; another device or torch re-plans from the saved
    measurements (with this machine's link) and warns. Inputs of other shapes re-profile at the first
    forward that has them, as they would in any steady state.
    """
    source = os.fspath(path)
    if not os.path.exists(source):
        raise ProfileError(
            f"profile {source} does not exist; run without profile= once and save one with "
            "flextensor.save_profile(model, path)"
        )
    profile = load_profile_file(source)
    saved = profile.fingerprint
    current = engine_fingerprint(engine, saved.input_shapes)
    compatibility = check_compatibility(saved, current, source=source)
    _match_units(engine, profile, source)

    measurements = profile.measurements
    plan = profile.plan
    if compatibility is Compatibility.REPLAN:
        reasons = "; ".join(replan_reasons(saved, current))
        warnings.warn(
            f"profile {source} was made on another setup ({reasons}); re-planning from its measurements",
            UserWarning,
            stacklevel=4,
        )
        if engine.link is not None:
            measurements = dataclasses.replace(measurements, link=engine.link)
        plan = None  # install_plan plans as a fresh run would (budget, device ceiling)
    elif plan.budget_bytes not in (engine.budget_bytes, _no_budget_ceiling(engine)):
        logger.info("profile %s was planned for another budget; re-planning", source)
        plan = None
    engine.order = list(profile.order)
    engine.input_shapes = measurements.input_shapes
    engine.install_plan(measurements, plan)


def _no_budget_ceiling(engine: OffloadEngine) -> int | None:
    """Without a budget, the ceiling a plan that would not fit the device was made under (its recorded
    budget): such a plan is this engine's own, not one for another budget."""
    return engine._memory_limit() if engine.budget_bytes is None else engine.budget_bytes


def _match_units(engine: OffloadEngine, profile: Profile, source: str) -> None:
    """Make the engine's units stream exactly what the profile's did (discovery may have kept some
    parameters resident, which this run has not discovered)."""
    if set(profile.unit_parameters) != set(engine.units):
        missing = sorted(set(engine.units) ^ set(profile.unit_parameters))
        raise ProfileError(
            f"profile {source} lists other offload units than this run selects (first difference: "
            f"{missing[0]!r}); delete the profile to re-profile"
        )
    for name, unit in engine.units.items():
        saved = set(profile.unit_parameters[name])
        for fqn, param, _ in list(unit.parameters):
            if fqn not in saved:
                engine.keep_resident(id(param), "found read outside its unit when the profile was made")
