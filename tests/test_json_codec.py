"""The record codec (pydantic) and the atomic write that profiles and traces share."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flextensor.common import json_codec
from flextensor.common.json_codec import (
    Bytes,
    RecordError,
    Seconds,
    atomic_write_text,
    from_json_data,
    from_json_text,
    record,
    render_json,
    to_json_data,
)


@record
@dataclass(frozen=True)
class _Inner:
    size: Bytes
    seconds: Seconds = 0.0


@record
@dataclass(frozen=True)
class _EveryType:
    """Field types a future record field might use: the codec must handle each generically."""

    flag: bool
    counts: dict[str, int]
    pair: tuple[str, float]
    maybe: tuple[int, ...] | None
    inner: tuple[_Inner, ...] = ()
    name: str = "x"
    extra: dict[str, tuple[str, ...]] = field(default_factory=dict)


VALUE = _EveryType(
    flag=True, counts={"a": 1}, pair=("p", 0.5), maybe=(3, 4), inner=(_Inner(2, 1.5),), extra={"k.1": ("v",)}
)


def test_every_supported_annotation_round_trips() -> None:
    data = to_json_data(VALUE, _EveryType)
    assert data == {
        "flag": True,
        "counts": {"a": 1},
        "pair": ["p", 0.5],
        "maybe": [3, 4],
        "inner": [{"size": 2, "seconds": 1.5}],
        "name": "x",
        "extra": {"k.1": ["v"]},
    }
    assert from_json_data(data, _EveryType) == VALUE
    assert from_json_text(json.dumps(data), _EveryType) == VALUE


@pytest.mark.parametrize(
    ("edit", "path", "problem"),
    [
        (lambda d: d.update(flag=1), "flag", "must be a valid boolean, got 1"),
        (lambda d: d.update(maybe=[True]), "maybe[0]", "must be a valid integer, got true"),
        (lambda d: d["inner"][0].update(size=-1), "inner[0].size", "greater than or equal to 0"),
        (lambda d: d["inner"][0].update(seconds=float("inf")), "inner[0].seconds", "finite number"),
        (lambda d: d["inner"][0].pop("size"), "inner[0].size", "is missing"),
        (lambda d: d.update(speed=3), "speed", "unknown key"),
        (lambda d: d["extra"].update({"k.1": [3]}), "extra['k.1'][0]", "must be a valid string, got 3"),
        (lambda d: d.update(pair=["p"]), "pair[1]", "is missing"),
    ],
)
def test_a_bad_value_is_named_by_its_json_path(edit: object, path: str, problem: str) -> None:
    data = to_json_data(VALUE, _EveryType)
    edit(data)  # type: ignore[operator]
    with pytest.raises(RecordError) as info:
        from_json_data(data, _EveryType)
    assert info.value.path == path
    assert problem in info.value.problem


def test_what_json_cannot_hold_is_refused_on_the_way_out() -> None:
    with pytest.raises(RecordError, match="cannot be stored as JSON"):
        to_json_data(_Inner(size=object(), seconds=0.0), _Inner)  # type: ignore[arg-type]


def test_render_puts_short_flat_lists_on_one_line() -> None:
    text = render_json({"a": [1, 2], "b": {"c": [[1, [2]], "x"]}, "d": []})
    assert text == '{\n "a": [1, 2],\n "b": {\n  "c": [[1, [2]], "x"]\n },\n "d": []\n}'
    assert json.loads(text) == {"a": [1, 2], "b": {"c": [[1, [2]], "x"]}, "d": []}


def test_atomic_write_keeps_the_mode_of_what_it_replaces(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    assert atomic_write_text(path, "one") == str(path)
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    path.chmod(0o600)
    atomic_write_text(path, "two")
    assert path.read_text() == "two" and oct(path.stat().st_mode & 0o777) == oct(0o600)


def test_atomic_write_follows_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f.json"
    path.write_text("old")

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(json_codec.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_a_missing_directory_is_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write_text(tmp_path / "no" / "f.json", "x")
