"""The CPU reference decoder: the format's meaning in torch ops, vectorised over whole chunks.

It computes, for every element at once, what the GPU kernel (triton_decoder.py) computes per thread: the
code at bit ``j * width`` of its chunk, table entry or escape (an escape's byte found by a prefix sum over
the chunk), then the literal and symbol bytes joined. The GPU decoder must match it bit for bit, and the
engine uses it where ``device="cpu"``, so the CPU tests run the real format.
"""

from __future__ import annotations

import torch

from flextensor.codec.format import LITERAL_WIDTH, EncodedTensor, join_bytes
from flextensor.errors import CodecError

__all__ = ["decode_reference"]

_BATCH_ELEMENTS = 1 << 21


def decode_reference(encoded: EncodedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a CPU-resident ``encoded`` into ``out`` (a new tensor if None) and return it."""
    if encoded.data.device.type != "cpu":
        raise CodecError(f"the reference decoder reads CPU streams; this one is on {encoded.data.device}")
    with torch.device("cpu"):  # its temporaries, whatever default device the caller set (vLLM sets one)
        return _decode_reference(encoded, out)


def _decode_reference(encoded: EncodedTensor, out: torch.Tensor | None) -> torch.Tensor:
    encoded.check()
    out = _output_for(encoded, out)
    flat = out.view(-1)
    if not encoded.coded:
        if encoded.numel:
            flat.view(torch.uint8).copy_(encoded.data)
        return out
    pairs = flat.view(torch.uint8).view(-1, 2)  # (numel, 2): low, high byte of each value
    chunk = encoded.chunk_elements
    chunks_per_batch = max(1, _BATCH_ELEMENTS // chunk)
    widths = encoded.chunk_widths.to(torch.int64)
    for first in range(0, encoded.num_chunks, chunks_per_batch):
        last = min(first + chunks_per_batch, encoded.num_chunks)
        literal, symbol = _decode_chunks(
            encoded, first, last, widths[first:last], encoded.chunk_offsets[first:last]
        )
        start = first * chunk
        pairs[start : start + literal.numel()] = join_bytes(literal, symbol, encoded.dtype)
    return out


def _output_for(encoded: EncodedTensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(encoded.shape, dtype=encoded.dtype)
    if out.dtype != encoded.dtype or out.numel() != encoded.numel or not out.is_contiguous():
        raise CodecError(
            f"decode needs a contiguous {encoded.dtype} output of {encoded.numel} elements; got "
            f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    return out


def _decode_chunks(
    encoded: EncodedTensor, first: int, last: int, width: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks [first, last) -> their (literal, symbol) bytes, each flat uint8."""
    data = encoded.data
    chunk = encoded.chunk_elements
    start, stop = first * chunk, min(last * chunk, encoded.numel)
    count = stop - start
    lengths = torch.full((last - first,), chunk, dtype=torch.int64)
    lengths[-1] = count - (last - first - 1) * chunk
    width, base = width.unsqueeze(1), base.unsqueeze(1)  # (chunks, 1)

    coded = width < LITERAL_WIDTH
    escape_code = (1 << width) - 1
    code_start = base + torch.where(coded, escape_code, 0)  # after the table
    bit = torch.arange(chunk) * width  # (chunks, chunk)
    byte = (bit >> 3).add_(code_start)
    if count < (last - first) * chunk:  # a short last chunk: keep the lanes past its end in bounds
        byte.clamp_(max=data.numel() - 2)
    pair = data[byte].to(torch.int32) | (data[byte + 1].to(torch.int32) << 8)
    code = (pair >> (bit & 7).to(torch.int32)) & escape_code.to(torch.int32)
    del pair, byte, bit

    escaped = (code == escape_code) & coded
    escape_rank = torch.cumsum(escaped, 1, dtype=torch.int64)  # 1-based among the chunk's escapes
    escape_start = code_start - 1 + width * ((lengths.unsqueeze(1) + 7) // 8)
    lookup = torch.where(escaped, escape_rank.add_(escape_start), code.to(torch.int64).add_(base))
    lookup.clamp_(max=data.numel() - 1)  # lanes of stored chunks and past the end read a byte they ignore
    symbol = torch.where(coded, data[lookup], code.to(torch.uint8)).view(-1)[:count]
    return data[start:stop], symbol
