"""The segment files of the shared host store under /dev/shm: the header, the three kinds of ``flock``, and
how a segment is created, inspected, swept when its processes died, and left (see [Note: shared host
store] in host/shared/store.py, which decides what to do with them).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from flextensor.common.sizes import format_bytes
from flextensor.errors import SharedMemoryError
from flextensor.host.packs import PackedParameter

logger = logging.getLogger("flextensor")

__all__ = [
    "ANY_KEY",
    "SegmentHeader",
    "SegmentLayout",
    "create_segment",
    "grow_segment",
    "inspect_segment",
    "leave_segment",
    "live_segments",
    "mark_ready",
    "open_own",
    "read_header",
    "read_index",
    "segment_mutex",
    "set_content",
    "sweep_leftovers",
    "try_exclusive",
    "write_index",
]

_MAGIC = b"FTSHM002"  # 002: the instance id and index fields after the header
_HEADER = struct.Struct("<8sII Q 32s 32s")  # magic, state, creator pid, total bytes, layout, content
_STATE_OFFSET = 8
_TOTAL_OFFSET = 16
_CONTENT_OFFSET = 56
_EXTRA = struct.Struct("<16s Q")  # this segment's instance (random at creation), bytes of its index
_EXTRA_OFFSET = 96
_PACKING, _READY = 0, 1

ANY_KEY = b"*"
"""For :func:`inspect_segment`: keep a READY segment whatever its layout key (the caller reads its index)."""


@dataclass(frozen=True)
class SegmentHeader:
    """What a segment's first page says: its size, layout key, content digest, the instance id drawn
    when it was created (a segment packed again under the same name gets another), and how many bytes
    of index (a coded segment's, see host/shared/coded.py) end the segment."""

    total: int
    key: bytes
    content: bytes
    instance: bytes
    index_nbytes: int


def read_header(fd: int) -> SegmentHeader:
    size = _EXTRA_OFFSET + _EXTRA.size
    raw = os.pread(fd, size, 0).ljust(size, b"\0")
    _, _, _, total, key, content = _HEADER.unpack_from(raw)
    instance, index_nbytes = _EXTRA.unpack_from(raw, _EXTRA_OFFSET)
    return SegmentHeader(total, key, content, instance, index_nbytes)


@dataclass(frozen=True)
class SegmentLayout:
    """Where each unit sits in the segment: (unit, entries, offset, nbytes); ``key`` hashes all of it."""

    units: tuple[tuple[str, tuple[PackedParameter, ...], int, int], ...]
    total: int
    key: bytes


def mark_ready(segment: mmap.mmap) -> None:
    """Set the header's state to READY: the creator has packed every unit."""
    segment[_STATE_OFFSET : _STATE_OFFSET + 4] = struct.pack("<I", _READY)


def open_own(path: str, flags: int) -> int:
    """Open ``path`` (never through a symlink) and check it is this user's and private to them."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise SharedMemoryError(
            f"{path} belongs to another user or is open to others (mode {st.st_mode & 0o777:o}); "
            "flextensor only maps its own private segments: remove the file, or set share_host_memory=False"
        )
    return fd


@contextmanager
def segment_mutex(path: str) -> Iterator[None]:
    """Hold ``<path>.lock`` exclusively; remove it on the way out if the segment is gone."""
    lock = path + ".lock"
    while True:
        fd = open_own(lock, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # removed (or replaced) while we waited for it: lock what is there now
    try:
        yield
    finally:
        if not os.path.exists(path):
            os.unlink(lock)
        os.close(fd)


def inspect_segment(path: str, key: bytes | None, total: int | None = None) -> tuple[str, int | None]:
    """Under the mutex: "absent", "packing", "removed" (a leftover) or "ready" with an fd holding a
    shared lock. The header must say ``key`` (and ``total`` when given, else any size). With ``key``
    None (a sweep) the fd is never kept."""
    try:
        fd = open_own(path, os.O_RDWR)
    except FileNotFoundError:
        return "absent", None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return "packing", None
    magic, state, pid, held_total, held_key, _ = _HEADER.unpack(
        os.pread(fd, _HEADER.size, 0).ljust(_HEADER.size, b"\0")
    )
    if try_exclusive(fd):
        if state == _PACKING:
            logger.warning("process %d died while packing %s; removing what it left", pid, path)
        os.unlink(path)  # nobody holds it: a leftover of processes that were killed, or died packing
        os.close(fd)
        return "removed", None
    if key is None or magic != _MAGIC or state != _READY:
        os.close(fd)
        return ("ready" if state == _READY else "packing"), None
    if key is not ANY_KEY and (held_key != key or (total is not None and held_total != total)):
        os.close(fd)
        raise SharedMemoryError(
            f"{path} holds another parameter layout than this model's (a name collision); remove it once "
            "no process uses it, or set share_host_memory=False"
        )
    return "ready", fd


def try_exclusive(fd: int) -> bool:
    """Upgrade this fd's shared lock to exclusive if no one else holds the file; else keep it shared."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        # A failed upgrade may have dropped the shared lock (flock(2)); take it back. Every exclusive
        # request goes through the mutex, which the caller holds, so this cannot block.
        fcntl.flock(fd, fcntl.LOCK_SH)
        return False


def live_segments(prefix: str, layout: SegmentLayout) -> list[tuple[str, int | None]]:
    """Segments of this layout in use: (path, fd holding a shared lock) when ready, (path, None) packing."""
    live = []
    for path in sorted(p for p in glob.glob(glob.escape(prefix) + "*") if not p.endswith(".lock")):
        with segment_mutex(path):
            state, fd = inspect_segment(path, layout.key, layout.total)
        if state in ("ready", "packing"):
            live.append((path, fd))
    return live


def sweep_leftovers(shm_dir: str) -> None:
    """Remove this user's segments that no process holds (their processes were killed)."""
    for path in glob.glob(os.path.join(shm_dir, f"flextensor-{os.getuid()}-*")):
        if path.endswith(".lock"):
            continue
        try:
            with segment_mutex(path):
                inspect_segment(path, None)
        except (SharedMemoryError, OSError) as exc:
            logger.debug("not sweeping %s: %s", path, exc)


def create_segment(path: str, total: int, key: bytes, content: bytes) -> int:
    """Under the mutex: create the segment, locked exclusively, ``total`` bytes reserved, header PACKING."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _reserve(path, fd, total)
        os.pwrite(fd, _HEADER.pack(_MAGIC, _PACKING, os.getpid(), total, key, content), 0)
        os.pwrite(fd, _EXTRA.pack(os.urandom(16), 0), _EXTRA_OFFSET)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return fd


def grow_segment(path: str, fd: int, total: int) -> None:
    """The creator (holding the exclusive lock) makes its segment at least ``total`` bytes: for segments
    filled before their size is known."""
    _reserve(path, fd, total)


def write_index(path: str, fd: int, offset: int, index: bytes) -> int:
    """The creator writes ``index`` at ``offset`` (after everything else) and records the segment's
    size, which ends with it; returns that size."""
    total = offset + len(index)
    _reserve(path, fd, total)
    os.pwrite(fd, index, offset)
    os.pwrite(fd, struct.pack("<Q", total), _TOTAL_OFFSET)
    os.pwrite(fd, struct.pack("<Q", len(index)), _EXTRA_OFFSET + 16)
    return total


def read_index(fd: int, header: SegmentHeader) -> bytes:
    """The index :func:`write_index` wrote: the last ``index_nbytes`` of the segment."""
    return os.pread(fd, header.index_nbytes, header.total - header.index_nbytes)


def set_content(fd: int, content: bytes) -> None:
    """Replace the header's content field (under the segment's mutex)."""
    os.pwrite(fd, content.ljust(32, b"\0")[:32], _CONTENT_OFFSET)


def _reserve(path: str, fd: int, total: int) -> None:
    try:
        # Reserve every page now: writing past a full tmpfs later would kill us with SIGBUS.
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno == errno.EFBIG:  # RLIMIT_FSIZE (ulimit -f) is below the segment's size
            raise SharedMemoryError(
                f"the file-size limit (ulimit -f) is below the {format_bytes(total)} shared "
                "segment of weights; raise it (ulimit -f unlimited) or set share_host_memory=False"
            ) from None
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise SharedMemoryError(
            f"{os.path.dirname(path)} has too little room for the {format_bytes(total)} of shared weights; "
            "enlarge it (e.g. docker run --shm-size) or set share_host_memory=False"
        ) from None


def leave_segment(path: str, fd: int, pid: int) -> None:
    """Drop this process's hold on a segment, removing it if no other process holds it."""
    if os.getpid() != pid:
        return  # a forked child shares the parent's lock: releasing it would release the parent's
    try:
        with segment_mutex(path):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
            except BlockingIOError:
                pass
    except (OSError, SharedMemoryError) as exc:
        # Often at exit: say why, but do not fail; a later start removes the segment if it is left.
        logger.warning("could not leave the shared segment %s cleanly: %s", path, exc)
    finally:
        os.close(fd)
