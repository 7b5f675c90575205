"""Units called inside another unit's forward after learning: they borrow their range, outputs stay right,
and the engine keeps them resident and profiles again (see [Note: nested calls] in nested_calls.py).

Before this, the inner unit's load (or the prefetches its post-hook issued) overwrote the range of the
unit it ran inside, which then computed on the inner unit's bytes: a silently wrong output."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import LEARN, run_forwards
from flextensor.api import engine_of
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
    assert f"'helper' inside 'blocks.{nest_in}' ran nested" in caplog.text
    assert "helper" not in flextensor.offload_units(model)
    assert "helper.0.weight" in flextensor.resident_parameters(model)
    for out in run_forwards(model, X, LEARN + 1):
        assert torch.equal(out, expected)
    assert flextensor.phase(model) == "inference"
    assert set(flextensor.status(model).plan.streamed) == {f"blocks.{i}" for i in range(4)}
    model.nest_in = None
    assert torch.equal(run_forwards(model, X, 1)[0], _expected(X, None, helper_layers))


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
    assert caplog.text.count("ran nested") == 1
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
