"""The configuration schema: :class:`OffloadConfig`, its fields and how each is validated.

Every value is checked when the config is built. A bad value raises :class:`~flextensor.errors.ConfigError`
with one line that names the field and says what to set; nothing is silently corrected. Where values can
come from besides the constructor (a YAML file, ``FT_*`` environment variables) and which wins is in
config/sources.py (:func:`flextensor.load_config`).

Importing this module does not import torch; torch is imported when a device is checked.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flextensor.common.sizes import format_bytes, parse_bytes
from flextensor.config.patterns import validate_pattern
from flextensor.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["BYTE_SIZE", "ENV_PREFIX", "OffloadConfig", "suggestion"]

ENV_PREFIX = "FT_"
"""Prefix of every environment variable flextensor reads."""


class _ByteSize:
    """Marks a field that takes a byte size (``"8GiB"``) as well as an int: its environment variable's
    text goes to the field's validator as it is."""

    def __repr__(self) -> str:
        return "BYTE_SIZE"


BYTE_SIZE = _ByteSize()


# ----------------------------------------------------------------------------------------------------------
# Helpers for messages
# ----------------------------------------------------------------------------------------------------------


def suggestion(name: str, candidates: Iterable[str], quote: bool = False) -> str:
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
    host_memory_budget      FT_HOST_MEMORY_BUDGET       ``512MiB``
    entry_methods           FT_ENTRY_METHODS            ``encode,decode`` (comma-separated)
    compression             FT_COMPRESSION              ``lossless`` (or ``off``)
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
    gpu_memory_budget: Annotated[int | None, BYTE_SIZE] = Field(
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
    host_memory_budget: Annotated[int | None, BYTE_SIZE] = Field(
        default=None,
        description=(
            "A bound, in bytes, on the host memory page-locked for the offloaded weights. Units whose "
            "packs fit are pinned; the rest stay pageable and are copied through a small pinned staging "
            "ring (counted in the budget), still asynchronously but slower; the planner pins the units "
            "whose copies matter most. None means the limit detected on this machine: WSL2's pinning cap "
            "and a share of the cgroup's memory limit (no bound when neither applies). Accepts an int or "
            "a string such as '512MiB'; must be > 0, and at least the staging ring (offload() says how "
            "much). Applies on a CPU device too (nothing is page-locked there, the staged path runs the "
            "same). See docs/host-memory.md."
        ),
    )

    map_embeddings: bool = Field(
        default=False,
        description=(
            "Keep the offload units made only of nn.Embedding modules (a text encoder's token embedding) "
            "in page-locked host memory and let the device read the rows each call needs there, in "
            "place: they take no device memory and are never copied, and the plans give their room to "
            "other units. For embeddings much larger than what a call reads; a weight also read by "
            "another kind of module (an LM head tied to it) is never mapped. Not with share_host_memory, "
            "compression, or a host memory budget that stages packs (offload() warns and maps nothing). "
            "Unset, a pipeline's components map their vocabulary-sized tables (16384 rows or more) where "
            "they can, without warnings; a single model maps nothing. See docs/pipelines.md."
        ),
    )
    entry_methods: tuple[str, ...] = Field(
        default=("encode", "decode"),
        description=(
            "Methods other than forward through which callers run the model, e.g. a VAE's encode and "
            "decode, which pipelines call instead of forward: each call is a step of its own, learned, "
            "planned and streamed like a forward (its own plan, since it runs other modules). Names the "
            "model lacks are skipped for the default; a name given explicitly must be a method of the "
            "model, else offload() raises ConfigError. () means forward only."
        ),
    )
    compression: str = Field(
        default="off",
        description=(
            "'lossless' holds the host copies of bfloat16 / float16 units compressed (about 0.7 of their "
            "size) and decodes them on the device as they stream, bit for bit: fewer bytes cross the link, "
            "so steps bound by it run faster. offload() probes the link and the decoder and compresses "
            "only the units whose loads it speeds up (on a CPU device, normally none). 'off' (the default) "
            "copies weights as they are. With share_host_memory the node holds the compressed copy once. "
            "See docs/compression.md."
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
                f"unknown config field {unknown[0]!r}" + suggestion(unknown[0], type(self).model_fields, True)
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

    @field_validator("entry_methods", mode="before")
    @classmethod
    def _check_entry_methods(cls, value: object) -> tuple[str, ...]:
        if not isinstance(value, list | tuple):
            raise ConfigError(
                f"entry_methods must be a list of method names, e.g. ['encode', 'decode'], got "
                f"{type(value).__name__} {value!r}"
            )
        for index, name in enumerate(value):
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
                raise ConfigError(f"entry_methods[{index}]: {name!r} is not a method name such as 'decode'")
            if name == "forward":
                raise ConfigError("entry_methods: 'forward' is always an entry; name only the other methods")
        return tuple(value)

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: object) -> str | None:
        if value is None:
            return None
        import torch  # deferred so that importing flextensor.config.schema stays light

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

    @field_validator("gpu_memory_budget", "host_memory_budget", mode="before")
    @classmethod
    def _check_budget(cls, value: object, info: ValidationInfo) -> int | None:
        name = info.field_name
        example = "'8GiB'" if name == "gpu_memory_budget" else "'512MiB'"
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(
                f"{name} must be a number of bytes or a string such as {example}, got {value!r}"
            )
        try:
            budget = parse_bytes(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        if budget <= 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}; e.g. {example}")
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

    @field_validator("compression", mode="before")
    @classmethod
    def _check_compression(cls, value: object) -> str:
        if value not in ("off", "lossless"):
            raise ConfigError(f"compression must be 'off' or 'lossless', got {value!r}")
        return str(value)

    @model_validator(mode="after")
    def _check_one_budget(self) -> OffloadConfig:
        if self.gpu_memory_budget is not None and self.max_gpu_mem_fraction is not None:
            raise ConfigError(
                f"gpu_memory_budget ({format_bytes(self.gpu_memory_budget)}) and max_gpu_mem_fraction "
                f"({self.max_gpu_mem_fraction}) are both set; set only one of them"
            )
        return self

    def resolved_device(self) -> torch.device:
        """The device offload() will use for this config: :attr:`device`, or the current CUDA device
        when unset and CUDA is available, else CPU (see ``flextensor.config.devices.resolve_device``).

        Raises:
            ConfigError: the device is CUDA but CUDA is not available, or its index does not exist.
        """
        from flextensor.config.devices import resolve_device  # imports torch

        return resolve_device(self.device)

    @classmethod
    def env_var(cls, field_name: str) -> str:
        """Return the environment variable that sets ``field_name``, e.g. ``FT_GPU_MEMORY_BUDGET``.

        Raises:
            ConfigError: ``field_name`` is not a field; the message names the closest one.
        """
        if field_name not in cls.model_fields:
            raise ConfigError(
                f"unknown config field {field_name!r}" + suggestion(field_name, cls.model_fields, True)
            )
        return ENV_PREFIX + field_name.upper()
