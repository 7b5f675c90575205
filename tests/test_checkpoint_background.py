"""offload(weights=PATH) reads the offloaded units in the background (host/checkpoint.py, [Note: reading while
the model runs]): it returns before they are read, the first forward waits for each unit it needs and is
bitwise right, a read that fails fails every use of that unit, and a failed offload waits for its reads
before it frees their memory."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import flextensor
import flextensor.host.checkpoint as checkpoint
from engine_helpers import LEARN, assert_all_equal, first_tensor, run_forwards
from flextensor import CheckpointError, NotOffloadedError
from real_models import llama_inputs, tiny_llama
from streaming import streaming_config

GATED = "model.layers.1."
"""The tensors whose reads the tests hold back: one decoder layer, not the largest unit."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, torch.Tensor]:
    model = tiny_llama()
    with torch.no_grad():
        expected = first_tensor(model(llama_inputs()))
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path, model, expected


def meta_llama(reference: nn.Module) -> nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(reference.config).eval()


def offload_meta(reference: nn.Module, path: Path, **fields: object) -> nn.Module:
    config = streaming_config(meta_llama(reference), ["model.layers.*"], **fields)
    return flextensor.offload(meta_llama(reference), config, weights=path)


def gate_reads(monkeypatch: pytest.MonkeyPatch, gate: threading.Event, started: threading.Event) -> None:
    read_into = checkpoint._read_into

    def held_back(fd: int, source: checkpoint.CheckpointTensor, dest: memoryview) -> None:
        if source.name.startswith(GATED):
            started.set()
            assert gate.wait(30), "the test never opened the gate"
        read_into(fd, source, dest)

    monkeypatch.setattr(checkpoint, "_read_into", held_back)


def test_offload_returns_before_the_units_are_read_and_the_first_forward_waits_for_each(
    monkeypatch: pytest.MonkeyPatch, saved
) -> None:
    path, reference, expected = saved
    gate, started = threading.Event(), threading.Event()
    gate_reads(monkeypatch, gate, started)
    model = offload_meta(reference, path)
    assert started.wait(30)
    assert not gate.is_set()  # offload() returned while a unit's read was held back
    opener = threading.Timer(0.2, gate.set)  # the first forward waits for it, then runs
    opener.start()
    try:
        assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 1), expected)
    finally:
        gate.set()
        opener.join()
    assert flextensor.phase(model) == "inference"
    assert all(u.placement == "streamed" for u in flextensor.status(model).units)


def test_offload_reads_the_weights_kept_on_the_device_before_the_units(
    monkeypatch: pytest.MonkeyPatch, saved
) -> None:
    """With one reading thread and a unit's read held back, offload() still returns: the embeddings, norm
    and head it waits for are read before the units, not queued behind them."""
    path, reference, expected = saved
    monkeypatch.setattr(checkpoint, "READ_THREADS", 1)
    gate, started = threading.Event(), threading.Event()
    gate_reads(monkeypatch, gate, started)
    returned: list[nn.Module] = []
    offloading = threading.Thread(target=lambda: returned.append(offload_meta(reference, path)))
    offloading.start()
    offloading.join(30)
    try:
        assert returned, "offload() waited for a unit's read"
        assert started.is_set() and not gate.is_set()
    finally:
        gate.set()
        offloading.join()
    assert_all_equal(run_forwards(returned[0], llama_inputs(), LEARN + 1), expected)


def test_a_failed_read_fails_every_use_of_its_unit_and_nothing_computes_with_unread_bytes(
    monkeypatch: pytest.MonkeyPatch, saved
) -> None:
    path, reference, _ = saved
    read_into = checkpoint._read_into

    def failing(fd: int, source: checkpoint.CheckpointTensor, dest: memoryview) -> None:
        if source.name.startswith(GATED):
            raise OSError(5, "Input/output error")
        read_into(fd, source, dest)

    monkeypatch.setattr(checkpoint, "_read_into", failing)
    model = offload_meta(reference, path)
    for _ in range(2):  # each time: the unit never loads bytes that were not read
        with pytest.raises(CheckpointError, match=r"'model\.layers\.1'.*Input/output error"), torch.no_grad():
            model(llama_inputs())
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1'"):
        model.state_dict()


def test_a_failed_offload_waits_for_its_reads_before_it_frees_their_memory(
    monkeypatch: pytest.MonkeyPatch, saved, tmp_path: Path
) -> None:
    path, reference, _ = saved
    gate, started = threading.Event(), threading.Event()
    gate_reads(monkeypatch, gate, started)
    model = meta_llama(reference)
    before = dict(model.named_parameters()) | dict(model.named_buffers())
    opener = threading.Timer(0.5, gate.set)
    opener.start()
    config = streaming_config(model, ["model.layers.*"], profile=str(tmp_path / "missing.json"))
    try:
        with pytest.raises(flextensor.ProfileError, match="does not exist"):
            flextensor.offload(model, config, weights=path)
    finally:
        gate.set()
        opener.join()
    with pytest.raises(NotOffloadedError):
        flextensor.status(model)
    after = dict(model.named_parameters()) | dict(model.named_buffers())
    assert all(after[name] is tensor for name, tensor in before.items())
    assert all(t.device.type == "meta" for t in after.values())


def test_a_pin_the_system_refuses_leaves_the_unit_readable_and_pageable(
    saved, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Readers page-lock their packs when the budget holds them all; a refusal (WSL2's or a cgroup's cap
    below the budget) logs a warning and the pack is read pageable, as the host budget's own pinning does,
    instead of failing every use of the unit."""
    from flextensor.errors import PinningError
    from flextensor.host.packs import UnitPack

    path, reference, _ = saved
    model = meta_llama(reference)
    load = checkpoint.plan_checkpoint_load(model, path)
    params = dict(model.named_parameters())
    units = [
        (f"model.layers.{i}", [(n, p) for n, p in params.items() if n.startswith(f"model.layers.{i}.")])
        for i in range(2)
    ]

    def refuse(pack: UnitPack, by_reader: bool = False) -> None:
        raise PinningError(f"could not page-lock unit {pack.unit!r} (test)")

    monkeypatch.setattr(UnitPack, "pin", refuse)
    with caplog.at_level("WARNING", logger="flextensor"):
        packs, _ = checkpoint.read_checkpoint(
            load, units, [], pin=True, device=torch.device("cpu"), advance=lambda n: None
        )
        for pack in packs:
            pack.wait_read()
    state = reference.state_dict()
    for pack, (_, named) in zip(packs, units, strict=True):
        assert not pack.pinned
        for entry, (name, _) in zip(pack.entries, named, strict=True):
            assert torch.equal(pack.view(entry), state[name]), name
        pack.free()
    assert "copied from pageable memory" in caplog.text
