"""The budget under vLLM: the model's weights on the device alone.

vLLM sizes its KV cache from the device memory the model holds when its loader returns, and its
activations from a warm-up step; flextensor's budget then covers only what flextensor places (see [Note: a
budget for the weights alone] in engine/policy.py). On a GPU the loader holds the budget's bytes until vLLM
has measured them, so the KV cache is sized around the layouts the plans will make.
"""

from __future__ import annotations

import itertools
import logging
import weakref

from torch import nn

from flextensor.api import engine_of
from flextensor.common.sizes import align_up, format_bytes
from flextensor.errors import BudgetError
from flextensor.plan.layout import UNIT_ALIGNMENT, provisional_arena_bytes
from flextensor.plan.simulator import coded_staging_bytes

logger = logging.getLogger("flextensor")

__all__ = ["count_weights_only", "hold_budget_in_reserve", "weights_outside_units"]


def weights_outside_units(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers on its offload device that no unit streams or holds:
    the weights that never stream (tied ones counted once). Plan time only: a loop over the tensors."""
    engine = engine_of(model)
    device = engine.store.runtime.device
    in_units = {id(param) for unit in engine.store.units for _, param, _ in unit.parameters}
    seen: set[int] = set()
    total = 0
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) in in_units or tensor.device.type != device.type or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def count_weights_only(model: nn.Module) -> None:
    """Make ``model``'s plans count its weights alone, and refuse a budget below the smallest plan now
    (while vLLM loads) rather than at the first planned step."""
    engine = engine_of(model)
    policy = engine.policy
    alive = weakref.ref(model)  # the engine must not keep its model alive (see ModelHooks)

    def fixed() -> int:
        target = alive()
        return 0 if target is None else weights_outside_units(target)

    policy.count_weights_only(fixed)
    outside = fixed()
    units = engine.store.units
    in_flight = provisional_arena_bytes([unit.nbytes for unit in units])
    budget = policy.budget_bytes
    if budget is not None and budget < outside + in_flight:
        raise BudgetError(
            f"gpu_memory_budget {format_bytes(budget)} is below the {format_bytes(outside + in_flight)} "
            "the smallest plan needs under vLLM: the weights outside the offload units "
            f"({format_bytes(outside)}) and room for the two largest units in flight "
            f"({format_bytes(in_flight)}); raise the budget (under vLLM it counts the weights alone; vLLM "
            "sizes the KV cache and activations from what is left)",
            needed_bytes=outside + in_flight,
            budget_bytes=budget,
        )
    # Compressed packs load through staging slots the plans count too (see [Note: coded loads]); without
    # room for them the plans give compression up (see [Note: compression yields to the budget]).
    staging = coded_staging_bytes(
        [u.pack.staging_nbytes for u in units if u.pack is not None and u.pack.coded]  # type: ignore[attr-defined]
    )
    if budget is not None and budget < outside + in_flight + staging:
        logger.warning(
            "gpu_memory_budget %s has no room for the %s of staging slots compressed loads take next to the "
            "smallest plan: the plans will copy the packs uncompressed (%s more budget streams them "
            "compressed)",
            format_bytes(budget),
            format_bytes(staging),
            format_bytes(outside + in_flight + staging - budget),
        )


def hold_budget_in_reserve(model: nn.Module) -> None:
    """On a GPU, hold the budget's bytes on the device (the whole model's when that is less, or without a
    budget) beside what the model holds now, until flextensor's next layout frees them: vLLM measures the
    model's memory when the loader returns. Call after any profile was adopted (its layout would free
    them)."""
    engine = engine_of(model)
    store, policy = engine.store, engine.policy
    if store.runtime.device.type != "cuda":
        return
    outside = weights_outside_units(model)
    whole = outside + sum(align_up(unit.nbytes, UNIT_ALIGNMENT) for unit in store.units)
    budget = policy.budget_bytes
    target = whole if budget is None else min(budget, whole)
    store.hold_in_reserve(target - outside - store.device_bytes_held())
