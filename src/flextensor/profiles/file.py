"""Profiles: what the first forwards learned about a model on a machine, saved so the next run starts planned.

A profile holds the execution order of the offload units, which parameters each unit streams, the
measurements (per-unit compute time, sizes, link speed) and the plan made from them, plus a
:class:`Fingerprint` of the model and the run it was made for. :func:`check_compatibility` decides whether
a saved profile may be used as is, must be re-planned from its measurements, or belongs to another model.

[Note: profile format]
Profiles are versioned JSON, never pickle: loading one must not run code, and a user must be able to read
it. The layout is::

    {"format": "flextensor-profile", "version": 1, "flextensor_version": ..., "created_at": ...,
     "fingerprint": {...}, "order": [...], "unit_parameters": {...}, "resident_parameters": [...],
     "measurements": {...}, "plan": {...}, "host": {...}}   # "host" only under a host budget

The records (Fingerprint, Measurements, UnitMeasurement, LinkModel, Plan) are written as objects with
one key per field, in field order, by the codec in common/json_codec.py (pydantic), so a field added to
``Plan`` round-trips without changes here. Tuples are written as lists and read back as tuples.

Loading is strict: every value is checked against its field's annotation (an integer is not a boolean; a
number is finite; sizes, durations and counts are not negative), unknown keys are rejected (they come
from a newer flextensor or a hand edit, and dropping them silently could mis-plan), and a missing key is
an error unless its field has a default. That one leniency is deliberate: a profile
written before a defaulted field was added still describes a valid plan, so it stays readable without a
version bump. Every error is a :class:`ProfileError` naming the file and the JSON path of the bad field,
e.g. ``measurements.units[3].compute_s``.

Pure: no torch.
"""

from __future__ import annotations

import datetime
import enum
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from flextensor.common.json_codec import (
    RecordError,
    atomic_write_text,
    from_json_data,
    record,
    render_json,
    show,
    to_json_data,
)
from flextensor.common.sizes import align_up
from flextensor.errors import ProfileError
from flextensor.plan.host_plan import HostPlan
from flextensor.plan.layout import UNIT_ALIGNMENT, minimal_arena_bytes
from flextensor.plan.measurements import Measurements
from flextensor.plan.plan import Plan

__all__ = [
    "PIPELINE_PROFILE_FORMAT",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "Compatibility",
    "Fingerprint",
    "ParameterSignature",
    "Profile",
    "check_compatibility",
    "load_profile_file",
    "profile_from_dict",
    "profile_to_dict",
    "read_profile_json",
    "replan_reasons",
    "save_profile_file",
    "write_profile_json",
]

PROFILE_FORMAT = "flextensor-profile"
"""The ``format`` marker of every profile file: tells a profile apart from any other JSON."""

PROFILE_VERSION = 1
"""The profile layout this flextensor writes and reads. Bump it when a change would mislead older readers."""

PIPELINE_PROFILE_FORMAT = "flextensor-pipeline-profile"
"""The ``format`` marker of a whole pipeline's profile: one per component (pipelines/profile.py)."""

_REPROFILE = "delete it to re-profile"
_OTHER_MODEL_FIX = "delete the profile or pass profile=None to re-profile"
_TOP_LEVEL_FIRST = ("flextensor_version", "created_at")
"""Profile fields written right after format/version, before the bulky ones, so a reader sees them first."""

_Count = Annotated[int, Field(ge=0)]

ParameterSignature = tuple[str, tuple[_Count, ...], str]
"""(fully qualified name, shape, dtype as ``str(tensor.dtype)``) of one parameter."""


@record
@dataclass(frozen=True)
class Fingerprint:
    """What a profile was made for: the model's parameters, the patterns, the device and the run.

    ``parameters``: (FQN, shape, dtype string such as ``"torch.bfloat16"``) of every parameter, in
    ``named_parameters`` order. ``input_shapes``: the shapes of the tensors seen as inputs while profiling,
    e.g. ``("x:(1, 4096)",)``. ``rank`` / ``world_size``: this process's place in a distributed run.
    """

    parameters: tuple[ParameterSignature, ...]
    include_patterns: tuple[str, ...]
    exclude_patterns: tuple[str, ...]
    device_name: str
    torch_version: str
    input_shapes: tuple[str, ...]
    rank: _Count = 0
    world_size: Annotated[int, Field(ge=1)] = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ProfileError(f"rank must be in [0, {self.world_size}), got {self.rank}")


@record
@dataclass(frozen=True)
class Profile:
    """Everything a run needs to start in steady state: order, unit contents, measurements and plan.

    ``order``: offload units in execution order. ``unit_parameters``: unit -> the parameter FQNs it
    streams. ``resident_parameters``: parameters that stay on the device, including those found read
    outside their unit. ``created_at``: ISO 8601 time in UTC. ``flextensor_version``: the writer's version.
    ``host``: what a host budget left the planner when the plan was made (the pinned capacity, the staged
    and disk copy speeds, the disk units), so that ``flextensor plan`` times staged copies as the run
    did; None without a host budget.
    """

    fingerprint: Fingerprint
    order: tuple[str, ...]
    unit_parameters: dict[str, tuple[str, ...]]
    resident_parameters: tuple[str, ...]
    measurements: Measurements
    plan: Plan
    created_at: str
    flextensor_version: str
    host: HostPlan | None = None


class Compatibility(enum.Enum):
    """What to do with a saved profile in this run (see :func:`check_compatibility`)."""

    SAME = "same"
    """Use the saved plan as is."""
    REPLAN = "replan"
    """Other device, torch, rank or input shapes: re-plan from the saved measurements (the caller warns)."""


# --------------------------------------------------------------------------------------------------------
# Compatibility


def check_compatibility(saved: Fingerprint, current: Fingerprint, source: str | None = None) -> Compatibility:
    """Whether a profile made for ``saved`` may serve a run described by ``current``.

    Raises ProfileError when it belongs to another model (a parameter added, missing, renamed, of another
    shape or dtype), to other include/exclude patterns or to another world size: its order and unit
    contents would be wrong. Returns REPLAN when only the device, torch version, rank or input shapes
    differ (the measurements are still a fair starting point; :func:`replan_reasons` says why), else SAME.
    ``source`` (the profile's path) is named in error messages.
    """
    whose = f"profile {source}" if source else "the profile"
    difference = _parameter_difference(saved.parameters, current.parameters)
    if difference is not None:
        raise ProfileError(f"{whose} was made for another model: {difference}; {_OTHER_MODEL_FIX}")
    for label, saved_patterns, current_patterns in (
        ("include_patterns", saved.include_patterns, current.include_patterns),
        ("exclude_patterns", saved.exclude_patterns, current.exclude_patterns),
    ):
        # Order matters too: it can change which pattern claims a module.
        if tuple(saved_patterns) != tuple(current_patterns):
            raise ProfileError(
                f"{whose} was made with other patterns: {label} differ: profile {list(saved_patterns)!r}, "
                f"config {list(current_patterns)!r}; {_OTHER_MODEL_FIX}"
            )
    if saved.world_size != current.world_size:
        raise ProfileError(
            f"{whose} was made with world_size {saved.world_size} but this run has world_size "
            f"{current.world_size}; each world size needs its own profile: {_OTHER_MODEL_FIX}"
        )
    return Compatibility.REPLAN if replan_reasons(saved, current) else Compatibility.SAME


def replan_reasons(saved: Fingerprint, current: Fingerprint) -> tuple[str, ...]:
    """Human-readable differences that make a saved plan stale but its measurements reusable.

    Empty when the run matches the profile. Meant for the warning a caller prints on REPLAN.
    """
    reasons: list[str] = []
    if saved.device_name != current.device_name:
        reasons.append(f"device {saved.device_name!r} in the profile, {current.device_name!r} now")
    if saved.torch_version != current.torch_version:
        reasons.append(f"torch {saved.torch_version} in the profile, {current.torch_version} now")
    if saved.rank != current.rank:
        reasons.append(f"rank {saved.rank} in the profile, {current.rank} now")
    if tuple(saved.input_shapes) != tuple(current.input_shapes):
        reasons.append(
            f"input shapes {list(saved.input_shapes)} in the profile, {list(current.input_shapes)} now"
        )
    return tuple(reasons)


def _parameter_difference(
    saved: Sequence[ParameterSignature], current: Sequence[ParameterSignature]
) -> str | None:
    """The first difference between two parameter lists, walking this model's order; None if none.

    The order of parameters alone is not a difference: units and plans are keyed by name.
    """
    saved_by_name = {name: (tuple(shape), dtype) for name, shape, dtype in saved}
    current_names = {name for name, _, _ in current}
    for i, (name, shape, dtype) in enumerate(current):
        if name not in saved_by_name:
            hint = ""
            if i < len(saved) and saved[i][0] not in current_names:
                # Same position, a name this model lacks: most likely a rename; say so.
                hint = f" (the profile has {saved[i][0]!r} at that position instead)"
            return f"parameter {name!r} is in this model but not in the profile{hint}"
        saved_shape, saved_dtype = saved_by_name[name]
        if saved_shape != tuple(shape):
            return (
                f"parameter {name!r} has shape {saved_shape} in the profile but {tuple(shape)} in this model"
            )
        if saved_dtype != dtype:
            return f"parameter {name!r} has dtype {saved_dtype} in the profile but {dtype} in this model"
    for name, _, _ in saved:
        if name not in current_names:
            return f"parameter {name!r} is in the profile but not in this model"
    return None


# --------------------------------------------------------------------------------------------------------
# Dict <-> Profile


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON-ready dict of ``profile`` (see [Note: profile format]).

    Raises ProfileError naming the field when a value cannot be stored. Does not check consistency:
    :func:`save_profile_file` does, by reading the dict back.
    """
    if not isinstance(profile, Profile):
        raise ProfileError(f"cannot save {type(profile).__name__} as a profile; expected a Profile")
    try:
        body = to_json_data(profile, Profile)
    except RecordError as exc:
        raise ProfileError(f"cannot save the profile: {exc}") from None
    out: dict[str, Any] = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION}
    for key in _TOP_LEVEL_FIRST:
        out[key] = body.pop(key)
    out.update(body)  # the remaining fields, in Profile's field order
    if out.get("host") is None:
        del out["host"]  # without a host budget the file stays what older versions read
    return out


def profile_from_dict(data: Any, source: str = "<dict>") -> Profile:
    """Validate ``data`` (parsed JSON) and build the Profile it describes.

    Raises ProfileError, naming ``source`` and the JSON path of the first bad field, for anything that is
    not a well-formed, self-consistent profile of this version.
    """
    if not isinstance(data, dict):
        raise ProfileError(
            f"profile {source} is not a flextensor profile: it holds {_json_type(data)}, not an object; "
            f"{_REPROFILE}"
        )
    marker = data.get("format")
    if marker == PIPELINE_PROFILE_FORMAT:
        raise ProfileError(
            f"profile {source} is a whole pipeline's (saved by flextensor.save_profile(pipe, ...)), not one "
            "model's: give it to the pipeline's offload, flextensor.offload(pipe, "
            "OffloadConfig(profile=...))"
        )
    if marker != PROFILE_FORMAT:
        raise ProfileError(
            f"profile {source} is not a flextensor profile: its 'format' is {show(marker)}, expected "
            f"{PROFILE_FORMAT!r}; check the path, or {_REPROFILE}"
        )
    if "version" not in data:
        raise ProfileError(f"profile {source} has no 'version'; {_REPROFILE}")
    version = data["version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProfileError(
            f"profile {source} has version {show(version)}, not an integer; this flextensor reads version "
            f"{PROFILE_VERSION}; {_REPROFILE}"
        )
    if version != PROFILE_VERSION:
        advice = (
            "it was written by a newer flextensor: upgrade flextensor or " + _REPROFILE
            if version > PROFILE_VERSION
            else _REPROFILE
        )
        raise ProfileError(
            f"profile {source} has version {version}; this flextensor reads version {PROFILE_VERSION}; "
            + advice
        )
    body = {key: value for key, value in data.items() if key not in ("format", "version")}
    try:
        profile = from_json_data(body, Profile)
    except RecordError as exc:
        raise ProfileError(f"profile {source} is invalid: {exc}; {_REPROFILE}") from None
    except ProfileError as exc:  # a record's own check (a rank outside the world size)
        raise ProfileError(f"profile {source} is invalid: {exc}; {_REPROFILE}") from None
    _check_consistency(profile, source)
    return profile


def _check_consistency(profile: Profile, source: str) -> None:
    """Cross-field checks the annotations cannot express; raises ProfileError naming the field."""

    def bad(path: str, message: str) -> ProfileError:
        return ProfileError(f"profile {source} is inconsistent: {path} {message}; {_REPROFILE}")

    try:
        datetime.datetime.fromisoformat(profile.created_at)
    except ValueError:
        raise bad("created_at", f"is {show(profile.created_at)}, not an ISO 8601 time") from None

    parameter_names = [name for name, _, _ in profile.fingerprint.parameters]
    for path, names, what in (
        ("fingerprint.parameters", parameter_names, "parameter"),
        ("order", profile.order, "unit"),
        ("resident_parameters", profile.resident_parameters, "parameter"),
        ("plan.resident", profile.plan.resident, "unit"),
        ("plan.streamed", profile.plan.streamed, "unit"),
    ):
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name in seen:
                raise bad(f"{path}[{i}]", f"lists {what} {name!r} a second time")
            seen.add(name)

    measured = [u.name for u in profile.measurements.units]
    if list(profile.order) != measured:
        first = next(
            (i for i, (a, b) in enumerate(zip(profile.order, measured, strict=False)) if a != b),
            min(len(profile.order), len(measured)),
        )
        raise bad(
            "order",
            f"({len(profile.order)} units) and measurements.units ({len(measured)} units) disagree at "
            f"position {first}: {_at(profile.order, first)} vs {_at(measured, first)}",
        )

    # A unit of unit_parameters that is not in order never ran while the profile was learned (a VAE's
    # encoder in text-to-video): it loads on demand.
    for unit in profile.order:
        if unit not in profile.unit_parameters:
            raise bad("unit_parameters", f"has no entry for unit {unit!r} of order")

    # Every streamed parameter belongs to exactly one unit and is a parameter of the fingerprinted model.
    known = set(parameter_names)
    owner: dict[str, str] = {}
    for unit, fqns in profile.unit_parameters.items():
        for i, fqn in enumerate(fqns):
            path = f"unit_parameters[{unit!r}][{i}]"
            if fqn not in known:
                raise bad(path, f"names {fqn!r}, which is not in fingerprint.parameters")
            if fqn in owner:
                raise bad(path, f"names {fqn!r}, which unit {owner[fqn]!r} streams too")
            owner[fqn] = unit
    for i, fqn in enumerate(profile.resident_parameters):
        path = f"resident_parameters[{i}]"
        if fqn not in known:
            raise bad(path, f"names {fqn!r}, which is not in fingerprint.parameters")
        if fqn in owner:
            raise bad(path, f"names {fqn!r}, which unit {owner[fqn]!r} streams")

    plan = profile.plan
    units = set(profile.order)
    for path, planned in (("plan.resident", plan.resident), ("plan.streamed", plan.streamed)):
        for i, unit in enumerate(planned):
            if unit not in units:
                raise bad(f"{path}[{i}]", f"names unit {unit!r}, which is not in order")
    both = set(plan.resident) & set(plan.streamed)
    if both:
        raise bad("plan", f"has unit {sorted(both)[0]!r} both resident and streamed")
    unplanned = [u for u in profile.order if u not in set(plan.resident) | set(plan.streamed)]
    if unplanned:
        raise bad("plan", f"places unit {unplanned[0]!r} neither resident nor streamed")
    streamed = set(plan.streamed)
    if list(plan.streamed) != [u for u in profile.order if u in streamed]:
        raise bad("plan.streamed", "is not in execution order (the order of order)")
    sizes = {u.name: u.nbytes for u in profile.measurements.units}
    needed = minimal_arena_bytes([sizes[u] for u in plan.streamed])
    if plan.arena_bytes < needed:
        raise bad("plan.arena_bytes", f"is {plan.arena_bytes}, less than the {needed} its largest unit needs")
    _check_arena_bound(plan, sizes, bad)


def _check_arena_bound(plan: Plan, sizes: dict[str, int], bad: Any) -> None:
    """No plan holds more than its budget, nor an arena larger than its streamed units together: adopted,
    a plan that did would fail in the allocator (an out-of-memory error on a GPU) rather than here."""
    on_device = sum(sizes[u] for u in plan.resident if u not in plan.mapped)
    if plan.budget_bytes is not None and plan.arena_bytes + on_device > plan.budget_bytes:
        raise bad(
            "plan.arena_bytes",
            f"is {plan.arena_bytes}: with the {on_device} of its resident units, more than its budget "
            f"(plan.budget_bytes) of {plan.budget_bytes}",
        )
    together = sum(align_up(sizes[u], UNIT_ALIGNMENT) for u in plan.streamed)
    if plan.arena_bytes > together:
        raise bad(
            "plan.arena_bytes",
            f"is {plan.arena_bytes}, more than the {together} its streamed units take together",
        )


def _at(items: Sequence[str], i: int) -> str:
    return repr(items[i]) if i < len(items) else "(end)"


# --------------------------------------------------------------------------------------------------------
# Files


def save_profile_file(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write ``profile`` to ``path`` atomically: the old file stays intact until the new one is complete.

    The profile is validated first (it must load back); a symbolic link at ``path`` is followed (its
    target is replaced). A missing parent directory or a failed write raises ProfileError.
    """
    path = os.fspath(path)
    data = profile_to_dict(profile)
    # Read it back before writing: whatever is saved must load (a NaN or an inconsistent plan fails here).
    profile_from_dict(data, source=f"{path} (being saved)")
    write_profile_json(data, path)


def write_profile_json(data: dict[str, Any], path: str) -> None:
    """Write validated profile JSON ``data`` to ``path`` atomically (see :func:`save_profile_file`)."""
    directory = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(directory):
        raise ProfileError(
            f"cannot save profile {path}: directory {directory} does not exist; create it first"
        )
    try:
        atomic_write_text(path, render_json(data) + "\n")
    except OSError as exc:
        raise ProfileError(f"cannot save profile {path}: {exc}") from exc


def load_profile_file(path: str | os.PathLike[str]) -> Profile:
    """Read and validate the profile at ``path``. Every failure is a ProfileError naming the path."""
    path = os.fspath(path)
    return profile_from_dict(read_profile_json(path), source=path)


def read_profile_json(path: str) -> Any:
    """The parsed JSON at ``path``; a missing, unreadable or malformed file is a ProfileError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ProfileError(f"profile {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"profile {path} is not valid JSON (not UTF-8 text): {e}; {_REPROFILE}") from None
    except OSError as e:
        raise ProfileError(f"profile {path} cannot be read: {e}") from e
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and integers too long to parse.
        raise ProfileError(
            f"profile {path} is not valid JSON (truncated or hand-edited?): {e}; {_REPROFILE}"
        ) from None


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages read by people who edited the JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
