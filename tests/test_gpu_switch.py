"""A pipeline whose budget holds one component at a time: at each switch the component that ran gives its
memory back and the next one lays its plan out, ordered by streams, without waiting for the device (see
[Note: a switch in stream order] in stream_switch.py). The CUDA variant queues each forward behind a
sleep, so the next component takes memory the previous one's queued kernels still read and writes its
weights there: a missing wait would change the output. The CPU variant runs the same path in CI."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor
from flextensor.api import engine_of
from flextensor.device import DeviceRuntime
from flextensor.pipelines import pipeline_of
from flextensor.slots import DeviceStore

NAMES = ("first", "second", "third")


class SlowBlocks(nn.Module):
    """Blocks queued behind a sleep on a GPU: the host reaches the next component's switch while every
    kernel of this forward, its reads of the weights included, still waits on the device."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda._sleep(20_000_000)  # about 10 ms
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def components(dim: int, dtype: torch.dtype, device: str) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {name: SlowBlocks(dim, layers=6).to(device=device, dtype=dtype) for name in NAMES}


def generation(parts: dict[str, nn.Module], x: torch.Tensor) -> torch.Tensor:
    x = parts["first"](x)
    for _ in range(3):
        x = parts["second"](x)
    for _ in range(2):
        x = parts["third"](x)
    return x


def run_until_steady(parts: dict[str, nn.Module], x: torch.Tensor, expected: torch.Tensor) -> None:
    for _ in range(6):
        assert torch.equal(generation(parts, x), expected)
        if flextensor.phase(parts) == "inference":
            return
    raise AssertionError(f"not steady: {flextensor.phase(parts)}")


def largest_peak(dim: int, dtype: torch.dtype, device: str, x: torch.Tensor) -> tuple[int, int]:
    """The largest planned peak of a step and the largest layout, with room for every component."""
    parts = components(dim, dtype, device)
    expected = generation(parts, x)
    flextensor.offload(parts, flextensor.OffloadConfig(device=device))
    try:
        run_until_steady(parts, x, expected)
        engines = [engine_of(m) for m in parts.values()]
        return max(e.planned_peak_bytes() for e in engines), max(e.store.device_bytes_held() for e in engines)
    finally:
        flextensor.release(parts)


def watch_switches(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> dict[str, int]:
    """Counts device synchronisations, layouts and vacates, and layouts made while compute was queued."""
    seen = {"synchronize": 0, "lay_out": 0, "vacate": 0, "compute_queued": 0}
    real_sync, real_lay_out, real_vacate = (
        DeviceRuntime.synchronize,
        DeviceStore._lay_out,
        DeviceStore._vacate,
    )

    def synchronize(self) -> None:
        seen["synchronize"] += 1
        real_sync(self)

    def lay_out(self, *args, **kwargs) -> None:
        seen["lay_out"] += 1
        if cuda and not torch.cuda.current_stream().query():
            seen["compute_queued"] += 1
        real_lay_out(self, *args, **kwargs)

    def vacate(self, keep_resident: bool) -> None:
        seen["vacate"] += 1
        real_vacate(self, keep_resident)

    monkeypatch.setattr(DeviceRuntime, "synchronize", synchronize)
    monkeypatch.setattr(DeviceStore, "_lay_out", lay_out)
    monkeypatch.setattr(DeviceStore, "_vacate", vacate)
    return seen


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
@torch.no_grad()
def test_components_switch_without_waiting_for_the_device(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = device == "cuda"
    dim, dtype = (4096, torch.bfloat16) if cuda else (64, torch.float32)
    x = torch.randn(4096 if cuda else 4, dim, dtype=dtype, device=device)
    peak, layout = largest_peak(dim, dtype, device, x)
    budget = peak + layout // 2  # one component at a time: every switch gives back and lays out
    parts = components(dim, dtype, device)
    expected = generation(parts, x)
    flextensor.offload(parts, flextensor.OffloadConfig(device=device, gpu_memory_budget=budget))
    try:
        run_until_steady(parts, x, expected)
        pipeline = pipeline_of(parts)
        vacated, ahead = pipeline.vacated, pipeline.laid_out_ahead
        seen = watch_switches(monkeypatch, cuda)
        for _ in range(3):
            assert torch.equal(generation(parts, x), expected)
        assert pipeline.laid_out_ahead == ahead  # no room for two: each lays out at its step
        assert pipeline.vacated - vacated >= 6 and seen["vacate"] >= 6, seen
        assert seen["lay_out"] >= 6, seen
        assert seen["synchronize"] == 0, seen
        if cuda:
            assert seen["compute_queued"] >= 6, seen  # the previous component's kernels still queued
            assert torch.cuda.max_memory_allocated() > 0
    finally:
        flextensor.release(parts)


@torch.no_grad()
def test_a_switch_synchronises_where_streams_cannot_order_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A component under a host budget (its packs may be unpinned and staged at a layout) keeps the
    synchronising switch, and stays bitwise."""
    x = torch.randn(4, 64)
    parts = components(64, torch.float32, "cpu")
    expected = generation(parts, x)
    peak, layout = largest_peak(64, torch.float32, "cpu", x)
    weights = sum(p.numel() * p.element_size() for m in parts.values() for p in m.parameters())
    budget = peak + layout // 2
    config = flextensor.OffloadConfig(
        device="cpu", gpu_memory_budget=budget, host_memory_budget=weights * 6 // 10
    )
    flextensor.offload(parts, config)
    try:
        run_until_steady(parts, x, expected)
        seen = watch_switches(monkeypatch, cuda=False)
        assert torch.equal(generation(parts, x), expected)
        assert any(flextensor.status(m).staging_bytes for m in parts.values())  # a ring: packs staged
        assert seen["vacate"] >= 2 and seen["synchronize"] >= seen["vacate"], seen
    finally:
        flextensor.release(parts)
