"""The public verbs end to end on the CPU engine: offload, release, the introspection calls and status."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import flextensor
import flextensor.api
import flextensor.weights.packing
from engine_helpers import (
    CPU,
    LEARN,
    assert_packs_dropped,
    offload_with_placements,
    run_forwards,
)
from flextensor.errors import AlreadyOffloadedError, NotOffloadedError, SelectionError
from flextensor.hooks.functions import input_signature
from spec_model import make_spec_model, spec_tokens
from streaming import streaming_config


def _no_hooks_left(model: nn.Module) -> bool:
    return not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


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


def test_fqcn_class_pattern_keeps_user_linear_streamed() -> None:
    model = flextensor.offload(
        make_spec_model(),
        flextensor.OffloadConfig(
            include_patterns=["layers.*"], exclude_patterns=["class:torch.nn.*.Linear"], **CPU
        ),
    )
    assert "layers.0.proj.weight" in flextensor.offloaded_parameters(model)  # the user's own Linear


def test_introspection_on_plain_model_says_offload_first() -> None:
    plain = make_spec_model()
    for call in (flextensor.offload_units, flextensor.status, flextensor.phase, flextensor.api.engine_of):
        with pytest.raises(NotOffloadedError, match="offload"):
            call(plain)


def test_status_describes_units_plans_and_bytes_consistently() -> None:
    model = make_spec_model()
    model = flextensor.offload(model, streaming_config(model))
    status = flextensor.status(model)
    assert status.phase == "discovery" and status.forwards == 0 and not status.forward_running
    assert status.plan is None and status.plans == {} and status.input_signature is None
    assert [u.name for u in status.units] == flextensor.offload_units(model)
    assert all(u.placement == "streamed" and u.host_bytes >= u.nbytes for u in status.units)
    with pytest.raises(SelectionError, match="'nope' is not an offload unit"):
        status.unit("nope")

    tokens = spec_tokens()
    run_forwards(model, tokens, LEARN)
    status = flextensor.status(model)
    signature = input_signature((tokens,), {})
    assert status.phase == "inference" and status.forwards == LEARN
    assert status.input_signature == signature and list(status.plans) == [signature]
    assert status.plan is status.plans[signature]
    assert set(status.streamed) == set(status.plan.streamed)
    assert set(status.resident) == set(status.plan.resident)
    assert status.host_bytes_held == sum(u.host_bytes for u in status.units)
    resident = sum(status.unit(u).nbytes for u in status.resident)
    assert status.device_bytes_held == status.arena_bytes + resident
    assert status.layouts >= 2  # discovery's, then the plan's


def test_offload_twice_says_release_first() -> None:
    model = flextensor.offload(make_spec_model(), flextensor.OffloadConfig(**CPU))
    with pytest.raises(AlreadyOffloadedError, match="release"):
        flextensor.offload(model, flextensor.OffloadConfig(**CPU))


def test_selecting_nothing_raises_and_leaves_model_alone() -> None:
    model = make_spec_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning), pytest.raises(SelectionError):
        flextensor.offload(model, flextensor.OffloadConfig(include_patterns=["nope.*"], **CPU))
    with pytest.raises(NotOffloadedError):
        flextensor.status(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_failure_inside_offload_leaves_model_exactly_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_spec_model()
    before = {k: (v.clone(), v.device, v.dtype) for k, v in model.state_dict().items()}
    params_before = dict(model.named_parameters())
    real_pack = flextensor.weights.packing.pack_unit
    calls = {"n": 0}

    def failing_pack(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated failure while packing")
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(flextensor.weights.packing, "pack_unit", failing_pack)
    with pytest.raises(RuntimeError, match="simulated"):
        flextensor.offload(model, flextensor.OffloadConfig(**CPU))
    assert calls["n"] == 3
    assert dict(model.named_parameters()) == params_before  # same Parameter objects
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k][0]) and v.device == before[k][1] and v.dtype == before[k][2]
    assert _no_hooks_left(model)
    with pytest.raises(NotOffloadedError):
        flextensor.status(model)
    monkeypatch.undo()
    flextensor.offload(model, flextensor.OffloadConfig(**CPU))  # nothing was left marked as offloaded


def test_meta_parameters_are_refused_clearly() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(flextensor.FlexTensorError, match="meta"):
        flextensor.offload(model, flextensor.OffloadConfig(**CPU))


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
    assert _no_hooks_left(model)
    with pytest.raises(NotOffloadedError):
        flextensor.phase(model)
    flextensor.offload(model, flextensor.OffloadConfig(**CPU))  # and it can be offloaded again
    assert torch.equal(
        run_forwards(model, spec_tokens(), 1)[0], run_forwards(make_spec_model(), spec_tokens(), 1)[0]
    )


@pytest.mark.parametrize("device", [None, "cpu"])
def test_release_after_packs_were_dropped_returns_the_original_weights(device: str | None) -> None:
    before = copy.deepcopy(make_spec_model().state_dict())
    placements = {8: ("embed", "layers.0", "lm_head")}
    model, tokens, refs = offload_with_placements(placements, tight=False)
    engine = flextensor.api.engine_of(model)
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    assert_packs_dropped(model, placements[8])
    during = model.state_dict()  # resident units' parameters from their storage, the others' packs
    assert list(during) == list(before) and all(torch.equal(during[k], v) for k, v in before.items())
    flextensor.release(model, device)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) and after[k].device.type == "cpu" for k, v in before.items())
    # Each parameter has storage of its own again, not a view of a unit's storage.
    pointers = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(pointers)) == len(pointers)
    # The released engine holds nothing: no pack, no storage, no arena.
    left = engine.status()
    assert left.host_bytes_held == 0 and left.device_bytes_held == 0 and left.arena_bytes == 0
    assert all(u.placement == "host" and u.host_bytes == 0 for u in left.units)
    assert _no_hooks_left(model)
    assert torch.equal(run_forwards(model, tokens[8], 1)[0], refs[8])


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_release_interrupted_after_a_pack_was_freed_is_finished_by_the_next(
    monkeypatch: pytest.MonkeyPatch, device: str | None
) -> None:
    """Ctrl-C in release() after the parameters got their own copies, while the packs are freed: the
    model computes and saves right already, and a second release() finishes (it used to rebuild the
    copies from the packs already freed: "unit 'layers.0' lost its weights")."""
    from flextensor.host.packs import UnitPack

    before = copy.deepcopy(make_spec_model().state_dict())
    placements = {8: ("embed", "layers.0", "lm_head")}  # resident units (packs dropped) and streamed ones
    model, tokens, refs = offload_with_placements(placements, tight=False)
    with torch.no_grad():
        assert torch.equal(model(tokens[8]), refs[8])
    real_free, freed = UnitPack.free, []

    def free_then_interrupt(pack: UnitPack) -> None:
        real_free(pack)
        freed.append(pack.unit)
        if len(freed) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(UnitPack, "free", free_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        flextensor.release(model, device)
    assert len(freed) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    flextensor.release(model, device)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) and after[k].device.type == "cpu" for k, v in before.items())
    assert _no_hooks_left(model)
    with pytest.raises(NotOffloadedError):
        flextensor.phase(model)
    assert torch.equal(run_forwards(model, tokens[8], 1)[0], refs[8])


def test_offload_from_a_profile_rolls_back_after_the_plan_dropped_packs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "spec.json"
    placements = {8: ("embed", "layers.0", "lm_head")}
    model, _, _ = offload_with_placements(placements, tight=False)
    flextensor.save_profile(model, path)

    other = make_spec_model()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    params_before = dict(other.named_parameters())
    seen: list[str] = []

    def failing_mark(model: nn.Module) -> None:  # the last step of offload(), after the saved plan
        assert_packs_dropped(model, placements[8])  # the saved plan is in place
        seen.append(flextensor.status(model).phase)
        raise RuntimeError("simulated failure after the plan")

    monkeypatch.setattr(flextensor.api, "mark_offloaded", failing_mark)
    with pytest.raises(RuntimeError, match="simulated"):
        flextensor.offload(other, flextensor.OffloadConfig(profile=path, **CPU))
    assert seen == ["inference"]
    assert dict(other.named_parameters()) == params_before
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    assert _no_hooks_left(other)
    with pytest.raises(NotOffloadedError):
        flextensor.status(other)


@pytest.mark.parametrize("host_budget", [False, True], ids=["pinned", "staged"])
def test_a_released_model_is_freed_as_soon_as_its_last_reference_goes(host_budget: bool) -> None:
    """No reference cycle keeps a released model (and, on a GPU, whatever it was moved to) alive until the
    garbage collector happens to run: the next model's memory would otherwise count both."""
    import gc
    import weakref

    from real_models import llama_inputs, tiny_llama
    from test_host_budget import LAYERS, budget_for

    model = tiny_llama(layers=4)
    fields = {"host_memory_budget": budget_for(model, pinned_units=1)} if host_budget else {}
    flextensor.offload(model, streaming_config(model, LAYERS, **fields))
    run_forwards(model, llama_inputs(), LEARN + 2)
    engine = weakref.ref(flextensor.api.engine_of(model))
    store = weakref.ref(flextensor.api.engine_of(model).store)
    streamed = weakref.ref(model.model.layers[1].mlp.up_proj.weight)
    model.state_dict()
    flextensor.release(model)
    released = weakref.ref(model)
    gc.disable()
    try:
        del model
        # The store and the weights its units name too: the store was kept by a cycle with its nested
        # calls' helper, and with it every streamed weight release() had handed back (on a GPU, 240 MiB
        # that the next test's budget counted).
        assert released() is None and engine() is None
        assert store() is None and streamed() is None
    finally:
        gc.enable()
