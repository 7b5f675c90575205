"""Between a live engine and a saved profile: take one from the engine, start an engine from one.

A run started from a profile skips discovery and profiling: the saved plan is laid out at once. Its
first forward still checks that the model behaves as when the profile was made (see
``OffloadEngine.adopt_profile``): a model whose code changed since is profiled again rather than run
with a plan that no longer fits it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import warnings
from typing import TYPE_CHECKING

import torch

from flextensor.common.parameters import parameter_signatures
from flextensor.device.runtime import distributed_place
from flextensor.errors import NotOffloadedError, ProfileError
from flextensor.profiles.file import (
    Compatibility,
    Fingerprint,
    Profile,
    check_compatibility,
    load_profile_file,
    replan_reasons,
)

if TYPE_CHECKING:
    from flextensor.engine.controller import OffloadEngine
    from flextensor.plan.plan import Plan

logger = logging.getLogger("flextensor")

__all__ = [
    "adopted_coded_units",
    "engine_fingerprint",
    "read_profile",
    "snapshot_profile",
    "start_from_loaded_profile",
    "start_from_profile",
]


def engine_fingerprint(engine: OffloadEngine, input_shapes: tuple[str, ...]) -> Fingerprint:
    """What a profile of ``engine`` made at ``input_shapes`` is for."""
    rank, world_size = distributed_place()
    # A unit given back its device bytes (a pipeline's component between its steps) holds empty
    # placeholders: its parameters' shapes are those of its pack.
    packed = {fqn: entry.shape for unit in engine.units.values() for fqn, _, entry in unit.parameters}
    return Fingerprint(
        parameters=tuple(
            (fqn, packed.get(fqn, shape), dtype) for fqn, shape, dtype in parameter_signatures(engine.model)
        ),
        include_patterns=tuple(engine.config.include_patterns),
        exclude_patterns=tuple(engine.config.exclude_patterns),
        device_name=engine.runtime.name(),
        torch_version=torch.__version__,
        input_shapes=input_shapes,
        rank=rank,
        world_size=world_size,
    )


def snapshot_profile(engine: OffloadEngine) -> Profile:
    """The engine's measurements and plan in force, as a Profile (steady state only)."""
    from flextensor.common.version import __version__

    entry = engine.current
    if entry is None:
        raise NotOffloadedError(
            f"nothing to save yet: the model is in its {engine.phase.value} phase; run forwards until "
            "flextensor.phase(model) == 'inference', then save"
        )
    measurements, plan = entry.measurements, entry.plan
    if entry.crowded_bytes:
        # Planned for memory the caller held then (see PlanStates.plan_again_if_crowded): the next run
        # starts from what was measured, and plans again if its caller holds as much.
        measurements = dataclasses.replace(
            measurements, baseline_bytes=measurements.baseline_bytes - entry.crowded_bytes
        )
        plan = engine.policy.make_plan(measurements)
    streamed = {fqn for unit in engine.units.values() for fqn, _, _ in unit.parameters}
    return Profile(
        fingerprint=engine_fingerprint(engine, measurements.input_shapes),
        order=tuple(u.name for u in engine.order),
        unit_parameters={
            name: tuple(fqn for fqn, _, _ in unit.parameters) for name, unit in engine.units.items()
        },
        resident_parameters=tuple(n for n, _ in engine.model.named_parameters() if n not in streamed),
        measurements=measurements,
        plan=plan,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        flextensor_version=__version__,
        host=engine.policy.host,
    )


def start_from_profile(engine: OffloadEngine, path: str | os.PathLike[str]) -> None:
    """Put a freshly offloaded engine straight into steady state from the profile at ``path``.

    Another model or other patterns raise ProfileError; another device or torch re-plans from the saved
    measurements (with this machine's link) and warns. Inputs of other shapes re-profile at the first
    forward that has them, as they would in any steady state.
    """
    start_from_loaded_profile(engine, read_profile(path), os.fspath(path))


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """The profile at ``path``; ProfileError, saying how to make one, when there is none."""
    source = os.fspath(path)
    if not os.path.exists(source):
        raise ProfileError(
            f"profile {source} does not exist; run without profile= once and save one with "
            "flextensor.save_profile(model, path)"
        )
    return load_profile_file(source)


def adopted_coded_units(engine: OffloadEngine, profile: Profile, source: str) -> frozenset[str] | None:
    """The units a run started from ``profile`` loads compressed: its saved plan's coded units when the run
    adopts that plan as it is (empty when it copies every unit as it is: made without compression, or
    under a budget with no room for its staging slots); None when the run plans afresh. Encoding any
    other unit at offload() would be undone or wasted. Another model raises ProfileError."""
    compatibility = check_compatibility(
        profile.fingerprint, engine_fingerprint(engine, profile.fingerprint.input_shapes), source=source
    )
    plan = profile.plan
    if compatibility is Compatibility.REPLAN or not _keeps_budget(engine, plan):
        return None
    return frozenset(plan.coded)


def _keeps_budget(engine: OffloadEngine, plan: Plan) -> bool:
    """Whether ``plan`` was made for this engine's budget. Without a budget, a plan capped at the device's
    share is this engine's own, not another budget's."""
    return plan.budget_bytes in (engine.policy.budget_bytes, engine.policy.memory_limit())


def start_from_loaded_profile(engine: OffloadEngine, profile: Profile, source: str) -> None:
    """:func:`start_from_profile` with the profile already read (a pipeline's file holds several);
    ``source`` names it in messages."""
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
            stacklevel=5,
        )
        if engine.link is not None:
            measurements = dataclasses.replace(measurements, link=engine.link)
        plan = None  # the engine plans as a fresh run would (budget, device ceiling)
    elif not _keeps_budget(engine, plan):
        logger.info("profile %s was planned for another budget; re-planning", source)
        plan = None
    elif set(plan.mapped) != engine.policy.mapped:
        logger.info("profile %s was planned with other units mapped (map_embeddings); re-planning", source)
        plan = None
    elif plan.coded and engine.policy.decode_bps is None:
        logger.info("profile %s was planned with compressed loads, now off; re-planning", source)
        plan = None
    engine.adopt_profile(list(profile.order), measurements, plan)


def _match_units(engine: OffloadEngine, profile: Profile, source: str) -> None:
    """Make the engine's units stream exactly what the profile's did (discovery may have kept some
    parameters resident, which this run has not discovered)."""
    resident = set(profile.resident_parameters)
    # A unit the profiled run stopped streaming (every weight kept resident) is not in the profile.
    dropped = {
        name
        for name, unit in engine.units.items()
        if name not in profile.unit_parameters and all(fqn in resident for fqn, _, _ in unit.parameters)
    }
    if set(profile.unit_parameters) != set(engine.units) - dropped:
        missing = sorted((set(engine.units) - dropped) ^ set(profile.unit_parameters))
        raise ProfileError(
            f"profile {source} lists other offload units than this run selects (first difference: "
            f"{missing[0]!r}); delete the profile to re-profile"
        )
    for name, unit in list(engine.units.items()):
        saved = set(profile.unit_parameters.get(name, ()))
        for fqn, param, _ in list(unit.parameters):
            if fqn not in saved:
                engine.keep_parameter_resident(
                    id(param), "found read outside its unit when the profile was made"
                )
    engine.drop_empty_units()
