"""Offloaded models under torch.compile (inductor on the CPU): every way of compiling, in either order.

Each model streams every unit through a two-slot arena (the tightest budget), so a compiled kernel that
read a weight before its unit's copy, or after the next one, would give a different output. Outputs are
compared bit for bit with the same model compiled the same way without offload.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import flextensor
from flextensor.errors import UnsupportedOperationError
from real_models import llama_inputs, tiny_llama, tiny_wan, wan_inputs
from streaming import streaming_config

pytest.importorskip("torch._inductor")
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

FORWARDS = 5  # discovery, profiling (one or two), then steady state


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Graphs and counters of one test never leak into the next (they are keyed on the classes' code)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Case:
    """A real model class, its inputs, and where its units are."""

    def __init__(self, build: Callable[[], nn.Module], run: Callable[[nn.Module], torch.Tensor], blocks: str):
        self.build, self.run, self.blocks = build, run, blocks

    def block_list(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.blocks)


def _llama_case(layers: int = 3) -> Case:
    tokens = llama_inputs()
    return Case(lambda: tiny_llama(layers=layers, tie=False), lambda m: m(tokens).logits, "model.layers")


def _wan_case(layers: int = 3) -> Case:
    pytest.importorskip("diffusers")
    inputs = wan_inputs()
    return Case(lambda: tiny_wan(layers=layers), lambda m: m(**inputs).sample, "blocks")


CASES = {"llama": _llama_case, "wan": _wan_case}


def compile_whole(model: nn.Module, case: Case) -> nn.Module:
    return torch.compile(model)


def compile_method(model: nn.Module, case: Case) -> nn.Module:
    model.compile()
    return model


def compile_blocks(model: nn.Module, case: Case) -> nn.Module:
    for block in case.block_list(model):  # diffusers' compile_repeated_blocks does this
        block.compile()
    return model


HOW = {
    "torch.compile(model)": compile_whole,
    "model.compile()": compile_method,
    "block.compile()": compile_blocks,
}


def native_compiled(case: Case, how: Callable[[nn.Module, Case], nn.Module]) -> tuple[torch.Tensor, int]:
    """The output of the model compiled ``how`` without offload, and how many graphs that compiled."""
    with torch.no_grad():
        output = case.run(how(case.build(), case))
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    return output, graphs


def offloaded(case: Case, **fields: Any) -> nn.Module:
    model = case.build()
    return flextensor.offload(model, streaming_config(model, [f"{case.blocks}.*"], **fields))


def assert_all_stream(model: nn.Module) -> None:
    status = flextensor.status(model)
    assert status.phase == "inference"
    assert not status.resident and len(status.streamed) == len(status.units)


def assert_no_graph_breaks() -> None:
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("how", HOW, ids=list(HOW))
@pytest.mark.parametrize("which", CASES)
def test_compiled_offloaded_model_is_bitwise_the_natively_compiled_one(which: str, how: str) -> None:
    case = CASES[which]()
    reference, native_graphs = native_compiled(case, HOW[how])
    model = offloaded(case)
    compiled = HOW[how](model, case)
    with torch.no_grad():
        outputs = [case.run(compiled) for _ in range(FORWARDS)]
    assert_all_stream(model)
    # The discovery forward runs eagerly (it watches every torch call); from the profiling forward on
    # the model runs compiled, with the plan made for the compiled compute.
    for output in outputs[2:]:
        assert torch.equal(output, reference)
    assert_no_graph_breaks()
    # Phase changes recompile nothing: the ops carry the engine and unit as constants.
    assert counters["stats"]["unique_graphs"] == native_graphs


@pytest.mark.parametrize(("which", "how"), [("llama", "torch.compile(model)"), ("wan", "block.compile()")])
def test_graph_count_does_not_grow_with_the_number_of_units(which: str, how: str) -> None:
    """(Per-block compile of a Llama recompiles per layer natively too: each layer's index is a constant.)"""
    graphs = []
    for layers in (3, 6):
        case = CASES[which](layers)
        _, native_graphs = native_compiled(case, HOW[how])
        model = HOW[how](offloaded(case), case)
        with torch.no_grad():
            for _ in range(FORWARDS):
                case.run(model)
        assert_all_stream(model)
        graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[-1] == native_graphs
        torch._dynamo.reset()
        counters.clear()
    assert graphs[0] == graphs[1], graphs


class WeightOnlyBlock(nn.Module):
    """Work on weights alone before the input is touched: inductor is free to move it (fusing every
    block's ``bias * 3 + temb`` into one kernel at the graph's start, before those weights arrive)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(32, 32, generator=g))
        self.bias = nn.Parameter(torch.randn(32, generator=g))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift = (self.bias * 3 + temb).sigmoid()
        mixed = (self.weight.t() * 0.5).cos()
        return (x @ mixed) / 8 + shift


class WeightOnlyStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(WeightOnlyBlock(i) for i in range(6))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, temb)
        return x


def test_kernels_reading_only_weights_wait_for_their_unit() -> None:
    x, temb = torch.randn(4, 32), torch.randn(32)
    with torch.no_grad():
        reference = torch.compile(WeightOnlyStack())(x, temb)
        torch._dynamo.reset()
        model = WeightOnlyStack()
        flextensor.offload(model, streaming_config(model, ["blocks.*"]))
        compiled = torch.compile(model)
        outputs = [compiled(x, temb) for _ in range(FORWARDS)]
    assert_all_stream(model)
    for output in outputs[2:]:
        assert torch.equal(output, reference)


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_model_compiled_and_run_before_offload_streams_after_it(how: str) -> None:
    """Graphs compiled before offload() have no hooks: they must not be reused for the offloaded model."""
    case = _llama_case()
    reference, _ = native_compiled(case, HOW[how])
    model = case.build()
    compiled = HOW[how](model, case)
    with torch.no_grad():
        assert torch.equal(case.run(compiled), reference)  # cached, without flextensor's hooks
        returned = flextensor.offload(compiled, streaming_config(model, [f"{case.blocks}.*"]))
        assert returned is compiled  # a torch.compile wrapper comes back as it was given
        outputs = [case.run(compiled) for _ in range(FORWARDS)]
    assert flextensor.status(compiled).units == flextensor.status(model).units
    assert_all_stream(model)
    assert flextensor.status(model).forwards == FORWARDS  # every forward went through the hooks
    for output in outputs[2:]:
        assert torch.equal(output, reference)
    flextensor.release(compiled)
    with torch.no_grad():
        assert torch.equal(case.run(compiled), reference)


def test_per_block_compile_before_offload_streams_after_it() -> None:
    case = _wan_case()
    reference, _ = native_compiled(case, compile_blocks)
    model = compile_blocks(case.build(), case)
    with torch.no_grad():
        case.run(model)
        flextensor.offload(model, streaming_config(model, [f"{case.blocks}.*"]))
        outputs = [case.run(model) for _ in range(FORWARDS)]
    assert_all_stream(model)
    for output in outputs[2:]:
        assert torch.equal(output, reference)
    assert_no_graph_breaks()


def test_saved_profile_starts_a_compiled_run_in_steady_state_without_recompiling(tmp_path: Path) -> None:
    case = _llama_case()
    reference, native_graphs = native_compiled(case, compile_whole)
    path = tmp_path / "llama.json"
    first = offloaded(case)
    with torch.no_grad():
        for _ in range(FORWARDS):
            case.run(first)
    flextensor.save_profile(first, path)
    flextensor.release(first)

    model = offloaded(case, profile=path)
    assert flextensor.phase(model) == "inference"
    compiled = torch.compile(model)
    with torch.no_grad():
        outputs = [case.run(compiled) for _ in range(3)]
    # The first forward checks the saved profile against the model's behaviour, eagerly.
    assert all(torch.equal(o, reference) for o in outputs[1:])
    assert counters["stats"]["unique_graphs"] == native_graphs
    assert_all_stream(model)


class Wrapper(nn.Module):
    """A larger module compiled as a whole, with an offloaded model inside."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(64, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(tokens).logits)


def test_an_offloaded_model_inside_a_compiled_module_needs_its_plan_first() -> None:
    case = _llama_case()
    torch.manual_seed(5)
    native = Wrapper(case.build())
    with torch.no_grad():
        reference = torch.compile(native)(llama_inputs())
    torch._dynamo.reset()
    inner = offloaded(case)
    torch.manual_seed(5)
    wrapper = Wrapper(case.build())
    wrapper.inner = inner
    compiled = torch.compile(wrapper)
    with torch.no_grad(), pytest.raises(UnsupportedOperationError, match=r"flextensor\.phase"):
        compiled(llama_inputs())
    with torch.no_grad():
        for _ in range(FORWARDS):  # its learning forwards, uncompiled
            wrapper(llama_inputs())
        assert flextensor.phase(inner) == "inference"
        outputs = [compiled(llama_inputs()) for _ in range(3)]
    assert all(torch.equal(o, reference) for o in outputs)
    assert_all_stream(inner)


class CountingRuns:
    """Stands in for a model's hooks when the ops are checked on their own."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def run_unit_pre(
        self, index: int, in_graph: bool = False, weights: list[torch.Tensor] | None = None
    ) -> None:
        assert in_graph and weights is not None  # called by the op from a compiled graph, with its weights
        self.calls.append(("pre", index))

    def run_unit_post(self, index: int) -> None:
        self.calls.append(("post", index))

    def run_model_begin(self, signature: str) -> None:
        self.calls.append(("begin", signature))

    def run_model_end(self) -> None:
        self.calls.append(("end", None))


def test_the_ops_pass_torch_library_opcheck() -> None:
    from flextensor.hooks import compiled_ops as compiled

    runs = CountingRuns()
    model_id = compiled.register(runs)
    try:
        weights = [torch.randn(4, 4), torch.randn(4)]
        token = torch.zeros(1)
        torch.library.opcheck(torch.ops.flextensor.unit_pre, (weights, token, model_id, 3))
        torch.library.opcheck(torch.ops.flextensor.unit_post, ([torch.randn(2, 4)], token, model_id, 3))
        torch.library.opcheck(torch.ops.flextensor.model_begin, (token, model_id, "x:2x8"))
        torch.library.opcheck(torch.ops.flextensor.model_end, (token, model_id))
    finally:
        compiled.unregister(model_id)
    assert ("pre", 3) in runs.calls and ("post", 3) in runs.calls and ("end", None) in runs.calls


def test_a_profiling_forward_in_which_the_compiler_ran_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its times and memory peak are the compiler's: one more forward is profiled instead."""
    import flextensor.phases.learning

    # no noise retries
    monkeypatch.setattr(flextensor.phases.learning, "samples_disagree", lambda *args: False)
    case = _llama_case()
    model = offloaded(case, discovery_forwards=1, profiling_forwards=1)
    compiled = torch.compile(model)
    phases = []
    with torch.no_grad():
        for _ in range(3):
            case.run(compiled)
            phases.append(flextensor.phase(model))
    # Forward 1 discovers (eagerly); forward 2 compiles, so it is left out; forward 3 is profiled.
    assert phases == ["profiling", "profiling", "inference"]


@inductor_config.patch(emulate_precision_casts=True)
def test_whole_model_compile_in_bf16_is_bitwise_when_inductor_rounds_as_eager() -> None:
    """At unit boundaries the ops stop inductor fusing one block's last kernel with the next block's
    first; fused, inductor skips a bf16 rounding unless told to emulate eager's casts. With that flag the
    offloaded model compiled whole is bitwise the natively compiled one (docs/compile.md, Known limits)."""
    tokens = llama_inputs()
    case = Case(
        lambda: tiny_llama(layers=3, tie=False, hidden=64).to(torch.bfloat16),
        lambda m: m(tokens).logits,
        "model.layers",
    )
    reference, _ = native_compiled(case, compile_whole)
    model = offloaded(case)
    compiled = torch.compile(model)
    with torch.no_grad():
        outputs = [case.run(compiled) for _ in range(FORWARDS)]
    assert_all_stream(model)
    for output in outputs[2:]:
        assert torch.equal(output, reference)
    assert_no_graph_breaks()


class ReadsWeightData(nn.Module):
    """A block whose forward reads ``weight.data`` (as vLLM's RMSNorm does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.lin.weight.data, self.lin.bias)


def test_a_forward_reading_weight_data_compiles_whole_and_streams_bitwise() -> None:
    """The edit guard on ``.data`` (weights/edits.py) is transparent inside a compiled forward."""
    torch.manual_seed(0)
    model = nn.Sequential(*(ReadsWeightData() for _ in range(4)))
    x = torch.randn(2, 16)
    with torch.no_grad():
        reference = torch.compile(copy.deepcopy(model), fullgraph=True)(x)
    torch._dynamo.reset()
    flextensor.offload(model, streaming_config(model, ["*"]))
    with torch.no_grad():
        for _ in range(FORWARDS):  # fullgraph traces the model's hooks too: plan first (compile.md)
            model(x)
        compiled = torch.compile(model, fullgraph=True)
        outputs = [compiled(x) for _ in range(3)]
    assert_all_stream(model)
    assert all(torch.equal(out, reference) for out in outputs)


@pytest.mark.parametrize("which", CASES)
def test_a_backend_that_copies_the_weights_is_refused(which: str) -> None:
    """aot_eager has no re-inplacing: it runs the pre op on copies of the weights taken before they
    arrive, computes with them and writes them back over other units (NaN on the tiny Wan transformer).
    The first compiled forward raises, naming the backends that work; the model runs eagerly after."""
    case = CASES[which]()
    with torch.no_grad():
        expected = case.run(case.build())
    model = offloaded(case)
    whole = torch.compile(model, backend="aot_eager")
    with torch.no_grad(), pytest.raises(UnsupportedOperationError, match="inductor"):
        for _ in range(FORWARDS):
            case.run(whole)
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(case.run(model), expected)
        assert torch.equal(case.run(torch.compile(model, backend="eager")), expected)  # Dynamo alone


def test_a_refusal_inside_a_larger_compiled_module_ends_its_forward() -> None:
    """The refused pre op is the model's forward's last word: its bracket closes as for any failed
    pre-hook, so the next calls begin forwards of their own (plans switch, pipelines make room)."""
    from flextensor.api import engine_of

    case = _llama_case()
    inner = offloaded(case)
    wrapper = Wrapper(case.build())
    wrapper.inner = inner
    with torch.no_grad():
        for _ in range(FORWARDS):
            wrapper(llama_inputs())
        with pytest.raises(UnsupportedOperationError, match="inductor"):
            torch.compile(wrapper, backend="aot_eager")(llama_inputs())
    engine = engine_of(inner)
    assert engine.bracket.depth == 0 and engine.bracket.owner is None
    forwards = engine.forwards
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(wrapper, backend="eager")(llama_inputs())
    assert engine.forwards == forwards + 1


class FirstWeightEmpty(nn.Module):
    """A block whose first parameter is an empty marker (a common way to find a module's device)."""

    def __init__(self) -> None:
        super().__init__()
        self.marker = nn.Parameter(torch.empty(0), requires_grad=False)
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def test_a_unit_whose_first_weight_is_empty_compiles_whole() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(FirstWeightEmpty() for _ in range(3)))
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = torch.compile(copy.deepcopy(model))(x)
    torch._dynamo.reset()
    flextensor.offload(model, streaming_config(model, ["*"]))
    with torch.no_grad():
        for _ in range(FORWARDS):  # learning, eagerly
            model(x)
        assert flextensor.phase(model) == "inference"
        outputs = [torch.compile(model)(x) for _ in range(3)]
    assert all(torch.equal(o, expected) for o in outputs)
