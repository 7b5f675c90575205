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
