"""Never a silently wrong output: interrupts, failed releases, odd parameters, copies of the model.

Each test is named for the behaviour it guards; each failed before the fix it came with. Every unit
streams (the tightest budget) wherever that is what makes a wrong output possible.
"""

from __future__ import annotations

import copy
import io
import pickle
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import Stack
from flextensor.errors import (
    ConfigError,
    SelectionError,
    UnsupportedModelError,
    UnsupportedOperationError,
)
from flextensor.store import device_store as slots
from spec_model import make_spec_model, spec_tokens
from streaming import streaming_config


def _steady(model: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(6):
            out = model(*inputs)
    assert flextensor.phase(model) == "inference"
    return out


# -- interrupts -----------------------------------------------------------------------------------------


def _interrupted_forward(model: nn.Module, x: torch.Tensor, delay_s: float) -> bool:
    """Run a forward with a real SIGALRM raising KeyboardInterrupt after ``delay_s``; True if it hit."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    grad = torch.is_grad_enabled()  # a signal inside no_grad's own __enter__/__exit__ can leave it off
    try:
        signal.setitimer(signal.ITIMER_REAL, delay_s)
        try:
            with torch.no_grad():
                model(x)
            hit = False
        except KeyboardInterrupt:
            hit = True
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:  # landed between the forward's end and the timer's cancel
        hit = True
    finally:
        signal.signal(signal.SIGALRM, previous)
        torch.set_grad_enabled(grad)
    return hit


def test_a_profiling_forward_interrupted_before_a_units_end_event_is_recorded_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C in a unit's post-hook between creating its end event and recording it (found by the sweep
    below): the next forward closed the interrupted one by reading that event and raised PlanError."""
    from flextensor.phases.profiling import StepProfiler

    x = torch.randn(4, 256)
    with torch.no_grad():
        ref = Stack()(x)
    model = Stack()
    flextensor.offload(model, streaming_config(model, ["layers.*"]))
    with torch.no_grad():
        model(x)  # discovery; the next forward profiles
        assert flextensor.phase(model) == "profiling"
    real_unit_end = StepProfiler.unit_end

    def interrupted(self, unit: str) -> None:
        call = self._open.pop(unit)
        call.end = self.runtime.event(timing=True)  # created, never recorded
        raise KeyboardInterrupt

    monkeypatch.setattr(StepProfiler, "unit_end", interrupted)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(x)
    monkeypatch.setattr(StepProfiler, "unit_end", real_unit_end)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(x), ref)
    assert flextensor.phase(model) == "inference"


def test_any_forward_after_a_real_interrupt_anywhere_is_bitwise_right() -> None:
    """A seeded sweep of real signals over whole forwards, in every phase: the next forward is right.

    Ctrl-C during a copy used to leave the units it overwrote marked as holding their weights (25 of
    120 next forwards wrong); now a copy's cells are unowned until the copy and its event are issued.
    """
    x = torch.randn(4, 256)
    with torch.no_grad():
        ref = Stack()(x)
    rng = random.Random(0)
    model = Stack()
    flextensor.offload(model, streaming_config(model, ["layers.*"]))
    import time

    with torch.no_grad():
        for _ in range(4):
            model(x)
        start = time.perf_counter()
        model(x)  # a steady forward: aim the signals inside one
        span = time.perf_counter() - start
    hits = 0
    for trial in range(60):
        if trial == 30:  # the second half starts from scratch: interrupts during learning too
            flextensor.release(model)
            model = Stack()
            flextensor.offload(model, streaming_config(model, ["layers.*"]))
        hits += _interrupted_forward(model, x, rng.uniform(0.0, span) + 1e-6)
        with torch.no_grad():
            assert torch.equal(model(x), ref), f"trial {trial}: the forward after the interrupt is wrong"
    assert hits >= 20  # the sweep really interrupted forwards


# -- release ------------------------------------------------------------------------------------------


def test_release_to_a_device_that_does_not_exist_changes_nothing() -> None:
    model = make_spec_model()
    flextensor.offload(model, streaming_config(model))
    ref = _steady(model, spec_tokens())
    with pytest.raises(ConfigError, match="CUDA is not available"):
        flextensor.release(model, "cuda:7")
    assert flextensor.phase(model) == "inference"  # still offloaded, and still right
    with torch.no_grad():
        assert torch.equal(model(spec_tokens()), ref)
    flextensor.release(model, "cpu")
    with torch.no_grad():
        assert torch.equal(model(spec_tokens()), ref)


def test_a_release_that_fails_part_way_leaves_a_working_model_and_a_second_release_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = make_spec_model()
    flextensor.offload(model, streaming_config(model))
    ref = _steady(model, spec_tokens())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = {"n": 0}
    real = slots.release_copy

    def out_of_memory_on_the_fifth(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 5:
            raise torch.OutOfMemoryError("injected")
        return real(tensor, device)

    monkeypatch.setattr(slots, "release_copy", out_of_memory_on_the_fifth)
    with pytest.raises(torch.OutOfMemoryError):
        flextensor.release(model)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(model(spec_tokens()), ref)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    flextensor.release(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(model(spec_tokens()), ref)


# -- parameters of unusual kinds ----------------------------------------------------------------------


class OutputNestsAWeightView(nn.Module):
    class Block(nn.Linear):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            return super().forward(x), [self.weight[0]]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(OutputNestsAWeightView.Block(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = []
        for block in self.blocks:
            x, (row,) = block(x)
            rows.append(row)
        return x + sum(rows)


def test_an_output_nesting_a_view_of_its_weights_keeps_its_unit_resident() -> None:
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = OutputNestsAWeightView()(x)
    model = OutputNestsAWeightView()
    flextensor.offload(model, streaming_config(model, ["blocks.*"]))
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(model(x), ref)
    assert {"blocks.0.weight", "blocks.2.weight"} <= set(flextensor.resident_parameters(model))


class Transposed(nn.Module):
    """Weights stored transposed, as some checkpoints are: strides that are not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(64, 32) for _ in range(3))
        for layer in self.layers:
            layer.weight = nn.Parameter(torch.randn(64, 32).t())  # (32, 64) with strides (1, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))[:, :32].repeat(1, 2)
        return x


def test_non_contiguous_parameters_keep_their_strides_and_outputs_stay_bitwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref = Transposed()(x)
    strides = [layer.weight.stride() for layer in Transposed().layers]
    assert strides[0] == (1, 32)
    model = Transposed()
    flextensor.offload(model, streaming_config(model, ["layers.*"]))
    assert torch.equal(_steady(model, x), ref)
    assert [layer.weight.stride() for layer in model.layers] == strides  # as the kernels see them
    flextensor.release(model)
    assert [layer.weight.stride() for layer in model.layers] == strides
    with torch.no_grad():
        assert torch.equal(model(x), ref)

    # And a failed offload gives them back as they were.
    other = Transposed()
    monkeypatch.setattr(flextensor.api, "mark_offloaded", lambda m: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        flextensor.offload(other, streaming_config(other, ["layers.*"]))
    assert [layer.weight.stride() for layer in other.layers] == strides


class Counts(nn.Module):
    """A block that keeps a running count as a parameter and uses it: updated in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls.add_(1)
        return self.linear(x) * self.calls


class CountingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Counts() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_unit_that_updates_its_own_parameter_keeps_every_update() -> None:
    x = torch.randn(2, 8)
    plain, model = CountingModel(), CountingModel()
    flextensor.offload(model, streaming_config(model, ["blocks.*"]))
    with torch.no_grad():
        for step in range(6):
            assert torch.equal(model(x), plain(x)), f"forward {step}"
    assert "blocks.0.calls" in flextensor.resident_parameters(model)
    assert float(model.blocks[0].calls) == 6.0


def test_state_dict_of_a_unit_mixing_dtypes_saves_with_torch_save() -> None:
    model = make_spec_model()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.q.to(torch.bfloat16)  # bf16 weights beside fp32 norms in one unit
    flextensor.offload(model, flextensor.OffloadConfig(include_patterns=["layers.*"], device="cpu"))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in expected.items())


# -- copies of the model, tracing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "copier",
    [copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())],
    ids=["deepcopy", "pickle", "torch.save"],
)
def test_copying_an_offloaded_model_says_what_to_do_instead(copier: object) -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(device="cpu"))
    with pytest.raises(UnsupportedOperationError, match=r"state_dict\(\).*release"):
        copier(model)  # type: ignore[operator]
    flextensor.release(model)
    copier(model)  # type: ignore[operator]


def test_jit_trace_of_an_offloaded_model_is_refused_and_the_model_still_works() -> None:
    model = make_spec_model()
    flextensor.offload(model, streaming_config(model))
    ref = _steady(model, spec_tokens())
    with pytest.raises(UnsupportedOperationError, match=r"torch\.compile"):
        torch.jit.trace(model, spec_tokens())
    with torch.no_grad():
        assert torch.equal(model(spec_tokens()), ref)


class ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> None:
        for block in self.blocks:
            x = block(x)
        self.seen.append(x)


def test_a_model_returning_none_inside_an_except_block_reaches_steady_state() -> None:
    model = ReturnsNone()
    flextensor.offload(model, streaming_config(model, ["blocks.*"]))
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(4):
            try:
                raise ValueError("the caller's retry logic")
            except ValueError:
                model(x)
    assert flextensor.phase(model) == "inference"
    assert all(torch.equal(t, model.seen[0]) for t in model.seen)


# -- clear errors ---------------------------------------------------------------------------------------


def test_sparse_parameters_are_refused_naming_them() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = nn.Parameter(torch.eye(4).to_sparse())
    with pytest.raises(UnsupportedModelError, match=r"'1.weight' is torch.sparse_coo.*exclude_patterns"):
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu"))
    assert not hasattr(model, "_flextensor_engine")


def test_offloading_a_submodule_of_an_offloaded_model_is_refused_as_such() -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(device="cpu"))
    with pytest.raises(UnsupportedModelError, match=r"already offloads; release that model first"):
        flextensor.offload(model.layers[0], flextensor.OffloadConfig(device="cpu"))
    flextensor.release(model)
    flextensor.offload(model.layers[0], flextensor.OffloadConfig(device="cpu"))  # fine once released


def test_a_model_under_accelerate_offloading_is_told_to_remove_its_hooks() -> None:
    accelerate = pytest.importorskip("accelerate")
    model = make_spec_model()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match="remove_hook_from_module"):
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu"))


def test_selection_errors_never_suggest_the_pattern_that_failed() -> None:
    model = make_spec_model()
    with pytest.raises(SelectionError) as info:
        flextensor.offload(
            model, flextensor.OffloadConfig(include_patterns=["layers.*"], exclude_patterns=["*"])
        )
    assert "try include_patterns=['layers.*']" not in str(info.value)
    assert "loosen exclude_patterns" in str(info.value)

    class NoParameters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU()

    with pytest.raises(SelectionError, match="has no parameters, so there is nothing to offload"):
        flextensor.offload(NoParameters(), flextensor.OffloadConfig(device="cpu"))


def test_a_shared_segment_over_the_file_size_limit_is_a_clear_error(tmp_path: object) -> None:
    script = textwrap.dedent(
        """
        import resource, torch, flextensor
        from flextensor.host.shared import store as shared_store
        shared_store.SHM_DIR = sys.argv[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        try:
            flextensor.offload(model, flextensor.OffloadConfig(device="cpu", share_host_memory=True))
        except flextensor.SharedMemoryError as e:
            print("refused:", e)
        """
    )
    import os
    import uuid

    shm = f"/dev/shm/ft-test-{uuid.uuid4().hex[:12]}"
    os.mkdir(shm)
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import sys\n" + script, shm], capture_output=True, text=True, timeout=120
        )
        assert "refused:" in out.stdout and "ulimit -f" in out.stdout, out.stdout + out.stderr
    finally:
        for name in os.listdir(shm):
            os.unlink(os.path.join(shm, name))
        os.rmdir(shm)
