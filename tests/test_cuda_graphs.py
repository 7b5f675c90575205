"""The bookkeeping of captured forwards, on the CPU: what a graph assumes at its start, what it and every
eager forward after it leave in the arena (see [Note: captured forwards] in engine/cuda_graphs.py).

A CPU has no CUDA graphs; these tests make the engine believe a capture runs, so the captured driver
does its real work (loads, prefetches, joins) on the host streams. The GPU tests capture for real.
"""

from __future__ import annotations

import pytest
import torch

import flextensor
from flextensor.api import engine_of
from flextensor.engine.cuda_graphs import steady_end_state
from flextensor.errors import UnsupportedOperationError
from flextensor.phases.steady import CapturedStep
from flextensor.store.copies import holds_weights
from real_models import llama_inputs, tiny_llama
from streaming import streaming_config


def steady_llama(layers: int = 4, **fields: object):
    model = tiny_llama(layers=layers, tie=False)
    flextensor.offload(model, streaming_config(model, ["model.layers.*"], **fields))
    with torch.no_grad():
        for _ in range(4):
            model(llama_inputs())
    assert flextensor.phase(model) == "inference"
    return model


def capture_one(model, monkeypatch: pytest.MonkeyPatch) -> CapturedStep:
    """One forward run by the captured driver, as inside torch.cuda.graph."""
    engine = engine_of(model)
    seen: list[CapturedStep] = []
    original = engine._captured_driver

    def spy() -> CapturedStep:
        seen.append(original())
        return seen[-1]

    monkeypatch.setattr(engine.graphs, "capturing", lambda: True)
    monkeypatch.setattr(engine, "_captured_driver", spy)
    with torch.no_grad():
        model(llama_inputs())
    monkeypatch.undo()
    return seen[0]


def test_the_steady_end_state_is_a_fixed_point_that_a_forward_reaches() -> None:
    model = steady_llama()
    engine = engine_of(model)
    streamed = [u for u in engine.order if not u.resident]
    predicted = steady_end_state(streamed, [None] * len(engine.store.owner))
    assert steady_end_state(streamed, predicted) == predicted
    with torch.no_grad():
        model(llama_inputs())
    assert engine.store.owner == predicted


def test_a_captured_forward_leaves_what_the_next_replay_assumes(monkeypatch: pytest.MonkeyPatch) -> None:
    model = steady_llama()
    engine = engine_of(model)
    reference = tiny_llama(layers=4, tie=False)
    with torch.no_grad():
        expected = reference(llama_inputs()).logits
    step = capture_one(model, monkeypatch)
    guaranteed = engine.graphs.guaranteed
    assert guaranteed and step.assumed <= guaranteed and step.joined
    assert engine.graphs.captured
    # After the capture only what both the pre-capture arena and any replay's end hold counts as loaded.
    owner = engine.store.owner
    assert {u for u in owner if u is not None} <= step.assumed
    # An eager forward after it is right, and leaves every guaranteed unit loaded for a replay.
    with torch.no_grad():
        assert torch.equal(model(llama_inputs()).logits, expected)
    assert all(holds_weights(u, engine.store.owner) for u in guaranteed)
    # A second capture keeps the first one's guarantee.
    second = capture_one(model, monkeypatch)
    assert engine.graphs.guaranteed == guaranteed and second.assumed == guaranteed
    with torch.no_grad():
        assert torch.equal(model(llama_inputs()).logits, expected)


def test_a_capture_while_learning_is_refused_and_leaves_the_model_working(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_llama(layers=4, tie=False)
    flextensor.offload(model, streaming_config(model, ["model.layers.*"]))
    engine = engine_of(model)
    monkeypatch.setattr(engine.graphs, "capturing", lambda: True)
    with torch.no_grad(), pytest.raises(UnsupportedOperationError, match="discovery phase"):
        model(llama_inputs())
    monkeypatch.undo()
    reference = tiny_llama(layers=4, tie=False)
    with torch.no_grad():
        expected = reference(llama_inputs()).logits
        outputs = [model(llama_inputs()).logits for _ in range(4)]
    assert flextensor.phase(model) == "inference"
    assert all(torch.equal(o, expected) for o in outputs)


def test_after_a_capture_other_shapes_keep_the_layout(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    model = steady_llama()
    engine = engine_of(model)
    layouts = flextensor.status(model).layouts
    capture_one(model, monkeypatch)
    reference = tiny_llama(layers=4, tie=False)
    other = llama_inputs(batch=1, seq=5)
    with torch.no_grad(), caplog.at_level("WARNING", logger="flextensor"):
        assert torch.equal(model(other).logits, reference(other).logits)
        assert torch.equal(model(other).logits, reference(other).logits)
    assert caplog.text.count("run with the plan made for") == 1
    assert flextensor.status(model).layouts == layouts and flextensor.phase(model) == "inference"
    assert engine.signature is not None


def test_releasing_a_captured_model_warns_that_its_graphs_must_not_replay(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = steady_llama()
    capture_one(model, monkeypatch)
    with caplog.at_level("WARNING", logger="flextensor"):
        flextensor.release(model)
    assert "must not be replayed" in caplog.text


def test_announced_captures_end_learning_with_a_plan_kept_for_every_input(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM warms each batch size up once, then captures it; before its first capture it calls the
    offloader's sync_prev_onload, which announces captures to the engine (prepare_for_captures)."""
    model = tiny_llama(layers=4, tie=False)
    flextensor.offload(
        model, streaming_config(model, ["model.layers.*"], discovery_forwards=1, profiling_forwards=2)
    )
    engine = engine_of(model)
    reference = tiny_llama(layers=4, tie=False)
    with torch.no_grad():
        model(llama_inputs())  # discovery
        model(llama_inputs())  # one profiling forward of two
    assert flextensor.phase(model) == "profiling"
    engine.prepare_for_captures()
    assert flextensor.phase(model) == "inference"
    layouts = flextensor.status(model).layouts
    step = capture_one(model, monkeypatch)  # the capture runs the plan just made
    assert step.joined
    other = llama_inputs(batch=1, seq=5)
    with torch.no_grad(), caplog.at_level("INFO", logger="flextensor"):
        assert torch.equal(model(other).logits, reference(other).logits)
    assert "run with the plan made for" in caplog.text and "WARNING" not in caplog.text
    assert flextensor.status(model).layouts == layouts and flextensor.phase(model) == "inference"
    engine.prepare_for_captures()  # before every replay: nothing more
    assert flextensor.status(model).layouts == layouts


def test_announced_captures_fall_back_on_an_earlier_plan_when_profiling_has_no_sample() -> None:
    """A profiling forward during which the compiler ran is left out: with no sample of the inputs in
    flight, captures run the plan made for earlier inputs."""
    model = steady_llama(profiling_forwards=2)
    engine = engine_of(model)
    reference = tiny_llama(layers=4, tie=False)
    other = llama_inputs(batch=1, seq=5)
    with torch.no_grad():
        model(other)  # new inputs: profiling them
    assert flextensor.phase(model) == "profiling"
    engine.learning.restart_profiling()  # as when the compiler ran in that forward
    engine.prepare_for_captures()
    assert flextensor.phase(model) == "inference"
    with torch.no_grad():
        assert torch.equal(model(other).logits, reference(other).logits)
        assert torch.equal(model(llama_inputs()).logits, reference(llama_inputs()).logits)
    assert flextensor.phase(model) == "inference"


@pytest.mark.parametrize("profiled", [False, True], ids=["after-one-discovery-forward", "profiling"])
def test_captures_announced_early_plan_from_the_forwards_so_far(profiled: bool) -> None:
    """vLLM captures two graphs to measure their memory right after its first forward (the first of
    flextensor's discovery forwards): the plan then comes from that forward's times."""
    model = tiny_llama(layers=4, tie=False)
    flextensor.offload(model, streaming_config(model, ["model.layers.*"], discovery_forwards=2))
    engine = engine_of(model)
    reference = tiny_llama(layers=4, tie=False)
    with torch.no_grad():
        model(llama_inputs())
        if profiled:
            model(llama_inputs())  # the second discovery forward: profiling next
            assert not engine.learning.has_samples()
    engine.prepare_for_captures()
    assert flextensor.phase(model) == "inference" and engine.graphs.layout_kept
    assert [u.name for u in engine.order] == [f"model.layers.{i}" for i in range(4)]
    for inputs in (llama_inputs(), llama_inputs(batch=1, seq=3)):
        with torch.no_grad():
            assert torch.equal(model(inputs).logits, reference(inputs).logits)
    assert flextensor.phase(model) == "inference"
    assert flextensor.report(model).units  # reports like any plan


def test_a_unit_called_outside_a_forward_after_a_capture_leaves_what_the_next_replay_assumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A unit called outside any forward (or a tied alias: ``get_input_embeddings()(ids)``) loads on
    demand; after a capture it fences against queued replays and loads the guaranteed units again, as an
    eager forward does (found by review: the next replay computed with another unit's bytes)."""

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
            self.head = torch.nn.Linear(16, 16, bias=False)
            self.head.weight = self.blocks[2].weight  # an alias of unit blocks.2

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.tanh(block(x))
            return x

    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = Blocks()(x), Blocks().head(x)
    model = Blocks()
    flextensor.offload(model, streaming_config(model, ["blocks.*"]))
    engine = engine_of(model)
    with torch.no_grad():
        for _ in range(4):
            model(x)
    monkeypatch.setattr(engine.graphs, "capturing", lambda: True)
    with torch.no_grad():
        model(x)
    monkeypatch.undo()
    guaranteed = engine.graphs.guaranteed
    assert guaranteed and not any(u.name == "blocks.2" for u in guaranteed)
    with torch.no_grad():
        assert torch.equal(model.head(x), expected[1])
        assert all(holds_weights(u, engine.store.owner) for u in guaranteed)
        model.blocks[2](x)
        assert all(holds_weights(u, engine.store.owner) for u in guaranteed)
        assert torch.equal(model(x), expected[0])
