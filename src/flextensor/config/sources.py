"""Where a config's values come from: :func:`load_config` reads defaults, YAML, ``FT_*`` variables, arguments.

Every field can be set in four places; later ones win:

1. the defaults of :class:`~flextensor.OffloadConfig`,
2. a YAML file (``load_config(path)``, or the file named by ``FT_CONFIG_FILE`` when no path is given),
3. ``FT_*`` environment variables (``FT_`` + the field name in upper case, e.g. ``FT_GPU_MEMORY_BUDGET``),
4. keyword arguments to :func:`load_config`.

Example::

    # FT_INCLUDE_PATTERNS="*" FT_EXCLUDE_PATTERNS="lm_head,*.norm" python serve.py
    config = flextensor.load_config()

and the same as YAML::

    include_patterns:
      - "*"
    exclude_patterns:
      - "lm_head"
      - "*.scale"

How a variable's text becomes a value follows from the field's type (see :func:`env_parser`): a list of
patterns is comma-separated, a boolean is 1/0, true/false, yes/no or on/off, a number is ASCII digits.
A YAML file that names a key twice is an error, like any other value that would be silently dropped.

Why not pydantic-settings: it ignores unknown ``FT_*`` variables and YAML keys, takes the last of two
duplicate YAML keys, and cannot treat the two budget fields as one setting across layers; each of those
would silently change what the user asked for.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic.fields import FieldInfo

from flextensor.config.schema import BYTE_SIZE, ENV_PREFIX, OffloadConfig, suggestion
from flextensor.errors import ConfigError

__all__ = ["CONFIG_FILE_ENV_VAR", "ENV_VARS", "NON_FIELD_ENV_VARS", "env_parser", "env_syntax", "load_config"]

CONFIG_FILE_ENV_VAR = "FT_CONFIG_FILE"
"""Names the YAML file :func:`load_config` reads when it is given no path."""

NON_FIELD_ENV_VARS: frozenset[str] = frozenset({CONFIG_FILE_ENV_VAR, "FT_LOG_LEVEL", "FT_PROGRESS"})
"""``FT_*`` variables that are not config fields but are read elsewhere; :func:`load_config` accepts them."""

ENV_VARS: dict[str, str] = {name: OffloadConfig.env_var(name) for name in OffloadConfig.model_fields}
"""Map from each :class:`OffloadConfig` field name to the environment variable that sets it."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_INT_RE = re.compile(r"[+-]?[0-9]+", re.ASCII)  # int() alone takes non-ASCII digits too
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)

EnvParser = Callable[[str, str], object]
"""(variable name, raw text) -> the value handed to the field's validator."""


def _env_list(var: str, raw: str) -> list[str]:
    # An empty value is an empty list; an empty item between commas is almost surely a typo.
    if not raw.strip():
        return []
    items = [item.strip() for item in raw.split(",")]
    if any(not item for item in items):
        raise ConfigError(
            f"{var}={raw!r} has an empty item; separate patterns with single commas, e.g. 'lm_head,*.norm'"
        )
    return items


def _env_int(var: str, raw: str) -> int:
    if not _INT_RE.fullmatch(raw.strip()):
        raise ConfigError(f"{var}={raw!r} is not an integer")
    return int(raw)


def _env_float(var: str, raw: str) -> float:
    # float() alone would take Arabic-Indic digits and "nan"; the validator then checks the range.
    if not _FLOAT_RE.fullmatch(raw.strip()):
        raise ConfigError(f"{var}={raw!r} is not a number; e.g. {var}=0.8")
    return float(raw)


def _env_bool(var: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(f"{var}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _env_text(var: str, raw: str) -> str:
    return raw


def env_parser(field: FieldInfo) -> EnvParser:
    """How a variable's text becomes a value for ``field``, from its annotation (``None`` arms aside).

    Tuples and lists are comma-separated; ``bool``, ``int`` and ``float`` are parsed (ASCII only);
    ``str`` and ``Path``, and fields marked ``BYTE_SIZE``, reach the field's validator as the raw text.
    Raises ConfigError for any other annotation: a new field of such a type needs a rule here.
    """
    if BYTE_SIZE in field.metadata:
        return _env_text
    annotation = field.annotation
    arms = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if len(arms) != 1:
            raise ConfigError(f"flextensor bug: no environment parser for a field of type {annotation!r}")
        annotation = arms[0]
    origin = typing.get_origin(annotation) or annotation
    if origin in (tuple, list):
        return _env_list
    if annotation is bool:
        return _env_bool
    if annotation is int:
        return _env_int
    if annotation is float:
        return _env_float
    if annotation in (str, Path):
        return _env_text
    raise ConfigError(f"flextensor bug: no environment parser for a field of type {annotation!r}")


_SYNTAX: dict[EnvParser, str] = {
    _env_list: "comma-separated list",
    _env_int: "integer",
    _env_float: "number",
    _env_bool: "1/0, true/false, yes/no, on/off",
    _env_text: "text, checked like the field's value",
}


def env_syntax(field: FieldInfo) -> str:
    """How the value of ``field``'s environment variable is written, in words (for the docs)."""
    return _SYNTAX[env_parser(field)]


_ENV_PARSERS: dict[str, EnvParser] = {
    name: env_parser(field) for name, field in OffloadConfig.model_fields.items()
}


def _read_env(environ: Mapping[str, str]) -> dict[str, object]:
    """Return the config fields set by ``FT_*`` variables in ``environ``, each checked on its own."""
    fields_by_var = {var: name for name, var in ENV_VARS.items()}
    known = set(fields_by_var) | NON_FIELD_ENV_VARS
    values: dict[str, object] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in NON_FIELD_ENV_VARS:
            continue
        name = fields_by_var.get(var)
        if name is None:
            raise ConfigError(f"unknown environment variable {var}" + suggestion(var, known))
        raw = environ[var]
        value = _ENV_PARSERS[name](var, raw)
        try:
            OffloadConfig(**{name: value})
        except ConfigError as exc:
            raise ConfigError(f"{var}={raw!r}: {exc}") from None
        values[name] = value
    return values


class _NoDuplicateKeysLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping naming a key twice is an error (it keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key; PyYAML's own construction reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path, origin: str) -> dict[str, object]:
    """Return the fields set in the YAML file at ``path``; ``origin`` says where the path came from."""
    where = f"config file {path}{origin}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; check the path") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text; it should be a YAML mapping") from None
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_NoDuplicateKeysLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where} is not valid YAML: {problem}{at}") from None
    # A file of only comments loads as None: nothing set, which is a legitimate file.
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where} must be a YAML mapping of field names to values (e.g. 'gpu_memory_budget: 8GiB'), "
            f"got a {type(data).__name__}"
        )
    for key in data:
        if not isinstance(key, str) or key not in OffloadConfig.model_fields:
            raise ConfigError(
                f"unknown key {key!r} in {path}" + suggestion(str(key), OffloadConfig.model_fields, True)
            )
    return dict(data)


# Two spellings of one setting: a layer that sets either replaces whatever a lower layer set for the other.
_BUDGET_FIELDS = ("gpu_memory_budget", "max_gpu_mem_fraction")


def _check_layer(values: Mapping[str, object], where: str) -> None:
    """Validate one layer on its own so that an error names the layer it came from."""
    try:
        OffloadConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> OffloadConfig:
    """Build an :class:`OffloadConfig` from defaults, a YAML file, ``FT_*`` variables and ``overrides``.

    Precedence, lowest first: field defaults < the YAML file < ``FT_*`` environment variables <
    ``overrides``. Each layer replaces only the fields it sets, except that ``gpu_memory_budget`` and
    ``max_gpu_mem_fraction`` count as one setting: a layer that sets one discards the other from lower
    layers (setting both in one layer is an error).

    Args:
        path: a YAML file whose top level maps field names to values. When None, the file named by
            ``FT_CONFIG_FILE`` is read if that variable is set; otherwise no file is read.
        **overrides: field values that win over everything else, e.g. ``gpu_memory_budget="8GiB"``.

    Environment variables are ``FT_`` + the field name in upper case. Pattern lists are comma-separated
    (``FT_EXCLUDE_PATTERNS="lm_head,*.norm"``; whitespace around items is ignored), booleans accept
    1/0, true/false, yes/no, on/off (any case). ``FT_CONFIG_FILE``, ``FT_LOG_LEVEL`` and ``FT_PROGRESS``
    are read elsewhere and accepted; any other unknown ``FT_*`` variable is an error.

    Raises:
        ConfigError: an unknown override, ``FT_*`` variable or YAML key (with the closest valid name);
            a missing, unreadable, malformed or non-mapping YAML file, or one with a duplicate key; or
            an invalid value. The message names the file, variable or field at fault.
    """
    unknown = sorted(set(overrides) - set(OffloadConfig.model_fields))
    if unknown:
        raise ConfigError(
            f"unknown load_config() argument {unknown[0]!r}"
            + suggestion(unknown[0], OffloadConfig.model_fields, True)
        )

    environ = dict(os.environ)
    if path is not None:
        file_values = _read_yaml(Path(path), "")
        file_where = f"in {Path(path)}"
    elif CONFIG_FILE_ENV_VAR in environ:
        raw = environ[CONFIG_FILE_ENV_VAR]
        if not raw.strip():
            raise ConfigError(f"{CONFIG_FILE_ENV_VAR} is set but empty; unset it or give a YAML file path")
        file_values = _read_yaml(Path(raw), f" (from {CONFIG_FILE_ENV_VAR})")
        file_where = f"in {Path(raw)} (from {CONFIG_FILE_ENV_VAR})"
    else:
        file_values, file_where = {}, ""

    layers: list[tuple[Mapping[str, object], str]] = [
        (file_values, file_where),
        (_read_env(environ), "in FT_* environment variables"),
        (overrides, "in load_config() arguments"),
    ]
    merged: dict[str, object] = {}
    for values, where in layers:
        _check_layer(values, where)
        if any(name in values for name in _BUDGET_FIELDS):
            for name in _BUDGET_FIELDS:
                merged.pop(name, None)
        merged.update(values)
    return OffloadConfig(**merged)
