"""The CPU reference decoder: the format's meaning in torch ops, vectorised over whole chunks.

It computes, for every element at once, what the GPU kernel (triton_decoder.py) computes per thread: the
code at bit ``j * width`` of its chunk, table entry or escape (an escape's byte found by a prefix sum over
the chunk), then the literal and symbol bytes joined. The GPU decoder must match it bit for bit, and the
engine uses it where ``device="cpu"``, so the CPU tests run the real format.
"""

from __future__ import annotations

import torch

from ..errors import CodecError
from .format import LITERAL_WIDTH, EncodedTensor, join_bytes

__all__ = ["decode_reference"]

_BATCH_ELEMENTS = 1 << 21


def decode_reference(encoded: EncodedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a CPU-resident ``encoded`` into ``out`` (a new tensor if None) and return it."""
    encoded.check()
    out = _output_for(encoded, out)
    flat = out.view(-1)
    if not encoded.coded:
        if encoded.numel:
            flat.view(torch.uint8).copy_(encoded.data)
        return out
    bits = flat.view(torch.int16)
    chunk = encoded.chunk_elements
    chunks_per_batch = max(1, _BATCH_ELEMENTS // chunk)
    widths = encoded.chunk_widths.to(torch.int64)
    for first in range(0, encoded.num_chunks, chunks_per_batch):
        last = min(first + chunks_per_batch, encoded.num_chunks)
        values = _decode_chunks(encoded, first, last, widths[first:last], encoded.chunk_offsets[first:last])
        start = first * chunk
        bits[start : start + values.numel()] = torch.where(values >= 1 << 15, values - (1 << 16), values).to(
            torch.int16
        )
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
) -> torch.Tensor:
    """Chunks [first, last) -> their values as int32 bit patterns (0..65535), flat."""
    data = encoded.data
    chunk = encoded.chunk_elements
    index = first * chunk + torch.arange((last - first) * chunk).view(-1, chunk)  # (chunks, chunk)
    valid = index < encoded.numel
    lengths = valid.sum(1)
    j = torch.arange(chunk).unsqueeze(0)
    width, base = width.unsqueeze(1), base.unsqueeze(1)

    literal_chunk = width == LITERAL_WIDTH
    escape_code = (1 << width) - 1
    code_start = base + torch.where(literal_chunk, 0, escape_code)  # after the table
    bit = j * width
    byte = torch.where(valid, code_start + (bit >> 3), 0)
    pair = data[byte].to(torch.int64) | (data[byte + 1].to(torch.int64) << 8)
    code = (pair >> (bit & 7)) & escape_code

    escaped = valid & ~literal_chunk & (code == escape_code)
    escape_rank = torch.cumsum(escaped, 1) - 1
    escape_start = code_start + width * ((lengths.unsqueeze(1) + 7) // 8)
    from_escape = data[torch.where(escaped, escape_start + escape_rank, 0)]
    from_table = data[torch.where(valid & ~literal_chunk & ~escaped, base + code, 0)]
    symbol = torch.where(literal_chunk, code, torch.where(escaped, from_escape, from_table).to(torch.int64))

    literal = data[torch.where(valid, index, 0)].to(torch.int64)
    return join_bytes(literal, symbol, encoded.dtype)[valid]
