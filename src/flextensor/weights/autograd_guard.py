"""Backward through streamed weights fails loudly instead of computing wrong gradients.

A streamed weight's arena range is overwritten by other units after its compute, so a tensor autograd
saved from it would hold another unit's bytes at backward time. While a forward with grad enabled runs,
one saved-tensors hook (:class:`StreamedWeightGuard`) replaces every saved tensor that views the arena by
a marker; unpacking the marker raises :class:`~flextensor.errors.BackwardNotSupportedError`. Resident
weights and activations are saved as usual, so inference with grad enabled (the default outside
``torch.no_grad()``) runs unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from flextensor.errors import BackwardNotSupportedError

__all__ = ["StreamedWeightGuard"]


class _StreamedWeightRef:
    """What autograd saves in place of a streamed weight."""

    __slots__ = ()


def _unpack(saved: Any) -> Any:
    if isinstance(saved, _StreamedWeightRef):
        raise BackwardNotSupportedError(
            "backward reached weights that flextensor streams for inference and overwrites after use, so "
            "their gradients would be wrong; run forwards under torch.no_grad() or inference_mode(), or "
            "call flextensor.release(model) to train"
        )
    return saved


class StreamedWeightGuard:
    """One saved-tensors hook for a whole forward; :meth:`enter` and :meth:`exit` are safe to repeat."""

    def __init__(self) -> None:
        self._hooks: Any = None

    def enter(self, arena: torch.Tensor) -> None:
        self.exit()
        # By address: each streamed parameter has a storage object of its own over the arena's bytes.
        start = arena.data_ptr()
        end = start + arena.nbytes

        def pack(tensor: torch.Tensor) -> Any:
            try:
                storage = tensor.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                return tensor  # wrapper subclasses and sparse tensors have no plain storage to alias
            return _StreamedWeightRef() if start <= storage < end else tensor

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        self._hooks.__enter__()

    def exit(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
