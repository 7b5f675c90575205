"""One host copy of the compressed weights per node, for processes that offload the same model with
``share_host_memory=True`` and ``compression="lossless"``.

[Note: shared coded packs]
Packing goes as without compression: the raw weights in the node's raw segment (see [Note: shared host
store] in shared_store.py). At offload()'s compression step (pack_compression.py) the packs move to a
second segment, the *coded segment*, named after the raw one (``flextensor-<uid>-coded-<layout>-<content>``,
``-c<n>`` appended on a collision) and holding every unit of the raw one: coded where the coded load
pays, raw otherwise (fp32 units, or where the first process's decoder did not beat its link). Every
process then frees its raw packs, and the last one to leave the raw segment removes it: the node holds
the compressed copy once.

The first process to get there creates the coded segment (one page, header PACKING, locked exclusively
like a raw segment being packed) and encodes the units one at a time, each written into the segment
as it is encoded; then the index of every unit's range and pieces (JSON, at the end), and READY. The
others wait for it (a creator that dies is replaced, as for raw segments; after SHARED_CODED_TIMEOUT_S
a waiter streams its raw packs, with a warning) and map it. So the first offload briefly holds the raw
segment and the coded one beside it (about 1.7x the raw bytes), each process pins both for a moment.

Which units are coded is the creator's choice (its link and decode speed); a process for which a coded
unit's load does not pay keeps that unit's raw pack, and with it the raw segment.

The header's content field records the raw segment the coded bytes equal (its *instance*, drawn when it
was packed). A process whose raw segment is another packing (the first was removed once every process
held the coded one, and the weights were packed again) compares the decoded bytes with its own before
using them, then records its raw instance there; when they differ (weights whose cheap digest collided,
see shared_store.py) it encodes a coded segment of its own under the next name. A process with meta
parameters counts the coded segments whose raw segment is not live as models too: with one model on the
node and only its coded copy left, it unpacks the raw segment from it (decoding on its GPU) and attaches
as usual; with more, it refuses to guess.

A process whose plan has no room for the staging slots holds its packs uncompressed again
(pack_compression.hold_uncompressed): they move to the raw segment the coded one was made from (live, or
packed again from the coded one, as for a meta process), so the weights stay shared; the index keeps the
raw segment's name, key, size and each unit's offset in it for that.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import mmap
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .codec.format import DEFAULT_CHUNK_ELEMENTS
from .coded_packs import CodedPack
from .errors import SharedMemoryError
from .host_store import PAGE, UnitPack
from .measurements import CODED_PIECE_BYTES
from .segment_files import (
    ANY_KEY,
    SegmentLayout,
    create_segment,
    grow_segment,
    inspect_segment,
    leave_segment,
    mark_ready,
    read_header,
    read_index,
    segment_mutex,
    write_index,
)
from .shared_store import POLL_S, SharedSegment, abandon, publish
from .sizes import align_up, format_bytes

if TYPE_CHECKING:
    from .units import Unit

logger = logging.getLogger("flextensor")

__all__ = ["CODED_SEGMENT_FORMAT", "coded_without_raw", "raw_again", "raw_from_coded", "share_coded"]

CODED_SEGMENT_FORMAT = 1
"""Version of the coded segment's index and of the codec's bytes in it: part of the segment's key."""

SHARED_CODED_TIMEOUT_S = 600.0
"""How long a process waits for another to finish encoding the coded segment."""

Encode = Callable[["Unit"], "CodedPack | None"]

_COLLISION = re.compile(r"-c\d+$")


def _coded_name(raw_path: str) -> str:
    folder, name = os.path.split(raw_path)
    prefix = f"flextensor-{os.getuid()}-"
    assert name.startswith(prefix), raw_path
    return os.path.join(folder, f"{prefix}coded-{name[len(prefix) :]}")


def _raw_name(coded_path: str) -> str:
    folder, name = os.path.split(_COLLISION.sub("", coded_path))
    return os.path.join(
        folder, name.replace(f"flextensor-{os.getuid()}-coded-", f"flextensor-{os.getuid()}-", 1)
    )


def share_coded(
    units: Sequence[Unit],
    encode: Encode,
    decode_on: torch.device | None,
    timeout_s: float | None = None,
) -> dict[str, UnitPack] | None:
    """Packs over the node's coded segment for ``units`` (every unit whose pack is in one raw segment),
    encoding it if no process has (``encode``: a unit's coded pack, or None to hold it raw). Returns unit
    name -> pack (the units' own packs untouched: the caller swaps them), or None after waiting too long
    for another process. ``decode_on``: the device that decodes when the segment must be checked against
    this process's raw bytes."""
    raw = _raw_segment(units)
    stem = _coded_name(raw.path)
    key = hashlib.sha256(
        json.dumps(
            [
                CODED_SEGMENT_FORMAT,
                os.path.basename(raw.path),
                CODED_PIECE_BYTES,
                DEFAULT_CHUNK_ELEMENTS,
                [[u.name, u.nbytes] for u in units],
            ]
        ).encode()
    ).digest()
    timeout = SHARED_CODED_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout
    collisions = 0  # coded segments of this name found to hold other weights: the next name is tried
    waited = False
    while True:
        path = stem + (f"-c{collisions}" if collisions else "")
        with segment_mutex(path):
            state, fd = inspect_segment(path, key)
            if state in ("absent", "removed"):
                fd = create_segment(path, PAGE, key, raw.instance)
                state = "created"
        if state == "created":
            assert fd is not None
            return _encode_as_creator(path, fd, units, encode, raw)
        if state == "ready":
            assert fd is not None
            attached = _attach(path, fd, units, raw, decode_on)
            if attached is not None:
                return attached
            collisions += 1
            continue
        if time.monotonic() >= deadline:
            logger.warning(
                "waited %g s for another process to finish compressing the weights into %s; this process "
                "streams them uncompressed (if that process is stuck, stop it: a later start removes what "
                "it left)",
                timeout,
                path,
            )
            return None
        if not waited:
            logger.info("waiting for another process to compress the shared weights into %s", path)
            waited = True
        time.sleep(POLL_S)


def _raw_segment(units: Sequence[Unit]) -> SharedSegment:
    owners = {id(u.pack.owner): u.pack.owner for u in units if u.pack is not None}
    (owner,) = owners.values()  # one model's packs are ranges of one segment
    assert isinstance(owner, SharedSegment)
    return owner


def _encode_as_creator(
    path: str, fd: int, units: Sequence[Unit], encode: Encode, raw: SharedSegment
) -> dict[str, UnitPack]:
    """Fill a coded segment this process just created (holding its exclusive lock), unit by unit, then
    its index, and mark it READY."""
    segment: SharedSegment | None = None
    packs: dict[str, UnitPack] = {}
    try:
        entries, offset = [], PAGE
        for unit in units:
            assert unit.pack is not None
            coded = encode(unit)
            try:
                data = unit.pack.buffer if coded is None else coded.copy_source
                nbytes = unit.nbytes if coded is None else coded.coded_nbytes
                grow_segment(path, fd, offset + nbytes)
                _write(fd, data[:nbytes], offset)
            finally:
                if coded is not None:
                    coded.free()
            record = None if coded is None else coded.record()
            entries.append([unit.name, offset, nbytes, record, unit.pack.offset_in_owner])
            offset = align_up(offset + max(nbytes, 1), PAGE)
        index = json.dumps(
            {
                "raw": os.path.basename(raw.path),
                "raw_key": raw.key.hex(),
                "raw_total": raw.total,
                "units": entries,
            }
        ).encode()
        # Padded (JSON allows trailing spaces) so that the segment is whole pages, as page-locking wants.
        index = index.ljust(align_up(offset + len(index), PAGE) - offset, b" ")
        total = write_index(path, fd, offset, index)
        segment = SharedSegment(path, fd, total, raw.pinned)
        segment.index = json.loads(index)
        for unit, (_, at, nbytes, record, _) in zip(units, entries, strict=True):
            packs[unit.name] = _pack_over(segment, unit, at, nbytes, record)
        publish(segment, path, fd)
    except BaseException:
        abandon(path, fd, segment, list(packs.values()))
        raise
    logger.info(
        "compressed %d of %d unit(s) into shared host memory %s: %s for %s of weights",
        sum(isinstance(p, CodedPack) for p in packs.values()),
        len(units),
        path,
        format_bytes(total),
        format_bytes(sum(u.nbytes for u in units)),
    )
    return packs


def _write(fd: int, data: torch.Tensor, offset: int) -> None:
    view = memoryview(data.numpy()).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _attach(
    path: str, fd: int, units: Sequence[Unit], raw: SharedSegment, decode_on: torch.device | None
) -> dict[str, UnitPack] | None:
    """Packs over a READY coded segment (this process holds a shared lock on ``fd``); None, with the
    segment left as it was, when it was encoded from another packing of the raw segment and its bytes
    differ from this process's."""
    try:
        header = read_header(fd)
        index = json.loads(read_index(fd, header))
        entries = index["units"]
        segment = SharedSegment(path, fd, header.total, raw.pinned)
        segment.index = index
    except BaseException:
        leave_segment(path, fd, os.getpid())
        raise
    by_name = {u.name: u for u in units}
    packs: dict[str, UnitPack] = {}
    try:
        for name, at, nbytes, record, _ in entries:
            packs[name] = _pack_over(segment, by_name[name], at, nbytes, record)
        if set(packs) != set(by_name):
            raise SharedMemoryError(f"{path} does not hold every unit of this model; remove it")
        if header.content[: len(raw.instance)] != raw.instance:
            if not _holds(packs, by_name, decode_on):
                logger.info("coded segment %s holds other weights than this process's; using another", path)
                for pack in packs.values():
                    pack.free()  # the last one closes this process's hold
                return None
            segment.set_content(raw.instance)  # the raw segment live now holds these weights
    except BaseException:
        for pack in packs.values():
            pack.free()
        if not packs:
            segment.close()
        raise
    logger.info("attached to the shared compressed copy of the weights in %s", path)
    return packs


def _pack_over(segment: SharedSegment, unit: Unit, offset: int, nbytes: int, record: dict | None) -> UnitPack:
    if record is None:
        return segment.pack(unit.name, unit.entries, offset, nbytes)
    return CodedPack.over_coded(unit.name, unit.entries, record, segment.claim(offset, nbytes), segment)


def _decoded(pack: CodedPack, decode_on: torch.device | None, out: torch.Tensor) -> torch.Tensor:
    """``pack``'s raw bytes written into ``out`` (host), decoded on ``decode_on`` when given (a GPU
    decodes many times faster than the host)."""
    if decode_on is not None:
        pack.decode_through(decode_on, out)
    else:
        pack.decode_into(pack.copy_source, out)
    return out


def _holds(packs: dict[str, UnitPack], units: dict[str, Unit], decode_on: torch.device | None) -> bool:
    """Whether the packs hold exactly the bytes of the units' own packs."""
    return all(_same_bytes(pack, units[name].pack, decode_on) for name, pack in packs.items())


def _same_bytes(one: UnitPack, other: UnitPack | None, decode_on: torch.device | None) -> bool:
    """Whether two packs of a unit hold the same raw bytes, each decoded (on ``decode_on`` when given)
    if it is coded."""
    assert other is not None
    return torch.equal(_raw_bytes(one, decode_on), _raw_bytes(other, decode_on))


def _raw_bytes(pack: UnitPack, decode_on: torch.device | None) -> torch.Tensor:
    if isinstance(pack, CodedPack):
        return _decoded(pack, decode_on, torch.empty(pack.nbytes, dtype=torch.uint8, device="cpu"))
    return pack.buffer


# -- packs held uncompressed again --------------------------------------------------------------------------


def raw_again(
    units: Sequence[Unit], decode_on: torch.device | None, timeout_s: float | None = None
) -> dict[str, UnitPack] | None:
    """Packs over the node's raw segment for ``units`` (every unit whose pack is in one coded segment),
    for a process that must hold them uncompressed (a plan with no room for the staging slots): the raw
    segment live, or packed again from the coded one. None (the caller decodes into packs of its own,
    with a warning) when the live raw segment holds other bytes, or another process packs it for longer
    than ``timeout_s``."""
    coded = _raw_segment(units)
    index = coded.index
    assert index is not None
    raw_path = os.path.join(os.path.dirname(coded.path), index["raw"])
    offsets = {entry[0]: entry[4] for entry in index["units"]}
    layout = SegmentLayout(
        tuple((u.name, u.entries, offsets[u.name], u.nbytes) for u in units),
        index["raw_total"],
        bytes.fromhex(index["raw_key"]),
    )
    deadline = time.monotonic() + (SHARED_CODED_TIMEOUT_S if timeout_s is None else timeout_s)
    while True:
        unpacked = _unpack_into_raw(raw_path, layout, coded, index["units"], decode_on)
        if unpacked is not None:
            fd, check = unpacked[1], False
            coded.set_content(read_header(fd).instance)  # unpacked from it: the same bytes
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
        segment = SharedSegment(raw_path, fd, layout.total, coded.pinned)
    except BaseException:
        leave_segment(raw_path, fd, os.getpid())
        raise
    packs = {u.name: segment.pack(u.name, u.entries, offsets[u.name], u.nbytes) for u in units}
    if check and not all(_same_bytes(packs[u.name], u.pack, decode_on) for u in units):
        logger.info("raw segment %s holds other weights than this process's", raw_path)
        for pack in packs.values():
            pack.free()
        return None
    return packs


# -- processes whose parameters are on the meta device ------------------------------------------------------


def coded_without_raw(raw_prefix: str, live: Sequence[str]) -> list[str] | None:
    """The READY coded segments of the raw segments named ``raw_prefix*`` whose weights no live raw
    segment (``live``, their paths) is known to hold: each is one more model on the node. None when one
    of ``live`` was removed meanwhile (look again)."""
    instances = {}
    for path in live:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            instances[path] = read_header(fd).instance
        finally:
            os.close(fd)
    found = []
    for path in sorted(
        p for p in glob.glob(glob.escape(_coded_name(raw_prefix)) + "*") if not p.endswith(".lock")
    ):
        with segment_mutex(path):
            state, fd = inspect_segment(path, ANY_KEY)
        if state != "ready" or fd is None:
            continue
        try:
            content = read_header(fd).content
        finally:
            os.close(fd)
        held_by = instances.get(_raw_name(path))
        if held_by is None or content[: len(held_by)] != held_by:
            found.append(path)
    return found


def raw_from_coded(
    coded_path: str, layout: SegmentLayout, decode_on: torch.device | None
) -> tuple[str, int] | None:
    """Pack the raw segment of ``layout`` again from the coded segment at ``coded_path``, decoding it (on
    ``decode_on`` when given). Returns the raw segment's path and an fd holding a shared lock on it, for
    the caller to attach to; None when the coded segment is gone, or another process packs the raw one."""
    with segment_mutex(coded_path):
        state, fd = inspect_segment(coded_path, ANY_KEY)
    if state != "ready" or fd is None:
        return None
    try:
        header = read_header(fd)
        index = json.loads(read_index(fd, header))
        coded = SharedSegment(coded_path, fd, header.total, pin=False)
    except BaseException:
        leave_segment(coded_path, fd, os.getpid())
        raise
    raw_path = os.path.join(os.path.dirname(coded_path), index["raw"])
    hold = coded.claim(0, 0)  # keeps the segment's hold while its packs below come and go
    try:
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
            pack = CodedPack.over_coded(name, entries, record, coded.claim(at, held_nbytes), coded)
            try:
                _decoded(pack, decode_on, target)
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
