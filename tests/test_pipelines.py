"""One offload() call for a whole diffusers pipeline: a tiny two-expert Wan2.2 text-to-video pipeline
(UMT5 text encoder, two transformers, Wan VAE run through ``vae.decode``) on the CPU engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import install_placement
from flextensor.api import engine_of
from flextensor.errors import (
    ConfigError,
    NotOffloadedError,
    ProfileError,
    SelectionError,
    UnsupportedOperationError,
)
from flextensor.hooks.functions import input_signature
from flextensor.host.packs import pack_layout
from flextensor.pipelines.configs import default_unit_patterns
from flextensor.pipelines.methods import CALL_END_METHOD, REFUSED_METHODS
from flextensor.pipelines.pipeline import pipeline_of
from flextensor.plan.layout import minimal_arena_bytes
from flextensor.weights.selection import select

pytest.importorskip("diffusers")
from real_models import run_wan_pipeline, tiny_wan_pipeline

COMPONENTS = ("vae", "text_encoder", "transformer", "transformer_2")


def modules_of(pipe) -> dict[str, nn.Module]:
    return {name: getattr(pipe, name) for name in COMPONENTS}


def tightest_budget(pipe) -> int:
    """Two of the largest units in flight of the component that needs most: every unit of that
    component streams, and it fits beside no other (the tiny Wan pipeline's VAE; its two transformers,
    whose blocks are much smaller, fit together). Of a pipeline not offloaded."""
    needs = []
    modules = pipe.values() if isinstance(pipe, dict) else modules_of(pipe).values()
    for module in modules:
        selection = select(module, default_unit_patterns(module), ())
        params = dict(module.named_parameters())
        sizes = [
            pack_layout([(n, params[n]) for n in selection.unit_parameters[u]])[1] for u in selection.units
        ]
        needs.append(2 * minimal_arena_bytes(sizes))
    return max(needs)


@torch.no_grad()
def run_until_steady(pipe) -> None:
    """Generations until every component is steady: two, or up to two more when a busy machine made
    profiling samples disagree (profiling.EXTRA_FORWARDS)."""
    for _ in range(4):
        run_wan_pipeline(pipe)
        if flextensor.phase(pipe) == "inference":
            return
    raise AssertionError(f"not steady after 4 generations: {flextensor.phase(pipe)}")


def offloaded_pipeline(**fields) -> object:
    pipe = tiny_wan_pipeline()
    fields.setdefault("gpu_memory_budget", tightest_budget(pipe))
    flextensor.offload(pipe, flextensor.OffloadConfig(device="cpu", **fields))
    return pipe


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    with torch.no_grad():
        return run_wan_pipeline(tiny_wan_pipeline())


@torch.no_grad()
def test_one_call_offloads_every_component_and_generations_are_bitwise(reference: torch.Tensor) -> None:
    pipe = offloaded_pipeline()
    for name, module in modules_of(pipe).items():
        assert flextensor.offload_units(module), name  # every component is offloaded
    outputs = [run_wan_pipeline(pipe) for _ in range(2)]
    run_until_steady(pipe)
    outputs.append(run_wan_pipeline(pipe))
    assert all(flextensor.phase(m) == "inference" for m in modules_of(pipe).values())
    assert all(torch.equal(out, reference) for out in outputs)
    # The VAE runs through vae.decode only, and has a plan like the others.
    assert any(s.startswith("method=decode") for sig in flextensor.status(pipe.vae).plans for s in sig)
    report = flextensor.report(pipe)
    assert set(report.components) == set(COMPONENTS) and "== transformer_2" in str(report)


@torch.no_grad()
def test_components_share_one_budget_by_giving_memory_back_in_turn(reference: torch.Tensor) -> None:
    pipe = offloaded_pipeline()
    run_until_steady(pipe)
    pipeline = pipe._flextensor_pipeline
    before = pipeline.vacated
    assert torch.equal(run_wan_pipeline(pipe), reference)
    # Steady generations still hand the memory on: text encoder -> transformer -> transformer_2 -> VAE.
    assert pipeline.vacated - before >= 3
    budget = pipeline.budget_bytes
    held = sum(flextensor.status(m).device_bytes_held for m in modules_of(pipe).values())
    assert held <= budget, (held, budget)  # only the VAE, which ran last, holds device memory now


@torch.no_grad()
def test_pipe_to_a_dtype_is_refused_before_any_component_changes() -> None:
    pipe = offloaded_pipeline()
    dtypes = {n: next(m.parameters()).dtype for n, m in modules_of(pipe).items()}
    with pytest.raises(UnsupportedOperationError, match="nothing was converted"):
        pipe.to(torch.float16)
    assert {n: next(m.parameters()).dtype for n, m in modules_of(pipe).items()} == dtypes
    assert pipe.to("cpu") is pipe  # the device it streams to already: a no-op
    with pytest.raises(UnsupportedOperationError, match="enable_model_cpu_offload"):
        pipe.enable_model_cpu_offload()


@torch.no_grad()
def test_release_gives_back_a_plain_pipeline(reference: torch.Tensor) -> None:
    pipe = offloaded_pipeline()
    run_wan_pipeline(pipe)
    flextensor.release(pipe)
    with pytest.raises(NotOffloadedError):
        flextensor.phase(pipe)
    for module in modules_of(pipe).values():
        with pytest.raises(NotOffloadedError):
            flextensor.phase(module)
    replaced = {"to", CALL_END_METHOD, *REFUSED_METHODS}
    assert not replaced & set(pipe.__dict__), set(pipe.__dict__) & replaced
    assert torch.equal(run_wan_pipeline(pipe), reference)


@torch.no_grad()
def test_releasing_one_component_is_refused_and_the_pipeline_keeps_working(reference: torch.Tensor) -> None:
    """A component shares the pipeline's budget and hooks: released alone, the pipeline could neither
    generate nor be released. Refused before anything changes; the pipeline is released whole."""
    pipe = offloaded_pipeline()
    run_wan_pipeline(pipe)
    with pytest.raises(UnsupportedOperationError, match=r"'transformer' of .*release the pipeline"):
        flextensor.release(pipe.transformer)
    assert flextensor.phase(pipe.transformer) in ("discovery", "profiling", "inference")
    assert torch.equal(run_wan_pipeline(pipe), reference)
    flextensor.release(pipe)
    assert torch.equal(run_wan_pipeline(pipe), reference)


@torch.no_grad()
def test_release_puts_back_what_another_library_patched_on_the_instance(reference: torch.Tensor) -> None:
    pipe = tiny_wan_pipeline()
    calls: list[str] = []
    original = pipe.maybe_free_model_hooks

    def patched() -> None:
        calls.append("patched")
        original()

    pipe.maybe_free_model_hooks = patched
    flextensor.offload(pipe, flextensor.OffloadConfig(device="cpu", gpu_memory_budget=tightest_budget(pipe)))
    run_wan_pipeline(pipe)
    assert calls == ["patched"]  # flextensor's watch runs it
    flextensor.release(pipe)
    assert pipe.__dict__["maybe_free_model_hooks"] is patched
    assert torch.equal(run_wan_pipeline(pipe), reference)
    assert calls == ["patched", "patched"]


def test_patterns_name_their_component_and_others_get_their_blocks_and_large_modules() -> None:
    pipe = offloaded_pipeline(include_patterns=["transformer.blocks.0"], gpu_memory_budget=None)
    assert flextensor.offload_units(pipe.transformer) == ["blocks.0"]
    # condition_embedder holds more than an eighth of a block; patch_embedding and proj_out less
    assert flextensor.offload_units(pipe.transformer_2) == ["condition_embedder", "blocks.0", "blocks.1"]
    assert flextensor.offload_units(pipe.text_encoder) == ["encoder.block.0", "encoder.block.1"]
    small = ["scale_shift_table", "patch_embedding.weight", "patch_embedding.bias", "proj_out.weight"]
    assert flextensor.resident_parameters(pipe.transformer_2) == [*small, "proj_out.bias"]


def test_a_pattern_without_a_component_name_is_refused() -> None:
    pipe = tiny_wan_pipeline()
    with pytest.raises(ConfigError, match="names no component"):
        flextensor.offload(pipe, flextensor.OffloadConfig(device="cpu", include_patterns=["blocks.*"]))
    assert not hasattr(pipe, "_flextensor_pipeline")


def test_a_component_that_fails_releases_those_offloaded_before_it() -> None:
    pipe = tiny_wan_pipeline()
    before = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in modules_of(pipe).items()}
    config = flextensor.OffloadConfig(device="cpu", include_patterns=["transformer_2.nothing.*"])
    with pytest.warns(UserWarning), pytest.raises(SelectionError):
        flextensor.offload(pipe, config)
    for name, module in modules_of(pipe).items():
        with pytest.raises(NotOffloadedError):
            flextensor.phase(module)
        after = module.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before[name].items()), name
    assert not hasattr(pipe, "_flextensor_pipeline")


def test_one_profile_file_restarts_every_component_in_steady_state(reference: torch.Tensor, tmp_path) -> None:
    pipe = offloaded_pipeline()
    run_until_steady(pipe)
    assert flextensor.phase(pipe) == "inference"
    path = tmp_path / "wan.ftprofile.json"
    flextensor.save_profile(pipe, path)
    budget = tightest_budget(tiny_wan_pipeline())  # an offloaded pipeline's weights are not all there
    flextensor.release(pipe)

    again = offloaded_pipeline(gpu_memory_budget=budget, profile=str(path))
    assert flextensor.phase(again) == "inference"  # before its first call: nothing to learn
    for name, module in modules_of(again).items():
        assert flextensor.status(module).plan is not None, name
    with torch.no_grad():
        outputs = [run_wan_pipeline(again) for _ in range(2)]
    for output in outputs:
        assert torch.equal(output, reference)
    assert flextensor.phase(again) == "inference"


def test_a_pipeline_profile_for_another_setup_is_refused_and_the_pipeline_left_as_it_was(tmp_path) -> None:
    pipe = offloaded_pipeline()
    run_until_steady(pipe)
    path = tmp_path / "wan.ftprofile.json"
    flextensor.save_profile(pipe, path)
    flextensor.release(pipe)

    other = tiny_wan_pipeline()
    fewer = {name: getattr(other, name) for name in ("transformer", "transformer_2", "vae")}
    with pytest.raises(ProfileError, match="components"):  # checked before any component is offloaded
        flextensor.offload(fewer, flextensor.OffloadConfig(device="cpu", profile=str(path)))

    weights = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in modules_of(other).items()}
    config = flextensor.OffloadConfig(
        device="cpu", include_patterns=["transformer.blocks.0"], profile=str(path)
    )
    with pytest.raises(ProfileError, match="patterns"):  # found once the transformer is offloaded
        flextensor.offload(other, config)
    with pytest.raises(NotOffloadedError):
        flextensor.phase(other)
    for name, module in modules_of(other).items():  # every component offloaded before was released
        with pytest.raises(NotOffloadedError):
            flextensor.status(module)
        state = module.state_dict()
        assert all(torch.equal(state[k], v) for k, v in weights[name].items()), name


def test_model_and_pipeline_profiles_are_not_taken_for_each_other(tmp_path) -> None:
    pipe = offloaded_pipeline()
    run_until_steady(pipe)
    flextensor.save_profile(pipe, tmp_path / "pipe.json")
    flextensor.save_profile(pipe.transformer, tmp_path / "transformer.json")
    flextensor.release(pipe)
    with pytest.raises(ProfileError, match="one model's profile"):
        offloaded_pipeline(profile=str(tmp_path / "transformer.json"))
    model = tiny_wan_pipeline().transformer
    with pytest.raises(ProfileError, match="whole pipeline's"):
        flextensor.offload(model, flextensor.OffloadConfig(device="cpu", profile=str(tmp_path / "pipe.json")))


def test_saving_a_pipeline_still_learning_says_which_components_must_run() -> None:
    pipe = offloaded_pipeline()
    with pytest.raises(NotOffloadedError, match="transformer"):
        flextensor.save_profile(pipe, "never-written.json")


@torch.no_grad()
def test_a_mapping_of_modules_is_a_pipeline() -> None:
    torch.manual_seed(0)
    parts = {
        "first": nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))),
        "second": nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))),
    }
    x = torch.randn(2, 8)
    expected = parts["second"](parts["first"](x))
    flextensor.offload(
        parts, flextensor.OffloadConfig(device="cpu", include_patterns=["first.*", "second.*"])
    )
    outputs = [parts["second"](parts["first"](x)) for _ in range(3)]
    assert all(torch.equal(out, expected) for out in outputs)
    assert flextensor.phase(parts) == "inference"
    flextensor.release(parts)
    assert torch.equal(parts["second"](parts["first"](x)), expected)


def two_stacks(monkeypatch: pytest.MonkeyPatch, budget: str) -> tuple[dict, object, torch.Tensor]:
    """Two stacks of six layers offloaded as a pipeline (a mapping) under ``budget`` and run until steady,
    the link modelled slow (10 kB/s: a layer's copy takes 1.7 s, which no compute hides, even on a busy
    machine) so that plans keep layers resident where they fit. Returns the mapping, a
    function running one "generation" through both, and its expected output."""
    from flextensor import api
    from flextensor.plan.measurements import LinkModel

    real_probe = api.probe_links
    monkeypatch.setattr(
        api, "probe_links", lambda store, arena: (LinkModel.constant(1e4), real_probe(store, arena)[1])
    )
    torch.manual_seed(0)
    parts = {name: nn.Sequential(*(nn.Linear(64, 64) for _ in range(6))) for name in ("first", "second")}
    x = torch.randn(2, 64)
    expected = parts["second"](parts["first"](x))
    patterns = ["first.*", "second.*"]
    flextensor.offload(
        parts, flextensor.OffloadConfig(device="cpu", include_patterns=patterns, gpu_memory_budget=budget)
    )

    def generate() -> torch.Tensor:
        return parts["second"](parts["first"](x))

    for _ in range(5):
        assert torch.equal(generate(), expected)
    assert flextensor.phase(parts) == "inference"
    return parts, generate, expected


@torch.no_grad()
def test_a_component_plans_again_when_the_memory_outside_it_grew(monkeypatch: pytest.MonkeyPatch) -> None:
    """A component plans in the first generation; by a later one its caller may hold more on the device
    (the last generation's frames): before its step it plans again when its plan would no longer fit the
    budget beside what is there now. The allocator's counters are the CUDA ones: on the CPU engine the
    memory outside the first component is faked."""
    parts, generate, expected = two_stacks(monkeypatch, "1MiB")
    engine = engine_of(parts["first"])
    planned = engine.current
    assert len(planned.plan.resident) == 6  # room for all
    limit = engine.policy.memory_limit()
    outside = planned.measurements.baseline_bytes + (limit - planned.plan.predicted_peak_bytes) + 4096
    monkeypatch.setattr(
        engine.store.runtime, "memory_allocated", lambda: outside + engine.store.device_bytes_held()
    )
    assert torch.equal(generate(), expected)
    again = engine.current
    assert again is not planned and again.measurements.baseline_bytes == outside
    assert again.plan.predicted_peak_bytes <= limit and again.plan.streamed  # less room: some stream
    assert torch.equal(generate(), expected)
    assert engine.current is again  # planned once: what is outside did not grow again
    # A profile saved now is the measured one: the next run plans again only if its caller holds as much.
    from flextensor.profiles.reuse import snapshot_profile

    saved = snapshot_profile(engine)
    assert saved.measurements.baseline_bytes == planned.measurements.baseline_bytes
    assert saved.plan.resident == planned.plan.resident
    # The caller freed it again: the room comes back, down to the outside first measured.
    monkeypatch.setattr(
        engine.store.runtime,
        "memory_allocated",
        lambda: planned.measurements.baseline_bytes + engine.store.device_bytes_held(),
    )
    assert torch.equal(generate(), expected)
    back = engine.current
    assert back is not again and back.measurements.baseline_bytes == planned.measurements.baseline_bytes
    assert back.crowded_bytes == 0 and back.plan.resident == planned.plan.resident
    assert torch.equal(generate(), expected)
    assert engine.current is back
    flextensor.release(parts)


@torch.no_grad()
def test_components_that_fit_together_beside_the_callers_tensors_stay_laid_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the other components hold is the pipeline's to count, not part of a component's outside: two
    components that fit together beside the caller's tensors keep their layouts generation after
    generation (counted twice, they made each other give memory back at every step); once the caller
    holds more, they take turns, and nothing plans again while each fits alone. The allocator's
    counters are faked on the CPU engine (allocated = caller + what the components hold)."""
    parts, generate, expected = two_stacks(monkeypatch, "300KiB")
    engines = [engine_of(parts["first"]), engine_of(parts["second"])]
    plans = [e.current for e in engines]
    caller = [1000]

    def allocated() -> int:
        return caller[0] + sum(e.store.device_bytes_held() for e in engines)

    for engine in engines:
        monkeypatch.setattr(engine.store.runtime, "memory_allocated", allocated)
    pipeline = pipeline_of(parts)
    vacated = pipeline.vacated
    for _ in range(5):
        assert torch.equal(generate(), expected)
    assert pipeline.vacated == vacated  # both fit beside the caller's 1000 bytes: nobody gives back
    caller[0] = 100_000  # both no longer fit beside it, each still does alone
    for _ in range(3):
        assert torch.equal(generate(), expected)
    assert pipeline.vacated > vacated
    assert [e.current for e in engines] == plans  # no plan made again
    flextensor.release(parts)


@torch.no_grad()
def test_components_hold_no_device_memory_for_their_units_until_they_run(reference: torch.Tensor) -> None:
    """A component that has not run yet holds no learning layout: when the text encoder runs first, what
    the transformers would hold is not counted against its budget."""
    pipe = offloaded_pipeline()
    held = {n: flextensor.status(m).device_bytes_held for n, m in modules_of(pipe).items()}
    assert held == dict.fromkeys(COMPONENTS, 0)
    pipe.encode_prompt("a cat runs in the snow", max_sequence_length=8)
    assert flextensor.status(pipe.text_encoder).device_bytes_held > 0
    assert flextensor.status(pipe.transformer).device_bytes_held == 0
    assert torch.equal(run_wan_pipeline(pipe), reference)


def test_offloading_a_pipeline_holds_no_more_device_memory_than_a_generation(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """offload(pipe) gives each component's learning layout back before it offloads the next (and, from a
    profile, its plan's layout too): the device holds one component's layout at a time, within the
    budget, not every component's at once (on a GPU, a few GB over a one-phase budget for Wan2.2). The
    tightest budget is the VAE's learning layout: the sum would exceed it. (Not bounded by the
    generation's peak: from a profile a busy machine's plan may stream the VAE through a smaller arena
    than the layout it learned in.)"""
    from device_allocations import DeviceAllocations

    pipe = offloaded_pipeline()
    run_until_steady(pipe)
    path = tmp_path / "wan.ftprofile.json"
    flextensor.save_profile(pipe, path)
    flextensor.release(pipe)
    for fields in ({}, {"profile": str(path)}):
        device = DeviceAllocations(monkeypatch)
        pipe = offloaded_pipeline(**fields)
        offloading = device.peak
        assert device.live_bytes() == 0  # every component lays out at its first step
        device.reset_peak()
        with torch.no_grad():
            run_wan_pipeline(pipe)
        assert 0 < offloading <= pipe._flextensor_pipeline.budget_bytes, (fields, offloading)
        assert device.peak > 0
        flextensor.release(pipe)


@torch.no_grad()
def test_a_component_given_back_before_it_ever_ran_still_discovers_first() -> None:
    torch.manual_seed(0)
    parts = {"first": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
             "second": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))}  # fmt: skip
    x = torch.randn(2, 8)
    expected = parts["second"](parts["first"](x))
    config = flextensor.OffloadConfig(device="cpu", include_patterns=["first.*", "second.*"])
    flextensor.offload(parts, config)
    phases = []
    for _ in range(5):
        out = parts["second"](parts["first"](x))
        phases.append(flextensor.phase(parts["second"]))
        assert torch.equal(out, expected)
    # Its first call discovered (then it profiles): a layout given back must not skip discovery.
    assert phases[0] == "profiling" and phases[-1] == "inference", phases
    flextensor.release(parts)


class EmbeddingThenBlocks(nn.Module):
    """A text encoder's shape: a token embedding over a large vocabulary, then small repeated layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 128)  # four layers' worth of weights
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


@torch.no_grad()
def test_a_large_module_outside_the_blocks_streams_as_a_unit_of_its_own() -> None:
    """Outside the repeated blocks, a module holding at least an eighth of a block's weights (here a token
    embedding over a large vocabulary, four layers' worth) is a unit too, instead of staying on the
    device for good."""
    torch.manual_seed(0)
    encoder = EmbeddingThenBlocks().eval()
    assert default_unit_patterns(encoder) == ("layers.*", "embed")
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = encoder(ids)
    parts = {"text_encoder": encoder}
    budget = tightest_budget(parts)
    flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", gpu_memory_budget=budget))
    for _ in range(4):
        assert torch.equal(encoder(ids), expected)
    status = flextensor.status(encoder)
    assert status.phase == "inference" and status.streamed  # under the tightest budget
    assert "embed" in flextensor.offload_units(encoder)
    flextensor.release(parts)


@torch.no_grad()
def test_a_pipeline_that_ran_before_is_offloaded(reference: torch.Tensor) -> None:
    # A run leaves an empty diffusers hook registry on the transformers (their cache_context): no hook.
    pipe = tiny_wan_pipeline()
    assert torch.equal(run_wan_pipeline(pipe), reference)
    flextensor.offload(pipe, flextensor.OffloadConfig(device="cpu", gpu_memory_budget=tightest_budget(pipe)))
    assert torch.equal(run_wan_pipeline(pipe), reference)


def test_a_list_of_one_block_makes_that_block_a_unit_not_its_layers() -> None:
    """LTX-2's connectors hold one transformer block each: its feed-forward list must not become the units
    (tiny pieces of one block), the block must."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(8, 8)
            self.ff = nn.ModuleList([nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)])

    class Connector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer_blocks = nn.ModuleList([Block()])
            self.norm = nn.LayerNorm(8)

    assert default_unit_patterns(Connector()) == ("transformer_blocks.*",)  # its norm is small


@torch.no_grad()
def test_a_torch_profiler_sees_what_a_switch_between_components_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Components that take turns give their memory back and lay out again at each switch: under a torch
    profiler those appear as named ranges (vacate, lay_out, one upload per resident unit), so a trace
    shows where a pipeline's time between its phases goes."""
    parts, generate, expected = two_stacks(monkeypatch, "300KiB")
    engines = [engine_of(parts["first"]), engine_of(parts["second"])]
    for engine in engines:  # the caller holds enough that the two no longer fit together
        monkeypatch.setattr(
            engine.store.runtime,
            "memory_allocated",
            lambda: 100_000 + sum(e.store.device_bytes_held() for e in engines),
        )
    assert torch.equal(generate(), expected)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert torch.equal(generate(), expected)
    names = {event.name for event in prof.events()}
    assert "flextensor.vacate" in names, names
    assert names & {"flextensor.lay_out", "flextensor.lay_out_ahead"}, names
    assert {f"flextensor.upload {i}" for i in range(6)} <= names, names
    flextensor.release(parts)


def _tied_text_encoder() -> nn.Module:
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    return UMT5EncoderModel(
        UMT5Config(vocab_size=512, d_model=32, d_kv=8, d_ff=32, num_layers=3, num_heads=2)
    ).eval()


def _after_component() -> nn.Module:
    torch.manual_seed(0)
    return EmbeddingThenBlocks().eval()


@torch.no_grad()
def test_a_text_encoders_tied_embedding_streams_gives_its_memory_back_and_restarts_from_the_profile(
    tmp_path,
) -> None:
    """Wan's UMT5 shape: the token embedding, tied between ``shared`` and ``encoder.embed_tokens``, is a
    unit of the text encoder (``shared`` its alias, see [Note: tied aliases]), so the encoder gives it
    back when the other component runs; one profile file restarts both, bitwise."""
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = _tied_text_encoder()(input_ids=ids).last_hidden_state
    expected_after = _after_component()(ids)

    def parts_now() -> dict[str, nn.Module]:
        return {"text_encoder": _tied_text_encoder(), "after": _after_component()}

    def run(parts: dict[str, nn.Module]) -> None:
        assert torch.equal(parts["text_encoder"](input_ids=ids).last_hidden_state, expected)
        assert torch.equal(parts["after"](ids), expected_after)

    parts = parts_now()
    assert default_unit_patterns(parts["text_encoder"]) == ("encoder.block.*", "encoder.embed_tokens")
    budget = tightest_budget(parts_now())
    flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", gpu_memory_budget=budget))
    assert "shared.weight" in flextensor.offloaded_parameters(parts["text_encoder"])
    held_at_after: list[int] = []
    parts["after"].register_forward_pre_hook(
        lambda module, args: held_at_after.append(flextensor.status(parts["text_encoder"]).device_bytes_held)
    )
    for _ in range(4):
        run(parts)
    assert flextensor.phase(parts) == "inference"
    assert held_at_after[-1] == 0  # given back for "after"
    path = tmp_path / "parts.json"
    flextensor.save_profile(parts, path)
    flextensor.release(parts)

    again = parts_now()
    config = flextensor.OffloadConfig(device="cpu", gpu_memory_budget=budget, profile=str(path))
    flextensor.offload(again, config)
    assert flextensor.phase(again) == "inference"
    for _ in range(2):
        run(again)
    assert flextensor.phase(again) == "inference"
    flextensor.release(again)


def encoder_given_back_with_a_resident_embedding() -> tuple[dict[str, nn.Module], torch.Tensor]:
    """A mapping pipeline under a budget that holds one component at a time, steady, the encoder's plan
    keeping its embedding ``0`` resident (unhooked), the encoder given back for the decoder's step."""
    torch.manual_seed(0)
    parts: dict[str, nn.Module] = {
        "encoder": nn.Sequential(nn.Embedding(64, 32), *(nn.Linear(32, 32) for _ in range(3))),
        "decoder": nn.Sequential(*(nn.Linear(32, 32) for _ in range(4))),
    }
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    config = flextensor.OffloadConfig(
        device="cpu", include_patterns=["encoder.*", "decoder.*"], gpu_memory_budget=tightest_budget(parts)
    )
    flextensor.offload(parts, config)
    with torch.no_grad():
        while flextensor.phase(parts) != "inference":
            parts["decoder"](parts["encoder"](ids))
        install_placement(parts["encoder"], input_signature((ids,), {}), ["0"])
        # Laid out with the embedding resident; laid out again at the end of the decoder's run (the
        # switch at a run's end), then given back when the decoder runs once more than it did.
        parts["decoder"](parts["decoder"](parts["encoder"](ids)))
    encoder = engine_of(parts["encoder"])
    assert encoder.current is not None and "0" in encoder.current.plan.resident
    assert not encoder.laid_out and encoder.units["0"].storage is None
    return parts, ids


@torch.no_grad()
def test_a_component_given_back_reports_its_plan_and_a_resident_unit_called_directly_lays_it_out() -> None:
    """A plan's resident units carry no hooks in steady state. Given back while another component runs,
    they hold placeholders: one called directly then (``get_input_embeddings()(ids)``) is hooked again
    until the next layout, lays the plan out (the other component making room, as for a step) and
    computes with its weights; once its call ends it loses its hooks again."""
    torch.manual_seed(0)
    expected = nn.Embedding(64, 32)  # the same seed: the encoder's embedding
    parts, ids = encoder_given_back_with_a_resident_embedding()
    encoder, decoder = engine_of(parts["encoder"]), engine_of(parts["decoder"])
    # The report describes the plan, not the placeholders of the layout given back.
    given_back = flextensor.report(parts).components["encoder"].to_dict()  # type: ignore[union-attr]
    slots = {row["name"]: (row["placement"], row["slot"]) for row in given_back["units"]}
    assert slots == {"0": ("resident", "resident"), **{str(i): ("streamed", "-") for i in (1, 2, 3)}}
    assert given_back["device_bytes_held"] == 0
    assert decoder.laid_out
    assert torch.equal(parts["encoder"][0](ids), expected(ids))
    assert encoder.laid_out and encoder.units["0"].resident
    assert not decoder.laid_out  # it made room: the budget holds one component at a time
    assert encoder.hooks.running == [] and encoder.units["0"] not in encoder.hooks.hooked_units
    parts["encoder"][1](torch.randn(2, 8, 32))  # an ordinary call by hand, not one nested in the embedding
    assert not encoder.store.nested.seen
    flextensor.release(parts)


@torch.no_grad()
def test_units_called_by_hand_around_a_give_back_do_not_warn_of_a_bypassed_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning that every unit ran outside a call of the model counts the units the plan streams: a
    resident one called after its component was given back is not one of them."""
    parts, ids = encoder_given_back_with_a_resident_embedding()
    hidden = parts["encoder"](ids)  # laid out: the plan streams units 1, 2 and 3
    parts["encoder"][1](hidden)
    parts["encoder"][2](hidden)
    parts["decoder"](hidden)  # the encoder is given back
    with caplog.at_level("WARNING", logger="flextensor"):
        parts["encoder"][0](ids)
    assert "outside a call of the model" not in caplog.text
    flextensor.release(parts)
