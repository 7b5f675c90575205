"""offload(model, config, weights=PATH): a meta model read from a safetensors checkpoint in every layout,
bitwise against the model loaded the usual way; bad checkpoints refused before anything changes; host
memory during loading bounded by the weights (measured in a subprocess)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import flextensor
from engine_helpers import LEARN, assert_all_equal, first_tensor, run_forwards
from flextensor import CheckpointError, NotOffloadedError
from real_models import llama_inputs, tiny_llama, tiny_wan, wan_inputs
from streaming import streaming_config

ROOT = Path(__file__).resolve().parent.parent
SHARD = "20KB"  # small enough that the tiny models below are saved in several shards


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, torch.Tensor]:
    model = tiny_llama()
    with torch.no_grad():
        return model, first_tensor(model(llama_inputs()))


@pytest.fixture(scope="module")
def wan() -> tuple[nn.Module, torch.Tensor]:
    model = tiny_wan()
    with torch.no_grad():
        return model, first_tensor(model(**wan_inputs()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, llama, wan) -> dict[str, Path]:
    """Every layout: folders as save_pretrained writes them (whole and sharded), a file, an index file."""
    root = tmp_path_factory.mktemp("checkpoints")
    llama[0].save_pretrained(root / "llama")
    llama[0].save_pretrained(root / "llama_sharded", max_shard_size=SHARD)
    wan[0].save_pretrained(root / "wan")
    wan[0].save_pretrained(root / "wan_sharded", max_shard_size=SHARD)
    return {
        "llama": root / "llama",
        "llama_sharded": root / "llama_sharded",
        "llama_file": root / "llama" / "model.safetensors",
        "llama_index": root / "llama_sharded" / "model.safetensors.index.json",
        "wan": root / "wan",
        "wan_sharded": root / "wan_sharded",
        "wan_file": root / "wan" / "diffusion_pytorch_model.safetensors",
    }


def meta_llama(reference: nn.Module) -> nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(reference.config).eval()


def meta_wan(reference: nn.Module) -> nn.Module:
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        return WanTransformer3DModel.from_config(reference.config).eval()


def test_save_pretrained_wrote_the_layouts_named(saved: dict[str, Path]) -> None:
    assert len(list(saved["llama_sharded"].glob("model-*-of-*.safetensors"))) > 1
    assert len(list(saved["wan_sharded"].glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    assert (saved["wan_sharded"] / "diffusion_pytorch_model.safetensors.index.json").is_file()


@pytest.mark.parametrize("layout", ["llama", "llama_sharded", "llama_file", "llama_index"])
def test_meta_llama_from_each_layout_is_bitwise(layout: str, saved, llama) -> None:
    reference, expected = llama
    model = flextensor.offload(
        meta_llama(reference),
        streaming_config(meta_llama(reference), ["model.layers.*"]),
        weights=saved[layout],
    )
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 1), expected)
    assert flextensor.phase(model) == "inference"
    assert all(u.placement == "streamed" for u in flextensor.status(model).units)
    # transformers saves one of two tied weights: both names are one parameter again
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


def test_meta_llama_built_in_the_checkpoints_dtype_matches_from_pretrained_bitwise(tmp_path: Path) -> None:
    """docs/loading.md's recipe for a bfloat16 checkpoint: from_config(config, dtype=) on the meta device
    keeps the rotary table float32, as from_pretrained(dtype=) does, and every logit is the same;
    model.to(bfloat16) would cast the table too (and its logits differ)."""
    from transformers import AutoModelForCausalLM

    tiny_llama().to(torch.bfloat16).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = first_tensor(reference(llama_inputs()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(reference.config, dtype=torch.bfloat16).eval()
    model = flextensor.offload(model, streaming_config(model, ["model.layers.*"]), weights=tmp_path)
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 1), expected)
    assert all(u.placement == "streamed" for u in flextensor.status(model).units)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.device("meta"):
        cast = AutoModelForCausalLM.from_config(reference.config).to(torch.bfloat16)
    assert cast.model.rotary_emb.inv_freq.dtype == torch.bfloat16  # why the docs do not cast


@pytest.mark.parametrize("layout", ["wan", "wan_sharded", "wan_file"])
def test_meta_wan_from_each_layout_is_bitwise(layout: str, saved, wan) -> None:
    reference, expected = wan
    model = flextensor.offload(
        meta_wan(reference), streaming_config(meta_wan(reference), ["blocks.*"]), weights=saved[layout]
    )
    assert_all_equal(run_forwards(model, wan_inputs(), LEARN + 1), expected)
    assert flextensor.phase(model) == "inference"
    for name, buffer in reference.named_buffers():  # rotary tables: non-persistent, computed again
        assert torch.equal(model.get_buffer(name), buffer), name


def test_a_model_with_weights_takes_the_checkpoints(saved, llama) -> None:
    _, expected = llama
    model = tiny_llama(seed=5)  # same architecture, other values
    kept = model.model.layers[0].mlp.up_proj.weight
    model = flextensor.offload(model, streaming_config(model, ["model.layers.*"]), weights=saved["llama"])
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN), expected)
    assert model.model.layers[0].mlp.up_proj.weight is kept  # the user's parameter objects stay


def test_release_gives_back_a_normal_model(saved, llama) -> None:
    reference, expected = llama
    model = flextensor.offload(
        meta_llama(reference), flextensor.OffloadConfig(device="cpu"), weights=saved["llama"]
    )
    run_forwards(model, llama_inputs(), 1)
    flextensor.release(model, "cpu")
    assert_all_equal(run_forwards(model, llama_inputs(), 1), expected)
    assert all(p.device.type == "cpu" for p in model.parameters())


# -- bad checkpoints: a clear error, and the model as it was ----------------------------------------------


def _bad(tmp_path: Path, reference: nn.Module, change) -> Path:
    state = {k: v.clone() for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    change(state)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    return path


BAD = {
    "missing": (
        lambda s: s.pop("model.layers.1.mlp.down_proj.weight"),
        ["1 missing", "layers.1.mlp.down_proj"],
    ),
    "unexpected": (lambda s: s.update(extra=torch.zeros(3)), ["1 unexpected", "extra"]),
    "shape": (
        lambda s: s.update({"model.norm.weight": torch.ones(7)}),
        ["mismatched", "model.norm.weight", "[7]", "[32]"],
    ),
    "dtype": (
        lambda s: s.update({k: v.to(torch.bfloat16) for k, v in s.items()}),
        [
            "mismatched",
            "torch.bfloat16",
            "from_config(config, dtype=torch.bfloat16)",
            "model.to(torch.bfloat16)",
        ],
    ),
}


def _untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    with pytest.raises(NotOffloadedError):
        flextensor.status(model)
    after = dict(model.named_parameters()) | dict(model.named_buffers())
    assert after.keys() == before.keys()
    assert all(after[name] is tensor for name, tensor in before.items())
    assert all(t.device.type == "meta" for t in after.values())


@pytest.mark.parametrize("case", list(BAD))
def test_mismatched_checkpoint_is_refused_naming_the_tensors(case: str, tmp_path: Path, llama) -> None:
    change, words = BAD[case]
    path = _bad(tmp_path, llama[0], change)
    model = meta_llama(llama[0])
    before = dict(model.named_parameters()) | dict(model.named_buffers())
    with pytest.raises(CheckpointError) as caught:
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu"), weights=path)
    for word in words:
        assert word in str(caught.value)
    _untouched(model, before)


def test_keys_the_model_class_ignores_are_not_unexpected(tmp_path: Path, wan) -> None:
    """diffusers' Wan lists ``norm_added_q`` among the keys to ignore on load, as its from_pretrained does."""
    reference, expected = wan
    state = {**reference.state_dict(), "blocks.0.attn2.norm_added_q.weight": torch.ones(16)}
    save_file(state, str(tmp_path / "w.safetensors"))
    model = flextensor.offload(
        meta_wan(reference), flextensor.OffloadConfig(device="cpu"), weights=tmp_path / "w.safetensors"
    )
    assert_all_equal(run_forwards(model, wan_inputs(), 1), expected)


def _corrupt_header(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + b"{not json" + raw[17:])


def _huge_header_length(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes((2**40).to_bytes(8, "little") + raw[8:])


def _truncated(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])


@pytest.mark.parametrize(
    ("corrupt", "words"),
    [(_corrupt_header, "not JSON"), (_huge_header_length, "header length"), (_truncated, "truncated")],
)
def test_corrupt_file_is_refused(corrupt, words: str, tmp_path: Path, llama) -> None:
    path = _bad(tmp_path, llama[0], lambda s: None)
    corrupt(path)
    model = meta_llama(llama[0])
    before = dict(model.named_parameters()) | dict(model.named_buffers())
    with pytest.raises(CheckpointError, match="not a valid safetensors file") as caught:
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu"), weights=path)
    assert words in str(caught.value) and str(path) in str(caught.value)
    _untouched(model, before)


def test_paths_that_name_no_checkpoint(tmp_path: Path, saved, llama) -> None:
    model = meta_llama(llama[0])
    config = flextensor.OffloadConfig(device="cpu")
    with pytest.raises(CheckpointError, match="does not exist"):
        flextensor.offload(model, config, weights=tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"holds no \.safetensors"):
        flextensor.offload(model, config, weights=tmp_path)
    (tmp_path / "a.safetensors").write_bytes(saved["llama_file"].read_bytes())
    (tmp_path / "b.safetensors").write_bytes(saved["llama_file"].read_bytes())
    with pytest.raises(CheckpointError, match="several checkpoints"):
        flextensor.offload(model, config, weights=tmp_path)
    shards = shutil.copytree(saved["llama_sharded"], tmp_path / "shards")
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00009-of-00009.*incomplete"):
        flextensor.offload(model, config, weights=shards)


def test_meta_buffer_nothing_can_compute_is_refused(tmp_path: Path) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) * self.scale

    save_file(Scaled().state_dict(), str(tmp_path / "w.safetensors"))
    with torch.device("meta"):
        model = Scaled()
    before = dict(model.named_parameters()) | dict(model.named_buffers())
    with pytest.raises(CheckpointError, match=r"scale.*init_empty_weights"):
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu"), weights=tmp_path / "w.safetensors")
    _untouched(model, before)


def test_failure_after_reading_puts_the_meta_model_back(tmp_path: Path, saved, llama) -> None:
    """A profile that is not there fails once the weights are read and packed: the model is meta again."""
    model = meta_llama(llama[0])
    before = dict(model.named_parameters()) | dict(model.named_buffers())
    config = flextensor.OffloadConfig(device="cpu", profile=str(tmp_path / "missing.json"))
    with pytest.raises(flextensor.ProfileError, match="does not exist"):
        flextensor.offload(model, config, weights=saved["llama"])
    _untouched(model, before)


def test_failure_after_reading_gives_a_model_with_weights_its_own_values_back(tmp_path: Path, saved) -> None:
    model = tiny_llama(seed=5)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = flextensor.OffloadConfig(device="cpu", profile=str(tmp_path / "missing.json"))
    with pytest.raises(flextensor.ProfileError):
        flextensor.offload(model, config, weights=saved["llama"])
    after = model.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_a_pipeline_with_weights_is_refused(saved, llama) -> None:
    with pytest.raises(flextensor.UnsupportedOperationError, match="weights="):
        flextensor.offload(
            {"a": meta_llama(llama[0])}, flextensor.OffloadConfig(device="cpu"), weights=saved["llama"]
        )


# -- host memory -------------------------------------------------------------------------------------------

RSS_LAYERS, RSS_IN, RSS_OUT = 64, 1024, 1024  # 64 units of 4 MiB: 256 MiB of float32 weights, an 8 MiB arena

_RSS_CHILD = """
import sys, threading, time
import psutil, torch
from torch import nn
import flextensor

def build():
    return nn.Sequential(*[nn.Linear({n_in}, {n_out}, bias=False) for _ in range({layers})])

with torch.device("meta"):
    model = build()
process = psutil.Process()
peak = before = process.memory_info().rss
done = False

def sample():
    global peak
    while not done:
        peak = max(peak, process.memory_info().rss)
        time.sleep(0.002)

sampler = threading.Thread(target=sample)
sampler.start()
flextensor.offload(model, flextensor.OffloadConfig(device="cpu"), weights=sys.argv[1])
done = True
sampler.join()
peak = max(peak, process.memory_info().rss)
print(peak - before)
"""


def test_host_memory_grows_by_the_weights_only(tmp_path: Path) -> None:
    """Reading the checkpoint adds the packs and nothing else: no loaded copy, no mapped page cache."""
    torch.manual_seed(0)
    state = {f"{i}.weight": torch.randn(RSS_OUT, RSS_IN) for i in range(RSS_LAYERS)}
    weights = sum(t.numel() * t.element_size() for t in state.values())
    save_file(state, str(tmp_path / "big.safetensors"))
    del state
    child = _RSS_CHILD.format(layers=RSS_LAYERS, n_in=RSS_IN, n_out=RSS_OUT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FT_PROGRESS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(child), str(tmp_path / "big.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.strip().splitlines()[-1])
    assert growth <= 1.1 * weights, (
        f"RSS grew by {growth / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"
    )


# -- on the GPU machine -------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["llama", "llama_sharded"])
def test_cuda_meta_llama_from_checkpoint_is_bitwise(layout: str, saved, llama) -> None:
    """Packs page-locked from the reading threads, resident weights moved to the GPU from them."""
    with torch.no_grad():
        expected = first_tensor(tiny_llama().cuda()(llama_inputs().cuda()))
    config = flextensor.OffloadConfig(device="cuda", include_patterns=["model.layers.*"])
    model = flextensor.offload(meta_llama(llama[0]), config, weights=saved[layout])
    assert all(u.pinned for u in flextensor.status(model).units)
    assert model.lm_head.weight.device.type == "cuda"
    assert_all_equal(run_forwards(model, llama_inputs().cuda(), LEARN + 1), expected)


@pytest.mark.gpu
@needs_cuda
def test_probe_measures_parallel_registration() -> None:
    from flextensor.observe.probe import measure_parallel_host_register

    measured = measure_parallel_host_register(16 << 20, threads=4, repeats=1)
    assert measured.nbytes == 4 * (16 << 20) and measured.gbps > 0
