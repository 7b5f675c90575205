"""The steady state end to end: bitwise the outputs of the plain model, on the spec's examples and on real
model classes (transformers' Llama, diffusers' Wan), under every autograd mode, through generate(), and
with units run out of the learned order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import CPU, LEARN, assert_all_equal, run_forwards
from flextensor.errors import BackwardNotSupportedError
from flextensor.hooks.functions import input_signature
from real_models import llama_inputs, tiny_llama, tiny_wan, wan_inputs
from spec_model import make_spec_model, spec_tokens
from streaming import streaming_config

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
    status = flextensor.status(model)
    assert status.phase == "inference"
    assert status.plan.streamed  # the streaming path ran, not an all-resident plan
    assert set(status.streamed) == set(status.plan.streamed)


# -- real model classes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("include", [["*"], ["model.layers.*"]])
def test_llama_tied_embeddings_bitwise(include: list[str]) -> None:
    ref = run_forwards(tiny_llama(), llama_inputs(), 1)[0]
    model = tiny_llama()
    model = flextensor.offload(model, streaming_config(model, include))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if include == ["*"]:
        assert "model.embed_tokens.weight" in flextensor.resident_parameters(model)
    assert_all_equal(run_forwards(model, llama_inputs()), ref)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied in steady state


def test_llama_untied_embeddings_bitwise() -> None:
    ref = run_forwards(tiny_llama(tie=False), llama_inputs(), 1)[0]
    model = tiny_llama(tie=False)
    model = flextensor.offload(model, streaming_config(model))
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(flextensor.offloaded_parameters(model))
    assert_all_equal(run_forwards(model, llama_inputs()), ref)
    assert flextensor.status(model).plan.streamed


def test_llama_under_inference_mode_autocast_and_grad() -> None:
    inputs = llama_inputs()
    base = tiny_llama()
    model = tiny_llama()
    model = flextensor.offload(model, streaming_config(model, ["model.layers.*"]))
    run_forwards(model, inputs, LEARN)
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


def _input_ids_length(args: tuple, kwargs: dict) -> int:
    ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
    return ids.shape[1]


@pytest.mark.parametrize("streaming", [False, True], ids=["no-budget", "tightest-budget"])
def test_llama_generate_matches_the_plain_model_token_for_token(streaming: bool) -> None:
    """generate(): a prefill, then decode steps on a growing cache; a plan for each, switched between at
    every call.

    How many decode plans there are depends on transformers: the cache is not a tensor argument, but some
    versions (5.17) also pass an attention mask one token longer at each step, whose length is bucketed to
    powers of two (one plan per bucket); others (5.24) pass none, and decode has one plan."""
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
    calls: list[tuple[tuple[str, ...], int]] = []  # per forward: its input signature, its input_ids length

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append((input_signature(args, kwargs), _input_ids_length(args, kwargs)))

    model.register_forward_pre_hook(record, with_kwargs=True)
    plans_after: list[set[tuple[str, ...]]] = []
    with torch.no_grad():
        for _ in range(2):  # the first call learns; the second runs on the plans it made
            out = model.generate(prompt, **settings)
            assert torch.equal(out.sequences, ref.sequences)
            assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores, strict=True))
            plans_after.append(set(flextensor.status(model).plans))
    assert flextensor.phase(model) == "inference"
    prefill = {signature for signature, length in calls if length == 5}
    decode = {signature for signature, length in calls if length == 1}
    assert len(prefill) == 1 and decode and not prefill & decode
    # A plan for every input signature generate() used, no more: the prompt's and the decode steps'...
    assert plans_after[1] == prefill | decode
    # ...the first call's decode steps planned theirs; the second call planned only the prompt (which the
    # first call's discovery saw) and ran every decode step on a plan the first call made.
    assert plans_after[0] == decode
    assert plans_after[1] - plans_after[0] == prefill


def test_out_of_order_units_load_on_demand_and_stay_right() -> None:
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

    x = torch.randn(3, 16)
    ref_model = Branchy()
    model = Branchy()
    model = flextensor.offload(model, streaming_config(model))
    run_forwards(model, x, LEARN)
    assert len(flextensor.status(model).plan.streamed) == 5
    with torch.no_grad():
        for flip in (True, False, True, True, False):
            assert torch.equal(model(x, flip=flip), ref_model(x, flip=flip))
    assert len(flextensor.status(model).plans) == 1  # the flag is no tensor: one plan serves both orders
