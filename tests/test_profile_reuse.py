"""Saved profiles through the public API: the next run starts in steady state, bad profiles fail early."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor
from flextensor.errors import NotOffloadedError, ProfileError
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
    engine = second._flextensor_engine
    assert engine.forwards == 1 and engine.plan == first._flextensor_engine.plan
    assert engine.plan.streamed


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
