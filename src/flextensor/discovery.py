"""Discovery: which weights are read outside the forward of the unit that owns them.

During discovery forwards a TorchFunctionMode sees every torch call. When an argument is a streamed
parameter whose unit is not running (a parent reading a child's weight, a weight passed to a functional
call elsewhere), the engine makes that parameter resident before the call runs, so the call reads the
right values and steady state never streams it. Costs nothing outside discovery.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _tensors_in(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


class OutsideReadTracker(TorchFunctionMode):
    """Calls ``on_outside_read(param_id, func)`` for a streamed parameter read while its unit is idle."""

    def __init__(
        self,
        owner_of: dict[int, str],
        active_units: set[str],
        on_outside_read: Callable[[int, Any], None],
    ) -> None:
        super().__init__()
        self._owner_of = owner_of
        self._active = active_units
        self._on_outside_read = on_outside_read

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for tensor in _tensors_in((*args, *kwargs.values())):
            owner = self._owner_of.get(id(tensor))
            if owner is not None and owner not in self._active:
                self._on_outside_read(id(tensor), func)
        return func(*args, **kwargs)
