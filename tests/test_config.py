"""Tests for flextensor.config.schema: OffloadConfig's fields, defaults and validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from flextensor.config.devices import resolve_device
from flextensor.config.schema import OffloadConfig
from flextensor.config.sources import ENV_VARS
from flextensor.errors import ConfigError

GiB = 2**30
MiB = 2**20


# ----------------------------------------------------------------------------------------------------------
# Defaults, immutability, errors
# ----------------------------------------------------------------------------------------------------------


def test_defaults() -> None:
    config = OffloadConfig()
    assert config.include_patterns == ("*",)
    assert config.exclude_patterns == ()
    assert config.device is None
    assert config.discovery_forwards == 1
    assert config.profiling_forwards == 1
    assert config.pinned_memory is None
    assert config.gpu_memory_budget is None
    assert config.max_gpu_mem_fraction is None
    assert config.profile is None
    assert config.share_host_memory is False


def test_every_field_has_a_description_and_env_var() -> None:
    for name, info in OffloadConfig.model_fields.items():
        assert info.description, name
        assert ENV_VARS[name] == "FT_" + name.upper() == OffloadConfig.env_var(name)
    assert set(ENV_VARS) == set(OffloadConfig.model_fields)


def test_env_var_of_unknown_field_suggests() -> None:
    with pytest.raises(ConfigError, match="did you mean 'gpu_memory_budget'"):
        OffloadConfig.env_var("gpu_memory_budgt")


def test_frozen_assignment_raises() -> None:
    config = OffloadConfig()
    with pytest.raises(ValidationError, match="frozen"):
        config.discovery_forwards = 3  # type: ignore[misc]
    assert config.discovery_forwards == 1


def test_pattern_fields_are_immutable_tuples() -> None:
    config = OffloadConfig(include_patterns=["layers.*"])
    assert isinstance(config.include_patterns, tuple)
    assert config.include_patterns == ("layers.*",)


def test_hashable_and_equal_by_value() -> None:
    a = OffloadConfig(include_patterns=["a.*"], gpu_memory_budget="1GiB")
    b = OffloadConfig(include_patterns=("a.*",), gpu_memory_budget=GiB)
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b, OffloadConfig()}) == 2


def test_repr_shows_fields() -> None:
    text = repr(OffloadConfig(gpu_memory_budget=123))
    assert text.startswith("OffloadConfig(")
    assert "gpu_memory_budget=123" in text


def test_invalid_value_raises_one_line_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig(discovery_forwards=0)
    assert not isinstance(info.value, ValidationError)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)
    assert "discovery_forwards" in str(info.value)
    # Raised `from None`: no pydantic report chained underneath.
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_unknown_field_suggests_closest() -> None:
    with pytest.raises(
        ConfigError, match="unknown config field 'exclude_pattern'; did you mean 'exclude_patterns'"
    ):
        OffloadConfig(exclude_pattern=["x"])


def test_unknown_field_without_close_match_lists_fields() -> None:
    with pytest.raises(ConfigError, match=r"valid ones are .*'device'"):
        OffloadConfig(zzzzzz=1)


# ----------------------------------------------------------------------------------------------------------
# Field validation
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["include_patterns", "exclude_patterns"])
def test_bare_string_pattern_is_an_error(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be a list of patterns, e\.g\. \['layers\.\*'\]"):
        OffloadConfig(**{field: "lm_head"})


@pytest.mark.parametrize("field", ["include_patterns", "exclude_patterns"])
@pytest.mark.parametrize("value", [None, 3, {"a": 1}])
def test_non_list_patterns_are_an_error(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be a list"):
        OffloadConfig(**{field: value})


def test_empty_include_patterns_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"include_patterns is empty.*\['\*'\]"):
        OffloadConfig(include_patterns=[])


def test_empty_exclude_patterns_is_fine() -> None:
    assert OffloadConfig(exclude_patterns=[]).exclude_patterns == ()


@pytest.mark.parametrize("field", ["include_patterns", "exclude_patterns"])
@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("", "empty pattern"),
        ("a b", "whitespace"),
        ("foo:bar", "unknown prefix"),
        ("class:", "names no class"),
        (7, "int"),
    ],
)
def test_malformed_pattern_names_field_and_index(field: str, pattern: object, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field}\[1\]: .*{message}"):
        OffloadConfig(**{field: ["ok.*", pattern]})


def test_valid_patterns_kept_in_order() -> None:
    config = OffloadConfig(
        include_patterns=["layers.*", "class:MoELayer"], exclude_patterns=["lm_head", "*.norm"]
    )
    assert config.include_patterns == ("layers.*", "class:MoELayer")
    assert config.exclude_patterns == ("lm_head", "*.norm")


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        ("cpu", "cpu"),
        ("cuda", "cuda"),
        ("cuda:0", "cuda:0"),
        ("cuda:3", "cuda:3"),
        (torch.device("cuda", 1), "cuda:1"),
    ],
)
def test_valid_devices(value: object, stored: str) -> None:
    assert OffloadConfig(device=value).device == stored


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("gpu", "is not a device"),
        ("", "is not a device"),
        ("cuda:x", "is not a device"),
        ("meta", "has type 'meta'"),
        ("mps", "has type 'mps'"),
        (0, "must be a string"),
    ],
)
def test_invalid_devices(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadConfig(device=value)


@pytest.mark.parametrize("field", ["discovery_forwards", "profiling_forwards"])
def test_forwards_accept_positive_ints(field: str) -> None:
    assert getattr(OffloadConfig(**{field: 4}), field) == 4


@pytest.mark.parametrize("field", ["discovery_forwards", "profiling_forwards"])
@pytest.mark.parametrize("value", [0, -1, True, 1.0, "2", None])
def test_forwards_reject_non_positive_or_non_int(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be an integer >= 1"):
        OffloadConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pinned_memory", "yes"),
        ("pinned_memory", 1),
        ("share_host_memory", "true"),
        ("share_host_memory", 0),
        ("share_host_memory", None),
    ],
)
def test_bool_fields_are_strict(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be true or false"):
        OffloadConfig(**{field: value})


def test_bool_fields_accept_bools() -> None:
    config = OffloadConfig(pinned_memory=False, share_host_memory=True)
    assert config.pinned_memory is False
    assert config.share_host_memory is True


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("8GiB", 8 * GiB),
        ("8 GiB", 8 * GiB),
        ("7.5GB", 7_500_000_000),
        ("512MiB", 512 * MiB),
        ("1024", 1024),
        (4096, 4096),
    ],
)
def test_gpu_memory_budget_parsed_to_bytes(value: object, expected: int) -> None:
    assert OffloadConfig(gpu_memory_budget=value).gpu_memory_budget == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "must be > 0"),
        ("0GiB", "must be > 0"),
        ("0.0001B", "must be > 0"),
        (-5, "negative"),
        ("8G", "unknown unit"),
        ("lots", "not a byte size"),
        (1.5e9, "number of bytes"),
        (True, "number of bytes"),
    ],
)
def test_gpu_memory_budget_errors(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=f"gpu_memory_budget.*{message}"):
        OffloadConfig(gpu_memory_budget=value)


@pytest.mark.parametrize(("value", "expected"), [(0.5, 0.5), (1, 1.0), (1.0, 1.0), (1e-6, 1e-6)])
def test_max_gpu_mem_fraction_valid(value: float, expected: float) -> None:
    stored = OffloadConfig(max_gpu_mem_fraction=value).max_gpu_mem_fraction
    assert stored == expected
    assert isinstance(stored, float)


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.0001, 2, math.nan, math.inf, True, "0.5"])
def test_max_gpu_mem_fraction_invalid(value: object) -> None:
    with pytest.raises(ConfigError, match=r"max_gpu_mem_fraction must be"):
        OffloadConfig(max_gpu_mem_fraction=value)


def test_budget_and_fraction_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"gpu_memory_budget .*max_gpu_mem_fraction.*set only one"):
        OffloadConfig(gpu_memory_budget="8GiB", max_gpu_mem_fraction=0.5)


@pytest.mark.parametrize("value", ["p.profile", Path("/tmp/p.profile")])
def test_profile_stored_as_path(value: object) -> None:
    assert OffloadConfig(profile=value).profile == Path(value)  # type: ignore[arg-type]


def test_profile_need_not_exist_yet(tmp_path: Path) -> None:
    missing = tmp_path / "nope.profile"
    assert OffloadConfig(profile=missing).profile == missing


@pytest.mark.parametrize(
    ("value", "message"),
    [("", "profile is empty"), ("   ", "profile is empty"), (3, "profile must be a path")],
)
def test_profile_errors(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadConfig(profile=value)


# ----------------------------------------------------------------------------------------------------------
# What the device means on this machine (config/devices.py)
# ----------------------------------------------------------------------------------------------------------


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, available: bool, current: int = 0, count: int = 1) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_resolve_device_unset_without_cuda_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=False)
    assert resolve_device(None) == torch.device("cpu")


def test_resolve_device_unset_with_cuda_is_current_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, current=2, count=4)
    assert resolve_device(None) == torch.device("cuda", 2)


def test_resolve_device_bare_cuda_gets_current_index(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, current=1, count=2)
    assert resolve_device("cuda") == torch.device("cuda", 1)


def test_resolve_device_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, current=0, count=2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_resolve_device_cuda_without_cuda_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=False)
    with pytest.raises(ConfigError, match=r"CUDA is not available.*device='cpu'"):
        resolve_device("cuda")


def test_resolve_device_missing_index_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, count=2)
    with pytest.raises(ConfigError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_resolved_device_of_a_config(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, current=1, count=2)
    assert OffloadConfig(device="cuda").resolved_device() == torch.device("cuda", 1)
    _fake_cuda(monkeypatch, available=False)
    config = OffloadConfig(device="cuda")  # the syntax is fine: CUDA is asked for when resolving
    with pytest.raises(ConfigError, match="CUDA is not available"):
        config.resolved_device()
