"""Packs held losslessly compressed (``OffloadConfig(compression="lossless")``), and their loads.

[Note: coded packs]
At offload(), once the link's speed and the device's decode speed are probed (store/coded_loads.py decides
which packs are held compressed, and undoes it), every unit whose coded load beats its raw copy (see
[Note: coded loads] in plan/measurements.py) gets its pack encoded (codec/) and the raw pack freed: host
memory then holds the compressed bytes, pinned like any pack. The pack's bytes are encoded as the unit's
16-bit dtype (bfloat16 or float16, whichever holds most of them): every bit pattern round-trips, so parameters
of other dtypes and the alignment padding pass through intact, just less compressed. They are encoded in
pieces of ``CODED_PIECE_BYTES`` (64 MiB of weights), each its own ``[stream | chunk offsets (int64) |
chunk widths]`` (:class:`CodedPiece`): one copy moves everything a piece's decode reads, and the staging
slots hold a piece, not a unit.

A load (:class:`CodedLoads`) copies each piece into one of two device staging slots on the copy stream,
then decodes it from there into its part of the unit's arena range on a decode stream of its own; after
the last piece that stream records the event the unit's pre-hook waits on. The next piece's copy runs
while this one decodes; a slot is copied into again only after the decode that read it (an event per
slot). A decode writes the range after everything the copy stream was ordered after (it waits for the
copy's event), so it never overtakes a reader of the range. Any load into a range a compressed unit was
decoded into first waits for that unit's decode (``wait_decoded``): in the planned order the wait is
already met (the ring orders each load after the compute of the units whose range it takes, which waited
for their decodes), but a unit loaded and never run (control flow) would otherwise race its own decode. A
load out of the learned order waits for those decodes too (and, from ``DeviceStore.load_on_demand``, for
every decode). Waiting for every decode on each load would idle the link while the unit before decodes
(found on the H200: each 306 MB copy then took 6.4 ms instead of 5.6). On a CPU device the same happens
with the reference decoder and the host's stand-in streams, so the CPU tests run it.

Everything else that reads a pack gets decoded bytes, a copy of its own each time (``buffer``, ``view``,
``standalone_view``): uploads to resident storage, ``state_dict()``, ``release()``. A pack built again
from device storage (a resident unit that streams again) is encoded again. Under a host budget a coded
pack it cannot pin stays pageable and its pieces go through the staging ring (``Unit.staging``) into
the staging slots. With ``share_host_memory`` the coded packs are ranges of a segment shared between
processes (see [Note: shared coded packs] in host/shared/coded.py). Not supported with coded packs (refused
where set): ``flextensor.editing``. From a checkpoint (``offload(weights=)``), each pack is encoded once
its read is done. A CUDA-graph capture (``torch.cuda.graph``, reduce-overhead, vLLM's decode graphs)
records the loads like any copy (:meth:`CodedLoads.begin_capture`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flextensor.codec import EncodedTensor, decode, encode
from flextensor.codec.format import CODED_DTYPES
from flextensor.common.sizes import align_up
from flextensor.device.runtime import DeviceRuntime
from flextensor.errors import CodecError
from flextensor.host.packs import HasPack, PackedParameter, PackOwner, UnitPack
from flextensor.plan.measurements import CODED_PIECE_BYTES
from flextensor.plan.simulator import CODED_STAGING_SLOTS

logger = logging.getLogger("flextensor")

__all__ = ["CodedLoads", "CodedPack", "CodedPiece", "coded_dtype"]

_INDEX_ALIGNMENT = 8  # the chunk offsets are int64


def coded_dtype(entries: Sequence[PackedParameter]) -> torch.dtype | None:
    """The 16-bit dtype a pack of ``entries`` is coded as: the one holding most of its bytes; None when
    neither bfloat16 nor float16 holds half of them (the pack would barely shrink)."""
    by_dtype = {dtype: sum(e.nbytes for e in entries if e.dtype == dtype) for dtype in CODED_DTYPES}
    dtype, held = max(by_dtype.items(), key=lambda item: item[1])
    total = sum(e.nbytes for e in entries)
    return dtype if total and 2 * held >= total else None


@dataclass(frozen=True)
class CodedPiece:
    """Bytes ``[raw_start, raw_start + raw_nbytes)`` of a unit's packed weights, compressed in bytes
    ``[start, start + nbytes)`` of its coded pack as ``[stream | chunk offsets (int64) | chunk widths]``
    (``offsets_at``, ``widths_at``: from ``start``)."""

    raw_start: int
    raw_nbytes: int
    start: int
    nbytes: int
    stream_nbytes: int
    offsets_at: int
    widths_at: int
    chunks: int

    def encoded(self, data: torch.Tensor, dtype: torch.dtype, chunk_elements: int) -> EncodedTensor:
        """The piece's encoding over ``data``: its ``nbytes`` (in the pack, or copied to a staging slot)."""
        return EncodedTensor(
            dtype=dtype,
            shape=(self.raw_nbytes // dtype.itemsize,),
            chunk_elements=chunk_elements,
            data=data[: self.stream_nbytes],
            chunk_offsets=data[self.offsets_at : self.widths_at].view(torch.int64),
            chunk_widths=data[self.widths_at : self.widths_at + self.chunks],
        )


class CodedPack(UnitPack):
    """A unit's pack holding its bytes losslessly compressed, in pieces (see [Note: coded packs]).
    ``nbytes`` is the unit's raw size, as for any pack; ``coded_nbytes`` what a load copies;
    ``staging_nbytes`` its largest piece, what a staging slot holds."""

    coded = True

    def __init__(
        self, unit: str, entries: tuple[PackedParameter, ...], nbytes: int, pieces: Sequence[EncodedTensor]
    ) -> None:
        layout, start, raw_start = [], 0, 0
        for encoded in pieces:
            stream = encoded.data.numel()
            offsets_at = align_up(stream, _INDEX_ALIGNMENT)
            widths_at = offsets_at + encoded.chunk_offsets.nbytes
            size = widths_at + encoded.num_chunks
            layout.append(
                CodedPiece(
                    raw_start,
                    encoded.raw_nbytes,
                    start,
                    size,
                    stream,
                    offsets_at,
                    widths_at,
                    encoded.num_chunks,
                )
            )
            start, raw_start = align_up(start + size, _INDEX_ALIGNMENT), raw_start + encoded.raw_nbytes
        assert raw_start == nbytes and pieces
        super().__init__(unit, entries, start, pin=False)  # the host budget pins it, like any pack
        self._describe(tuple(layout), nbytes, pieces[0].dtype, pieces[0].chunk_elements)
        coded = self._buffer
        for piece, encoded in zip(layout, pieces, strict=True):
            at = coded[piece.start : piece.start + piece.nbytes]
            at[: piece.stream_nbytes].copy_(encoded.data)
            at[piece.offsets_at : piece.widths_at].copy_(encoded.chunk_offsets.view(torch.uint8))
            at[piece.widths_at :].copy_(encoded.chunk_widths)

    def _describe(
        self, pieces: tuple[CodedPiece, ...], nbytes: int, dtype: torch.dtype, chunk_elements: int
    ) -> None:
        self.pieces = pieces
        self.coded_nbytes = align_up(pieces[-1].start + pieces[-1].nbytes, _INDEX_ALIGNMENT)
        self.staging_nbytes = max(piece.nbytes for piece in pieces)
        self.nbytes = nbytes
        self.dtype, self.chunk_elements = dtype, chunk_elements
        self.loads: CodedLoads | None = None  # the store's, set at each layout (see DeviceStore)

    def record(self) -> dict[str, Any]:
        """How to read this pack's bytes again (:meth:`over_coded`), as JSON values."""
        return {
            "nbytes": self.nbytes,
            "dtype": str(self.dtype).removeprefix("torch."),
            "chunk_elements": self.chunk_elements,
            "pieces": [dataclasses.astuple(piece) for piece in self.pieces],
        }

    @classmethod
    def over_coded(
        cls,
        unit: str,
        entries: tuple[PackedParameter, ...],
        record: dict[str, Any],
        buffer: torch.Tensor,
        owner: PackOwner,
    ) -> CodedPack:
        """A coded pack viewing ``buffer``, bytes that ``owner`` holds (a segment shared between
        processes, see host/shared/coded.py), laid out as ``record`` (from :meth:`record`) says."""
        dtype = getattr(torch, record["dtype"])
        if dtype not in CODED_DTYPES:
            raise CodecError(f"unit {unit!r}: {record['dtype']} is not a coded dtype")
        pack = cls.over(unit, entries, buffer, owner)
        pieces = tuple(CodedPiece(*piece) for piece in record["pieces"])
        pack._describe(pieces, record["nbytes"], dtype, record["chunk_elements"])
        if pack.coded_nbytes > buffer.numel() or pack.nbytes != sum(p.raw_nbytes for p in pieces):
            pack.free()
            raise CodecError(f"unit {unit!r}: its coded layout does not fit the {buffer.numel()} bytes given")
        return pack

    @classmethod
    def encode(
        cls,
        unit: str,
        entries: tuple[PackedParameter, ...],
        raw: torch.Tensor,
        device: torch.device | None = None,
    ) -> CodedPack:
        """The coded pack of ``raw`` (a unit's packed bytes, uint8; its layout ``entries``), encoded in
        pieces of ``CODED_PIECE_BYTES`` on ``device`` (a CUDA device encodes many times faster)."""
        dtype = coded_dtype(entries)
        assert dtype is not None and raw.numel() % 2 == 0 and raw.numel() > 0
        values, step = raw.view(dtype), CODED_PIECE_BYTES // dtype.itemsize
        pieces = [encode(values[at : at + step], device=device) for at in range(0, values.numel(), step)]
        return cls(unit, entries, raw.numel(), pieces)

    def decode_into(self, data: torch.Tensor, out: torch.Tensor) -> None:
        """Decode ``data`` (this pack's bytes, or a copy of them on a device) into ``out`` (the unit's raw
        bytes, on the same device), piece by piece, on the current stream."""
        for piece in self.pieces:
            encoded = piece.encoded(
                data[piece.start : piece.start + piece.nbytes], self.dtype, self.chunk_elements
            )
            decode(encoded, out=out[piece.raw_start : piece.raw_start + piece.raw_nbytes].view(self.dtype))

    def decode_through(self, device: torch.device, out: torch.Tensor) -> None:
        """Decode into ``out`` (the unit's raw bytes, on ``device`` or on the host) through ``device``,
        a piece at a time on the current stream: each piece's bytes copied there, decoded straight into
        ``out`` when it is on the device, else into a buffer copied back (which waits for the decode)."""
        on_device = out.device.type == device.type
        for piece in self.pieces:
            data = self._buffer[piece.start : piece.start + piece.nbytes].to(device)
            target = out[piece.raw_start : piece.raw_start + piece.raw_nbytes]
            decoded = target if on_device else torch.empty(piece.raw_nbytes, dtype=torch.uint8, device=device)
            decode(piece.encoded(data, self.dtype, self.chunk_elements), out=decoded.view(self.dtype))
            if not on_device:
                target.copy_(decoded)

    # -- everything else reads decoded bytes ---------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        """The unit's raw bytes, decoded on the host into a new tensor (a one-off: an upload, a release)."""
        raw = torch.empty(self.nbytes, dtype=torch.uint8, device="cpu")
        self.decode_into(self._buffer, raw)
        return raw

    @property
    def copy_source(self) -> torch.Tensor:
        return self._buffer

    @property
    def unread_buffer(self) -> torch.Tensor:
        return self.buffer

    def unread_view(self, entry: PackedParameter) -> torch.Tensor:
        return self.view(entry)

    def view(self, entry: PackedParameter) -> torch.Tensor:
        """``entry``'s weights, decoded: a copy, so writing to it never changes the pack."""
        return entry.view(self.buffer)

    def standalone_view(self, entry: PackedParameter) -> torch.Tensor:
        """``entry``'s weights, decoded into a tensor with a storage of its own (memory order kept)."""
        raw = self.buffer
        return entry.shaped(raw[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).clone())

    def fault_in(self) -> None:
        return  # written at construction: its pages are mapped

    def __repr__(self) -> str:
        return (
            f"CodedPack({self.unit!r}, {len(self.entries)} parameters, {self.nbytes} bytes coded in "
            f"{self.coded_nbytes} ({self.coded_nbytes / max(self.nbytes, 1):.3f}) in {len(self.pieces)} "
            f"piece(s), pinned={self.pinned})"
        )


class LoadedUnit(HasPack, Protocol):
    """What a coded load reads of a unit besides its pack: its device range, the staging ring its copies
    go through (None when its pack is pinned) and the event its load records."""

    @property
    def storage(self) -> torch.Tensor | None: ...

    @property
    def staging(self) -> Any: ...

    @property
    def copy_done(self) -> Any: ...


@dataclass(frozen=True)
class PreparedLoad:
    """The views one coded load of a unit works with, made once (not per forward): per piece its bytes in
    the pack, per staging slot (the slot's first bytes, the encoding over them), and its part of the
    unit's range. Valid while the unit keeps its pack, its pack's buffer and its range."""

    pack: CodedPack
    source_ptr: int
    storage_ptr: int
    pieces: tuple[tuple[torch.Tensor, tuple[tuple[torch.Tensor, EncodedTensor], ...], torch.Tensor], ...]

    @classmethod
    def of(cls, unit: LoadedUnit, slots: Sequence[torch.Tensor]) -> PreparedLoad:
        pack, storage = unit.pack, unit.storage
        assert isinstance(pack, CodedPack) and storage is not None
        source = pack.copy_source
        pieces = []
        for piece in pack.pieces:
            staged = tuple(
                (slot[: piece.nbytes], piece.encoded(slot[: piece.nbytes], pack.dtype, pack.chunk_elements))
                for slot in slots
            )
            out = storage[piece.raw_start : piece.raw_start + piece.raw_nbytes].view(pack.dtype)
            pieces.append((source[piece.start : piece.start + piece.nbytes], staged, out))
        return cls(pack, source.data_ptr(), storage.data_ptr(), tuple(pieces))

    def serves(self, unit: LoadedUnit) -> bool:
        pack, storage = unit.pack, unit.storage
        return (
            pack is self.pack
            and storage is not None
            and storage.data_ptr() == self.storage_ptr
            and pack.copy_source.data_ptr() == self.source_ptr
        )


class CodedLoads:
    """The device side of coded loads: two staging slots, the decode stream and their events (see
    [Note: coded packs]). Built by the store at each layout that places a coded unit."""

    SLOTS = CODED_STAGING_SLOTS  # what the planner counts

    def __init__(
        self, runtime: DeviceRuntime, slot_bytes: int, allocate: Callable[[int], torch.Tensor]
    ) -> None:
        self.runtime = runtime
        self.slots = [allocate(slot_bytes) for _ in range(self.SLOTS)]
        self.decode_stream = runtime.decode_stream
        self._fresh_events()
        self.next = 0
        self._prepared: dict[int, PreparedLoad] = {}  # id(unit) -> its pieces' views, made at its first load
        self._in_capture: set[int] | None = None  # ids of the events recorded in the capture under way
        self._retired: list[Any] = []  # events recorded inside captures, kept alive with the graphs

    def _fresh_events(self) -> None:
        self.copied = [self.runtime.event() for _ in range(self.SLOTS)]
        self.freed = [self.runtime.event() for _ in range(self.SLOTS)]  # the decode that last read the slot
        self.last_decode = self.runtime.event()

    @property
    def nbytes(self) -> int:
        return sum(slot.numel() for slot in self.slots)

    def load(self, unit: LoadedUnit, copy_stream: Any) -> None:
        """Copy each piece of ``unit``'s compressed pack into a slot (on ``copy_stream``, the current
        stream) and decode it into its part of the unit's range on the decode stream, which then records
        ``unit.copy_done``."""
        prepared = self._prepared.get(id(unit))
        if prepared is None or not prepared.serves(unit):
            prepared = self._prepared[id(unit)] = PreparedLoad.of(unit, self.slots)
        decode_stream, runtime, ring = self.decode_stream, self.runtime, unit.staging
        try:
            for source, staged, out in prepared.pieces:
                index, self.next = self.next, (self.next + 1) % self.SLOTS
                self._wait(copy_stream, self.freed[index])
                slot, encoded = staged[index]
                if ring is None:
                    slot.copy_(source, non_blocking=True)
                else:  # a pageable pack under the host budget (see [Note: staging ring] in host/staging.py)
                    ring.copy_from_host(slot, source, copy_stream)
                self._record(self.copied[index], copy_stream)
                decode_stream.wait_event(self.copied[index])
                runtime.set_stream(decode_stream)
                try:
                    decode(encoded, out=out)
                    self._record(self.freed[index], decode_stream)
                finally:
                    runtime.set_stream(copy_stream)
        except BaseException:
            # The range's cells stay unowned, so no later load waits for this unit's decode: order the
            # copy stream after the decodes issued so far, or a copy there could be overwritten by one.
            self._record(self.last_decode, decode_stream)
            self.fence(copy_stream)
            raise
        self._record(unit.copy_done, decode_stream)
        self._record(self.last_decode, decode_stream)

    def wait_decoded(self, stream: Any, unit: LoadedUnit) -> None:
        """Order what ``stream`` issues next after the decode of ``unit``'s latest load (and every decode
        before it: the decode stream runs them in order)."""
        self._wait(stream, unit.copy_done)

    def fence(self, stream: Any) -> None:
        """Order what ``stream`` issues next after every decode issued so far (in the capture under way,
        if one is: a captured stream may not wait on an event recorded outside it)."""
        self._wait(stream, self.last_decode)

    # -- CUDA graphs (see [Note: captured forwards] in engine/cuda_graphs.py) --------------------------------

    def begin_capture(self) -> None:
        """A forward is being captured: from now on, wait only on events recorded inside the capture."""
        self._in_capture = set()

    def end_capture(self) -> None:
        """The capture ended: its events were never recorded on the device; eager loads get fresh ones."""
        self._in_capture = None
        self._retired += [*self.copied, *self.freed, self.last_decode]
        self._fresh_events()

    def _record(self, event: Any, stream: Any) -> None:
        event.record(stream)
        if self._in_capture is not None:
            self._in_capture.add(id(event))

    def _wait(self, stream: Any, event: Any) -> None:
        if self._in_capture is None or id(event) in self._in_capture:
            stream.wait_event(event)
