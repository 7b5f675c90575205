"""The device memory budget: what offload() can check of it, and changing it on an offloaded model.

[Note: the budget known at offload()]
Every plan copies the next unit into the arena while the one before it computes: at least the two
largest units (of those not mapped, which take no device bytes) are in flight, whatever the forwards
measure (see ``planner.minimal_need_bytes``). A budget below that fails every plan, first at the plan
made after the profiling forward and then at each forward after it, so ``offload()`` refuses it at once
with the model left as it was. What the forwards measure (activations, the memory held outside the
model) is checked when the plan is made; ``set_budget`` then changes the budget without offloading
again. offload() cannot know which units will run: a unit that never runs (a VAE's encoder in
text-to-video) or that discovery keeps resident for good counts here, though the plans leave it out of
the units in flight; a budget refused for it alone would have been taken with a warning before.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from flextensor.common.sizes import format_bytes, parse_bytes
from flextensor.errors import BudgetError, ConfigError, UnsupportedOperationError
from flextensor.plan.layout import provisional_arena_bytes
from flextensor.store.units import Unit

if TYPE_CHECKING:
    from flextensor.engine.controller import OffloadEngine

__all__ = ["check_units_fit", "parse_budget_value", "set_engine_budgets"]


def check_units_fit(units: Iterable[Unit], mapped: Collection[str], budget_bytes: int | None) -> None:
    """BudgetError when ``budget_bytes`` cannot hold the two largest of ``units`` in flight (see the note)."""
    if budget_bytes is None:
        return
    streamable = sorted((u for u in units if u.name not in mapped), key=lambda u: u.nbytes, reverse=True)
    in_flight = provisional_arena_bytes([u.nbytes for u in streamable])
    if budget_bytes >= in_flight:
        return
    largest = " and ".join(repr(u.name) for u in streamable[:2])
    raise BudgetError(
        f"gpu_memory_budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the "
        f"{format_bytes(in_flight)} ({in_flight} bytes) that the largest offload units ({largest}) take in "
        "flight: every plan copies one in while the other computes, before activations count; raise the "
        "budget to at least that, or select smaller units with include_patterns",
        needed_bytes=in_flight,
        budget_bytes=budget_bytes,
    )


def parse_budget_value(budget: int | str | None) -> int | None:
    """``set_budget``'s argument in bytes: a size (``"10GiB"``, an int) > 0, or None for no budget."""
    if budget is None:
        return None
    nbytes = parse_bytes(budget)
    if nbytes <= 0:
        raise ConfigError(f"a budget must be > 0 bytes, got {budget!r}; give a size such as '10GiB' or None")
    return nbytes


def set_engine_budgets(engines: list[OffloadEngine], budget_bytes: int | None) -> None:
    """Give every engine (one model's, or a pipeline's components') ``budget_bytes``: every plan is made
    again from its measurements first, for all of them, so that a budget refused (BudgetError) or a model
    mid-forward (UnsupportedOperationError) changes nothing."""
    replanned: list[dict[Any, Any]] = []
    for engine in engines:
        check_units_fit(engine.units.values(), engine.policy.mapped, budget_bytes)
        if engine.bracket.running or engine.graphs.layout_kept:
            raise UnsupportedOperationError(
                f"cannot change the budget of this {type(engine.model).__name__} now: "
                + ("a forward is running" if engine.bracket.running else "CUDA graphs hold its layout")
                + "; release it and offload it again with the new gpu_memory_budget"
            )
        replanned.append(engine.plans_under(budget_bytes))
    for engine, plans in zip(engines, replanned, strict=True):
        engine.adopt_budget(budget_bytes, plans)
