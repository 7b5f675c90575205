"""A pipeline whose budget holds one component at a time: at each switch, made where the finishing
component's run ends (see [Note: the switch at a run's end] in pipelines/pipeline.py), that component gives
its memory back and the next one lays its plan out, ordered by streams, without waiting for the device (see
[Note: a switch in stream order] in store/stream_order.py). On CUDA the first component's forward is queued
behind a sleep, so the next one takes memory whose last reads are still queued, and its own first kernels
(no sleep) come right after: a missing wait before its copies, after its uploads, or for the previous
one's copies still queued changes the output. Link-bound blocks make every unit resident (the uploads),
compute-bound ones stream them through a ring (the arena, prefetches queued at a forward's end). The CPU
variants run the same path in CI."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import flextensor
from flextensor.api import engine_of
from flextensor.device.runtime import DeviceRuntime, HostStream
from flextensor.pipelines.pipeline import pipeline_of
from flextensor.store.device_store import DeviceStore
from test_gpu_pipeline import generation
from test_gpu_pipeline import steady as run_until_steady

NAMES = ("first", "second", "third")


class Blocks(nn.Module):
    """``repeats`` passes through each block: 1 is link-bound on a GPU (a plan keeps every block resident
    when the budget allows), 8 compute-bound (a plan streams them with the least memory). ``sleeps``: the
    forward is queued behind a sleep on a GPU, its reads of the weights included, while the host goes on
    to the next component's switch."""

    def __init__(self, dim: int, layers: int, repeats: int, sleeps: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.repeats, self.sleeps = repeats, sleeps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.sleeps:
            torch.cuda._sleep(20_000_000)  # about 10 ms
        for block in self.blocks:
            for _ in range(self.repeats):
                x = torch.tanh(block(x))
        return x


def components(dim: int, dtype: torch.dtype, device: str, repeats: int) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        name: Blocks(dim, 6, repeats, sleeps=name == "first").to(device=device, dtype=dtype) for name in NAMES
    }


def largest_peak(parts: dict[str, nn.Module], device: str, x: torch.Tensor) -> tuple[int, int]:
    """The largest planned peak of a step and the largest layout, with room for every component."""
    expected = generation(parts, x)
    flextensor.offload(parts, flextensor.OffloadConfig(device=device))
    try:
        run_until_steady(parts, x, expected)
        engines = [engine_of(m) for m in parts.values()]
        return max(e.planned_peak_bytes() for e in engines), max(e.store.device_bytes_held() for e in engines)
    finally:
        flextensor.release(parts)


def layouts_and_peaks(parts: dict[str, nn.Module]) -> tuple[list[int], list[int]]:
    """Each component's layout (arena and resident units) and planned step peak, under the plan in force."""
    engines = [engine_of(m) for m in parts.values()]
    layouts = [
        e.current.plan.arena_bytes + sum(e.units[n].nbytes for n in e.current.plan.resident) for e in engines
    ]
    return layouts, [e.planned_peak_bytes() for e in engines]


@contextlib.contextmanager
def steady_components(
    budget: int, x: torch.Tensor, dim: int = 64, dtype: torch.dtype = torch.float32, repeats: int = 1
) -> Iterator[tuple[dict[str, nn.Module], torch.Tensor]]:
    """The components offloaded under ``budget`` on ``x``'s device and run to steady state, and the output
    of a generation without offload; released at the end."""
    parts = components(dim, dtype, x.device.type, repeats)
    expected = generation(parts, x)
    flextensor.offload(parts, flextensor.OffloadConfig(device=x.device.type, gpu_memory_budget=budget))
    try:
        run_until_steady(parts, x, expected)
        yield parts, expected
    finally:
        flextensor.release(parts)


def layouts_and_peaks_under(
    budget: int, x: torch.Tensor, dim: int, dtype: torch.dtype, repeats: int
) -> tuple[list[int], list[int]]:
    """:func:`layouts_and_peaks` of components steady under ``budget``, released and let go on return
    (back on a GPU after release(), components kept alive would crowd the next plans)."""
    with steady_components(budget, x, dim, dtype, repeats) as (parts, _):
        return layouts_and_peaks(parts)


def one_at_a_time_budget(dim: int, dtype: torch.dtype, device: str, repeats: int, x: torch.Tensor) -> int:
    """A budget with room for one component's step and never for another's layout beside it. The plans
    depend on the budget: without one a plan may keep blocks resident that a tighter one streams (then
    the layouts shrink), so the budget is narrowed until the plans made under it leave no such room."""
    peak, layout = largest_peak(components(dim, dtype, device, repeats), device, x)
    budget = peak + layout // 2
    for _ in range(3):
        layouts, peaks = layouts_and_peaks_under(budget, x, dim, dtype, repeats)
        if min(layouts) + min(peaks) > budget:
            return budget
        budget = max(peaks) + min(layouts) // 2
    raise AssertionError(f"no budget holds one component at a time: layouts {layouts}, peaks {peaks}")


def watch_switches(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> dict[str, int]:
    """Counts device synchronisations, layouts and vacates, and layouts made while compute was queued."""
    seen = {"synchronize": 0, "lay_out": 0, "vacate": 0, "compute_queued": 0}
    real_sync, real_lay_out, real_vacate = (
        DeviceRuntime.synchronize,
        DeviceStore._lay_out,
        DeviceStore._vacate,
    )

    def synchronize(self) -> None:
        seen["synchronize"] += 1
        real_sync(self)

    def lay_out(self, *args, **kwargs) -> None:
        seen["lay_out"] += 1
        if cuda and not torch.cuda.current_stream().query():
            seen["compute_queued"] += 1
        real_lay_out(self, *args, **kwargs)

    def vacate(self, keep_resident: bool) -> None:
        seen["vacate"] += 1
        real_vacate(self, keep_resident)

    monkeypatch.setattr(DeviceRuntime, "synchronize", synchronize)
    monkeypatch.setattr(DeviceStore, "_lay_out", lay_out)
    monkeypatch.setattr(DeviceStore, "_vacate", vacate)
    return seen


def watch_allocations(monkeypatch: pytest.MonkeyPatch, parts: dict[str, nn.Module]) -> list[bool]:
    """Per device allocation of a layout: whether a copy stream was current (its blocks would go back to
    that stream's pool only)."""
    import flextensor.store.device_store as slots

    copy_streams = [engine_of(m).runtime.copy_stream for m in parts.values()]
    seen: list[bool] = []
    real = slots.allocate_device_bytes

    def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
        seen.append(torch.cuda.current_stream() in copy_streams)
        return real(nbytes, device)

    monkeypatch.setattr(slots, "allocate_device_bytes", allocate)
    return seen


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("repeats", [1, 8], ids=["resident", "streamed"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
@torch.no_grad()
def test_components_switch_without_waiting_for_the_device(
    device: str, repeats: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = device == "cuda"
    dim, tokens = ((4096, 4096) if repeats == 1 else (4096, 2048)) if cuda else (64, 4)
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(tokens, dim, dtype=dtype, device=device)
    budget = one_at_a_time_budget(dim, dtype, device, repeats, x)
    with steady_components(budget, x, dim, dtype, repeats) as (parts, expected):
        layouts, peaks = layouts_and_peaks(parts)
        # The setup, not the switch: no component's step fits beside another's layout (none is laid out
        # ahead beside the finishing one).
        assert min(layouts) + min(peaks) > budget, (layouts, peaks, budget)
        if not cuda:  # a device that counts its memory (the components' alone), as the run-end check reads it
            engines = [engine_of(m) for m in parts.values()]
            held = lambda _runtime: sum(e.store.device_bytes_held() for e in engines)  # noqa: E731
            monkeypatch.setattr(DeviceRuntime, "memory_allocated", held)
        pipeline = pipeline_of(parts)
        vacated, ahead, at_run_end = pipeline.vacated, pipeline.laid_out_ahead, pipeline.switched_at_run_end
        seen = watch_switches(monkeypatch, cuda)
        on_copy_streams = watch_allocations(monkeypatch, parts) if cuda else []
        for _ in range(3):
            assert torch.equal(generation(parts, x), expected)
        assert not any(on_copy_streams)  # from the compute stream's pool, which the next one reuses
        assert pipeline.laid_out_ahead == ahead
        assert pipeline.switched_at_run_end - at_run_end >= 6  # made where each run ends
        assert pipeline.vacated - vacated >= 6 and seen["vacate"] >= 6, seen
        assert seen["lay_out"] >= 6, seen
        assert seen["synchronize"] == 0, seen
        if cuda:
            assert seen["compute_queued"] >= 3, seen  # at least behind each generation's first sleep


@torch.no_grad()
def test_a_switch_synchronises_where_streams_cannot_order_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A component under a host budget (its packs may be unpinned and staged at a layout) keeps the
    synchronising switch, and stays bitwise."""
    x = torch.randn(4, 64)
    parts = components(64, torch.float32, "cpu", repeats=1)
    expected = generation(parts, x)
    peak, layout = largest_peak(components(64, torch.float32, "cpu", repeats=1), "cpu", x)
    weights = sum(p.numel() * p.element_size() for m in parts.values() for p in m.parameters())
    budget = peak + layout // 2
    config = flextensor.OffloadConfig(
        device="cpu", gpu_memory_budget=budget, host_memory_budget=weights * 6 // 10
    )
    flextensor.offload(parts, config)
    try:
        run_until_steady(parts, x, expected)
        seen = watch_switches(monkeypatch, cuda=False)
        assert torch.equal(generation(parts, x), expected)
        assert pipeline_of(parts).switched_at_run_end == 0  # left to the step, which synchronises
        assert any(flextensor.status(m).staging_bytes for m in parts.values())  # a ring: packs staged
        assert seen["vacate"] >= 2 and seen["synchronize"] >= seen["vacate"], seen
    finally:
        flextensor.release(parts)


@pytest.mark.parametrize("by_hand", [False, True], ids=["forward", "unit-by-hand"])
@torch.no_grad()
def test_a_call_on_another_stream_makes_the_next_switch_synchronise(
    by_hand: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ordering on the stream current at a switch covers only the work queued there: once a component ran
    a forward, or one of its blocks called by hand, on another stream, giving it back synchronises; its
    next layout starts afresh."""
    x = torch.randn(4, 64)
    parts = components(64, torch.float32, "cpu", repeats=1)
    expected = generation(parts, x)
    peak, layout = largest_peak(components(64, torch.float32, "cpu", repeats=1), "cpu", x)
    flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", gpu_memory_budget=peak + layout // 2))
    try:
        run_until_steady(parts, x, expected)
        seen = watch_switches(monkeypatch, cuda=False)
        runtime = engine_of(parts["second"]).runtime
        out = parts["second"](parts["first"](x))  # "second" laid out at "first"'s run end, on this stream
        with monkeypatch.context() as patched:  # a stream of its own (a CPU stand-in)
            other = type(runtime.current_stream())()
            patched.setattr(runtime, "current_stream", lambda: other)
            if by_hand:
                parts["second"].blocks[0](out)  # between its steps
            else:
                out = parts["second"](out)
        pipeline = pipeline_of(parts)
        for _ in range(1 if not by_hand else 2):
            at_run_end, synchronized = pipeline.switched_at_run_end, seen["synchronize"]
            out = parts["second"](out)
        # Its run's end: no switch there (giving "second" back would synchronise), so no synchronise yet.
        assert (pipeline.switched_at_run_end, seen["synchronize"]) == (at_run_end, synchronized), seen
        for _ in range(2):
            out = parts["third"](out)
        assert torch.equal(out, expected)
        assert seen["synchronize"] >= 1, seen  # "second" gave its memory back at "third"'s step
        synchronized = seen["synchronize"]
        assert torch.equal(generation(parts, x), expected)
        assert seen["synchronize"] == synchronized, seen  # laid out again on this stream: ordered
    finally:
        flextensor.release(parts)


@torch.no_grad()
def test_a_wrong_guess_at_a_runs_end_costs_a_layout_not_correctness() -> None:
    """A run longer than the last one: the component that followed it last time was laid out at the
    run's end, so the finishing one lays out again at its extra step, giving that one back; a shorter run
    switches at the step. Both stay bitwise, and the next generation switches at its runs' ends again."""
    x = torch.randn(4, 64)
    plain = components(64, torch.float32, "cpu", repeats=1)
    with steady_components(one_at_a_time_budget(64, torch.float32, "cpu", 1, x), x) as (parts, expected):
        pipeline = pipeline_of(parts)
        for runs in ((1, 4, 2), (1, 2, 1), (1, 3, 2)):
            ours, reference = x, x
            for name, count in zip(NAMES, runs, strict=True):
                for _ in range(count):
                    ours, reference = parts[name](ours), plain[name](reference)
            assert torch.equal(ours, reference), runs
        at_run_end = pipeline.switched_at_run_end
        assert torch.equal(generation(parts, x), expected)
        assert pipeline.switched_at_run_end - at_run_end == 3
        held = [flextensor.status(m).device_bytes_held for m in parts.values()]
        assert sum(held) == max(held)  # one component laid out at a time


@torch.no_grad()
def test_a_forward_on_another_stream_than_its_layout_at_a_runs_end_waits_for_the_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The switch at a run's end orders the next component's layout on the stream current then; when its
    forward runs on another one, that stream waits for the copy stream first (its uploads and first
    copies), and the component's next switch synchronises."""
    x = torch.randn(4, 64)
    with steady_components(one_at_a_time_budget(64, torch.float32, "cpu", 1, x), x) as (parts, expected):
        second = engine_of(parts["second"])
        out = parts["first"](x)
        assert second.laid_out  # at the end of the first component's run
        waited: list[object] = []

        class Other(HostStream):  # a stream of its own (a CPU stand-in)
            __slots__ = ()

            def wait_stream(self, stream: object) -> None:
                waited.append(stream)

        other = Other()
        with monkeypatch.context() as patched:
            patched.setattr(second.runtime, "current_stream", lambda: other)
            out = parts["second"](out)
        assert second.runtime.copy_stream in waited
        seen = watch_switches(monkeypatch, cuda=False)
        for name, count in (("second", 2), ("third", 2)):
            for _ in range(count):
                out = parts[name](out)
        assert torch.equal(out, expected)
        assert seen["synchronize"] >= 1, seen  # "second" gave its memory back synchronising


@torch.no_grad()
def test_no_switch_at_a_runs_end_lays_out_more_than_it_gives_back() -> None:
    """Until the next component's step the caller may allocate what no plan counts, so a switch at a run's
    end never leaves less room than the step would: a smaller first component hands over to a larger
    second one at the second one's step; the equal ones switch at the run's end."""
    x = torch.randn(4, 64)
    budget = one_at_a_time_budget(64, torch.float32, "cpu", 1, x)

    def uneven() -> dict[str, nn.Module]:
        torch.manual_seed(0)
        return {name: Blocks(64, 2 if name == "first" else 6, 1, sleeps=False) for name in NAMES}

    parts, plain = uneven(), uneven()
    expected = generation(plain, x)
    flextensor.offload(parts, flextensor.OffloadConfig(device="cpu", gpu_memory_budget=budget))
    try:
        run_until_steady(parts, x, expected)
        first, second = engine_of(parts["first"]), engine_of(parts["second"])
        assert first.layout_bytes() < second.layout_bytes()
        assert first.layout_bytes() + second.planned_peak_bytes() > budget  # not laid out ahead either
        pipeline = pipeline_of(parts)
        at_run_end = pipeline.switched_at_run_end
        out = parts["first"](x)
        assert not second.laid_out and first.laid_out
        for name, count in (("second", 3), ("third", 2)):
            for _ in range(count):
                out = parts[name](out)
        assert torch.equal(out, expected)
        assert pipeline.switched_at_run_end - at_run_end == 2  # "second" to "third", "third" to "first"
    finally:
        flextensor.release(parts)


@torch.no_grad()
def test_a_resident_unit_called_by_hand_after_a_layout_ahead_reads_its_upload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layout ahead uploads the next component's resident units on its copy stream while the finishing
    one's compute may still be queued. Resident units carry no hooks, so one called directly before that
    component's forward is ordered after its upload only by the stream the layout was made on having
    waited for the copy stream then."""
    from flextensor import api
    from flextensor.plan.measurements import LinkModel

    real_probe = api.probe_links  # a slow link (10 kB/s): plans keep every block resident where it fits
    monkeypatch.setattr(
        api, "probe_links", lambda store, arena: (LinkModel.constant(1e4), real_probe(store, arena)[1])
    )
    x = torch.randn(4, 64)
    peak, layout = largest_peak(components(64, torch.float32, "cpu", repeats=1), "cpu", x)
    with steady_components(peak + layout, x) as (parts, expected):  # room for one layout beside a step
        pipeline, second = pipeline_of(parts), engine_of(parts["second"])
        assert torch.equal(generation(parts, x), expected)
        second.vacate()
        waits: list[object] = []
        real_wait = HostStream.wait_stream

        def wait_stream(stream: HostStream, other: object) -> None:
            waits.append(other)
            real_wait(stream, other)

        monkeypatch.setattr(HostStream, "wait_stream", wait_stream)
        ahead = pipeline.laid_out_ahead
        out = parts["first"](x)
        assert pipeline.laid_out_ahead == ahead + 1 and second.laid_out
        assert any(s is second.runtime.copy_stream for s in waits), waits  # before any call of "second"
        block = parts["second"].blocks[0]
        assert not block._forward_pre_hooks  # resident: nothing would wait at its call
        assert torch.equal(block(out), components(64, torch.float32, "cpu", 1)["second"].blocks[0](out))
        for name, count in (("second", 3), ("third", 2)):  # the rest of the generation
            for _ in range(count):
                out = parts[name](out)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@torch.no_grad()
def test_a_run_that_ends_in_a_give_back_copies_nothing_in_for_a_next_forward(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last forward of a run, after which the component gives its memory back, does not copy in the
    first units of a next forward (the ring's wrap): they would be thrown away, and they held up the
    link and the switch. A run longer than the last one loads them at its extra forward, bitwise."""
    from flextensor.store.copies import holds_weights

    cuda = device == "cuda"
    dim, tokens, repeats = (4096, 2048, 8) if cuda else (64, 4, 1)
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(tokens, dim, dtype=dtype, device=device)
    longer_run = (1, 4, 2)  # "second" runs once more than it learned
    reference = x
    for name, count in zip(NAMES, longer_run, strict=True):
        plain = components(dim, dtype, device, repeats)[name]  # one at a time: the budget is tight
        for _ in range(count):
            reference = plain(reference)
        del plain
    with steady_components(one_at_a_time_budget(dim, dtype, device, repeats, x), x, dim, dtype, repeats) as (
        parts,
        expected,
    ):
        engines = {id(engine_of(m).store): engine_of(m) for m in parts.values()}
        first_held: list[bool] = []  # at each give-back of a component with a wrapping ring
        real_vacate = DeviceStore._vacate

        def vacate(self: DeviceStore, keep_resident: bool) -> None:
            plan = engines[id(self)].current.plan
            if plan.streamed and self.past_end:
                first_held.append(holds_weights(engines[id(self)].units[plan.streamed[0]], self.owner))
            real_vacate(self, keep_resident)

        monkeypatch.setattr(DeviceStore, "_vacate", vacate)
        for _ in range(2):
            assert torch.equal(generation(parts, x), expected)
        assert len(first_held) >= 4 and not any(first_held), first_held
        assert all(not e._past_end_off for e in engines.values())
        wrapping = [(u, ring) for e in engines.values() for u, ring, _ in e.store.past_end]
        assert all(u.prefetch_next == ring for u, ring in wrapping)  # the layout's own after the forward
        ours = x
        for name, count in zip(NAMES, longer_run, strict=True):
            for _ in range(count):
                ours = parts[name](ours)
        assert torch.equal(ours, reference)
