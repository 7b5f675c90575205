"""On a CUDA device: the Triton decoder matches the CPU reference bit for bit, and a GPU encode the CPU's.

Run on the GPU machine with ``pytest -m gpu tests/test_codec_gpu.py``; elsewhere these skip visibly. The
throughput is measured by ``python -m benchmarks.codec_decode`` (no test asserts a time).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator

import pytest
import torch

from flextensor import codec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="needs Triton (CUDA builds of torch)"
    ),
]

CODED = [torch.bfloat16, torch.float16]


def patterns(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = values.to(torch.int32)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)


def drawn(kind: str, length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if kind == "weights":
        return (torch.randn(length, generator=generator) / math.sqrt(4096)).to(dtype)
    if kind == "random bits":
        return patterns(torch.randint(0, 1 << 16, (length,), generator=generator), dtype)
    if kind == "nan and specials":
        pool = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -1e-40, 1.0], dtype=dtype)
        return pool[torch.randint(0, pool.numel(), (length,), generator=generator)]
    return torch.full((length,), 0.5, dtype=dtype)


def assert_gpu_matches_reference(tensor: torch.Tensor, chunk_elements: int) -> None:
    encoded = codec.encode(tensor, chunk_elements)
    reference = codec.decode_reference(encoded)
    on_gpu = codec.decode(encoded.to("cuda"))
    assert on_gpu.is_cuda and on_gpu.dtype == tensor.dtype and on_gpu.shape == tensor.shape
    assert torch.equal(on_gpu.cpu().view(torch.int16), reference.view(torch.int16))
    assert torch.equal(reference.view(torch.int16), tensor.view(torch.int16))


@pytest.mark.parametrize("dtype", CODED)
@pytest.mark.parametrize("chunk_elements", [64, 1024, 4096, 16384])
def test_every_bit_pattern_decodes_on_the_gpu_as_on_the_cpu(dtype: torch.dtype, chunk_elements: int) -> None:
    every = patterns(torch.arange(1 << 16), dtype)
    assert_gpu_matches_reference(every, chunk_elements)
    shuffled = every[torch.randperm(1 << 16, generator=torch.Generator().manual_seed(0))]
    assert_gpu_matches_reference(shuffled, chunk_elements)


@pytest.mark.parametrize("dtype", CODED)
@pytest.mark.parametrize("kind", ["weights", "random bits", "nan and specials", "constant"])
@pytest.mark.parametrize("length", [0, 1, 7, 4095, 4097, 100_003])
def test_drawn_tensors_decode_on_the_gpu_as_on_the_cpu(dtype: torch.dtype, kind: str, length: int) -> None:
    for chunk_elements in (64, 4096):
        assert_gpu_matches_reference(drawn(kind, length, dtype, seed=length), chunk_elements)


@pytest.mark.parametrize("dtype", CODED)
def test_a_large_weight_decodes_on_the_gpu_as_on_the_cpu(dtype: torch.dtype) -> None:
    weight = (torch.randn(8192, 4100) / 64).to(dtype)
    assert_gpu_matches_reference(weight, 4096)


@pytest.mark.parametrize("dtype", CODED)
def test_encoding_on_the_gpu_gives_the_cpu_encoding(dtype: torch.dtype) -> None:
    weight = torch.cat([drawn(k, 50_001, dtype, 3) for k in ("weights", "random bits", "nan and specials")])
    on_cpu = codec.encode(weight, 1024)
    on_gpu = codec.encode(weight.cuda(), 1024, device="cuda")
    assert on_gpu.data.device.type == "cpu"
    assert torch.equal(on_gpu.data, on_cpu.data)
    assert torch.equal(on_gpu.chunk_offsets, on_cpu.chunk_offsets)
    assert torch.equal(on_gpu.chunk_widths, on_cpu.chunk_widths)


def test_a_decode_ordered_after_a_side_stream_copy_fills_its_arena_range_only() -> None:
    weight = (torch.randn(2048, 1024) / 32).to(torch.bfloat16)
    encoded = codec.encode(weight)
    pinned = encoded.data.pin_memory()
    arena = torch.full((4 * weight.numel(),), 3.0, dtype=torch.bfloat16, device="cuda")
    staging = torch.empty_like(pinned, device="cuda")
    index = encoded.to("cuda")
    copy_stream, decode_stream = torch.cuda.Stream(), torch.cuda.Stream()
    copied = torch.cuda.Event()
    with torch.cuda.stream(copy_stream):
        staging.copy_(pinned, non_blocking=True)
        copied.record()
    on_device = codec.EncodedTensor(
        encoded.dtype, encoded.shape, encoded.chunk_elements, staging, index.chunk_offsets, index.chunk_widths
    )
    target = arena[weight.numel() : 2 * weight.numel()]
    with torch.cuda.stream(decode_stream):
        decode_stream.wait_event(copied)
        codec.decode(on_device, out=target)
    torch.cuda.current_stream().wait_stream(decode_stream)
    result = arena.cpu()
    assert torch.equal(
        result[weight.numel() : 2 * weight.numel()].view(torch.int16), weight.view(-1).view(torch.int16)
    )
    assert (result[: weight.numel()] == 3).all() and (result[2 * weight.numel() :] == 3).all()


MEDIUM_VOCAB = 4096


def medium_llama() -> torch.nn.Module:
    """An 8-layer bf16 Llama, its layers 30 MB each."""
    from real_models import tiny_llama

    return tiny_llama(layers=8, hidden=1024, heads=16, kv_heads=4, vocab=MEDIUM_VOCAB).to(torch.bfloat16)


@pytest.fixture
def compressed_medium_llama() -> Iterator[torch.nn.Module]:
    """:func:`medium_llama` offloaded with compression under 240 MiB (most layers stream; room for the
    two 40 MiB staging slots of its 64 MiB pieces at 32 tokens, which 200 MiB lacked), released after
    the test (pass or fail: the next test's budget must not see it)."""
    import flextensor

    config = flextensor.OffloadConfig(
        include_patterns=["model.layers.*"], gpu_memory_budget="240MiB", compression="lossless"
    )
    model = flextensor.offload(medium_llama(), config)
    try:
        yield model
    finally:
        flextensor.release(model)
        del model
        torch.cuda.empty_cache()


def device_logits(inputs: torch.Tensor) -> torch.Tensor:
    """What :func:`medium_llama` computes for ``inputs`` whole on the device."""
    with torch.no_grad():
        reference = medium_llama().cuda()
        want = reference(inputs).logits
    del reference
    torch.cuda.empty_cache()
    return want


def tokens(length: int) -> torch.Tensor:
    return torch.randint(0, MEDIUM_VOCAB, (1, length), generator=torch.Generator().manual_seed(1)).cuda()


@pytest.mark.parametrize("length", [16, 1], ids=["prefill", "one-token"])
def test_offload_with_compression_streams_bit_for_bit_on_cuda(
    compressed_medium_llama: torch.nn.Module, length: int
) -> None:
    """compression="lossless" end to end on the GPU: the Triton decoder outpaces the link, so every
    layer's pack is held compressed, and the streamed model's outputs are the device model's, bit for
    bit; with one token (compute far shorter than each load, as in decode) too, where a race between the
    copies, the decodes and the compute would show."""
    import flextensor

    model = compressed_medium_llama
    inputs = tokens(length)
    want = device_logits(inputs)
    with torch.no_grad():
        for _ in range(12):
            assert torch.equal(model(inputs).logits, want)
    assert flextensor.phase(model) == "inference"
    report = flextensor.report(model)
    streamed = [u for u in report.units if not u.resident]
    assert streamed and all(u.coded_nbytes is not None for u in streamed)
    assert report.decode_gbps is not None and report.decode_gbps > 100
    assert report.host_bytes_held < 0.8 * sum(u.nbytes for u in report.units)


def test_a_cuda_graph_of_a_compressed_model_replays_bit_for_bit(
    compressed_medium_llama: torch.nn.Module,
) -> None:
    """A torch.cuda.graph capture of a steady forward with coded loads: the graph holds each copy into a
    staging slot and the decode on the decode stream; replays and eager forwards mixed stay bitwise."""
    import flextensor

    model, static = compressed_medium_llama, tokens(16)
    want = device_logits(static)
    with torch.no_grad():
        while flextensor.phase(model) != "inference":
            model(static)
        model(static)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(static).logits
        for _ in range(3):
            graph.replay()
            assert torch.equal(out, want)
            assert torch.equal(model(static).logits, want)  # an eager forward between replays
    assert any(u.coded_nbytes is not None for u in flextensor.report(model).units)


def test_packs_held_uncompressed_again_are_decoded_on_the_gpu_bit_for_bit(
    compressed_medium_llama: torch.nn.Module,
) -> None:
    """A plan without coded loads (a budget with no room for the staging slots) holds the packs raw
    again, decoded through the device piece by piece: each the bytes the host's reference decoder gives,
    and the model streams them bit for bit."""
    import flextensor
    from flextensor.api import engine_of
    from flextensor.host.coded_packs import CodedPack
    from flextensor.store.coded_loads import hold_uncompressed

    model = compressed_medium_llama
    engine = engine_of(model)
    want = {u.name: u.pack.buffer for u in engine.units.values() if isinstance(u.pack, CodedPack)}
    assert want
    hold_uncompressed(engine.store)
    for name, raw in want.items():
        pack = engine.units[name].pack
        assert not isinstance(pack, CodedPack) and torch.equal(pack.buffer, raw), name
    inputs = tokens(16)
    logits = device_logits(inputs)
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(model(inputs).logits, logits)
    assert flextensor.phase(model) == "inference"


def test_a_budget_without_room_for_the_staging_slots_streams_uncompressed_on_cuda(
    compressed_medium_llama: torch.nn.Module,
) -> None:
    """The engine's own way there: steady with coded loads, then a budget that fits the smallest plan
    without staging slots but not with them (about 42 MB here), and inputs of another shape: their plan
    gives compression up, every pack is decoded back through the GPU, the plan made before is made again
    without coded loads, and both inputs stay bit for bit."""
    import flextensor
    from flextensor.api import engine_of
    from flextensor.engine.policy import without_coding
    from flextensor.host.coded_packs import CodedPack
    from flextensor.plan.planner import minimal_need_bytes

    model = compressed_medium_llama
    long, short = tokens(32), tokens(16)
    want_long, want_short = device_logits(long), device_logits(short)
    with torch.no_grad():
        while flextensor.phase(model) != "inference":
            model(long)
        assert torch.equal(model(long).logits, want_long)
    engine = engine_of(model)
    assert engine.current.plan.coded  # type: ignore[union-attr]
    planned = engine.policy.planned(engine.current.measurements)  # type: ignore[union-attr]
    raw_need = minimal_need_bytes(without_coding(planned))[0]
    assert minimal_need_bytes(planned)[0] > raw_need + 16 * 2**20
    engine.policy.budget_bytes = raw_need + 4 * 2**20  # room for small tensors allocated since
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(model(short).logits, want_short)
        assert torch.equal(model(long).logits, want_long)
    assert not any(isinstance(u.pack, CodedPack) for u in engine.units.values())
    assert all(not entry.plan.coded for entry in engine.plans.values())


def test_processes_sharing_compressed_weights_stream_them_bit_for_bit_on_cuda(shm, monkeypatch) -> None:
    """share_host_memory with compression on the GPU: the second offload maps the first's coded segment
    (page-locked in each), the raw segment goes, and both stream bit for bit; a model built on the meta
    device then unpacks the coded copy through the GPU and streams the same. Waits are cut to 30 s so a
    stuck step fails with its own message."""
    import flextensor
    from flextensor.host.shared import coded as shared_coded
    from flextensor.host.shared import store as shared_store

    monkeypatch.setattr(shared_store, "SHARED_STORE_TIMEOUT_S", 30.0)
    monkeypatch.setattr(shared_coded, "SHARED_CODED_TIMEOUT_S", 30.0)

    # One process stands for three here, and a budget counts the device memory of every other model as
    # memory outside its own: the models run (then give their memory back) in order, so the k-th one's
    # budget is 240 MiB plus what each model after it holds on the device while it waits (embeddings,
    # norms, head, its learning slots), measured on a model offloaded alone first.
    def config(models_after: int, held: int = 0, share: bool = True) -> flextensor.OffloadConfig:
        return flextensor.OffloadConfig(
            include_patterns=["model.layers.*"],
            gpu_memory_budget=240 * 2**20 + models_after * held,
            compression="lossless",
            share_host_memory=share,
        )

    before = torch.cuda.memory_allocated()
    probe = flextensor.offload(medium_llama(), config(0, share=False))
    held = torch.cuda.memory_allocated() - before
    flextensor.release(probe, "cpu")
    del probe

    inputs = tokens(16)
    want = device_logits(inputs)
    models: list[torch.nn.Module] = []
    released: list[torch.nn.Module] = []
    try:
        models.append(flextensor.offload(medium_llama(), config(2, held)))
        assert [
            p.name for p in shm.iterdir() if not p.name.endswith(".lock") and "-coded-" not in p.name
        ] == []
        models.append(flextensor.offload(medium_llama(), config(1, held)))
        with torch.device("meta"):
            meta = medium_llama()
        source = medium_llama()
        kept = {k: v for k, v in source.state_dict().items() if not k.startswith("model.layers.")}
        meta.load_state_dict(kept, strict=False, assign=True)
        meta.model.rotary_emb = source.model.rotary_emb
        meta.tie_weights()  # assign=True gave the head a parameter of its own: the layout must match
        models.append(flextensor.offload(meta, config(0, held)))
        (segment,) = [p for p in shm.iterdir() if not p.name.endswith(".lock")]
        assert "-coded-" in segment.name
        for index, model in enumerate(models):
            units = flextensor.status(model).units
            assert all(u.shared and u.compressed and u.pinned for u in units), (index, units)
        for index, model in enumerate(models):
            with torch.no_grad():
                for _ in range(5):
                    assert torch.equal(model(inputs).logits, want), index
            flextensor.release(model, "cpu")  # the next model's budget does not count this one
            released.append(model)
    finally:
        for model in models:
            if not any(model is done for done in released):
                flextensor.release(model)
        torch.cuda.empty_cache()
