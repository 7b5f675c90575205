"""``flextensor demo``: one model run natively, then offloaded, side by side.

Builds a model with random weights (a transformers ``LlamaForCausalLM`` when transformers is installed,
else a plain stack of MLP blocks), runs it natively on the device for a reference output, step time and
peak memory, then offloads its layers with flextensor, runs forwards until steady state, times a few
steady steps and compares: device memory held by weights, step time, and whether the outputs are
bitwise equal. The sizes default small on CPU (the whole demo takes seconds there) and to a model of
about a billion parameters in bfloat16 on CUDA.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flextensor.common.sizes import format_bytes, parse_bytes
from flextensor.config.devices import resolve_device
from flextensor.config.schema import OffloadConfig
from flextensor.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["DemoModel", "MLPStack", "build_demo_model", "format_demo", "run_demo"]

CPU_DEFAULTS = {"layers": 8, "hidden": 512, "seq": 128}
"""About 100 MB of float32 weights: a few seconds of forwards on two CPU cores."""

CUDA_DEFAULTS = {"layers": 24, "hidden": 2048, "seq": 4096}
"""About 1.2 B parameters (2.5 GB in bfloat16), built directly on the GPU in about a second. A long
input gives each layer enough compute to hide some copies under, as in real serving."""

HEAD_DIM = 64


@dataclass
class DemoModel:
    """A model built for the demo, with its input and the include patterns that select its layers."""

    model: nn.Module
    forward: Callable[[], torch.Tensor]
    include_patterns: tuple[str, ...]
    description: str


class _Block(nn.Module):
    """Pre-norm MLP with a residual: a transformer layer's weight shape, without attention."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MLPStack(nn.Module):
    """The demo's model when transformers is missing: ``layers.N`` blocks between two projections."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(_Block(hidden) for _ in range(layers))
        self.proj_out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for layer in self.layers:
            x = layer(x)
        return self.proj_out(x)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_demo_model(
    device: torch.device, layers: int, hidden: int, seq: int, *, batch: int = 1, seed: int = 0
) -> DemoModel:
    """The demo's model and input, built directly on ``device`` (random init is fast there).

    bfloat16 on CUDA, float32 on CPU (where bfloat16 matmuls are slow). A LlamaForCausalLM when
    transformers imports, else an MLP stack.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        LlamaForCausalLM = None  # the demo falls back to an MLP stack

    if LlamaForCausalLM is not None:
        heads = hidden // HEAD_DIM if hidden % HEAD_DIM == 0 else 1
        vocab = 32000 if device.type == "cuda" else 4096
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=_llama_mlp_width(hidden),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            vocab_size=vocab,
            max_position_embeddings=max(seq, 128),
            tie_word_embeddings=False,
        )
        with torch.device(device), _default_dtype(dtype):
            llama = LlamaForCausalLM(config).eval()
        tokens = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)

        def forward_llama() -> torch.Tensor:
            return llama(input_ids=tokens, use_cache=False).logits

        params = sum(p.numel() for p in llama.parameters())
        return DemoModel(
            llama,
            forward_llama,
            ("model.layers.*",),
            f"LlamaForCausalLM, {layers} layers, hidden {hidden}, {params / 1e6:.0f} M parameters, "
            f"{str(dtype).removeprefix('torch.')}, input {batch}x{seq} tokens",
        )

    with torch.device(device), _default_dtype(dtype):
        stack = MLPStack(layers, hidden).eval()
    x = torch.randn(batch, seq, hidden, generator=generator).to(device=device, dtype=dtype)

    def forward_stack() -> torch.Tensor:
        return stack(x)

    params = sum(p.numel() for p in stack.parameters())
    return DemoModel(
        stack,
        forward_stack,
        ("layers.*",),
        f"MLP stack (transformers not installed), {layers} layers, hidden {hidden}, "
        f"{params / 1e6:.0f} M parameters, {str(dtype).removeprefix('torch.')}, input {batch}x{seq}x{hidden}",
    )


def _llama_mlp_width(hidden: int) -> int:
    """Llama's MLP width: 8/3 of the hidden size, rounded up to a multiple of 64."""
    return -(-(8 * hidden // 3) // 64) * 64


def _timed(forward: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = forward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


class _Agreement:
    """Compares each offloaded output with the native one as it comes, keeping no outputs alive."""

    def __init__(self, reference: torch.Tensor) -> None:
        self.reference = reference
        self.equal = True
        self.max_abs_diff = 0.0

    def check(self, out: torch.Tensor) -> None:
        host = out.cpu()
        self.equal = self.equal and torch.equal(host, self.reference)
        diff = float((host.float() - self.reference.float()).abs().max()) if host.numel() else 0.0
        self.max_abs_diff = max(self.max_abs_diff, diff)


def _parameter_bytes(model: nn.Module, names: set[str] | None = None) -> int:
    return sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if names is None or name in names
    )


def run_demo(
    device: str | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    steps: int = 3,
    *,
    seq: int | None = None,
    budget: int | str | None = None,
) -> dict[str, Any]:
    """Run the demo and return its numbers (``format_demo`` renders them).

    ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; default CUDA when available. ``layers``,
    ``hidden``, ``seq``: model and input size, defaulting per device (see CPU_DEFAULTS, CUDA_DEFAULTS).
    ``steps``: timed steady steps, after the forwards that reach steady state. ``budget``: the device
    memory budget for flextensor (bytes or a string such as ``"1GiB"``; None: the planner's choice).

    Keys of the result: ``device``, ``model``, ``weights_bytes``, ``native_weights_bytes`` and
    ``offloaded_weights_bytes`` (device bytes held by weights), ``native_peak_bytes`` and
    ``offloaded_peak_bytes`` (CUDA only, else None), ``native_step_s`` and ``offloaded_step_s`` (medians),
    ``slowdown``, ``offload_s``, ``forwards_to_steady``, ``bitwise_equal``, ``max_abs_diff``, ``plan``
    (the Plan) and ``report`` (the :class:`flextensor.observe.report.Report` of the first steady step).
    """
    from flextensor.api import engine_of, offload, phase, resident_parameters
    from flextensor.observe.report import report

    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    budget_bytes = None if budget is None else parse_bytes(budget)
    # Resolve (and check) the device the way offload() will.
    dev = resolve_device(OffloadConfig(device=device).device)
    defaults = CUDA_DEFAULTS if dev.type == "cuda" else CPU_DEFAULTS
    layers = defaults["layers"] if layers is None else layers
    hidden = defaults["hidden"] if hidden is None else hidden
    seq = defaults["seq"] if seq is None else seq
    for name, value in (("layers", layers), ("hidden", hidden), ("seq", seq)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    cuda = dev.type == "cuda"

    demo = build_demo_model(dev, layers, hidden, seq)
    model = demo.model
    weights_bytes = _parameter_bytes(model)

    with torch.no_grad():
        # Native: every weight on the device. One warm-up forward, then the timed ones.
        _timed(demo.forward, dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        native_times = []
        for _ in range(steps):
            out, elapsed = _timed(demo.forward, dev)
            native_times.append(elapsed)
        native_peak = torch.cuda.max_memory_allocated(dev) if cuda else None
        # Kept on the host, so the offloaded runs' peak does not carry an extra output (logits are large).
        reference = out.cpu()
        del out

        config = OffloadConfig(
            include_patterns=demo.include_patterns, device=str(dev), gpu_memory_budget=budget_bytes
        )
        start = time.perf_counter()
        offload(model, config)
        offload_s = time.perf_counter() - start

        agreement = _Agreement(reference)
        forwards_to_steady = 0
        while phase(model) != "inference":
            agreement.check(demo.forward())
            forwards_to_steady += 1
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        offloaded_times = []
        for _ in range(steps):
            out, elapsed = _timed(demo.forward, dev)
            offloaded_times.append(elapsed)
            agreement.check(out)  # after the timing, and before the next step allocates another output
            del out
        offloaded_peak = torch.cuda.max_memory_allocated(dev) if cuda else None

    engine = engine_of(model)
    resident = set(resident_parameters(model))
    offloaded_weights = engine.store.device_bytes_held() + _parameter_bytes(model, resident)
    native_step = statistics.median(native_times)
    offloaded_step = statistics.median(offloaded_times)
    result = {
        "device": str(dev),
        "model": demo.description,
        "weights_bytes": weights_bytes,
        "native_weights_bytes": weights_bytes,
        "offloaded_weights_bytes": offloaded_weights,
        "native_peak_bytes": native_peak,
        "offloaded_peak_bytes": offloaded_peak,
        "native_step_s": native_step,
        "offloaded_step_s": offloaded_step,
        "slowdown": offloaded_step / native_step if native_step > 0 else float("inf"),
        "offload_s": offload_s,
        "forwards_to_steady": forwards_to_steady,
        "steps": steps,
        "bitwise_equal": agreement.equal,
        "max_abs_diff": agreement.max_abs_diff,
        "budget_bytes": budget_bytes,
        "plan": engine.status().plan,
        "report": report(model),
    }
    # Give the device memory and pinned host memory back now rather than at the next GC cycle.
    del engine, demo, model, reference, agreement
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def format_demo(result: dict[str, Any]) -> RenderableType:
    """The demo's comparison table followed by flextensor's report of the first steady step."""
    from rich.console import Group
    from rich.table import Table

    table = Table(title=f"flextensor demo on {result['device']}: {result['model']}", title_justify="left")
    table.add_column("")
    table.add_column("native", justify="right")
    table.add_column("flextensor", justify="right")
    table.add_column("", justify="left")

    weights = result["weights_bytes"]
    held = result["offloaded_weights_bytes"]
    where = "host memory stands in for the device" if result["device"] == "cpu" else "device memory"
    table.add_row(
        "weights held on the device",
        format_bytes(result["native_weights_bytes"]),
        format_bytes(held),
        f"{held / weights:.0%} of {format_bytes(weights)} ({where})" if weights else "",
    )
    if result["native_peak_bytes"] is not None:
        table.add_row(
            "peak allocated",
            format_bytes(result["native_peak_bytes"]),
            format_bytes(result["offloaded_peak_bytes"]),
            "" if result["budget_bytes"] is None else f"budget {format_bytes(result['budget_bytes'])}",
        )
    table.add_row(
        "step time (median)",
        f"{result['native_step_s'] * 1e3:.1f} ms",
        f"{result['offloaded_step_s'] * 1e3:.1f} ms",
        f"{result['slowdown']:.2f}x native, over {result['steps']} steps",
    )
    table.add_row("offload() took", "", f"{result['offload_s']:.2f} s", "packing and pinning the weights")
    table.add_row(
        "forwards until steady state", "", str(result["forwards_to_steady"]), "discovery and profiling"
    )
    if result["bitwise_equal"]:
        equal = "[green]yes[/]"
    else:
        equal = f"[red]no[/] (max |diff| {result['max_abs_diff']:.3g})"
    table.add_row("outputs bitwise equal", "", equal, "every offloaded forward vs native")
    if result["device"] == "cpu":
        # On a CPU the "device" is host memory: copies cost what the compute they hide under costs, and
        # nothing runs concurrently. The run shows the mechanism works, not what it costs on a GPU.
        table.caption = (
            "On the CPU these timings say nothing about a GPU: host memory stands in for the device and "
            "copies do not overlap compute. Run on a CUDA device (or see docs/benchmarks.md) for real costs."
        )
        table.caption_justify = "left"
    return Group(table, "", result["report"])
