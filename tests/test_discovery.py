"""Discovery end to end: the execution order, and the weights and units that must never stream (read
outside their unit, running inside another unit, returning views of their own weights)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import CPU, LEARN, assert_all_equal, run_forwards
from streaming import streaming_config


def test_units_listed_in_execution_order_once_discovered() -> None:
    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(x))

    model = flextensor.offload(Reversed(), flextensor.OffloadConfig(**CPU))
    assert flextensor.offload_units(model) == ["a", "b"]
    assert [u.name for u in flextensor.status(model).units] == ["a", "b"]
    run_forwards(model, torch.randn(2, 8), 1)
    assert flextensor.offload_units(model) == ["b", "a"]
    assert [u.name for u in flextensor.status(model).units] == ["b", "a"]


class ParentReadsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.linear(x, self.blocks[0].weight)  # read outside blocks.0's forward


def test_weight_read_outside_its_unit_is_kept_resident(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(2, 16)
    ref = ParentReadsChild()(x)
    model = ParentReadsChild()
    model = flextensor.offload(model, streaming_config(model))
    with caplog.at_level(logging.INFO, logger="flextensor"):
        outs = run_forwards(model, x, LEARN)
    assert_all_equal(outs, ref.detach())
    assert "blocks.0.weight" in flextensor.resident_parameters(model)
    assert "blocks.0.bias" in flextensor.offloaded_parameters(model)
    assert sum("blocks.0.weight" in r.getMessage() for r in caplog.records) == 1  # decided once
    assert flextensor.phase(model) == "inference"


class Nested(nn.Module):
    """Unit ``a`` calls unit ``b`` in the middle of its own forward."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(16, 16)
            self.l2 = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, inner: nn.Module) -> torch.Tensor:
            return self.l2(inner(self.l1(x)))

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = Nested.Outer()
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.a(x, self.b))


def test_unit_running_inside_another_unit_stays_resident_and_outputs_stay_right() -> None:
    x = torch.randn(4, 16)
    ref = Nested()(x).detach()
    model = Nested()
    model = flextensor.offload(model, streaming_config(model))
    assert "b" in flextensor.offload_units(model)
    assert_all_equal(run_forwards(model, x, 5), ref)
    assert "b" not in flextensor.offload_units(model)
    assert {"b.weight", "b.bias"} <= set(flextensor.resident_parameters(model))
    assert [u.name for u in flextensor.status(model).units] == ["a", "c"]


class PositionTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pe = nn.Parameter(torch.randn(1, 32, 16))

    def forward(self, n: int) -> torch.Tensor:
        return self.pe[:, :n]  # a view of the weight itself


class ReturnsItsWeight(nn.Module):
    """A positional table whose forward returns a view of its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = PositionTable()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        pe = self.table(x.shape[1])
        for block in self.blocks:
            x = block(x)
        return x + pe


def test_unit_whose_output_views_its_weights_stays_resident() -> None:
    x = torch.randn(2, 8, 16)
    ref = ReturnsItsWeight()(x).detach()
    model = ReturnsItsWeight()
    model = flextensor.offload(model, streaming_config(model, ["table", "blocks.*"]))
    assert "table" in flextensor.offload_units(model)
    assert_all_equal(run_forwards(model, x, 5), ref)
    assert "table.pe" in flextensor.resident_parameters(model)


class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if fail and i == 1:
                raise ValueError("user code failed mid-forward")
            x = block(x)
        return x


def test_a_forward_that_raises_does_not_count_as_a_learning_forward() -> None:
    x = torch.randn(2, 8)
    ref = Flaky()(x).detach()
    model = Flaky()
    model = flextensor.offload(model, streaming_config(model))
    with pytest.raises(ValueError, match="mid-forward"):
        model(x, fail=True)
    assert flextensor.phase(model) == "discovery"  # the partial order was not taken as the order
    with pytest.raises(ValueError, match="mid-forward"):
        model(x, fail=True)
    assert flextensor.phase(model) == "discovery"
    assert not flextensor.status(model).forward_running
    assert_all_equal(run_forwards(model, x, LEARN), ref)
    assert flextensor.phase(model) == "inference"
    assert flextensor.offload_units(model) == ["blocks.0", "blocks.1", "blocks.2"]


def _tiny_umt5() -> nn.Module:
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=512, d_model=32, d_kv=8, d_ff=32, num_layers=3, num_heads=2)
    torch.manual_seed(0)
    return UMT5EncoderModel(config).eval()


def test_a_token_embedding_tied_to_a_holder_that_never_runs_streams_and_the_holder_loads_it() -> None:
    """UMT5's embedding: the unit ``encoder.embed_tokens`` runs, ``shared`` holds the same weight and never
    runs. The weight streams with its unit (it stayed on the device before: 2.1 GB of UMT5-XXL in every
    phase of a Wan pipeline), and ``shared``, the unit's alias, loads it when called (see [Note: tied
    aliases] in phases/discovery.py). Every unit streams; outputs, state_dict and release as without
    offload."""
    pytest.importorskip("transformers")
    reference = _tiny_umt5()
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, embedded = reference(input_ids=ids).last_hidden_state, reference.shared(ids)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    model = _tiny_umt5()
    model = flextensor.offload(model, streaming_config(model, ["encoder.embed_tokens", "encoder.block.*"]))
    assert "shared.weight" in flextensor.offloaded_parameters(model)  # the tied weight's first name
    with torch.no_grad():
        for _ in range(LEARN + 2):
            assert torch.equal(model(input_ids=ids).last_hidden_state, expected)
        assert flextensor.status(model).plan.streamed == tuple(flextensor.offload_units(model))
        assert torch.equal(model.get_input_embeddings()(ids), embedded)  # the alias, called
        assert torch.equal(model(input_ids=ids).last_hidden_state, expected)
    assert "shared.weight" in flextensor.offloaded_parameters(model)  # called after learning: still streams
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in state.items())
    released = flextensor.release(model)
    assert released.shared.weight is released.encoder.embed_tokens.weight
    assert torch.equal(released.shared.weight, state["shared.weight"])


def test_a_tied_holder_that_runs_makes_its_unit_resident_and_outputs_stay_right(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Llama with tied embeddings whose embedding is a unit: lm_head, its alias, runs at every forward's
    end, where the learned order does not expect the unit; discovery keeps it resident instead."""
    from real_models import llama_inputs, tiny_llama

    x = llama_inputs()
    with torch.no_grad():
        expected = tiny_llama(vocab=512)(x).logits
        generated = tiny_llama(vocab=512).generate(x, max_new_tokens=3, do_sample=False)
    model = tiny_llama(vocab=512)
    model = flextensor.offload(model, streaming_config(model, ["model.embed_tokens", "model.layers.*"]))
    assert "model.embed_tokens.weight" in flextensor.offloaded_parameters(model)
    with caplog.at_level(logging.INFO, logger="flextensor"):
        assert_all_equal(run_forwards(model, x, LEARN + 2), expected)
    assert "model.embed_tokens.weight" in flextensor.resident_parameters(model)
    assert "tied to 'lm_head', which runs too" in caplog.text
    assert torch.equal(model.generate(x, max_new_tokens=3, do_sample=False), generated)


def test_a_tied_weight_that_leaves_its_unit_takes_the_alias_role_with_it() -> None:
    """keep_alias_weights_resident (vLLM reads a tied output head's weight outside the forward, without
    calling it): the weight stays on the device, its unit (nothing else to stream) is dropped, and the
    holder loses the unit's hooks (found by review: a stale alias loaded the unit, out of order)."""
    from flextensor.api import engine_of

    reference = _tiny_umt5()
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).last_hidden_state
    model = _tiny_umt5()
    model = flextensor.offload(model, streaming_config(model, ["encoder.embed_tokens", "encoder.block.*"]))
    engine_of(model).keep_alias_weights_resident("read outside the forward")
    assert "shared.weight" in flextensor.resident_parameters(model)
    assert "encoder.embed_tokens" not in flextensor.offload_units(model)
    assert not model.shared._forward_pre_hooks and not model.shared._forward_hooks
    with torch.no_grad():
        for _ in range(LEARN + 2):
            assert torch.equal(model(input_ids=ids).last_hidden_state, expected)
    flextensor.release(model)
