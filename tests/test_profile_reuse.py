"""Saved profiles through the public API: the next run starts in steady state, bad profiles fail early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flextensor
from flextensor.errors import NotOffloadedError, ProfileError
from flextensor.plan.layout import minimal_arena_bytes
from real_models import llama_inputs, tiny_llama
from spec_model import make_spec_model, spec_tokens
from streaming import streaming_config

CPU = {"device": "cpu"}


def _steady(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        while flextensor.phase(model) != "inference":
            model(inputs)
        return model(inputs)


def test_saved_profile_starts_next_run_in_steady_state(tmp_path: Path) -> None:
    path = tmp_path / "llama.json"
    inputs = llama_inputs()
    config = streaming_config(tiny_llama(), ["model.layers.*"])
    first = flextensor.offload(tiny_llama(), config)
    ref = _steady(first, inputs).logits
    flextensor.save_profile(first, path)

    second = flextensor.offload(tiny_llama(), config.model_copy(update={"profile": path}))
    assert flextensor.phase(second) == "inference"  # no discovery or profiling forwards
    with torch.no_grad():
        assert torch.equal(second(inputs).logits, ref)
    status = flextensor.status(second)
    assert status.forwards == 1 and status.plan == flextensor.status(first).plan
    assert status.plan.streamed
    with torch.no_grad():  # the checking first forward found nothing changed: the plan stays
        assert torch.equal(second(inputs).logits, ref)
    assert flextensor.status(second).plans == flextensor.status(first).plans


@pytest.mark.parametrize("compression", ["off", "lossless"])
def test_offload_from_a_profile_frees_the_learning_layout_before_it_lays_out_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    """offload(profile=...) lays a learning arena out (the link probe writes into it), then the profile's
    plan: the first is freed before the second is made, so the device never holds both (it did: a local
    reference kept it alive, twice the plan's arena at a budget made for one)."""
    from device_allocations import DeviceAllocations

    path = tmp_path / "llama.json"
    model = tiny_llama().to(torch.bfloat16)
    config = streaming_config(model, ["model.layers.*"], compression=compression)
    first = flextensor.offload(model, config)
    _steady(first, llama_inputs())
    flextensor.save_profile(first, path)
    device = DeviceAllocations(monkeypatch)
    second = flextensor.offload(tiny_llama().to(torch.bfloat16), config.model_copy(update={"profile": path}))
    assert flextensor.phase(second) == "inference"
    assert device.peak <= device.live_bytes(), (device.peak, device.live_bytes())


def test_profile_of_another_model_is_refused_naming_the_difference(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    _steady(model, spec_tokens())
    flextensor.save_profile(model, path)
    other = make_spec_model(hidden=128)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ProfileError, match=r"layers\.0\..*shape"):
        flextensor.offload(other, flextensor.OffloadConfig(profile=path, **CPU))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    assert not hasattr(other, "_flextensor_engine")
    with pytest.raises(ProfileError, match="include_patterns"):
        flextensor.offload(
            make_spec_model(), flextensor.OffloadConfig(include_patterns=["layers.*"], profile=path, **CPU)
        )


def test_a_profile_whose_arena_is_beyond_its_budget_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    """Adopted, such a plan (hand-edited, or damaged) failed in the allocator (an OOM on a GPU)."""
    path = tmp_path / "llama.json"
    config = streaming_config(tiny_llama(), ["model.layers.*"])
    first = flextensor.offload(tiny_llama(), config)
    _steady(first, llama_inputs())
    flextensor.save_profile(first, path)
    data = json.loads(path.read_text())
    data["plan"]["arena_bytes"] = 1 << 40
    path.write_text(json.dumps(data))
    other = tiny_llama()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ProfileError, match=r"inconsistent: plan\.arena_bytes .* budget"):
        flextensor.offload(other, config.model_copy(update={"profile": path}))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    assert not hasattr(other, "_flextensor_engine")


def test_truncated_or_missing_profile_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    _steady(model, spec_tokens())
    flextensor.save_profile(model, path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match="not valid JSON"):
        flextensor.offload(make_spec_model(), flextensor.OffloadConfig(profile=path, **CPU))
    with pytest.raises(ProfileError, match="does not exist"):
        flextensor.offload(make_spec_model(), flextensor.OffloadConfig(profile=tmp_path / "none.json", **CPU))


def test_save_before_steady_state_says_what_to_do(tmp_path: Path) -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    with pytest.raises(NotOffloadedError, match="inference"):
        flextensor.save_profile(model, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


class _Blocks(torch.nn.Module):
    """Three blocks; ``reads_outside`` makes the forward read blocks.0's weight outside its unit, as a
    model whose code changed since its profile was made might."""

    def __init__(self, reads_outside: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.reads_outside = reads_outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        if self.reads_outside:
            x = torch.nn.functional.linear(x, self.blocks[0].weight)
        return x


def test_a_profile_of_a_model_whose_code_changed_gives_right_outputs_and_profiles_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "blocks.json"
    x = torch.randn(4, 16)
    first = _Blocks()
    flextensor.offload(first, streaming_config(first, ["blocks.*"]))
    _steady(first, x)
    flextensor.save_profile(first, path)

    changed = _Blocks(reads_outside=True)
    with torch.no_grad():
        ref = changed(x)
    second = _Blocks(reads_outside=True)
    flextensor.offload(second, streaming_config(second, ["blocks.*"]).model_copy(update={"profile": path}))
    assert flextensor.phase(second) == "inference"
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(second(x), ref)
    assert "blocks.0.weight" in flextensor.resident_parameters(second)
    assert flextensor.phase(second) == "inference"
    assert flextensor.status(second).plan != flextensor.status(first).plan  # planned again for the new code


def test_a_profile_whose_run_stopped_streaming_a_unit_starts_the_next_run(tmp_path: Path) -> None:
    # A unit whose every weight was found read outside it leaves the profiled run's units; the next run
    # selects it again and must match the profile all the same.
    class ReadsAll(_Blocks):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = super().forward(x)
            return torch.nn.functional.linear(x, self.blocks[2].weight, self.blocks[2].bias)

    path = tmp_path / "p.json"
    x = torch.randn(4, 16)
    with torch.no_grad():
        ref = ReadsAll()(x)
    first = ReadsAll()
    flextensor.offload(first, streaming_config(first, ["blocks.*"]))
    _steady(first, x)
    assert "blocks.2" not in flextensor.offload_units(first)
    flextensor.save_profile(first, path)
    second = ReadsAll()
    flextensor.offload(second, streaming_config(second, ["blocks.*"]).model_copy(update={"profile": path}))
    assert flextensor.offload_units(second) == flextensor.offload_units(first)
    with torch.no_grad():
        assert torch.equal(second(x), ref)


def _profile_keeping_first_block_resident(first: torch.nn.Module, x: torch.Tensor, folder: Path) -> Path:
    """A profile of ``first`` whose plan keeps blocks.0 resident, as a planner with room to spare could
    have chosen (on a CPU it streams every block), the others streamed through an arena of one block: the
    tightest budget's, which holds it beside blocks.0."""
    path = folder / "p.json"
    flextensor.offload(first, streaming_config(first, ["blocks.*"]))
    _steady(first, x)
    flextensor.save_profile(first, path)
    saved = json.loads(path.read_text())
    plan = saved["plan"]
    plan["resident"], plan["streamed"] = ["blocks.0"], [u for u in plan["streamed"] if u != "blocks.0"]
    sizes = {u["name"]: u["nbytes"] for u in saved["measurements"]["units"]}
    plan["arena_bytes"] = minimal_arena_bytes([sizes[u] for u in plan["streamed"]])
    path.write_text(json.dumps(saved))
    return path


def test_a_weight_read_outside_a_unit_the_profile_keeps_resident_is_found_by_the_check(
    tmp_path: Path,
) -> None:
    """The first forward from a profile watches the units its plan keeps resident too: a weight of theirs
    read outside its unit (the code changed since the profile) leaves the stream before a later plan
    streams that unit (found wrong before: the check watched streamed units only, and the next input
    shape's plan streamed blocks.0 with the read going to the arena)."""
    x, wide = torch.randn(4, 16), torch.randn(64, 16)
    path = _profile_keeping_first_block_resident(_Blocks(), x, tmp_path)

    changed = _Blocks(reads_outside=True)
    with torch.no_grad():
        refs = changed(x), changed(wide)
    second = _Blocks(reads_outside=True)
    flextensor.offload(second, streaming_config(second, ["blocks.*"]).model_copy(update={"profile": path}))
    assert flextensor.status(second).plan.resident == ("blocks.0",)
    with torch.no_grad():
        assert torch.equal(second(x), refs[0])  # the checking forward
        assert "blocks.0.weight" in flextensor.resident_parameters(second)
        for _ in range(5):  # a new input shape: learnt and planned, blocks.0 streamed
            assert torch.equal(second(wide), refs[1])
        assert torch.equal(second(x), refs[0])


class _GivesWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, give: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.tanh(self.lin(x)), self.lin.weight[:8] if give else None


class _Gives(torch.nn.Module):
    """Four blocks; ``changed`` makes blocks.0 return a view of its weight, used after blocks.1."""

    def __init__(self, changed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_GivesWeight() for _ in range(4))
        self.changed = changed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = None
        for i, block in enumerate(self.blocks):
            x, weight = block(x, self.changed and i == 0)
            kept = weight if weight is not None else kept
            if i == 1 and kept is not None:
                x = x + x[:, :8] @ kept
        return x


def test_a_unit_the_profile_keeps_resident_whose_output_views_its_weights_is_found_by_the_check(
    tmp_path: Path,
) -> None:
    """As above for a unit whose output is a view of its weights: its own storage passes the check's
    arena test, so the check tests resident storage too (found by review: a later plan streamed it)."""
    x, wide = torch.randn(4, 16), torch.randn(64, 16)
    path = _profile_keeping_first_block_resident(_Gives(), x, tmp_path)

    with torch.no_grad():
        refs = _Gives(changed=True)(x), _Gives(changed=True)(wide)
    second = _Gives(changed=True)
    flextensor.offload(second, streaming_config(second, ["blocks.*"]).model_copy(update={"profile": path}))
    with torch.no_grad():
        assert torch.equal(second(x), refs[0])
        assert "blocks.0.lin.weight" in flextensor.resident_parameters(second)
        for _ in range(5):
            assert torch.equal(second(wide), refs[1])
