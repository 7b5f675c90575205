"""Changing an offloaded model's weights after offload(): peft and diffusers LoRA workflows on real classes,
``flextensor.editing(model)``, and edits made without it (see [Note: editing streamed weights]).

Every comparison is bitwise against the same sequence on the model without offload, under the tightest
budget (every unit streams), so an edit that lands in another unit's weights or is lost at a reload shows.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import flextensor
from engine_helpers import LEARN, run_forwards
from real_models import llama_inputs, tiny_llama, tiny_wan, wan_inputs
from streaming import streaming_config

peft = pytest.importorskip("peft")


def lora_config(targets: tuple[str, ...] = ("q_proj", "v_proj")) -> object:
    # init_lora_weights=False: random B, so an adapter changes the outputs (a merge that is lost shows)
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)


def offloaded_llama() -> torch.nn.Module:
    model = tiny_llama()
    return flextensor.offload(model, streaming_config(model))


def editing_if(offloaded: bool, model: torch.nn.Module) -> object:
    return flextensor.editing(model) if offloaded else torch.no_grad()


def assert_streams_everything(model: torch.nn.Module) -> None:
    status = flextensor.status(model)
    assert status.phase == "inference" and not status.resident and status.streamed


# -- peft on a transformers Llama --------------------------------------------------------------------------


def peft_merge_sequence(model: torch.nn.Module, offloaded: bool) -> list[torch.Tensor]:
    """Two adapters, switched, merged, unmerged: the outputs after each step."""
    x = llama_inputs()
    torch.manual_seed(5)
    peft_model = peft.get_peft_model(model, lora_config(), adapter_name="first")
    peft_model.add_adapter("second", lora_config(("k_proj", "o_proj")))
    outs = [run_forwards(peft_model, x, LEARN + 1)[-1]]
    if offloaded:
        assert_streams_everything(model)
    peft_model.set_adapter("second")
    outs.append(run_forwards(peft_model, x, 2)[-1])
    with editing_if(offloaded, model):
        peft_model.merge_adapter()
    outs.append(run_forwards(peft_model, x, 3)[-1])
    with editing_if(offloaded, peft_model):  # the PeftModel wrapper stands for the model it wraps
        peft_model.unmerge_adapter()
    peft_model.set_adapter("first")
    outs.append(run_forwards(peft_model, x, 3)[-1])
    return outs


def test_peft_adapters_merged_and_unmerged_in_editing_give_the_outputs_of_the_model_without_offload() -> None:
    expected = peft_merge_sequence(tiny_llama(), offloaded=False)
    got = peft_merge_sequence(offloaded_llama(), offloaded=True)
    assert not torch.equal(expected[0], expected[1]) and not torch.equal(expected[1], expected[3])
    for step, (out, ref) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(out, ref), f"step {step} differs from the model without offload"


def test_peft_from_pretrained_and_load_adapter_on_an_offloaded_model_match_the_model_without_offload(
    tmp_path,
) -> None:
    x = llama_inputs()
    torch.manual_seed(5)
    source = peft.get_peft_model(tiny_llama(), lora_config(), adapter_name="default")
    source.add_adapter("other", lora_config(("up_proj",)))
    source.save_pretrained(tmp_path)  # default in tmp_path, other in tmp_path/other

    def sequence(model: torch.nn.Module, offloaded: bool) -> list[torch.Tensor]:
        outs = [run_forwards(model, x, LEARN + 1)[-1]]
        peft_model = peft.PeftModel.from_pretrained(model, tmp_path)
        outs.append(run_forwards(peft_model, x, 2)[-1])
        peft_model.load_adapter(tmp_path / "other", adapter_name="other")
        peft_model.set_adapter("other")
        outs.append(run_forwards(peft_model, x, 2)[-1])
        with editing_if(offloaded, model):
            peft_model.merge_adapter()
        outs.append(run_forwards(peft_model, x, 2)[-1])
        return outs

    expected = sequence(tiny_llama(), offloaded=False)
    model = offloaded_llama()
    got = sequence(model, offloaded=True)
    assert_streams_everything(model)
    for step, (out, ref) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(out, ref), f"step {step} differs from the model without offload"
    # The state dict reports every weight by its name now (peft renamed q_proj.weight to
    # q_proj.base_layer.weight), with the merged values.
    plain = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path)
    plain.load_adapter(tmp_path / "other", adapter_name="other")
    plain.set_adapter("other")
    plain.merge_adapter()
    reference = plain.state_dict()
    state = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in state
    assert {"base_model.model." + key for key in state} == reference.keys()
    for key, value in state.items():
        assert torch.equal(value, reference["base_model.model." + key]), key


# -- diffusers on a Wan transformer -------------------------------------------------------------------------


def diffusers_lora_sequence(model: torch.nn.Module, offloaded: bool, adapters: dict) -> list[torch.Tensor]:
    x = wan_inputs()
    outs = [run_forwards(model, x, LEARN + 1)[-1]]
    for name, state in adapters.items():
        model.load_lora_adapter(state, prefix=None, adapter_name=name)
    model.set_adapters(["a", "b"], weights=[1.0, 0.5])
    outs.append(run_forwards(model, x, 2)[-1])
    with editing_if(offloaded, model):
        model.fuse_lora(lora_scale=0.7)
    outs.append(run_forwards(model, x, 2)[-1])
    with editing_if(offloaded, model):
        model.unfuse_lora()
    model.set_adapters("a")
    outs.append(run_forwards(model, x, 2)[-1])
    return outs


def test_diffusers_lora_loaded_fused_and_unfused_on_an_offloaded_transformer_matches_without_offload() -> (
    None
):
    from peft import get_peft_model_state_dict

    adapters = {}
    for seed, (name, targets) in enumerate({"a": ("to_q", "to_v"), "b": ("to_k", "ffn.net.0.proj")}.items()):
        source = tiny_wan()
        torch.manual_seed(seed)
        source.add_adapter(peft.LoraConfig(r=4, target_modules=list(targets), init_lora_weights=False), name)
        adapters[name] = get_peft_model_state_dict(source, adapter_name=name)
    expected = diffusers_lora_sequence(tiny_wan(), False, adapters)
    model = tiny_wan()
    model = flextensor.offload(model, streaming_config(model))
    got = diffusers_lora_sequence(model, True, adapters)
    assert_streams_everything(model)
    assert not torch.equal(expected[1], expected[0])
    for step, (out, ref) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(out, ref), f"step {step} differs from the model without offload"


# -- edits by hand ------------------------------------------------------------------------------------------


def test_an_edit_inside_editing_survives_every_reload_of_its_unit() -> None:
    x = llama_inputs()
    plain = tiny_llama()
    with torch.no_grad():
        plain.model.layers[1].mlp.up_proj.weight.mul_(2)
    expected = run_forwards(plain, x, 1)[0]
    model = offloaded_llama()
    run_forwards(model, x, LEARN)
    with flextensor.editing(model), torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(2)
    outs = run_forwards(model, x, 4)  # each forward reloads every unit from its host pack
    assert_streams_everything(model)
    assert all(torch.equal(out, expected) for out in outs)
    assert torch.equal(
        model.state_dict()["model.layers.1.mlp.up_proj.weight"], plain.model.layers[1].mlp.up_proj.weight
    )


def test_a_refused_nested_editing_leaves_the_open_one_and_every_later_forward_right() -> None:
    """The inner with-block is refused before it changes anything; the outer one's edit is kept, and
    nothing the refusal did reaches the host packs (it once pointed the weights back at the arena, so the
    outer block's write-back copied the arena's bytes into every pack)."""
    x = llama_inputs()
    plain = tiny_llama()
    with torch.no_grad():
        plain.model.layers[0].mlp.down_proj.weight.mul_(3)
    expected = run_forwards(plain, x, 1)[0]
    model = offloaded_llama()
    with flextensor.editing(model), torch.no_grad():
        refused = pytest.raises(flextensor.UnsupportedOperationError, match="already open")
        with refused, flextensor.editing(model):
            pass
        model.model.layers[0].mlp.down_proj.weight.mul_(3)
    outs = run_forwards(model, x, LEARN + 2)
    assert_streams_everything(model)
    assert all(torch.equal(out, expected) for out in outs)


def test_load_state_dict_inside_editing_writes_the_offloaded_weights() -> None:
    x = llama_inputs()
    other = tiny_llama(seed=3)
    expected = run_forwards(other, x, 1)[0]
    model = offloaded_llama()
    run_forwards(model, x, LEARN)
    with flextensor.editing(model):
        model.load_state_dict(other.state_dict())
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))


def test_an_in_place_edit_outside_editing_raises_before_the_next_forward_and_is_discarded() -> None:
    x = llama_inputs()
    expected = run_forwards(tiny_llama(), x, 1)[0]
    model = offloaded_llama()
    run_forwards(model, x, LEARN + 1)
    ran = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: ran.append(1))
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight.mul_(2)  # views an arena range another unit may occupy
    with pytest.raises(
        flextensor.UnsupportedOperationError, match=r"'model\.layers\.2'.*flextensor\.editing"
    ):
        run_forwards(model, x, 1)
    assert not ran, "the refused forward computed"
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))


def test_a_forward_inside_editing_is_refused() -> None:
    model = offloaded_llama()
    run_forwards(model, llama_inputs(), LEARN)
    with (
        flextensor.editing(model),
        pytest.raises(flextensor.UnsupportedOperationError, match="after the with"),
    ):
        run_forwards(model, llama_inputs(), 1)


def test_peft_merge_outside_editing_is_refused_before_it_writes_anything() -> None:
    x = llama_inputs()
    model = offloaded_llama()
    torch.manual_seed(5)
    peft_model = peft.get_peft_model(model, lora_config())
    expected = run_forwards(peft_model, x, LEARN + 1)[-1]
    with pytest.raises(flextensor.UnsupportedOperationError, match=r"\.data .*flextensor\.editing"):
        peft_model.merge_adapter()
    assert all(torch.equal(out, expected) for out in run_forwards(peft_model, x, 3))


def test_a_write_through_data_outside_editing_is_refused_at_once_and_release_gives_plain_parameters() -> None:
    model = offloaded_llama()
    run_forwards(model, llama_inputs(), LEARN)
    weight = model.model.layers[1].mlp.up_proj.weight
    with pytest.raises(flextensor.UnsupportedOperationError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        weight.data.mul_(2)
    with flextensor.editing(model):
        weight.data.mul_(2)  # allowed, and kept
    flextensor.release(model)
    assert type(weight) is torch.nn.Parameter
    expected = tiny_llama().model.layers[1].mlp.up_proj.weight * 2
    assert torch.equal(weight.data, expected)


def test_state_dict_inside_editing_holds_the_edits_made_so_far() -> None:
    """A merge saved before the with-block closes (found by review: state_dict() read the host packs,
    which get the edits only at its end)."""
    model = offloaded_llama()
    run_forwards(model, llama_inputs(), LEARN)
    name = "model.layers.1.mlp.up_proj.weight"
    with flextensor.editing(model), torch.no_grad():
        weight = model.model.layers[1].mlp.up_proj.weight
        weight.mul_(2)
        assert torch.equal(model.state_dict()[name], weight)
        edited = weight.clone()
    assert torch.equal(model.state_dict()[name], edited)


def _lora_state(model: torch.nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name in names:
        linear = model.get_submodule(name)
        state[f"{name}.lora_A.weight"] = torch.randn(4, linear.in_features, generator=generator) * 0.1
        state[f"{name}.lora_B.weight"] = torch.randn(linear.out_features, 4, generator=generator) * 0.1
    return state


@torch.no_grad()
def test_a_refused_fuse_lora_leaves_every_layer_as_it_was_the_resident_ones_too() -> None:
    """A LoRA on a weight outside every unit (an embedder, kept on the device) and on a streamed one:
    fuse_lora outside editing() is refused before it scales or merges anything (found by review: the
    embedder was fused and the scale changed before the streamed weight refused, silently)."""
    x = wan_inputs()
    targets = ("condition_embedder.text_embedder.linear_1", "blocks.0.ffn.net.2")
    native, model = tiny_wan(layers=2), tiny_wan(layers=2)
    flextensor.offload(model, streaming_config(model, include=["blocks.*"]))
    run_forwards(model, x, LEARN)
    for m in (native, model):
        m.load_lora_adapter(_lora_state(m, targets), adapter_name="a", prefix=None)
    with pytest.raises(flextensor.UnsupportedOperationError, match=r"fuse_lora\(\).*nothing was changed"):
        model.fuse_lora(lora_scale=0.5)
    assert not [n for n, m in model.named_modules() if getattr(m, "merged_adapters", None)]
    assert torch.equal(run_forwards(model, x, 1)[0], run_forwards(native, x, 1)[0])
    with flextensor.editing(model):
        model.fuse_lora(lora_scale=0.5)
    native.fuse_lora(lora_scale=0.5)
    expected = run_forwards(native, x, 1)[0]
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 2))


def test_a_merge_refused_halfway_refuses_forwards_until_it_is_made_whole_in_editing() -> None:
    """peft merges layer by layer: a layer kept on the device (its .data is its own) merges, then the
    first streamed one refuses. The model is half-merged, so forwards refuse until the merge is redone
    inside editing(), where peft skips the layer already merged."""
    x = llama_inputs()
    native, model = tiny_llama(layers=3, tie=False), tiny_llama(layers=3, tie=False)
    flextensor.offload(model, streaming_config(model, exclude=["model.layers.0"]))
    run_forwards(model, x, LEARN)
    peft_models = []
    for m in (native, model):
        torch.manual_seed(5)
        peft_models.append(peft.get_peft_model(m, lora_config()))
    with pytest.raises(flextensor.UnsupportedOperationError, match=r"layers\.0\..*half-edited"):
        peft_models[1].merge_adapter()
    with pytest.raises(flextensor.UnsupportedOperationError, match="a forward after a refused edit"):
        run_forwards(peft_models[1], x, 1)
    with flextensor.editing(peft_models[1]):
        peft_models[1].merge_adapter()
    peft_models[0].merge_adapter()
    expected = run_forwards(peft_models[0], x, 1)[0]
    assert all(torch.equal(out, expected) for out in run_forwards(peft_models[1], x, 2))


def test_data_of_a_weight_outside_every_unit_stays_readable_and_writable_between_forwards() -> None:
    """Its bytes are its own: reads (deepcopy, torch.save, peft's modules_to_save) and edits work."""
    model = tiny_llama(layers=3, tie=False)
    flextensor.offload(model, streaming_config(model, exclude=["model.layers.0"]))
    x = llama_inputs()
    run_forwards(model, x, LEARN)
    layer = model.model.layers[0].input_layernorm
    before = layer.weight.detach().clone()
    assert torch.equal(copy.deepcopy(layer).weight, before)
    buffer = io.BytesIO()
    torch.save(layer, buffer)  # pickles the parameter: flextensor's guard is not part of it
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False).weight, before)
    layer.weight.data.mul_(2)
    native = tiny_llama(layers=3, tie=False)
    native.model.layers[0].input_layernorm.weight.data.mul_(2)
    assert torch.equal(run_forwards(model, x, 1)[0], run_forwards(native, x, 1)[0])
    flextensor.release(model)
    assert type(layer.weight) is torch.nn.Parameter and torch.equal(layer.weight.data, before * 2)


@pytest.mark.parametrize("exclude", [(), ("model.layers.0",)], ids=["streamed", "a layer on the device"])
def test_a_dora_adapter_added_and_merged_in_editing_matches_the_model_without_offload(exclude: tuple) -> None:
    """DoRA reads each base weight to set its magnitude when it is added: outside editing that read is
    refused and says where to add it; inside, adding, running and merging are bitwise."""

    def dora() -> object:
        targets = ["q_proj", "v_proj", "up_proj"]
        return peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False, use_dora=True)

    x = llama_inputs()
    native, model, outside = (tiny_llama(layers=3, tie=False) for _ in range(3))
    for m in (model, outside):
        flextensor.offload(m, streaming_config(m, exclude=list(exclude)))
        run_forwards(m, x, LEARN)
    with pytest.raises(flextensor.UnsupportedOperationError, match="use_dora=True"):
        peft.get_peft_model(outside, dora())
    torch.manual_seed(5)
    native_peft = peft.get_peft_model(native, dora())
    torch.manual_seed(5)
    with flextensor.editing(model):
        peft_model = peft.get_peft_model(model, dora())
    assert torch.equal(run_forwards(peft_model, x, 2)[-1], run_forwards(native_peft, x, 1)[0])
    native_peft.merge_adapter()
    with flextensor.editing(model):
        peft_model.merge_adapter()
    assert torch.equal(run_forwards(peft_model, x, 2)[-1], run_forwards(native_peft, x, 1)[0])


# -- edits between forwards without editing() ---------------------------------------------------------------


def test_a_write_into_a_state_dict_tensor_between_forwards_reaches_every_later_forward() -> None:
    """``model.state_dict()[k].copy_(v)``, the in-place loading idiom, writes the unit's host pack: the next
    forward used to compute with the copy already in the arena (old weights) and the later ones with the
    new, so one forward mixed both."""
    x = llama_inputs()
    plain, model = tiny_llama(), offloaded_llama()
    run_forwards(model, x, LEARN + 1)
    state = model.state_dict()  # taken before forwards that load every unit again
    run_forwards(model, x, 2)
    keys = ["model.layers.1.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.weight"]
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for key in keys:
            new = torch.randn(state[key].shape, generator=generator)
            state[key].copy_(new)
            plain.state_dict()[key].copy_(new)
    expected = run_forwards(plain, x, 1)[0]
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))
    assert_streams_everything(model)
    for key in keys:
        assert torch.equal(model.state_dict()[key], plain.state_dict()[key])
    flextensor.release(model)
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_refused_set_between_forwards_is_really_discarded() -> None:
    """``weight.set_(t)`` was refused as discarded, yet the parameter kept viewing ``t``: every later forward
    computed with it while state_dict() and release() gave the old weight."""
    x = llama_inputs()
    plain, model = tiny_llama(), offloaded_llama()
    expected = run_forwards(plain, x, 1)[0]
    run_forwards(model, x, LEARN + 1)
    weight = model.model.layers[2].mlp.up_proj.weight
    with torch.no_grad():
        weight.set_(torch.zeros(weight.shape))
    with pytest.raises(flextensor.UnsupportedOperationError, match=r"'model\.layers\.2'.*discarded"):
        run_forwards(model, x, 1)
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))
    key = "model.layers.2.mlp.up_proj.weight"
    assert torch.equal(model.state_dict()[key], plain.state_dict()[key])
    flextensor.release(model)
    assert torch.equal(weight, plain.model.layers[2].mlp.up_proj.weight)


def _replace_weight(model: torch.nn.Module) -> None:
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(weight)


def _replace_layer(model: torch.nn.Module) -> None:
    torch.manual_seed(9)
    model.model.layers[1] = type(model.model.layers[1])(model.config, 1)


def _reparametrize(how: object) -> object:
    def apply(model: torch.nn.Module) -> None:
        torch.manual_seed(4)  # spectral norm starts its power iteration from random vectors
        how(model.model.layers[1].mlp.up_proj)  # type: ignore[operator]

    return apply


STRUCTURE_CHANGES = {
    "a parameter replaced": _replace_weight,
    "a layer replaced": _replace_layer,
    "weight_norm": _reparametrize(torch.nn.utils.weight_norm),
    "spectral_norm": _reparametrize(torch.nn.utils.spectral_norm),
    "parametrizations.weight_norm": _reparametrize(torch.nn.utils.parametrizations.weight_norm),
    "parametrizations.spectral_norm": _reparametrize(torch.nn.utils.parametrizations.spectral_norm),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("change", list(STRUCTURE_CHANGES), ids=list(STRUCTURE_CHANGES))
def test_a_weight_replaced_or_reparametrized_outside_editing_is_refused_and_the_model_left_as_it_was(
    change: str,
) -> None:
    """Each was accepted, or refused half-way: forwards computed with the newcomer while state_dict() kept
    the offloaded weight (a replaced parameter or layer; spectral_norm, refused as "discarded" but kept),
    every later forward raised AttributeError (weight_norm, after it deleted ``weight``), or
    ``nn.Parameter(weight)`` failed inside torch (parametrizations.weight_norm)."""
    x = llama_inputs()
    plain, model = tiny_llama(), offloaded_llama()
    expected = run_forwards(plain, x, 1)[0]
    run_forwards(model, x, LEARN + 1)
    with pytest.raises(
        flextensor.UnsupportedOperationError, match=r"model\.layers\.1\..*flextensor\.editing"
    ):
        STRUCTURE_CHANGES[change](model)
    assert type(model.model.layers[1].mlp.up_proj) is torch.nn.Linear
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))
    state = model.state_dict()
    assert state.keys() == plain.state_dict().keys()
    assert all(torch.equal(state[key], value) for key, value in plain.state_dict().items())


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("change", list(STRUCTURE_CHANGES), ids=list(STRUCTURE_CHANGES))
def test_a_weight_replaced_or_reparametrized_inside_editing_matches_the_model_without_offload(
    change: str,
) -> None:
    x = llama_inputs()
    plain, model = tiny_llama(), offloaded_llama()
    run_forwards(model, x, LEARN + 1)
    with torch.no_grad():
        STRUCTURE_CHANGES[change](plain)
    with flextensor.editing(model):
        STRUCTURE_CHANGES[change](model)
    for m in (plain, model):
        m.eval()
    expected = run_forwards(plain, x, 1)[0]
    assert all(torch.equal(out, expected) for out in run_forwards(model, x, 3))
    reference = plain.state_dict()
    for state in (model.state_dict(), flextensor.release(model).state_dict()):
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[key], value) for key, value in reference.items())
    assert torch.equal(run_forwards(model, x, 1)[0], expected)


def test_nn_parameter_of_an_offloaded_weight_works_inside_editing_and_is_refused_outside() -> None:
    """``nn.Parameter(weight)`` raised torch's "requires that detach() returns an instance of the same
    type" (the guard's subclass), inside editing() too; outside, it would alias the shared arena."""
    model = offloaded_llama()
    run_forwards(model, llama_inputs(), LEARN)
    weight = model.model.layers[1].mlp.up_proj.weight
    with pytest.raises(flextensor.UnsupportedOperationError, match=r"nn\.Parameter\(model\.layers\.1\.mlp"):
        torch.nn.Parameter(weight)
    with flextensor.editing(model):
        copy_ = torch.nn.Parameter(weight, requires_grad=False)
        assert torch.equal(copy_, weight) and not copy_.requires_grad
        model.model.layers[1].mlp.register_parameter("extra", copy_)
    assert type(copy_) is torch.nn.Parameter  # registered: the guard's subclass is shed
    assert torch.equal(copy_, tiny_llama().model.layers[1].mlp.up_proj.weight)
