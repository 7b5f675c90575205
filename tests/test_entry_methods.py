"""Models run through methods other than forward (a VAE's ``encode`` / ``decode``, which pipelines call
instead of ``vae()``): each call is a step, learned, planned and streamed like a forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import flextensor
from flextensor.errors import ConfigError
from streaming import streaming_config

pytest.importorskip("diffusers")

VAE_UNITS = ["encoder.down_blocks.*", "decoder.up_blocks.*", "*.mid_block"]


def tiny_vae() -> nn.Module:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False]
    ).eval()


def frames() -> torch.Tensor:
    return torch.randn(1, 3, 1, 16, 16, generator=torch.Generator().manual_seed(3))


def latents() -> torch.Tensor:
    return torch.randn(1, 4, 1, 4, 4, generator=torch.Generator().manual_seed(4))


def assert_all_stream(model: nn.Module) -> None:
    status = flextensor.status(model)
    assert status.phase == "inference"
    assert not status.resident and len(status.streamed) == len(status.units)


@torch.no_grad()
def test_a_vae_called_only_through_decode_reaches_steady_state_bitwise() -> None:
    z = latents()
    expected = tiny_vae().decode(z).sample
    vae = tiny_vae()
    flextensor.offload(vae, streaming_config(vae, ["decoder.up_blocks.*", "decoder.mid_block"]))
    outputs = [vae.decode(z).sample for _ in range(4)]
    assert flextensor.phase(vae) == "inference"  # it used to stay in discovery for good
    assert_all_stream(vae)
    assert all(torch.equal(out, expected) for out in outputs)
    assert "steady step" in str(flextensor.report(vae))


@torch.no_grad()
def test_encode_decode_and_forward_each_get_a_plan_and_match_the_model_without_offload() -> None:
    x, z = frames(), latents()
    reference = tiny_vae()
    expected = (reference.encode(x).latent_dist.mode(), reference.decode(z).sample, reference(x).sample)
    vae = tiny_vae()
    flextensor.offload(vae, streaming_config(vae, VAE_UNITS))
    for _ in range(4):
        got = (vae.encode(x).latent_dist.mode(), vae.decode(z).sample, vae(x).sample)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_all_stream(vae)
    # forward calls encode and decode inside it: one step, not three (nested calls are not new steps)
    plans = flextensor.status(vae).plans
    assert sum(1 for signature in plans if any(s.startswith("method=") for s in signature)) == 2, plans


@torch.no_grad()
def test_a_failing_decode_closes_its_step_and_the_next_call_works() -> None:
    z = latents()
    expected = tiny_vae().decode(z).sample
    vae = tiny_vae()
    flextensor.offload(vae, streaming_config(vae, VAE_UNITS))
    with pytest.raises(RuntimeError):
        vae.decode(torch.randn(1, 5, 1, 4, 4))  # wrong channel count: fails inside a unit
    outputs = [vae.decode(z).sample for _ in range(4)]
    assert all(torch.equal(out, expected) for out in outputs)
    assert flextensor.phase(vae) == "inference"


@torch.no_grad()
def test_a_saved_profile_starts_decode_in_steady_state(tmp_path: Path) -> None:
    z = latents()
    vae = tiny_vae()
    flextensor.offload(vae, streaming_config(vae, VAE_UNITS))
    expected = [vae.decode(z).sample for _ in range(3)][-1]
    path = tmp_path / "vae.ftprofile.json"
    flextensor.save_profile(vae, path)
    again = tiny_vae()
    flextensor.offload(again, streaming_config(again, VAE_UNITS, profile=path))
    assert flextensor.phase(again) == "inference"
    assert torch.equal(again.decode(z).sample, expected)


def test_release_removes_the_entry_wrappers() -> None:
    vae = tiny_vae()
    flextensor.offload(vae, streaming_config(vae, VAE_UNITS))
    assert "decode" in vae.__dict__ and "encode" in vae.__dict__
    flextensor.release(vae)
    assert "decode" not in vae.__dict__ and "encode" not in vae.__dict__
    with torch.no_grad():
        assert torch.equal(vae.decode(latents()).sample, tiny_vae().decode(latents()).sample)


class Featurizer(nn.Module):
    """A model whose callers use a method of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@torch.no_grad()
def test_any_named_method_can_be_an_entry() -> None:
    x = torch.randn(4, 16)
    expected = Featurizer().features(x)
    model = Featurizer()
    flextensor.offload(model, streaming_config(model, ["blocks.*"], entry_methods=["features"]))
    outputs = [model.features(x) for _ in range(4)]
    assert all(torch.equal(out, expected) for out in outputs)
    assert_all_stream(model)


def test_an_entry_method_the_model_lacks_is_refused_before_anything_changes() -> None:
    model = Featurizer()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match="no method of that name"):
        flextensor.offload(model, streaming_config(model, ["blocks.*"], entry_methods=["decode"]))
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert not hasattr(model, "_flextensor_hooks")


@pytest.mark.parametrize("bad", ["forward", "__call__", "not a name", 3])
def test_entry_methods_are_checked_in_the_config(bad: object) -> None:
    with pytest.raises(ConfigError, match="entry_methods"):
        flextensor.OffloadConfig(entry_methods=[bad])


def test_the_entry_wrapper_is_named_as_the_interrupted_forward_check_expects() -> None:
    """ForwardBracket.interrupted counts an entry wrapper's frames as calls of the model by its qualified
    name: renaming the wrapper would make every decode() inside a forward look like an interrupt."""
    from flextensor.hooks.bracket import ENTRY_WRAPPER
    from flextensor.hooks.functions import entry_point

    assert entry_point(nn.Module(), "decode", lambda: None).__code__.co_qualname == ENTRY_WRAPPER
