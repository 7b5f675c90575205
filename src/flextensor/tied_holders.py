"""Modules outside every unit that hold a streamed weight: the other end of a tie.

[Note: tied weights outside every unit]
A weight tied between one unit and modules outside every unit streams with that unit (selection.py, rule
4 in docs/patterns.md): UMT5's ``shared`` holds the token embedding that ``encoder.embed_tokens`` runs
with, and exists only for the tie. Discovery keeps the weight resident if one of those modules reads it
(Llama's ``embed_tokens`` beside a ``lm_head`` unit). What discovery cannot see is a holder that did not
run while the model was learned and runs later: it would read whatever the arena holds. So each such
holder gets a forward pre-hook. In a learning forward (discovery, or the checking forward of a run from a
profile) the hook notes that the holder ran; once learning ends, the hooks of holders that ran, or whose
weights discovery made resident, are removed (a hook costs a module PyTorch's slow call path). A holder
that never ran keeps its hook, which costs nothing until it runs; if it ever does while its weight still
streams, it raises instead of computing with the wrong weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from .errors import UnsupportedOperationError
from .units import Unit

__all__ = ["TiedHolders"]


class TiedHolders:
    """The pre-hooks on the holders of one model's streamed tied weights (see the note above)."""

    def __init__(
        self,
        model: nn.Module,
        holders: Mapping[str, tuple[str, ...]],
        owner_of: dict[int, Unit],
        learning: Callable[[], bool],
    ) -> None:
        """``holders``: parameter FQN -> paths of the modules outside every unit that hold it;
        ``owner_of``: the engine's map from a streamed parameter to its unit (a parameter made resident
        leaves it); ``learning()``: whether the forward running is a learning one."""
        params = dict(model.named_parameters())
        self._weights: dict[str, list[tuple[str, int]]] = {}  # holder path -> (FQN, id) it holds
        for fqn, paths in holders.items():
            for path in paths:
                self._weights.setdefault(path, []).append((fqn, id(params[fqn])))
        self._model = model
        self._owner_of = owner_of
        self._learning = learning
        self._ran: set[str] = set()
        self._handles: dict[str, torch.utils.hooks.RemovableHandle] = {}

    def attach(self) -> None:
        for path in self._weights:
            module = self._model.get_submodule(path)
            self._handles[path] = module.register_forward_pre_hook(partial(self._called, path))

    def _called(self, path: str, module: nn.Module, args: Any) -> None:
        if self._learning():
            self._ran.add(path)
            return
        if path in self._ran:
            return
        owner = self._owner_of
        streamed = {fqn: owner[pid].name for fqn, pid in self._weights[path] if pid in owner}
        if streamed:
            units = sorted(set(streamed.values()))
            raise UnsupportedOperationError(
                f"module {path!r} runs and holds {', '.join(map(repr, streamed))}, tied to unit "
                f"{', '.join(map(repr, units))}, which streams it; {path!r} did not run while flextensor "
                "learned the model, so its weight is not in place. Keep it resident: "
                f"exclude_patterns={list(streamed)!r} (then offload again)"
            )

    def learned(self) -> None:
        """Learning ended: drop the hooks no longer needed (holders that ran, weights made resident)."""
        for path in list(self._handles):
            if path in self._ran or not any(pid in self._owner_of for _, pid in self._weights[path]):
                self._handles.pop(path).remove()

    def detach(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
