"""The ``flextensor`` command: a thin layer over the public API.

    flextensor probe [--device cuda:0] [--sizes 1MiB,16MiB,256MiB]
    flextensor profile show PATH
    flextensor plan PATH [--budget 8GiB | --budget 4GiB..16GiB [--steps 8] | --budget none]
    flextensor demo [--device cpu|cuda] [--layers N] [--hidden N] [--seq N] [--steps N] [--budget SIZE]

Every failure flextensor anticipates (a bad path, size or profile; no CUDA for ``probe``) prints one line
on stderr and exits with status 2; ``--help`` works on every subcommand.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flextensor.common.sizes import format_bytes, parse_bytes
from flextensor.common.version import __version__
from flextensor.errors import BudgetError, ConfigError, FlexTensorError

if TYPE_CHECKING:
    from rich.console import Console

    from flextensor.plan.host_plan import HostPlan
    from flextensor.plan.measurements import Measurements
    from flextensor.plan.plan import Plan
    from flextensor.profiles.file import Profile

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_ERROR = 2
"""Status for every anticipated failure, the same argparse uses for a bad command line."""

DEFAULT_RANGE_STEPS = 8
"""Budgets in a ``--budget LO..HI`` table, both ends included."""

_NON_TERMINAL_WIDTH = 120
"""Table width when stdout is not a terminal (rich would use 80, folding real models' unit paths)."""


def _console() -> Console:
    from rich.console import Console

    width = None
    if "COLUMNS" not in os.environ and not sys.stdout.isatty():
        width = _NON_TERMINAL_WIDTH
    return Console(width=width, highlight=False)


# -- budgets ------------------------------------------------------------------------------------------------


def parse_budget(text: str, steps: int = DEFAULT_RANGE_STEPS) -> list[int | None]:
    """``"8GiB"`` -> one budget; ``"4GiB..16GiB"`` -> ``steps`` evenly spaced; ``"none"`` -> [None]."""
    text = text.strip()
    if text.lower() == "none":
        return [None]
    if ".." not in text:
        return [parse_bytes(text)]
    low_text, _, high_text = text.partition("..")
    low, high = parse_bytes(low_text), parse_bytes(high_text)
    if low > high:
        raise ConfigError(f"budget range {text!r} runs backwards; write LOW..HIGH, e.g. '4GiB..16GiB'")
    if steps < 2:
        raise ConfigError(f"--steps must be at least 2 for a budget range, got {steps}")
    return [round(low + (high - low) * i / (steps - 1)) for i in range(steps)]


# -- probe --------------------------------------------------------------------------------------------------


def _cmd_probe(args: argparse.Namespace) -> int:
    from flextensor.observe.probe import run_probe

    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) <= 0:
        raise ConfigError(f"--sizes needs positive sizes such as '1MiB,16MiB,256MiB', got {args.sizes!r}")
    result = run_probe(args.device, sizes, repeats=args.repeats)
    _console().print(result)
    return EXIT_OK


# -- profile show -------------------------------------------------------------------------------------------


def _load_profiles(path: str) -> dict[str, Profile]:
    """The profile at ``path`` by component: ``{"": profile}`` for one model's, every component's for a
    pipeline's (see pipelines/profile.py)."""
    from flextensor.pipelines.profile import is_pipeline_profile, read_pipeline_profile
    from flextensor.profiles.file import profile_from_dict, read_profile_json

    data = read_profile_json(path)
    if is_pipeline_profile(data):
        return read_pipeline_profile(path, data)
    return {"": profile_from_dict(data, source=path)}


def _cmd_profile_show(args: argparse.Namespace) -> int:
    profiles = _load_profiles(args.path)
    console = _console()
    if "" not in profiles:  # a pipeline's: each component's profile in turn
        about = _grid()
        about.add_row("pipeline profile", str(args.path))
        about.add_row("components", ", ".join(profiles))
        console.print(about)
    for name, profile in profiles.items():
        if name:
            console.print()
            console.rule(f"component {name}")
        _show_profile(console, profile, args.path)
    return EXIT_OK


def _show_profile(console: Console, profile: Profile, path: str) -> None:
    from rich.table import Table

    fp = profile.fingerprint
    elements = 0
    for _, shape, _ in fp.parameters:
        count = 1
        for dim in shape:
            count *= dim
        elements += count

    about = _grid()
    about.add_row("profile", str(path))
    about.add_row("written", f"by flextensor {profile.flextensor_version} at {profile.created_at}")
    about.add_row("device", fp.device_name)
    about.add_row("torch", fp.torch_version)
    about.add_row("include", ", ".join(fp.include_patterns) or "-")
    about.add_row("exclude", ", ".join(fp.exclude_patterns) or "-")
    about.add_row("input shapes", ", ".join(fp.input_shapes) or "-")
    about.add_row("parameters", f"{len(fp.parameters)} tensors, {_count(elements)} elements")
    if fp.world_size > 1:
        about.add_row("rank", f"{fp.rank} of {fp.world_size}")
    console.print(about)
    console.print()
    console.print(_plan_summary(profile.plan, profile.measurements, title="plan"))
    console.print()
    console.print(_measurement_summary(profile.measurements, profile.host))

    placement = {u: "resident" for u in profile.plan.resident}
    placement.update({u: "streamed" for u in profile.plan.streamed})
    placement.update({u: "mapped" for u in profile.plan.mapped})
    table = Table(title="units, in execution order", title_justify="left")
    table.add_column("#", justify="right", style="dim")
    table.add_column("unit", overflow="fold")
    table.add_column("params", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("compute ms", justify="right")
    table.add_column("gap ms", justify="right")
    table.add_column("activation", justify="right")
    table.add_column("placement")
    for i, unit in enumerate(profile.measurements.units):
        table.add_row(
            str(i),
            unit.name,
            str(len(profile.unit_parameters.get(unit.name, ()))),
            format_bytes(unit.nbytes),
            f"{unit.compute_s * 1e3:.3f}",
            f"{unit.gap_before_s * 1e3:.3f}",
            format_bytes(unit.activation_bytes),
            placement.get(unit.name, "-"),
        )
    console.print(table)


def _grid(title: str | None = None) -> Any:
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    if title:
        grid.title = title
        grid.title_justify = "left"
        grid.title_style = "bold"
    grid.add_column(style="bold")
    grid.add_column()
    return grid


def _count(n: int) -> str:
    for suffix, factor in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= factor:
            return f"{n / factor:.2f} {suffix}"
    return str(n)


def _plan_summary(plan: Plan, measurements: Measurements, title: str) -> Any:
    sizes = {u.name: u.nbytes for u in measurements.units}
    grid = _grid(title)
    grid.add_row("budget", "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes))
    on_device = [u for u in plan.resident if u not in plan.mapped]
    grid.add_row("resident", f"{len(on_device)} units, {format_bytes(sum(sizes[u] for u in on_device))}")
    if plan.mapped:
        held = format_bytes(sum(sizes[u] for u in plan.mapped))
        grid.add_row("mapped", f"{len(plan.mapped)} units, {held} read in place from host memory")
    grid.add_row(
        "streamed", f"{len(plan.streamed)} units, {format_bytes(sum(sizes[u] for u in plan.streamed))}"
    )
    grid.add_row("arena", format_bytes(plan.arena_bytes))
    grid.add_row("predicted step", f"{plan.predicted_step_s * 1e3:.2f} ms{_versus(plan, measurements)}")
    grid.add_row("predicted peak", format_bytes(plan.predicted_peak_bytes))
    return grid


def _versus(plan: Plan, measurements: Measurements) -> str:
    """The predicted step against the all-resident one (the measured compute)."""
    if measurements.compute_s <= 0:
        return ""
    ratio = plan.predicted_step_s / measurements.compute_s
    return f" ({ratio:.2f}x the {measurements.compute_s * 1e3:.2f} ms with every weight resident)"


def _measurement_summary(measurements: Measurements, host: HostPlan | None = None) -> Any:
    from flextensor.observe.report import format_speed

    grid = _grid("measurements")
    grid.add_row("compute", f"{measurements.compute_s * 1e3:.2f} ms per step with every weight resident")
    grid.add_row("tail", f"{measurements.tail_s * 1e3:.3f} ms after the last unit")
    grid.add_row("baseline", f"{format_bytes(measurements.baseline_bytes)} never streamed")
    grid.add_row("activations", f"{format_bytes(measurements.activation_peak_bytes)} peak")
    link = ", ".join(f"{format_speed(bps)} at {format_bytes(size)}" for size, bps in measurements.link.points)
    if measurements.link.latency_s:
        link += f", {measurements.link.latency_s * 1e6:.1f} us per copy"
    grid.add_row("link", link)
    if host is not None:  # made under a host budget: what it left the planner
        line = f"{format_bytes(host.capacity_bytes)} of packs pinned at most, the rest staged at "
        line += format_speed(host.staged_link.points[-1][1])
        if host.disk_units and host.disk_link is not None:
            disk = format_speed(host.disk_link.points[-1][1])
            line += f"; {len(host.disk_units)} unit(s) read from disk at {disk}"
        grid.add_row("host budget", line)
    return grid


# -- plan ---------------------------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    """A pipeline's components run in turn, each planned under the whole budget: each gets its plan."""
    budgets = parse_budget(args.budget, args.steps)
    profiles = _load_profiles(args.path)
    console = _console()
    if len(budgets) > 1:
        for name, profile in profiles.items():
            if name:
                console.rule(f"component {name}")
            console.print(_budget_table(profile, budgets))
        return EXIT_OK
    plans = {}
    for name, profile in profiles.items():  # every one planned before anything is printed
        try:
            plans[name] = _plan(profile, budgets[0])
        except BudgetError as e:  # one line, status 2
            if not name:
                raise
            raise BudgetError(
                f"component {name!r}: {e}", needed_bytes=e.needed_bytes, budget_bytes=e.budget_bytes
            ) from None
    for name, plan in plans.items():
        measurements = profiles[name].measurements
        if name:
            console.rule(f"component {name}")
        console.print(_plan_summary(plan, measurements, title=f"plan for {args.path}"))
        console.print()
        console.print(_simulated_units(plan, measurements))
    return EXIT_OK


def _plan(profile: Profile, budget: int | None) -> Plan:
    """The plan for ``profile``'s measurements under ``budget``, with the units its plan maps mapped
    again (planned without them, as the run plans them)."""
    from flextensor.engine.policy import with_mapped, without_units
    from flextensor.plan.planner import plan_offload

    mapped = set(profile.plan.mapped)
    plan = plan_offload(without_units(profile.measurements, mapped), budget, profile.host)
    return with_mapped(plan, profile.measurements, mapped)


def _simulated_units(plan: Plan, measurements: Measurements) -> Any:
    from rich.table import Table

    from flextensor.plan.simulator import simulate

    simulation = simulate(plan, measurements)
    table = Table(title="predicted steady step, per unit", title_justify="left")
    table.add_column("#", justify="right", style="dim")
    table.add_column("unit", overflow="fold")
    table.add_column("bytes", justify="right")
    table.add_column("placement")
    table.add_column("arena offset", justify="right")
    table.add_column("compute ms", justify="right")
    table.add_column("copy ms", justify="right")
    table.add_column("wait ms", justify="right")
    for i, unit in enumerate(simulation.units):
        copy = "-"
        if unit.copy_start_s is not None and unit.copy_end_s is not None:
            copy = f"{(unit.copy_end_s - unit.copy_start_s) * 1e3:.3f}"
        table.add_row(
            str(i),
            unit.name,
            format_bytes(unit.nbytes),
            "resident" if unit.resident else "streamed",
            "-" if unit.slot_offset is None else format_bytes(unit.slot_offset),
            f"{(unit.compute_end_s - unit.compute_start_s) * 1e3:.3f}",
            copy,
            f"{unit.wait_s * 1e3:.3f}",
        )
    return table


def _budget_table(profile: Profile, budgets: list[int | None]) -> Any:
    from rich.table import Table

    measurements = profile.measurements
    table = Table(
        title=f"plans over budgets ({measurements.compute_s * 1e3:.2f} ms with every weight resident)",
        title_justify="left",
    )
    table.add_column("budget", justify="right")
    table.add_column("step ms", justify="right")
    table.add_column("vs resident", justify="right")
    table.add_column("peak", justify="right")
    table.add_column("arena", justify="right")
    table.add_column("resident", justify="right")
    table.add_column("streamed", justify="right")
    table.add_column("note", overflow="fold")
    for budget in budgets:
        label = "none" if budget is None else format_bytes(budget)
        try:
            plan = _plan(profile, budget)
        except BudgetError as e:
            table.add_row(label, "-", "-", "-", "-", "-", "-", f"[red]{e}[/]")
            continue
        ratio = plan.predicted_step_s / measurements.compute_s if measurements.compute_s > 0 else 1.0
        table.add_row(
            label,
            f"{plan.predicted_step_s * 1e3:.2f}",
            f"{ratio:.2f}x",
            format_bytes(plan.predicted_peak_bytes),
            format_bytes(plan.arena_bytes),
            str(len(plan.resident)),
            str(len(plan.streamed)),
            "",
        )
    return table


# -- demo ---------------------------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from flextensor.cli.demo import format_demo, run_demo

    budget = None if args.budget is None or args.budget.strip().lower() == "none" else args.budget
    result = run_demo(args.device, args.layers, args.hidden, args.steps, seq=args.seq, budget=budget)
    _console().print(format_demo(result))
    return EXIT_OK


# -- parser -------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``flextensor`` command (exposed for documentation tools)."""
    parser = argparse.ArgumentParser(
        prog="flextensor",
        description="Inspect the host-device link, saved profiles and plans; run the demo.",
    )
    parser.add_argument("--version", action="version", version=f"flextensor {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    probe = commands.add_parser(
        "probe",
        help="measure host<->device copy speed and how fast host memory pins (needs CUDA)",
        description=(
            "Measure host-to-device and device-to-host copy speed from pinned and pageable memory at "
            "several sizes, and how fast host memory is page-locked (cudaHostRegister, pin_memory())."
        ),
    )
    probe.add_argument("--device", default="cuda", help="CUDA device to probe (default: cuda)")
    probe.add_argument(
        "--sizes",
        default="1MiB,16MiB,256MiB",
        help="comma-separated copy sizes (default: 1MiB,16MiB,256MiB)",
    )
    probe.add_argument("--repeats", type=int, default=5, help="timed copies per measurement (default: 5)")
    probe.set_defaults(handler=_cmd_probe)

    profile = commands.add_parser(
        "profile", help="inspect a saved profile", description="Inspect a profile saved by save_profile()."
    )
    profile_commands = profile.add_subparsers(dest="profile_command", metavar="ACTION")
    show = profile_commands.add_parser(
        "show",
        help="print a profile's plan, measurements and fingerprint",
        description="Print a saved profile's plan, per-unit measurements and fingerprint.",
    )
    show.add_argument(
        "path", help="profile file written by flextensor.save_profile() (of a model or a pipeline)"
    )
    show.set_defaults(handler=_cmd_profile_show)
    profile.set_defaults(handler=lambda args: _missing_action(profile))

    plan = commands.add_parser(
        "plan",
        help="re-plan a saved profile for other memory budgets (no GPU needed)",
        description=(
            "Re-plan offline from a saved profile's measurements with the planner and simulator: the "
            "predicted step time and peak memory for a budget, or a table over a range of budgets."
        ),
    )
    plan.add_argument(
        "path", help="profile file written by flextensor.save_profile() (of a model or a pipeline)"
    )
    plan.add_argument(
        "--budget",
        default="none",
        help="a size (8GiB), a range LOW..HIGH (4GiB..16GiB) or 'none' for the no-budget plan (default)",
    )
    plan.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_RANGE_STEPS,
        help=f"budgets in a range, both ends included (default: {DEFAULT_RANGE_STEPS})",
    )
    plan.set_defaults(handler=_cmd_plan)

    demo = commands.add_parser(
        "demo",
        help="run a model natively and offloaded, and compare memory, speed and outputs",
        description=(
            "Build a model with random weights (LlamaForCausalLM if transformers is installed, else an "
            "MLP stack), run it natively, then offloaded with flextensor, and compare device memory "
            "held by weights, step time and outputs; then print flextensor's report."
        ),
    )
    demo.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    demo.add_argument("--layers", type=int, default=None, help="layers (default: 8 on CPU, 24 on CUDA)")
    demo.add_argument("--hidden", type=int, default=None, help="hidden size (default: 512 CPU, 2048 CUDA)")
    demo.add_argument("--seq", type=int, default=None, help="input length (default: 128 CPU, 4096 CUDA)")
    demo.add_argument("--steps", type=int, default=3, help="timed steady steps (default: 3)")
    demo.add_argument(
        "--budget", default=None, help="device memory budget, e.g. 1GiB (default: the planner's choice)"
    )
    demo.set_defaults(handler=_cmd_demo)
    return parser


def _missing_action(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: choose an action (see --help)", file=sys.stderr)
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flextensor`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error: argparse has printed it already
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        return handler(args)
    except (FlexTensorError, OSError) as e:
        # One line, no traceback: these are the user's to fix, and the message says how.
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"flextensor: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("flextensor: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
