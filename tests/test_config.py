"""Tests for flextensor.config: OffloadConfig validation, byte sizes, and load_config's layering."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from flextensor.config import (
    CONFIG_FILE_ENV_VAR,
    ENV_VARS,
    NON_FIELD_ENV_VARS,
    OffloadConfig,
    format_bytes,
    load_config,
    parse_bytes,
)
from flextensor.errors import ConfigError

GiB = 2**30
MiB = 2**20
KiB = 2**10

# The autouse fixture below is function-scoped; it only clears FT_* variables, which hypothesis examples
# neither set nor read, so sharing it across examples is safe.
_hypothesis = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep FT_* variables from the real environment out of every test."""
    for name in list(os.environ):
        if name.startswith("FT_"):
            monkeypatch.delenv(name)


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


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
# Resolution
# ----------------------------------------------------------------------------------------------------------


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, available: bool, current: int = 0, count: int = 1) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_resolved_device_unset_without_cuda_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=False)
    assert OffloadConfig().resolved_device() == torch.device("cpu")


def test_resolved_device_unset_with_cuda_is_current_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, current=2, count=4)
    assert OffloadConfig().resolved_device() == torch.device("cuda", 2)


def test_resolved_device_bare_cuda_gets_current_index(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, current=1, count=2)
    assert OffloadConfig(device="cuda").resolved_device() == torch.device("cuda", 1)


def test_resolved_device_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, current=0, count=2)
    assert OffloadConfig(device="cuda:1").resolved_device() == torch.device("cuda", 1)
    assert OffloadConfig(device="cpu").resolved_device() == torch.device("cpu")


def test_resolved_device_cuda_without_cuda_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=False)
    with pytest.raises(ConfigError, match=r"CUDA is not available.*device='cpu'"):
        OffloadConfig(device="cuda").resolved_device()


def test_resolved_device_missing_index_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, available=True, count=2)
    with pytest.raises(ConfigError, match="only 2 CUDA device"):
        OffloadConfig(device="cuda:2").resolved_device()


@pytest.mark.parametrize(
    ("pinned", "device", "expected"),
    [
        (None, "cuda:0", True),
        (None, "cpu", False),
        (True, "cuda:0", True),
        (False, "cuda:0", False),
        (True, "cpu", False),
        (False, "cpu", False),
    ],
)
def test_resolved_pinned_memory(pinned: bool | None, device: str, expected: bool) -> None:
    assert OffloadConfig(pinned_memory=pinned).resolved_pinned_memory(torch.device(device)) is expected


def test_resolved_budget_bytes() -> None:
    assert OffloadConfig().resolved_budget_bytes(80 * GiB) is None
    assert OffloadConfig().resolved_budget_bytes(None) is None
    assert OffloadConfig(gpu_memory_budget="8GiB").resolved_budget_bytes(80 * GiB) == 8 * GiB
    assert OffloadConfig(gpu_memory_budget="8GiB").resolved_budget_bytes(None) == 8 * GiB
    assert OffloadConfig(max_gpu_mem_fraction=0.25).resolved_budget_bytes(80 * GiB) == 20 * GiB
    assert OffloadConfig(max_gpu_mem_fraction=0.3).resolved_budget_bytes(1003) == 300  # 300.9, rounded down


@pytest.mark.parametrize("total", [None, 0, -1])
def test_resolved_budget_bytes_fraction_needs_total(total: int | None) -> None:
    with pytest.raises(ConfigError, match=r"max_gpu_mem_fraction.*total memory"):
        OffloadConfig(max_gpu_mem_fraction=0.5).resolved_budget_bytes(total)


# ----------------------------------------------------------------------------------------------------------
# Byte sizes
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1024", 1024),
        (" 1024 ", 1024),
        ("1024B", 1024),
        ("1024 b", 1024),
        ("1KiB", KiB),
        ("1KB", 1000),
        ("1kb", 1000),
        ("512MiB", 512 * MiB),
        ("512mib", 512 * MiB),
        ("8GiB", 8 * GiB),
        ("8 GiB", 8 * GiB),
        ("8gib", 8 * GiB),
        ("8GIB", 8 * GiB),
        ("8GB", 8 * 10**9),
        ("7.5GB", 7_500_000_000),
        ("7.5GiB", 7.5 * GiB),
        (".5GiB", GiB // 2),
        ("2TiB", 2 * 2**40),
        ("2TB", 2 * 10**12),
        ("3MB", 3 * 10**6),
        ("1.0000000001KiB", KiB),  # fractional bytes round down
        ("123456789012345678901234567890.5 TiB", 123456789012345678901234567890 * 2**40 + 2**39),
        (0, 0),
        (8 * GiB, 8 * GiB),
    ],
)
def test_parse_bytes_table(text: str | int, expected: int) -> None:
    result = parse_bytes(text)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "not a byte size"),
        ("GiB", "not a byte size"),
        ("-1GiB", "not a byte size"),
        ("1,024", "not a byte size"),
        ("8 G iB", "not a byte size"),
        ("1e9", "not a byte size"),
        ("8G", "unknown unit"),
        ("8 gigs", "unknown unit"),
        ("8PiB", "unknown unit"),
        ("1024.5", "must be whole"),
        (-1, "negative"),
        (True, "not a byte size"),
        (1.5, "not a byte size"),
        (None, "not a byte size"),
    ],
)
def test_parse_bytes_errors(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_bytes(value)  # type: ignore[arg-type]
    # Every message shows what a valid size looks like.
    assert "'8GiB'" in str(info.value) or "'1024'" in str(info.value)


@_hypothesis
@given(st.integers(min_value=0, max_value=10**30))
def test_parse_bytes_plain_integer_round_trips(n: int) -> None:
    assert parse_bytes(f"{n}") == n
    assert parse_bytes(n) == n
    assert parse_bytes(f"{n} B") == n


@_hypothesis
@given(
    st.integers(min_value=0, max_value=10**9),
    st.sampled_from(
        [
            ("KiB", KiB),
            ("MiB", MiB),
            ("GiB", GiB),
            ("TiB", 2**40),
            ("KB", 10**3),
            ("MB", 10**6),
            ("GB", 10**9),
            ("TB", 10**12),
        ]
    ),
    st.sampled_from(["", " "]),
    st.sampled_from([str, str.lower, str.upper]),
)
def test_parse_bytes_whole_units(k: int, unit: tuple[str, int], space: str, case: object) -> None:
    name, factor = unit
    assert parse_bytes(f"{k}{space}{case(name)}") == k * factor  # type: ignore[operator]


@_hypothesis
@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=0, max_value=99))
def test_parse_bytes_decimal_fraction_is_exact(whole: int, hundredths: int) -> None:
    assert parse_bytes(f"{whole}.{hundredths:02d}GB") == whole * 10**9 + hundredths * 10**7


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (512 * MiB, "512.0 MiB"),
        (8 * GiB, "8.00 GiB"),
        (int(1.46 * GiB), "1.46 GiB"),
        (3 * 2**40, "3.00 TiB"),
        (-2 * GiB, "-2.00 GiB"),
    ],
)
def test_format_bytes_table(n: int, text: str) -> None:
    assert format_bytes(n) == text


@_hypothesis
@given(st.integers(min_value=0, max_value=2**50))
def test_format_bytes_parses_back_closely(n: int) -> None:
    back = parse_bytes(format_bytes(n))
    # One decimal of KiB/MiB or two of GiB/TiB: off by at most 5% (1 B for exact byte counts).
    assert abs(back - n) <= max(1, 0.05 * n)


# ----------------------------------------------------------------------------------------------------------
# load_config: layers and precedence
# ----------------------------------------------------------------------------------------------------------


def test_load_config_with_nothing_set_is_defaults() -> None:
    assert load_config() == OffloadConfig()


def test_spec_env_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_INCLUDE_PATTERNS", "*")
    monkeypatch.setenv("FT_EXCLUDE_PATTERNS", "lm_head,*.norm")
    config = load_config()
    assert config.include_patterns == ("*",)
    assert config.exclude_patterns == ("lm_head", "*.norm")


def test_spec_yaml_example(tmp_path: Path) -> None:
    path = _write(tmp_path, 'include_patterns:\n  - "*"\nexclude_patterns:\n  - "lm_head"\n  - "*.scale"\n')
    config = load_config(path)
    assert config.include_patterns == ("*",)
    assert config.exclude_patterns == ("lm_head", "*.scale")


def test_yaml_sets_every_field(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "include_patterns: ['layers.*']\n"
        "exclude_patterns: ['*.norm']\n"
        "device: cpu\n"
        "discovery_forwards: 2\n"
        "profiling_forwards: 3\n"
        "pinned_memory: false\n"
        "gpu_memory_budget: 8GiB\n"
        "profile: saved.profile\n"
        "share_host_memory: true\n",
    )
    config = load_config(str(path))
    assert config == OffloadConfig(
        include_patterns=["layers.*"],
        exclude_patterns=["*.norm"],
        device="cpu",
        discovery_forwards=2,
        profiling_forwards=3,
        pinned_memory=False,
        gpu_memory_budget=8 * GiB,
        profile="saved.profile",
        share_host_memory=True,
    )


def test_env_sets_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "FT_INCLUDE_PATTERNS": "layers.*, class:MoELayer",
        "FT_EXCLUDE_PATTERNS": " lm_head ,*.norm ",
        "FT_DEVICE": "cpu",
        "FT_DISCOVERY_FORWARDS": "2",
        "FT_PROFILING_FORWARDS": " 3 ",
        "FT_PINNED_MEMORY": "off",
        "FT_MAX_GPU_MEM_FRACTION": "0.75",
        "FT_PROFILE": "p.profile",
        "FT_SHARE_HOST_MEMORY": "YES",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert load_config() == OffloadConfig(
        include_patterns=["layers.*", "class:MoELayer"],
        exclude_patterns=["lm_head", "*.norm"],
        device="cpu",
        discovery_forwards=2,
        profiling_forwards=3,
        pinned_memory=False,
        max_gpu_mem_fraction=0.75,
        profile="p.profile",
        share_host_memory=True,
    )


def test_env_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_GPU_MEMORY_BUDGET", "8GiB")
    assert load_config().gpu_memory_budget == 8 * GiB


def test_yaml_overrides_defaults_and_keeps_unset_fields(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "discovery_forwards: 3\n"))
    assert config.discovery_forwards == 3
    assert config.profiling_forwards == 1
    assert config.include_patterns == ("*",)


def test_env_overrides_yaml_and_keeps_other_yaml_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, "discovery_forwards: 3\nprofiling_forwards: 4\n")
    monkeypatch.setenv("FT_DISCOVERY_FORWARDS", "5")
    config = load_config(path)
    assert config.discovery_forwards == 5
    assert config.profiling_forwards == 4


def test_overrides_win_over_env_and_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "discovery_forwards: 3\nprofiling_forwards: 4\ndevice: cpu\n")
    monkeypatch.setenv("FT_DISCOVERY_FORWARDS", "5")
    monkeypatch.setenv("FT_PROFILING_FORWARDS", "6")
    config = load_config(path, discovery_forwards=7)
    assert config.discovery_forwards == 7
    assert config.profiling_forwards == 6
    assert config.device == "cpu"


def test_override_of_none_clears_lower_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_DEVICE", "cpu")
    assert load_config(device=None).device is None


@pytest.mark.parametrize(
    ("yaml_text", "env", "overrides", "budget", "fraction"),
    [
        ("gpu_memory_budget: 8GiB\n", {"FT_MAX_GPU_MEM_FRACTION": "0.5"}, {}, None, 0.5),
        ("max_gpu_mem_fraction: 0.5\n", {"FT_GPU_MEMORY_BUDGET": "4GiB"}, {}, 4 * GiB, None),
        ("max_gpu_mem_fraction: 0.5\n", {}, {"gpu_memory_budget": "2GiB"}, 2 * GiB, None),
        ("gpu_memory_budget: 8GiB\n", {}, {"max_gpu_mem_fraction": 0.9}, None, 0.9),
        ("gpu_memory_budget: 8GiB\n", {"FT_DEVICE": "cpu"}, {}, 8 * GiB, None),
    ],
)
def test_budget_and_fraction_are_one_setting_across_layers(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    yaml_text: str,
    env: dict[str, str],
    overrides: dict[str, object],
    budget: int | None,
    fraction: float | None,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = load_config(_write(tmp_path, yaml_text), **overrides)
    assert config.gpu_memory_budget == budget
    assert config.max_gpu_mem_fraction == fraction


def test_budget_and_fraction_in_one_yaml_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "gpu_memory_budget: 8GiB\nmax_gpu_mem_fraction: 0.5\n")
    with pytest.raises(ConfigError, match=f"in {re.escape(str(path))}: .*set only one"):
        load_config(path)


def test_budget_and_fraction_in_env_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_GPU_MEMORY_BUDGET", "8GiB")
    monkeypatch.setenv("FT_MAX_GPU_MEM_FRACTION", "0.5")
    with pytest.raises(ConfigError, match=r"environment variables: .*set only one"):
        load_config()


# ----------------------------------------------------------------------------------------------------------
# load_config: the config file
# ----------------------------------------------------------------------------------------------------------


def test_ft_config_file_is_read_when_no_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV_VAR, str(_write(tmp_path, "profiling_forwards: 9\n")))
    assert load_config().profiling_forwards == 9


def test_env_overrides_ft_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV_VAR, str(_write(tmp_path, "profiling_forwards: 9\n")))
    monkeypatch.setenv("FT_PROFILING_FORWARDS", "2")
    assert load_config().profiling_forwards == 2


def test_explicit_path_wins_over_ft_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV_VAR, str(_write(tmp_path, "profiling_forwards: 9\n", "env.yaml")))
    assert load_config(_write(tmp_path, "profiling_forwards: 4\n", "arg.yaml")).profiling_forwards == 4


def test_missing_ft_config_file_names_file_and_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "absent.yaml"
    monkeypatch.setenv(CONFIG_FILE_ENV_VAR, str(missing))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(missing))}.*FT_CONFIG_FILE.*does not exist"):
        load_config()


def test_empty_ft_config_file_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV_VAR, "")
    with pytest.raises(ConfigError, match="FT_CONFIG_FILE is set but empty"):
        load_config()


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.yaml does not exist"):
        load_config(tmp_path / "absent.yaml")


def test_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{re.escape(str(tmp_path))} cannot be read"):
        load_config(tmp_path)


def test_non_utf8_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(b"device: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml is not UTF-8"):
        load_config(path)


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "device: cpu\ninclude_patterns: [a, b\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))} is not valid YAML: .*line \d+") as info:
        load_config(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "kind"), [("- a\n- b\n", "list"), ("just a string\n", "str"), ("3\n", "int")]
)
def test_non_mapping_yaml_is_an_error(tmp_path: Path, text: str, kind: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))} must be a YAML mapping.*got a {kind}"):
        load_config(path)


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_yaml_sets_nothing(tmp_path: Path, text: str) -> None:
    assert load_config(_write(tmp_path, text)) == OffloadConfig()


def test_unknown_yaml_key_suggests_closest(tmp_path: Path) -> None:
    path = _write(tmp_path, "exclude_pattern:\n  - lm_head\n")
    with pytest.raises(
        ConfigError,
        match=rf"unknown key 'exclude_pattern' in {re.escape(str(path))}; did you mean 'exclude_patterns'\?",
    ):
        load_config(path)


def test_non_string_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "1: x\n")
    with pytest.raises(ConfigError, match=f"unknown key 1 in {re.escape(str(path))}"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("include_patterns: lm_head\n", "include_patterns must be a list"),
        ("include_patterns: []\n", "include_patterns is empty"),
        ("discovery_forwards: true\n", "discovery_forwards must be an integer"),
        ("gpu_memory_budget: 8G\n", "unknown unit"),
        ("device: tpu\n", "device 'tpu'"),
        ("profile: ''\n", "profile is empty"),
    ],
)
def test_bad_yaml_value_names_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"in {re.escape(str(path))}: .*{message}"):
        load_config(path)


# ----------------------------------------------------------------------------------------------------------
# load_config: environment variables
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"), [("a,b", ("a", "b")), (" a , b ", ("a", "b")), ("a", ("a",)), ("", ())]
)
def test_env_comma_list(monkeypatch: pytest.MonkeyPatch, raw: str, expected: tuple[str, ...]) -> None:
    monkeypatch.setenv("FT_EXCLUDE_PATTERNS", raw)
    assert load_config().exclude_patterns == expected


@pytest.mark.parametrize("raw", ["a,,b", "a,", ",a", "a, ,b"])
def test_env_comma_list_empty_item_is_an_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("FT_EXCLUDE_PATTERNS", raw)
    with pytest.raises(ConfigError, match=r"FT_EXCLUDE_PATTERNS=.*empty item"):
        load_config()


def test_env_empty_include_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_INCLUDE_PATTERNS", "")
    with pytest.raises(ConfigError, match=r"FT_INCLUDE_PATTERNS=.*include_patterns is empty"):
        load_config()


def test_env_bad_pattern_names_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_INCLUDE_PATTERNS", "layers.*,bad:x")
    with pytest.raises(
        ConfigError, match=r"FT_INCLUDE_PATTERNS='layers\.\*,bad:x': include_patterns\[1\].*prefix"
    ):
        load_config()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("Yes", True),
        ("on", True),
        (" on ", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
    ],
)
@pytest.mark.parametrize("var", ["FT_PINNED_MEMORY", "FT_SHARE_HOST_MEMORY"])
def test_env_booleans(monkeypatch: pytest.MonkeyPatch, var: str, raw: str, expected: bool) -> None:
    monkeypatch.setenv(var, raw)
    field = var.removeprefix("FT_").lower()
    assert getattr(load_config(), field) is expected


@pytest.mark.parametrize("raw", ["2", "y", "n", "enabled", "", "truee"])
def test_env_bad_boolean_names_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("FT_PINNED_MEMORY", raw)
    with pytest.raises(ConfigError, match=f"FT_PINNED_MEMORY='{raw}' is not a boolean"):
        load_config()


@pytest.mark.parametrize("raw", ["two", "1.5", "", "1e3", "0x10"])
def test_env_bad_integer_names_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("FT_DISCOVERY_FORWARDS", raw)
    with pytest.raises(ConfigError, match=f"FT_DISCOVERY_FORWARDS='{raw}' is not an integer"):
        load_config()


def test_env_spec_integer_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_DISCOVERY_FORWARDS", "two")
    with pytest.raises(ConfigError) as info:
        load_config()
    assert str(info.value) == "FT_DISCOVERY_FORWARDS='two' is not an integer"


def test_env_out_of_range_integer_names_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_PROFILING_FORWARDS", "0")
    with pytest.raises(
        ConfigError, match="FT_PROFILING_FORWARDS='0': profiling_forwards must be an integer >= 1"
    ):
        load_config()


@pytest.mark.parametrize("raw", ["half", ""])
def test_env_bad_float_names_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("FT_MAX_GPU_MEM_FRACTION", raw)
    with pytest.raises(ConfigError, match=f"FT_MAX_GPU_MEM_FRACTION='{raw}' is not a number"):
        load_config()


@pytest.mark.parametrize(
    ("var", "raw", "message"),
    [
        ("FT_MAX_GPU_MEM_FRACTION", "1.5", "must be in"),
        ("FT_GPU_MEMORY_BUDGET", "8 gigs", "unknown unit"),
        ("FT_GPU_MEMORY_BUDGET", "0", "must be > 0"),
        ("FT_DEVICE", "tpu", "device 'tpu'"),
        ("FT_PROFILE", "", "profile is empty"),
    ],
)
def test_env_invalid_value_names_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, raw: str, message: str
) -> None:
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError, match=f"{var}='{raw}': .*{message}"):
        load_config()


def test_unknown_env_var_suggests_closest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_GPU_MEMORY_BUDGT", "8GiB")
    with pytest.raises(ConfigError) as info:
        load_config()
    assert (
        str(info.value)
        == "unknown environment variable FT_GPU_MEMORY_BUDGT; did you mean FT_GPU_MEMORY_BUDGET?"
    )


def test_unknown_env_var_without_close_match_lists_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_ZZZZZZZZZZZZ", "1")
    with pytest.raises(
        ConfigError, match=r"unknown environment variable FT_ZZZZZZZZZZZZ; valid ones are .*FT_DEVICE"
    ):
        load_config()


def test_unknown_env_var_is_rejected_even_with_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_DEVISE", "cpu")
    with pytest.raises(ConfigError, match="did you mean FT_DEVICE"):
        load_config(device="cpu")


def test_non_ft_env_vars_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XFT_DEVICE", "nonsense")
    monkeypatch.setenv("DEVICE", "nonsense")
    assert load_config() == OffloadConfig()


def test_non_field_env_vars_set() -> None:
    assert {"FT_CONFIG_FILE", "FT_LOG_LEVEL", "FT_PROGRESS"} == NON_FIELD_ENV_VARS
    assert not NON_FIELD_ENV_VARS & set(ENV_VARS.values())


@pytest.mark.parametrize("var", ["FT_LOG_LEVEL", "FT_PROGRESS"])
def test_non_field_env_vars_are_accepted(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.setenv(var, "anything at all")
    assert load_config() == OffloadConfig()


# ----------------------------------------------------------------------------------------------------------
# load_config: overrides
# ----------------------------------------------------------------------------------------------------------


def test_unknown_override_suggests_closest() -> None:
    with pytest.raises(
        ConfigError,
        match="unknown load_config\\(\\) argument 'discovery_forward'; did you mean 'discovery_forwards'",
    ):
        load_config(discovery_forward=2)


def test_bad_override_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="load_config\\(\\) arguments: gpu_memory_budget must be > 0"):
        load_config(gpu_memory_budget=0)


def test_overrides_accept_strings_for_budget() -> None:
    assert load_config(gpu_memory_budget="512MiB").gpu_memory_budget == 512 * MiB
