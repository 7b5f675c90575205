"""Weight edits on an offloaded pipeline's components between generations: a component's weights are
streamed, or not on the device at all while another component runs (see [Note: editing streamed
weights]); an in-place edit outside flextensor.editing() is refused at that component's next forward,
never silently dropped by the layouts in between, and an edit inside it is kept."""

from __future__ import annotations

import pytest
import torch

import flextensor
from flextensor.errors import UnsupportedOperationError

pytest.importorskip("diffusers")
from real_models import run_wan_pipeline, tiny_wan_pipeline
from test_pipelines import offloaded_pipeline, run_until_steady


def _edited_weights(pipe) -> list[torch.Tensor]:
    """A weight of the VAE (streamed under the tightest budget, laid out: it ran last) and one of the
    second transformer (resident in its plan, but vacated when the VAE took the memory)."""
    return [
        pipe.vae.decoder.up_blocks[0].resnets[0].conv1.weight,
        pipe.transformer_2.blocks[0].ffn.net[2].weight,
    ]


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    with torch.no_grad():
        return run_wan_pipeline(tiny_wan_pipeline())


@torch.no_grad()
@pytest.mark.parametrize("which", [0, 1], ids=["vae", "vacated_transformer_2"])
def test_an_edit_between_generations_is_never_dropped_silently(which: int, reference) -> None:
    """Outside editing() an edit of a streamed or vacated weight is refused at the component's next
    forward (and dropped, as it says); one of a unit the plan keeps on the device is real and kept (the
    VAE's plan may keep that unit resident when profiling on a busy machine gives it room). Inside
    editing() it is kept either way."""
    pipe, native = offloaded_pipeline(), tiny_wan_pipeline()
    run_until_steady(pipe)
    _edited_weights(native)[which].mul_(2)
    edited = run_wan_pipeline(native)
    assert not torch.equal(edited, reference)
    _edited_weights(pipe)[which].mul_(2)  # the components laid out and vacated in between must not lose it
    try:
        out = run_wan_pipeline(pipe)
    except UnsupportedOperationError as error:
        assert "changed in place outside" in str(error)
        assert torch.equal(run_wan_pipeline(pipe), reference)  # dropped, and said so
        with flextensor.editing(pipe.vae if which == 0 else pipe.transformer_2):
            _edited_weights(pipe)[which].mul_(2)
    else:
        assert torch.equal(out, edited)  # kept (a unit on the device): then in every generation after
    for _ in range(2):
        assert torch.equal(run_wan_pipeline(pipe), edited)


def _lora_state(transformer: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    from peft import LoraConfig, get_peft_model_state_dict

    source = type(transformer).from_config(transformer.config)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, target_modules=["to_q", "to_v", "ffn.net.0.proj"], init_lora_weights=False)
    source.add_adapter(config, "lora")
    return get_peft_model_state_dict(source, adapter_name="lora")


@torch.no_grad()
def test_both_experts_fused_in_one_editing_block_within_the_pipeline_budget(reference) -> None:
    """pipe.fuse_lora on both experts inside editing(pipe): one working set for every component, within
    the pipeline's budget less what the layouts hold; the generations after it are those of the
    pipeline without offload fused the same way."""
    pytest.importorskip("peft")
    from flextensor.api import engine_of

    pipe, native = offloaded_pipeline(), tiny_wan_pipeline()
    run_until_steady(pipe)
    for p in (native, pipe):
        for seed, name in enumerate(("transformer", "transformer_2")):
            getattr(p, name).load_lora_adapter(_lora_state(getattr(native, name), seed), prefix=None)
    with flextensor.editing(pipe):
        session, other = engine_of(pipe.transformer).editing, engine_of(pipe.transformer_2).editing
        assert session is not None and other is not None and other.working_set is session.working_set
        pipe.fuse_lora(components=["transformer", "transformer_2"], lora_scale=0.5)
    native.fuse_lora(components=["transformer", "transformer_2"], lora_scale=0.5)
    working_set = session.working_set
    assert working_set.limit_bytes is not None and 0 < working_set.peak_bytes <= working_set.limit_bytes
    expected = run_wan_pipeline(native)
    assert not torch.equal(expected, reference)  # the fuse changed the weights
    assert torch.equal(run_wan_pipeline(pipe), expected)
    for p in (native, pipe):
        p.unload_lora_weights()  # the LoRA layers go; the fused weights stay
    assert torch.equal(run_wan_pipeline(native), expected)
    for _ in range(2):
        assert torch.equal(run_wan_pipeline(pipe), expected)
