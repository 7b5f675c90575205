"""The bracketing of each forward of an offloaded model: the outermost call told apart from nested ones,
the thread that owns it, and a forward left unfinished by an exception PyTorch hands to no
``always_call`` hook (KeyboardInterrupt, SystemExit). hooks/model_hooks.py drives it."""

from __future__ import annotations

import sys
import threading

from torch import nn

from flextensor.errors import ConcurrentForwardError

__all__ = ["ENTRY_WRAPPER", "ForwardBracket"]

ENTRY_WRAPPER = "entry_point.<locals>.entered"
"""Qualified name of the wrapper hooks.functions.entry_point puts around an entry method (``vae.decode``):
its frames count as calls of the model."""


class ForwardBracket:
    """Depth and owner thread of the forward in progress.

    ``enter`` returns True for the outermost call of the model; ``exit`` True when it ends. A call from
    another thread while a forward runs raises ConcurrentForwardError (the weights share one arena).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.depth = 0
        self.owner: int | None = None
        self.handled_at_start: BaseException | None = None  # what sys.exc_info() held as the forward began
        self._lock = threading.Lock()  # makes the owner check-and-set atomic between threads

    @property
    def running(self) -> bool:
        """Whether a forward of the model is in progress (or was left unfinished by an interrupt)."""
        return self.depth > 0

    def claim(self) -> None:
        """Take the model for this thread, or raise if another thread's forward runs."""
        me = threading.get_ident()
        with self._lock:
            if self.owner is not None and self.owner != me:
                raise ConcurrentForwardError(
                    f"a forward of this offloaded {type(self._model).__name__} is already running in "
                    "another thread; its weights share one device arena, so run forwards one at a time "
                    "(use a lock) or offload one model per thread"
                )
            self.owner = me

    def interrupted(self) -> bool:
        """Whether a forward seems to run but the only call of the model on this thread's stack is this
        one: the previous forward was interrupted without its end (a rare path: a stack walk)."""
        if not self.depth:
            return False
        calls, frame = 0, sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_call_impl" and frame.f_locals.get("self") is self._model:
                calls += 1
            elif code.co_qualname == ENTRY_WRAPPER and frame.f_locals.get("module") is self._model:
                calls += 1  # an entry method (vae.decode) called inside the model's forward
            frame = frame.f_back
        return calls == 1

    def reset(self) -> None:
        self.depth = 0
        self.owner = None

    def is_foreign_thread(self) -> bool:
        owner = self.owner
        return owner is not None and owner != threading.get_ident()
