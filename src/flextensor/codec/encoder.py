"""Encoding on the CPU: a tensor -> an :class:`EncodedTensor`, vectorised over chunks with torch ops.

Per batch of chunks (a few million values at a time, to bound the temporaries): one histogram of the
symbol bytes per chunk, the symbols ranked by frequency, the width whose payload is smallest, codes from the
ranks, codes bit-packed eight at a time (eight ``w``-bit codes are ``w`` bytes), then tables, codes and
escapes scattered into the batch's payload. No Python loop runs per element or per chunk, only per batch
and per width.
"""

from __future__ import annotations

import sys

import torch

from flextensor.codec.format import (
    CODED_DTYPES,
    DEFAULT_CHUNK_ELEMENTS,
    LITERAL_WIDTH,
    EncodedTensor,
    check_chunk_elements,
    split_bytes,
)

__all__ = ["encode"]

_BATCH_ELEMENTS = 1 << 22
_WIDTHS = range(1, LITERAL_WIDTH)  # the table widths; LITERAL_WIDTH is handled on its own


def encode(
    tensor: torch.Tensor,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    device: torch.device | str | None = None,
) -> EncodedTensor:
    """Compress ``tensor`` losslessly; bfloat16 and float16 are coded, any other dtype is stored.

    The tensor may live on any device. The work runs on ``device`` (the CPU by default; a CUDA device
    encodes a large model many times faster, with the same result bit for bit); the result is on the CPU.
    Every bit pattern round-trips, NaN payloads, infinities, -0.0 and subnormals included.
    """
    check_chunk_elements(chunk_elements)
    work_device = torch.device(device if device is not None else "cpu")
    shape = tuple(tensor.shape)
    if tensor.dtype not in CODED_DTYPES:
        flat = tensor.detach().reshape(-1).cpu().contiguous()
        return EncodedTensor(
            dtype=tensor.dtype,
            shape=shape,
            chunk_elements=chunk_elements,
            data=flat.view(torch.uint8).clone() if flat.numel() else torch.empty(0, dtype=torch.uint8),
            chunk_offsets=torch.empty(0, dtype=torch.int64),
            chunk_widths=torch.empty(0, dtype=torch.uint8),
        )
    if sys.byteorder != "little":  # the bit packing views int64 words as bytes
        raise NotImplementedError("the codec's encoder assumes a little-endian host")
    flat = tensor.detach().reshape(-1).to(work_device).contiguous()
    with work_device:  # the factory calls below (arange, empty, ...) allocate there
        return _encode_coded(flat, tensor.dtype, shape, chunk_elements)


def _encode_coded(
    flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], chunk_elements: int
) -> EncodedTensor:
    numel = flat.numel()
    pairs = flat.view(torch.uint8).view(numel, 2)  # (numel, 2): low, high byte of each value
    literal = torch.empty(numel, dtype=torch.uint8)
    payloads: list[torch.Tensor] = []
    offsets: list[torch.Tensor] = []
    widths: list[torch.Tensor] = []
    batch = max(chunk_elements, _BATCH_ELEMENTS // chunk_elements * chunk_elements)
    written = numel  # payloads start after the literal bytes
    for start in range(0, numel, batch):
        lit, sym = split_bytes(pairs[start : start + batch], dtype)
        literal[start : start + lit.numel()] = lit
        payload, local_offsets, batch_widths = _encode_symbols(sym, chunk_elements)
        payloads.append(payload)
        offsets.append(local_offsets + written)
        widths.append(batch_widths)
        written += payload.numel()
    padding = torch.zeros(1, dtype=torch.uint8)  # keeps a decoder's two-byte read of the last code in bounds
    chunk_offsets = torch.cat(offsets) if offsets else torch.empty(0, dtype=torch.int64)
    chunk_widths = torch.cat(widths) if widths else torch.empty(0, dtype=torch.uint8)
    return EncodedTensor(
        dtype=dtype,
        shape=shape,
        chunk_elements=chunk_elements,
        data=_to_host(torch.cat([literal, *payloads, padding])),
        chunk_offsets=_to_host(chunk_offsets),
        chunk_widths=_to_host(chunk_widths),
    )


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in pageable host memory. From a GPU through a page-locked bounce buffer (PyTorch's
    caching host allocator reuses it for the next piece): a copy straight into pageable memory ran at
    about 1.5 GB/s on the H200 machine and took most of an encode (benchmarks/codec_decode.py,
    ``encode_breakdown``); the bounce copies at the link's rate, then a host memcpy."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    bounce = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    bounce.copy_(tensor)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    host.copy_(bounce)
    return host


def _encode_symbols(symbols: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symbol bytes of whole chunks (the last may be short) -> (payload, payload offsets, widths)."""
    count = symbols.numel()
    num_chunks = -(-count // chunk)
    padded = torch.zeros(num_chunks * chunk, dtype=torch.uint8)
    padded[:count] = symbols
    sym = padded.view(num_chunks, chunk)  # (chunks, chunk)
    lengths = torch.full((num_chunks,), chunk, dtype=torch.int64)
    lengths[-1] = count - (num_chunks - 1) * chunk
    # keys: chunk * 256 + symbol, the index into any (chunks, 256) per-chunk table, flattened
    keys = sym.to(torch.int64).add_((torch.arange(num_chunks) * 256).unsqueeze(1))  # (chunks, chunk)

    histogram = torch.bincount(keys.view(-1), minlength=num_chunks * 256).view(num_chunks, 256)
    histogram[-1, 0] -= num_chunks * chunk - count  # the padding is not data
    counts_sorted, order = torch.sort(histogram, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(256).expand(num_chunks, 256))
    width, table_len, code_len, escape_counts = _best_widths(counts_sorted, lengths)

    # Per chunk, symbol -> code as a (chunks, 256) table looked up by key.
    coded = (width < LITERAL_WIDTH).unsqueeze(1)
    escape_code = ((1 << width) - 1).unsqueeze(1)
    code_of = torch.where(coded, torch.minimum(rank, escape_code), torch.arange(256)).to(torch.uint8)
    code = torch.take(code_of, keys)  # (chunks, chunk) uint8
    # A stored chunk's escape code (255) is out of reach: 256 as uint8 would wrap, so compare in int16.
    escaped = code == torch.where(coded, escape_code, 256).to(torch.int16)
    escaped.view(-1)[count:] = False

    sizes = table_len + code_len + escape_counts
    offsets = torch.cumsum(sizes, 0) - sizes
    payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    for w in [*_WIDTHS, LITERAL_WIDTH]:
        rows = torch.nonzero(width == w).flatten()
        if rows.numel():
            _write_group(payload, rows, w, offsets, order, code, code_len, chunk)
    # Escaped symbols, chunk by chunk in element order, after each chunk's codes.
    escape_symbols = sym[escaped]
    chunk_of = torch.repeat_interleave(torch.arange(num_chunks), escape_counts)
    first = torch.cumsum(escape_counts, 0) - escape_counts
    within = torch.arange(escape_symbols.numel()) - first[chunk_of]
    payload[(offsets + table_len + code_len)[chunk_of] + within] = escape_symbols
    return payload, offsets, width.to(torch.uint8)


def _best_widths(
    counts_sorted: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per chunk, the width with the smallest payload: (width, table bytes, code bytes, escapes), each
    (chunks,)."""
    covered = torch.cumsum(counts_sorted, 1)  # covered[:, t]: values among the t + 1 most frequent symbols
    groups = (lengths + 7) // 8
    candidates = [
        ((1 << w) - 1) + w * groups + (lengths - covered[:, (1 << w) - 2])  # table + codes + escapes
        for w in _WIDTHS
    ]
    candidates.append(lengths)  # LITERAL_WIDTH: the symbols as they are
    width = torch.stack(candidates, 1).argmin(1) + 1  # the first minimum: the narrowest such width
    literal = width == LITERAL_WIDTH
    table_len = torch.where(literal, 0, (1 << width) - 1)
    code_len = torch.where(literal, lengths, width * groups)
    escapes = torch.where(
        literal, 0, lengths - covered.gather(1, (table_len - 1).clamp(min=0).unsqueeze(1))[:, 0]
    )
    return width, table_len, code_len, escapes


def _write_group(
    payload: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    offsets: torch.Tensor,
    order: torch.Tensor,
    code: torch.Tensor,
    code_len: torch.Tensor,
    chunk: int,
) -> None:
    """Write the tables and packed codes of the chunks ``rows``, which all use ``width``."""
    start = offsets[rows].unsqueeze(1)
    if width == LITERAL_WIDTH:
        packed = code[rows]  # (rows, chunk): the symbols themselves
    else:
        table_len = (1 << width) - 1
        payload[start + torch.arange(table_len)] = order[rows, :table_len].to(torch.uint8)
        start = start + table_len
        word = torch.int32 if 8 * width <= 31 else torch.int64
        shifts = torch.arange(8, dtype=word) * width
        words = (code[rows].view(-1, chunk // 8, 8).to(word) << shifts).sum(-1, dtype=word)  # 8 codes a word
        bytes_per_word = word.itemsize
        packed = words.view(torch.uint8).view(-1, chunk // 8, bytes_per_word)[:, :, :width]
        packed = packed.reshape(rows.numel(), -1)  # (rows, chunk / 8 * width)
    columns = packed.shape[1]
    last_short = int(code_len[rows[-1]]) < columns  # only a tensor's last chunk may be short
    full = rows.numel() - int(last_short)
    payload[start[:full] + torch.arange(columns)] = packed[:full]
    if last_short:
        tail = int(code_len[rows[-1]])
        payload[int(start[-1]) : int(start[-1]) + tail] = packed[-1, :tail]
