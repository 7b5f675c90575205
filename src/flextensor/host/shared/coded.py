"""One host copy of the compressed weights per node, for processes that offload the same model with
``share_host_memory=True`` and ``compression="lossless"``.

[Note: shared coded packs]
Packing goes as without compression: the raw weights in the node's raw segment (see [Note: shared host
store] in host/shared/store.py). At offload()'s compression step (store/coded_loads.py) the packs move to a
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
see host/shared/store.py) it encodes a coded segment of its own under the next name. A process with meta
parameters counts the coded segments whose raw segment is not live as models too (a raw segment live
under another packing is compared with the coded copy first; one still being packed is waited for):
with one model on the node and only its coded copy left, it unpacks the raw segment from it (decoding
on its GPU, every unit) and attaches as usual; with more, it refuses to guess (host/shared/unpack.py).

A process whose plan has no room for the staging slots holds its packs uncompressed again
(store.coded_loads.hold_uncompressed): they move to the raw segment the coded one was made from (live, or
packed again from the coded one, as for a meta process), so the weights stay shared; the index keeps the
raw segment's name, key, size and each unit's offset in it for that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from flextensor.codec.format import DEFAULT_CHUNK_ELEMENTS
from flextensor.common.sizes import align_up, format_bytes
from flextensor.errors import SharedMemoryError
from flextensor.host.coded_packs import CodedPack
from flextensor.host.packs import PAGE, HasPack, UnitPack
from flextensor.host.shared.segments import (
    create_segment,
    grow_segment,
    inspect_segment,
    leave_segment,
    read_header,
    read_index,
    segment_mutex,
    write_index,
)
from flextensor.host.shared.store import POLL_S, SharedSegment, abandon, publish
from flextensor.plan.measurements import CODED_PIECE_BYTES

logger = logging.getLogger("flextensor")

__all__ = [
    "CODED_SEGMENT_FORMAT",
    "coded_segment_name",
    "decode_to",
    "owning_segment",
    "pack_over",
    "raw_bytes",
    "share_coded",
]

CODED_SEGMENT_FORMAT = 1
"""Version of the coded segment's index and of the codec's bytes in it: part of the segment's key."""

SHARED_CODED_TIMEOUT_S = 600.0
"""How long a process waits for another to finish encoding the coded segment."""

AnyUnit = TypeVar("AnyUnit", bound=HasPack)
"""The units' own type (the store's ``Unit``), which ``encode`` is given back."""


def coded_segment_name(raw_path: str) -> str:
    folder, name = os.path.split(raw_path)
    prefix = f"flextensor-{os.getuid()}-"
    assert name.startswith(prefix), raw_path
    return os.path.join(folder, f"{prefix}coded-{name[len(prefix) :]}")


def share_coded(
    units: Sequence[AnyUnit],
    encode: Callable[[AnyUnit], CodedPack | None],
    decode_on: torch.device | None,
    timeout_s: float | None = None,
) -> dict[str, UnitPack] | None:
    """Packs over the node's coded segment for ``units`` (every unit whose pack is in one raw segment),
    encoding it if no process has (``encode``: a unit's coded pack, or None to hold it raw). Returns unit
    name -> pack (the units' own packs untouched: the caller swaps them), or None after waiting too long
    for another process. ``decode_on``: the device that decodes when the segment must be checked against
    this process's raw bytes."""
    raw = owning_segment(units)
    stem = coded_segment_name(raw.path)
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


def owning_segment(units: Sequence[HasPack]) -> SharedSegment:
    owners = {id(u.pack.owner): u.pack.owner for u in units if u.pack is not None}
    (owner,) = owners.values()  # one model's packs are ranges of one segment
    assert isinstance(owner, SharedSegment)
    return owner


def _encode_as_creator(
    path: str,
    fd: int,
    units: Sequence[AnyUnit],
    encode: Callable[[AnyUnit], CodedPack | None],
    raw: SharedSegment,
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
    path: str, fd: int, units: Sequence[HasPack], raw: SharedSegment, decode_on: torch.device | None
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


def _pack_over(
    segment: SharedSegment, unit: HasPack, offset: int, nbytes: int, record: dict | None
) -> UnitPack:
    return pack_over(segment, unit.name, unit.entries, offset, nbytes, record)


def pack_over(
    segment: SharedSegment, name: str, entries: tuple, offset: int, nbytes: int, record: dict | None
) -> UnitPack:
    """A pack of unit ``name`` over bytes [offset, offset + nbytes) of ``segment``: coded as ``record``
    says, or raw when it is None."""
    if record is None:
        return segment.pack(name, entries, offset, nbytes)
    claimed = segment.claim(offset, nbytes)
    try:
        return CodedPack.over_coded(name, entries, record, claimed, segment)
    except BaseException:
        segment.pack_freed()  # the claim no pack holds
        raise


def decode_to(pack: CodedPack, decode_on: torch.device | None, out: torch.Tensor) -> torch.Tensor:
    """``pack``'s raw bytes written into ``out`` (host), decoded on ``decode_on`` when given (a GPU
    decodes many times faster than the host)."""
    if decode_on is not None:
        pack.decode_through(decode_on, out)
    else:
        pack.decode_into(pack.copy_source, out)
    return out


def _holds(packs: dict[str, UnitPack], units: dict[str, HasPack], decode_on: torch.device | None) -> bool:
    """Whether the packs hold exactly the bytes of the units' own packs, each decoded if coded."""
    for name, pack in packs.items():
        mine = units[name].pack
        assert mine is not None
        if not torch.equal(raw_bytes(pack, decode_on), raw_bytes(mine, decode_on)):
            return False
    return True


def raw_bytes(pack: UnitPack, decode_on: torch.device | None) -> torch.Tensor:
    if isinstance(pack, CodedPack):
        return decode_to(pack, decode_on, torch.empty(pack.nbytes, dtype=torch.uint8, device="cpu"))
    return pack.buffer
