"""Autocast's weight cache is paused while an offloaded model's forward runs.

[Note: autocast's weight cache]
Under ``torch.autocast`` (cache on, the default), the first cast of a float32 leaf tensor that requires
grad, which a model's weights are, even under ``torch.no_grad()``, is cached until the outermost autocast
region exits, so that later uses of the weight reuse it. For a streamed weight that keeps a
lower-precision copy of every unit on the device for the whole region: measured on a CPU, 16 float32
units of 16 MiB run three times in one region held 134 MiB more at its end (half the streamed bytes),
21 MiB with the cache off, which is the budget's memory back. Each forward therefore runs with the cache
off (two calls per forward) when autocast is on for the device, and turns it back on after. Outputs do
not change: a cast gives the same bits whether cached or not. Resident float32 weights then cast again
at each use instead of once per region, which costs a memory-bound copy of their bytes per forward.
Compiled graphs are not affected: the compiler turns autocast into explicit casts, with no cache.
A forward stopped without its end (Ctrl-C) left its autocast region through the region's own exit, which
restored the setting: the pause is then forgotten, not undone (:meth:`AutocastCachePause.forget`), so a
later region opened with ``cache_enabled=False`` keeps it off.
"""

from __future__ import annotations

import torch

__all__ = ["AutocastCachePause"]


class AutocastCachePause:
    """Turns autocast's weight cache off for one forward on ``device_type`` if it was on; safe to repeat."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.paused = False

    def enter(self) -> None:
        if torch.is_autocast_cache_enabled() and torch.is_autocast_enabled(self.device_type):
            torch.set_autocast_cache_enabled(False)
            self.paused = True

    def exit(self) -> None:
        if self.paused:
            self.paused = False
            torch.set_autocast_cache_enabled(True)

    def forget(self) -> None:
        """The forward that paused the cache was interrupted: whatever autocast region it ran in has
        restored its own setting on the way out (see the note)."""
        self.paused = False
