"""One host copy of the offloaded weights per node, shared by every process that offloads the same model.

[Note: shared host store]
With ``share_host_memory`` the units' packs are byte ranges of one file under /dev/shm (a *segment*),
mapped ``MAP_SHARED`` by every process and page-locked in each when the device is CUDA. The first process
packs its weights into it; the others map it and point their parameters at it (they may have built the
model on the meta device, never reading the checkpoint). Host RAM then holds one copy however many
processes run.

Name: ``flextensor-<uid>-<layout>-<content>``. ``layout`` hashes the model's parameter signature, the
patterns and every unit's byte layout; ``content`` hashes what the weights hold (a wrap-around sum of
every parameter plus sampled bytes), so tensor-parallel shards or another checkpoint of the same
architecture get segments of their own. A process with meta parameters cannot hash content: it attaches
to the one live segment of its layout and refuses to guess between several.

Files are created ``O_EXCL`` with mode 0600 and must belong to this user. Three kinds of lock, all
``flock`` (the kernel drops them when a process dies, even by ``kill -9``):

- ``<name>.lock``, exclusive: a mutex around every decision about the segment (create, attach, remove).
  Whoever removes the segment removes this file while holding it; a process that locked an unlinked lock
  file notices (another inode is at the path, or none) and retries.
- the segment, exclusive: held by its creator while it packs. Anyone who can lock it shared while the
  header still says PACKING knows the creator died; the half-packed segment is removed and the next
  process with real weights packs it again (meta processes keep waiting, then time out).
- the segment, shared: held by every process using it, for its lifetime. A process that leaves (all
  its packs freed, or at exit) removes the segment when it can upgrade to exclusive: it was the last.
  A segment nobody holds (every user was killed) is a leftover; any later start removes it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from flextensor.common.parameters import parameter_signatures
from flextensor.common.sizes import align_up, format_bytes
from flextensor.errors import SharedMemoryError
from flextensor.host.packs import (
    PAGE,
    PackedParameter,
    UnitPack,
    fill_pack,
    pack_layout,
    page_lock,
    unlock_when_gone,
    unpack,
)
from flextensor.host.shared.segments import (
    SegmentLayout,
    create_segment,
    inspect_segment,
    leave_segment,
    live_segments,
    mark_ready,
    read_header,
    segment_mutex,
    set_content,
    sweep_leftovers,
)

logger = logging.getLogger("flextensor")

SHM_DIR = "/dev/shm"
"""Where segments live: a tmpfs, so their pages are RAM that every process maps."""

SHARED_STORE_TIMEOUT_S = 600.0
"""How long a process waits for another to finish packing (or, with meta parameters, to start)."""

POLL_S = 0.05
"""Sleep between looks at a segment that is not ready yet."""

between_units_hook: Callable[[int], None] | None = None
"""Tests only: called with the unit index after the creator packs each unit (to pause or crash there)."""

_SAMPLES = 8  # raw byte windows hashed per parameter, on top of the sum of all its bytes
_WINDOW = 256

Named = Sequence[tuple[str, nn.Parameter]]
Advance = Callable[[int], None]


def segment_layout(model: nn.Module, units: Sequence[tuple[str, Named]], patterns: object) -> SegmentLayout:
    """Lay the units out after a header page, each at a page boundary; works on meta parameters."""
    placed = []
    offset = PAGE
    for name, named in units:
        entries, nbytes = pack_layout([(n, p) for n, p in named])
        placed.append((name, entries, offset, nbytes))
        offset = align_up(offset + max(nbytes, 1), PAGE)
    described = [
        [name, off, n, [[e.name, e.offset, e.nbytes, list(e.shape), str(e.dtype)] for e in entries]]
        for name, entries, off, n in placed
    ]
    text = json.dumps([1, parameter_signatures(model), patterns, described, offset], default=list)
    return SegmentLayout(tuple(placed), offset, hashlib.sha256(text.encode()).digest())


def content_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """A digest of what ``tensors`` hold: cheap next to loading them (one multi-threaded pass).

    Per tensor: the wrap-around sum of its 8-byte words (modular, so the same for any reduction order)
    and a few evenly spaced raw byte windows. Enough to tell a different checkpoint or shard apart.
    """
    h = hashlib.sha256()
    for tensor in tensors:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        n = data.numel()
        words = data[: n - n % 8]
        if words.storage_offset() % 8:
            words = words.clone()  # an int64 view needs an 8-byte aligned start
        total = int(words.view(torch.int64).sum()) if words.numel() else 0
        h.update(struct.pack("<Qq", n, total))
        step = max(n // _SAMPLES, 1)
        for start in range(0, n, step):
            h.update(data[start : start + _WINDOW].cpu().numpy().tobytes())
        h.update(data[n - n % 8 :].cpu().numpy().tobytes())
    return h.digest()


class SharedSegment:
    """This process's hold on one segment: its fd (with a shared flock), its mapping and its pin."""

    def __init__(self, path: str, fd: int, total: int, pin: bool) -> None:
        self.path = path
        self.total = total
        header = read_header(fd)
        self.key = header.key  # its layout's
        self.instance = header.instance  # which packing of ``path`` this is
        self.index: dict | None = None  # a coded segment's (see host/shared/coded.py)
        self._mmap = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._fd = fd
        self._private: mmap.mmap | None = None
        self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8, count=total)
        self._pinned = False
        self._users = 0
        self._unlock: weakref.finalize | None = None
        if pin:
            page_lock(self.buffer, total, f"the shared segment {path}")
            self._unlock = unlock_when_gone(self, self._mmap, self.buffer.data_ptr())
            self._pinned = True
        # Runs at close(), when this object dies, or at exit: whichever comes first, once. Made last:
        # if anything above fails, the caller still owns ``fd`` and leaves.
        self._leave = weakref.finalize(self, leave_segment, path, fd, os.getpid())

    @property
    def pinned(self) -> bool:
        return self._pinned

    def pack(self, unit: str, entries: tuple[PackedParameter, ...], offset: int, nbytes: int) -> UnitPack:
        """A pack over this segment's bytes [offset, offset + nbytes); the segment lives while it does."""
        return UnitPack.over(unit, entries, self.claim(offset, nbytes), self)

    def claim(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) for a pack to view: the segment lives until that pack is
        freed (``pack_freed``)."""
        self._users += 1
        return self.buffer[offset : offset + nbytes]

    def standalone(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._private is None:
            # MAP_PRIVATE: reads share the segment's pages, a write copies the page for this process.
            self._private = mmap.mmap(
                self._fd, self.total, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
            )
        return torch.frombuffer(self._private, dtype=dtype, count=numel, offset=offset)

    def pack_freed(self) -> None:
        self._users -= 1
        if self._users == 0:
            self.close()

    def set_ready(self) -> None:
        mark_ready(self._mmap)

    def read_content(self) -> bytes:
        """The header's content field (a coded segment's: which raw segment holds its bytes)."""
        with segment_mutex(self.path):
            return read_header(self._fd).content

    def set_content(self, content: bytes) -> None:
        """Replace the header's content field (a coded segment's: which raw segment holds its bytes)."""
        with segment_mutex(self.path):
            set_content(self._fd, content)

    def close(self) -> None:
        """Unpin and leave: the last process to leave removes the segment."""
        if self._unlock is not None:
            self._unlock()
            self._unlock = None
            self._pinned = False
        self._leave()


@dataclass
class SharedPacks:
    """One pack per unit, the parameters now viewing them, and the Parameter objects replaced because
    meta tensors cannot take host data: (module, key, original, new)."""

    packs: list[UnitPack]
    parameters: list[list[tuple[str, nn.Parameter]]]
    swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = field(default_factory=list)


def pack_shared(
    model: nn.Module,
    units: Sequence[tuple[str, Named]],
    patterns: object,
    pin: bool,
    advance: Advance = lambda n: None,
    timeout_s: float | None = None,
    decode_on: torch.device | None = None,
) -> SharedPacks:
    """Put the units' weights in this node's shared segment for the model, packing it if no one has.

    Processes whose streamed parameters are all real hash them and find or create their segment; those
    with any meta parameter attach to the one live segment of this layout. Waits (up to ``timeout_s``,
    default SHARED_STORE_TIMEOUT_S) while another process packs. All or nothing: on failure the model's
    parameters are as they were. ``decode_on``: the device that decodes when the node holds the weights
    only compressed (see host/shared/coded.py), None for the host.
    """
    if not os.path.isdir(SHM_DIR):
        raise SharedMemoryError(f"share_host_memory needs {SHM_DIR} (Linux); set share_host_memory=False")
    timeout = SHARED_STORE_TIMEOUT_S if timeout_s is None else timeout_s
    layout = segment_layout(model, units, patterns)
    prefix = os.path.join(SHM_DIR, f"flextensor-{os.getuid()}-{layout.key.hex()[:16]}-")
    has_data = all(p.device.type != "meta" for _, named in units for _, p in named)
    digest = content_digest([p.data for _, named in units for _, p in named]) if has_data else b""
    sweep_leftovers(SHM_DIR)
    deadline = time.monotonic() + timeout
    waited = False
    stuck = "if that process is stuck, stop it (a later start removes what it left)"
    collisions = 0  # segments of this digest found to hold other bytes: the next name is tried
    while True:
        if has_data:
            path = prefix + digest.hex()[:16] + (f"-{collisions}" if collisions else "")
            with segment_mutex(path):
                state, fd = inspect_segment(path, layout.key, layout.total)
                if state in ("absent", "removed"):
                    fd = create_segment(path, layout.total, layout.key, digest)
                    state = "created"
            # Packing happens outside the mutex, so that others keep polling (and can time out).
            if state == "created":
                return _pack_as_creator(path, _checked(fd), layout, units, pin, advance)
            if state == "ready":
                attached = _attach(model, path, _checked(fd), layout, units, pin, advance, verify=True)
                if attached is not None:
                    return attached
                collisions += 1  # another model's weights with the same digest: never attach to them
                continue
            what, hint = f"another process to finish packing the weights into {path}", stuck
        else:
            from flextensor.host.shared.unpack import coded_without_raw, raw_from_coded

            live = live_segments(prefix, layout)
            ready = [(path, fd) for path, fd in live if fd is not None]
            # Weights every process holds compressed have no live raw segment (see host/shared/coded.py).
            coded = coded_without_raw(prefix, live, layout, decode_on)
            if coded is None:  # a raw segment is being packed again: wait for it
                for _, fd in ready:
                    os.close(fd)
                ready = []
            elif len(live) + len(coded) > 1:
                for _, fd in ready:
                    os.close(fd)
                raise SharedMemoryError(
                    f"{len(live) + len(coded)} models with this parameter layout share host memory on this "
                    f"node ({', '.join([p for p, _ in live] + coded)}) and this process's parameters are on "
                    "the meta device, so it cannot tell which holds its weights; load the real weights in "
                    "this process (they are freed once it attaches), or set share_host_memory=False"
                )
            elif coded:
                unpacked = raw_from_coded(coded[0], layout, decode_on)
                ready = [unpacked] if unpacked is not None else []
            if ready:
                attached = _attach(model, *ready[0], layout, units, pin, advance, verify=False)
                assert attached is not None  # nothing to verify against: attaching cannot be refused
                return attached
            what, hint = (
                (f"another process to finish packing the weights into {live[0][0]}", stuck)
                if live
                else (
                    f"a process with the real weights to pack them into {prefix}*",
                    "parameters on the meta device can only attach to weights that another process of "
                    "this node has loaded, of the same parameter layout (names, shapes, dtypes; tied "
                    "weights tied alike, e.g. model.tie_weights() after loading the rest): load them in "
                    "at least one process",
                )
            )
        if time.monotonic() >= deadline:
            raise SharedMemoryError(
                f"timed out after {timeout:g} s waiting for {what}; {hint}, or set share_host_memory=False"
            )
        if not waited:
            logger.info("waiting for %s", what)
            waited = True
        time.sleep(POLL_S)


def _checked(fd: int | None) -> int:
    assert fd is not None
    return fd


def _pack_as_creator(
    path: str, fd: int, layout: SegmentLayout, units: Sequence[tuple[str, Named]], pin: bool, advance: Advance
) -> SharedPacks:
    """Fill a segment this process just created (holding its exclusive lock), then mark it READY."""
    segment = None
    packs: list[UnitPack] = []
    try:
        segment = SharedSegment(path, fd, layout.total, pin)
        for index, ((name, entries, offset, nbytes), (_, named)) in enumerate(
            zip(layout.units, units, strict=True)
        ):
            packs.append(segment.pack(name, entries, offset, nbytes))
            fill_pack(packs[-1], named)
            advance(sum(e.nbytes for e in entries))
            if between_units_hook is not None:
                between_units_hook(index)
        publish(segment, path, fd)
    except BaseException:
        for pack, (_, named) in zip(packs, units, strict=False):
            unpack(pack, named)
        abandon(path, fd, segment, packs)
        raise
    logger.info("packed %s of weights into shared host memory %s", format_bytes(layout.total), path)
    return SharedPacks(packs, [list(named) for _, named in units])


def publish(segment: SharedSegment, path: str, fd: int) -> None:
    """Its creator filled ``segment``: mark it READY and let the others attach (from exclusive to shared)."""
    segment.set_ready()
    with segment_mutex(path):
        fcntl.flock(fd, fcntl.LOCK_SH)


def abandon(path: str, fd: int, segment: SharedSegment | None, packs: Sequence[UnitPack]) -> None:
    """Its creator failed while filling the segment: free the packs made over it (the last one frees the
    segment, and so removes it), or leave it when there are none."""
    for pack in packs:
        pack.free()
    if segment is None:
        leave_segment(path, fd, os.getpid())
    elif not packs:
        segment.close()


def _attach(
    model: nn.Module,
    path: str,
    fd: int,
    layout: SegmentLayout,
    units: Sequence[tuple[str, Named]],
    pin: bool,
    advance: Advance,
    verify: bool,
) -> SharedPacks | None:
    """Point the parameters at a READY segment (this process holds a shared lock on ``fd``).

    With ``verify`` (a process that holds real weights) the segment's bytes are compared with the
    parameters' first: when they differ (another checkpoint whose cheap digest collided) this process
    leaves the segment untouched and returns None. Meta parameters have nothing to compare.
    """
    try:
        segment = SharedSegment(path, fd, layout.total, pin)
    except BaseException:
        leave_segment(path, fd, os.getpid())
        raise
    packs = [segment.pack(name, entries, off, n) for name, entries, off, n in layout.units]
    if verify and not _holds(packs, units):
        logger.info("shared segment %s holds other weights with the same digest; using another", path)
        for pack in packs:
            pack.free()  # the last one closes this process's hold
        return None
    new: dict[int, nn.Parameter] = {}
    for pack, (_, named) in zip(packs, units, strict=True):
        for entry, (_, param) in zip(pack.entries, named, strict=True):
            if param.device.type == "meta":
                # A meta tensor's data cannot be swapped for host data: the Parameter itself is replaced.
                new[id(param)] = nn.Parameter(pack.view(entry), requires_grad=param.requires_grad)
            else:
                param.data = pack.view(entry)  # frees this process's own copy
    swapped = [
        (module, key, param, new[id(param)])
        for module in model.modules()
        for key, param in module._parameters.items()
        if param is not None and id(param) in new
    ]
    for module, key, _, replacement in swapped:
        module._parameters[key] = replacement
    advance(sum(e.nbytes for _, entries, _, _ in layout.units for e in entries))
    logger.info("attached to the shared host copy of the weights in %s", path)
    parameters = [[(fqn, new.get(id(p), p)) for fqn, p in named] for _, named in units]
    return SharedPacks(packs, parameters, swapped)


def _holds(packs: Sequence[UnitPack], units: Sequence[tuple[str, Named]]) -> bool:
    """Whether the packs hold exactly the bytes of the units' parameters (bitwise: -0.0, NaN payloads)."""
    for pack, (_, named) in zip(packs, units, strict=True):
        for entry, (_, param) in zip(pack.entries, named, strict=True):
            mine = param.data.detach().contiguous().reshape(-1).view(torch.uint8)
            theirs = pack.view(entry).contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(mine, theirs):
                return False
    return True
