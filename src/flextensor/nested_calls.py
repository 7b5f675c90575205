"""A streamed unit called inside another unit's forward after learning: it borrows its arena range.

[Note: nested calls]
Discovery keeps a unit that runs inside another one resident, so the plan never streams it. A nesting
first made later (a branch the learning forwards did not take, a tied alias called from inside a block)
reaches a step whose loads and prefetches assume that no unit is running. Loading the inner unit there
could overwrite the range of the outer one, which computes again once the inner returns, and the copies
the inner's post-hook would issue (the schedule after the inner's place in the learned order) could too.
So such a call *borrows* its range:

- its copy waits for all the compute enqueued so far (the outer's kernels read the range it may take), not
  only for the ``compute_done`` of the range's occupants, which the outer has not recorded yet;
- its post-hook issues no prefetch;
- each running unit whose range the load took is loaded again after the inner's compute, and the compute
  stream waits for that copy before the outer goes on.

The outputs stay right. The engine then keeps the unit resident and profiles again, as discovery would
have (``OffloadEngine._learn_nested_calls``); until then, or while CUDA graphs hold the layout, every such
call pays an unhidden copy. The hooks keep the stack of running units (``ModelHooks.running``) and send a
call made while it is not empty to the step's ``nested_pre`` / ``nested_post``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .units import Unit

if TYPE_CHECKING:
    from .slots import DeviceStore

logger = logging.getLogger("flextensor")

__all__ = ["Load", "NestedCalls"]

Load = Callable[[Unit, Any], None]
"""``load(unit, compute_stream)``: copy ``unit`` into its range on the copy stream, after the compute that
last read each of its cells, leaving ``compute_stream`` current (``DeviceStore.load_on_demand``)."""


class NestedCalls:
    """The borrowing of [Note: nested calls] for one model's store, and the nestings it saw."""

    __slots__ = ("_enqueued", "displaced", "reported", "seen", "store")

    def __init__(self, store: DeviceStore) -> None:
        self.store = store
        self._enqueued: Any = None  # an event marking "all compute so far"; made on first use
        self.displaced: list[list[Unit]] = []  # per nested call running: the running units it displaced
        self.seen: dict[Unit, Unit] = {}  # inner unit -> the unit it first ran inside, since forget()
        self.reported: set[Unit] = set()  # units warned of that go on borrowing (a kept layout)

    def pre(self, unit: Unit, running: Sequence[Unit], load: Load | None = None) -> None:
        """``unit`` (``running[-1]``) starts inside ``running[-2]``: load it if it must, after everything
        enqueued so far, noting the running units whose range it takes."""
        self.seen.setdefault(unit, running[-2])
        store = self.store
        compute = store.runtime.current_stream()
        displaced: list[Unit] = []
        self.displaced.append(displaced)  # first: a load that raises still leaves its post one to pop
        if unit.resident:
            return
        owner = store.owner
        if any(owner[cell] is not unit for cell in unit.cells):
            taken = {owner[cell] for cell in unit.cells}
            displaced += [u for u in running if u in taken and u is not unit]
            self._after_enqueued(compute)
            (load or store.load_on_demand)(unit, compute)
        compute.wait_event(unit.copy_done)

    def post(self, unit: Unit, load: Load | None = None) -> None:
        """``unit`` returns: mark its compute, give the running units it displaced their bytes back."""
        displaced = self.displaced.pop() if self.displaced else []
        if unit.resident:
            return
        store = self.store
        compute = store.runtime.current_stream()
        unit.compute_done.record(compute)
        for outer in displaced:
            (load or store.load_on_demand)(outer, compute)  # waits for unit.compute_done: it occupies it
            compute.wait_event(outer.copy_done)

    def forget(self) -> dict[Unit, Unit]:
        """The nestings seen since the last call, and start over (once per forward)."""
        seen, self.seen = self.seen, {}
        self.displaced.clear()
        return seen

    def _after_enqueued(self, compute: Any) -> None:
        """Make the copy stream wait for every kernel enqueued on ``compute`` so far."""
        if self._enqueued is None:
            self._enqueued = self.store.runtime.event()
        self._enqueued.record(compute)
        self.store.runtime.copy_stream.wait_event(self._enqueued)

    def __repr__(self) -> str:
        return f"NestedCalls({len(self.displaced)} running, {len(self.seen)} seen)"
