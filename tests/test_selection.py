"""Selection: include/exclude patterns -> offload units, streamed and resident parameters.

Every example of the spec's "How to Exclude Modules and Parameters" page runs here on ``SpecModel``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flextensor.config.patterns import (
    class_names,
    is_class_pattern,
    match_class,
    match_exclude,
    match_include,
)
from flextensor.errors import SelectionError
from flextensor.weights.selection import Selection, select
from spec_model import Linear as UserLinear
from spec_model import make_spec_model

N_LAYERS = 4  # make_spec_model() default; odd layers hold a MoELayer


def layer_units(n: int = N_LAYERS) -> tuple[str, ...]:
    return tuple(f"layers.{i}" for i in range(n))


def quiet_select(model: nn.Module, include: list[str], exclude: list[str]) -> Selection:
    """select() with any warning turned into a test failure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return select(model, include, exclude)


def params_of(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def assert_partition(model: nn.Module, sel: Selection) -> None:
    """Every parameter of the model is streamed by exactly one unit or resident, never both."""
    streamed = sel.streamed_parameters()
    assert sorted([*streamed, *sel.resident_parameters]) == sorted(params_of(model))
    assert len(set(streamed)) == len(streamed)
    for unit, names in sel.unit_parameters.items():
        # Named as named_parameters() names them: a weight tied to a holder outside (an alias) may be
        # named there, but the unit holds it.
        held = {id(p) for p in model.get_submodule(unit).parameters()}
        assert all(id(model.get_parameter(name)) in held for name in names)


# --- pure pattern helpers -------------------------------------------------------------------------


def test_match_include_is_segment_wise() -> None:
    assert match_include("layers.*", "layers.0", nn.Linear)
    assert not match_include("layers.*", "layers.0.attn", nn.Linear)
    assert match_include("*", "embed", nn.Embedding)
    assert not match_include("*", "layers.0", nn.Linear)
    assert match_include("layers.*.attn", "layers.3.attn", nn.Module)
    assert not match_include("*", "", nn.Module)  # the root has no name


def test_match_exclude_is_whole_string_and_spans_dots() -> None:
    assert match_exclude("*.scale", "layers.0.scale", None)
    assert match_exclude("*.norm", "layers.3.norm", nn.LayerNorm)
    assert not match_exclude("*.norm", "norm", nn.LayerNorm)
    assert not match_exclude("head", "lm_head", nn.Linear)
    assert match_exclude("layers.*", "layers.0.attn.q.weight", None)
    assert not match_exclude("*", "", nn.Module)  # name patterns never match the root
    assert not match_exclude("class:Linear", "layers.0.attn.q.weight", None)  # class vs parameter


def test_class_patterns_match_short_or_qualified_name_only_of_the_class_itself() -> None:
    assert is_class_pattern("class:MoELayer") and not is_class_pattern("layers.*")
    assert class_names(nn.Linear) == ("Linear", "torch.nn.modules.linear.Linear")
    assert not class_names(UserLinear)[1].startswith("torch.")
    assert match_class("class:torch.nn.*.Linear", nn.Linear)
    assert not match_class("class:torch.nn.*.Linear", UserLinear)
    assert match_class("class:Linear", nn.Linear) and match_class("class:Linear", UserLinear)
    assert match_include("class:Lin*", "x", nn.Linear) and match_exclude("class:Lin*", "x", nn.Linear)
    # No base-class matching: SharedExpertMLP subclasses MLP but is not "an MLP" to a pattern.
    shared_cls = type(make_spec_model().layers[0].shared)
    assert not match_class("class:MLP", shared_cls)


# --- the spec's examples --------------------------------------------------------------------------


def test_include_star_gives_top_level_units_never_the_layer_list() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["*"], [])
    assert sel.units == ("embed", *layer_units(), "norm", "head", "lm_head")
    assert sel.resident_parameters == () and sel.resident_reasons == {}
    assert_partition(model, sel)


def test_offload_everything_except_lm_head() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["*"], ["lm_head"])
    assert sel.units == ("embed", *layer_units(), "norm", "head")
    assert sel.resident_parameters == ("lm_head.weight",)
    assert sel.resident_reasons == {"lm_head.weight": "excluded by 'lm_head'"}


def test_exclude_fp8_scale_tensors() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["layers.*"], ["*.scale"])
    assert sel.units == layer_units()
    scales = [f"layers.{i}.scale" for i in range(N_LAYERS)]
    assert all(sel.unit_of(s) is None for s in scales)
    assert {s: sel.resident_reasons[s] for s in scales} == dict.fromkeys(scales, "excluded by '*.scale'")
    assert sel.unit_of("layers.2.attn.q.weight") == "layers.2"
    # Everything else in the layers streams; outside the layers nothing was asked for.
    layer_params = [n for n in params_of(model) if n.startswith("layers.")]
    assert set(sel.streamed_parameters()) == set(layer_params) - set(scales)
    assert_partition(model, sel)


def test_exclude_a_specific_layer() -> None:
    model = make_spec_model(n_layers=32)
    sel = quiet_select(model, ["layers.*"], ["layers.31"])
    assert sel.units == layer_units(31)  # layers.3 and layers.30 are not caught by "layers.31"
    last = [n for n in params_of(model) if n.startswith("layers.31.")]
    assert last and all(sel.resident_reasons[n] == "excluded by 'layers.31'" for n in last)
    assert set(last) <= set(sel.resident_parameters)


def test_class_excludes_keep_shared_expert_and_moe_resident() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["layers.*"], ["class:SharedExpertMLP", "class:MoELayer"])
    assert sel.units == layer_units()
    for name in params_of(model):
        if ".shared." in name:
            assert sel.resident_reasons[name] == "excluded by class:SharedExpertMLP"
        elif name.startswith(("layers.1.mlp.", "layers.3.mlp.")):
            assert sel.resident_reasons[name] == "excluded by class:MoELayer"
        elif name.startswith("layers."):
            assert sel.unit_of(name) == name[: len("layers.0")], name  # plain MLP, attn, norm, proj...
    assert sel.unit_of("layers.0.mlp.up.weight") == "layers.0"


def test_fqcn_glob_matches_torch_linear_but_not_user_linear() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["layers.*"], ["class:torch.nn.*.Linear"])
    for i in range(N_LAYERS):
        assert sel.unit_of(f"layers.{i}.proj.weight") == f"layers.{i}"  # the user's Linear streams
        assert sel.unit_of(f"layers.{i}.norm.weight") == f"layers.{i}"
        assert sel.unit_of(f"layers.{i}.scale") == f"layers.{i}"
        for name in (f"layers.{i}.attn.q.weight", f"layers.{i}.shared.down.bias"):
            assert sel.resident_reasons[name] == "excluded by class:torch.nn.*.Linear"
    assert "layers.1.mlp.router.weight" in sel.resident_parameters
    assert "layers.1.mlp.experts.0.up.weight" in sel.resident_parameters
    # The short name matches both classes.
    both = quiet_select(model, ["layers.*"], ["class:Linear"])
    assert both.unit_of("layers.0.proj.weight") is None
    assert both.resident_reasons["layers.0.proj.weight"] == "excluded by class:Linear"


def test_combine_include_and_exclude() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["embed", "layers.*", "head"], ["head", "*.norm"])
    assert sel.units == ("embed", *layer_units())
    assert sel.resident_reasons["head.weight"] == "excluded by 'head'"
    for i in range(N_LAYERS):
        assert sel.resident_reasons[f"layers.{i}.norm.bias"] == "excluded by '*.norm'"
        assert sel.unit_of(f"layers.{i}.attn.o.weight") == f"layers.{i}"
    # Top-level norm and lm_head were never included: resident, no exclusion reason.
    for name in ("norm.weight", "lm_head.weight"):
        assert name in sel.resident_parameters and name not in sel.resident_reasons


def test_submodule_exclude_is_parameter_level() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["layers.*"], ["layers.*.norm"])
    assert sel.units == layer_units()
    for i in range(N_LAYERS):
        assert sel.unit_of(f"layers.{i}.norm.weight") is None
        assert sel.resident_reasons[f"layers.{i}.norm.weight"] == "excluded by 'layers.*.norm'"
        assert sel.unit_of(f"layers.{i}.proj.weight") == f"layers.{i}"
    assert "norm.weight" not in sel.resident_reasons  # top-level norm is not layers.*.norm


def test_head_does_not_match_lm_head() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["*"], ["head"])
    assert "lm_head" in sel.units and "head" not in sel.units
    assert sel.unit_of("lm_head.weight") == "lm_head"


# --- units: ancestor guard, containers ------------------------------------------------------------


@pytest.mark.parametrize("include", [["layers.*", "layers.0.attn"], ["layers.0.attn", "layers.*"]])
def test_ancestor_guard_keeps_the_outer_candidate(include: list[str]) -> None:
    sel = quiet_select(make_spec_model(), include, [])
    assert sel.units == layer_units()
    assert sel.unit_of("layers.0.attn.q.weight") == "layers.0"


def test_inner_candidate_is_a_unit_when_its_ancestor_is_not() -> None:
    sel = quiet_select(make_spec_model(), ["layers.0.attn", "layers.0.attn.q", "layers.1.*"], [])
    assert sel.units == ("layers.0.attn", "layers.1.attn", "layers.1.norm", "layers.1.mlp", "layers.1.shared",
                         "layers.1.proj")  # fmt: skip
    assert "layers.1.scale" in sel.resident_parameters  # held by layers.1 itself, not by a unit


@pytest.mark.parametrize(
    ("include", "units"),
    [
        (["layers"], layer_units()),
        (["class:ModuleList"], layer_units()),  # experts lists sit under layers.N: ancestor guard
        (["layers.1.mlp.experts"], ("layers.1.mlp.experts.0", "layers.1.mlp.experts.1")),
    ],
)
def test_containers_are_replaced_by_their_children(include: list[str], units: tuple[str, ...]) -> None:
    assert quiet_select(make_spec_model(), include, []).units == units


def test_class_exclude_on_an_ancestor_removes_its_units() -> None:
    sel = quiet_select(make_spec_model(), ["layers.*.mlp.*"], ["class:MoELayer"])
    # layers.1.mlp (a MoELayer) is no unit, but it is the ancestor of router and experts.N units.
    assert sel.units == ("layers.0.mlp.up", "layers.0.mlp.down", "layers.2.mlp.up", "layers.2.mlp.down")
    assert sel.resident_reasons["layers.1.mlp.experts.0.up.weight"] == "excluded by class:MoELayer"
    assert sel.resident_reasons["layers.3.mlp.router.weight"] == "excluded by class:MoELayer"


def test_name_exclude_on_an_ancestor_removes_its_units() -> None:
    sel = quiet_select(make_spec_model(), ["*"], ["layers"])
    assert sel.units == ("embed", "norm", "head", "lm_head")
    assert sel.resident_reasons["layers.2.scale"] == "excluded by 'layers'"


class Holder(nn.Module):
    """A model whose containers hold parameters directly (ParameterList) and modules (ModuleDict)."""

    def __init__(self) -> None:
        super().__init__()
        self.gains = nn.ParameterList([nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))])
        self.blocks = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        self.empty = nn.LayerNorm(0)  # zero-size parameters: storage pointer 0, must not look tied
        self.empty2 = nn.LayerNorm(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks["b"](self.blocks["a"](x) * self.gains[0] + self.gains[1])


def test_container_parameters_are_resident_and_empty_parameters_are_not_tied() -> None:
    model = Holder()
    sel = quiet_select(model, ["*"], [])
    assert sel.units == ("blocks.a", "blocks.b", "empty", "empty2")
    assert set(sel.resident_parameters) == {"gains.0", "gains.1"}
    assert sel.unit_of("empty.weight") == "empty" and sel.unit_of("empty2.weight") == "empty2"


def test_meta_parameters_are_not_mistaken_for_shared_storage() -> None:
    with torch.device("meta"):
        model = make_spec_model()
    sel = quiet_select(model, ["*"], [])
    assert sel.resident_parameters == ()
    assert len(sel.streamed_parameters()) == len(params_of(model))


# --- tied and shared weights ----------------------------------------------------------------------


def tied_model() -> nn.Module:
    model = make_spec_model()
    model.lm_head.weight = model.embed.weight  # both (vocab, dim)
    return model


def test_tied_weights_across_units_are_resident_with_reason() -> None:
    model = tied_model()
    sel = quiet_select(model, ["*"], [])
    assert sel.resident_reasons == {"embed.weight": "tied: also used by lm_head"}
    assert sel.resident_parameters == ("embed.weight",)
    assert sel.units == (*layer_units(), "norm", "head")  # embed and lm_head have nothing else
    assert_partition(model, sel)


def test_tied_weight_reached_from_outside_every_unit_streams_with_its_holder_as_an_alias() -> None:
    """A module outside every unit holding a unit's weight (tied) becomes the unit's alias (see [Note:
    tied aliases] in phases/discovery.py); a holder with units inside it (here the root) cannot be one, and
    the weight stays resident."""
    sel = quiet_select(tied_model(), ["layers.*", "lm_head"], [])
    assert sel.units == (*layer_units(), "lm_head")
    assert sel.unit_parameters["lm_head"] == ("embed.weight",)  # named as named_parameters names it
    assert sel.unit_aliases == {"lm_head": ("embed",)} and not sel.resident_reasons

    model = tied_model()
    model.shortcut = model.embed.weight  # the root holds it too: its calls span every unit's
    sel = quiet_select(model, ["layers.*", "lm_head"], [])
    assert sel.units == layer_units() and not sel.unit_aliases
    assert sel.resident_reasons == {"shortcut": "tied: also used by <root>, which holds offload units"}


def test_distinct_parameters_sharing_one_storage_are_resident() -> None:
    model = make_spec_model()
    base = torch.randn(2, 64, 32)
    model.embed.weight = nn.Parameter(base[0])
    model.lm_head.weight = nn.Parameter(base[1])
    sel = quiet_select(model, ["*"], [])
    assert sel.resident_reasons["embed.weight"] == "tied: also used by lm_head"
    assert sel.resident_reasons["lm_head.weight"] == "tied: also used by embed"
    assert "embed" not in sel.units and "lm_head" not in sel.units


def test_parameter_shared_inside_one_unit_streams_once() -> None:
    model = make_spec_model()
    model.layers[0].attn.k.weight = model.layers[0].attn.q.weight
    sel = quiet_select(model, ["layers.*"], [])
    assert sel.unit_of("layers.0.attn.q.weight") == "layers.0"
    assert "layers.0.attn.k.weight" not in [*sel.streamed_parameters(), *sel.resident_parameters]
    assert_partition(model, sel)


def test_module_shared_by_two_units_keeps_its_parameters_resident() -> None:
    model = make_spec_model()
    model.layers[1].attn = model.layers[0].attn
    sel = quiet_select(model, ["layers.*"], [])
    assert sel.resident_reasons["layers.0.attn.q.weight"] == "tied: also used by layers.1.attn.q"
    assert sel.unit_of("layers.1.norm.weight") == "layers.1"
    assert_partition(model, sel)


# --- a real transformers model --------------------------------------------------------------------


def tiny_llama() -> nn.Module:
    pytest.importorskip("transformers")
    from real_models import tiny_llama as build

    return build(layers=2)


def test_llama_include_star() -> None:
    model = tiny_llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sel = quiet_select(model, ["*"], [])
    # `model` holds nearly every byte, so it is split: the whole model is never one unit. lm_head holds
    # only the tied weight, so it is dropped.
    assert sel.units == ("model.layers.0", "model.layers.1", "model.norm")
    assert sel.resident_parameters == ("model.embed_tokens.weight",)
    assert sel.resident_reasons == {"model.embed_tokens.weight": "tied: also used by lm_head"}
    assert_partition(model, sel)


def test_module_holding_most_of_the_model_is_split_into_children() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["*"], [])
    assert "layers" not in sel.units and "layers.0" in sel.units
    wrapper = torch.nn.Sequential(model)  # "*" selects "0", the whole spec model: split it
    sel = quiet_select(wrapper, ["*"], [])
    assert "0" not in sel.units and "0.layers.0" in sel.units


def test_llama_layers() -> None:
    model = tiny_llama()
    sel = quiet_select(model, ["model.layers.*"], [])
    assert sel.units == ("model.layers.0", "model.layers.1")
    assert set(sel.resident_parameters) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert sel.unit_of("model.layers.1.mlp.down_proj.weight") == "model.layers.1"
    assert_partition(model, sel)


# --- warnings and errors --------------------------------------------------------------------------


def test_unmatched_include_warns_with_suggestions() -> None:
    with pytest.warns(UserWarning, match=r"include pattern 'layer\.\*' matches nothing") as record:
        sel = select(make_spec_model(), ["layers.*", "layer.*"], [])
    assert len(record) == 1
    assert "'layers.*'" in str(record[0].message)  # a real, pattern-shaped suggestion
    assert sel.units == layer_units()


def test_unmatched_exclude_warns_with_suggestions() -> None:
    model = make_spec_model()
    with pytest.warns(UserWarning) as record:
        select(model, ["layers.*"], ["*.scales", "class:SharedExpertMlp", "class:Nope9"])
    messages = [str(w.message) for w in record]
    assert len(messages) == 3
    assert "exclude pattern '*.scales' matches nothing" in messages[0] and "'*.scale'" in messages[0]
    assert "'class:SharedExpertMLP'" in messages[1]
    assert "class:Nope9" in messages[2]


def test_include_matching_only_the_root_warns() -> None:
    with pytest.warns(UserWarning, match="never an offload unit"):
        select(make_spec_model(), ["class:SpecModel", "layers.*"], [])


def test_patterns_that_match_something_do_not_warn() -> None:
    # An exclude matching a module outside every unit, or only a parameter, is not "nothing".
    quiet_select(make_spec_model(), ["layers.*"], ["lm_head", "*.scale", "class:SharedExpertMLP"])


def test_nothing_selected_raises_a_helpful_error() -> None:
    model = make_spec_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SelectionError) as info:
            select(model, ["blocks.*"], [])
    message = str(info.value)
    assert "['blocks.*']" in message
    assert f"{len(list(model.modules()))} modules" in message
    assert "'embed'" in message and "'lm_head'" in message
    assert "'layers.*'" in message  # a pattern that would work


def test_everything_excluded_raises() -> None:
    with pytest.raises(SelectionError, match="keep every parameter resident"):
        quiet_select(make_spec_model(), ["layers.*"], ["layers.*"])
    with pytest.raises(SelectionError):  # a class exclude on the root covers every unit
        quiet_select(make_spec_model(), ["*"], ["class:SpecModel"])
    with pytest.raises(SelectionError):
        quiet_select(make_spec_model(), [], [])


@pytest.mark.parametrize(
    ("include", "exclude"),
    [("layers.*", []), (["layers .*"], []), (["*"], ["bad:Linear"]), (["*"], ["class:"]), ([3], [])],
)
def test_malformed_patterns_raise(include: object, exclude: object) -> None:
    with pytest.raises(SelectionError):
        select(make_spec_model(), include, exclude)  # type: ignore[arg-type]


# --- the Selection object and the model -----------------------------------------------------------


def test_selection_accessors_and_repr() -> None:
    model = make_spec_model()
    sel = quiet_select(model, ["layers.*", "lm_head"], ["*.scale"])
    assert sel.streamed_parameters() == tuple(n for u in sel.units for n in sel.unit_parameters[u])
    assert sel.streamed_parameters()[-1] == "lm_head.weight"
    # Within a unit: named_parameters order.
    order = params_of(model)
    assert list(sel.unit_parameters["layers.0"]) == [n for n in order if n in sel.unit_parameters["layers.0"]]
    assert sel.unit_of("layers.0.scale") is None and sel.unit_of("no.such") is None
    assert sel.resident_parameters == tuple(n for n in order if sel.unit_of(n) is None)
    text = repr(sel)
    assert "5 units" in text and "layers.0" in text and len(text) < 200


def test_select_leaves_the_model_unchanged() -> None:
    model = tied_model()
    before = {k: (v, v.data_ptr(), v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    modules = [(n, id(m), m.training) for n, m in model.named_modules()]
    global_hooks = len(torch.nn.modules.module._global_forward_pre_hooks)
    quiet_select(model, ["*"], ["*.norm", "class:MoELayer"])
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for key, (tensor, pointer, copy) in before.items():
        assert after[key] is tensor and tensor.data_ptr() == pointer and torch.equal(tensor, copy)
    assert [(n, id(m), m.training) for n, m in model.named_modules()] == modules
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == global_hooks


# --- property: any mix of patterns gives a sound partition ----------------------------------------

INCLUDES = ["*", "layers.*", "layers", "layers.0", "layers.*.attn", "layers.1.mlp.experts", "embed", "head",
            "lm_head", "norm", "layers.0.attn", "class:Linear", "class:MoELayer", "class:torch.nn.*.Linear",
            "class:ModuleList", "nope", "layers.99", "class:Nope"]  # fmt: skip
EXCLUDES = ["*.scale", "*.norm", "layers.*.norm", "head", "lm_head", "layers.1", "layers", "*.weight",
            "class:SharedExpertMLP", "class:MoELayer", "class:torch.nn.*.Linear", "class:Linear",
            "layers.0.attn.q.bias", "nothing", "class:Missing", "*.experts.*"]  # fmt: skip
MODELS = {False: make_spec_model(), True: tied_model()}


def runs_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


@settings(max_examples=150, deadline=None)
@given(
    include=st.lists(st.sampled_from(INCLUDES), max_size=4),
    exclude=st.lists(st.sampled_from(EXCLUDES), max_size=4),
    tied=st.booleans(),
)
def test_any_patterns_give_a_sound_partition(include: list[str], exclude: list[str], tied: bool) -> None:
    model = MODELS[tied]
    modules = dict(model.named_modules())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            sel = select(model, include, exclude)
        except SelectionError:
            return
    assert_partition(model, sel)
    assert sel.units and all(sel.unit_parameters[u] for u in sel.units)
    for unit in sel.units:
        assert runs_forward(modules[unit])
        assert not any(unit.startswith(other + ".") for other in sel.units)  # units never nest
        # The unit, or an ancestor reached only through pure containers, matched an include.
        parts = unit.split(".")
        reached = False
        for i in range(len(parts), 0, -1):
            path = ".".join(parts[:i])
            if any(match_include(p, path, type(modules[path])) for p in include):
                reached = True
                break
            if runs_forward(modules[".".join(parts[: i - 1])]) and i > 1:
                break  # a real module in between: it would have been the unit
        assert reached, unit
    for name in sel.streamed_parameters():
        assert not any(match_exclude(p, name, None) for p in exclude), name
        parts = name.split(".")
        for i in range(len(parts)):  # every enclosing module, the root included
            path = ".".join(parts[:i])
            assert not any(match_exclude(p, path, type(modules[path])) for p in exclude), (name, path)
    for aliases in sel.unit_aliases.values():  # holders outside every unit, with none inside
        for alias in aliases:
            assert alias and not any(alias == u or alias.startswith(u + ".") for u in sel.units)
            assert not any(u.startswith(alias + ".") for u in sel.units)
    if tied:  # embed and lm_head hold one weight: it streams with one of them, the other its alias
        unit = sel.unit_of("embed.weight")
        if unit is not None:
            assert unit in ("embed", "lm_head")
            assert sel.unit_aliases[unit] == (({"embed", "lm_head"} - {unit}).pop(),)


def test_a_holder_of_two_units_tied_weights_is_no_alias_and_those_weights_stay_resident() -> None:
    """A module outside every unit holding weights of two units cannot stand for both (a call of it would
    load only one of them): those weights stay resident (found by review: the call read the arena).
    Another path to a unit's own module is no alias of it either."""

    class Pair(nn.Module):
        def __init__(self, first: nn.Parameter, second: nn.Parameter) -> None:
            super().__init__()
            self.a, self.b = first, second

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.a + x @ self.b

    model = make_spec_model()
    model.pair = Pair(model.layers[0].attn.q.weight, model.layers[2].attn.q.weight)
    sel = quiet_select(model, ["layers.*"], [])
    assert "layers.0" not in sel.unit_aliases and "layers.2" not in sel.unit_aliases
    assert sel.unit_of("layers.0.attn.q.weight") is None and sel.unit_of("layers.2.attn.q.weight") is None
    assert "which holds weights of layers.2 too" in sel.resident_reasons["layers.0.attn.q.weight"]

    model = make_spec_model()
    model.again = model.layers[1]  # a second path to a unit's module
    sel = quiet_select(model, ["layers.*"], [])
    assert not sel.unit_aliases and sel.unit_of("layers.1.attn.q.weight") == "layers.1"
