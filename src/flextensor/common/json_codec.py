"""Records as JSON: one codec for the dataclasses flextensor saves, and one atomic file write.

Saved records (profiles and what they hold) are frozen dataclasses marked ``@record``: pydantic's
``TypeAdapter`` turns them into JSON data and validates JSON text back into them, strictly (an integer is
not a boolean, a float is finite, unknown keys are refused, sizes and durations annotated :data:`Bytes` and
:data:`Seconds` are not negative). A failure is a :class:`RecordError` with the JSON path of the first bad
value (``measurements.units[3].compute_s``) for the caller to phrase.

Files are written by :func:`atomic_write_text`: a reader sees the old file or the new one, never half.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from functools import cache
from typing import Annotated, Any, TypeVar

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from pydantic_core import PydanticSerializationError

from flextensor.errors import FlexTensorError

__all__ = [
    "Bytes",
    "BytesPerSecond",
    "RecordError",
    "Seconds",
    "atomic_write_text",
    "from_json_data",
    "from_json_text",
    "record",
    "render_json",
    "to_json_data",
]

T = TypeVar("T")

record = with_config(ConfigDict(extra="forbid", strict=True))
"""Decorator for a dataclass saved as JSON: unknown keys and loose types are refused when it is read."""

Bytes = Annotated[int, Field(ge=0)]
"""A size in bytes in a saved record: a non-negative integer."""

Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A duration in a saved record: finite, not negative."""

BytesPerSecond = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A copy speed in a saved record: finite, not negative."""

_MAX_SHOWN = 60
"""Characters of a bad value quoted in an error message (a corrupted leaf may be a huge list)."""

_INLINE_WIDTH = 100
"""Lists without objects inside are written on one line when they fit: shapes, parameter entries."""


class RecordError(FlexTensorError, ValueError):
    """A value that cannot be written as, or read back from, its record's JSON.

    ``path`` is the JSON path of the first bad value (empty for the whole document), ``problem`` what is
    wrong with it, in words.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or 'the top level'}: {problem}")
        self.path = path
        self.problem = problem


@cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def to_json_data(value: Any, tp: type[T]) -> Any:
    """``value`` (a ``tp``) as plain JSON data: dicts, lists, strings, numbers, booleans, None."""
    try:
        return _adapter(tp).dump_python(value, mode="json", warnings="error")
    except PydanticSerializationError as exc:
        raise RecordError("", f"cannot be stored as JSON: {exc}") from None


def from_json_text(text: str | bytes, tp: type[T]) -> T:
    """Validate JSON ``text`` into a ``tp``; RecordError naming the first bad value's path."""
    try:
        return _adapter(tp).validate_json(text)
    except ValidationError as exc:
        raise _record_error(exc) from None


def from_json_data(data: Any, tp: type[T]) -> T:
    """Validate parsed JSON ``data`` into a ``tp``, exactly as if it were read from its text."""
    try:
        text = json.dumps(data, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RecordError("", f"is not JSON data: {exc}") from None
    return from_json_text(text, tp)


def _record_error(exc: ValidationError) -> RecordError:
    error = exc.errors()[0]
    path = _json_path(error["loc"])
    message = error["msg"]
    kind = error["type"]
    if kind == "missing":
        return RecordError(path, "is missing")
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return RecordError(path, "is an unknown key (written by a newer flextensor, or hand-edited?)")
    if kind == "value_error":  # a record's own check (its __post_init__): the message says it all
        return RecordError(path, message.removeprefix("Value error, "))
    if message.startswith("Input should be "):  # pydantic's phrasing -> ours: "must be a valid integer"
        message = "must be " + message.removeprefix("Input should be ")
    return RecordError(path, f"{message[0].lower()}{message[1:]}, got {show(error.get('input'))}")


def _json_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier():
            path += f".{part}" if path else part
        else:
            path += f"[{part!r}]"
    return path


def show(value: Any) -> str:
    """A short rendering of a value for an error message: JSON where possible (null, not None)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def render_json(value: Any, level: int = 0) -> str:
    """JSON text of ``value``, indented by one space per level, short flat lists on one line."""
    if isinstance(value, dict):
        if not value:
            return "{}"
        pad = " " * (level + 1)
        items = [f"{pad}{json.dumps(k)}: {render_json(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    if isinstance(value, list):
        if not _has_object(value):
            flat = json.dumps(value, allow_nan=False)
            if len(flat) + level <= _INLINE_WIDTH:
                return flat
        if not value:
            return "[]"
        pad = " " * (level + 1)
        return "[\n" + ",\n".join(pad + render_json(v, level + 1) for v in value) + "\n" + " " * level + "]"
    return json.dumps(value, allow_nan=False)


def _has_object(value: Any) -> bool:
    if isinstance(value, dict):
        return True
    return isinstance(value, list) and any(_has_object(v) for v in value)


def atomic_write_text(path: str | os.PathLike[str], text: str, new_file_mode: int = 0o644) -> str:
    """Write ``text`` to ``path`` so that readers see the old content or the new, never part of it.

    A symbolic link is followed: its target is replaced and the link stays. The text goes to a temporary
    file in the target's directory, is flushed and fsynced, takes the permissions of the file it replaces
    (``new_file_mode`` for a new one) and is renamed over it. Returns the path written. Raises OSError
    (FileNotFoundError when the directory does not exist); the temporary file never stays behind.
    """
    target = os.path.realpath(os.fspath(path))
    directory = os.path.dirname(target)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mode = new_file_mode
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the rename makes it the file
        os.chmod(temp, mode)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_directory(directory)
    return target


def _fsync_directory(directory: str) -> None:
    """Make the rename durable (POSIX); best effort, since some systems cannot open directories."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
