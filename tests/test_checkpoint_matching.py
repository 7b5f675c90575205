"""How the model's tensors are matched to a checkpoint's: tied weights the checkpoint holds with values of
their own are untied as transformers' from_pretrained unties them (checked against from_pretrained), or
refused for a model whose ties transformers does not declare; a shape mismatch is named as one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import flextensor
from engine_helpers import LEARN, assert_all_equal, first_tensor, run_forwards
from flextensor import CheckpointError
from real_models import llama_inputs, tiny_llama
from streaming import streaming_config


@pytest.fixture(scope="module")
def untied_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A fine-tune that untied the head, saved with a config that still ties it, and the outputs of that
    folder loaded by from_pretrained."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("untied") / "llama"
    tiny_llama(tie=False).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    loaded = LlamaForCausalLM.from_pretrained(folder).eval()
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight  # transformers unties them
    with torch.no_grad():
        return folder, first_tensor(loaded(llama_inputs()))


def meta_tied_llama(folder: Path) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(folder)
    assert config.tie_word_embeddings
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("include", [["model.layers.*"], ["model.layers.*", "lm_head"]])
def test_a_checkpoint_that_unties_the_head_is_read_as_from_pretrained_reads_it(
    include: list[str], untied_head, caplog: pytest.LogCaptureFixture
) -> None:
    folder, expected = untied_head
    model = meta_tied_llama(folder)
    with caplog.at_level("WARNING", logger="flextensor"):
        model = flextensor.offload(model, streaming_config(model, include), weights=folder)
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 1), expected)
    assert "lm_head.weight with different values" in caplog.text
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert "lm_head.weight" not in model.all_tied_weights_keys  # as from_pretrained leaves it
    flextensor.release(model, "cpu")
    assert_all_equal(run_forwards(model, llama_inputs(), 1), expected)


def test_a_failure_after_untying_puts_the_tie_back(untied_head, tmp_path: Path) -> None:
    folder, _ = untied_head
    model = meta_tied_llama(folder)
    tied = model.lm_head.weight
    config = flextensor.OffloadConfig(device="cpu", profile=str(tmp_path / "missing.json"))
    with pytest.raises(flextensor.ProfileError):
        flextensor.offload(model, config, weights=folder)
    assert model.lm_head.weight is tied and model.model.embed_tokens.weight is tied
    assert model.all_tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    assert all(p.device.type == "meta" for p in model.parameters())


class _TiedHead(nn.Module):
    """A model that ties its head to its embedding in its own code (no transformers declaration)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def test_ties_the_model_does_not_declare_are_refused_when_the_checkpoint_differs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = _TiedHead()
    state = {k: v.clone() for k, v in reference.state_dict().items()}  # both names, same values: kept tied
    save_file(state, str(tmp_path / "same.safetensors"))
    save_file({**state, "head.weight": state["head.weight"] + 1}, str(tmp_path / "other.safetensors"))
    with torch.device("meta"):
        model = _TiedHead()
    with pytest.raises(CheckpointError, match=r"ties embed.weight = head.weight .*different values"):
        flextensor.offload(
            model, flextensor.OffloadConfig(device="cpu"), weights=tmp_path / "other.safetensors"
        )
    assert model.head.weight is model.embed.weight and model.head.weight.device.type == "meta"
    model = flextensor.offload(
        model, flextensor.OffloadConfig(device="cpu"), weights=tmp_path / "same.safetensors"
    )
    assert model.head.weight is model.embed.weight
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_a_shape_mismatch_is_named_as_one(tmp_path: Path) -> None:
    """A float32 model for a float32 checkpoint of another vocabulary: no dtype advice."""
    from transformers import LlamaForCausalLM

    reference = tiny_llama()
    reference.save_pretrained(tmp_path / "llama")
    config = copy.deepcopy(reference.config)
    config.vocab_size = 72
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    with pytest.raises(CheckpointError) as caught:
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu"), weights=tmp_path / "llama")
    message = str(caught.value)
    assert "1 mismatched in shape: model.embed_tokens.weight: checkpoint [64, 32], model [72, 32]" in message
    assert "checkpoint's own config" in message
    assert "dtype" not in message and "model.to(" not in message
