"""A pipeline of three components where two fit the budget at once: each lays the next one out at the end
of its run (see [Note: the next component ahead] in pipelines/pipeline.py). The CUDA variant checks the layout
made on the copy stream while the previous component's compute is still queued; the CPU one runs the same
scenario in CI."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor
from flextensor.api import engine_of

NAMES = ("first", "second", "third")


class Blocks(nn.Module):
    """Blocks that reuse their weights: compute-bound on a GPU, so every plan streams with the least
    memory, whatever the budget leaves room for."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            for _ in range(8):
                x = torch.tanh(block(x))
        if x.is_cuda:  # a few ms more of queued work: the next layout ahead starts while it runs
            torch.cuda._sleep(5_000_000)
        return x


def components(dim: int, dtype: torch.dtype, device: str) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {name: Blocks(dim, layers=4).to(device=device, dtype=dtype) for name in NAMES}


def generation(parts: dict[str, nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Runs of 1, 3 and 2 steps, as a text encoder, a transformer and a VAE would."""
    x = parts["first"](x)
    for _ in range(3):
        x = parts["second"](x)
    for _ in range(2):
        x = parts["third"](x)
    return x


def steady(parts: dict[str, nn.Module], x: torch.Tensor, expected: torch.Tensor) -> None:
    for _ in range(6):  # discovery and profiling of every component; more on a busy machine
        assert torch.equal(generation(parts, x), expected)
        if flextensor.phase(parts) == "inference":
            return
    raise AssertionError(f"not steady: {flextensor.phase(parts)}")


def largest_layout_and_peak(dim: int, dtype: torch.dtype, device: str, x: torch.Tensor) -> tuple[int, int]:
    """The largest component's device bytes held between steps and its planned peak during one, with
    room for all three (compute-bound: each plan streams its blocks through the smallest arena)."""
    parts = components(dim, dtype, device)
    expected = generation(parts, x)
    flextensor.offload(parts, flextensor.OffloadConfig(device=device))
    try:
        steady(parts, x, expected)
        engines = [engine_of(m) for m in parts.values()]
        return max(e.store.device_bytes_held() for e in engines), max(e.planned_peak_bytes() for e in engines)
    finally:
        flextensor.release(parts)


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
def test_each_component_lays_the_next_one_out_at_the_end_of_its_run(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dim, dtype = (2048, torch.bfloat16) if device == "cuda" else (64, torch.float32)
    x = torch.randn(8192 if device == "cuda" else 4, dim, dtype=dtype, device=device)
    # Room for one component's step beside another's layout, not beside two.
    layout, peak = largest_layout_and_peak(dim, dtype, device, x)
    budget = peak + int(1.5 * layout)
    parts = components(dim, dtype, device)
    expected = generation(parts, x)
    flextensor.offload(parts, flextensor.OffloadConfig(device=device, gpu_memory_budget=budget))
    try:
        steady(parts, x, expected)
        pipeline = parts_pipeline(parts)
        seen: dict[str, list[bool]] = {name: [] for name in NAMES}
        for name in NAMES:
            parts[name].register_forward_pre_hook(
                lambda module, args, name=name: seen[name].append(engine_of(module).laid_out), prepend=True
            )
        before, vacated = pipeline.laid_out_ahead, pipeline.vacated
        ahead = watch_layouts_ahead(monkeypatch, cuda=device == "cuda")
        for _ in range(3):
            assert torch.equal(generation(parts, x), expected)
        assert ahead and not any(a["synchronized"] for a in ahead), ahead  # no wait for the device
        if device == "cuda":
            assert all(a["on_copy_stream"] for a in ahead), ahead  # memory from the copy stream's blocks
            assert any(a["compute_queued"] for a in ahead), ahead  # while the previous one still ran
        assert pipeline.vacated > vacated  # the three never fit at once: some give memory back
        assert pipeline.laid_out_ahead - before >= 6  # each run's end lays the next component out
        assert all(steps[0] for steps in seen.values()), seen  # in place before the first step of a run
    finally:
        flextensor.release(parts)


def watch_layouts_ahead(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> list[dict[str, bool]]:
    """Per layout ahead: whether it synchronised the device, allocated with the copy stream current, and
    began while compute was still queued on the stream of the forward that just ended."""
    from flextensor.device.runtime import DeviceRuntime
    from flextensor.engine.controller import OffloadEngine
    from flextensor.store.device_store import DeviceStore

    seen: list[dict[str, bool]] = []
    real_ahead, real_lay_out, real_sync = (
        OffloadEngine.lay_out_ahead,
        DeviceStore._lay_out,
        DeviceRuntime.synchronize,
    )

    active: list[dict[str, bool]] = []  # the layout ahead under way, if one is

    def lay_out_ahead(self) -> bool:
        queued = cuda and not torch.cuda.current_stream().query()
        active.append({"synchronized": False, "on_copy_stream": False, "compute_queued": queued})
        try:
            done = real_ahead(self)
        finally:
            watched = active.pop()
        if done:
            seen.append(watched)
        return done

    def lay_out(self, *args, **kwargs) -> None:
        if active and cuda:
            active[-1]["on_copy_stream"] = torch.cuda.current_stream() == self.runtime.copy_stream
        real_lay_out(self, *args, **kwargs)

    def synchronize(self) -> None:
        if active:
            active[-1]["synchronized"] = True
        real_sync(self)

    monkeypatch.setattr(OffloadEngine, "lay_out_ahead", lay_out_ahead)
    monkeypatch.setattr(DeviceStore, "_lay_out", lay_out)
    monkeypatch.setattr(DeviceRuntime, "synchronize", synchronize)
    return seen


def parts_pipeline(parts: dict[str, nn.Module]):
    from flextensor.pipelines.pipeline import pipeline_of

    return pipeline_of(parts)
