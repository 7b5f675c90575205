"""The plan: which offload units stay on the device and how large the arena the others stream through is.

Pure data (saved in profiles), the contract between the planner (which makes plans), the simulator
(which predicts them) and the engine (which lays them out). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from flextensor.common.json_codec import Bytes, Seconds, record

__all__ = ["Plan"]


@record
@dataclass(frozen=True)
class Plan:
    """Where every offload unit's weights live in steady state.

    ``resident``: units whose weights are copied to the device once and stay, in execution order.
    ``streamed``: units streamed through the arena, in execution order.
    ``arena_bytes``: size of the device arena the streamed units share (see [Note: ring layout]).
    ``predicted_step_s`` / ``predicted_peak_bytes``: the simulator's prediction for this plan.
    ``budget_bytes``: the budget it was made for (None: none).
    ``staged``: streamed units copied through the staging ring because the host budget cannot pin them
    (see [Note: host budget] in store/host_budget.py), in execution order; the others are pinned.
    ``coded``: streamed units loaded compressed (see [Note: coded loads] in plan/measurements.py), staged ones
    included (their compressed pieces go through the staging ring), in execution order; the others are
    copied as packed.
    ``mapped``: resident units read in place from their pinned host packs (see [Note: mapped units] in
    store/mapping.py), in execution order: laid out as resident, they hold no device bytes, and the plan
    was made without them.
    """

    resident: tuple[str, ...]
    streamed: tuple[str, ...]
    arena_bytes: Bytes
    predicted_step_s: Seconds = 0.0
    predicted_peak_bytes: Bytes = 0
    budget_bytes: Bytes | None = None
    staged: tuple[str, ...] = ()
    coded: tuple[str, ...] = ()
    mapped: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line for the log: counts, arena, and what the simulator predicts."""
        budget = "" if self.budget_bytes is None else f" (budget {self.budget_bytes / 2**30:.2f} GiB)"
        staged = f" ({len(self.staged)} staged)" if self.staged else ""
        staged += f" ({len(self.coded)} compressed)" if self.coded else ""
        mapped = f" ({len(self.mapped)} mapped)" if self.mapped else ""
        return (
            f"{len(self.streamed)} unit(s) streamed{staged}, {len(self.resident)} resident{mapped}, arena "
            f"{self.arena_bytes / 2**30:.2f} GiB, predicted step {self.predicted_step_s * 1e3:.1f} ms, "
            f"predicted peak {self.predicted_peak_bytes / 2**30:.2f} GiB{budget}"
        )
