"""The methods a workload runs under: native, ours, flextensor 0.5.0, diffusers group offload, accelerate.

A method is named by a spec, ``name[:arg][/key=value...]``:

==============================  ====================================================================
``native``                      every weight on the device (``model.to(device)``): the reference
``native_ref``                  native with the workload's memory cap lifted: the reference for a
                                workload native cannot run under (``wan40``)
``ours``                        ``flextensor.offload`` with the default config (unit = workload's)
``ours_budget:8GiB``            ... with ``gpu_memory_budget="8GiB"``
``ours_frac:0.05``              ... with ``max_gpu_mem_fraction=0.05``
``flextensor050``               flextensor 0.5.0 from PyPI, default config, from its own folder
``flextensor050_frac:0.05``     ... with ``max_gpu_mem_fraction=0.05``
``flextensor050_budget:22GiB``  ... with ``max_gpu_mem_fraction`` = 22 GiB / the card's memory
``diffusers_group``             diffusers ``apply_group_offloading``, block_level, 1 block per group,
                                ``use_stream`` on CUDA
``diffusers_group:model``       ... applied to the submodule ``model`` (``+``-separated list), the rest
                                of the model on the device: reaches ``model.layers`` of a transformers
                                LLM, which plain block_level misses (its ``lm_head`` stays resident)
``accelerate``                  accelerate ``cpu_offload`` (execution device = the run's device)
``diffusers_model_offload``     a pipeline's ``enable_model_cpu_offload()``: each component moved whole
                                to the device when it runs
``diffusers_sequential_offload``  a pipeline's ``enable_sequential_cpu_offload()``: each module's weights
                                moved to the device at each call (accelerate's hooks), synchronously
==============================  ====================================================================

On a whole pipeline (``wan22_pipeline``) each method is applied as its library documents for one:
``ours`` offloads the pipeline in one call (each component's repeated blocks), ``diffusers_group`` is
the pipeline's ``enable_group_offload`` (block level, streams), flextensor 0.5.0 offloads the two
transformers (one manager each) with the rest on the device, as its Wan2.2 example does; ``accelerate``
is not run there.

Options after ``/`` override the runner's settings for that method only: ``timeout`` (s),
``min_steps``, ``max_steps``, ``step_budget`` (s of timed steps), ``max_warmup`` (forwards). One more
changes the method itself and so its label: ``compile=regional`` (each offload unit's module compiled
on its own with ``module.compile()``, as diffusers' ``compile_repeated_blocks``; flextensor 0.5.0 gets
``compile_fn=torch.compile``), ``compile=whole`` (``torch.compile(model)``), ``compile=graphs``
(``torch.compile(model, mode="reduce-overhead")``: CUDA graphs). ``native/compile=regional`` is the
native compiled reference for ``ours/compile=regional``. ``cap=24GiB`` runs that method under a GPU
memory cap of its own (``set_per_process_memory_fraction``), in place of the workload's.
``compression=lossless`` runs ours with ``OffloadConfig(compression="lossless")``; ``map=on`` with
``OffloadConfig(map_embeddings=True)``, ``map=off`` with ``False`` (a pipeline maps by default).

Each method's setup runs inside its own worker process (``benchmarks.worker``); this module only
defines what "set up" means and how the method reports its phase and streamed bytes.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .workloads import Workload

if TYPE_CHECKING:  # torch is imported where it is used: the parent process never needs it (stays light)
    from torch import nn

METHOD_NAMES = (
    "native",
    "native_ref",
    "ours",
    "ours_budget",
    "ours_frac",
    "flextensor050",
    "flextensor050_frac",
    "flextensor050_budget",
    "diffusers_group",
    "diffusers_model_offload",
    "diffusers_sequential_offload",
    "accelerate",
)
OPTION_KEYS = (
    "timeout",
    "min_steps",
    "max_steps",
    "step_budget",
    "max_warmup",
    "compile",
    "cap",
    "compression",
    "map",
)
COMPILE_MODES = ("regional", "whole", "graphs")
PEER_VERSION = "0.5.0"


class SkipMethod(Exception):  # a signal, not a failure: the run is recorded as skipped
    """The method cannot run here (device, missing package); the message says why."""


@dataclass(frozen=True)
class MethodSpec:
    spec: str
    name: str
    arg: str | None
    options: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The spec without runner options (``compile`` kept): the name used in tables and plots."""
        label = self.name if self.arg is None else f"{self.name}:{self.arg}"
        for key in ("compile", "cap", "compression", "map"):  # they change what runs, not how it is timed
            if key in self.options:
                label += f"/{key}={self.options[key]}"
        return label

    @property
    def family(self) -> str:
        """``native`` / ``ours`` / ``flextensor050`` / ``diffusers_group`` / ``diffusers_model_offload`` /
        ``diffusers_sequential_offload`` / ``accelerate``."""
        return self.name.split("_budget")[0].split("_frac")[0].removesuffix("_ref")

    def option(self, key: str, default: float) -> float:
        return float(self.options[key]) if key in self.options else default


def parse_method(spec: str) -> MethodSpec:
    head, *opts = spec.strip().split("/")
    name, _, arg = head.partition(":")
    if name not in METHOD_NAMES:
        raise ValueError(f"unknown method {name!r} in {spec!r}; known: {', '.join(METHOD_NAMES)}")
    needs_arg = name.endswith(("_budget", "_frac"))
    if needs_arg and not arg:
        raise ValueError(f"method {name!r} needs an argument, e.g. {name}:8GiB or {name}:0.05")
    options: dict[str, str] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if key not in OPTION_KEYS or not eq:
            raise ValueError(
                f"bad option {opt!r} in {spec!r}; options: {', '.join(OPTION_KEYS)} as key=value"
            )
        options[key] = value
    if options.get("compile", COMPILE_MODES[0]) not in COMPILE_MODES:
        raise ValueError(f"compile={options['compile']} in {spec!r}; one of {', '.join(COMPILE_MODES)}")
    return MethodSpec(spec=spec.strip(), name=name, arg=arg or None, options=options)


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``"5.7GiB"`` -> bytes; decimal (GB) and binary (GiB) units, ``B`` optional."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 8GiB, 5.7GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def unsupported_reason(ms: MethodSpec, w: Workload, device: str) -> str | None:
    """Why ``ms`` cannot run on ``device`` for ``w``, decided before any weight is loaded."""
    cuda = device.startswith("cuda")
    if ms.family == "flextensor050" and not cuda:
        return "flextensor 0.5.0 needs CUDA: its config takes only a GPU index (gpu_device)"
    compile_mode = ms.options.get("compile")
    if compile_mode == "graphs" and not cuda:
        return "CUDA graphs need CUDA"
    if compile_mode is not None and ms.family in ("diffusers_group", "accelerate"):
        return f"{ms.family} is benchmarked uncompiled"
    if compile_mode not in (None, "regional") and ms.family == "flextensor050":
        return "flextensor 0.5.0 compiles per unit only (compile_fn)"
    if "compression" in ms.options and ms.family != "ours":
        return "compression is flextensor's (OffloadConfig.compression)"
    if "map" in ms.options and ms.family != "ours":
        return "map is flextensor's (OffloadConfig.map_embeddings)"
    if ms.name == "native_ref" and (w.memory_cap_bytes is None or not cuda):
        return "no memory cap on this run: plain native is the reference"
    pipeline = w.kind == "wan_pipeline"
    if ms.family == "diffusers_model_offload" and not pipeline:
        return "enable_model_cpu_offload is a pipeline's method"
    if ms.family == "diffusers_sequential_offload" and not pipeline:
        return "enable_sequential_cpu_offload is a pipeline's method"
    if ms.family == "accelerate" and pipeline:
        return "accelerate's cpu_offload is benchmarked on single models"
    if pipeline and compile_mode is not None:
        return "whole pipelines are benchmarked uncompiled"
    return None


@dataclass
class Prepared:
    """A method set up on a model: what to call, and how to ask it about its state.

    ``phase()``: the method's phase (``"inference"`` = steady) or ``None`` for methods without phases,
    which are steady after ``min_warmup`` forwards. ``streamed()``: (bytes copied host->device per steady
    step, where that figure comes from). ``details()``: the method's own account of its steady step, if
    it gives one (ours: ``flextensor.report(model).to_dict()``), saved as is.
    """

    model: Any
    phase: Callable[[], str | None]
    min_warmup: int
    streamed: Callable[[], tuple[int | None, str]]
    info: dict[str, Any] = field(default_factory=dict)
    details: Callable[[], dict[str, Any]] | None = None


def _no_phase() -> None:
    return None


def _under(names: dict[str, int], prefixes: list[str]) -> int:
    return sum(b for n, b in names.items() if any(n.startswith(p + ".") for p in prefixes))


def ours_streamed_bytes(ft: Any, model: Any, nbytes: dict[str, int]) -> tuple[int | None, str]:
    """Bytes ours copies host->device in one steady step, and where the figure comes from.

    The one place to change when the engine's report says it directly. Until then: the bytes of the
    offloaded parameters the plan did not keep resident (sizes from the meta model, so the figure does
    not depend on what the engine leaves in ``param.data``).
    """
    try:
        totals = ft.report(model).to_dict()
        for scope in (totals, totals.get("totals", {}), totals.get("per_step", {})):
            for key in ("bytes_streamed", "bytes_streamed_per_step", "streamed_bytes"):
                if isinstance(scope.get(key), int | float):
                    return int(scope[key]), "report"
    except AttributeError:
        pass  # report() not in this version of the library
    offloaded = set(ft.offloaded_parameters(model))
    resident = set(ft.resident_parameters(model))
    return sum(nbytes.get(n, 0) for n in offloaded - resident), "plan"


def _import_ours() -> Any:
    import flextensor as ft

    if getattr(ft, "__version__", None) == PEER_VERSION:
        raise RuntimeError(f"`import flextensor` found the 0.5.0 peer ({ft.__file__}), not ours")
    return ft


def _import_peer(peer_path: str | None) -> Any:
    if not peer_path or not Path(peer_path, "flextensor", "__init__.py").exists():
        raise SkipMethod(
            f"flextensor {PEER_VERSION} not found at {peer_path!r}: install it with "
            f"`pip install --target <dir> flextensor=={PEER_VERSION}` and pass --peer-path <dir>"
        )
    # Ours and the peer share the import name: the peer's folder must win, and ours must not be there.
    sys.path.insert(0, str(Path(peer_path).resolve()))
    import flextensor as ft

    if getattr(ft, "__version__", None) != PEER_VERSION:
        raise RuntimeError(f"`import flextensor` resolved to {ft.__file__}, not the {PEER_VERSION} peer")
    return ft


def prepare(
    ms: MethodSpec, model: nn.Module, w: Workload, device: str, nbytes: dict[str, int], peer_path: str | None
) -> Prepared:
    """Set ``model`` (weights on the CPU) up for ``ms``; the returned ``model`` is what to call."""
    prepared = _prepare_uncompiled(ms, model, w, device, nbytes, peer_path)
    compile_mode = ms.options.get("compile")
    if compile_mode is None or ms.family == "flextensor050":  # the peer compiles through compile_fn
        return prepared
    import torch

    if compile_mode == "regional":
        for module in unit_modules(model, w.unit):
            module.compile()
    elif compile_mode == "graphs" and ms.family == "ours":
        compile_when_steady = CompileWhenSteady(prepared.model, prepared.phase)
        prepared.model, prepared.phase = compile_when_steady, compile_when_steady.phase
    else:
        mode = "reduce-overhead" if compile_mode == "graphs" else None
        prepared.model = torch.compile(prepared.model, mode=mode)
    prepared.min_warmup = max(prepared.min_warmup, 3)  # compile, then a CUDA graph's warm-up and capture
    prepared.info = {**prepared.info, "compile": compile_mode}
    return prepared


class CompileWhenSteady:
    """docs/compile.md's recipe for ``mode="reduce-overhead"`` on an offloaded model: only a steady forward
    can be captured, and CUDA-graph trees capture from the second compiled call, so the model learns its
    plan uncompiled and is compiled once in steady state. Steady for the benchmark after the compile, the
    graph trees' warm-up and their capture (three compiled calls)."""

    COMPILED_WARMUP = 3

    def __init__(self, model: Any, model_phase: Callable[[], str | None]) -> None:
        self.model, self.model_phase = model, model_phase
        self.compiled: Any = None
        self.compiled_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None and self.model_phase() == "inference":
            import torch

            self.compiled = torch.compile(self.model, mode="reduce-overhead")
        if self.compiled is None:
            return self.model(*args, **kwargs)
        self.compiled_calls += 1
        return self.compiled(*args, **kwargs)

    def phase(self) -> str | None:
        phase = self.model_phase()
        return "compiling" if phase == "inference" and self.compiled_calls < self.COMPILED_WARMUP else phase


def unit_modules(model: nn.Module, pattern: str) -> list[nn.Module]:
    """The modules whose names match the workload's unit pattern (``blocks.*``)."""
    from fnmatch import fnmatchcase

    return [m for name, m in model.named_modules() if name and fnmatchcase(name, pattern)]


def _prepare_uncompiled(
    ms: MethodSpec, model: nn.Module, w: Workload, device: str, nbytes: dict[str, int], peer_path: str | None
) -> Prepared:
    import torch

    total = sum(nbytes.values())
    cuda = device.startswith("cuda")
    if w.kind == "wan_pipeline" and ms.family != "native":
        from .pipeline_methods import prepare_pipeline

        return prepare_pipeline(ms, model, device, nbytes, peer_path)
    if ms.family == "native":
        model.to(device)
        return Prepared(model, _no_phase, 1, lambda: (0, "none: weights stay on the device"))

    if ms.family == "ours":
        ft = _import_ours()
        kwargs: dict[str, Any] = {"include_patterns": [w.unit], "device": device}
        if ms.name == "ours_budget":
            kwargs["gpu_memory_budget"] = ms.arg
        elif ms.name == "ours_frac":
            kwargs["max_gpu_mem_fraction"] = float(ms.arg or 0)
        if "compression" in ms.options:
            kwargs["compression"] = ms.options["compression"]
        if "map" in ms.options:
            kwargs["map_embeddings"] = ms.options["map"] == "on"
        cfg = ft.OffloadConfig(**kwargs)
        wrapped = ft.offload(model, config=cfg)
        info = {"impl_file": ft.__file__, "impl_version": getattr(ft, "__version__", None), "config": kwargs}

        def ours_details() -> dict[str, Any]:
            try:
                details = dict(ft.report(wrapped).to_dict())
                trace_dir = os.environ.get("FLEXTENSOR_BENCH_TRACE_DIR")
                if trace_dir:  # the recorded steady step as a Chrome trace, for Perfetto
                    spec = ms.name + (f"-{ms.arg}" if ms.arg else "")
                    details["trace"] = str(ft.trace(wrapped, Path(trace_dir) / f"{w.name}-{spec}.trace.json"))
                return details
            except Exception as exc:  # extra information only: never lose the run over it
                return {"error": f"{type(exc).__name__}: {exc}"[:500]}

        return Prepared(
            wrapped,
            lambda: str(ft.phase(wrapped)),
            0,
            lambda: ours_streamed_bytes(ft, wrapped, nbytes),
            info,
            ours_details,
        )

    if ms.family == "flextensor050":
        ft = _import_peer(peer_path)
        kwargs = {"include_patterns": [w.unit]}
        if ms.name == "flextensor050_frac":
            kwargs["max_gpu_mem_fraction"] = float(ms.arg or 0)
        elif ms.name == "flextensor050_budget":
            card = torch.cuda.get_device_properties(torch.device(device)).total_memory
            kwargs["max_gpu_mem_fraction"] = round(parse_bytes(ms.arg or "0") / card, 4)
        if ms.options.get("compile") == "regional":
            wrapped = ft.offload(model, config=ft.OffloadConfig(**kwargs), compile_fn=torch.compile)
        else:
            wrapped = ft.offload(model, config=ft.OffloadConfig(**kwargs))

        def peer_phase() -> str:
            return str(ft.get_offload_manager().phase.value)

        def peer_streamed() -> tuple[int | None, str]:
            units = [name for name, _ in ft.offload_units()]
            return _under(nbytes, units), "upper bound: all bytes of its offload units"

        info = {"impl_file": ft.__file__, "impl_version": ft.__version__, "config": kwargs}
        return Prepared(wrapped, peer_phase, 0, peer_streamed, info)

    if ms.family == "diffusers_group":
        from diffusers.hooks import apply_group_offloading

        kwargs = {"offload_type": "block_level", "num_blocks_per_group": 1, "use_stream": cuda}
        targets = [model] if not ms.arg else [model.get_submodule(name) for name in ms.arg.split("+")]
        offloaded = {id(p): p for target in targets for p in target.parameters()}
        offloaded_bytes = sum(p.numel() * p.element_size() for p in offloaded.values())
        if ms.arg:
            # A weight tied between a target and the rest (tied embeddings) counts as the target's, so it
            # would stay on the CPU for the outside reader: fine for the untied workloads here.
            # Not block_modules=[...]: with use_stream, diffusers 0.42.1 registers its layer-execution
            # tracker twice (ValueError "layer_execution_tracker already exists"). Offloading the named
            # submodules themselves reaches the same blocks; what lies outside them stays on the device.
            covered = {id(t) for target in targets for t in (*target.parameters(), *target.buffers())}
            for tensor in (*model.parameters(), *model.buffers()):
                if id(tensor) not in covered:
                    tensor.data = tensor.data.to(device)
        for target in targets:
            apply_group_offloading(target, onload_device=torch.device(device), offload_device="cpu", **kwargs)
        # Every group, the leftovers of each target too, goes back to the CPU after its forward.
        info = {"config": {**kwargs, "offload_device": "cpu", "targets": ms.arg or "<model>"}}
        # One warm-up forward: with streams, the first forward records the order of the groups.
        estimate = "estimate: all parameters of " + (ms.arg or "the model")
        return Prepared(model, _no_phase, 1, lambda: (offloaded_bytes, estimate), info)

    if ms.family == "accelerate":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=torch.device(device))
        info = {"config": {"execution_device": device, "offload_buffers": False}}
        return Prepared(model, _no_phase, 1, lambda: (total, "estimate: all parameters"), info)

    raise ValueError(f"no setup for method {ms.spec!r}")
