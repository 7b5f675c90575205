"""The hooks and guards on an offloaded model: the bracketing of each forward (threads, interrupts, a model
calling itself) and the guards on load_state_dict, dtype conversions and backward."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import CPU, LEARN, Stack, assert_all_equal, run_forwards
from flextensor.errors import ConcurrentForwardError, UnsupportedOperationError
from spec_model import make_spec_model, spec_tokens
from streaming import streaming_config


def _forward_in_another_thread(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run one forward of ``model`` on a thread of its own and hand back its output (or its error)."""
    result: list[object] = []

    def run() -> None:
        try:
            with torch.no_grad():
                result.append(model(x))
        except BaseException as exc:
            result.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(30)
    assert result, "the forward in the other thread did not finish"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]  # type: ignore[return-value]


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
        assert flextensor.status(model).forward_running
        with pytest.raises(ConcurrentForwardError):
            model(x)
        with pytest.raises(ConcurrentForwardError):
            model.b(x)  # a unit called directly from the second thread
    finally:
        release_gate.set()
        worker.join(10)
    assert outputs and torch.equal(outputs[0], ref)  # the running forward was not disturbed
    assert not flextensor.status(model).forward_running
    model(torch.randn(1, 4))  # and the first thread's forward left the model usable


@pytest.mark.parametrize("interrupted", [1, 2, 4], ids=["discovery", "profiling", "inference"])
def test_a_forward_interrupted_by_ctrl_c_is_closed_by_the_next_one(interrupted: int) -> None:
    """KeyboardInterrupt is not handed to PyTorch's always_call hooks: the next forward finds the step
    unfinished and closes it, and everything after runs as if the interrupted forward had failed."""
    tokens = spec_tokens()
    ref = run_forwards(make_spec_model(), tokens, 1)[0]
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
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
    assert flextensor.status(model).forward_running  # what the interrupt left behind
    assert_all_equal(run_forwards(model, tokens, LEARN), ref)
    assert not flextensor.status(model).forward_running
    assert torch._C._len_torch_function_stack() == 0  # discovery's read tracker was popped
    assert flextensor.phase(model) == "inference"
    # The interrupted forward's thread no longer owns the model: another thread may run it.
    assert torch.equal(_forward_in_another_thread(model, tokens), ref)


def test_a_discovery_forward_interrupted_by_ctrl_c_leaves_torch_compile_working() -> None:
    """Discovery runs eagerly under Dynamo's process-wide force_eager stance; a forward interrupted there
    never reaches the hook that leaves it, so the next forward does, or every torch.compile in the
    process would silently run eagerly from then on."""
    from torch._dynamo.testing import CompileCounter

    tokens = spec_tokens()
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))

    def ctrl_c(module: nn.Module, args: tuple) -> None:
        raise KeyboardInterrupt

    handle = model.layers[1].register_forward_pre_hook(ctrl_c)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(tokens)
    handle.remove()
    run_forwards(model, tokens, LEARN)
    assert flextensor.phase(model) == "inference"
    counter = CompileCounter()
    torch.compile(lambda x: x * 2 + 1, backend=counter)(torch.ones(3))
    assert counter.frame_count == 1  # compiled, not run eagerly under a leftover stance
    flextensor.release(model)


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
    assert_all_equal(run_forwards(model, x, LEARN), ref)
    status = flextensor.status(model)
    assert status.forwards == LEARN and not status.forward_running  # one step per call, not two
    assert flextensor.phase(model) == "inference"


def test_load_state_dict_while_offloaded_is_refused() -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    with pytest.raises(UnsupportedOperationError, match="release"):
        model.load_state_dict(make_spec_model().state_dict())


def test_dtype_or_device_conversion_while_offloaded_is_refused_until_release() -> None:
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    run_forwards(model, spec_tokens(), 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedOperationError, match="release"):
        model.half()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing converted
    # A move to where everything already is (as a diffusers pipeline's pipe.to(device) does) is fine.
    assert model.to("cpu") is model
    ref = run_forwards(make_spec_model(), spec_tokens(), 1)[0]
    assert_all_equal(run_forwards(model, spec_tokens(), 2), ref)
    flextensor.release(model)
    model.double()  # a plain module again
    assert next(model.parameters()).dtype == torch.float64


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
    assert flextensor.phase(model) == "inference"


class _TiedBlock(nn.Module):
    """Two linear layers sharing one weight: a weight tied within a unit, with a name for each holder."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 16)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class _TiedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_TiedBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_autocast_caches_no_streamed_weight_casts_and_outputs_match_the_cached_native_run() -> None:
    """[Note: autocast's weight cache]: inside an offloaded forward the cache is off (casts of streamed
    weights would pile up on the device for the whole autocast region), on again after it; the outputs
    are the bits of the model without flextensor run with the cache on."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    native = Stack(layers=4, width=64)
    model = Stack(layers=4, width=64)
    seen: list[bool] = []
    model.layers[2].register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_cache_enabled()))
    flextensor.offload(model, streaming_config(model, ["layers.*"]))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(LEARN + 3):  # one region: the native run reuses its cached casts
            expected = native(x)
            assert torch.equal(model(x), expected), f"forward {i}"
            assert torch.is_autocast_cache_enabled()
    assert flextensor.phase(model) == "inference"
    assert seen and not any(seen)
    with torch.no_grad():
        model(x)  # no autocast: nothing to pause
    assert seen[-1] and torch.is_autocast_cache_enabled()


def test_a_forward_interrupted_under_autocast_leaves_a_later_regions_cache_setting_alone() -> None:
    """The interrupted forward's autocast region restored its own cache setting on the way out: closing
    that forward later must not turn the cache on inside a region opened with ``cache_enabled=False``."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    model = Stack(layers=4, width=64)
    flextensor.offload(model, streaming_config(model, ["layers.*"]))
    run_forwards(model, x, LEARN)

    def ctrl_c(module: nn.Module, args: tuple) -> None:
        raise KeyboardInterrupt

    handle = model.layers[1].register_forward_pre_hook(ctrl_c)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(KeyboardInterrupt):
        model(x)
    handle.remove()
    assert flextensor.status(model).forward_running and torch.is_autocast_cache_enabled()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        model(x)
        assert not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()


def test_calling_forward_directly_warns_once_and_outputs_stay_right(caplog: pytest.LogCaptureFixture) -> None:
    """``model.forward(x)`` skips the model's hooks: every unit runs as if called by hand, loaded when it
    runs and learning nothing. Said once; one block called by hand is not that."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = Stack(layers=4, width=64)(x)
    model = Stack(layers=4, width=64)
    flextensor.offload(model, streaming_config(model, ["layers.*"]))
    with torch.no_grad(), caplog.at_level("WARNING", logger="flextensor"):
        model.layers[0](x)  # by hand: no warning
        model.layers[0](x)
        assert "outside a call of the model itself" not in caplog.text
        for _ in range(3):
            assert torch.equal(model.forward(x), expected)
        assert flextensor.phase(model) == "discovery"  # nothing learned
        assert caplog.text.count("every unit of Stack ran outside a call of the model itself") == 1
        assert_all_equal(run_forwards(model, x, LEARN + 1), expected)
        assert flextensor.phase(model) == "inference"


def test_a_weight_tied_within_a_unit_reads_right_under_every_name_and_keeps_its_tie() -> None:
    """state_dict() holds a key for each name of a tied weight: every one is the host copy (found wrong
    before: the last name only, the others read the arena, which held another unit's bytes), one tensor
    for both as in the model's own; load_state_dict through either name is refused; an edit keeps the
    weight's name, and release() keeps the tie."""
    torch.manual_seed(0)
    original = _TiedStack()
    expected = {k: v.clone() for k, v in original.state_dict().items()}
    x = torch.randn(3, 16)
    ref = run_forwards(original, x, 1)[0]
    model = flextensor.offload(original, streaming_config(original, include=["blocks.*"]))
    assert_all_equal(run_forwards(model, x, LEARN + 2), ref)
    assert flextensor.status(model).plan.streamed, "units stream under the tightest budget"
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    for block in range(4):
        first, second = f"blocks.{block}.first.weight", f"blocks.{block}.second.weight"
        assert state[first] is state[second]
    for name in ("blocks.3.first.weight", "blocks.3.second.weight"):
        with pytest.raises(UnsupportedOperationError, match="editing"):
            model.load_state_dict({name: torch.zeros(16, 16)}, strict=False)
    with flextensor.editing(model), torch.no_grad():
        model.blocks[3].second.weight.mul_(2)
    assert "blocks.3.first.weight" in flextensor.offloaded_parameters(model)
    assert torch.equal(model.state_dict()["blocks.3.second.weight"], 2 * expected["blocks.3.first.weight"])
    released = flextensor.release(model)
    assert released.blocks[3].first.weight is released.blocks[3].second.weight
    assert torch.equal(released.blocks[3].first.weight, 2 * expected["blocks.3.first.weight"])
