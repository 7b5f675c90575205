"""Lossless compression of bfloat16 / float16 weights, decoded on the GPU (or on the CPU for device="cpu").

When a step is bound by the host-to-device link, moving fewer bytes is the only way to go faster: the bf16
exponent byte carries about 2.5 bits, so a value stored as its sign+mantissa byte plus a short code for its
exponent takes ~0.70 of its size, and a GPU kernel restores the exact bits at hundreds of GB/s.

    encoded = codec.encode(weight)            # on the CPU, once, at pack time
    restored = codec.decode(encoded)          # CPU reference decoder
    codec.decode(encoded.to("cuda"), out=t)   # Triton decoder, bit-identical, on the current stream

The format (format.py) is cut into chunks of a few thousand values, each decodable alone by one GPU
program. Modules: ``format`` (the layout and :class:`EncodedTensor`), ``encoder`` (vectorised CPU encoder),
``reference`` (the vectorised CPU decoder, the definition every decoder matches), ``triton_decoder`` (the
GPU kernel, imported lazily).

How it plugs into the engine: ``OffloadConfig(compression="lossless")``; packs held compressed and their
loads are host/coded_packs.py's ([Note: coded packs]), the planner's model of them is [Note: coded loads] in
plan/measurements.py. ``device="cpu"`` decodes with :func:`decode_reference`, so the CPU tests exercise the
same path the GPU runs; outputs stay bit-for-bit those of the uncompressed model.
"""

from __future__ import annotations

import torch

from flextensor.codec.encoder import encode
from flextensor.codec.format import CODED_DTYPES, DEFAULT_CHUNK_ELEMENTS, EncodedTensor
from flextensor.codec.reference import decode_reference
from flextensor.errors import CodecError

__all__ = [
    "CODED_DTYPES",
    "DEFAULT_CHUNK_ELEMENTS",
    "EncodedTensor",
    "decode",
    "decode_reference",
    "encode",
]


def decode(encoded: EncodedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``encoded`` on the device its stream is on, into ``out`` (new if None); return the tensor.

    A CPU stream decodes with the reference decoder; a CUDA stream with the Triton kernel, on the current
    CUDA stream (no synchronisation: order it after the stream's copy with an event). ``out`` must be a
    contiguous tensor of the encoded dtype and element count, on the stream's device.
    """
    device = encoded.data.device
    if device.type == "cpu":
        return decode_reference(encoded, out)
    if device.type != "cuda":
        raise CodecError(
            f"no decoder for streams on {device}: move the EncodedTensor to the CPU or a CUDA device"
        )
    encoded.check(read_index=False)  # reading the index here would sync; it was checked when encoded
    if out is None:
        out = torch.empty(encoded.shape, dtype=encoded.dtype, device=device)
    fits = out.dtype == encoded.dtype and out.numel() == encoded.numel and out.is_contiguous()
    if not fits or out.device != device:
        raise CodecError(
            f"decode needs a contiguous {encoded.dtype} output of {encoded.numel} elements on {device}; got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if not encoded.coded:
        out.view(-1).view(torch.uint8).copy_(encoded.data)
        return out
    try:
        from flextensor.codec.triton_decoder import decode_triton
    except ImportError as error:
        raise CodecError(
            "decoding a compressed stream on CUDA needs Triton, which this torch build lacks: install the "
            "CUDA build of torch (it ships triton) or `pip install triton`"
        ) from error
    return decode_triton(encoded, out)
