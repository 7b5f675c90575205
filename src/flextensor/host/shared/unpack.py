"""The node's raw segment packed again from its coded segment (see [Note: shared coded packs] in
host/shared/coded.py): for a process whose parameters are on the meta device when only the compressed copy is
left, and for one whose plan holds its packs uncompressed again. Also how a meta process counts the
compressed copies among the models of its layout.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import mmap
import os
import time
from collections.abc import Sequence

import torch

from flextensor.host.packs import HasPack, UnitPack
from flextensor.host.shared.coded import (
    SHARED_CODED_TIMEOUT_S,
    coded_segment_name,
    decode_to,
    owning_segment,
    pack_over,
    raw_bytes,
)
from flextensor.host.shared.segments import (
    ANY_KEY,
    SegmentLayout,
    create_segment,
    inspect_segment,
    leave_segment,
    mark_ready,
    read_header,
    read_index,
    segment_mutex,
)
from flextensor.host.shared.store import POLL_S, SharedSegment

logger = logging.getLogger("flextensor")

__all__ = ["coded_without_raw", "raw_again", "raw_from_coded"]


def _open_coded(path: str) -> SharedSegment | None:
    """This process's hold on the READY coded segment at ``path`` (unpinned, its index read), or None."""
    with segment_mutex(path):
        state, fd = inspect_segment(path, ANY_KEY)
    if state != "ready" or fd is None:
        return None
    try:
        header = read_header(fd)
        index = json.loads(read_index(fd, header))
        coded = SharedSegment(path, fd, header.total, pin=False)
    except BaseException:
        leave_segment(path, fd, os.getpid())
        raise
    coded.index = index
    return coded


def raw_again(
    units: Sequence[HasPack],
    everyone: Sequence[HasPack],
    decode_on: torch.device | None,
    timeout_s: float | None = None,
) -> dict[str, UnitPack] | None:
    """Packs over the node's raw segment for ``units`` (those of ``everyone``, the model's units, whose
    packs are in one coded segment), for a process that must hold them uncompressed (a plan with no room
    for the staging slots): the raw segment live, or packed again from the coded one, whole (every unit
    of the coded segment's index, whatever this process holds for it now). None (the caller decodes into
    packs of its own, with a warning) when the live raw segment holds other bytes than the coded one, or
    another process packs it for longer than ``timeout_s``."""
    coded = owning_segment(units)
    index = coded.index
    assert index is not None
    raw_path = os.path.join(os.path.dirname(coded.path), index["raw"])
    layout = _raw_layout(index, {u.name: u for u in everyone})
    deadline = time.monotonic() + (SHARED_CODED_TIMEOUT_S if timeout_s is None else timeout_s)
    while True:
        unpacked = _unpack_into_raw(raw_path, layout, coded, index["units"], decode_on)
        if unpacked is not None:
            fd, check = unpacked[1], False  # unpacked from the coded one: the same bytes
            break
        with segment_mutex(raw_path):
            state, fd = inspect_segment(raw_path, layout.key, layout.total)
        if state == "ready" and fd is not None:
            check = read_header(fd).instance != coded.read_content()[:16]
            break
        if state == "packing" and time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)
    try:
        raw = SharedSegment(raw_path, fd, layout.total, coded.pinned)
    except BaseException:
        leave_segment(raw_path, fd, os.getpid())
        raise
    raw.claim(0, 0)  # held while the check below runs, whatever it raises
    try:
        if check and not _equal(coded, index, raw.buffer, layout, decode_on):
            logger.info("raw segment %s holds other weights than the coded one %s", raw_path, coded.path)
            return None
        coded.set_content(raw.instance)
        offsets = {name: offset for name, _, offset, _ in layout.units}
        return {u.name: raw.pack(u.name, u.entries, offsets[u.name], u.nbytes) for u in units}
    finally:
        raw.pack_freed()


def _raw_layout(index: dict, units: dict[str, HasPack]) -> SegmentLayout:
    """The raw segment a coded segment's ``index`` was made from, laid out for the model's ``units``."""
    return SegmentLayout(
        tuple(
            (name, units[name].entries, raw_offset, units[name].nbytes)
            for name, *_, raw_offset in index["units"]
        ),
        index["raw_total"],
        bytes.fromhex(index["raw_key"]),
    )


def _equal(
    coded: SharedSegment,
    index: dict,
    raw: torch.Tensor,
    layout: SegmentLayout,
    decode_on: torch.device | None,
) -> bool:
    """Whether the raw segment's bytes (``raw``, laid out as ``layout``) are the coded segment's, decoded."""
    held = {name: (at, nbytes, record) for name, at, nbytes, record, _ in index["units"]}
    for name, entries, offset, nbytes in layout.units:
        at, held_nbytes, record = held[name]
        if record is None:
            same = torch.equal(coded.buffer[at : at + nbytes], raw[offset : offset + nbytes])
        else:
            pack = pack_over(coded, name, entries, at, held_nbytes, record)
            try:
                same = torch.equal(raw_bytes(pack, decode_on), raw[offset : offset + nbytes])
            finally:
                pack.free()
        if not same:
            return False
    return True


# -- processes whose parameters are on the meta device ------------------------------------------------------


def coded_without_raw(
    raw_prefix: str,
    live: Sequence[tuple[str, int | None]],
    layout: SegmentLayout,
    decode_on: torch.device | None,
) -> list[str] | None:
    """The READY coded segments of ``layout`` whose weights no live raw segment holds: each is one more
    model on the node. ``live``: the raw segments of the layout, (path, fd holding a shared lock) when
    ready, (path, None) while packed. A coded segment whose raw segment is live under another packing
    (the weights packed again, or unpacked by another process) is compared with it byte for byte. None
    when that raw segment is still being packed: look again."""
    by_path = dict(live)
    found = []
    candidates = glob.glob(glob.escape(coded_segment_name(raw_prefix)) + "*")
    for path in sorted(p for p in candidates if not p.endswith(".lock")):
        coded = _open_coded(path)
        if coded is None:
            continue
        index = coded.index
        assert index is not None
        coded.claim(0, 0)  # this process's hold until the end of the look
        try:
            if index["raw_key"] != layout.key.hex():
                continue  # another layout whose name starts alike
            raw_path = os.path.join(os.path.dirname(path), index["raw"])
            if raw_path not in by_path:
                found.append(path)
                continue
            raw_fd = by_path[raw_path]
            if raw_fd is None:
                return None
            instance = read_header(raw_fd).instance
            if instance == coded.read_content()[: len(instance)]:
                continue
            data = mmap.mmap(raw_fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            raw = torch.frombuffer(data, dtype=torch.uint8, count=layout.total)
            try:
                same = _equal(coded, index, raw, layout, decode_on)
            finally:
                del raw
                data.close()  # its own fd would hold the segment's lock until collected
            if same:
                coded.set_content(instance)
            else:
                found.append(path)
        finally:
            coded.pack_freed()
    return found


def raw_from_coded(
    coded_path: str, layout: SegmentLayout, decode_on: torch.device | None
) -> tuple[str, int] | None:
    """Pack the raw segment of ``layout`` again from the coded segment at ``coded_path``, decoding it (on
    ``decode_on`` when given). Returns the raw segment's path and an fd holding a shared lock on it, for
    the caller to attach to; None when the coded segment is gone, or another process packs the raw one."""
    coded = _open_coded(coded_path)
    if coded is None:
        return None
    index = coded.index
    assert index is not None
    raw_path = os.path.join(os.path.dirname(coded_path), index["raw"])
    hold = coded.claim(0, 0)  # keeps the segment's hold while its packs below come and go
    try:
        if index["raw_key"] != layout.key.hex():
            return None  # another layout whose name starts alike
        unpacked = _unpack_into_raw(raw_path, layout, coded, index["units"], decode_on)
        if unpacked is not None:
            coded.set_content(read_header(unpacked[1]).instance)  # unpacked from it: the same bytes
        return unpacked
    finally:
        del hold
        coded.pack_freed()


def _unpack_into_raw(
    raw_path: str, layout: SegmentLayout, coded: SharedSegment, units: list, decode_on: torch.device | None
) -> tuple[str, int] | None:
    with segment_mutex(raw_path):
        state, fd = inspect_segment(raw_path, layout.key, layout.total)
        if state not in ("absent", "removed"):
            if fd is not None:
                os.close(fd)
            return None
        fd = create_segment(raw_path, layout.total, layout.key, b"")
    try:
        data = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        raw = torch.frombuffer(data, dtype=torch.uint8, count=layout.total)
        held = {name: (at, nbytes, record) for name, at, nbytes, record, _ in units}
        target = raw
        for name, entries, offset, nbytes in layout.units:
            at, held_nbytes, record = held[name]
            target = raw[offset : offset + nbytes]
            if record is None:
                target.copy_(coded.buffer[at : at + nbytes])
                continue
            pack = pack_over(coded, name, entries, at, held_nbytes, record)
            try:
                decode_to(pack, decode_on, target)
            finally:
                pack.free()
        mark_ready(data)
        del raw, target
        data.close()
        with segment_mutex(raw_path):
            fcntl.flock(fd, fcntl.LOCK_SH)  # from exclusive: this process and others attach now
    except BaseException:
        leave_segment(raw_path, fd, os.getpid())
        raise
    logger.info("unpacked the shared compressed weights of %s into %s", coded.path, raw_path)
    return raw_path, fd
