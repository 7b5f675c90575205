"""Byte sizes: parsing ``"8GiB"``, printing ``"8.00 GiB"``, rounding up to an alignment. Pure: no torch."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from flextensor.errors import ConfigError

__all__ = ["MAX_BYTES", "align_up", "format_bytes", "parse_bytes"]

MAX_BYTES = 2**60
"""The largest size accepted (1 EiB): far beyond any machine, and small enough that every size converts
to a float exactly enough for the planner and the report (a 400-digit budget would overflow them)."""

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
# ASCII digits only: str.isdigit and \d also accept Arabic-Indic and full-width digits, which nobody
# means as a size.
_SIZE_RE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*(?P<unit>[A-Za-z]*)", re.ASCII)


def align_up(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return (nbytes + alignment - 1) // alignment * alignment


def parse_bytes(value: str | int) -> int:
    """Return a byte count given as an int or as a string such as ``"8GiB"``, ``"7.5 GB"`` or ``"1024"``.

    Strings are a non-negative number in ASCII digits, optional whitespace, and an optional unit: binary
    ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024), decimal ``KB``, ``MB``, ``GB``, ``TB`` (powers of
    1000) or ``B``; unit letters are case-insensitive. A number without a unit is bytes and must be whole.
    A fractional size with a unit is rounded down to whole bytes. At most :data:`MAX_BYTES`.

    Raises:
        ConfigError: ``value`` is negative, too large, a bool, not an int or str, or not a size as above.
    """
    # bool is an int subclass; True bytes is surely a mistake, not one byte.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            f"{value!r} is not a byte size; give an int number of bytes or a string such as '8GiB'"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"byte size {value} is negative; give a number of bytes >= 0, e.g. '8GiB'")
        return _within_range(value, value)
    match = _SIZE_RE.fullmatch(value.strip())
    if match is None:
        raise ConfigError(
            f"{_short(value)} is not a byte size; write a number (ASCII digits) and a unit such as "
            "'8GiB', '7.5GB' or '512MiB'"
        )
    number, unit = match["number"], match["unit"]
    factor = _BYTE_UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(
            f"{_short(value)} has an unknown unit {unit!r}; use one of {_UNIT_NAMES} (e.g. '8GiB' or '8GB')"
        )
    if not unit and "." in number:
        raise ConfigError(f"{value!r} has no unit, so it is bytes and must be whole; e.g. '1024' or '7.5GiB'")
    if len(number) > 40:  # far past MAX_BYTES whatever the unit; Fraction of it would still be exact
        raise ConfigError(
            f"{_short(value)} is larger than {format_bytes(MAX_BYTES)}, the largest size accepted"
        )
    # Fraction keeps long decimals exact, where float or a 28-digit Decimal would round.
    return _within_range(math.floor(Fraction(number) * factor), value)


def _within_range(nbytes: int, given: str | int) -> int:
    if nbytes > MAX_BYTES:
        raise ConfigError(
            f"{_short(given)} is larger than {format_bytes(MAX_BYTES)}, the largest size accepted; "
            "give a size such as '8GiB'"
        )
    return nbytes


def _short(value: str | int) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
