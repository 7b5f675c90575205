"""Pinned host buffers that hold the offloaded weights, one exact-size buffer per offload unit.

[Note: exact-size pinned buffers]
``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
request up to a power of two: a 0.73 GB unit would hold 1 GiB of locked RAM. Instead each unit's
parameters are packed into one anonymous mmap of exactly their bytes (rounded to a page), which is then
page-locked with ``cudaHostRegister``, so host RAM held is within a page per unit of the weights' bytes.
Packing goes unit by unit and drops the parameter's original storage as soon as it is copied, so
``offload()`` never holds two full copies of the model.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import FlexTensorError
from .layout import align_up

logger = logging.getLogger("flextensor")

PARAMETER_ALIGNMENT = 512
"""Byte alignment of each parameter inside a unit's pack (and so inside the device arena): what vectorised
kernels and cuBLAS want from a tensor's base pointer; 512 is what the CUDA caching allocator
gives every tensor, so kernel selection sees the same alignment as for a resident model."""

PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class PackedParameter:
    """Where one parameter sits inside its unit's pack."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This parameter as a tensor over ``buffer`` (a unit-sized uint8 tensor, host or device)."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def pack_layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[tuple[PackedParameter, ...], int]:
    """Offsets of ``named`` tensors packed back to back at PARAMETER_ALIGNMENT; returns (entries, bytes)."""
    entries = []
    offset = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(PackedParameter(name, offset, nbytes, tuple(tensor.shape), tensor.dtype))
        offset = align_up(offset + nbytes, PARAMETER_ALIGNMENT)
    return tuple(entries), offset


class UnitPack:
    """One unit's parameters in one host buffer (pinned when the device is CUDA)."""

    def __init__(self, unit: str, entries: tuple[PackedParameter, ...], nbytes: int, pin: bool) -> None:
        self.unit = unit
        self.entries = entries
        self.nbytes = nbytes
        self.pinned = False
        mapped = align_up(max(nbytes, 1), PAGE)
        self._mmap: mmap.mmap | None = mmap.mmap(-1, mapped)
        if hasattr(mmap, "MADV_HUGEPAGE") and mapped >= 2 * 2**20:
            # Huge pages make the page-locking below several times faster for large units.
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8, count=mapped)[:nbytes]
        if pin:
            self._pin()

    @property
    def held_bytes(self) -> int:
        return 0 if self._mmap is None else len(self._mmap)

    def _pin(self) -> None:
        err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.held_bytes, 0)
        if int(err) != 0:
            raise FlexTensorError(
                f"could not page-lock {self.held_bytes} bytes of host memory for unit {self.unit!r} "
                f"(cudaHostRegister error {int(err)}); raise the memlock limit (ulimit -l) or pass "
                "OffloadConfig(pinned_memory=False)"
            )
        self.pinned = True

    def view(self, entry: PackedParameter) -> torch.Tensor:
        return entry.view(self.buffer)

    def free(self) -> None:
        """Unpin and let go of the buffer.

        The mapping itself is unmapped when the last tensor viewing it dies (each holds a reference to the
        mmap object): a caller may still hold a state_dict() that views it, and must not be left dangling.
        """
        if self._mmap is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        del self.buffer
        self._mmap = None

    def __repr__(self) -> str:
        return (
            f"UnitPack({self.unit!r}, {len(self.entries)} parameters, {self.nbytes} bytes, "
            f"pinned={self.pinned})"
        )


def pack_unit(unit: str, named: Sequence[tuple[str, torch.nn.Parameter]], pin: bool) -> UnitPack:
    """Copy ``named`` parameters into a new pack and point each at its place there.

    Each parameter's original storage is released as soon as it is copied (``param.data`` becomes the
    packed host view), which keeps the peak host memory of packing at one model plus one unit.
    """
    for name, param in named:
        if param.device.type == "meta":
            raise FlexTensorError(
                f"parameter {name!r} is on the meta device and holds no data; load the weights "
                "(e.g. load_state_dict(..., assign=True)) before offload()"
            )
    entries, nbytes = pack_layout([(n, p.data) for n, p in named])
    pack = UnitPack(unit, entries, nbytes, pin)
    try:
        for entry, (_, param) in zip(entries, named, strict=True):
            host = pack.view(entry)
            host.copy_(param.data)
            param.data = host
    except BaseException:
        # Parameters already moved keep their values through the views; give them storage of their own.
        for entry, (_, param) in zip(entries, named, strict=False):
            if param.data.untyped_storage().data_ptr() == pack.buffer.untyped_storage().data_ptr():
                param.data = pack.view(entry).clone()
        pack.free()
        raise
    return pack
