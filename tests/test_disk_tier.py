"""The disk tier end to end on CPU: offload(weights=...) under a host budget too small for every pack
streams the rest from the checkpoint file through the staging ring; outputs stay bitwise, status and
report show the disk bytes, state_dict() and release() read the file, editing refuses, the planner times
disk units with their own speed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import flextensor
import flextensor.host.checkpoint as checkpoint
from engine_helpers import LEARN, assert_all_equal, first_tensor, install_placement, run_forwards
from flextensor.hooks.functions import input_signature
from flextensor.host.disk import READ_AHEAD, plan_disk_tier
from flextensor.host.staging import staging_layout
from flextensor.plan.host_plan import HostPlan, choose_staged, pack_bytes
from flextensor.plan.measurements import LinkModel, Measurements, UnitMeasurement
from flextensor.plan.planner import plan_offload
from real_models import llama_inputs, tiny_llama
from streaming import streaming_config
from test_host_budget import LAYERS, budget_for

LAYER_COUNT = 7  # with the ring, the read-ahead buffers and one unit pinned, the others are on disk


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, torch.Tensor]:
    model = tiny_llama(layers=LAYER_COUNT)
    with torch.no_grad():
        return model, first_tensor(model(llama_inputs()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, llama) -> Path:
    path = tmp_path_factory.mktemp("disk") / "llama"
    llama[0].save_pretrained(path)
    return path


def meta_llama(reference: nn.Module) -> nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(reference.config).eval()


def disk_budget_for(reference: nn.Module, pinned_units: int) -> int:
    """A host budget that holds the staging ring, the disk reader's buffers and ``pinned_units`` packs."""
    return budget_for(reference, pinned_units + READ_AHEAD)


def offload_with_disk(
    reference: nn.Module, saved: Path, pinned_units: int = 1, budget: int | None = None
) -> nn.Module:
    model = meta_llama(reference)
    budget = disk_budget_for(reference, pinned_units) if budget is None else budget
    return flextensor.offload(
        model, streaming_config(model, LAYERS, host_memory_budget=budget), weights=saved
    )


def test_units_beyond_the_budget_stream_from_the_file_bitwise(saved: Path, llama) -> None:
    reference, expected = llama
    model = offload_with_disk(reference, saved)
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 3), expected)  # learning and steady state
    status = flextensor.status(model)
    assert status.phase == "inference"
    assert all(u.placement == "streamed" for u in status.units)
    on_disk = [u for u in status.units if u.on_disk]
    assert 0 < len(on_disk) < len(status.units)  # one unit keeps its pack, the others are on disk
    assert all(u.staged and u.host_bytes == 0 for u in on_disk)
    assert status.disk_bytes == sum(u.nbytes for u in on_disk)
    assert status.read_ahead_bytes == READ_AHEAD * max(u.nbytes for u in status.units)
    assert status.direct_bytes + status.staging_bytes + status.read_ahead_bytes <= status.host_budget_bytes
    assert status.host_bytes_held == sum(u.host_bytes for u in status.units)
    ahead, inline = status.disk_reads_ahead, status.disk_reads_inline
    assert ahead > 0
    # steady state: every disk unit was read ahead of its copy, and computes bitwise from that read
    assert_all_equal(run_forwards(model, llama_inputs(), 3), expected)
    after = flextensor.status(model)
    assert after.disk_reads_inline == inline
    assert after.disk_reads_ahead == ahead + 3 * len(on_disk)
    report = flextensor.report(model)
    assert report.disk_bytes == status.disk_bytes
    assert report.read_ahead_bytes == status.read_ahead_bytes
    assert "read from the checkpoint file through" in str(report)


def test_reads_ahead_split_in_pieces_land_where_they_belong(
    saved: Path, llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each unit read ahead in many small pieces, by several threads at once, computes bitwise."""
    import flextensor.host.disk as disk_tier

    monkeypatch.setattr(disk_tier, "READ_CHUNK", 4096 + 512)  # pieces that straddle the tensors' ends
    reference, expected = llama
    model = offload_with_disk(reference, saved)
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 3), expected)
    status = flextensor.status(model)
    assert min(u.nbytes for u in status.units if u.on_disk) > 4 * disk_tier.READ_CHUNK
    assert status.disk_reads_ahead > 0
    flextensor.release(model)


def test_a_budget_too_small_for_the_read_ahead_buffers_keeps_packs_and_reads_inline(
    saved: Path, llama
) -> None:
    """Beside the ring, the budget holds one unit, not two read-ahead buffers: there are none, that unit
    keeps its pack, every disk unit is read when its copy is issued, and outputs stay bitwise."""
    reference, expected = llama
    model = offload_with_disk(reference, saved, budget=budget_for(reference, 1))
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 2), expected)
    status = flextensor.status(model)
    assert status.read_ahead_bytes == 0 and status.direct_bytes > 0
    assert sum(u.on_disk for u in status.units) == len(status.units) - 1
    assert status.disk_reads_ahead == 0 and status.disk_reads_inline > 0
    assert status.direct_bytes + status.staging_bytes <= status.host_budget_bytes


MiB = 2**20


def test_plan_disk_tier_at_its_edges() -> None:
    sizes = [4 * MiB] * 6
    slot, slots = staging_layout(4 * MiB)
    ring = slot * slots
    assert plan_disk_tier(sizes, None) == (frozenset(), 0)
    assert plan_disk_tier(sizes, 24 * MiB) == (frozenset(), 0)  # every pack fits: no ring, no disk
    assert plan_disk_tier(sizes, ring - 1) == (frozenset(), 0)  # not even the ring (start raises)
    assert plan_disk_tier(sizes, ring + 4 * MiB) == (frozenset({1, 2, 3, 4, 5}), 0)  # no room for buffers
    assert plan_disk_tier(sizes, ring + 12 * MiB) == (frozenset({1, 2, 3, 4, 5}), 4 * MiB)
    # the buffers hold the largest unit left on disk, not the largest of all
    slot, slots = staging_layout(12 * MiB)
    disk, buffer = plan_disk_tier([12 * MiB] + [2 * MiB] * 40, slot * slots + 40 * MiB)
    assert 0 not in disk and buffer == 2 * MiB
    assert len(disk) == 28  # 40 MiB: buffers 2 x 2, the large unit, 12 small ones (2 with 12 MiB buffers)


@given(
    st.lists(st.integers(1, 64 * MiB), min_size=1, max_size=24),
    st.integers(0, 2**31),
)
@settings(max_examples=300, deadline=None)
def test_plan_disk_tier_stays_within_the_budget(sizes: list[int], budget: int) -> None:
    disk, buffer = plan_disk_tier(sizes, budget)
    if not disk:
        assert buffer == 0
        return
    slot, slots = staging_layout(max(sizes))
    kept = sum(pack_bytes(n) for i, n in enumerate(sizes) if i not in disk)
    assert slot * slots + READ_AHEAD * buffer + kept <= budget
    assert buffer == 0 or buffer == max(sizes[i] for i in disk)


def test_without_weights_a_small_budget_still_stages_pageable_packs(llama) -> None:
    reference, expected = llama
    model = tiny_llama(layers=LAYER_COUNT)
    flextensor.offload(model, streaming_config(model, LAYERS, host_memory_budget=budget_for(reference, 1)))
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 1), expected)
    status = flextensor.status(model)
    assert status.disk_bytes == 0 and not any(u.on_disk for u in status.units)
    assert any(u.staged for u in status.units)


def test_state_dict_of_disk_units_is_the_checkpoint(saved: Path, llama) -> None:
    reference, _ = llama
    model = offload_with_disk(reference, saved)
    run_forwards(model, llama_inputs(), LEARN + 1)
    assert any(u.on_disk for u in flextensor.status(model).units)
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name


def test_release_reads_disk_units_back(saved: Path, llama) -> None:
    reference, expected = llama
    model = offload_with_disk(reference, saved)
    run_forwards(model, llama_inputs(), LEARN + 1)
    flextensor.release(model, "cpu")
    assert_all_equal(run_forwards(model, llama_inputs(), 1), expected)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_editing_refuses_a_model_with_disk_units(saved: Path, llama) -> None:
    reference, expected = llama
    model = offload_with_disk(reference, saved)
    refused = pytest.raises(flextensor.UnsupportedOperationError, match="checkpoint file")
    with refused, flextensor.editing(model):
        pass
    assert_all_equal(run_forwards(model, llama_inputs(), 2), expected)


def test_a_saved_profile_keeps_the_disk_units_streaming_bitwise(saved: Path, llama, tmp_path: Path) -> None:
    reference, expected = llama
    model = offload_with_disk(reference, saved)
    run_forwards(model, llama_inputs(), LEARN)
    path = tmp_path / "llama.profile"
    flextensor.save_profile(model, path)
    from flextensor.profiles.file import load_profile_file

    host = load_profile_file(path).host  # `flextensor plan` then times the disk units as this run did
    on_disk = {u.name for u in flextensor.status(model).units if u.on_disk}
    assert host is not None and host.disk_units == on_disk and host.disk_link is not None
    plan = flextensor.status(model).plan
    flextensor.release(model)
    again = meta_llama(reference)
    budget = disk_budget_for(reference, 1)
    config = streaming_config(again, LAYERS, host_memory_budget=budget, profile=path)
    flextensor.offload(again, config, weights=saved)
    assert_all_equal(run_forwards(again, llama_inputs(), 2), expected)
    status = flextensor.status(again)
    assert status.plan is not None and plan is not None and status.plan.staged == plan.staged
    assert status.disk_bytes > 0 and status.forwards == 2 and status.phase == "inference"


def test_disk_units_made_resident_are_read_from_the_file(saved: Path, llama) -> None:
    reference, expected = llama
    model = offload_with_disk(reference, saved)
    inputs = llama_inputs()
    run_forwards(model, inputs, LEARN)
    on_disk = [u.name for u in flextensor.status(model).units if u.on_disk]
    keep = on_disk[:2]  # placed by hand: on a CPU the tightest budget streams everything
    install_placement(model, input_signature((inputs,), {}), keep)
    assert_all_equal(run_forwards(model, inputs, 3), expected)
    status = flextensor.status(model)
    assert [u.name for u in status.units if u.placement == "resident"] == keep
    assert all(status.unit(name).uploads == 1 and status.unit(name).on_disk for name in keep)
    assert status.unit(keep[0]).host_bytes == 0  # uploaded from the file: no host pack was built


def test_disk_units_are_always_staged_and_need_no_pinned_room() -> None:
    order, nbytes = [0, 1, 2], [4096, 4096, 4096]
    starts, compute = [0.0, 1.0, 2.0], [1.0, 1.0, 1.0]
    staged = choose_staged(
        order, nbytes, starts, compute, 3.0, [2, 0, 1], [0.1] * 3, 3 * 4096, frozenset({1})
    )
    assert staged == frozenset({1})  # the others fit the pinned capacity: only the disk unit is staged
    staged = choose_staged(order, nbytes, starts, compute, 3.0, [2, 0, 1], [0.1] * 3, 4096, frozenset({1}))
    assert 1 in staged and len(staged) == 2  # one more staged to fit one pack


def test_the_planner_times_disk_units_at_the_disk_speed() -> None:
    units = tuple(UnitMeasurement(f"u{i}", 2**20, 1e-3, 0.0) for i in range(4))
    link = LinkModel(points=((2**20, 10e9),))
    measurements = Measurements(units=units, link=link, baseline_bytes=0, activation_peak_bytes=0, tail_s=0.0)
    staged_link = LinkModel(points=((2**20, 5e9),))
    slow_disk = LinkModel(points=((2**20, 0.01e9),))  # 100 ms a unit: far slower than the compute
    fast = HostPlan(10 * 2**20, staged_link)
    slow = HostPlan(10 * 2**20, staged_link, disk_units=frozenset({"u1", "u2"}), disk_link=slow_disk)
    budget = 3 * 2**20
    plan_fast = plan_offload(measurements, budget, fast)
    plan_slow = plan_offload(measurements, budget, slow)
    assert set(plan_slow.staged) >= {"u1", "u2"} & set(plan_slow.streamed)
    assert plan_slow.predicted_step_s > plan_fast.predicted_step_s


class _SlowPack:
    """Stands in for a DiskPack: its reads fill the slot with its name, once ``gate`` (if any) opens."""

    def __init__(self, name: str, gate: threading.Event | None = None) -> None:
        self.name, self.nbytes, self.gate, self.reads = name, 8, gate, 0

    def fill(self, slot: torch.Tensor, offset: int) -> None:
        self.reads += 1
        if self.gate is not None:
            self.gate.wait(10)
        slot.fill_(ord(self.name))


class _InlineRing:
    """Stands in for the staging ring: a copy reads straight into the destination."""

    def copy(self, destination: torch.Tensor, fill, stream: object) -> None:
        fill(destination, 0)


def test_an_interrupted_copy_keeps_its_buffer_until_the_read_into_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while a copy waits for its read ahead: that read goes on writing into its buffer, so no
    other read may be given the buffer until it ends."""
    import flextensor.host.disk as disk_tier

    gate = threading.Event()
    packs = [_SlowPack("a", gate), _SlowPack("b"), _SlowPack("c")]
    reader = disk_tier.DiskReadAhead(8)
    reader.plan(packs)  # type: ignore[arg-type]  # reads a and b ahead, one buffer each
    destination = torch.empty(8, dtype=torch.uint8)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(disk_tier, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            reader.copy(packs[0], _InlineRing(), destination, None)  # type: ignore[arg-type]
    # c was not read ahead: it is read inline, then the reader would read a again into a free buffer;
    # the only other buffer is b's, still pending, so a's must not be free while its first read runs.
    reader.copy(packs[2], _InlineRing(), destination, None)  # type: ignore[arg-type]
    assert packs[0].reads == 1
    gate.set()
    reader.close()


# -- host memory -------------------------------------------------------------------------------------------

RSS_LAYERS, RSS_IN, RSS_OUT = 24, 1024, 1024  # 24 units of 4 MiB: 96 MiB of float32 weights

_RSS_CHILD = """
import sys, threading, time
import psutil, torch
from torch import nn
import flextensor

with torch.device("meta"):
    model = nn.Sequential(*[nn.Linear({n_in}, {n_out}, bias=False) for _ in range({layers})]).eval()
process = psutil.Process()
x = torch.randn(1, {n_in})
peak = before = process.memory_info().rss
done = False

def sample():
    global peak
    while not done:
        peak = max(peak, process.memory_info().rss)
        time.sleep(0.002)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
config = flextensor.OffloadConfig(device="cpu", gpu_memory_budget="8MiB", host_memory_budget="16MiB")
flextensor.offload(model, config, weights=sys.argv[1])
with torch.no_grad():
    for _ in range({forwards}):
        model(x)
done = True
sampler.join()
peak = max(peak, process.memory_info().rss)
status = flextensor.status(model)
assert status.phase == "inference" and status.disk_bytes > 0, status
print(peak - before)
"""


def test_host_memory_stays_below_the_weights(tmp_path: Path) -> None:
    """Offloaded from a checkpoint under a small host budget, the model runs with far less host RAM than
    its weights: most units stay in the file, and streaming them holds only the ring and the reader's
    buffers."""
    import os
    import subprocess
    import sys
    import textwrap

    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {f"{i}.weight": torch.randn(RSS_OUT, RSS_IN) for i in range(RSS_LAYERS)}
    weights = sum(t.numel() * t.element_size() for t in state.values())
    save_file(state, str(tmp_path / "big.safetensors"))
    del state
    child = _RSS_CHILD.format(layers=RSS_LAYERS, n_in=RSS_IN, n_out=RSS_OUT, forwards=LEARN + 2)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "FT_PROGRESS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(child), str(tmp_path / "big.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.strip().splitlines()[-1])
    print(f"RSS grew by {growth / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights")
    assert growth <= weights / 2, (
        f"RSS grew by {growth / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"
    )


class _Locks:
    """Stands in for page-locking on a CPU: records which packs were locked and unlocked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import flextensor.host.packs as host_store

        self.locked: list[int] = []
        self.unlocked: list[int] = []
        monkeypatch.setattr(
            host_store, "page_lock", lambda buffer, n, what: self.locked.append(buffer.data_ptr())
        )

        def unlock_later(owner: object, mapping: object, pointer: int):
            return lambda: self.unlocked.append(pointer)

        monkeypatch.setattr(host_store, "unlock_when_gone", unlock_later)


def _units(model: nn.Module, count: int) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    params = dict(model.named_parameters())
    return [
        (f"model.layers.{i}", [(n, p) for n, p in params.items() if n.startswith(f"model.layers.{i}.")])
        for i in range(count)
    ]


def test_a_pack_unpinned_before_its_reader_pins_it_stays_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host budget may stage a pack (unpin it) before its reader got to it; the reader's late pin must
    not lock memory the budget no longer counts."""
    from flextensor.host.packs import UnitPack

    locks = _Locks(monkeypatch)
    pack = UnitPack("u", (), 8192, pin=False)
    pack.reader_pins = True
    pack.unpin()  # staged by the budget first
    pack.pin(by_reader=True)
    assert not pack.pinned and locks.locked == []
    pack.pin()  # the budget's own pin still works
    assert pack.pinned and len(locks.locked) == 1
    pack.unpin()
    assert not pack.pinned and len(locks.unlocked) == 1
    pack.free()


def test_readers_pin_the_packs_a_budget_keeps_beside_the_disk_units(
    saved: Path, llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a host budget that leaves units on disk, every pack it keeps is direct: the readers pin them
    in the background, the disk units get none; a budget too small for the ring pins nothing."""
    reference, _ = llama
    locks = _Locks(monkeypatch)
    model = meta_llama(reference)
    load = checkpoint.plan_checkpoint_load(model, saved)
    units = _units(model, LAYER_COUNT)
    budget = disk_budget_for(reference, 1)  # the ring, the read-ahead buffers, one pack; the rest on disk
    packs, _ = checkpoint.read_checkpoint(
        load,
        units,
        [],
        pin=True,
        device=torch.device("cpu"),
        advance=lambda n: None,
        host_budget_bytes=budget,
    )
    for pack in packs:
        pack.wait_read()
    kept = [p for p in packs if not p.disk]
    assert len(kept) == 1 and all(p.pinned and p.reader_pins for p in kept)
    assert len(locks.locked) == len(kept)
    for pack in packs:
        pack.free()
    # too small for the ring: nothing is pinned (HostBudget.start raises its error)
    packs, _ = checkpoint.read_checkpoint(
        load, units, [], pin=True, device=torch.device("cpu"), advance=lambda n: None, host_budget_bytes=1
    )
    for pack in packs:
        pack.wait_read()
        assert not pack.pinned
        pack.free()
