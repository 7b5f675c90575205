"""Fixtures shared by several test files."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flextensor.host.shared import store as shared_store


@pytest.fixture
def shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private segment directory on tmpfs; the test must leave it empty."""
    path = Path("/dev/shm") / f"ft-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    monkeypatch.setattr(shared_store, "SHM_DIR", str(path))
    try:
        yield path
        assert sorted(os.listdir(path)) == [], "segments or locks left behind"
    finally:
        for leftover in path.iterdir():
            leftover.unlink()
        path.rmdir()


@pytest.fixture
def fast_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder faster than any link: every unit's coded load pays."""
    monkeypatch.setattr("flextensor.store.coded_loads.probe_decode", lambda runtime, pack, destination: 1e15)
