"""The shared host store: one copy of the weights per node, attach, meta models, locks and cleanup.

In-process tests offload several models in one process (each offload holds its segment like a process
would). The killed-process tests run this file as a script in child processes (see ``_child``) and
``kill -9`` them while they pack or after they attached. Every test uses a fresh directory under /dev/shm.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import flextensor
from flextensor.api import engine_of
from flextensor.errors import FlexTensorError, ProfileError
from flextensor.host.shared import store as shared_store
from flextensor.plan.layout import provisional_arena_bytes

WIDTH, DEPTH = 32, 4
CHILD_TIMEOUT_S = 60


def make_model(seed: int = 0, meta: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))


def shared_config(**kwargs: object) -> flextensor.OffloadConfig:
    return flextensor.OffloadConfig(device="cpu", share_host_memory=True, **kwargs)


def run_to_steady_state(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        y = model(x)
    assert flextensor.phase(model) == "inference"
    return y


def segments(shm: Path) -> list[Path]:
    return sorted(p for p in shm.iterdir() if not p.name.endswith(".lock"))


def test_one_process_packs_a_private_segment_that_release_removes(shm: Path) -> None:
    x = torch.randn(3, WIDTH)
    expected = make_model()(x)
    model = flextensor.offload(make_model(), shared_config())
    (segment,) = segments(shm)
    assert segment.name.startswith(f"flextensor-{os.getuid()}-")
    assert segment.stat().st_mode & 0o777 == 0o600
    assert (shm / (segment.name + ".lock")).stat().st_mode & 0o777 == 0o600
    assert all(u.shared for u in flextensor.status(model).units)
    assert torch.equal(run_to_steady_state(model, x), expected)
    flextensor.release(model, "cpu")
    assert segments(shm) == []
    assert torch.equal(model(x), expected)


def test_resident_units_keep_their_shared_packs(shm: Path) -> None:
    x = torch.randn(3, WIDTH)
    expected = make_model()(x)
    model = flextensor.offload(make_model(), shared_config())
    held = flextensor.status(model).host_bytes_held
    assert torch.equal(run_to_steady_state(model, x), expected)
    # Place residency by hand, the path a learned plan takes: the CPU planner may stream everything.
    engine = engine_of(model)
    entry = engine.current
    assert entry is not None
    sizes = {u.name: u.nbytes for u in flextensor.status(model).units}
    plan = dataclasses.replace(
        entry.plan,
        resident=("0", "2"),
        streamed=("1", "3"),
        arena_bytes=provisional_arena_bytes([sizes[u] for u in ("1", "3")]),
    )
    engine.install_plan(entry.measurements, plan)
    status = flextensor.status(model)
    assert status.resident == ("0", "2") and status.streamed == ("1", "3")
    # Other processes read the segment: no pack is dropped, and the host bytes stay as they were.
    assert all(u.shared and u.host_bytes > 0 for u in status.units)
    assert status.host_bytes_held == held
    assert torch.equal(model(x), expected)
    flextensor.release(model, "cpu")
    assert segments(shm) == []
    assert torch.equal(model(x), expected)


def _units(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    return [(str(i), [(f"{i}.weight", m.weight), (f"{i}.bias", m.bias)]) for i, m in enumerate(model)]


def test_a_second_model_with_the_same_weights_maps_the_same_copy(shm: Path) -> None:
    a = flextensor.offload(make_model(), shared_config())
    b = flextensor.offload(make_model(), shared_config())
    assert len(segments(shm)) == 1
    assert [u.host_bytes for u in flextensor.status(a).units] == [
        u.host_bytes for u in flextensor.status(b).units
    ]
    flextensor.release(a)
    assert len(segments(shm)) == 1  # b still holds it
    flextensor.release(b)


def test_two_packings_of_the_same_weights_are_two_mappings_of_one_memory(shm: Path) -> None:
    first, second = make_model(), make_model()
    packs_a = shared_store.pack_shared(first, _units(first), ["*"], pin=False).packs
    packs_b = shared_store.pack_shared(second, _units(second), ["*"], pin=False).packs
    assert len(segments(shm)) == 1
    assert packs_a[0].buffer.data_ptr() != packs_b[0].buffer.data_ptr()  # two mappings ...
    packs_a[0].buffer[:4] += 1
    assert torch.equal(packs_a[0].buffer[:4], packs_b[0].buffer[:4])  # ... of one memory
    for model, packs in ((first, packs_a), (second, packs_b)):
        for (_, named), pack in zip(_units(model), packs, strict=True):
            for _, param in named:
                param.data = param.data.clone()
            pack.free()
    assert segments(shm) == []  # the last pack freed removed the segment


def test_a_model_built_on_meta_attaches_without_reading_weights(shm: Path) -> None:
    x = torch.randn(2, WIDTH)
    loaded = flextensor.offload(make_model(), shared_config())
    meta = make_model(meta=True)
    originals = list(meta.parameters())
    flextensor.offload(meta, shared_config())
    assert all(p.device.type == "cpu" for p in meta.parameters())
    assert not any(p is q for p, q in zip(meta.parameters(), originals, strict=True))
    assert torch.equal(run_to_steady_state(meta, x), run_to_steady_state(loaded, x))
    flextensor.release(meta, "cpu")
    assert torch.equal(meta(x), make_model()(x))
    flextensor.release(loaded)


def test_a_meta_model_with_nothing_to_attach_to_times_out_clearly(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_store, "SHARED_STORE_TIMEOUT_S", 0.3)
    meta = make_model(meta=True)
    originals = list(meta.parameters())
    with pytest.raises(FlexTensorError, match=r"timed out after 0.3 s waiting for a process with the real"):
        flextensor.offload(meta, shared_config())
    assert all(p is q and p.is_meta for p, q in zip(meta.parameters(), originals, strict=True))


def test_meta_weights_that_stay_resident_are_refused(shm: Path) -> None:
    with pytest.raises(FlexTensorError, match=r"parameter '3.weight' is on the meta device .* not offloaded"):
        flextensor.offload(make_model(meta=True), shared_config(exclude_patterns=["3"]))


def test_other_weights_of_the_same_layout_get_their_own_segment(shm: Path) -> None:
    # Tensor-parallel shards or another checkpoint: same shapes, other values.
    a = flextensor.offload(make_model(seed=0), shared_config())
    b = flextensor.offload(make_model(seed=1), shared_config())
    assert len(segments(shm)) == 2
    x = torch.randn(2, WIDTH)
    assert torch.equal(run_to_steady_state(b, x), make_model(seed=1)(x))
    with pytest.raises(FlexTensorError, match=r"2 models with this parameter layout .* meta device"):
        flextensor.offload(make_model(meta=True), shared_config())
    flextensor.release(a)
    flextensor.release(b)


def test_a_failed_offload_rolls_back_and_leaves_no_segment(shm: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    model = make_model()
    with pytest.raises(ProfileError):
        flextensor.offload(model, shared_config(profile=missing))
    assert segments(shm) == []
    assert torch.equal(model(torch.ones(1, WIDTH)), make_model()(torch.ones(1, WIDTH)))

    loaded = flextensor.offload(make_model(), shared_config())
    meta = make_model(meta=True)
    originals = list(meta.parameters())
    with pytest.raises(ProfileError):
        flextensor.offload(meta, shared_config(profile=missing))
    assert all(p is q and p.is_meta for p, q in zip(meta.parameters(), originals, strict=True))
    flextensor.release(loaded)


def test_a_creator_that_fails_while_packing_restores_its_model(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(index: int) -> None:
        if index == 1:
            raise RuntimeError("disk on fire")

    monkeypatch.setattr(shared_store, "between_units_hook", fail)
    model = make_model()
    with pytest.raises(RuntimeError, match="disk on fire"):
        flextensor.offload(model, shared_config())
    assert all(p.untyped_storage().size() == p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(2, WIDTH)
    assert torch.equal(model(x), make_model()(x))


def test_a_forked_child_leaving_does_not_drop_the_parents_hold(shm: Path) -> None:
    model = make_model()
    packs = shared_store.pack_shared(model, _units(model), ["*"], pin=False).packs
    segment = packs[0].owner
    pid = os.fork()
    if pid == 0:  # the child shares the parent's lock; leaving (as at its exit) must not release it
        segment._leave()
        os._exit(0)
    os.waitpid(pid, 0)
    assert len(segments(shm)) == 1
    for pack in packs:
        pack.free()
    assert segments(shm) == []


def test_a_segment_open_to_other_users_is_refused(shm: Path) -> None:
    model = make_model()
    units = [(str(i), [(f"{i}.weight", m.weight), (f"{i}.bias", m.bias)]) for i, m in enumerate(model)]
    layout = shared_store.segment_layout(model, units, [["*"], []])
    digest = shared_store.content_digest([p for _, named in units for _, p in named])
    name = f"flextensor-{os.getuid()}-{layout.key.hex()[:16]}-{digest.hex()[:16]}"
    planted = shm / name
    planted.touch(mode=0o644)
    planted.chmod(0o644)
    with pytest.raises(FlexTensorError, match=f"{planted} belongs to another user or is open to others"):
        flextensor.offload(model, shared_config())
    planted.unlink()
    (shm / (name + ".lock")).unlink(missing_ok=True)


# -- other processes, killed -------------------------------------------------------------------------------


def start_child(shm: Path, role: str, seed: int = 0) -> subprocess.Popen[str]:
    """Run ``_child(role)`` and wait until it reports that it packs ("packing") or holds ("holding")."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), ""])}
    child = subprocess.Popen(
        [sys.executable, __file__, role, str(shm), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    assert line in ("packing", "holding"), f"child said {line!r}"
    return child


def kill(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(CHILD_TIMEOUT_S)


def test_a_process_killed_while_packing_is_waited_for_then_replaced(
    shm: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shared_store, "SHARED_STORE_TIMEOUT_S", 0.5)
    child = start_child(shm, "stall")
    try:
        with pytest.raises(FlexTensorError, match=r"timed out after 0.5 s waiting for another process"):
            flextensor.offload(make_model(), shared_config())
    finally:
        kill(child)
    assert len(segments(shm)) == 1  # half packed, its creator dead
    x = torch.randn(2, WIDTH)
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        model = flextensor.offload(make_model(), shared_config())
    assert f"process {child.pid} died while packing" in caplog.text
    assert torch.equal(run_to_steady_state(model, x), make_model()(x))
    flextensor.release(model)


def test_segments_go_when_the_last_holder_leaves_even_after_kill_9(shm: Path) -> None:
    model = flextensor.offload(make_model(), shared_config())
    kill(start_child(shm, "hold"))  # attached, then killed: its hold goes with it
    assert len(segments(shm)) == 1
    flextensor.release(model)
    assert segments(shm) == []

    # Every holder killed: a leftover, removed by the next start (of any model).
    kill(start_child(shm, "hold", seed=1))
    (leftover,) = segments(shm)
    model = flextensor.offload(make_model(), shared_config())
    assert leftover not in segments(shm) and len(segments(shm)) == 1
    flextensor.release(model)


def _child(role: str, shm: str, seed: int) -> None:
    """A process that offloads with sharing and then waits to be killed, reporting on stdout."""
    import time

    shared_store.SHM_DIR = shm

    def stall(index: int) -> None:
        if index == 1:
            print("packing", flush=True)
            time.sleep(CHILD_TIMEOUT_S)

    if role == "stall":
        shared_store.between_units_hook = stall
    flextensor.offload(make_model(seed), shared_config())
    print("holding", flush=True)
    time.sleep(CHILD_TIMEOUT_S)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))


def _wide(swap: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    if swap:  # two rows swapped: the same sum of words, and outside the sampled byte windows
        with torch.no_grad():
            model[0].weight[[1, 2]] = model[0].weight[[2, 1]]
    return model


def test_another_checkpoint_whose_digest_collides_gets_its_own_segment(shm: Path) -> None:
    assert shared_store.content_digest([_wide()[0].weight.data]) == shared_store.content_digest(
        [_wide(swap=True)[0].weight.data]
    )  # the cheap digest cannot tell them apart...
    x = torch.randn(2, 1024)
    with torch.no_grad():
        expected = _wide(swap=True)(x)
    first = flextensor.offload(_wide(), shared_config())
    second = flextensor.offload(_wide(swap=True), shared_config())
    assert len(segments(shm)) == 2  # ...the byte comparison before attaching can
    with torch.no_grad():
        assert torch.equal(run_to_steady_state(second, x), expected)
    flextensor.release(first)
    flextensor.release(second)


def test_state_dict_of_a_shared_model_cannot_change_another_process_weights(shm: Path) -> None:
    a = flextensor.offload(make_model(), shared_config())
    b = flextensor.offload(make_model(), shared_config())
    x = torch.randn(3, WIDTH)
    expected = make_model()(x)
    state = a.state_dict()
    with torch.no_grad():
        state["0.weight"].mul_(2)  # copy on write: this tensor only
    assert torch.equal(run_to_steady_state(b, x), expected)
    assert torch.equal(b.state_dict()["0.weight"], make_model()[0].weight)
    flextensor.release(a)
    flextensor.release(b)
