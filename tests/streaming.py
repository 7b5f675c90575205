"""Configs that make the CPU engine stream in steady state.

On a CPU every copy is as slow as the compute it would hide under, so the no-budget planner rightly keeps
everything resident. Tests that check the streaming path give the tightest feasible budget instead: two
of the largest units in flight, nothing else, so every unit streams through a two-slot arena.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

import flextensor
from flextensor.host.packs import pack_layout
from flextensor.plan.layout import minimal_arena_bytes
from flextensor.weights.selection import select


def streaming_config(
    model: nn.Module, include: Sequence[str] = ("*",), exclude: Sequence[str] = (), **fields: object
) -> flextensor.OffloadConfig:
    selection = select(model, include, exclude)
    params = dict(model.named_parameters())
    sizes = [pack_layout([(n, params[n]) for n in selection.unit_parameters[u]])[1] for u in selection.units]
    budget = 2 * minimal_arena_bytes(sizes)
    return flextensor.OffloadConfig(
        include_patterns=list(include),
        exclude_patterns=list(exclude),
        device="cpu",
        gpu_memory_budget=budget,
        **fields,
    )
