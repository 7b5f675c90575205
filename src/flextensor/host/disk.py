"""The disk tier: units whose bytes stay in the checkpoint file and stream from it through the staging ring.

[Note: disk tier]
With ``offload(model, config, weights=PATH)`` and a host budget too small for every pack next to the
staging ring, the units that do not fit get no host pack at all: a :class:`DiskPack` stands in for it.
Its copies to the device read the unit's tensors from the checkpoint file (``preadv``, one range per
tensor, dropped from the page cache like the loading's reads) into a staging slot, then copy the slot to
the device, as a staged copy does (``StagingRing.copy`` with :meth:`DiskPack.fill` as its fill). Which
units these are is decided at offload(), like the first split of the host budget: units in module order
keep a host pack while the budget (less the ring) holds them, the rest stay on disk for good. The
planner knows the disk units' speed (``HostPlan.disk_link``, probed at offload() by timing a disk unit's
copy through the ring with the page cache dropped): they are always staged and timed at that speed, so
the search keeps a disk unit resident when its copy would stall the step.

[Note: disk reads ahead]
A read on the thread that issues the copy (the forward's, in the prefetch after the previous unit) would
hold the model's host thread for the whole read. Instead reader threads (:class:`DiskReadAhead`) read the
next READ_AHEAD disk units of the planned order (cyclic: the next step's first ones after the last), each
in READ_CHUNK pieces read in parallel, into pageable buffers while the model runs; a disk unit's copy
then waits for its read (already done when the compute between two disk units is longer than a read) and
goes through the ring from that buffer, a memcpy. Each layout gives the reader the new order. The file
must not change while the model is offloaded (see [Note: checkpoint changed under the model]), so a read
done early is never stale.

The buffers count against the host budget: each holds the largest disk unit, taken from the budget
before any unit keeps a host pack (:func:`plan_disk_tier`). Overlapping the reads with compute saves up to
a whole step's compute, more than keeping the two units those buffers could hold saves (their reads).
When the budget beside the ring cannot hold two such buffers there are none, and every disk unit (or one
the reader has not reached) is read on the copying thread (wan20 with an 8 GiB budget on the H200 read
all 36 disk units that way while the buffers were capped at half the ring: 5.25 s a step against 4.3 s
of disk reads; 4.83 s against 4.91 s with them).

Everything else that reads a pack reads the file: the parameters of a disk unit that is not loaded view
the checkpoint through a private copy-on-write mapping (reading pages on demand, holding none of them as
anonymous memory), so ``state_dict()``, ``release()`` and reads outside a forward see the checkpoint's
values; a unit made resident is uploaded from a read of the file. ``flextensor.editing`` refuses a model
with disk units: the file is the only copy of their weights, and writing into it is not ours to do.

[Note: checkpoint changed under the model]
The file is the only copy of the disk units' weights, so it must not change while the model is offloaded.
Nothing stops a user from saving over it, though: a write in place of the same size would stream other
weights without a sign, and a truncation makes a mapped view's pages vanish (reading one is SIGBUS, which
kills the process). So every forward starts with one ``fstat`` per checkpoint file (size and modification
time against those at offload(); ``CheckpointFiles.check_unchanged``), and so does every view of a disk
unit's weights (``state_dict()``, ``release()``, a unit made resident), before any of its pages is read:
a change is a CheckpointError, never another model's output or a crash. A change made while a forward
runs is seen by the next one (the reads themselves see a truncation at once: a read past the end is a
CheckpointError too); views handed out before the change (an earlier ``state_dict()``) are the caller's.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from flextensor.errors import CheckpointError
from flextensor.host.checkpoint_files import CheckpointTensor
from flextensor.host.packs import PackedParameter, UnitPack
from flextensor.host.staging import StagingRing, staging_layout
from flextensor.plan.host_plan import pack_bytes
from flextensor.plan.measurements import LinkModel

__all__ = [
    "READ_AHEAD",
    "CheckpointFiles",
    "DiskPack",
    "DiskReadAhead",
    "choose_disk_units",
    "plan_disk_tier",
    "probe_disk_link",
]

READ_AHEAD = 2
"""Disk units read ahead of their copies (see [Note: disk reads ahead]): two keep one read going while
the previous unit's buffer is copied through the ring."""

READ_THREADS = 4
"""Threads reading ahead. A unit's read is split into READ_CHUNK pieces read in parallel: one reader
leaves an NVMe drive idle between its requests and copies out of the page cache on one core (wan20 with
an 8 GiB budget on the H200: 4.08 s a step against 3.75 s of disk reads at 2.06 GB/s)."""

READ_CHUNK = 32 * 2**20
"""Bytes of one read ahead: large enough that a request's overhead is lost in it, small enough that a
unit of a few hundred MiB keeps every thread busy."""


def plan_disk_tier(nbytes: Sequence[int], budget_bytes: int | None) -> tuple[frozenset[int], int]:
    """Which units (indices into ``nbytes``, in module order) stay on disk under ``budget_bytes``, and the
    bytes of each of the READ_AHEAD read-ahead buffers (see [Note: disk reads ahead]).

    None on disk when the budget holds every pack, or not even the staging ring (HostBudget.start then
    raises its error). Else the budget less the ring holds the buffers first, when it has room for
    READ_AHEAD buffers of the largest unit (none otherwise: every disk read is then inline), and units keep
    a pack in order while the rest holds them: the same greedy split as HostBudget.start, which calls
    this too. The buffers then shrink to the largest unit left on disk, which can only leave more room
    for packs, until nothing changes."""
    held = [pack_bytes(n) for n in nbytes]
    if budget_bytes is None or not nbytes or sum(held) <= budget_bytes:
        return frozenset(), 0
    slot, slots = staging_layout(max(nbytes))
    room = budget_bytes - slot * slots
    if room < 0:
        return frozenset(), 0
    buffer = max(nbytes) if READ_AHEAD * max(nbytes) <= room else 0
    while True:
        left, disk = room - READ_AHEAD * buffer, set()
        for i, size in enumerate(held):
            if size <= left:
                left -= size
            else:
                disk.add(i)
        largest_on_disk = max(nbytes[i] for i in disk)
        if not buffer or largest_on_disk >= buffer:
            return frozenset(disk), buffer
        buffer = largest_on_disk


def choose_disk_units(nbytes: Sequence[int], budget_bytes: int | None) -> frozenset[int]:
    """Indices of the units left on disk (see :func:`plan_disk_tier`)."""
    return plan_disk_tier(nbytes, budget_bytes)[0]


class CheckpointFiles:
    """The checkpoint's files, open for reading and mapped copy-on-write, shared by the disk packs; closed
    when the last pack and the last tensor viewing a mapping are gone.

    The files must stay as they were (see [Note: checkpoint changed under the model]): each file's size
    and modification time when opened are kept, and :meth:`check_unchanged` compares them."""

    def __init__(self, files: Sequence[Path]) -> None:
        self.fds: dict[Path, int] = {}
        self.maps: dict[Path, mmap.mmap] = {}
        self._stats: dict[Path, tuple[int, int]] = {}
        try:
            for file in files:
                fd = os.open(file, os.O_RDONLY)
                self.fds[file] = fd
                self._stats[file] = _identity(os.fstat(fd))
                if self._stats[file][0]:
                    self.maps[file] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except BaseException:
            _close(dict(self.fds))
            raise
        weakref.finalize(self, _close, dict(self.fds))

    def check_unchanged(self) -> None:
        """CheckpointError if a file was written, truncated or extended since it was opened: one ``fstat``
        per file (the open file itself, so a file replaced by a rename is still the one read)."""
        for file, fd in self.fds.items():
            now = _identity(os.fstat(fd))
            if now != self._stats[file]:
                raise _changed(file, self._stats[file], now)


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _changed(file: Path, before: tuple[int, int], now: tuple[int, int]) -> CheckpointError:
    what = (
        f"its size went from {before[0]} to {now[0]} bytes"
        if now[0] != before[0]
        else "written to: its modification time changed"
    )
    return CheckpointError(
        f"the checkpoint file {file} changed after offload() ({what}), while units of this model stream "
        "from it: their weights are no longer the ones offloaded. A checkpoint must stay unchanged while a "
        "model streams from it; build the model again and offload it from the file as it is now (or save "
        "new weights under another name), or raise host_memory_budget so that no unit stays on disk"
    )


def _close(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        os.close(fd)


class DiskPack(UnitPack):
    """A unit's "pack" that holds no host memory: its bytes are read from the checkpoint when needed (see
    [Note: disk tier]). ``sources[k]`` is where ``entries[k]`` is in the checkpoint."""

    disk = True

    def __init__(
        self,
        unit: str,
        entries: tuple[PackedParameter, ...],
        nbytes: int,
        sources: Sequence[CheckpointTensor],
        files: CheckpointFiles,
    ) -> None:
        # No UnitPack.__init__: it maps host memory, which is what a disk unit does without.
        self.unit = unit
        self.entries = entries
        self.nbytes = nbytes
        self.pinned = False
        self._pin_lock = threading.Lock()
        self._reading = None
        self._owner = None
        self._owner_offset = 0
        self._mmap = None
        self._held = 0
        self._unlock = None
        self.files: CheckpointFiles | None = files
        # Per entry, in pack order: (pack offset, bytes, fd, file offset); a copy reads these ranges.
        self._ranges = [
            (entry.offset, entry.nbytes, files.fds[source.file], source.start)
            for entry, source in zip(entries, sources, strict=True)
        ]
        self._source_at = {entry.offset: source for entry, source in zip(entries, sources, strict=True)}
        self.read_ahead: DiskReadAhead | None = None  # set by the host budget when it stages the unit

    def copy_through(self, ring: StagingRing, destination: torch.Tensor, stream: object) -> None:
        """Copy the unit's bytes to ``destination`` through ``ring``, from a read done ahead if there is one
        (see [Note: disk reads ahead]), else reading the file now."""
        if self.read_ahead is None:
            ring.copy(destination, self.fill, stream)
        else:
            self.read_ahead.copy(self, ring, destination, stream)

    @property
    def buffer(self) -> torch.Tensor:
        """The unit's bytes in pack layout, read from the file into a new pageable tensor (a one-off:
        an upload to resident storage, a link probe)."""
        whole = torch.zeros(self.nbytes, dtype=torch.uint8, device="cpu")
        self.fill(whole, 0)
        return whole

    @property
    def unread_buffer(self) -> torch.Tensor:
        raise CheckpointError(f"unit {self.unit!r} streams from the checkpoint file: it has no host buffer")

    def unread_view(self, entry: PackedParameter) -> torch.Tensor:
        return self.view(entry)

    def view(self, entry: PackedParameter) -> torch.Tensor:
        """``entry``'s weights viewing the checkpoint file (copy-on-write: a write never reaches the file)."""
        if entry.numel == 0:
            return torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
        assert self.files is not None, f"the disk pack of unit {self.unit!r} was freed"
        self.files.check_unchanged()  # a truncated file's pages would be SIGBUS when read
        source = self._source_at[entry.offset]
        flat = torch.frombuffer(
            self.files.maps[source.file], dtype=entry.dtype, count=entry.numel, offset=source.start
        )
        return entry.shaped(flat)

    def standalone_view(self, entry: PackedParameter) -> torch.Tensor:
        return self.view(entry)  # a storage of its own per call already

    def fill(self, slot: torch.Tensor, offset: int) -> None:
        """Read the unit's bytes at pack ``offset`` into ``slot`` (a uint8 host tensor): the staging
        ring's fill. Padding between tensors is left as it was (nothing reads it)."""
        end = offset + slot.numel()
        dest = memoryview(slot.numpy())
        for start, count, fd, file_offset in self._ranges:
            lo, hi = max(start, offset), min(start + count, end)
            if lo < hi:
                _pread(fd, dest[lo - offset : hi - offset], file_offset + lo - start, self.unit)

    def free(self) -> None:
        self.files = None  # the files close when no pack and no view needs them
        self._ranges = []

    def __repr__(self) -> str:
        return f"DiskPack({self.unit!r}, {len(self.entries)} parameters, {self.nbytes} bytes)"


def _pread(fd: int, dest: memoryview, offset: int, unit: str) -> None:
    done = 0
    while done < len(dest):
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(
                f"the checkpoint ended while reading unit {unit!r} from disk (byte {offset + done}): it was "
                "truncated or replaced while the model ran; it must stay as it was while a model streams "
                "from it"
            )
        if hasattr(os, "posix_fadvise"):  # the disk tier exists because the host cannot hold these bytes
            os.posix_fadvise(fd, offset + done, n, os.POSIX_FADV_DONTNEED)
        done += n


def probe_disk_link(ring: StagingRing, pack: DiskPack, destination: torch.Tensor) -> LinkModel:
    """The speed of a disk unit's copies into ``destination`` (the arena): reads from the file into the
    ring and the copies out of it, host clock around the whole copy, median of three."""
    runtime = ring.runtime
    size = min(pack.nbytes, destination.numel())
    stream = runtime.copy_stream
    previous = runtime.current_stream()
    runtime.set_stream(stream)
    times = []
    target = destination[:size]
    try:
        for _ in range(3):
            runtime.synchronize()
            start = time.perf_counter()
            ring.copy(target, pack.fill, stream)
            runtime.synchronize()
            times.append(max(time.perf_counter() - start, 1e-9))
    finally:
        runtime.set_stream(previous)
    ring.copies -= 3  # probes are not the model's copies
    ring.staged_bytes -= 3 * size
    return LinkModel(points=((max(size, 1), size / sorted(times)[1]),))


class DiskReadAhead:
    """The reader thread and buffers of one model's disk units (see [Note: disk reads ahead])."""

    def __init__(self, buffer_bytes: int) -> None:
        self.buffer_bytes = buffer_bytes
        count = READ_AHEAD if buffer_bytes else 0  # no room beside the ring: every read is inline
        self._free = [torch.empty(buffer_bytes, dtype=torch.uint8, device="cpu") for _ in range(count)]
        self._pending: dict[DiskPack, tuple[list[Future], torch.Tensor]] = {}
        self._next: dict[DiskPack, DiskPack] = {}
        self._parked: list[tuple[list[Future], torch.Tensor]] = []  # see _give_back
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            READ_THREADS, thread_name_prefix="flextensor-disk"
        )
        self.hits = 0  # copies served from a read done ahead
        self.misses = 0  # copies that read the file on the copying thread

    @property
    def nbytes(self) -> int:
        """Host bytes of the buffers (pageable), counted in the host budget."""
        return 0 if self._pool is None else READ_AHEAD * self.buffer_bytes

    def plan(self, order: Sequence[DiskPack]) -> None:
        """The disk units in the order the model streams them; reads ahead start from the first. Plan
        time: waits for reads in flight."""
        self._settle()
        ahead = [p for p in order if p.nbytes <= self.buffer_bytes]
        self._next = {p: ahead[(k + 1) % len(ahead)] for k, p in enumerate(ahead)}
        if ahead:
            self._start_after(ahead[-1])  # the step's first disk units

    def copy(self, pack: DiskPack, ring: StagingRing, destination: torch.Tensor, stream: object) -> None:
        pending = self._pending.pop(pack, None)
        if pending is None:
            self.misses += 1
            ring.copy(destination, pack.fill, stream)
        else:
            pieces, buffer = pending
            try:
                wait(pieces)  # every piece done before the buffer is used or reused
                for piece in pieces:
                    piece.result()  # a read's error, if one failed, is this copy's
                ring.copy_from_host(destination, buffer[: pack.nbytes], stream)  # done with buffer on return
            finally:
                self._give_back(pieces, buffer)
            self.hits += 1
        self._start_after(pack)

    def _give_back(self, pieces: list[Future], buffer: torch.Tensor) -> None:
        """Return ``buffer`` for reuse once every piece read into it is done; a copy interrupted while
        waiting (Ctrl-C) leaves pieces running, and their buffer waits in ``_parked`` until they end."""
        if all(piece.done() for piece in pieces):
            self._free.append(buffer)
        else:
            self._parked.append((pieces, buffer))

    def _start_after(self, pack: DiskPack) -> None:
        """Read the units that follow ``pack`` in the order, while buffers are free."""
        if self._parked:
            parked, self._parked = self._parked, []
            for pieces, buffer in parked:
                self._give_back(pieces, buffer)
        nxt = self._next.get(pack)
        for _ in range(READ_AHEAD):
            if nxt is None or nxt is pack or not self._free or self._pool is None:
                return
            if nxt not in self._pending:
                buffer = self._free.pop()
                pieces = [
                    self._pool.submit(nxt.fill, buffer[lo : min(lo + READ_CHUNK, nxt.nbytes)], lo)
                    for lo in range(0, nxt.nbytes, READ_CHUNK)
                ]
                self._pending[nxt] = (pieces, buffer)
            nxt = self._next.get(nxt)

    def _settle(self) -> None:
        """Wait for the reads in flight and take their buffers back."""
        waiting = [*self._pending.values(), *self._parked]
        self._pending, self._parked = {}, []
        wait([piece for pieces, _ in waiting for piece in pieces])
        self._free.extend(buffer for _, buffer in waiting)

    def close(self) -> None:
        self._settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._free = []
