"""Configuration: :class:`OffloadConfig` and :func:`load_config`.

Every field can be set in four places; later ones win:

1. the defaults below,
2. a YAML file (``load_config(path)``, or the file named by ``FT_CONFIG_FILE`` when no path is given),
3. ``FT_*`` environment variables (``FT_`` + the field name in upper case, e.g. ``FT_GPU_MEMORY_BUDGET``),
4. keyword arguments to :func:`load_config`.

Every value is checked when the config is built. A bad value raises :class:`~flextensor.errors.ConfigError`
with one line that names the field (or variable, or file) and says what to set; nothing is silently
corrected.

Example::

    # FT_INCLUDE_PATTERNS="*" FT_EXCLUDE_PATTERNS="lm_head,*.norm" python serve.py
    config = flextensor.load_config()

and the same as YAML::

    include_patterns:
      - "*"
    exclude_patterns:
      - "lm_head"
      - "*.scale"

Importing this module does not import torch; torch is imported when a device is checked or resolved.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flextensor.errors import ConfigError
from flextensor.patterns import validate_pattern

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONFIG_FILE_ENV_VAR",
    "ENV_PREFIX",
    "ENV_VARS",
    "NON_FIELD_ENV_VARS",
    "OffloadConfig",
    "format_bytes",
    "load_config",
    "parse_bytes",
]

ENV_PREFIX = "FT_"
"""Prefix of every environment variable flextensor reads."""

CONFIG_FILE_ENV_VAR = "FT_CONFIG_FILE"
"""Names the YAML file :func:`load_config` reads when it is given no path."""

NON_FIELD_ENV_VARS: frozenset[str] = frozenset({CONFIG_FILE_ENV_VAR, "FT_LOG_LEVEL", "FT_PROGRESS"})
"""``FT_*`` variables that are not config fields but are read elsewhere; :func:`load_config` accepts them."""


# ----------------------------------------------------------------------------------------------------------
# Byte sizes
# ----------------------------------------------------------------------------------------------------------

_BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
_SIZE_RE = re.compile(r"(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[A-Za-z]*)")


def parse_bytes(value: str | int) -> int:
    """Return a byte count given as an int or as a string such as ``"8GiB"``, ``"7.5 GB"`` or ``"1024"``.

    Strings are a non-negative number, optional whitespace, and an optional unit: binary ``KiB``, ``MiB``,
    ``GiB``, ``TiB`` (powers of 1024), decimal ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000) or ``B``;
    unit letters are case-insensitive. A number without a unit is bytes and must be whole. A fractional
    size with a unit is rounded down to whole bytes.

    Raises:
        ConfigError: ``value`` is negative, a bool, not an int or str, or not a size as described above.
    """
    # bool is an int subclass; True bytes is surely a mistake, not one byte.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            f"{value!r} is not a byte size; give an int number of bytes or a string such as '8GiB'"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"byte size {value} is negative; give a number of bytes >= 0, e.g. '8GiB'")
        return value
    match = _SIZE_RE.fullmatch(value.strip())
    if match is None:
        raise ConfigError(
            f"{value!r} is not a byte size; write a number and a unit such as '8GiB', '7.5GB' or '512MiB'"
        )
    number, unit = match["number"], match["unit"]
    factor = _BYTE_UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(
            f"{value!r} has an unknown unit {unit!r}; use one of {_UNIT_NAMES} (e.g. '8GiB' or '8GB')"
        )
    if not unit and "." in number:
        raise ConfigError(f"{value!r} has no unit, so it is bytes and must be whole; e.g. '1024' or '7.5GiB'")
    # Fraction keeps huge or long decimals exact, where float or a 28-digit Decimal would round.
    return math.floor(Fraction(number) * factor)


def format_bytes(n: int) -> str:
    """Return ``n`` bytes as a short readable string in binary units.

    Under 1 KiB: ``"512 B"``; KiB and MiB with one decimal (``"512.0 MiB"``); GiB and TiB with two
    (``"8.00 GiB"``, ``"1.46 GiB"``). Negative counts (e.g. a shortfall) keep their sign. The result is
    accepted by :func:`parse_bytes` (up to rounding).
    """
    sign = "-" if n < 0 else ""
    magnitude = abs(n)
    for unit, factor, decimals in (
        ("TiB", 2**40, 2),
        ("GiB", 2**30, 2),
        ("MiB", 2**20, 1),
        ("KiB", 2**10, 1),
    ):
        if magnitude >= factor:
            return f"{sign}{magnitude / factor:.{decimals}f} {unit}"
    return f"{sign}{int(magnitude)} B"


# ----------------------------------------------------------------------------------------------------------
# Helpers for messages
# ----------------------------------------------------------------------------------------------------------


def _suggestion(name: str, candidates: Iterable[str], quote: bool = False) -> str:
    """Return '; did you mean X?' for the closest candidate, or the valid names when none is close."""
    options = sorted(candidates)
    fmt: Callable[[str], str] = repr if quote else str
    close = difflib.get_close_matches(name, options, n=1)
    if close:
        return f"; did you mean {fmt(close[0])}?"
    return "; valid ones are " + ", ".join(fmt(o) for o in options)


def _first_error(exc: ValidationError) -> str:
    """Turn pydantic's report into the one line a user needs: the first error, without pydantic's framing."""
    error = exc.errors()[0]
    original = (error.get("ctx") or {}).get("error")
    if isinstance(original, ConfigError):
        # Our own validators already wrote a complete message that names the field.
        return str(original)
    location = ".".join(str(part) for part in error["loc"])
    return f"{location}: {error['msg']}" if location else str(error["msg"])


def _check_bool(name: str, value: object) -> bool | None:
    # Strict: pydantic's lax mode would turn "no" or 0 into False, which hides typos in YAML or code.
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"{name} must be true or false, got {value!r}")


# ----------------------------------------------------------------------------------------------------------
# OffloadConfig
# ----------------------------------------------------------------------------------------------------------


class OffloadConfig(BaseModel):
    """How flextensor offloads a model: which weights, to which device, and within which memory budget.

    Immutable and hashable; every value is validated when the config is built, and a bad one raises
    :class:`~flextensor.errors.ConfigError` naming the field and what to set. Build it directly
    (``OffloadConfig(gpu_memory_budget="8GiB")``) or with :func:`load_config`, which also reads YAML and
    ``FT_*`` environment variables.

    Each field's environment variable is ``FT_`` + the field name in upper case
    (:meth:`env_var` returns it) and its YAML key is the field name:

    ======================  ==========================  ==================================================
    field                   environment variable        example value
    ======================  ==========================  ==================================================
    include_patterns        FT_INCLUDE_PATTERNS         ``layers.*,class:MoELayer`` (comma-separated)
    exclude_patterns        FT_EXCLUDE_PATTERNS         ``lm_head,*.norm`` (comma-separated)
    device                  FT_DEVICE                   ``cuda:1``
    discovery_forwards      FT_DISCOVERY_FORWARDS       ``2``
    profiling_forwards      FT_PROFILING_FORWARDS       ``1``
    pinned_memory           FT_PINNED_MEMORY            ``true`` (1/0, true/false, yes/no, on/off)
    gpu_memory_budget       FT_GPU_MEMORY_BUDGET        ``8GiB``
    max_gpu_mem_fraction    FT_MAX_GPU_MEM_FRACTION     ``0.8``
    profile                 FT_PROFILE                  ``/data/llama.profile``
    share_host_memory       FT_SHARE_HOST_MEMORY        ``false``
    ======================  ==========================  ==================================================

    The pattern fields are stored as tuples (lists are accepted) so that the config is truly immutable
    and hashable.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    include_patterns: tuple[str, ...] = Field(
        default=("*",),
        description=(
            "Patterns of the modules whose weights are offloaded: module-path globs such as 'layers.*' "
            "or class patterns such as 'class:LlamaDecoderLayer'. The default '*' selects every module; "
            "an empty list is an error because it would offload nothing."
        ),
    )
    exclude_patterns: tuple[str, ...] = Field(
        default=(),
        description=(
            "Patterns of modules to keep where they are even if include_patterns selects them, "
            "e.g. ['lm_head', '*.norm']. Same syntax as include_patterns."
        ),
    )
    device: str | None = Field(
        default=None,
        description=(
            "Device the weights are streamed to and computed on: 'cpu', 'cuda' or 'cuda:N'. "
            "None means the current CUDA device when CUDA is available, else 'cpu'."
        ),
    )
    discovery_forwards: int = Field(
        default=1,
        description="Number of forward passes (>= 1) spent learning the order in which modules execute.",
    )
    profiling_forwards: int = Field(
        default=1,
        description=(
            "Number of forward passes (>= 1), after discovery, spent measuring each module's compute time."
        ),
    )
    pinned_memory: bool | None = Field(
        default=None,
        description=(
            "Keep the host copy of the weights in pinned (page-locked) RAM so copies to the GPU are fast "
            "and asynchronous. None means on when the device is CUDA. True with a CPU device is allowed "
            "but has no effect."
        ),
    )
    gpu_memory_budget: int | None = Field(
        default=None,
        description=(
            "A bound, in bytes, on the planned peak allocated device memory of a steady-state step: "
            "weights, copies in flight and activations together, as torch.cuda.max_memory_allocated "
            "measures from the step's start, predicted from the profiled forward (a larger input of the "
            "same power-of-two size group can exceed it). Accepts an int or a string such as '8GiB', "
            "'7.5GB' or '512MiB'; must be > 0. An infeasible budget raises BudgetError when the plan is "
            "made. Set this or max_gpu_mem_fraction, not both; with neither, the planner keeps resident "
            "only what cannot stream without slowing the step, within 92% of the memory this process "
            "may use on the device."
        ),
    )
    max_gpu_mem_fraction: float | None = Field(
        default=None,
        description=(
            "The budget as a fraction (0 < f <= 1) of the memory this process may use on the device, "
            "e.g. 0.8: the card's total memory, times torch.cuda.set_per_process_memory_fraction's cap "
            "when one is set. Set this or gpu_memory_budget, not both."
        ),
    )
    profile: Path | None = Field(
        default=None,
        description=(
            "A saved profile to start from, skipping discovery and profiling forwards. Only the path is "
            "checked here; the file is read (and must exist) when the model is offloaded."
        ),
    )
    share_host_memory: bool = Field(
        default=False,
        description=(
            "Share one pinned host copy of the offloaded weights between the processes of a node that "
            "hold the same weights (data-parallel replicas, context parallelism): the first packs them "
            "into a shared-memory segment under /dev/shm, the others map it, so host RAM does not grow "
            "with the number of processes. Those others may build the model on the meta device. "
            "Processes with other weights of the same shapes (tensor-parallel shards) get segments of "
            "their own. Linux only."
        ),
    )

    def __init__(self, **data: Any) -> None:
        """Validate ``data`` and build the config.

        Raises:
            ConfigError: a field name is unknown (the message names the closest valid one) or a value
                is invalid (the message says what to set).
        """
        unknown = sorted(set(data) - set(type(self).model_fields))
        if unknown:
            raise ConfigError(
                f"unknown config field {unknown[0]!r}"
                + _suggestion(unknown[0], type(self).model_fields, True)
            )
        try:
            super().__init__(**data)
        except ValidationError as exc:
            # One readable line instead of pydantic's multi-line report; the chain adds nothing for users.
            raise ConfigError(_first_error(exc)) from None

    # -- field validators ------------------------------------------------------------------------------

    @field_validator("include_patterns", "exclude_patterns", mode="before")
    @classmethod
    def _check_patterns(cls, value: object, info: ValidationInfo) -> tuple[str, ...]:
        name = info.field_name
        # A bare string is iterable, so without this check 'lm_head' would become 7 one-letter patterns.
        if not isinstance(value, list | tuple):
            raise ConfigError(
                f"{name} must be a list of patterns, e.g. ['layers.*'], got {type(value).__name__} {value!r}"
            )
        if name == "include_patterns" and not value:
            raise ConfigError(
                "include_patterns is empty, so nothing would be offloaded; use ['*'] to offload every "
                "module or name modules, e.g. ['layers.*']"
            )
        for index, pattern in enumerate(value):
            try:
                validate_pattern(pattern)
            except ValueError as exc:
                raise ConfigError(f"{name}[{index}]: {exc}") from None
        return tuple(value)

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: object) -> str | None:
        if value is None:
            return None
        import torch  # deferred so that importing flextensor.config stays light

        if isinstance(value, torch.device):
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(f"device must be a string such as 'cuda', 'cuda:0' or 'cpu', got {value!r}")
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            raise ConfigError(f"device {value!r} is not a device; use 'cuda', 'cuda:N' or 'cpu'") from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(
                f"device {value!r} has type {device.type!r}; flextensor supports 'cuda', 'cuda:N' and 'cpu'"
            )
        return str(device)

    @field_validator("discovery_forwards", "profiling_forwards", mode="before")
    @classmethod
    def _check_forwards(cls, value: object, info: ValidationInfo) -> int:
        name = info.field_name
        # bool is an int subclass; True forwards is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value}")
        return value

    @field_validator("pinned_memory", "share_host_memory", mode="before")
    @classmethod
    def _check_bools(cls, value: object, info: ValidationInfo) -> bool | None:
        if value is None and info.field_name == "share_host_memory":
            raise ConfigError("share_host_memory must be true or false, got None")
        return _check_bool(info.field_name, value)

    @field_validator("gpu_memory_budget", mode="before")
    @classmethod
    def _check_budget(cls, value: object) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(
                f"gpu_memory_budget must be a number of bytes or a string such as '8GiB', got {value!r}"
            )
        try:
            budget = parse_bytes(value)
        except ConfigError as exc:
            raise ConfigError(f"gpu_memory_budget: {exc}") from None
        if budget <= 0:
            raise ConfigError(f"gpu_memory_budget must be > 0, got {value!r}; e.g. '8GiB'")
        return budget

    @field_validator("max_gpu_mem_fraction", mode="before")
    @classmethod
    def _check_fraction(cls, value: object) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"max_gpu_mem_fraction must be a number in (0, 1], e.g. 0.8, got {value!r}")
        # Written so that NaN fails too.
        if not 0 < value <= 1:
            raise ConfigError(f"max_gpu_mem_fraction must be in (0, 1], e.g. 0.8, got {value!r}")
        return float(value)

    @field_validator("profile", mode="before")
    @classmethod
    def _check_profile(cls, value: object) -> Path | None:
        if value is None:
            return None
        if not isinstance(value, str | os.PathLike):
            raise ConfigError(f"profile must be a path to a saved profile, got {value!r}")
        text = os.fspath(value)
        # Path('') is '.', a directory, which would fail much later with a confusing message.
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("profile is empty; give the path of a saved profile or leave it unset")
        return Path(text)

    @model_validator(mode="after")
    def _check_one_budget(self) -> OffloadConfig:
        if self.gpu_memory_budget is not None and self.max_gpu_mem_fraction is not None:
            raise ConfigError(
                f"gpu_memory_budget ({format_bytes(self.gpu_memory_budget)}) and max_gpu_mem_fraction "
                f"({self.max_gpu_mem_fraction}) are both set; set only one of them"
            )
        return self

    # -- resolution ------------------------------------------------------------------------------------

    @classmethod
    def env_var(cls, field_name: str) -> str:
        """Return the environment variable that sets ``field_name``, e.g. ``FT_GPU_MEMORY_BUDGET``.

        Raises:
            ConfigError: ``field_name`` is not a field; the message names the closest one.
        """
        if field_name not in cls.model_fields:
            raise ConfigError(
                f"unknown config field {field_name!r}" + _suggestion(field_name, cls.model_fields, True)
            )
        return ENV_PREFIX + field_name.upper()

    def resolved_device(self) -> torch.device:
        """Return the device to use: :attr:`device`, or the current CUDA device when unset and CUDA is
        available, else CPU. A bare ``'cuda'`` resolves to the current CUDA device with its index.

        Raises:
            ConfigError: the device is CUDA but CUDA is not available, or its index does not exist.
        """
        import torch

        if self.device is None:
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        device = torch.device(self.device)
        if device.type != "cuda":
            return device
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device is {self.device!r} but CUDA is not available here; "
                "set device='cpu' or leave it unset"
            )
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ConfigError(
                f"device is {self.device!r} but only {count} CUDA device(s) exist; use an index below {count}"
            )
        return device

    def resolved_pinned_memory(self, device: torch.device) -> bool:
        """Return whether to pin host memory for ``device``.

        Unset (None) means on for a CUDA device. Pinning only speeds up copies to a CUDA device, so for
        any other device this is False even when :attr:`pinned_memory` is True.
        """
        if device.type != "cuda":
            return False
        return True if self.pinned_memory is None else self.pinned_memory

    def resolved_budget_bytes(self, total_device_bytes: int | None) -> int | None:
        """Return the device-memory budget in bytes, or None when neither budget field is set.

        Args:
            total_device_bytes: the memory this process may use on the device; needed only when
                :attr:`max_gpu_mem_fraction` is set (the budget is then that fraction of it, rounded down).

        Raises:
            ConfigError: :attr:`max_gpu_mem_fraction` is set but ``total_device_bytes`` is None or not > 0.
        """
        if self.gpu_memory_budget is not None:
            return self.gpu_memory_budget
        if self.max_gpu_mem_fraction is None:
            return None
        if total_device_bytes is None or total_device_bytes <= 0:
            raise ConfigError(
                f"max_gpu_mem_fraction={self.max_gpu_mem_fraction} needs the device's total memory, "
                f"got {total_device_bytes!r}; set gpu_memory_budget (e.g. '8GiB') instead"
            )
        return math.floor(total_device_bytes * self.max_gpu_mem_fraction)


ENV_VARS: dict[str, str] = {name: OffloadConfig.env_var(name) for name in OffloadConfig.model_fields}
"""Map from each :class:`OffloadConfig` field name to the environment variable that sets it."""


# ----------------------------------------------------------------------------------------------------------
# Environment variables
# ----------------------------------------------------------------------------------------------------------

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_INT_RE = re.compile(r"[+-]?\d+")


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
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a number; e.g. {var}=0.8") from None


def _env_bool(var: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(f"{var}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _env_str(var: str, raw: str) -> str:
    return raw


_ENV_PARSERS: dict[str, Callable[[str, str], object]] = {
    "include_patterns": _env_list,
    "exclude_patterns": _env_list,
    "device": _env_str,
    "discovery_forwards": _env_int,
    "profiling_forwards": _env_int,
    "pinned_memory": _env_bool,
    "gpu_memory_budget": _env_str,
    "max_gpu_mem_fraction": _env_float,
    "profile": _env_str,
    "share_host_memory": _env_bool,
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
            raise ConfigError(f"unknown environment variable {var}" + _suggestion(var, known))
        raw = environ[var]
        value = _ENV_PARSERS[name](var, raw)
        try:
            OffloadConfig(**{name: value})
        except ConfigError as exc:
            raise ConfigError(f"{var}={raw!r}: {exc}") from None
        values[name] = value
    return values


# ----------------------------------------------------------------------------------------------------------
# YAML
# ----------------------------------------------------------------------------------------------------------


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
        data = yaml.safe_load(text)
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
                f"unknown key {key!r} in {path}" + _suggestion(str(key), OffloadConfig.model_fields, True)
            )
    return dict(data)


# ----------------------------------------------------------------------------------------------------------
# load_config
# ----------------------------------------------------------------------------------------------------------

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
            a missing, unreadable, malformed or non-mapping YAML file; or an invalid value. The message
            names the file, variable or field at fault.
    """
    unknown = sorted(set(overrides) - set(OffloadConfig.model_fields))
    if unknown:
        raise ConfigError(
            f"unknown load_config() argument {unknown[0]!r}"
            + _suggestion(unknown[0], OffloadConfig.model_fields, True)
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
