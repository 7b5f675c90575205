"""Wan2.2 text-to-video (A14B: two experts) with every component offloaded by one flextensor call.

    python examples/wan2_2_t2v.py --model-id Wan-AI/Wan2.2-T2V-A14B-Diffusers --budget 8GiB
    python examples/wan2_2_t2v.py --random-weights --tiny --compare-native

The high-noise expert (``transformer``) runs the first steps, the low-noise one (``transformer_2``) the
rest (``boundary_ratio``); the UMT5 text encoder runs first and the VAE decode last. All four share the
one budget (see docs/pipelines.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from example_common import PROMPT_WORDS, Example, generator, main, word_tokenizer


def load(args: argparse.Namespace) -> Any:
    from diffusers import AutoencoderKLWan, WanPipeline

    # The Wan VAE is meant to run in float32 (its decode is sensitive to rounding).
    vae = AutoencoderKLWan.from_pretrained(args.model_id, subfolder="vae", torch_dtype=torch.float32)
    return WanPipeline.from_pretrained(args.model_id, vae=vae, torch_dtype=args.dtype)


def build_tiny(args: argparse.Namespace) -> Any:
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    def expert(seed: int) -> WanTransformer3DModel:
        torch.manual_seed(seed)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32,
        )  # fmt: skip

    torch.manual_seed(args.seed)
    tokenizer = word_tokenizer(PROMPT_WORDS)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16)
    )  # fmt: skip
    vae = AutoencoderKLWan(
        base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
        latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 2.0, 1.0, 2.5],
        scale_factor_temporal=2, scale_factor_spatial=2,
    )  # fmt: skip
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=expert(args.seed + 1),
        transformer_2=expert(args.seed + 2),
        boundary_ratio=0.875,  # Wan2.2-T2V-A14B's switch point
    )
    return pipe if args.dtype == torch.float32 else pipe.to(args.dtype)


def call_kwargs(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "prompt": args.prompt,
        "negative_prompt": "blurry, bad quality",
        "num_frames": args.frames,
        "height": args.height,
        "width": args.width,
        "num_inference_steps": args.steps,
        "guidance_scale": 4.0,
        "guidance_scale_2": 3.0,  # the low-noise expert's
        "generator": generator(args),
        "output_type": "np",
        "max_sequence_length": 8 if args.tiny else 512,
    }


EXAMPLE = Example(
    name="wan2_2_t2v",
    description="Wan2.2 text-to-video, both experts, every component offloaded by one flextensor call.",
    load=load,
    build_tiny=build_tiny,
    call_kwargs=call_kwargs,
    defaults={"steps": 40, "frames": 81, "height": 480, "width": 832, "fps": 16},
    tiny_defaults={"steps": 4, "frames": 5, "height": 32, "width": 32, "fps": 8},
)

if __name__ == "__main__":
    sys.exit(main(EXAMPLE))
