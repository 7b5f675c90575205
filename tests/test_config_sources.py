"""Tests for flextensor.config.sources: load_config's layers, YAML files and FT_* variables."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from flextensor.config.schema import OffloadConfig
from flextensor.config.sources import (
    CONFIG_FILE_ENV_VAR,
    ENV_VARS,
    NON_FIELD_ENV_VARS,
    env_parser,
    load_config,
)
from flextensor.errors import ConfigError

GiB = 2**30
MiB = 2**20


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


def test_every_field_gets_an_environment_parser_from_its_type() -> None:
    for name, field in OffloadConfig.model_fields.items():
        assert callable(env_parser(field)), name


def test_a_field_of_a_type_without_a_rule_is_a_bug_reported_as_such() -> None:
    from pydantic.fields import FieldInfo

    with pytest.raises(ConfigError, match="flextensor bug"):
        env_parser(FieldInfo(annotation=dict[str, int]))


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("FT_DISCOVERY_FORWARDS", "\u0663"),
        ("FT_PROFILING_FORWARDS", "\uff12"),
        ("FT_MAX_GPU_MEM_FRACTION", "\u0660.\u0665"),
        ("FT_GPU_MEMORY_BUDGET", "\uff18GiB"),
    ],
)
def test_env_values_take_ascii_digits_only(monkeypatch: pytest.MonkeyPatch, var: str, raw: str) -> None:
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError, match=var):
        load_config()


def test_a_budget_too_large_to_plan_with_is_refused_when_the_config_is_built() -> None:
    with pytest.raises(ConfigError, match="larger than"):
        load_config(gpu_memory_budget="1" * 400)


def test_a_yaml_file_naming_a_key_twice_is_an_error_not_the_last_value(tmp_path: Path) -> None:
    path = _write(tmp_path, "gpu_memory_budget: 8GiB\nprofiling_forwards: 2\ngpu_memory_budget: 4GiB\n")
    with pytest.raises(ConfigError, match="duplicate key 'gpu_memory_budget' at line 3"):
        load_config(path)


def test_a_nested_duplicate_yaml_key_is_an_error_too(tmp_path: Path) -> None:
    path = _write(tmp_path, "include_patterns:\n  - {a: 1, a: 2}\n")
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(path)
