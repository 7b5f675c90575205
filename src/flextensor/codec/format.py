"""The compressed format: what an :class:`EncodedTensor` holds and how a 16-bit value splits in two bytes.

Every 16-bit value is split into a *literal* byte, stored as it is, and a *symbol* byte, which is coded:

    bfloat16  s eeeeeeee mmmmmmm    literal = s mmmmmmm          symbol = eeeeeeee (the exponent)
    float16   s eeeee mmmmmmmmmm    literal = low 8 mantissa bits symbol = s eeeee mm (the high byte)

Weights use few exponents (about 2.5 bits of information in the 8-bit bf16 exponent), so the symbol byte is
where the saving is. The float16 exponent is 5 bits, so its symbol keeps 3 near-random bits and float16
compresses less (see docs/compression.md).

Layout of ``EncodedTensor.data`` (uint8, one buffer, so one copy moves everything a decode reads)::

    [ literal bytes: numel ][ chunk 0 payload ][ chunk 1 payload ] ... [ one padding byte ]

Elements are cut into chunks of ``chunk_elements`` (a power of two); the last one may be shorter. Each chunk
is decodable alone. Chunk ``c``'s literal bytes are at ``c * chunk_elements``; its payload starts at
``chunk_offsets[c]`` and its symbols are coded with a fixed width ``w = chunk_widths[c]``:

    w == 8      codes: ``n_c`` bytes, the symbols themselves (a chunk that does not compress)
    1 <= w < 8  table:  ``2**w - 1`` bytes, the chunk's most frequent symbols, most frequent first
                codes:  ``w * ceil(n_c / 8)`` bytes, element ``j``'s code at bit ``j * w``, little-endian
                        bit order; code ``t < 2**w - 1`` means ``table[t]``, code ``2**w - 1`` is an escape
                escapes: one byte per escape, the chunk's escaped symbols in element order

The encoder picks, per chunk, the width that makes the payload smallest. A decoder reads two bytes at the
code's byte position (the padding byte keeps the last read in bounds), finds an escape's byte by counting
the escapes before it in the chunk (a prefix sum), and joins the literal and symbol bytes back into the
value. A fixed-width code was chosen over a Huffman code because every element's code sits at a known bit
position, so one GPU thread per element decodes with no sequential walk; docs/compression.md has the sizes
of both on benchmark weights.

Any other dtype is *stored*: ``data`` is its raw bytes and there are no chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flextensor.errors import CodecError

__all__ = [
    "CODED_DTYPES",
    "DEFAULT_CHUNK_ELEMENTS",
    "LITERAL_WIDTH",
    "EncodedTensor",
    "check_chunk_elements",
    "join_bytes",
    "split_bytes",
]

CODED_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes whose values are coded; any other dtype is stored as it is."""

DEFAULT_CHUNK_ELEMENTS = 4096
"""Values per chunk: one GPU program decodes one chunk; index and table cost ~0.03 bit a value."""

LITERAL_WIDTH = 8
"""The code width that means "the symbols themselves, no table, no escapes"."""

MIN_CHUNK_ELEMENTS = 64
MAX_CHUNK_ELEMENTS = 1 << 14  # one Triton block per chunk: larger blocks spill registers


def check_chunk_elements(chunk_elements: int) -> None:
    """Raise CodecError unless ``chunk_elements`` is a power of two in [64, 16384]."""
    if (
        not isinstance(chunk_elements, int)
        or isinstance(chunk_elements, bool)
        or not MIN_CHUNK_ELEMENTS <= chunk_elements <= MAX_CHUNK_ELEMENTS
        or chunk_elements & (chunk_elements - 1)
    ):
        raise CodecError(
            f"chunk_elements={chunk_elements!r} is not a power of two between {MIN_CHUNK_ELEMENTS} and "
            f"{MAX_CHUNK_ELEMENTS}: pick one such as {DEFAULT_CHUNK_ELEMENTS} (a GPU program per chunk)"
        )


@dataclass(frozen=True, eq=False)  # eq on tensors is ambiguous; compare the fields with torch.equal
class EncodedTensor:
    """A tensor losslessly compressed: the byte stream, its per-chunk index, and what to rebuild.

    ``data`` is the stream a copy moves (layout in this module's docstring); ``chunk_offsets`` (int64, one
    per chunk) and ``chunk_widths`` (uint8, one per chunk) are the index a decoder reads. Stored (uncoded)
    dtypes have an empty index and ``data`` holds the raw bytes.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunk_elements: int
    data: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_widths: torch.Tensor

    def __repr__(self) -> str:
        how = f"{self.num_chunks} chunks of {self.chunk_elements}" if self.coded else "stored"
        return (
            f"EncodedTensor({str(self.dtype).removeprefix('torch.')}{list(self.shape)}, {how}, "
            f"{self.nbytes} bytes = {self.ratio:.3f} of raw, on {self.data.device})"
        )

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def coded(self) -> bool:
        """True when the values are coded, False when the bytes are stored as they are."""
        return self.dtype in CODED_DTYPES

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_widths.numel())

    @property
    def raw_nbytes(self) -> int:
        """Size of the tensor uncompressed."""
        return self.numel * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Everything a decode needs: the stream plus the index."""
        return int(self.data.nbytes + self.chunk_offsets.nbytes + self.chunk_widths.nbytes)

    @property
    def ratio(self) -> float:
        """Compressed size over raw size (1.0 for an empty tensor)."""
        return self.nbytes / self.raw_nbytes if self.raw_nbytes else 1.0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EncodedTensor:
        """The same encoding with its stream and index on ``device`` (the data a decoder there reads)."""
        return EncodedTensor(
            dtype=self.dtype,
            shape=self.shape,
            chunk_elements=self.chunk_elements,
            data=self.data.to(device, non_blocking=non_blocking),
            chunk_offsets=self.chunk_offsets.to(device, non_blocking=non_blocking),
            chunk_widths=self.chunk_widths.to(device, non_blocking=non_blocking),
        )

    def check(self, read_index: bool = True) -> None:
        """Raise CodecError if the index does not fit the stream (a corrupt or hand-made encoding).

        ``read_index=False`` checks shapes and dtypes only, reading no values (no device sync on CUDA).
        """
        if self.data.dtype != torch.uint8 or self.data.dim() != 1:
            raise CodecError(
                f"encoded data must be a 1-D uint8 tensor, got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if not self.coded:
            if self.data.numel() != self.raw_nbytes or self.num_chunks:
                raise CodecError(
                    f"a stored {self.dtype} tensor of shape {self.shape} needs {self.raw_nbytes} bytes "
                    f"and no chunks; got {self.data.numel()} bytes and {self.num_chunks} chunks"
                )
            return
        check_chunk_elements(self.chunk_elements)
        expected_chunks = -(-self.numel // self.chunk_elements)
        if (
            self.chunk_widths.dtype != torch.uint8
            or self.chunk_offsets.dtype != torch.int64
            or self.num_chunks != expected_chunks
            or self.chunk_offsets.numel() != expected_chunks
        ):
            raise CodecError(
                f"the index of an encoded {tuple(self.shape)} tensor must have {expected_chunks} uint8 "
                f"widths and int64 offsets; got {self.chunk_widths.dtype}[{self.num_chunks}] and "
                f"{self.chunk_offsets.dtype}[{self.chunk_offsets.numel()}]; re-encode the tensor"
            )
        if self.data.numel() < self.numel + 1:
            raise CodecError("the encoded stream is shorter than its literal bytes: re-encode the tensor")
        if read_index and expected_chunks:
            self._check_index_values()

    def _check_index_values(self) -> None:
        widths, offsets = self.chunk_widths, self.chunk_offsets
        if not bool(((widths >= 1) & (widths <= LITERAL_WIDTH)).all()):
            raise CodecError("chunk widths must lie in [1, 8]: the encoding is corrupt; re-encode the tensor")
        inside = int(offsets[0]) >= self.numel and int(offsets[-1]) < self.data.numel()
        if not inside or not bool((offsets[1:] >= offsets[:-1]).all()):
            raise CodecError(
                "chunk offsets must rise from the end of the literal bytes and stay inside the stream: the "
                "encoding is corrupt; re-encode the tensor"
            )


def split_bytes(pairs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 2) bytes of 16-bit values (low, high: little-endian) -> (literal, symbol) bytes, (n,) each."""
    low, high = pairs[:, 0], pairs[:, 1]
    if dtype == torch.bfloat16:
        return (high & 0x80) | (low & 0x7F), (high << 1) | (low >> 7)  # uint8 arithmetic drops the carry
    return low.clone(), high.clone()


def join_bytes(literal: torch.Tensor, symbol: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(literal, symbol) uint8 -> the (n, 2) little-endian bytes of the values: the inverse of split_bytes."""
    if dtype == torch.bfloat16:
        low = ((symbol & 1) << 7) | (literal & 0x7F)
        high = (literal & 0x80) | (symbol >> 1)
        return torch.stack([low, high], 1)
    return torch.stack([literal, symbol], 1)
