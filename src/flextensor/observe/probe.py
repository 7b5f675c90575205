"""``flextensor probe``: how fast this machine moves bytes between host and GPU, and how fast it pins.

Measures, at each requested size, host-to-device and device-to-host copies from pinned and from pageable
host memory (median of a few copies, timed with CUDA events), and how fast host memory can be page-locked:
``cudaHostRegister`` on a fresh anonymous mapping, alone and after a zero is written into each page (the
way ``flextensor.offload`` pins each unit), the latter from several threads at once too (as
``offload(weights=...)`` pins, a unit per reading thread), and ``torch.Tensor.pin_memory()``. Streaming
speed is bounded by the copies; the time ``offload()`` spends before the first forward, by the pinning.

Needs CUDA; importing this module does not touch it.
"""

from __future__ import annotations

import contextlib
import mmap
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from flextensor.common.progress import progress_bar
from flextensor.common.sizes import format_bytes
from flextensor.errors import ConfigError, NoCudaError, PinningError

if TYPE_CHECKING:
    import torch
    from rich.console import RenderableType

__all__ = [
    "DEFAULT_SIZES",
    "CopyMeasurement",
    "NoCudaError",
    "PinMeasurement",
    "ProbeResult",
    "measure_copy",
    "measure_host_register",
    "measure_parallel_host_register",
    "measure_pin_memory",
    "measure_staged_copy",
    "run_probe",
]

DEFAULT_SIZES: tuple[int, ...] = (1 << 20, 16 << 20, 256 << 20)
"""1 MiB (latency-bound), 16 MiB (a small layer) and 256 MiB (a large layer, at full link speed)."""

DEFAULT_REPEATS = 5
"""Copies per measurement after one warm-up; the median ignores a stray slow one."""

PIN_REPEATS = 3
"""Pinning is slower and steadier than copying: fewer repeats suffice."""

Direction = Literal["host_to_device", "device_to_host"]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


@dataclass(frozen=True)
class CopyMeasurement:
    """One copy size in one direction from one kind of host memory. ``seconds``: median per copy."""

    direction: Direction
    pinned: bool
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Speed in GB/s (10^9 bytes per second)."""
        return _gbps(self.nbytes, self.seconds)


@dataclass(frozen=True)
class PinMeasurement:
    """Page-locking ``nbytes`` of host memory by ``method``. ``seconds``: median per call."""

    method: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Bytes pinned per second, in GB/s."""
        return _gbps(self.nbytes, self.seconds)


@dataclass(frozen=True)
class ProbeResult:
    """Everything one probe measured; ``print`` it with rich, or ``to_dict`` it."""

    device: str
    device_name: str
    copies: tuple[CopyMeasurement, ...]
    pinning: tuple[PinMeasurement, ...]
    staged: tuple[CopyMeasurement, ...] = ()  # host-to-device from pageable memory through a staging ring
    host_limits: str = ""  # what bounds page-locking here (device/host_limits.py)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data, each measurement with its ``gbps``."""
        return {
            "device": self.device,
            "device_name": self.device_name,
            "copies": [{**asdict(c), "gbps": c.gbps} for c in self.copies],
            "pinning": [{**asdict(p), "gbps": p.gbps} for p in self.pinning],
            "staged": [{**asdict(c), "gbps": c.gbps} for c in self.staged],
            "host_limits": self.host_limits,
        }

    def __rich__(self) -> RenderableType:
        from rich.console import Group
        from rich.table import Table

        copies = Table(
            title=f"host <-> {self.device} ({self.device_name}) copies, GB/s", title_justify="left"
        )
        copies.add_column("size", justify="right")
        kinds = [
            ("host_to_device", True, "H2D pinned"),
            ("host_to_device", False, "H2D pageable"),
            ("device_to_host", True, "D2H pinned"),
            ("device_to_host", False, "D2H pageable"),
        ]
        for _, _, label in kinds:
            copies.add_column(label, justify="right")
        staged = {c.nbytes: c for c in self.staged}
        if staged:
            copies.add_column("H2D staged", justify="right")
        by_key = {(c.direction, c.pinned, c.nbytes): c for c in self.copies}
        for size in sorted({c.nbytes for c in self.copies}):
            cells = []
            for direction, pinned, _ in kinds:
                found = by_key.get((direction, pinned, size))
                cells.append("-" if found is None else f"{found.gbps:.1f}")
            if staged:
                cells.append(f"{staged[size].gbps:.1f}" if size in staged else "-")
            copies.add_row(format_bytes(size), *cells)

        pinning = Table(title="pinning host memory", title_justify="left")
        pinning.add_column("method")
        pinning.add_column("size", justify="right")
        pinning.add_column("ms", justify="right")
        pinning.add_column("GB/s", justify="right")
        for p in self.pinning:
            pinning.add_row(p.method, format_bytes(p.nbytes), f"{p.seconds * 1e3:.1f}", f"{p.gbps:.2f}")
        if not self.host_limits:
            return Group(copies, pinning)
        return Group(copies, pinning, f"host limits: {self.host_limits}")


def _cuda_device(device: str | torch.device) -> torch.device:
    import torch

    resolved = torch.device(device)
    if resolved.type != "cuda":
        raise NoCudaError(f"probe measures a CUDA device's link to the host; got device {str(device)!r}")
    if not torch.cuda.is_available():
        raise NoCudaError("no CUDA device: probe measures the host-device link")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    if resolved.index >= torch.cuda.device_count():
        raise NoCudaError(f"no CUDA device {resolved}: this machine has {torch.cuda.device_count()}")
    return resolved


def measure_copy(
    device: str | torch.device,
    nbytes: int,
    direction: Direction,
    pinned: bool,
    repeats: int = DEFAULT_REPEATS,
) -> CopyMeasurement:
    """Median time of one ``nbytes`` copy between host memory (pinned or pageable) and ``device``."""
    import torch

    dev = _cuda_device(device)
    host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)
    host.fill_(1)  # touch every page, so page faults are not timed as copy time
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src, dst = (host, gpu) if direction == "host_to_device" else (gpu, host)
    stream = torch.cuda.current_stream(dev)
    times = []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
        end.synchronize()
        if i:  # the first copy pays one-off costs (staging buffers, lazy init)
            times.append(start.elapsed_time(end) / 1e3)
    return CopyMeasurement(direction, pinned, nbytes, statistics.median(times))


def measure_staged_copy(
    device: str | torch.device, nbytes: int, repeats: int = DEFAULT_REPEATS
) -> CopyMeasurement:
    """Median time of one ``nbytes`` host-to-device copy from pageable memory through the staging ring that
    units beyond the host budget stream through (see host/staging.py), host clock included: its memcpy into
    the ring is part of the cost."""
    import torch

    from flextensor.device.runtime import DeviceRuntime
    from flextensor.host.staging import StagingRing, staging_layout

    dev = _cuda_device(device)
    runtime = DeviceRuntime(dev)
    slot, slots = staging_layout(nbytes)
    ring = StagingRing(slot, slots, runtime, pin=True)
    host = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    host.fill_(1)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    stream = runtime.copy_stream
    times = []
    try:
        with torch.cuda.stream(stream):
            for i in range(repeats + 1):
                torch.cuda.synchronize(dev)
                begin = time.perf_counter()
                ring.copy_from_host(gpu, host, stream)
                torch.cuda.synchronize(dev)
                if i:
                    times.append(time.perf_counter() - begin)
    finally:
        ring.free()
    return CopyMeasurement("host_to_device", False, nbytes, statistics.median(times))


def measure_host_register(nbytes: int, repeats: int = PIN_REPEATS, fault_in: bool = True) -> PinMeasurement:
    """Median time to pin a fresh anonymous mapping of ``nbytes``: with ``fault_in``, a zero written into
    each page and then ``cudaHostRegister``, as offload() pins a pack (see [Note: fault pages in before
    page-locking] in host/packs.py); without, ``cudaHostRegister`` on the unmapped pages alone.

    Each repeat maps new memory (huge pages advised, as flextensor's host store does), so page population
    is part of the time, as it is when offload() pins a unit.
    """
    import torch

    _cuda_device("cuda")
    cudart = torch.cuda.cudart()
    size = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages, as mmap maps
    times = []
    for _ in range(repeats):
        mapping = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_HUGEPAGE") and size >= 2 << 20:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=size)
        begin = time.perf_counter()
        if fault_in:
            buffer[:: mmap.PAGESIZE].zero_()
        err = int(cudart.cudaHostRegister(buffer.data_ptr(), size, 0))
        elapsed = time.perf_counter() - begin
        if err != 0:
            del buffer
            _close(mapping)
            raise PinningError(
                f"cudaHostRegister of {format_bytes(size)} failed with CUDA error {err}; "
                "check the memlock limit (ulimit -l)"
            )
        cudart.cudaHostUnregister(buffer.data_ptr())
        del buffer
        _close(mapping)
        times.append(elapsed)
    method = (
        "fault in + cudaHostRegister (as offload pins)" if fault_in else "cudaHostRegister, pages unmapped"
    )
    return PinMeasurement(method, size, statistics.median(times))


def measure_parallel_host_register(nbytes: int, threads: int, repeats: int = PIN_REPEATS) -> PinMeasurement:
    """Median wall time to fault in and ``cudaHostRegister`` ``threads`` fresh mappings of ``nbytes`` each,
    all at once from ``threads`` threads: how ``offload(weights=...)`` pins, a unit per reading thread.
    Set against :func:`measure_host_register` it says whether pinning runs in parallel."""
    import torch

    _cuda_device("cuda")
    device = torch.cuda.current_device()

    def one() -> float:
        torch.cuda.set_device(device)  # a new thread starts on device 0
        return measure_host_register(nbytes, repeats=1).seconds

    times = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            begin = time.perf_counter()
            list(pool.map(lambda _: one(), range(threads)))
            times.append(time.perf_counter() - begin)
    size = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    return PinMeasurement(
        f"fault in + cudaHostRegister, {threads} threads at once", size * threads, statistics.median(times)
    )


def _close(mapping: mmap.mmap) -> None:
    # A tensor still viewing the mapping keeps it exported; then it is unmapped when that tensor dies.
    with contextlib.suppress(BufferError):
        mapping.close()


def measure_pin_memory(nbytes: int, repeats: int = PIN_REPEATS) -> PinMeasurement:
    """Median time of ``tensor.pin_memory()`` on a pageable tensor of ``nbytes`` (allocation and copy)."""
    import torch

    _cuda_device("cuda")
    source = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    source.fill_(1)
    # Without emptying torch's pinned-block cache, every call after the first reuses one block.
    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
    times = []
    for _ in range(repeats):
        if empty_host_cache is not None:
            empty_host_cache()
        begin = time.perf_counter()
        pinned = source.pin_memory()
        elapsed = time.perf_counter() - begin
        del pinned
        times.append(elapsed)
    return PinMeasurement("torch pin_memory()", nbytes, statistics.median(times))


def run_probe(
    device: str | torch.device = "cuda",
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
) -> ProbeResult:
    """Measure copies both ways, pinned and pageable, at every size, and pinning at the largest size.

    Raises NoCudaError without a usable CUDA device. Shows a progress bar on stderr when it takes long
    (see :mod:`flextensor.common.progress`).
    """
    import torch

    from flextensor.host.checkpoint import READ_THREADS

    dev = _cuda_device(device)
    sizes = sorted(set(sizes))
    if not sizes or sizes[0] <= 0:
        raise ConfigError(f"probe sizes must be positive byte counts, got {list(sizes)}")
    if repeats < 1:
        raise ConfigError(f"probe repeats must be at least 1, got {repeats}")
    kinds: list[tuple[Direction, bool]] = [
        ("host_to_device", True),
        ("host_to_device", False),
        ("device_to_host", True),
        ("device_to_host", False),
    ]
    copies = []
    pinning = []
    staged = []
    with progress_bar("Probing the host-device link", len(sizes) * (len(kinds) + 1) + 3) as bar:
        for size in sizes:
            for direction, pinned in kinds:
                copies.append(measure_copy(dev, size, direction, pinned, repeats))
                bar.advance(1)
            staged.append(measure_staged_copy(dev, size, repeats))
            bar.advance(1)
        with torch.cuda.device(dev):
            pinning.append(measure_host_register(sizes[-1], fault_in=False))
            pinning.append(measure_host_register(sizes[-1]))
            bar.advance(1)
            pinning.append(measure_parallel_host_register(sizes[-1], READ_THREADS))
            bar.advance(1)
            pinning.append(measure_pin_memory(sizes[-1]))
            bar.advance(1)
    from flextensor.device.host_limits import detect_host_limits

    return ProbeResult(
        str(dev),
        torch.cuda.get_device_name(dev),
        tuple(copies),
        tuple(pinning),
        tuple(staged),
        detect_host_limits().describe(),
    )
