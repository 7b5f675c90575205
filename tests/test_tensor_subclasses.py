"""Weights that are tensor subclasses: wrapper subclasses (torchao, quanto) stay resident with a warning,
parameter subclasses over a storage of their own (diffusers' GGUF) stream; outputs bitwise either way.
See [Note: tensor-subclass weights] in weights/subclasses.py."""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import flextensor
from engine_helpers import LEARN, Stack, assert_all_equal, first_tensor, run_forwards
from flextensor.errors import UnsupportedModelError
from flextensor.weights.subclasses import is_wrapper_subclass, set_parameter_value
from real_models import tiny_wan, wan_inputs
from streaming import streaming_config

SUBCLASS_WARNING = "tensor subclasses"


def _as_two_tensor(linear: nn.Linear) -> None:
    weight = linear.weight.detach()
    linear.weight = nn.Parameter(TwoTensor(weight.clone(), weight.clone()), requires_grad=False)


def _subclass_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if SUBCLASS_WARNING in str(w.message)]


def test_a_wrapper_subclass_weight_stays_resident_with_a_warning_and_outputs_stay_bitwise() -> None:
    model = Stack(layers=4, width=32)
    _as_two_tensor(model.layers[1])
    weight = model.layers[1].weight
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    config = streaming_config(model, ["layers.*"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flextensor.offload(model, config)
    (message,) = _subclass_warnings(caught)
    # 8 KiB: both inner tensors count
    assert "layers.1.weight" in message and "TwoTensor" in message and "8.0 KiB" in message
    assert "layers.1.weight" in flextensor.resident_parameters(model)
    assert "layers.1.bias" in flextensor.offloaded_parameters(model)  # the rest of its unit streams
    assert model.layers[1].weight is weight  # the same object, its inner tensors untouched
    outs = run_forwards(model, x, LEARN + 2)
    assert flextensor.phase(model) == "inference"
    assert_all_equal([out.a for out in outs], ref.a)
    assert_all_equal([out.b for out in outs], ref.b)
    flextensor.release(model)
    assert model.layers[1].weight is weight and isinstance(weight, TwoTensor)
    with torch.no_grad():
        assert torch.equal(model(x).a, ref.a)


def test_torchao_quantized_blocks_keep_their_weights_resident_and_the_rest_streams() -> None:
    torchao = pytest.importorskip("torchao.quantization")
    model = tiny_wan(layers=2)
    torchao.quantize_(model.blocks[0], torchao.Int8WeightOnlyConfig())
    quantized = [f"blocks.0.{n}" for n, p in model.blocks[0].named_parameters() if is_wrapper_subclass(p)]
    assert quantized, "torchao left no quantized weight"
    inputs = wan_inputs()
    with torch.no_grad():
        ref = first_tensor(model(**inputs))
    config = streaming_config(model, ["blocks.*"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flextensor.offload(model, config)
    (message,) = _subclass_warnings(caught)
    assert quantized[0] in message
    assert set(quantized) <= set(flextensor.resident_parameters(model))
    streamed = flextensor.offloaded_parameters(model)
    assert any(n.startswith("blocks.0.") for n in streamed)  # its norms and biases
    assert any(n.startswith("blocks.1.") and n.endswith(".weight") for n in streamed)
    assert_all_equal(run_forwards(model, inputs, LEARN + 2), ref)
    flextensor.release(model)
    assert_all_equal(run_forwards(model, inputs, 1), ref)


def test_gguf_weights_stream_bit_for_bit_and_keep_their_quant_type() -> None:
    gguf = pytest.importorskip("gguf")
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    torch.manual_seed(0)
    model = Stack(layers=4, width=32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for i, layer in enumerate(model.layers):
        linear = GGUFLinear(32, 32, bias=True, compute_dtype=torch.float32)
        values = gguf.quants.quantize(layer.weight.detach().numpy(), q8)
        linear.weight = GGUFParameter(torch.from_numpy(values), quant_type=q8)
        linear.bias = layer.bias
        model.layers[i] = linear
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    native_state = model.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flextensor.offload(model, streaming_config(model, ["layers.*"]))
    assert not _subclass_warnings(caught)
    assert "layers.0.weight" in flextensor.offloaded_parameters(model)
    outs = run_forwards(model, x, LEARN + 2)
    # state_dict() gives what the model's own gives: GGUFParameter with its quant_type, the same bytes
    for key, value in model.state_dict().items():
        assert type(value) is type(native_state[key]), key
        assert getattr(value, "quant_type", None) == getattr(native_state[key], "quant_type", None), key
        assert torch.equal(value.as_subclass(torch.Tensor), native_state[key].as_subclass(torch.Tensor)), key
    assert flextensor.report(model).units[0].placement == "streamed"
    assert_all_equal(outs, ref)
    flextensor.release(model)
    assert type(model.layers[0].weight) is GGUFParameter and model.layers[0].weight.quant_type == q8
    assert_all_equal(run_forwards(model, x, 1), ref)


def test_a_model_whose_units_hold_only_subclass_weights_is_refused_naming_them() -> None:
    model = Stack(layers=2, width=32)
    for layer in model.layers:
        _as_two_tensor(layer)
        layer.bias = None
    with pytest.raises(flextensor.SelectionError, match="tensor subclasses"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flextensor.offload(model, flextensor.OffloadConfig(include_patterns=["layers.*"], device="cpu"))
    assert not hasattr(model, "_flextensor_engine")


def test_moving_a_wrapper_subclass_parameter_keeps_the_object_and_its_ties() -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    _as_two_tensor(first)
    second.weight = first.weight  # tied: one object in two modules
    param = first.weight
    new = TwoTensor(torch.ones(4, 4), torch.full((4, 4), 2.0))
    set_parameter_value(param, new)
    assert first.weight is param and second.weight is param
    assert torch.equal(param.a, torch.ones(4, 4)) and torch.equal(param.b, torch.full((4, 4), 2.0))
    assert isinstance(param, nn.Parameter) and not param.requires_grad

    plain = nn.Parameter(torch.zeros(2))
    set_parameter_value(plain, torch.ones(2))
    assert torch.equal(plain.data, torch.ones(2)) and plain.requires_grad


def test_a_wrapper_subclass_that_cannot_be_swapped_is_refused_with_what_to_do() -> None:
    layer = nn.Linear(4, 4)
    _as_two_tensor(layer)
    watcher = weakref.ref(layer.weight)  # what a compiled graph's guards hold
    with pytest.raises(UnsupportedModelError, match="move it there before offload"):
        set_parameter_value(layer.weight, TwoTensor(torch.ones(4, 4), torch.ones(4, 4)), "'layer.weight'")
    assert watcher() is layer.weight and not torch.equal(layer.weight.a, torch.ones(4, 4))


def test_reading_a_checkpoint_into_a_subclass_weight_is_refused_before_anything_changes(tmp_path) -> None:
    from safetensors.torch import save_file

    model = Stack(layers=2, width=32)
    path = tmp_path / "stack.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    _as_two_tensor(model.layers[1])
    weight = model.layers[1].weight
    before = weight.a.clone()
    with pytest.raises(UnsupportedModelError, match="cannot read a checkpoint into"):
        flextensor.offload(
            model, flextensor.OffloadConfig(include_patterns=["layers.*"], device="cpu"), weights=path
        )
    assert model.layers[1].weight is weight and torch.equal(weight.a, before)
    assert not hasattr(model, "_flextensor_engine")


def test_release_to_a_device_refuses_a_subclass_weight_it_cannot_swap_before_changing_anything() -> None:
    model = Stack(layers=3, width=32)
    _as_two_tensor(model.layers[1])
    weight = model.layers[1].weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flextensor.offload(model, streaming_config(model, ["layers.*"]))
    x = torch.randn(2, 32)
    with torch.no_grad():
        expected = model(x)
    watcher = weakref.ref(weight)  # what a compiled graph's guards hold
    with pytest.raises(flextensor.FlexTensorError, match="weak reference"):
        flextensor.release(model, "meta")
    with torch.no_grad():
        assert torch.equal(model(x).a, expected.a)  # still offloaded and working
    assert "layers.0.weight" in flextensor.offloaded_parameters(model)
    del watcher
    flextensor.release(model)
