"""The device, resolved once: streams, events and memory statistics, or their CPU stand-ins.

With ``device="cpu"`` the engine runs the same code path (host store, arena, copies, events); copies are
synchronous memcpy and events read the host clock, which is exact because CPU work is synchronous. Nothing
here touches CUDA until a runtime for a CUDA device is built inside ``offload()``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch


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
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._t - self._t) * 1000.0

    def __repr__(self) -> str:
        return f"HostEvent(recorded={self._t is not None})"


class HostStream:
    """CPU stand-in for a CUDA stream: everything is already ordered."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "HostStream()"


class DeviceRuntime:
    """Everything the engine asks of the device. Build one per offloaded model, inside ``offload()``."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._copy_stream: Any = None
        self._host_stream = HostStream()

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

    def current_stream(self) -> Any:
        if not self.is_cuda:
            return self._host_stream
        return torch.cuda.current_stream(self.device)

    def event(self, timing: bool = False) -> Any:
        if not self.is_cuda:
            return HostEvent()
        return torch.cuda.Event(enable_timing=timing)

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        if not self.is_cuda:
            yield
            return
        with torch.cuda.stream(self.copy_stream):
            yield

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

    def total_memory(self) -> int | None:
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
