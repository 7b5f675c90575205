"""A model's parameters as metadata: :func:`parameter_signatures`, what a saved profile and a shared host
segment are fingerprinted with. Reads only tensor metadata, so importing it does not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["parameter_signatures"]


def parameter_signatures(model: nn.Module) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(FQN, shape, dtype string) of every parameter of ``model``, in ``named_parameters`` order.

    Read from the tensor metadata only, so this works on meta and offloaded parameters alike: what a
    saved profile and a shared host segment are fingerprinted with.
    """
    return tuple(
        (name, tuple(int(d) for d in param.shape), str(param.dtype))
        for name, param in model.named_parameters()
    )
