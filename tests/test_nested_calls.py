"""Units called inside another unit's forward after learning: they borrow their range, outputs stay right,
and the engine keeps them resident and profiles again (see [Note: nested calls] in store/nesting.py).

Before this, the inner unit's load (or the prefetches its post-hook issued) overwrote the range of the
unit it ran inside, which then computed on the inner unit's bytes: a silently wrong output."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import LEARN, LEARN_COMPILED, install_placement, run_forwards, run_until_steady
from flextensor.api import engine_of
from flextensor.errors import UnsupportedOperationError
from flextensor.hooks.functions import input_signature
from flextensor.plan.planner import minimal_need_bytes
from nesting_models import Block, LateNesting
from streaming import streaming_config

WIDTH = 32


def _expected(x: torch.Tensor, nest_in: int | None, helper_layers: int = 2) -> torch.Tensor:
    reference = LateNesting(WIDTH, helper_layers)
    reference.nest_in = nest_in
    with torch.no_grad():
        return reference(x)


def _offloaded(helper_layers: int = 2, **fields: object) -> LateNesting:
    model = LateNesting(WIDTH, helper_layers)
    config = streaming_config(model, ["helper", "blocks.*"], **fields)
    return flextensor.offload(model, config)  # type: ignore[return-value]


X = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("helper_layers", [1, 2, 3])
@pytest.mark.parametrize("nest_in", [0, 1, 2, 3])
def test_a_unit_first_called_inside_another_after_learning_computes_right_and_is_then_kept_resident(
    nest_in: int, helper_layers: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Every block, a helper smaller than, as large as and larger than a block: the nested call's outputs
    are bitwise those of the model without offload from the first such forward on, and the model then
    learns again, with the helper resident, back to steady state."""
    model = _offloaded(helper_layers)
    run_forwards(model, X, LEARN)
    assert flextensor.phase(model) == "inference" and "helper" in flextensor.offload_units(model)
    model.nest_in = nest_in
    expected = _expected(X, nest_in, helper_layers)
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        first = run_forwards(model, X, 1)[0]
    assert torch.equal(first, expected)
    assert f"never saw ('helper' inside 'blocks.{nest_in}')" in caplog.text
    assert "helper" not in flextensor.offload_units(model)
    assert "helper.0.weight" in flextensor.resident_parameters(model)
    for out in run_forwards(model, X, LEARN + 1):
        assert torch.equal(out, expected)
    assert flextensor.phase(model) == "inference"
    assert set(flextensor.status(model).plan.streamed) == {f"blocks.{i}" for i in range(4)}
    model.nest_in = None
    assert torch.equal(run_forwards(model, X, 1)[0], _expected(X, None, helper_layers))


def test_the_arena_a_unit_left_behind_is_freed_when_the_next_layout_replaces_it() -> None:
    """The helper kept resident leaves the units; its old arena range must not keep the whole old arena
    alive beside the new one (on a GPU: 128 MiB more, which the next profile counted against the
    budget as memory outside the model)."""
    import gc

    def arenas(nbytes: int) -> set[int]:
        """The live storages of ``nbytes`` bytes that tensors view (the arena is the only one here)."""
        gc.collect()
        return {
            o.untyped_storage().data_ptr()
            for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes() == nbytes
        }

    model = _offloaded()
    run_forwards(model, X, LEARN)
    arena = engine_of(model).store.arena
    assert arena is not None
    nbytes = arena.untyped_storage().nbytes()
    del arena
    assert len(arenas(nbytes)) == 1
    model.nest_in = 1
    run_forwards(model, X, LEARN + 1)
    assert flextensor.phase(model) == "inference" and "helper" not in flextensor.offload_units(model)
    arena = engine_of(model).store.arena
    assert arena is not None and arena.untyped_storage().nbytes() == nbytes
    del arena
    assert len(arenas(nbytes)) == 1


def test_without_room_in_the_budget_to_keep_it_resident_a_nested_unit_goes_on_borrowing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A budget that holds the streaming ring and no more (the GPU test's case: a helper of 64 MiB
    beside a 200 MiB budget): keeping the helper resident would make the next plan fail with BudgetError
    in a forward that ran before, so the nested calls go on borrowing, right each time, with one warning
    that says how much more budget would keep it resident."""
    model = _offloaded()
    budget = engine_of(model).policy.budget_bytes
    assert budget is not None
    run_forwards(model, X, LEARN)
    plan = flextensor.status(model).plan
    assert plan is not None and "helper" in plan.streamed
    # As on a GPU, the weights kept outside the units would count in the next plan's baseline; the
    # streaming config's budget is already the tightest the learned plan accepts (two units in flight).
    engine_of(model).store.runtime.counts_memory = True
    assert budget == minimal_need_bytes(engine_of(model).current.measurements)[0]
    model.nest_in = 2
    expected = _expected(X, 2)
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        for out in run_forwards(model, X, LEARN + 2):
            assert torch.equal(out, expected)
    assert caplog.text.count("units ran inside another") == 1
    assert "no room to keep them resident" in caplog.text and "more gpu_memory_budget" in caplog.text
    assert "helper" in flextensor.offload_units(model)
    assert flextensor.phase(model) == "inference"


def _count_memory_as_a_gpu(model: nn.Module, activations: dict[int, int]) -> None:
    """The CPU stand-in's memory counters as CUDA's would read: flextensor's device bytes, the weights
    kept resident outside the units, and ``activations[batch]`` more at the peak of a forward."""
    engine = engine_of(model)
    runtime, batch = engine.store.runtime, [0]

    def allocated() -> int:
        kept = sum(p.nbytes for n, p in model.named_parameters() if n in engine.resident_reasons)
        return engine.store.device_bytes_held() + kept

    def forward_pre_hook(module: nn.Module, args: tuple) -> None:
        batch[0] = args[0].shape[0]

    model.register_forward_pre_hook(forward_pre_hook, prepend=True)
    runtime.memory_allocated = allocated
    runtime.max_memory_allocated = lambda: allocated() + activations.get(batch[0], 0)
    runtime.counts_memory = True


@pytest.mark.parametrize("first", ["small", "large"])
def test_the_room_to_keep_a_nested_unit_is_checked_against_the_plan_of_every_input(first: str) -> None:
    """Two input sizes, the larger with more activations: the helper fits beside the small input's plan
    but not the large one's, so it goes on borrowing whichever input shows the nesting first (keeping
    it resident would stop the large input's next forward with BudgetError)."""
    model = LateNesting(WIDTH)
    config = streaming_config(model, ["helper", "blocks.*"])
    # The ring (24 KiB) and the helper (9 KiB) fit with the small input's activations (none), not with
    # the large one's (4,000 bytes).
    flextensor.offload(model, config.model_copy(update={"gpu_memory_budget": 34_000}))
    small, large = X, torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(4))
    _count_memory_as_a_gpu(model, {large.shape[0]: 4000})
    run_forwards(model, small, LEARN)
    run_forwards(model, large, LEARN)
    assert len(flextensor.status(model).plans) == 2
    model.nest_in = 1
    inputs = [small, large] if first == "small" else [large, small]
    for _ in range(LEARN + 1):
        for x in inputs:
            assert torch.equal(run_forwards(model, x, 1)[0], _expected(x, 1))
    assert "helper" in flextensor.offload_units(model) and flextensor.phase(model) == "inference"


def test_the_room_to_keep_a_unit_that_only_ever_runs_nested_counts_its_size() -> None:
    """A unit that never ran in the learning forwards (no measurement of it) and then runs inside a block:
    its own size decides whether it fits, so at the tightest budget it borrows instead of failing the
    next plan."""

    class OnlyNested(LateNesting):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                x = block(x, self.helper if i == self.nest_in else None)
            return x

    model = OnlyNested(WIDTH)
    flextensor.offload(model, streaming_config(model, ["helper", "blocks.*"]))
    _count_memory_as_a_gpu(model, {})
    run_forwards(model, X, LEARN)
    model.nest_in = 1
    reference = OnlyNested(WIDTH)
    reference.nest_in = 1
    with torch.no_grad():
        expected = reference(X)
    for out in run_forwards(model, X, LEARN + 2):
        assert torch.equal(out, expected)
    assert "helper" in flextensor.offload_units(model) and flextensor.phase(model) == "inference"


def test_a_nesting_first_seen_while_profiling_is_right_and_learned() -> None:
    """The nesting begins after the discovery forward, in the profiling ones (which assumed, as steady
    state does, that no unit runs when another loads)."""
    model = _offloaded()
    run_forwards(model, X, 1)
    assert flextensor.phase(model) == "profiling"
    model.nest_in = 3
    expected = _expected(X, 3)
    for out in run_forwards(model, X, LEARN + 1):
        assert torch.equal(out, expected)
    assert flextensor.phase(model) == "inference"
    assert "helper.0.weight" in flextensor.resident_parameters(model)


def test_under_a_kept_layout_nested_calls_go_on_borrowing_and_warn_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A kept layout (a serving engine, CUDA graphs) is not laid out again: every nested call borrows,
    right each time, with one warning."""
    model = _offloaded()
    engine_of(model).keep_one_layout()
    run_forwards(model, X, LEARN)
    model.nest_in = 3
    expected = _expected(X, 3)
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        for out in run_forwards(model, X, 3):
            assert torch.equal(out, expected)
    assert caplog.text.count("units ran inside another") == 1
    assert "helper" in flextensor.offload_units(model)
    assert flextensor.phase(model) == "inference"


def test_a_nested_call_outside_any_forward_is_right_and_teaches_nothing() -> None:
    """A user calls one block, passing it the helper, between forwards: it borrows; the next forwards run
    the plan as before."""
    model = _offloaded()
    run_forwards(model, X, LEARN)
    reference = LateNesting(WIDTH)
    with torch.no_grad():
        expected = reference.blocks[3](X, reference.helper)
        assert torch.equal(model.blocks[3](X, model.helper), expected)
        assert torch.equal(model.blocks[3](X, model.helper), expected)
    assert torch.equal(run_forwards(model, X, 1)[0], _expected(X, None))
    assert "helper" in flextensor.offload_units(model) and flextensor.phase(model) == "inference"


def test_a_nested_call_that_raises_leaves_the_next_forwards_right() -> None:
    """The stack of running units stays balanced when the inner unit raises (its post-hook runs)."""

    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inner failure")

    model = _offloaded()
    run_forwards(model, X, LEARN)
    with torch.no_grad(), pytest.raises(RuntimeError, match="inner failure"):
        model.blocks[1](X, nn.Sequential(model.helper, Failing()))
    model.nest_in = 2
    expected = _expected(X, 2)
    for out in run_forwards(model, X, LEARN + 1):
        assert torch.equal(out, expected)


class TiedLate(nn.Module):
    """UMT5's shape: the unit ``embed`` runs, ``shared`` holds the same weight (the unit's alias). Once
    ``late`` is set, a block calls ``shared`` inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Embedding(64, WIDTH)
        self.embed = nn.Embedding(64, WIDTH)
        self.embed.weight = self.shared.weight
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(3))
        self.late = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        extra = _AddEmbedding(self.shared, ids) if self.late else None
        for i, block in enumerate(self.blocks):
            x = block(x, extra if i == 2 else None)
        return x


class _AddEmbedding:
    def __init__(self, embedding: nn.Embedding, ids: torch.Tensor) -> None:
        self.embedding, self.ids = embedding, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.embedding(self.ids)


def test_a_tied_alias_first_called_inside_a_block_after_learning_is_right() -> None:
    """The hole docs/patterns.md named for tied aliases: the alias loads its unit inside another unit's
    forward, where the learned order does not expect it."""
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    reference = TiedLate()
    reference.late = True
    with torch.no_grad():
        expected = reference(ids)
    model = TiedLate()
    model = flextensor.offload(model, streaming_config(model, ["embed", "blocks.*"]))
    assert "shared.weight" in flextensor.offloaded_parameters(model)
    run_forwards(model, ids, LEARN)
    model.late = True
    for out in run_forwards(model, ids, LEARN + 2):
        assert torch.equal(out, expected)
    assert "shared.weight" in flextensor.resident_parameters(model)
    assert flextensor.phase(model) == "inference"


@pytest.mark.parametrize(
    ("how", "room"), [("model", True), ("blocks", True), ("model", False)], ids=["model", "blocks", "no-room"]
)
def test_under_torch_compile_a_late_nesting_is_refused_before_a_wrong_output_then_learned(
    how: str, room: bool
) -> None:
    """Inside a compiled graph the caller's reads of its weights may be moved past the inner unit's pre
    op, so a nested load that would take the caller's range stops the forward with an error (nothing
    wrong computed); the unit is kept resident, and the next forwards are bitwise the natively compiled
    model's. A nested load that takes no running unit's range just runs. Without room in the budget to
    keep the helper resident (the weights it keeps counted as on a GPU), the one that just runs goes on
    borrowing, while the refused one is kept resident all the same: it could never run otherwise."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo

    def compiled(model: LateNesting) -> nn.Module:
        if how == "model":
            return torch.compile(model)
        for block in model.blocks:
            block.compile()
        return model

    for nest_in in (0, 3):
        torch._dynamo.reset()
        reference = LateNesting(WIDTH)
        reference.nest_in = nest_in
        with torch.no_grad():
            expected = compiled(reference)(X)
        torch._dynamo.reset()
        model = _offloaded()
        run_until_steady(model, compiled(model), X, LEARN_COMPILED)
        assert flextensor.phase(model) == "inference"
        engine_of(model).store.runtime.counts_memory = not room  # the tightest budget: no room then
        model.nest_in = nest_in
        refused = 0
        outs = []
        for _ in range(LEARN + 2):
            try:
                outs.append(run_forwards(compiled(model), X, 1)[0])
            except UnsupportedOperationError as error:
                assert "runs when called again" in str(error)
                refused += 1
        assert refused == (nest_in == 3)  # blocks.3 shares helper's range in this layout; blocks.0 not
        assert len(outs) >= LEARN + 1
        assert all(torch.equal(out, expected) for out in outs)
        kept = room or nest_in == 3
        assert ("helper.0.weight" in flextensor.resident_parameters(model)) == kept
    torch._dynamo.reset()


def test_a_unit_borrowing_for_lack_of_room_is_kept_resident_once_compiled_forwards_refuse_it() -> None:
    """Eager forwards borrow the helper (no room to keep it resident); compiled afterwards, the nested load
    is refused, and the helper is then kept resident all the same: a compiled forward could never run
    otherwise. Bitwise the natively compiled model's from then on."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo

    torch._dynamo.reset()
    reference = LateNesting(WIDTH)
    reference.nest_in = 3
    with torch.no_grad():
        expected = torch.compile(reference)(X)
    torch._dynamo.reset()
    model = _offloaded()
    run_forwards(model, X, LEARN)
    engine_of(model).store.runtime.counts_memory = True  # the tightest budget: no room for the helper
    model.nest_in = 3
    run_forwards(model, X, 2)
    assert "helper" in flextensor.offload_units(model)  # borrowing
    compiled = torch.compile(model)
    with pytest.raises(UnsupportedOperationError, match="runs when called again"):
        run_forwards(compiled, X, 1)
    outs = run_forwards(compiled, X, LEARN + 1)
    assert all(torch.equal(out, expected) for out in outs)
    assert "helper.0.weight" in flextensor.resident_parameters(model)
    torch._dynamo.reset()


class Stage(nn.Module):
    """Linear layers; a module in ``inner`` (a list, so it is no child) runs between them once set."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.inner: list[nn.Module] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = len(self.layers) // 2 or 1
        for layer in self.layers[:half]:
            x = layer(x)
        for inner in self.inner:
            x = torch.tanh(inner(x))
        for layer in self.layers[half:]:
            x = layer(x)
        return x


class ThreeDeep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.ModuleList(Stage(k) for k in (1, 2, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x

    def nest(self) -> None:
        """stages.1 calls stages.2, which calls stages.3."""
        self.stages[1].inner = [self.stages[2]]
        self.stages[2].inner = [self.stages[3]]


def test_a_nesting_three_deep_gives_each_caller_its_bytes_back_before_it_computes_again() -> None:
    """Found by review: stages.3 took cells of stages.1 (not of stages.2, its caller); restoring every
    unit it displaced on its return gave stages.1's bytes back over the cell stages.2 then occupied. Each
    caller is restored when the unit it called returns."""
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))
    reference = ThreeDeep()
    reference.nest()
    with torch.no_grad():
        expected = reference(x)
    model = ThreeDeep()
    model = flextensor.offload(model, streaming_config(model, ["stages.*"]))
    run_forwards(model, x, LEARN)
    model.nest()
    for out in run_forwards(model, x, LEARN + 1):
        assert torch.equal(out, expected)
    assert flextensor.offload_units(model) == ["stages.0", "stages.1"]


class _Calls(nn.Module):
    """Calls ``block`` with ``inner`` inside it; no unit itself."""

    def __init__(self, block: nn.Module, inner: nn.Module) -> None:
        super().__init__()
        self.calls = [block, inner]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.calls[0](x, self.calls[1])


def test_nested_calls_outside_a_forward_with_a_resident_inner_unit_are_right() -> None:
    """Found by review: outside a forward, a resident inner unit (hooked while other inputs profile)
    skipped the borrowing's bookkeeping, and the next nested return restored the wrong caller. Every
    two blocks, one called inside the other with the helper inside it, as the model on the device."""
    model = LateNesting(WIDTH)
    config = streaming_config(model, ["helper", "blocks.*"], profiling_forwards=3)
    # No budget: a new input's profiling keeps the units resident until then resident.
    model = flextensor.offload(model, config.model_copy(update={"gpu_memory_budget": None}))
    run_forwards(model, X, LEARN + 1)
    engine = engine_of(model)
    install_placement(model, input_signature((X,), {}), ["helper"])
    run_forwards(model, X, 1)
    run_forwards(model, torch.randn(7, WIDTH), 1)  # new inputs: profiling, helper resident and hooked
    assert flextensor.phase(model) == "profiling"
    assert any(u.name == "helper" for u in engine.hooks.hooked_units)
    reference = LateNesting(WIDTH)
    for a, b in ((0, 1), (1, 2), (2, 3), (3, 0), (1, 3), (2, 0)):
        with torch.no_grad():
            expected = reference.blocks[a](X, _Calls(reference.blocks[b], reference.helper))
            assert torch.equal(model.blocks[a](X, _Calls(model.blocks[b], model.helper)), expected)


def test_a_failed_load_in_an_alias_call_leaves_no_unit_running() -> None:
    """Found by review: an alias whose pre-hook raised (a failed load) left its unit on the stack of
    running units, so every later unit of that forward counted as nested in it and was kept resident."""
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))

    class CatchesFailure(TiedLate):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for i, block in enumerate(self.blocks):
                x = block(x)
                if self.late and i == 0:
                    with contextlib.suppress(OSError):  # an optional extra
                        x = x + self.shared(ids)
            return x

    model = CatchesFailure()
    model = flextensor.offload(model, streaming_config(model, ["embed", "blocks.*"]))
    run_forwards(model, ids, LEARN)
    engine = engine_of(model)
    load = engine.store.load_on_demand
    failures = [1]

    def failing_once(unit: object, stream: object) -> None:
        if getattr(unit, "name", None) == "embed" and failures[0]:
            failures[0] = 0
            raise OSError("a read failed")
        load(unit, stream)  # type: ignore[arg-type]

    engine.store.load_on_demand = failing_once  # type: ignore[method-assign]
    model.late = True
    run_forwards(model, ids, 1)
    assert not failures[0] and not engine.hooks.running
    assert flextensor.offload_units(model) == ["embed", "blocks.0", "blocks.1", "blocks.2"]
    assert not flextensor.resident_parameters(model)


class Recursive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, again: bool = False) -> torch.Tensor:
        x = self.linear(x)
        return self(x) if again else x


def test_a_unit_called_inside_itself_is_no_nesting_to_learn() -> None:
    """As discovery does: recursion holds the unit's own weights, so nothing is kept resident."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(Recursive() for _ in range(3))
            self.late = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                x = block(x, again=self.late and i == 1)
            return x

    reference = Model()
    reference.late = True
    with torch.no_grad():
        expected = reference(X)
    model = Model()
    model = flextensor.offload(model, streaming_config(model, ["blocks.*"]))
    run_forwards(model, X, LEARN)
    model.late = True
    for out in run_forwards(model, X, 3):
        assert torch.equal(out, expected)
    assert flextensor.offload_units(model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert flextensor.phase(model) == "inference"


class _CatchingBlock(Block):
    """A block whose inner call is optional: a failure in it is skipped."""

    def forward(self, x: torch.Tensor, inner: nn.Module | None = None) -> torch.Tensor:
        x = self.first(x)
        if inner is not None:
            with contextlib.suppress(OSError):
                x = torch.tanh(inner(x))
        return self.second(x)


@pytest.mark.parametrize("nest_in", [0, 1, 2, 3])
def test_a_nested_load_that_fails_and_is_caught_leaves_its_caller_right(nest_in: int) -> None:
    """Found by review: the inner unit's pre raised (a failed read) after emptying cells, the caller caught
    it and went on; the inner's post took the plain path (prefetches into the caller's range) and the
    caller computed on another unit's bytes. Its post now restores the caller as a nested one does."""
    model = LateNesting(WIDTH)
    model.blocks = nn.ModuleList(_CatchingBlock(WIDTH) for _ in range(4))
    reference = LateNesting(WIDTH)
    reference.blocks.load_state_dict(model.blocks.state_dict())
    model = flextensor.offload(model, streaming_config(model, ["helper", "blocks.*"]))
    with torch.no_grad():  # the inner call fails before computing anything: the block skips it
        expected = reference(X)
    run_forwards(model, X, LEARN)
    engine = engine_of(model)
    load = engine.store.load_on_demand

    def failing_nested(unit: object, stream: object) -> None:
        if getattr(unit, "name", None) == "helper" and len(engine.hooks.running) > 1:
            raise OSError("a read failed")
        load(unit, stream)  # type: ignore[arg-type]

    engine.store.load_on_demand = failing_nested  # type: ignore[method-assign]
    model.nest_in = nest_in
    assert torch.equal(run_forwards(model, X, 1)[0], expected)


def test_a_refusal_inside_a_larger_compiled_module_ends_the_forward_and_the_next_runs() -> None:
    """Found by review: the offloaded model inside a compiled wrapper; the refused nested load aborted the
    graph before its model_end op, so the forward never ended and every later one was refused too."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.head = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.inner(x))

    torch._dynamo.reset()
    reference = Wrapper(LateNesting(WIDTH))
    reference.inner.nest_in = 3
    with torch.no_grad():
        expected = torch.compile(reference)(X)
    torch._dynamo.reset()
    model = _offloaded()
    wrapper = Wrapper(model)
    wrapper.head.load_state_dict(reference.head.state_dict())
    run_forwards(wrapper, X, LEARN)
    compiled = torch.compile(wrapper)
    run_forwards(compiled, X, 1)
    model.nest_in = 3
    with pytest.raises(UnsupportedOperationError, match="runs when called again"):
        run_forwards(compiled, X, 1)
    engine = engine_of(model)
    assert engine.bracket.depth == 0 and not engine.hooks.running
    for out in run_forwards(compiled, X, LEARN + 1):
        assert torch.equal(out, expected)
    assert "helper.0.weight" in flextensor.resident_parameters(model)
    torch._dynamo.reset()
