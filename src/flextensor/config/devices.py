"""What a config's ``device`` means on this machine: :func:`resolve_device`.

``OffloadConfig`` checks the value's syntax when it is built; which device an unset or bare ``'cuda'``
stands for, and whether it exists, depends on the machine, so it is asked here, when ``offload()`` resolves
its target (device/runtime.py) or a caller asks ``OffloadConfig.resolved_device()``.
"""

from __future__ import annotations

import torch

from flextensor.errors import ConfigError

__all__ = ["resolve_device"]


def resolve_device(device: str | None) -> torch.device:
    """The device to use for a config's ``device``: itself, or the current CUDA device when unset and
    CUDA is available, else CPU. A bare ``'cuda'`` resolves to the current CUDA device with its index.

    Raises:
        ConfigError: the device is CUDA but CUDA is not available, or its index does not exist.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device is {device!r} but CUDA is not available here; set device='cpu' or leave it unset"
        )
    if resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if resolved.index >= count:
        raise ConfigError(
            f"device is {device!r} but only {count} CUDA device(s) exist; use an index below {count}"
        )
    return resolved
