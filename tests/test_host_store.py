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
from flextensor.engine import provisional_arena_bytes
from flextensor.host_store import pack_layout


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
    held = sum(u.pack.held_bytes for u in model._flextensor_engine.units.values())
    assert weight_bytes <= held <= 1.02 * weight_bytes


def test_packed_views_share_one_buffer_per_unit() -> None:
    model = flextensor.offload(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), flextensor.OffloadConfig(device="cpu")
    )
    for unit in model._flextensor_engine.units.values():
        ptr = unit.pack.buffer.untyped_storage().data_ptr()
        assert all(unit.pack.view(e).untyped_storage().data_ptr() == ptr for e in unit.pack.entries)


def test_dropping_resident_packs_gives_their_host_memory_back() -> None:
    psutil = pytest.importorskip("psutil")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(16)))  # 16 x 4 MiB fp32
    x = torch.randn(2, 1024)
    ref = model(x).detach()
    flextensor.offload(model, flextensor.OffloadConfig(device="cpu"))
    engine = model._flextensor_engine
    names = list(engine.units)
    resident, streamed = names[:12], names[12:]
    arena = provisional_arena_bytes([engine.units[u].nbytes for u in streamed])
    engine.apply_layout(streamed, resident, arena)  # as a plan keeping 12 units resident does
    held = engine.host_bytes_held()
    before = psutil.Process().memory_info().rss
    engine._drop_resident_packs()
    freed = before - psutil.Process().memory_info().rss
    resident_bytes = sum(engine.units[u].nbytes for u in resident)
    assert held - engine.host_bytes_held() >= resident_bytes
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
    engine = model._flextensor_engine
    # On device="cpu" the device arena lives in host RAM too; on a GPU it does not. Count the host store.
    device_side = engine.device_bytes_held()
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
