"""End to end on the CPU engine: the same host store, arena, copies and hooks as on a GPU."""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

import flextensor
from flextensor.layout import provisional_arena_bytes
from flextensor.plan_policy import input_signature
from flextensor.planner import residents_within
from flextensor.errors import (
    AlreadyOffloadedError,
    BackwardNotSupportedError,
    ConcurrentForwardError,
    NotOffloadedError,
    SelectionError,
)
from flextensor.layout import UNIT_ALIGNMENT
from flextensor.measurements import LinkModel, Measurements, UnitMeasurement
from real_models import llama_inputs, tiny_llama, tiny_wan, wan_inputs
from spec_model import make_spec_model, spec_tokens
from streaming import streaming_config

CPU = {"device": "cpu"}


def run_forwards(model: nn.Module, inputs: object, n: int = 4) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for _ in range(n):
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            outs.append(_first_tensor(out))
    return outs


def _first_tensor(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if hasattr(out, "sample"):
        return out.sample
    return out[0]  # type: ignore[index]


def assert_all_equal(outs: list[torch.Tensor], ref: torch.Tensor) -> None:
    for i, out in enumerate(outs):
        assert torch.equal(out, ref), f"forward {i} differs from the resident model"


# -- the spec's examples, end to end ------------------------------------------------------------------------

SPEC_CONFIGS = {
    "all_but_lm_head": ({"include_patterns": ["*"], "exclude_patterns": ["lm_head"]}, ["lm_head.weight"]),
    "fp8_scales": ({"include_patterns": ["layers.*"], "exclude_patterns": ["*.scale"]}, ["layers.0.scale"]),
    "one_layer": (
        {"include_patterns": ["layers.*"], "exclude_patterns": ["layers.3"]},
        ["layers.3.attn.q.weight"],
    ),
    "classes": (
        {"include_patterns": ["layers.*"], "exclude_patterns": ["class:SharedExpertMLP", "class:MoELayer"]},
        ["layers.0.shared.up.weight", "layers.1.mlp.router.weight"],
    ),
    "fqcn": (
        {"include_patterns": ["layers.*"], "exclude_patterns": ["class:torch.nn.*.Linear"]},
        ["layers.0.attn.q.weight"],
    ),
    "combine": (
        {"include_patterns": ["embed", "layers.*", "head"], "exclude_patterns": ["head", "*.norm"]},
        ["head.weight", "layers.0.norm.weight", "lm_head.weight"],
    ),
    "submodule": (
        {"include_patterns": ["layers.*"], "exclude_patterns": ["layers.*.norm"]},
        ["layers.2.norm.bias"],
    ),
}


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_spec_examples_match_resident_model(name: str) -> None:
    fields, must_be_resident = SPEC_CONFIGS[name]
    ref = run_forwards(make_spec_model(), spec_tokens(), 1)[0]
    model = make_spec_model()
    model = flextensor.offload(
        model, streaming_config(model, fields["include_patterns"], fields["exclude_patterns"])
    )
    resident = set(flextensor.resident_parameters(model))
    for fqn in must_be_resident:
        assert fqn in resident
    assert flextensor.offloaded_parameters(model)
    assert_all_equal(run_forwards(model, spec_tokens()), ref)
    assert flextensor.phase(model) == "inference"
    assert flextensor.status(model).plan.streamed  # the streaming path ran, not an all-resident plan


def test_fqcn_class_pattern_keeps_user_linear_streamed() -> None:
    model = flextensor.offload(
        make_spec_model(),
        flextensor.OffloadConfig(
            include_patterns=["layers.*"], exclude_patterns=["class:torch.nn.*.Linear"], **CPU
        ),
    )
    assert "layers.0.proj.weight" in flextensor.offloaded_parameters(model)  # the user's own Linear


def test_offload_returns_same_object_with_names_and_keys_unchanged() -> None:
    model = make_spec_model()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    calls: list[str] = []
    model.layers[0].register_forward_hook(lambda *a: calls.append("user hook"))
    out = flextensor.offload(model, flextensor.OffloadConfig(**CPU))
    assert out is model and isinstance(out, type(make_spec_model()))
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    run_forwards(model, spec_tokens(), 1)
    assert calls == ["user hook"]


def test_include_star_streams_through_list_children_and_never_needs_whole_model() -> None:
    model = flextensor.offload(make_spec_model(n_layers=6), flextensor.OffloadConfig(**CPU))
    units = flextensor.offload_units(model)
    assert "layers" not in units and "layers.0" in units
    engine = model._flextensor_engine
    total = sum(u.nbytes for u in engine.units.values())
    run_forwards(model, spec_tokens(), 1)
    assert engine.device_bytes_held() < total / 2  # learning phases hold the two largest units

    budget = total // 2
    model = flextensor.offload(
        make_spec_model(n_layers=6), flextensor.OffloadConfig(gpu_memory_budget=budget, **CPU)
    )
    run_forwards(model, spec_tokens(), 3)
    engine = model._flextensor_engine
    assert engine.device_bytes_held() <= budget
    assert engine.plan is not None and engine.plan.streamed


def test_phases_follow_configured_counts() -> None:
    model = flextensor.offload(
        make_spec_model(), flextensor.OffloadConfig(discovery_forwards=2, profiling_forwards=2, **CPU)
    )
    seen = [flextensor.phase(model)]
    for _ in range(4):
        run_forwards(model, spec_tokens(), 1)
        seen.append(flextensor.phase(model))
    assert seen == ["discovery", "discovery", "profiling", "profiling", "inference"]


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
    run_forwards(model, torch.randn(2, 8), 1)
    assert flextensor.offload_units(model) == ["b", "a"]


# -- real model classes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("include", [["*"], ["model.layers.*"]])
def test_llama_tied_embeddings_bitwise(include: list[str], caplog: pytest.LogCaptureFixture) -> None:
    ref = run_forwards(tiny_llama(), llama_inputs(), 1)[0]
    model = tiny_llama()
    model = flextensor.offload(model, streaming_config(model, include))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if include == ["*"]:
        assert "model.embed_tokens.weight" in flextensor.resident_parameters(model)
    assert_all_equal(run_forwards(model, llama_inputs()), ref)


def test_llama_under_inference_mode_autocast_and_grad() -> None:
    inputs = llama_inputs()
    base = tiny_llama()
    model = tiny_llama()
    model = flextensor.offload(model, streaming_config(model, ["model.layers.*"]))
    run_forwards(model, inputs, 3)
    assert flextensor.status(model).plan.streamed
    with torch.inference_mode():
        assert torch.equal(model(inputs).logits, base(inputs).logits)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(inputs).logits, base(inputs).logits)
    out = model(inputs).logits  # grad enabled: right outputs...
    assert torch.equal(out, base(inputs).logits)
    with pytest.raises(BackwardNotSupportedError, match="release"):
        out.sum().backward()  # ...but no silently wrong gradients


def test_wan_transformer_bitwise() -> None:
    inputs = wan_inputs()
    ref = run_forwards(tiny_wan(layers=3), inputs, 1)[0]
    model = tiny_wan(layers=3)
    model = flextensor.offload(model, streaming_config(model, ["blocks.*"]))
    assert len(flextensor.offload_units(model)) == 3
    assert_all_equal(run_forwards(model, inputs), ref)


def test_wan_include_everything_bitwise() -> None:
    inputs = wan_inputs()
    ref = run_forwards(tiny_wan(), inputs, 1)[0]
    model = tiny_wan()
    model = flextensor.offload(model, streaming_config(model))
    assert_all_equal(run_forwards(model, inputs), ref)
    assert flextensor.status(model).plan.streamed


def test_new_input_shape_in_steady_state_replans_and_stays_right() -> None:
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    run_forwards(model, spec_tokens(), 3)
    longer = spec_tokens(seq=16)
    ref = run_forwards(make_spec_model(), longer, 1)[0]
    assert_all_equal(run_forwards(model, longer, 3), ref)
    assert flextensor.phase(model) == "inference"
    engine = model._flextensor_engine
    assert len(engine._plans) == 2


# -- order changes, outside reads ----------------------------------------------------------------------------


class Branchy(nn.Module):
    """Runs its blocks in an order that depends on the input, one of them twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))

    def forward(self, x: torch.Tensor, flip: bool = False) -> torch.Tensor:
        order = [4, 2, 0, 2, 1] if flip else [0, 1, 2, 3, 4]
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return x


@pytest.mark.parametrize("streaming", [False, True], ids=["no-budget", "tightest-budget"])
def test_llama_generate_matches_the_plain_model_token_for_token(streaming: bool) -> None:
    """generate(): a prefill, then decode steps on a growing cache; a plan for each, switched between at
    every call."""
    prompt = llama_inputs(batch=2, seq=5)
    settings = {
        "max_new_tokens": 24,
        "do_sample": False,
        "output_scores": True,
        "return_dict_in_generate": True,
    }
    with torch.no_grad():
        ref = tiny_llama(tie=False).generate(prompt, **settings)
    model = tiny_llama(tie=False)
    config = streaming_config(model, ["model.layers.*"]) if streaming else flextensor.OffloadConfig(**CPU)
    model = flextensor.offload(model, config)
    with torch.no_grad():
        for _ in range(2):  # the first call learns; the second runs on the plans it made
            out = model.generate(prompt, **settings)
            assert torch.equal(out.sequences, ref.sequences)
            assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores, strict=True))
    engine = model._flextensor_engine
    assert len(engine._plans) == 2  # the prompt and the decode step (the cache is not a tensor argument)
    assert flextensor.phase(model) == "inference"


@pytest.mark.parametrize("interrupted", [1, 2, 4], ids=["discovery", "profiling", "inference"])
def test_a_forward_interrupted_by_ctrl_c_is_closed_by_the_next_one(interrupted: int) -> None:
    """KeyboardInterrupt is not handed to PyTorch's always_call hooks: the next forward finds the step
    unfinished and closes it, and everything after runs as if the interrupted forward had failed."""
    tokens = spec_tokens()
    ref = run_forwards(make_spec_model(), tokens, 1)[0]
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    engine = model._flextensor_engine
    calls = [0]

    def ctrl_c(module: nn.Module, args: tuple) -> None:
        calls[0] += 1
        if calls[0] == interrupted:
            raise KeyboardInterrupt

    handle = model.layers[1].register_forward_pre_hook(ctrl_c)
    with torch.no_grad():
        for forward in range(1, interrupted + 1):
            if forward == interrupted:
                with pytest.raises(KeyboardInterrupt):
                    model(tokens)
            else:
                assert torch.equal(model(tokens), ref)
    handle.remove()
    assert engine._depth == 1  # what the interrupt left behind
    assert_all_equal(run_forwards(model, tokens, 4), ref)
    assert engine._depth == 0 and engine._owner_thread is None
    assert torch._C._len_torch_function_stack() == 0  # discovery's read tracker was popped
    assert flextensor.phase(model) == "inference"


class CallsItself(nn.Module):
    """A model whose forward calls the model again (the way some wrappers re-enter it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
        if again:
            x = self(x, again=False)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_model_that_calls_itself_is_one_step_not_an_interrupted_one() -> None:
    x = torch.randn(4, 16)
    with torch.no_grad():
        ref = CallsItself()(x)
    model = CallsItself()
    model = flextensor.offload(model, streaming_config(model, ["layers.*"]))
    engine = model._flextensor_engine
    assert_all_equal(run_forwards(model, x, 4), ref)
    assert engine.forwards == 4 and engine._depth == 0
    assert flextensor.phase(model) == "inference"


def test_out_of_order_units_load_on_demand_and_stay_right() -> None:
    x = torch.randn(3, 16)
    ref_model = Branchy()
    model = Branchy()
    model = flextensor.offload(model, streaming_config(model))
    run_forwards(model, x, 3)
    assert len(flextensor.status(model).plan.streamed) == 5
    with torch.no_grad():
        for flip in (True, False, True, True, False):
            assert torch.equal(model(x, flip=flip), ref_model(x, flip=flip))


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
        outs = run_forwards(model, x, 4)
    assert_all_equal(outs, ref.detach())
    assert "blocks.0.weight" in flextensor.resident_parameters(model)
    assert "blocks.0.bias" in flextensor.offloaded_parameters(model)
    assert sum("blocks.0.weight" in r.getMessage() for r in caplog.records) == 1


# -- release ---------------------------------------------------------------------------------------------


def test_release_round_trip_restores_state_dict() -> None:
    before = {k: v.clone() for k, v in make_spec_model().state_dict().items()}
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    run_forwards(model, spec_tokens(), 4)
    during = model.state_dict()
    assert all(torch.equal(during[k], v) for k, v in before.items())
    flextensor.release(model, device="cpu")
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) and after[k].device.type == "cpu" for k, v in before.items())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    with pytest.raises(NotOffloadedError):
        flextensor.phase(model)
    flextensor.offload(model, flextensor.OffloadConfig(**CPU))  # and it can be offloaded again
    assert torch.equal(
        run_forwards(model, spec_tokens(), 1)[0], run_forwards(make_spec_model(), spec_tokens(), 1)[0]
    )


# -- bad input -------------------------------------------------------------------------------------------


def test_offload_twice_says_release_first() -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    with pytest.raises(AlreadyOffloadedError, match="release"):
        flextensor.offload(model, flextensor.OffloadConfig(**CPU))


def test_selecting_nothing_raises_and_leaves_model_alone() -> None:
    model = make_spec_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning), pytest.raises(SelectionError):
        flextensor.offload(model, flextensor.OffloadConfig(include_patterns=["nope.*"], **CPU))
    assert not hasattr(model, "_flextensor_engine")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_failure_inside_offload_leaves_model_exactly_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    import flextensor.api as api

    model = make_spec_model()
    before = {k: (v.clone(), v.device, v.dtype) for k, v in model.state_dict().items()}
    params_before = {n: p for n, p in model.named_parameters()}
    real_pack = api.pack_unit
    calls = {"n": 0}

    def failing_pack(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated failure while packing")
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(api, "pack_unit", failing_pack)
    with pytest.raises(RuntimeError, match="simulated"):
        flextensor.offload(model, flextensor.OffloadConfig(**CPU))
    assert {n: p for n, p in model.named_parameters()} == params_before  # same Parameter objects
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k][0]) and v.device == before[k][1] and v.dtype == before[k][2]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert not hasattr(model, "_flextensor_engine")


def test_meta_parameters_are_refused_clearly() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(flextensor.FlexTensorError, match="meta"):
        flextensor.offload(model, flextensor.OffloadConfig(**CPU))


def test_forward_from_second_thread_raises() -> None:
    started, release_gate = threading.Event(), threading.Event()

    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            started.set()
            release_gate.wait(10)
            return self.b(x)

    torch.manual_seed(0)
    x = torch.randn(1, 4)
    reference = Slow()
    reference.load_state_dict(Slow().state_dict())
    model = Slow()
    model.load_state_dict(reference.state_dict())
    release_gate.set()
    with torch.no_grad():
        ref = reference(x)
    release_gate.clear()
    model = flextensor.offload(model, streaming_config(model))
    outputs: list[torch.Tensor] = []

    def first_thread() -> None:
        with torch.no_grad():
            outputs.append(model(x))

    worker = threading.Thread(target=first_thread)
    worker.start()
    assert started.wait(10)
    try:
        with pytest.raises(ConcurrentForwardError):
            model(x)
        with pytest.raises(ConcurrentForwardError):
            model.b(x)  # a unit called directly from the second thread
    finally:
        release_gate.set()
        worker.join(10)
    assert outputs and torch.equal(outputs[0], ref)  # the running forward was not disturbed
    model(torch.randn(1, 4))  # and the first thread's forward left the model usable


def test_introspection_on_plain_model_says_offload_first() -> None:
    with pytest.raises(NotOffloadedError, match="offload"):
        flextensor.offload_units(make_spec_model())


def test_load_state_dict_while_offloaded_is_refused() -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    with pytest.raises(RuntimeError, match="release"):
        model.load_state_dict(make_spec_model().state_dict())


# -- units that must not stream ---------------------------------------------------------------------------


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
    assert_all_equal(run_forwards(model, x, 5), ref)
    assert "b" not in flextensor.offload_units(model)
    assert {"b.weight", "b.bias"} <= set(flextensor.resident_parameters(model))


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


def test_dtype_or_device_conversion_while_offloaded_is_refused_until_release() -> None:
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    run_forwards(model, spec_tokens(), 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="release"):
        model.half()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing converted
    # A move to where everything already is (as a diffusers pipeline's pipe.to(device) does) is fine.
    assert model.to("cpu") is model
    ref = run_forwards(make_spec_model(), spec_tokens(), 1)[0]
    assert_all_equal(run_forwards(model, spec_tokens(), 2), ref)
    flextensor.release(model)
    model.double()  # a plain module again
    assert next(model.parameters()).dtype == torch.float64


def test_switching_back_to_known_input_shapes_reuses_their_plan() -> None:
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    short, long = spec_tokens(seq=8), spec_tokens(seq=32)
    refs = {8: run_forwards(make_spec_model(), short, 1)[0], 32: run_forwards(make_spec_model(), long, 1)[0]}
    run_forwards(model, short, 3)
    run_forwards(model, long, 2)
    engine = model._flextensor_engine
    plans = dict(engine._plans)
    with torch.no_grad():
        for tokens in (short, long, short, long):
            assert torch.equal(model(tokens), refs[tokens.shape[1]])
    assert engine._plans == plans  # no new profiling: both plans were reused


# -- switching between cached plans keeps shared resident units ---------------------------------------------


def _offload_with_placements(
    placements: dict[int, tuple[str, ...]], tight: bool = True, **fields: object
) -> tuple[nn.Module, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """A spec model that learned a plan per sequence length in ``placements``, each then replaced by one
    keeping those units resident and streaming the rest; with the inputs and the plain model's outputs.

    On a CPU the tightest budget streams everything and no budget keeps everything resident, so residency
    is placed by hand through install_plan, the path a learned plan takes. ``tight``: under the tightest
    budget (else none).
    """
    model = make_spec_model()
    config = streaming_config(model, **fields) if tight else flextensor.OffloadConfig(**CPU, **fields)
    model = flextensor.offload(model, config)
    tokens = {seq: spec_tokens(seq=seq) for seq in placements}
    refs = {seq: run_forwards(make_spec_model(), tokens[seq], 1)[0] for seq in placements}
    for seq in placements:
        run_forwards(model, tokens[seq], 4)
    engine = model._flextensor_engine
    assert len(engine._plans) == len(placements)
    for seq, resident in placements.items():
        state = engine._plans[input_signature((tokens[seq],), {})]
        streamed = tuple(u for u in state.measurements.unit_names() if u not in resident)
        sizes = [engine.units[u].nbytes for u in streamed]
        arena = max(state.plan.arena_bytes, provisional_arena_bytes(sizes)) if streamed else 0
        plan = dataclasses.replace(state.plan, resident=resident, streamed=streamed, arena_bytes=arena)
        engine.install_plan(state.measurements, plan)
    return model, tokens, refs


def _count_uploads(engine: OffloadEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the units given resident storage (one upload each) from now on."""
    uploaded: list[str] = []
    upload = engine._upload_resident

    def counted(unit: UnitState) -> None:
        uploaded.append(unit.name)
        upload(unit)

    monkeypatch.setattr(engine, "_upload_resident", counted)
    return uploaded


def _assert_packs_hold_the_weights(engine: OffloadEngine, names: Iterable[str]) -> None:
    """Each of these units has a host pack again, holding its parameters' original values."""
    original = make_spec_model().state_dict()
    for name in names:
        unit = engine.units[name]
        assert unit.pack is not None and unit.pack.held_bytes > 0, name
        for fqn, _, entry in unit.parameters:
            assert torch.equal(unit.pack.view(entry), original[fqn]), fqn


def _assert_packs_dropped(engine: OffloadEngine, resident: Iterable[str]) -> None:
    """Units resident now and in every saved plan hold no host pack; every other unit holds its own."""
    everywhere = set(resident).intersection(*(state.plan.resident for state in engine._plans.values()))
    for name, unit in engine.units.items():
        assert (unit.pack is None) == (name in everywhere), name
    assert engine.host_bytes_held() == sum(u.pack.held_bytes for u in engine.units.values() if u.pack)


def _assert_placement(engine: OffloadEngine, resident: tuple[str, ...]) -> None:
    for unit in engine.units.values():
        assert unit.resident == (unit.name in resident), unit.name
        assert unit.storage is not None
        if unit.resident:
            assert unit.valid and unit.conflicts == unit.prefetch_next == ()
        else:
            assert engine.arena is not None
            assert unit.storage.untyped_storage().data_ptr() == engine.arena.untyped_storage().data_ptr()


def test_alternating_plans_keep_shared_resident_units_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # embed, layers.1 and lm_head are resident in both; layers.0 and layers.3 trade places.
    placements = {
        8: ("embed", "layers.0", "layers.1", "lm_head"),
        32: ("embed", "layers.1", "layers.3", "lm_head"),
    }
    shared = ("embed", "layers.1", "lm_head")
    model, tokens, refs = _offload_with_placements(placements)
    engine = model._flextensor_engine
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    pointers = {name: engine.units[name].storage.data_ptr() for name in shared}
    uploaded = _count_uploads(engine, monkeypatch)
    with torch.no_grad():
        for seq, before in ((32, 8), (8, 32), (32, 8), (8, 32), (32, 8)):
            uploaded.clear()
            assert torch.equal(model(tokens[seq]), refs[seq]), f"seq {seq} differs from the resident model"
            assert torch.equal(model(tokens[seq]), refs[seq])  # steady state on the switched-to plan
            assert sorted(uploaded) == sorted(set(placements[seq]) - set(placements[before]))
            assert {name: engine.units[name].storage.data_ptr() for name in shared} == pointers
            _assert_placement(engine, placements[seq])


@pytest.mark.parametrize("next_seq", [32, 8], ids=["same-shapes-again", "back-to-the-old-shapes"])
def test_a_switch_that_fails_half_way_is_laid_out_again_by_the_next_forward(
    monkeypatch: pytest.MonkeyPatch, next_seq: int
) -> None:
    placements = {
        8: ("embed", "layers.0", "layers.1", "lm_head"),
        32: ("embed", "layers.1", "layers.3", "lm_head"),
    }
    model, tokens, refs = _offload_with_placements(placements)
    engine = model._flextensor_engine
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    upload = engine._upload_resident
    armed = [True]

    def out_of_memory_once(unit: UnitState) -> None:
        if armed[0] and unit.name == "layers.3":  # after layers.0 left residency: the old layout is gone
            armed[0] = False
            raise torch.OutOfMemoryError("injected")
        upload(unit)

    monkeypatch.setattr(engine, "_upload_resident", out_of_memory_once)
    with torch.no_grad():
        with pytest.raises(torch.OutOfMemoryError):
            model(tokens[32])
        assert torch.equal(model(tokens[next_seq]), refs[next_seq])
        _assert_placement(engine, placements[next_seq])
        for seq in (8, 32):
            assert torch.equal(model(tokens[seq]), refs[seq])


def test_a_layout_with_a_unit_both_resident_and_streamed_is_refused() -> None:
    model, tokens, refs = _offload_with_placements({8: ("embed", "layers.0")})
    engine = model._flextensor_engine
    with pytest.raises(ValueError, match=r"both resident and streamed.*layers\.0"):
        engine.apply_layout(["layers.0", "layers.1"], ["layers.0"], 1 << 20)
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])  # refused before anything moved


def test_switching_between_all_resident_plans_uploads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    everything = ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head", "lm_head")
    model, tokens, refs = _offload_with_placements({8: everything, 32: everything})
    engine = model._flextensor_engine
    pointers = {name: unit.storage.data_ptr() for name, unit in engine.units.items()}
    uploaded = _count_uploads(engine, monkeypatch)
    with torch.no_grad():
        for seq in (8, 32, 8, 32):
            assert torch.equal(model(tokens[seq]), refs[seq])
    assert uploaded == []
    assert engine.arena is None
    assert {name: unit.storage.data_ptr() for name, unit in engine.units.items()} == pointers
    assert engine.device_bytes_held() == sum(u.nbytes for u in engine.units.values())


def test_new_shape_under_a_tight_budget_streams_resident_units_and_switching_back_uploads_them() -> None:
    placements = {8: ("embed", "layers.0", "layers.1", "lm_head")}
    model, tokens, refs = _offload_with_placements(placements, profiling_forwards=2)
    engine = model._flextensor_engine
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    _assert_placement(engine, placements[8])
    _assert_packs_dropped(engine, placements[8])
    longer = spec_tokens(seq=16)
    ref = run_forwards(make_spec_model(), longer, 1)[0]
    with torch.no_grad():
        # Profiling: the resident units and the arena of the rest would overrun the budget, so every
        # unit streams and nothing else is held; the residents' packs come back exactly.
        assert torch.equal(model(longer), ref)
    assert flextensor.phase(model) == "profiling"
    _assert_placement(engine, ())
    _assert_packs_hold_the_weights(engine, engine.units)
    sizes = [engine.units[u].nbytes for u in engine.order]
    assert engine.device_bytes_held() == provisional_arena_bytes(sizes)
    assert_all_equal(run_forwards(model, longer, 2), ref)
    assert flextensor.phase(model) == "inference"
    with torch.no_grad():
        for tokens_now, ref_now in ((tokens[8], refs[8]), (longer, ref), (tokens[8], refs[8])):
            assert torch.equal(model(tokens_now), ref_now)
    _assert_placement(engine, placements[8])
    _assert_packs_dropped(engine, placements[8])


# -- one copy of a resident unit: its host pack is dropped in steady state -------------------------------


def _count_rebuilds(engine: OffloadEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the units whose host pack is built again from their storage, from now on."""
    rebuilt: list[str] = []
    rebuild = engine._rebuild_pack

    def counted(unit: UnitState) -> None:
        rebuilt.append(unit.name)
        rebuild(unit)

    monkeypatch.setattr(engine, "_rebuild_pack", counted)
    return rebuilt


def test_only_units_resident_in_every_plan_drop_their_pack_and_a_plan_streaming_one_rebuilds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # layers.0 and layers.3 trade places between the two plans: they keep their packs, so alternating
    # re-pins nothing; embed, layers.1 and lm_head are resident in both and hold no host copy.
    placements = {
        8: ("embed", "layers.0", "layers.1", "lm_head"),
        32: ("embed", "layers.1", "layers.3", "lm_head"),
    }
    everywhere = {"embed", "layers.1", "lm_head"}
    model, tokens, refs = _offload_with_placements(placements)
    engine = model._flextensor_engine
    _assert_packs_dropped(engine, placements[32])
    assert {n for n, u in engine.units.items() if u.pack is None} == everywhere
    assert engine.host_bytes_held() == sum(u.pack.held_bytes for u in engine.units.values() if u.pack)
    rebuilt = _count_rebuilds(engine, monkeypatch)
    with torch.no_grad():
        for seq in (8, 32, 8, 32):
            assert torch.equal(model(tokens[seq]), refs[seq]), f"seq {seq} differs from the resident model"
            assert torch.equal(model(tokens[seq]), refs[seq])
            _assert_placement(engine, placements[seq])
            _assert_packs_dropped(engine, placements[seq])
    assert rebuilt == []
    _assert_packs_hold_the_weights(engine, {"layers.0", "layers.3"})

    # A plan for 8 that streams layers.1: its pack is built again from its storage, exactly.
    state = engine._plans[input_signature((tokens[8],), {})]
    resident = ("embed", "layers.0", "lm_head")
    streamed = tuple(u for u in state.measurements.unit_names() if u not in resident)
    arena = max(state.plan.arena_bytes, provisional_arena_bytes([engine.units[u].nbytes for u in streamed]))
    plan = dataclasses.replace(state.plan, resident=resident, streamed=streamed, arena_bytes=arena)
    engine.install_plan(state.measurements, plan)
    assert rebuilt == ["layers.1"]
    _assert_packs_hold_the_weights(engine, {"layers.1"})
    with torch.no_grad():
        for seq in (8, 32, 8):
            assert torch.equal(model(tokens[seq]), refs[seq])


def test_new_shape_profiles_with_resident_units_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    placements = {8: ("embed", "layers.0", "layers.1", "lm_head")}
    model, tokens, refs = _offload_with_placements(placements, tight=False, profiling_forwards=2)
    engine = model._flextensor_engine
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    pointers = {name: engine.units[name].storage.data_ptr() for name in placements[8]}
    uploaded = _count_uploads(engine, monkeypatch)
    rebuilt = _count_rebuilds(engine, monkeypatch)
    longer = spec_tokens(seq=16)
    ref = run_forwards(make_spec_model(), longer, 1)[0]
    with torch.no_grad():
        assert torch.equal(model(longer), ref)  # profiling: only the units streamed before stream
    assert flextensor.phase(model) == "profiling"
    _assert_placement(engine, placements[8])
    _assert_packs_dropped(engine, placements[8])
    assert {name: engine.units[name].storage.data_ptr() for name in placements[8]} == pointers
    assert uploaded == rebuilt == []
    streamed = [engine.units[u].nbytes for u in engine.order if u not in placements[8]]
    resident = sum(engine.units[u].nbytes for u in placements[8])
    assert engine.device_bytes_held() == resident + provisional_arena_bytes(streamed)

    assert_all_equal(run_forwards(model, longer, 2), ref)
    assert flextensor.phase(model) == "inference"
    state = engine._plans[input_signature((longer,), {})]
    assert engine.plan is state.plan and engine.measurements is state.measurements
    # Resident units were profiled too: every unit is measured, in execution order.
    assert list(state.measurements.unit_names()) == engine.order == flextensor.offload_units(model)
    assert all(u.compute_s > 0 for u in state.measurements.units)
    _assert_placement(engine, state.plan.resident)
    _assert_packs_dropped(engine, state.plan.resident)
    assert sorted(rebuilt) == sorted(set(placements[8]) - set(state.plan.resident))
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])  # back to the hand-made plan
    _assert_packs_hold_the_weights(engine, set(engine.units) - set(placements[8]))
    _assert_packs_dropped(engine, placements[8])


def _residency_seen_by(module: nn.Module, engine: OffloadEngine) -> list[set[str]]:
    """The resident units at each call of ``module`` from now on."""
    seen: list[set[str]] = []
    module.register_forward_pre_hook(
        lambda *_: seen.append({u.name for u in engine.units.values() if u.resident})
    )
    return seen


def test_a_profiling_forward_out_of_memory_with_residents_held_profiles_again_streaming_everything() -> None:
    placements = {8: ("embed", "layers.0", "layers.1", "lm_head")}
    model, tokens, refs = _offload_with_placements(placements, tight=False)
    engine = model._flextensor_engine
    longer = spec_tokens(seq=16)
    ref = run_forwards(make_spec_model(), longer, 1)[0]
    armed = [True]

    def out_of_memory_once(module: nn.Module, args: tuple) -> None:
        if armed[0]:  # the new shape's activations did not fit beside the resident units
            armed[0] = False
            raise torch.OutOfMemoryError("injected")

    handle = model.layers[2].register_forward_pre_hook(out_of_memory_once)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        model(longer)
    handle.remove()
    assert flextensor.phase(model) == "profiling"
    seen = _residency_seen_by(model.layers[3], engine)
    assert_all_equal(run_forwards(model, longer, 3), ref)
    assert seen[0] == set()  # the profiling forward after the failure streamed every unit
    assert flextensor.phase(model) == "inference"
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])


@pytest.mark.parametrize("error", [RuntimeError, torch.OutOfMemoryError])
def test_a_plan_whose_layout_fails_profiles_again_and_retries_until_a_layout_lands(
    monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    # Out of memory also caps the next plan below the failed one, but never below the smallest plan:
    # the smallest plan (all streamed, as on this CPU) is retried, not refused with a BudgetError.
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    engine = model._flextensor_engine
    tokens = spec_tokens()
    ref = run_forwards(make_spec_model(), tokens, 1)[0]
    apply_layout = engine.apply_layout
    failures = [2]  # the plan's layout, then the first attempt at the layout to profile again

    def fails_half_way(streamed: list[str], resident: Iterable[str], arena_bytes: int) -> None:
        if failures[0] and engine.phase is Phase.PROFILING:
            failures[0] -= 1
            engine._free_device_bytes(set())  # what a failure after the old layout was let go leaves
            raise error("injected")
        apply_layout(streamed, resident, arena_bytes)

    with torch.no_grad():
        assert torch.equal(model(tokens), ref)  # discovery
        monkeypatch.setattr(engine, "apply_layout", fails_half_way)
        with pytest.raises(error, match="injected"):
            model(tokens)  # profiling: the forward ran, its plan's layout failed
        assert flextensor.phase(model) == "profiling" and engine.plan is None
        with pytest.raises(error, match="injected"):
            model(tokens)  # laying out to profile again fails too: the next forward tries again
    assert_all_equal(run_forwards(model, tokens, 3), ref)
    assert flextensor.phase(model) == "inference"
    _assert_placement(engine, engine.plan.resident)
    assert engine._failed_peak_bytes is None  # cleared once a layout landed


def test_after_a_layout_ran_out_of_memory_the_next_plan_asks_for_less(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    engine = model._flextensor_engine
    names = list(engine.units)
    size = max(u.nbytes for u in engine.units.values())
    measurements = Measurements(  # transfer-bound: without a limit everything stays resident
        units=tuple(UnitMeasurement(name, size, 1e-3) for name in names),
        link=LinkModel.constant(size / 10e-3),
        baseline_bytes=0,
        activation_peak_bytes=size,
    )
    first = engine._make_plan(measurements)
    assert set(first.resident) == set(names)

    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(engine, "apply_layout", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.install_plan(measurements, first)
    second = engine._make_plan(measurements)
    assert second.predicted_peak_bytes <= 0.9 * first.predicted_peak_bytes
    assert len(second.resident) < len(names)


def test_profiling_keeps_the_residents_that_leave_room_within_the_limit() -> None:
    page = UNIT_ALIGNMENT
    resident = {"a": 4 * page, "b": page, "c": 10 * page}
    streamed = [2 * page, 2 * page]  # a provisional arena of 4 pages
    assert residents_within(resident, streamed, 10**9) == {"a", "b", "c"}
    # Streaming a or c would grow the arena by as much as it frees; streaming b saves its page.
    assert residents_within(resident, streamed, 18 * page) == {"a", "c"}
    assert residents_within(resident, streamed, 0) == {"a", "c"}  # nothing holds less
    # Streaming the largest resident unit saves the most when it is no larger than the streamed ones.
    assert residents_within({"a": page, "b": 3 * page}, [4 * page, 4 * page], 10 * page) == {"a"}
    # No single move saves anything, but streaming both holds less than keeping them.
    assert residents_within({"x": 10 * page, "y": 10 * page}, [page], 0) == set()
    assert residents_within({}, streamed, 0) == set()
    # Units that never ran set a floor under the arena: keeping a unit must leave room beside it.
    assert residents_within({"a": page}, [page], 3 * page) == {"a"}
    assert residents_within({"a": page}, [page], 3 * page, arena_floor=3 * page) == set()


@pytest.mark.parametrize("device", [None, "cpu"])
def test_release_after_packs_were_dropped_returns_the_original_weights(device: str | None) -> None:
    before = copy.deepcopy(make_spec_model().state_dict())
    placements = {8: ("embed", "layers.0", "lm_head")}
    model, tokens, refs = _offload_with_placements(placements, tight=False)
    engine = model._flextensor_engine
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    _assert_packs_dropped(engine, placements[8])
    during = model.state_dict()  # resident units' parameters from their storage, the others' packs
    assert list(during) == list(before) and all(torch.equal(during[k], v) for k, v in before.items())
    flextensor.release(model, device)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) and after[k].device.type == "cpu" for k, v in before.items())
    # Each parameter has storage of its own again, not a view of a unit's storage.
    pointers = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(pointers)) == len(pointers)
    assert engine.host_bytes_held() == 0 and all(u.storage is None for u in engine.units.values())
    assert torch.equal(run_forwards(model, tokens[8], 1)[0], refs[8])


def test_offload_from_a_profile_rolls_back_after_the_plan_dropped_packs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "spec.json"
    placements = {8: ("embed", "layers.0", "lm_head")}
    model, _, _ = _offload_with_placements(placements, tight=False)
    flextensor.save_profile(model, path)

    other = make_spec_model()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    params_before = dict(other.named_parameters())

    def failing_attach(self: OffloadEngine) -> None:
        _assert_packs_dropped(self, placements[8])  # the saved plan is in place
        raise RuntimeError("simulated failure after the plan")

    monkeypatch.setattr(OffloadEngine, "attach", failing_attach)
    with pytest.raises(RuntimeError, match="simulated"):
        flextensor.offload(other, flextensor.OffloadConfig(profile=path, **CPU))
    assert dict(other.named_parameters()) == params_before
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    assert not hasattr(other, "_flextensor_engine")


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
    assert_all_equal(run_forwards(model, x, 4), ref)
    assert flextensor.phase(model) == "inference"
    assert flextensor.offload_units(model) == ["blocks.0", "blocks.1", "blocks.2"]


class _SavesSparse(torch.autograd.Function):
    """Saves a sparse tensor for backward: it has no plain storage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x.detach().to_sparse())
        return x * 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _SparseSavingBlock(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_SavesSparse.apply(x))  # inside the unit, under its saved-tensor guard


class SparseInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_SparseSavingBlock(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_grad_enabled_forward_with_storage_less_saved_tensors_runs() -> None:
    x = torch.randn(2, 8)
    ref = SparseInput()(x).detach()
    model = SparseInput()
    model = flextensor.offload(model, streaming_config(model))
    for _ in range(4):
        assert torch.equal(model(x).detach(), ref)  # grad enabled: the saved-tensor guard is active


class HasUnusedModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.unused = nn.Linear(256, 256)  # selected by "*", never run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_never_run_unit_larger_than_the_planned_arena_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = HasUnusedModule()
    budget = 2 * 4096  # two of the small blocks' arena ranges: the unused unit does not fit
    model = flextensor.offload(model, flextensor.OffloadConfig(gpu_memory_budget=budget, **CPU))
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        run_forwards(model, torch.randn(2, 8), 3)
    assert any("never ran" in r.getMessage() and "unused" in r.getMessage() for r in caplog.records)
