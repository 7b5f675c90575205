"""Compressed size per weight kind, and the encoder's speed (CPU only; the numbers in docs/compression.md).

    python -m benchmarks.codec_sizes            # every kind; about a minute on a few cores
    python -m benchmarks.codec_sizes --quick    # smaller shapes

For each kind of weight it prints the size of flextensor's codec (fixed-width code per chunk, what
``codec.encode`` writes, index included) over the raw size, and two references computed from the same
per-chunk symbol histograms: a per-chunk canonical Huffman code of the symbol byte (its payload only: no
table, no index, no offsets for parallel decoding, so a lower bound on any Huffman format), and the
entropy bound (literal byte + the per-tensor entropy of the symbol byte).
"""

from __future__ import annotations

import argparse
import heapq
import math
import time
from collections.abc import Iterator

import torch
from torch import nn

from flextensor import codec

LLAMA_8B_LAYER = {  # (out_features, in_features) of one Llama-3-8B decoder layer's linears
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}


def benchmark_weights(quick: bool, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """N(0, 1) / sqrt(fan_in), the issue's benchmark weights, in Llama-3-8B layer shapes."""
    generator = torch.Generator().manual_seed(0)
    for name, (rows, cols) in LLAMA_8B_LAYER.items():
        rows = rows // 8 if quick else rows
        yield name, (torch.randn(rows, cols, generator=generator) / math.sqrt(cols)).to(dtype)


def wider_weights() -> Iterator[tuple[str, torch.Tensor]]:
    """Stand-ins for trained weights, whose exponents spread wider than a Gaussian's (2048 x 2048, bf16)."""
    generator = torch.Generator().manual_seed(0)
    shape = (2048, 2048)

    def row_scales(sigma: float) -> torch.Tensor:
        return torch.exp(torch.randn(shape[0], 1, generator=generator) * sigma)

    torch.manual_seed(0)  # torch.distributions sample from the global generator
    kinds = {
        "rows scaled by lognormal(0, 0.5)": torch.randn(shape, generator=generator) * row_scales(0.5),
        "rows scaled by lognormal(0, 1)": torch.randn(shape, generator=generator) * row_scales(1.0),
        "Student-t, 3 degrees of freedom": torch.distributions.StudentT(3.0).sample(shape),
        "Laplace": torch.distributions.Laplace(0.0, 1.0).sample(shape),
    }
    for name, values in kinds.items():
        yield name, (values / math.sqrt(shape[1])).to(torch.bfloat16)


def transformers_llama(quick: bool) -> nn.Module:
    """A LlamaForCausalLM initialised by transformers (normal(0, 0.02) linears and embeddings, unit norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 1024 if quick else 2048
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 3.5),
        num_hidden_layers=2,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 512,
        vocab_size=32000,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def wan_block(quick: bool) -> nn.Module:
    """A diffusers Wan transformer block, randomly initialised: Wan 2.1 14B's width (1.3B's with --quick)."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    dim, ffn, heads = (1536, 8960, 12) if quick else (5120, 13824, 40)
    return WanTransformerBlock(dim, ffn, heads, cross_attn_norm=True).to(torch.bfloat16)


def parameter_kind(name: str, tensor: torch.Tensor) -> str:
    if tensor.dim() == 1:
        return "bias" if name.endswith("bias") else "norm / 1-D"
    if "embed" in name or "lm_head" in name:
        return "embedding"
    return "linear weight" if tensor.dim() == 2 else "other"


def huffman_bits(counts: list[int]) -> int:
    """Payload bits of a Huffman code of these symbol counts (one symbol: 1 bit each)."""
    present = [c for c in counts if c]
    if len(present) <= 1:
        return sum(present)
    heap = [(c, 0) for c in present]  # (weight, internal bits so far)
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        a, _ = heapq.heappop(heap)
        b, _ = heapq.heappop(heap)
        total += a + b  # every symbol below a merge gets one more bit
        heapq.heappush(heap, (a + b, 0))
    return total


def symbol_bytes(tensor: torch.Tensor) -> torch.Tensor:
    from flextensor.codec.format import split_bytes

    pairs = tensor.reshape(-1).contiguous().view(torch.uint8).view(-1, 2)
    return split_bytes(pairs, tensor.dtype)[1]


def reference_sizes(tensors: list[torch.Tensor], chunk: int) -> tuple[float, float]:
    """(Huffman payload bytes with per-chunk codes, entropy-bound bytes) summed over ``tensors``."""
    huffman = entropy = 0.0
    for tensor in tensors:
        symbols = symbol_bytes(tensor)
        n = symbols.numel()
        counts = torch.bincount(symbols.to(torch.int64), minlength=256).double()
        p = counts[counts > 0] / n
        entropy += n + n * float(-(p * p.log2()).sum()) / 8
        num_chunks = -(-n // chunk)
        step = max(1, num_chunks // 2000)  # a sample of chunks, evenly spread, keeps this fast
        sampled = range(0, num_chunks, step)
        bits = sum(
            huffman_bits(
                torch.bincount(symbols[c * chunk : (c + 1) * chunk].to(torch.int64), minlength=256).tolist()
            )
            for c in sampled
        )
        sampled_values = sum(min(chunk, n - c * chunk) for c in sampled)
        huffman += n + bits / 8 * n / sampled_values
    return huffman, entropy


def measure(label: str, named: list[tuple[str, torch.Tensor]]) -> None:
    groups: dict[str, list[torch.Tensor]] = {}
    for name, tensor in named:
        groups.setdefault(parameter_kind(name, tensor), []).append(tensor.detach())
    for kind, tensors in groups.items():
        raw = sum(t.numel() * t.element_size() for t in tensors)
        start = time.perf_counter()
        encoded = [codec.encode(t) for t in tensors]
        seconds = time.perf_counter() - start
        for t, e in zip(tensors, encoded, strict=True):
            assert torch.equal(codec.decode(e).view(torch.int16), t.view(torch.int16)), "not lossless"
        ours = sum(e.nbytes for e in encoded)
        huffman, entropy = reference_sizes(tensors, codec.DEFAULT_CHUNK_ELEMENTS)
        print(
            f"| {label} | {kind} | {sum(t.numel() for t in tensors) / 1e6:.1f} M | {ours / raw:.3f} | "
            f"{huffman / raw:.3f} | {entropy / raw:.3f} | {raw / seconds / 1e9:.2f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller shapes (an eighth of the rows)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    print("| weights | kind | values | ours | Huffman payload | entropy bound | encode GB/s |")
    print("|---|---|---|---|---|---|---|")
    measure(
        "Llama-3-8B layer shapes, N(0, 1/sqrt(fan_in)), bf16",
        list(benchmark_weights(args.quick, torch.bfloat16)),
    )
    measure("same, fp16", list(benchmark_weights(args.quick, torch.float16)))
    measure(
        "transformers LlamaForCausalLM init, bf16", list(transformers_llama(args.quick).named_parameters())
    )
    measure("diffusers WanTransformerBlock init, bf16", list(wan_block(args.quick).named_parameters()))
    for name, tensor in wider_weights():
        measure(f"{name}, bf16", [("weight", tensor)])


if __name__ == "__main__":
    main()
