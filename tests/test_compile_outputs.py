"""Whole-model torch.compile of units whose outputs are views or nested (inductor on the CPU).

The post op of a unit compiled whole declares the unit's outputs written, so every kernel that produces
them runs before the next copies overwrite the unit's weights (see [Note: compiled hot path]). These
models return what a flat list of plain tensors would miss: views (``.view``, ``.reshape``, slices; the
single-stream blocks of Flux return two slices of one tensor) and tensors nested two levels deep. Every
unit streams through a two-slot arena, and every compiled forward is compared bit for bit with the same
model compiled whole without offload.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import flextensor
from real_models import flux_inputs, tiny_flux
from streaming import streaming_config

pytest.importorskip("torch._inductor")
from torch._dynamo.utils import counters

FORWARDS = 5  # discovery, profiling (one or two), then steady state


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled_outputs(
    model: nn.Module, include: list[str], run: Callable[[nn.Module], torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``model`` offloaded and compiled whole: each forward's output, and what it must be, the output of
    the model without offload, eager for the discovery forward (which runs eagerly) and compiled whole
    for the others."""
    with torch.no_grad():
        eager = run(model)
        native = run(torch.compile(copy.deepcopy(model)))
    torch._dynamo.reset()
    flextensor.offload(model, streaming_config(model, include))
    compiled = torch.compile(model)
    with torch.no_grad():
        outputs = [run(compiled) for _ in range(FORWARDS)]
    status = flextensor.status(model)
    assert status.phase == "inference"
    assert not status.resident and len(status.streamed) == len(status.units)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return list(zip(outputs, [eager] + [native] * (FORWARDS - 1), strict=True))


OUTPUT_VIEWS: dict[str, Callable[[torch.Tensor], Any]] = {
    "view": lambda y: y.view(-1, y.shape[-1]),
    "reshape": lambda y: y.reshape(2, -1, y.shape[-1]),
    "transpose": lambda y: y.transpose(0, 1),
    "two slices": lambda y: (y[:, :3], y[:, 3:]),  # as Flux's single-stream blocks return
}


class ViewingBlock(nn.Module):
    def __init__(self, shape: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.norm, self.linear, self.shape = nn.LayerNorm(32), nn.Linear(32, 32), shape

    def forward(self, x: torch.Tensor) -> Any:
        return self.shape(self.linear(self.norm(x)))


class ViewingStack(nn.Module):
    def __init__(self, shape: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(ViewingBlock(shape) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            out = block(x)
            x = torch.cat(out, dim=1) if isinstance(out, tuple) else out
        return x


@pytest.mark.parametrize("shape", OUTPUT_VIEWS)
def test_units_whose_outputs_are_views_compile_whole_bitwise(shape: str) -> None:
    x = torch.randn(4, 8, 32)
    for output, expected in compiled_outputs(ViewingStack(OUTPUT_VIEWS[shape]), ["blocks.*"], lambda m: m(x)):
        assert torch.equal(output, expected)


NESTINGS: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = {
    "tuple in tuple": (lambda y, aux: (y, ((aux,),)), lambda out: out[1][0][0]),
    "dict": (lambda y, aux: (y, {"aux": aux}), lambda out: out[1]["aux"]),
}


class NestingBlock(nn.Module):
    """Its second result leaves the block nested two levels deep; inductor fuses its kernel, which reads
    the block's weights, into the parent's sum unless something orders it before the post op."""

    def __init__(self, nest: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        super().__init__()
        self.linear, self.aux_norm, self.nest = nn.Linear(32, 32), nn.LayerNorm(32), nest
        self.gate = nn.Parameter(torch.randn(32))

    def forward(self, x: torch.Tensor) -> Any:
        y = self.linear(x)
        return self.nest(y, self.aux_norm(y) * self.gate)


class NestingStack(nn.Module):
    def __init__(self, nesting: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        nest, self.aux = NESTINGS[nesting]
        self.blocks = nn.ModuleList(NestingBlock(nest) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            out = block(x)
            x = out[0] + self.aux(out)
        return x


@pytest.mark.parametrize("nesting", NESTINGS)
def test_units_with_nested_outputs_compile_whole_bitwise(nesting: str) -> None:
    x = torch.randn(4, 32)
    for output, expected in compiled_outputs(NestingStack(nesting), ["blocks.*"], lambda m: m(x)):
        assert torch.equal(output, expected)


def test_flux_transformer_compiles_whole_bitwise() -> None:
    """Flux's single-stream blocks return two slices of one tensor."""
    pytest.importorskip("diffusers")
    inputs = flux_inputs()
    for output, expected in compiled_outputs(
        tiny_flux(),
        ["transformer_blocks.*", "single_transformer_blocks.*"],
        lambda m: m(**inputs).sample,
    ):
        assert torch.equal(output, expected)
