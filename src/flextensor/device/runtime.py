"""The device, resolved once: which one, whether to pin, the budget; its streams and events, or CPU stand-ins.

:func:`resolve_target` turns a config into a :class:`Target` when ``offload()`` starts, and nothing later
asks the config again. With ``device="cpu"`` the engine runs the same code path (host store, arena,
copies, events): copies are synchronous memcpy and events read the host clock, which is exact because CPU
work is synchronous. Nothing here touches CUDA until a target for a CUDA device is resolved.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flextensor.config.devices import resolve_device
from flextensor.device.cudart import CudartCalls
from flextensor.errors import ConfigError, PlanError

if TYPE_CHECKING:
    from flextensor.config.schema import OffloadConfig
    from flextensor.device.host_limits import HostLimits

__all__ = [
    "DeviceRuntime",
    "HostCalls",
    "HostEvent",
    "HostStream",
    "Target",
    "distributed_place",
    "resolve_target",
]


class HostEvent:
    """CPU stand-in for ``torch.cuda.Event``: records the host clock; waiting is a no-op."""

    __slots__ = ("_t",)

    def __init__(self) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``, like ``torch.cuda.Event.elapsed_time``."""
        if self._t is None or end._t is None:
            raise PlanError("both events must be recorded before elapsed_time()")
        return (end._t - self._t) * 1000.0

    def __repr__(self) -> str:
        return f"HostEvent(recorded={self._t is not None})"


class HostStream:
    """CPU stand-in for a CUDA stream: everything is already ordered."""

    __slots__ = ()

    cuda_stream = 0  # the handle the direct calls take (HostCalls ignores it)

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "HostStream()"


logger = logging.getLogger("flextensor")


def profiler_running() -> bool:
    """Whether a torch profiler (Kineto, or NVTX ranges for Nsight) records right now: asked once per
    forward, so that forwards without one pay for no range (see steady.ProfiledStep)."""
    return torch._C._autograd._profiler_enabled()


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A range named ``name`` in the trace of a torch profiler running now, else nothing: for plan-time
    work (layouts, uploads, vacating), so that a trace of a pipeline shows what a switch between its
    components costs. The steady forward has ranges of its own (steady.ProfiledStep)."""
    if profiler_running():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class HostCalls:
    """CPU stand-in for :class:`CudartCalls`: a record reads the host clock, a wait is nothing (CPU work is
    already ordered), a copy is a memmove."""

    __slots__ = ()

    def record(self, event: HostEvent, stream_handle: int, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream_handle: int, event: HostEvent) -> None:
        return None

    def copy_to_device(self, destination: int, source: int, nbytes: int, stream_handle: int) -> None:
        ctypes.memmove(destination, source, nbytes)


_CUDART: CudartCalls | None = None
_CUDART_LOOKED_UP = False


def _no_stream_switch(stream: Any) -> None:
    return None


def _no_stream_handle() -> int:
    return 0


class DeviceRuntime:
    """Everything the engine asks of the device: streams, events, memory statistics.

    ``set_stream(stream)`` makes ``stream`` current (a no-op on CPU); the hot path switches to
    ``copy_stream`` and back with it, without a context manager.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.is_cuda = device.type == "cuda"
        # Whether memory_allocated() measures the device: weights outside the units then count in a plan's
        # baseline (the CPU stand-in counts nothing).
        self.counts_memory = self.is_cuda
        self._copy_stream: Any = None
        self._decode_stream: Any = None
        self._host_stream = HostStream()
        self.set_stream = torch.cuda.set_stream if self.is_cuda else _no_stream_switch
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) if self.is_cuda else None
        # The current stream's raw handle on this device, for the direct calls (0 on CPU).
        self.current_stream_handle: Callable[[], int] = (
            functools.partial(raw_stream, device.index) if raw_stream is not None else _no_stream_handle
        )

    def __repr__(self) -> str:
        return f"DeviceRuntime({self.device})"

    # -- streams and events -------------------------------------------------------------------------------

    @property
    def copy_stream(self) -> Any:
        """The side stream that carries host-to-device copies (created on first use)."""
        if not self.is_cuda:
            return self._host_stream
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        return self._copy_stream

    @property
    def decode_stream(self) -> Any:
        """The side stream that decodes compressed loads (host/coded_packs.py; created on first use, kept for
        the model's life: a stream per layout would cycle through torch's stream pool)."""
        if not self.is_cuda:
            return self._host_stream
        if self._decode_stream is None:
            self._decode_stream = torch.cuda.Stream(device=self.device)
        return self._decode_stream

    def current_stream(self) -> Any:
        if not self.is_cuda:
            return self._host_stream
        return torch.cuda.current_stream(self.device)

    def event(self, timing: bool = False) -> Any:
        if not self.is_cuda:
            return HostEvent()
        return torch.cuda.Event(enable_timing=timing)

    def is_current(self) -> bool:
        """Whether this is the current CUDA device (always, on CPU)."""
        return not self.is_cuda or torch.cuda.current_device() == self.device.index

    def direct_calls(self) -> CudartCalls | HostCalls | None:
        """Direct calls into PyTorch's CUDA runtime for the hot path (see [Note: direct runtime calls] in
        device/cudart.py), None when it cannot be found (warned once per process); their stand-in on CPU."""
        if not self.is_cuda:
            return HostCalls()
        if torch.version.hip or self.current_stream_handle is _no_stream_handle:
            return None  # ROCm has no libcudart; a build without the raw stream lookup: torch's calls
        global _CUDART, _CUDART_LOOKED_UP
        if not _CUDART_LOOKED_UP:
            _CUDART_LOOKED_UP = True
            _CUDART = CudartCalls.load()
            if _CUDART is None:
                logger.warning(
                    "flextensor did not find the CUDA runtime library PyTorch loaded (a statically linked "
                    "build?): streaming issues its copies and events through torch, which costs the host "
                    "a few microseconds more per streamed unit"
                )
        return _CUDART

    def synchronize(self) -> None:
        """Wait for all work on the device. Plan time and profiling only, never the hot path."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # -- memory ---------------------------------------------------------------------------------------------

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else 0

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else 0

    def reset_peak_memory(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def fits_outside_cache(self, nbytes: int) -> bool:
        """Whether ``nbytes`` can be allocated on the device without the caching allocator freeing what it
        caches (which waits for the device): the device's free memory, on CPU always."""
        if not self.is_cuda:
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        return free >= nbytes

    def total_memory(self) -> int | None:
        """What this process may allocate on the device (None on CPU, where it is not counted)."""
        if not self.is_cuda:
            return None
        total = torch.cuda.get_device_properties(self.device).total_memory
        # A process capped with torch.cuda.set_per_process_memory_fraction cannot allocate past the cap:
        # plan for that, as for a smaller card. torch < 2.6 and pluggable allocators cannot report it.
        try:
            fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        except (AttributeError, RuntimeError):
            fraction = 1.0
        return int(total * fraction)

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.is_cuda else "cpu"


@dataclass(frozen=True)
class Target:
    """Where an offloaded model runs, resolved once by ``offload()``.

    ``device``: with its index for CUDA. ``pin``: whether host packs are page-locked (CUDA only).
    ``budget_bytes``: the device-memory budget, None without one. ``runtime``: the device's streams.
    ``host_budget_bytes``: the most host bytes to treat as page-locked (packs copied directly, and the
    staging ring), None for no bound (see store/host_budget.py). ``host_limits``: what bounded it.
    """

    device: torch.device
    pin: bool
    budget_bytes: int | None
    runtime: DeviceRuntime
    host_budget_bytes: int | None = None
    host_limits: HostLimits | None = None


def resolve_pinning(pinned_memory: bool | None, device: torch.device) -> bool:
    """Whether to page-lock host packs: unset means on for a CUDA device. Pinning only speeds up copies
    to a CUDA device, so for any other device this is False even when ``pinned_memory`` is True."""
    if device.type != "cuda":
        return False
    return True if pinned_memory is None else pinned_memory


def resolve_budget(config: OffloadConfig, total_device_bytes: int | None) -> int | None:
    """The device-memory budget in bytes, or None when neither budget field is set.

    ``total_device_bytes``: what this process may use on the device; needed only for
    ``max_gpu_mem_fraction`` (the budget is then that fraction of it, rounded down).

    Raises:
        ConfigError: ``max_gpu_mem_fraction`` is set but the device's memory is unknown (a CPU device).
    """
    if config.gpu_memory_budget is not None:
        return config.gpu_memory_budget
    if config.max_gpu_mem_fraction is None:
        return None
    if total_device_bytes is None or total_device_bytes <= 0:
        raise ConfigError(
            f"max_gpu_mem_fraction={config.max_gpu_mem_fraction} needs the device's total memory, "
            f"got {total_device_bytes!r}; set gpu_memory_budget (e.g. '8GiB') instead"
        )
    return math.floor(total_device_bytes * config.max_gpu_mem_fraction)


def resolve_target(config: OffloadConfig) -> Target:
    """Device, pinning and budget for ``config``, checked once (see :class:`Target`)."""
    from flextensor.device.host_limits import detect_host_limits

    device = resolve_device(config.device)
    runtime = DeviceRuntime(device)
    pin = resolve_pinning(config.pinned_memory, device)
    limits = detect_host_limits() if pin else None
    return Target(
        device=runtime.device,
        pin=pin,
        budget_bytes=resolve_budget(config, runtime.total_memory()),
        runtime=runtime,
        host_budget_bytes=resolve_host_budget(config.host_memory_budget, limits),
        host_limits=limits,
    )


def resolve_host_budget(explicit: int | None, limits: HostLimits | None) -> int | None:
    """The host pinning budget: the tighter of ``explicit`` (host_memory_budget) and what ``limits``
    allow. Without pinning (a CPU device, pinned_memory=False) ``limits`` is None and only an explicit
    budget applies: on a CPU it runs the staged path the same way, which is how CI tests it."""
    caps = [c for c in (explicit, None if limits is None else limits.pinned_cap()) if c is not None]
    return min(caps, default=None)


def distributed_place() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside torch.distributed."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
