"""Which files ``weights=`` reads: a folder holding both of a library's names is read as that library's
from_pretrained reads it (checked against from_pretrained itself), and a malformed index is a
CheckpointError naming the file and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flextensor
from engine_helpers import LEARN, assert_all_equal, first_tensor, run_forwards
from flextensor import CheckpointError
from real_models import llama_inputs, tiny_llama, tiny_wan
from streaming import streaming_config
from test_checkpoint import SHARD, meta_llama, meta_wan


def _expected_from_pretrained(folder: Path) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return first_tensor(loaded(llama_inputs()))


@pytest.mark.parametrize("sharded_first", [True, False], ids=["stale_index", "stale_file"])
def test_a_folder_saved_twice_is_read_as_transformers_reads_it(
    sharded_first: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Sharded then whole: save_pretrained removes the shards and leaves the index. Whole then sharded:
    it leaves model.safetensors. Either way from_pretrained reads model.safetensors, and so does offload."""
    folder = tmp_path / "llama"
    first, second = tiny_llama(seed=3), tiny_llama(seed=4)
    first.save_pretrained(folder, **({"max_shard_size": SHARD} if sharded_first else {}))
    second.save_pretrained(folder, **({} if sharded_first else {"max_shard_size": SHARD}))
    assert (folder / "model.safetensors").is_file()
    assert (folder / "model.safetensors.index.json").is_file()
    assert bool(list(folder.glob("model-*-of-*.safetensors"))) is not sharded_first
    expected = _expected_from_pretrained(folder)
    with caplog.at_level("WARNING", logger="flextensor"):
        model = meta_llama(first)
        model = flextensor.offload(model, streaming_config(model, ["model.layers.*"]), weights=folder)
    assert "holds both model.safetensors and model.safetensors.index.json" in caplog.text
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 1), expected)


def test_a_diffusers_folder_with_a_stale_index_names_the_whole_file(tmp_path: Path) -> None:
    """diffusers' from_pretrained reads the index first (and fails on a stale one): so does offload, and
    its error names the whole file to pass instead."""
    folder = tmp_path / "wan"
    reference = tiny_wan()
    reference.save_pretrained(folder, max_shard_size=SHARD)
    reference.save_pretrained(folder)
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    with pytest.raises(
        CheckpointError, match=r"incomplete.*diffusion_pytorch_model\.safetensors' as weights="
    ):
        flextensor.offload(meta_wan(reference), flextensor.OffloadConfig(device="cpu"), weights=folder)
    model = flextensor.offload(
        meta_wan(reference),
        flextensor.OffloadConfig(device="cpu"),
        weights=folder / "diffusion_pytorch_model.safetensors",
    )
    assert flextensor.status(model).units


def _with_shard(name: str, shard: object):
    return lambda index: {**index, "weight_map": {**index["weight_map"], name: shard}}


BAD_INDEXES = {
    "a number for a shard": (_with_shard("model.norm.weight", 7), "maps 'model.norm.weight' to 7"),
    "a list for a shard": (_with_shard("model.norm.weight", ["a"]), "maps 'model.norm.weight' to ['a']"),
    "an empty shard name": (_with_shard("lm_head.weight", ""), "maps 'lm_head.weight' to ''"),
    "a list for the map": (lambda index: {**index, "weight_map": ["x"]}, "no 'weight_map' object"),
    "a list for the index": (lambda index: [index], "no 'weight_map' object"),
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_a_malformed_index_is_refused_naming_the_file_and_key(case: str, tmp_path: Path) -> None:
    reference = tiny_llama()
    folder = tmp_path / "llama"
    reference.save_pretrained(folder, max_shard_size=SHARD)
    index_path = folder / "model.safetensors.index.json"
    change, words = BAD_INDEXES[case]
    index_path.write_text(json.dumps(change(json.loads(index_path.read_text()))))
    model = meta_llama(reference)
    with pytest.raises(CheckpointError, match="is not a safetensors index") as caught:
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu"), weights=folder)
    assert str(index_path) in str(caught.value) and words in str(caught.value)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing changed
