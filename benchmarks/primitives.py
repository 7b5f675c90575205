"""What each CUDA primitive of the hot path costs the host, called from Python (GPU only).

    python -m benchmarks.primitives

Times, in microseconds per call (median of batches), torch's event record / stream wait / stream switch /
a small pinned copy, the same through the CUDA driver API with ctypes, and a module call with and
without forward hooks: the pieces a streamed unit's pre- and post-hook are made of.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

CALLS = 400
"""Calls per batch; the device is drained between batches so that queued copies never block the host."""

BATCHES = 7


def _per_call_us(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(BATCHES):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    side = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()
    event = torch.cuda.Event()
    event.record(main_stream)
    src = torch.empty(128 * 1024, dtype=torch.uint8).pin_memory()
    dst = torch.empty(128 * 1024, dtype=torch.uint8, device="cuda")
    rows: list[tuple[str, float]] = []
    rows.append(("torch.cuda.current_stream()", _per_call_us(torch.cuda.current_stream)))
    rows.append(("Event.record(stream)", _per_call_us(lambda: event.record(side))))
    rows.append(("Stream.wait_event(event)", _per_call_us(lambda: main_stream.wait_event(event))))

    def switch() -> None:
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(main_stream)

    rows.append(("torch.cuda.set_stream x2 (there and back)", _per_call_us(switch)))

    def copy_on_side() -> None:
        torch.cuda.set_stream(side)
        dst.copy_(src, non_blocking=True)
        torch.cuda.set_stream(main_stream)

    rows.append(("copy_ 128 KiB pinned, on a side stream (incl. switch)", _per_call_us(copy_on_side)))
    same_stream = _per_call_us(lambda: dst.copy_(src, non_blocking=True))
    rows.append(("copy_ 128 KiB pinned, current stream", same_stream))

    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    driver.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    driver.cuMemcpyHtoDAsync_v2.argtypes = [
        ctypes.c_uint64,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    ev, s_side, s_main = event.cuda_event, side.cuda_stream, main_stream.cuda_stream
    d_ptr, s_ptr, n = dst.data_ptr(), src.data_ptr(), src.numel()
    record, wait, memcpy = driver.cuEventRecord, driver.cuStreamWaitEvent, driver.cuMemcpyHtoDAsync_v2
    rows.append(("driver cuEventRecord (ctypes)", _per_call_us(lambda: record(ev, s_side))))
    rows.append(("driver cuStreamWaitEvent (ctypes)", _per_call_us(lambda: wait(s_main, ev, 0))))
    copy_us = _per_call_us(lambda: memcpy(d_ptr, s_ptr, n, s_side))
    rows.append(("driver cuMemcpyHtoDAsync 128 KiB (ctypes)", copy_us))

    layer = nn.Linear(256, 256).cuda()
    x = torch.randn(1, 256, device="cuda")
    with torch.no_grad():
        rows.append(("Linear(256) call, no hooks", _per_call_us(lambda: layer(x))))
        layer.register_forward_pre_hook(lambda m, a: None, prepend=True)
        layer.register_forward_hook(lambda m, a, o: None, always_call=True)
        rows.append(("Linear(256) call, empty pre + post hooks", _per_call_us(lambda: layer(x))))
    width = max(len(name) for name, _ in rows)
    print(f"{'primitive':<{width}}  us/call")
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
