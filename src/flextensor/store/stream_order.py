"""A pipeline component's switch ordered by streams, without waiting for the device.

[Note: a switch in stream order]
At each switch between a pipeline's components (see [Note: one budget for a pipeline] in
pipelines/pipeline.py), the component that ran gives its device bytes back and the next one lays its plan out.
Both used to synchronise the device first, so the GPU, which otherwise runs a whole forward behind the host,
idled while the host freed one component and laid the next out in Python (some 1,200 parameter rebinds for a
40-block transformer): 0.27 s a Wan2.2 generation on an H100 (2026-12-05), four switches. Here the same
two steps are ordered on the device instead:

- Giving back (``let_go_in_stream_order``): the compute stream waits for the component's copy stream, so
  copies still queued into its arena (the next forward's first units, prefetched at the end of this one)
  complete before anything the compute stream runs later. Freed memory goes back to the caching
  allocator's pool of the stream it was allocated on. Taken with the compute stream current (a layout
  at a step), it is handed again only to work queued after everything the freed component queued there.
  Taken with a copy stream current (a layout ahead, see [Note: the next component ahead] in
  pipelines/pipeline.py), ``record_stream`` keeps it from that copy stream until the compute stream passes
  this point.
- Laying out (``DeviceStore._lay_out``): from a store that holds nothing, memory is taken with the compute
  stream current (so it may be memory the previous component's queued kernels still read); the copy
  stream waits for the compute stream before it writes any of it; each resident unit's storage is taken
  the same way (taken on the copy stream, it could go back only to that stream's pool, and PyTorch's
  reserved memory grew to 19.7 GB under an 8 GiB budget: H100, 2026-12-06) and uploaded on the copy
  stream without blocking the host; the compute stream waits for those uploads before the forward.

The GPU then runs the previous component's last kernels, the uploads and the next component's first
kernels back to back while the host is already queuing further ahead. A pipeline makes the switch where
the finishing component's run ends when it can be ordered so (see [Note: the switch at a run's end] in
pipelines/pipeline.py), before the pipeline's own code waits for the device.

Only where nothing else needs the device idle: packs kept (a pipeline component's), all pinned or
pageable in full (no host budget, no staging ring, no checkpoint reads, no compressed packs), resident
units unedited since their upload (an edit is copied to the host pack first), every forward since the
layout (and every unit called outside one) run on the stream current at the switch
(``note_forward_stream``), and no CUDA graph capture under way. Otherwise both steps synchronise, as
before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flextensor.store.device_store import DeviceStore

__all__ = [
    "copy_after_compute",
    "in_stream_order",
    "lays_out_in_stream_order",
    "let_go_in_stream_order",
    "note_forward_stream",
    "wait_for_uploads",
]


def in_stream_order(store: DeviceStore, giving_back_residents: bool) -> bool:
    """Whether ``store`` may give back or lay out without synchronising the device (see the note).
    ``giving_back_residents``: a vacate that frees resident storage too, whose packs must be current."""
    if store.compute_stream is None or store.runtime.current_stream() != store.compute_stream:
        return False  # forwards on another stream: ordering on this one would not cover their reads
    return _packs_in_stream_order(store, giving_back_residents)


def lays_out_in_stream_order(store: DeviceStore) -> bool:
    """Whether a layout of ``store`` made now, on the current stream, would be ordered by streams rather
    than synchronise: it holds no device bytes, and its packs allow it (the layout makes the current
    stream its compute stream)."""
    return not store.device_bytes_held() and _packs_in_stream_order(store, False)


def _packs_in_stream_order(store: DeviceStore, giving_back_residents: bool) -> bool:
    if not store.keep_packs or store.coded_loads is not None or store.host.capacity is not None:
        return False
    if store.runtime.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # a capture would only record the copies: synchronising refuses it, as before
    for unit in store.units:
        pack = unit.pack
        if pack is None or pack.coded or pack.disk or unit.staging is not None:
            return False
        if (
            giving_back_residents
            and unit.resident
            and unit.mapped is None
            and unit.weights_version() != unit.storage_version
        ):
            return False  # edited in place: its pack is refreshed from the device, which must be idle
    return True


def let_go_in_stream_order(store: DeviceStore, keep_resident: bool) -> None:
    """Order the memory ``store`` is about to free (with ``keep_resident``, the streamed side only) after
    every use already queued (see the note): the compute stream waits for the copy stream, and memory
    taken on another stream is marked as used by the compute stream."""
    runtime = store.runtime
    compute = runtime.current_stream()
    compute.wait_stream(runtime.copy_stream)
    if not runtime.is_cuda:
        return
    # A mapped unit's storage is its host pack, which stays: nothing of it goes back to the allocator.
    residents = () if keep_resident else (u.storage for u in store.units if u.resident and u.mapped is None)
    freed = [store.arena, store.reserved, *residents]
    for tensor in freed:
        if tensor is not None:
            tensor.record_stream(compute)  # a no-op for memory taken on the compute stream itself


def wait_for_uploads(store: DeviceStore) -> None:
    """The compute stream waits for what the copy stream has queued (the resident uploads)."""
    store.runtime.current_stream().wait_stream(store.runtime.copy_stream)


def copy_after_compute(store: DeviceStore) -> None:
    """The copy stream waits for what the compute stream has queued: memory just taken may be what it
    still reads."""
    store.runtime.copy_stream.wait_stream(store.runtime.current_stream())


def note_forward_stream(store: DeviceStore) -> None:
    """A forward begins: if it runs on another stream than the layout's forwards so far, the next switch
    synchronises (ordering on one stream would not cover reads queued on the other)."""
    if store.compute_stream is not None and store.runtime.current_stream() != store.compute_stream:
        store.compute_stream = None
