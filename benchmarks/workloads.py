"""Benchmark workloads: real library model classes with seeded random bf16 weights, cached on local disk.

Nothing is downloaded. A model is built with its parameters on the meta device (fast, no memory), then
its weights are either loaded from the on-disk cache (safetensors) or generated from per-parameter seeds
and saved there. Weights are generated on the GPU when the run targets one: 15-30 GB of ``randn`` on
the CPU takes minutes, on the GPU well under a second. The generator device is part of the cache key,
so a CPU-built and a GPU-built cache never mix; within one invocation every method sees the same file.

``wan20`` and ``llama32`` are the anchor workloads of ``shared/anchors/README.md``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch is imported where it is used: the parent process never needs it (stays light)
    import torch
    from torch import nn

GIB = 1 << 30
# Bump when the weight recipe changes: it is part of the cache key, so old caches stop matching.
GEN_VERSION = 1

Kind = Literal["wan", "llama_prefill", "llama_decode", "wan_pipeline"]


@dataclass(frozen=True)
class Workload:
    """One model and one input shape.

    ``unit``: the offload-unit pattern (module-path glob) every offloading method is given.
    ``shape``: input sizes (see :func:`make_inputs`). ``memory_cap_bytes``: the GPU memory every method
    runs under (``torch.cuda.set_per_process_memory_fraction``), to stand in for a smaller card.
    ``methods``: what ``benchmarks.run`` runs when ``--methods`` is not given (methods that cannot run on
    the chosen device are recorded as skipped, with the reason).
    """

    name: str
    kind: Kind
    model_kwargs: Mapping[str, Any]
    unit: str
    shape: Mapping[str, Any]
    description: str
    methods: tuple[str, ...] = ()
    memory_cap_bytes: int | None = None
    seed: int = 0
    tiny: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)


# Wan2.2-A14B transformer block config (diffusers' WanTransformer3DModel argument names).
WAN_A14B: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
WAN_TINY: dict[str, Any] = {
    **WAN_A14B,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 3,
}
# Llama-3.1-8B config (transformers' LlamaConfig argument names); plain rope, no scaling, as the anchors.
LLAMA_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
LLAMA_TINY: dict[str, Any] = {
    **LLAMA_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}

# Default method lists, sized so a full comparison fits one 10-minute call on the GPU machine. Budgets
# are decimal GB like the anchors' targets; several budgets trace ours' time-against-memory curve.
# flextensor 0.5.0's fraction variant only where the anchors show it changes something (llama32).
_WAN_METHODS = ("native", "ours", "ours_budget:5.7GB", "flextensor050", "diffusers_group", "accelerate")
_LLAMA_METHODS = (
    "native",
    "ours",
    "ours_budget:7GB",
    "ours_budget:10GB",
    "ours_budget:13GB",
    "flextensor050",
    "flextensor050_frac:0.05",
    "diffusers_group",
    "diffusers_group:model",
    "accelerate",
)
# Decode: plain diffusers_group is left out, since on a transformers LLM it onloads the whole model as one
# group (llama32 shows it); `diffusers_group:model` reaches the decoder layers.
_DECODE_METHODS = (
    "native",
    "ours",
    "ours_budget:8GB",
    "ours_budget:12GB",
    "flextensor050",
    "diffusers_group:model",
    "accelerate",
)

# Whole pipelines: the peers applied the way each documents for a pipeline (see methods.py).
_PIPELINE_METHODS = (
    "native",
    "ours_budget:8GiB",
    "ours/cap=24GiB",
    "diffusers_model_offload",
    "diffusers_group",
    "flextensor050",
    "diffusers_sequential_offload",
)


def _wan22_pipeline_kwargs(tiny: bool) -> dict[str, Any]:
    from .pipeline_workload import UMT5_TINY, UMT5_XXL, WAN_VAE, WAN_VAE_TINY

    return {
        "transformer": WAN_TINY if tiny else {**WAN_A14B, "num_layers": 40},
        "text_encoder": UMT5_TINY if tiny else UMT5_XXL,
        "vae": WAN_VAE_TINY if tiny else WAN_VAE,
        "boundary_ratio": 0.875,  # Wan2.2-T2V-A14B's switch to the low-noise expert
        "shift": 12.0,  # its sampling shift: with 4 steps, timesteps 1000, 960 | 857, 12: two per expert
    }


# Tiny smoke workloads: every method that has a CPU path (flextensor 0.5.0 is recorded as skipped there).
_TINY_METHODS = ("native", "ours", "ours_budget:256KiB", "diffusers_group", "accelerate", "flextensor050")

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="wan20",
            kind="wan",
            model_kwargs={**WAN_A14B, "num_layers": 20},
            unit="blocks.*",
            shape={"latent": (1, 16, 21, 60, 104), "text_len": 512, "timestep": 500},
            description="Wan2.2-A14B transformer cut to 20 blocks (14.5 GB bf16), one denoising step of "
            "81 frames at 832x480 (latent 1x16x21x60x104, 512 text tokens): compute-heavy",
            methods=_WAN_METHODS,
        ),
        Workload(
            name="wan40",
            kind="wan",
            model_kwargs={**WAN_A14B, "num_layers": 40},
            unit="blocks.*",
            shape={"latent": (1, 16, 21, 60, 104), "text_len": 512, "timestep": 500},
            description="Wan2.2-A14B transformer, all 40 blocks (29 GB bf16), same step as wan20, every "
            "method capped at 24 GiB of GPU memory (a consumer card): native does not fit",
            # flextensor 0.5.0's default (latency mode) sizes itself from the whole card, not the cap:
            # under a 24 GiB card a user gives it a budget, as here.
            methods=(
                "native",
                "native_ref",
                "ours",
                "ours_budget:22GiB",
                "flextensor050_budget:22GiB",
                "diffusers_group",
                "accelerate",
            ),
            memory_cap_bytes=24 * GIB,
        ),
        Workload(
            name="llama32",
            kind="llama_prefill",
            model_kwargs=LLAMA_8B,
            unit="model.layers.*",
            shape={"batch": 1, "seq_len": 4096},
            description="Llama-3.1-8B config (16.1 GB bf16), one prefill of 1x4096 tokens, use_cache=False, "
            "logits of the last token: transfer-heavy",
            methods=_LLAMA_METHODS,
        ),
        Workload(
            name="llama32_decode_b1",
            kind="llama_decode",
            model_kwargs=LLAMA_8B,
            unit="model.layers.*",
            shape={"batch": 1, "cache_len": 4096},
            description="Llama-3.1-8B config, one new token on a 4096-token KV cache (random K/V), batch 1",
            methods=_DECODE_METHODS,
        ),
        Workload(
            name="llama32_decode_b1_static",
            kind="llama_decode",
            model_kwargs=LLAMA_8B,
            unit="model.layers.*",
            shape={"batch": 1, "cache_len": 4096, "static_cache": True},
            description="Llama-3.1-8B config, one new token on a 4096-token transformers StaticCache (random "
            "K/V), batch 1: every step the same addresses, as CUDA graphs need",
            methods=(
                "native",
                "native/compile=graphs",
                "ours_budget:8GB",
                "ours_budget:8GB/compile=graphs",
            ),
        ),
        Workload(
            name="llama32_decode_b32",
            kind="llama_decode",
            model_kwargs=LLAMA_8B,
            unit="model.layers.*",
            shape={"batch": 32, "cache_len": 4096},
            description="Llama-3.1-8B config, one new token on a 4096-token KV cache (random K/V, 17 GB), "
            "batch 32",
            # The 17 GB KV cache stays on the GPU whatever the method: budgets start above it.
            methods=(
                "native",
                "ours",
                "ours_budget:24GB",
                "ours_budget:28GB",
                "flextensor050",
                "diffusers_group:model",
                "accelerate",
            ),
        ),
        Workload(
            name="wan22_pipeline",
            kind="wan_pipeline",
            model_kwargs=_wan22_pipeline_kwargs(tiny=False),
            unit="",  # a pipeline's own default units: each component's repeated blocks
            shape={
                "height": 480,
                "width": 832,
                "num_frames": 81,
                "steps": 4,
                "guidance": 4.0,
                "guidance_2": 3.0,
                "text_len": 512,
            },
            description="Wan2.2-T2V-A14B pipeline at its real config (two 40-block experts, UMT5-XXL, Wan "
            "VAE; 69 GB bf16), one generation of 81 frames at 832x480, guidance on, 4 steps (2 per "
            "expert), VAE decode",
            methods=_PIPELINE_METHODS,
            extra={"cache": False},  # 69 GB: generated on the GPU each run, never written to disk
        ),
        # Tiny variants: same classes and code paths, a few MB, for the CPU smoke test.
        Workload(
            name="wan_tiny",
            kind="wan",
            model_kwargs=WAN_TINY,
            unit="blocks.*",
            shape={"latent": (1, 16, 3, 16, 16), "text_len": 8, "timestep": 500},
            description="tiny WanTransformer3DModel (3 blocks), CPU smoke",
            methods=_TINY_METHODS,
            tiny=True,
        ),
        Workload(
            name="llama_tiny",
            kind="llama_prefill",
            model_kwargs=LLAMA_TINY,
            unit="model.layers.*",
            shape={"batch": 1, "seq_len": 32},
            description="tiny LlamaForCausalLM (3 layers), prefill, CPU smoke",
            methods=_TINY_METHODS,
            tiny=True,
        ),
        Workload(
            name="llama_tiny_decode",
            kind="llama_decode",
            model_kwargs=LLAMA_TINY,
            unit="model.layers.*",
            shape={"batch": 2, "cache_len": 48},
            description="tiny LlamaForCausalLM (3 layers), one token on a 48-token KV cache, CPU smoke",
            methods=("native", "ours", "diffusers_group:model", "accelerate"),
            tiny=True,
        ),
        Workload(
            name="llama_tiny_decode_static",
            kind="llama_decode",
            model_kwargs=LLAMA_TINY,
            unit="model.layers.*",
            shape={"batch": 2, "cache_len": 48, "static_cache": True},
            description="tiny LlamaForCausalLM (3 layers), one token on a 48-token StaticCache, CPU smoke",
            methods=("native", "ours", "ours/compile=whole"),
            tiny=True,
        ),
        Workload(
            name="wan22_pipeline_tiny",
            kind="wan_pipeline",
            model_kwargs=_wan22_pipeline_kwargs(tiny=True),
            unit="",
            shape={
                "height": 16,
                "width": 16,
                "num_frames": 1,
                "steps": 4,
                "guidance": 4.0,
                "guidance_2": 3.0,
                "text_len": 8,
            },
            description="tiny two-expert Wan2.2 pipeline, CPU smoke",
            methods=(
                "native",
                "ours",
                "ours_budget:600KiB",
                "diffusers_group",
                "diffusers_model_offload",
                "diffusers_sequential_offload",
            ),
            tiny=True,
            extra={"cache": False},
        ),
    )
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


# ---------------------------------------------------------------------------------------------------
# Model construction


def llama_config(w: Workload) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**dict(w.model_kwargs))


def build_empty(w: Workload) -> nn.Module:
    """The model with parameters on the meta device and real (CPU, float32) buffers, in eval mode.

    Buffers stay real because they are computed at construction (rotary tables) and are not weights;
    ``init_empty_weights(include_buffers=False)`` is the one helper that does exactly that.
    """
    from accelerate import init_empty_weights

    if w.kind == "wan_pipeline":
        from .pipeline_workload import build_pipeline

        return build_pipeline(dict(w.model_kwargs), w.tiny)
    with init_empty_weights(include_buffers=False):
        if w.kind == "wan":
            from diffusers import WanTransformer3DModel

            model: nn.Module = WanTransformer3DModel(**dict(w.model_kwargs))
        else:
            from transformers import LlamaForCausalLM

            model = LlamaForCausalLM(llama_config(w))
    return model.eval()


def param_nbytes(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes each parameter has once materialised in ``dtype`` (bf16); valid on a meta model."""
    import torch

    size = torch.empty((), dtype=dtype or torch.bfloat16).element_size()
    return {name: p.numel() * size for name, p in model.named_parameters()}


def _seed_for(w: Workload, name: str) -> int:
    # Per-parameter seeds: the values do not depend on creation order or on which parameters exist.
    return (w.seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF


def _random_param(w: Workload, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Seeded bf16 values scaled so a deep stack of them gives finite, non-degenerate outputs."""
    import torch

    if len(shape) == 1 and "norm" in name and name.endswith("weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)  # norm gains: identity
    gen = torch.Generator(device=device).manual_seed(_seed_for(w, name))
    t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(generator=gen)
    fan_in = math.prod(shape[1:]) if len(shape) >= 2 else 0
    scale = fan_in**-0.5 if fan_in else 0.02  # 1/sqrt(fan_in) keeps activations O(1); biases small
    return t.mul_(scale)


def cache_dir() -> Path | None:
    """``FLEXTENSOR_BENCH_CACHE`` (``off`` disables caching), else ``~/.cache/flextensor-bench``."""
    value = os.environ.get("FLEXTENSOR_BENCH_CACHE", "")
    if value.lower() in ("off", "0", "none", "false"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "flextensor-bench"


def cache_path(w: Workload, generated_on: str) -> Path | None:
    """The cache file of ``w``'s weights: keyed by the model, not the workload, so the prefill and decode
    workloads of one model share it."""
    root = cache_dir()
    if root is None:
        return None
    family = {"wan": "wan", "wan_pipeline": "wan_pipeline"}.get(w.kind, "llama")
    key = {
        "family": family,
        "model": dict(w.model_kwargs),
        "seed": w.seed,
        "gen": GEN_VERSION,
        "on": generated_on,
    }
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=list).encode()).hexdigest()[:12]
    return root / f"{family}-{digest}.safetensors"


def load_weights(w: Workload, model: nn.Module, device: str) -> dict[str, Any]:
    """Give ``model`` (from :func:`build_empty`) its weights on the CPU; return how they were obtained.

    Loaded from the cache when present, else generated (on the GPU if ``device`` is one) and saved.
    """
    import torch
    from safetensors.torch import load_file, save_file

    gen_device = torch.device(device if device.startswith("cuda") else "cpu")
    path = cache_path(w, gen_device.type) if w.extra.get("cache", True) else None
    info: dict[str, Any] = {"cache_path": str(path) if path else None, "generated_on": gen_device.type}
    t0 = time.perf_counter()
    if path is not None and path.exists():
        state = load_file(str(path), device="cpu")
        info["built"] = False
    else:
        state = {}
        for name, p in model.named_parameters():
            state[name] = _random_param(w, name, tuple(p.shape), gen_device).to("cpu")
        if gen_device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand the generation scratch back before anything is measured
        info["built"] = True
        info["build_s"] = round(time.perf_counter() - t0, 3)
        if path is not None:
            t1 = time.perf_counter()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save_file(state, str(tmp))
            tmp.replace(path)  # atomic: a killed build never leaves a half file under the real name
            info["save_s"] = round(time.perf_counter() - t1, 3)
    names = {n for n, _ in model.named_parameters()}
    if set(state) != names:
        raise RuntimeError(f"cache {path} does not match the model: delete it and run again")
    model.load_state_dict(state, strict=False, assign=True)
    if w.kind == "wan_pipeline":
        # Built on the meta device, UMT5's token embedding and `shared` came out as two weights; loaded
        # from a checkpoint (from_pretrained) they are one, 2.1 GB on the real config.
        model.pipe.text_encoder.tie_weights()
    for p in model.parameters():
        p.requires_grad_(False)
    info["load_s"] = round(time.perf_counter() - t0, 3)
    return info


# ---------------------------------------------------------------------------------------------------
# Inputs and one step


@functools.cache
def _cache_kwarg() -> str:
    # transformers renamed ``past_key_values`` to ``cache`` (the old name is deprecated, then removed).
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def make_inputs(w: Workload, device: str) -> dict[str, Any]:
    """Seeded inputs on ``device``. Small ones are drawn on the CPU (same values on any machine); the KV
    cache of the decode workloads is drawn on the device (17 GB at batch 32)."""
    import torch

    if w.kind == "wan_pipeline":
        from .pipeline_workload import pipeline_inputs

        return pipeline_inputs(dict(w.shape))
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1234 + w.seed)
    s = w.shape
    if w.kind == "wan":
        latent = torch.randn(s["latent"], generator=gen).to(torch.bfloat16)
        text = torch.randn((s["latent"][0], s["text_len"], w.model_kwargs["text_dim"]), generator=gen)
        return {
            "hidden_states": latent.to(dev),
            "timestep": torch.full((s["latent"][0],), s["timestep"], dtype=torch.long, device=dev),
            "encoder_hidden_states": text.to(torch.bfloat16).to(dev),
            "return_dict": False,
        }
    vocab = w.model_kwargs["vocab_size"]
    if w.kind == "llama_prefill":
        ids = torch.randint(0, vocab, (s["batch"], s["seq_len"]), generator=gen)
        return {"input_ids": ids.to(dev), "use_cache": False, "logits_to_keep": 1}
    # decode: one new token per sequence on a full KV cache
    cfg = llama_config(w)
    ids = torch.randint(0, vocab, (s["batch"], 1), generator=gen)
    if s.get("static_cache"):
        return _static_decode_inputs(w, cfg, ids.to(dev), dev)
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    for layer, k, v in _random_kv(w, cfg, dev):
        cache.update(k, v, layer)
        del k, v
    if not hasattr(cache, "layers"):
        raise RuntimeError("this transformers' DynamicCache has no .layers: the decode reset needs it")
    return {"input_ids": ids.to(dev), _cache_kwarg(): cache, "use_cache": True, "logits_to_keep": 1}


def _random_kv(w: Workload, cfg: Any, dev: Any) -> Iterator[tuple[int, Any, Any]]:
    """Seeded random keys and values of every layer, drawn on ``dev``, one layer at a time."""
    import torch

    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_shape = (w.shape["batch"], cfg.num_key_value_heads, w.shape["cache_len"], head_dim)
    dgen = torch.Generator(device=dev).manual_seed(4321 + w.seed)
    for layer in range(cfg.num_hidden_layers):
        k = torch.empty(kv_shape, dtype=torch.bfloat16, device=dev).normal_(generator=dgen)
        v = torch.empty(kv_shape, dtype=torch.bfloat16, device=dev).normal_(generator=dgen)
        yield layer, k, v


def _static_decode_inputs(w: Workload, cfg: Any, ids: Any, dev: Any) -> dict[str, Any]:
    # A StaticCache one position longer than the random cache: every step writes its token's K/V at
    # position cache_len, the same slot with the same values, so every step sees the same cache at the same
    # addresses (nothing to cut back, as CUDA graphs need).
    import torch
    from transformers import StaticCache

    length = w.shape["cache_len"]
    cache = StaticCache(config=cfg, max_cache_len=length + 1)
    filled = torch.arange(length, device=dev)
    for layer, k, v in _random_kv(w, cfg, dev):
        cache.update(k, v, layer, {"cache_position": filled})
        del k, v
    import torch._dynamo

    for layer in cache.layers:  # the length count a step advances: a static input for CUDA-graph trees
        counted = getattr(layer, "cumulative_length", None)
        if isinstance(counted, torch.Tensor):
            torch._dynamo.mark_static_address(counted)
    position = torch.tensor([length], device=dev)
    return {"input_ids": ids, _cache_kwarg(): cache, "cache_position": position, "use_cache": True,
            "logits_to_keep": 1}  # fmt: skip


def _rewind_cache(cache: Any, length: int, static: bool) -> None:
    # Each decode step appends one token; cut it off so every step sees the same 4k cache. A static
    # layer rewrites the same position every step; one that counts its own length (transformers >= 5.2x)
    # has its count set back in place (its address is static).
    for layer in cache.layers:
        if static:
            counted = getattr(layer, "cumulative_length", None)
            if counted is not None:
                counted.fill_(length)
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def run_step(model: Any, w: Workload, inputs: dict[str, Any]) -> torch.Tensor:
    """One forward; returns the tensor every method's output is compared on."""
    out = model(**inputs)
    if w.kind == "wan_pipeline":
        return out  # the decoded frames
    if w.kind == "wan":
        return out[0]
    if w.kind == "llama_decode":
        _rewind_cache(inputs[_cache_kwarg()], w.shape["cache_len"], static=bool(w.shape.get("static_cache")))
    return out.logits
