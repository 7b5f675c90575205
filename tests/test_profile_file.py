"""Tests of flextensor.profiles.file: JSON round trips, compatibility rules, strict loading, atomic saving."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flextensor.common import json_codec
from flextensor.common.json_codec import render_json
from flextensor.common.parameters import parameter_signatures
from flextensor.common.sizes import align_up
from flextensor.errors import ProfileError
from flextensor.plan.layout import UNIT_ALIGNMENT, minimal_arena_bytes
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.plan.plan import Plan
from flextensor.plan.planner import plan_offload
from flextensor.profiles.file import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    Compatibility,
    Fingerprint,
    Profile,
    check_compatibility,
    load_profile_file,
    profile_from_dict,
    profile_to_dict,
    replan_reasons,
    save_profile_file,
)
from spec_model import make_spec_model

N_LAYERS = 4
DTYPE_BYTES = 4


def make_profile(plan: Plan | None = None) -> Profile:
    """A consistent profile of the spec model: one unit per layer, ``*.scale`` excluded (resident)."""
    model = make_spec_model(n_layers=N_LAYERS)
    params = parameter_signatures(model)
    order = tuple(f"layers.{i}" for i in range(N_LAYERS))
    unit_parameters = {
        u: tuple(n for n, _, _ in params if n.startswith(u + ".") and not n.endswith(".scale")) for u in order
    }
    streamed_params = {n for fqns in unit_parameters.values() for n in fqns}
    resident_parameters = tuple(n for n, _, _ in params if n not in streamed_params)
    numel = {n: math.prod(shape) for n, shape, _ in params}
    units = tuple(
        UnitMeasurement(
            name=u,
            nbytes=sum(numel[n] for n in unit_parameters[u]) * DTYPE_BYTES,
            compute_s=1e-3 * (i + 1) + 1 / 3,  # a float with a long repr: must round-trip exactly
            gap_before_s=2e-5 if i == 0 else 0.0,
            activation_bytes=4096 * (i + 1),
        )
        for i, u in enumerate(order)
    )
    measurements = Measurements(
        units=units,
        link=LinkModel(points=((4096, 1.5e9), (1 << 20, 2.4e10)), latency_s=7e-6),
        tail_s=0.1,
        baseline_bytes=123_456,
        activation_peak_bytes=65_536,
        input_shapes=("tokens:(2, 8)",),
    )
    if plan is None:
        largest = max(align_up(u.nbytes, UNIT_ALIGNMENT) for u in units[1:])
        plan = Plan(
            resident=(order[0],),
            streamed=order[1:],
            arena_bytes=2 * largest,
            predicted_step_s=0.0123,
            predicted_peak_bytes=1 << 20,
            budget_bytes=1 << 30,
        )
    fingerprint = Fingerprint(
        parameters=params,
        include_patterns=("layers.*",),
        exclude_patterns=("*.scale",),
        device_name="NVIDIA H200",
        torch_version=torch.__version__,
        input_shapes=("tokens:(2, 8)",),
    )
    return Profile(
        fingerprint=fingerprint,
        order=order,
        unit_parameters=unit_parameters,
        resident_parameters=resident_parameters,
        measurements=measurements,
        plan=plan,
        created_at="2025-01-02T03:04:05+00:00",
        flextensor_version="0.1.0",
    )


PROFILE = make_profile()


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


# --------------------------------------------------------------------------------------------------------
# Fingerprint


def test_parameter_signatures_list_every_parameter_in_order() -> None:
    model = make_spec_model(n_layers=2)
    fp = parameter_signatures(model)
    assert [n for n, _, _ in fp] == [n for n, _ in model.named_parameters()]
    assert ("layers.1.mlp.router.weight", (2, 32), "torch.float32") in fp
    assert all(type(shape) is tuple and all(type(d) is int for d in shape) for _, shape, _ in fp)
    bf16 = parameter_signatures(model.to(torch.bfloat16))
    assert {dtype for _, _, dtype in bf16} == {"torch.bfloat16"}


@pytest.mark.parametrize(("rank", "world_size"), [(1, 1), (-1, 2), (0, 0)])
def test_fingerprint_rejects_impossible_rank(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"rank|world_size"):
        dataclasses.replace(PROFILE.fingerprint, rank=rank, world_size=world_size)


# --------------------------------------------------------------------------------------------------------
# Round trip and layout


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    path = tmp_path / "model.profile.json"
    save_profile_file(PROFILE, path)
    loaded = load_profile_file(path)
    assert loaded == PROFILE
    # repr also tells tuples from lists, floats from ints and 0.0 from -0.0.
    assert repr(loaded) == repr(PROFILE)
    assert type(loaded.order) is tuple
    assert type(loaded.resident_parameters) is tuple
    assert all(type(v) is tuple for v in loaded.unit_parameters.values())
    assert all(type(p) is tuple and type(p[1]) is tuple for p in loaded.fingerprint.parameters)
    assert all(type(pt) is tuple for pt in loaded.measurements.link.points)
    assert type(loaded.measurements.units) is tuple
    assert type(loaded.plan.streamed) is tuple


def test_file_layout_is_versioned_readable_json_in_a_stable_order(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile_file(PROFILE, path)
    text = path.read_text(encoding="utf-8")
    data = json.loads(text)
    assert list(data) == [
        "format",
        "version",
        "flextensor_version",
        "created_at",
        "fingerprint",
        "order",
        "unit_parameters",
        "resident_parameters",
        "measurements",
        "plan",
    ]
    assert data["format"] == PROFILE_FORMAT
    assert data["version"] == PROFILE_VERSION
    assert data == profile_to_dict(PROFILE)
    assert list(data["plan"]) == [f.name for f in dataclasses.fields(Plan)]
    assert list(data["measurements"]["units"][0]) == [f.name for f in dataclasses.fields(UnitMeasurement)]
    # Readable: indented, one parameter entry per line.
    assert '\n  "parameters": [\n   ["embed.weight", [64, 32], "torch.float32"],\n' in text
    # Stable: saving again gives the same bytes.
    first = path.read_bytes()
    save_profile_file(load_profile_file(path), path)
    assert path.read_bytes() == first


def test_every_plan_field_is_written_generically() -> None:
    # Whatever fields Plan has (others may add some), each is written and read back.
    data = profile_to_dict(PROFILE)
    assert set(data["plan"]) == {f.name for f in dataclasses.fields(Plan)}
    assert profile_from_dict(data).plan == PROFILE.plan


def test_plan_from_the_planner_round_trips(tmp_path: Path) -> None:
    # The planner's output is the contract: it must satisfy the profile's consistency checks.
    plan = plan_offload(PROFILE.measurements, budget_bytes=1 << 30)
    prof = make_profile(plan=plan)
    save_profile_file(prof, tmp_path / "p.json")
    assert load_profile_file(tmp_path / "p.json").plan == plan


def test_save_converts_by_annotation() -> None:
    # An int in a float field is saved as a float; what JSON cannot hold is refused.
    units = list(PROFILE.measurements.units)
    units[0] = dataclasses.replace(units[0], compute_s=2)
    prof = dataclasses.replace(
        PROFILE, measurements=dataclasses.replace(PROFILE.measurements, units=tuple(units))
    )
    value = profile_to_dict(prof)["measurements"]["units"][0]["compute_s"]
    assert value == 2.0 and type(value) is float
    bad = dataclasses.replace(PROFILE, plan=dataclasses.replace(PROFILE.plan, arena_bytes=object()))
    with pytest.raises(ProfileError, match=r"cannot save the profile"):
        profile_to_dict(bad)


def test_absent_defaulted_fields_take_their_defaults() -> None:
    # A profile written before a defaulted field existed stays readable.
    data = profile_to_dict(PROFILE)
    del data["plan"]["budget_bytes"]
    del data["measurements"]["units"][0]["gap_before_s"]
    loaded = profile_from_dict(data)
    assert loaded.plan.budget_bytes is None
    assert loaded.measurements.units[0].gap_before_s == 0.0
    assert loaded.measurements.units[1] == PROFILE.measurements.units[1]


# --------------------------------------------------------------------------------------------------------
# Compatibility


def _fp(**changes: Any) -> Fingerprint:
    return dataclasses.replace(PROFILE.fingerprint, **changes)


def _with_param(
    index: int, name: str | None = None, shape: Any = None, dtype: str | None = None
) -> Fingerprint:
    params = list(PROFILE.fingerprint.parameters)
    n, s, d = params[index]
    params[index] = (name or n, shape or s, dtype or d)
    return _fp(parameters=tuple(params))


UP = "layers.2.mlp.up.weight"
UP_INDEX = [n for n, _, _ in PROFILE.fingerprint.parameters].index(UP)
FIX = "; delete the profile or pass profile=None to re-profile"

COMPATIBILITY_CASES: list[tuple[str, Fingerprint, Fingerprint, Compatibility | str]] = [
    ("identical", PROFILE.fingerprint, PROFILE.fingerprint, Compatibility.SAME),
    (
        "parameter order only",
        PROFILE.fingerprint,
        _fp(parameters=tuple(reversed(PROFILE.fingerprint.parameters))),
        Compatibility.SAME,
    ),
    ("other device", PROFILE.fingerprint, _fp(device_name="NVIDIA H100 80GB HBM3"), Compatibility.REPLAN),
    ("other torch", PROFILE.fingerprint, _fp(torch_version="2.99.0"), Compatibility.REPLAN),
    ("other input shapes", PROFILE.fingerprint, _fp(input_shapes=("tokens:(4, 8)",)), Compatibility.REPLAN),
    ("other rank", _fp(world_size=2), _fp(rank=1, world_size=2), Compatibility.REPLAN),
    (
        "other shape",
        PROFILE.fingerprint,
        _with_param(UP_INDEX, shape=(128, 32)),
        f"profile /p.json was made for another model: parameter '{UP}' has shape (64, 32) in the profile "
        f"but (128, 32) in this model{FIX}",
    ),
    (
        "other dtype",
        PROFILE.fingerprint,
        _with_param(UP_INDEX, dtype="torch.bfloat16"),
        f"profile /p.json was made for another model: parameter '{UP}' has dtype torch.float32 in the "
        f"profile but torch.bfloat16 in this model{FIX}",
    ),
    (
        "parameter added",
        PROFILE.fingerprint,
        _fp(parameters=(*PROFILE.fingerprint.parameters, ("extra.weight", (3,), "torch.float32"))),
        f"profile /p.json was made for another model: parameter 'extra.weight' is in this model but not "
        f"in the profile{FIX}",
    ),
    (
        "parameter missing",
        PROFILE.fingerprint,
        _fp(parameters=PROFILE.fingerprint.parameters[:-1]),
        f"profile /p.json was made for another model: parameter 'lm_head.weight' is in the profile but "
        f"not in this model{FIX}",
    ),
    (
        "parameter renamed",
        PROFILE.fingerprint,
        _with_param(UP_INDEX, name="layers.3.mlp.w_up.weight"),
        "profile /p.json was made for another model: parameter 'layers.3.mlp.w_up.weight' is in this "
        f"model but not in the profile (the profile has '{UP}' at that position instead){FIX}",
    ),
    (
        "two differences: the first is named",
        PROFILE.fingerprint,
        _fp(
            parameters=tuple(
                (n, (7,), d) if n == "layers.0.attn.q.weight" else (n, (128, 32) if n == UP else s, d)
                for n, s, d in PROFILE.fingerprint.parameters
            ),
            include_patterns=("*",),
        ),
        "profile /p.json was made for another model: parameter 'layers.0.attn.q.weight' has shape "
        f"(32, 32) in the profile but (7,) in this model{FIX}",
    ),
    (
        "include patterns",
        PROFILE.fingerprint,
        _fp(include_patterns=("*",)),
        f"profile /p.json was made with other patterns: include_patterns differ: profile ['layers.*'], "
        f"config ['*']{FIX}",
    ),
    (
        "exclude patterns",
        PROFILE.fingerprint,
        _fp(exclude_patterns=()),
        f"profile /p.json was made with other patterns: exclude_patterns differ: profile ['*.scale'], "
        f"config []{FIX}",
    ),
    (
        "world size",
        _fp(world_size=2),
        _fp(world_size=4),
        "profile /p.json was made with world_size 2 but this run has world_size 4; each world size needs "
        "its own profile: delete the profile or pass profile=None to re-profile",
    ),
]


@pytest.mark.parametrize(
    ("saved", "current", "expected"),
    [case[1:] for case in COMPATIBILITY_CASES],
    ids=[case[0] for case in COMPATIBILITY_CASES],
)
def test_check_compatibility(saved: Fingerprint, current: Fingerprint, expected: Compatibility | str) -> None:
    if isinstance(expected, Compatibility):
        assert check_compatibility(saved, current, source="/p.json") is expected
        assert bool(replan_reasons(saved, current)) == (expected is Compatibility.REPLAN)
    else:
        with pytest.raises(ProfileError) as info:
            check_compatibility(saved, current, source="/p.json")
        assert str(info.value) == expected


def test_check_compatibility_without_a_source_and_replan_reasons() -> None:
    with pytest.raises(ProfileError, match=r"^the profile was made for another model: "):
        check_compatibility(PROFILE.fingerprint, _with_param(0, shape=(1,)))
    reasons = replan_reasons(PROFILE.fingerprint, _fp(device_name="cpu", input_shapes=("x:(1, 2)",)))
    assert reasons == (
        "device 'NVIDIA H200' in the profile, 'cpu' now",
        "input shapes ['tokens:(2, 8)'] in the profile, ['x:(1, 2)'] now",
    )


# --------------------------------------------------------------------------------------------------------
# Strict loading


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


def _edit_plan(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["plan"].update(changes)

    return edit


def _swap_units(data: dict[str, Any]) -> None:
    units = data["measurements"]["units"]
    units[0], units[1] = units[1], units[0]


INVALID_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "string for a float",
        _set(("measurements", "units", 3, "compute_s"), "0.5"),
        r'measurements\.units\[3\]\.compute_s: must be a valid number, got "0\.5"',
    ),
    (
        "negative byte count",
        _set(("measurements", "units", 2, "nbytes"), -1),
        r"measurements\.units\[2\]\.nbytes: must be greater than or equal to 0, got -1",
    ),
    (
        "NaN",
        _set(("measurements", "tail_s"), math.nan),
        r"measurements\.tail_s: must be a finite number, got NaN",
    ),
    (
        "infinity",
        _set(("plan", "predicted_step_s"), math.inf),
        r"plan\.predicted_step_s: must be a finite number, got Infinity",
    ),
    (
        "huge int for a float",
        _set(("measurements", "tail_s"), 10**400),
        r"measurements\.tail_s: must be a finite number",
    ),
    (
        "bool for an int",
        _set(("plan", "arena_bytes"), True),
        r"plan\.arena_bytes: must be a valid integer, got true",
    ),
    (
        "float for an int",
        _set(("measurements", "baseline_bytes"), 1.5),
        r"baseline_bytes: must be a valid integer, got 1\.5",
    ),
    ("null for a list", _set(("order",), None), r"order: must be a valid array, got null"),
    ("string for a list", _set(("order",), "layers.0"), r"order: must be a valid array, got \"layers\.0\""),
    (
        "short tuple",
        _set(("fingerprint", "parameters", 0), ["embed.weight", [64, 32]]),
        r"fingerprint\.parameters\[0\]\[2\]: is missing",
    ),
    ("shape entry", _set(("fingerprint", "parameters", 1, 1, 0), "32"), r"parameters\[1\]\[1\]\[0\]"),
    (
        "unknown key",
        _set(("plan", "speed"), 1),
        r"plan\.speed: is an unknown key \(written by a newer flextensor",
    ),
    ("unknown top-level key", _set(("extra",), 1), r"invalid: extra: is an unknown key"),
    ("missing key", _delete(("measurements", "units", 1, "compute_s")), r"units\[1\]\.compute_s: is missing"),
    ("missing top-level key", _delete(("plan",)), r"invalid: plan: is missing"),
    (
        "world size 0",
        _set(("fingerprint", "world_size"), 0),
        r"fingerprint\.world_size: must be greater than or equal to 1, got 0",
    ),
    (
        "link point",
        _set(("measurements", "link", "points"), [[0, 1.0]]),
        r"measurements\.link: link points must be positive",
    ),
    ("no link point", _set(("measurements", "link", "points"), []), r"measurements\.link: a LinkModel needs"),
    ("created_at", _set(("created_at",), "yesterday"), r"created_at is \"yesterday\", not an ISO 8601"),
    (
        "order vs units",
        _swap_units,
        r"order \(4 units\) and measurements\.units \(4 units\) disagree at position 0",
    ),
    (
        "unit twice in order",
        _set(("order", 1), "layers.0"),
        r"order\[1\] lists unit 'layers\.0' a second time",
    ),
    (
        "duplicate parameter",
        _set(("fingerprint", "parameters", 1, 0), "embed.weight"),
        r"parameters\[1\] lists",
    ),
    ("unit_parameters missing", _delete(("unit_parameters", "layers.2")), r"no entry for unit 'layers\.2'"),
    (
        "unknown streamed parameter",
        _set(("unit_parameters", "layers.1", 0), "nope.weight"),
        r"unit_parameters\['layers\.1'\]\[0\] names 'nope\.weight', which is not in fingerprint\.parameters",
    ),
    (
        "parameter in two units",
        _set(("unit_parameters", "layers.1", 0), "layers.0.attn.q.weight"),
        r"unit_parameters\['layers\.1'\]\[0\] names 'layers\.0\.attn\.q\.weight', which unit 'layers\.0'",
    ),
    (
        "resident parameter also streamed",
        _set(("resident_parameters", 0), "layers.0.attn.q.weight"),
        r"resident_parameters\[0\] names 'layers\.0\.attn\.q\.weight', which unit 'layers\.0' streams",
    ),
    ("plan unit not in order", _edit_plan(resident=["ghost"]), r"plan\.resident\[0\] names unit 'ghost'"),
    ("plan both", _edit_plan(resident=["layers.0", "layers.1"]), r"'layers\.1' both resident and streamed"),
    ("plan misses a unit", _edit_plan(resident=[]), r"places unit 'layers\.0' neither resident nor streamed"),
    (
        "plan out of order",
        _edit_plan(streamed=["layers.2", "layers.1", "layers.3"]),
        r"plan\.streamed is not in execution order",
    ),
    ("arena too small", _edit_plan(arena_bytes=4096), r"plan\.arena_bytes is 4096, less than the \d+"),
    (
        "arena beyond the budget",
        _edit_plan(arena_bytes=1 << 40),
        r"plan\.arena_bytes is 1099511627776: with the \d+ of its resident units, more than its budget "
        r"\(plan\.budget_bytes\) of 1073741824",
    ),
    (
        "arena beyond its streamed units",
        _edit_plan(arena_bytes=1 << 40, budget_bytes=None),
        r"plan\.arena_bytes is 1099511627776, more than the \d+ its streamed units take together",
    ),
]


@pytest.mark.parametrize(
    ("edit", "message"), [case[1:] for case in INVALID_CASES], ids=[case[0] for case in INVALID_CASES]
)
def test_invalid_field_is_named(tmp_path: Path, edit: Callable[[dict[str, Any]], None], message: str) -> None:
    data = profile_to_dict(PROFILE)
    edit(data)
    path = tmp_path / "p.json"
    write_json(path, data)
    with pytest.raises(ProfileError, match=message) as info:
        load_profile_file(path)
    assert str(path) in str(info.value)
    assert "delete it to re-profile" in str(info.value)


@pytest.mark.parametrize("version", [2, 0])
def test_other_version_is_refused_naming_both(tmp_path: Path, version: int) -> None:
    data = profile_to_dict(PROFILE)
    data["version"] = version
    path = tmp_path / "p.json"
    write_json(path, data)
    with pytest.raises(
        ProfileError, match=rf"^profile {path} has version {version}; this flextensor reads version 1"
    ):
        load_profile_file(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _set(("format",), "something-else"),
            r'its \'format\' is "something-else", expected \'flextensor-profile\'',
        ),
        (_delete(("format",)), r"its 'format' is null"),
        (_set(("version",), "1"), r'has version "1", not an integer'),
        (_set(("version",), True), r"has version true, not an integer"),
        (_delete(("version",)), r"has no 'version'"),
    ],
)
def test_format_marker_and_version_are_checked(edit: Callable[[dict[str, Any]], None], message: str) -> None:
    data = profile_to_dict(PROFILE)
    edit(data)
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(data, source="/p.json")


@pytest.mark.parametrize("data", [[], "profile", None, 1])
def test_non_object_is_refused(data: Any) -> None:
    with pytest.raises(ProfileError, match=r"^profile <dict> is not a flextensor profile"):
        profile_from_dict(data)


def test_truncated_file_is_not_valid_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile_file(PROFILE, path)
    text = path.read_bytes()
    path.write_bytes(text[: len(text) // 2])
    with pytest.raises(
        ProfileError, match=rf"^profile {path} is not valid JSON \(truncated or hand-edited\?\): "
    ):
        load_profile_file(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "is not valid JSON"), (b"\xff\xfe{", "is not valid JSON"), (b"[" * 100_000, "is not valid JSON")],
)
def test_unparseable_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match=message):
        load_profile_file(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"does not exist"):
        load_profile_file(tmp_path / "absent.json")


# --------------------------------------------------------------------------------------------------------
# Atomic saving


def _crash(*args: Any, **kwargs: Any) -> None:
    raise OSError(28, "No space left on device")


def _crash_runtime(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("interrupted")


@pytest.mark.parametrize(
    ("target", "crash", "error"),
    [
        ("replace", _crash, ProfileError),
        ("fsync", _crash, ProfileError),
        ("replace", _crash_runtime, RuntimeError),
        ("chmod", _crash, ProfileError),
    ],
)
def test_crash_mid_save_keeps_the_old_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, crash: Callable[..., None], error: type
) -> None:
    path = tmp_path / "p.json"
    old = make_profile(plan=plan_offload(PROFILE.measurements))
    save_profile_file(old, path)
    before = path.read_bytes()
    monkeypatch.setattr(json_codec.os, target, crash)
    with pytest.raises(error):
        save_profile_file(PROFILE, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["p.json"]  # no temporary file left behind
    assert load_profile_file(path) == old


def test_save_replaces_the_old_profile_keeping_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile_file(make_profile(plan=plan_offload(PROFILE.measurements)), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    path.chmod(0o600)
    save_profile_file(PROFILE, path)
    assert load_profile_file(path) == PROFILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["p.json"]


def test_save_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    real = tmp_path / "profiles" / "model.json"
    real.parent.mkdir()
    save_profile_file(make_profile(plan=plan_offload(PROFILE.measurements)), real)
    link = tmp_path / "current.json"
    link.symlink_to(real)
    save_profile_file(PROFILE, link)
    assert link.is_symlink() and link.resolve() == real
    assert load_profile_file(real) == PROFILE
    assert sorted(os.listdir(real.parent)) == ["model.json"]


def test_save_into_a_missing_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "no" / "such" / "dir" / "p.json"
    with pytest.raises(ProfileError, match=r"directory .*dir does not exist; create it first"):
        save_profile_file(PROFILE, path)
    assert not (tmp_path / "no").exists()


def test_save_refuses_an_invalid_profile_and_keeps_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile_file(PROFILE, path)
    before = path.read_bytes()
    nan = dataclasses.replace(
        PROFILE, measurements=dataclasses.replace(PROFILE.measurements, tail_s=math.nan)
    )
    with pytest.raises(ProfileError, match=r"measurements\.tail_s: must be a finite number, got NaN"):
        save_profile_file(nan, path)
    ghost = dataclasses.replace(PROFILE, plan=dataclasses.replace(PROFILE.plan, resident=("ghost",)))
    with pytest.raises(ProfileError, match=r"plan\.resident\[0\] names unit 'ghost'"):
        save_profile_file(ghost, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["p.json"]


# --------------------------------------------------------------------------------------------------------
# Property tests

_names = st.text(min_size=1, max_size=12)
_sizes = st.integers(min_value=0, max_value=2**62)
_times = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def random_profiles(draw: st.DrawFn) -> Profile:
    """A consistent profile around random measurements and a random plan."""
    names = draw(st.lists(_names, min_size=0, max_size=6, unique=True))
    units = tuple(
        UnitMeasurement(
            name=n,
            nbytes=draw(_sizes),
            compute_s=draw(_times),
            gap_before_s=draw(_times),
            activation_bytes=draw(_sizes),
        )
        for n in names
    )
    points = draw(
        st.lists(
            st.tuples(
                st.integers(min_value=1, max_value=2**62),
                st.floats(min_value=0.0, exclude_min=True, allow_nan=False, allow_infinity=False),
            ),
            min_size=1,
            max_size=4,
        )
    )
    measurements = Measurements(
        units=units,
        link=LinkModel(points=tuple(points), latency_s=draw(_times)),
        tail_s=draw(_times),
        baseline_bytes=draw(_sizes),
        activation_peak_bytes=draw(_sizes),
        input_shapes=tuple(draw(st.lists(st.text(max_size=20), max_size=3))),
    )
    resident_flags = [draw(st.booleans()) for _ in names]
    streamed = tuple(n for n, r in zip(names, resident_flags, strict=True) if not r)
    resident = tuple(n for n, r in zip(names, resident_flags, strict=True) if r)
    sizes = {u.name: u.nbytes for u in units}
    # Between the largest streamed unit and all of them, and with the residents within the budget.
    most = sum(align_up(sizes[n], UNIT_ALIGNMENT) for n in streamed)
    arena = min(minimal_arena_bytes([sizes[n] for n in streamed]) + draw(_sizes), most)
    within = arena + sum(sizes[n] for n in resident)
    plan = Plan(
        resident=resident,
        streamed=streamed,
        arena_bytes=arena,
        predicted_step_s=draw(_times),
        predicted_peak_bytes=draw(_sizes),
        budget_bytes=draw(st.none() | st.integers(within, within + 2**40)),
    )
    parameters = tuple(
        (f"{n}.weight", tuple(draw(st.lists(st.integers(0, 2**31), max_size=3))), "torch.float16")
        for n in names
    )
    fingerprint = Fingerprint(
        parameters=parameters,
        include_patterns=tuple(draw(st.lists(_names, max_size=2))),
        exclude_patterns=tuple(draw(st.lists(_names, max_size=2))),
        device_name=draw(st.text(max_size=20)),
        torch_version=draw(st.text(max_size=10)),
        input_shapes=measurements.input_shapes,
        rank=0,
        world_size=draw(st.integers(1, 8)),
    )
    return Profile(
        fingerprint=fingerprint,
        order=tuple(names),
        unit_parameters={n: (f"{n}.weight",) for n in names},
        resident_parameters=(),
        measurements=measurements,
        plan=plan,
        created_at="2025-06-30T12:00:00.123456+00:00",
        flextensor_version=draw(st.text(max_size=10)),
    )


@settings(max_examples=150, deadline=None)
@given(random_profiles())
def test_random_profiles_round_trip_exactly(prof: Profile) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.json")
        save_profile_file(prof, path)
        loaded = load_profile_file(path)
    assert loaded == prof
    assert repr(loaded) == repr(prof)  # every float bit-exact, tuples still tuples


_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([10**400, -(10**400), 2**64, -1, 0])  # past float range, past int64, edges
    | st.floats()
    | st.text(max_size=8)
)
# Scalars as often as containers: a wrong-typed leaf is the commonest hand edit.
_json_values = _json_scalars | st.recursive(
    _json_scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=6,
)


def _nodes(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of nodes below ``value``: every key of every object, the first, second and last list items.

    Sampling lists sparsely keeps the long ``fingerprint.parameters`` list from drowning out small
    sections such as ``measurements.link``.
    """
    if isinstance(value, dict):
        keys: list[Any] = list(value)
    elif isinstance(value, list):
        keys = sorted({0, 1, len(value) - 1} & set(range(len(value))))
    else:
        return []
    out: list[tuple[Any, ...]] = []
    for key in keys:
        out.append((*path, key))
        out.extend(_nodes(value[key], (*path, key)))
    return out


BASE_DICT = profile_to_dict(PROFILE)
DEFAULTED_FIELDS = {
    f.name
    for cls in (Fingerprint, Profile, Measurements, UnitMeasurement, LinkModel, Plan)
    for f in dataclasses.fields(cls)
    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
}
NODES = _nodes(BASE_DICT)


def _corrupt(target: tuple[Any, ...], value: Any = None, *, delete: bool = False) -> dict[str, Any]:
    """A deep copy of the valid profile dict with the node at ``target`` replaced or deleted."""
    corrupted = copy.deepcopy(BASE_DICT)
    parent = corrupted
    for key in target[:-1]:
        parent = parent[key]
    if delete:
        del parent[target[-1]]
    else:
        parent[target[-1]] = value
    return corrupted


def _in_object(target: tuple[Any, ...]) -> bool:
    parent: Any = BASE_DICT
    for key in target[:-1]:
        parent = parent[key]
    return isinstance(parent, dict)


def _load_or_refuse(target: tuple[Any, ...], corrupted: dict[str, Any], deleted: bool) -> bool:
    """Load ``corrupted``; True if it loaded. Any exception but ProfileError fails the test."""
    try:
        loaded = profile_from_dict(corrupted, source="/p.json")
    except ProfileError as e:
        assert str(e).startswith("profile /p.json ")
        return False
    if deleted:
        # Only a field with a default may go missing unnoticed.
        assert target[-1] in DEFAULTED_FIELDS, target
    # Whatever loads is a valid profile: it saves and loads back unchanged.
    assert profile_from_dict(profile_to_dict(loaded)) == loaded
    return True


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_corruption_loads_or_raises_profile_error(data: st.DataObject) -> None:
    target = data.draw(st.sampled_from(NODES))
    if _in_object(target) and data.draw(st.booleans()):
        _load_or_refuse(target, _corrupt(target, delete=True), deleted=True)
    else:
        _load_or_refuse(target, _corrupt(target, data.draw(_json_values)), deleted=False)


FIXED_BAD_VALUES = [None, True, -1, 0, 2**64, 10**400, 2.5, -0.5, math.nan, math.inf, "x", "", [], [0], {}]


def test_every_node_with_every_bad_value_loads_or_raises_profile_error() -> None:
    # Exhaustive companion to the random test: each sampled node, each awkward value, each deletion.
    loaded = refused = 0
    for target in NODES:
        for value in FIXED_BAD_VALUES:
            ok = _load_or_refuse(target, _corrupt(target, value), deleted=False)
            loaded, refused = loaded + ok, refused + (not ok)
        if _in_object(target):
            ok = _load_or_refuse(target, _corrupt(target, delete=True), deleted=True)
            loaded, refused = loaded + ok, refused + (not ok)
    # Most edits break the profile; a few (0 for a time, another string for a name) are still valid.
    assert refused > loaded > 0


BASE_TEXT = render_json(BASE_DICT)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(BASE_TEXT)), st.integers(0, len(BASE_TEXT) - 1), st.characters(codec="utf-8"))
def test_random_text_damage_raises_only_profile_error(cut: int, at: int, char: str) -> None:
    for text in (BASE_TEXT[:cut], BASE_TEXT[:at] + char + BASE_TEXT[at + 1 :]):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "p.json")
            Path(path).write_text(text, encoding="utf-8")
            try:
                loaded = load_profile_file(path)
            except ProfileError:
                continue
            assert isinstance(loaded, Profile)


def test_a_host_plan_round_trips_and_is_left_out_without_a_host_budget(tmp_path: Path) -> None:
    """A profile made under a host budget keeps what the budget left the planner (pinned capacity, staged
    and disk copy speeds, disk units); one without writes no ``host`` key, as before."""
    from flextensor.plan.host_plan import HostPlan

    host = HostPlan(
        capacity_bytes=1 << 20,
        staged_link=LinkModel(points=((1 << 20, 1.2e10),)),
        disk_units=frozenset({"layers.3", "layers.2"}),
        disk_link=LinkModel(points=((1 << 20, 1.5e9),)),
    )
    with_host = dataclasses.replace(PROFILE, host=host)
    path = tmp_path / "p.json"
    save_profile_file(with_host, path)
    assert load_profile_file(path).host == host
    assert json.loads(path.read_text(encoding="utf-8"))["host"]["disk_units"] == ["layers.2", "layers.3"]
    save_profile_file(PROFILE, path)
    assert "host" not in json.loads(path.read_text(encoding="utf-8"))
    assert load_profile_file(path).host is None
