"""A streamed unit called inside another unit's forward after learning: it borrows its arena range.

[Note: nested calls]
Discovery keeps a unit that runs inside another one resident, so the plan never streams it. A nesting
first made later (a branch the learning forwards did not take, a tied alias called from inside a block)
reaches a step whose loads and prefetches assume that no unit is running. Loading the inner unit there
could overwrite the range of the unit it runs in (its caller), which computes again once the inner
returns, and the copies the inner's post-hook would issue (the schedule after the inner's place in the
learned order) could too. So such a call *borrows* its range:

- its copy waits for all the compute enqueued so far on its stream (the callers' kernels read the range
  it may take), not only for the ``compute_done`` of the range's occupants, which the callers have not
  recorded yet;
- its post-hook issues no prefetch;
- when it returns, its caller is loaded again if it no longer holds its weights (after the inner's
  compute), and the compute stream waits for that copy before the caller goes on. Each caller deeper in
  the stack is restored when the unit it called returns, before it computes again.

The outputs stay right. The engine then keeps the unit resident and profiles again, as discovery would
have (``PlanStates._learn_nested_calls``); until then, or while CUDA graphs or a serving engine hold the
layout, or where the budget has no room to keep them resident, every such call pays an unhidden copy.
The hooks keep the stack of running units (``ModelHooks.running``) and send a call made while it is not
empty to the step's ``nested_pre`` / ``nested_post``. A unit called inside itself (recursion) is not
taken for a nesting to learn.

Inside a compiled graph the kernels around the call need not run in program order: the inner's pre op is
ordered only after what writes its own weights, so the compiler may move the caller's reads of its
weights past it. A nested load there that would take a running unit's range is refused (the forward
stops with an error before any kernel reads wrong bytes; the unit is then kept resident, so the next
call runs). One that takes no running unit's range is as safe as in eager mode, except inside a CUDA
graph the compiler records around a block whose own hooks ran eagerly (``block.compile(mode=
"reduce-overhead")``): no step drives that capture, so the load would be replayed blindly; refused too.
Kernels of a caller that runs on another stream than the inner are ordered only as far as the model's own
code orders the two.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from flextensor.errors import UnsupportedOperationError
from flextensor.store.units import Unit

if TYPE_CHECKING:
    from flextensor.store.device_store import DeviceStore

__all__ = ["Load", "NestedCalls"]

Load = Callable[[Unit, Any], None]
"""``load(unit, compute_stream)``: copy ``unit`` into its range on the copy stream, after the compute that
last read each of its cells, leaving ``compute_stream`` current (``DeviceStore.load_on_demand``)."""


class NestedCalls:
    """The borrowing of [Note: nested calls] for one model's store, and the nestings it saw."""

    __slots__ = ("_enqueued", "refused", "reported", "seen", "store", "without_room")

    def __init__(self, store: DeviceStore) -> None:
        # A proxy: the store holds this object, and a cycle would keep the store's units, and through
        # them the weights release() hands back, until the garbage collector runs (on a GPU, the next
        # model's budget would count them).
        self.store = weakref.proxy(store)
        self._enqueued: Any = None  # an event marking "all compute so far"; made on first use
        self.seen: dict[Unit, Unit] = {}  # inner unit -> the unit it first ran inside, since forget()
        self.reported: set[Unit] = set()  # units warned of that go on borrowing under a kept layout
        self.without_room: set[Unit] = set()  # units that go on borrowing: no room to keep them resident
        self.refused: set[Unit] = set()  # units whose nested load a compiled forward refused: cannot borrow

    def pre(
        self,
        unit: Unit,
        running: Sequence[Unit],
        load: Load | None = None,
        in_graph: bool = False,
        capture_step: bool = False,
    ) -> None:
        """``unit`` (``running[-1]``) starts inside ``running[-2]``: load it if it must, after everything
        enqueued so far. The caller then waits for ``unit.copy_done`` as its step does. ``in_graph``:
        called from a compiled graph's op (see the note); ``capture_step``: by the step that drives a
        CUDA-graph capture."""
        callers = running[:-1]
        if unit not in callers:  # recursion is no nesting the plan could avoid
            self.seen.setdefault(unit, callers[-1])
        store = self.store
        owner = store.owner
        if unit.resident or all(owner[cell] is unit for cell in unit.cells):
            return
        if in_graph:
            taken = {owner[cell] for cell in unit.cells}
            hit = [u.name for u in callers if u in taken]
            # A CUDA graph recorded by the compiler around a block whose own hooks ran eagerly: no step
            # drives the capture, so the load would be baked into the graph and repeated by every replay.
            recorded = not capture_step and store.runtime.is_cuda and torch.cuda.is_current_stream_capturing()
            if hit or recorded:
                why = (
                    f"its load would overwrite the weights of {', '.join(repr(n) for n in hit)} while "
                    "the compiled graph may still read them"
                    if hit
                    else "its load would be recorded into a CUDA graph that no flextensor step drives"
                )
                self.refused.add(unit)
                raise UnsupportedOperationError(
                    f"unit {unit.name!r} was called inside {callers[-1].name!r} in a compiled forward, a "
                    f"nesting the learning forwards never saw; {why}, so this call stopped instead. In a "
                    f"forward, {unit.name!r} is then kept resident and the forward runs when called "
                    "again; where CUDA graphs or a serving engine keep the layout, or outside a forward, "
                    f"keep it out of the units (exclude_patterns=[{unit.name!r}]) and offload again"
                )
        compute = store.runtime.current_stream()
        self._after_enqueued(compute)
        (load or store.load_on_demand)(unit, compute)

    def post(self, unit: Unit, caller: Unit, load: Load | None = None) -> None:
        """``unit`` returns to ``caller``: mark its compute, and give ``caller`` its bytes back if it lost
        them."""
        store = self.store
        compute = store.runtime.current_stream()
        if not unit.resident:
            unit.compute_done.record(compute)
        owner = store.owner
        if caller.resident or all(owner[cell] is caller for cell in caller.cells):
            return
        (load or store.load_on_demand)(caller, compute)  # after unit.compute_done: it occupies some cells
        compute.wait_event(caller.copy_done)

    def forget(self) -> dict[Unit, Unit]:
        """The nestings seen since the last call, and start over (once per forward)."""
        seen, self.seen = self.seen, {}
        return seen

    def _after_enqueued(self, compute: Any) -> None:
        """Make the copy stream wait for every kernel enqueued on ``compute`` so far."""
        if self._enqueued is None:
            self._enqueued = self.store.runtime.event()
        self._enqueued.record(compute)
        self.store.runtime.copy_stream.wait_event(self._enqueued)

    def __repr__(self) -> str:
        return f"NestedCalls({len(self.seen)} seen)"
