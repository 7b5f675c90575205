"""Tests for flextensor.common.sizes: parsing and printing byte sizes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flextensor.common.sizes import MAX_BYTES, format_bytes, parse_bytes
from flextensor.errors import ConfigError

GiB = 2**30
MiB = 2**20
KiB = 2**10

_hypothesis = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)


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
        ("123456.5 TiB", 123456 * 2**40 + 2**39),
        ("0.123456789012345678901234567890 TiB", 135742175046),
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
@given(st.integers(min_value=0, max_value=MAX_BYTES))
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
    text = f"{k}{space}{case(name)}"  # type: ignore[operator]
    if k * factor > MAX_BYTES:
        with pytest.raises(ConfigError, match="larger than"):
            parse_bytes(text)
    else:
        assert parse_bytes(text) == k * factor


@pytest.mark.parametrize("text", ["\u0661\u0662\u0663", "\uff18GiB", "8\u0660MiB", "1.\u0665GB"])
def test_parse_bytes_takes_ascii_digits_only(text: str) -> None:
    with pytest.raises(ConfigError, match="ASCII digits"):
        parse_bytes(text)


@pytest.mark.parametrize("value", ["1" * 400, 2**60 + 1, "1025 PiB", f"{2**50 + 1} KiB", 10**400])
def test_sizes_past_the_largest_accepted_are_refused_not_overflowing(value: str | int) -> None:
    with pytest.raises(ConfigError, match=r"larger than 1048576\.00 TiB|unknown unit"):
        parse_bytes(value)


def test_the_largest_size_is_accepted() -> None:
    assert parse_bytes(MAX_BYTES) == MAX_BYTES == parse_bytes(f"{2**20} TiB")


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
