"""The host store: exact-size packs, and offload() never holding two copies of the model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import flextensor
from flextensor.api import engine_of
from flextensor.host.packs import UnitPack, pack_layout
from flextensor.plan.layout import provisional_arena_bytes
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.plan.plan import Plan


def test_pack_layout_is_aligned_and_dense() -> None:
    tensors = [("a", torch.empty(3, dtype=torch.float32)), ("b", torch.empty(1000, dtype=torch.bfloat16))]
    entries, total = pack_layout(tensors)
    assert [e.offset for e in entries] == [0, 512]
    assert entries[1].nbytes == 2000 and total == 512 + 2048  # next 512 boundary after 2512


def test_host_memory_held_is_within_two_percent_of_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(16)))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flextensor.offload(model, flextensor.OffloadConfig(device="cpu"))
    held = flextensor.status(model).host_bytes_held
    assert held == sum(u.host_bytes for u in flextensor.status(model).units)
    assert weight_bytes <= held <= 1.02 * weight_bytes


def test_fault_in_maps_a_fresh_pack_and_leaves_it_zero() -> None:
    """A fresh pack's pages are mapped before it is page-locked or read into (see [Note: fault pages in
    before page-locking]): the process's resident memory grows by the pack's size, its bytes stay zero,
    and the weights viewing it do not look edited."""
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    nbytes = 64 * 2**20
    entries, _ = pack_layout([("w", torch.empty(nbytes // 4))])
    pack = UnitPack("u", entries, nbytes, pin=False)
    weight = pack.unread_view(entries[0])  # what a parameter views while its pack is read
    version = weight._version
    before = process.memory_info().rss
    pack.fault_in()
    grown = process.memory_info().rss - before
    assert grown >= 0.9 * nbytes, f"{grown} of {nbytes} bytes mapped"
    assert int(pack.buffer.count_nonzero()) == 0
    # not an edit: the engine reads a changed version counter as weights changed outside editing()
    assert weight._version == version
    pack.free()


def test_packed_views_share_one_buffer_per_unit() -> None:
    torch.manual_seed(0)
    named = [("w", nn.Parameter(torch.randn(8, 8))), ("b", nn.Parameter(torch.randn(8)))]
    entries, nbytes = pack_layout([(n, p.data) for n, p in named])
    pack = UnitPack("u", entries, nbytes, pin=False)
    ptr = pack.buffer.untyped_storage().data_ptr()
    assert all(pack.view(e).untyped_storage().data_ptr() == ptr for e in pack.entries)
    pack.free()


def test_standalone_views_have_storages_of_their_own_so_mixed_dtypes_save() -> None:
    # A unit mixing bf16 weights and fp32 norms (a Wan block): one storage viewed as two dtypes is what
    # torch.save refuses; each standalone view has its own storage over the same bytes.
    import io

    tensors = [("w", torch.randn(4, 4).to(torch.bfloat16)), ("norm", torch.randn(4))]
    entries, nbytes = pack_layout(tensors)
    pack = UnitPack("u", entries, nbytes, pin=False)
    for entry, (_, tensor) in zip(entries, tensors, strict=True):
        pack.view(entry).copy_(tensor)
    views = {e.name: pack.standalone_view(e) for e in entries}
    assert views["w"].untyped_storage().data_ptr() != views["norm"].untyped_storage().data_ptr()
    buffer = io.BytesIO()
    torch.save(views, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert all(torch.equal(loaded[n], t) for n, t in tensors)
    pack.free()


def test_dropping_resident_packs_gives_their_host_memory_back() -> None:
    psutil = pytest.importorskip("psutil")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(16)))  # 16 x 4 MiB fp32
    x = torch.randn(2, 1024)
    ref = model(x).detach()
    flextensor.offload(model, flextensor.OffloadConfig(device="cpu"))
    status = flextensor.status(model)
    names = [u.name for u in status.units]
    sizes = {u.name: u.nbytes for u in status.units}
    resident, streamed = tuple(names[:12]), tuple(names[12:])
    measurements = Measurements(
        units=tuple(UnitMeasurement(n, sizes[n], 1e-3) for n in names), link=LinkModel.constant(1e9)
    )
    held = flextensor.status(model).host_bytes_held
    before = psutil.Process().memory_info().rss
    # A plan keeping 12 units resident: in every plan made, so their packs are freed.
    arena = provisional_arena_bytes([sizes[u] for u in streamed])
    engine_of(model).install_plan(measurements, Plan(resident, streamed, arena))
    freed = before - psutil.Process().memory_info().rss
    status = flextensor.status(model)
    assert {u.name for u in status.units if u.placement == "device_only"} == set(resident)
    resident_bytes = sum(sizes[u] for u in resident)
    assert held - status.host_bytes_held >= resident_bytes
    # On a CPU the resident storage is host RAM too: what was freed is the packs, beyond the new storage.
    freed += resident_bytes
    assert freed >= 0.9 * resident_bytes, (freed, resident_bytes)  # unmapped, not just forgotten
    with torch.no_grad():
        assert torch.equal(model(x), ref)


RSS_SCRIPT = textwrap.dedent(
    """
    import json, threading, time, psutil, torch
    from torch import nn
    import flextensor

    proc = psutil.Process()
    torch.manual_seed(0)
    base = proc.memory_info().rss
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(64)))  # 64 x 4 MiB fp32
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = [proc.memory_info().rss]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    flextensor.offload(model, flextensor.OffloadConfig(device="cpu"))
    done.set()
    sampler.join()
    # On device="cpu" the device arena lives in host RAM too; on a GPU it does not. Count the host store.
    device_side = flextensor.status(model).device_bytes_held
    print(json.dumps({"base": base, "peak": peak[0], "model": model_bytes, "device_side": device_side}))
    """
)


def test_offload_never_holds_two_copies_of_the_model() -> None:
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, check=True, timeout=300
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    host_peak = m["peak"] - m["base"] - m["device_side"]
    assert host_peak < 1.1 * m["model"], m


def test_a_pack_pinned_from_two_threads_at_once_is_registered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's reader and the host budget may both pin a pack being read: one registration, since
    a second cudaHostRegister of the same pages fails."""
    import threading
    import time

    import flextensor.host.packs as host_store

    registered = []

    def slow_lock(buffer: torch.Tensor, nbytes: int, what: str) -> None:
        registered.append(buffer.data_ptr())
        time.sleep(0.05)  # both threads are inside pin() at once

    monkeypatch.setattr(host_store, "page_lock", slow_lock)
    monkeypatch.setattr(host_store, "unlock_when_gone", lambda *args: None)
    entries, nbytes = pack_layout([("w", torch.zeros(1024))])
    pack = UnitPack("u", entries, nbytes, pin=False)
    threads = [threading.Thread(target=pack.pin) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(registered) == 1 and pack.pinned
