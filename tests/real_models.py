"""Small random-weight models from real library classes (transformers, diffusers), built on CPU."""

from __future__ import annotations

import torch


def tiny_llama(
    seed: int = 0,
    layers: int = 3,
    tie: bool = True,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 64,
):
    """A LlamaForCausalLM with random weights; the defaults make it tiny."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden if hidden > 32 else 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def llama_inputs(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g)


def tiny_wan(seed: int = 0, layers: int = 2):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=32,
    ).eval()


def wan_inputs(seed: int = 1, frames: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 4, frames, 8, 8, generator=g),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
    }


def tiny_tokenizer():
    """A word-level tokenizer built here (nothing downloaded): enough for a pipeline's prompt encoding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", "a", "cat", "dog", "runs", "in", "the", "snow", "blurry", "bad"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_wan_pipeline(seed: int = 0):
    """A Wan2.2-style text-to-video pipeline, two experts (transformer for high noise, transformer_2 for
    low noise), a UMT5 text encoder and a Wan VAE, every part tiny and random."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=12, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16)
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(
        base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
        latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 2.0, 1.0, 2.5],
    ).eval()  # fmt: skip
    return WanPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan(seed + 2),
        transformer_2=tiny_wan(seed + 3),
        boundary_ratio=0.5,
    )


def run_wan_pipeline(pipe, steps: int = 4) -> torch.Tensor:
    """One seeded generation: guidance on, both experts (the switch at half the steps), the VAE decode."""
    return pipe(
        prompt="a cat runs in the snow",
        negative_prompt="blurry",
        height=16,
        width=16,
        num_frames=1,
        num_inference_steps=steps,
        guidance_scale=3.0,
        generator=torch.Generator().manual_seed(7),
        output_type="pt",
        max_sequence_length=8,
    ).frames


def tiny_flux(seed: int = 0, layers: int = 2, single_layers: int = 4):
    """A FluxTransformer2DModel with random weights: its single-stream blocks return two slices of one
    tensor (views), its double-stream blocks a tuple of two tensors."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4),
    ).eval()


def flux_inputs(seed: int = 1, image_tokens: int = 16, text_tokens: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, image_tokens, 8, generator=g),
        "encoder_hidden_states": torch.randn(1, text_tokens, 16, generator=g),
        "pooled_projections": torch.randn(1, 16, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.randint(0, 4, (image_tokens, 3), generator=g).float(),
        "txt_ids": torch.zeros(text_tokens, 3),
    }
