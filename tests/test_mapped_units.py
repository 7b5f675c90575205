"""Units read in place from their pinned host packs (``map_embeddings``; see [Note: mapped units] in
store/mapping.py): a UMT5 text encoder's token embedding under the tightest budget, bitwise, holding no
device memory; the plans give its room to other units; what is never mapped; edits, profiles, release;
a whole pipeline. On CUDA (``-m gpu``) the device reads the pack through its mapping."""

from __future__ import annotations

import gc
import logging
import time

import pytest
import torch
from torch import nn

import flextensor
from flextensor.api import engine_of
from flextensor.common.sizes import align_up
from flextensor.pipelines.configs import default_unit_patterns
from flextensor.plan.layout import UNIT_ALIGNMENT

transformers = pytest.importorskip("transformers")

EMBEDDING = "encoder.embed_tokens"


def encoder(device: str = "cpu", layers: int = 4) -> nn.Module:
    """A UMT5 encoder whose token embedding (1 MiB) outweighs each of its layers (162 KiB)."""
    torch.manual_seed(0)
    config = transformers.UMT5Config(
        vocab_size=4096, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_heads=4
    )
    return transformers.UMT5EncoderModel(config).eval().to(device)


def token_ids(device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)


def offloaded(model: nn.Module, device: str = "cpu", **fields: object) -> nn.Module:
    fields.setdefault("map_embeddings", True)
    fields.setdefault("gpu_memory_budget", "2MiB")  # every layer streams
    config = flextensor.OffloadConfig(
        device=device, include_patterns=list(default_unit_patterns(model)), **fields
    )
    return flextensor.offload(model, config)


def hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state


def run_until_steady(model: nn.Module, ids: torch.Tensor, expected: torch.Tensor) -> None:
    for _ in range(4):
        assert torch.equal(hidden(model, ids), expected)
    assert flextensor.phase(model) == "inference"


def slow_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A link of 10 kB/s: the plans keep every unit resident that the budget leaves room for."""
    from flextensor import api
    from flextensor.plan.measurements import LinkModel

    real_probe = api.probe_links
    monkeypatch.setattr(
        api, "probe_links", lambda store, arena: (LinkModel.constant(1e4), real_probe(store, arena)[1])
    )


def test_a_mapped_embedding_holds_no_device_memory_and_stays_bitwise() -> None:
    model, ids = encoder(), token_ids()
    expected = hidden(model, ids)
    weight = model.get_input_embeddings().weight.detach().clone()
    offloaded(model)
    try:
        run_until_steady(model, ids, expected)
        engine, status = engine_of(model), flextensor.status(model)
        unit = engine.units[EMBEDDING]
        assert status.unit(EMBEDDING).mapped and status.unit(EMBEDDING).placement == "resident"
        assert engine.current.plan.mapped == (EMBEDDING,) and EMBEDDING in engine.current.plan.resident
        assert EMBEDDING not in status.streamed
        # Its storage is its pack: its parameters view host memory held once, not a copy of it.
        assert unit.storage.data_ptr() == unit.pack.buffer.data_ptr() and unit.uploads == 0
        layers = sum(engine.units[n].nbytes for n in status.resident if n != EMBEDDING)
        assert status.device_bytes_held == engine.store.arena_bytes() + layers == engine.layout_bytes()
        row = next(r for r in flextensor.report(model).to_dict()["units"] if r["name"] == EMBEDDING)
        assert (row["placement"], row["slot"]) == ("mapped", "host memory")
    finally:
        flextensor.release(model)
    assert torch.equal(model.get_input_embeddings().weight, weight)
    assert torch.equal(hidden(model, ids), expected)


def test_learning_reads_a_mapped_embedding_in_place_too() -> None:
    """Discovery and profiling stream the other units through their arena, sized for the two largest of
    them: the mapped embedding (six times a layer here) stays in place from offload() on."""
    model, ids = encoder(), token_ids()
    expected = hidden(model, ids)
    offloaded(model)
    try:
        engine = engine_of(model)
        unit = engine.units[EMBEDDING]
        layer = max(u.nbytes for u in engine.units.values() if u is not unit)
        arenas = []
        while flextensor.phase(model) != "inference":
            assert unit.storage is not None and unit.storage.data_ptr() == unit.pack.buffer.data_ptr()
            arenas.append(engine.store.arena_bytes())
            assert torch.equal(hidden(model, ids), expected)
        assert len(arenas) >= 2 and max(arenas) <= 2 * align_up(layer, UNIT_ALIGNMENT) < unit.nbytes
        assert unit.uploads == 0
    finally:
        flextensor.release(model)


def test_the_plans_give_a_mapped_units_room_to_other_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget below what the encoder needs with its embedding on the device (streamed, it takes a
    1 MiB slot and its neighbour's) holds it with the embedding mapped, and every layer resident then."""
    from flextensor.errors import BudgetError

    slow_link(monkeypatch)
    ids = token_ids()
    model = encoder()
    expected = hidden(model, ids)
    with pytest.raises(BudgetError, match="take in flight"):  # refused at offload(), the model left alone
        offloaded(model, map_embeddings=False, gpu_memory_budget="1400KiB")
    offloaded(model, gpu_memory_budget="1400KiB")
    try:
        run_until_steady(model, ids, expected)
        engine = engine_of(model)
        plan = engine.current.plan
        assert plan.streamed == () and len(plan.resident) == 5 and plan.mapped == (EMBEDDING,)
        assert flextensor.status(model).device_bytes_held <= 1400 * 2**10
        # What keeping more units resident would need (units first seen nested) counts it no more.
        assert engine._short_to_keep({}) == 0
    finally:
        flextensor.release(model)


def test_an_embedding_tied_to_another_kind_of_module_is_never_mapped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A weight also read by an LM head would be read whole over the link at each call."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(512, 64)
            self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
            self.head = nn.Linear(64, 512, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model, ids = Tied().eval(), torch.randint(0, 512, (2, 8))
    with torch.no_grad():
        expected = model(ids)
    config = flextensor.OffloadConfig(
        device="cpu", include_patterns=["embed", "blocks.*"], map_embeddings=True
    )
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        flextensor.offload(model, config)
    try:
        assert "unit embed is not mapped: head (Linear) reads its weights" in caplog.text
        assert "map_embeddings=True maps nothing" in caplog.text
        assert not any(u.mapped for u in flextensor.status(model).units)
        with torch.no_grad():
            for _ in range(4):
                assert torch.equal(model(ids), expected)
    finally:
        flextensor.release(model)


def test_a_host_budget_that_stages_packs_maps_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Its ring may unpin or stage any pack, so no pack can be read in place."""
    model, ids = encoder(layers=8), token_ids()  # 2.3 MiB of packs: a 2 MiB ring and 0.1 MiB pinned
    expected = hidden(model, ids)
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        offloaded(model, host_memory_budget="2100KiB", gpu_memory_budget="3MiB")
    try:
        assert "maps nothing: a host_memory_budget" in caplog.text
        assert not any(u.mapped for u in flextensor.status(model).units)
        run_until_steady(model, ids, expected)
    finally:
        flextensor.release(model)


def test_an_embedding_read_from_a_checkpoint_is_mapped_once_read(tmp_path, monkeypatch) -> None:
    """offload(weights=...) returns before the packs are read: the embedding's read is waited for, then
    it is mapped (never left unmapped by how fast the read was)."""
    import flextensor.host.checkpoint as checkpoint

    reference, ids = encoder(), token_ids()
    expected = hidden(reference, ids)
    reference.save_pretrained(tmp_path)
    real_read = checkpoint._read_unit

    def slow_read(*args, **kwargs):  # not done when offload() marks the units
        time.sleep(0.2)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "_read_unit", slow_read)
    with torch.device("meta"):
        model = transformers.UMT5EncoderModel(reference.config).eval()
    config = flextensor.OffloadConfig(
        device="cpu", include_patterns=list(default_unit_patterns(model)), map_embeddings=True
    )
    flextensor.offload(model, config, weights=tmp_path)
    try:
        assert flextensor.status(model).unit(EMBEDDING).mapped
        run_until_steady(model, ids, expected)
    finally:
        flextensor.release(model)


def test_an_edit_of_a_mapped_embedding_is_what_the_next_forward_reads() -> None:
    model, ids = encoder(), token_ids()
    reference = encoder()
    offloaded(model)
    try:
        run_until_steady(model, ids, hidden(reference, ids))
        with torch.no_grad():
            reference.get_input_embeddings().weight.mul_(2)
            with flextensor.editing(model) as editable:
                editable.get_input_embeddings().weight.mul_(2)
        assert torch.equal(hidden(model, ids), hidden(reference, ids))
        assert flextensor.status(model).unit(EMBEDDING).mapped
    finally:
        flextensor.release(model)
    assert torch.equal(model.get_input_embeddings().weight, reference.get_input_embeddings().weight)


def test_a_profile_keeps_its_plan_where_the_same_units_are_mapped(tmp_path, caplog) -> None:
    """Reloaded with the same units mapped, the saved plan is the run's from its first forward; without
    mapping, the plan is made again (the saved one counted no device bytes for the embedding)."""
    model, ids = encoder(), token_ids()
    expected = hidden(model, ids)
    path = tmp_path / "umt5.ftprofile.json"
    offloaded(model)
    try:
        run_until_steady(model, ids, expected)
        saved = engine_of(model).current.plan
        flextensor.save_profile(model, path)
    finally:
        flextensor.release(model)
    for mapped in (True, False):
        again = encoder()
        with caplog.at_level(logging.INFO, logger="flextensor"):
            offloaded(again, map_embeddings=mapped, profile=path)
        try:
            assert torch.equal(hidden(again, ids), expected)
            assert flextensor.phase(again) == "inference"
            plan = engine_of(again).current.plan
            assert (plan == saved) is mapped
            assert plan.mapped == ((EMBEDDING,) if mapped else ())
        finally:
            flextensor.release(again)
    assert "planned with other units mapped" in caplog.text


@torch.no_grad()
def test_a_pipelines_text_encoder_embedding_is_mapped() -> None:
    pytest.importorskip("diffusers")
    from real_models import run_wan_pipeline, tiny_wan_pipeline
    from test_pipelines import tightest_budget

    reference = run_wan_pipeline(tiny_wan_pipeline())
    pipe = tiny_wan_pipeline()
    # The tiny encoder's embedding is no unit by default (smaller than an eighth of a layer): made one.
    patterns = ["text_encoder.encoder.block.*", "text_encoder.encoder.embed_tokens"]
    config = flextensor.OffloadConfig(
        device="cpu", gpu_memory_budget=tightest_budget(pipe), map_embeddings=True, include_patterns=patterns
    )
    flextensor.offload(pipe, config)
    try:
        for _ in range(3):
            assert torch.equal(run_wan_pipeline(pipe), reference)
        assert flextensor.status(pipe.text_encoder).unit(EMBEDDING).mapped
        assert not any(u.mapped for u in flextensor.status(pipe.transformer).units)
    finally:
        flextensor.release(pipe)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_device_reads_the_mapped_pack_bitwise() -> None:
    model, ids = encoder("cuda"), token_ids("cuda")
    expected = hidden(model, ids)
    offloaded(model, "cuda", gpu_memory_budget=None)
    try:
        run_until_steady(model, ids, expected)
        engine = engine_of(model)
        unit = engine.units[EMBEDDING]
        assert flextensor.status(model).unit(EMBEDDING).mapped and unit.pack.pinned
        # The pack itself, seen from the device (the same address under unified addressing): no copy.
        assert unit.storage.is_cuda and unit.storage.data_ptr() == unit.pack.buffer.data_ptr()
        kept = unit.storage  # a tensor over the mapping, held past release()
        first_bytes = unit.pack.buffer[:64].clone()
    finally:
        flextensor.release(model)
    gc.collect()
    assert torch.equal(kept[:64].cpu(), first_bytes)  # still page-locked: the device reads it
    assert torch.equal(hidden(model, ids), expected)


@torch.no_grad()
def test_a_pipeline_maps_a_vocabulary_by_default_and_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """A pipeline's components map their token embeddings unless map_embeddings is set: only a
    vocabulary-sized table, and with no warning for the components that have none."""
    from flextensor.store.mapping import VOCABULARY_ROWS

    def pipeline() -> dict[str, nn.Module]:
        torch.manual_seed(0)
        config = transformers.UMT5Config(
            vocab_size=VOCABULARY_ROWS, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2
        )
        encoder = transformers.UMT5EncoderModel(config).eval()
        return {"text_encoder": encoder, "head": nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))}

    ids = torch.randint(0, VOCABULARY_ROWS, (2, 12), generator=torch.Generator().manual_seed(1))

    def generation(parts: dict[str, nn.Module]) -> torch.Tensor:
        return parts["head"](parts["text_encoder"](input_ids=ids).last_hidden_state)

    expected = generation(pipeline())
    for fields, mapped in (({}, True), ({"map_embeddings": False}, False)):
        parts = pipeline()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="flextensor"):
            flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", **fields))
        try:
            for _ in range(4):
                assert torch.equal(generation(parts), expected)
            assert flextensor.status(parts["text_encoder"]).unit(EMBEDDING).mapped is mapped
            assert not any(r.levelno >= logging.WARNING for r in caplog.records), caplog.text
            assert "maps nothing" not in caplog.text  # the head has no vocabulary: no news
        finally:
            flextensor.release(parts)
