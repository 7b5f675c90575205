"""``share_host_memory`` with ``compression="lossless"``: the node holds the compressed weights once, in a
coded segment the first process encodes and the others map (see [Note: shared coded packs] in
host/shared/coded.py). In-process tests offload several models in one process, each holding its segments like
a process would; the killed-creator test runs this file as a script in a child process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import flextensor
from flextensor.api import engine_of
from flextensor.errors import FlexTensorError
from flextensor.host.coded_packs import CodedPack
from flextensor.host.shared import coded as shared_coded
from flextensor.host.shared import store as shared_store
from real_models import tiny_llama
from test_compression import bf16_llama, compressed_config, streams_bit_for_bit
from test_shared_store import segments

CHILD_TIMEOUT_S = 60


def shared_compressed(model: torch.nn.Module) -> torch.nn.Module:
    return flextensor.offload(model, compressed_config(model, share_host_memory=True))


def coded_segments(shm: Path) -> list[Path]:
    return [p for p in segments(shm) if "-coded-" in p.name]


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The units this process encodes, in order."""
    seen: list[str] = []
    encode = CodedPack.encode.__func__  # type: ignore[attr-defined]

    def counted(cls: type, unit: str, *args: object, **kwargs: object) -> CodedPack:
        seen.append(unit)
        return encode(cls, unit, *args, **kwargs)

    monkeypatch.setattr(CodedPack, "encode", classmethod(counted))
    return seen


def test_processes_that_share_the_weights_hold_one_compressed_copy(
    shm: Path, fast_decoder: None, encodes: list[str]
) -> None:
    first = shared_compressed(bf16_llama())
    second = shared_compressed(bf16_llama())
    # The raw segment went when the last process that held it took the coded one.
    (coded,) = segments(shm)
    assert coded in coded_segments(shm)
    # The first encoded the 4 layers (the largest twice: probe and pack); the second only its probe.
    assert len(encodes) == 4 + 1
    raw_bytes = sum(u.nbytes for u in flextensor.status(first).units)
    assert coded.stat().st_size < 0.8 * raw_bytes
    for model in (first, second):
        status = flextensor.status(model)
        assert all(u.shared and u.compressed for u in status.units)
        assert status.host_bytes_held < 0.8 * raw_bytes
        streams_bit_for_bit(model, bf16_llama())
    flextensor.release(first)
    assert segments(shm) == [coded]  # the second still holds it
    flextensor.release(second, "cpu")
    assert segments(shm) == []
    with torch.no_grad():
        inputs = torch.randint(0, 64, (1, 8))
        assert torch.equal(second(inputs).logits, bf16_llama()(inputs).logits)


def test_units_that_are_not_coded_move_to_the_coded_segment_as_they_are(
    shm: Path, fast_decoder: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flextensor.store import coded_loads as pack_compression

    real = pack_compression.coded_dtype
    monkeypatch.setattr(
        pack_compression,
        "coded_dtype",
        lambda entries: None if entries[0].name.startswith("model.layers.0.") else real(entries),
    )
    model = shared_compressed(bf16_llama())
    assert segments(shm) == coded_segments(shm)  # no process holds the raw segment any more
    units = {u.name: u for u in flextensor.status(model).units}
    assert units["model.layers.0"].shared and not units["model.layers.0"].compressed
    assert all(units[f"model.layers.{i}"].compressed for i in (1, 2, 3))
    streams_bit_for_bit(model, bf16_llama())
    flextensor.release(model)
    assert segments(shm) == []


def test_weights_packed_again_are_checked_against_the_coded_copy_before_use(
    shm: Path, fast_decoder: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = shared_compressed(bf16_llama())
    checks: list[bool] = []
    holds = shared_coded._holds
    monkeypatch.setattr(shared_coded, "_holds", lambda *args: checks.append(holds(*args)) or checks[-1])
    # The raw segment is gone: the second packs it again, a new instance, so it compares the bytes.
    second = shared_compressed(bf16_llama())
    assert checks == [True]
    assert len(coded_segments(shm)) == 1
    streams_bit_for_bit(second, bf16_llama())
    flextensor.release(first)
    flextensor.release(second)
    assert segments(shm) == []


def meta_layers(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its decoder layers (the offloaded units) on the meta device, as a process that
    never read them builds it: the rest (kept on the device) is loaded."""
    with torch.device("meta"):
        meta = bf16_llama()
    kept = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.")}
    meta.load_state_dict(kept, strict=False, assign=True)
    meta.model.rotary_emb = model.model.rotary_emb  # its buffers are not in the state dict
    return meta


def test_a_model_built_on_meta_starts_from_the_compressed_copy_alone(shm: Path, fast_decoder: None) -> None:
    loaded = shared_compressed(bf16_llama())
    (coded,) = segments(shm)  # no raw segment left to attach to
    meta = shared_compressed(meta_layers(bf16_llama()))
    assert segments(shm) == [coded]  # unpacked from it, attached, compressed again: the same copy
    assert all(u.shared and u.compressed for u in flextensor.status(meta).units)
    streams_bit_for_bit(meta, bf16_llama())
    flextensor.release(loaded)
    flextensor.release(meta)
    assert segments(shm) == []


def swapped_rows(model: torch.nn.Module) -> torch.nn.Module:
    """Two rows of one weight swapped: the same wrap-around sum, outside the sampled byte windows, so
    the cheap content digest (and the segment's name) cannot tell the weights apart."""
    with torch.no_grad():
        weight = model.model.layers[1].self_attn.q_proj.weight
        weight[[2, 3]] = weight[[3, 2]]
    return model


def test_other_weights_whose_digest_collides_get_their_own_coded_copy(shm: Path, fast_decoder: None) -> None:
    first = shared_compressed(bf16_llama())
    (taken,) = coded_segments(shm)
    second = shared_compressed(swapped_rows(bf16_llama()))
    assert sorted(coded_segments(shm)) == [taken, Path(f"{taken}-c1")]
    streams_bit_for_bit(second, swapped_rows(bf16_llama()))
    streams_bit_for_bit(first, bf16_llama())
    flextensor.release(first)
    flextensor.release(second)
    assert segments(shm) == []


def test_a_process_killed_while_compressing_is_waited_for_then_replaced(
    shm: Path, fast_decoder: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shared_coded, "SHARED_CODED_TIMEOUT_S", 0.5)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), ""])}
    here = Path(__file__).parent
    child = subprocess.Popen(
        [sys.executable, __file__, str(shm)], stdout=subprocess.PIPE, text=True, env=env, cwd=here
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "compressing"
        # Waited too long: this process streams its raw packs, and says so.
        with caplog.at_level(logging.WARNING, logger="flextensor"):
            waiting = shared_compressed(bf16_llama())
        assert "waited 0.5 s for another process to finish compressing" in caplog.text
        assert not any(u.compressed for u in flextensor.status(waiting).units)
        streams_bit_for_bit(waiting, bf16_llama())
    finally:
        child.kill()
        child.wait(CHILD_TIMEOUT_S)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        model = shared_compressed(bf16_llama())
    assert f"process {child.pid} died while packing" in caplog.text
    assert all(u.compressed for u in flextensor.status(model).units)
    assert len(coded_segments(shm)) == 1 and len(segments(shm)) == 2  # the raw one: ``waiting`` holds it
    streams_bit_for_bit(model, bf16_llama())
    flextensor.release(model)
    flextensor.release(waiting)


def other_weights() -> torch.nn.Module:
    return tiny_llama(seed=1, layers=4, tie=False, hidden=64).to(torch.bfloat16)


def test_a_meta_model_refuses_to_guess_between_a_compressed_copy_and_other_live_weights(
    shm: Path, fast_decoder: None
) -> None:
    compressed_only = shared_compressed(bf16_llama())  # its raw segment is gone
    raw = other_weights()
    live = flextensor.offload(
        raw, compressed_config(raw, share_host_memory=True).model_copy(update={"compression": "off"})
    )
    meta = meta_layers(bf16_llama())
    before = {name: p for name, p in meta.named_parameters()}
    with pytest.raises(FlexTensorError, match="2 models with this parameter layout share host memory"):
        shared_compressed(meta)
    assert all(p is before[name] for name, p in meta.named_parameters())
    flextensor.release(compressed_only)
    flextensor.release(live)
    assert segments(shm) == []


def test_a_collision_while_the_first_weights_are_live_again_still_streams_the_right_ones(
    shm: Path, fast_decoder: None
) -> None:
    first = shared_compressed(bf16_llama())
    second = shared_compressed(swapped_rows(bf16_llama()))
    raw = bf16_llama()
    third = flextensor.offload(
        raw, compressed_config(raw, share_host_memory=True).model_copy(update={"compression": "off"})
    )
    fourth = shared_compressed(swapped_rows(bf16_llama()))
    for model, weights in (
        (first, bf16_llama()),
        (second, swapped_rows(bf16_llama())),
        (third, bf16_llama()),
    ):
        streams_bit_for_bit(model, weights)
    streams_bit_for_bit(fourth, swapped_rows(bf16_llama()))
    for model in (first, second, third, fourth):
        flextensor.release(model)
    assert segments(shm) == []


def _stalling_child(shm: str) -> None:
    """Offload with sharing and compression, stalling (then killed) after encoding one unit."""
    from flextensor.store import coded_loads as pack_compression

    shared_store.SHM_DIR = shm
    pack_compression.probe_decode = lambda runtime, pack, destination: 1e15
    encode = CodedPack.encode.__func__  # type: ignore[attr-defined]
    calls = 0

    def stall(cls: type, *args: object, **kwargs: object) -> CodedPack:
        nonlocal calls
        calls += 1
        if calls == 3:  # the probe, one unit, then stall: the coded segment is being filled
            print("compressing", flush=True)
            time.sleep(CHILD_TIMEOUT_S)
        return encode(cls, *args, **kwargs)

    CodedPack.encode = classmethod(stall)  # type: ignore[method-assign]
    shared_compressed(bf16_llama())


if __name__ == "__main__":
    _stalling_child(sys.argv[1])


def test_a_budget_without_room_for_the_staging_slots_keeps_the_weights_shared_uncompressed(
    shm: Path, fast_decoder: None
) -> None:
    """The tightest budget leaves no room for the staging slots: each process's plan copies the packs as
    they are, and they move to the node's raw segment (packed again from the coded one by the first, the
    second attaching to it), not into packs of each process's own."""
    from streaming import streaming_config

    models = []
    for _ in range(2):
        model = bf16_llama()
        config = streaming_config(model, ["model.layers.*"], compression="lossless", share_host_memory=True)
        models.append(flextensor.offload(model, config))
    for model in models:
        streams_bit_for_bit(model, bf16_llama())
        units = flextensor.status(model).units
        assert all(u.shared and not u.compressed for u in units), units
    assert segments(shm) != [] and coded_segments(shm) == []  # the raw copy alone, once
    assert len(segments(shm)) == 1
    for model in models:
        flextensor.release(model)
    assert segments(shm) == []


def test_the_raw_copy_packed_again_holds_every_unit_whatever_this_process_holds(
    shm: Path, fast_decoder: None
) -> None:
    """A unit whose pack this process holds privately (a resident unit edited in place gets one) is still
    unpacked from the coded copy when the raw segment is packed again for packs held uncompressed: the
    raw segment is whole, and a process that attaches to it later gets every unit's weights."""
    from flextensor.host.packs import UnitPack
    from flextensor.store import coded_loads as pack_compression

    first = shared_compressed(bf16_llama())
    store = engine_of(first).store
    unit = store.units[0]
    private = UnitPack(unit.name, unit.entries, unit.nbytes, False)
    private.buffer.copy_(unit.pack.buffer)
    pack_compression.swap_in(store, unit, private)
    pack_compression.hold_uncompressed(store)  # what a plan without room for the staging slots does
    assert segments(shm) != [] and coded_segments(shm) == []
    meta = meta_layers(bf16_llama())
    later = flextensor.offload(
        meta, compressed_config(meta, share_host_memory=True).model_copy(update={"compression": "off"})
    )
    streams_bit_for_bit(later, bf16_llama())
    streams_bit_for_bit(first, bf16_llama())
    flextensor.release(later)
    flextensor.release(first)
    assert segments(shm) == []


def test_a_meta_model_attaches_when_the_live_raw_copy_is_the_compressed_one(
    shm: Path, fast_decoder: None
) -> None:
    """Weights packed again by a process without compression are another packing of the raw segment than
    the one the coded copy was made from: a meta-built process compares the two before it counts them
    as two models, and attaches."""
    compressed_only = shared_compressed(bf16_llama())
    raw = bf16_llama()
    live = flextensor.offload(
        raw, compressed_config(raw, share_host_memory=True).model_copy(update={"compression": "off"})
    )
    meta = shared_compressed(meta_layers(bf16_llama()))
    streams_bit_for_bit(meta, bf16_llama())
    for model in (compressed_only, live, meta):
        flextensor.release(model)
    assert segments(shm) == []
