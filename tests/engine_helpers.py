"""Helpers shared by the engine's end-to-end tests (test_api, test_hooks, test_discovery, test_steady,
test_engine): running forwards, comparing outputs, and placing units by hand.

Everything here reads an offloaded model through its public surface only: ``flextensor.status(model)``,
the model's own parameters and state dict, and the engine's public ``plans`` / ``install_plan``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

import flextensor
from flextensor.api import engine_of
from flextensor.hooks.functions import input_signature
from flextensor.phases.profiling import EXTRA_FORWARDS
from flextensor.plan.layout import provisional_arena_bytes
from spec_model import make_spec_model, spec_tokens
from streaming import streaming_config

CPU = {"device": "cpu"}

LEARN = 2 + EXTRA_FORWARDS
"""Forwards that take a model with the default config (one discovery, one profiling forward) to steady
state for certain: timing noise (another process on a 2-core machine) may add the extra profiling
forwards of [Note: robust measurements] in phases/profiling.py."""

LEARN_COMPILED = LEARN + EXTRA_FORWARDS
"""The same under torch.compile: a profiling forward during which the compiler ran is left out, up to
``EXTRA_FORWARDS`` of them (phases/learning.py, ``compiler_ran``), besides the noisy ones."""

RESIDENT = ("resident", "device_only")
"""The placements of a unit with device storage of its own."""


class Stack(nn.Module):
    """Linear layers with a tanh between them, seeded: a stack of equal units."""

    def __init__(self, layers: int = 16, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def run_forwards(model: nn.Module, inputs: object, n: int = 4) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for _ in range(n):
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            outs.append(first_tensor(out))
    return outs


def run_until_steady(model: nn.Module, runner: nn.Module, inputs: object, limit: int) -> int:
    """Forwards of ``runner`` (``model`` or a compiled ``model``) until ``model`` is in steady state, at
    most ``limit``; how many ran. The count of learning forwards depends on timing noise."""
    for count in range(1, limit + 1):
        run_forwards(runner, inputs, 1)
        if flextensor.phase(model) == "inference":
            return count
    return limit


def first_tensor(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if hasattr(out, "sample"):
        return out.sample
    return out[0]  # type: ignore[index]


def assert_all_equal(outs: list[torch.Tensor], ref: torch.Tensor) -> None:
    for i, out in enumerate(outs):
        assert torch.equal(out, ref), f"forward {i} differs from the resident model"


# -- placing units by hand ----------------------------------------------------------------------------------


def offload_with_placements(
    placements: dict[int, tuple[str, ...]], tight: bool = True, **fields: object
) -> tuple[nn.Module, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """A spec model that learned a plan per sequence length in ``placements``, each then replaced by one
    keeping those units resident and streaming the rest; with the inputs and the plain model's outputs.

    On a CPU the tightest budget streams everything and no budget keeps everything resident, so residency
    is placed by hand through the engine's public install_plan, the path a learned plan takes. ``tight``:
    under the tightest budget (else none).
    """
    model = make_spec_model()
    config = streaming_config(model, **fields) if tight else flextensor.OffloadConfig(**CPU, **fields)
    model = flextensor.offload(model, config)
    tokens = {seq: spec_tokens(seq=seq) for seq in placements}
    refs = {seq: run_forwards(make_spec_model(), tokens[seq], 1)[0] for seq in placements}
    learn = config.discovery_forwards + config.profiling_forwards + EXTRA_FORWARDS  # see LEARN
    for seq in placements:
        run_forwards(model, tokens[seq], learn)
    assert len(flextensor.status(model).plans) == len(placements)
    for seq, resident in placements.items():
        install_placement(model, input_signature((tokens[seq],), {}), resident)
    return model, tokens, refs


def install_placement(model: nn.Module, signature: tuple[str, ...], resident: Iterable[str]) -> None:
    """Replace the plan cached for ``signature`` by one keeping ``resident`` resident, streaming the rest
    through an arena at least as large as the one to learn with."""
    engine = engine_of(model)
    resident = tuple(resident)
    entry = engine.plans[signature]
    status = flextensor.status(model)
    streamed = tuple(u for u in entry.measurements.unit_names() if u not in resident)
    sizes = [status.unit(u).nbytes for u in streamed]
    arena = max(entry.plan.arena_bytes, provisional_arena_bytes(sizes)) if streamed else 0
    plan = dataclasses.replace(entry.plan, resident=resident, streamed=streamed, arena_bytes=arena)
    engine.install_plan(entry.measurements, plan)


# -- reading placements through the public view -------------------------------------------------------------


def unit_parameters(model: nn.Module, unit: str) -> list[torch.Tensor]:
    """The parameters of the offload unit ``unit`` (its module's parameters that stream)."""
    streamed = set(flextensor.offloaded_parameters(model))
    module = model.get_submodule(unit)
    return [p for n, p in module.named_parameters() if f"{unit}.{n}" in streamed]


def storage_pointers(model: nn.Module, units: Iterable[str]) -> dict[str, int]:
    """Where each unit's parameters live on the device: the storage whose bytes they alias (the unit's
    own storage when resident, the arena when streamed). Each parameter has a storage object of its own
    over those bytes (see Unit.point_parameters), so the owner is found by address."""
    engine = engine_of(model)
    owners = {u.storage.untyped_storage() for u in engine.units.values() if u.storage is not None}
    spans = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in owners]
    pointers = {}
    for u in units:
        address = unit_parameters(model, u)[0].data_ptr()
        pointers[u] = next(start for start, end in spans if start <= address < end)
    return pointers


def uploads(model: nn.Module) -> dict[str, int]:
    """Per unit, how often it has been given resident storage so far."""
    return {u.name: u.uploads for u in flextensor.status(model).units}


def pack_rebuilds(model: nn.Module) -> dict[str, int]:
    """Per unit, how often its host pack has been built again from its device storage so far."""
    return {u.name: u.pack_rebuilds for u in flextensor.status(model).units}


def grown(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The units whose counter grew between two readings (each by one), sorted."""
    changed = sorted(name for name in after if after[name] != before.get(name, 0))
    assert all(after[name] == before.get(name, 0) + 1 for name in changed), (before, after)
    return changed


def assert_placement(model: nn.Module, resident: Iterable[str]) -> None:
    """Exactly ``resident`` is resident, every other unit is streamed; each holds device bytes: resident
    ones storage of their own, streamed ones a range of the one arena."""
    resident = set(resident)
    status = flextensor.status(model)
    for unit in status.units:
        assert unit.placement != "host", unit.name
        assert (unit.placement in RESIDENT) == (unit.name in resident), unit.name
    pointers = storage_pointers(model, (u.name for u in status.units))
    arena = {pointers[u] for u in status.streamed}
    assert len(arena) <= 1, "streamed units view more than one arena"
    assert (status.arena_bytes > 0) == bool(status.streamed)
    own = [pointers[u] for u in status.resident]
    assert len(set(own)) == len(own) and not arena.intersection(own)
    resident_bytes = sum(status.unit(u).nbytes for u in status.resident)
    assert status.device_bytes_held == status.arena_bytes + resident_bytes


def assert_packs_dropped(model: nn.Module, resident: Iterable[str]) -> None:
    """Units resident now and in every saved plan hold no host pack; every other unit holds its own."""
    status = flextensor.status(model)
    everywhere = set(resident).intersection(*(plan.resident for plan in status.plans.values()))
    for unit in status.units:
        dropped = unit.name in everywhere
        assert (unit.placement == "device_only") == dropped, unit.name
        assert (unit.host_bytes == 0) == dropped, unit.name
    assert status.host_bytes_held == sum(u.host_bytes for u in status.units)


def assert_packs_hold_the_weights(model: nn.Module, names: Iterable[str]) -> None:
    """Each of these units, streamed now, has a host pack holding its parameters' original values (the
    state dict reports a streamed unit's weights from its pack)."""
    original = make_spec_model().state_dict()
    state = model.state_dict()
    status = flextensor.status(model)
    streamed = set(flextensor.offloaded_parameters(model))
    for name in names:
        unit = status.unit(name)
        assert unit.placement == "streamed" and unit.host_bytes > 0, name
        fqns = [k for k in original if k.startswith(name + ".") and k in streamed]
        assert fqns, name
        for fqn in fqns:
            assert torch.equal(state[fqn], original[fqn]), fqn


def resident_now(model: nn.Module) -> set[str]:
    return set(flextensor.status(model).resident)


def residency_seen_by(module: nn.Module, model: nn.Module) -> list[set[str]]:
    """The resident units at each call of ``module`` from now on."""
    seen: list[set[str]] = []
    module.register_forward_pre_hook(lambda *_: seen.append(resident_now(model)))
    return seen
