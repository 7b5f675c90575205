"""The three CUDA runtime calls of the steady hot path, made straight into the runtime PyTorch loaded.

[Note: direct runtime calls]
A streamed unit costs the host an event wait in its pre-hook and, in its post-hook, an event record, a
wait and a copy per unit it prefetches. Through torch each is several Python frames and a dispatch
(``Stream.wait_event`` calls ``Event.wait``; ``Tensor.copy_`` builds a TensorIterator and needs the copy
stream made current and then the compute stream again): 8.6 us for a small pinned copy on a side stream,
1.4-1.5 us per record or wait on the H200 host, against 3.3 / 1.0 / 1.3 us for the same calls made
through ctypes (``python -m benchmarks.primitives``). :class:`CudartCalls` binds ``cudaEventRecord``,
``cudaStreamWaitEvent`` and ``cudaMemcpyAsync`` of the very libcudart PyTorch uses (found among the
process's mapped files, never loaded on its own: a second runtime would be a second set of contexts), so
events and streams are PyTorch's own handles and the calls are the ones PyTorch would make.

What torch does around these calls and they do not: an event is created on its first record (handle 0
before: :meth:`record` leaves that one to torch, :meth:`wait` skips it as torch does); the current device
is switched to the event's (the steady step uses these calls only while the model's device is current);
a copy from PyTorch's caching host allocator is recorded against reuse (packs are page-locked with
``cudaHostRegister``, not allocated there).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from flextensor.errors import DeviceError

__all__ = ["CudartCalls", "loaded_cudart_path"]

_MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


def loaded_cudart_path(maps: str | None = None, cuda_version: str | None = None) -> str | None:
    """The path of the CUDA runtime library PyTorch uses among those mapped into this process: the one of
    ``cuda_version``'s major version (default ``torch.version.cuda``; CuPy or an extension may map
    another); None when there is none (a CPU build, a runtime linked statically). ``maps``: the text of
    /proc/self/maps (read if None)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    if cuda_version is None:
        cuda_version = torch.version.cuda
    found: list[str] = []
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith("libcudart.so") and path not in found:
            found.append(path)
    if not cuda_version:
        return found[0] if len(found) == 1 else None
    major = f"libcudart.so.{cuda_version.split('.')[0]}"
    matching = [p for p in found if Path(p).name == major or Path(p).name.startswith(major + ".")]
    return matching[0] if matching else None  # another major version is not torch's runtime


class CudartCalls:
    """``cudaEventRecord``, ``cudaStreamWaitEvent`` and ``cudaMemcpyAsync`` on raw handles (see
    [Note: direct runtime calls]). A failed call raises :class:`DeviceError` with the runtime's message."""

    __slots__ = ("_clear_error", "_copy", "_error_string", "_record", "_wait")

    def __init__(self, path: str) -> None:
        library = ctypes.CDLL(path)  # already mapped: the same library object torch calls
        self._record = library.cudaEventRecord
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._record.restype = ctypes.c_int
        self._wait = library.cudaStreamWaitEvent
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._wait.restype = ctypes.c_int
        self._copy = library.cudaMemcpyAsync
        pointer, size, kind = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._copy.argtypes = [pointer, pointer, size, kind, pointer]
        self._copy.restype = ctypes.c_int
        self._clear_error = library.cudaGetLastError
        self._clear_error.restype = ctypes.c_int
        self._error_string = library.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p

    @classmethod
    def load(cls) -> CudartCalls | None:
        """The calls into PyTorch's runtime, or None when it cannot be found in this process."""
        path = loaded_cudart_path()
        if path is None:
            return None
        try:
            return cls(path)
        except (OSError, AttributeError):
            return None

    def record(self, event: object, stream_handle: int, stream: object) -> None:
        """Record ``event`` on the stream ``stream_handle``. An event not created yet is recorded by torch
        on ``stream``, the same stream as a torch object (None: the current stream), which creates it."""
        handle = event.cuda_event  # type: ignore[attr-defined]
        if not handle:
            event.record(stream)  # type: ignore[attr-defined]
            return
        err = self._record(handle, stream_handle)
        if err:
            self._fail("cudaEventRecord", err)

    def wait(self, stream_handle: int, event: object) -> None:
        """Make the stream ``stream_handle`` wait for ``event``; an event never recorded is no wait."""
        handle = event.cuda_event  # type: ignore[attr-defined]
        if handle:
            err = self._wait(stream_handle, handle, 0)
            if err:
                self._fail("cudaStreamWaitEvent", err)

    def copy_to_device(self, destination: int, source: int, nbytes: int, stream_handle: int) -> None:
        """Copy ``nbytes`` from host address ``source`` to device address ``destination`` on the stream."""
        err = self._copy(destination, source, nbytes, _MEMCPY_HOST_TO_DEVICE, stream_handle)
        if err:
            self._fail("cudaMemcpyAsync", err)

    def _fail(self, call: str, err: int) -> None:
        self._clear_error()  # else torch reports it again at its next kernel launch, as its own failure
        message = self._error_string(err).decode(errors="replace")
        raise DeviceError(f"{call} failed with CUDA error {err}: {message}")
