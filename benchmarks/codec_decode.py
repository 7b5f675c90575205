"""GPU decode throughput of the lossless codec, alone, next to compute, and behind the host link (CUDA only).

    python -m benchmarks.codec_decode            # one Llama-3-8B layer of benchmark weights (436 MB bf16)
    python -m benchmarks.codec_decode --quick    # an eighth of it

Prints, on the weights of benchmarks/codec_sizes.py (N(0, 1) / sqrt(fan_in), bf16):

1. encode speed on the GPU (``codec.encode(..., device="cuda")``) and on the host's CPU cores, then where
   the time of one unit's ``CodedPack.encode`` goes (what ``offload()`` runs per unit): its top operators
   by host time and by device time (torch.profiler), to tell GPU kernels from host copies;
2. that the Triton decoder restores every bit, then its throughput in GB/s of output for each chunk size
   and ``num_warps`` (CUDA events, median of repeats);
3. decode running on a side stream while bf16 matmuls run on another: each alone, then both together;
4. the link: raw weights copied host-to-device, against compressed bytes copied on a copy stream with
   each tensor decoded on a decode stream after its copy's event (the engine's plan), in GB/s of weights.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from flextensor import codec
from flextensor.codec.triton_decoder import decode_triton

from .codec_sizes import LLAMA_8B_LAYER

REPEATS = 7


def gpu_seconds(work: Callable[[], None], iterations: int, stream: torch.cuda.Stream | None = None) -> float:
    """Median seconds of ``iterations`` calls of ``work`` on ``stream``, timed with CUDA events."""
    stream = stream or torch.cuda.current_stream()
    times = []
    with torch.cuda.stream(stream):
        work()  # warm-up (compiles the kernel)
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iterations):
                work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def make_weights(quick: bool) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = []
    for rows, cols in LLAMA_8B_LAYER.values():
        rows = rows // 8 if quick else rows
        weight = torch.randn(rows, cols, device="cuda", generator=generator) / math.sqrt(cols)
        weights.append(weight.to(torch.bfloat16))
    return weights


def encode_speed(weights: list[torch.Tensor]) -> list[codec.EncodedTensor]:
    raw = sum(w.nbytes for w in weights)
    torch.cuda.synchronize()
    start = time.perf_counter()
    encoded = [codec.encode(w, device="cuda") for w in weights]
    gpu_s = time.perf_counter() - start
    host_copy = weights[0].cpu()
    start = time.perf_counter()
    on_cpu = codec.encode(host_copy)
    cpu_s = time.perf_counter() - start
    assert torch.equal(on_cpu.data, encoded[0].data), "GPU and CPU encodings differ"
    ratio = sum(e.nbytes for e in encoded) / raw
    print(f"weights: {raw / 1e9:.3f} GB bf16, compressed to {ratio:.4f} of raw (index included)")
    print(f"encode on the GPU: {raw / gpu_s / 1e9:.2f} GB/s (input, results copied to the host)")
    print(f"encode on the CPU ({torch.get_num_threads()} threads): {host_copy.nbytes / cpu_s / 1e9:.3f} GB/s")
    return encoded


def encode_breakdown(weights: list[torch.Tensor]) -> None:
    """One unit's pack (the layer's weights packed back to back, pinned) encoded as offload() does, timed
    whole and profiled by operator."""
    from torch.profiler import ProfilerActivity, profile

    from flextensor.host.coded_packs import CodedPack
    from flextensor.host.packs import pack_layout

    entries, nbytes = pack_layout([(f"w{i}", w) for i, w in enumerate(weights)])
    buffer = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    for entry, weight in zip(entries, weights, strict=True):
        buffer[entry.offset : entry.offset + entry.nbytes].copy_(weight.reshape(-1).view(torch.uint8))
    device = torch.device("cuda")
    CodedPack.encode("warm-up", entries, buffer, device).free()
    torch.cuda.synchronize()
    start = time.perf_counter()
    CodedPack.encode("unit", entries, buffer, device).free()
    whole_s = time.perf_counter() - start
    rate = nbytes / whole_s / 1e9
    print(f"CodedPack.encode of one {nbytes / 1e6:.0f} MB unit: {whole_s:.3f} s ({rate:.2f} GB/s)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        CodedPack.encode("unit", entries, buffer, device).free()
    table = trace.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    print(table.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=40))


def decode_sweep(weights: list[torch.Tensor]) -> tuple[list[codec.EncodedTensor], int]:
    raw = sum(w.nbytes for w in weights)
    outputs = [torch.empty_like(w) for w in weights]
    best = (0.0, None, 4)
    print("\n| chunk values | num_warps | decode GB/s (output) |\n|---|---|---|")
    for chunk in (2048, 4096, 8192, 16384):
        encoded = [codec.encode(w, chunk, device="cuda").to("cuda") for w in weights]
        for enc, out, w in zip(encoded, outputs, weights, strict=True):
            decode_triton(enc, out)
            assert torch.equal(out.view(torch.int16), w.view(torch.int16)), f"chunk {chunk}: not bitwise"
        for warps in (2, 4, 8, 16):

            def work(encoded=encoded, warps=warps) -> None:
                for enc, out in zip(encoded, outputs, strict=True):
                    decode_triton(enc, out, num_warps=warps)

            rate = raw * 10 / gpu_seconds(work, 10) / 1e9
            print(f"| {chunk} | {warps} | {rate:.0f} |", flush=True)
            if rate > best[0]:
                best = (rate, encoded, warps)
    print(f"best: {best[0]:.0f} GB/s with num_warps={best[2]}")
    return best[1], best[2]


def concurrent_with_compute(
    weights: list[torch.Tensor], encoded: list[codec.EncodedTensor], warps: int
) -> None:
    raw = sum(w.nbytes for w in weights)
    outputs = [torch.empty_like(w) for w in weights]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    compute_stream, decode_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def matmuls() -> None:
        for _ in range(8):
            torch.mm(a, b)

    def decodes() -> None:
        for enc, out in zip(encoded, outputs, strict=True):
            decode_triton(enc, out, num_warps=warps)

    compute_s = gpu_seconds(matmuls, 4, compute_stream)
    decode_iters = max(1, round(compute_s / gpu_seconds(decodes, 1, decode_stream)))
    decode_s = gpu_seconds(decodes, decode_iters, decode_stream)
    matmul_tflops = 4 * 8 * 2 * 8192**3 / compute_s / 1e12
    together = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(compute_stream):
            for _ in range(4):
                matmuls()
        with torch.cuda.stream(decode_stream):
            for _ in range(decode_iters):
                decodes()
        torch.cuda.synchronize()
        together.append(time.perf_counter() - start)
    both_s = statistics.median(together)
    print(
        f"\nalone: matmuls {compute_s * 1e3:.1f} ms ({matmul_tflops:.0f} TFLOP/s), decode x{decode_iters} "
        f"{decode_s * 1e3:.1f} ms ({raw * decode_iters / decode_s / 1e9:.0f} GB/s); on two streams together: "
        f"{both_s * 1e3:.1f} ms wall (sum alone {1e3 * (compute_s + decode_s):.1f} ms, max "
        f"{1e3 * max(compute_s, decode_s):.1f} ms)"
    )


def behind_the_link(weights: list[torch.Tensor], encoded: list[codec.EncodedTensor], warps: int) -> None:
    raw = sum(w.nbytes for w in weights)
    host_raw = [w.cpu().pin_memory() for w in weights]
    device_raw = [torch.empty_like(w) for w in weights]
    host_streams = [e.data.cpu().pin_memory() for e in encoded]
    staging = [torch.empty_like(h, device="cuda") for h in host_streams]
    on_device = [
        codec.EncodedTensor(e.dtype, e.shape, e.chunk_elements, s, e.chunk_offsets, e.chunk_widths)
        for e, s in zip(encoded, staging, strict=True)
    ]
    outputs = [torch.empty_like(w) for w in weights]
    copy_stream, decode_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def copy_raw() -> None:
        for dst, src in zip(device_raw, host_raw, strict=True):
            dst.copy_(src, non_blocking=True)

    def copy_and_decode() -> None:
        decode_stream.wait_stream(torch.cuda.current_stream())
        for host, stage, enc, out in zip(host_streams, staging, on_device, outputs, strict=True):
            stage.copy_(host, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
            decode_stream.wait_event(copied)
            with torch.cuda.stream(decode_stream):
                decode_triton(enc, out, num_warps=warps)
        torch.cuda.current_stream().wait_stream(decode_stream)

    raw_s = gpu_seconds(copy_raw, 3, copy_stream)
    compressed_s = gpu_seconds(copy_and_decode, 3, copy_stream)
    for out, w in zip(outputs, weights, strict=True):
        assert torch.equal(out.view(torch.int16), w.view(torch.int16))
    print(
        f"\nlink: raw copy {raw * 3 / raw_s / 1e9:.1f} GB/s of weights; compressed copy + decode "
        f"{raw * 3 / compressed_s / 1e9:.1f} GB/s of weights ({raw_s / compressed_s:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="an eighth of the weights")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.codec_decode needs a CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    weights = make_weights(args.quick)
    encode_speed(weights)
    encode_breakdown(weights)
    encoded, warps = decode_sweep(weights)
    concurrent_with_compute(weights, encoded, warps)
    behind_the_link(weights, encoded, warps)


if __name__ == "__main__":
    main()
