"""The host memory budget on a CUDA device: pinned bytes stay within it, staged copies are bitwise.

Run on the GPU machine with ``pytest -m gpu tests/test_gpu_host_budget.py``; elsewhere these skip visibly.
"""

from __future__ import annotations

import pytest
import torch

import flextensor
from flextensor.host.packs import pack_layout
from flextensor.host.staging import staging_layout
from flextensor.plan.host_plan import pack_bytes
from flextensor.weights.selection import select
from real_models import tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]

LAYERS = ["model.layers.*"]


def medium_llama(layers: int = 8):
    return tiny_llama(layers=layers, hidden=1024, heads=16, kv_heads=4, vocab=4096).to(torch.bfloat16)


def host_budget_for(model: torch.nn.Module, pinned_units: int) -> int:
    selection = select(model, LAYERS, ())
    params = dict(model.named_parameters())
    sizes = [
        pack_bytes(pack_layout([(n, params[n]) for n in selection.unit_parameters[u]])[1])
        for u in selection.units
    ]
    slot, slots = staging_layout(max(sizes))
    return slot * slots + pinned_units * max(sizes)


def test_llama_bitwise_with_a_host_budget_and_pinned_bytes_within_it() -> None:
    inputs = torch.randint(0, 4096, (2, 128), generator=torch.Generator().manual_seed(1))
    native = medium_llama().cuda()
    with torch.no_grad():
        ref = native(inputs.cuda()).logits.clone()
    del native
    torch.cuda.empty_cache()
    model = medium_llama()
    budget = host_budget_for(model, pinned_units=2)
    # The budget covers what the process holds on the device: tensors earlier tests left alive count too
    # (after test_gpu.py, 95 MiB on the H200: 179.5 MiB needed against 120 MiB).
    config = flextensor.OffloadConfig(
        include_patterns=LAYERS,
        gpu_memory_budget=torch.cuda.memory_allocated() + 120 * 2**20,
        host_memory_budget=budget,
    )
    flextensor.offload(model, config)
    status = flextensor.status(model)
    assert 0 < status.host_pinned_bytes <= budget
    assert any(u.staged for u in status.units)
    with torch.no_grad():
        for i in range(6):
            out = model(inputs.cuda()).logits
            assert torch.equal(out, ref), f"forward {i} differs from the model on the device"
    assert flextensor.phase(model) == "inference"
    status = flextensor.status(model)
    assert status.plan is not None and status.plan.staged, "no streamed unit is staged: lower the budgets"
    assert 0 < status.host_pinned_bytes <= budget
    assert all(u.pinned != u.staged for u in status.units if u.host_bytes)
    report = flextensor.report(model)
    assert report.host_pinned_bytes <= budget and report.host_pageable_bytes > 0
    print(report)
    flextensor.release(model)


def test_host_budget_without_pinning_is_refused() -> None:
    model = tiny_llama(layers=2)
    config = flextensor.OffloadConfig(pinned_memory=False, host_memory_budget="64MiB")
    with pytest.raises(flextensor.ConfigError, match="pinned_memory=False"):
        flextensor.offload(model, config)


def test_probe_measures_staged_copies() -> None:
    from flextensor.observe.probe import measure_copy, measure_staged_copy

    staged = measure_staged_copy("cuda", 64 * 2**20, repeats=3)
    pinned = measure_copy("cuda", 64 * 2**20, "host_to_device", True, repeats=3)
    assert staged.gbps > 0
    print(f"staged {staged.gbps:.1f} GB/s, pinned {pinned.gbps:.1f} GB/s")
