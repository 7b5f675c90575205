"""``flextensor.editing`` within the memory the model may use (see [Note: editing within the budget] in
engine/edit_session.py): a streamed unit gets device copies only when used, the working set stays within its
limit by writing units back to their packs, and nothing an edit wrote is lost on the way.

Every model runs under the tightest budget (every unit streams): its layout leaves no room for a unit, so
the block gives it back and the working set has the budget, two layers here, and a merge over all layers
must write units back as it goes. Outputs are compared
bitwise with the same edit on the model without offload.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import flextensor
from engine_helpers import LEARN, install_placement, run_forwards
from flextensor.api import engine_of
from flextensor.engine.edit_session import EditSession, WorkingSet
from flextensor.hooks.functions import input_signature
from real_models import llama_inputs, tiny_llama
from streaming import streaming_config

peft = pytest.importorskip("peft")


def offloaded_llama(layers: int = 4, **fields: object) -> torch.nn.Module:
    model = tiny_llama(layers=layers, tie=False)
    flextensor.offload(model, streaming_config(model, **fields))
    run_forwards(model, llama_inputs(), LEARN)
    assert flextensor.status(model).phase == "inference" and not flextensor.status(model).resident
    return model


@contextmanager
def editing_with_working_set(model: torch.nn.Module) -> Iterator[WorkingSet]:
    with flextensor.editing(model):
        session = engine_of(model).editing
        assert session is not None
        yield session.working_set


def largest_unit_bytes(model: torch.nn.Module) -> int:
    return max(u.nbytes for u in engine_of(model).units.values())


def assert_edits_alike(edit: Callable[[torch.nn.Module], None], model: torch.nn.Module | None = None) -> None:
    """``edit`` on the model without offload and inside editing on ``model`` (offloaded, every unit
    streamed): the forwards after it are bitwise alike."""
    x = llama_inputs()
    native, model = tiny_llama(layers=4, tie=False), model if model is not None else offloaded_llama()
    with torch.no_grad():
        edit(native)
        with flextensor.editing(model):
            edit(model)
    expected = run_forwards(native, x, 1)[0]
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))


def lora_config() -> object:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)


def test_a_merge_over_every_layer_holds_at_most_its_working_set_and_matches_the_plain_model() -> None:
    x = llama_inputs()
    native = tiny_llama(layers=4, tie=False)
    torch.manual_seed(5)
    native_peft = peft.get_peft_model(native, lora_config())
    native_peft.merge_adapter()
    expected = run_forwards(native_peft, x, 1)[0]
    model = offloaded_llama()
    torch.manual_seed(5)
    peft_model = peft.get_peft_model(model, lora_config())
    engine = engine_of(model)
    with editing_with_working_set(model) as working_set:
        # The plan fills the budget, leaving no room for a unit: the layout was given back for the edit.
        assert engine.store.device_bytes_held() == 0 and not engine.laid_out
        peft_model.merge_adapter()
    assert working_set.limit_bytes == engine.policy.memory_limit()  # the whole budget
    assert working_set.peak_bytes <= working_set.limit_bytes
    assert working_set.written_back >= 2  # four layers through a set of two
    assert all(torch.equal(out, expected) for out in run_forwards(peft_model, x, 3))


def test_reading_shapes_dtypes_and_devices_gives_no_unit_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    model = offloaded_llama()
    engine = engine_of(model)
    held = engine.store.device_bytes_held()
    room = held + 2 * largest_unit_bytes(model)  # a device with room for units beside the layout
    monkeypatch.setattr(engine.policy, "memory_limit", lambda: room)
    with editing_with_working_set(model) as working_set:
        assert engine.laid_out and engine.store.device_bytes_held() == held  # the layout stays
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        shapes = {p.shape for p in model.parameters()} | {p.dtype for p in model.parameters()}
        devices = {p.device for p in model.parameters()}
        assert not working_set.live
    assert total > 0 and shapes and devices == {torch.device("cpu")}
    assert working_set.peak_bytes == 0


@torch.no_grad()
def test_a_view_held_across_other_layers_keeps_its_unit_and_its_write_is_not_lost() -> None:
    """``w = p.data`` taken first, every other layer edited, then a write through ``w``: the unit stays
    (its storage has a holder outside), so the write reaches the pack."""

    def edit(m: torch.nn.Module) -> None:
        held = m.model.layers[0].mlp.up_proj.weight.data
        for layer in m.model.layers[1:]:
            layer.mlp.down_proj.weight.mul_(0.5)
        held.mul_(3)

    assert_edits_alike(edit)


@torch.no_grad()
def test_a_unit_written_back_and_used_again_keeps_its_first_edit() -> None:
    def edit(m: torch.nn.Module) -> None:
        for _ in range(2):  # the second pass reads layer 0 back from its edited pack
            for layer in m.model.layers:
                layer.self_attn.q_proj.weight.add_(0.25)

    assert_edits_alike(edit)


def test_load_state_dict_within_the_working_set() -> None:
    x = llama_inputs()
    other = tiny_llama(layers=4, tie=False, seed=3)
    expected = run_forwards(other, x, 1)[0]
    model = offloaded_llama()
    with editing_with_working_set(model) as working_set:
        model.load_state_dict(other.state_dict())
    assert working_set.peak_bytes <= working_set.limit_bytes and working_set.written_back >= 2
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))


@torch.no_grad()
def test_out_of_memory_while_copying_a_unit_in_writes_the_others_back_and_tries_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = llama_inputs()
    native = tiny_llama(layers=4, tie=False)
    model = offloaded_llama()
    give = EditSession.give_copies
    failed: list[int] = []

    def give_copies(session: EditSession, unit: object) -> None:
        if session.working_set.live and not failed:
            failed.append(len(session.working_set.live))
            raise torch.OutOfMemoryError("no room")
        give(session, unit)  # type: ignore[arg-type]

    monkeypatch.setattr(EditSession, "give_copies", give_copies)
    # no limit: the first unit is still held when the second is copied in
    monkeypatch.setattr("flextensor.weights.edits.working_set_for", lambda engines: WorkingSet(None))
    for m in (native, model):
        with editing_with_working_set(m) if m is model else torch.no_grad() as working_set:
            m.model.layers[0].mlp.up_proj.weight.mul_(2)
            m.model.layers[1].mlp.up_proj.weight.mul_(3)
    assert failed == [1] and working_set.written_back == 1
    expected = run_forwards(native, x, 1)[0]
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))


@torch.no_grad()
def test_only_the_units_an_edit_used_leave_the_shared_segment(shm: Path) -> None:
    def edit(m: torch.nn.Module) -> None:
        m.model.layers[2].mlp.up_proj.weight.mul_(2)
        m.model.layers[3].mlp.up_proj.weight.sum()  # used, not changed

    model = offloaded_llama(share_host_memory=True)
    units = engine_of(model).units
    assert all(u.pack is not None and u.pack.shared for u in units.values())
    assert_edits_alike(edit, model)
    private = sorted(name for name, u in units.items() if not u.pack.shared)  # type: ignore[union-attr]
    assert private == ["model.layers.2"]
    flextensor.release(model)


@torch.no_grad()
def test_a_write_from_another_thread_inside_editing_is_refused_at_the_end_not_lost_silently() -> None:
    """The first-use mode is per thread: a write from another thread lands in the arena unseen. The end
    of the block finds its version counter moved, raises, and the model keeps its unedited weights."""
    x = llama_inputs()
    expected = run_forwards(tiny_llama(layers=4, tie=False), x, 1)[0]
    model = offloaded_llama()

    def write() -> None:
        with torch.no_grad():  # per thread, as the first-use mode is
            model.model.layers[1].mlp.up_proj.weight.mul_(2)

    writer = threading.Thread(target=write)
    refused = pytest.raises(flextensor.UnsupportedOperationError, match=r"model\.layers\.1.*another thread")
    with refused, flextensor.editing(model):
        writer.start()
        writer.join()
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))


def _foreach_mul(m: torch.nn.Module) -> None:
    torch._foreach_mul_([layer.mlp.up_proj.weight for layer in m.model.layers], 2.0)


def _stacked_read(m: torch.nn.Module) -> None:
    m.lm_head.weight.add_(torch.stack([layer.mlp.up_proj.weight for layer in m.model.layers]).mean())


def _sgd_foreach(m: torch.nn.Module) -> None:
    weights = [layer.mlp.up_proj.weight for layer in m.model.layers]
    for w in weights:
        w.grad = torch.ones_like(w)
    torch.optim.SGD(weights, lr=0.1, foreach=True).step()
    for w in weights:
        w.grad = None


@pytest.mark.parametrize("edit", [_foreach_mul, _stacked_read, _sgd_foreach], ids=lambda f: f.__name__)
@torch.no_grad()
def test_one_call_over_more_units_than_the_working_set_sees_them_all(edit: object) -> None:
    """Found by review: making room for a call's later weights wrote back its earlier ones before it ran."""
    assert_edits_alike(edit)  # type: ignore[arg-type]


@torch.no_grad()
def test_an_unseen_write_to_a_unit_used_later_in_the_block_is_refused_not_lost() -> None:
    """Found by review: the unit's copies came from its unedited pack and the end saw nothing."""
    model = offloaded_llama()
    weight = model.model.layers[1].mlp.up_proj.weight
    refused = pytest.raises(flextensor.UnsupportedOperationError, match=r"model\.layers\.1.*could not see")
    with refused, flextensor.editing(model):
        with torch._C.DisableTorchFunction():
            weight.mul_(2)
        weight.sum()


@torch.no_grad()
def test_a_held_storage_object_keeps_its_unit() -> None:
    """Found by review: a Python storage object held outside did not count as a holder."""

    def edit(m: torch.nn.Module) -> None:
        storage = m.model.layers[0].mlp.up_proj.weight.untyped_storage()
        for layer in m.model.layers[1:]:
            layer.mlp.down_proj.weight.mul_(0.5)
        torch.empty(0).set_(storage).add_(1.0)

    assert_edits_alike(edit)


def test_editing_refused_inside_a_forward_gives_no_layout_back() -> None:
    """The refusals come before the layout is given back for the block: a forward that tries to open
    one keeps running on its layout, and its output is the plain model's."""
    x = llama_inputs()
    expected = run_forwards(tiny_llama(layers=4, tie=False), x, 1)[0]
    model = offloaded_llama()
    engine = engine_of(model)
    refusals: list[Exception] = []

    def try_editing(*_: object) -> None:
        try:
            with flextensor.editing(model):
                pass
        except flextensor.UnsupportedOperationError as exc:
            refusals.append(exc)
        assert engine.laid_out

    handle = model.model.layers[1].register_forward_hook(try_editing)
    assert torch.equal(run_forwards(model, x, 1)[0], expected)
    handle.remove()
    assert len(refusals) == 1 and "inside a forward" in str(refusals[0])


def test_resident_units_keep_their_storage_when_the_block_gives_the_arena_back() -> None:
    """A plan with resident units that fills the budget: the block gives only the arena back. A resident
    unit carries no hooks in steady state, so a caller that calls it directly right after the block
    (``model(inputs_embeds=model.get_input_embeddings()(ids))``) must find its weights in place."""
    x = llama_inputs()
    native = tiny_llama(layers=4, tie=False)
    with torch.no_grad():
        expected = native(inputs_embeds=native.get_input_embeddings()(x)).logits
    model = tiny_llama(layers=4, tie=False)
    flextensor.offload(model, streaming_config(model))
    run_forwards(model, x, LEARN)
    install_placement(model, input_signature((x,), {}), ["model.embed_tokens", "model.norm", "lm_head"])
    run_forwards(model, x, 1)
    engine = engine_of(model)
    resident = engine.store.device_bytes_held() - engine.store.arena_bytes()
    with editing_with_working_set(model) as working_set:
        assert not engine.laid_out and engine.store.device_bytes_held() == resident
    assert working_set.limit_bytes == engine.policy.memory_limit() - resident  # type: ignore[operator]
    with torch.no_grad():
        out = model(inputs_embeds=model.get_input_embeddings()(x)).logits
    assert torch.equal(out, expected)


def test_an_edit_of_a_compressed_resident_unit_is_kept(fast_decoder: None) -> None:
    """bf16 layers compressed at offload and resident in the plan hold no pack (their storage is the only
    copy, so compression does not refuse the block): the edit goes to that storage, never to a pack
    re-encoded for a layout given back (a coded pack's view is a decoded copy: a write there is lost)."""

    class CastLinear(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(super().forward(x.to(self.weight.dtype))).float()

    def mixed() -> torch.nn.Module:  # two bf16 layers (compressible), two fp32 ones (not)
        torch.manual_seed(0)
        layers = [CastLinear(64, 64) for _ in range(4)]
        layers[0].to(torch.bfloat16)
        layers[1].to(torch.bfloat16)
        return torch.nn.Sequential(*layers)

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    native, model = mixed(), mixed()
    with torch.no_grad():
        native[0].weight.mul_(2)
    expected = run_forwards(native, x, 1)[0]
    layer = sum(p.numel() * p.element_size() for p in model[0].parameters())
    config = streaming_config(model, compression="lossless")
    config = config.model_copy(update={"gpu_memory_budget": config.gpu_memory_budget + 2 * layer + 2 * 4096})
    flextensor.offload(model, config)
    run_forwards(model, x, LEARN)
    install_placement(model, input_signature((x,), {}), ["0", "1"])
    run_forwards(model, x, 1)
    assert all(engine_of(model).units[name].pack is None for name in ("0", "1"))
    with flextensor.editing(model), torch.no_grad():
        model[0].weight.mul_(2)
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))


def test_an_edit_made_before_the_block_is_refused_by_it_not_taken_as_the_weights() -> None:
    """``weight.mul_()`` between forwards wrote into the shared arena; the next forward refuses it, and so
    does an editing block opened first: it would otherwise take those bytes as the unit's weights (or
    accept the counters and drop the edit silently)."""
    x = llama_inputs()
    expected = run_forwards(tiny_llama(layers=4, tie=False), x, 1)[0]
    model = offloaded_llama()
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight.mul_(2)
    refused = pytest.raises(flextensor.UnsupportedOperationError, match=r"changed in place outside")
    with refused, flextensor.editing(model):
        pass
    assert engine_of(model).editing is None
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 2))  # discarded, as said
