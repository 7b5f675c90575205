"""LTX-2 text-to-video (with its audio track) with every component offloaded by one flextensor call.

    python examples/ltx2.py --model-id Lightricks/LTX-2 --budget 8GiB
    python examples/ltx2.py --random-weights --tiny --compare-native

``LTX2Pipeline`` runs a Gemma 3 text encoder, the text connectors, the audio-video transformer at every
step, then the video VAE's decode, the audio VAE's decode and the vocoder: seven components under one
budget (see docs/pipelines.md). The mp4 holds the video; the audio is generated (and offloaded) too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from example_common import PROMPT_WORDS, Example, generator, main, word_tokenizer


def load(args: argparse.Namespace) -> Any:
    from diffusers import LTX2Pipeline

    return LTX2Pipeline.from_pretrained(args.model_id, torch_dtype=args.dtype)


def build_tiny(args: argparse.Namespace) -> Any:
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = word_tokenizer(PROMPT_WORDS)
    torch.manual_seed(args.seed)
    text_layers = 2
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=dict(vocab_size=len(tokenizer) + 3, hidden_size=32, intermediate_size=32,
                             num_hidden_layers=text_layers, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=8, max_position_embeddings=64, sliding_window=8),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, image_size=16, patch_size=8),
            mm_tokens_per_image=4, image_token_index=len(tokenizer), boi_token_index=len(tokenizer) + 1,
            eoi_token_index=len(tokenizer) + 2,
        )
    )  # fmt: skip
    torch.manual_seed(args.seed + 1)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
        qk_norm="rms_norm_across_heads", caption_channels=32, rope_double_precision=False, rope_type="split",
    )  # fmt: skip
    torch.manual_seed(args.seed + 2)
    connectors = LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=text_layers + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split",
    )  # fmt: skip
    torch.manual_seed(args.seed + 3)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
        decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
        upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    )  # fmt: skip
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(args.seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None,
        in_channels=2, resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height",
        dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
        mel_bins=8,
    )  # fmt: skip
    torch.manual_seed(args.seed + 5)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    )  # fmt: skip
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    return pipe if args.dtype == torch.float32 else pipe.to(args.dtype)


def call_kwargs(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "prompt": args.prompt,
        "negative_prompt": "blurry, bad quality",
        "num_frames": args.frames,
        "height": args.height,
        "width": args.width,
        "frame_rate": float(args.fps),
        "num_inference_steps": args.steps,
        "generator": generator(args),
        "output_type": "np",
        "max_sequence_length": 16 if args.tiny else 1024,
    }


EXAMPLE = Example(
    name="ltx2",
    description="LTX-2 text-to-video with audio, every component offloaded by one flextensor call.",
    load=load,
    build_tiny=build_tiny,
    call_kwargs=call_kwargs,
    defaults={"steps": 40, "frames": 121, "height": 512, "width": 768, "fps": 24},
    tiny_defaults={"steps": 2, "frames": 5, "height": 32, "width": 32, "fps": 25},
)

if __name__ == "__main__":
    sys.exit(main(EXAMPLE))
