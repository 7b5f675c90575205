"""The lossless codec on the CPU: every bit pattern round-trips, sizes, and clear errors.

The reference decoder is the one ``device="cpu"`` uses, so these tests run the real format; tests/
test_codec_gpu.py checks that the Triton decoder matches it bit for bit.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flextensor import codec
from flextensor.errors import CodecError, FlexTensorError

CODED = [torch.bfloat16, torch.float16]
CHUNKS = [64, 128, 256, 1024, 4096, 16384]


def patterns(values: list[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """16-bit patterns (0..65535) as a tensor of ``dtype`` holding exactly those bits."""
    bits = torch.as_tensor(values, dtype=torch.int32)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)


def assert_round_trip(tensor: torch.Tensor, chunk_elements: int = codec.DEFAULT_CHUNK_ELEMENTS) -> None:
    encoded = codec.encode(tensor, chunk_elements)
    decoded = codec.decode(encoded)
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    if tensor.dtype.itemsize == 2:
        assert torch.equal(decoded.view(torch.int16), tensor.view(torch.int16))
    else:
        assert torch.equal(decoded.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def weights(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """The benchmark weights: N(0, 1) / sqrt(fan_in)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) / math.sqrt(shape[-1])).to(dtype)


@pytest.mark.parametrize("dtype", CODED)
@pytest.mark.parametrize("chunk_elements", [64, 4096])
def test_every_bit_pattern_round_trips(dtype: torch.dtype, chunk_elements: int) -> None:
    every = patterns(torch.arange(1 << 16), dtype)  # NaN payloads, infinities, -0, subnormals, all of them
    assert_round_trip(every, chunk_elements)
    shuffled = every[torch.randperm(1 << 16, generator=torch.Generator().manual_seed(1))]
    assert_round_trip(shuffled, chunk_elements)


@pytest.mark.parametrize("dtype", CODED)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(st.integers(0, (1 << 16) - 1), max_size=700), chunk_elements=st.sampled_from(CHUNKS))
def test_any_list_of_patterns_round_trips(dtype: torch.dtype, values: list[int], chunk_elements: int) -> None:
    assert_round_trip(patterns(values, dtype), chunk_elements)


def _drawn_tensor(kind: str, length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if kind == "weights":
        scale = float(torch.empty(1).uniform_(-12, 4, generator=generator).exp2())
        return (torch.randn(length, generator=generator) * scale).to(dtype)
    if kind == "random bits":
        return patterns(torch.randint(0, 1 << 16, (length,), generator=generator), dtype)
    if kind == "specials":
        specials = patterns([0x0000, 0x8000, 0x0001, 0x8001, 0x7FFF, 0xFFFF], dtype)  # zeros, subnormal, NaN
        infinities = torch.tensor([math.inf, -math.inf, math.nan], dtype=dtype)
        pool = torch.cat([specials, infinities, torch.randn(4, generator=generator).to(dtype)])
        return pool[torch.randint(0, pool.numel(), (length,), generator=generator)]
    return torch.full((length,), float(torch.randn(1, generator=generator)), dtype=dtype)  # constant


@pytest.mark.parametrize("dtype", CODED)
@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["weights", "random bits", "specials", "constant"]),
    length=st.one_of(st.integers(0, 10), st.integers(0, 20_000)),
    chunk_elements=st.sampled_from(CHUNKS),
    seed=st.integers(0, 2**31),
)
def test_drawn_tensors_round_trip(
    dtype: torch.dtype, kind: str, length: int, chunk_elements: int, seed: int
) -> None:
    tensor = _drawn_tensor(kind, length, dtype, seed)
    assert_round_trip(tensor, chunk_elements)
    encoded = codec.encode(tensor, chunk_elements)
    index_bytes = 9 * encoded.num_chunks
    assert encoded.nbytes <= 2 * length + index_bytes + 1  # never larger than raw, but for the index


@pytest.mark.parametrize("dtype", CODED)
@pytest.mark.parametrize(
    "shape", [(0,), (1,), (7,), (4096,), (4097,), (3, 4099), (2, 0, 5), (64, 64, 3), (8191,)]
)
def test_shapes_round_trip_including_empty_odd_and_one_value_chunks(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    tensor = weights(shape, dtype) if shape[-1] else torch.empty(shape, dtype=dtype)
    assert_round_trip(tensor)
    assert_round_trip(tensor, 64)


@pytest.mark.parametrize("dtype", CODED)
def test_nan_payloads_infinities_and_signed_zeros_survive_in_whole_chunks(dtype: torch.dtype) -> None:
    nan_payloads = patterns(list(range(0x7F81, 0x7F81 + 64)) + list(range(0xFF81, 0xFF81 + 64)), dtype)
    if dtype == torch.float16:
        nan_payloads = patterns(list(range(0x7C01, 0x7C01 + 64)) + list(range(0xFC01, 0xFC01 + 64)), dtype)
    assert torch.isnan(nan_payloads.float()).all()
    assert_round_trip(nan_payloads.repeat(40), 256)  # chunks that are all NaN, with different payloads
    assert_round_trip(torch.full((1000,), math.nan, dtype=dtype), 64)
    assert_round_trip(torch.tensor([math.inf, -math.inf, 0.0, -0.0] * 300, dtype=dtype), 128)
    smallest = torch.finfo(dtype).smallest_normal
    assert_round_trip(torch.linspace(-smallest, smallest, 5000).to(dtype), 512)  # subnormals


def test_width_follows_the_data_constant_chunks_take_one_bit_random_bytes_are_stored() -> None:
    constant = codec.encode(torch.ones(8192, dtype=torch.bfloat16), 4096)
    assert constant.chunk_widths.tolist() == [1, 1]
    assert constant.nbytes < 8192 * (1 + 1 / 8) + 64  # literal byte + one bit a value + index
    noise = codec.encode(patterns(torch.randint(0, 1 << 16, (8192,)), torch.bfloat16), 4096)
    assert noise.chunk_widths.tolist() == [8, 8]  # no table beats the symbols as they are
    assert noise.nbytes < 2 * 8192 + 64
    assert_round_trip(patterns(torch.randint(0, 1 << 16, (8192,)), torch.bfloat16), 4096)


@pytest.mark.parametrize(("shape", "limit"), [((512, 2048), 0.72), ((2048, 512), 0.72), ((32000, 64), 0.72)])
def test_benchmark_weights_compress_to_at_most_0_72(shape: tuple[int, int], limit: float) -> None:
    encoded = codec.encode(weights(shape))
    assert encoded.ratio <= limit
    assert_round_trip(weights(shape))


def test_float16_weights_compress_less_but_still_compress() -> None:
    encoded = codec.encode(weights((512, 2048), torch.float16))
    assert encoded.ratio < 0.9  # the 5-bit exponent shares its coded byte with 3 near-random bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.int64, torch.bool])
def test_other_dtypes_are_stored_as_they_are(dtype: torch.dtype) -> None:
    tensor = (torch.randn(3, 17) * 100).to(dtype)
    encoded = codec.encode(tensor)
    assert not encoded.coded and encoded.num_chunks == 0
    assert encoded.data.numel() == tensor.numel() * dtype.itemsize
    assert_round_trip(tensor)


def test_decode_writes_into_a_given_range_of_a_larger_buffer_only() -> None:
    arena = torch.full((10_000,), 7.0, dtype=torch.bfloat16)
    weight = weights((60, 100))
    codec.decode(codec.encode(weight, 256), out=arena[1000:7000])
    assert torch.equal(arena[1000:7000].view(torch.int16), weight.reshape(-1).view(torch.int16))
    assert (arena[:1000] == 7).all() and (arena[7000:] == 7).all()


def test_encoding_is_lossless_for_a_non_contiguous_view() -> None:
    weight = weights((64, 300)).t()
    assert_round_trip(weight, 128)


@pytest.mark.parametrize("chunk_elements", [0, 100, 32, 1 << 15, True, 4096.0])
def test_a_bad_chunk_size_is_a_clear_error(chunk_elements: object) -> None:
    with pytest.raises(CodecError, match="power of two"):
        codec.encode(weights((4, 4)), chunk_elements)  # type: ignore[arg-type]


def test_a_mismatched_output_is_a_clear_error() -> None:
    encoded = codec.encode(weights((8, 8)))
    with pytest.raises(CodecError, match=r"contiguous torch\.bfloat16 output of 64 elements"):
        codec.decode(encoded, out=torch.empty(64, dtype=torch.float16))
    with pytest.raises(CodecError, match="64 elements"):
        codec.decode(encoded, out=torch.empty(65, dtype=torch.bfloat16))
    with pytest.raises(CodecError, match="not contiguous"):
        codec.decode(encoded, out=torch.empty(8, 16, dtype=torch.bfloat16)[:, ::2])


def test_a_corrupt_index_is_a_clear_error() -> None:
    encoded = codec.encode(weights((64, 64)), 1024)
    bad_width = encoded.chunk_widths.clone()
    bad_width[1] = 0
    corrupt = codec.EncodedTensor(
        encoded.dtype, encoded.shape, 1024, encoded.data, encoded.chunk_offsets, bad_width
    )
    with pytest.raises(CodecError, match=r"\[1, 8\]"):
        codec.decode(corrupt)
    short_index = codec.EncodedTensor(
        encoded.dtype, encoded.shape, 1024, encoded.data, encoded.chunk_offsets[:2], encoded.chunk_widths[:2]
    )
    with pytest.raises(CodecError, match="re-encode"):
        codec.decode(short_index)
    past_the_end = encoded.chunk_offsets.clone()
    past_the_end[-1] = encoded.data.numel()
    bad_offsets = codec.EncodedTensor(
        encoded.dtype, encoded.shape, 1024, encoded.data, past_the_end, encoded.chunk_widths
    )
    with pytest.raises(CodecError, match="offsets must rise"):
        codec.decode(bad_offsets)
    assert issubclass(CodecError, FlexTensorError)


def test_a_stream_on_a_device_without_a_decoder_is_a_clear_error() -> None:
    encoded = codec.encode(weights((8, 8))).to("meta")
    with pytest.raises(CodecError, match="no decoder for streams on meta"):
        codec.decode(encoded)


def test_importing_and_cpu_decoding_never_import_triton() -> None:
    script = (
        "import sys, torch\n"
        "from flextensor import codec\n"
        "codec.decode(codec.encode(torch.ones(100, dtype=torch.bfloat16)))\n"
        "print('triton' in sys.modules, 'flextensor.codec.triton_decoder' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "False"]


INTERPRETED_KERNEL = """
import torch
from flextensor import codec
from flextensor.codec.triton_decoder import decode_triton
every = torch.arange(1 << 16, dtype=torch.int32)
for dtype in (torch.bfloat16, torch.float16):
    bits = torch.where(every >= 1 << 15, every - (1 << 16), every).to(torch.int16).view(dtype)
    cases = [(bits[torch.randperm(1 << 16)], 4096), ((torch.randn(3, 700) / 64).to(dtype), 64)]
    cases += [(torch.full((300,), float("nan"), dtype=dtype), 128), (bits[:1], 64)]
    for tensor, chunk_elements in cases:
        encoded = codec.encode(tensor, chunk_elements)
        out = torch.empty_like(tensor)
        decode_triton(encoded, out)
        assert torch.equal(out.view(torch.int16), codec.decode_reference(encoded).view(torch.int16))
print("match")
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs Triton (not on CPU torch builds)"
)
def test_the_triton_kernel_interpreted_on_the_cpu_matches_the_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", INTERPRETED_KERNEL], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0 and out.stdout.strip() == "match", out.stderr[-3000:]


def test_a_whole_pack_with_mixed_dtypes_and_padding_viewed_as_bfloat16_round_trips_byte_for_byte() -> None:
    # How the engine is to use the codec: a unit's pack (parameters at aligned offsets) encoded as one tensor.
    pieces = [
        weights((256, 512)).view(torch.uint8).reshape(-1),
        torch.zeros(512, dtype=torch.uint8),  # alignment padding
        torch.randn(300).view(torch.uint8),  # a float32 norm
        torch.zeros(304, dtype=torch.uint8),
        weights((128, 512)).view(torch.uint8).reshape(-1),
    ]
    pack = torch.cat(pieces)
    encoded = codec.encode(pack.view(torch.bfloat16))
    assert torch.equal(codec.decode(encoded).view(torch.uint8), pack)
    assert encoded.ratio < 0.72


def decode_as_documented(encoded: codec.EncodedTensor) -> list[int]:
    """A slow, element-by-element reading of the layout format.py's docstring describes."""
    data = encoded.data.tolist()
    numel, chunk = encoded.numel, encoded.chunk_elements
    values = []
    index = zip(encoded.chunk_widths.tolist(), encoded.chunk_offsets.tolist(), strict=True)
    for c, (width, offset) in enumerate(index):
        length = min(chunk, numel - c * chunk)
        table_len = 0 if width == 8 else 2**width - 1
        table = data[offset : offset + table_len]
        codes_at = offset + table_len
        escapes_at = codes_at + (length if width == 8 else width * -(-length // 8))
        escapes_seen = 0
        for j in range(length):
            code = sum(
                ((data[codes_at + (j * width + b) // 8] >> ((j * width + b) % 8)) & 1) << b
                for b in range(width)
            )
            if width == 8:
                symbol = code
            elif code == 2**width - 1:
                symbol = data[escapes_at + escapes_seen]
                escapes_seen += 1
            else:
                symbol = table[code]
            literal = data[c * chunk + j]
            if encoded.dtype == torch.bfloat16:
                values.append(((literal & 0x80) << 8) | (symbol << 7) | (literal & 0x7F))
            else:
                values.append((symbol << 8) | literal)
    return values


@pytest.mark.parametrize("dtype", CODED)
def test_the_stream_follows_the_documented_layout(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    tensor = torch.cat(
        [
            (torch.randn(300, generator=generator) / 20).to(dtype),
            torch.ones(256, dtype=dtype),
            patterns(torch.randint(0, 1 << 16, (256,), generator=generator), dtype),
            torch.full((5,), math.nan, dtype=dtype),
        ]
    )
    encoded = codec.encode(tensor, 256)
    widths = encoded.chunk_widths.tolist()  # a table chunk, one-bit chunks with escapes, a short stored one
    assert 2 <= widths[0] < 8 and widths[1:3] == [1, 1] and widths[3] == 8
    expected = (tensor.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    assert decode_as_documented(encoded) == expected
