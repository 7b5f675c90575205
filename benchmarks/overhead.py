"""Host-side costs of the engine: per-unit overhead of a steady step, and how setup scales with units.

    python -m benchmarks.overhead --device cuda                    # both measurements, a table each
    python -m benchmarks.overhead --device cpu --skip-scaling      # only the per-unit hot-path overhead

Per-unit overhead: a stack of ``--units`` small linear layers (decode-like: one token, launch-bound), every
unit streamed (the tightest budget the planner accepts). The host time to enqueue one forward (no device
synchronisation inside it) is timed for the model held natively and offloaded; the difference divided by
the number of streamed units is what each unit's hooks, copies and events cost the host.

Scaling: offload() plus the first three forwards (discovery, profiling, the first steady one) of stacks of
1,000 and 10,000 tiny units, each in a fresh process, with the growth of its resident set size. The cost
per unit should not grow with the number of units.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

SCALING_UNITS = (1_000, 10_000)
"""Unit counts of the scaling run: a ratio of ten shows any quadratic term clearly."""

TIMED_FORWARDS = 50
"""Steady forwards timed per variant (over ROUNDS rounds, rounded up); the median is reported."""

PROFILE_HOST = False
"""Set by --profile: print where the host time of 20 steady forwards goes (cProfile)."""


class Stack(nn.Module):
    """``units`` linear layers applied in sequence; each layer is one offload unit."""

    def __init__(self, units: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_times(model: nn.Module, x: torch.Tensor, device: torch.device, n: int) -> list[float]:
    """Seconds the host spends enqueueing each of ``n`` forwards (the device drained between them)."""
    times = []
    with torch.no_grad():
        for _ in range(n):
            _sync(device)
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
    _sync(device)
    return times


def _tightest_budget(model: nn.Module, config_fields: dict, x: torch.Tensor, path: str) -> int:
    """The smallest budget the planner accepts for ``model``: profile it once, save the profile to ``path``
    (the timed run starts from it: a second profiling may measure a few activation bytes more, and the
    budget would then be just short), ask the planner."""
    import flextensor
    from flextensor.plan.planner import minimal_need_bytes

    try:
        from flextensor.profiles.file import load_profile_file
    except ImportError:  # the engine before its redesign (benchmarked for the before/after numbers)
        from flextensor.profile import load_profile_file  # type: ignore[no-redef]

    flextensor.offload(model, flextensor.OffloadConfig(**config_fields))
    with torch.no_grad():
        while flextensor.phase(model) != "inference":
            model(x)
    flextensor.save_profile(model, path)
    need, _ = minimal_need_bytes(load_profile_file(path).measurements)
    flextensor.release(model)
    return need


ROUNDS = 7
"""Rounds of timed forwards; each round times every variant once, so drifts of the host hit them alike."""


def _offloaded_copy(model: nn.Module, x: torch.Tensor, device: torch.device, plain: bool) -> nn.Module:
    """``model`` offloaded under the tightest budget and brought to steady state; ``plain``: with the
    plain steady step (torch's calls) instead of the direct runtime calls."""
    import flextensor
    import flextensor.device.runtime

    model = copy.deepcopy(model)
    fields = {"include_patterns": ["layers.*"], "device": str(device)}
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "profile.json")
        budget = _tightest_budget(model, fields, x, profile)
        config = flextensor.OffloadConfig(gpu_memory_budget=budget, profile=profile, **fields)
        runtime = flextensor.device.runtime.DeviceRuntime
        direct_calls = getattr(runtime, "direct_calls", None)
        if plain and direct_calls is not None:
            runtime.direct_calls = lambda self: None  # type: ignore[method-assign]
        try:
            flextensor.offload(model, config)
        finally:
            if direct_calls is not None:
                runtime.direct_calls = direct_calls  # type: ignore[method-assign]
        with torch.no_grad():
            while flextensor.phase(model) != "inference":
                model(x)
    return model


def per_unit_overhead(device: torch.device, units: int, hidden: int, compare_plain: bool) -> dict[str, float]:
    import flextensor

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Stack(units, hidden).to(dtype).eval()
    x = torch.randn(1, hidden, dtype=dtype, device=device)
    variants = {
        "native": copy.deepcopy(model).to(device),
        "offloaded": _offloaded_copy(model, x, device, plain=False),
    }
    if compare_plain:
        variants["plain"] = _offloaded_copy(model, x, device, plain=True)
    for variant in variants.values():
        _host_times(variant, x, device, 5)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:  # each goes first in turn
            times[name].extend(_host_times(variants[name], x, device, -(-TIMED_FORWARDS // ROUNDS)))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    offloaded = variants["offloaded"]
    if PROFILE_HOST:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        _host_times(offloaded, x, device, 20)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)

    def streamed_units(model: nn.Module) -> int:
        return sum(1 for row in flextensor.report(model).units if not row.resident)

    streamed = streamed_units(offloaded)
    row = {
        "units": units,
        "streamed": streamed,
        "native_host_ms": medians["native"] * 1e3,
        "offloaded_host_ms": medians["offloaded"] * 1e3,
        "per_unit_us": (medians["offloaded"] - medians["native"]) / max(streamed, 1) * 1e6,
    }
    if compare_plain:
        row["plain_host_ms"] = medians["plain"] * 1e3
        plain_streamed = streamed_units(variants["plain"])
        row["plain_per_unit_us"] = (medians["plain"] - medians["native"]) / max(plain_streamed, 1) * 1e6
    for name in variants:
        if name != "native":
            flextensor.release(variants[name])
    return row


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scaling_child(units: int, device: str) -> dict[str, float]:
    """One scaling measurement in this (fresh) process."""
    import flextensor

    torch.manual_seed(0)
    model = Stack(units, 4).eval()
    x = torch.randn(1, 4)
    if device.startswith("cuda"):
        x = x.to(device)
    rss0 = _rss_bytes()
    start = time.perf_counter()
    flextensor.offload(model, flextensor.OffloadConfig(include_patterns=["layers.*"], device=device))
    offload_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(3):
            model(x)
    _sync(torch.device(device))
    forwards_s = time.perf_counter() - start
    return {
        "units": units,
        "offload_s": offload_s,
        "three_forwards_s": forwards_s,
        "rss_growth_mib": (_rss_bytes() - rss0) / 2**20,
        "phase": flextensor.phase(model),
    }


def scaling(device: str) -> list[dict[str, float]]:
    rows = []
    for units in SCALING_UNITS:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.overhead", "--child", str(units), "--device", device],
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--units", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile 20 steady offloaded forwards")
    parser.add_argument(
        "--compare-plain",
        action="store_true",
        help="also time the plain steady step (torch's calls, not the direct runtime calls), interleaved",
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(scaling_child(args.child, args.device)))
        return 0
    global PROFILE_HOST
    PROFILE_HOST = args.profile
    device = torch.device(args.device)
    row = per_unit_overhead(device, args.units, args.hidden, args.compare_plain)
    print(
        f"per-unit host overhead on {device}: {row['per_unit_us']:.1f} us per streamed unit "
        f"({row['streamed']} of {row['units']} streamed; host enqueue {row['native_host_ms']:.2f} ms "
        f"native, {row['offloaded_host_ms']:.2f} ms offloaded)"
    )
    if "plain_per_unit_us" in row:
        print(
            f"plain steady step (torch's calls): {row['plain_per_unit_us']:.1f} us per streamed unit "
            f"(host enqueue {row['plain_host_ms']:.2f} ms)"
        )
    if not args.skip_scaling:
        rows = scaling(args.device)
        print(f"{'units':>8} {'offload s':>10} {'3 fwd s':>9} {'RSS MiB':>9} {'us/unit':>9} {'KiB/unit':>9}")
        for r in rows:
            per = (r["offload_s"] + r["three_forwards_s"]) / r["units"] * 1e6
            print(
                f"{r['units']:>8} {r['offload_s']:>10.2f} {r['three_forwards_s']:>9.2f} "
                f"{r['rss_growth_mib']:>9.1f} {per:>9.1f} {r['rss_growth_mib'] * 1024 / r['units']:>9.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
