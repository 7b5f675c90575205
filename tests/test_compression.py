"""``compression="lossless"``: packs held compressed, loads decoded into the arena, outputs bit for bit (see
[Note: coded packs] in host/coded_packs.py). On a CPU the reference decoder is slower than a memcpy, so no
unit is compressed unless the decode speed is forced up: these tests force it, and the real path runs."""

from __future__ import annotations

import mmap

import pytest
import torch

import flextensor
from flextensor.api import engine_of
from flextensor.common.sizes import align_up
from flextensor.errors import CodecError, ConfigError, UnsupportedOperationError
from flextensor.host.coded_packs import CodedPack
from flextensor.plan.layout import UNIT_ALIGNMENT
from real_models import llama_inputs, tiny_llama
from streaming import streaming_config


def bf16_llama(layers: int = 4) -> torch.nn.Module:
    return tiny_llama(layers=layers, tie=False, hidden=64).to(torch.bfloat16)


def steady(model: torch.nn.Module, inputs: torch.Tensor, forwards: int = 4) -> None:
    with torch.no_grad():
        for _ in range(forwards):
            model(inputs)


def compressed_config(model: torch.nn.Module, **fields: object) -> flextensor.OffloadConfig:
    """Every decoder layer of a Llama streamed and compressed: the tightest budget (two layers in flight)
    plus the two staging slots of the coded loads (each under 0.75 of a layer), no room for a resident
    layer."""
    tightest = streaming_config(model, ["model.layers.*"]).gpu_memory_budget
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    config = streaming_config(model, ["model.layers.*"], compression="lossless", **fields)
    return config.model_copy(update={"gpu_memory_budget": tightest + int(1.5 * layer) + 2 * 4096})


def compressed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` offloaded under :func:`compressed_config`."""
    return flextensor.offload(model, compressed_config(model))


def streams_bit_for_bit(model: torch.nn.Module, reference: torch.nn.Module, forwards: int = 5) -> None:
    """``forwards`` forwards of the offloaded ``model`` reach steady state, each bit for bit
    ``reference``'s."""
    inputs = llama_inputs()
    with torch.no_grad():
        want = reference(inputs).logits
        outs = [model(inputs).logits for _ in range(forwards)]
    assert flextensor.phase(model) == "inference"
    assert all(torch.equal(out, want) for out in outs)


def test_compressed_streaming_is_bit_for_bit(fast_decoder: None) -> None:
    reference = bf16_llama()
    model = compressed(bf16_llama())
    engine = engine_of(model)
    packs = [u.pack for u in engine.units.values()]
    assert all(isinstance(p, CodedPack) for p in packs)
    raw = sum(u.nbytes for u in engine.units.values())
    assert engine.store.host_bytes_held() < 0.8 * raw  # held compressed (random weights: ~0.7)
    streams_bit_for_bit(model, reference)
    plan = engine.current.plan  # type: ignore[union-attr]
    assert plan.streamed and plan.coded == plan.streamed  # every streamed unit loads coded
    assert engine.store.coded_loads is not None and len(engine.store.coded_loads.slots) == 2
    assert engine.policy.planned(engine.current.measurements).decode_bps == 1e15  # type: ignore[union-attr]
    report = flextensor.report(model)
    assert report.decode_gbps == 1e6
    assert all(u.coded_nbytes is not None and u.coded_nbytes < 0.8 * u.nbytes for u in report.units)
    assert "held at 0.7" in str(report) and "staging slots" in str(report)
    assert report.decode_staging_bytes == engine.store.coded_loads.nbytes > 0  # type: ignore[union-attr]


def test_a_default_device_set_by_the_caller_changes_nothing(fast_decoder: None) -> None:
    """vLLM offloads while its device is PyTorch's default one: host tensors (packs, encoder and decoder
    temporaries, the encoder's pinned bounce buffer) must say they are on the CPU. The meta device stands in
    for the GPU: a host tensor made without saying so would be a meta one here."""
    inputs = llama_inputs()
    with torch.no_grad():
        want = bf16_llama()(inputs).logits
    model = bf16_llama()
    with torch.device("meta"), torch.no_grad():
        compressed(model)
        outs = [model(inputs).logits for _ in range(5)]
    assert flextensor.phase(model) == "inference"
    assert all(torch.equal(out, want) for out in outs)
    assert all(isinstance(u.pack, CodedPack) for u in engine_of(model).units.values())


def test_the_weights_read_back_are_the_originals(fast_decoder: None) -> None:
    reference = bf16_llama()
    model = compressed(bf16_llama())
    with torch.no_grad():
        model(llama_inputs())
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    flextensor.release(model)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(got, want), name


def test_a_decoder_slower_than_the_link_compresses_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As on a CPU device with large units: the reference decoder (about 0.2 GB/s) against a memcpy."""
    monkeypatch.setattr("flextensor.store.coded_loads.probe_decode", lambda runtime, pack, destination: 1e6)
    reference = bf16_llama(layers=2)
    with caplog.at_level("INFO", logger="flextensor"):
        model = compressed(bf16_llama(layers=2))
    assert not any(u.pack.coded for u in engine_of(model).units.values())  # type: ignore[union-attr]
    assert "every unit is copied as it is" in caplog.text
    inputs = llama_inputs()
    with torch.no_grad():
        assert torch.equal(model(inputs).logits, reference(inputs).logits)


def test_an_unknown_compression_is_refused() -> None:
    with pytest.raises(ConfigError, match="'off' or 'lossless'"):
        flextensor.OffloadConfig(compression="zstd")


def test_editing_a_compressed_model_is_refused_and_changes_nothing(fast_decoder: None) -> None:
    reference = bf16_llama(layers=2)
    model = compressed(bf16_llama(layers=2))
    inputs = llama_inputs()
    with pytest.raises(UnsupportedOperationError, match="compressed"), flextensor.editing(model):
        pass
    with torch.no_grad():
        assert torch.equal(model(inputs).logits, reference(inputs).logits)


def test_a_pack_built_again_from_device_storage_is_held_compressed_again(fast_decoder: None) -> None:
    """A unit resident in every plan drops its host pack; when its storage goes (here: the device
    memory given back, as a pipeline's component does), the pack is built again, and compressed."""
    reference = bf16_llama()
    model = bf16_llama()
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    config = streaming_config(model, ["model.layers.*"], compression="lossless")
    budget = (
        streaming_config(model, ["model.layers.*"]).gpu_memory_budget + 3 * layer
    )  # room for two residents
    model = flextensor.offload(model, config.model_copy(update={"gpu_memory_budget": budget}))
    engine = engine_of(model)
    engine.policy.plan_for_every_input()  # plans as if the link were the bottleneck: residents
    inputs = llama_inputs()
    with torch.no_grad():
        for _ in range(4):
            model(inputs)
    dropped = [u for u in engine.units.values() if u.pack is None]
    assert dropped  # resident in every plan: the device holds the only copy
    assert engine.vacate() > 0
    assert all(isinstance(u.pack, CodedPack) and u.pack_rebuilds == 1 for u in dropped)
    with torch.no_grad():
        assert torch.equal(model(inputs).logits, reference(inputs).logits)


def test_a_profile_saved_with_compression_starts_the_next_run_compressed(
    fast_decoder: None, tmp_path
) -> None:
    """The profile records each unit's compressed size and the decode speed; a run started from it
    (compressed too) is in steady state at once and still bit for bit."""
    reference = bf16_llama()
    model = compressed(bf16_llama())
    inputs = llama_inputs()
    steady(model, inputs)
    path = tmp_path / "coded.ftprofile.json"
    flextensor.save_profile(model, path)
    saved = engine_of(model).current.measurements  # type: ignore[union-attr]
    assert saved.decode_bps == 1e15 and all(u.coded_nbytes for u in saved.units)
    flextensor.release(model)
    again = bf16_llama()
    again = flextensor.offload(again, compressed_config(again, profile=path))
    assert flextensor.phase(again) == "inference"
    with torch.no_grad():
        assert torch.equal(again(inputs).logits, reference(inputs).logits)
    assert engine_of(again).current.plan.coded  # type: ignore[union-attr]


def test_a_budget_without_room_for_the_staging_slots_streams_uncompressed(
    fast_decoder: None, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tightest budget without compression has no room for the two staging slots: the plan copies
    every unit as it is, the packs are held uncompressed again (warned), outputs stay bit for bit, and a
    run started from the saved profile holds its packs uncompressed too (see [Note: compression yields
    to the budget])."""
    reference = bf16_llama()
    inputs = llama_inputs()
    model = bf16_llama()
    config = streaming_config(model, ["model.layers.*"], compression="lossless")
    with caplog.at_level("WARNING", logger="flextensor"):
        model = flextensor.offload(model, config)
        assert all(isinstance(u.pack, CodedPack) for u in engine_of(model).units.values())  # until the plan
        streams_bit_for_bit(model, reference)
    assert "compression='lossless' is not used" in caplog.text and "more gpu_memory_budget" in caplog.text
    engine = engine_of(model)
    plan = engine.current.plan  # type: ignore[union-attr]
    assert plan.streamed and not plan.coded
    assert not any(isinstance(u.pack, CodedPack) for u in engine.units.values())
    assert engine.store.coded_loads is None and engine.policy.decode_bps is None
    assert engine.current.measurements.decode_bps is None  # type: ignore[union-attr]
    assert flextensor.report(model).decode_gbps is None
    path = tmp_path / "raw.ftprofile.json"
    flextensor.save_profile(model, path)
    flextensor.release(model)

    again = bf16_llama()
    caplog.clear()
    with caplog.at_level("INFO", logger="flextensor"):
        again = flextensor.offload(
            again, streaming_config(again, ["model.layers.*"], compression="lossless", profile=path)
        )
    assert "the packs stay uncompressed" in caplog.text  # not encoded only to be decoded again
    assert "held uncompressed again" not in caplog.text
    assert flextensor.phase(again) == "inference"
    engine = engine_of(again)
    assert not any(isinstance(u.pack, CodedPack) for u in engine.units.values())
    assert not engine.current.plan.coded  # type: ignore[union-attr]
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(again(inputs).logits, reference(inputs).logits)


def test_compressed_streaming_under_torch_compile_is_bit_for_bit(fast_decoder: None) -> None:
    """Whole-model compile: the unit ops load (copy and decode) like the eager hooks."""
    reference = bf16_llama(layers=2)
    model = compressed(bf16_llama(layers=2))
    inputs = llama_inputs()
    with torch.no_grad():
        for _ in range(3):  # learning runs eager
            model(inputs)
        compiled = torch.compile(model)
        outs = [compiled(inputs).logits for _ in range(2)]
        want = torch.compile(reference)(inputs).logits
    assert all(torch.equal(out, want) for out in outs)


def test_a_model_loaded_from_a_checkpoint_is_compressed_once_read(fast_decoder: None, tmp_path) -> None:
    from transformers import LlamaForCausalLM

    reference = bf16_llama()
    reference.save_pretrained(tmp_path / "llama")
    with torch.device("meta"):
        meta = LlamaForCausalLM(reference.config).to(torch.bfloat16).eval()
    model = flextensor.offload(meta, compressed_config(meta), weights=tmp_path / "llama")
    assert all(isinstance(u.pack, CodedPack) for u in engine_of(model).units.values())
    inputs = llama_inputs()
    with torch.no_grad():
        want = reference(inputs).logits
        assert all(torch.equal(model(inputs).logits, want) for _ in range(4))


def test_a_captured_forward_with_coded_loads_joins_the_decode_stream(
    fast_decoder: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bookkeeping of a capture (as in test_cuda_graphs, the engine made to believe a capture runs):
    coded loads inside it wait only on events recorded inside it, the capture joins the decode stream, and
    eager forwards after it get fresh events and stay bit for bit. The GPU test captures for real."""
    from test_cuda_graphs import capture_one

    reference = bf16_llama()
    model = compressed(bf16_llama())
    inputs = llama_inputs()
    steady(model, inputs)
    loads = engine_of(model).store.coded_loads
    assert loads is not None
    before = loads.last_decode
    step = capture_one(model, monkeypatch)
    assert step.joined and loads._in_capture is None and loads.last_decode is not before
    assert len(loads._retired) == 2 * loads.SLOTS + 1
    with torch.no_grad():
        assert torch.equal(model(inputs).logits, reference(inputs).logits)


class MixedDtypes(torch.nn.Module):
    """Layers in bfloat16 (held compressed) around one in float32 (copied as it is)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        dtypes = (torch.bfloat16, torch.float32, *([torch.bfloat16] * 6))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(128, 128).to(dtype) for dtype in dtypes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x.to(layer.weight.dtype)))
        return x.float()


def recorded_waits(monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """(the units whose decode a load waited for, the streams that waited for every decode), recorded."""
    from flextensor.host.coded_packs import CodedLoads

    decoded, fences = [], []
    wait_decoded, fence = CodedLoads.wait_decoded, CodedLoads.fence
    monkeypatch.setattr(
        CodedLoads,
        "wait_decoded",
        lambda self, stream, unit: (decoded.append(unit), wait_decoded(self, stream, unit)),
    )
    monkeypatch.setattr(
        CodedLoads, "fence", lambda self, stream: (fences.append(stream), fence(self, stream))
    )
    return decoded, fences


def test_a_raw_copy_into_a_compressed_units_range_waits_for_its_decode(
    fast_decoder: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode runs on a stream of its own: a raw copy into a range a compressed unit was loaded into
    first waits for that unit's decode (on a GPU it could still be writing it, had the unit not run)."""
    decoded, _ = recorded_waits(monkeypatch)
    reference = MixedDtypes()
    model = MixedDtypes()
    # Two float32 layers in flight (68 KiB each) and two staging slots of a compressed bf16 layer (0.7 of
    # 33 KB, page-aligned): no room left for a resident layer.
    config = streaming_config(model, ["layers.*"], compression="lossless")
    budget = 2 * 68 * 1024 + 2 * 24 * 1024
    model = flextensor.offload(model, config.model_copy(update={"gpu_memory_budget": budget}))
    packs = [type(u.pack).__name__ for u in engine_of(model).units.values()]
    assert packs == ["CodedPack", "UnitPack", *(["CodedPack"] * 6)]
    inputs = torch.randn(4, 128)
    with torch.no_grad():
        want = reference(inputs)
        outs = [model(inputs) for _ in range(5)]
        assert flextensor.phase(model) == "inference"
        decoded.clear()
        outs += [model(inputs) for _ in range(2)]
    assert all(torch.equal(out, want) for out in outs)
    assert len(engine_of(model).current.plan.streamed) == 8  # type: ignore[union-attr]
    # In steady state too: the loads into the ranges the compressed layers were decoded into (the float32
    # layer's among them) waited for those decodes.
    assert decoded and all(u.pack.coded for u in decoded)


def test_loads_in_the_planned_order_wait_only_for_the_decodes_they_overwrite(
    fast_decoder: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In steady state a load waits for the decode of the unit whose range it takes (met already: that
    unit ran), never for every decode issued: that would keep the link idle while the unit loaded just
    before decodes (on the H200 a 306 MB copy took 6.4 ms instead of 5.6)."""
    decoded, fences = recorded_waits(monkeypatch)
    model = compressed(bf16_llama(layers=6))
    inputs = llama_inputs()
    steady(model, inputs, forwards=5)
    assert flextensor.phase(model) == "inference"
    engine = engine_of(model)
    decoded.clear()
    fences.clear()
    steady(model, inputs, forwards=1)
    assert not fences
    assert decoded and set(decoded) <= {u for u in engine.units.values() if not u.resident}


def test_state_dict_of_strided_weights_held_compressed_keeps_their_values(fast_decoder: None) -> None:
    """A weight laid out in another order (a transposed checkpoint) is packed in its own memory order;
    read back from a compressed pack, it has its values and its strides."""

    def strided() -> torch.nn.Module:
        model = MixedDtypes().to(torch.bfloat16)
        for layer in model.layers:
            layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous().t())
        return model

    reference = strided()
    model = strided()
    budget = 2 * 36 * 1024 + 2 * 28 * 1024
    config = streaming_config(model, ["layers.*"], compression="lossless")
    model = flextensor.offload(model, config.model_copy(update={"gpu_memory_budget": budget}))
    assert all(isinstance(u.pack, CodedPack) for u in engine_of(model).units.values())
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value) and state[name].stride() == value.stride(), name


PIECE = 16 * 1024  # bytes of weights per piece in the tests below: a tiny Llama layer is several


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packs cut in pieces of PIECE bytes, for the encoder and for the planner's model of their loads."""
    monkeypatch.setattr("flextensor.host.coded_packs.CODED_PIECE_BYTES", PIECE)
    monkeypatch.setattr("flextensor.plan.measurements.CODED_PIECE_BYTES", PIECE)


def test_a_pack_in_pieces_streams_bit_for_bit_through_slots_of_one_piece(
    fast_decoder: None, small_pieces: None
) -> None:
    """Each unit's compressed pack is cut in pieces, each copied to a staging slot and decoded into its
    part of the range: the two slots hold a piece each, not a unit, so a budget with room for two raw
    layers in flight and two pieces streams every layer compressed (two slots of a whole coded layer
    would not fit), and the outputs and the weights read back are the originals."""
    reference = bf16_llama()
    model = bf16_llama()
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    tightest = streaming_config(model, ["model.layers.*"]).gpu_memory_budget
    config = streaming_config(model, ["model.layers.*"], compression="lossless")
    budget = tightest + 2 * (PIECE + 8192)  # a piece's index, page-aligned
    assert budget < tightest + 2 * 0.7 * layer
    model = flextensor.offload(model, config.model_copy(update={"gpu_memory_budget": budget}))
    engine = engine_of(model)
    packs = [u.pack for u in engine.units.values()]
    assert all(isinstance(p, CodedPack) and len(p.pieces) == -(-p.nbytes // PIECE) > 4 for p in packs)
    streams_bit_for_bit(model, reference, forwards=6)
    plan = engine.current.plan  # type: ignore[union-attr]
    assert plan.coded == plan.streamed == tuple(engine.units)
    assert engine.store.coded_loads is not None
    slot = align_up(max(p.staging_nbytes for p in packs), UNIT_ALIGNMENT)
    assert engine.store.coded_loads.nbytes == 2 * slot <= 2 * (PIECE + 8192)
    state = model.state_dict()
    assert all(torch.equal(state[name], value) for name, value in reference.state_dict().items())


def test_a_load_in_pieces_reuses_its_views_across_forwards(fast_decoder: None, small_pieces: None) -> None:
    """The views a coded load works with (per piece: source, staging slots, destination) are made at a
    unit's first load and reused by every forward after: no per-piece tensor slicing in steady state."""
    model = compressed(bf16_llama())  # 4 layers: the budget cannot keep them all
    inputs = llama_inputs()
    steady(model, inputs, forwards=5)
    loads = engine_of(model).store.coded_loads
    assert loads is not None
    prepared = dict(loads._prepared)
    assert prepared
    steady(model, inputs, forwards=2)
    assert all(loads._prepared[key] is value for key, value in prepared.items())


def test_compressed_packs_the_host_budget_cannot_pin_go_through_the_staging_ring(
    fast_decoder: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a host budget that pins one compressed layer, not two, the other layers' packs stay pageable:
    each piece of theirs goes through the staging ring into a staging slot, then decodes. The plan loads
    them compressed too, and the outputs are bit for bit."""
    from flextensor.host.staging import StagingRing, staging_layout

    through_ring: list[int] = []
    original = StagingRing.copy_from_host
    monkeypatch.setattr(
        StagingRing,
        "copy_from_host",
        lambda self, destination, source, stream: (
            through_ring.append(source.numel()),
            original(self, destination, source, stream),
        ),
    )
    reference = bf16_llama()
    model = bf16_llama()
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    slot, slots = staging_layout(layer)
    budget = slot * slots + align_up(int(0.75 * layer), mmap.PAGESIZE)  # one coded pack (0.7), not two
    model = flextensor.offload(model, compressed_config(model, host_memory_budget=budget))
    engine = engine_of(model)
    assert all(isinstance(u.pack, CodedPack) for u in engine.units.values())
    inputs = llama_inputs()
    with torch.no_grad():
        want = reference(inputs).logits
        outs = [model(inputs).logits for _ in range(5)]
        assert flextensor.phase(model) == "inference"
        through_ring.clear()
        outs += [model(inputs).logits for _ in range(2)]
    assert all(torch.equal(out, want) for out in outs)
    plan = engine.current.plan  # type: ignore[union-attr]
    assert plan.staged and set(plan.staged) <= set(plan.coded) == set(plan.streamed)
    assert len(through_ring) >= 2 * len(plan.staged)  # every staged unit's pieces, each steady forward
    status = flextensor.status(model)
    assert status.direct_bytes + status.staging_bytes <= budget
    assert {u.name for u in status.units if u.staged} == set(plan.staged)


def test_release_frees_the_coded_loads_at_once(fast_decoder: None) -> None:
    """The coded loads' cached views hold the arena, the staging slots and every compressed pack, and the
    packs point back at them: release() breaks that cycle, so the memory goes at once, not at the next
    garbage collection."""
    import gc
    import weakref

    model = compressed(bf16_llama())
    steady(model, llama_inputs())
    loads = engine_of(model).store.coded_loads
    assert loads is not None and loads._prepared
    gone = weakref.ref(loads)
    del loads
    gc.disable()
    try:
        flextensor.release(model)
        assert gone() is None
    finally:
        gc.enable()


def test_a_decode_that_fails_half_way_orders_later_copies_after_the_decodes_issued(
    fast_decoder: None, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode raising after some pieces of a load were issued leaves the unit's range unowned: the copy
    stream is ordered after the decodes issued so far (a copy into that range could otherwise be
    overwritten by one), the error reaches the caller, and the next forwards are bit for bit."""
    from flextensor.host import coded_packs

    reference = bf16_llama()
    model = compressed(bf16_llama())
    inputs = llama_inputs()
    steady(model, inputs)
    real_decode, calls, fences = coded_packs.decode, [0], []

    def failing_decode(encoded: object, out: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:  # the second piece of the forward's first coded load
            raise CodecError("a corrupt piece")
        return real_decode(encoded, out=out)

    real_fence = coded_packs.CodedLoads.fence
    monkeypatch.setattr(coded_packs, "decode", failing_decode)
    monkeypatch.setattr(
        coded_packs.CodedLoads,
        "fence",
        lambda self, stream: (fences.append(stream), real_fence(self, stream)),
    )
    with torch.no_grad(), pytest.raises(CodecError, match="corrupt piece"):
        model(inputs)
    assert fences  # the copy stream waited for the decodes issued before the failure
    monkeypatch.setattr(coded_packs, "decode", real_decode)
    streams_bit_for_bit(model, reference, forwards=3)


def test_packs_held_uncompressed_half_way_when_a_decode_fails_still_serve_every_forward(
    fast_decoder: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Giving the packs their raw bytes back fails on the second unit (out of memory, say): that forward
    raises, the first unit is raw and the others still compressed, and the next forwards profile again,
    finish the job and run bit for bit."""
    reference = bf16_llama()
    model = bf16_llama()
    model = flextensor.offload(model, streaming_config(model, ["model.layers.*"], compression="lossless"))
    real, calls = CodedPack.decode_into, [0]

    def failing_once(self: CodedPack, data: torch.Tensor, out: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("no room for a decode")
        real(self, data, out)

    inputs = llama_inputs()
    with torch.no_grad():
        model(inputs)  # discovery
        monkeypatch.setattr(CodedPack, "decode_into", failing_once)
        with pytest.raises(MemoryError):
            while flextensor.phase(model) != "inference":  # the plan is made at the end of profiling
                model(inputs)
    engine = engine_of(model)
    assert [isinstance(u.pack, CodedPack) for u in engine.units.values()] == [False, True, True, True]
    streams_bit_for_bit(model, reference)
    assert not any(isinstance(u.pack, CodedPack) for u in engine.units.values())
    assert not engine.current.plan.coded  # type: ignore[union-attr]


def test_plans_made_for_coded_loads_are_made_again_when_the_packs_are_held_uncompressed(
    fast_decoder: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Inputs planned with coded loads, then inputs whose plan has no room for the staging slots: every
    pack is held uncompressed, for every input (a pack is held one way), and the plan of the first inputs
    is made again without coded loads; their outputs stay bit for bit."""
    reference = bf16_llama()
    tighter = streaming_config(reference, ["model.layers.*"]).gpu_memory_budget
    model = compressed(bf16_llama())
    short, long = llama_inputs(), torch.cat([llama_inputs()] * 2, dim=1)
    steady(model, short)
    engine = engine_of(model)
    assert engine.current.plan.coded  # type: ignore[union-attr]
    engine.policy.budget_bytes = tighter  # no room for the staging slots
    with caplog.at_level("WARNING", logger="flextensor"), torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(long).logits, reference(long).logits)
    assert "for every input from now on" in caplog.text
    assert not any(isinstance(u.pack, CodedPack) for u in engine.units.values())
    assert engine.plans and all(not entry.plan.coded for entry in engine.plans.values())
    assert all(entry.measurements.decode_bps is None for entry in engine.plans.values())
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(short).logits, reference(short).logits)
    assert not engine.current.plan.coded and flextensor.report(model).decode_gbps is None  # type: ignore[union-attr]


def test_a_profile_made_with_compression_loaded_without_it_plans_raw(
    fast_decoder: None, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Compression off: a profile whose plan loads units compressed is planned again, without coded loads
    and without a word about compression."""
    reference = bf16_llama()
    budget = compressed_config(reference).gpu_memory_budget
    model = compressed(bf16_llama())
    steady(model, llama_inputs())
    path = tmp_path / "coded.ftprofile.json"
    flextensor.save_profile(model, path)
    flextensor.release(model)
    again = bf16_llama()
    config = streaming_config(again, ["model.layers.*"], profile=path)
    with caplog.at_level("INFO", logger="flextensor"):
        again = flextensor.offload(again, config.model_copy(update={"gpu_memory_budget": budget}))
        streams_bit_for_bit(again, reference)
    assert "compression" not in caplog.text.replace("compressed loads, now off", "")
    engine = engine_of(again)
    assert not engine.current.plan.coded  # type: ignore[union-attr]
    assert engine.current.measurements.decode_bps is None  # type: ignore[union-attr]


def test_a_run_from_a_profile_encodes_only_the_units_its_plan_loads_compressed(
    fast_decoder: None, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Units the saved plan keeps resident are never encoded when a run starts from it (their packs go
    once laid out), and the run is in steady state at once, bit for bit. The link is modelled slow, so
    that the plan keeps as many layers resident as the budget allows whatever the CPU's timings."""
    from flextensor import api
    from flextensor.plan.measurements import LinkModel

    real_probe = api.probe_links
    monkeypatch.setattr(
        api, "probe_links", lambda store, arena: (LinkModel.constant(1e6), real_probe(store, arena)[1])
    )
    reference = bf16_llama(layers=8)
    layer = sum(p.numel() * p.element_size() for p in reference.model.layers[0].parameters())
    model = bf16_llama(layers=8)
    config = compressed_config(model)
    config = config.model_copy(update={"gpu_memory_budget": config.gpu_memory_budget + 2 * layer})
    model = flextensor.offload(model, config)
    steady(model, llama_inputs())
    plan = engine_of(model).current.plan  # type: ignore[union-attr]
    assert plan.resident and plan.coded  # room for some layers, not all (all: 8 layers; this: ~5.5)
    path = tmp_path / "mixed.ftprofile.json"
    flextensor.save_profile(model, path)
    flextensor.release(model)

    encoded: list[str] = []
    real_encode = CodedPack.encode.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        CodedPack,
        "encode",
        classmethod(lambda cls, unit, *rest: (encoded.append(unit), real_encode(cls, unit, *rest))[1]),
    )
    again = bf16_llama(layers=8)
    again = flextensor.offload(again, config.model_copy(update={"profile": path}))
    assert sorted(set(encoded)) == sorted(plan.coded)
    assert flextensor.phase(again) == "inference"
    engine = engine_of(again)
    assert all(not isinstance(engine.units[name].pack, CodedPack) for name in plan.resident)
    assert engine.current.plan.coded == plan.coded  # type: ignore[union-attr]
    streams_bit_for_bit(again, reference, forwards=3)


def test_a_pack_decoded_through_a_device_gives_its_raw_bytes(small_pieces: None) -> None:
    """``CodedPack.decode_through``, the way a compressed unit is uploaded to resident storage on a GPU
    (and held raw again): piece by piece into a device tensor. Here the CPU is the device; the GPU
    variant runs in tests/test_codec_gpu.py through the uploads of resident units."""
    from flextensor.host.packs import pack_layout

    torch.manual_seed(0)
    weights = [(torch.randn(96, 128) / 12).to(torch.bfloat16), torch.randn(40)]  # a float32 tail too
    entries, nbytes = pack_layout([(f"w{i}", w) for i, w in enumerate(weights)])
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    for entry, weight in zip(entries, weights, strict=True):
        raw[entry.offset : entry.offset + entry.nbytes].copy_(weight.reshape(-1).view(torch.uint8))
    pack = CodedPack.encode("unit", entries, raw)
    assert len(pack.pieces) > 1
    out = torch.full((nbytes,), 7, dtype=torch.uint8)
    pack.decode_through(torch.device("cpu"), out)
    assert torch.equal(out, raw)
    pack.free()
