"""Packs held losslessly compressed (``OffloadConfig(compression="lossless")``), and their loads.

[Note: coded packs]
At offload(), once the link's speed and the device's decode speed are probed, every unit whose coded load
beats its raw copy (see [Note: coded loads] in measurements.py) gets its pack encoded (codec/) and the raw
pack freed: host memory then holds the compressed bytes, pinned like any pack. The pack's bytes are
encoded as the unit's 16-bit dtype (bfloat16 or float16, whichever holds most of them): every bit
pattern round-trips, so parameters of other dtypes and the alignment padding pass through intact, just
less compressed. They are encoded in pieces of ``CODED_PIECE_BYTES`` (64 MiB of weights), each its own
``[stream | chunk offsets (int64) | chunk widths]`` (:class:`CodedPiece`): one copy moves everything a
piece's decode reads, and the staging slots hold a piece, not a unit.

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
the staging slots. Not supported with coded packs (refused where set): shared host memory,
``flextensor.editing``, vLLM's CUDA graphs. From a checkpoint (``offload(weights=)``), each pack is
encoded once its read is done. A CUDA-graph capture records the loads like any copy
(:meth:`CodedLoads.begin_capture`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .codec import EncodedTensor, decode, encode
from .codec.format import CODED_DTYPES
from .device import DeviceRuntime
from .host_store import PackedParameter, UnitPack
from .measurements import CODED_PIECE_BYTES, LinkModel, coded_load_seconds
from .simulator import CODED_STAGING_SLOTS
from .sizes import align_up
from .units import Placement

if TYPE_CHECKING:
    from .slots import DeviceStore
    from .units import Unit

logger = logging.getLogger("flextensor")

__all__ = [
    "CodedLoads",
    "CodedPack",
    "CodedPiece",
    "coded_dtype",
    "coded_load_pays",
    "coded_sizes",
    "compress_packs",
    "hold_uncompressed",
    "probe_decode",
]

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
        self.pieces = tuple(layout)
        self.coded_nbytes = start
        self.staging_nbytes = max(piece.nbytes for piece in layout)
        self.nbytes = nbytes
        self.dtype, self.chunk_elements = pieces[0].dtype, pieces[0].chunk_elements
        coded = self._buffer
        for piece, encoded in zip(layout, pieces, strict=True):
            at = coded[piece.start : piece.start + piece.nbytes]
            at[: piece.stream_nbytes].copy_(encoded.data)
            at[piece.offsets_at : piece.widths_at].copy_(encoded.chunk_offsets.view(torch.uint8))
            at[piece.widths_at :].copy_(encoded.chunk_widths)
        self.loads: CodedLoads | None = None  # the store's, set at each layout (see DeviceStore)

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

    # -- everything else reads decoded bytes ---------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        """The unit's raw bytes, decoded on the host into a new tensor (a one-off: an upload, a release)."""
        raw = torch.empty(self.nbytes, dtype=torch.uint8)
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
    def of(cls, unit: Unit, slots: Sequence[torch.Tensor]) -> PreparedLoad:
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

    def serves(self, unit: Unit) -> bool:
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

    def load(self, unit: Unit, copy_stream: Any) -> None:
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
                else:  # a pageable pack under the host budget (see [Note: staging ring] in staging.py)
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

    def wait_decoded(self, stream: Any, unit: Unit) -> None:
        """Order what ``stream`` issues next after the decode of ``unit``'s latest load (and every decode
        before it: the decode stream runs them in order)."""
        self._wait(stream, unit.copy_done)

    def fence(self, stream: Any) -> None:
        """Order what ``stream`` issues next after every decode issued so far (in the capture under way,
        if one is: a captured stream may not wait on an event recorded outside it)."""
        self._wait(stream, self.last_decode)

    # -- CUDA graphs (see [Note: captured forwards] in cuda_graphs.py) ------------------------------------

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


def coded_load_pays(raw_nbytes: int, coded_nbytes: int, link: LinkModel, decode_bps: float) -> bool:
    """Whether a coded load of a unit beats its raw copy (see [Note: coded loads] in measurements.py)."""
    return coded_load_seconds(raw_nbytes, coded_nbytes, link, decode_bps) < link.copy_s(raw_nbytes)


_PROBE_S = 0.02  # the decodes timed together: long enough that the host clock and a sync add little


def probe_decode(runtime: DeviceRuntime, pack: CodedPack, destination: torch.Tensor) -> float:
    """The device's decode speed, bytes of weights written per second: ``pack`` decoded piece by piece
    into ``destination`` (the arena) from a device copy of its bytes. One decode first (a GPU compiles
    its kernel then), then as many back to back as fill about 20 ms, timed together: one decode of a few
    MB timed alone would measure the launch and the sync, not the decoder."""
    on_device = pack.copy_source.to(runtime.device)
    out = destination[: pack.nbytes]

    def seconds_per_decode(repeats: int) -> float:
        runtime.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            pack.decode_into(on_device, out)
        runtime.synchronize()
        return max(time.perf_counter() - start, 1e-9) / repeats

    seconds_per_decode(1)
    repeats = max(1, min(50, round(_PROBE_S / seconds_per_decode(1))))
    return pack.nbytes / seconds_per_decode(repeats)


def coded_sizes(units: Sequence[Unit]) -> dict[str, tuple[int, int]]:
    """Unit name -> (bytes its coded load copies, its largest piece), for the units held compressed."""
    return {
        u.name: (u.pack.coded_nbytes, u.pack.staging_nbytes)  # type: ignore[attr-defined]
        for u in units
        if u.pack is not None and u.pack.coded
    }


def compress_packs(store: DeviceStore, link: LinkModel, arena: torch.Tensor) -> float | None:
    """At offload(), with ``compression="lossless"``: encode the packs whose coded loads beat their raw
    copies on this link (see [Note: coded packs]) and return the decode speed measured, or None when
    no unit's load gets faster (a CPU device: its decoder is slower than a memcpy)."""
    runtime = store.runtime
    candidates = [
        u
        for u in store.units
        if u.pack is not None
        and type(u.pack) is UnitPack
        and not u.pack.shared
        and coded_dtype(u.entries) is not None
        and u.nbytes % 2 == 0
        and u.nbytes > 0
    ]
    if not candidates:
        return None
    encode_on = runtime.device if runtime.is_cuda else None
    largest = max(candidates, key=lambda u: u.nbytes)
    assert largest.pack is not None
    probe = CodedPack.encode(largest.name, largest.entries, largest.pack.buffer, encode_on)
    decode_bps = probe_decode(runtime, probe, arena)
    store.forget_contents()  # the probe wrote over the arena
    if not coded_load_pays(largest.nbytes, probe.coded_nbytes, link, decode_bps):
        probe.free()
        logger.info(
            "compression='lossless': decoding at %.1f GB/s loads no unit faster than the link's %.1f GB/s "
            "copies; every unit is copied as it is",
            decode_bps / 1e9,
            link.bytes_per_s(largest.nbytes) / 1e9,
        )
        return None
    coded = 0
    for unit in candidates:
        assert unit.pack is not None
        pack = (
            probe
            if unit is largest
            else CodedPack.encode(unit.name, unit.entries, unit.pack.buffer, encode_on)
        )
        if coded_load_pays(unit.nbytes, pack.coded_nbytes, link, decode_bps):
            swap_in(store, unit, pack)
            coded += 1
        else:
            pack.free()
    chosen = {u.name for u in candidates if u.pack is not None and u.pack.coded}
    store.recode = lambda unit: recode(unit, encode_on) if unit.name in chosen else None
    store.allocate_coded_loads([u for u in store.units if u.placement is Placement.STREAMED])
    logger.info(
        "compression='lossless': %d of %d unit(s) held compressed (%.3f of their size), decoded at %.1f GB/s",
        coded,
        len(store.units),
        sum(u.pack.coded_nbytes for u in store.units if u.pack is not None and u.pack.coded)  # type: ignore[attr-defined]
        / max(1, sum(u.nbytes for u in store.units if u.pack is not None and u.pack.coded)),
        decode_bps / 1e9,
    )
    return decode_bps


def swap_in(store: DeviceStore, unit: Unit, pack: CodedPack) -> None:
    """Hold ``unit``'s weights in ``pack`` from now on, freeing its raw pack (nothing views it: the
    parameters view the device), pinned as the host budget allows."""
    old, unit.pack = unit.pack, pack
    unit.staging = None
    if old is not None:
        old.free()
    store.host.admit(unit, store.units)


def hold_uncompressed(store: DeviceStore) -> None:
    """Give every compressed pack its raw bytes back, for plans that copy them as they are (see [Note:
    compression yields to the budget] in plan_policy.py). Plan time only: waits for the device, whose
    copies may still read the packs. Decodes through the device when there is one, a piece at a time (its
    bytes and output there for a moment: call it with the layout given back), on the host otherwise.
    Unit by unit, so host memory holds one unit's two forms at most: a failure (out of memory) leaves the
    units before it raw and the others compressed, a state the next layout serves as it is."""
    runtime = store.runtime
    runtime.synchronize()
    for unit in store.units:
        pack = unit.pack
        if not isinstance(pack, CodedPack):
            continue
        raw = UnitPack(unit.name, unit.entries, pack.nbytes, False)  # the host budget pins it
        try:
            if runtime.is_cuda:
                _decode_on_device(pack, raw.buffer, runtime.device)
            else:
                pack.decode_into(pack.copy_source, raw.buffer)
        except BaseException:
            raw.free()
            raise
        unit.pack, unit.staging = raw, None
        pack.free()
        store.host.admit(unit, store.units)
    store.drop_coded_loads()  # their staging slots serve no pack now
    logger.info("compressed packs held uncompressed again: every unit is copied as it is")


def _decode_on_device(pack: CodedPack, out: torch.Tensor, device: torch.device) -> None:
    """Decode ``pack`` into ``out`` (host memory) through ``device``, one piece at a time."""
    source = pack.copy_source
    for piece in pack.pieces:
        data = source[piece.start : piece.start + piece.nbytes].to(device)
        decoded = torch.empty(piece.raw_nbytes, dtype=torch.uint8, device=device)
        decode(piece.encoded(data, pack.dtype, pack.chunk_elements), out=decoded.view(pack.dtype))
        out[piece.raw_start : piece.raw_start + piece.raw_nbytes].copy_(decoded)  # waits for the decode


def recode(unit: Unit, encode_on: torch.device | None) -> None:
    """A pack built again from device storage (see DeviceStore._refresh_pack) of a unit that was held
    compressed is compressed again (encoded on the device when there is one: a layout's brief peak)."""
    raw = unit.pack
    if raw is None or raw.coded:
        return
    unit.pack = CodedPack.encode(unit.name, unit.entries, raw.buffer, encode_on)
    raw.free()
