"""Which packs are held compressed, and changing that (see [Note: coded packs] in host/coded_packs.py).

At offload() (:func:`compress_packs`): the device's decode speed is probed on the largest unit, and every
unit whose coded load beats its raw copy on the link gets a :class:`~flextensor.host.coded_packs.CodedPack`
(:func:`swap_in`). A pack built again from device storage is encoded again (:func:`recode`). A plan with
no room for the staging slots gives every pack its raw bytes back (:func:`hold_uncompressed`; see [Note:
compression yields to the budget] in engine/policy.py). The planner reads the sizes through
:func:`coded_sizes`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import torch

from flextensor.common.sizes import format_bytes
from flextensor.device.runtime import DeviceRuntime
from flextensor.host.coded_packs import CodedPack, coded_dtype
from flextensor.host.packs import UnitPack
from flextensor.plan.measurements import LinkModel, coded_load_seconds
from flextensor.store.units import Placement

if TYPE_CHECKING:
    from flextensor.store.device_store import DeviceStore
    from flextensor.store.units import Unit

logger = logging.getLogger("flextensor")

__all__ = [
    "coded_load_pays",
    "coded_sizes",
    "compress_packs",
    "hold_uncompressed",
    "probe_decode",
    "recode",
    "swap_in",
]


def coded_load_pays(raw_nbytes: int, coded_nbytes: int, link: LinkModel, decode_bps: float) -> bool:
    """Whether a coded load of a unit beats its raw copy (see [Note: coded loads] in plan/measurements.py)."""
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


def compress_packs(
    store: DeviceStore, link: LinkModel, arena: torch.Tensor, only: Collection[str] | None = None
) -> float | None:
    """At offload(), with ``compression="lossless"``: encode the packs whose coded loads beat their raw
    copies on this link (see [Note: coded packs]) and return the decode speed measured, or None when
    no unit's load gets faster (a CPU device: its decoder is slower than a memcpy). ``only``: the units
    to consider (a saved plan's coded ones: the others are resident or copied as they are)."""
    runtime = store.runtime
    candidates = [
        u
        for u in store.units
        if (only is None or u.name in only)
        and u.pack is not None
        and type(u.pack) is UnitPack
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

    def pays(unit: Unit, pack: CodedPack) -> bool:
        return coded_load_pays(unit.nbytes, pack.coded_nbytes, link, decode_bps)

    considered = {id(u) for u in candidates}

    def coded_if_pays(unit: Unit) -> CodedPack | None:
        if id(unit) not in considered:
            return None
        assert unit.pack is not None
        pack = (
            probe
            if unit is largest
            else CodedPack.encode(unit.name, unit.entries, unit.pack.buffer, encode_on)
        )
        if pays(unit, pack):
            return pack
        pack.free()
        return None

    shared = [u for u in store.units if u.pack is not None and u.pack.shared]
    if shared:
        coded = _hold_shared(store, shared, coded_if_pays, pays, encode_on)
        probe.free()  # a no-op if this process encoded the segment (copied in, then freed)
    else:
        coded = 0
        for unit in candidates:
            pack = coded_if_pays(unit)
            if pack is not None:
                swap_in(store, unit, pack)
                coded += 1
    if not coded:
        return None
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


def _hold_shared(
    store: DeviceStore,
    units: list[Unit],
    coded_if_pays: Callable[[Unit], CodedPack | None],
    pays: Callable[[Unit, CodedPack], bool],
    encode_on: torch.device | None,
) -> int:
    """Units whose packs are shared between processes: their packs move to the node's coded segment
    (see [Note: shared coded packs] in host/shared/coded.py), but for the coded units whose loads do not pay
    on this process's link, which keep their raw packs. Returns how many units are held coded."""
    from flextensor.host.shared.coded import share_coded

    packs = share_coded(units, coded_if_pays, encode_on)
    if packs is None:
        return 0  # waited too long for another process: this one streams its raw packs
    coded, kept = 0, []
    for unit in units:
        pack = packs[unit.name]
        if isinstance(pack, CodedPack) and not pays(unit, pack):
            pack.free()
            kept.append(unit.name)
            continue
        swap_in(store, unit, pack)
        coded += isinstance(pack, CodedPack)
    if kept:
        logger.warning(
            "compression='lossless': %d unit(s) that another process holds compressed load faster raw on "
            "this link; this process keeps their raw packs, and so the node's raw copy of the weights",
            len(kept),
        )
    return coded


def swap_in(store: DeviceStore, unit: Unit, pack: UnitPack) -> None:
    """Hold ``unit``'s weights in ``pack`` from now on, freeing its old pack (nothing views it: the
    parameters view the device), pinned as the host budget allows."""
    old, unit.pack = unit.pack, pack
    unit.staging = None
    if old is not None:
        old.free()
    store.host.admit(unit, store.units)


def hold_uncompressed(store: DeviceStore) -> None:
    """Give every compressed pack its raw bytes back, for plans that copy them as they are (see [Note:
    compression yields to the budget] in engine/policy.py). Plan time only: waits for the device, whose
    copies may still read the packs. Decodes through the device when there is one, a piece at a time (its
    bytes and output there for a moment: call it with the layout given back), on the host otherwise.
    Unit by unit, so host memory holds one unit's two forms at most: a failure (out of memory) leaves the
    units before it raw and the others compressed, a state the next layout serves as it is."""
    runtime = store.runtime
    store.recode = None  # a pack built again from device storage stays raw from now on
    runtime.synchronize()
    _share_uncompressed(store)
    for unit in store.units:
        pack = unit.pack
        if not isinstance(pack, CodedPack):
            continue
        raw = UnitPack(unit.name, unit.entries, pack.nbytes, False)  # the host budget pins it
        try:
            if runtime.is_cuda:
                pack.decode_through(runtime.device, raw.buffer)
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


def _share_uncompressed(store: DeviceStore) -> None:
    """Packs in the node's coded segment (see [Note: shared coded packs] in host/shared/coded.py) move to its
    raw segment, live or packed again from the coded one, so that the weights stay shared; when that
    cannot be (the live one holds other bytes, or another process takes too long packing it), the
    caller decodes them into packs of this process's own, with a warning."""
    in_coded = [
        u for u in store.units if u.pack is not None and getattr(u.pack.owner, "index", None) is not None
    ]
    if not in_coded:
        return
    from flextensor.host.shared.unpack import raw_again

    runtime = store.runtime
    packs = raw_again(in_coded, store.units, runtime.device if runtime.is_cuda else None)
    if packs is None:
        logger.warning(
            "the %s of compressed weights shared with other processes are held uncompressed again in this "
            "process's own host memory (the node's raw copy could not be used); give it the budget for the "
            "staging slots to keep sharing them",
            format_bytes(sum(u.nbytes for u in in_coded if isinstance(u.pack, CodedPack))),
        )
        return
    for unit in in_coded:
        swap_in(store, unit, packs[unit.name])


def recode(unit: Unit, encode_on: torch.device | None) -> None:
    """A pack built again from device storage (see DeviceStore._refresh_pack) of a unit that was held
    compressed is compressed again (encoded on the device when there is one: a layout's brief peak)."""
    raw = unit.pack
    if raw is None or raw.coded:
        return
    unit.pack = CodedPack.encode(unit.name, unit.entries, raw.buffer, encode_on)
    raw.free()
