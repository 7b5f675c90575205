"""Pinned host buffers that hold the offloaded weights, one exact-size buffer per offload unit.

[Note: exact-size pinned buffers]
``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
request up to a power of two: a 0.73 GB unit would hold 1 GiB of locked RAM. Instead each unit's
parameters are packed into one anonymous mmap of exactly their bytes (rounded to a page), which is then
page-locked with ``cudaHostRegister``, so host RAM held is within a page per unit of the weights' bytes.
Packing goes unit by unit and drops the parameter's original storage as soon as it is copied, so
``offload()`` never holds two full copies of the model.

[Note: fault pages in before page-locking]
``cudaHostRegister`` on memory the kernel has not mapped yet maps it itself, page by page: about 2 GB/s
whatever the number of threads, as slow as the kernel's other ways to populate memory (MAP_POPULATE,
MADV_POPULATE_WRITE: 2-10 GB/s); a ``preadv`` into such memory runs at about 5 GB/s. Writing one zero per
page from user space maps it at 19 GB/s (47 GB/s with huge pages), after which registration runs at
18-35 GB/s and reads at 27 GB/s (H200 host, 2026-12-04; a VM, whose first touch of its RAM costs more
still). So a fresh pack is faulted in (:meth:`UnitPack.fault_in`) before it is page-locked or read into
(with this and the readers pinning in the background, wan20's warm ``offload(weights=)`` went from 6.8 to
1.7 s). Only memory nothing has written yet may be faulted in this way.

With ``share_host_memory`` the packs are instead byte ranges of one segment that every process of the
node maps (see [Note: shared host store] in host/shared/store.py): a pack then views memory it does not own,
and the segment is page-locked once per process as a whole.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Protocol

import torch

from flextensor.common.sizes import align_up
from flextensor.errors import PinningError, UnsupportedModelError

logger = logging.getLogger("flextensor")

PARAMETER_ALIGNMENT = 512
"""Byte alignment of each parameter inside a unit's pack (and so inside the device arena): what vectorised
kernels and cuBLAS want from a tensor's base pointer; 512 is what the CUDA caching allocator
gives every tensor, so kernel selection sees the same alignment as for a resident model."""

PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class PackedParameter:
    """Where one parameter sits inside its unit's pack, and the strides it is viewed with.

    ``stride`` is None for a contiguous parameter. A dense parameter laid out in another order (a
    transposed checkpoint) keeps its strides: its bytes are packed in its own memory order, so kernels see
    the same layout as before and outputs stay bitwise.
    """

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This parameter as a tensor over ``buffer`` (a unit-sized uint8 tensor, host or device)."""
        return self.shaped(buffer[self.offset : self.offset + self.nbytes].view(self.dtype))

    def shaped(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (this parameter's elements, in memory order) with its shape and strides."""
        if self.stride is None:
            return flat.view(self.shape)
        return flat.as_strided(self.shape, self.stride)

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


def kept_strides(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides a packed copy of ``tensor`` keeps: None when it is contiguous or cannot keep them
    (a view with gaps, which is packed contiguous), else its own."""
    if tensor.is_contiguous() or not _dense(tensor):
        return None
    return tuple(tensor.stride())


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill one block of memory with no gaps or overlaps, in some order."""
    expected = 1
    for dim in sorted(range(tensor.dim()), key=tensor.stride):
        if tensor.size(dim) != 1 and tensor.stride(dim) != expected:
            return False
        expected *= tensor.size(dim)
    return True


def pack_layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[tuple[PackedParameter, ...], int]:
    """Offsets of ``named`` tensors packed back to back at PARAMETER_ALIGNMENT; returns (entries, bytes)."""
    entries = []
    offset = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        shape = tuple(tensor.shape)
        entries.append(PackedParameter(name, offset, nbytes, shape, tensor.dtype, kept_strides(tensor)))
        offset = align_up(offset + nbytes, PARAMETER_ALIGNMENT)
    return tuple(entries), offset


def page_lock(buffer: torch.Tensor, nbytes: int, what: str) -> None:
    """Page-lock ``nbytes`` of host memory from ``buffer``'s first byte with ``cudaHostRegister``."""
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise PinningError(
            f"could not page-lock {nbytes} bytes of host memory for {what} "
            f"(cudaHostRegister error {int(err)}); raise the memlock limit (ulimit -l), bound pinning with "
            "OffloadConfig(host_memory_budget=...) (see docs/host-memory.md), or pass "
            "OffloadConfig(pinned_memory=False)"
        )


def unlock_when_gone(owner: object, mapping: mmap.mmap, pointer: int) -> weakref.finalize:
    """Page-unlock ``pointer`` (the start of ``mapping``) when ``owner`` is collected, or when the
    returned finalizer is called, whichever comes first, once.

    Memory unmapped while still registered stays registered with the driver: the next mapping at that
    address then fails to register (cudaErrorHostMemoryAlreadyRegistered, 712). The finalizer holds
    ``mapping``, so the memory cannot be unmapped before it is unlocked. Not run at exit: the process's
    end releases both.
    """
    finalizer = weakref.finalize(owner, _unlock, mapping, pointer)
    finalizer.atexit = False
    return finalizer


def _unlock(mapping: mmap.mmap, pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


class PackOwner(Protocol):
    """What holds the memory of packs that do not own theirs (a shared segment)."""

    @property
    def pinned(self) -> bool:
        """Whether the memory is page-locked in this process."""
        ...

    def pack_freed(self) -> None:
        """One pack over this memory has been freed; the owner lets go once all have."""
        ...

    def standalone(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements at byte ``offset`` of this memory as a tensor with a storage of its own,
        whose writes never reach the memory other processes read (copy on write)."""
        ...


class UnitPack:
    """One unit's parameters in one host buffer (pinned when the device is CUDA).

    Built with the constructor, the pack owns an exact-size mmap of its own; built with :meth:`over`, it
    views a range of memory that ``owner`` holds (a segment shared between processes).
    """

    disk = False  # a DiskPack (host/disk.py) holds no host memory: its bytes stay in the checkpoint file
    coded = False  # a CodedPack (host/coded_packs.py) holds its bytes compressed
    reader_pins = False  # its checkpoint reader page-locks it, unless unpinned first (see pin())

    def __init__(self, unit: str, entries: tuple[PackedParameter, ...], nbytes: int, pin: bool) -> None:
        self.unit = unit
        self.entries = entries
        self.nbytes = nbytes
        self.pinned = False
        self._pin_lock = threading.Lock()
        self._reading: Future | None = None  # bytes still being read in (see read_in_background)
        self._owner: PackOwner | None = None
        self._owner_offset = 0
        mapped = align_up(max(nbytes, 1), PAGE)
        self._mmap: mmap.mmap | None = mmap.mmap(-1, mapped)
        self._held = mapped
        if hasattr(mmap, "MADV_HUGEPAGE") and mapped >= 2 * 2**20:
            # Huge pages make the page-locking below several times faster for large units.
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self._buffer = torch.frombuffer(self._mmap, dtype=torch.uint8, count=mapped)[:nbytes]
        self._unlock: weakref.finalize | None = None
        if pin:
            self.fault_in()
            self.pin()

    @classmethod
    def over(
        cls, unit: str, entries: tuple[PackedParameter, ...], buffer: torch.Tensor, owner: PackOwner
    ) -> UnitPack:
        """A pack viewing ``buffer`` (``nbytes`` uint8 host bytes) that ``owner`` holds and pins."""
        pack = cls.__new__(cls)
        pack.unit = unit
        pack.entries = entries
        pack.nbytes = buffer.numel()
        pack.pinned = owner.pinned
        pack._pin_lock = threading.Lock()
        pack._reading = None
        pack._owner = owner
        pack._owner_offset = buffer.storage_offset()
        pack._mmap = None
        pack._unlock = None
        pack._held = align_up(max(pack.nbytes, 1), PAGE)
        pack._buffer = buffer
        return pack

    # [Note: packs filled in the background]
    # offload(weights=...) returns before every pack is read from the checkpoint, so that the first
    # forward overlaps the reads (host/checkpoint.py). Every way to the bytes goes through ``buffer`` (or
    # ``standalone_view``), which first waits for the pack's read and raises its error, so nothing can
    # copy, upload, save or release bytes not yet read: one attribute test per access once the read is
    # done. Only the reader itself and the parameters pointed at the pack before their unit loads use
    # the bytes unread (``unread_buffer``).

    def read_in_background(self, reading: Future) -> None:
        """``reading`` fills this pack's bytes; every access to them waits for it from now on."""
        self._reading = reading

    def wait_read(self) -> None:
        """Wait until the pack's bytes are all read; raises what the read raised, at every call."""
        reading = self._reading
        if reading is not None:
            reading.result()
            self._reading = None

    @property
    def read(self) -> bool:
        """Whether the pack's bytes are all read, without waiting."""
        reading = self._reading
        return reading is None or (reading.done() and not reading.cancelled() and reading.exception() is None)

    @property
    def buffer(self) -> torch.Tensor:
        """The pack's bytes (uint8), once read."""
        if self._reading is not None:
            self.wait_read()
        return self._buffer

    @property
    def copy_source(self) -> torch.Tensor:
        """The host bytes a copy of this pack moves to the device (a coded pack's are compressed)."""
        return self.buffer

    @property
    def unread_buffer(self) -> torch.Tensor:
        """The pack's memory whether or not its bytes are read yet: for its reader, and to point
        parameters at before their unit loads (see [Note: packs filled in the background])."""
        return self._buffer

    def unread_view(self, entry: PackedParameter) -> torch.Tensor:
        """``entry``'s weights over ``unread_buffer``: what a parameter points at before its unit loads."""
        return entry.view(self._buffer)

    def fault_in(self) -> None:
        """Map this fresh pack's pages by writing a zero into each (see [Note: fault pages in before
        page-locking]): only before anything has written the pack's bytes."""
        if self.nbytes and self._mmap is not None:
            # Through a tensor of its own: writing through ``_buffer`` would bump the version counter
            # that the parameters viewing it share, which the engine reads as an edit of the weights.
            torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.nbytes)[::PAGE].zero_()

    def pin(self, by_reader: bool = False) -> None:
        """Page-lock this pack's own memory (the host budget decides which packs are; a pack read from a
        checkpoint is locked by its reader); no-op if pinned. ``by_reader``: the checkpoint reader's call,
        a no-op unless ``reader_pins`` still holds: the host budget may have staged the pack (unpinned
        it) before its reader got to it, and a late pin would hold locked memory beyond the budget."""
        with self._pin_lock:  # a checkpoint's reader and the host budget may both pin a pack being read
            if self.pinned or self._mmap is None or (by_reader and not self.reader_pins):
                return
            page_lock(self._buffer, self._held, f"unit {self.unit!r}")
            self._unlock = unlock_when_gone(self, self._mmap, self._buffer.data_ptr())
            self.pinned = True

    def hand_pinning_to(self, holder: object) -> None:
        """Keep this pack's memory page-locked until ``holder`` is collected, whatever unpin() or free()
        do before: a device mapping of the memory (store/mapping.py), which a tensor the caller still holds
        may read after the pack is freed, must never point at memory the driver let go of."""
        with self._pin_lock:
            assert self._unlock is not None and self._mmap is not None, "only a pinned pack of its own"
            self._unlock.detach()
            self._unlock = None  # unpin() and free() leave the page-locking alone from now on
            unlock_when_gone(holder, self._mmap, self._buffer.data_ptr())

    def unpin(self) -> None:
        """Page-unlock this pack's own memory (no copy may be reading it); no-op if not pinned by it. Its
        reader, if it is still being read, no longer pins it."""
        with self._pin_lock:
            self.reader_pins = False
            if self._unlock is not None:
                self._unlock()
                self._unlock = None
                self.pinned = False

    @property
    def owner(self) -> PackOwner | None:
        """What holds this pack's memory when the pack does not own it (a shared segment), else None."""
        return self._owner

    @property
    def offset_in_owner(self) -> int:
        """Where this pack's bytes start in its owner's memory (0 for a pack owning its memory)."""
        return self._owner_offset

    @property
    def shared(self) -> bool:
        """Whether the buffer is a range of a segment other processes may map too."""
        return self._owner is not None

    @property
    def held_bytes(self) -> int:
        """Host bytes held for this unit (for a shared pack: its page-rounded range of the segment)."""
        return self._held if (self._mmap is not None or self._owner is not None) else 0

    def view(self, entry: PackedParameter) -> torch.Tensor:
        return entry.view(self.buffer)

    def standalone_view(self, entry: PackedParameter) -> torch.Tensor:
        """``entry``'s weights as a tensor with a storage of its own, without a copy: what state_dict()
        hands out (torch.save and safetensors refuse one storage viewed as several dtypes). For a pack
        shared between processes the view is copy-on-write: writing to it changes this process's tensor
        only, never the weights other processes read."""
        if entry.numel == 0:
            return torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
        self.wait_read()
        if self._owner is not None:
            flat = self._owner.standalone(self._owner_offset + entry.offset, entry.numel, entry.dtype)
        else:
            assert self._mmap is not None, f"the pack of unit {self.unit!r} was freed"
            flat = torch.frombuffer(self._mmap, dtype=entry.dtype, count=entry.numel, offset=entry.offset)
        return entry.shaped(flat)

    def free(self) -> None:
        """Unpin and let go of the buffer.

        The mapping itself is unmapped when the last tensor viewing it dies (each holds a reference to the
        mmap object): a caller may still hold a state_dict() that views it, and must not be left dangling.
        """
        if self._reading is not None:  # a read still writing into the memory: stop it, or let it end
            self._reading.cancel()
            wait([self._reading])
            self._reading = None
        if self._owner is not None:
            owner, self._owner = self._owner, None
            self.pinned = False
            del self._buffer
            owner.pack_freed()
            return
        if self._mmap is None:
            return
        if self._unlock is not None:
            self._unlock()
            self._unlock = None
        self.pinned = False
        del self._buffer
        self._mmap = None

    def __repr__(self) -> str:
        return (
            f"UnitPack({self.unit!r}, {len(self.entries)} parameters, {self.nbytes} bytes, "
            f"pinned={self.pinned}{', shared' if self.shared else ''})"
        )


class HasPack(Protocol):
    """What host code reads of an offload unit (``Unit`` in store/units.py, a layer above): its name, its
    pack's layout, and the host pack it holds now."""

    @property
    def name(self) -> str: ...

    @property
    def entries(self) -> tuple[PackedParameter, ...]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def pack(self) -> UnitPack | None: ...


def check_not_meta(named: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """Raise if a parameter to be packed has no data (built under ``torch.device("meta")``)."""
    for name, param in named:
        if param.device.type == "meta":
            raise UnsupportedModelError(
                f"parameter {name!r} is on the meta device and holds no data; load the weights "
                "(e.g. load_state_dict(..., assign=True)) before offload()"
            )


def fill_pack(pack: UnitPack, named: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """Copy ``named`` parameters into ``pack`` and point each at its place there.

    On failure the parameters already moved get storage of their own back, with their values.
    """
    try:
        for entry, (_, param) in zip(pack.entries, named, strict=True):
            host = pack.view(entry)
            host.copy_(param.data)
            param.data = host
    except BaseException:
        unpack(pack, named)
        raise


def unpack(pack: UnitPack, named: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """Give every parameter of ``named`` that views ``pack`` a private copy of its values."""
    base = pack.buffer.untyped_storage().data_ptr()
    for entry, (_, param) in zip(pack.entries, named, strict=False):
        if param.data.untyped_storage().data_ptr() == base:
            param.data = pack.view(entry).clone()


def pack_unit(unit: str, named: Sequence[tuple[str, torch.nn.Parameter]], pin: bool) -> UnitPack:
    """Copy ``named`` parameters into a new pack and point each at its place there.

    Each parameter's original storage is released as soon as it is copied (``param.data`` becomes the
    packed host view), which keeps the peak host memory of packing at one model plus one unit.
    """
    check_not_meta(named)
    entries, nbytes = pack_layout([(n, p.data) for n, p in named])
    pack = UnitPack(unit, entries, nbytes, pin)
    try:
        fill_pack(pack, named)
    except BaseException:
        pack.free()
        raise
    return pack
