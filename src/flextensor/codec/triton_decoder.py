"""The GPU decoder: one Triton program per chunk, one lane per element, bit-identical to reference.py.

Imported only when a CUDA-resident stream is decoded (``flextensor.codec.decode``), never by
``import flextensor``: Triton ships with CUDA builds of torch, not with CPU ones.

Each program loads its chunk's width and payload offset, then per element: the literal byte (coalesced),
the two bytes holding its code, the table entry or, for an escape, the escape byte whose rank a block-wide
prefix sum gives, and stores the joined 16-bit value. Every read but the literal bytes' hits a few hundred
bytes per chunk, which stay in L1/L2, so the kernel is bound by reading ~1.4 bytes and writing 2 per value.
The launch goes on the current stream: order it after the copy of the stream with an event, like a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flextensor.codec.format import LITERAL_WIDTH, EncodedTensor

__all__ = ["decode_triton"]


@triton.jit
def _decode_chunk_kernel(
    data_ptr,
    offsets_ptr,
    widths_ptr,
    out_ptr,
    numel,
    CHUNK: tl.constexpr,
    BFLOAT16: tl.constexpr,
    LITERAL: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, CHUNK)
    index = chunk * CHUNK + j
    valid = index < numel
    length = tl.minimum(numel - chunk * CHUNK, CHUNK)

    # The width broadcast to a block: masks then combine block with block (Triton's interpreter mis-types
    # a block & scalar-bool mask).
    width = tl.zeros([CHUNK], dtype=tl.int32) + tl.load(widths_ptr + chunk).to(tl.int32)
    base = tl.load(offsets_ptr + chunk)
    coded = width != LITERAL
    escape_code = (1 << width) - 1
    code_start = base + tl.where(coded, escape_code, 0)

    bit = j * width
    pair_ptr = data_ptr + code_start + (bit >> 3)
    low = tl.load(pair_ptr, mask=valid, other=0).to(tl.int32)
    high = tl.load(pair_ptr + 1, mask=valid, other=0).to(tl.int32)
    code = ((low | (high << 8)) >> (bit & 7)) & escape_code

    escaped = valid & coded & (code == escape_code)
    escape_rank = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
    escape_start = code_start + width * ((length + 7) // 8)
    from_escape = tl.load(data_ptr + escape_start + escape_rank, mask=escaped, other=0).to(tl.int32)
    in_table = valid & coded & (code != escape_code)
    from_table = tl.load(data_ptr + base + code, mask=in_table, other=0).to(tl.int32)
    symbol = tl.where(coded, tl.where(escaped, from_escape, from_table), code)

    literal = tl.load(data_ptr + index, mask=valid, other=0).to(tl.int32)
    if BFLOAT16:  # noqa: SIM108 (a constexpr branch reads better in a kernel)
        value = ((literal & 0x80) << 8) | (symbol << 7) | (literal & 0x7F)
    else:
        value = (symbol << 8) | literal
    tl.store(out_ptr + index, value.to(tl.int16), mask=valid)  # int32 -> int16 keeps the low 16 bits


def decode_triton(encoded: EncodedTensor, out: torch.Tensor, num_warps: int = 4) -> torch.Tensor:
    """Decode ``encoded`` (stream and index on ``out``'s CUDA device) into ``out`` on the current stream.

    ``out`` is a contiguous tensor of the encoded dtype and element count (checked by the caller).
    """
    if encoded.num_chunks:
        _decode_chunk_kernel[(encoded.num_chunks,)](
            encoded.data,
            encoded.chunk_offsets,
            encoded.chunk_widths,
            out.view(-1).view(torch.int16),
            encoded.numel,
            CHUNK=encoded.chunk_elements,
            BFLOAT16=encoded.dtype == torch.bfloat16,
            LITERAL=LITERAL_WIDTH,
            num_warps=num_warps,
        )
    return out
